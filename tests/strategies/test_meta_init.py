"""Models built on the meta device, and pretrained weights loaded into them, under every strategy.

Each rank gives storage only to its share (`shardwise.strategies.materialize`, `checkpoint.pretrained`);
the values must equal, bit for bit, the model built eagerly from the same seed (or loaded with
``from_pretrained``). In one launch per world size: Llama (untied), GPT-2 (tied head, fused ``c_attn``)
and Gemma (tied head, scaled embeddings, zero-initialized norms: a family no other test uses), trained one float64 step
from the eager model, from the meta-built one and from ``init_from`` of a checkpoint of the eager
model, under ddp, zero3, tp, tp with sequence parallelism, the pipeline, and pp x tp: the three final
states are equal bit for bit. In this process: the materialized weights against the eager build for
transformers models, hand-written models (under ``shardwise.meta_init``) and torch's own modules, and
the refusals.
"""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch
from torch import nn

import shardwise
from shardwise import launch
from shardwise.errors import ConfigError
from shardwise.strategies import materialize
from tests.support import harness, zoo
from tests.support import own_models as own

transformers = pytest.importorskip("transformers")

MODELS = ("llama", "gpt2", "gemma")
CELLS_2 = (("ddp", {}), ("zero3", {}), ("tp", {"tp": 2}), ("tp", {"tp": 2, "sequence_parallel": True}), ("pipeline", {"pp": 2, "microbatches": 2}))
CELLS_4 = (("pipeline", {"pp": 2, "tp": 2, "microbatches": 2}),)


def _gemma() -> nn.Module:
    cfg = transformers.GemmaConfig(
        vocab_size=zoo.VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=zoo.SEQ,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        attn_implementation="eager",
    )
    return transformers.GemmaForCausalLM(cfg)


def build(name: str, how: str = "eager") -> nn.Module:
    """``name`` from seed 0: eager, or on the meta device (``meta``, ``meta_init``), in float32."""
    make = _gemma if name == "gemma" else (lambda: zoo._hf(name, 2))
    torch.manual_seed(0)
    if how == "eager":
        return make()
    if how == "meta_init":
        with shardwise.meta_init():
            return make()
    with torch.device("meta"):
        model = make()
    return model


def _train(name: str, strategy: str, options: dict[str, Any], model: nn.Module) -> dict[str, torch.Tensor] | None:
    data_name = "llama" if name == "gemma" else name
    t = harness.trainer(data_name, strategy, options, max_steps=1, clip_grad_norm=None)
    data = zoo.dataset(data_name, 16)
    t._check(model, data)
    materialize.note_build_state(model)
    return t._fit(model, data, None, return_state=True)[1]


PRETRAINED = {2: ("gpt2",), 4: ("llama", "gemma")}
"""Which models also train from ``init_from`` end to end (every family's slices are checked bit for bit
against ``from_pretrained`` in tests/checkpoint/test_pretrained_dist.py): GPT-2's fused, tied weights at 2 ranks."""


def _cells_worker(cells: tuple[tuple[str, dict[str, Any]], ...], folders: dict[str, str]) -> dict[str, Any]:
    import torch.distributed as dist

    out: dict[str, Any] = {}
    for name in MODELS:
        for strategy, options in cells:
            states = {}
            for how in ("eager", "meta", "pretrained") if name in PRETRAINED[dist.get_world_size()] else ("eager", "meta"):
                model = build(name, "eager" if how == "eager" else "meta")
                if how == "pretrained":
                    shardwise.init_from(model, folders[name])
                states[how] = _train(name, strategy, options, model)
            out[f"{name} {strategy} {sorted(options.items())}"] = states
    return out


def _checkpoints(folder: str) -> dict[str, str]:
    """Each model's eager float64 weights saved as transformers does (sharded for GPT-2)."""
    paths = {}
    for name in MODELS:
        path = f"{folder}/{name}"
        build(name).to(torch.float64).save_pretrained(path, max_shard_size="20KB" if name == "gpt2" else "5GB")
        paths[name] = path
    return paths


