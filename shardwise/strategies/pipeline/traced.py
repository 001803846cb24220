"""Pipeline stages cut from the model's traced ``forward``: the code between and around the layers
(activations, pooling, reshapes, residual adds, scaling, a bare parameter read in ``forward``)
runs on the stage it belongs to, instead of being skipped. How nodes get a stage, what crosses a
boundary, and the float64 check: docs/strategies/pipeline.md, "The traced split".
"""

from __future__ import annotations

import builtins
import copy
import linecache
import operator
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx, nn

from shardwise.errors import ConfigError
from shardwise.strategies.pipeline.split import split_layers
from shardwise.strategies.pipeline.ties import Tie

_LAYERS = "_shardwise_layers"
"""The key under which a traced GraphModule keeps the model's layers (name, module), in ``__dict__``."""
_SIZE_METHODS = {"size", "dim", "numel", "nelement", "stride", "element_size", "get_device", "ndimension", "is_contiguous", "is_floating_point"}
_SIZE_ATTRS = {"shape", "dtype", "device", "ndim", "is_cuda", "layout", "requires_grad"}


def traced_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The model's layers by original name, in registration order: top-level children with
    ``ModuleList`` / ``ModuleDict`` children expanded into their items."""
    layers: list[tuple[str, nn.Module]] = []
    for name, child in model.named_children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            for sub, item in child.named_children():
                layers.append((f"{name}.{sub}", item))
        else:
            layers.append((name, child))
    return layers


class _LayerTracer(fx.Tracer):
    def __init__(self, leaves: set[str]) -> None:
        super().__init__()
        self.leaves = leaves

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        return module_qualified_name in self.leaves or super().is_leaf_module(m, module_qualified_name)


def trace(model: nn.Module) -> fx.GraphModule:
    """The model's forward as an fx graph whose calls are its layers; a `TraceFailure` saying why not."""
    leaves = {n for n, _ in traced_layers(model)}
    tracer = _LayerTracer(leaves)
    try:
        graph = tracer.trace(model)
    except Exception as exc:  # fx raises TraceError, TypeError, AttributeError... from the user's forward
        raise TraceFailure(_why(exc, model)) from exc
    gm = fx.GraphModule(model, graph, type(model).__name__)
    # by name, the unused ones too (gm holds only what the graph calls); kept under a private key: a plain
    # "layers" attribute would shadow a submodule of that name (model.layers, the commonest block list)
    gm.__dict__[_LAYERS] = traced_layers(model)
    return gm


class TraceFailure(Exception):
    """``torch.fx`` could not trace the model's forward (the message says where and why)."""


def _why(exc: BaseException, model: nn.Module) -> str:
    """The trace error and the line of the user's code it came from."""
    where = ""
    source = sys.modules.get(type(model).__module__)
    files = {getattr(source, "__file__", None)} - {None}
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        if frame.filename in files or ("torch" not in frame.filename and "shardwise" not in frame.filename):
            line = (frame.line or linecache.getline(frame.filename, frame.lineno or 0)).strip()
            where = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} ({line})"
            break
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}{where}"


def _layer_of(target: str, layer_names: Sequence[str]) -> str | None:
    """The layer holding ``target`` (a module or tensor path), or None for the root's own tensors."""
    best = None
    for name in layer_names:
        if (target == name or target.startswith(name + ".")) and (best is None or len(name) > len(best)):
            best = name
    return best


def node_types(gm: fx.GraphModule, args: Sequence[Any]) -> dict[str, bool]:
    """Which nodes produce a tensor, learnt by running ``gm`` on ``args`` (train mode, random state kept)."""
    kinds: dict[str, bool] = {}

    class _Record(fx.Interpreter):
        def run_node(self, n: fx.Node) -> Any:
            result = super().run_node(n)
            kinds[n.name] = isinstance(result, torch.Tensor)
            return result

    with torch.random.fork_rng(devices=[]), torch.no_grad():
        _Record(gm).run(*args)
    return kinds


