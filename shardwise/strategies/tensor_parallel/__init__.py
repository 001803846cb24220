"""``tp``: Megatron tensor parallelism on DTensor, optionally with sequence parallelism and data parallel.

Here: the `TensorParallel` strategy (options, plan, the rehearsal in the parent) and its run; the
building blocks compositions use are re-exported (`parallelize`, `replicate_grads`,
`shard_data_parallel`, `clip_grad_norm_`, `reduce_partial_grads`, `count_collectives`). The
package by concern and the design notes: docs/strategies/tensor_parallel.md.
"""

from __future__ import annotations

import contextlib
import difflib
import json
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.distributed as dist
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies import compose, materialize
from shardwise.strategies.common import accumulate_backward
from shardwise.strategies.compose import shard_data_parallel  # tp over FSDP2: a composition with the sharded family
from shardwise.strategies.contract import Batch, Layout, OptimizerFactory, Parallel, Placement, StepFn, Strategy, plan_layout
from shardwise.strategies.counting import (
    StepCounts,
    batch_signature,
    collective_counter_mode,
    count_collectives,
    group_names,
    ns_is_input_shard,
)
from shardwise.strategies.precision import Precision
from shardwise.strategies.tensor_parallel.apply import parallelize, synchronize_dropout, tp_info
from shardwise.strategies.tensor_parallel.grads import clip_grad_norm_, reduce_partial_grads, replicate_grads
from shardwise.strategies.tensor_parallel.plan import (
    ATTN_COLWISE,
    ATTN_ROWWISE,
    FUSED,
    MLP_COLWISE,
    MLP_ROWWISE,
    STYLES,
    _sequence_blocks,
    auto_plan,
    check_divisible,
    declared_plan,
    fused_parts,
    resolve,
    resolve_plan,
)
from shardwise.strategies.tensor_parallel.rehearse import rehearse
from shardwise.strategies.tensor_parallel.relayout import check_replicas, fused_layout, to_original, to_run
from shardwise.strategies.tensor_parallel.roles import roles

__all__ = [
    "ATTN_COLWISE",
    "ATTN_ROWWISE",
    "FUSED",
    "MLP_COLWISE",
    "MLP_ROWWISE",
    "STYLES",
    "TensorParallel",
    "TensorParallelRun",
    "auto_plan",
    "check_divisible",
    "check_model_fits",
    "check_replicas",
    "clip_grad_norm_",
    "count_collectives",
    "declared_plan",
    "group_names",
    "ns_is_input_shard",
    "parallelize",
    "reduce_partial_grads",
    "replicate_grads",
    "resolve",
    "resolve_plan",
    "roles",
    "shard_data_parallel",
    "synchronize_dropout",
]


# -- the strategy ------------------------------------------------------------------------------

DP_STRATEGIES = ("ddp", "fsdp")
"""How the data-parallel dimension of a dp x tp mesh may stay in sync (the choices of ``dp_strategy``)."""


def check_model_fits(model: nn.Module, plan: dict[str, str] | None, tp: int, sequence_parallel: bool, dp_strategy: str) -> dict[str, str]:
    """Refuse a model ``plan`` does not fit at degree ``tp``, with the `ConfigError` a user reads:
    the plan itself (styles, names, linears), widths and heads (key/value heads included) divisible
    by ``tp``, blocks for sequence parallelism, a role for every module (the backstop), and a fused
    q|k|v split by heads only with ``dp_strategy`` ``"ddp"``. Needs no process group: `TensorParallel.plan`
    runs it in the parent, `TensorParallel.apply` again on each rank at the mesh's degree.
    Returns the resolved plan (``{linear name: style}``)."""
    resolved, grad_sum, _ = resolve(model, plan, tp)
    if sequence_parallel:
        _sequence_blocks(model, resolved)
    roles(model, resolved, grad_sum, sequence_parallel)  # the backstop: a module no rule covers
    permuted = [n for n, st in resolved.items() if st in ("packed_colwise", "moe_tp_experts")]
    if dp_strategy == "fsdp" and permuted:
        raise ConfigError(
            f"{permuted[0]} ({resolved[permuted[0]]}) is split with its gate|up halves permuted per rank, which runs with "
            "dp_strategy 'ddp' only; got dp_strategy 'fsdp'. Use dp_strategy='ddp'"
        )
    if dp_strategy == "fsdp" and any(fused_parts(model, n) for n, st in resolved.items() if st == "colwise"):
        raise ConfigError(
            "a fused q|k|v projection split by heads (permuted per rank) runs with dp_strategy 'ddp' only; got dp_strategy 'fsdp'. Use dp_strategy='ddp'"
        )
    return resolved


