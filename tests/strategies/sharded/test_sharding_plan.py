"""The sharding family's options and plans (zero1, zero2, zero3 / fsdp, hsdp), without a process group:
every refusal is made by the constructor or by ``plan``, in the parent, before any process starts."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing

import pytest
import torch.distributed as dist
from torch import nn

from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, get_strategy
from shardwise.strategies.sharded.fsdp import FSDP, HSDP, ShardedDataParallel, Zero2
from shardwise.strategies.sharded.zero1 import Zero1

NAMES = ("zero1", "zero2", "zero3", "fsdp", "hsdp")


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))


class _Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.lin.requires_grad_(False)


def test_each_name_plans_a_data_parallel_layout_without_a_process_group():
    for name in NAMES:
        layout = get_strategy(name).plan(4, model=_Blocks(), batch=Batch(32, accumulate=2))
        assert (layout.world_size, layout.trainers, layout.data_parallel, layout.micro_batch) == (4, 4, 4, 4), name
        assert dict(layout.degrees) == {"dp": 4, "pp": 1, "tp": 1} and layout.servers == () and layout.expendable == ()
        assert layout.strategy == ("zero3" if name == "fsdp" else name)
    assert not dist.is_initialized()  # plan is pure


def test_the_registry_builds_the_classes_and_the_options_are_frozen():
    assert type(get_strategy("zero1")) is Zero1 and type(get_strategy("zero2")) is Zero2
    assert type(get_strategy("zero3")) is FSDP and type(get_strategy("fsdp")) is FSDP and type(get_strategy("hsdp")) is HSDP
    assert not isinstance(Zero2(), FSDP) and not isinstance(HSDP(), FSDP)  # siblings over one base, not subclasses of zero3
    s = get_strategy("zero3", wrap=["layers.0", "layers.1"], mixed_precision="bf16", offload=True)
    new = {"ep": 1, "cp": 1, "cp_style": "ring"}  # expert and context parallelism's options (issue 40)
    assert s.options() == {"wrap": ("layers.0", "layers.1"), "mixed_precision": "bf16", "offload": True, "count_collectives": True, **new}
    hash(s)  # a list from TOML is kept as a tuple: the options stay hashable
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.offload = False  # type: ignore[misc]
    assert get_strategy("hsdp", replicate=2).options()["replicate"] == 2
    assert Zero1().options() == {"offload": False, **new}


def test_every_option_is_documented_and_fixed_sets_are_literals():
    for cls in (Zero1, ShardedDataParallel, HSDP):
        tree = ast.parse(inspect.getsource(cls))
        body = tree.body[0].body  # type: ignore[attr-defined]
        own = [f.name for f in dataclasses.fields(cls) if f.name in cls.__dict__.get("__annotations__", {})]
        assert own, cls
        for name in own:
            i = next(i for i, node in enumerate(body) if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name)
            doc = body[i + 1]
            assert isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant) and doc.value.value.strip(), (cls.__name__, name)
    hints = typing.get_type_hints(FSDP)
    literal = [a for a in typing.get_args(hints["mixed_precision"]) if typing.get_origin(a) is typing.Literal]
    assert literal and set(typing.get_args(literal[0])) == {"bf16", "bfloat16", "fp16", "float16"}


def test_hsdp_shapes():
    assert HSDP().shape(4) == (2, 2) and HSDP().shape(8) == (2, 4) and HSDP().shape(2) == (1, 2) and HSDP().shape(3) == (1, 3)
    assert HSDP(replicate=4).shape(4) == (4, 1) and HSDP(shard=4).shape(8) == (2, 4)
    assert FSDP().shape(4) == (1, 4) and Zero2().shape(6) == (1, 6)
    with pytest.raises(
        ConfigError, match=r"hsdp shape replicate=3 x shard=None does not divide the world size 4; choose replicate x shard = 4 \(one of 1x4, 2x2, 4x1\)"
    ):
        HSDP(replicate=3).plan(4)
    with pytest.raises(ConfigError, match="replicate=2 x shard=2 does not divide the world size 2"):
        get_strategy("hsdp", replicate=2, shard=2).plan(2)


@pytest.mark.parametrize("name", NAMES)
def test_a_model_a_stage_cannot_shard_is_refused_by_the_plan(name):
    with pytest.raises(
        ConfigError,
        match=rf"strategy '{'zero3' if name == 'fsdp' else name}' shards .* _Frozen has no trainable parameters \(21 parameters, none with requires_grad\)",
    ):
        get_strategy(name).plan(2, model=_Frozen())
    with pytest.raises(ConfigError, match="the model Tanh has no parameters; there is nothing to train"):
        get_strategy(name).plan(2, model=nn.Tanh())
    with pytest.raises(ConfigError, match=r"shards over data-parallel ranks only; got mesh degrees \{'dp': 2, 'pp': 1, 'tp': 2\}"):
        get_strategy(name).plan(4, mesh={"tp": 2})


def test_unknown_units_are_refused_by_the_plan_and_bad_options_by_the_constructor():
    with pytest.raises(ConfigError, match=r"\['nope'\] match no submodule name or class of _Blocks"):
        get_strategy("zero3", wrap=["nope"]).plan(2, model=_Blocks())
    assert get_strategy("zero3", wrap="_Linear").plan(2) is not None  # without a model the names cannot be checked yet
    for name, options, message in (
        ("zero3", {"mixed_precision": "fp8"}, "mixed_precision must be 'bf16', 'fp16' or None; got 'fp8'"),
        ("zero2", {"wrap": 3}, r"zero2: wrap must be 'auto', 'root', a submodule or class name, or a list of them .*got 3"),
        ("zero3", {"wrap": []}, "wrap must be"),
        ("hsdp", {"offload": "yes"}, "hsdp: offload must be true or false; got 'yes'"),
        ("hsdp", {"replicate": 0}, "hsdp replicate must be a whole number >= 1; got 0"),
        ("hsdp", {"shard": True}, "hsdp shard must be a whole number >= 1; got True"),
        ("zero1", {"offload": True}, r"strategy 'zero1' does not support offload=True.*Use strategy 'zero2', 'zero3' or 'hsdp'"),
    ):
        with pytest.raises(ConfigError, match=message):
            get_strategy(name, **options)
    with pytest.raises(ConfigError, match="strategy 'zero1' has no option 'wrap'.*its options are: offload"):
        get_strategy("zero1", wrap="auto")


@pytest.mark.parametrize("name", NAMES)
def test_apply_without_a_process_group_says_how_to_start_one(name):
    mesh = Mesh.build(world_size=1)
    with pytest.raises(ConfigError, match="needs a process group; start the run through shardwise"):
        get_strategy(name).apply(_Blocks(), lambda p: None, mesh, Recorder())  # type: ignore[arg-type,return-value]


def test_blocks_that_share_a_module_are_not_units_of_their_own() -> None:
    """A hand-written model whose blocks all call one shared Linear: no block may own its weight, so
    the blocks stay with the root (FSDP2 failed inside the workers on the overlap); blocks that own
    their parameters are still units, and a shared module elsewhere leaves them so."""
    from torch import nn

    from shardwise.strategies.sharded.units import auto_wrap_units

    class Block(nn.Module):
        def __init__(self, shared: nn.Module | None) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(8)
            self.mix = shared if shared is not None else nn.Linear(8, 8)

    class Model(nn.Module):
        def __init__(self, share: bool) -> None:
            super().__init__()
            shared = nn.Linear(8, 8) if share else None
            self.blocks = nn.ModuleList(Block(shared) for _ in range(3))

    assert auto_wrap_units(Model(share=True)) == []
    assert auto_wrap_units(Model(share=False)) == ["blocks.0", "blocks.1", "blocks.2"]
