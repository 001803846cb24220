"""Sharded data parallel (zero1, zero2, zero3, hsdp) equals the single-process reference, each
rank's model-state bytes equal the ZeRO formula for its stage, and the bytes the Recorder
recorded equal the traffic formula of each stage.

One launch per world size runs every fit of that size (a process start costs ~2.5 s here):
the Trainer, started inside a launched worker, joins the existing process group.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise.errors import ConfigError
from shardwise.strategies.cost.memory import model_state_bytes, plain
from tests.support.models import accuracy, adam, ce, classification, max_diff, mlp, params, sgd

pytestmark = pytest.mark.dist

COMMON = dict(precision="64", global_batch_size=16, accumulate=2, max_steps=10, log_every=5, progress_bar=False, clip_grad_norm=0.05)
OPTIMIZERS = {"adam": adam, "sgd": sgd}
VAL = 37  # an odd number of validation samples: ranks get shards of unequal size


def _full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Whole parameters on every rank, whatever the strategy left in the module (DTensor shards or tensors)."""
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _fit(strategy: str, optimizer: str, **options: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = mlp()
    trainer = Trainer(strategy=strategy, optimizer=OPTIMIZERS[optimizer], loss_fn=ce, metrics={"accuracy": accuracy}, strategy_options=options, **COMMON)
    summary = trainer.fit(model, classification(), classification(n=VAL, seed=5))
    return _full_params(model), summary


class Blocks(nn.Module):
    """Eight 8x8 blocks: every tensor splits evenly on dim 0 across 2 and 4 ranks (FSDP2), and
    whole tensors split evenly across ranks too (zero1's ZeroRedundancyOptimizer assigns tensors)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(8, 8, bias=False) for _ in range(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x  # 8 logits; labels are 0..2


def normed() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()


def eight_features(n: int = 96) -> TensorDataset:
    x, y = classification(n).tensors
    return TensorDataset(torch.cat([x, x[:, :2] ** 2], dim=1), y)


def _memory(strategy: str, optimizer: str, **options: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's memory section, measured on a model whose tensors split evenly."""
    model = Blocks().double()
    trainer = Trainer(
        strategy=strategy, optimizer=OPTIMIZERS[optimizer], loss_fn=ce, strategy_options=options, **{**COMMON, "max_steps": 2, "clip_grad_norm": None}
    )
    summary = trainer.fit(model, eight_features())
    psi = sum(p.numel() for p in Blocks().parameters())
    return summary["memory_per_rank"], {"psi": psi, "fsdp": summary.get("fsdp"), "comm": summary["comm"]["by_op"]}


HSDP_SHAPES = {"2x1": {"replicate": 2, "shard": 1}, "1x2": {"replicate": 1, "shard": 2}}


def _world_of_two() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy in ("zero1", "zero2", "zero3"):
        for opt in OPTIMIZERS:
            out[(strategy, opt)] = _fit(strategy, opt)
    for strategy in ("zero1", "zero2", "zero3"):
        for opt in OPTIMIZERS:
            out[("memory", strategy, opt)] = _memory(strategy, opt)
    for strategy in ("zero2", "zero3"):  # CPUOffloadPolicy without pinned memory (no CUDA here)
        out[("offload", strategy)] = _fit(strategy, "adam", offload=True)
    trainer = Trainer(strategy="zero3", optimizer=adam, loss_fn=ce, sync_batchnorm=True, **{**COMMON, "max_steps": 2, "clip_grad_norm": None})
    out["syncbn"] = trainer.fit(normed(), classification())
    for shape in HSDP_SHAPES:  # hsdp's two shapes at 2 ranks: swapping its mesh dimensions turns one into the other
        out[("hsdp", shape)] = _fit("hsdp", "adam", **HSDP_SHAPES[shape])
        out[("memory", "hsdp", shape)] = _memory("hsdp", "adam", **HSDP_SHAPES[shape])
    return out


def _world_of_four() -> dict[str, Any]:
    out: dict[str, Any] = {}
    for opt in OPTIMIZERS:
        out[("hsdp", opt)] = _fit("hsdp", opt)  # default shape at 4: replicate 2 x shard 2
    for strategy in ("zero1", "zero2", "zero3"):
        out[("memory", strategy, "adam")] = _memory(strategy, "adam")
    out[("memory", "hsdp", "adam")] = _memory("hsdp", "adam")
    for setting in ("off", "on:aot_eager"):  # compiled per block before fully_shard, as zero3 (compile_unit "blocks")
        model = Blocks().double()
        trainer = Trainer(strategy="hsdp", optimizer=adam, loss_fn=ce, compile=setting, **{**COMMON, "max_steps": 4})
        out[("compile", setting)] = (_full_params(model), trainer.fit(model, eight_features()))
    return out


@pytest.fixture(scope="module")
def reference() -> dict[str, tuple[dict[str, torch.Tensor], dict[str, Any]]]:
    return {opt: _fit("single", opt) for opt in OPTIMIZERS}


@pytest.fixture(scope="module")
def two() -> list[dict[str, Any]]:
    return launch(_world_of_two, nproc=2, threads_per_proc=1)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return launch(_world_of_four, nproc=4, threads_per_proc=1)  # type: ignore[no-any-return]


def _check_parity(result: tuple[dict[str, torch.Tensor], dict[str, Any]], ref: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    got, summary = result
    want, ref_summary = ref
    assert max_diff(want, got) < 1e-9
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) < 1e-9
    # Evaluation: every rank made the same number of (collective) forward calls, each sample counted once.
    assert summary["val_samples"] == VAL
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], abs=1e-9)
    assert summary["val_accuracy"] == pytest.approx(ref_summary["val_accuracy"], abs=1e-12)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_stage_equals_single_at_world_size_two(strategy, opt, two, reference):
    for rank in range(2):  # every rank ends with the same whole parameters
        _check_parity(two[rank][(strategy, opt)], reference[opt])
    assert two[0][(strategy, opt)][1]["steps"] == 10
    # That the clip is active in these runs (a reference without it differs) is
    # test_clipping_matters_in_the_parity_runs; that it clips by the global norm, the hand loop of
    # tests/strategies/data_parallel/test_maths_single.py.


