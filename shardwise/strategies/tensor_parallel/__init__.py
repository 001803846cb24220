"""``tp``: Megatron tensor parallelism on DTensor, optionally with sequence parallelism and data parallel.

Megatron-LM (Shoeybi et al. 2019) splits each transformer block's two matrix products inside
the layer: the first linear of a pair by output columns (``ColwiseParallel``: every rank holds
``1/tp`` of the output features, for attention whole heads), the second by input rows
(``RowwiseParallel``: every rank computes a partial sum, added across ranks). Between them no
communication is needed; each pair costs Megatron's ``f`` (identity forward, allreduce backward)
before the column-split linears and ``g`` (allreduce forward, identity backward) after the
row-split one. A block (attention + MLP) is therefore exactly 2 allreduces forward and 2
backward (tested). Here ``f`` and ``g`` are DTensor's own: ``parallelize_module`` with
``ColwiseParallel`` / ``RowwiseParallel``, and ``PrepareModuleInput`` on a sublayer whose input
feeds several column-split linears (q, k, v), so the three input gradients are summed once.
Sequence parallelism (Korthikanti et al. 2022) shards the activations between the pairs along
the sequence, with the same bytes sent.

The package, by concern:

- ``plan``: which linears split how (`declared_plan`, `auto_plan`, `resolve_plan`, `check_divisible`); no process
  group needed.
- ``roles``: every other module's rule by its place in the block, and the backstop.
- ``styles``: the split styles for Linear and Conv1D, the fused q|k|v permutation, inputs bound by signature.
- ``relayout``: fused weights back in the original layout on save; `check_replicas`.
- ``apply``: `parallelize`, the sequence-parallel region, `synchronize_dropout`.
- ``grads``: `reduce_partial_grads`, `replicate_grads`, `shard_data_parallel`, `clip_grad_norm_`.
- ``counting``: `count_collectives` and the dispatch mode behind it.
- here: the `TensorParallel` strategy, which calls them in a fixed order (tensor first, then data
  parallel).

Building blocks, for compositions with pipeline parallelism (stable signatures):

- `parallelize(module, tp_mesh, plan=None, sequence_parallel=False)`: in place, on a module whose
  submodules keep their original names (a whole model or a pipeline stage).
- `replicate_grads(module, dp_group, recorder=None)`: average every gradient's local tensor over
  the data-parallel group (one coalesced allreduce per dtype): data parallel for DTensor modules.
- `shard_data_parallel(module, dp_mesh, units="auto")`: FSDP2 ``fully_shard`` over the dp mesh
  (2D with tp when ``dp_mesh`` and the tp mesh are slices of one DeviceMesh).
- `clip_grad_norm_(parameters, max_norm, recorder=None)`: the global norm over DTensor (any mesh,
  any placements) and plain gradients.
- `reduce_partial_grads(module, recorder=None)`: after backward under sequence parallelism, the
  norm weights' partial gradients summed over tp (one coalesced allreduce).
- `count_collectives(recorder=None, **groups)`: count (and record) DTensor's and FSDP2's collectives.

Dropout on replicated activations draws the same mask on every tp rank (`synchronize_dropout`).
fp16 with a grad scaler is refused (torch's GradScaler cannot unscale mixed DTensor and plain
gradients); bf16-mixed runs.
"""

from __future__ import annotations

import contextlib
import difflib
from collections import Counter
from typing import Any, ClassVar, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.mesh import Mesh
from shardwise.precision import Precision
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.protocol import OptimizerFactory, StepFn
from shardwise.strategies.tensor_parallel.apply import parallelize, synchronize_dropout
from shardwise.strategies.tensor_parallel.counting import _collective_counter_mode, count_collectives, group_names, ns_is_input_shard
from shardwise.strategies.tensor_parallel.grads import clip_grad_norm_, reduce_partial_grads, replicate_grads, shard_data_parallel
from shardwise.strategies.tensor_parallel.plan import (
    ATTN_COLWISE, ATTN_ROWWISE, FUSED, MLP_COLWISE, MLP_ROWWISE, STYLES, _sequence_blocks, auto_plan, check_divisible, declared_plan,
    fused_parts, resolve, resolve_plan,
)
from shardwise.strategies.tensor_parallel.roles import roles
from shardwise.strategies.tensor_parallel.relayout import check_replicas, to_original, to_run

__all__ = [
    "ATTN_COLWISE", "ATTN_ROWWISE", "FUSED", "MLP_COLWISE", "MLP_ROWWISE", "STYLES", "TensorParallel", "auto_plan",
    "check_divisible", "check_replicas", "clip_grad_norm_", "count_collectives", "declared_plan", "group_names", "ns_is_input_shard", "parallelize",
    "reduce_partial_grads", "replicate_grads", "resolve", "resolve_plan", "roles", "shard_data_parallel", "synchronize_dropout",
]


# -- the strategy ------------------------------------------------------------------------------


