"""benchmarks/compile_speedup.py at a tiny size with ``aot_eager`` (Dynamo and AOTAutograd, no code generated), so
that it cannot rot: the README's block (single, tp with and without the collective counter, pipeline; one repeat)
run as written here (test_readme leaves it to this file: RUN_ELSEWHERE), its printed table checked; the
speed-up arithmetic, the timer's warm-up and the eager/compiled alternation on made-up runs.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
README_COMMAND = "python benchmarks/compile_speedup.py "
BLOCK = (
    "python benchmarks/compile_speedup.py --backend aot_eager --d-model 32 --layers 2 --block 16 --batch 8 --steps 6 --warmup 2 "
    "--repeats 1 --strategies single,tp,tp-nocount,pipeline"
)
"""The README's block, as written there (`test_the_readme_block_is_the_one_run_here` holds them together)."""


def _bench() -> Any:
    spec = importlib.util.spec_from_file_location("compile_speedup", ROOT / "benchmarks" / "compile_speedup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(name: str, step_s: float, loss: float, compile_s: float = 0.0, graphs: int = 0, recompiles: int = 0) -> dict[str, Any]:
    return {
        "step_s": step_s,
        "timed_steps": 5,
        "train_loss": loss,
        "compile_s": compile_s,
        "recompiles": recompiles,
        "graphs": graphs,
        "graph_breaks": 0,
        "reasons": ["x changed"] * recompiles,
    }


def test_a_row_is_each_sides_fastest_repeat_and_eager_over_compiled():
    bench = _bench()
    runs = {
        "cold": 31.0,
        "eager": [_run("e", 0.30, 2.00), _run("e", 0.10, 2.00), _run("e", 0.20, 2.00)],
        "compiled": [_run("c", 0.05, 2.01, 4.0, 1), _run("c", 0.40, 1.97, 6.0, 1, 1), _run("c", 0.08, 2.00, 5.0, 1)],
    }
    r = bench.row("tp", runs)
    assert r["eager_ms"] == pytest.approx(100.0) and r["compiled_ms"] == pytest.approx(50.0)  # other work only adds time
    assert r["speedup"] == pytest.approx(2.0)  # eager / compiled: > 1 is faster compiled
    assert r["pairs"] == pytest.approx([2.5, 0.25, 6.0])  # 0.30 / 0.05, 0.10 / 0.40, 0.20 / 0.08: median, least, most
    assert r["compile_s"] == pytest.approx(5.0) and r["cold_compile_s"] == 31.0
    assert r["recompiles"] == 1 and r["recompile_reasons"] == ["x changed"]
    assert r["loss_diff"] == pytest.approx(0.03)  # the largest pairwise difference, repeat by repeat
    assert r["eager_graphs"] == 0 and r["timed_steps"] == 5
    args = argparse.Namespace(d_model=8, layers=1, block=4, batch=2, warmup=1, steps=3, repeats=3, backend="inductor")
    off = bench.row("tp-nocount", {**runs, "eager": [_run("e", 0.08, 2.0)] * 3, "compiled": [_run("c", 0.05, 2.0, 4.0, 1)] * 3})
    text = bench.table([r, off], args)
    assert "| tp | 2 | 100.0 | 50.0 | 2.00x | 2.50x (0.25-6.00) | 31.0 | 5.0 | 1 | 1 | 3.0e-02 |" in text
    assert "(tp / tp-nocount): eager 1.250x, compiled 1.000x" in text
    assert "- tp: x changed" in text


def test_the_timer_leaves_the_warm_up_steps_out(monkeypatch):
    bench = _bench()
    clock = iter([0.0, 10.0, 20.0, 20.5, 21.0, 21.25])  # steps 1-2 slow (compiling), then 0.5, 0.5, 0.25 s
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    timer = bench.StepTimer(warmup=2)
    timer.on_fit_start(None, None)
    for step in range(1, 6):
        timer.on_train_step_end(None, None, step, None)
    assert timer.times == [0.5, 0.5, 0.25]


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_eager_and_compiled_alternate_and_inductor_first_compiles_cold(monkeypatch, backend):
    bench = _bench()
    calls: list[tuple[str, bool, int | None]] = []

    def fake_fit(name, compiled, args, steps=None):
        calls.append((name, compiled, steps))
        return {"compile_s": 9.0}

    monkeypatch.setattr(bench, "fit", fake_fit)
    out = bench.measure(["a", "b"], argparse.Namespace(repeats=2, backend=backend))
    cold = [("a", True, 2), ("b", True, 2)] if backend == "inductor" else []
    assert calls == [
        *cold,
        ("a", False, None),
        ("a", True, None),
        ("b", False, None),
        ("b", True, None),
        ("a", True, None),
        ("a", False, None),
        ("b", True, None),
        ("b", False, None),
    ]
    assert out["a"]["cold"] == (9.0 if backend == "inductor" else None) and len(out["a"]["eager"]) == len(out["a"]["compiled"]) == 2


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--strategies", "single,tpp"], "--strategies takes rows among single, ddp, zero3, tp, tp-nocount, pipeline; got 'single,tpp'"),
        (["--steps", "5", "--warmup", "4"], "--steps 5 leaves no timed step after --warmup 4; take --steps of at least 6"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        _bench().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_readme_block_is_the_one_run_here():
    from tests.readme.test_readme import RUN_ELSEWHERE, blocks

    assert RUN_ELSEWHERE[README_COMMAND].endswith(os.path.basename(__file__))
    (code,) = [code for _, code in blocks("bash") if README_COMMAND in code]
    assert code.replace("\\\n", " ").split() == BLOCK.split()


@pytest.mark.dist
@pytest.mark.timeout(120)
def test_the_readme_block_runs_compiled_and_eager_side_by_side():
    from tests.readme.test_readme import env

    proc = subprocess.run(["bash", "-e", "-c", BLOCK], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    rows = {cells[1].strip(): [c.strip() for c in cells[2:-1]] for line in lines if line.startswith("| ") and (cells := line.split("|"))}
    assert list(rows) == ["strategy", "single", "tp", "tp-nocount", "pipeline"], proc.stdout
    for name in ("single", "tp", "tp-nocount", "pipeline"):
        procs, eager, comp, speedup, pairs, cold, compile_s, graphs, recompiles, loss_diff = rows[name]
        assert procs == ("1" if name == "single" else "2")
        assert float(eager) > 0 and float(comp) > 0
        # the ms cells are rounded to 0.1 and the speed-up to 0.01: the speed-up lies within what the rounded cells allow
        e, c, x = float(eager), float(comp), float(speedup[:-1])
        assert (e - 0.05) / (c + 0.05) - 0.005 <= x <= (e + 0.05) / max(c - 0.05, 1e-9) + 0.005, (eager, comp, speedup)
        assert pairs == f"{speedup} ({speedup[:-1]}-{speedup[:-1]})"  # one repeat: one pair
        assert cold == "-"  # aot_eager generates no code: no cache to warm
        assert float(compile_s) > 0 and int(graphs) >= 1 and recompiles == "0"  # the compiled runs compiled, once
        assert float(loss_diff) < 1e-4  # the same model, seed and batches; aot_eager runs the same kernels
    assert any(line.startswith("collective counter's cost under tp (tp / tp-nocount): eager ") for line in lines), proc.stdout
    assert "backend aot_eager" in lines[0] and "fastest of 1 interleaved repeats" in lines[0]
