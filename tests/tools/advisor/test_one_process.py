"""When not to distribute (issue 39): ``single`` costed with its own thread count and the machine's load,
fewer processes than asked as candidates, and the recommendation to stay on one process when it is
predicted faster than every multi-process candidate, with the numbers.

The decision is tested on controlled inputs (a model spec whose step timings are given, a profile with
2 cores, the load given); which layout wins on digits depends on this machine's timing, so the CLI
test checks the fields and their consistency only.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from shardwise.strategies.cost.cluster import A100_40GB, Cluster, Framework, Link
from shardwise.strategies.cost.estimate import Settings, Shape, estimate
from shardwise.strategies.cost.model_spec import ModelSpec, StepFit
from shardwise.tools.advisor.candidates import fastest_threads, own_threads, plan_all, planned_threads
from shardwise.tools.advisor.recommend import recommend

LINK = Link(alpha=1e-4, beta=1e-9)
TWO_CORES = replace(
    A100_40GB, name="here", local=True, cores=2, memory_bytes=12e9, intra=LINK, inter=LINK, overlap=0.0, framework={"ddp": Framework(1e-3, 1e-4)}
)
ONE_THREAD = StepFit(fixed_s=2e-3, per_sample_s=1e-5, sizes=(4, 64), threads=1)
TWO_THREADS = StepFit(fixed_s=1e-3, per_sample_s=6e-6, sizes=(4, 64), threads=2)


def spec(*fits: StepFit) -> ModelSpec:
    return ModelSpec("m", params=26_000, layers=3, layer_params=16_000, hidden=128, flops_per_sample=1.4e5, tensors=6).with_fits(fits)


@pytest.fixture
def torch_threads() -> Iterator[None]:
    """A single process's own thread count is torch's: 2 here (the suite runs with 1), put back after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def plan(model: ModelSpec, nproc: int = 2, load: float = 0.0, batch: int = 64) -> tuple[list[dict], dict]:
    cluster = Cluster(TWO_CORES, nproc, load=load)
    settings = Settings(batch)
    records = plan_all(model, cluster, settings)
    return records, recommend(records, model, cluster, settings)


def test_single_is_costed_with_the_step_timed_at_its_thread_count() -> None:
    model = spec(ONE_THREAD, TWO_THREADS)
    one = estimate(model, Cluster(TWO_CORES, 1, threads=1), Settings(64), Shape("single")).time
    two = estimate(model, Cluster(TWO_CORES, 1, threads=2), Settings(64), Shape("single")).time
    assert one["threads"] == 1 and one["step_s"] == pytest.approx(ONE_THREAD.seconds(64))
    assert two["threads"] == 2 and two["step_s"] == pytest.approx(TWO_THREADS.seconds(64))  # no framework cost: the timing is its step
    # two launched ranks on two cores run one thread each: the one-thread timing, half the batch each
    ddp = estimate(model, Cluster(TWO_CORES, 2), Settings(64), Shape("ddp", dp=2)).time
    assert ddp["threads"] == 1 and ddp["compute_s"] == pytest.approx(ONE_THREAD.seconds(32))
    # a thread count never timed is costed as the most threads timed below it, never a guessed speed-up
    assert model.fit_for(8) is TWO_THREADS and model.fit_for(1) is ONE_THREAD and spec(TWO_THREADS).fit_for(1) is TWO_THREADS


