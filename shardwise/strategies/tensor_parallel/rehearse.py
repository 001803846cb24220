"""A rehearsal of the split in the parent: the model's forward and backward run once, before launch,
on one sample batch, on meta tensors, with the tp layout applied by the same `parallelize` the
workers call.

Why run it rather than read the model: whether a model takes the split is decided by the code in
its ``forward``, which no rule over module names sees. A convolution that receives the DTensor the
split makes of its input, an attention that reshapes its ``1/tp`` heads with a width read from its
whole input (``d // heads``), a bare position table added to a sequence-sharded activation: each
fails in the workers with DTensor's or a shape error, after the launch. Here it fails in the parent,
with the same error, and is reported as a `ConfigError` naming the innermost module that was
running.

How: a copy of the model whose parameters and buffers are meta tensors (no memory, no arithmetic),
a ``fake`` process group of ``tp`` ranks in this process (torch's, whose collectives do nothing:
shapes and placements are exact, values are not; this process is tp rank 0), `parallelize`, one
forward of the sample and a backward of its loss (the first tensor of the output, summed). The
model unsplit runs first on the same meta sample: a forward that cannot run on meta tensors at all
(a data-dependent branch, ``.item()``) is not judged, and the static checks stand alone. Nothing
runs when this process already belongs to a process group (a run that joined torchrun: each rank
checks in ``apply``). torch's own loggers (fake tensors, DTensor's sharding propagation) are
silenced meanwhile: their tracebacks are the error this module reports in one line.
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardwise.errors import ConfigError

_LOGGERS = ("torch", "torch.distributed", "torch._subclasses.fake_tensor", "torch.distributed.tensor")


@contextlib.contextmanager
def quiet_torch() -> Iterator[None]:
    """torch's loggers above CRITICAL while the body runs (a failed meta kernel logs its whole traceback)."""
    saved = [(name, logging.getLogger(name).level) for name in _LOGGERS]
    for name, _ in saved:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for name, level in saved:
            logging.getLogger(name).setLevel(level)