def static_types(gm: fx.GraphModule) -> dict[str, bool]:
    """Which nodes produce a tensor, read from the ops alone (no sample): sizes, dtypes and
    arithmetic on them are not; every other node is."""
    kinds: dict[str, bool] = {}
    for n in gm.graph.nodes:
        ins = [a for a in n.all_input_nodes]
        if n.op == "call_method" and n.target in _SIZE_METHODS:
            kinds[n.name] = False
        elif n.op == "call_function" and n.target is builtins.getattr:
            kinds[n.name] = not (len(n.args) > 1 and n.args[1] in _SIZE_ATTRS)
        elif n.op == "call_function" and n.target is builtins.len:
            kinds[n.name] = False
        elif n.op == "call_function" and getattr(n.target, "__module__", None) in ("_operator", "operator") and ins:
            if n.target is operator.getitem:
                kinds[n.name] = kinds.get(ins[0].name, True) if isinstance(n.args[0], fx.Node) else True
            else:
                kinds[n.name] = any(kinds.get(a.name, True) for a in ins)
        else:
            kinds[n.name] = True
    return kinds


@dataclass(frozen=True)
class TracedPlan:
    """How a traced forward is cut: pure data keyed by node names (the same on every rank, which
    traces the same code into the same names)."""

    runs: list[list[str]]
    """The layers each stage owns (balanced by parameter count, in first-call order)."""
    compute: list[list[str]]
    """The nodes each stage runs, in graph order (its own and the ones it recomputes)."""
    inputs: list[list[str]]
    """The values each stage takes: the model's inputs on stage 0, the tensors received after."""
    outputs: list[list[str]]
    """The tensors each stage before the last sends on, in graph order."""
    unused: list[str]
    """Layers the forward never calls: held by the last stage, so checkpoints keep them."""


def plan_stages(gm: fx.GraphModule, stages: int, split_points: Sequence[str] | None, is_tensor: dict[str, bool]) -> TracedPlan:
    """Cut the traced graph into ``stages`` (see the module docstring); a `ConfigError` for a split
    the pipeline cannot run (too few layers, a value that cannot cross)."""
    model_layers: list[tuple[str, nn.Module]] = gm.__dict__[_LAYERS]
    names = [n for n, _ in model_layers]
    nodes = list(gm.graph.nodes)
    order: list[str] = []
    for n in nodes:
        if n.op in ("call_module", "get_attr"):
            layer = _layer_of(str(n.target), names)
            if layer is not None and layer not in order and n.op == "call_module":
                order.append(layer)
    unused = [n for n in names if n not in order]
    by_name = dict(model_layers)
    runs = split_layers([(n, by_name[n]) for n in order], stages, split_points)
    stage_of_layer = {n: s for s, run in enumerate(runs) for n, _ in run}
    assigned: dict[str, int | None] = {}
    for n in nodes:
        ins = [st for a in n.all_input_nodes if (st := assigned.get(a.name)) is not None]
        if n.op == "placeholder":
            assigned[n.name] = 0
        elif n.op == "get_attr":
            assigned[n.name] = None  # with its users
        elif n.op == "call_module":
            layer = _layer_of(str(n.target), names)
            own = stage_of_layer.get(layer, 0) if layer is not None else 0
            assigned[n.name] = max([own, *ins])
        elif n.op == "output":
            assigned[n.name] = stages - 1
        else:
            assigned[n.name] = max(ins) if ins else None  # no tensor input: recomputed where used
    by = {n.name: n for n in nodes}
    compute: list[set[str]] = [set() for _ in range(stages)]
    received: list[set[str]] = [set() for _ in range(stages)]
    for s in range(stages):
        todo = [n.name for n in nodes if assigned[n.name] == s and n.op not in ("output", "placeholder")]
        compute[s].update(todo)
        if s == stages - 1:
            todo += [n.name for n in nodes if n.op == "output"]
        while todo:
            node = by[todo.pop()]
            for a in node.all_input_nodes:
                if a.name in compute[s] or a.name in received[s]:
                    continue
                if _need(a, s, assigned, is_tensor, compute, received):
                    todo.append(a.name)
    crossing: list[set[str]] = [set() for _ in range(stages)]  # crossing[b]: from stage b to b + 1
    for s in range(stages):
        for v in received[s]:
            producer = assigned[v]
            assert producer is not None
            for b in range(producer, s):
                crossing[b].add(v)
    position = {n.name: i for i, n in enumerate(nodes)}
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    inputs = [placeholders] + [sorted(crossing[b], key=position.__getitem__) for b in range(stages - 1)]
    outputs = [sorted(crossing[b], key=position.__getitem__) for b in range(stages - 1)] + [[]]
    for s in range(1, stages):
        wrong = [v for v in inputs[s] if not is_tensor.get(v, True)]
        if wrong:
            raise ConfigError(
                f"the pipeline cannot pass {wrong} (not tensors) from stage {s - 1} to stage {s} of the traced forward; use split_points to move the cut"
            )
    return TracedPlan(
        runs=[[n for n, _ in run] for run in runs],
        compute=[sorted(c, key=position.__getitem__) for c in compute],
        inputs=inputs,
        outputs=outputs,
        unused=unused,
    )


