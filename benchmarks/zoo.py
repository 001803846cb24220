"""The zoo sweep: every causal LM transformers ships, built small, trained under tp, tp+sp, 1F1B and
ep, each against ``single`` in float64.

Each model (`zoo_models.build`: 2 layers, hidden 32, 4 heads, 2 key/value heads, vocabulary 64,
4 experts of which 2 per token, float64, random weights from seed 0) trains 5 SGD steps with
momentum on global batches of 8 sequences of 16 tokens, clipping every step (clip norm 0.2), its
own logits through a float64 next-token loss, as in tests/support/harness.py. Cells:

- ``tp``: ``strategy="tp", tp=2`` (the model's declared plan, else shardwise's automatic one);
- ``tp+sp``: the same with ``sequence_parallel=True``;
- ``1F1B``: ``strategy="pipeline", pp=2, schedule="1f1b", microbatches=4``;
- ``ep``: ``strategy="ddp", ep=2`` on models with MoE layers ("not built" while ddp has no ``ep``).

Outcome of a cell: ``exact`` (largest weight difference from single within the model's tolerance:
``max(1e-9, 10 x its noise floor)``, the floor being single against single with ``accumulate=2``:
the same sums in another order, which a model with top-k routing or a chaotic step may amplify),
``refused`` (a ConfigError from the checks the Trainer makes before any process starts; its first
line), ``failed`` (an error after launch, or a timeout), ``WRONG`` (it ran and is not exact).

Isolation: each model runs in its own Python process with a wall-clock limit (``--timeout``), so a
model that hangs or crashes the interpreter while building is a row, not the end of the sweep.
Inside it the cells that pass the checks run one after another in one launch of 2 processes (one
thread each); a cell that fails ends that launch, is recorded with its error, and the cells after
it run in a fresh launch (a fresh process group), so no failure poisons another cell.

    python benchmarks/zoo.py [--models llama mixtral] [--cells tp 1F1B] [--json out.json] [--markdown out.md]
    python benchmarks/zoo.py --declared tp       # only the models whose config declares a tp plan
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
CELLS: dict[str, tuple[str, dict[str, Any]]] = {
    "tp": ("tp", {"tp": 2}),
    "tp+sp": ("tp", {"tp": 2, "sequence_parallel": True}),
    "1F1B": ("pipeline", {"pp": 2, "schedule": "1f1b", "microbatches": 4}),
    "ep": ("ddp", {"ep": 2}),
}
STEPS, GLOBAL_BATCH, SAMPLES, CLIP, TOL, FLOOR_FACTOR = 5, 8, 40, 0.2, 1e-9, 10.0


# -- one model, in its own process -------------------------------------------------------------------
def _models() -> Any:
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))
    import zoo_models

    return zoo_models


def _sgd(params: Any) -> Any:
    import torch

    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def trainer(strategy: str, options: dict[str, Any], **settings: Any) -> Any:
    """The Trainer of every cell (harness.trainer's settings, this zoo's float64 loss)."""
    import shardwise

    zm = _models()
    base = dict(
        strategy=strategy,
        strategy_options=dict(options),
        global_batch_size=GLOBAL_BATCH,
        max_steps=STEPS,
        precision="64",
        clip_grad_norm=CLIP,
        seed=0,
        progress_bar=False,
        log_every=STEPS,
        timeout_s=60.0,
        announce_outputs=False,
    )
    return shardwise.Trainer(optimizer=_sgd, loss_fn=zm.causal_lm_loss64, **{**base, **settings})


def max_difference(state: dict[str, Any], ref: dict[str, Any]) -> float:
    """Largest absolute difference over the floating tensors (inf when keys or shapes differ)."""
    if set(state) != set(ref):
        return float("inf")
    worst = 0.0
    for k, v in ref.items():
        got = state[k]
        if tuple(got.shape) != tuple(v.shape):
            return float("inf")
        if v.is_floating_point() and v.numel():
            worst = max(worst, (got.double() - v.double()).abs().max().item())
    return worst


def _single(model_type: str, **settings: Any) -> dict[str, Any]:
    zm = _models()
    model = zm.build(model_type)
    t = trainer("single", {}, **settings)
    t._check(model, zm.Samples(SAMPLES))
    t._fit(model, zm.Samples(SAMPLES), None, return_state=False)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _cells_worker(pairs: list[tuple[str, str]], refs: dict[str, Any], progress: str) -> None:
    """Rank side: train each (model, cell) pair in turn; rank 0 appends each one's difference to ``progress``."""
    import torch.distributed as dist

    zm = _models()
    for model_type, name in pairs:
        strategy, options = CELLS[name]
        model = zm.build(model_type)
        t = trainer(strategy, options)
        t._check(model, zm.Samples(SAMPLES))
        _, state = t._fit(model, zm.Samples(SAMPLES), None, return_state=True)
        if dist.get_rank() == 0:
            with open(progress, "a") as f:
                f.write(json.dumps({"model": model_type, "cell": name, "diff": max_difference(state, refs[model_type])}) + "\n")


