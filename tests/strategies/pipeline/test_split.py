"""Pipeline splitting (balance, split points, names), the bubble formulas, naive layer placement,
and the configurations refused before anything runs. No process group."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, get_strategy
from shardwise.strategies.cost.bubble import idle_to_busy, measured_bubble, predicted_bubble, step_bubbles
from shardwise.strategies.pipeline import (
    Pipeline,
    StageModule,
    balance,
    check_rows,
    check_schedule,
    concat_batches,
    sequence_layers,
    split_batch,
    split_layers,
)
from shardwise.strategies.pipeline.naive_mp import NaiveModelParallel, apply_naive_mp
from shardwise.tools.recipes.charlm import CharGPT


def gpt(n_layers: int = 4) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(11, 8, 16, 2, n_layers).double()


def names(runs):
    return [[n for n, _ in run] for run in runs]


# -- layers and names ------------------------------------------------------------------------------


def test_chargpt_layers_are_embed_blocks_head():
    assert [n for n, _ in sequence_layers(gpt())] == ["embed", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "head"]
    assert [n for n, _ in sequence_layers(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2)))] == ["0", "1", "2"]


def test_a_stage_keeps_the_original_names_and_runs_its_layers_in_order():
    model = gpt()
    runs = split_layers(sequence_layers(model), 2, ["blocks.2"])
    full = model.state_dict()
    second = StageModule(runs[1])
    assert list(second.state_dict()) == [k for k in full if k.startswith(("blocks.2.", "blocks.3.", "head."))]
    first = StageModule(runs[0])
    assert list(first.state_dict()) + list(second.state_dict()) == list(full)  # the whole model, in order
    x = torch.randint(0, 11, (3, 8))
    torch.testing.assert_close(second(first(x)), model(x), rtol=0, atol=0)
    # The stage's tensors are the model's (no copy): a checkpoint of the stage is a slice of the model's.
    assert second.state_dict()["blocks.2.attn.q.weight"].data_ptr() == full["blocks.2.attn.q.weight"].data_ptr()


def test_models_that_cannot_be_split_are_config_errors():
    class OwnParam(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(1))
            self.lin = nn.Linear(2, 2)

    with pytest.raises(ConfigError, match=r"holds tensors of its own \(scale\)"):
        sequence_layers(OwnParam())
    with pytest.raises(ConfigError, match="it has no child modules"):
        sequence_layers(nn.Module())
    holder = nn.Module()
    holder.parts = nn.ModuleDict({"a": nn.Linear(2, 2)})
    with pytest.raises(ConfigError, match="ModuleDict"):
        sequence_layers(holder)


def test_fewer_layers_than_stages_is_a_config_error():
    with pytest.raises(ConfigError, match=r"the model has 4 layers \(4 with parameters.*needs 6 stages"):
        split_layers(sequence_layers(gpt(2)), 6)


# -- balance ---------------------------------------------------------------------------------------


def test_balance_minimises_the_largest_stage():
    assert balance([4, 1, 1, 1, 1], 2) == [0, 1]
    assert balance([1, 1, 1, 1], 2) == [0, 2]
    assert balance([1, 1, 1, 1, 1, 1, 1, 1], 4) == [0, 2, 4, 6]
    assert balance([5, 1, 1, 1, 1, 5], 3) == [0, 1, 5]
    # A layer without parameters (an activation) stays with the layer before it.
    assert balance([3, 0, 3, 0], 2) == [0, 2]
    with pytest.raises(ValueError):
        balance([1, 0, 0], 2)


def test_chargpt_balanced_by_parameter_count():
    model = gpt()
    runs = split_layers(sequence_layers(model), 2)
    assert names(runs) == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    counts = [sum(p.numel() for _, m in run for p in m.parameters()) for run in runs]
    assert sum(counts) == sum(p.numel() for p in model.parameters())
    # No other 2-way cut has a smaller largest stage.
    layer_counts = [sum(p.numel() for p in m.parameters()) for _, m in sequence_layers(model)]
    best = min(max(sum(layer_counts[:c]), sum(layer_counts[c:])) for c in range(1, len(layer_counts)))
    assert max(counts) == best
    # Interleaved: pp 2 x v 2 = 4 stages.
    assert len(split_layers(sequence_layers(model), 4)) == 4


def test_split_points_name_where_stages_start():
    layers = sequence_layers(gpt())
    assert names(split_layers(layers, 2, ["blocks.1"])) == [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]
    assert names(split_layers(layers, 3, ["embed", "blocks.1", "head"])) == [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3"], ["head"]]
    with pytest.raises(ConfigError, match=r"split_points \['block.1'\] are not layers of the model"):
        split_layers(layers, 2, ["block.1"])
    with pytest.raises(ConfigError, match="make 3 stages but the pipeline has 2"):
        split_layers(layers, 2, ["blocks.1", "blocks.2"])
    with pytest.raises(ConfigError, match="in model order"):
        split_layers(layers, 3, ["blocks.2", "blocks.1"])
    with pytest.raises(ConfigError, match="no trainable parameters"):
        split_layers(sequence_layers(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))), 3, ["1", "2"])


def test_batches_split_like_the_schedule_splits_inputs():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    chunks = split_batch((x, y), 3)
    assert len(chunks) == 3 and all(isinstance(c, tuple) for c in chunks)
    torch.testing.assert_close(chunks[1][0], x[2:4])
    torch.testing.assert_close(chunks[2][1], y[4:6])
    whole = concat_batches([(x[:3], y[:3]), (x[3:], y[3:])])
    torch.testing.assert_close(whole[0], x)


# -- bubble formulas -----------------------------------------------------------------------------


def test_bubble_formulas():
    assert predicted_bubble("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert predicted_bubble("1f1b", 2, 4) == pytest.approx(1 / 5)
    assert predicted_bubble("interleaved", 4, 8, v=2) == pytest.approx(3 / 19)
    assert predicted_bubble("gpipe", 4, 8, v=2) == predicted_bubble("gpipe", 4, 8)  # v only matters interleaved
    assert predicted_bubble("gpipe", 1, 8) == 0.0
    # The paper's idle/busy ratio and the idle share of the step describe the same times.
    for sched, p, m, v in (("gpipe", 4, 8, 1), ("interleaved", 4, 8, 2), ("1f1b", 2, 16, 1)):
        r = idle_to_busy(sched, p, m, v)
        assert predicted_bubble(sched, p, m, v) == pytest.approx(r / (1 + r))
    with pytest.raises(ValueError, match="unknown schedule"):
        predicted_bubble("zb", 2, 2)


def test_measured_bubble_from_busy_and_wall_times():
    assert measured_bubble(3.0, 4.0) == 0.25
    assert measured_bubble(1.0, 0.0) == 0.0
    # Two stages of a GPipe step, m = 2, t_f = t_b = 1: wall 6, each busy 4.
    wall, bubbles = step_bubbles([4.0, 4.0], [10.0, 10.0], [16.0, 15.0])
    assert wall == 6.0 and bubbles == [pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert bubbles[0] == pytest.approx(predicted_bubble("gpipe", 2, 2))


# -- refused before anything runs ---------------------------------------------------------------


def test_schedule_validation():
    with pytest.raises(ConfigError, match=r"1f1b needs at least as many micro-batches as stages; got microbatches=2 < pp=4"):
        check_schedule("1f1b", 4, 2, 1)
    with pytest.raises(ConfigError, match="unknown pipeline schedule 'gpipe2'.*Did you mean 'gpipe'"):
        Pipeline(schedule="gpipe2")
    with pytest.raises(ConfigError, match="multiple of max"):
        check_schedule("interleaved", 2, 7, 2)  # rounds of max(1, 7 // 2) = 3 micro-batches: 7 is not a multiple
    with pytest.raises(ConfigError, match="virtual_stages >= 2"):
        Pipeline(schedule="interleaved", virtual_stages=1)
    with pytest.raises(ConfigError, match="needs schedule interleaved"):
        Pipeline(schedule="gpipe", virtual_stages=2)
    with pytest.raises(ConfigError, match="dp_strategy"):
        Pipeline(dp_strategy="zero")
    check_schedule("gpipe", 4, 2, 1)  # GPipe runs any m
    check_schedule("interleaved", 2, 4, 2)
    assert Pipeline(schedule="interleaved").virtual_stages == 2
    assert get_strategy("pipeline", pp=2).plan(2).degrees == {"dp": 1, "pp": 2, "tp": 1}
    layout = Pipeline(pp=2, tp=2, schedule="gpipe").plan(8)
    assert layout.degrees == {"dp": 2, "pp": 2, "tp": 2} and layout.data_parallel == 2 and layout.trainers == 8


def test_options_are_a_frozen_dataclass_normalized_and_checked_when_built():
    p = Pipeline(split_points="blocks.2,blocks.4", schedule="interleaved", timeline="", layers="")
    assert (p.split_points, p.virtual_stages, p.microbatches, p.timeline, p.layers) == (("blocks.2", "blocks.4"), 2, 2, None, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.pp = 4  # type: ignore[misc]
    assert dataclasses.replace(p, pp=4, microbatches=4).num_stages == 8
    for bad, message in [
        (dict(tp=0), "tp must be a whole number >= 1; got 0"),
        (dict(sequence_parallel=True), "sequence_parallel needs tp > 1"),
        (dict(warmup_steps=-1), "warmup_steps must be a whole number >= 0; got -1"),
        (dict(split_points=[2]), "split_points must be layer names"),
        (dict(tp_plan="blocks.*"), "tp_plan must map"),
        (dict(pp=0), "pp must be a whole number >= 1"),
    ]:
        with pytest.raises(ConfigError, match=message):
            Pipeline(**bad)
    mp = NaiveModelParallel(devices="cpu,cpu", split_points="blocks.3")
    assert mp.devices == ("cpu", "cpu") and mp.split_points == ("blocks.3",) and NaiveModelParallel(split_points="").split_points is None


def test_every_option_has_a_docstring_that_becomes_its_help():
    import ast
    import inspect

    for cls in (Pipeline, NaiveModelParallel):
        body = ast.parse(inspect.getsource(cls)).body[0].body  # type: ignore[attr-defined]
        documented = {
            a.target.id
            for a, b in itertools.pairwise(body)
            if isinstance(a, ast.AnnAssign)
            and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr)
            and isinstance(b.value, ast.Constant)
            and isinstance(b.value.value, str)
        }
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in documented]
        assert not missing, f"{cls.__name__} options without a docstring: {missing}"


def test_plan_splits_the_model_it_is_given_and_refuses_one_it_cannot_split():
    assert Pipeline(pp=2).split(gpt()) == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    assert Pipeline(pp=2, split_points=["blocks.3"]).split(gpt()) == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "head"]]
    Pipeline(pp=2).plan(2, model=gpt())
    with pytest.raises(ConfigError, match=r"but the pipeline needs 4 stages"):
        Pipeline(pp=2, schedule="interleaved").plan(2, model=nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2)))
    with pytest.raises(ConfigError, match=r"needs 2 stages"):
        NaiveModelParallel(devices=["cpu", "cpu"]).plan(1, model=nn.Sequential(nn.Linear(2, 2)))


def test_the_state_exchange_carries_tensors_and_plain_values_exactly():
    """What a pipeline checkpoint gathers crosses as tensors (JSON text and raw bytes), and comes back the same."""
    from shardwise.comm import WORLD
    from shardwise.strategies.pipeline.exchange import all_gather_tree

    state = (
        {0: {"w": torch.randn(2, 3, dtype=torch.float64), "mask": torch.tensor([True, False])}, 3: {}},
        {
            "state": {"w": {"step": torch.tensor(5.0), "exp_avg": torch.zeros(0, 4), "calls": 7}},
            "param_groups": [
                {
                    "lr": 0.1,
                    "betas": (0.9, 0.999),
                    "eps": float("inf"),
                    "fused": None,
                    "tag": "déjà",
                    "params": ["w", "mask"],
                    "scale": torch.ones(2, dtype=torch.bfloat16),
                }
            ],
        },
    )
    [back] = all_gather_tree(state, group=WORLD, recorder=None, device=torch.device("cpu"))

    def same(a, b, where="state"):
        assert type(a) is type(b), where
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and (a.numel() == 0 or a.data_ptr() != b.data_ptr()), where
        elif isinstance(a, dict):
            assert list(a) == list(b), where
            for k in a:
                same(a[k], b[k], f"{where}[{k!r}]")
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b), where
            for i, (x, y) in enumerate(zip(a, b, strict=True)):
                same(x, y, f"{where}[{i}]")
        else:
            assert a == b, where

    same(state, back)
    with pytest.raises(ConfigError, match=r"got set at state\['x'\]"):
        all_gather_tree({"x": {1}}, group=WORLD, recorder=None, device=torch.device("cpu"))


def test_pp_that_does_not_divide_the_world_lists_valid_shapes():
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by pp 2 x tp 1; valid shapes: .*dp3xpp1xtp1"):
        Pipeline(pp=2).plan(3)


def test_indivisible_batch_is_refused():
    with pytest.raises(ConfigError, match="per-rank batch of 6 samples does not split into 4 equal pipeline micro-batches"):
        Pipeline(pp=2, microbatches=4, schedule="gpipe").plan(2, batch=Batch(6, accumulate=2))  # 3 rows x 2
    assert Pipeline(pp=2, microbatches=4).plan(2, batch=Batch(8, accumulate=2)).micro_batch == 4
    with pytest.raises(ConfigError, match="per-rank batch of 6 samples"):  # 12 over dp 2: 6 per rank
        Pipeline(pp=2, microbatches=4, schedule="gpipe").plan(4, batch=Batch(12))
    with pytest.raises(ConfigError):
        check_rows(2, 4, "x")


def _lm(output, batch):
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def _tokens(n: int = 32) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randint(0, 11, (n, 8), generator=g), torch.randint(0, 11, (n, 8), generator=g))


@pytest.mark.parametrize(
    "settings,message",
    [
        (dict(strategy_options=dict(pp=2, microbatches=1, schedule="1f1b")), "1f1b needs at least as many micro-batches as stages"),
        (dict(strategy_options=dict(pp=2, microbatches=4, schedule="gpipe"), global_batch_size=6), "per-rank batch of 6 samples does not split into 4"),
        (dict(strategy_options=dict(pp=2, microbatches=4, schedule="gpipe"), global_batch_size=12, accumulate=2, nproc=4), "per-rank batch of 6 samples"),
        (dict(strategy_options=dict(pp=2), nproc=3), "world size 3 is not divisible by pp 2"),
        # interleaved at pp 2 runs 3 micro-batches (rounds of one), but 8 rows do not split into 3
        (dict(strategy_options=dict(pp=2, schedule="interleaved", microbatches=3)), "does not split into 3"),
    ],
)
def test_the_trainer_refuses_before_launch(settings, message):
    settings = {"nproc": 2, "global_batch_size": 8, "max_steps": 1, "progress_bar": False, **settings}
    trainer = Trainer(strategy="pipeline", loss_fn=_lm, **settings)
    with pytest.raises(ConfigError, match=message):
        trainer._check(gpt(), _tokens())


@pytest.mark.parametrize(
    "make_model,options,message",
    [
        (lambda: nn.Sequential(nn.Linear(8, 11)), dict(pp=2), r"the model has 1 layers \(1 with parameters: \['0'\]\) but the pipeline needs 2 stages"),
        (gpt, dict(pp=2, split_points=["block.2"]), r"split_points \['block.2'\] are not layers of the model"),
    ],
    ids=["one-layer-model", "unknown-split-point"],
)
def test_fit_refuses_a_model_it_cannot_split_in_the_parent(monkeypatch, make_model, options, message):
    import shardwise.trainer.loop as loop

    def no_launch(*args, **kwargs):
        raise AssertionError("fit launched processes before refusing the model")

    monkeypatch.setattr(loop, "launch", no_launch)
    data = TensorDataset(torch.randn(8, 8), torch.randint(0, 11, (8,)))
    trainer = Trainer(
        strategy="pipeline",
        strategy_options=options,
        nproc=2,
        global_batch_size=8,
        max_steps=1,
        progress_bar=False,
        loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]),
    )
    with pytest.raises(ConfigError, match=message):
        trainer.fit(make_model(), data)


# -- naive layer placement -------------------------------------------------------------------------


def test_naive_placement_on_fake_devices_equals_the_model():
    model = gpt()
    ref = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 11, (3, 8))
    want = model(x)
    mp = apply_naive_mp(model, ["cpu", "cpu", "cpu"])
    assert len(mp.stage_layers) == 3 and sum(len(s) for s in mp.stage_layers) == 6
    assert [str(d) for d in mp.devices] == ["cpu"] * 3
    assert list(mp.state_dict()) == list(ref)  # original names, original order
    torch.testing.assert_close(mp(x), want, rtol=0, atol=0)
    mp2 = apply_naive_mp(gpt(), ["cpu", "cpu"], split_points=["blocks.3"])
    assert mp2.stage_layers == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "head"]]


def test_naive_placement_refuses_a_forward_that_is_more_than_its_layers_in_order():
    # it runs the top-level children one after another: mlp_zero's "* 0" would be left out and another network trained
    from tests.support.own_models import build_own

    for name in ("mlp_zero", "cnn", "skipnet"):
        with pytest.raises(ConfigError, match=r"naive-mp runs \w+'s top-level children one after another, but its forward does more"):
            apply_naive_mp(build_own(name), ["cpu", "cpu"])
    with pytest.raises(ConfigError, match=r"torch.fx cannot read its forward"):
        apply_naive_mp(build_own("gpt"), ["cpu", "cpu"])


def test_naive_placement_trains_like_single():
    torch.manual_seed(1)
    trainer_args = dict(precision="64", global_batch_size=8, max_steps=3, progress_bar=False, loss_fn=_lm, accelerator="cpu")
    ref = gpt()
    Trainer(strategy="single", **trainer_args).fit(ref, _tokens())
    mp = gpt()
    summary = Trainer(strategy="naive-mp", strategy_options={"devices": ["cpu", "cpu"]}, **trainer_args).fit(mp, _tokens())
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(mp.state_dict()[k], v, rtol=0, atol=1e-12)
    assert summary["naive_mp"]["stage_layers"] == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs: naive-mp is allowed")
def test_naive_mp_without_two_gpus_says_so_and_suggests_pipeline():
    with pytest.raises(ConfigError, match=r"needs at least 2. Use strategy 'pipeline'"):
        get_strategy("naive-mp").plan(1)
    with pytest.raises(ConfigError, match="world size of 2"):
        NaiveModelParallel(devices=["cpu", "cpu"]).plan(2)


# -- nested models (transformers, nanoGPT): stages from the block list ---------------------------


def _hf_or_skip():
    return pytest.importorskip("transformers", reason="the nested-model tests need transformers: pip install -e '.[dev]'")


def _opt():
    tf = _hf_or_skip()
    torch.manual_seed(0)
    cfg = tf.OPTConfig(
        vocab_size=64,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        max_position_embeddings=16,
        dropout=0.0,
        attention_dropout=0.0,
        word_embed_proj_dim=32,
        attn_implementation="eager",
    )
    return tf.OPTForCausalLM(cfg).double().eval()


def test_modules_are_placed_by_the_order_the_forward_runs_them_not_by_declaration():
    """OPT declares final_layer_norm before layers and runs it after them: it belongs to the last stage."""
    from shardwise.strategies.pipeline.nested import nested_layout, runs_after
    from tests.support import zoo

    opt = _opt()
    assert runs_after(opt, "model.decoder.final_layer_norm", "model.decoder.layers") is True
    assert runs_after(opt, "model.decoder.embed_tokens", "model.decoder.layers") is False
    layout = nested_layout(opt)
    assert layout.prelude == ("model.decoder.embed_tokens", "model.decoder.embed_positions")
    assert set(layout.postlude) == {"model.decoder.final_layer_norm", "lm_head"}
    nano = nested_layout(zoo.build("nanogpt"))  # its root's forward runs self.transformer.ln_f (a ModuleDict has no forward)
    assert nano.blocks == "transformer.h" and set(nano.postlude) == {"transformer.ln_f", "lm_head"}
    assert nano.aliases == {"lm_head.weight": "transformer.wte.weight"}


@pytest.mark.parametrize("name", ["llama", "gpt2", "bert", "nanogpt"])
def test_nested_stages_chained_in_one_process_give_the_models_output(name):
    """Stage 0 (embeddings, blocks 0-1) then stage 1 (blocks 2-3, norm, head): the model's own logits, bit for bit."""
    from shardwise.data.batches import model_args
    from shardwise.strategies.pipeline.nested import NestedStage, batch_kwargs, nested_layout, split_blocks
    from tests.support import zoo

    _hf_or_skip()
    model = zoo.build(name).eval()
    batch = zoo.batch(name, 2)
    args, kwargs = model_args(batch)
    layout = nested_layout(model)
    runs = split_blocks(model, layout, 2)
    first, last = NestedStage(model, layout, runs[0], True, False), NestedStage(model, layout, runs[1], False, True)
    keywords = batch_kwargs(args, kwargs)
    with torch.no_grad():
        hidden = first(**keywords)
        out = last(hidden, **keywords)
        expected = model(*args, **kwargs)
    assert isinstance(hidden, torch.Tensor) and isinstance(out, torch.Tensor)
    assert torch.equal(out, expected if isinstance(expected, torch.Tensor) else expected.logits)
    assert not {n for n, _ in first.named_parameters()} & {n for n, _ in last.named_parameters()}  # each name on one stage


