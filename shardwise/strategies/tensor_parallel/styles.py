"""The split styles for linears of either weight layout, and the fused q|k|v re-layout.

torch's ``ColwiseParallel`` / ``RowwiseParallel`` take ``nn.Linear`` (weight ``(out, in)``) only.
transformers' GPT-2 family uses ``Conv1D``, a linear whose weight is stored transposed
(``(in, out)``, ``y = x @ W + b``): its column split is ``Shard(1)`` of the weight and its row
split ``Shard(0)``. A fused q|k|v projection (GPT-2's ``c_attn``: q, k and v stacked along the
output features) is permuted once so that rank r's contiguous shard holds its own heads' q, then
k, then v (`fused_permutation`); the strategy inverts the permutation on save, so checkpoints and
exports keep the original layout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


def is_transposed(module: nn.Module) -> bool:
    """A linear that stores its weight as ``(in, out)`` (transformers' ``Conv1D``)."""
    w = getattr(module, "weight", None)
    return type(module).__name__ == "Conv1D" and isinstance(w, torch.Tensor) and w.dim() == 2


def is_splittable(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) or is_transposed(module)


def weight_of(module: nn.Module) -> torch.Tensor:
    """The ``weight`` of a Linear or a Conv1D."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor to split (got {type(w).__name__})")
    return w


def features(module: nn.Module) -> tuple[int, int]:
    """``(in_features, out_features)`` of a Linear or a Conv1D."""
    if isinstance(module, nn.Linear):
        return module.in_features, module.out_features
    w = weight_of(module)
    return int(w.shape[0]), int(w.shape[1])


def out_dim(module: nn.Module) -> int:
    """The weight dimension that holds the output features."""
    return 1 if is_transposed(module) else 0


def fused_permutation(width: int, parts: int, tp: int) -> torch.Tensor:
    """Index that reorders ``parts`` stacked blocks of ``width`` features so that each of the ``tp``
    contiguous shards holds its slice of every block: ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]``."""
    step = width // tp
    return torch.cat([torch.arange(j * width + r * step, j * width + (r + 1) * step) for r in range(tp) for j in range(parts)])


def _styles() -> tuple[type, type]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    class Colwise(ColwiseParallel):
        """``ColwiseParallel`` for Linear and Conv1D, with an optional fused-block permutation."""

        def __init__(self, *, fused_parts: int = 0, **kw: Any) -> None:
            super().__init__(**kw)
            self.fused_parts = fused_parts

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            tp = device_mesh.size()
            for pname, param in list(module.named_parameters(recurse=False)):
                dim = out_dim(module) if pname == "weight" else 0
                data = param.detach()
                if self.fused_parts:
                    perm = fused_permutation(data.shape[dim] // self.fused_parts, self.fused_parts, tp)
                    data = data.index_select(dim, perm.to(data.device))
                dist = distribute_tensor(data, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
                module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            from functools import partial

            from torch.distributed.tensor import distribute_module

            if not is_splittable(module):
                raise NotImplementedError(f"column split takes nn.Linear or Conv1D; got {type(module).__name__}")
            return distribute_module(
                module,
                device_mesh,
                self._partition_linear_fn,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    class Rowwise(RowwiseParallel):
        """``RowwiseParallel`` for Linear and Conv1D (weight split by input features, bias replicated)."""

        @staticmethod
        def _prepare_output_fn(output_layouts: Any, use_local_output: bool, mod: nn.Module, outputs: Any, device_mesh: Any) -> Any:
            out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
            # ``to_local`` returns a view autograd forbids modifying in place, and a model may add to the
            # result in place (Llama 4's MoE: ``out = shared_expert(x); out.add_(routed)``): a copy of its own
            return out.clone() if use_local_output else out

        def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: Any) -> None:
            w = weight_of(module)
            dim = 0 if is_transposed(module) else 1
            module.register_parameter(
                "weight",
                nn.Parameter(distribute_tensor(w.detach(), device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank), requires_grad=w.requires_grad),
            )
            if isinstance(b := getattr(module, "bias", None), torch.Tensor):
                module.register_parameter(
                    "bias",
                    nn.Parameter(distribute_tensor(b.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank), requires_grad=b.requires_grad),
                )

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            from functools import partial

            from torch.distributed.tensor import distribute_module

            if not is_splittable(module):
                raise NotImplementedError(f"row split takes nn.Linear or Conv1D; got {type(module).__name__}")
            self.desired_input_layouts = (Shard(-1),)
            return distribute_module(
                module,
                device_mesh,
                self._partition_linear_fn,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )

    return Colwise, Rowwise


def colwise(fused_parts: int = 0, **kw: Any) -> Any:
    return _styles()[0](fused_parts=fused_parts, **kw)


def rowwise(output_layout: Any, **kw: Any) -> Any:
    return _styles()[1](output_layouts=output_layout, **kw)


# -- a module's main input, however it was passed ----------------------------------------------


def input_name(module: nn.Module) -> str | None:
    """The name of ``forward``'s first parameter (HF layers pass ``hidden_states=...`` by keyword)."""
    import inspect

    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    for p in params:
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return p.name
    return None


def get_input(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, str | int | None]:
    """The module's main input (first positional argument, or its keyword) and where it was."""
    if args:
        return args[0], 0
    name = input_name(module)
    if name is not None and name in kwargs:
        return kwargs[name], name
    return None, None


def put_input(args: tuple[Any, ...], kwargs: dict[str, Any], where: str | int | None, value: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if where == 0:
        return (value, *args[1:]), kwargs
    return args, {**kwargs, str(where): value}


def main_output(out: Any) -> Any:
    """The hidden states a block returned: a tensor, or the first element of a tuple/list."""
    return out[0] if isinstance(out, (tuple, list)) else out


def replace_output(out: Any, value: Any) -> Any:
    if isinstance(out, tuple):
        return (value, *out[1:])
    if isinstance(out, list):
        return [value, *out[1:]]
    return value
