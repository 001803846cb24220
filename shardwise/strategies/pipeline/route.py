"""How a model is cut into stages (`Route`: its block list, its traced forward, or its children in
order), and the float64 proof of a split the tracer did not give (`prove`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from shardwise.strategies.pipeline import traced
from shardwise.strategies.pipeline.nested import (
    NestedLayout,
    NestedStage,
    batch_kwargs,
)
from shardwise.strategies.pipeline.split import StageModule, sequence_layers, split_layers
from shardwise.strategies.pipeline.split import _register as _register  # importable from here, as before the split
from shardwise.strategies.pipeline.ties import Tie

# -- how a model is split ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """How a model is cut into stages: ``nested`` (its block list, `nested`), ``traced`` (its traced
    forward, `traced`) or ``sequence`` (its top-level children in order, `split`)."""

    kind: Literal["nested", "traced", "sequence"]
    names: list[list[str]]
    """The layers (blocks) each stage owns."""
    layout: NestedLayout | None = None
    block_runs: list[list[str]] | None = None
    plan: traced.TracedPlan | None = None
    stage_mods: dict[int, nn.Module] | None = None
    """A traced split's stage modules (over the model's own tensors), built once here and used by ``apply``."""
    ties: list[Tie] | None = None
    """A traced split's weights held by stages of two pipeline ranks."""


def _is_transformers(model: nn.Module) -> bool:
    """A transformers model (any class of its hierarchy defined in the transformers package)."""
    return any(c.__module__.split(".")[0] == "transformers" for c in type(model).__mro__)


def _types(gm: Any, args: tuple[Any, ...], model64: nn.Module) -> dict[str, bool]:
    """Each node's kind (tensor or not) from one run on the sample; in eval mode where training mode
    cannot take one sample (BatchNorm on one row)."""
    try:
        return traced.node_types(gm, args)
    except Exception:
        model64.eval()
        try:
            return traced.node_types(gm, args)
        except Exception as exc:
            raise ConfigError(f"{type(model64).__name__}'s traced forward raises on a sample batch: {type(exc).__name__}: {exc}") from None
        finally:
            model64.train()


def _needs_sample(model: nn.Module, why: str, where: str) -> ConfigError:
    return ConfigError(
        f"cannot split {type(model).__name__} into pipeline stages: {why}, and splitting it by {where} "
        "is only done once a sample batch proves the stages equal the model's forward; train through the "
        "Trainer (which passes its first sample), build the strategy object, call its check_sample(model, batch, layout) "
        "and give it to Engine(strategy=...), or make the forward traceable (no Python control flow on tensor values or sizes)"
    )


PROOF_PARAMETERS = 50_000_000
"""The largest model (parameters) a split by a transformers model's own block list is proven for in
float64 before launch (a copy of 400 MB); larger ones are split unproven, as before."""


def provable(model: nn.Module) -> bool:
    """Whether the float64 proof of a block-list split is affordable for ``model`` (weights present, small)."""
    return not materialize.has_meta(model) and sum(p.numel() for p in model.parameters()) <= PROOF_PARAMETERS


def _prove(model: nn.Module, r: Route, sample: Any, where: str, call: Any = None, eval_mode: bool = False) -> None:
    """The stages of ``r``, on a float64 copy of ``model`` run one after another on ``sample``, give
    the model's own output exactly (`traced.check_composition`), or a `ConfigError` naming where not.
    ``call`` (an `own_step.Call`): the model called as its ``training_step`` calls it (``self(x, y)``);
    ``eval_mode``: dropout off (the stages draw their random numbers in another order)."""
    from shardwise.data.batches import model_args

    if materialize.has_meta(model):
        raise ConfigError(
            f"{type(model).__name__} was built on the meta device, and the pipeline splits it by {where}: a split the "
            "tracer did not give is used only after its stages, run in float64 on the first training sample, give the "
            "model's output exactly, which needs the model's weights. Build this model eagerly for the pipeline, or make "
            "its forward traceable by torch.fx (no assert or branch on a tensor's size or value), or use another strategy"
        )

    model64 = traced.float64_copy(model)
    if eval_mode:
        model64.eval()  # before the stages copy the modules' training flags
    args, kwargs = call.bind(sample) if call is not None else model_args(sample)
    args64, kwargs64 = traced.to_float64(tuple(args)), traced.to_float64(dict(kwargs))
    stage_of: dict[str, int] = {}
    if r.kind == "nested":
        assert r.layout is not None and r.block_runs is not None
        layout, n = r.layout, len(r.block_runs)
        stages: list[nn.Module] = [NestedStage(model64, layout, r.block_runs[s], s == 0, s == n - 1) for s in range(n)]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run} | {p: 0 for p in layout.prelude} | {p: n - 1 for p in layout.postlude}
        order = list(layout.prelude) + [name for run in r.names for name in run] + list(layout.postlude)

        def run() -> Any:
            traced.run_in_turn(stages, (), batch_kwargs(args64, kwargs64), True)
            return stages[-1].output

    else:
        if kwargs:
            raise ConfigError(
                f"{type(model).__name__} is split by its top-level children, which take positional inputs; the batch is a dict ({sorted(kwargs)})"
            )
        runs = split_layers(sequence_layers(model64), len(r.names), [run[0] for run in r.names[1:]])
        stages = [StageModule(run) for run in runs]
        stage_of = {name: s for s, run in enumerate(r.names) for name in run}
        order = [name for run in r.names for name in run]

        def run() -> Any:
            return traced.run_in_turn(stages, args64, {}, False)

    traced.check_composition(model64, args64, kwargs64, stages, run, order, stage_of, where)
