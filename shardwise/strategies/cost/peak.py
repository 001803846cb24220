"""Each rank's peak resident memory, predicted before the run: what summary.json's ``memory`` section
sets beside the measured high-water marks (`shardwise.launcher.memory`).

``peak = baseline + max(build, train)``, the parts in bytes:

- ``baseline``: the runtime alone, an interpreter that imported torch, transformers and shardwise,
  measured by ``shardwise plan --calibrate`` (``DeviceProfile.runtime_baseline_bytes``; 0 on a
  device whose memory the runtime does not use, a GPU's).
- ``build``: the model as the script built it, held until the strategy placed it: the whole model's
  parameters and buffers when it was built eagerly (every process runs the script up to ``fit``),
  nothing when it was built on the meta device (each rank materializes only its share), plus what
  the strategy copies out of it while both exist (FSDP's shards, tensor parallelism's local shards).
- ``train``: the rank's model state, ZeRO's formulas (`shardwise.strategies.cost.memory.model_state_bytes`)
  over the rank's share (``share``: a pipeline stage's blocks, with the embeddings on the first
  stage and the head on the last; the linears tensor parallelism splits, ``1/tp`` of each), plus
  the transient buffers the strategy really holds at its peak (``transient``), plus the activations
  of one micro-batch (Korthikanti et al. 2023, eq. 1 and 2, at 4-byte activations) and the logits
  with their two gradients in the loss (``batch x seq x vocab``, three times).

The transients, per family (``R``: the parameters no FSDP unit holds, which the root unit gathers;
``U``: the largest unit):

- ddp, zero1, and tp or pipeline with dp > 1: DDP's gradient buckets. shardwise builds DDP with
  ``gradient_as_bucket_view=True``, so the gradients are views of the buckets: the buckets are the
  gradients (counted in model state), kept between steps (``zero_grad`` frees the views only).
- zero3 / fsdp / hsdp: the root unit's gathered parameters (FSDP2 keeps the root whole from its
  forward to its backward) and its unsharded gradients (the head's come first in backward and wait
  for the root's reduce-scatter at the very end), ``2 R``, plus, for the largest unit, its all-gather
  buffer and the parameters copied out of it, its unsharded gradients and the reduce-scatter's input
  copy of them, ``4 U`` (the untied embedding and head are units of their own, `fsdp.auto_wrap_units`:
  on the 200 M Llama of benchmarks/memory.py, ``2 R + 2 U`` predicted 1.12 GB above the baseline for
  a measured 1.35 GB; ``4 U`` gives 1.38).
- zero2: its parameters stay gathered (model state says so) and one unit's unsharded gradients wait
  for their reduce-scatter: ``R`` or ``U``, the larger.
- every other family: `GRADIENT_FORMING` times the largest tensor the rank holds whole (fitted).

Left out: the allocator's slack and fragmentation, the data loader, gloo's buffers (a few MB), the
optimizer's temporaries (plain SGD has none; Adam's foreach step makes one parameter-sized
temporary per tensor group), a tied weight held by two pipeline stages (counted once).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from shardwise.strategies.cost.memory import STAGE_OF, model_state_bytes, plain

DIM_ORDER = ("dp", "pp", "tp")
GRADIENT_FORMING = 3
"""Whole-tensor transients of a strategy that holds its weights whole (single, ddp, zero1, tp, pipeline), in units
of the largest tensor the rank holds: at the end of backward the head's gradient is formed in a new tensor while
the logits' gradient and the embedding's dense gradient are alive, and a second micro-batch's gradient is formed
before it is added to ``.grad``. Fitted, not derived: benchmarks/memory.py's 200 M Llama measured 0.34-0.41 GB
above the rest of the prediction for single, ddp, tp and the pipeline, 2.6-3.1 times its 131 MB embedding."""
FSDP_FAMILIES = ("zero3", "fsdp", "hsdp")


@dataclass(frozen=True)
class Tensors:
    """The model's parameters by name, as the planner sees them: elements and bytes per element,
    the block list's prefix (``model.layers``) and whole-model bytes. Counted on any module,
    meta-built too (no tensor is read)."""

    params: Mapping[str, tuple[int, int]]
    """``name -> (elements, bytes per element)`` in ``named_parameters`` order (shared ones once)."""
    blocks: str | None = None
    """The longest block list's name (``model.layers``); its children are the pipeline's blocks."""
    buffer_bytes: int = 0
    """Bytes of the model's buffers (held whole on every rank)."""
    config: Mapping[str, Any] = field(default_factory=dict)
    """A transformer's sizes when the model has a Hugging Face-style ``config`` (hidden, heads, layers, vocab)."""

    @property
    def bytes(self) -> int:
        return sum(n * b for n, b in self.params.values()) + self.buffer_bytes

    def block_of(self, name: str) -> int | None:
        """Which block a parameter is in (``model.layers.3.mlp.up.weight -> 3``), None outside the list."""
        if self.blocks is None or not name.startswith(self.blocks + "."):
            return None
        head = name[len(self.blocks) + 1 :].split(".", 1)[0]
        return int(head) if head.isdigit() else None