@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_hsdp_two_by_two_equals_single(opt, four, reference):
    for rank in range(4):
        _check_parity(four[rank][("hsdp", opt)], reference[opt])
    assert four[0][("hsdp", opt)][1]["fsdp"]["replicate"] == 2 and four[0][("hsdp", opt)][1]["fsdp"]["shard"] == 2


def test_hsdp_two_by_two_compiled_trains_the_same_weights_as_uncompiled(four):
    """``compile=`` under hsdp (2 x 2): each block compiled before it is sharded; float64 and aot_eager (no generated
    code: the same aten operators in the same order), so not a bit differs from the uncompiled run."""
    for rank in range(4):
        (eager, _), (compiled, summary) = four[rank][("compile", "off")], four[rank][("compile", "on:aot_eager")]
        assert max_diff(eager, compiled) == 0.0
        section = summary["compile"]
        assert section["mode"] == "blocks" and section["backend"] == "aot_eager", section
        assert section["compiled"][0] == "layers.0" and section["compiled"][-1] == "... 8 in all", section
        # nn.Linear blocks are torch's own class: their whole call (FSDP2's hooks in it) compiled no graph before
        assert section["graphs"] >= 1 and section["compile_s"] > 0, section
    assert "compile" not in four[0][("compile", "off")][1]


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_offload_to_cpu_trains_the_same(strategy, two, reference):
    for rank in range(2):
        _check_parity(two[rank][("offload", strategy)], reference["adam"])
    assert two[0][("offload", strategy)][1]["fsdp"]["offload"] is True


def test_clipping_matters_in_the_parity_runs():
    model = mlp()
    Trainer(strategy="single", optimizer=adam, loss_fn=ce, **{**COMMON, "clip_grad_norm": None}).fit(model, classification())
    clipped = _fit("single", "adam")[0]
    assert max_diff(params(model), clipped) > 1e-4


def _expected(strategy: str, psi: int, world: int, slots: int) -> dict[str, float]:
    stage = {"zero1": 1, "zero2": 2, "zero3": 3, "hsdp": 3}[strategy]
    shard = world // 2 if strategy == "hsdp" else world
    # zero2 steps FSDP2's shards, a copy apart from the gathered compute parameters: a master copy.
    return model_state_bytes(stage, psi, shard, plain(8, slots, master_copy=strategy == "zero2"))


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_measured_bytes_equal_the_formula_at_world_size_two(strategy, two):
    for rank in range(2):
        for opt, slots in (("adam", 2), ("sgd", 1)):
            section, info = two[rank][("memory", strategy, opt)]
            expected = _expected(strategy, info["psi"], 2, slots)
            for cat in ("params", "grads", "optimizer", "total"):
                assert section[cat]["measured"] == expected[cat], (strategy, opt, rank, cat, section[cat], expected[cat])
                assert section[cat]["ratio"] == 1.0


