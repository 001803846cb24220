"""`single` against the maths: the Trainer and the Engine's own loop against a hand-written loop.

The parity tests hold every strategy to `single`; these hold `single` to arithmetic written out
here, so a bug that `single` shares with the strategies (they all call
`strategies.common.accumulate_backward` and `clip_local`) fails here. In float64 with the whole
data set as the global batch, each step's gradient is the gradient of the mean loss over the same
32 samples whatever their order or micro-batch split, so the Trainer at accumulate 1, 2 and 4, the
Engine, and the hand loop must agree to rounding (1e-12 on weights of order 1; a wrong scale, a
dropped micro-batch or a skipped clip moves them by more than 1e-3).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise.data import epoch_permutation
from shardwise.engine import Engine

N = 32  # the global batch is the whole data set: one step per epoch
STEPS = 6
LR, MOMENTUM, WD = 0.3, 0.9, 0.01
MAX_NORM = 0.05  # far below this model's gradient norms (about 0.3 to 1), so every step clips
TOL = 1e-12


def model64(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def data(dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 5, generator=g, dtype=dtype)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.3).long()
    return TensorDataset(x, y)


def ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def lr_at(step: int) -> float:
    """The schedule, written out: halve every two steps."""
    return 0.5 ** (step // 2)


def schedule(optimizer: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)


def hand_loop(model: nn.Module, steps: int, *, optimizer: str, clip: float | None, scheduled: bool) -> dict[str, Any]:
    """The maths by hand: the gradient of the mean loss over all N samples, the global norm and its
    clip coefficient (torch's: max_norm / (norm + 1e-6), capped at 1), SGD with momentum and weight
    decay written out (AdamW is torch's own: the optimizer is the user's, not the project's)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    x, y = data().tensors
    bufs: list[torch.Tensor | None] = [None] * len(params)
    adam = torch.optim.AdamW(params, lr=0.05, weight_decay=0.1) if optimizer == "adamw" else None
    norms, losses = [], []
    for step in range(steps):
        loss = F.cross_entropy(model(x), y)
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum((g * g).sum() for g in grads))
        norms.append(float(norm))
        losses.append(float(loss.detach()))
        if clip is not None:
            coef = min(1.0, clip / (float(norm) + 1e-6))
            grads = tuple(g * coef for g in grads)
        scale = lr_at(step) if scheduled else 1.0
        with torch.no_grad():
            if adam is not None:
                for p, g in zip(params, grads, strict=True):
                    p.grad = g
                adam.param_groups[0]["lr"] = 0.05 * scale
                adam.step()
                continue
            for i, (p, g) in enumerate(zip(params, grads, strict=True)):
                d = g + WD * p
                bufs[i] = d.clone() if bufs[i] is None else MOMENTUM * bufs[i] + d
                p -= LR * scale * bufs[i]
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()}, "norms": norms, "losses": losses}


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def fit(accumulate: int, *, optimizer: Any = sgd, clip: float | None = None, scheduled: bool = False, steps: int = STEPS) -> dict[str, torch.Tensor]:
    model = model64()
    trainer = Trainer(
        optimizer=optimizer,
        loss_fn=ce,
        lr_scheduler=schedule if scheduled else None,
        precision="64",
        global_batch_size=N,
        accumulate=accumulate,
        max_steps=steps,
        clip_grad_norm=clip,
        log_every=steps,
        progress_bar=False,
    )
    trainer.fit(model, data())
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_trainer_at_accumulate_1_2_4_equals_the_hand_loop_with_clipping_and_a_schedule(optimizer):
    factory = sgd if optimizer == "sgd" else adamw
    ref = hand_loop(model64(), STEPS, optimizer=optimizer, clip=MAX_NORM, scheduled=True)
    # The clip was active on every step (a max norm above the gradients' would prove nothing).
    assert min(ref["norms"]) > 2 * MAX_NORM, ref["norms"]
    assert diff(ref["state"], model64().state_dict()) > 1e-2  # it trained
    for accumulate in (1, 2, 4):
        got = fit(accumulate, optimizer=factory, clip=MAX_NORM, scheduled=True)
        assert diff(ref["state"], got) < TOL, (optimizer, accumulate, diff(ref["state"], got))


def test_accumulation_is_the_mean_over_micro_batches_without_clipping():
    """Without a clip, a wrong scale of the accumulated gradient (a sum where the mean belongs) is
    not renormalized away: SGD moves by the gradient itself."""
    ref = hand_loop(model64(), 3, optimizer="sgd", clip=None, scheduled=False)
    for accumulate in (1, 2, 4):
        got = fit(accumulate, steps=3)
        assert diff(ref["state"], got) < TOL, (accumulate, diff(ref["state"], got))


