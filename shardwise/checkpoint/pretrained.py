"""Pretrained weights into a model that was never whole: each rank reads only the slices it holds.

A model built on the meta device (``with torch.device("meta")``) has shapes but no storage. The
strategy splits it (FSDP2 shards, tp's DTensor shards, a pipeline stage's own blocks), each rank
allocates its share (``module.to_empty(device=...)``), and `load_local` fills that share from a
safetensors checkpoint, reading only the bytes the rank holds (``safe_open(...).get_slice``), so
no process ever holds the whole model. What it gives is, bit for bit, what ``from_pretrained``
and then the strategy give: every value is cast to the parameter's dtype as ``from_pretrained``
casts it.

- `WeightsSource.open(path)`: a Hugging Face checkpoint directory (``model.safetensors``, or
  sharded with ``model.safetensors.index.json``), one ``.safetensors`` file, or a ``shardwise
  export`` (one file, or a directory holding one). Shapes and dtypes come from the files'
  headers (the first bytes of each file), no tensor data is read.
- `check(model, source)`: in the parent, before launch, on the meta model: every parameter and
  persistent buffer maps to a key of the same shape, names mapped as ``from_pretrained`` maps
  them (exact; with or without the model's ``base_model_prefix``, so a ``LlamaModel``
  checkpoint loads into ``LlamaForCausalLM`` and the reverse; a tied weight, one ``Parameter``
  under several names such as GPT-2's ``lm_head.weight`` and ``transformer.wte.weight``, by
  whichever name the checkpoint holds). Anything missing, unexpected or of another shape is a
  `ConfigError`. Returns the map parameter name -> checkpoint key.
- `load_local(module, source, keys=..., fused=...)`: on a rank, fills every parameter and
  persistent buffer ``module`` holds, in place; returns the names it filled. Non-persistent
  buffers (rotary ``inv_freq``) are in no checkpoint: the caller initializes them.
- `init_from(model, path)`: the user's marker (``shardwise.init_from``); `recorded(model)` reads it back.

Which elements a DTensor holds comes from its mesh and placements (``Shard`` of any dimension,
uneven shards, several mesh dimensions, FSDP2's strided shards over tp), computed locally by
splitting an index vector the way DTensor splits the tensor (no communication). A fused q|k|v
weight that tensor parallelism permutes so that each rank's contiguous shard holds whole heads
(``fused``: tp's record, module or parameter name -> parts) is read as a few contiguous runs of
the original rows, one per part, never whole.

``resume=`` of a shardwise checkpoint is unchanged: it restores the whole training state
(optimizer, data position, RNG) through `shardwise.checkpoint.files`; this module loads only
weights, into a fresh run.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
RECORD = "_shardwise_weights"
"""The attribute `init_from` sets in the model's ``__dict__``: a plain dict (path and key map), so the model pickles."""

_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_SHOWN = 5


def _few(names: Iterable[str]) -> str:
    items = sorted(names)
    head = ", ".join(items[:_SHOWN])
    return f"{head} (and {len(items) - _SHOWN} more)" if len(items) > _SHOWN else head


@dataclass(frozen=True)
class Entry:
    """One key of a checkpoint: its file, global shape and dtype (from the file's header)."""

    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype | str
    nbytes: int


def _header(file: Path) -> dict[str, Any]:
    """A safetensors file's header (8 bytes of length, then JSON): the keys without their data."""
    size = file.stat().st_size
    with file.open("rb") as f:
        raw = f.read(8)
        n = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
        if n <= 0 or n > size - 8:
            raise ConfigError(f"{file} is not a safetensors file (its header length reads {n}, the file has {size} bytes); pass a .safetensors file")
        try:
            header = json.loads(f.read(n))
        except ValueError as exc:
            raise ConfigError(f"{file} is not a safetensors file (its header is not JSON: {exc})") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{file} is not a safetensors file (its header is a {type(header).__name__}, not a mapping)")
    return header


