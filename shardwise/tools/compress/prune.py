"""Magnitude pruning of a model's ``nn.Linear`` weights with ``torch.nn.utils.prune``, one-shot or iterative.

Two kinds (Han et al. 2015, "Learning both Weights and Connections for Efficient Neural
Networks", section 3: remove the smallest-magnitude weights, then retrain the rest):

- **unstructured** (global): the ``round(s * N)`` entries of smallest absolute value among all N
  Linear weights of the model are masked (``prune.global_unstructured`` with ``L1Unstructured``
  and a whole-number amount, so the count is exact whatever the ties). Layers keep their shapes;
  the zeros pay off only with sparse storage or sparse kernels.
- **structured**: whole output channels (weight rows, and the bias entries of those rows) of
  every Linear except the model's last (its outputs are the classes or the vocabulary) are masked,
  ``round(s * rows)`` per layer, by smallest L2 norm (``prune.ln_structured``, dim 0). Where a
  module is an attention block (Linear children ``q``, ``k``, ``v`` and an integer ``head_dim``,
  as charlm's), its q/k/v rows are masked a whole head at a time, ``round(s * heads)`` heads of
  smallest joint L2 norm over their q, k and v rows (Michel et al. 2019, "Are Sixteen Heads Really
  Better than One?", section 4, prune heads whole), with ``prune.custom_from_mask``. A removed
  channel or head can then be cut out of the layer for a smaller dense model.

Pruning first re-parametrizes each weight as ``weight_orig * weight_mask`` (a forward pre-hook),
so the masked entries stay zero while fine-tuning updates the rest; `make_permanent` folds the
masks in (``prune.remove``) and leaves plain ``weight`` parameters. Iterative pruning (`prune_to`
called again at a higher sparsity) masks further entries among those still alive, so the total
is again exact. `ModelPruning` is the Trainer callback that does this at given steps.

Under data parallelism every rank holds the same weights, so every rank computes the same masks
from them: no communication is needed (tested at world size 2 under ddp). A checkpoint written
while masks are applied holds ``weight_orig`` and ``weight_mask``; it is not meant for resume.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.utils import prune

from shardwise.errors import ConfigError
from shardwise.strategies import get_strategy
from shardwise.trainer.callbacks import Callback

if TYPE_CHECKING:
    from shardwise.engine import Engine
    from shardwise.trainer.loop import Trainer


def check_sparsity(sparsity: float) -> float:
    if isinstance(sparsity, bool) or not isinstance(sparsity, (int, float)) or not 0 <= sparsity < 1:
        raise ConfigError(f"sparsity must be a fraction in [0, 1) (0.5 masks half the weights); got {sparsity!r}")
    return float(sparsity)


def linears(model: nn.Module) -> list[tuple[str, nn.Linear]]:
    """The model's ``nn.Linear`` layers in module order; ConfigError when there is none."""
    found = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    if not found:
        raise ConfigError(f"{type(model).__name__} has no nn.Linear layer to prune; magnitude pruning here covers Linear weights only")
    return found


