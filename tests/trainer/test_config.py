"""Settings: validation before anything runs, TOML and --set overrides, the registries."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shardwise import Trainer
from shardwise.comm.mesh import Mesh, valid_shapes
from shardwise.errors import ConfigError
from shardwise.strategies import available, get_strategy, register_strategy
from shardwise.strategies.precision import Precision, normalize
from shardwise.tools.recipes import get_recipe
from shardwise.trainer.config import TrainerConfig, apply_overrides, from_mapping, load_toml


def test_unknown_strategy_lists_known_names_and_the_closest():
    with pytest.raises(ConfigError, match=r"unknown strategy 'ddpp'. Did you mean 'ddp'\? Known strategies: .*ddp.*single"):
        get_strategy("ddpp")
    with pytest.raises(ConfigError, match=r"unknown strategy 'DDP'. Did you mean 'ddp'\? \(strategy names are lower case\)"):
        get_strategy("DDP")
    with pytest.raises(ConfigError, match=r"unknown strategy 'dpp'. Did you mean 'ddp' or 'dp'\?"):
        TrainerConfig(strategy="dpp")  # refused when the Trainer is made, not at fit
    with pytest.raises(ConfigError, match=r"strategy 'ddp' has no option 'bucket_size'( \(did you mean '\w+'\?\))?; its options are: bucket_cap_mb"):
        get_strategy("ddp", bucket_size=3)
    assert {"single", "ddp"} <= set(available())


def test_registering_a_strategy_by_name(monkeypatch):
    import shardwise.strategies as strategies
    from shardwise.strategies.data_parallel.single import Single

    monkeypatch.setattr(strategies, "_EXTRA", {})  # registered for this test only

    class Mine(Single):
        name = "mine"

    register_strategy("mine-test", Mine)
    assert isinstance(get_strategy("mine-test"), Mine)
    with pytest.raises(ConfigError, match="built in"):
        register_strategy("ddp", Mine)


def test_single_refuses_several_processes():
    with pytest.raises(ConfigError, match="strategy 'single' runs one process; got a world size of 2"):
        get_strategy("single").plan(2)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"nproc": 0}, "nproc must be a whole number >= 1; got 0"),
        ({"accumulate": -1}, "accumulate must be a whole number >= 1; got -1"),
        ({"precision": "fp8"}, r"precision must be one of \['32', '64', 'bf16-mixed', '16-mixed'\]; got 'fp8'"),
        ({"clip_grad_norm": 0.0}, "clip_grad_norm must be > 0"),
        ({"resume": "auto"}, "resume='auto' looks for checkpoints in out/checkpoints; set out as well"),
        ({"resume": "/no/such/dir"}, "no such checkpoint directory"),
        ({"accelerator": "tpu"}, "accelerator must be"),
        ({"max_step": 3}, r"unknown trainer settings: max_step \(did you mean max_steps\?\)"),
    ],
)
def test_bad_settings_are_clear_errors(settings, message):
    with pytest.raises(ConfigError, match=message):
        from_mapping(settings)


def test_trainer_checks_before_anything_runs():
    model = torch.nn.Linear(2, 2)
    data = torch.utils.data.TensorDataset(torch.randn(40, 2), torch.randn(40, 2))
    with pytest.raises(ConfigError, match="no loss: pass loss_fn="):
        Trainer(max_steps=1).fit(model, data)
    loss = lambda out, batch: out.sum()  # noqa: E731 - never pickled: the error comes first
    with pytest.raises(ConfigError, match="global batch 10 is not divisible by world size 4 x accumulate 1"):
        Trainer(strategy="ddp", nproc=4, global_batch_size=10, loss_fn=loss).fit(model, data)
    with pytest.raises(ConfigError, match="unknown strategy 'zer0'"):
        Trainer(strategy="zer0", loss_fn=loss).fit(model, data)
    with pytest.raises(ConfigError, match="nproc must be a whole number >= 1; got 0"):
        Trainer(nproc=0, loss_fn=loss)


def test_toml_and_overrides(tmp_path):
    f = tmp_path / "run.toml"
    f.write_text('[trainer]\nstrategy = "ddp"\nmax_steps = 5\n[recipe]\nhidden = 32\n')
    sections = apply_overrides(load_toml(f), ["trainer.max_steps=7", "trainer.strategy_options.bucket_cap_mb=1.5", "recipe.lr=0.01", "trainer.out=runs/x"])
    cfg = from_mapping(sections["trainer"])
    assert cfg.max_steps == 7 and cfg.strategy == "ddp" and cfg.strategy_options == {"bucket_cap_mb": 1.5} and cfg.out == "runs/x"
    assert sections["recipe"] == {"hidden": 32, "lr": 0.01}
    with pytest.raises(ConfigError, match="--set takes section.key=value"):
        apply_overrides({}, ["max_steps=3"])
    bad = tmp_path / "bad.toml"
    bad.write_text("[trainer\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="recipe 'digits' has no options \\['hiden'\\] \\(did you mean 'hidden' for 'hiden'\\?\\)"):
        get_recipe("digits").parts({"hiden": 3})
    with pytest.raises(ConfigError, match="unknown recipe 'digit'. Did you mean 'digits'"):
        get_recipe("digit")


def test_toml_strategy_options_are_checked_and_typed_against_the_chosen_strategy(tmp_path, capsys):
    from shardwise import cli

    f = tmp_path / "run.toml"
    f.write_text('[trainer]\nstrategy = "ddp"\n[trainer.strategy_options]\nbucket_cap_mb = 2\nallreduce = "ring"\nbroadcast_buffers = "false"\n')
    settings = cli._resolve_strategy_options(load_toml(f)["trainer"], {})
    cfg = from_mapping(settings)
    assert cfg.strategy_options == {"bucket_cap_mb": 2.0, "allreduce": "ring", "broadcast_buffers": False}
    assert type(cfg.strategy_options["bucket_cap_mb"]) is float  # the field's type, not TOML's integer
    # A flag wins over the file; --set values are read the same way as the file's.
    sections = apply_overrides(load_toml(f), ["trainer.strategy_options.compression=int8"])
    assert cli._resolve_strategy_options(sections["trainer"], {"allreduce": "tree"})["strategy_options"] == {
        "bucket_cap_mb": 2.0,
        "allreduce": "tree",
        "broadcast_buffers": False,
        "compression": "int8",
    }
    # Through the command: an unknown key, a bad value, a misplaced section: one line, exit code 2, nothing run.
    cases = [
        (
            '[trainer]\nstrategy = "ddp"\n[trainer.strategy_options]\nbucket_cap = 2\n',
            "strategy 'ddp' has no option 'bucket_cap' (did you mean 'bucket_cap_mb'?) (in trainer.strategy_options); its options are: bucket_cap_mb, ",
        ),
        (
            '[trainer]\nstrategy = "ddp"\n[trainer.strategy_options]\nstatic_graph = 3\n',
            "strategy 'ddp': option static_graph (--static-graph) must be true or false; got 3",
        ),
        ('[trainer]\nstrategy = "ddp"\nstrategy_options = 5\n', "trainer.strategy_options must be a table of option = value"),
        (
            '[trainer]\nstrategy = "ddp"\n[strategy_options]\nbucket_cap_mb = 2\n',
            "unknown config sections ['strategy_options']; use [trainer] and [recipe] (strategy options go under [trainer.strategy_options])",
        ),
    ]
    for text, message in cases:
        f.write_text(text)
        assert cli.main(["train", "--recipe", "digits", "--config", str(f)]) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err


def test_config_is_frozen():
    cfg = TrainerConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.nproc = 3  # type: ignore[misc]


def test_precision_modes():
    assert normalize("bf16") == "bf16-mixed" and normalize(16) == "16-mixed" and normalize(32) == "32"
    p = Precision("64", torch.device("cpu"))
    m = p.convert_module(torch.nn.Linear(2, 2))
    assert m.weight.dtype == torch.float64
    x, y = p.convert_input((torch.ones(2), torch.ones(2, dtype=torch.long)))
    assert x.dtype == torch.float64 and y.dtype == torch.long
    fp16 = Precision("16-mixed", torch.device("cpu"))
    assert fp16.scaler is not None and "scaler" in fp16.state_dict()
    with fp16.autocast():
        assert torch.nn.Linear(2, 2)(torch.ones(1, 2)).dtype == torch.float16


def test_mesh_shapes_are_validated():
    assert Mesh.build(world_size=4, tp=2).degrees == {"dp": 2, "pp": 1, "tp": 2}
    with pytest.raises(ConfigError, match="world size 6 is not divisible by pp 4 x tp 1; valid shapes: "):
        Mesh.build(world_size=6, pp=4)
    with pytest.raises(ConfigError, match="do not multiply to the world size 4"):
        Mesh.build(world_size=4, dp=2, tp=4)
    assert {"dp": 1, "pp": 2, "tp": 2} in valid_shapes(4)
    m = Mesh.build(world_size=8, rank=5, pp=2, tp=2)
    assert (m.coordinate("dp"), m.coordinate("pp"), m.coordinate("tp")) == (1, 0, 1)
