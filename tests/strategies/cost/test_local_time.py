"""Step time on a profile measured here: the model's own timed step and each strategy's per-step cost.

The cost model's arithmetic is checked against hand computations with made-up figures; the
calibration's fit against exact points; the timing helper against the model it must not change.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.cost.cluster import A100_40GB, Cluster, Framework, Link, profile_from_mapping
from shardwise.strategies.cost.estimate import Settings, Shape, estimate, framework_key, framework_keys, local_compute
from shardwise.strategies.cost.families import cost_of
from shardwise.strategies.cost.model_spec import ModelSpec, StepFit
from shardwise.tools.advisor.calibrate_framework import CalibrationNet, fit_framework, point_medians
from shardwise.tools.advisor.models import time_step

FIT = StepFit(fixed_s=2e-3, per_sample_s=1e-4)
SPEC = ModelSpec("m", params=10_000, layers=6, layer_params=1_000, hidden=64, flops_per_sample=1e6, step_fit=FIT)
SLOW = Link(alpha=1e-4, beta=1e-9)
PROFILE = replace(
    A100_40GB,
    name="here",
    local=True,
    intra=SLOW,
    inter=SLOW,
    overlap=0.0,
    framework={"ddp": Framework(1e-3, 2e-4), "pipeline/1f1b": Framework(5e-4, 3e-4), "zero3": Framework(4e-3, 1e-3)},
)


def test_local_compute_keeps_per_operation_time_whole_and_splits_the_per_sample_part() -> None:
    # 4 passes of 8 samples; tp 2 halves only the per-sample part; pp 2 halves the whole (half the layers)
    assert local_compute(FIT, 8, 4, 1, 1) == pytest.approx(4 * (2e-3 + 8e-4))
    assert local_compute(FIT, 8, 4, 2, 1) == pytest.approx(4 * (2e-3 + 4e-4))
    assert local_compute(FIT, 8, 4, 1, 2) == pytest.approx(4 * (2e-3 + 8e-4) / 2)


def test_ddp_step_is_timed_compute_plus_allreduce_plus_its_framework_cost() -> None:
    est = estimate(SPEC, Cluster(PROFILE, 2), Settings(32), Shape("ddp", dp=2))
    t = est.time
    compute = 2e-3 + 1e-4 * 16  # 16 samples per rank, one pass
    assert t["compute_s"] == pytest.approx(compute) and t["optimizer_s"] == 0.0  # the timed step holds the optimizer
    grads = 4 * 10_000
    allreduce = 2 * SLOW.alpha + grads * SLOW.beta  # ring over 2: 2 rounds, (2(p-1)/p) N = N bytes sent
    assert t["exposed_comm_s"] == pytest.approx(allreduce)
    assert t["overhead_s"] == pytest.approx(1e-3 + 2e-4 * 12)  # per parameter tensor: 6 layers' weights and biases
    assert t["step_s"] == pytest.approx(compute + allreduce + 1e-3 + 2e-4 * 12)


def test_a_framework_cost_per_second_of_compute_scales_with_the_rank_s_compute() -> None:
    slowed = replace(PROFILE, framework={"ddp": Framework(1e-3, 0.0, 0.5)})
    t = estimate(SPEC, Cluster(slowed, 2), Settings(32), Shape("ddp", dp=2)).time
    compute = 2e-3 + 1e-4 * 16
    assert t["overhead_compute_s"] == pytest.approx(compute) and t["overhead_s"] == pytest.approx(1e-3 + 0.5 * compute)
    back = profile_from_mapping({**slowed.to_json(), "intra": {"alpha": 1e-4, "beta": 1e-9}, "inter": {"alpha": 1e-4, "beta": 1e-9}})
    assert back.framework["ddp"] == Framework(1e-3, 0.0, 0.5)  # written and read back


def test_pipeline_framework_cost_scales_with_micro_batches_and_compute_with_the_bubble() -> None:
    shape = Shape("pipeline", pp=2, microbatches=4, schedule="1f1b")
    t = estimate(SPEC, Cluster(PROFILE, 2), Settings(32), shape).time
    per_stage = 4 * (2e-3 + 1e-4 * 8) / 2  # 4 micro-batches of 8 samples, half the layers per stage
    assert t["compute_s"] == pytest.approx(per_stage)
    assert t["bubble_s"] == pytest.approx(per_stage * (1 / 4))  # (p-1)/m of the compute: bubble (p-1)/(m+p-1)
    assert t["overhead_s"] == pytest.approx(5e-4 + 3e-4 * 4)


class _Stack(nn.Module):
    """Three Linear layers in a Sequential under ``net`` (digits' shape): FSDP's auto wrap makes the
    two large ones units and leaves the small head in the root."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 4))


def test_fsdp_framework_cost_counts_the_groups_its_plan_wraps_root_included() -> None:
    from shardwise.tools.advisor.candidates import Candidate, evaluate

    # without a module: the model's layers and the root
    t = estimate(SPEC, Cluster(PROFILE, 2), Settings(32), Shape("zero3", dp=2)).time
    assert t["overhead_units"] == 7 and t["overhead_s"] == pytest.approx(4e-3 + 1e-3 * 7)
    # with one: zero3's own plan says which units it wraps, and the cost counts those and the root
    model = _Stack()
    spec = replace(SPEC, layers=3)
    rec = evaluate(Candidate("zero3"), spec, Cluster(PROFILE, 2), Settings(32), model)
    assert rec["time_breakdown"]["overhead_units"] == 3  # net.0, net.2 and the root (net.4 stays in it)
    assert rec["time_breakdown"]["overhead_s"] == pytest.approx(4e-3 + 1e-3 * 3)
    wrapped = evaluate(Candidate("zero3", {"wrap": "root"}), spec, Cluster(PROFILE, 2), Settings(32), model)
    assert wrapped["time_breakdown"]["overhead_units"] == 1
    # ddp's cost is per parameter tensor, whatever FSDP would wrap
    spec = replace(spec, tensors=6)
    assert evaluate(Candidate("ddp"), spec, Cluster(PROFILE, 2), Settings(32), model)["time_breakdown"]["overhead_units"] == 6


def test_tp_cost_counts_the_linears_its_plan_splits_with_one_allreduce_each() -> None:
    from shardwise.tools.advisor.candidates import Candidate, evaluate

    net = CalibrationNet(3)  # 3 blocks of fc1 (column-wise) and fc2 (row-wise): 6 split linears
    spec = replace(SPEC, layers=3, transformer=False)
    rec = evaluate(Candidate("tp", {"tp": 2}), spec, Cluster(PROFILE, 2), Settings(32), net)
    assert rec["fits"], rec["reason"]
    assert rec["time_breakdown"]["overhead_units"] == 6
    (tp_ar,) = [c for c in rec["comm_breakdown"] if c["group"] == "tp"]
    assert tp_ar["count"] == 6  # fc2's output in forward, fc1's input gradient in backward, per block
    # without the module: Megatron's 4 a layer (2 forward, 2 backward), and 2 split linears a layer
    bare = estimate(spec, Cluster(PROFILE, 2), Settings(32), Shape("tp", tp=2))
    assert [c.count for c in bare.collectives if c.group == "tp"] == [12] and bare.time["overhead_units"] == 6


def test_without_a_local_profile_the_flop_model_and_fixed_overhead_stay() -> None:
    remote = replace(PROFILE, local=False, framework={})
    t = estimate(SPEC, Cluster(remote, 2), Settings(32), Shape("ddp", dp=2)).time
    assert t["compute_s"] == pytest.approx(1e6 * 16 / (remote.flops_for("32") * remote.efficiency))
    assert t["overhead_s"] == remote.step_overhead_s and t["optimizer_s"] > 0


def test_framework_keys_name_the_variant_and_fall_back_to_the_family() -> None:
    assert framework_key(Shape("pipeline", schedule="gpipe")) == "pipeline/gpipe"
    assert framework_key(Shape("ps", mode="async")) == "ps/async"
    assert framework_key(Shape("ddp", codec="int8")) == "ddp/codec/int8"
    assert framework_key(Shape("ddp", codec="topk:0.01")) == "ddp/codec/topk"
    assert framework_keys(Shape("ddp", codec="topk:0.01")) == ["ddp/codec/topk", "ddp/codec", "ddp"]
    assert framework_key(Shape("ddp", algorithm="ring")) == "ddp/algorithm/ring"
    assert framework_keys(Shape("ddp", algorithm="tree")) == ["ddp/algorithm/tree", "ddp/algorithm", "ddp"]
    assert framework_keys(Shape("ddp")) == ["ddp"]
    # no algorithm entry in PROFILE: the family's entry is used
    t = estimate(SPEC, Cluster(PROFILE, 2), Settings(32), Shape("ddp", dp=2, algorithm="ring")).time
    assert t["overhead_s"] == pytest.approx(1e-3 + 2e-4 * 12)
    # an algorithm with an entry of its own uses it; another falls back to ddp/algorithm (older profiles)
    algs = replace(PROFILE, framework={**PROFILE.framework, "ddp/algorithm": Framework(5e-3), "ddp/algorithm/ring": Framework(7e-3)})
    for algorithm, overhead in (("ring", 7e-3), ("tree", 5e-3)):
        t = estimate(SPEC, Cluster(algs, 2), Settings(32), Shape("ddp", dp=2, algorithm=algorithm)).time
        assert t["overhead_s"] == pytest.approx(overhead)
    # a codec with an entry of its own uses it; another codec falls back to ddp/codec, then to ddp
    codecs = replace(PROFILE, framework={**PROFILE.framework, "ddp/codec": Framework(5e-3), "ddp/codec/sign": Framework(2e-3)})
    for codec, overhead in (("sign", 2e-3), ("topk:0.01", 5e-3)):
        t = estimate(SPEC, Cluster(codecs, 2), Settings(32), Shape("ddp", dp=2, codec=codec)).time
        assert t["overhead_s"] == pytest.approx(overhead)
    t = estimate(SPEC, Cluster(PROFILE, 2), Settings(32), Shape("ddp", dp=2, codec="fp16")).time
    assert t["overhead_s"] == pytest.approx(1e-3 + 2e-4 * 12)


def test_a_framework_cost_per_parameter_scales_with_the_rank_s_share_of_the_model() -> None:
    per_param = replace(PROFILE, framework={"ddp": Framework(1e-3, 0.0, 0.0, 2e-8), "tp": Framework(1e-3, 0.0, 0.0, 2e-8)})
    t = estimate(SPEC, Cluster(per_param, 2), Settings(32), Shape("ddp", dp=2)).time
    assert t["overhead_params"] == SPEC.params and t["overhead_s"] == pytest.approx(1e-3 + 2e-8 * SPEC.params)
    # tp's rank holds half the model (the spec knows no split linears: all of it splits)
    t = estimate(SPEC, Cluster(per_param, 2), Settings(32), Shape("tp", tp=2)).time
    assert t["overhead_params"] == SPEC.params / 2 and t["overhead_s"] == pytest.approx(1e-3 + 2e-8 * SPEC.params / 2)
    back = profile_from_mapping({**per_param.to_json(), "intra": {"alpha": 1e-4, "beta": 1e-9}, "inter": {"alpha": 1e-4, "beta": 1e-9}})
    assert back.framework["ddp"] == Framework(1e-3, 0.0, 0.0, 2e-8)  # written and read back


def test_the_fit_s_third_term_is_per_parameter_for_work_on_gradients_and_per_compute_for_work_beside_the_compute() -> None:
    from shardwise.tools.advisor.calibrate_framework import scaling

    assert [scaling(k) for k in ("ddp", "ddp/codec/fp16", "zero1", "ps/async", "diloco")] == ["per_param_s"] * 5
    assert [scaling(k) for k in ("tp", "pipeline/1f1b", "zero3", "fsdp")] == ["per_compute"] * 4

    # extra = 1 ms + 0.5 ms a tensor + 20 ns a parameter: the deep points move both, the wide one parameters alone
    def extra(u: float, n: float) -> float:
        return 1e-3 + 0.5e-3 * u + 2e-8 * n

    pts = [{"units": u, "params": n, "compute_s": n * 1e-8, "extra_s": extra(u, n)} for u, n in ((8, 3e4), (20, 1.4e5), (36, 2.7e5), (12, 1.1e6))]
    f = fit_framework(pts, "per_param_s")
    assert (f["step_s"], f["per_unit_s"], f["per_param_s"], f["per_compute"]) == pytest.approx((1e-3, 0.5e-3, 2e-8, 0.0)) and not f["notes"]
    assert Framework(f["step_s"], f["per_unit_s"], f["per_compute"], f["per_param_s"]).seconds(69, 0.09, 8.3e5) == pytest.approx(extra(69, 8.3e5))
    assert fit_framework(pts)["per_param_s"] == 0.0  # per second of compute unless asked


def test_the_framework_fit_is_the_least_squares_line_and_says_what_it_clamped() -> None:
    pts = [{"units": 2, "extra_s": 3e-3}, {"units": 8, "extra_s": 9e-3}]
    f = fit_framework(pts)
    assert f["per_unit_s"] == pytest.approx(1e-3) and f["step_s"] == pytest.approx(1e-3) and not f["notes"]
    assert f["max_residual_s"] == pytest.approx(0.0, abs=1e-15)
    # three points off a line (x 2, 5, 8; y 2, 5, 5 ms): slope (-3 * -2 + 0 * 1 + 3 * 1) / 18 = 0.5 ms, intercept 4 - 0.5 * 5
    f = fit_framework([{"units": 2, "extra_s": 2e-3}, {"units": 5, "extra_s": 5e-3}, {"units": 8, "extra_s": 5e-3}])
    assert f["per_unit_s"] == pytest.approx(0.5e-3) and f["step_s"] == pytest.approx(4e-3 - 2.5e-3)
    assert f["max_residual_s"] == pytest.approx(1e-3)  # the middle point: 5 ms against the line's 4 ms
    f = fit_framework([{"units": 2, "extra_s": 5e-3}, {"units": 8, "extra_s": 2e-3}])
    assert f["per_unit_s"] == 0.0 and f["step_s"] == pytest.approx(3.5e-3) and "per_unit_s" in f["notes"][0]


def test_the_framework_fit_separates_a_cost_per_second_of_compute_with_the_wide_point() -> None:
    # extra = 1 ms + 0.5 ms a unit + 0.2 x compute: the deep points move units and compute together,
    # the wide one (2 units, 30 ms of compute) moves compute alone
    def extra(u: float, c: float) -> float:
        return 1e-3 + 0.5e-3 * u + 0.2 * c

    pts = [{"units": u, "compute_s": c, "extra_s": extra(u, c)} for u, c in ((2, 2e-3), (5, 5e-3), (8, 8e-3), (2, 30e-3))]
    f = fit_framework(pts)
    assert (f["step_s"], f["per_unit_s"], f["per_compute"]) == pytest.approx((1e-3, 0.5e-3, 0.2)) and not f["notes"]
    assert f["max_residual_s"] == pytest.approx(0.0, abs=1e-12)
    assert Framework(f["step_s"], f["per_unit_s"], f["per_compute"]).seconds(3, 0.1) == pytest.approx(extra(3, 0.1))
    # compute that makes the step faster is noise: set to 0, and the line fitted again without it
    pts = [{"units": u, "compute_s": c, "extra_s": 1e-3 + 0.5e-3 * u - 0.01 * c} for u, c in ((2, 2e-3), (5, 5e-3), (8, 8e-3), (2, 30e-3))]
    f = fit_framework(pts)
    assert f["per_compute"] == 0.0 and "per_compute" in f["notes"][0] and f["per_unit_s"] > 0


def test_a_profile_reads_its_framework_table_and_names_a_bad_entry() -> None:
    raw = {**PROFILE.to_json()}
    raw["intra"] = raw["inter"] = {"alpha": 1e-4, "beta": 1e-9}
    back = profile_from_mapping(raw)
    assert back.local and back.framework["zero3"] == Framework(4e-3, 1e-3)
    raw["framework"] = {"ddp": {"per_unit_s": 1.0}}
    with pytest.raises(ConfigError, match=r"framework\.ddp must be a table with step_s"):
        profile_from_mapping(raw)


def test_time_step_leaves_the_model_as_it_was() -> None:
    torch.manual_seed(0)
    model = CalibrationNet(2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    data = torch.utils.data.TensorDataset(torch.randn(64, 32), torch.randint(0, 8, (64,)))
    loss = lambda out, batch: nn.functional.cross_entropy(out, batch[1])  # noqa: E731
    fit = time_step(model, data, loss, lambda p: torch.optim.SGD(p, lr=1.0), (2, 16))
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert fit.sizes == (2, 16) and fit.fixed_s >= 0 and fit.per_sample_s >= 0 and fit.seconds(16) > 0


def test_more_processes_than_cores_stretch_every_part_of_the_step() -> None:
    two_cores = replace(PROFILE, cores=2)
    t2 = estimate(SPEC, Cluster(two_cores, 2), Settings(32), Shape("ddp", dp=2)).time
    est4 = estimate(SPEC, Cluster(two_cores, 4), Settings(32), Shape("ddp", dp=4))
    alone = estimate(SPEC, Cluster(PROFILE, 4), Settings(32), Shape("ddp", dp=4)).time  # cores unknown: no sharing
    assert est4.time["step_s"] == pytest.approx(2 * alone["step_s"]) and est4.time["compute_s"] == pytest.approx(2 * alone["compute_s"])
    assert "4 processes share 2 cores" in est4.notes[-1] and t2["step_s"] == pytest.approx(
        estimate(SPEC, Cluster(PROFILE, 2), Settings(32), Shape("ddp", dp=2)).time["step_s"]
    )


def test_every_candidate_the_planner_lists_has_a_calibration_point_of_its_own() -> None:
    # a candidate whose own key the calibration never measures would borrow another's cost silently
    from shardwise.tools.advisor.calibrate_framework import POINTS
    from shardwise.tools.advisor.candidates import _intended_layout, enumerate_candidates, shape_of

    cluster = Cluster(PROFILE, 4)
    keys = {framework_key(shape_of(c, _intended_layout(c, 4))) for c in enumerate_candidates(cluster, SPEC, 32)}
    assert {"ddp/algorithm/ring", "ddp/algorithm/tree", "ddp/codec/powersgd"} <= keys
    assert {k for k in keys if not cost_of(k).timed_whole} - set(POINTS) == set()  # single's step is the timing itself: nothing to calibrate


def test_each_calibration_point_is_the_median_of_its_rounds() -> None:
    # the faster of two rounds, taken before, left the profile predicting its own points 1.1-1.6x fast; of two, the mean
    runs = [
        {"size": s, "units": u, "compute_s": 1e-3, "measured_s": m, "predicted_without_s": 1e-3, "extra_s": m - 1e-3}
        for s, u, m in ((1, 8, 3e-3), (4, 20, 6e-3), (1, 8, 5e-3), (4, 20, 8e-3))
    ]
    points = point_medians(runs, [1, 4])
    assert [p["measured_s"] for p in points] == pytest.approx([4e-3, 7e-3])
    assert [p["extra_s"] for p in points] == pytest.approx([3e-3, 6e-3]) and [p["units"] for p in points] == [8, 20]
    fit = fit_framework(points)
    assert fit["per_unit_s"] == pytest.approx(3e-3 / 12) and fit["max_residual_s"] == pytest.approx(0.0, abs=1e-15)
    # of three, one slow round (the machine's slow stretch) moves nothing; each round's own timed compute counts too
    slow = {"size": 1, "units": 8, "compute_s": 2e-3, "measured_s": 30e-3, "predicted_without_s": 2e-3, "extra_s": 28e-3}
    point = point_medians([*runs, slow], [1])[0]
    assert (point["measured_s"], point["extra_s"], point["compute_s"]) == pytest.approx((5e-3, 4e-3, 1e-3))


def test_a_pipeline_with_tp_pays_tp_s_per_linear_cost_per_micro_batch_on_each_stage() -> None:
    from shardwise.strategies import get_strategy
    from shardwise.tools.advisor.candidates import Candidate, evaluate

    # the pipeline's plan resolves tp's split linears on the whole model: fc1 and fc2 of each of 4 blocks
    net = CalibrationNet(4)
    layout = get_strategy("pipeline", pp=2, tp=2, microbatches=4).plan(4, net)
    assert layout.units is not None and len(layout.units) == 8
    # a model the whole-model plan does not resolve plans as before, without units (apply checks each stage)
    assert get_strategy("pipeline", pp=2, tp=2, microbatches=4).plan(4, nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))).units is None
    profile = replace(PROFILE, framework={**PROFILE.framework, "tp": Framework(9e-3, 1e-3)})
    spec = replace(SPEC, layers=4, transformer=False)
    rec = evaluate(Candidate("pipeline", {"pp": 2, "tp": 2, "schedule": "1f1b", "microbatches": 4}), spec, Cluster(profile, 4), Settings(32), net)
    assert rec["fits"], rec["reason"]
    # the pipeline's own cost per micro-batch, plus tp's per linear: 8 linears over 2 stages, 4 micro-batches
    assert rec["time_breakdown"]["overhead_s"] == pytest.approx(5e-4 + 3e-4 * 4 + 1e-3 * 8 / 2 * 4)
    (tp_ar,) = [c for c in rec["comm_breakdown"] if c["group"] == "tp"]
    assert tp_ar["count"] == 8 / 2 * 4