@pytest.mark.parametrize("shape", list(HSDP_SHAPES))
def test_hsdp_replicates_over_one_mesh_dimension_and_shards_over_the_other(shape, two, reference):
    """At 2 ranks, replicate 2 x shard 1 keeps whole tensors and allreduces every gradient across
    the replicas; 1 x 2 is zero3. Every other hsdp test runs 2 x 2, where swapped mesh dimensions
    (or a swapped (replicate, shard) pair) change nothing."""
    replicate, shard = HSDP_SHAPES[shape]["replicate"], HSDP_SHAPES[shape]["shard"]
    for rank in range(2):
        _check_parity(two[rank][("hsdp", shape)], reference["adam"])
        section, info = two[rank][("memory", "hsdp", shape)]
        assert (info["fsdp"]["replicate"], info["fsdp"]["shard"]) == (replicate, shard)
        psi = info["psi"]
        expected = model_state_bytes(3, psi, shard, plain(8, 2))  # each rank holds 1/shard of every tensor
        for cat in ("params", "grads", "optimizer", "total"):
            assert section[cat]["measured"] == expected[cat], (shape, rank, cat, section[cat], expected[cat])
        comm = {op: v["payload_bytes"] for op, v in info["comm"].items() if op != "world/all_reduce"}  # world: the metrics' mean
        steps = 2
        if shape == "2x1":  # no gather, no reduce-scatter: every gradient allreduced whole across the 2 replicas
            assert comm == {"replicate/all_reduce": steps * psi * 8}
            assert info["fsdp"]["collectives_per_step"] == {"replicate/all_reduce": {"backward": 8.0}}
        else:  # zero3 over 2: gathered in forward and backward, reduce-scattered once per unit
            assert comm == {"dp/all_gather": steps * 2 * 2 * psi * 8, "dp/reduce_scatter": steps * psi * 8}


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "hsdp"])
def test_measured_bytes_equal_the_formula_at_world_size_four(strategy, four):
    for rank in range(4):
        section, info = four[rank][("memory", strategy, "adam")]
        expected = _expected(strategy, info["psi"], 4, 2)
        for cat in ("params", "grads", "optimizer", "total"):
            assert section[cat]["measured"] == expected[cat], (strategy, rank, cat, section[cat], expected[cat])
    # Stage 3 holds a quarter of stage 0's bytes at world size 4 (16 Psi -> 4 Psi bytes of fp64 Adam x 1/4 ...).
    z3 = four[0][("memory", "zero3", "adam")][0]["total"]["measured"]
    z1 = four[0][("memory", "zero1", "adam")][0]["total"]["measured"]
    psi = four[0][("memory", "zero3", "adam")][1]["psi"]
    assert z3 == 32 * psi / 4 and z1 == 8 * psi * 2 + 16 * psi / 4


# -- bad inputs: clear errors before training starts -------------------------------------------


class Frozen(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.lin.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)  # type: ignore[no-any-return]


def test_a_stage_on_a_model_without_trainable_parameters_is_a_config_error():
    with pytest.raises(ConfigError, match=r"strategy 'zero3' shards .* has no trainable parameters \(21 parameters, none with requires_grad\)"):
        Trainer(strategy="zero3", nproc=1, loss_fn=ce, max_steps=1, progress_bar=False).fit(Frozen(), classification())
    with pytest.raises(ConfigError, match="has no parameters; there is nothing to train"):
        Trainer(strategy="zero2", nproc=1, loss_fn=ce, max_steps=1, progress_bar=False).fit(nn.Tanh(), classification())


def test_offload_with_a_strategy_that_cannot_is_a_config_error():
    with pytest.raises(ConfigError, match="strategy 'zero1' does not support offload=True.*Use strategy 'zero2', 'zero3' or 'hsdp'"):
        Trainer(strategy="zero1", nproc=2, strategy_options={"offload": True}, loss_fn=ce).fit(mlp(), classification())
    with pytest.raises(ConfigError, match="strategy 'ddp' has no option 'offload'"):
        Trainer(strategy="ddp", nproc=2, strategy_options={"offload": True}, loss_fn=ce).fit(mlp(), classification())