@dataclass
class WeightsSource:
    """The tensors of a safetensors checkpoint by key: shapes and dtypes known, data read by slice.

    >>> src = WeightsSource.open("gpt2/")            # doctest: +SKIP
    >>> src.shape("h.0.attn.c_attn.weight")          # doctest: +SKIP
    (768, 2304)
    >>> src.read("wte.weight", (slice(0, 10), slice(None)))  # 10 rows, only their bytes  # doctest: +SKIP
    """

    path: Path
    entries: dict[str, Entry]
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> WeightsSource:
        """Open a checkpoint directory, a ``.safetensors`` file or a shardwise export; reads headers only."""
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"pretrained weights {str(path)!r} do not exist; pass a Hugging Face checkpoint directory or a .safetensors file")
        files = _files_of(path)
        entries: dict[str, Entry] = {}
        metadata: dict[str, str] = {}
        for file in files:
            header = _header(file)
            meta = header.pop("__metadata__", None) or {}
            metadata.update({str(k): str(v) for k, v in meta.items()})
            for key, info in header.items():
                dtype = info.get("dtype", "?")
                start, end = info.get("data_offsets", (0, 0))
                entries[key] = Entry(file, tuple(int(d) for d in info.get("shape", ())), _DTYPES.get(dtype, dtype), int(end) - int(start))
        if path.is_dir() and (path / INDEX).is_file():
            wanted = set(_index(path))
            if wanted - set(entries):
                raise ConfigError(f"{path / INDEX} lists keys its files do not hold: {_few(wanted - set(entries))}; the download is incomplete")
        return cls(path, entries, metadata)

    def keys(self) -> list[str]:
        return list(self.entries)

    def __contains__(self, key: object) -> bool:
        return key in self.entries

    def shape(self, key: str) -> tuple[int, ...]:
        return self.entries[key].shape

    def dtype(self, key: str) -> torch.dtype | str:
        return self.entries[key].dtype

    def read(self, key: str, index: tuple[slice, ...] | None = None) -> torch.Tensor:
        """``key``'s tensor, or the block ``index`` (one slice per dimension) of it: only those bytes are read.

        Each read maps the file and unmaps it before returning: a mapped page counts in the
        process's resident memory (its VmHWM) for as long as the map lives, so a map kept open
        over a whole load would hold every page read so far (measured: +168 MB of file pages
        beside a 127 MB shard of a 253 MB checkpoint); one read's pages at most this way."""
        from safetensors import safe_open

        entry = self.entries[key]
        with safe_open(str(entry.file), framework="pt", device="cpu") as handle:
            out: torch.Tensor = handle.get_tensor(key) if index is None or not entry.shape else handle.get_slice(key)[index]
        return out


def _index(path: Path) -> dict[str, str]:
    try:
        weight_map = json.loads((path / INDEX).read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path / INDEX} is not a safetensors index (no weight_map: {exc!r}); download the checkpoint again") from None
    return {str(k): str(v) for k, v in weight_map.items()}


def _files_of(path: Path) -> list[Path]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ConfigError(f"pretrained weights must be safetensors; got {path.name}. Convert it (save_pretrained(dir)) or pass a .safetensors file")
        return [path]
    if (path / INDEX).is_file():
        return [path / f for f in dict.fromkeys(sorted(set(_index(path).values())))]
    if (path / SINGLE).is_file():
        return [path / SINGLE]
    if (path / "manifest.json").is_file():
        raise ConfigError(
            f"{path} is a shardwise checkpoint, not pretrained weights; continue its run with resume={str(path)!r}, "
            "or write its weights to one file with: shardwise export CHECKPOINT OUT.safetensors"
        )
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found  # a shardwise export, or any one-file checkpoint under another name
    held = sorted(p.name for p in path.iterdir())[:8]
    what = f"{len(found)} .safetensors files and no {INDEX}" if found else f"no .safetensors file (it holds {held})"
    raise ConfigError(f"{path} has {what}; pass a directory with {SINGLE} or {INDEX}, or one .safetensors file")


def _open(source: WeightsSource | str | os.PathLike[str]) -> WeightsSource:
    return source if isinstance(source, WeightsSource) else WeightsSource.open(source)


# -- names: the model's tensors -> the checkpoint's keys -----------------------------------------