def _attention_blocks(model: nn.Module) -> list[tuple[nn.Module, tuple[nn.Linear, nn.Linear, nn.Linear], int]]:
    """(module, its (q, k, v), head count) of each attention block: Linear q, k, v and an integer head_dim."""
    out = []
    for m in model.modules():
        q, k, v, hd = (getattr(m, a, None) for a in ("q", "k", "v", "head_dim"))
        if isinstance(q, nn.Linear) and isinstance(k, nn.Linear) and isinstance(v, nn.Linear) and isinstance(hd, int) and hd > 0 and q.out_features % hd == 0:
            out.append((m, (q, k, v), q.out_features // hd))
    return out


def _mask(module: nn.Module, name: str = "weight") -> torch.Tensor:
    mask = getattr(module, f"{name}_mask", None)
    return mask if isinstance(mask, torch.Tensor) else torch.ones_like(getattr(module, name))


def _row_mask(module: nn.Linear, keep_rows: torch.Tensor) -> None:
    """Mask the weight rows (and bias entries) where ``keep_rows`` is 0, on top of any mask already there."""
    prune.custom_from_mask(module, "weight", keep_rows[:, None].expand_as(module.weight).to(module.weight.dtype))
    if module.bias is not None:
        prune.custom_from_mask(module, "bias", keep_rows.to(module.bias.dtype))


def prune_to(model: nn.Module, sparsity: float, structured: bool = False) -> dict[str, Any]:
    """Mask ``model``'s Linear weights up to ``sparsity`` (masks stay as re-parametrization); returns what was masked.

    Called again with a higher sparsity it masks more among the entries still alive; the result
    counts the same as one call at that sparsity.
    """
    sparsity = check_sparsity(sparsity)
    layers = linears(model)
    if not structured:
        params = [(m, "weight") for _, m in layers]
        total = sum(m.weight.numel() for m, _ in params)
        masked = sum(int((_mask(m) == 0).sum()) for m, _ in params)
        target = round(sparsity * total)
        if target > masked:
            prune.global_unstructured(params, pruning_method=prune.L1Unstructured, amount=target - masked)
        return {"kind": "unstructured", "layers": [n for n, _ in layers], "target_zeros": target, "weights": total}
    heads = _attention_blocks(model)
    in_attention = {id(lin) for _, qkv, _ in heads for lin in qkv}
    last = layers[-1][1]
    done: list[str] = []
    for _, qkv, n_heads in heads:
        hd = qkv[0].out_features // n_heads
        alive = _mask(qkv[0]).view(n_heads, -1).any(dim=1)
        want = round(sparsity * n_heads)
        extra = want - int((~alive).sum())
        if extra <= 0:
            continue
        with torch.no_grad():
            norms = torch.stack([lin.weight.detach().view(n_heads, -1).pow(2).sum(1) for lin in qkv]).sum(0)
        norms = torch.where(alive, norms, torch.full_like(norms, float("inf")))
        drop = torch.topk(norms, extra, largest=False).indices
        keep = torch.ones(n_heads)
        keep[drop] = 0
        keep_rows = keep.repeat_interleave(hd)
        for lin in qkv:
            _row_mask(lin, keep_rows)
    for name, m in layers:
        if m is last or id(m) in in_attention:
            continue
        rows = m.out_features
        pruned_rows = int((_mask(m) == 0).all(dim=1).sum())
        extra = round(sparsity * rows) - pruned_rows
        if extra > 0:
            with torch.no_grad():
                row_norms = m.weight.detach().norm(dim=1)
            row_norms = torch.where((_mask(m) == 0).all(dim=1), torch.full_like(row_norms, float("inf")), row_norms)
            keep_rows = torch.ones(rows)
            keep_rows[torch.topk(row_norms, extra, largest=False).indices] = 0
            _row_mask(m, keep_rows)
        done.append(name)
    attention = [n for n, m in model.named_modules() if any(m is a for a, _, _ in heads)]
    return {"kind": "structured", "channel_layers": done, "head_layers": attention}


def make_permanent(model: nn.Module) -> nn.Module:
    """Fold every pruning mask into its parameter (``prune.remove``): plain parameters with zeros."""
    for m in model.modules():
        for name in ("weight", "bias"):
            if prune.is_pruned(m) and hasattr(m, f"{name}_mask"):
                prune.remove(m, name)
    return model


def masks(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every pruning mask of the model, by buffer name."""
    return {name: buf for name, buf in model.named_buffers() if name.endswith("_mask")}


def sparsity_of(model: nn.Module) -> dict[str, Any]:
    """Zeros among the Linear weights (counted on the weights themselves): total, and per layer."""
    per = {name: (int((m.weight == 0).sum()), m.weight.numel()) for name, m in linears(model)}
    zeros = sum(z for z, _ in per.values())
    total = sum(n for _, n in per.values())
    return {"sparsity": zeros / total, "zeros": zeros, "weights": total, "layers": {k: z / n for k, (z, n) in per.items()}}


def sparse_bytes(model: nn.Module) -> int:
    """Bytes of ``torch.save`` of the state dict with each Linear weight in CSR form (int32 indices):
    4 bytes per kept value, 4 per column index, 4 per row; every other tensor dense."""
    state: dict[str, Any] = {}
    weights = {f"{name}.weight" if name else "weight" for name, _ in linears(model)}
    for key, value in model.state_dict().items():
        if key in weights and value.dim() == 2:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="Sparse CSR tensor support is in beta")
                csr = value.to_sparse_csr()
            state[key] = (csr.crow_indices().int(), csr.col_indices().int(), csr.values(), tuple(value.shape))
        else:
            state[key] = value
    buf = io.BytesIO()
    torch.save(state, buf)
    return buf.getbuffer().nbytes


class ModelPruning(Callback):
    """Prune during training: at each step of ``at_steps`` mask up to the next sparsity of an even
    schedule reaching ``sparsity`` at the last of them, fine-tune in between, fold the masks in at
    the end of fit.

    With ``at_steps=(1, 101, 201)`` and ``sparsity=0.9`` the model is masked to 30%, 60% and 90%
    before steps 1, 101 and 201 (an even schedule; Zhu and Gupta 2017, "To prune, or not to prune",
    section 3, ramp sparsity gradually with training in between). Every rank prunes the same weights
    to the same masks (the weights agree under data parallelism). Made for data-parallel strategies,
    where each rank holds the whole model; a sharded model (zero3, fsdp, tp) is refused at start.

    >>> Trainer(callbacks=[ModelPruning(0.5, at_steps=(1, 51))], max_steps=100)  # doctest: +SKIP
    """

    def __init__(self, sparsity: float, at_steps: Sequence[int] = (1,), structured: bool = False, permanent: bool = True) -> None:
        self.sparsity = check_sparsity(sparsity)
        steps = sorted(set(at_steps))
        if not steps or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in steps):
            raise ConfigError(f"ModelPruning: at_steps must be step numbers >= 1 (the steps before which to prune); got {list(at_steps)!r}")
        self.at_steps = steps
        self.structured = structured
        self.permanent = permanent
        self.history: list[dict[str, Any]] = []

    def check(self, trainer: Trainer, has_val: bool) -> None:
        strategy = trainer.config.strategy
        if isinstance(strategy, str) and not get_strategy(strategy, **trainer.config.strategy_options).whole_model:
            raise ConfigError(f"ModelPruning needs the whole model on every rank; strategy {strategy!r} splits it; use single, ddp, zero1 or zero2")

    def check_model(self, trainer: Trainer, model: nn.Module) -> None:
        linears(model)  # a model with no Linear layer is refused here, not at the first pruning step in the workers

    def _module(self, trainer: Trainer, engine: Engine) -> nn.Module:
        assert trainer.model is not None, "ModelPruning hooks run inside fit"
        return engine.unwrap(trainer.model)

    def on_train_step_start(self, trainer: Trainer, engine: Engine, step: int) -> None:
        if step not in self.at_steps:
            return
        target = self.sparsity * (self.at_steps.index(step) + 1) / len(self.at_steps)
        module = self._module(trainer, engine)
        prune_to(module, target, self.structured)
        self.history.append({"step": step, "target": target, "masked": _masked_fraction(module)})

    def on_fit_end(self, trainer: Trainer, engine: Engine, summary: dict[str, Any]) -> None:
        module = self._module(trainer, engine)
        if self.permanent:
            make_permanent(module)
        summary["pruning"] = {"sparsity": self.sparsity, "structured": self.structured, "rounds": self.history}


def _masked_fraction(model: nn.Module) -> float:
    ws = [_mask(m) for _, m in linears(model)]
    return sum(int((w == 0).sum()) for w in ws) / sum(w.numel() for w in ws)
