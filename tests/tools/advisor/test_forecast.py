"""The step timing bench scaling's predictions start from: each size's fastest run, so one run that other work slowed
(a thread count timed while the machine was busy) cannot move every prediction; plan keeps the median."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch
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


_TINY = """import torch
from torch import nn


class Tiny(nn.Module):  # 16 -> 32 -> 4, a residual, one Linear used twice
    def __init__(self):
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 4)

    def forward(self, x):
        h = torch.relu(self.inp(x))
        h = h + self.shared(h)
        return self.out(h + self.shared(torch.relu(h)))


def make_model():
    return Tiny()


def make_data():
    return torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
"""


def _bare_step_s(model: nn.Module, x: torch.Tensor, steps: int = 30) -> float:
    """The median step of a plain forward-backward-Adam loop: less than the Trainer's step, never more."""
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        model(x).float().mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return statistics.median(times[5:])


def test_plan_of_a_tiny_hand_written_factory_predicts_a_step_of_the_order_it_measures(tmp_path, monkeypatch) -> None:
    # The plan of a module:factory used to default to a datasheet GPU and cost it by FLOPs alone:
    # 3.2e-05 ms a step (1.6e10 samples/s), 1e4x below the step it takes. A real module is timed here.
    from shardwise.cli import main

    (tmp_path / "tinymods.py").write_text(_TINY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(models, "TIMED_RUNS", 1)  # one short timing run of each size: the order, not the precise figure, is checked
    monkeypatch.setattr(models, "TIMED_TARGET_S", 0.2)
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "tinymods:make_model", "--data", "tinymods:make_data", "--nproc", "1", "--global-batch", "64", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["cluster"]["device"]["name"].startswith("cpu") and plan["model"]["step_fit"] is not None
    single = next(c for c in plan["candidates"] if c["label"] == "single")
    import tinymods  # type: ignore[import-not-found]

    torch.manual_seed(0)
    bare = _bare_step_s(tinymods.make_model(), torch.randn(64, 16))
    assert bare / 5 < single["step_time_s"] < bare * 200, (single["step_time_s"], bare)
