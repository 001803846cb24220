"""Pipeline bubble, measured against the formula, for p in {2, 4}, m in {2, 4, 8, 16} and each schedule.

The benchmark model has equal stage costs by construction: no embedding and no head, an
``nn.Sequential`` of identical ``Linear(width, width) + tanh`` blocks, ``--layers-per-rank`` of
them on every rank (interleaved: ``v`` chunks of ``layers / v``), the input requiring a gradient
so the first stage's backward does the same work as the others, and a loss (mean square) too
small to matter. Every micro-batch has ``--rows`` rows whatever m, so each forward and backward
costs the same in every configuration.

Measured bubble (``summary()['pipeline']['bubble_measured']``): for each stage, 1 - (time inside
its forward and backward actions) / (the step's wall time from the first rank's start to the
last rank's end, on a clock aligned across ranks at setup), averaged over stages and over the
steps after ``--warmup``. Predicted (Narayanan et al. 2021): (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v m+p-1) interleaved. The formula counts no communication and no scheduling overhead,
so the measured value sits above it by what those cost next to one action (``--width`` and
``--rows`` set the action's size).

``--cost sleep`` swaps the compute for blocks that sleep a fixed time in forward
(``--action-ms``) and twice that in backward: stage costs are then equal by construction and do
not compete for cores, so the measurement isolates the schedule (and message latency) from CPU
contention, and p=4 runs honestly on two cores. ``--cost compute`` (default) is real work.

One thread per process. On a machine with fewer cores than p (p=4 here on 2 cores) the
processes share cores: an action that overlaps another rank's runs slower, which inflates busy
time and changes the measured bubble in ways the formula does not model; the table marks
those rows ``oversubscribed``.

    python benchmarks/pipeline.py [--pp 2 4] [--microbatches 2 4 8 16] [--steps 4] [--timeline /tmp/pipeline_timeline.png]

``--model hf-llama``: the same table for a Hugging Face ``LlamaForCausalLM`` built from a small
config (no download; ``--llama-layers`` layers of width ``--llama-hidden``, sequences of
``--llama-seq`` tokens, ``--rows`` sequences per micro-batch, float32), split along
``model.layers`` with the embedding on the first stage and the norm and head on the last, trained
on its own loss from ``labels`` (a dict batch). Its stages are not equal (the embedding and the
head sit on the end stages), so the measured bubble also holds that imbalance; the table adds the
step time of the unsplit model on the same global batch in one process (``single s``), measured
in the same run.

    python benchmarks/pipeline.py --model hf-llama --pp 2 --microbatches 2 4 8 --rows 4
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from torch import nn

import shardwise

SCHEDULES = ("gpipe", "1f1b", "interleaved")


def equal_blocks(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks)


class _Sleep(torch.autograd.Function):
    """Identity times a scalar weight whose forward sleeps ``ms`` and backward ``2 ms``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor, ms: float) -> torch.Tensor:  # type: ignore[override]
        time.sleep(ms / 1000)
        ctx.save_for_backward(x, w)
        ctx.ms = ms
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:  # type: ignore[override]
        time.sleep(2 * ctx.ms / 1000)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum().reshape(w.shape), None


class SleepBlock(nn.Module):
    """An equal-cost stage block that costs time but no CPU: forward ``ms``, backward ``2 ms``."""

    def __init__(self, ms: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(1))
        self.ms = ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.weight, self.ms)  # type: ignore[no-any-return]


def sleep_blocks(ms: float, layers: int) -> nn.Sequential:
    return nn.Sequential(*[SleepBlock(ms) for _ in range(layers)])


def _mean_square(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return output.pow(2).mean()


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-4)