def test_a_module_placed_before_the_blocks_that_runs_after_them_fails_loudly():
    """If the placement is wrong for a forward, the stand-in raises instead of skipping the layer."""
    from shardwise.strategies.pipeline.nested import NestedLayout, NestedStage

    opt = _opt()
    wrong = NestedLayout(
        blocks="model.decoder.layers",
        prelude=("model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.final_layer_norm"),
        postlude=("lm_head",),
        source="test",
    )
    last = NestedStage(opt, wrong, ["2", "3"], False, True)
    ids = torch.randint(0, 64, (2, 16))
    with pytest.raises(ConfigError, match="took model.decoder.final_layer_norm for a module that runs before the blocks"):
        last(torch.zeros(2, 16, 32, dtype=torch.float64), input_ids=ids)


@pytest.mark.parametrize("family", ["t5", "bart"])
def test_encoder_decoder_models_are_refused_not_split_wrong(family):
    """Every decoder block reads the encoder's output; only the first stage would have it."""
    tf = _hf_or_skip()
    if family == "t5":
        model = tf.T5ForConditionalGeneration(tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4))
    else:
        model = tf.BartForConditionalGeneration(
            tf.BartConfig(
                vocab_size=64,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=16,
            )
        )
    with pytest.raises(ConfigError, match=r"runs a second stack of blocks before .*decoder.*\.(block|layers) .*encoder.*cross-attention"):
        get_strategy("pipeline", pp=2).plan(2, model=model)