def persistent_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer of ``module`` under each of its names (tied ones more than once)."""
    for prefix, mod in module.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, p in mod._parameters.items():
            if p is not None:
                yield dot + name, p
        for name, b in mod._buffers.items():
            if b is not None and name not in mod._non_persistent_buffers_set:
                yield dot + name, b


def _groups(module: nn.Module) -> list[list[str]]:
    """Names grouped by tensor identity: a tied weight is one group of several names."""
    by_id: dict[int, list[str]] = {}
    for name, t in persistent_tensors(module):
        names = by_id.setdefault(id(t), [])
        if name not in names:
            names.append(name)
    return list(by_id.values())


def _ignored(model: nn.Module, attr: str) -> list[str]:
    # transformers' own list of keys from_pretrained drops silently (GPT-2's old causal-mask
    # buffers ``attn.bias``); a set of patterns in transformers 5, a list in 4.
    patterns = model.__dict__.get(attr, getattr(type(model), attr, None))
    return [str(p) for p in patterns or ()]


def key_map(model: nn.Module, source: WeightsSource | str | os.PathLike[str], *, strict: bool = True) -> dict[str, str]:
    """Parameter / persistent-buffer name -> checkpoint key, as ``from_pretrained`` maps them; raises `ConfigError`.

    ``strict=False`` (a part of a model, such as a pipeline stage) does not call the checkpoint's
    other keys unexpected."""
    src = _open(source)
    keys = set(src.keys())
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    has_base = bool(prefix) and isinstance(model._modules.get(prefix), nn.Module)
    prefixed = bool(prefix) and any(k.startswith(prefix + ".") for k in keys)
    # from_pretrained decides once per checkpoint: a base model's checkpoint into a model with a
    # head gets the prefix added; a head model's checkpoint into its base model loses it.
    if has_base and not prefixed:
        to_key = {(f"{prefix}.{k}"): k for k in keys}
    elif prefix and not has_base and prefixed:
        to_key = {k[len(prefix) + 1 :]: k for k in keys if k.startswith(prefix + ".")}
    else:
        to_key = {k: k for k in keys}
    mapping: dict[str, str] = {}
    missing: list[str] = []
    for names in _groups(model):
        found = [n for n in names if n in to_key]
        if not found:
            missing.append(names[0] if len(names) == 1 else f"{names[0]} (tied: {', '.join(names[1:])})")
            continue
        for n in names:  # a tied weight is read once, from its own key when the checkpoint has it
            mapping[n] = to_key[n] if n in to_key else to_key[found[0]]
    ignore_missing = _ignored(model, "_keys_to_ignore_on_load_missing")
    missing = [m for m in missing if not any(re.search(p, m) for p in ignore_missing)]
    shapes = {n: tuple(t.shape) for n, t in persistent_tensors(model)}
    wrong = [f"{n} {list(shapes[n])} (checkpoint {k}: {list(src.shape(k))})" for n, k in mapping.items() if tuple(src.shape(k)) != shapes[n]]
    unexpected: list[str] = []
    if strict:
        used = set(mapping.values())
        ignore = _ignored(model, "_keys_to_ignore_on_load_unexpected")
        # keys outside the prefix in a head model's checkpoint loaded into its base model are the
        # head's, which the base model has not: dropped, as from_pretrained drops them
        head = {k for k in keys if prefix and not has_base and prefixed and not k.startswith(prefix + ".")}
        unexpected = [k for k in keys - used - head if not any(re.search(p, k) for p in ignore)]
    if missing or unexpected or wrong:
        raise ConfigError(_mismatch(model, src, missing, unexpected, wrong))
    return mapping


def _mismatch(model: nn.Module, src: WeightsSource, missing: list[str], unexpected: list[str], wrong: list[str]) -> str:
    lines = [f"the pretrained weights in {src.path} do not fit {type(model).__name__} ({len(src.entries)} keys in the checkpoint):"]
    if missing:
        lines.append(f"  {len(missing)} missing from the checkpoint: {_few(missing)}")
    if unexpected:
        lines.append(f"  {len(unexpected)} unexpected (the model has no such tensor): {_few(unexpected)}")
    if wrong:
        lines.append(f"  {len(wrong)} of another shape: {_few(wrong)}")
    lines.append("Build the model from the checkpoint's own config (AutoConfig.from_pretrained(path)) so that names and shapes agree")
    return "\n".join(lines)


def check(model: nn.Module, source: WeightsSource | str | os.PathLike[str]) -> dict[str, str]:
    """Before launch, on the (meta) model: every tensor has its key, same shape; returns name -> key.

    Raises `ConfigError` naming the first few missing, unexpected and differently shaped names,
    each with its count. Meta tensors are enough: only names and shapes are compared."""
    return key_map(model, source, strict=True)


# -- marker -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recorded:
    """What `init_from` recorded on a model: the checkpoint's path and the name -> key map."""

    path: str
    keys: dict[str, str]