def outcome(diff: float, tol: float) -> str:
    """A cell that ran: ``exact`` within ``tol`` of single, else ``WRONG`` (a NaN is WRONG too)."""
    return "exact" if diff <= tol else "WRONG"


def _first_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    return f"{type(exc).__name__}: {text}"[:400]


def _error_of(exc: BaseException) -> str:
    """The worker's error in one line: the last 'SomethingError: ...' line of a launch's report."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    named = [ln for ln in lines if ln.split(":")[0].endswith(("Error", "Exception")) and "Traceback" not in ln]
    return (named[-1] if named else _first_line(exc))[:400]


def _refusal(model_type: str, name: str) -> str | None:
    """The first line of the ConfigError the parent raises before launching cell ``name``, else None."""
    from shardwise.errors import ConfigError

    zm = _models()
    strategy, options = CELLS[name]
    try:
        trainer(strategy, options, nproc=2)._check(zm.build(model_type), zm.Samples(SAMPLES))
    except ConfigError as exc:
        return str(exc).strip().splitlines()[0][:400]
    return None


def _applies(name: str, info: dict[str, Any]) -> bool:
    return name != "ep" or bool(info["moe"])


class _Alarm(Exception):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise _Alarm()


def prepare(model_type: str, cells: list[str], limit: int = 60) -> tuple[dict[str, Any], Any, list[str]]:
    """The parent's part for one model: build, describe, single and its noise floor, the refusals;
    (row, single's state, the cells left to launch). A build that runs past ``limit`` s is the row's error."""
    import signal

    zm = _models()
    row: dict[str, Any] = {"model": model_type, "class": zm.catalogue()[model_type], "cells": {}}
    clock = time.perf_counter()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(limit)
    try:
        model = zm.build(model_type)
        row.update(zm.describe(model))
        ref = _single(model_type)
        floor = max_difference(_single(model_type, accumulate=2), ref)
        moved = max_difference(ref, model.state_dict())
    except _Alarm:
        row["build_error"] = f"building and training under single ran past {limit} s"
        return row, None, []
    except Exception as exc:  # a family that does not build or train small here is a row of its own
        row["build_error"] = _first_line(exc)
        return row, None, []
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    row.update(floor=floor, tol=max(TOL, FLOOR_FACTOR * floor), moved=moved, single_s=round(time.perf_counter() - clock, 1))
    todo = []
    for name in cells:
        if not _applies(name, row):
            row["cells"][name] = {"outcome": "n/a"}
        elif (why := _refusal(model_type, name)) is not None:
            not_built = name == "ep" and "has no option 'ep'" in why
            row["cells"][name] = {"outcome": "not built" if not_built else "refused", "message": why}
        else:
            todo.append(name)
    return row, ref, todo


def run_models(model_types: list[str], cells: list[str]) -> list[dict[str, Any]]:
    """Every cell of ``model_types``: the parent's part model by model, then the cells that passed the
    checks in one launch of 2 processes; a failing cell is recorded and the rest relaunched."""
    import torch

    import shardwise

    torch.set_num_threads(1)
    rows: dict[str, dict[str, Any]] = {}
    refs: dict[str, Any] = {}
    pairs: list[tuple[str, str]] = []
    for m in model_types:
        rows[m], ref, todo = prepare(m, cells)
        if todo:
            refs[m] = ref
            pairs += [(m, c) for c in todo]
    with tempfile.TemporaryDirectory() as tmp:
        progress = os.path.join(tmp, "progress.jsonl")
        while pairs:
            clock = time.perf_counter()
            try:
                shardwise.launch(_cells_worker, pairs, refs, progress, nproc=2, threads_per_proc=1, timeout=120 + 60 * len(pairs))
                error = None
            except Exception as exc:
                error = _error_of(exc)
            done = [json.loads(line) for line in open(progress)] if os.path.exists(progress) else []
            open(progress, "w").close()
            share = round((time.perf_counter() - clock) / max(1, len(done) + (error is not None)), 1)
            for d in done:
                row = rows[d["model"]]
                row["cells"][d["cell"]] = {"outcome": outcome(d["diff"], row["tol"]), "diff": d["diff"], "s": share}
            pairs = pairs[len(done) :]
            if error is not None and pairs:
                (m, c), pairs = pairs[0], pairs[1:]
                rows[m]["cells"][c] = {"outcome": "failed", "message": error, "s": share}
    return list(rows.values())


# -- the sweep --------------------------------------------------------------------------------------
def _chunk(model_types: list[str], cells: list[str], timeout: float) -> list[dict[str, Any]]:
    """`run_models` in a fresh interpreter with a wall-clock limit; when it hangs or crashes, each
    model again alone, so only the model at fault is the row of the error."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", *model_types, "--cells", *cells]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error", "PYTHONWARNINGS": "ignore"}
    started = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout * len(model_types), env=env, cwd=HERE.parent)
        lines = [line[len("ZOO-ROWS ") :] for line in proc.stdout.splitlines() if line.startswith("ZOO-ROWS ")]
        why = "" if lines else f"crashed (exit {proc.returncode}): " + ([ln for ln in proc.stderr.splitlines() if ln.strip()][-1:] or [""])[0][:300]
    except subprocess.TimeoutExpired:
        lines, why = [], f"timed out after {timeout * len(model_types):.0f} s"
    if lines:
        rows: list[dict[str, Any]] = json.loads(lines[-1])
        for r in rows:
            r["seconds"] = round((time.perf_counter() - started) / len(rows), 1)
        return rows
    if len(model_types) > 1:
        return [r for m in model_types for r in _chunk([m], cells, timeout)]
    return [{"model": model_types[0], "build_error": why, "cells": {}}]