def test_an_hsdp_shape_that_does_not_divide_the_world_size_is_a_config_error():
    with pytest.raises(
        ConfigError, match=r"hsdp shape replicate=3 x shard=None does not divide the world size 4; choose replicate x shard = 4 \(one of 1x4, 2x2, 4x1\)"
    ):
        Trainer(strategy="hsdp", nproc=4, strategy_options={"replicate": 3}, loss_fn=ce).fit(mlp(), classification())
    with pytest.raises(ConfigError, match="replicate=2 x shard=2 does not divide the world size 2"):
        Trainer(strategy="hsdp", nproc=2, strategy_options={"replicate": 2, "shard": 2}, loss_fn=ce).fit(mlp(), classification())


# -- traffic: the bytes the Recorder saw equal each stage's formula ------------------------------------
#
# The Recorder counts, per rank, the payload handed to each collective and the bandwidth-optimal
# bytes sent and received (`shardwise.comm.recorder.wire_bytes`): 2(p-1)/p of the payload for an
# allreduce, (p-1)/p of the gathered / unreduced buffer for an all-gather or reduce-scatter, the
# payload out of the root of a broadcast and into every other rank. Below, the counts and bytes
# each stage must produce, derived from the model's shapes alone.

STEPS, ACCUMULATE = 2, 2  # the memory runs: 2 optimizer steps of 2 micro-batches, no clipping, no evaluation
BLOCK = 8 * 8 * 8  # bytes of one Blocks layer (an 8x8 float64 weight): one FSDP unit, one zero1 tensor


def _gathered(shape: tuple[int, ...], shard: int, itemsize: int = 8) -> int:
    """Bytes of a parameter as FSDP2 gathers it: dim 0 padded to a multiple of the shard degree."""
    return math.ceil(shape[0] / shard) * shard * math.prod(shape[1:]) * itemsize


def _op(count: int, payload: int, sent: int, received: int | None = None) -> dict[str, int]:
    return {"count": count, "payload_bytes": payload, "sent_bytes": sent, "received_bytes": sent if received is None else received}


def _collective(p: int, payload: int, op: str) -> int:
    """Bytes one rank sends (and receives) in a library collective of ``payload`` bytes over ``p`` ranks."""
    return 2 * (p - 1) * payload // p if op == "all_reduce" else (p - 1) * payload // p