def test_the_clip_and_the_schedule_each_change_the_result():
    """The hand loop's clip and schedule are not no-ops: leaving either out moves the weights."""
    full = hand_loop(model64(), STEPS, optimizer="sgd", clip=MAX_NORM, scheduled=True)["state"]
    assert diff(full, hand_loop(model64(), STEPS, optimizer="sgd", clip=None, scheduled=True)["state"]) > 1e-2
    assert diff(full, hand_loop(model64(), STEPS, optimizer="sgd", clip=MAX_NORM, scheduled=False)["state"]) > 1e-3


@pytest.mark.parametrize("accumulate", [1, 4])
def test_engine_bring_your_own_loop_equals_the_hand_loop(accumulate):
    engine = Engine(strategy="single", precision="64", accelerator="cpu")
    model, opt = engine.setup(model64(), sgd)
    sched = schedule(opt)
    x, y = engine.to_device(data().tensors)
    step_fn = lambda m, b: ce(m(b[0]), b)  # noqa: E731
    norms = []
    for _ in range(STEPS):
        micro = list(zip(x.chunk(accumulate), y.chunk(accumulate), strict=True))
        loss = engine.forward_backward(model, micro, step_fn)
        norms.append(float(engine.clip_grad_norm(model, opt, MAX_NORM)))
        assert engine.step(opt)
        opt.zero_grad(set_to_none=True)
        sched.step()
    ref = hand_loop(model64(), STEPS, optimizer="sgd", clip=MAX_NORM, scheduled=True)
    # The engine reports the pre-clip norm and the mean loss of the last step, as the hand loop computed them.
    assert norms == pytest.approx(ref["norms"], rel=1e-12, abs=0)
    assert float(loss) == pytest.approx(ref["losses"][-1], rel=1e-12, abs=0)
    assert diff(ref["state"], engine.unwrap(model).state_dict()) < TOL
    engine.close()


def test_engine_backward_on_a_plain_loss_equals_the_hand_loop():
    engine = Engine(strategy="single", precision="64", accelerator="cpu")
    model, opt = engine.setup(model64(), sgd)
    x, y = data().tensors
    for _ in range(3):
        engine.backward(ce(model(x), (x, y)))
        engine.step(opt)
        opt.zero_grad()
    ref = hand_loop(model64(), 3, optimizer="sgd", clip=None, scheduled=False)
    assert diff(ref["state"], model.state_dict()) < TOL
    engine.close()


def test_bf16_mixed_equals_a_hand_written_autocast_loop():
    """Same ops in the same order (the loader's permutation, the same micro-batches, autocast around
    the forward and the loss, backward of loss / 2 in float32): the weights agree bit for bit on CPU.
    A float32 run of the same loop differs, so the autocast really ran."""
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ds = data(torch.float32)
    model = copy.deepcopy(init)
    Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9),
        loss_fn=ce,
        precision="bf16-mixed",
        global_batch_size=N,
        accumulate=2,
        max_steps=4,
        log_every=4,
        progress_bar=False,
    ).fit(model, ds)

    def by_hand(autocast: bool) -> dict[str, torch.Tensor]:
        m = copy.deepcopy(init)
        opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)
        for epoch in range(4):
            idx = epoch_permutation(N, seed=0, epoch=epoch)
            for half in idx.chunk(2):
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                    loss = F.cross_entropy(m(ds.tensors[0][half]), ds.tensors[1][half])
                (loss / 2).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    assert all(v.dtype == torch.float32 for v in got.values())  # bf16-mixed keeps float32 parameters
    assert diff(by_hand(True), got) == 0.0
    assert diff(by_hand(False), got) > 1e-4


def test_16_mixed_equals_a_hand_written_grad_scaler_loop_with_clipping():
    """fp16 autocast with torch's GradScaler, written out: scale(loss / 2).backward() per micro-batch,
    unscale_ before the clip (the clip must see true gradients), then the scaler's step and update:
    bit for bit. Leaving out the unscale gives other weights. (Leaving out the scaling does not, on
    this model: a power-of-two scale is exact unless gradients underflow, which these do not.)"""
    torch.manual_seed(0)
    init = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))
    ds = data(torch.float32)
    x, y = ds.tensors
    model = copy.deepcopy(init)
    Trainer(
        optimizer=lambda p: torch.optim.SGD(p, lr=0.3, momentum=0.9),
        loss_fn=ce,
        precision="16-mixed",
        clip_grad_norm=MAX_NORM,
        global_batch_size=N,
        accumulate=2,
        max_steps=4,
        log_every=4,
        progress_bar=False,
    ).fit(model, ds)

    def by_hand(*, unscale: bool = True) -> tuple[dict[str, torch.Tensor], list[float]]:
        m = copy.deepcopy(init)
        opt = torch.optim.SGD(m.parameters(), lr=0.3, momentum=0.9)
        scaler = torch.amp.GradScaler("cpu")
        norms = []
        for epoch in range(4):
            idx = epoch_permutation(N, seed=0, epoch=epoch)
            for half in idx.chunk(2):
                with torch.autocast("cpu", dtype=torch.float16):
                    loss = F.cross_entropy(m(x[half]), y[half])
                scaler.scale(loss / 2).backward()
            if unscale:
                scaler.unscale_(opt)
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(m.parameters()), MAX_NORM, foreach=True)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad(set_to_none=True)
        return {k: v.detach().clone() for k, v in m.state_dict().items()}, norms

    got = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref, norms = by_hand()
    assert min(norms) > 2 * MAX_NORM, norms  # the clip was active on every step
    assert all(v.dtype == torch.float32 for v in got.values())  # 16-mixed keeps float32 parameters
    assert diff(ref, got) == 0.0
    assert diff(by_hand(unscale=False)[0], got) > 1e-4  # clipping the scaled gradients is another run


