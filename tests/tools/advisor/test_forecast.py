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


def test_plan_takes_a_factory_that_returns_the_module_alone_with_data(tmp_path, monkeypatch, capsys) -> None:
    from shardwise.cli import main
    from shardwise.errors import ConfigError

    (tmp_path / "planmods.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def make_model():\n    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))\n"
        "def make_data():\n    x = torch.randn(64, 8)\n    return torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long())\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["plan", "--model", "planmods:make_model", "--nproc", "2", "--device", "h100-80gb"]  # a datasheet device: nothing timed
    assert main(flags) == 2
    assert "returned the module alone: " in capsys.readouterr().err  # and says what to do:
    with pytest.raises(ConfigError, match=r"return \(model, example_input\) from the factory .*or pass --data MODULE:FACTORY"):
        models.load_model("planmods:make_model")
    assert main([*flags, "--data", "planmods:make_data"]) == 0
    assert "ddp" in capsys.readouterr().out