def _run(configs: list[dict[str, Any]], width: int, layers_per_rank: int, rows: int, steps: int, warmup: int, timeline: str | None,
         action_ms: float | None = None) -> list[dict[str, Any]]:
    out = []
    for cfg in configs:
        p, m, schedule = cfg["pp"], cfg["microbatches"], cfg["schedule"]
        options: dict[str, Any] = dict(pp=p, microbatches=m, schedule=schedule, warmup_steps=warmup)
        if timeline and cfg.get("timeline"):
            options["timeline"] = timeline
        engine = shardwise.Engine(strategy="pipeline", strategy_options=options, accelerator="cpu")
        blocks = equal_blocks(width, layers_per_rank * p) if action_ms is None else sleep_blocks(action_ms / layers_per_rank, layers_per_rank * p)
        model, opt = engine.setup(blocks, _sgd)
        g = torch.Generator().manual_seed(1)
        x = torch.randn(rows * m, width, generator=g).requires_grad_(True)  # the first stage computes dx too: equal backward cost
        y = torch.zeros(rows * m)
        for _ in range(warmup + steps):
            engine.forward_backward(model, [(x, y)], lambda mod, b: _mean_square(mod(b[0]), b))
            engine.step(opt)
            opt.zero_grad(set_to_none=True)
        section = engine.finish()["pipeline"]
        out.append({**cfg, "measured": section["bubble_measured"], "median": section["bubble_measured_median_step"], "predicted": section["bubble_predicted"],
                    "per_stage": [s["bubble"] for s in section["per_stage"]], "step_s": section["step_wall_s"],
                    "virtual_stages": section["virtual_stages"], "timeline": section.get("timeline")})
    return out


def hf_llama(hidden: int, layers: int, vocab: int, seq: int) -> nn.Module:
    """A float32 ``LlamaForCausalLM`` with random weights from a small config (seed 0)."""
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=seq, tie_word_embeddings=False, attn_implementation="sdpa")
    return tf.LlamaForCausalLM(cfg)


def _llama_batch(rows: int, vocab: int, seq: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (rows, seq), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids.clone()}


def _own_loss(model: Any, batch: Any) -> torch.Tensor:
    from shardwise.data.batches import call_model, loss_from_output

    return loss_from_output(call_model(model, batch), batch)


