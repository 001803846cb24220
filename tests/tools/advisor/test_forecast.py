"""The step timing bench scaling's predictions start from: each size's fastest run, so one run that other work slowed
(a thread count timed while the machine was busy) cannot move every prediction; plan keeps the median."""

from __future__ import annotations

import pytest
from torch import nn

from shardwise.tools.advisor import forecast, models, validate


def test_best_keeps_each_sizes_fastest_run_and_the_default_its_median(monkeypatch: pytest.MonkeyPatch) -> None:
    def script() -> dict[int, list[float]]:
        return {4: [0.10, 5.0, 0.11], 64: [0.20, 0.21, 6.0]}  # one collapsed run at each size

    for best, at_64 in ((True, 0.20), (False, 0.21)):
        runs = script()
        monkeypatch.setattr(validate, "timed_fit", lambda model, data, *, batch, runs=runs, **kw: runs[batch].pop(0))
        monkeypatch.setattr(models, "_now", lambda: 0.0)  # no time budget cut
        fit = models.time_step(nn.Linear(2, 2), None, lambda o, b: o.sum(), lambda p: None, (4, 64), threads=2, best=best)
        assert runs == {4: [], 64: []}  # three runs of each size
        assert fit.seconds(64) == pytest.approx(at_64) and fit.threads == 2
        assert fit.seconds(4) == pytest.approx(0.10 if best else 0.11)


def test_planned_model_times_for_the_best_run_and_passes_the_data_on(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}
    monkeypatch.setattr(models, "load_model", lambda model, **kw: seen.update(kw, model=model))
    forecast.planned_model("m:make", global_batch=32, nprocs=(1, 2), data="m:data")
    assert seen["model"] == "m:make" and seen["best"] is True and seen["data"] == "m:data" and seen["timed_batch"] == 32
