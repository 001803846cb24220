"""The learning-rate range test (Smith 2017, section 3.3): its pieces against hand computations, and
its suggestion on digits against the rates where the loss falls fastest, measured independently
by short runs at fixed rates."""

from __future__ import annotations

import copy
import functools
import math
import random
import re

import matplotlib.image
import pytest
import sklearn  # noqa: F401  # digits' data package sets KMP_* once per interpreter: before the hygiene fixture's snapshot
import torch
import torch.nn.functional as F

from shardwise.errors import ConfigError
from shardwise.tools.recipes import get_recipe
from shardwise.tools.recipes.digits import adamw
from shardwise.trainer import Trainer
from shardwise.trainer.lr_find import diverged, smooth, steepest_index, summarize, sweep_lrs

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_the_sweep_is_geometric_from_min_to_max():
    lrs = sweep_lrs(1e-5, 10.0, 7)
    assert lrs[0] == 1e-5 and lrs[-1] == pytest.approx(10.0)
    for a, b in zip(lrs, lrs[1:], strict=False):
        assert b / a == pytest.approx(10.0, rel=1e-12)  # 6 decades in 6 steps


def test_the_smoothed_loss_is_the_bias_corrected_moving_average():
    # By hand, b = 0.5: m1 = 0.5, m2 = 0.25 + 1 = 1.25, m3 = 0.625 + 1.5 = 2.125; divided by 1 - b^t.
    assert smooth([1.0, 2.0, 3.0], 0.5) == pytest.approx([1.0, 1.25 / 0.75, 2.125 / 0.875])
    assert smooth([2.5] * 20, 0.98) == pytest.approx([2.5] * 20)  # no warm-up bias: a constant stays itself


def test_the_suggestion_is_the_steepest_descent_against_log_lr():
    lrs = sweep_lrs(1e-6, 1.0, 61)  # 10 points a decade; 1e-3 is lrs[30]
    losses = [2.0 - math.tanh(math.log10(lr) + 3) for lr in lrs]  # steepest at log10(lr) = -3
    assert lrs[steepest_index(lrs, losses, skip_start=0)] == pytest.approx(1e-3)
    # Slopes by hand (one unit of log10 lr apart): (1.4-2.0)/2, (1.0-1.9)/2 = -0.45 at index 2, ...;
    # after the lowest point (index 3) the last one, (1.6-2.5)/1 = -0.9, is steeper but not chosen.
    assert steepest_index(sweep_lrs(1e-3, 1e3, 7), [2.0, 1.9, 1.4, 1.0, 1.5, 2.5, 1.6], skip_start=0) == 2


def test_the_stop_rule_and_a_trailing_nan():
    assert diverged(4.01, 1.0, 4.0) and not diverged(3.99, 1.0, 4.0) and diverged(math.nan, 1.0, 4.0)
    lrs = sweep_lrs(1e-4, 1.0, 10)
    result = summarize(lrs, [2.0, 1.9, 1.5, 1.0, 0.8, 0.7, math.nan], min_lr=1e-4, max_lr=1.0, steps=10, smoothing=0.0, skip_start=0)
    assert len(result.losses) == 6 and result.stopped_early
    assert result.suggestion == lrs[2]  # no smoothing: central differences -0.25, -0.45, -0.35, -0.15 from step 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_lr": 1.0, "max_lr": 0.1}, "0 < min_lr < max_lr"),
        ({"steps": 2}, "steps >= 3"),
        ({"smoothing": 1.0}, "smoothing must be in [0, 1)"),
        ({"diverge": 1.0}, "diverge must be > 1"),
    ],
)
def test_bad_settings_are_one_line(kwargs, message):
    parts = get_recipe("digits").parts()
    trainer = Trainer(optimizer=parts.optimizer, loss_fn=parts.loss_fn)
    with pytest.raises(ConfigError, match=re.escape(message)):
        trainer.tune_lr(parts.model, parts.train, **kwargs)


