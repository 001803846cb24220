"""Pretrained weights into a meta-built model under every split: each rank's tensors equal, bit for
bit, the slices of ``from_pretrained`` that rank holds, and it reads no other bytes.

One launch of 2 processes. For HF Llama (untied, its checkpoint sharded over several files by
``max_shard_size``), GPT-2 (tied ``lm_head``, fused Conv1D ``c_attn`` permuted by tp) and Gemma
(tied, a family no other test used), vocabularies of 33 so FSDP's shards are uneven, each built
under ``torch.device("meta")`` and split by the project's own functions: the whole module (ddp,
single), FSDP2 (`apply_fsdp`), HSDP (a 2-D mesh), tensor parallelism (`parallelize`, sequence
parallelism off and on), tp with FSDP over it (2-D mesh, strided shards: Llama), and a
pipeline stage's module (`NestedStage`, stage = rank; GPT-2's head on the last stage, its
embedding on the first). Then ``to_empty`` and `load_local`; compared in float64 with the
from_pretrained model: every local tensor (the expected shard cut from the whole tensor, tp's
permutation applied by the strategy's own `fused_permutation`), every DTensor gathered whole,
the local storage unchanged (written in place), the bytes read equal to the bytes held, and
the split model's logits.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from shardwise import launch

pytest.importorskip("transformers", reason="the pretrained tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

FAMILIES = ("llama", "gpt2", "gemma")
CELLS = ("whole", "fsdp", "hsdp", "tp", "tp+sp", "tp+fsdp", "pipeline")


def _build(name: str, meta: bool) -> torch.nn.Module:
    import transformers as tf

    c: dict[str, Any] = dict(vocab_size=33, attn_implementation="eager")
    if name == "gpt2":
        drop = dict(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        cfg: Any = tf.GPT2Config(n_positions=16, n_embd=16, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0, **drop, **c)
        cls: Any = tf.GPT2LMHeadModel
    else:
        c.update(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16)
        if name == "llama":
            cfg, cls = tf.LlamaConfig(tie_word_embeddings=False, **c), tf.LlamaForCausalLM
        else:
            cfg, cls = tf.GemmaConfig(head_dim=4, **c), tf.GemmaForCausalLM  # tied head
    if meta:
        with torch.device("meta"):
            return cls(cfg).double()
    torch.manual_seed(0)
    return cls(cfg).double()


def _split(cell: str, model: torch.nn.Module, rank: int) -> tuple[torch.nn.Module, dict[str, int] | None]:
    """``model`` split as ``cell`` splits it; the module this rank holds and tp's fused record."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardwise.strategies.pipeline.nested import NestedStage, nested_layout, split_blocks
    from shardwise.strategies.sharded.fsdp import apply_fsdp
    from shardwise.strategies.tensor_parallel.apply import parallelize, tp_info

    layout = nested_layout(model)
    units = [f"{layout.blocks}.{k}" for k in split_blocks(model, layout, 1)[0]]
    if cell == "fsdp":
        apply_fsdp(model, init_device_mesh("cpu", (2,)), units=units)
    elif cell == "hsdp":
        apply_fsdp(model, init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")), units=units)
    elif cell in ("tp", "tp+sp"):
        parallelize(model, init_device_mesh("cpu", (2,)), sequence_parallel=cell == "tp+sp")
    elif cell == "tp+fsdp":  # FSDP over the tp-split weights: a tp dimension of 1 keeps it cheap, the placements are 2-D
        mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("dp", "tp"))
        parallelize(model, mesh["tp"])
        for unit in units:
            fully_shard(model.get_submodule(unit), mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    elif cell == "pipeline":
        runs = split_blocks(model, layout, 2)
        return NestedStage(model, layout, runs[rank], rank == 0, rank == 1), None
    info = tp_info(model)
    return model, (info["fused"] if info else None)


def _expected(t: Any, whole: torch.Tensor, parts: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from shardwise.strategies.tensor_parallel.styles import fused_permutation

    if not isinstance(t, DTensor):
        return whole
    if parts:
        (dim,) = {p.dim for p in t.placements if isinstance(p, Shard)}
        whole = whole.index_select(dim, fused_permutation(whole.shape[dim] // parts, parts, t.device_mesh.size()))
    return distribute_tensor(whole, t.device_mesh, t.placements, src_data_rank=None).to_local()


_REFS: dict[str, torch.nn.Module] = {}


def _cell(name: str, cell: str, root: str, rank: int) -> dict[str, Any]:
    import transformers as tf
    from torch.distributed.tensor import DTensor

    from shardwise.checkpoint.pretrained import WeightsSource, init_from, load_local, persistent_tensors

    path = f"{root}/{name}"
    if name not in _REFS:
        _REFS[name] = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64, attn_implementation="eager")
    ref = _REFS[name]
    meta = _build(name, meta=True)
    keys = init_from(meta, path).__dict__["_shardwise_weights"]["keys"]  # a pipeline stage is not the model: its keys are passed
    module, fused = _split(cell, meta, rank)
    module.to_empty(device="cpu")
    storage = {n: (t.to_local() if isinstance(t, DTensor) else t).data_ptr() for n, t in persistent_tensors(module)}
    src = WeightsSource.open(path)
    read = [0]
    plain_read = src.read

    def counted(key: str, index: Any = None) -> torch.Tensor:
        out = plain_read(key, index)
        read[0] += out.numel() * out.element_size()
        return out

    src.read = counted  # type: ignore[method-assign]
    filled = load_local(module, src, keys=keys if cell == "pipeline" else None, fused=fused)
    out: dict[str, Any] = {"filled": filled, "read": read[0], "wrong": [], "moved": [], "gathered": [], "dtensors": 0, "fused": sorted(fused or {})}
    parts = {f"{m}.{p}": n for m, n in (fused or {}).items() for p in ("weight", "bias")}
    held, seen = 0, set()
    params = dict(module.named_parameters(remove_duplicate=False))
    for n, t in persistent_tensors(module):
        local = t.to_local() if isinstance(t, DTensor) else t
        if id(t) not in seen:
            seen.add(id(t))
            held += local.numel() * local.element_size()
        whole = ref.get_parameter(n) if n in params else ref.get_buffer(n)
        if not torch.equal(local, _expected(t, whole.detach(), parts.get(n, 0))):
            out["wrong"].append(n)
        if local.data_ptr() != storage[n]:
            out["moved"].append(n)
        if isinstance(t, DTensor):
            out["dtensors"] += 1
            if not torch.equal(t.full_tensor().detach(), whole.detach()) and n not in parts:
                out["gathered"].append(n)
    out["held"] = held
    out["checkpoint"] = sum(e.nbytes for e in src.entries.values())
    out["inv_freq"] = [n for n, _ in module.named_buffers() if n.endswith("inv_freq")]
    if cell != "pipeline":
        # the split model's own forward: FSDP gathers from its own storage, tp computes on its shards;
        # the buffers no checkpoint holds (rotary inv_freq) are the initializer's: here, the reference's
        with torch.no_grad():
            for n, b in module.named_buffers():
                if n not in filled:
                    b.copy_(ref.get_buffer(n))
            x = torch.arange(12).view(1, 12) % 33
            out["logits"] = float((module(x).logits - ref(x).logits).abs().max())
    return out


def _own_model(meta: bool) -> torch.nn.Sequential:
    """A model written by hand (no prefix, no transformers) whose last bias has 1 element: rank 1's FSDP shard of it is empty."""
    with torch.device("meta" if meta else "cpu"):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(16, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1)).double()


def _own_cell(root: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.checkpoint.pretrained import WeightsSource, check, load_local
    from shardwise.strategies.sharded.fsdp import apply_fsdp

    path, ref = f"{root}/own.safetensors", _own_model(meta=False)
    model = _own_model(meta=True)
    keys = check(model, path)
    apply_fsdp(model, init_device_mesh("cpu", (2,)), units=["0", "2"])
    model.to_empty(device="cpu")
    filled = load_local(model, WeightsSource.open(path), keys=keys)
    x = torch.linspace(-1, 1, 32, dtype=torch.float64).view(2, 16)
    with torch.no_grad():
        logits = float((model(x) - ref(x)).abs().max())
    shapes = {n: tuple(p.to_local().shape) for n, p in model.named_parameters()}
    same = all(torch.equal(p.full_tensor().detach(), ref.get_parameter(n).detach()) for n, p in model.named_parameters())
    return {"filled": filled, "shapes": shapes, "same": same, "logits": logits}


def _worker(root: str) -> dict[tuple[str, str], dict[str, Any]]:
    import torch.distributed as dist

    rank = dist.get_rank()
    out = {("own", "fsdp"): _own_cell(root)}
    for name in FAMILIES:
        out |= {(name, cell): _cell(name, cell, root, rank) for cell in CELLS if not (cell == "tp+fsdp" and name != "llama")}
    return out


@pytest.fixture(scope="module")
def runs() -> tuple[list[dict[tuple[str, str], dict[str, Any]]], dict[str, list[str]]]:
    with tempfile.TemporaryDirectory() as root:
        for name in FAMILIES:
            # Llama's checkpoint is sharded over several files, as large downloads are
            _build(name, meta=False).save_pretrained(f"{root}/{name}", max_shard_size="20KB" if name == "llama" else "5GB")
        save_file({k: v.contiguous() for k, v in _own_model(meta=False).state_dict().items()}, f"{root}/own.safetensors")
        files = {name: sorted(p.name for p in Path(root, name).glob("*.safetensors*")) for name in FAMILIES}
        return launch(_worker, root, nproc=2, threads_per_proc=1, timeout=280), files


def test_the_llama_checkpoint_is_sharded(runs: Any) -> None:
    files = runs[1]["llama"]
    assert "model.safetensors.index.json" in files and len(files) >= 3, files  # the index and 2 or more files


@pytest.mark.parametrize("name", FAMILIES)
def test_every_rank_holds_exactly_its_slice_of_from_pretrained(runs: Any, name: str) -> None:
    for rank, results in enumerate(runs[0]):
        for (family, cell), r in results.items():
            if family not in FAMILIES or family != name:
                continue
            where = f"{name} {cell} rank {rank}"
            assert not r["wrong"], f"{where}: local tensors differ from from_pretrained's slice: {r['wrong'][:5]}"
            assert not r["gathered"], f"{where}: gathered whole, differ: {r['gathered'][:5]}"
            assert not r["moved"], f"{where}: not written in place: {r['moved'][:5]}"
            assert r["read"] == r["held"], f"{where}: read {r['read']} bytes, holds {r['held']}"
            assert not any(n.endswith("inv_freq") for n in r["filled"]), f"{where}: a non-persistent buffer was filled"
            if cell != "pipeline":
                assert r["logits"] <= 1e-12, f"{where}: logits differ by {r['logits']}"
            if cell in ("fsdp", "hsdp", "tp", "tp+sp", "tp+fsdp"):
                assert r["dtensors"] > 0, f"{where}: nothing was split"
            if cell in ("tp", "tp+sp") and name == "gpt2":
                assert len(r["fused"]) == 2, f"{where}: tp permuted no c_attn: {r['fused']}"


def test_a_pipeline_stage_reads_only_its_own_blocks(runs: Any) -> None:
    for name in FAMILIES:
        first, last = (runs[0][rank][(name, "pipeline")] for rank in (0, 1))
        assert not first["filled"] & last["filled"] - {"lm_head.weight", "transformer.wte.weight", "model.embed_tokens.weight"}
        assert any(".layers.0." in n or ".h.0." in n for n in first["filled"]) and not any(".layers.0." in n or ".h.0." in n for n in last["filled"])
        assert "lm_head.weight" in last["filled"]  # GPT-2's and Gemma's tied head, read from the embedding's key
        whole = runs[0][0][(name, "whole")]
        assert first["read"] < whole["read"] and last["read"] < whole["read"]


def test_fsdp_ranks_read_each_byte_of_the_checkpoint_once_between_them(runs: Any) -> None:
    for name in FAMILIES:
        whole = runs[0][0][(name, "fsdp")]["checkpoint"]
        parts = [runs[0][rank][(name, "fsdp")]["read"] for rank in (0, 1)]
        assert sum(parts) == whole, (name, parts, whole)  # the tied weight once: FSDP keeps one Parameter for it
        assert max(parts) < 0.6 * whole, (name, parts, whole)


def test_a_hand_written_model_with_an_empty_fsdp_shard_loads_on_both_ranks(runs: Any) -> None:
    first, second = (runs[0][rank][("own", "fsdp")] for rank in (0, 1))
    assert first["shapes"]["2.bias"] == (1,) and second["shapes"]["2.bias"] == (0,)  # 1 element over 2 ranks
    for r in (first, second):
        assert r["same"] and r["logits"] <= 1e-12 and r["filled"] == {"0.weight", "0.bias", "2.weight", "2.bias"}
