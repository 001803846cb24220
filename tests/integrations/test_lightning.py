"""A module written for Lightning's API trains in shardwise's Trainer (one process here; ddp, zero3
and tp in tests/integrations/test_lightning_dist.py): its parameters equal a plain PyTorch loop over the
same batches, its logged values land in metrics.jsonl with the numbers the plain loop computes,
every ``configure_optimizers`` form gives the schedule built by hand, and what is not supported is
one line naming it, before anything runs. Where Lightning is installed, the same module trained by
Lightning's own Trainer gives the same loss curve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise.data import ShardedLoader
from shardwise.errors import ConfigError
from shardwise.integrations.lightning import LightningModule, parse_optimizers

BATCH, EPOCHS, N, VAL = 16, 2, 64, 37
STEPS_PER_EPOCH = N // BATCH


# -- the module, as a Lightning user writes it ------------------------------------------------------
class ClassifierCode:
    """A small MLP classifier's Lightning code, written once; `LitClassifier` puts it on shardwise's
    base class, the Lightning comparison on ``lightning.LightningModule``."""

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        torch.manual_seed(0)
        self.fc1 = nn.Linear(6, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_loss_avg", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(-1) == y).double().mean(), sync_dist=True)

    def on_train_epoch_end(self) -> None:
        self.log("epochs_done", float(self.current_epoch + 1))

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


class LitClassifier(ClassifierCode, LightningModule):  # type: ignore[misc]
    pass


def data(n: int = N, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 6, generator=g, dtype=torch.float64)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long())


def batch_order(epochs: int = EPOCHS, seed: int = 0) -> list[list[int]]:
    """The indices of each global batch the Trainer draws (seed 0, shuffled per epoch)."""
    loader = ShardedLoader(list(range(N)), global_batch=BATCH, world_size=1, rank=0, seed=seed, collate_fn=lambda xs: list(xs))
    return [list(micro[0]) for _ in range(epochs) for micro in loader]


def hand_loop(epochs: int = EPOCHS) -> dict[str, Any]:
    """The same training in plain PyTorch: parameters, per-step losses and lrs, validation numbers."""
    ref = LitClassifier().double()
    optimizer = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    x, y = data().tensors
    losses, lrs = [], []
    for idx in batch_order(epochs):
        loss = F.cross_entropy(ref(x[idx]), y[idx])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
        lrs.append(optimizer.param_groups[0]["lr"])
    xv, yv = data(VAL, seed=5).tensors
    with torch.no_grad():
        logits = ref(xv)
    return {
        "params": {k: v.detach().clone() for k, v in ref.state_dict().items()},
        "losses": losses,
        "lrs": lrs,
        "val_loss": F.cross_entropy(logits, yv).item(),
        "val_acc": (logits.argmax(-1) == yv).double().mean().item(),
    }


def records(out: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def check_run(model: nn.Module, out: Path, ref: dict[str, Any], *, per_step_loss: bool) -> None:
    """Parameters within 1e-9 of the hand loop; metrics.jsonl holds the logged values it computes."""
    got = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in model.state_dict().items()}
    assert max((got[k].double() - ref["params"][k]).abs().max().item() for k in ref["params"]) < 1e-9
    rows = records(out)
    train = [r for r in rows if "samples_per_s" in r]
    assert [r["step"] for r in train] == list(range(1, EPOCHS * STEPS_PER_EPOCH + 1))
    assert [r["lr"] for r in train] == pytest.approx(ref["lrs"], abs=1e-15)
    if per_step_loss:  # one data-parallel rank: its own step loss is the global one
        assert [r["train_loss"] for r in train] == pytest.approx(ref["losses"], abs=1e-9)
    epochs = [r for r in rows if "train_loss_avg" in r]
    assert [r["epochs_done"] for r in epochs] == [1.0, 2.0]
    for e, r in enumerate(epochs):  # on_epoch: the mean over the epoch's samples on every rank
        assert r["step"] == (e + 1) * STEPS_PER_EPOCH
        want = sum(ref["losses"][e * STEPS_PER_EPOCH : (e + 1) * STEPS_PER_EPOCH]) / STEPS_PER_EPOCH
        assert r["train_loss_avg"] == pytest.approx(want, abs=1e-9)
    val = [r for r in rows if "val_samples" in r]
    assert len(val) == 1 and val[0]["val_samples"] == VAL
    assert val[0]["val_loss"] == pytest.approx(ref["val_loss"], abs=1e-9)
    assert val[0]["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-12)


SETTINGS = dict(precision="64", global_batch_size=BATCH, max_epochs=EPOCHS, log_every=1, progress_bar=False)


def test_single_equals_the_plain_loop_and_logs_into_metrics(tmp_path):
    model = LitClassifier()
    summary = Trainer(strategy="single", out=str(tmp_path), **SETTINGS).fit(model, data(), data(VAL, seed=5))
    ref = hand_loop()
    check_run(model, tmp_path, ref, per_step_loss=True)
    assert summary["val_acc"] == pytest.approx(ref["val_acc"], abs=1e-12)
    assert "trainer" not in model.__dict__ and model._trainer is None and "log" not in model.__dict__  # the module is left as it was


# -- every configure_optimizers form ---------------------------------------------------------------
def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def _step(opt: torch.optim.Optimizer) -> Any:
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)


FORMS: dict[str, Any] = {
    "optimizer": lambda p: (o := _sgd(p), o, None),
    "list": lambda p: ([o := _sgd(p)], o, None),
    "tuple": lambda p: ((o := _sgd(p),), o, None),
    "dict": lambda p: ({"optimizer": (o := _sgd(p))}, o, None),
    "dict+scheduler": lambda p: ({"optimizer": (o := _sgd(p)), "lr_scheduler": (s := _step(o))}, o, ("epoch", 1, s)),
    "dict+step": lambda p: ({"optimizer": (o := _sgd(p)), "lr_scheduler": {"scheduler": (s := _step(o)), "interval": "step"}}, o, ("step", 1, s)),
    "dict+step/2": lambda p: (
        {"optimizer": (o := _sgd(p)), "lr_scheduler": {"scheduler": (s := _step(o)), "interval": "step", "frequency": 2}},
        o,
        ("step", 2, s),
    ),
    "lists": lambda p: ([o := _sgd(p)], [s := _step(o)]) and (([o], [s]), o, ("epoch", 1, s)),
    "lists+dict": lambda p: ([o := _sgd(p)], [s := _step(o)]) and (([o], [{"scheduler": s, "interval": "step"}]), o, ("step", 1, s)),
    "dicts in a list": lambda p: ([{"optimizer": (o := _sgd(p)), "lr_scheduler": (s := _step(o))}], o, ("epoch", 1, s)),
}


class FormModule(LightningModule):
    """Logs the learning rate each step used; returns one of the forms."""

    def __init__(self, form: str) -> None:
        super().__init__()
        self.form = form
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("lr_used", self.opt.param_groups[0]["lr"])
        self.log("batch_idx", float(batch_idx))
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        result, self.opt, _ = FORMS[self.form](self.parameters())
        return result


@pytest.mark.parametrize("form", list(FORMS))
def test_each_configure_optimizers_form_gives_the_schedule_built_by_hand(form, tmp_path):
    epochs = 3
    Trainer(strategy="single", out=str(tmp_path), **{**SETTINGS, "max_epochs": epochs}).fit(FormModule(form), data())
    used = [r["lr_used"] for r in records(tmp_path) if "lr_used" in r]
    # by hand: the scheduler the form describes, stepped after each step (or epoch) as Lightning documents
    _, optimizer, sched = FORMS[form]([nn.Parameter(torch.zeros(1))])
    want = []
    for step in range(1, epochs * STEPS_PER_EPOCH + 1):
        want.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: it only keeps the scheduler's order check quiet
        if sched is not None:
            interval, every, scheduler = sched
            count = step if interval == "step" else step // STEPS_PER_EPOCH
            if (interval == "step" or step % STEPS_PER_EPOCH == 0) and count % every == 0:
                scheduler.step()
    assert used == want
    if sched is not None:
        assert len(set(used)) > 1  # the schedule moved the rate
    assert [r["batch_idx"] for r in records(tmp_path) if "batch_idx" in r] == [float(i % STEPS_PER_EPOCH) for i in range(epochs * STEPS_PER_EPOCH)]


class PlateauModule(FormModule):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> Any:
        self.opt = _sgd(self.parameters())
        self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, factor=0.5, patience=0, threshold=0.5)
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": self.plateau, "interval": "step", "monitor": "train_loss"}}


def test_reduce_on_plateau_reads_the_monitored_value(tmp_path):
    Trainer(strategy="single", out=str(tmp_path), **SETTINGS).fit(PlateauModule("optimizer"), data())
    rows = [r for r in records(tmp_path) if "samples_per_s" in r]
    # by hand: the same scheduler fed the train loss of each step (a 50% threshold: it never improves enough)
    optimizer = _sgd([nn.Parameter(torch.zeros(1))])
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=0.5)
    want = []
    for r in rows:
        want.append(optimizer.param_groups[0]["lr"])
        plateau.step(r["train_loss"])
    assert [r["lr_used"] for r in rows] == want and want[-1] < want[0]


def test_parse_optimizers_forms():
    p = [nn.Parameter(torch.zeros(1))]
    for form, build in FORMS.items():
        result, optimizer, sched = build(p)
        got, config = parse_optimizers(result)
        assert got is optimizer, form
        assert (config is None) == (sched is None), form
        if config is not None:
            assert (config.interval, config.frequency, config.scheduler) == sched, form


# -- what is refused, each in one line naming it ----------------------------------------------------
class Manual(LitClassifier):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class ManualBackward(LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = F.cross_entropy(self(batch[0]), batch[1])
        self.manual_backward(loss)
        return loss


class Toggles(LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.toggle_optimizer(None)
        return F.cross_entropy(self(batch[0]), batch[1])


class TwoOptimizers(LitClassifier):
    def configure_optimizers(self) -> Any:
        return [torch.optim.SGD(self.fc1.parameters(), lr=0.1), torch.optim.SGD(self.fc2.parameters(), lr=0.1)]


class TwoOptimizerLists(LitClassifier):
    def configure_optimizers(self) -> Any:
        one, two = torch.optim.SGD(self.fc1.parameters(), lr=0.1), torch.optim.SGD(self.fc2.parameters(), lr=0.1)
        return [one, two], [_step(one)]


class SkipsBatches(LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return None


class BatchHook(LitClassifier):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        pass


class AfterBackward(LitClassifier):
    def on_after_backward(self) -> None:
        pass


class Setup(LitClassifier):
    def setup(self, stage: str) -> None:
        pass


class OwnStep(LitClassifier):
    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        pass


class PlateauNoMonitor(LitClassifier):
    def configure_optimizers(self) -> Any:
        opt = _sgd(self.parameters())
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.ReduceLROnPlateau(opt)}


class BadInterval(LitClassifier):
    def configure_optimizers(self) -> Any:
        opt = _sgd(self.parameters())
        return {"optimizer": opt, "lr_scheduler": {"scheduler": _step(opt), "interval": "batch"}}


class VectorLog(LitClassifier):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("logits", self(batch[0]))
        return F.cross_entropy(self(batch[0]), batch[1])


REFUSED = {
    Manual: "automatic_optimization = False",
    ManualBackward: "self.manual_backward()",
    Toggles: "self.toggle_optimizer()",
    TwoOptimizers: "returned 2 optimizers",
    TwoOptimizerLists: "returned 2 optimizers",
    BatchHook: "on_train_batch_start()",
    AfterBackward: "on_after_backward()",
    Setup: "setup()",
    OwnStep: "optimizer_step()",
    PlateauNoMonitor: "ReduceLROnPlateau needs",
    BadInterval: "interval must be 'step' or 'epoch'; got 'batch'",
}


@pytest.mark.parametrize("cls", list(REFUSED), ids=lambda c: c.__name__)
def test_unsupported_is_refused_before_anything_runs(cls, tmp_path):
    with pytest.raises(ConfigError) as err:
        Trainer(strategy="ddp", nproc=2, out=str(tmp_path), **SETTINGS).fit(cls(), data())  # refused in the parent: no process starts
    assert REFUSED[cls] in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    ("cls", "settings", "message"),
    [
        (SkipsBatches, {}, "training_step returned None"),
        (VectorLog, {}, "takes a scalar; got a tensor of shape (16, 3)"),
        (LitClassifier, {"optimizer": _sgd}, "drop Trainer(optimizer=...)"),
        (LitClassifier, {"lr_scheduler": _step}, "drop Trainer(lr_scheduler=...)"),
        (LitClassifier, {"loss_fn": lambda out, batch: out.sum()}, "drop Trainer(loss_fn=...)"),
    ],
)
def test_misuse_is_one_line(cls, settings, message):
    with pytest.raises(ConfigError) as err:
        Trainer(strategy="single", **{**SETTINGS, **settings}).fit(cls(), data())
    assert message in str(err.value) and "\n" not in str(err.value)


class NoValidation(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return F.cross_entropy(self.fc(batch[0]), batch[1])

    def configure_optimizers(self) -> Any:
        return _sgd(self.parameters())


def test_validation_data_needs_validation_step():
    with pytest.raises(ConfigError, match=r"defines no validation_step\(batch, batch_idx\)"):
        Trainer(strategy="single", **SETTINGS).fit(NoValidation(), data(), data(VAL))
    with pytest.raises(ConfigError, match=r"Trainer.test but NoValidation defines no test_step"):
        Trainer(strategy="single", **SETTINGS).test(NoValidation(), data(VAL))


# -- validate, test, predict -----------------------------------------------------------------------
class Evaluated(LitClassifier):
    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.log("test_acc", (self(batch[0]).argmax(-1) == batch[1]).double().mean())

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(-1)


def test_validate_test_predict_call_the_lightning_steps():
    model = Evaluated().double()
    xv, yv = data(VAL, seed=5).tensors
    with torch.no_grad():
        logits = model(xv)
    trainer = Trainer(strategy="single", **SETTINGS)
    assert trainer.validate(model, data(VAL, seed=5))["val_acc"] == pytest.approx((logits.argmax(-1) == yv).double().mean().item(), abs=1e-12)
    assert trainer.test(model, data(VAL, seed=5))["test_acc"] == pytest.approx((logits.argmax(-1) == yv).double().mean().item(), abs=1e-12)
    assert torch.equal(trainer.predict(model, data(VAL, seed=5)), logits.argmax(-1))


# -- the same module under Lightning's own Trainer ------------------------------------------------
def test_same_loss_curve_as_lightning(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # importing Lightning sets it; monkeypatch removes it afterwards
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader

    class RealLitClassifier(ClassifierCode, L.LightningModule):  # type: ignore[misc, name-defined]
        pass

    class Losses(L.Callback):  # type: ignore[misc, name-defined]
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self.losses.append(float(outputs["loss"]))

    # Lightning over the very batches our Trainer draws (one epoch's order per epoch)
    order = batch_order()
    per_epoch = [order[e * STEPS_PER_EPOCH : (e + 1) * STEPS_PER_EPOCH] for e in range(EPOCHS)]

    class EpochBatches(torch.utils.data.Sampler):  # type: ignore[type-arg]
        def __init__(self) -> None:
            self.epoch = 0

        def __iter__(self) -> Any:
            batches = per_epoch[self.epoch]
            self.epoch += 1
            return iter(batches)

        def __len__(self) -> int:
            return STEPS_PER_EPOCH

    losses = Losses()
    real = L.Trainer(
        max_epochs=EPOCHS, accelerator="cpu", devices=1, precision="64-true", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, callbacks=[losses],
        default_root_dir=str(tmp_path / "lightning"),
    )  # fmt: skip
    real.fit(RealLitClassifier(), DataLoader(data(), batch_sampler=EpochBatches()))
    ours_model = RealLitClassifier()  # a real LightningModule in shardwise's Trainer, as it is
    Trainer(strategy="single", out=str(tmp_path / "ours"), **SETTINGS).fit(ours_model, data())
    ours = [r["train_loss"] for r in records(tmp_path / "ours") if "samples_per_s" in r]
    assert len(losses.losses) == len(ours) == EPOCHS * STEPS_PER_EPOCH
    assert ours == pytest.approx(losses.losses, abs=1e-6)
    assert ours == pytest.approx(hand_loop()["losses"], abs=1e-9)
