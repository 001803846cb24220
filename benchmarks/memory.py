"""Every process's peak resident memory against the plan, per strategy, eager and meta-built (issue 37).

The model of issue 37: ``LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096,
num_hidden_layers=8, num_attention_heads=16)`` (200 M parameters, 0.8 GB in fp32), SGD lr 1e-3,
global batch 4 x 32 tokens, 2 steps, at 2 and 4 processes: single, ddp, zero1, zero2, zero3, tp,
pipeline (pp x tp at 4), the model built eagerly and under ``torch.device("meta")``. Each
configuration is a training script written to a temporary directory and run in its own fresh
launching process, so every high-water mark (VmHWM) is that configuration's alone; the script
builds the model at its top level and calls ``fit`` unguarded, as a new user writes it (the
workers run the script up to ``fit``, so they build the model too). The figures are the Trainer's
own (summary.json's ``memory``: each rank at fit start and at the end, the launching process after
its workers returned) beside `shardwise.strategies.cost.peak`'s prediction; "above base" is the peak less a
fresh interpreter's that imported torch, shardwise's trainer and transformers' modeling code,
measured here first. The first two losses are compared with single's (eager).

    python benchmarks/memory.py [--quick] [--worlds 2 4] [--families ddp zero3 ...] [--builds eager meta]

``--quick``: a 4-layer, 256-wide Llama with a 4000-token vocabulary (seconds per configuration).
The full run needs about 10 GB and both cores for a few minutes. Benchmarks print; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

FULL = {"vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 8, "num_attention_heads": 16}
QUICK = {"vocab_size": 4000, "hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4}
FAMILIES = ("ddp", "zero1", "zero2", "zero3", "tp", "pipeline")

SCRIPT = """\
import json, sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from shardwise import Trainer, TrainerConfig

cfg = LlamaConfig(**{sizes!r})
torch.manual_seed(0)
if {meta!r}:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
else:
    model = LlamaForCausalLM(cfg)
ids = torch.randint(0, cfg.vocab_size, (8, 32), generator=torch.Generator().manual_seed(1))
data = [{{"input_ids": x, "labels": x}} for x in ids]
trainer = Trainer(
    config=TrainerConfig(
        strategy={strategy!r}, strategy_options={options!r}, nproc={nproc}, max_steps=2, global_batch_size=4, log_every=1,
        out={out!r}, overwrite=True, progress_bar=False, model_summary=False, keep_last=1,
    ),
    optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
)
summary = trainer.fit(model, data)
print("SUMMARY " + json.dumps({{"memory": summary.get("memory")}}))
"""


def baseline_bytes() -> int:
    """A fresh interpreter's peak after importing torch, shardwise's trainer and transformers' modeling code."""
    from shardwise.tools.advisor.calibrate import BASELINE_IMPORTS

    code = BASELINE_IMPORTS + "import json\nprint(json.dumps(shardwise.launcher.memory.host_memory()['peak_bytes']))\n"
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()[-1])


def options_for(family: str, nproc: int) -> dict[str, Any]:
    if family == "tp":
        return {"tp": nproc}
    if family == "pipeline":
        return {"pp": 2, "tp": nproc // 2} if nproc >= 4 else {"pp": nproc}
    return {}


def run_one(family: str, nproc: int, meta: bool, sizes: dict[str, int], root: Path, timeout: float) -> dict[str, Any]:
    """One configuration in a fresh launching process; its memory section, first losses, or its error."""
    name = f"{family}-{nproc}-{'meta' if meta else 'eager'}"
    out = root / name
    script = root / f"{name.replace('-', '_')}.py"
    script.write_text(SCRIPT.format(sizes=sizes, meta=meta, strategy=family, options=options_for(family, nproc), nproc=nproc, out=str(out)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=timeout, env=env, cwd=root)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f}s"}
    line = next((x for x in done.stdout.splitlines() if x.startswith("SUMMARY ")), None)
    if done.returncode != 0 or line is None:
        tail = (done.stderr or done.stdout).strip().splitlines()
        return {"error": (tail[-1] if tail else f"exit {done.returncode}")[:150]}
    memory = json.loads(line[len("SUMMARY ") :])["memory"]
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    losses = [m["train_loss"] for m in metrics if "train_loss" in m][:2]
    return {"memory": memory, "losses": losses}


def _gb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e9:.2f}"


def rows_of(label: str, res: dict[str, Any], base: int, single_above: float | None, single_losses: list[float] | None) -> list[str]:
    if "error" in res:
        meta = label.endswith("meta")
        why = "not supported yet" if meta else "failed"
        return [f"| {label} | | {why}: {res['error'].replace('|', '/')} | | | | | | |"]
    out = []
    mem = res["memory"]
    same = "-"
    if single_losses and res["losses"]:
        diff = max(abs(a - b) for a, b in zip(res["losses"], single_losses, strict=False))
        same = f"{diff:.1e}"
    for row in mem["ranks"]:
        if row is None:
            continue
        peak, pred = row["end"]["peak_bytes"], row["predicted"]["peak"]
        above = peak - base
        pred_above = pred - row["predicted"]["baseline"]
        vs_single = f"{above / single_above:.2f}" if single_above else "-"
        out.append(
            f"| {label} | rank {row['rank']} ({row['role']}) | {_gb(row['start']['peak_bytes'])} | {_gb(peak)} | {_gb(above)} | "
            f"{_gb(pred_above)} | {above / pred_above:.2f} | {vs_single} | {same} |"
        )
    launcher = mem.get("launcher")
    if launcher is not None:
        above = launcher["peak_bytes"] - base
        pred_above = launcher["predicted"]["peak"] - launcher["predicted"]["baseline"]
        out.append(f"| {label} | launcher | | {_gb(launcher['peak_bytes'])} | {_gb(above)} | {_gb(pred_above)} | | | |")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small Llama (4 layers, 256 wide, 4000 tokens)")
    ap.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES))
    ap.add_argument("--builds", nargs="+", default=["eager", "meta"], choices=["eager", "meta"])
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per configuration")
    args = ap.parse_args()
    sizes = QUICK if args.quick else FULL
    base = baseline_bytes()
    print(f"model: LlamaConfig({', '.join(f'{k}={v}' for k, v in sizes.items())}), fp32, SGD, global batch 4 x 32 tokens, 2 steps")
    print(f"runtime baseline (fresh interpreter: torch, shardwise.trainer, transformers.PreTrainedModel): {base / 1e9:.3f} GB", flush=True)
    lines = [
        "| configuration | process | peak at start (GB) | peak at end (GB) | above base (GB) | predicted above base (GB) | measured / predicted "
        "| above base / single's | first losses vs single (max abs diff) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    with tempfile.TemporaryDirectory(prefix="shardwise-memory-") as tmp:
        root = Path(tmp)
        single = run_one("single", 1, False, sizes, root, args.timeout)
        single_above = single["memory"]["ranks"][0]["end"]["peak_bytes"] - base if "memory" in single else None
        single_losses = single.get("losses")
        lines += rows_of("single-1-eager", single, base, single_above, None)
        print(lines[-1], flush=True)
        for nproc in args.worlds:
            for family in args.families:
                for build in args.builds:
                    res = run_one(family, nproc, build == "meta", sizes, root, args.timeout)
                    new = rows_of(f"{family}-{nproc}-{build}", res, base, single_above, single_losses)
                    lines += new
                    print("\n".join(new), flush=True)
    print()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
