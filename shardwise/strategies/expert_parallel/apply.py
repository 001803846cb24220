"""Expert parallelism applied to one rank's model, inside the data-parallel dimension.

``dp = dp_outer x ep``: data-parallel rank d is in ep group ``d // ep`` (ranks that split the
experts among them and exchange tokens) and in dp_outer group ``d % ep`` (ranks that hold the
same experts). Each rank keeps its own slice of the global batch, as under plain dp.

Gradients, so that the step equals ``single``'s on the global batch: every other parameter is
averaged over all dp ranks by the data-parallel strategy as usual; an expert parameter's gradient
on its owner already sums the contributions of the tokens of its whole ep group (the all-to-all's
backward brings them), each rank's loss a mean over its own slice; so it is summed over dp_outer
and divided by dp (`reduce_grads`). The global gradient norm for clipping counts replicated
gradients once and expert gradients once per ep rank (`clip_grad_norm`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardwise.comm import WORLD, Group, Recorder, all_gather, all_reduce, new_group
from shardwise.comm.mesh import Mesh
from shardwise.errors import ConfigError
from shardwise.strategies.expert_parallel.detect import ExpertsLayer, check_model, forward_args
from shardwise.strategies.expert_parallel.dispatch import dispatch_forward


def _groups(mesh: Mesh, ep: int) -> tuple[Group, Group]:
    """This rank's ep group and dp_outer group (every rank builds every group, in one order)."""
    dp, d = mesh.size("dp"), mesh.coordinate("dp")
    mine, outer = WORLD, WORLD
    for b in range(dp // ep):
        g = new_group(range(b * ep, (b + 1) * ep), name="ep")
        mine = g if d // ep == b else mine
    for j in range(ep):
        g = new_group(range(j, dp, ep), name="ep_outer")
        outer = g if d % ep == j else outer
    return mine, outer


class ExpertParallel:
    """The experts of one rank's model split over its ep group; what a data-parallel run calls."""

    def __init__(self, model: nn.Module, layers: list[ExpertsLayer], mesh: Mesh, ep: int, recorder: Recorder | None) -> None:
        if mesh.size("pp") > 1 or mesh.size("tp") > 1:
            raise ConfigError(f"ep={ep} composes with data parallelism only here (got pp={mesh.size('pp')}, tp={mesh.size('tp')}); use pp=1 and tp=1 with ep")
        self.ep, self.dp, self.recorder = ep, mesh.size("dp"), recorder
        self.group, self.outer = _groups(mesh, ep)
        self.layers = layers
        self.params: dict[str, nn.Parameter] = {}
        rank = self.group.rank
        for layer in layers:
            module = model.get_submodule(layer.name)
            n = layer.num_experts // ep
            for pname in layer.params:
                whole = getattr(module, pname)
                if whole.is_meta:
                    raise ConfigError(f"ep={ep}: '{layer.name}.{pname}' is on the meta device; expert parallelism needs the model built whole")
                setattr(module, pname, nn.Parameter(whole.detach()[rank * n : (rank + 1) * n].clone(), requires_grad=whole.requires_grad))
                self.params[f"{layer.name}.{pname}" if layer.name else pname] = getattr(module, pname)
            for attr, value in list(vars(module).items()):  # the module's own count of its experts (num_experts, ...)
                if "expert" in attr and isinstance(value, int) and not isinstance(value, bool) and value == layer.num_experts:
                    setattr(module, attr, n)
            inner = type(module).forward.__get__(module)
            module.forward = dispatch_forward(module, inner, self.group, recorder, layer.num_experts, layer.name, forward_args(module))
        self._ids = {id(p) for p in self.params.values()}

    def ignore(self, model: nn.Module) -> None:
        """Keep DDP away from the expert parameters (they differ per rank; `reduce_grads` reduces them)."""
        names = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        model._ddp_params_and_buffers_to_ignore = names + [n for n in self.params if n not in names]  # type: ignore[assignment]

    def is_expert(self, p: torch.Tensor) -> bool:
        return id(p) in self._ids

    def reduce_grads(self) -> None:
        """Expert gradients summed over dp_outer and divided by dp (module docstring)."""
        params = list(self.params.values())
        for p in params:
            if p.grad is None and p.requires_grad:
                p.grad = torch.zeros_like(p)
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1) for g in grads])
        all_reduce(flat, "sum", group=self.outer, recorder=self.recorder)
        flat.div_(self.dp)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        """Clip by the global norm (replicated gradients once, expert slices summed over the ep group);
        torch's coefficient ``max_norm / (norm + 1e-6)``, at most 1."""
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        if not grads:
            return torch.zeros(())
        rep = sum(
            (g.double().pow(2).sum() for p in model.parameters() if (g := p.grad) is not None and not self.is_expert(p)), torch.zeros((), dtype=torch.float64)
        )
        norm = self.global_norm(rep.sqrt())
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        torch._foreach_mul_(grads, coef.to(grads[0].dtype))
        return norm.to(grads[0].dtype)

    def global_norm(self, others: torch.Tensor) -> torch.Tensor:
        """The global gradient norm from ``others`` (the norm of every non-expert gradient, the same on
        every rank) and the expert slices' squares summed over the ep group."""
        exp = sum((g.double().pow(2).sum() for p in self.params.values() if (g := p.grad) is not None), torch.zeros((), dtype=torch.float64)).reshape(1)
        all_reduce(exp, "sum", group=self.group, recorder=self.recorder)
        return (others.double().pow(2) + exp[0]).sqrt().to(others.dtype)

    def _whole(self, local: torch.Tensor) -> torch.Tensor:
        return torch.cat(all_gather(local.detach().contiguous(), group=self.group, recorder=self.recorder), dim=0)

    def _part(self, whole: torch.Tensor) -> torch.Tensor:
        n = whole.shape[0] // self.ep
        return whole[self.group.rank * n : (self.group.rank + 1) * n].clone()

    def _optimizer_slots(self, optimizer: torch.optim.Optimizer) -> dict[Any, torch.Size]:
        """The optimizer state's keys of the expert parameters (numbers, as torch's state_dict, and
        names, as torch.distributed.checkpoint's), with their local shapes."""
        slots: dict[Any, torch.Size] = {name: p.shape for name, p in self.params.items()}
        i = 0
        for group in optimizer.param_groups:
            for p in group["params"]:
                if self.is_expert(p):
                    slots[i] = p.shape
                i += 1
        return slots

    def whole_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """``state`` (``{"model": ..., "optimizer": ...}`` of this rank) with every expert tensor whole (collective over ep)."""
        model = dict(state["model"])
        for name in self.params:
            model[name] = self._whole(model[name])
        out = {**state, "model": model}
        if optimizer is not None and "optimizer" in state:
            opt = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
            for i, shape in self._optimizer_slots(optimizer).items():
                if i not in opt["state"]:
                    continue
                slot = dict(opt["state"][i])
                for k, v in slot.items():
                    if isinstance(v, torch.Tensor) and v.shape == shape:
                        slot[k] = self._whole(v)
                opt["state"][i] = slot
            out["optimizer"] = opt
        return out

    def local_state(self, state: dict[str, Any], optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        """The inverse of `whole_state`: this rank's slices of a whole state."""
        model = dict(state["model"])
        for name in self.params:
            model[name] = self._part(model[name])
        out = {**state, "model": model}
        if optimizer is not None and "optimizer" in state:
            opt = {**state["optimizer"], "state": dict(state["optimizer"]["state"])}
            for i, shape in self._optimizer_slots(optimizer).items():
                if i not in opt["state"]:
                    continue
                slot = {
                    k: self._part(v) if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == shape[0] * self.ep else v for k, v in opt["state"][i].items()
                }
                opt["state"][i] = slot
            out["optimizer"] = opt
        return out

    def summary(self) -> dict[str, Any]:
        return {
            "ep": self.ep,
            "dp_outer": self.dp // self.ep,
            "layers": len(self.layers),
            "experts_per_rank": [layer.num_experts // self.ep for layer in self.layers][:1],
        }


def expert_parallel(model: nn.Module, ep: int, mesh: Mesh, recorder: Recorder | None) -> ExpertParallel:
    """Split ``model``'s experts over ep groups of the mesh's dp dimension, in place (checks as `check_model`)."""
    return ExpertParallel(model, check_model(model, ep, mesh.size("dp")), mesh, ep, recorder)