def test_local_sgd_and_diloco_spread_their_round_cost_over_the_round_as_one_over_sqrt_h() -> None:
    rounds = replace(PROFILE, framework={**PROFILE.framework, "local-sgd": Framework(4e-3), "diloco": Framework(6e-3)})
    for family, cost in (("local-sgd", 4e-3), ("diloco", 6e-3)):
        for h in (1, 4, 16):
            t = estimate(SPEC, Cluster(rounds, 2), Settings(32), Shape(family, dp=2, sync_every=h)).time
            assert t["overhead_period"] == h and t["overhead_scale"] == pytest.approx(h**-0.5)
            assert t["overhead_s"] == pytest.approx(cost / h**0.5)
    t = estimate(SPEC, Cluster(rounds, 2), Settings(32), Shape("ddp", dp=2)).time  # every step: whole
    assert t["overhead_period"] == 1 and t["overhead_s"] == pytest.approx(1e-3 + 2e-4 * 12)


def test_a_round_s_measured_extra_is_kept_unscaled_and_its_run_logs_whole_rounds(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.tools.advisor.calibrate_framework as cf

    seen = {}

    def measure(strategy: str, options: dict, model: nn.Module, world: int, predicted_s: float, period: int, batch: int = 32) -> float:
        seen.update(strategy=strategy, period=period)
        return 5e-3

    monkeypatch.setattr(cf, "_measure", measure)
    monkeypatch.setattr(cf, "_spec", lambda depth, width, batch, specs, threads=1: replace(SPEC, layers=depth))
    rounds = replace(PROFILE, framework={"local-sgd": Framework(4e-3)})
    point = cf.measure_point("local-sgd", 1, rounds)  # the calibration's local SGD averages every 8 steps
    assert seen == {"strategy": "local-sgd", "period": 8} and point["scale"] == pytest.approx(8**-0.5)
    assert point["framework_s"] == pytest.approx(4e-3 / 8**0.5)
    assert point["extra_s"] == pytest.approx((5e-3 - point["predicted_without_s"]) * 8**0.5)
    assert cf.measure_point("ddp", 1, rounds)["extra_s"] == pytest.approx(5e-3 - cf.measure_point("ddp", 1, rounds)["predicted_without_s"])
    assert seen["period"] == 1


def test_each_calibration_round_times_the_networks_again_and_shares_them_within_the_round(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.tools.advisor.calibrate_framework as cf

    calls: list[tuple[str, int | str, int]] = []

    def point(key: str, size: int | str, profile: object, world: int = 2, specs: dict | None = None) -> dict:
        assert specs is not None
        calls.append((key, size, id(specs)))
        specs.setdefault("timed", True)  # a round's dict outlives its points
        units = 8.0 if size == "wide" else 4.0 * int(size) + 4
        timings = {"compute_s": 1e-3, "measured_s": 3e-3, "predicted_without_s": 1e-3, "extra_s": 2e-3}
        return {"key": key, "size": size, "varies": "layers", "units": units, "params": 1e4, **timings}

    monkeypatch.setattr(cf, "measure_point", point)
    cf.calibrate_framework(PROFILE, ["ddp", "zero1"], repeats=2)
    first, second = {c[2] for c in calls[: len(calls) // 2]}, {c[2] for c in calls[len(calls) // 2 :]}
    assert len(calls) == 2 * 2 * 4 and len(first) == 1 and len(second) == 1 and first != second


def test_time_step_takes_each_size_s_median_of_runs_taken_in_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.tools.advisor.validate as validate
    from shardwise.tools.advisor.models import TIMED_RUNS

    # one slow run of each size (a slow stretch of the machine) moves neither size's time
    script = {2: [0.10, 0.50, 0.12], 16: [0.20, 0.22, 0.90]}
    order: list[int] = []

    def timed_fit(model: nn.Module, data: object, *, steps: int, batch: int, **kwargs: object) -> float:
        order.append(batch)
        return script[batch][sum(1 for b in order if b == batch) - 1]

    monkeypatch.setattr(validate, "timed_fit", timed_fit)
    fit = time_step(CalibrationNet(1), None, None, None, (16, 2))  # type: ignore[arg-type]
    assert TIMED_RUNS == 3 and order == [2, 16] * 3
    assert fit.per_sample_s == pytest.approx((0.22 - 0.12) / 14) and fit.fixed_s == pytest.approx(0.12 - 2 * (0.10 / 14))


def test_calibrate_only_measures_the_named_costs_again_and_keeps_the_rest(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # noqa: ANN001
    import json

    import shardwise.tools.advisor.calibrate_framework as cf
    from shardwise.tools.advisor.calibrate import cmd_calibrate, recalibrate

    raw = PROFILE.to_json()
    raw["intra"] = raw["inter"] = {"alpha": 1e-4, "beta": 1e-9}
    raw["calibration"] = {"date": "then", "framework": {"ddp": {"kept": True}}}
    new = {"step_s": 9e-3, "per_unit_s": 1e-4, "per_param_s": 0.0, "per_compute": 0.0, "points": [], "notes": []}
    asked: list[list[str]] = []
    monkeypatch.setattr(cf, "calibrate_framework", lambda profile, keys: asked.append(keys) or dict.fromkeys(keys, new))
    out = recalibrate(raw, ["local-sgd", "diloco"])
    assert asked == [["local-sgd", "diloco"]] and out["framework"]["diloco"]["step_s"] == 9e-3
    assert out["framework"]["ddp"] == raw["framework"]["ddp"] and out["calibration"]["framework"]["ddp"] == {"kept": True}
    assert out["calibration"]["refitted"][0]["keys"] == ["local-sgd", "diloco"] and "diloco" not in raw["framework"]  # the input is not changed
    with pytest.raises(ConfigError, match=r"strategy cost keys.*got local_sgd"):
        recalibrate(raw, ["local_sgd"])
    with pytest.raises(ConfigError, match="run --calibrate alone first"):
        recalibrate({k: v for k, v in raw.items() if k != "calibration"}, ["ddp"])
    with pytest.raises(ConfigError, match=r"does not exist"):
        cmd_calibrate(str(tmp_path / "none.json"), ["ddp"])
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(raw))
    assert cmd_calibrate(str(path), ["ddp"]) == 0 and json.loads(path.read_text())["framework"]["ddp"]["step_s"] == 9e-3


def test_time_step_takes_no_further_round_once_its_budget_is_spent(monkeypatch: pytest.MonkeyPatch) -> None:
    import shardwise.tools.advisor.models as models
    import shardwise.tools.advisor.validate as validate

    clock = iter([0.0, models.TIMED_BUDGET_S + 1])  # the start, then after the first round: a long step's round
    monkeypatch.setattr(models, "_now", lambda: next(clock))
    order: list[int] = []
    monkeypatch.setattr(validate, "timed_fit", lambda model, data, *, steps, batch, **kw: order.append(batch) or 0.1 * batch)
    fit = time_step(CalibrationNet(1), None, None, None, (2, 16))  # type: ignore[arg-type]
    assert order == [2, 16] and fit.per_sample_s == pytest.approx(0.1)
