"""Tensor parallelism on charlm: step time and bytes per step for tp=1, tp=2 and tp=2 with
sequence parallelism, at a few model widths, side by side in one table.

Each row trains CharGPT (``--layers`` blocks, 4 heads, block size ``--block``, global batch
``--batch``, fp32, AdamW) for ``--steps`` steps on random characters; step time is rank 0's
median after ``--warmup`` steps. tp=1 is ``single`` in one process, tp=2 two processes on gloo,
one thread each (one "device" each). Bytes are what rank 0 sent on the tp group per step, as the
Recorder counted DTensor's collectives (bandwidth-optimal figures for library collectives), next
to Megatron's prediction: per block and pass (forward, backward) two allreduces of the block's
activations ``B x T x d``, ``2 (p-1)/p`` of them each; sequence parallelism replaces each by an
all-gather and a reduce-scatter, ``(p-1)/p`` each, the same bytes, plus one all-gather leaving
the sequence-sharded region (and its mirror in backward). ``no count`` is tp=2 with the
collective counter off, to show what counting costs. ``act. MB``: the bytes autograd saved for
backward in rank 0's first forward (local shards of DTensors; views of one buffer once;
parameters left out): the
activation memory that tensor and sequence parallelism divide. On CPU with gloo this measures overhead
and communication cost, not a GPU's speed-up.

The last rows train Hugging Face's ``LlamaForCausalLM`` (``--llama-width``, 4 heads, 2 key/value
heads, MLP 2x wide, the same layers, block and batch; built from a config, no download) through
its own declared tensor-parallel plan and its own loss (``model(**batch).loss``): the same formula
holds, since grouped-query attention changes the weights, not the activations between the pairs.

    python benchmarks/tensor_parallel.py [--widths 64 128 256] [--steps 12] [--layers 2] [--repeats 1] [--llama-width 128]
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import shardwise
from shardwise.tools.recipes.charlm import CharGPT

VOCAB = 100


def _loss(out: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1))


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


class StepTimer:
    """Step times after the warm-up, and the bytes autograd saves for backward in the first forward."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self.last = warmup, [], 0.0
        self.saved_bytes = 0

    def on_fit_start(self, trainer: Any, engine: Any) -> None:
        model = engine.unwrap(engine._model)
        storages: dict[int, int] = {}
        params = {(p.to_local() if hasattr(p, "to_local") else p).untyped_storage().data_ptr() for p in model.parameters()}

        def pack(t: torch.Tensor) -> torch.Tensor:
            local = t.to_local() if hasattr(t, "to_local") else t  # a DTensor holds only its shard
            storage = local.untyped_storage()
            if storage.data_ptr() not in params:  # weights saved by matmuls are not activations
                storages[storage.data_ptr()] = storage.nbytes()  # views of one buffer count once
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)

        def before(module: Any, args: Any) -> None:
            if torch.is_grad_enabled() and not self.saved_bytes:
                ctx.__enter__()

        def after(module: Any, args: Any, out: Any) -> None:
            if torch.is_grad_enabled() and not self.saved_bytes:
                ctx.__exit__(None, None, None)
                self.saved_bytes = sum(storages.values())
                self.handles[0].remove()
                self.handles[1].remove()

        self.handles = [model.register_forward_pre_hook(before), model.register_forward_hook(after)]
        self.last = time.perf_counter()

    def on_train_step_end(self, trainer: Any, engine: Any, step: int, loss: torch.Tensor) -> None:
        now = time.perf_counter()
        if step > self.warmup:
            self.times.append(now - self.last)
        self.last = now