def meta_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers live on the meta device (ties kept)."""
    memo: dict[int, Any] = {}
    for p in model.parameters():
        memo[id(p)] = nn.Parameter(p.detach().to("meta"), requires_grad=p.requires_grad)
    for b in model.buffers():
        memo[id(b)] = b.detach().to("meta")
    return copy.deepcopy(model, memo)


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().to("meta")
    if isinstance(x, dict):
        return {k: _to_meta(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_meta(v) for v in x) if not hasattr(x, "_fields") else type(x)(*(_to_meta(v) for v in x))
    return x


def _first_tensor(out: Any) -> torch.Tensor | None:
    from shardwise.data.batches import output_loss

    loss = output_loss(out)
    if loss is not None:
        return loss
    if isinstance(out, torch.Tensor):
        return out
    values = out.values() if isinstance(out, dict) else out if isinstance(out, (list, tuple)) else ()
    for v in values:
        found = _first_tensor(v)
        if found is not None:
            return found
    return None


class _Where:
    """The stack of modules running (forward) in the copy, to name the one an error came from."""

    def __init__(self, model: nn.Module) -> None:
        self.names = {id(m): n for n, m in model.named_modules()}
        self.stack: list[nn.Module] = []
        self.failed: nn.Module | None = None
        self.phase = "forward"

    @contextlib.contextmanager
    def watch(self) -> Iterator[None]:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        def before(m: nn.Module, args: Any) -> None:
            if id(m) in self.names:
                self.stack.append(m)

        def after(m: nn.Module, args: Any, out: Any) -> None:
            if self.stack and self.stack[-1] is m:
                self.stack.pop()

        handles = [register_module_forward_pre_hook(before), register_module_forward_hook(after)]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def innermost(self) -> tuple[str, nn.Module] | None:
        named = [m for m in self.stack if self.names.get(id(m))]
        if not named:
            return None
        return self.names[id(named[-1])], named[-1]


def _run(model: nn.Module, batch: Any, where: _Where | None = None) -> None:
    from shardwise.data.batches import call_model

    with where.watch() if where is not None else contextlib.nullcontext():
        out = call_model(model, batch)
    loss = _first_tensor(out)
    if loss is not None and loss.requires_grad:
        if where is not None:
            where.phase = "backward"
        loss.sum().backward()


def rehearse(model: nn.Module, batch: Any, plan: dict[str, str] | None, tp: int, sequence_parallel: bool) -> bool:
    """Run ``model`` split at degree ``tp`` on ``batch`` (one sample batch, called as the Trainer calls
    the model) in this process, on meta tensors; raise a `ConfigError` naming the module where the
    split fails. Returns whether the rehearsal ran (False: this process is in a process group, or the
    model does not run on meta tensors even unsplit, so it cannot be judged here)."""
    if dist.is_initialized() or tp < 2:
        return False
    sample = _to_meta(batch)
    with quiet_torch():
        try:
            _run(meta_copy(model), sample)
        except Exception:  # noqa: BLE001 - the model does not run on meta tensors: not ours to judge
            return False
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("fake", rank=0, world_size=tp)
        try:
            mesh = init_device_mesh("cpu", (tp,))
            failed = _try(model, sample, plan, sequence_parallel, mesh)
            if failed is not None and sequence_parallel and _try(model, sample, plan, False, mesh) is not None:
                sequence_parallel = False  # it fails without sequence parallelism too: say the reason that is true for tp itself
                failed = _try(model, sample, plan, False, mesh)
            if failed is not None:
                split, where, exc = failed
                raise ConfigError(_message(model, split, tp, sequence_parallel, where, exc) + _suggest(model, sample, sequence_parallel, mesh, where))
        finally:
            dist.destroy_process_group()
    return True


def _try(model: nn.Module, sample: Any, plan: dict[str, str] | None, sp: bool, mesh: Any) -> tuple[nn.Module, _Where, BaseException] | None:
    """(the split copy, where it was, the error) when the rehearsal fails; None when it runs."""
    from shardwise.strategies.tensor_parallel.apply import parallelize

    copy_ = meta_copy(model)
    where = _Where(copy_)
    try:
        parallelize(copy_, mesh, plan, sp)
        _run(copy_, sample, where)
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure under the split is the user's to see, before launch
        return copy_, where, exc
    return None


def _suggest(model: nn.Module, sample: Any, sp: bool, mesh: Any, where: _Where) -> str:
    """A plan of another linear pair (outside the module that failed) that the rehearsal runs, as a hint; '' when none does."""
    import re

    from shardwise.strategies.tensor_parallel.styles import features, is_splittable

    found = where.innermost()
    avoid = found[0] if found is not None and where.phase == "forward" else None
    linears = [(n, m) for n, m in model.named_modules() if is_splittable(m) and not (avoid and (n == avoid or n.startswith(avoid + ".")))]
    tried: set[tuple[str, str]] = set()
    for (a, first), (b, second) in zip(linears, linears[1:], strict=False):
        if features(first)[1] != features(second)[0] or a.rpartition(".")[0] != b.rpartition(".")[0]:
            continue
        pa, pb = (re.sub(r"(^|\.)\d+(\.|$)", r"\1*\2", n) for n in (a, b))
        if (pa, pb) in tried or len(tried) >= 4:
            continue
        tried.add((pa, pb))
        candidate = {pa: "colwise", pb: "rowwise"}
        try:
            if _try(model, sample, candidate, sp, mesh) is None:
                return f". This plan rehearses without error: tp_plan={candidate}"
        except ConfigError:
            continue
    return ""


def _message(model: nn.Module, split: nn.Module, tp: int, sp: bool, where: _Where, exc: BaseException) -> str:
    from shardwise.strategies.tensor_parallel.apply import tp_info

    mode = f"tp={tp}" + (" with sequence_parallel" if sp else "")
    text = " ".join(str(exc).split("\n")[0].split()).split(", need to convert")[0][:300]
    found = where.innermost()
    if where.phase == "backward" or found is None:
        place = f"in the {where.phase} pass"
        what = ""
    else:
        name, mod = found
        place = f"in {name} ({type(mod).__name__})"
        what = name
    applied = (tp_info(split) or {}).get("plan") or {}
    plan = f" (the plan splits {len(applied)} linears, e.g. {next(iter(applied.items()))})" if applied else ""
    head = (
        f"{type(model).__name__} cannot train under {mode}: its forward, rehearsed in this process on one sample batch with the split "
        f"applied{plan}, fails {place}: {text}."
    )
    if "mixed torch.Tensor and DTensor" in text:
        from shardwise.strategies.tensor_parallel.plan import _sublayers

        # tp lays out the input of each module that holds split linears (Megatron's f) as a DTensor, so
        # everything that module's forward runs sees one, before the linears as well as between them
        holders = [h for h in _sublayers(applied) if not what or h == "" or what == h or what.startswith(h + ".")]
        holder = max(holders, key=len) if holders else None
        held = "the model itself (the split linears are its own children)" if holder == "" else holder
        fix = (
            f" {what or 'A module'} receives a distributed tensor (DTensor): tensor parallelism lays out the input of the module that "
            f"holds the split linears, here {held}, as one, so every layer that module's forward runs sees it, before the split "
            f"linears as well as between them, and a {type(found[1]).__name__ if found else 'layer'} cannot run on it."
        )
        if holder == "":
            fix += " No tp_plan changes that for this model: train it with a data-parallel strategy (ddp, zero1/2/3) or a pipeline"
        else:
            fix += (
                " Train this model with a data-parallel strategy (ddp, zero1/2/3), or pass a tp_plan naming linears held by "
                f"modules whose forward runs only linears and parameter-free operations (not {held})"
            )
    elif sp and what:
        fix = (
            f" Sequence parallelism shards dim 1 (the sequence) inside the blocks, so {what} sees 1/tp of the positions; "
            "turn sequence_parallel off for this model, or move what reads positions out of the blocks"
        )
    elif what:
        fix = (
            f" Under tp {what} runs on 1/tp of the heads or hidden units of the split linears inside it (an attention must reshape "
            "with a head width, e.g. view(b, t, -1, head_dim), not with a width read from its whole input). Pass a tp_plan that "
            "leaves it whole (names other linear pairs), or train this model with a data-parallel strategy"
        )
    else:
        fix = " Pass a tp_plan naming other linear pairs, or train this model with a data-parallel strategy"
    return head + fix