def select(models: list[str] | None, declared: str | None) -> list[str]:
    """Model types to sweep: ``models`` (exact types) or every causal LM, optionally only those whose
    default config declares a tp (``declared="tp"``) or pp plan (``"pp"``)."""
    zm = _models()
    names = list(zm.catalogue())
    if models:
        unknown = [m for m in models if m not in names]
        if unknown:
            raise SystemExit(f"unknown model types {unknown}; see transformers' causal LM mapping (e.g. {names[:5]})")
        names = [n for n in names if n in models]
    if declared:
        kept = []
        for n in names:
            try:
                cfg = zm.default_config(n)
            except Exception:
                continue
            plan = zm.tp_plan_of(cfg) if declared == "tp" else zm.pp_plan_of(cfg)
            if plan:
                kept.append(n)
        names = kept
    return names


def _cell_text(cell: dict[str, Any] | None) -> str:
    if not cell:
        return ""
    out = cell["outcome"]
    if "diff" in cell:
        return f"{out} {cell['diff']:.1e}"
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The sweep's figures: tp exact among the built models declaring a tp plan, 1F1B among those
    declaring a pp plan, WRONG cells, refusals and failures."""
    built = [r for r in rows if "build_error" not in r]

    def share(cell: str, plan: str) -> tuple[int, int]:
        pool = [r for r in built if r.get(plan) and cell in r["cells"]]
        return sum(r["cells"][cell]["outcome"] == "exact" for r in pool), len(pool)

    outcomes = [c["outcome"] for r in built for c in r["cells"].values()]
    figures: dict[str, Any] = {
        "models": len(rows),
        "built": len(built),
        "wrong": outcomes.count("WRONG"),
        "failed": outcomes.count("failed"),
        "refused": outcomes.count("refused"),
    }
    for cell, plan in (("tp", "tp_plan"), ("tp+sp", "tp_plan"), ("1F1B", "pp_plan")):
        exact, pool = share(cell, plan)
        figures[cell] = {"exact": exact, "of": pool, "percent": round(100 * exact / pool, 1) if pool else None}
    return figures


def cell_table(rows: list[dict[str, Any]], cells: list[str]) -> list[str]:
    """Markdown: per cell, how many built models ran it and each outcome's count."""
    kinds = ("exact", "refused", "failed", "WRONG", "not built")
    lines = ["| cell | models | " + " | ".join(kinds) + " |", "| --- | ---: | " + " | ".join("---:" for _ in kinds) + " |"]
    for cell in cells:
        got = [r["cells"][cell]["outcome"] for r in rows if "build_error" not in r and r["cells"].get(cell, {}).get("outcome", "n/a") != "n/a"]
        if got:
            lines.append(f"| {cell} | {len(got)} | " + " | ".join(str(got.count(k)) for k in kinds) + " |")
    return lines


