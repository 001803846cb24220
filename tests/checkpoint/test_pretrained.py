"""Pretrained weights (`shardwise.checkpoint.pretrained`), in one process: what a source knows from
its headers, what it reads by slice, how `check` maps names as ``from_pretrained`` does (prefix
either way, a tied weight by either key) and what it refuses, `init_from`'s record, and a whole
model (ddp, single) loaded bit for bit. The splits (FSDP, tp, pipeline) are in
tests/checkpoint/test_pretrained_dist.py.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

import shardwise
from shardwise.checkpoint import files as ckpt
from shardwise.checkpoint.export import export_safetensors
from shardwise.checkpoint.pretrained import WeightsSource, check, load_local, recorded
from shardwise.errors import ConfigError

tf = pytest.importorskip("transformers", reason="the pretrained tests need transformers: pip install -e '.[dev]'")


def _llama(cls: Any = None, meta: bool = False, **over: Any) -> torch.nn.Module:
    c = dict(vocab_size=33, hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    cfg = tf.LlamaConfig(**{**c, **over})
    cls = cls or tf.LlamaForCausalLM
    if meta:
        with torch.device("meta"):
            return cls(cfg).double()
    torch.manual_seed(0)
    return cls(cfg).double()


def _gpt2(meta: bool = False) -> torch.nn.Module:
    cfg = tf.GPT2Config(vocab_size=33, n_positions=8, n_embd=16, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    if meta:
        with torch.device("meta"):
            return tf.GPT2LMHeadModel(cfg).double()
    torch.manual_seed(0)
    return tf.GPT2LMHeadModel(cfg).double()


def _save(state: dict[str, torch.Tensor], path: Path) -> Path:
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(path))
    return path


def test_a_file_knows_shapes_dtypes_and_sizes_from_its_header_and_reads_a_slice(tmp_path: Path) -> None:
    a = torch.arange(35, dtype=torch.float64).view(5, 7)
    path = _save({"a": a, "b": torch.ones(3, dtype=torch.bfloat16), "c": torch.tensor(7)}, tmp_path / "w.safetensors")
    src = WeightsSource.open(path)
    assert sorted(src.keys()) == ["a", "b", "c"] and "a" in src and "z" not in src
    assert (src.shape("a"), src.dtype("a"), src.entries["a"].nbytes) == ((5, 7), torch.float64, 35 * 8)
    assert (src.shape("b"), src.dtype("b"), src.shape("c"), src.dtype("c")) == ((3,), torch.bfloat16, (), torch.int64)
    assert torch.equal(src.read("a", (slice(1, 3), slice(2, 6))), a[1:3, 2:6])
    assert torch.equal(src.read("a"), a) and int(src.read("c")) == 7
    # a directory holding one file under another name (a shardwise export saved into its own directory)
    assert WeightsSource.open(tmp_path).keys() == src.keys()


def test_a_sharded_checkpoint_is_read_through_its_index_and_a_whole_model_loads_bit_for_bit(tmp_path: Path) -> None:
    model = _llama()
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    src = WeightsSource.open(tmp_path)
    assert len({e.file for e in src.entries.values()}) >= 2, "not sharded: the test needs several files"
    assert {k: src.shape(k) for k in src.keys()} == {k: tuple(v.shape) for k, v in model.state_dict().items()}
    meta = _llama(meta=True)
    keys = check(meta, tmp_path)
    meta.to_empty(device="cpu")
    filled = load_local(meta, src, keys=keys)
    ref = tf.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    for name, value in ref.state_dict().items():
        assert torch.equal(meta.state_dict()[name], value), name
    assert filled == set(ref.state_dict()) and not any("inv_freq" in n for n in filled)  # non-persistent: the initializer's
    # float32 parameters get the float64 file's values cast as from_pretrained casts them
    meta32 = _llama(meta=True).float()
    meta32.to_empty(device="cpu")
    load_local(meta32, src, keys=keys)
    ref32 = tf.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(meta32.state_dict()[k], v) for k, v in ref32.state_dict().items())


def test_an_index_that_names_a_key_no_file_holds_is_an_incomplete_download(tmp_path: Path) -> None:
    _llama().save_pretrained(tmp_path, max_shard_size="20KB")
    first = sorted(tmp_path.glob("model-*.safetensors"))[0]
    _save({"x": torch.zeros(1)}, first)
    with pytest.raises(ConfigError, match="lists keys its files do not hold.*incomplete"):
        WeightsSource.open(tmp_path)


def test_a_shardwise_export_loads_with_both_tied_names(tmp_path: Path) -> None:
    model = _gpt2()
    state = model.state_dict()
    step = ckpt.write(ckpt.step_dir(tmp_path / "run", 3), rank=0, world_size=1, shared={"model": state}, own={}, barrier=lambda: None, meta={"step": 3})
    export_safetensors(step, tmp_path / "export" / "gpt2.safetensors")
    meta = shardwise.init_from(_gpt2(meta=True), tmp_path / "export")
    assert set(WeightsSource.open(tmp_path / "export").keys()) == set(state)  # the export holds lm_head.weight and wte
    meta.to_empty(device="cpu")
    load_local(meta, tmp_path / "export")
    assert all(torch.equal(meta.state_dict()[k], v) for k, v in state.items())
    with pytest.raises(ConfigError, match=r"is a shardwise checkpoint.*resume=.*shardwise export"):
        WeightsSource.open(step)


def test_prefix_either_way_as_from_pretrained(tmp_path: Path) -> None:
    base = _llama(tf.LlamaModel, tie_word_embeddings=True)
    base.save_pretrained(tmp_path / "base")  # keys embed_tokens.weight, layers.0..., no "model." and no head
    tied = _llama(meta=True, tie_word_embeddings=True)
    keys = check(tied, tmp_path / "base")
    assert keys["model.embed_tokens.weight"] == "embed_tokens.weight" and keys["lm_head.weight"] == "embed_tokens.weight"
    with pytest.raises(ConfigError, match=r"1 missing from the checkpoint: lm_head.weight"):
        check(_llama(meta=True), tmp_path / "base")  # untied: the base model has no head to give
    _llama().save_pretrained(tmp_path / "causal")  # model.* and lm_head.weight into the base model: the head is dropped
    keys = check(_llama(tf.LlamaModel, meta=True), tmp_path / "causal")
    assert keys["layers.0.mlp.up_proj.weight"] == "model.layers.0.mlp.up_proj.weight" and "lm_head.weight" not in keys.values()


def test_a_tied_weight_is_satisfied_by_either_key(tmp_path: Path) -> None:
    model = _gpt2()
    state = model.state_dict()
    hf = {k: v for k, v in state.items() if k != "lm_head.weight"}
    assert check(_gpt2(meta=True), _save(hf, tmp_path / "hf.safetensors"))["lm_head.weight"] == "transformer.wte.weight"
    head = {k: v for k, v in state.items() if k != "transformer.wte.weight"}
    keys = check(_gpt2(meta=True), _save(head, tmp_path / "head.safetensors"))
    assert keys["transformer.wte.weight"] == "lm_head.weight"
    meta = _gpt2(meta=True)
    meta.to_empty(device="cpu")  # unties the meta weights: each name is filled from the one key
    load_local(meta, tmp_path / "head.safetensors", keys=keys)
    assert torch.equal(meta.transformer.wte.weight, state["transformer.wte.weight"]) and torch.equal(meta.lm_head.weight, state["lm_head.weight"])
    # GPT-2's old causal-mask buffers are keys from_pretrained drops (_keys_to_ignore_on_load_unexpected)
    check(_gpt2(meta=True), _save({**hf, "transformer.h.0.attn.bias": torch.ones(1, 1, 8, 8)}, tmp_path / "old.safetensors"))


def test_missing_unexpected_and_misshapen_are_named_with_counts(tmp_path: Path) -> None:
    state = _llama().state_dict()
    few = {k: v for k, v in state.items() if ".layers." not in k}
    with pytest.raises(ConfigError) as err:
        check(_llama(meta=True), _save({**few, "extra.weight": torch.zeros(2)}, tmp_path / "a.safetensors"))
    text = str(err.value)
    assert "18 missing from the checkpoint: model.layers.0.input_layernorm.weight" in text and "(and 13 more)" in text
    assert "1 unexpected (the model has no such tensor): extra.weight" in text and "a.safetensors" in text
    assert "AutoConfig.from_pretrained" in text  # how to fix it
    with pytest.raises(ConfigError, match=r"2 of another shape: lm_head.weight \[33, 16\] \(checkpoint lm_head.weight: \[40, 16\]\)"):
        check(_llama(meta=True), _llama(vocab_size=40).save_pretrained(tmp_path / "b") or tmp_path / "b")


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda p: p / "nothing-here", "do not exist"),
        (lambda p: (p / "pytorch_model.bin").write_bytes(b"x") and p / "pytorch_model.bin", "must be safetensors; got pytorch_model.bin"),
        (lambda p: (p / "x.safetensors").write_bytes(b"\xff" * 20) and p / "x.safetensors", "not a safetensors file"),
        (lambda p: [(p / n).write_bytes(b"") for n in ("a.safetensors", "b.safetensors")] and p, "2 .safetensors files and no model.safetensors.index.json"),
    ],
)
def test_what_is_not_a_weights_source_is_refused(tmp_path: Path, make: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        WeightsSource.open(make(tmp_path))


def test_init_from_records_a_picklable_path_and_key_map(tmp_path: Path) -> None:
    _gpt2().save_pretrained(tmp_path)
    meta = _gpt2(meta=True)
    assert shardwise.init_from(meta, tmp_path) is meta
    rec = recorded(pickle.loads(pickle.dumps(meta)))
    assert rec is not None and rec.path == str(tmp_path.resolve()) and rec.keys["lm_head.weight"] == "transformer.wte.weight"
    assert recorded(_gpt2(meta=True)) is None
    with pytest.raises(ConfigError, match="missing"):
        shardwise.init_from(_llama(meta=True), tmp_path)