def _fsdp_traffic(strategy: str, units: list[int], shard: int, replicate: int, steps: int, accumulate: int, evals: int = 0) -> dict[str, dict[str, int]]:
    """ZeRO-2 / ZeRO-3 / HSDP on FSDP2, per rank: ``units`` are the gathered bytes of each unit (the
    root is one more when it holds parameters of its own; in these models it holds none)."""
    g = "dp" if replicate == 1 else "shard"
    total, n = sum(units), len(units)
    if strategy == "zero2":
        rounds = steps + 1  # every unit gathered before the first forward, then again after every optimizer step
    else:
        # every unit gathered before its forward and again before its backward, each micro-batch,
        # and before each evaluation forward
        rounds = steps * accumulate * 2 + evals
    out = {
        f"{g}/all_gather": _op(rounds * n, rounds * total, _collective(shard, rounds * total, "all_gather")),
        # one reduce-scatter of every unit's gradient per step (the last micro-batch's backward)
        f"{g}/reduce_scatter": _op(steps * n, steps * total, _collective(shard, steps * total, "reduce_scatter")),
    }
    if replicate > 1:  # the gradient shard of every unit allreduced across the replicas, once per step
        out["replicate/all_reduce"] = _op(steps * n, steps * total // shard, _collective(replicate, steps * total // shard, "all_reduce"))
    return out


def _zero1_traffic(tensors: list[int], owned: list[int], world: int, steps: int) -> dict[str, dict[str, int]]:
    """ZeRO-1, per rank: DDP's gradient allreduce once per step (every trainable byte), then after
    the step one broadcast per tensor from its owner: this rank sends what it owns and receives the rest."""
    psi = sum(tensors)
    return {
        "dp/all_reduce": _op(steps, steps * psi, _collective(world, steps * psi, "all_reduce")),
        "dp/broadcast": _op(steps * len(tensors), steps * psi, steps * sum(owned), steps * (psi - sum(owned))),
    }


def _recorded(by_op: dict[str, dict[str, Any]], groups: tuple[str, ...] = ("dp", "shard", "replicate")) -> dict[str, dict[str, int]]:
    """The strategy's traffic from a summary's ``comm.by_op`` (the loop's own logging, group world, left out)."""
    keys = ("count", "payload_bytes", "sent_bytes", "received_bytes")
    assert set(k.split("/")[0] for k in by_op) <= {*groups, "world"}, sorted(by_op)
    return {k: {f: int(v[f]) for f in keys} for k, v in by_op.items() if k.split("/")[0] in groups}


def _blocks_traffic(strategy: str, world: int) -> dict[str, dict[str, int]]:
    if strategy == "zero1":  # eight equal tensors: each rank owns 8 / world of them
        return _zero1_traffic([BLOCK] * 8, [BLOCK] * (8 // world), world, STEPS)
    shard, replicate = (world // 2, 2) if strategy == "hsdp" else (world, 1)
    return _fsdp_traffic(strategy, [_gathered((8, 8), shard)] * 8, shard, replicate, STEPS, ACCUMULATE)


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_recorded_traffic_equals_the_formula_at_world_size_two(strategy, two):
    expected = _blocks_traffic(strategy, 2)
    for rank in range(2):
        for opt in OPTIMIZERS:
            assert _recorded(two[rank][("memory", strategy, opt)][1]["comm"]) == expected, (strategy, opt, rank)
    if strategy != "zero1":
        # ZeRO-3's gathers, per step: each of the 8 units before its forward and before its backward,
        # per micro-batch; ZeRO-2's: each unit after the step (and once before the first forward).
        per_step = two[0][("memory", strategy, "adam")][1]["fsdp"]["collectives_per_step"]
        assert per_step["dp/reduce_scatter"] == {"backward": 8.0}
        assert per_step["dp/all_gather"] == ({"forward": 16.0, "backward": 16.0} if strategy == "zero3" else {"forward": 4.0, "step": 8.0})


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3", "hsdp"])
def test_recorded_traffic_equals_the_formula_at_world_size_four(strategy, four):
    expected = _blocks_traffic(strategy, 4)
    for rank in range(4):
        assert _recorded(four[rank][("memory", strategy, "adam")][1]["comm"]) == expected, (strategy, rank)


def test_zero3_records_padded_shards_clipping_and_evaluation(two):
    """The mlp's Linear(16, 3) does not split in two: FSDP2 pads its rows to 4, and the bytes
    recorded are the padded ones FSDP2 sends. Clipping adds one allreduce of the norm per step,
    evaluation one gather per unit per forward (37 samples: 19 on one rank, 5 calls of 4). The
    allreduce that clipping adds is issued by DTensor inside its own operator (the norm), which
    the recording sees too."""
    units = [_gathered((16, 6), 2) + _gathered((16,), 2), _gathered((3, 16), 2) + _gathered((3,), 2)]
    assert units == [896, 544]  # 163 parameters, 180 as gathered
    expected = _fsdp_traffic("zero3", units, 2, 1, steps=10, accumulate=2, evals=5)
    # DTensor's norm: each of the 4 gradients' partial norms (float64) stacked and allreduced, once per step
    expected["dp/all_reduce"] = _op(10, 10 * 4 * 8, _collective(2, 10 * 4 * 8, "all_reduce"))
    for opt in OPTIMIZERS:
        for rank in range(2):
            assert _recorded(two[rank][("zero3", opt)][1]["comm"]["by_op"]) == expected, (opt, rank)
        per_step = two[0][("zero3", opt)][1]["fsdp"]["collectives_per_step"]
        assert per_step["dp/all_gather"] == {"forward": 4.0, "backward": 4.0, "eval": 1.0}
        assert per_step["dp/all_reduce"] == {"clip": 1.0}


def test_collectives_sent_through_comm_inside_a_sharded_step_are_recorded_once(two):
    """SyncBatchNorm's statistics go through shardwise.comm, which records them, inside zero3's
    forward and backward, where FSDP2's own collectives are recorded from below: each is counted
    once (one allreduce of (sum x, sum x^2, count), 33 float64, per micro-batch forward and backward)."""
    units = [_gathered((16, 6), 2) + _gathered((16,), 2), 2 * _gathered((16,), 2), _gathered((3, 16), 2) + _gathered((3,), 2)]
    expected = _fsdp_traffic("zero3", units, 2, 1, STEPS, ACCUMULATE)
    calls = STEPS * ACCUMULATE * 2
    expected["dp/all_reduce"] = _op(calls, calls * 33 * 8, _collective(2, calls * 33 * 8, "all_reduce"))
    for rank in range(2):
        assert _recorded(two[rank]["syncbn"]["comm"]["by_op"]) == expected, rank