def _need(a: fx.Node, s: int, assigned: dict[str, int | None], is_tensor: dict[str, bool], compute: list[set[str]], received: list[set[str]]) -> bool:
    """Stage ``s`` uses ``a``: run it there again (True: its inputs are needed too) or receive it."""
    home = assigned[a.name]
    if a.op == "placeholder" and s == 0:
        return False  # the model's inputs: stage 0's own
    if home == s:
        compute[s].add(a.name)
        return False
    if home is None or (not is_tensor.get(a.name, True) and a.op != "placeholder"):
        if a.op == "call_module":
            raise ConfigError(
                f"the pipeline would have to run layer {a.target!r} again on stage {s} (its output is not a tensor); use split_points to move the cut"
            )
        compute[s].add(a.name)
        return True
    if home > s:
        raise ConfigError(f"stage {s} of the traced forward would need {a.name!r}, computed later on stage {home}; use split_points to move the cut")
    received[s].add(a.name)
    return False


def stage_module(gm: fx.GraphModule, plan: TracedPlan, s: int) -> fx.GraphModule:
    """Stage ``s`` as a GraphModule over the model's own modules and tensors, under their original names."""
    graph = fx.Graph()
    env: dict[str, fx.Node] = {}
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in plan.inputs[s]:
        src = nodes[name]
        default = src.args[0] if s == 0 and src.op == "placeholder" and src.args else ()
        env[name] = graph.placeholder(name, default_value=default) if default != () else graph.placeholder(name)
    keep = set(plan.compute[s])
    for n in gm.graph.nodes:
        if n.name in keep:
            env[n.name] = graph.node_copy(n, lambda a: env[a.name])
    last = s == len(plan.runs) - 1
    if last:
        graph.output(fx.node.map_arg(nodes["output"].args[0], lambda a: env[a.name]))
    else:
        outs = [env[v] for v in plan.outputs[s]]
        # a value passed through (received and sent on) leaves as a view: a tensor distinct from
        # the received buffer, with a grad_fn, as torch's stage expects of what it sends
        outs = [graph.call_method("view_as", (o, o)) if o.op == "placeholder" else o for o in outs]
        graph.output(outs[0] if len(outs) == 1 else tuple(outs))
    module = TracedStage(gm, graph, plan.runs[s] + (plan.unused if last else []))
    return module


class TracedStage(fx.GraphModule):
    """One stage of a traced forward: the model's modules and tensors it uses, under their
    original names; ``layer_names`` lists the layers it holds, ``root_tensors`` the root's own."""

    def __init__(self, gm: fx.GraphModule, graph: fx.Graph, owned: Sequence[str]) -> None:
        super().__init__(gm, graph, f"Stage_{type(gm).__name__}")
        layers: list[tuple[str, nn.Module]] = gm.__dict__[_LAYERS]
        layer_names = [n for n, _ in layers]
        held = []
        for n in graph.nodes:
            if n.op in ("call_module", "get_attr"):
                layer = _layer_of(str(n.target), layer_names)
                if layer is not None and layer not in held:
                    held.append(layer)
        for name in owned:
            if name not in held:
                held.append(name)
                _attach(self, dict(layers)[name], name)
        self.layer_names = [n for n in layer_names if n in held]
        self.root_tensors = {str(n.target): getattr(gm, str(n.target)) for n in graph.nodes if n.op == "get_attr" and "." not in str(n.target)}
        self.n_inputs = sum(1 for n in graph.nodes if n.op == "placeholder")