class CountingSet(torch.utils.data.Dataset):
    """A data set that is not a TensorDataset (fetched sample by sample) and records every fetch."""

    def __init__(self, base: TensorDataset) -> None:
        self.base, self.seen = base, []

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> Any:
        self.seen.append(int(i))
        return self.base[i]


def test_summary_samples_equal_the_samples_the_model_was_fed():
    """summary["samples"] is held to what the loader fetched, not to steps x global batch: 40 samples,
    a global batch of 16 (two steps an epoch, 8 dropped), five steps -> 80 fetches, each epoch's
    32 distinct."""
    x, y = data().tensors
    counting = CountingSet(TensorDataset(torch.cat([x, x[:8]]), torch.cat([y, y[:8]])))
    fed = []

    def counted_ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
        fed.append(int(output.shape[0]))
        return ce(output, batch)

    summary = Trainer(optimizer=sgd, loss_fn=counted_ce, precision="64", global_batch_size=16, accumulate=2, max_steps=5, log_every=5, progress_bar=False).fit(
        model64(), counting
    )
    assert fed == [8] * 10  # two micro-batches of 8 a step
    # before launch the Trainer reads sample 0 once to check that a batch fits the model's forward
    assert counting.seen[0] == 0
    counting.seen = counting.seen[1:]
    assert len(counting.seen) == sum(fed) == summary["samples"] == 80
    for epoch in range(2):
        assert len(set(counting.seen[epoch * 32 : (epoch + 1) * 32])) == 32


class WithSteps(nn.Module):
    """A module with its own ``training_step`` (cross-entropy plus an L2 penalty) and a different
    ``validation_step`` (plain cross-entropy and accuracy), so using one for the other shows."""

    def __init__(self) -> None:
        super().__init__()
        self.net = model64()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)  # type: ignore[no-any-return]

    def training_step(self, batch: Any) -> torch.Tensor:
        return ce(self(batch[0]), batch) + 0.05 * sum((p * p).sum() for p in self.parameters())

    def validation_step(self, batch: Any) -> dict[str, torch.Tensor]:
        out = self(batch[0])
        return {"loss": ce(out, batch), "accuracy": (out.argmax(-1) == batch[1]).double().mean()}


def test_training_step_and_validation_step_are_the_ones_used():
    """README: a module may define training_step and validation_step instead of loss_fn. The weights
    follow the hand loop on training_step's loss; val_loss and val_accuracy are validation_step's over
    every validation sample (13, in uneven batches of 4), computed here in one pass."""
    model = WithSteps()
    init = copy.deepcopy(model)
    g = torch.Generator().manual_seed(8)
    val = TensorDataset(torch.randn(13, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (13,), generator=g))
    summary = Trainer(
        optimizer=sgd,
        metrics={"accuracy": None},
        precision="64",
        global_batch_size=N,
        accumulate=2,
        max_steps=3,
        log_every=3,
        val_batch_size=4,
        progress_bar=False,
    ).fit(model, data(), val)
    opt = sgd(init.parameters())
    for _ in range(3):
        init.training_step(data().tensors).backward()
        opt.step()
        opt.zero_grad()
    assert diff(init.state_dict(), model.state_dict()) < TOL
    with torch.no_grad():
        out = init(val.tensors[0])
        want_loss = float(F.cross_entropy(out, val.tensors[1]))
        want_acc = float((out.argmax(-1) == val.tensors[1]).double().mean())
    assert summary["val_samples"] == 13
    assert summary["val_loss"] == pytest.approx(want_loss, rel=1e-12, abs=0)
    assert summary["val_accuracy"] == pytest.approx(want_acc, rel=1e-12, abs=0)