@dataclass(frozen=True, init=False)
class TensorParallel(Strategy):
    """Megatron tensor parallelism over ``tp`` ranks, data parallel (ddp or fsdp) over the rest.

    The plan option is ``tp_plan`` (the pipeline strategy's name for the same thing): ``plan`` is
    the contract's method. The constructor still takes ``plan=`` (its name before the contract),
    so ``TensorParallel(plan={...})`` and ``strategy_options.plan`` keep working.
    """

    name: ClassVar[str] = "tp"
    compile_unit: ClassVar[str] = "blocks"  # DTensor blocks, as torchtitan compiles them
    shards_meta: ClassVar[bool] = True  # split on the meta model, then each rank fills its shards
    whole_model: ClassVar[bool] = False
    smaller_last_batch: ClassVar[bool] = True

    tp: int | None = None
    """Tensor-parallel degree: how many ranks split each linear pair (default: the mesh's tp, else the world size)."""
    sequence_parallel: bool = False
    """Shard the activations between the split pairs (norms, dropout, residual) along the sequence."""
    tp_plan: dict[str, str] | None = None
    """Module (a '*' is one segment) -> colwise|rowwise|packed_colwise|colwise_gather_output|rowwise_split_input or JSON; default: declared, else auto."""
    dp_strategy: Literal["ddp", "fsdp"] = "ddp"
    """Data parallel over the rest: ddp (one gradient allreduce per step) or fsdp (FSDP2 over the dp dimension)."""
    count_collectives: bool = True
    """Count and record DTensor's collectives: a dispatch mode on a batch shape's first steps and every 32nd, replayed in between."""
    check_replicas: bool = False
    """After every step, compare the replicated parameters across the tp ranks bit for bit (a debug check)."""
    cp: int = 1
    """Context parallelism: split each sequence over this many ranks (attention by ring or Ulysses); they share samples."""
    cp_style: Literal["ring", "ulysses"] = "ring"
    """How context-parallel attention sees the whole sequence: ring (key/value blocks passed round) or ulysses (all-to-all over heads)."""

    def __init__(
        self,
        tp: int | None = None,
        sequence_parallel: bool = False,
        tp_plan: dict[str, str] | str | None = None,
        dp_strategy: Literal["ddp", "fsdp"] = "ddp",
        count_collectives: bool = True,
        check_replicas: bool = False,
        cp: int = 1,
        cp_style: Literal["ring", "ulysses"] = "ring",
        *,
        plan: dict[str, str] | str | None = None,
    ) -> None:
        if plan is not None and tp_plan is not None:
            raise ConfigError("the tensor-parallel plan was given twice, as tp_plan and as plan (its old name); give tp_plan only")
        values = dict(
            tp=tp,
            sequence_parallel=sequence_parallel,
            tp_plan=tp_plan if plan is None else plan,
            dp_strategy=dp_strategy,
            count_collectives=count_collectives,
            check_replicas=check_replicas,
            cp=cp,
            cp_style=cp_style,
        )
        for key, value in values.items():
            object.__setattr__(self, key, value)
        self.__post_init__()

    def __post_init__(self) -> None:
        compose.check_context_parallel_options(self.name, self.cp, self.cp_style)
        tp = self.tp
        if tp is not None and (isinstance(tp, bool) or not isinstance(tp, int) or tp < 1):
            raise ConfigError(f"tp must be a whole number >= 1; got {tp!r}")
        if self.dp_strategy not in DP_STRATEGIES:
            close = difflib.get_close_matches(str(self.dp_strategy), DP_STRATEGIES, n=1)
            raise ConfigError(f"dp_strategy must be 'ddp' or 'fsdp'; got {self.dp_strategy!r}" + (f". Did you mean {close[0]!r}?" if close else ""))
        plan: Any = self.tp_plan
        if isinstance(plan, str):  # JSON text (a TOML inline table from --set arrives as a dict already)
            try:
                plan = json.loads(plan)
            except ValueError:
                raise ConfigError(f"tp_plan must be a dict of module name (or pattern) -> 'colwise'|'rowwise', or its JSON text; got {plan!r}") from None
        if plan is not None:
            if not isinstance(plan, dict) or not plan:
                raise ConfigError(f"tp_plan must be a non-empty dict of module name (or pattern) -> 'colwise'|'rowwise'; got {plan!r}")
            for key, style in plan.items():
                if style not in STYLES:
                    close = difflib.get_close_matches(str(style), STYLES, n=1)
                    raise ConfigError(
                        f"tp_plan[{key!r}] = {style!r} is not a style."
                        + (f" Did you mean {close[0]!r}?" if close else "")
                        + " Styles: "
                        + ", ".join(map(repr, STYLES))
                    )
            plan = dict(plan)
        object.__setattr__(self, "tp_plan", plan)
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel))
        object.__setattr__(self, "check_replicas", bool(self.check_replicas))

    def tp_degree(self, world_size: int, mesh: Mapping[str, int] | None = None) -> int:
        """The tp degree for ``world_size`` processes: ``tp``, else the mesh settings' ``tp``, else the world size."""
        return self.tp or int((mesh or {}).get("tp") or 0) or world_size

    def check_precision(self, precision: str, layout: Layout) -> None:
        if precision == "16-mixed" and not (layout.degrees.get("dp", 1) > 1 and self.dp_strategy == "fsdp"):
            # torch's GradScaler unscales all gradients in one foreach call, which refuses a mix of
            # DTensor (split linears) and plain tensors (embedding, head).
            raise ConfigError(
                "strategy 'tp' does not run with precision '16-mixed' (torch's GradScaler cannot unscale a mix of "
                "DTensor and plain gradients); use precision 'bf16-mixed', which needs no scaler, or '32'"
            )

    def plan(self, world_size: int, model: nn.Module | None = None, batch: Batch | None = None, mesh: Mapping[str, int] | None = None) -> Layout:
        """The dp x tp layout; with ``cp`` > 1, that of the world less its cp factor, cp inserted (the cp ranks share samples)."""
        return compose.context_parallel_layout(lambda w: self._plan(w, model, batch, mesh), world_size, self.cp, self.name)

    def _plan(self, world_size: int, model: nn.Module | None, batch: Batch | None, mesh: Mapping[str, int] | None) -> Layout:
        pp = int((mesh or {}).get("pp", 1))
        if pp != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={pp}. Use strategy 'pipeline' with --tp for pp x tp")
        tp = self.tp_degree(world_size, mesh)
        if isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1 and world_size % tp:
            shapes = ", ".join(f"dp{world_size // d} x tp{d}" for d in range(1, world_size + 1) if world_size % d == 0)
            raise ConfigError(f"tp {tp} does not divide the world size {world_size}; valid shapes: {shapes} (set --tp to one of the tp degrees)")
        layout = plan_layout(self.name, world_size, batch=batch, mesh=mesh, own={"tp": tp})
        if model is not None:
            resolved = check_model_fits(model, self.tp_plan, tp, self.sequence_parallel, self.dp_strategy)
            layout = replace(layout, units=tuple(resolved))
        return layout

    def check_sample(self, model: nn.Module, batch: Any, layout: Layout) -> None:
        """Rehearse the split on one sample batch in the parent (`rehearse.rehearse`: meta tensors, a fake
        process group): a module the split would leave mixed or misshapen is a `ConfigError` naming it."""
        rehearse(model, batch, self.tp_plan, int(layout.degrees.get("tp", 1)), self.sequence_parallel)
        compose.check_context_parallel(model, batch, self.cp, self.cp_style, self.name)

    def apply(self, model: nn.Module, make_optimizer: OptimizerFactory, mesh: Mesh, recorder: Recorder) -> TensorParallelRun:
        if not dist.is_initialized():
            raise ConfigError("strategy 'tp' needs a process group; start the run through shardwise (Trainer, launch, or shardwise run)")
        if mesh.size("pp") != 1:
            raise ConfigError(f"strategy 'tp' runs on a dp x tp mesh; got pp={mesh.size('pp')}. Use strategy 'pipeline' with --tp for pp x tp")
        mesh = compose.apply_context_parallel(model, mesh, recorder, self.cp_style)  # cp first; tp inside, dp over dp x cp
        degree, dp = mesh.size("tp"), mesh.size("dp")
        check_model_fits(model, self.tp_plan, degree, self.sequence_parallel, self.dp_strategy)  # on every rank, before any group is built
        model = materialize.to_device(model, mesh.device)
        tp_mesh = mesh.device_mesh("tp")  # the run's mesh is dp-major, tp fastest
        parallelize(model, tp_mesh, self.tp_plan, self.sequence_parallel, recorder=recorder)
        names = group_names(tp=tp_mesh.get_group())
        dp_group: Group | None = None
        if dp > 1:
            dp_mesh = mesh.device_mesh("dp")
            names.update(group_names(dp=dp_mesh.get_group()))
            dp_group = Group("dp", dp_mesh.get_group())
            if self.dp_strategy == "fsdp":
                shard_data_parallel(model, dp_mesh)
        materialize.fill_share(model, [model], mesh.device, fused_layout(model))  # a meta-built model: this rank's shards only
        params = list(model.parameters())
        return TensorParallelRun(model, make_optimizer(params), self, Group("tp", tp_mesh.get_group()), dp_group, names, recorder)