def initial_loss(model, dataset) -> float:
    """Cross-entropy of the untrained model over the whole training set (dropout off)."""
    x, y = dataset.tensors
    model.eval()
    with torch.no_grad():
        loss = F.cross_entropy(model(x), y).item()
    model.train()
    return loss


def fastest_falling(parts, grid, steps: int = 20) -> tuple[list[float], dict[float, float]]:
    """The rates of ``grid`` at which ``steps`` steps of AdamW at a fixed rate lower the loss by at
    least half as much as the best rate does (the loss after: the mean of the last 5 steps)."""
    start = copy.deepcopy(parts.model.state_dict())
    base = initial_loss(parts.model, parts.train)
    after = {}
    for lr in grid:
        parts.model.load_state_dict(start)
        fixed = Trainer(optimizer=functools.partial(adamw, lr=lr, weight_decay=1e-4), loss_fn=parts.loss_fn, global_batch_size=64, max_steps=steps, log_every=5)
        after[lr] = fixed.fit(parts.model, parts.train)["train_loss"]
    parts.model.load_state_dict(start)
    best = max(base - loss for loss in after.values())
    return [lr for lr in grid if base - after[lr] >= best / 2], after


GRID = [10 ** (e / 2) for e in range(-8, 1)]  # 1e-4 .. 1, half decades


def test_on_digits_the_suggestion_lies_where_the_loss_falls_fastest_and_nothing_is_changed(tmp_path):
    torch.manual_seed(0)
    parts = get_recipe("digits").parts()
    trainer = Trainer(optimizer=parts.optimizer, loss_fn=parts.loss_fn, global_batch_size=64)
    config_before = trainer.config
    before = {n: t.clone() for n, t in parts.model.state_dict().items()}
    rng_before, py_before = torch.get_rng_state(), random.getstate()
    png = tmp_path / "lr.png"

    result = trainer.tune_lr(parts.model, parts.train, min_lr=1e-5, max_lr=10.0, steps=100, png=str(png))

    # Nothing of the caller's changed: weights bit for bit, the settings, the random streams.
    after = parts.model.state_dict()
    assert all(torch.equal(before[n], after[n]) and before[n].dtype == after[n].dtype for n in before)
    assert trainer.config == config_before and torch.equal(torch.get_rng_state(), rng_before) and random.getstate() == py_before
    assert parts.model.training
    # The sweep: the rate of each recorded step, and a stop once the loss ran away (AdamW at 10 diverges).
    assert result.lrs == pytest.approx(sweep_lrs(1e-5, 10.0, 100)[: len(result.lrs)], rel=1e-9)
    assert result.stopped_early and len(result.lrs) < 100
    assert result.losses[0] == pytest.approx(initial_loss(parts.model, parts.train), abs=0.1)
    # Independently: short runs at fixed rates, the same model and data.
    fast, after_fixed = fastest_falling(parts, GRID)
    print(f"suggested {result.suggestion:.3g}; fastest-falling fixed rates {fast}; loss after 20 steps {after_fixed}")
    assert fast[0] <= result.suggestion <= fast[-1]
    # The picture is a real PNG of the size drawn (7 x 4.2 inches at 120 dpi).
    assert png.read_bytes()[:8] == PNG_SIGNATURE and result.png == str(png)
    assert matplotlib.image.imread(str(png)).shape[:2] == (504, 840)


def test_without_matplotlib_the_png_is_refused_before_the_sweep(monkeypatch):
    import sys

    parts = get_recipe("digits").parts()
    trainer = Trainer(optimizer=parts.optimizer, loss_fn=parts.loss_fn, max_steps=5)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    monkeypatch.setattr(Trainer, "fit", lambda *a, **k: pytest.fail("the sweep ran"))
    with pytest.raises(ConfigError, match=re.escape("the range test's PNG needs matplotlib (pip install 'shardwise[plot]')")):
        trainer.tune_lr(parts.model, parts.train, png="x.png")
