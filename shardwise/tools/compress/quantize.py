"""Post-training int8 quantization of a model's ``nn.Linear`` layers, on CPU, with torch's own eager API.

Two kinds, both from ``torch.ao.quantization`` (the eager-mode API that ships inside torch 2.13
and runs on CPU with the x86/fbgemm kernels; torch marks it deprecated in favour of the separate
torchao package, which is not a dependency here, so its DeprecationWarning is silenced at these
two calls only):

- **dynamic** (`dynamic_int8`): each Linear's weight is stored as int8 (per-tensor affine scale
  and zero point); activations are quantized on the fly per batch, from their own range. No
  calibration; every model with a Linear layer qualifies.
- **static** (`static_int8`): weights int8 per output channel and activation ranges fixed ahead
  of time by histogram observers run over calibration batches of the recipe's training data. Eager
  static quantization needs every quantized op to receive a quantized tensor, and LayerNorm,
  GELU, embeddings and scaled-dot-product attention (charlm) have no quantized eager kernels, so
  each Linear is wrapped on its own: quantize its input, int8 matmul, dequantize its output
  (`torch.ao.quantization.QuantWrapper`). The rest of the model stays in float. For the digits
  MLP this is every matmul; ReLU and dropout run on the dequantized float.

The quantized modules are ``torch.ao.nn.quantized(.dynamic).Linear``; their state dicts hold the
packed int8 weights, so ``torch.save`` of the state dict is the size on disk reported.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError


def _linears(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if type(m) is nn.Linear]


def check_quantizable(model: nn.Module) -> None:
    """ConfigError when the model has no ``nn.Linear`` layer (nothing this module quantizes)."""
    if not _linears(model):
        kinds = sorted({type(m).__name__ for m in model.modules() if not list(m.children())})
        raise ConfigError(
            f"{type(model).__name__} has no nn.Linear layer to quantize (its layers: {', '.join(kinds) or 'none'}); "
            "int8 quantization here covers Linear layers only"
        )


def dynamic_int8(model: nn.Module) -> nn.Module:
    """A copy of ``model`` (eval mode) with every ``nn.Linear`` replaced by a dynamic int8 Linear."""
    check_quantizable(model)
    from torch.ao.quantization import quantize_dynamic

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        return quantize_dynamic(copy.deepcopy(model).eval(), {nn.Linear}, dtype=torch.qint8)


def static_int8(model: nn.Module, calibration: Iterable[Any], backend: str = "x86") -> nn.Module:
    """A copy of ``model`` with each ``nn.Linear`` statically quantized (int8 weights and activations).

    ``calibration`` yields batches whose first element is the model input; the observers record
    the activation ranges over all of them.
    """
    check_quantizable(model)
    from torch.ao.quantization import QuantWrapper, convert, get_default_qconfig, prepare

    qmodel = copy.deepcopy(model).eval()
    qconfig = get_default_qconfig(backend)
    for name in _linears(qmodel):
        parent_name, _, child = name.rpartition(".")
        parent = qmodel.get_submodule(parent_name) if parent_name else qmodel
        wrapper = QuantWrapper(getattr(parent, child))
        wrapper.qconfig = qconfig
        setattr(parent, child, wrapper)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", message=".*quantize_per_tensor.*")
        warnings.filterwarnings("ignore", message=".*reduce_range.*")
        prepare(qmodel, inplace=True)
        with torch.inference_mode():
            seen = 0
            for batch in calibration:
                qmodel(batch[0])
                seen += 1
        if seen == 0:
            raise ConfigError("static quantization needs at least one calibration batch; got none (raise --calibration-batches)")
        convert(qmodel, inplace=True)
    return qmodel


def linear_weight_bytes(model: nn.Module) -> int:
    """Bytes of the Linear layers' weights as stored: 4 per fp32 entry, 1 per int8 entry (scales not counted)."""
    total = 0
    for m in model.modules():
        weight = getattr(m, "weight", None)
        if type(m) is nn.Linear:
            total += m.weight.numel() * m.weight.element_size()
        elif callable(weight) and "quantized" in type(m).__module__:
            w = weight()
            total += w.numel() * w.element_size()
    return total


def int8_layers(model: nn.Module) -> list[str]:
    """Names of the modules whose stored weight is int8 (quantized Linear kinds)."""
    out = []
    for name, m in model.named_modules():
        weight = getattr(m, "weight", None)
        if callable(weight) and "quantized" in type(m).__module__ and weight().dtype == torch.qint8:
            out.append(name)
    return out
