"""``shardwise plan --validate`` on one small candidate: the table has predicted and measured columns.

No timing is asserted (a shared CI machine times anything): only that both columns are there,
positive and finite, for ddp on 2 processes on digits, that the model state measured on each
rank's tensors is the predicted one (exact: the same formula on the same parameter count), and
that the tensors per rank (model state and activations) are the predicted ones within 5%.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import sklearn  # noqa: F401  # digits' data package sets KMP_* once per interpreter: before the hygiene fixture's snapshot

from shardwise.cli import main

pytestmark = [pytest.mark.timeout(300)]


@pytest.fixture(autouse=True)
def _short_step_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's step timed once per size for about 0.3 s (3 runs of 1.5 s by default): these tests check what
    --validate runs, reports and predicts in bytes, not how closely the timing predicts a step."""
    from shardwise.tools.advisor import models

    monkeypatch.setattr(models, "TIMED_RUNS", 1)
    monkeypatch.setattr(models, "TIMED_TARGET_S", 0.3)


def test_validate_one_ddp_candidate_on_digits(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "validate.json"
    flags = ["plan", "--validate", "--model", "digits", "--nproc", "2", "--device", "cpu", "--steps", "10"]
    assert main([*flags, "--only", "ddp(allreduce=native);zero2", "--json", str(out)]) == 0
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ddp(allreduce=native)", "zero2"}
    for row in rows.values():
        for key in ("predicted_step_s", "measured_step_s"):
            assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    # zero2 reports its measured model state (fp32 Adam with its master copy: 4 Psi + 16 Psi / 2)
    zero2 = rows["zero2"]
    assert zero2["measured_model_state_bytes"] == pytest.approx(zero2["predicted_model_state_bytes"])
    # every candidate's tensors per rank: model state (ddp's measured on its tensors too) and the
    # activations autograd held, against the planner's model_state + activations (digits at a
    # per-rank batch of 32: the input, two hidden layers' outputs and masks)
    for row in rows.values():
        assert row["measured_model_state_bytes"] == pytest.approx(row["predicted_model_state_bytes"])
        assert row["measured_activation_bytes"] > 0
        assert row["measured_memory_bytes"] == pytest.approx(row["predicted_memory_bytes"], rel=0.05), row
    printed = capsys.readouterr().out
    assert "pred step" in printed
    # the profile is one measured here: the run also re-times the profile's own calibration point
    assert "machine check, round 1: ddp on the 4-layer calibration network" in printed and "its prediction (median of 1)" in printed


def test_a_calibration_point_times_the_trainer_against_the_model_and_counts_the_plan_s_units() -> None:
    from shardwise.strategies.cost.cluster import load_profile
    from shardwise.tools.advisor.calibrate_framework import GLOBAL_BATCH, WIDTH, CalibrationNet, measure_point

    specs: dict[tuple[int, int, int], object] = {}
    point = measure_point("zero3", 2, load_profile("cpu"), specs=specs)
    # zero3's plan wraps the two blocks; the root (embed and head) is the third group the cost counts
    assert point["units"] == 3 and point["size"] == 2 and set(specs) == {(2, WIDTH, GLOBAL_BATCH, 1)}  # timed with 1 thread, as each of 2 ranks runs
    assert math.isfinite(point["measured_s"]) and point["measured_s"] > 0 and point["predicted_without_s"] > 0
    assert point["compute_s"] > 0 and point["extra_s"] == pytest.approx(point["measured_s"] - point["predicted_without_s"])
    assert point["params"] == sum(p.numel() for p in CalibrationNet(2).parameters())  # zero3's rank: the whole model before sharding


def test_the_machine_check_sets_a_calibration_point_timed_now_against_the_profile_s_whole_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    import shardwise.tools.advisor.calibrate_framework as cf
    from shardwise.strategies.cost.cluster import Framework, load_profile
    from shardwise.tools.advisor.calibrate_framework import machine_check

    timed: dict[tuple[int, ...], object] = {}
    spec = cf._spec
    monkeypatch.setattr(cf, "_spec", lambda depth, width, batch, specs, threads=1: spec(depth, width, batch, timed, threads))  # timed once
    cpu = load_profile("cpu")
    check = machine_check(cpu)
    assert len(timed) == 1 and check["ratio"] == pytest.approx(check["measured_s"] / check["predicted_s"])
    # a profile that says ddp costs a second a step more predicts a second more, and the ratio says so (the network's
    # step and the run as the first check timed them: only the profile differs)
    monkeypatch.setattr(cf, "_measure", lambda *a, **kw: check["measured_s"])
    slow = machine_check(replace(cpu, framework={**cpu.framework, "ddp": Framework(1.0)}))
    assert slow["predicted_s"] > 1.0 and slow["ratio"] < 0.1


def tiny_llama() -> tuple[object, object]:
    """A ``module:factory`` for ``--model``: a 2-layer Llama (RMSNorm, rotary, grouped kv heads, SwiGLU) and its example input."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16
    )
    return transformers.LlamaForCausalLM(config), torch.randint(0, 64, (4, 16))


def test_validate_trains_a_factory_s_llama_under_tp_and_its_activations_are_the_predicted_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A user's own model (``module:factory``) is validated as a recipe is. Under tp each rank keeps
    whole what tp does not split (RMSNorm's work, the residual stream, the split linears' inputs:
    a quarter of a Llama layer's saved bytes), so splitting all of it by tp would predict 15-20% too
    little; the planner's prediction is the measured peak, and its model state the measured one."""
    import shardwise.tools.advisor.calibrate_framework as cf
    from shardwise.tools.advisor.models import factory_model

    # bytes are checked here, not times: no machine check (the digits test runs one)
    monkeypatch.setattr(cf, "machine_check", lambda profile: {"predicted_s": 1e-3, "measured_s": 1e-3, "ratio": 1.0})
    out = tmp_path / "validate.json"
    model = "tests.tools.advisor.test_validate:tiny_llama"
    flags = ["plan", "--validate", "--model", model, "--nproc", "2", "--global-batch", "8", "--steps", "10", "--only", "tp(tp=2)"]
    assert main([*flags, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["measured_activation_bytes"] == pytest.approx(row["predicted_activation_bytes"], rel=0.01), row
    # the model state too: the embeddings, the head and the norms are whole on both ranks
    assert row["measured_model_state_bytes"] == pytest.approx(row["predicted_model_state_bytes"], rel=1e-6), row
    spec = factory_model(model).spec
    all_split = (spec.layers * spec.act_bytes_per_layer_sample / 2 + spec.act_bytes_other_sample) * 8
    assert row["measured_activation_bytes"] > 1.1 * all_split


def test_a_round_every_h_steps_is_measured_over_whole_rounds_not_5_step_intervals() -> None:
    from shardwise.tools.advisor.validate import LOG_EVERY, log_every_for, measured_step_s, steps_for

    assert [log_every_for(p) for p in (1, 2, 3, 5, 8, 32)] == [5, 6, 6, 5, 8, 32]
    assert log_every_for(32, steps=100) == LOG_EVERY and log_every_for(32, steps=128) == 32  # too short for 3 whole intervals
    assert steps_for(1e-3) == 200 and steps_for(1e-3, None, 32) == 320 and steps_for(0.5, None, 8) == 32 and steps_for(1e-3, 50, 32) == 50

    # a 1 ms step with a 10 ms round every 32 steps: 5-step intervals' median leaves the round out
    def logged(every: int, steps: int = 320, batch: int = 64) -> list[dict[str, float]]:
        rows, clock, last = [], 0.0, 0
        for step in range(1, steps + 1):
            clock += 1e-3 + (10e-3 if step % 32 == 0 else 0.0)
            if step % every == 0:
                rows.append({"samples_per_s": every * batch / (clock - last)})
                last = clock
        return rows

    assert measured_step_s(logged(5), 64) == pytest.approx(1e-3)
    assert measured_step_s(logged(32), 64) == pytest.approx(1e-3 + 10e-3 / 32)


def test_a_candidate_whose_rank_dies_is_reported_and_the_others_still_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shardwise.tools.advisor.calibrate_framework as cf
    import shardwise.tools.advisor.validate as validate
    from shardwise.errors import LaunchError

    calls: list[str] = []

    def run_candidate(record: dict, model: object, settings: object, steps: object, out: Path) -> dict:
        calls.append(record["label"])
        if record["label"] == "zero2" or (record["label"] == "zero1" and calls.count("zero1") == 2):
            raise LaunchError("rank 1 died with exit code -11 before reporting a result (killed, out of memory, or a crash in native code)")
        return {"step_s": 4e-3, "model_state_bytes": 1.0, "activation_bytes": 1.0, "memory_bytes": 2.0}

    monkeypatch.setattr(validate, "run_candidate", run_candidate)
    monkeypatch.setattr(cf, "machine_check", lambda profile: {"predicted_s": 1e-3, "measured_s": 1e-3, "ratio": 1.0})
    out = tmp_path / "validate.json"
    flags = ["plan", "--validate", "--model", "digits", "--nproc", "2", "--repeats", "2", "--only", "zero1;zero2;ddp(allreduce=tree)"]
    assert main([*flags, "--json", str(out)]) == 1  # the table, then a failure exit
    rows = {r["label"]: r for r in json.loads(out.read_text())}
    assert calls == ["ddp(allreduce=tree)", "zero1", "zero2"] * 2  # every candidate in every round, after a failure too
    assert rows["zero2"]["measured_step_s"] is None and rows["zero2"]["step_rel_error"] is None and "exit code -11" in rows["zero2"]["error"]
    assert rows["zero1"]["measured_step_s"] == 4e-3 and "error" not in rows["zero1"]  # its other run counts
    printed = capsys.readouterr().out
    assert "zero1                                        run 2: failed: rank 1 died" in printed
    assert "over 2 candidates" in printed and "zero2 failed in every run: rank 1 died with exit code -11" in printed


def test_with_repeats_the_model_s_step_is_timed_each_round_and_the_rows_predict_from_the_median(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shardwise.tools.advisor.calibrate_framework as cf
    import shardwise.tools.advisor.validate as validate
    from shardwise.strategies.cost.model_spec import StepFit

    timings = iter([StepFit(0.5, 0.0, (4, 64)), StepFit(0.7, 1e-3, (4, 64))])  # rounds 2 and 3; round 1's is the planner's own (ms)
    monkeypatch.setattr(validate, "retimed", lambda model, sizes: next(timings))
    monkeypatch.setattr(validate, "run_candidate", lambda record, *a: {"step_s": 0.6, "model_state_bytes": 1.0, "activation_bytes": 1.0, "memory_bytes": 2.0})
    monkeypatch.setattr(cf, "machine_check", lambda profile: {"predicted_s": 1e-3, "measured_s": 1e-3, "ratio": 1.0})
    out = tmp_path / "validate.json"
    flags = [
        "plan",
        "--validate",
        "--model",
        "digits",
        "--nproc",
        "2",
        "--repeats",
        "3",
        "--only",
        "local-sgd(sync_every=32)",
        "--load",
        "0",
    ]  # no load stretch
    assert main([*flags, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    # each part's median: fixed 0.5 s (of the planner's ~1 ms, 0.5 s and 0.7 s), per sample the planner's few us (of it, 0 and 1 ms)
    assert 0.5 <= row["predicted_step_s"] < 0.55 and row["measured_step_s"] == 0.6
    printed = capsys.readouterr().out
    assert "model step timed again, round 2: 500.000 ms + 0.00 us a sample" in printed and "round 3: 700.000 ms" in printed