def test_buffers_survive_the_shape_inference_of_older_torch() -> None:
    """torch up to 2.12 names the extra forward ``_shape_inference``: BatchNorm's counter and running
    statistics come out of it as they went in (the forward itself still runs and answers)."""
    from shardwise.strategies.pipeline.schedule import keep_buffers_through_inference

    bn = torch.nn.BatchNorm1d(3)

    class OldStage:
        def _shape_inference(self, args: tuple[torch.Tensor, ...], kwargs: object = None) -> torch.Tensor:
            with torch.no_grad():
                return bn(*args)

    stage = OldStage()
    keep_buffers_through_inference(stage, bn)
    out = stage._shape_inference((torch.randn(4, 3) + 5,))
    assert out.shape == (4, 3)
    assert int(bn.num_batches_tracked) == 0 and torch.equal(bn.running_mean, torch.zeros(3))
    bn(torch.randn(4, 3) + 5)  # a real forward still counts
    assert int(bn.num_batches_tracked) == 1


# -- the traced forward (issue 36) -------------------------------------------------------------------


class _Branchy(nn.Module):
    """A forward fx cannot trace (a branch on a tensor's value) around code the children skip."""

    def __init__(self, scale: float = 2.0) -> None:
        super().__init__()
        self.scale = scale
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.sum() > -1e9:  # always true; data-dependent all the same
            h = torch.relu(h) * self.scale
        return self.fc2(h)