def _assert_equal(results: dict[str, Any]) -> None:
    assert results and any("pretrained" in states for states in results.values())
    for cell, states in results.items():
        eager = states["eager"]
        for how in [h for h in ("meta", "pretrained") if h in states]:
            got = states[how]
            assert set(got) == set(eager), f"{cell} {how}: keys differ"
            bad = [k for k in eager if not torch.equal(got[k], eager[k])]
            assert not bad, f"{cell}: trained from the {how} model, {bad[:3]} differ from the eager model's run"


@pytest.fixture(scope="module")
def folders() -> Any:
    with tempfile.TemporaryDirectory() as folder:
        yield _checkpoints(folder)


def test_every_strategy_two_ranks_equals_eager(folders: dict[str, str]) -> None:
    _assert_equal(launch(_cells_worker, CELLS_2, folders, nproc=2, threads_per_proc=1, timeout=600)[0])


def test_pipeline_with_tp_four_ranks_equals_eager(folders: dict[str, str]) -> None:
    _assert_equal(launch(_cells_worker, CELLS_4, folders, nproc=4, threads_per_proc=1, timeout=600)[0])


# -- in this process -------------------------------------------------------------------------------


def _same(a: nn.Module, b: nn.Module) -> list[str]:
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    return [k for k in sa if not torch.equal(sa[k], sb[k])]


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("how", ["meta", "meta_init"])
def test_transformers_models_materialize_as_built_eagerly(name: str, how: str) -> None:
    eager = build(name)
    model = build(name, how)
    materialize.note_build_state(model)
    torch.manual_seed(123)
    after = torch.random.get_rng_state()
    materialize.materialize(model)
    assert not _same(model, eager)
    assert torch.equal(torch.random.get_rng_state(), after), "the run's generator must be left as it was"
    if name == "gpt2":
        assert model.lm_head.weight is model.transformer.wte.weight, "the tie must survive"


def _torch_models() -> dict[str, Any]:
    return {
        "transformer": lambda: nn.Transformer(d_model=16, nhead=2, num_encoder_layers=1, num_decoder_layers=1, dim_feedforward=32),
        "layers": lambda: nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Conv1d(8, 8, 3), nn.BatchNorm1d(8), nn.Embedding(10, 4, padding_idx=0)),
    }


@pytest.mark.filterwarnings("ignore:enable_nested_tensor")
@pytest.mark.parametrize("name", ["transformer", "layers"])
@pytest.mark.parametrize("how", ["meta", "meta_init"])
def test_torch_modules_materialize_as_built_eagerly(name: str, how: str) -> None:
    make = _torch_models()[name]
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    if how == "meta":
        with torch.device("meta"):
            model = make()
        materialize.note_build_state(model)
    else:
        with shardwise.meta_init():
            model = make()
    assert not _same(materialize.materialize(model), eager)


@pytest.mark.parametrize("name", ["mlp", "cnn", "skipnet", "sharednet", "gpt"])
def test_hand_written_models_under_meta_init(name: str) -> None:
    """Constructors that initialize by hand (nanoGPT's ``apply(_init_weights)`` and scaled projections), a
    module used twice, float64 after the build: the recorded construction replays exactly."""
    eager = own.build_own(name)
    with shardwise.meta_init():
        model = own.build_own(name)
    assert not _same(materialize.materialize(model), eager)


def test_refusals_name_the_tensor_and_the_fix() -> None:
    with torch.device("meta"):
        gpt = own.build_own("gpt")
    with pytest.raises(ConfigError, match=r"constructor of GPT sets weights itself.*shardwise.meta_init"):
        materialize.plan_init(gpt).check()
    with shardwise.meta_init():
        pos = own.build_own("postransformer")  # a position table drawn after the embedding's (skipped) draw
    with pytest.raises(ConfigError, match=r"sets pos \(parameter of the root module\)"):
        materialize.plan_init(pos).check()

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)
            self.register_buffer("mask", torch.tril(torch.ones(4, 4)))

    with torch.device("meta"):
        masked = Masked()
    with pytest.raises(ConfigError, match=r"mask \(buffer of .*shardwise.meta_init\(\) \(buffers stay real"):
        materialize.plan_init(masked).check()
    with shardwise.meta_init():
        masked = Masked()
    assert torch.equal(materialize.materialize(masked).mask, torch.tril(torch.ones(4, 4)))
