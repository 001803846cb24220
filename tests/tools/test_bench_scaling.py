"""``shardwise bench scaling``: measured speed-up and efficiency per process count, beside the planner's.

One real run, the README's block (digits, ddp at 1 and 2 processes, 30 steps each, two ``shardwise train``
runs), checks the ``--json`` rows (the fields, speed-up = samples/s over the one-process run's, efficiency =
speed-up / N, the predicted figures present, positive and related alike), the printed table and the png. Bad input
stops before anything is built or launched; the warm-up filter, the speed-up arithmetic and the baseline of
a strategy that cannot run on one process are checked on made-up numbers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shardwise.errors import ConfigError
from shardwise.tools.bench import main as bench_main
from shardwise.tools.bench import scaling
from shardwise.tools.bench.scaling import REFERENCE, Config, baselines, parse_nproc, speedups, steady_samples_per_s, verdicts


@pytest.fixture
def nothing_runs(monkeypatch):
    """Fail the test if a model is built, timed or launched."""

    def boom(*a, **k):
        raise AssertionError("bench scaling built or launched something before refusing its input")

    monkeypatch.setattr(scaling, "setup", boom)
    monkeypatch.setattr(scaling, "run_one", boom)
    monkeypatch.setattr(subprocess, "run", boom)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--recipe", "digits", "--nproc", "0"], r"--nproc takes whole numbers >= 1 .*got '0'"),
        (["--recipe", "digits", "--nproc", "1,two"], r"got 'two'"),
        (["--recipe", "digits", "--strategy", "ddp,zer01"], r"unknown strategy 'zer01'\. Did you mean 'zero1'"),
        (["--recipe", "digitz"], r"unknown recipe 'digitz'; the recipes are .*digits"),
        ([], r"--recipe NAME .* or your own --model"),
        (["--model", "m:make"], r"--model m:make needs --data"),
        (["--recipe", "digits", "--max-steps", "20"], r"--max-steps 20 leaves fewer than 2 logged intervals"),
        (["--recipe", "digits", "--threads", "0"], r"--threads must be >= 1 .*got 0"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(nothing_runs, argv, message):
    with pytest.raises(ConfigError, match=message):
        bench_main(["scaling", *argv])


def test_a_used_out_directory_is_refused_before_anything_runs(nothing_runs, tmp_path):
    (tmp_path / "ddp-1proc").mkdir()
    with pytest.raises(ConfigError, match=r"--out .* is not empty"):
        bench_main(["scaling", "--recipe", "digits", "--out", str(tmp_path)])


def test_the_command_prints_one_line_for_a_user_mistake():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    proc = subprocess.run(
        [sys.executable, "-m", "shardwise", "bench", "scaling", "--recipe", "digits", "--nproc", "0"], capture_output=True, text=True, timeout=120, env=env
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == ["shardwise: error: --nproc takes whole numbers >= 1 (e.g. --nproc 1,2,4); got '0'"]


def test_the_png_without_matplotlib_is_one_line_naming_the_extra(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rows = [{"strategy": "ddp", "nproc": 1, "speedup": 1.0, "efficiency": 1.0}]
    with pytest.raises(ConfigError, match=r"^bench scaling --png needs matplotlib: pip install 'shardwise\[plot\]'"):
        scaling.write_png(rows, str(tmp_path / "x.png"), "t")
    assert not (tmp_path / "x.png").exists()


def test_each_run_gets_threads_given_else_omp_num_threads_else_its_own(monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert scaling.run_threads("ddp", 2, 3) == 3 and scaling.run_threads("single", 1, 3) == 3
    assert scaling.run_threads("ddp", 2) == max(1, cores // 2) and scaling.run_threads("single", 1) == torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the user's count, as shardwise train takes it
    assert scaling.run_threads("ddp", 1) == 1 and scaling.run_threads("ddp", 1, 2) == 2


def test_nproc_is_sorted_and_always_has_one():
    assert parse_nproc(["4,2", "2"]) == [1, 2, 4]


def test_steady_state_leaves_the_warm_up_out_and_takes_the_median_step():
    metrics = [
        {"step": 5, "samples_per_s": 100.0},  # warm-up: left out
        {"step": 10, "samples_per_s": 200.0},  # warm-up: left out
        {"step": 15, "samples_per_s": 1000.0},
        {"step": 20, "samples_per_s": 4000.0},
        {"step": 20, "val_loss": 0.5},  # a validation line has no rate
        {"step": 25, "samples_per_s": 2000.0},
    ]
    sps, intervals = steady_samples_per_s(metrics, global_batch=64, warmup=10)
    assert intervals == 3
    assert sps == pytest.approx(2000.0)  # the median step, 64 / 2000 s
    with pytest.raises(ConfigError, match="no training interval after step 30"):
        steady_samples_per_s(metrics, 64, warmup=30)


def test_speedup_and_efficiency_are_against_the_baseline_run():
    rows = [
        {"strategy": "single", "nproc": 1, "baseline": "single", "samples_per_s": 300.0, "predicted_samples_per_s": 250.0},
        {"strategy": "ddp", "nproc": 1, "baseline": "ddp", "samples_per_s": 100.0, "predicted_samples_per_s": 90.0},
        {"strategy": "ddp", "nproc": 4, "baseline": "ddp", "samples_per_s": 300.0, "predicted_samples_per_s": 180.0},
        {"strategy": "ps", "nproc": 2, "baseline": "single", "samples_per_s": 150.0, "predicted_samples_per_s": 500.0},
        {"strategy": "ps", "nproc": 4, "baseline": "single", "samples_per_s": None, "error": "boom", "predicted_samples_per_s": 1000.0},
    ]
    speedups(rows)
    assert rows[2]["speedup"] == pytest.approx(3.0) and rows[2]["efficiency"] == pytest.approx(0.75)
    assert rows[2]["predicted_speedup"] == pytest.approx(2.0) and rows[2]["predicted_efficiency"] == pytest.approx(0.5)
    assert rows[3]["speedup"] == pytest.approx(0.5) and rows[3]["efficiency"] == pytest.approx(0.25)  # against single's 300
    assert rows[4]["speedup"] is None and rows[4]["predicted_speedup"] == pytest.approx(4.0)
    # against the fastest one-process run of any strategy: single's 300 (predicted: single's 250)
    assert [r["speedup_vs_best_one"] for r in rows] == [pytest.approx(1.0), pytest.approx(1 / 3), pytest.approx(1.0), pytest.approx(0.5), None]
    assert rows[2]["predicted_speedup_vs_best_one"] == pytest.approx(180 / 250)
    assert {r["best_one"] for r in rows} == {"single"}
    table = scaling.format_table([{**r, "step_s": None, "predicted_step_s": 0.01} for r in rows])
    assert "failed: boom" in table and "(vs single)" in table


def _rows(single: float, ddp1: float, ddp2: float, predicted: tuple[float, float, float] = (100.0, 90.0, 50.0)) -> list[dict]:
    rows = [
        {"strategy": "single", "nproc": 1, "baseline": "single", "samples_per_s": single, "predicted_samples_per_s": predicted[0]},
        {"strategy": "ddp", "nproc": 1, "baseline": "ddp", "samples_per_s": ddp1, "predicted_samples_per_s": predicted[1]},
        {"strategy": "ddp", "nproc": 2, "baseline": "ddp", "samples_per_s": ddp2, "predicted_samples_per_s": predicted[2]},
    ]
    speedups(rows)
    return rows


def test_the_verdict_says_one_process_wins_against_the_fastest_one_process_run():
    # the user's run with OMP_NUM_THREADS=1: ddp x2 is 9.47x ddp x1 but 0.30x of single
    rows = _rows(20_394.0, 641.0, 6_074.0)
    assert rows[2]["speedup"] == pytest.approx(6_074 / 641) and rows[2]["speedup_vs_best_one"] == pytest.approx(6_074 / 20_394)
    lines = verdicts(rows)
    assert lines[0].startswith("one process is fastest: single on 1 process at 20,394 samples/s; the fastest on more processes, ddp on 2, reaches 0.30x of it")
    assert "  ddp on 2 reaches 0.30x of single's one-process run; 9.48x its own one-process run (ddp), 474% efficiency" in lines
    assert any("above 100%" in line for line in lines)
    assert lines[-1] == "the planner predicts one process fastest (single on 1; ddp on 2 at 0.50x of it)"
    assert not any("fastest on 2" in line for line in lines)


def test_the_verdict_names_a_faster_layout_against_the_fastest_one_process_run():
    rows = _rows(727.0, 667.0, 13_988.0, predicted=(100.0, 90.0, 150.0))
    lines = verdicts(rows)
    assert lines[0] == "fastest: ddp on 2 processes at 13,988 samples/s, 19.24x the fastest one-process run (single on 1 process at 727 samples/s)"
    assert lines[-1] == "the planner predicts ddp on 2 fastest, 1.50x its fastest one-process run (single)"
    table = scaling.format_table([{**r, "step_s": 0.001, "predicted_step_s": 0.01} for r in rows])
    assert "vs best1" in table.splitlines()[1] and "19.24x" in table.splitlines()[-1]


def test_a_model_factory_without_an_example_takes_the_first_sample_of_its_data(tmp_path, monkeypatch):
    from shardwise.tools.advisor.models import load_model

    (tmp_path / "benchmods.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make_model():\n    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))\n"
        "def make_data():\n    x = torch.randn(64, 8)\n    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())\n"
        "def make_loader():\n    return torch.utils.data.DataLoader(make_data(), batch_size=4)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for data in ("benchmods:make_data", "benchmods:make_loader"):
        planned = load_model("benchmods:make_model", data=data)
        assert planned.example.shape == (1, 8) and planned.trainable
        assert planned.spec.params == 8 * 32 + 32 + 32 * 2 + 2
    with pytest.raises(ConfigError, match=r"returned the module alone: .*return \(model, example_input\).*or pass --data MODULE:FACTORY"):
        load_model("benchmods:make_model")


def test_a_strategy_that_cannot_run_alone_is_measured_against_single():
    from shardwise.tools.recipes import get_recipe

    class Planned:
        module = get_recipe("digits").parts().model

    configs, skipped = baselines(["ddp", "ps"], [1, 2], 64, weak=False, planned=Planned())
    assert configs == [
        (Config(REFERENCE, 1, 64), REFERENCE),
        (Config("ddp", 1, 64), "ddp"),
        (Config("ddp", 2, 64), "ddp"),
        (Config("ps", 2, 64), REFERENCE),
    ]
    assert len(skipped) == 1 and skipped[0].startswith("ps on 1 process: ")
    weak, _ = baselines(["ddp"], [1, 2], 64, weak=True, planned=Planned())
    assert [c.global_batch for c, _ in weak] == [64, 128]


README_COMMAND = "shardwise bench scaling --recipe digits "


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_digits_ddp_on_one_and_two_processes(tmp_path):
    """The README's block (digits, ddp at 1 and 2 processes, 30 steps), run as written here only (test_readme_shell
    leaves it to this file: RUN_ELSEWHERE), its ``--json`` rows and printed table checked, and the ``--png`` drawn
    from those rows."""
    from tests.readme.test_readme import RUN_ELSEWHERE, blocks, env

    assert RUN_ELSEWHERE[README_COMMAND].endswith(os.path.basename(__file__))
    (code,) = [code for _, code in blocks("bash") if README_COMMAND in code]
    assert code.split() == [*README_COMMAND.split(), *"--strategy ddp --nproc 1,2 --max-steps 30 --warmup 10 --json scaling.json".split()]
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "scaling.json").read_text())
    assert [(r["strategy"], r["nproc"]) for r in rows] == [("ddp", 1), ("ddp", 2)]
    one, two = rows
    for r in rows:
        for key in ("samples_per_s", "step_s", "predicted_step_s", "predicted_samples_per_s", "predicted_speedup", "wall_s"):
            assert r[key] > 0, (key, r)
        assert r["samples_per_s"] * r["step_s"] == pytest.approx(64)
        assert r["predicted_samples_per_s"] * r["predicted_step_s"] == pytest.approx(64)
        assert r["efficiency"] == pytest.approx(r["speedup"] / r["nproc"])
        assert r["predicted_efficiency"] == pytest.approx(r["predicted_speedup"] / r["nproc"])
    assert [r["threads"] for r in rows] == [scaling.run_threads("ddp", 1), scaling.run_threads("ddp", 2)]  # as summary.json recorded them
    assert one["speedup_vs_best_one"] == 1.0 and two["speedup_vs_best_one"] == pytest.approx(two["speedup"])  # ddp x1 is the only one-process run
    assert one["speedup"] == 1.0 and one["predicted_speedup"] == 1.0
    assert two["speedup"] == pytest.approx(two["samples_per_s"] / one["samples_per_s"])
    assert two["predicted_speedup"] == pytest.approx(two["predicted_samples_per_s"] / one["predicted_samples_per_s"])
    assert two["predicted_step_s"] != one["predicted_step_s"]  # the planner costed each layout, not one number twice
    printed = proc.stdout
    assert "speed-up" in printed and "predicted by the planner" in printed and f"{two['samples_per_s']:,.0f}" in printed
    png = tmp_path / "scaling.png"
    scaling.write_png(rows, str(png), "digits: strong scaling")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
