"""``shardwise plan`` as a user runs it: a subprocess writing ``--json``, read back (ZeRO's table 1)."""

from __future__ import annotations

import json

import pytest

from tests.cli.test_cli import shardwise

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(200)]


def test_plan_json_holds_zero_table_1_and_every_candidates_fields(tmp_path):
    out = tmp_path / "out.json"
    png = tmp_path / "out.png"
    proc = shardwise(
        "plan", "--params", "7.5e9", "--nproc", "64", "--nodes", "8", "--device", "h100-80gb", "--precision", "bf16-mixed",
        "--global-batch", "512", "--seq", "2048", "--json", str(out), "--png", str(png), timeout=180,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recommendation:" in proc.stdout
    doc = json.loads(out.read_text())
    by_label = {r["label"]: r for r in doc["candidates"]}
    # Rajbhandari et al. 2020, table 1 (GB = 1e9 bytes): baseline, P_os, P_os+g, P_os+g+p
    got = [f"{by_label[k]['memory_breakdown']['model_state'] / 1e9:.3g}" for k in ("ddp(allreduce=native)", "zero1", "zero2", "zero3")]
    assert got == ["120", "31.4", "16.6", "1.88"]
    for rec in doc["candidates"]:
        for key in ("strategy", "fits", "memory_per_rank_bytes", "comm_bytes_per_step", "step_time_s"):
            assert key in rec
        assert rec["fits"] or rec["reason"]
    assert png.stat().st_size > 10_000


# -- the rough edges of issue 36: in this process (shardwise.cli.main), a few ms of formulas each -------------
def _plan_text(capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    from shardwise.cli import main

    assert main(["plan", *flags]) == 0
    return capsys.readouterr().out


def test_when_nothing_fits_the_recommendation_says_why_and_what_fits_instead(capsys):
    # 7e9 parameters, 8 H100s, a global batch of 512: every plain candidate's activations exceed 80 GB;
    # with activation checkpointing some fit (proposed), and smaller micro-batches are named beside it.
    text = _plan_text(capsys, "--params", "7e9", "--nproc", "8")
    rec = next(line for line in text.splitlines() if line.startswith("recommendation:"))
    assert rec.startswith("recommendation: pipeline(") and " +ac=blocks  (a data-parallel rank's activations alone" in rec, rec
    assert "fits only with --activation-checkpointing blocks" in text
    assert ". Without activation checkpointing or offload: With --accumulate 16" in rec
    label = rec.split("the fastest ")[1].split(" at ")[0]
    assert "With --accumulate 16 (micro-batches 16x smaller) 10 candidate(s) fit" in rec and "run plan again with --accumulate 16); run it: " in rec
    # ... and the advice holds: planned again as it says, that candidate is the recommendation.
    again = _plan_text(capsys, "--params", "7e9", "--nproc", "8", "--accumulate", "16")
    assert f"recommendation: {label}  (" in again
    # The model state itself too big for any accumulation: more processes or a bigger device.
    rec = _plan_text(capsys, "--params", "7e10", "--nproc", "2").splitlines()[-1]
    assert "its model state alone (560 GB) does not fit" in rec and "Nothing fits at any accumulation either: more processes (--nproc)" in rec


def test_the_refused_count_is_what_is_listed_or_said_to_be_more(capsys):
    for flags in ((), ("--all",)):
        lines = _plan_text(capsys, "--params", "7e9", "--nproc", "8", *flags).splitlines()
        start = next(i for i, line in enumerate(lines) if "candidate(s) do not fit or are refused:" in line)
        count = int(lines[start].split()[0])
        end = next(i for i, line in enumerate(lines) if line.startswith("recommendation:"))  # its detail lines are indented too
        listed = [line for line in lines[start + 1 : end] if line.startswith("  ") and not line.startswith("  ...")]
        more = [int(line.split()[2]) for line in lines[start + 1 : end] if line.startswith("  ... and ")]
        assert count == 50 and len(listed) + sum(more) == count, (flags, len(listed), more)  # ddp and zero3 with cp=2 among them
        assert all("schedule=interleaved,microbatches=8,virtual_stages=2" in line for line in listed if "interleaved,microbatches=8" in line)  # whole labels
        assert bool(more) is not bool(flags)


def test_the_global_batch_hint_names_a_flag_plan_takes(capsys):
    # ps on 8 processes trains on 7: 512 is refused with the strategy's own message, which names
    # --global-batch-size (train's flag): plan takes it too, and the suggested batch is then planned.
    text = _plan_text(capsys, "--params", "1e8", "--nproc", "8", "--seq", "512")
    (reason,) = [line for line in text.splitlines() if line.strip().startswith("ps(servers=1,mode=sync)")]
    assert "(e.g. 511 or 518): global_batch_size= in Python, --global-batch-size on the command line" in reason
    text = _plan_text(capsys, "--params", "1e8", "--nproc", "8", "--seq", "512", "--global-batch-size", "518")
    assert "global batch 518 (accumulate 1)" in text and "is not divisible by world size 7" not in text