def _run_llama(configs: list[dict[str, Any]], llama: dict[str, int], rows: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    out = []
    for cfg in configs:
        p, m, schedule = cfg["pp"], cfg["microbatches"], cfg["schedule"]
        engine = shardwise.Engine(strategy="pipeline", accelerator="cpu",
                                  strategy_options=dict(pp=p, microbatches=m, schedule=schedule, warmup_steps=warmup))
        model, opt = engine.setup(hf_llama(**llama), _sgd)
        batch = _llama_batch(rows * m, llama["vocab"], llama["seq"])
        for _ in range(warmup + steps):
            engine.forward_backward(model, [batch], _own_loss)
            engine.step(opt)
            opt.zero_grad(set_to_none=True)
        section = engine.finish()["pipeline"]
        out.append({**cfg, "measured": section["bubble_measured"], "median": section["bubble_measured_median_step"],
                    "predicted": section["bubble_predicted"], "per_stage": [s["bubble"] for s in section["per_stage"]],
                    "step_s": section["step_wall_s"], "virtual_stages": section["virtual_stages"], "timeline": None,
                    "stage_layers": section["stage_layers"]})
    return out


def _single_llama_step(llama: dict[str, int], rows: int, steps: int, warmup: int) -> float:
    """Mean step time of the unsplit model on ``rows`` sequences, in this process (one thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = hf_llama(**llama)
        opt = _sgd(model.parameters())
        batch = _llama_batch(rows, llama["vocab"], llama["seq"])
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            model(**batch).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if i >= warmup:
                times.append(time.perf_counter() - start)
        return sum(times) / len(times)
    finally:
        torch.set_num_threads(threads)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--microbatches", type=int, nargs="+", default=[2, 4, 8, 16])
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=128, help="rows per micro-batch")
    ap.add_argument("--layers-per-rank", type=int, default=4)
    ap.add_argument("--cost", choices=["compute", "sleep"], default="compute", help="compute: Linear+tanh blocks; sleep: blocks that sleep (equal, contention-free stage costs)")
    ap.add_argument("--action-ms", type=float, default=20.0, help="--cost sleep: one stage's forward per micro-batch in ms (backward twice that)")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--timeline", default=None, help="PNG for one configuration (interleaved, p=2, m=4), events as JSON next to it")
    ap.add_argument("--json", default=None, help="write the rows as JSON")
    ap.add_argument("--model", choices=["blocks", "hf-llama"], default="blocks", help="blocks: equal Linear+tanh (or sleeping) blocks; hf-llama: transformers' Llama")
    ap.add_argument("--llama-hidden", type=int, default=256)
    ap.add_argument("--llama-layers", type=int, default=8)
    ap.add_argument("--llama-vocab", type=int, default=2048)
    ap.add_argument("--llama-seq", type=int, default=128)
    args = ap.parse_args(argv)
    llama = {"hidden": args.llama_hidden, "layers": args.llama_layers, "vocab": args.llama_vocab, "seq": args.llama_seq}

    cores = os.cpu_count() or 1
    rows: list[dict[str, Any]] = []
    for p in args.pp:
        configs = []
        for schedule in args.schedules:
            for m in args.microbatches:
                if schedule == "1f1b" and m < p:
                    continue  # refused by design (fewer micro-batches than stages)
                if schedule == "interleaved" and m % max(1, m // p):
                    continue
                configs.append({"pp": p, "microbatches": m, "schedule": schedule,
                                "timeline": schedule == "interleaved" and p == 2 and m == 4})
        if args.model == "hf-llama":
            configs = [c for c in configs if c["schedule"] != "interleaved" or args.llama_layers >= 2 * c["pp"]]
            results = shardwise.launch(_run_llama, configs, llama, args.rows, args.steps, args.warmup, nproc=p, threads_per_proc=1, timeout=1800)
        else:
            results = shardwise.launch(_run, configs, args.width, args.layers_per_rank, args.rows, args.steps, args.warmup, args.timeline,
                                       args.action_ms if args.cost == "sleep" else None, nproc=p, threads_per_proc=1, timeout=1800)
        for r in results[0]:
            r["oversubscribed"] = p > cores and (args.cost == "compute" or args.model == "hf-llama")
            if args.model == "hf-llama":
                r["single_s"] = _single_llama_step(llama, args.rows * r["microbatches"], args.steps, args.warmup)
            rows.append(r)

    if args.model == "hf-llama":
        cost = (f"transformers LlamaForCausalLM, {args.llama_layers} layers of width {args.llama_hidden}, vocab {args.llama_vocab}, "
                f"{args.rows} sequences of {args.llama_seq} tokens per micro-batch, float32, own loss from labels")
        print(f"pipeline bubble: {cost}, {args.steps} steps after {args.warmup} warm-up, {cores} cores")
    else:
        cost = f"sleeping blocks, {args.action_ms:g} ms forward + {2 * args.action_ms:g} ms backward per stage and micro-batch" if args.cost == "sleep" \
            else f"width {args.width}, {args.rows} rows per micro-batch"
        print(f"pipeline bubble: {cost}, {args.layers_per_rank} blocks per rank, "
              f"{args.steps} steps after {args.warmup} warm-up, {cores} cores")
    single = f" {'single s':>8}" if args.model == "hf-llama" else ""
    print(f"{'p':>2} {'schedule':<12} {'v':>2} {'m':>3} {'measured':>9} {'median':>7} {'predicted':>9} {'ratio':>6} {'step s':>7}{single}  per-stage")
    for r in rows:
        ratio = r["measured"] / r["predicted"] if r["predicted"] else float("nan")
        flag = "  oversubscribed" if r["oversubscribed"] else ""
        stages = " ".join(f"{b:.3f}" for b in r["per_stage"])
        one = f" {r['single_s']:>8.3f}" if "single_s" in r else ""
        print(f"{r['pp']:>2} {r['schedule']:<12} {r['virtual_stages']:>2} {r['microbatches']:>3} {r['measured']:>9.3f} {r['median']:>7.3f} {r['predicted']:>9.3f} {ratio:>6.2f} {r['step_s']:>7.3f}{one}  {stages}{flag}")
    timelines = [r["timeline"] for r in rows if r.get("timeline")]
    if timelines:
        print(f"timeline: {timelines[0]} (events: {timelines[0]}.json)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