class _PlainBranchy(_Branchy):
    """Untraceable, but its forward is its children in order: the sequence split is proven on a sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.sum() > 1e9:  # never true on the data
            h = h * 0
        return self.fc2(h)


def _sample_of(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(1, 8, generator=g, dtype=torch.float64), torch.zeros(1, dtype=torch.int64)


def test_traced_stages_run_the_code_between_layers_and_keep_the_names():
    from shardwise.strategies.pipeline import traced
    from tests.support.own_models import build_own, own_sample

    for name, stages, crossing in (("skipnet", 4, [1, 1, 2, 1]), ("postransformer", 2, [1, 1]), ("cnn", 2, [1, 1])):
        model = build_own(name)
        x = own_sample(name, 0)[0].unsqueeze(0)
        gm = traced.trace(model)
        plan = traced.plan_stages(gm, stages, None, traced.node_types(gm, (x,)))
        assert [len(i) for i in plan.inputs] == crossing  # skipnet's skip crosses stages 1 -> 2 beside the activation
        mods = [traced.stage_module(gm, plan, s) for s in range(stages)]
        assert torch.equal(traced.run_in_turn(mods, (x,), {}, False), model(x))
        keys = [k for m in mods for k in m.state_dict()]
        assert sorted(keys) == sorted(model.state_dict()), name  # original names, each once
        assert all(m.state_dict()[k].data_ptr() == model.state_dict()[k].data_ptr() for m in mods for k in m.state_dict())  # no copies
    assert list(mods[0].root_tensors) == [] and "pos" in traced.stage_module(*_pos_split()).root_tensors


def _pos_split():
    from shardwise.strategies.pipeline import traced
    from tests.support.own_models import build_own

    gm = traced.trace(build_own("postransformer"))
    return gm, traced.plan_stages(gm, 2, None, traced.static_types(gm)), 0


def test_a_module_used_on_two_stages_is_a_weight_tied_across_them():
    from shardwise.strategies.pipeline import traced
    from tests.support.own_models import build_own

    model = build_own("sharednet")
    gm = traced.trace(model)
    plan = traced.plan_stages(gm, 4, None, traced.static_types(gm))
    mods = {s: traced.stage_module(gm, plan, s) for s in range(4)}
    assert plan.runs[1] == ["mix", "blocks.1"] and "mix" in mods[3].layer_names  # its second use, after blocks.3
    ties = traced.cross_stage_ties(model, mods, pp=4)
    assert sorted(t.name for t in ties) == ["mix.bias", "mix.weight"] and {t.owners for t in ties} == {(1, 3)}
    assert traced.cross_stage_ties(model, mods, pp=2) == []  # stages 1 and 3 on one rank: one Parameter there


def test_an_untraceable_forward_whose_children_skip_its_code_is_refused_naming_where():
    with pytest.raises(ConfigError) as info:
        Pipeline(pp=2).route(_Branchy(), _sample_of(_Branchy()))
    message = str(info.value)
    assert "torch.fx cannot trace its forward (TraceError: symbolically traced variables cannot be used as inputs to control flow" in message
    assert "if h.sum() > -1e9" in message  # the line of the user's forward
    assert "the first layer whose output differs is fc2 (stage 1)" in message
    # a scale of 1 makes relu the only difference; nothing else is let through either
    with pytest.raises(ConfigError, match="first layer whose output differs is fc2"):
        Pipeline(pp=2).route(_Branchy(scale=1.0), _sample_of(_Branchy()))


def test_an_untraceable_forward_equal_to_its_children_is_split_once_a_sample_proves_it():
    model = _PlainBranchy()
    assert Pipeline(pp=2).route(model, _sample_of(model)).kind == "sequence"
    Pipeline(pp=2).plan(2, model=model)  # plan, with no sample, leaves the proof to check_sample
    with pytest.raises(ConfigError, match="only done once a sample batch proves the stages equal the model's forward"):
        Pipeline(pp=2).route(model)  # an Engine with no sample: refused, saying how to give one


def test_the_trainer_refuses_an_unprovable_split_in_the_parent(monkeypatch):
    import shardwise.trainer.loop as loop

    monkeypatch.setattr(loop, "launch", lambda *a, **k: (_ for _ in ()).throw(AssertionError("launched before refusing")))
    data = TensorDataset(torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 3, (8,)))
    trainer = Trainer(strategy="pipeline", strategy_options=dict(pp=2), nproc=2, global_batch_size=8, max_steps=1, progress_bar=False, loss_fn=_ce)
    with pytest.raises(ConfigError, match="cannot split _Branchy into pipeline stages by its top-level children in order"):
        trainer.fit(_Branchy().double(), data)


def _ce(out, batch):
    return F.cross_entropy(out, batch[1])


def test_pp_with_tp_refuses_a_traced_split_with_the_reason():
    from tests.support.own_models import build_own

    with pytest.raises(ConfigError, match="tensor parallelism inside such stages is not supported"):
        Pipeline(pp=2, tp=2).plan(4, model=build_own("cnn"))


class _LayersNamedLayers(nn.Module):
    """A block list named ``layers`` (the commonest name), a norm shared by every block and the end, a
    residual and a bare scale: a new user's model, split by its trace (it failed in fx's copy of
    ``layers`` when the traced graph kept its own metadata under that very name)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.norm = nn.LayerNorm(8)
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.scale = nn.Parameter(torch.ones(8))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.embed(x))
        for lin in self.layers:
            h = h + torch.tanh(lin(self.norm(h)))
        return self.head(self.norm(h) * self.scale)


def test_a_block_list_named_layers_is_split_by_its_trace_and_proven_on_a_sample():
    torch.manual_seed(0)
    model = _LayersNamedLayers()
    sample = (torch.randn(2, 6), torch.zeros(2, dtype=torch.long))
    route = Pipeline(pp=2).route(model, sample)
    assert route.kind == "traced" and [n for run in route.names for n in run] == ["embed", "norm", "layers.0", "layers.1", "layers.2", "head"]
