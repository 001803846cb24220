"""``shardwise plot`` on real runs made here (ddp on digits, profiled; a 2-stage pipeline on charlm):
every chart a valid PNG, the curves equal to metrics.jsonl, the traffic equal to the ring formula,
the breakdown the profiler's, the timeline the events the pipeline saved, and what a run lacks said
instead of drawn."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.image
import pytest

from shardwise.tools.plot import plot_runs
from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
DIGITS_PARAMS = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10  # DigitsMLP(hidden=128): 26,122


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("runs")
    ddp, pipe = root / "ddp", root / "pipe"
    digits = ("--recipe", "digits", "--strategy", "ddp", "--nproc", "2", "--max-steps", "12", "--log-every", "3", "--val-every", "6")
    proc = shardwise("train", *digits, "--profile", "--out", str(ddp))
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = shardwise(
        "train",
        "--recipe",
        "charlm",
        "--strategy",
        "pipeline",
        "--pp",
        "2",
        "--nproc",
        "2",
        "--microbatches",
        "4",
        "--max-steps",
        "6",
        "--log-every",
        "2",
        "--out",
        str(pipe),
        "--set",
        "recipe.n_layers=2",
        "--set",
        "recipe.d_model=32",
        "--set",
        "recipe.val_windows=16",
        "--set",
        "recipe.sample_chars=8",
        "--set",
        f"trainer.strategy_options.timeline={pipe / 'timeline.png'}",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"ddp": ddp, "pipe": pipe}


def png_shape(path: str | Path) -> tuple[int, int]:
    assert Path(path).read_bytes()[:8] == PNG_SIGNATURE, path
    return matplotlib.image.imread(str(path)).shape[:2]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_every_chart_is_a_png_and_holds_the_run_s_own_numbers(runs, tmp_path):
    report = plot_runs([str(runs["ddp"]), str(runs["pipe"])], tmp_path / "plots")
    assert sorted(report.files) == ["breakdown-ddp", "comm-ddp", "comm-pipe", "comm_ranks-ddp", "comm_ranks-pipe", "curves", "throughput", "timeline-pipe"]
    for name, path in report.files.items():
        assert Path(path).parent == tmp_path / "plots", name
        height, width = png_shape(path)
        assert height >= 250 and width >= 960, (name, height, width)
    assert png_shape(report.files["curves"]) == (540, 1440)  # two panels (the losses, val accuracy): 12 x 4.5 in at 120 dpi
    assert png_shape(report.files["throughput"]) == (540, 960)
    assert png_shape(report.files["timeline-pipe"]) == (264, 1200)  # the pipeline's own drawing: 10 x (1 + 0.6 pp) in

    # The curves are metrics.jsonl's numbers, step for step.
    for label in ("ddp", "pipe"):
        lines = records(runs[label])
        drawn = report.series["curves"][label]
        for key in ("train_loss", "val_loss"):
            assert drawn[key] == ([r["step"] for r in lines if key in r], [r[key] for r in lines if key in r]), (label, key)
        assert drawn["train_loss"][0] == ([3, 6, 9, 12] if label == "ddp" else [2, 4, 6])
    assert report.series["curves"]["ddp"]["val_accuracy"][0] == [6, 12]

    # Throughput: the logged rates, at the time each log was written since the loop started (within the loop's wall time).
    xs, ys = report.series["throughput"]["ddp"]
    assert ys == [r["samples_per_s"] for r in records(runs["ddp"]) if "samples_per_s" in r]
    assert all(a < b for a, b in zip(xs, xs[1:], strict=False)) and xs[-1] <= json.loads((runs["ddp"] / "summary.json").read_text())["train_s"]

    # Traffic per step: ddp's gradient allreduce moves 2(p-1)/p of the gradient bytes each way, p = 2.
    assert report.series["comm-ddp"]["dp/all_reduce"] == {"sent": 4 * DIGITS_PARAMS, "received": 4 * DIGITS_PARAMS, "calls": 1.0}
    summary = json.loads((runs["pipe"] / "summary.json").read_text())
    sends = summary["comm"]["by_op"]["pp/send"]
    assert report.series["comm-pipe"]["pp/send"]["sent"] == sends["sent_bytes"] / 6
    # Per rank: each rank's own file. ddp's ranks move the same bytes; the pipeline's point-to-point
    # traffic balances across its two stages (what one stage sends, the other receives).
    ddp_ranks = report.series["comm_ranks-ddp"]
    assert sorted(ddp_ranks) == [0, 1]
    assert all(ddp_ranks[r]["dp/all_reduce"] == {"sent": 4 * DIGITS_PARAMS, "received": 4 * DIGITS_PARAMS} for r in (0, 1))
    pipe_ranks = report.series["comm_ranks-pipe"]
    assert sorted(pipe_ranks) == [0, 1] and pipe_ranks[0]["pp/send"]["sent"] == sends["sent_bytes"] / 6
    for a, b in ((0, 1), (1, 0)):
        assert pipe_ranks[a]["pp/send"]["sent"] == pipe_ranks[b]["pp/recv"]["received"] > 0, (a, b)
    assert pipe_ranks[0]["pp/send"]["sent"] != pipe_ranks[1]["pp/send"]["sent"]  # activations forward, gradients back: not a copy of rank 0

    # The timeline is the one the pipeline saved: 4 forwards and 4 backwards on each of 2 stages.
    saved = json.loads((runs["pipe"] / "timeline.png.json").read_text())["events"]
    drawn_events = report.series["timeline-pipe"]
    assert sorted((s, m, k) for s, m, k, _, _ in drawn_events) == sorted((e["stage"], e["microbatch"], e["kind"]) for e in saved)
    assert sorted((s, k) for s, _, k, _, _ in drawn_events) == sorted((s, k) for s in (0, 1) for k in "FB" for _ in range(4))

    # The step breakdown is the profiler's, rank by rank.
    profile = json.loads((runs["ddp"] / "summary.json").read_text())["profile"]
    drawn_parts = report.series["breakdown-ddp"]
    assert drawn_parts.parts == profile["parts"] == ["data", "forward", "backward", "comm_exposed", "optimizer", "idle"]
    assert drawn_parts.per_rank == {r: {p: row[p] for p in profile["parts"]} for r, row in enumerate(profile["per_rank"])}
    assert sorted(drawn_parts.per_rank) == [0, 1]

    # What the runs do not record is said, not drawn as an empty chart.
    said = "\n".join(report.skipped)
    assert "memory-ddp: ddp (ddp) has no memory figures in summary.json" in said
    assert "memory-pipe: pipe (pipeline) has no memory figures" in said
    assert "breakdown-pipe: pipe was not profiled (train with --profile for the step breakdown)" in said


def test_the_command_writes_into_the_run_directory_and_says_what_it_left_out(runs):
    proc = shardwise("plot", str(runs["pipe"]))
    assert proc.returncode == 0, proc.stderr
    out = runs["pipe"] / "plots"
    for name in ("curves", "throughput", "comm", "timeline"):
        assert f"wrote {out / name}.png" in proc.stdout
        png_shape(out / f"{name}.png")
    assert "not drawn: memory: pipe (pipeline) has no memory figures" in proc.stdout


def test_a_directory_without_a_run_is_one_line(tmp_path):
    proc = shardwise("plot", str(tmp_path))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == f"shardwise: error: {tmp_path} holds no metrics.jsonl or summary.json; is it the --out directory of a run?"