def markdown(rows: list[dict[str, Any]], cells: list[str]) -> str:
    import torch
    import transformers

    fig = summary(rows)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        f"zoo sweep {stamp}: transformers {transformers.__version__}, torch {torch.__version__}, {fig['models']} causal LMs, "
        f"{fig['built']} built small and trained under single",
        "",
    ]
    for cell in ("tp", "tp+sp", "1F1B"):
        f = fig[cell]
        if cell in cells and f["of"]:
            plan = "pp" if cell == "1F1B" else "tp"
            lines.append(f"- {cell} exact: {f['exact']} of {f['of']} models declaring a {plan} plan ({f['percent']}%)")
    lines += [f"- WRONG cells (ran, not exact): {fig['wrong']}; failed after launch: {fig['failed']}; refused before launch: {fig['refused']}", ""]
    lines += cell_table(rows, cells) + [""]
    lines.append("| model | tp plan | pp plan | MoE | floor | " + " | ".join(cells) + " |")
    lines.append("| --- | --- | --- | --- | --- | " + " | ".join("---" for _ in cells) + " |")
    for r in rows:
        if "build_error" in r:
            lines.append(f"| {r['model']} | did not build: {r['build_error'][:120]} |" + " |" * (len(cells) + 3))
            continue
        yes = lambda v: "yes" if v else "-"  # noqa: E731
        lines.append(
            f"| {r['model']} | {yes(r['tp_plan'])} | {yes(r['pp_plan'])} | {len(r['moe']) or '-'} | {r['floor']:.0e} | "
            + " | ".join(_cell_text(r["cells"].get(c)) for c in cells)
            + " |"
        )
    notes = [(r["model"], c, v) for r in rows for c, v in r.get("cells", {}).items() if v.get("message")]
    if notes:
        lines += ["", "Messages (refused: the ConfigError's first line; failed: the worker's error):", ""]
        lines += [f"- {m} {c} {v['outcome']}: {v['message'][:300]}" for m, c, v in notes]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", help="model types (transformers' config model_type, e.g. llama mixtral)")
    ap.add_argument("--cells", nargs="+", default=list(CELLS), choices=list(CELLS))
    ap.add_argument("--declared", choices=["tp", "pp"], help="only the models whose config declares this plan")
    ap.add_argument("--timeout", type=float, default=300.0, help="wall-clock seconds per model (all its cells)")
    ap.add_argument("--json", help="write the rows and figures here (rewritten after each model)")
    ap.add_argument("--markdown", help="write the table here (rewritten after each model)")
    ap.add_argument("--chunk", type=int, default=6, help="models per launch (a failing cell relaunches the rest)")
    ap.add_argument("--merge", nargs="+", help="JSON files of earlier sweeps: one table of their rows (a later file's cell wins)")
    ap.add_argument("--one", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        print("ZOO-ROWS " + json.dumps(run_models(args.one, args.cells)), flush=True)
        return
    if args.merge:
        merged: dict[str, dict[str, Any]] = {}
        for path in args.merge:  # cell by cell: a later file's cell wins; a row that built wins over one that did not
            for r in json.loads(Path(path).read_text())["rows"]:
                old = merged.get(r["model"])
                if old is None or "build_error" in old:
                    merged[r["model"]] = r
                elif "build_error" not in r:
                    merged[r["model"]] = {**old, **r, "cells": {**old["cells"], **r["cells"]}}
        for r in merged.values():  # what the config declares, read again (not what a row of an older script said)
            cfg = _models().default_config(r["model"])
            r.update(tp_plan=bool(_models().tp_plan_of(cfg)), pp_plan=bool(_models().pp_plan_of(cfg)))
        _write(args, sorted(merged.values(), key=lambda r: str(r["model"])))
        return
    rows: list[dict[str, Any]] = []
    names = select(args.models, args.declared)
    for i in range(0, len(names), args.chunk):
        for r in _chunk(names[i : i + args.chunk], args.cells, args.timeout):
            rows.append(r)
            cells = "  ".join(f"{c}: {_cell_text(v)}" for c, v in r["cells"].items())
            print(f"{r['model']:<28} {r.get('build_error') or cells}  ({r.get('seconds', 0):.0f} s)", flush=True)
        _write(args, rows, quiet=True)
    _write(args, rows)


def _write(args: argparse.Namespace, rows: list[dict[str, Any]], quiet: bool = False) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "summary": summary(rows)}, indent=1))
    if args.markdown:
        Path(args.markdown).write_text(markdown(rows, args.cells))
    if not quiet:
        print(markdown(rows, args.cells))


if __name__ == "__main__":
    main()
