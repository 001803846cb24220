"""``shardwise train --model MODULE:FACTORY --data ... [--val-data] [--loss] [--optimizer]`` and the same keys in
the config's [recipe] section: your own module, imported from the current directory, trained with every
Trainer option as a recipe is; a wrong path or a factory's wrong return is one line before anything starts.
In this process (``shardwise.cli.main``): the command's own code, without a fresh interpreter per case."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from shardwise import Trainer
from shardwise.cli import main

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

MODULE = """
import torch
from torch import nn


class Net(nn.Module):  # a class of the user's module: the workers import it from the same directory
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)))


def make_model():
    return Net().double()


def make_data(n=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return torch.utils.data.TensorDataset(x, (x[:, 0] > x[:, 1]).long() + (x[:, 2] > 1).long())


def make_val():
    return make_data(40, seed=2)


def loss(output, batch):
    return nn.functional.cross_entropy(output, batch[1])


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def not_a_model():
    return [1, 2]


def a_generator():
    yield 1
"""


@pytest.fixture
def here(tmp_path, monkeypatch):
    """A directory holding the user's module ``ownmod_cli.py``, as the current directory; sys.path and
    sys.modules as they were afterwards."""
    (tmp_path / "ownmod_cli.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    sys.modules.pop("ownmod_cli", None)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--model", "ownmod_clii:make_model"], "--model 'ownmod_clii:make_model': no module named 'ownmod_clii' in "),
        (["--model", "ownmod_cli:make_modell"], "--model 'ownmod_cli:make_modell': ownmod_cli ("),
        (["--model", "ownmod_cli:not_a_model"], "--model ownmod_cli:not_a_model returned a list, not a torch.nn.Module"),
        (["--model", "ownmod_cli.make_model"], "--model 'ownmod_cli.make_model': give module:name"),
        (["--data", "ownmod_cli:a_generator"], "--data ownmod_cli:a_generator returned a generator, not a data set; return a map-style Dataset"),
        (["--data", "ownmod_cli:loss"], "--data ownmod_cli:loss takes arguments (output, batch), but is called with none"),
        (["--loss", "ownmod_cli:nope"], "--loss 'ownmod_cli:nope': ownmod_cli ("),
        (["--recipe", "digits"], "--recipe digits and --model, --data both name what to train"),
        (["--set", "recipe.n_layers=2"], "[recipe] keys ['n_layers'] are options of built-in recipes"),
    ],
)
def test_a_wrong_module_path_or_a_factorys_wrong_return_is_one_line_and_exit_2(here, capsys, args, message):
    given = dict(zip(args[::2], args[1::2], strict=True))
    base = {"--model": "ownmod_cli:make_model", "--data": "ownmod_cli:make_data"}
    argv = [item for pair in {**base, **given}.items() for item in pair]
    assert main(["train", *argv, "--max-steps", "1"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err, err
    if "make_modell" in message:
        assert "has no 'make_modell'; it has ['Net', 'a_generator', 'loss', 'make_data', 'make_model', 'make_val', 'not_a_model', 'sgd']" in err


def test_no_recipe_and_no_model_says_both_ways(capsys):
    assert main(["train", "--max-steps", "1"]) == 2
    assert "needs --recipe NAME (one of `shardwise recipes`) or your own model: --model MODULE:FACTORY --data MODULE:FACTORY" in capsys.readouterr().err


def test_your_own_module_trains_under_ddp_on_two_processes_as_single_does(here):
    # model and data from the config's [recipe] section, the rest as flags; float64, compared with the
    # Trainer run in Python on the same parts with `single`.
    (here / "own.toml").write_text(
        '[recipe]\nmodel = "ownmod_cli:make_model"\ndata = "ownmod_cli:make_data"\nval_data = "ownmod_cli:make_val"\n\n[trainer]\nprecision = "64"\n'
    )
    flags = ["--loss", "ownmod_cli:loss", "--optimizer", "ownmod_cli:sgd", "--global-batch-size", "16", "--max-steps", "8", "--seed", "3"]
    code = main(["train", "--config", "own.toml", *flags, "--strategy", "ddp", "--nproc", "2", "--out", "run", "--checkpoint-every", "4"])
    assert code == 0
    summary = json.loads((here / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 8 and summary["val_samples"] == 40
    assert sorted(p.name for p in (here / "run" / "checkpoints").iterdir()) == ["step-00000004", "step-00000008"]

    import ownmod_cli

    reference = Trainer(
        strategy="single", precision="64", global_batch_size=16, max_steps=8, seed=3, optimizer=ownmod_cli.sgd, loss_fn=ownmod_cli.loss, progress_bar=False
    )
    torch.manual_seed(3)
    single = reference.fit(ownmod_cli.make_model(), ownmod_cli.make_data(), ownmod_cli.make_val())
    assert abs(summary["train_loss"] - single["train_loss"]) < 1e-12 and abs(summary["val_loss"] - single["val_loss"]) < 1e-12


def test_a_workers_failure_is_its_short_report_and_exit_1_without_the_parents_traceback(capsys):
    # launch raises the rank's own exception from a RemoteTraceback holding the short report (spawn.py);
    # the command prints that report, not the frames of cli, loop and spawn under it (a new user's report)
    from shardwise.cli import _guard
    from shardwise.launcher.spawn import RemoteTraceback

    report = "ranks 0, 1 failed: IndexError: tuple index out of range\n  at ownmod.py:8 in loss\n  full traceback: /tmp/x/rank-0.txt"

    def fit() -> int:
        raise IndexError("tuple index out of range") from RemoteTraceback(report)

    assert _guard(fit) == 1
    err = capsys.readouterr().err
    assert err == f"shardwise: a worker failed:\n{report}\n" and "Traceback" not in err

    def bug() -> int:
        raise IndexError("shardwise's own bug")  # not from a worker: the traceback stays

    with pytest.raises(IndexError):
        _guard(bug)
