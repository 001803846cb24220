"""What a model is to the planner: parameters, layers, widths, FLOPs and activations per sample.

A `ModelSpec` is numbers only, so the cost model never needs the model itself. It comes from
one of three places:

- `transformer_spec`: a decoder-only transformer described by its sizes (a Hugging Face config
  JSON read with `from_hf_config`, or just a parameter count with `from_param_count`). The
  formulas:

  * parameters per layer: attention ``h^2 (2 + 2 kv/a)`` (q and o are ``h x h``, k and v
    ``h x h kv/a`` with grouped-query attention) plus the MLP ``2 h f`` (``3 h f`` when gated,
    as in Llama's SwiGLU) plus two norms ``2 h``; embeddings ``V h`` (twice when the output
    layer is not tied) plus learned positions when the model has them.
  * FLOPs per sample, forward and backward (Narayanan et al., "Efficient Large-Scale Language
    Model Training on GPU Clusters Using Megatron-LM", SC 2021, section 5.1, eq. 3, which for
    ``f = 4h`` is ``72 s L h^2 (1 + s/(6h) + V/(12 L h))``): ``6 s`` times the matmul parameters
    per token (every layer's weights and the output layer) plus ``12 L s^2 h`` for the attention
    scores and their product with the values.
  * activation bytes per layer per sample (Korthikanti et al., "Reducing Activation
    Recomputation in Large Transformer Models", MLSys 2023, section 4.1, eq. 1, 16-bit
    activations): ``s h (34 + 5 a s / h)``; with tensor parallelism of degree ``t`` (eq. 2)
    ``s h (10 + 24/t + 5 a s/(h t))``, and with sequence parallelism too (eq. 4)
    ``s h (34 + 5 a s / h) / t``. 32-bit activations double the 2-byte terms; we scale the
    whole by ``act_bytes / 2`` (the 1-byte dropout masks make this a slight over-estimate).

- `measured_spec`: any `nn.Module` with an example batch (the built-in recipes, a
  ``module:factory``): the parameters are counted, FLOPs of one forward and backward are counted
  by ``torch.utils.flop_counter.FlopCounterMode`` and the activations are what autograd saves for
  backward in one forward and the loss (`shardwise.strategies.cost.saved.SavedBytes`). Given the linears
  tensor parallelism splits, the bytes saved from a column-split linear's output up to the
  row-split linear's input are set apart: tp divides those, the rest (norms, the residual stream,
  the split linears' inputs) stays whole on every tp rank, as in Korthikanti et al.'s eq. 2. The
  layers are the children of the model's longest block list.

Nothing here starts a process; `measured_spec` runs the model once on the example batch.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError


@dataclass(frozen=True)
class StepFit:
    """A whole training step of the model timed on this machine: ``fixed_s + per_sample_s * samples``.

    One process with ``threads`` intra-op threads (one: as each of two trainer processes runs on two
    cores; a single process runs torch's own count), forward, backward and the optimizer's step, at two
    batch sizes (`shardwise.tools.advisor.models.time_step`). On CPU a small model's step is mostly
    per-operation overhead that FLOPs do not see; the fixed part holds it.
    """

    fixed_s: float
    per_sample_s: float
    sizes: tuple[int, int] = (0, 0)
    """The two batch sizes timed."""
    threads: int = 1
    """The intra-op threads (``torch.set_num_threads``) the step was timed with."""

    def seconds(self, samples: float) -> float:
        return self.fixed_s + self.per_sample_s * samples


@dataclass(frozen=True)
class ModelSpec:
    """The numbers the cost model needs about a model (sizes per sample, not per batch)."""

    name: str
    params: int
    """Trainable parameters (``Psi``)."""
    layers: int
    """Repeated blocks (transformer layers; the layers of a sequential MLP)."""
    layer_params: int
    """Parameters of one block (the largest one when they differ)."""
    hidden: int
    """Width of the activations between blocks (``h``): what a tensor-parallel allreduce and a pipeline send carry per token."""
    seq: int = 1
    """Tokens per sample (``s``); 1 for a model that is not a sequence model."""
    heads: int = 1
    vocab: int = 0
    flops_per_sample: float = 0.0
    """FLOPs of one sample's forward and backward."""
    act_bytes_per_layer_sample: float = 0.0
    """Activation bytes one block keeps for backward per sample, at ``act_bytes`` per element."""
    act_bytes_other_sample: float = 0.0
    """Activation bytes outside the blocks per sample (embeddings, the output layer's logits, the loss)."""
    act_bytes_kept_per_layer_sample: float | None = None
    """Of a block checkpointed whole (``activation_checkpointing='blocks'``), the bytes it keeps per sample:
    the tensors it is called with (torch's checkpoint saves them; masks and rotary tables shared by every
    block count once over all of them). Measured by `measured_spec`; None: the hidden states, ``s h``
    elements (Korthikanti et al. 2023, section 5: full recomputation keeps ``2 s b h`` bytes at 16 bits)."""
    act_bytes_tp_split_per_layer_sample: float | None = None
    """Of `act_bytes_per_layer_sample`, the bytes tensor parallelism splits: those saved between a
    column-split linear's output and the row-split linear that takes it (attention's heads, the
    MLP's inner width). The rest (the norms, the residual stream, the split linears' own inputs)
    stays whole on every tp rank. Measured by `measured_spec` given a tp plan; None: all of it
    (the Korthikanti formulas decide for a `transformer` spec)."""
    act_bytes: int = 4
    """Bytes per activation element the activation figures were computed with."""
    transformer: bool = False
    """True when the activation formulas of Korthikanti et al. apply (tensor-parallel scaling)."""
    tensors: int = 0
    """Parameter tensors (each weight and each bias): what per-parameter work repeats over (DDP's
    gradient hooks, a codec's encode and decode, the optimizer's loop). Counted on a module; from a
    config, its weights and norms; 0 when not known (`parameter_tensors` estimates it then)."""
    tp_split_params: int | None = None
    """Parameters in the linears tensor parallelism splits (a column-split linear's weight and bias, a
    row-split one's weight): each tp rank holds ``1/tp`` of them and the whole of the rest (embeddings,
    norms, a row-split linear's bias). Counted by `measured_spec` given a tp plan; None: ``1/tp`` of
    every parameter (Megatron's layout, embeddings split by vocabulary)."""
    step_fit: StepFit | None = None
    """The model's step timed here (a recipe or factory module); a profile measured on this machine
    (``DeviceProfile.local``) uses it instead of FLOPs over FLOP/s."""
    step_fits: tuple[StepFit, ...] = ()
    """The same step timed at other thread counts (a single process's own, `fit_for`)."""
    kv_heads: int = 0
    """Key/value heads (grouped-query attention); 0: as many as `heads`."""
    moe_layers: int = 0
    """Mixture-of-experts layers (stacked experts, `shardwise.strategies.expert_parallel.cost.moe_structure`); 0: none."""
    experts: int = 0
    """Experts in each MoE layer."""
    top_k: int = 0
    """Experts each token is routed to."""
    expert_params: int = 0
    """Parameters of the experts of every MoE layer together (what ``ep`` splits)."""

    def fit_for(self, threads: int) -> StepFit | None:
        """The step timed with ``threads`` threads; else the one timed with the most threads below it (a
        process with more threads than were timed is costed as the timed count: no guessed speed-up)."""
        fits = [f for f in (self.step_fit, *self.step_fits) if f is not None]
        below = [f for f in fits if f.threads <= threads]
        if below:
            return max(below, key=lambda f: f.threads)
        return min(fits, key=lambda f: f.threads) if fits else None

    def with_fits(self, fits: Sequence[StepFit]) -> ModelSpec:
        """The same model with its step timed at ``fits``' thread counts: the one-thread fit (or the fewest
        threads) is `step_fit`, the others `step_fits`."""
        ordered = sorted(fits, key=lambda f: f.threads)
        return replace(self, step_fit=ordered[0] if ordered else None, step_fits=tuple(ordered[1:]))

    def with_act_bytes(self, act_bytes: int) -> ModelSpec:
        """The same model with activations stored at ``act_bytes`` per element (2 under mixed precision)."""
        if act_bytes == self.act_bytes:
            return self
        f = act_bytes / self.act_bytes
        split = self.act_bytes_tp_split_per_layer_sample
        return replace(
            self,
            act_bytes=act_bytes,
            act_bytes_per_layer_sample=self.act_bytes_per_layer_sample * f,
            act_bytes_other_sample=self.act_bytes_other_sample * f,
            act_bytes_kept_per_layer_sample=None if self.act_bytes_kept_per_layer_sample is None else self.act_bytes_kept_per_layer_sample * f,
            act_bytes_tp_split_per_layer_sample=None if split is None else split * f,
        )

    def layer_activation_bytes(self, samples: float, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes one block keeps for ``samples`` samples on one rank of a ``tp``-way split."""
        if tp == 1:
            return self.act_bytes_per_layer_sample * samples
        if not self.transformer:
            split = self.act_bytes_tp_split_per_layer_sample
            if split is None or sequence_parallel:  # sequence parallelism splits the rest along the sequence
                return self.act_bytes_per_layer_sample * samples / tp
            return (self.act_bytes_per_layer_sample - split + split / tp) * samples
        s, h, a = self.seq, self.hidden, self.heads
        if sequence_parallel:  # Korthikanti et al. 2023, eq. 4
            per = s * h * (34 + 5 * a * s / h) / tp
        else:  # eq. 2
            per = s * h * (10 + 24 / tp + 5 * a * s / (h * tp))
        return per * self.act_bytes / 2 * samples

    def kept_layer_bytes(self, samples: float, tp: int = 1, sequence_parallel: bool = False) -> float:
        """Bytes a block checkpointed whole keeps for ``samples`` samples on one rank of a ``tp``-way split: its
        inputs, whole on every tp rank (the hidden states before the first split linear), split with sequence
        parallelism (Korthikanti et al. 2023, section 5)."""
        kept = self.act_bytes_kept_per_layer_sample
        per = self.seq * self.hidden * self.act_bytes if kept is None else kept
        return per * samples / (tp if sequence_parallel else 1)

    def tp_rank_params(self, tp: int) -> float:
        """Parameters one rank of a ``tp``-way split holds (`tp_split_params`)."""
        if tp == 1 or self.tp_split_params is None:
            return self.params / tp
        return self.params - self.tp_split_params + self.tp_split_params / tp

    def parameter_tensors(self) -> int:
        """`tensors`, or when not known an estimate from the layers: 12 a transformer layer (GPT-2's:
        four linears and two norms, each with a weight and a bias) and 4 outside them (embeddings
        and the final norm), 2 a layer otherwise (a linear's weight and bias)."""
        if self.tensors:
            return self.tensors
        return 12 * self.layers + 4 if self.transformer else 2 * self.layers

    def to_json(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if self.step_fit is not None:
            out["step_fit"] = dict(self.step_fit.__dict__)
        out["step_fits"] = [dict(f.__dict__) for f in self.step_fits]
        return out


def korthikanti_layer_bytes(seq: int, hidden: int, heads: int) -> float:
    """Activation bytes per transformer layer per sample with 16-bit activations (Korthikanti et al. 2023, eq. 1)."""
    return seq * hidden * (34 + 5 * heads * seq / hidden)


def transformer_spec(
    name: str,
    *,
    layers: int,
    hidden: int,
    heads: int,
    vocab: int,
    seq: int,
    ffn: int | None = None,
    kv_heads: int | None = None,
    gated: bool = False,
    tied: bool = True,
    positions: int = 0,
    act_bytes: int = 2,
) -> ModelSpec:
    """A decoder-only transformer from its sizes (formulas in the module docstring).

    >>> s = transformer_spec("gpt", layers=2, hidden=64, heads=4, vocab=100, seq=16)
    >>> s.layer_params == 12 * 64 * 64 + 2 * 64   # 12 h^2 of weights (biases left out) and two norms
    True
    """
    for key, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("seq", seq)):
        if value < 1:
            raise ConfigError(f"model {name!r}: {key} must be >= 1; got {value}")
    f = ffn if ffn else 4 * hidden
    kv = kv_heads if kv_heads else heads
    attn = hidden * hidden * 2 + 2 * hidden * (hidden * kv // heads)
    mlp = (3 if gated else 2) * hidden * f
    layer = attn + mlp + 2 * hidden
    embed = vocab * hidden * (1 if tied else 2) + positions * hidden + hidden  # + the final norm
    params = layers * layer + embed
    matmul_per_token = layers * (attn + mlp) + vocab * hidden
    flops = 6 * seq * matmul_per_token + 12 * layers * seq * seq * hidden
    per_layer = korthikanti_layer_bytes(seq, hidden, heads) * act_bytes / 2
    # outside the layers: the embedding output and the logits (s V, kept in fp32 for the loss)
    other = seq * hidden * act_bytes + seq * vocab * 4
    return ModelSpec(
        name=name,
        params=params,
        layers=layers,
        layer_params=layer,
        hidden=hidden,
        seq=seq,
        heads=heads,
        vocab=vocab,
        flops_per_sample=float(flops),
        act_bytes_per_layer_sample=per_layer,
        act_bytes_other_sample=float(other),
        act_bytes=act_bytes,
        transformer=True,
        kv_heads=kv,
        # weights: q, k, v, o, the MLP's 2 or 3 and 2 norms a layer; the embedding(s) and the final norm
        tensors=layers * (4 + (3 if gated else 2) + 2) + (1 if tied else 2) + (1 if positions else 0) + 1,
    )


def from_param_count(
    params: float, *, layers: int | None = None, hidden: int | None = None, heads: int | None = None, seq: int = 2048, vocab: int = 50257
) -> ModelSpec:
    """A GPT-shaped model of about ``params`` parameters (``12 L h^2`` in the layers, Kaplan et al. 2020, section 2.1).

    Missing sizes are chosen as GPT-3's table does (Brown et al. 2020, table 2.1: width about
    128 times the depth): ``h`` from ``12 L h^2 = Psi`` with ``h = 128 L``, rounded to 128;
    ``heads = h / 128``. The parameter count given stays the count used for model state.
    """
    if not math.isfinite(params) or params < 1:
        raise ConfigError(f"--params must be a positive number of parameters (e.g. 7.5e9); got {params}")
    if hidden is None:
        if layers is None:
            hidden = max(128, round((params * 128 / 12) ** (1 / 3) / 128) * 128)
        else:
            hidden = max(64, round(math.sqrt(params / (12 * layers)) / 64) * 64)
    if layers is None:
        layers = max(1, round(params / (12 * hidden * hidden)))
    heads = heads or max(1, hidden // 128)
    spec = transformer_spec(f"{params:.3g} parameters", layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq)
    return replace(spec, params=int(params), layer_params=int((params - vocab * hidden) / layers) if params > vocab * hidden else spec.layer_params)


_HF_KEYS = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "vocab": ("vocab_size",),
}


def _pick(config: Mapping[str, Any], keys: tuple[str, ...]) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


def from_hf_config(path: str | Path, seq: int | None = None) -> ModelSpec:
    """A transformer from a Hugging Face ``config.json`` (read as JSON; transformers is not needed).

    Reads ``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
    ``intermediate_size``, ``vocab_size``, ``tie_word_embeddings``, ``max_position_embeddings``
    (and GPT-2's ``n_embd``, ``n_layer``, ``n_head``, ``n_inner``, ``n_positions``). A gated MLP
    (three matrices) is assumed when ``hidden_act`` is ``silu``/``swiglu`` (Llama, Mistral, Qwen).
    """
    p = Path(path)
    try:
        config = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"model file {str(p)!r} does not exist; give a Hugging Face config.json, a recipe (charlm, digits) or module:factory") from None
    except json.JSONDecodeError as exc:
        raise ConfigError(f"model file {str(p)!r} is not valid JSON ({exc.msg} at line {exc.lineno}); give a Hugging Face config.json") from None
    found = {k: _pick(config, keys) for k, keys in _HF_KEYS.items()}
    missing = [keys[0] for k, keys in _HF_KEYS.items() if found[k] is None]
    if missing:
        raise ConfigError(f"model config {str(p)!r} has no {', '.join(missing)}; a Hugging Face transformer config.json has them")
    act = str(config.get("hidden_act", config.get("activation_function", "gelu")))
    gpt2_like = "n_embd" in config
    positions = int(config.get("n_positions", 0)) if gpt2_like else 0
    max_pos = config.get("max_position_embeddings", config.get("n_positions", 2048))
    return transformer_spec(
        str(config.get("_name_or_path") or config.get("model_type") or p.stem),
        layers=int(found["layers"]),
        hidden=int(found["hidden"]),
        heads=int(found["heads"]),
        vocab=int(found["vocab"]),
        seq=int(seq or max_pos),
        ffn=_pick(config, ("intermediate_size", "n_inner", "ffn_dim")),
        kv_heads=config.get("num_key_value_heads"),
        gated=act in ("silu", "swiglu", "swish"),
        tied=bool(config.get("tie_word_embeddings", True)),
        positions=positions,
    )


def _block_list(model: nn.Module) -> list[nn.Module]:
    """The model's longest list of repeated blocks (a ModuleList or Sequential), or its leaf layers with parameters."""
    best: list[nn.Module] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList | nn.Sequential):
            kids = [m for m in module.children() if any(True for _ in m.parameters())]
            if len(kids) > len(best):
                best = kids
    return best or [model]


def _label_hooks(
    model: nn.Module, blocks: list[nn.Module], saved: Any, tp_plan: Mapping[str, str] | None, act_bytes: int
) -> tuple[list[Any], list[int], dict[int, int], int]:
    """Hooks that label what autograd saves (``saved.where``: inside a block, tensor parallelism's split
    part of one, or outside), record each block's output width and the bytes blocks are called with.
    Returns (handles, widths, kept bytes by storage, parameters ``tp_plan`` splits)."""
    widths: list[int] = []

    def enter(module: nn.Module, args: Any) -> None:
        saved.where = "block"

    def width(module: nn.Module, args: Any, out: Any) -> None:
        saved.where = "other"
        if isinstance(out, torch.Tensor):
            widths.append(out.shape[-1])

    def whole(module: nn.Module, *args: Any) -> None:  # a colwise linear's input, a rowwise linear's output
        if saved.where != "other":
            saved.where = "block"

    def split(module: nn.Module, args: Any, out: Any) -> None:  # a colwise linear's output, up to the rowwise one
        if saved.where != "other":
            saved.where = "block/split"

    kept: dict[int, int] = {}  # storage -> bytes of the tensors blocks are called with (a checkpointed block keeps them)

    def block_inputs(module: nn.Module, args: Any) -> None:
        for a in args if isinstance(args, tuple) else (args,):
            if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter):
                size = a.untyped_storage().nbytes()
                kept[a.untyped_storage().data_ptr()] = size // a.element_size() * act_bytes if a.is_floating_point() else size

    handles = [b.register_forward_pre_hook(enter) for b in blocks] + [b.register_forward_hook(width) for b in blocks]
    handles += [b.register_forward_pre_hook(block_inputs) for b in blocks]
    split_params = 0
    for lin, style in (tp_plan or {}).items():
        sub = model.get_submodule(lin)
        split_params += sum(p.numel() for n, p in sub.named_parameters() if p.requires_grad and (style == "colwise" or n != "bias"))
        if style == "colwise":
            handles += [sub.register_forward_pre_hook(whole), sub.register_forward_hook(split)]
        else:
            handles.append(sub.register_forward_hook(whole))
    return handles, widths, kept, split_params


def _forward_backward(model: nn.Module, example: Any, saved: Any, loss: Callable[[Any], torch.Tensor] | None) -> tuple[float, torch.Tensor]:
    """One forward and backward of ``model`` in training mode, FLOPs counted and saved tensors labelled:
    (FLOPs, the output's logits). The model's mode is restored and its gradients cleared."""
    from torch.utils.flop_counter import FlopCounterMode

    inputs = example if isinstance(example, tuple | list) else (example,)
    was_training = model.training
    model.train()
    try:
        with FlopCounterMode(display=False) as counter:
            with saved.hooks():
                out = model(*inputs)
                saved.where = "other"
                value = loss(out) if loss is not None else None
            logits = out if isinstance(out, torch.Tensor) else out[0]
            (value if value is not None else logits.float().sum()).backward()
    finally:
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    return counter.get_total_flops(), logits


def measured_spec(
    name: str,
    model: nn.Module,
    example: Any,
    samples: int,
    act_bytes: int = 4,
    *,
    loss: Callable[[Any], torch.Tensor] | None = None,
    tp_plan: Mapping[str, str] | None = None,
) -> ModelSpec:
    """Counts from one forward and backward of ``model`` on ``example`` (``samples`` samples in it).

    FLOPs come from ``torch.utils.flop_counter.FlopCounterMode`` (matmuls, convolutions and
    attention; element-wise work is not counted), activations from what autograd saves for
    backward in the forward (`shardwise.strategies.cost.saved.SavedBytes`: floating-point tensors at
    ``act_bytes`` an element, masks and indices as stored; the input batch when a layer saves it),
    inside the blocks per block, the rest apart. ``loss`` (the model's output -> the training
    loss) counts what the loss saves too (a cross-entropy keeps its log-softmax); without it the
    output is summed. ``tp_plan`` (``{linear name: "colwise" | "rowwise"}``, as tensor parallelism
    resolves it) sets apart the bytes tp splits (`ModelSpec.act_bytes_tp_split_per_layer_sample`):
    those saved from a colwise linear's output up to the rowwise linear's input.
    """
    from shardwise.strategies.cost.saved import SavedBytes

    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tensors = sum(1 for p in model.parameters() if p.requires_grad)
    blocks = _block_list(model)
    layer_params = max(sum(p.numel() for p in b.parameters()) for b in blocks)
    saved = SavedBytes(model.parameters(), act_bytes=act_bytes)
    handles, widths, kept, split_params = _label_hooks(model, blocks, saved, tp_plan, act_bytes)
    try:
        flops, logits = _forward_backward(model, example, saved, loss)
    finally:
        for h in handles:
            h.remove()
    seq = int(logits.shape[1]) if logits.dim() == 3 else 1
    hidden = widths[0] if widths else int(logits.shape[-1])
    return ModelSpec(
        name=name,
        params=params,
        layers=len(blocks),
        layer_params=layer_params,
        hidden=hidden,
        seq=seq,
        vocab=int(logits.shape[-1]) if seq > 1 else 0,
        flops_per_sample=flops / samples,
        act_bytes_per_layer_sample=(saved.by_label.get("block", 0) + saved.by_label.get("block/split", 0)) / samples / max(1, len(blocks)),
        act_bytes_tp_split_per_layer_sample=saved.by_label.get("block/split", 0) / samples / max(1, len(blocks)) if tp_plan else None,
        act_bytes_other_sample=saved.by_label.get("other", 0) / samples,
        act_bytes_kept_per_layer_sample=sum(kept.values()) / samples / max(1, len(blocks)),
        act_bytes=act_bytes,
        tensors=tensors,
        tp_split_params=split_params if tp_plan else None,
    )