def init_from(model: nn.Module, path: str | os.PathLike[str]) -> nn.Module:
    """Mark ``model`` (usually built on the meta device) to start from the weights at ``path``; returns it.

    ``path``: a Hugging Face checkpoint directory (``model.safetensors``, or sharded with
    ``model.safetensors.index.json``), a ``.safetensors`` file, or a ``shardwise export``. The
    names and shapes are checked here, in this process (`check`); the weights are read later,
    on each rank, only the slices that rank holds after the strategy split the model, instead
    of the model's random initialization. Parameters equal, bit for bit, ``from_pretrained``'s
    under any strategy. Buffers no checkpoint holds (rotary ``inv_freq``) are initialized as
    the model initializes them.

    This is for a fresh run from pretrained weights; ``resume=`` of a shardwise checkpoint is
    unchanged (it restores the optimizer, data position and RNG as well).

    >>> import shardwise, torch, transformers                              # doctest: +SKIP
    >>> cfg = transformers.AutoConfig.from_pretrained("path/to/llama")     # doctest: +SKIP
    >>> with torch.device("meta"):                                         # doctest: +SKIP
    ...     model = transformers.AutoModelForCausalLM.from_config(cfg)
    >>> shardwise.init_from(model, "path/to/llama")                        # doctest: +SKIP
    >>> shardwise.Trainer(strategy="fsdp", nproc=8).fit(model, data)       # doctest: +SKIP
    """
    keys = check(model, path)
    # a plain dict in __dict__ (not a module attribute torch tracks): the model pickles to the ranks with it
    model.__dict__[RECORD] = {"path": str(Path(path).resolve()), "keys": keys}
    return model


def recorded(model: nn.Module) -> Recorded | None:
    """What `init_from` recorded on ``model``; None when the model starts from its own initializer."""
    record = model.__dict__.get(RECORD)
    if not isinstance(record, dict):
        return None
    return Recorded(str(record["path"]), dict(record["keys"]))


# -- a rank's share -------------------------------------------------------------------------------


def _fused_parts(module: nn.Module, fused: Mapping[str, int] | None) -> dict[str, int]:
    """Parameter name -> parts for every fused tensor (``fused`` names modules or parameters)."""
    out: dict[str, int] = {}
    for name, parts in (fused or {}).items():
        sub = None
        try:
            sub = module.get_submodule(name)
        except AttributeError:
            out[name] = int(parts)
            continue
        for pname, _ in sub.named_parameters(recurse=False):
            out[f"{name}.{pname}" if name else pname] = int(parts)
    return out


def _permutation(width: int, parts: int, tp: int) -> list[int]:
    # tp's fused re-layout (strategies/tensor_parallel/styles.fused_permutation, one layer up):
    # position i of the run's tensor holds row perm[i] of the original, each rank's contiguous
    # shard holding its slice of every part, [q_r k_r v_r].
    step = width // tp
    return [j * width + r * step + i for r in range(tp) for j in range(parts) for i in range(step)]