def _attach(owner: nn.Module, module: nn.Module, name: str) -> None:
    """Register ``module`` on ``owner`` under its dotted ``name`` (plain containers)."""
    *parents, leaf = name.split(".")
    node = owner
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]  # type: ignore[assignment]
    node.add_module(leaf, module)


def is_chain(gm: fx.GraphModule) -> bool:
    """The graph is the model's layers in registration order, each output the next one's only input:
    a plain sequence, which the sequence split (`split.StageModule`) runs as it is."""
    nodes = list(gm.graph.nodes)
    layers = [n for n, _ in gm.__dict__[_LAYERS]]
    if [n.op for n in nodes] != ["placeholder"] + ["call_module"] * len(layers) + ["output"]:
        return False
    calls = nodes[1:-1]
    if [str(c.target) for c in calls] != layers:
        return False
    prev = nodes[0]
    for c in calls:
        if c.args != (prev,) or c.kwargs:
            return False
        prev = c
    return nodes[-1].args[0] is prev


# -- the check before launch: the stages' composition equals the model's forward --------------------


def to_float64(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.double() if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(to_float64(o) for o in obj)
    if isinstance(obj, list):
        return [to_float64(o) for o in obj]
    if isinstance(obj, dict):
        return {k: to_float64(v) for k, v in obj.items()}
    return obj


def _flat(out: Any) -> list[Any]:
    if isinstance(out, torch.Tensor) or out is None:
        return [out]
    if isinstance(out, (tuple, list)):
        return [x for o in out for x in _flat(o)]
    if isinstance(out, dict):
        return [x for v in out.values() for x in _flat(v)]
    for key in ("logits", "loss", "last_hidden_state"):  # a ModelOutput's tensors
        if getattr(out, key, None) is not None:
            return _flat(getattr(out, key))
    return [out]


def _differs(a: Any, b: Any) -> str | None:
    """None when ``a`` and ``b`` are equal exactly (tensors, nesting, Nones); else how they differ."""
    fa, fb = _flat(a), _flat(b)
    if len(fa) != len(fb):
        return f"{len(fb)} outputs instead of {len(fa)}"
    for x, y in zip(fa, fb, strict=True):
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape:
                return f"shape {tuple(y.shape)} instead of {tuple(x.shape)}"
            if not torch.equal(x, y):
                diff = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else float("nan")
                return f"values differ (largest difference {diff:.3g})"
        elif (x is None) != (y is None) or type(x) is not type(y):
            return f"{type(y).__name__} instead of {type(x).__name__}"
    return None


def check_composition(
    model64: nn.Module,
    sample_args: Sequence[Any],
    sample_kwargs: dict[str, Any],
    stages: Sequence[nn.Module],
    run_stages: Callable[[], Any],
    layers: Sequence[str],
    stage_of: dict[str, int],
    path: str,
) -> None:
    """Run ``model64`` (float64) and then ``run_stages()`` (its ``stages`` one after another, in one
    process) on the sample, from the same random state; a `ConfigError` naming the first layer whose
    output differs (or the stage that failed) unless the final outputs are equal exactly. Training
    mode, or eval mode where the model cannot take the sample in training mode (BatchNorm on one row).

    ``layers``: the layer names in order, hooked on ``model64`` to see where the two runs part."""
    seen: dict[str, list[Any]] = {}
    handles = []
    for name in layers:
        try:
            mod = model64.get_submodule(name)
        except AttributeError:
            continue
        handles.append(mod.register_forward_hook(lambda m, a, o, name=name: seen.setdefault(name, []).append(_flat(o))))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            try:
                torch.manual_seed(0)
                want = model64(*sample_args, **sample_kwargs)
            except Exception:
                for m in (model64, *stages):
                    m.eval()
                seen.clear()
                torch.manual_seed(0)
                try:
                    want = model64(*sample_args, **sample_kwargs)
                except Exception as exc:
                    raise ConfigError(f"{type(model64).__name__}'s forward raises on a sample batch: {type(exc).__name__}: {exc}") from None
            eager = {k: v[:] for k, v in seen.items()}
            seen.clear()
            torch.manual_seed(0)
            try:
                got = run_stages()
            except _StageFailed as failed:
                raise ConfigError(
                    f"cannot split {type(model64).__name__} into pipeline stages by {path}: run on a sample batch, stage "
                    f"{failed.stage} raises {type(failed.error).__name__}: {str(failed.error).splitlines()[0] if str(failed.error) else ''}"
                    f"{_first_difference(eager, seen, layers, stage_of)}"
                ) from None
    finally:
        for h in handles:
            h.remove()
    how = _differs(want, got)
    if how is not None:
        raise ConfigError(
            f"cannot split {type(model64).__name__} into pipeline stages by {path}: on a sample batch in float64 the "
            f"stages' output differs from the model's forward ({how}){_first_difference(eager, seen, layers, stage_of)}"
        )


class _StageFailed(Exception):
    def __init__(self, stage: int, error: BaseException) -> None:
        super().__init__(str(error))
        self.stage, self.error = stage, error


def run_in_turn(stages: Sequence[Callable[..., Any]], args: Sequence[Any], kwargs: dict[str, Any], side: bool) -> Any:
    """Stages one after another, each one's output the next one's input(s); ``side``: every stage
    also gets ``kwargs`` (the nested split's micro-batch keywords)."""
    x: tuple[Any, ...] = tuple(args)
    out: Any = None
    for s, stage in enumerate(stages):
        try:
            out = stage(*x, **(kwargs if (side or s == 0) else {}))
        except Exception as exc:  # the user's code on a stage it was not written for
            raise _StageFailed(s, exc) from exc
        x = tuple(out) if isinstance(out, tuple) and s < len(stages) - 1 else (out,)
    return out


def _first_difference(eager: dict[str, list[Any]], staged: dict[str, list[Any]], layers: Sequence[str], stage_of: dict[str, int]) -> str:
    for name in layers:
        a, b = eager.get(name), staged.get(name)
        if a is None and b is None:
            continue
        if a is None or b is None or len(a) != len(b) or any(_differs(x, y) for x, y in zip(a, b, strict=True)):
            where = f" (stage {stage_of[name]})" if name in stage_of else ""
            if b is None:
                return f"; layer {name}{where} never ran in the stages"
            return f"; the first layer whose output differs is {name}{where}: its input there is not what the model's forward gives it"
    return "; every layer's output agrees, so the difference is in the model's own code after the layers"


def float64_copy(model: nn.Module) -> nn.Module:
    return copy.deepcopy(model).double()


def cross_stage_ties(model: nn.Module, stage_mods: Mapping[int, nn.Module], pp: int) -> list[Tie]:
    """The model's parameters held by stages of different pipeline ranks (a module or root tensor
    used on two stages, or a parameter shared by identity under two names): each a `ties.Tie` named
    by its first name (``named_parameters`` order), referenced by the lowest stage holding it."""
    first_name: dict[int, str] = {}
    for name, p in model.named_parameters():
        first_name.setdefault(id(p), name)
    holders: dict[int, list[int]] = {}
    params: dict[int, nn.Parameter] = {}
    for s in sorted(stage_mods):
        for _, p in stage_mods[s].named_parameters(remove_duplicate=False):
            holders.setdefault(id(p), [])
            if s not in holders[id(p)]:
                holders[id(p)].append(s)
            params[id(p)] = p
    ties = []
    for pid, stages in holders.items():
        ranks = sorted({s % pp for s in stages})
        if len(ranks) > 1:
            p = params[pid]
            name = first_name.get(pid, "")
            home = min((s for s in stages if any(n == name for n, q in stage_mods[s].named_parameters(remove_duplicate=False) if q is p)), default=min(stages))
            ties.append(Tie(name, tuple(ranks), home % pp, tuple(p.shape), p.dtype))
    return ties