def test_the_load_takes_cores_from_single_s_threads_and_stretches_the_ranks(torch_threads: None) -> None:
    model = spec(ONE_THREAD, TWO_THREADS)
    quiet = {r["label"]: r for r in plan(model)[0]}
    assert quiet["single"]["threads"] == 2 and quiet["single"]["in_process"]
    assert quiet["single"]["step_time_s"] == pytest.approx(TWO_THREADS.seconds(64))
    # another job's runnable thread on two cores: one core left, single runs (and is costed with) one thread
    busy = {r["label"]: r for r in plan(model, load=1.0)[0]}
    assert own_threads(Cluster(TWO_CORES, 1, load=1.0)) == 1 and busy["single"]["threads"] == 1
    # the step is timed at the counts the planned processes run: single's own and the launched ranks' (one each here)
    assert planned_threads(Cluster(TWO_CORES, 2)) == (1, 2) and planned_threads(Cluster(TWO_CORES, 2, load=1.0)) == (1,)
    assert planned_threads(Cluster(TWO_CORES, 2), one_process=False) == (1,)  # --validate --only without single
    assert busy["single"]["step_time_s"] == pytest.approx(ONE_THREAD.seconds(64))
    # two one-thread ranks and that thread share two cores: 3/2 of the time (the timing had a core to itself)
    ddp_quiet, ddp_busy = quiet["ddp(allreduce=native)"]["time_breakdown"], busy["ddp(allreduce=native)"]["time_breakdown"]
    assert ddp_busy["shared"] == pytest.approx(1.5) and ddp_busy["step_s"] == pytest.approx(1.5 * ddp_quiet["step_s"])
    assert any("other work's 1 runnable threads (load) share 2 cores" in n for n in busy["ddp(allreduce=native)"]["notes"])


def test_a_thread_count_that_timed_slower_is_not_the_one_single_is_costed_with(torch_threads: None) -> None:
    collapsed = replace(TWO_THREADS, fixed_s=0.1)  # a busy machine's two threads wait on each other (issue 39: 40x)
    assert fastest_threads(spec(ONE_THREAD, collapsed), 2, 64) == 1 and fastest_threads(spec(ONE_THREAD, TWO_THREADS), 2, 64) == 2
    records, advice = plan(spec(ONE_THREAD, collapsed))
    single = next(r for r in records if r["label"] == "single")
    assert single["threads"] == 1 and single["step_time_s"] == pytest.approx(ONE_THREAD.seconds(64))


def test_one_process_faster_than_every_multi_process_candidate_is_the_recommendation_with_its_numbers(torch_threads: None) -> None:
    records, advice = plan(spec(ONE_THREAD, TWO_THREADS))
    single = next(r for r in records if r["label"] == "single")
    multi = min((r for r in records if r["fits"] and r["world_size"] > 1), key=lambda r: r["step_time_s"])
    assert single["step_time_s"] < multi["step_time_s"]  # the inputs: 1.4 ms against ddp's 2.3 ms compute alone
    assert advice["rule"] == "one-process" and advice["choice"] == "single" and advice["stay_on_one_process"] is True
    assert advice["processes"] == 1 and advice["threads"] == 2
    assert advice["one_process"]["step_time_s"] == single["step_time_s"] and advice["one_process"]["samples_per_s"] == pytest.approx(64 / single["step_time_s"])
    assert advice["best_multiprocess"]["label"] == multi["label"] and advice["speedup"] == pytest.approx(single["step_time_s"] / multi["step_time_s"])
    why = advice["why"]
    assert "stay on one process" in why and f"{single['step_time_s'] * 1e3:.3g} ms a step" in why and f"{multi['step_time_s'] * 1e3:.3g} ms" in why
    assert f"({multi['step_time_s'] / single['step_time_s']:.2f}x the step)" in why and "distributing is a trade-off" in why


def test_where_distributing_is_faster_the_guide_s_multi_process_choice_stands(torch_threads: None) -> None:
    heavy = [replace(f, per_sample_s=1e-3) for f in (ONE_THREAD, TWO_THREADS)]  # compute dominates: half a batch each pays
    records, advice = plan(spec(*heavy))
    assert advice["stay_on_one_process"] is False and advice["rule"] == "ddp" and advice["choice"].startswith("ddp(")
    assert advice["processes"] == 2 and advice["speedup"] > 1
    single = next(r for r in records if r["label"] == "single")
    assert advice["speedup"] == pytest.approx(single["step_time_s"] / advice["best_multiprocess"]["step_time_s"])