def tensors_of(model: Any) -> Tensors:
    """`Tensors` of an ``nn.Module`` (parameters, buffers, the longest ``ModuleList``)."""
    from torch import nn

    params = {n: (p.numel(), p.element_size()) for n, p in model.named_parameters()}
    lists = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.ModuleList | nn.Sequential) and n and len(m) > 1]
    blocks = max(lists, key=lambda item: (len(item[1]), -item[0].count(".")))[0] if lists else None
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    cfg = getattr(model, "config", None)
    sizes: dict[str, Any] = {}
    for key, names in {"hidden": ("hidden_size", "n_embd"), "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",)}.items():
        for n in names:
            if isinstance(getattr(cfg, n, None), int):
                sizes[key] = getattr(cfg, n)
                break
    return Tensors(params=params, blocks=blocks, buffer_bytes=buffers, config=sizes)


def coordinates(rank: int, degrees: Mapping[str, int]) -> dict[str, int]:
    """A rank's ``dp``, ``pp``, ``tp`` indices (dp-major, tp fastest: `shardwise.comm.mesh.Mesh.coordinate`)."""
    out, stride = {}, 1
    for d in reversed(DIM_ORDER):
        size = int(degrees.get(d, 1))
        out[d] = (rank // stride) % size
        stride *= size
    return {d: out[d] for d in DIM_ORDER}


def stage_of(tensors: Tensors, name: str, pp: int) -> int:
    """The pipeline stage a parameter lives on: blocks split in ``pp`` contiguous, nearly equal runs
    (the first stages take one more when they do not divide), what comes before the block list on the
    first stage, what comes after it on the last."""
    if pp == 1:
        return 0
    n_blocks = 1 + max((b for b in (tensors.block_of(k) for k in tensors.params) if b is not None), default=-1)
    block = tensors.block_of(name)
    if block is None or n_blocks == 0:
        names = list(tensors.params)
        first = next((i for i, k in enumerate(names) if tensors.block_of(k) is not None), len(names))
        return 0 if names.index(name) < first else pp - 1
    base, extra = divmod(n_blocks, pp)
    start = 0
    for s in range(pp):
        start += base + (1 if s < extra else 0)
        if block < start:
            return s
    return pp - 1


def _split(name: str, units: Sequence[str]) -> bool:
    return any(name.startswith(u + ".") for u in units)


def share(tensors: Tensors, coords: Mapping[str, int], degrees: Mapping[str, int], tp_units: Sequence[str] = ()) -> dict[str, float]:
    """Bytes of the parameters one rank's model-parallel slice holds before any data-parallel sharding:
    its stage's (``pp``), ``1/tp`` of the linears tensor parallelism splits (``tp_units``) and the whole
    of the rest; ``elements`` and ``bytes``."""
    pp, tp = int(degrees.get("pp", 1)), int(degrees.get("tp", 1))
    elements = nbytes = largest = 0.0
    for name, (n, b) in tensors.params.items():
        if stage_of(tensors, name, pp) != coords.get("pp", 0):
            continue
        frac = 1 / tp if tp > 1 and _split(name, tp_units) else 1.0
        elements += n * frac
        nbytes += n * b * frac
        largest = max(largest, n * b * frac)
    return {"elements": elements, "bytes": nbytes, "largest": largest}


def _units_bytes(tensors: Tensors, units: Sequence[str]) -> tuple[float, float]:
    """(``R``: bytes no unit holds, the root's; ``U``: the largest unit's bytes)."""
    per = {u: 0.0 for u in units}
    root = 0.0
    for name, (n, b) in tensors.params.items():
        owner = max((u for u in units if name.startswith(u + ".")), key=len, default=None)
        if owner is None:
            root += n * b
        else:
            per[owner] += n * b
    return root, max(per.values(), default=0.0)


def activation_bytes(tensors: Tensors, tokens: float, seq: int, layers: float, tp: int = 1) -> float:
    """One micro-batch's saved activations on one rank (``tokens = batch x seq``), 4-byte activations:
    Korthikanti et al. 2023, eq. 1 (eq. 2 at ``tp > 1``) per block held, and the logits with their
    gradients (three ``tokens x vocab`` tensors at the loss). 0 without a transformer config."""
    c = tensors.config
    if not {"hidden", "heads"} <= set(c) or seq <= 0:
        return 0.0
    h, a = c["hidden"], c["heads"]
    per_token = h * (34 + 5 * a * seq / h) if tp == 1 else h * (10 + 24 / tp + 5 * a * seq / (h * tp))
    return 2 * per_token * tokens * layers + 3 * 4 * tokens * c.get("vocab", 0)


def predict_rank(
    tensors: Tensors,
    family: str,
    rank: int,
    degrees: Mapping[str, int],
    *,
    units: Sequence[str] = (),
    micro_batch: int = 1,
    seq: int = 0,
    optimizer_slots: int = 0,
    built_whole: bool = True,
    baseline: float = 0.0,
) -> dict[str, float]:
    """The parts of one rank's predicted peak (see the module docstring) and ``peak`` itself.
    ``units``: the layout's (FSDP's units, or the linears tp splits); ``micro_batch``: samples
    per loader micro-batch on the rank; ``seq``: tokens per sample."""
    coords = coordinates(rank, degrees)
    dp, pp, tp = (int(degrees.get(d, 1)) for d in DIM_ORDER)
    tp_units = units if family in ("tp", "pipeline") else ()
    mine = share(tensors, coords, degrees, tp_units)
    elements = mine["elements"]
    width = mine["bytes"] / elements if elements else 4.0
    stage = STAGE_OF.get(family, 0)
    state = model_state_bytes(stage, elements, dp if stage else 1, plain(int(round(width)), optimizer_slots, master_copy=family == "zero2"))
    transient = 0.0
    if family in FSDP_FAMILIES or family == "zero2":
        root, unit = _units_bytes(tensors, units)
        transient = 2 * root + 4 * unit if family != "zero2" else max(root, unit)
    else:
        transient = GRADIENT_FORMING * mine["largest"]
    n_blocks = 1 + max((b for b in (tensors.block_of(k) for k in tensors.params) if b is not None), default=-1)
    layers = n_blocks / pp
    last = coords["pp"] == pp - 1
    acts = activation_bytes(tensors, micro_batch * seq, seq, layers, tp)
    if pp > 1 and not last:  # the logits and the loss are the last stage's
        acts -= 3 * 4 * micro_batch * seq * tensors.config.get("vocab", 0)
    held_params = state["params"]
    # What the strategy copies out of an eagerly built model while the model still exists: FSDP's and
    # tp's shards are new tensors; ddp, zero1, zero2 (before its first gather) and a pipeline stage keep the model's own.
    copied = held_params if family in (*FSDP_FAMILIES, "tp") else 0.0
    build = (tensors.bytes + copied) if built_whole else 0.0
    train = state["total"] + transient + max(acts, 0.0) + tensors.buffer_bytes
    if built_whole and family not in (*FSDP_FAMILIES, "tp"):
        train += tensors.bytes - mine["bytes"]  # the rest of the eager model stays with the script's reference
    peak = baseline + max(build, train)
    return {
        "params": held_params,
        "grads": state["grads"],
        "optimizer": state["optimizer"],
        "transient": transient,
        "activations": max(acts, 0.0),
        "build": build,
        "train": train,
        "baseline": baseline,
        "above_baseline": peak - baseline,
        "peak": peak,
    }


def role(rank: int, degrees: Mapping[str, int]) -> str:
    """``dp0 pp1 tp0`` for the dimensions larger than one (``dp0`` when none is)."""
    c = coordinates(rank, degrees)
    parts = [f"{d}{c[d]}" for d in DIM_ORDER if int(degrees.get(d, 1)) > 1]
    return " ".join(parts) or "dp0"