def _data(block: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (n, block + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def _fit(strategy: str, width: int, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    torch.manual_seed(0)
    model = CharGPT(VOCAB, args.block, width, 4, args.layers)
    timer = StepTimer(args.warmup)
    trainer = shardwise.Trainer(
        strategy=strategy, optimizer=_adamw, loss_fn=_loss, strategy_options=options, callbacks=[timer],
        global_batch_size=args.batch, max_steps=args.steps, log_every=args.steps, progress_bar=False,
    )
    summary = trainer.fit(model, _data(args.block, args.batch * args.steps))
    by_op = summary["comm"]["by_op"]
    tp_sent = sum(v["sent_bytes"] for k, v in by_op.items() if k.startswith("tp/"))
    return {"step_s": statistics.median(timer.times), "tp_sent_per_step": tp_sent / summary["steps"], "saved_mb": timer.saved_bytes / 1e6,
            "collectives": (summary.get("tp") or {}).get("collectives_per_step")}


class _Dicts(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Causal-LM samples as transformers users feed them: ``{"input_ids", "labels"}``."""

    def __init__(self, block: int, n: int) -> None:
        self.ids = _data(block, n).tensors[0]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _fit_llama(strategy: str, args: argparse.Namespace, **options: Any) -> dict[str, Any]:
    import transformers

    torch.manual_seed(0)
    width = args.llama_width
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=args.layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.block,
                                   tie_word_embeddings=False, use_cache=False, attn_implementation="eager")
    model = transformers.LlamaForCausalLM(cfg)
    timer = StepTimer(args.warmup)
    trainer = shardwise.Trainer(
        strategy=strategy, optimizer=_adamw, strategy_options=options, callbacks=[timer],
        global_batch_size=args.batch, max_steps=args.steps, log_every=args.steps, progress_bar=False,
    )
    summary = trainer.fit(model, _Dicts(args.block, args.batch * args.steps))
    by_op = summary["comm"]["by_op"]
    tp_sent = sum(v["sent_bytes"] for k, v in by_op.items() if k.startswith("tp/"))
    return {"step_s": statistics.median(timer.times), "tp_sent_per_step": tp_sent / summary["steps"], "saved_mb": timer.saved_bytes / 1e6,
            "collectives": (summary.get("tp") or {}).get("collectives_per_step")}


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The repeat with the lowest median step time (the machine may be shared: noise only adds)."""
    return min(runs, key=lambda r: r["step_s"])


def _two(widths: list[int], args: argparse.Namespace) -> dict[Any, Any]:
    runs: dict[Any, list[dict[str, Any]]] = {}
    for _ in range(args.repeats):  # interleaved: a slow spell on the machine hits every configuration alike
        for width in widths:
            runs.setdefault(("tp2", width), []).append(_fit("tp", width, args, tp=2))
            runs.setdefault(("tp2 sp", width), []).append(_fit("tp", width, args, tp=2, sequence_parallel=True))
            runs.setdefault(("no count", width), []).append(_fit("tp", width, args, tp=2, count_collectives=False))
        if args.llama_width:
            runs.setdefault(("tp2", "llama"), []).append(_fit_llama("tp", args, tp=2))
            runs.setdefault(("tp2 sp", "llama"), []).append(_fit_llama("tp", args, tp=2, sequence_parallel=True))
    return {k: _best(v) for k, v in runs.items()}


def predicted_bytes(width: int, args: argparse.Namespace, p: int, sequence_parallel: bool) -> float:
    """Megatron's bytes sent per rank per step on the tp group (fp32 activations)."""
    act = args.batch * args.block * width * 4
    per_op = 2 * (p - 1) / p * act
    total = args.layers * 2 * 2 * per_op  # blocks x (attention, MLP) x (forward, backward)
    if sequence_parallel:
        total += 2 * (p - 1) / p * act  # leaving the sharded region forward; entering it, backward
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--block", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--llama-width", type=int, default=128, help="hidden size of the HF Llama rows (0: leave them out)")
    ap.add_argument("--repeats", type=int, default=1, help="interleaved repetitions; each row keeps its fastest")
    args = ap.parse_args()
    torch.set_num_threads(1)
    single = {w: _best([_fit("single", w, args) for _ in range(args.repeats)]) for w in args.widths}
    if args.llama_width:
        single["llama"] = _best([_fit_llama("single", args) for _ in range(args.repeats)])
    two = shardwise.launch(_two, args.widths, args, nproc=2, threads_per_proc=1)[0]
    print(f"charlm, {args.layers} blocks, 4 heads, block {args.block}, global batch {args.batch}, fp32; median step after {args.warmup} "
          f"warm-up steps, fastest of {args.repeats} repeats")
    head = (f"{'d_model':>7} {'run':>9} {'step ms':>8} {'vs tp1':>7} {'tp MB sent/step':>16} {'predicted':>10} {'ratio':>6} "
            f"{'act. MB':>8} {'vs tp1':>7}  collectives per step (tp group: fwd/bwd)")
    print(head)
    print("-" * len(head))
    for w in args.widths + (["llama"] if args.llama_width else []):
        width = args.llama_width if w == "llama" else w
        base = single[w]["step_s"]
        act = single[w]["saved_mb"]
        if w == "llama":
            print(f"HF LlamaForCausalLM, d_model {width}, 4 heads / 2 kv heads, its declared plan and its own loss")
        print(f"{w:>7} {'tp1':>9} {base * 1e3:>8.2f} {1.0:>7.2f} {0.0:>16.3f} {0.0:>10.3f} {'':>6} {act:>8.2f} {1.0:>7.2f}")
        for run in ("tp2", "tp2 sp") + (("no count",) if w != "llama" else ()):
            r = two[(run, w)]
            pred = predicted_bytes(width, args, 2, run == "tp2 sp") / 1e6
            sent = r["tp_sent_per_step"] / 1e6
            counts = ", ".join(f"{k.split('/')[1]} {int(v.get('forward', 0))}/{int(v.get('backward', 0))}" for k, v in (r["collectives"] or {}).items())
            ratio = f"{sent / pred:>6.3f}" if run != "no count" else f"{'':>6}"
            print(f"{w:>7} {run:>9} {r['step_s'] * 1e3:>8.2f} {r['step_s'] / base:>7.2f} {sent:>16.3f} {pred if run != 'no count' else 0:>10.3f} {ratio} "
                  f"{r['saved_mb']:>8.2f} {r['saved_mb'] / act:>7.2f}  {counts}")


if __name__ == "__main__":
    main()