def test_fewer_processes_than_asked_are_candidates_and_named_as_such(torch_threads: None) -> None:
    heavy = [replace(f, per_sample_s=1e-3) for f in (ONE_THREAD, TWO_THREADS)]
    records, advice = plan(spec(*heavy), nproc=4)
    by_world = {r["label"]: r["world_size"] for r in records}
    assert by_world["single"] == 1 and by_world["ddp(allreduce=native) on 2"] == 2 and by_world["ddp(allreduce=tree) on 2"] == 2
    assert by_world["ddp(allreduce=native)"] == 4
    # four one-thread ranks on two cores take twice as long as two: the two-process candidates win, said so
    assert advice["processes"] == 2 and advice["choice"].endswith(" on 2") and "on 2 of the 4 processes: fewer are faster here" in advice["why"]
    # a model that does not fit on one device gets no fewer-process candidates
    big = replace(spec(*heavy), params=int(2e9), layer_params=int(1e8))
    assert all(r["world_size"] in (1, 4) for r in plan(big, nproc=4)[0])


def test_plan_json_carries_the_one_process_comparison(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.cli import main
    from shardwise.tools.advisor import models

    monkeypatch.setattr(models, "TIMED_RUNS", 1)  # the fields and their relations are checked, not the timing's precision
    monkeypatch.setattr(models, "TIMED_TARGET_S", 0.3)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "digits", "--nproc", "2", "--load", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    rec = doc["recommendation"]
    for key in ("rule", "why", "choice", "fastest", "numbers"):  # the fields before issue 39 are still there
        assert key in rec
    one, multi = rec["one_process"], rec["best_multiprocess"]
    assert one["label"] == "single" and one["world_size"] == 1 and one["threads"] >= 1 and one["step_time_s"] > 0
    assert multi["world_size"] == 2 and rec["speedup"] == pytest.approx(one["step_time_s"] / multi["step_time_s"])
    assert rec["stay_on_one_process"] is (one["step_time_s"] < multi["step_time_s"])
    assert (rec["choice"] == "single") is rec["stay_on_one_process"] and (rec["rule"] == "one-process") is rec["stay_on_one_process"]
    assert rec["processes"] == (1 if rec["stay_on_one_process"] else 2)
    assert doc["cluster"]["load"] == 0 and doc["cluster"]["cores"] >= 1
    assert all("threads" in r and "samples_per_s" in r for r in doc["candidates"])
    printed = capsys.readouterr().out
    assert "cores: " in printed and "load 0.00 (other work's runnable threads: --load)" in printed
    run = rec["run"]  # the recommendation line ends with the command that runs the choice
    assert run.startswith("shardwise train --recipe digits --strategy ") and f" --nproc {rec['processes']}" in run
    assert f"; run it: {run}\n" in printed and (" --threads " in run) is (rec["stay_on_one_process"] and rec["threads"] != torch.get_num_threads())


def test_validate_runs_single_and_the_fewer_process_candidates_too(monkeypatch: pytest.MonkeyPatch, torch_threads: None) -> None:
    import shardwise.tools.advisor.validate as validate
    from shardwise.tools.advisor.models import PlannedModel

    ran: list[tuple[str, int]] = []

    def run(record: dict, *args: object) -> dict:
        ran.append((record["label"], record["threads"]))
        return {"step_s": record["step_time_s"], "model_state_bytes": 1.0, "activation_bytes": 1.0, "memory_bytes": 2.0}

    monkeypatch.setattr(validate, "run_candidate", run)
    model = PlannedModel(spec(ONE_THREAD, TWO_THREADS), recipe="digits")
    rows = validate.validate(model, Cluster(TWO_CORES, 4, load=0.0), Settings(64), None, ["single", "ddp(allreduce=tree) on 2", "ddp"])
    assert ("single", 2) in ran and ("ddp(allreduce=tree) on 2", 1) in ran and ("ddp(allreduce=native)", 1) in ran
    assert {r["label"] for r in rows} == {label for label, _ in ran} and all(r["step_rel_error"] == 0 for r in rows)


def test_a_validated_single_runs_with_the_threads_it_was_costed_with(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import shardwise.tools.advisor.validate as validate
    from shardwise.tools.advisor.models import PlannedModel

    seen: list[int] = []
    start = validate.MemoryProbe.on_fit_start

    def probe(self: object, trainer: object, engine: object) -> None:
        seen.append(torch.get_num_threads())
        start(self, trainer, engine)  # type: ignore[arg-type]

    monkeypatch.setattr(validate.MemoryProbe, "on_fit_start", probe)
    records, _ = plan(spec(ONE_THREAD, TWO_THREADS))
    before = torch.get_num_threads()
    single = dict(next(r for r in records if r["label"] == "single"), threads=2, in_process=True)
    got = validate.run_candidate(single, PlannedModel(spec(ONE_THREAD), recipe="digits"), Settings(64), 10, tmp_path)
    assert seen == [2] and got["step_s"] > 0 and torch.get_num_threads() == before  # put back after the run


def test_the_recommendation_ends_with_the_command_that_runs_it_and_names_threads_torch_would_not_take(
    torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from shardwise.tools.advisor.commands import load_line
    from shardwise.tools.advisor.recommend import run_command

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # issue 39: on a busy machine single is costed at 1 thread, torch's default is 2: the command says --threads 1
    busy_records, advice = plan(spec(ONE_THREAD, TWO_THREADS), load=1.0)
    assert advice["choice"] == "single" and advice["threads"] == 1
    assert run_command(advice["choice_record"], "--recipe digits") == "shardwise train --recipe digits --strategy single --nproc 1 --threads 1"
    line = load_line(Cluster(TWO_CORES, 2, load=1.0), busy_records, given=True)
    assert "single is costed at 1 thread(s), not torch's 2" in line and "(run it with --threads 1; OMP_NUM_THREADS=1 also works)" in line
    # costed at torch's own 2: nothing to add
    _, advice = plan(spec(ONE_THREAD, TWO_THREADS))
    assert advice["threads"] == 2 and run_command(advice["choice_record"], "--model m:f", ["--global-batch-size", "64"]) == (
        "shardwise train --model m:f --strategy single --nproc 1 --global-batch-size 64"
    )
    # launched ranks: their options become flags; one thread each is the launcher's own 2 cores // 2, unless
    # the user's OMP_NUM_THREADS says otherwise
    heavy = [replace(f, per_sample_s=1e-3) for f in (ONE_THREAD, TWO_THREADS)]
    _, advice = plan(spec(*heavy))
    rec = advice["choice_record"]
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in rec["options"].items())
    assert rec["strategy"] == "ddp" and flags  # e.g. --compression topk:0.01
    expected = f"shardwise train --recipe digits --strategy ddp {flags} --nproc 2"
    assert rec["threads"] == 1 and run_command(rec, "--recipe digits") == expected
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert run_command(rec, "--recipe digits") == expected + " --threads 1"
    assert run_command(rec, "--recipe digits", cores_here=False) == expected  # a datasheet device: no thread count to name


def test_the_load_is_other_work_s_runnable_threads_now_not_the_lagging_average(tmp_path, monkeypatch):
    from shardwise.strategies.cost.cluster import load_profile
    from shardwise.tools.advisor import forecast

    stat = tmp_path / "stat"
    stat.write_text("cpu  1 2 3\nprocs_running 4\nprocs_blocked 0\n")
    assert forecast.runnable_now(samples=3, interval_s=0, path=str(stat)) == 3.0  # this reading is one of the 4
    stat.write_text("procs_running 1\n")
    assert forecast.runnable_now(samples=2, interval_s=0, path=str(stat)) == 0.0
    assert forecast.runnable_now(path=str(tmp_path / "missing")) is None
    monkeypatch.setattr(forecast, "runnable_now", lambda: 2.0)
    monkeypatch.setattr(forecast.os, "getloadavg", lambda: (7.0, 7.0, 7.0))
    here = load_profile("cpu")
    assert forecast.machine_load(None, here) == 2.0  # not the 1-minute average's 7
    assert forecast.machine_load(0.5, here) == 0.5
    monkeypatch.setattr(forecast, "runnable_now", lambda: None)  # no /proc/stat: the average
    assert forecast.machine_load(None, here) == 7.0
    assert forecast.machine_load(None, load_profile("h100-80gb")) == 0.0