def _dim_mesh(mesh: Mesh, dim: str) -> Any:
    """The DeviceMesh of one dimension of the run's mesh (dp-major, tp fastest)."""
    public = getattr(mesh, "device_mesh", None)
    if callable(public):
        return public(dim)
    return mesh._device_mesh()[dim]


class TensorParallel:
    """Megatron tensor parallelism over ``tp`` ranks, data parallel (ddp or fsdp) over the rest.

    Options: ``tp`` (degree; default the world size), ``sequence_parallel``, ``plan`` (module
    name or pattern -> ``"colwise"``/``"rowwise"``; default automatic), ``dp_strategy``
    (``"ddp"``: one allreduce of the gradients per step over the dp group; ``"fsdp"``: FSDP2
    over the dp dimension of the 2D mesh), ``count_collectives`` (record DTensor's collectives
    each step through a dispatch mode; costs a little Python per operator).
    """

    name: ClassVar[str] = "tp"

    def __init__(
        self, *, tp: int | None = None, sequence_parallel: bool = False, plan: dict[str, str] | None = None,
        dp_strategy: str = "ddp", count_collectives: bool = True, check_replicas: bool = False,
    ) -> None:
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"tp must be a whole number >= 1; got {tp!r}")
        if dp_strategy not in ("ddp", "fsdp"):
            close = difflib.get_close_matches(str(dp_strategy), ["ddp", "fsdp"], n=1)
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {dp_strategy!r}" + (f". Did you mean {close[0]!r}?" if close else ""))
        if isinstance(plan, str):  # JSON text (a TOML inline table from --set arrives as a dict already)
            import json

            try:
                plan = json.loads(plan)
            except ValueError:
                raise ConfigError(f"plan must be a dict of module name (or pattern) -> 'colwise'|'rowwise', or its JSON text; got {plan!r}") from None
        if plan is not None:
            if not isinstance(plan, dict) or not plan:
                raise ConfigError(f"plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
            for key, style in plan.items():
                if style not in STYLES:
                    close = difflib.get_close_matches(str(style), STYLES, n=1)
                    raise ConfigError(f"plan[{key!r}] = {style!r} is not a style." + (f" Did you mean {close[0]!r}?" if close else "") + " Styles: 'colwise', 'rowwise'")
        self.tp, self.sequence_parallel, self.plan, self.dp_strategy = tp, bool(sequence_parallel), plan, dp_strategy
        self.count = count_collectives
        self.check_replicas = bool(check_replicas)
        self.tp_group: Any = None
        self.degree, self.dp = tp or 1, 1
        self.applied: dict[str, str] = {}
        self.recorder: Recorder | None = None
        self.dp_group: Group | None = None
        self.names: dict[str, tuple[str, int]] = {}
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self.steps = 0
        self._world_tp: int | None = None
        self._model: nn.Module | None = None
        self.roles: dict[str, Any] = {}
        self._dirty = False

    def mesh_degrees(self) -> dict[str, int]:
        tp = self.tp or self._world_tp
        return {"tp": tp} if tp is not None else {}

    def validate(self, world_size: int) -> None:
        tp = self.tp or world_size
        self._world_tp = world_size  # tp defaults to the world size (validate runs before the mesh is built)
        if world_size % tp:
            shapes = ", ".join(f"dp{world_size // d} x tp{d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(f"tp {tp} does not divide the world size {world_size}; valid shapes: {shapes} (set --tp to one of the tp degrees)")

    def check_model(self, model: nn.Module) -> None:
        """Refuse, before any process starts, a model the plan does not fit: the checks `setup`
        and `parallelize` make that need no process group (plan, widths and heads divisible by
        the tp degree, blocks for sequence parallelism), with the same `ConfigError`.

        The degree is ``tp``, else the world size `validate` saw; without either only the plan
        itself is checked.
        """
        resolved, grad_sum, _ = resolve(model, self.plan, self.tp or self._world_tp)
        if self.sequence_parallel:
            _sequence_blocks(model, resolved)
        roles(model, resolved, grad_sum, self.sequence_parallel)  # the backstop: a module no rule covers
        if self.dp_strategy == "fsdp" and any(fused_parts(model, n) for n, st in resolved.items() if st == "colwise"):
            raise ConfigError("a fused q|k|v projection split by heads (permuted per rank) runs with dp_strategy 'ddp' only; "
                              "got dp_strategy 'fsdp'. Use dp_strategy='ddp'")

    def setup(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> tuple[nn.Module, torch.optim.Optimizer]:
        if not dist.is_initialized():
            raise ConfigError("strategy 'tp' needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={mesh.size('pp')}. Use strategy 'pipeline' with --tp for pp x tp")
        self.degree, self.dp = mesh.size("tp"), mesh.size("dp")
        self.recorder = recorder
        self.check_model(model)  # a bad plan or head count fails here, before any group is built
        model = model.to(mesh.device)
        tp_mesh = _dim_mesh(mesh, "tp")
        parallelize(model, tp_mesh, self.plan, self.sequence_parallel)
        info = model._shardwise_tp  # type: ignore[attr-defined]
        self.applied = dict(info["plan"])
        self.roles = {"plan_source": info["source"], "grad_summed": list(info["sum"]), "whole": list(info["whole"]),
                      "fused": sorted(info["fused"])}
        self.names = group_names(tp=tp_mesh.get_group())
        self.tp_group = tp_mesh.get_group()
        if self.dp > 1:
            dp_mesh = _dim_mesh(mesh, "dp")
            self.names.update(group_names(dp=dp_mesh.get_group()))
            self.dp_group = Group("dp", dp_mesh.get_group())
            if self.dp_strategy == "fsdp":
                shard_data_parallel(model, dp_mesh)
        self.model_params = list(model.parameters())
        self._model = model
        optimizer = make_optimizer(self.model_params)
        # Gradients are finished (sequence-parallel partial sums reduced, dp replicas averaged)
        # before clipping and before the optimizer step, however backward was called: through
        # forward_backward, or engine.backward in a loop of the user's own.
        model.register_forward_pre_hook(self._mark_dirty)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.finish_grads(model))
        return model, optimizer

    def _mark_dirty(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._dirty = True

    def finish_grads(self, model: nn.Module) -> None:
        """Reduce sequence-parallel partial gradients and (ddp) average over dp, once per backward round.

        Called after forward_backward, by clip_grad_norm and before every optimizer step; a no-op
        when nothing ran forward with gradients since the last call. Under ddp, accumulation
        needs no ``no_sync``: the one allreduce runs on the summed gradients before the step.
        """
        if not self._dirty:
            return
        self._dirty = False
        reduce_partial_grads(model, self.recorder)  # sequence-parallel norms, declared per-head norms
        if self.dp > 1 and self.dp_strategy == "ddp" and self.dp_group is not None:
            replicate_grads(model, self.dp_group, self.recorder)

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # parallelize_module and fully_shard change the module in place; names stay the user's

    def _fsdp(self) -> bool:
        return self.dp > 1 and self.dp_strategy == "fsdp"

    def forward_backward(self, model: nn.Module, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        if getattr(precision, "mode", None) == "16-mixed" and not self._fsdp():
            # torch's GradScaler unscales all gradients in one foreach call, which refuses a mix of
            # DTensor (split linears) and plain tensors (embedding, head): fail before the first step.
            raise ConfigError("strategy 'tp' does not run with precision '16-mixed' (torch's GradScaler cannot unscale a mix of "
                              "DTensor and plain gradients); use precision 'bf16-mixed', which needs no scaler, or '32'")
        mode = _collective_counter_mode()(self.recorder, self.names) if self.count else None
        if mode is not None:
            inner = step_fn

            def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # forward; the rest is backward (FSDP's final callbacks included)
                mode.phase = "forward"
                try:
                    return inner(model, batch)
                finally:
                    mode.phase = "backward"
        with mode if mode is not None else contextlib.nullcontext():
            loss = accumulate_backward(model, microbatches, step_fn, precision, no_sync=lambda: self.no_sync(model))
        if mode is not None:
            self.counts.update(mode.counts)
        self.steps += 1
        self.finish_grads(model)
        return loss

    def after_step(self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> None:
        """With ``check_replicas``: after every step, the replicated parameters must be equal bit for
        bit across the tp ranks (`relayout.check_replicas` names the first that differs)."""
        if self.check_replicas and self.tp_group is not None:
            check_replicas(model, self.tp_group)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        # ddp: nothing to skip (the dp allreduce runs once, in finish_grads); fsdp: accumulate
        # unsharded gradients and reduce-scatter their sum on the last micro-batch.
        if self._fsdp():
            model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            if self._fsdp():
                model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor:
        self.finish_grads(model)
        return clip_grad_norm_(self.model_params, max_norm, self.recorder)

    def state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
        from shardwise.strategies.fsdp import dtensor_state_dict

        return to_original(model, dtensor_state_dict(model, optimizer))

    def load_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, state: dict[str, Any]) -> None:
        """Sharded state (DTensors, from a tp/fsdp checkpoint) or whole tensors (from single/ddp)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from shardwise.checkpoint import optimizer_state_by_name, parameter_names
        from shardwise.strategies.fsdp import is_sharded_state

        full = not is_sharded_state(state["model"])
        state = to_run(model, state)
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        set_model_state_dict(model, state["model"], options=options)
        if optimizer is not None and "optimizer" in state:
            osd = state["optimizer"]
            if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                osd = optimizer_state_by_name(osd, parameter_names(model, optimizer))
            set_optimizer_state_dict(model, optimizer, osd, options=options)

    def summary(self) -> dict[str, Any]:
        steps = max(self.steps, 1)
        per_step: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            per_step.setdefault(f"{group}/{kind}", {})[phase] = n / steps
        return {"tp": {
            "degree": self.degree, "dp": self.dp, "dp_strategy": self.dp_strategy if self.dp > 1 else None,
            "sequence_parallel": self.sequence_parallel, "plan": self.applied, **self.roles,
            "collectives_per_step": per_step if self.count else None, "counted_steps": self.steps if self.count else 0,
        }}