class TensorParallelRun(Parallel):
    """One rank's share of a dp x tp run: the model split in place by `parallelize` (its module
    names are the user's), FSDP2 over dp or the dp gradient allreduce, and the step's collective counts.

    Gradients are finished (sequence-parallel partial sums reduced, dp replicas averaged) before
    clipping and before the optimizer step, however backward was called: through
    `forward_backward`, or ``engine.backward`` in a loop of the user's own (a forward hook marks a
    backward round; an optimizer step pre-hook finishes it).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        strategy: TensorParallel,
        tp_group: Group,
        dp_group: Group | None,
        names: dict[str, tuple[str, int]],
        recorder: Recorder,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.placement = Placement()  # every rank trains; tp ranks of one dp coordinate read the same data shard
        self._strategy, self._recorder = strategy, recorder
        self._tp_group, self._dp_group, self._names = tp_group, dp_group, names
        self.degree, self.dp = tp_group.size, dp_group.size if dp_group is not None else 1
        info = tp_info(model)
        if info is None:
            raise ValueError(f"{type(model).__name__} was not split by parallelize(): the tp run has no plan to report")
        self.applied: dict[str, str] = dict(info["plan"])
        self.roles: dict[str, Any] = {
            "plan_source": info["source"],
            "grad_summed": list(info["sum"]),
            "whole": list(info["whole"]),
            "fused": sorted(info["fused"]),
        }
        self.params = list(model.parameters())
        self.counts: Counter[tuple[str, str, str]] = Counter()
        self._sampler = StepCounts()
        self.steps = 0
        self._dirty = False
        self._report: dict[str, Any] | None = None
        model.register_forward_pre_hook(self._mark_dirty)
        optimizer.register_step_pre_hook(lambda opt, args, kwargs: self.finish_grads())

    def _mark_dirty(self, module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():
            self._dirty = True

    def _fsdp(self) -> bool:
        return self.dp > 1 and self._strategy.dp_strategy == "fsdp"

    def finish_grads(self) -> None:
        """Reduce sequence-parallel partial gradients and (ddp) average over dp, once per backward round.

        Called after forward_backward, by clip_grad_norm and before every optimizer step; a no-op
        when nothing ran forward with gradients since the last call. Under ddp, accumulation
        needs no ``no_sync``: the one allreduce runs on the summed gradients before the step.
        """
        if not self._dirty:
            return
        self._dirty = False
        reduce_partial_grads(self.model, self._recorder)  # sequence-parallel norms, declared per-head norms
        if self.dp > 1 and self._strategy.dp_strategy == "ddp" and self._dp_group is not None:
            replicate_grads(self.model, self._dp_group, self._recorder)

    def module(self) -> nn.Module:
        return self.model  # parallelize_module and fully_shard change the module in place; names stay the user's

    def forward_backward(self, microbatches: Sequence[Any], step_fn: StepFn, precision: Precision) -> torch.Tensor:
        mode = None
        if self._strategy.count_collectives:
            signature = batch_signature(microbatches)
            if self._sampler.must_count(signature):
                mode = collective_counter_mode()(self._recorder, self._names)
            else:
                self._sampler.replay(signature, self._recorder, self.counts)
        if mode is not None:
            inner = step_fn

            def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:  # forward; the rest is backward (FSDP's final callbacks included)
                mode.phase = "forward"
                try:
                    return inner(model, batch)
                finally:
                    mode.phase = "backward"

        with mode if mode is not None else contextlib.nullcontext():
            loss = accumulate_backward(self.model, microbatches, step_fn, precision, no_sync=self.no_sync)
        if mode is not None:
            self.counts.update(mode.counts)
            self._sampler.counted_step(signature, mode.log)
        self.steps += 1
        self.finish_grads()
        return loss

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        # ddp: nothing to skip (the dp allreduce runs once, in finish_grads); fsdp: accumulate
        # unsharded gradients and reduce-scatter their sum on the last micro-batch.
        fsdp = self._fsdp()
        if fsdp:
            self.model.set_requires_gradient_sync(False)  # type: ignore[operator]
        try:
            yield
        finally:
            if fsdp:
                self.model.set_requires_gradient_sync(True)  # type: ignore[operator]

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self.finish_grads()
        return clip_grad_norm_(self.params, max_norm, self._recorder)

    def state_dict(self, optimizer: bool) -> dict[str, Any]:
        from shardwise.checkpoint import dtensor_state_dict

        return to_original(self.model, dtensor_state_dict(self.model, self.optimizer if optimizer else None))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Sharded state (DTensors, from a tp/fsdp checkpoint) or whole tensors (from single/ddp);
        the optimizer loads when ``state`` holds one."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        from shardwise.checkpoint import has_dtensor, optimizer_state_by_name, parameter_names

        full = not has_dtensor(state["model"])
        state = to_run(self.model, state)
        options = StateDictOptions(full_state_dict=full, broadcast_from_rank0=False)
        set_model_state_dict(self.model, state["model"], options=options)
        if "optimizer" in state:
            osd = state["optimizer"]
            if any(isinstance(k, int) for k in osd.get("state", {})) or any(isinstance(i, int) for g in osd["param_groups"] for i in g["params"]):
                osd = optimizer_state_by_name(osd, parameter_names(self.model, self.optimizer))
            set_optimizer_state_dict(self.model, self.optimizer, osd, options=options)

    def after_step(self, step: int) -> None:
        """With ``check_replicas``: the replicated parameters must be equal bit for bit across the tp
        ranks after every step (`relayout.check_replicas` names the first that differs)."""
        if self._strategy.check_replicas:
            check_replicas(self.model, self._tp_group, recorder=self._recorder)

    def save_extra_state(self, directory: Path) -> None:
        return None  # the model's and optimizer's DTensors hold everything (fused weights saved in the original layout)

    def load_extra_state(self, path: Path) -> None:
        return None

    def finish(self) -> None:
        return None  # nothing to gather or stop: each rank counted its own collectives as they ran

    def summary(self) -> dict[str, Any]:
        s = self._strategy
        steps = max(self.steps, 1)
        per_step: dict[str, dict[str, float]] = {}
        for (group, kind, phase), n in sorted(self.counts.items()):
            per_step.setdefault(f"{group}/{kind}", {})[phase] = n / steps
        return {
            "tp": {
                "degree": self.degree,
                "dp": self.dp,
                "dp_strategy": s.dp_strategy if self.dp > 1 else None,
                "sequence_parallel": s.sequence_parallel,
                "plan": self.applied,
                **self.roles,
                "collectives_per_step": per_step if s.count_collectives else None,
                "counted_steps": self.steps if s.count_collectives else 0,
                "counting": self._sampler.summary() if s.count_collectives else None,
            }
        }
