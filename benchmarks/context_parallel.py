"""Activation memory per rank of one long sequence under context parallelism, measured, beside the planner's.

A Llama (hidden 256, 4 heads, 4 layers, MLP 688, vocabulary 512, float32, ``sdpa`` attention) trains
one 4,096-token sequence: cp=1 in one process (torch's own attention), cp=2 (and 4 with ``--cps``) in
as many processes through `shardwise.strategies.context_parallel` (ring, or ``--style ulysses``).
Each configuration runs in its own launch; each process measures its own step:

- ``step peak``: the resident high-water mark of one forward and backward above the resident size just
  before it (``/proc/self/clear_refs`` resets the mark; glibc returns every free of 256 kB or more),
  less the gradients the backward allocates (the parameters' bytes): what the step's activations took;
- ``saved``: the largest amount autograd held for backward at once (`cost.saved.SavedBytes`, what the
  planner and ``shardwise plan --validate`` call activations);
- ``planner``: `context_parallel.cost.activation_bytes` from the model measured once whole
  (`measured_spec`, cp=1) and divided as cp divides it.

    python benchmarks/context_parallel.py [--seq 4096] [--cps 1 2] [--style ring]

Benchmarks print; nothing is asserted.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

SIZES = {"vocab_size": 512, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4, "num_attention_heads": 4}
MB = 2**20
MMAP_FROM = 256 * 1024
"""glibc serves blocks from this size with their own mapping, returned on free: a cp rank's tensors are
1/cp the size, and below shardwise's 4 MB (`return_large_frees`) they would come from heaps that keep
what was freed, so the resident peak would count the heap's slack, not the tensors."""


def _mmap_from(size: int) -> None:
    import ctypes

    ctypes.CDLL("libc.so.6").mallopt(-3, size)  # M_MMAP_THRESHOLD


def build(seq: int) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**SIZES, max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def _status(field: str) -> int:
    from shardwise.launcher.memory import parse_status

    with open("/proc/self/status") as f:
        return parse_status(f.read())[field]


def step(seq: int, cp: int, style: str) -> dict[str, float]:
    """One forward and backward on this rank; its measured step peak and saved bytes (MB)."""
    from shardwise.comm.collectives import WORLD
    from shardwise.launcher.memory import return_large_frees
    from shardwise.strategies.context_parallel import apply_context_parallel
    from shardwise.strategies.cost.saved import SavedBytes

    return_large_frees()
    _mmap_from(MMAP_FROM)
    torch.set_num_threads(1)
    model = build(seq)
    if cp > 1:
        apply_context_parallel(model, WORLD, None, style)
    ids = torch.randint(0, SIZES["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    saved = SavedBytes(model.parameters())
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark back to the resident size now
    before = _status("VmRSS")
    with saved.hooks():
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    peak = _status("VmHWM")
    return {"step_peak_mb": (peak - before - grads) / MB, "saved_mb": saved.peak / MB, "loss": float(loss.detach())}


def planner(seq: int, cp: int) -> float:
    """The planner's activation figure for one cp rank (MB), from the whole model measured once."""
    from shardwise.strategies.context_parallel.cost import activation_bytes
    from shardwise.strategies.cost.model_spec import measured_spec

    model = build(seq)
    ids = torch.randint(0, SIZES["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1))
    spec = measured_spec("llama", model, ids, 1)
    return activation_bytes(spec, 1, cp)["total"] / MB


def main(argv: list[str] | None = None) -> None:
    from shardwise import launch

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--cps", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--style", default="ring", choices=("ring", "ulysses"))
    args = ap.parse_args(argv)
    print(f"Llama {SIZES}, one sequence of {args.seq} tokens, float32, cp style {args.style}")
    print(f"{'cp':>3} {'rank':>4} {'step peak MB':>13} {'saved MB':>9} {'planner MB':>11} {'loss':>8}")
    first: dict[str, float] = {}
    for cp in args.cps:
        rows = launch(step, args.seq, cp, args.style, nproc=cp, threads_per_proc=1, timeout=1200)
        plan = planner(args.seq, cp)
        for r, row in enumerate(rows):
            print(f"{cp:>3} {r:>4} {row['step_peak_mb']:>13.1f} {row['saved_mb']:>9.1f} {plan:>11.1f} {row['loss']:>8.4f}")
        worst = {k: max(row[k] for row in rows) for k in ("step_peak_mb", "saved_mb")}
        worst["planner"] = plan
        if not first:
            first = worst
        else:
            ratios = ", ".join(f"{k} {worst[k] / first[k]:.2f}" for k in worst)
            print(f"    cp={cp} / cp={args.cps[0]} (largest rank): {ratios}")


if __name__ == "__main__":
    main()