def _indices(t: Any) -> list[list[int]]:
    """For each dimension, the global indices of ``t``'s elements this rank holds (a DTensor's shard or all)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    shape = list(t.shape)
    out = [list(range(n)) for n in shape]
    if not isinstance(t, DTensor):
        return out
    mesh, placements = t.device_mesh, t.placements
    for dim in {p.dim for p in placements if isinstance(p, Shard)}:
        # split a vector of indices exactly as DTensor splits this dimension (uneven chunks,
        # strided shards of FSDP over tp), locally: src_data_rank=None sends nothing
        along = [type(p)(0, **_extra(p)) if isinstance(p, Shard) and p.dim == dim else Replicate() for p in placements]
        vec = torch.arange(shape[dim], device=mesh.device_type)
        out[dim] = distribute_tensor(vec, mesh, along, src_data_rank=None).to_local().cpu().tolist()
    return out


def _extra(p: Any) -> dict[str, Any]:
    # _StridedShard (FSDP2 over a tp-sharded dimension) carries its split factor
    split = getattr(p, "split_factor", None)
    return {"split_factor": split} if split is not None else {}


def _runs(index: list[int]) -> list[tuple[int, int]]:
    """Contiguous runs ``[start, stop)`` of an index list, in order."""
    runs: list[tuple[int, int]] = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _read_block(src: WeightsSource, key: str, runs: list[list[tuple[int, int]]], prefix: tuple[slice, ...] = ()) -> torch.Tensor:
    d = len(prefix)
    if d == len(runs):
        return src.read(key, prefix)
    parts = [_read_block(src, key, runs, (*prefix, slice(a, b))) for a, b in runs[d]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=d)


def read_local(src: WeightsSource, key: str, t: Any, parts: int = 0) -> torch.Tensor:
    """The elements of ``key`` that ``t`` (a plain tensor, or a DTensor's shard on this rank) holds,
    as a tensor of ``t``'s local shape, read slice by slice; ``parts`` > 0: a tp-permuted fused tensor."""
    from torch.distributed.tensor import DTensor, Shard

    index = _indices(t)
    if parts:
        sharded = [(i, p.dim) for i, p in enumerate(t.placements) if isinstance(p, Shard)] if isinstance(t, DTensor) else []
        dims = {d for _, d in sharded}
        if len(dims) > 1:
            raise ConfigError(f"{key}: a fused tensor sharded on several dimensions {sorted(dims)}; tp's fused layout splits one")
        if dims:
            dim = dims.pop()
            tp = 1
            for i, _ in sharded:
                tp *= t.device_mesh.size(i)
            perm = _permutation(t.shape[dim] // parts, parts, tp)
            index[dim] = [perm[i] for i in index[dim]]
    if any(not ix for ix in index):
        return torch.empty([len(ix) for ix in index], dtype=t.dtype)  # an empty shard (uneven split): nothing to read
    runs = [_runs(ix) for ix in index]
    return _read_block(src, key, runs)


def load_local(
    module: nn.Module,
    source: WeightsSource | str | os.PathLike[str],
    *,
    keys: Mapping[str, str] | None = None,
    fused: Mapping[str, int] | None = None,
) -> set[str]:
    """Fill the parameters and persistent buffers ``module`` holds on this rank from ``source``, in place.

    Call after the strategy split the (meta) model and ``module.to_empty(device=...)`` allocated
    this rank's storage. A plain tensor gets its whole key; a DTensor exactly its local shard,
    written into its own local tensor (``to_local()`` under ``no_grad`` is that storage: FSDP2's
    shard, tp's split). Values are cast to each tensor's dtype.

    ``keys``: name -> checkpoint key from `check` on the whole meta model (`recorded(model).keys`);
    needed where ``module`` is part of a model (a pipeline stage whose tied head has lost its
    embedding) or a tied model after ``to_empty`` (which unties meta weights: each name gets a
    Parameter of its own, filled here from the one key; re-tie them after, e.g. transformers'
    ``model.tie_weights()``). None: the map `init_from` recorded on ``module``, else ``module``'s own names. ``fused``: the fused q|k|v modules
    tensor parallelism permuted (its record's ``fused``, module or parameter name -> parts).

    Returns every name filled (tied names included); the caller initializes the rest (the
    non-persistent buffers, which no checkpoint holds).
    """
    from torch.distributed.tensor import DTensor

    src = _open(source)
    if keys is None:
        # the map `init_from` recorded on the whole model, before ``to_empty``: to_empty gives each
        # name of a meta weight its own new Parameter, so a tie is no longer visible by identity
        record = recorded(module)
        keys = record.keys if record is not None else key_map(module, src, strict=False)
    names = dict(keys)
    parts = _fused_parts(module, fused)
    filled: set[str] = set()
    done: dict[int, str] = {}
    for name, t in persistent_tensors(module):
        if id(t) in done:  # a tied name of a tensor already filled
            filled.add(name)
            continue
        key = names.get(name)
        if key is None:
            raise ConfigError(f"{name} has no key in {src.path} (a key map of {len(names)} other tensors); pass keys=check(model, path) of the whole model")
        data = read_local(src, key, t, parts.get(name, 0))
        with torch.no_grad():
            local = t.to_local() if isinstance(t, DTensor) else t
            if tuple(local.shape) != tuple(data.shape):
                raise ConfigError(f"{name}: this rank holds {list(local.shape)} but {key} gives {list(data.shape)} ({list(src.shape(key))} whole)")
            local.copy_(data)
        done[id(t)] = name
        filled.add(name)
    return filled
