"""README claims that no other test proves, each checked by a test that fails without it.

The claim each test proves is quoted beside it (``# README: "..."``). Only public API is used
(Trainer, Engine, launch, the summary, callbacks), so the tests hold whatever the strategies
look like inside. One launch per world size runs every fit of that size (a process start costs
seconds here): the Trainer, started inside a launched worker, joins the existing process group.
The single-process references run in the test process.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Engine, Trainer, launch
from shardwise.tools.recipes.charlm import CharGPT
from shardwise.trainer.straggler import Straggler
from tests.support.models import adam, ce, classification, max_diff, mlp

# Each module fixture is one launch; its own limit (600 s) stays below the test's, so a hang is
# reported with the ranks still running instead of being cut off by pytest.
pytestmark = [pytest.mark.dist, pytest.mark.timeout(900)]

N = 4  # steps before a checkpoint; resumed runs go on to 2N
COMMON = dict(global_batch_size=16, accumulate=2, max_steps=2 * N, log_every=N, progress_bar=False, clip_grad_norm=0.5)


class Probe(nn.Module):
    """Three linear layers in a ModuleList (sharded wrapping finds them); forward records the dtype
    its first layer's weight and output have while it runs (what autocast and FSDP's policy change)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList([nn.Linear(6, 16), nn.Linear(16, 16), nn.Linear(16, 3)]).to(dtype)
        self.seen: set[tuple[str, str]] = set()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        self.seen.add((str(self.layers[0].weight.dtype), str(h.dtype)))
        h = self.layers[1](torch.tanh(h))
        return self.layers[2](torch.tanh(h))


class Keep:
    """Callback: the whole trained weights (a collective under sharded strategies: every rank calls it)."""

    state: dict[str, torch.Tensor]

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def on_fit_end(self, trainer: Any, engine: Engine, summary: dict[str, Any]) -> None:
        from torch.distributed.tensor import DTensor

        self.state = {k: v.clone() for k, v in engine.consolidated_state_dict(self.model).items()}
        self.degrees = {d: engine.mesh.size(d) for d in ("dp", "pp", "tp")}
        # Parameters this rank holds only a slice of (torch's DTensor: its local piece is smaller).
        self.sliced = sum(isinstance(p, DTensor) and p.to_local().numel() < p.numel() for p in self.model.parameters())


class StepClock:
    """Callback, after the straggler's: the wall time of each step on this rank, its sleep included."""

    def __init__(self, straggler: Straggler) -> None:
        self.straggler, self.stamps = straggler, [time.perf_counter()]

    def on_train_step_end(self, trainer: Any, engine: Engine, step: int, loss: Any) -> None:
        self.stamps.append(time.perf_counter())


def fit(strategy: str, model: nn.Module, data: TensorDataset, *, options: dict[str, Any] | None = None, **settings: Any) -> dict[str, Any]:
    keep = Keep(model)
    cfg = {**COMMON, "precision": "64", **settings}
    callbacks = [keep, *cfg.pop("callbacks", [])]
    trainer = Trainer(
        strategy=strategy, optimizer=cfg.pop("optimizer", adam), loss_fn=cfg.pop("loss_fn", ce), strategy_options=options or {}, callbacks=callbacks, **cfg
    )
    summary = trainer.fit(model, data)
    return {"state": keep.state, "summary": summary, "seen": sorted(getattr(model, "seen", set())), "degrees": keep.degrees, "sliced": keep.sliced}


def data32() -> TensorDataset:
    return classification(dtype=torch.float32)


# -- the charlm model for the pipeline claims (float64, as test_pipeline.py) --


def gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(11, 8, 16, 2, 4).double()


def tokens(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randint(0, 11, (n, 8), generator=g), torch.randint(0, 11, (n, 8), generator=g))


def lm_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


LM = dict(optimizer=adamw, loss_fn=lm_loss, global_batch_size=8, accumulate=1, max_steps=N)


def _resume_cells(strategy: str, tmp: str, **options: Any) -> dict[str, Any]:
    """2N uninterrupted; N with a checkpoint, then a fresh fit resuming it to 2N (dropout: the RNG must resume too)."""
    out = {"full": fit(strategy, mlp(dropout=0.1), classification(), options=options, deterministic=True)}
    fit(strategy, mlp(dropout=0.1), classification(), options=options, deterministic=True, max_steps=N, out=f"{tmp}/{strategy}", checkpoint_every=N)
    out["resumed"] = fit(strategy, mlp(dropout=0.1), classification(), options=options, deterministic=True, out=f"{tmp}/{strategy}", resume="auto")
    return out


def _world_of_two(tmp: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for strategy in ("ddp", "zero3"):
        for precision in ("bf16-mixed", "16-mixed"):
            out[(strategy, precision)] = fit(strategy, Probe(), data32(), precision=precision)
    out["mixed_precision"] = fit("zero3", Probe(), data32(), precision="32", options={"mixed_precision": "bf16"})
    out["zero3-fp32"] = fit("zero3", Probe(), data32(), precision="32")
    # wrap: which submodules become FSDP units, seen through torch's own FSDPModule class.
    from torch.distributed.fsdp import FSDPModule

    for name, wrap in (("auto", "auto"), ("root", "root"), ("names", ["layers.0", "layers.2"]), ("classes", ["Linear"])):
        engine = Engine(strategy="zero3", strategy_options={"wrap": wrap}, accelerator="cpu", precision="64")
        wrapped, _ = engine.setup(Probe(torch.float64), adam)
        out[("units", name)] = sorted(n for n, m in engine.unwrap(wrapped).named_modules() if isinstance(m, FSDPModule))
        engine.close()
    out[("wrap", "root")] = fit("zero3", Probe(torch.float64), classification(), options={"wrap": "root"})
    out[("wrap", "names")] = fit("zero3", Probe(torch.float64), classification(), options={"wrap": ["layers.0", "layers.2"]})
    out["fsdp"] = fit("fsdp", Probe(torch.float64), classification())
    out["zero3"] = fit("zero3", Probe(torch.float64), classification())
    out["zero1"] = _resume_cells("zero1", tmp)
    out["split_points"] = fit("pipeline", gpt(), tokens(), options=dict(pp=2, microbatches=4, schedule="1f1b", split_points=["blocks.3"]), **LM)
    straggler = Straggler(1, 3.0)
    clock = StepClock(straggler)
    fit("ddp", mlp(), classification(), callbacks=[straggler, clock], max_steps=12, log_every=12)
    out["straggler"] = {
        "slept_s": straggler.slept_s,
        "fastest": straggler.fastest,
        "steps": [b - a for a, b in zip(clock.stamps[1:], clock.stamps[2:], strict=False)],
    }
    return out


def _world_of_eight(tmp: str) -> dict[Any, Any]:
    return {
        "dp_pp_tp": fit("pipeline", gpt(), tokens(), options=dict(pp=2, tp=2, microbatches=4, schedule="1f1b"), **LM),
        "hsdp": _resume_cells("hsdp", tmp),
    }


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return launch(_world_of_two, str(tmp_path_factory.mktemp("two")), nproc=2, threads_per_proc=1, timeout=600)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> list[dict[Any, Any]]:
    return launch(_world_of_eight, str(tmp_path_factory.mktemp("eight")), nproc=8, threads_per_proc=1, timeout=600)


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    """single in this process: the same fits at one rank."""
    return {
        "bf16-mixed": fit("single", Probe(), data32(), precision="bf16-mixed"),
        "16-mixed": fit("single", Probe(), data32(), precision="16-mixed"),
        "32": fit("single", Probe(), data32(), precision="32"),
        "64": fit("single", Probe(torch.float64), classification()),
        "gpt": fit("single", gpt(), tokens(), **LM),
    }


# README: 'precision="bf16-mixed"' (the Trainer example: ddp on 2 processes) and the CLI's
# '--precision 32, 64, bf16-mixed, 16-mixed', on ddp and zero3.
@pytest.mark.parametrize("strategy", ["ddp", "zero3"])
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_mixed_precision_at_world_size_two_computes_in_half_and_matches_single(two, reference, strategy, precision):
    half = {"bf16-mixed": "torch.bfloat16", "16-mixed": "torch.float16"}[precision]
    ref = reference[precision]
    assert ref["seen"] == [("torch.float32", half)]  # the reference itself ran under autocast
    for rank in range(2):
        got = two[rank][(strategy, precision)]
        # Weights stay float32 (the master copy); the layer computed in the half type.
        assert got["seen"] == [("torch.float32", half)], got["seen"]
        assert all(v.dtype == torch.float32 for v in got["state"].values())
        # Same run as single up to half-precision rounding (a gradient scaler that did not unscale,
        # or a gradient left unreduced, moves the weights by orders of magnitude more).
        gap = max_diff(ref["state"], got["state"])
        assert gap < 1e-3, gap
        assert got["summary"]["precision"] == precision


# README: "`mixed_precision` (`bf16`/`fp16`: parameters gathered and computed in that type,
# gradients reduced and master weights kept in fp32)"
def test_sharded_mixed_precision_gathers_in_bf16_and_keeps_fp32_master_weights(two):
    for rank in range(2):
        mp, plain = two[rank]["mixed_precision"], two[rank]["zero3-fp32"]
        # No autocast (precision 32): a bf16 output of a linear layer means input and weight were bf16.
        assert {out for _, out in mp["seen"]} == {"torch.bfloat16"}, mp["seen"]
        assert {out for _, out in plain["seen"]} == {"torch.float32"}, plain["seen"]
        assert all(v.dtype == torch.float32 for v in mp["state"].values())  # master weights
        gap = max_diff(plain["state"], mp["state"])
        assert 1e-5 < gap < 2e-2, gap  # bf16 compute changed the run, and only by rounding
    assert max_diff(two[0]["mixed_precision"]["state"], two[1]["mixed_precision"]["state"]) == 0


# README: "`wrap` (`auto`: one unit per block of a model's `ModuleList`, else per large child;
# `root`; or a list of submodule or class names)"
def test_wrap_options_choose_the_units_and_train_the_same(two, reference):
    units = {name: two[0][("units", name)] for name in ("auto", "root", "names", "classes")}
    assert units["auto"] == ["", "layers.0", "layers.1", "layers.2"]
    assert units["root"] == [""]
    assert units["names"] == ["", "layers.0", "layers.2"]
    assert units["classes"] == ["", "layers.0", "layers.1", "layers.2"]
    for name in ("root", "names"):
        assert max_diff(reference["64"]["state"], two[0][("wrap", name)]["state"]) < 1e-9


# README: "`zero3`, `fsdp`" (one row: fsdp is zero3 under another name)
def test_fsdp_is_zero3(two, reference):
    for rank in range(2):
        fsdp, zero3 = two[rank]["fsdp"], two[rank]["zero3"]
        assert max_diff(fsdp["state"], zero3["state"]) == 0
        assert max_diff(reference["64"]["state"], fsdp["state"]) < 1e-9
        memory = [r["summary"]["memory_per_rank"]["total"]["measured"] for r in (fsdp, zero3)]
        assert memory[0] == memory[1]  # sharded as zero3 is


def _check_resume(cells: dict[str, Any]) -> None:
    full, resumed = cells["full"], cells["resumed"]
    assert resumed["summary"]["resumed_from"].endswith(f"step-{N:08d}") and resumed["summary"]["steps_this_run"] == N
    for k in full["state"]:
        assert torch.equal(full["state"][k], resumed["state"][k]), f"{k} differs after resume"


# README: "exact resume from atomic checkpoints" and "Their checkpoints are sharded ... and resume"
# (zero1: ZeroRedundancyOptimizer's partitioned optimizer state)
def test_zero1_resumes_bit_for_bit(two):
    for rank in range(2):
        _check_resume(two[rank]["zero1"])


# README: "`hsdp` | as `zero3` within a group of S ranks, replicated across R groups (2D mesh R x S)"
# and its checkpoints resume.
def test_hsdp_two_by_four_resumes_bit_for_bit(eight):
    for rank in range(8):
        _check_resume(eight[rank]["hsdp"])
    fsdp = eight[0]["hsdp"]["full"]["summary"].get("fsdp", {})
    assert (fsdp.get("replicate"), fsdp.get("shard")) == (2, 4)  # the default shape at 8: 2 x N/2


# README: "(`--pp N` stages, balanced by parameter count or at named split points)"
def test_pipeline_split_points_cut_where_named_and_match_single(two, reference):
    for rank in range(2):
        got = two[rank]["split_points"]
        assert got["summary"]["pipeline"]["stage_layers"] == [["embed", "blocks.0", "blocks.1", "blocks.2"], ["blocks.3", "head"]]
        assert max_diff(reference["gpt"]["state"], got["state"]) < 1e-9


# README: "composes with `--tp` and data parallelism (dp x pp, pp x tp, dp x pp x tp)" and
# "--pp 2 --tp 2 ... --nproc 8: dp x pp x tp"
def test_dp_by_pp_by_tp_at_world_size_eight_matches_single(eight, reference):
    for rank in range(8):
        got = eight[rank]["dp_pp_tp"]
        assert max_diff(reference["gpt"]["state"], got["state"]) < 1e-9
        assert got["degrees"] == {"dp": 2, "pp": 2, "tp": 2}
        assert got["sliced"] > 0  # this rank holds slices of its stage's weights: tensor parallelism is on
    summary = eight[0]["dp_pp_tp"]["summary"]
    assert summary["world_size"] == 8 and summary["pipeline"]["pp"] == 2
    assert summary["comm"]["by_op"]["dp/all_reduce"]["count"] > 0  # the dp replicas were averaged


# README: "`--straggler RANK:FACTOR` slows one rank down on purpose (any strategy)"
def test_the_straggler_rank_alone_is_slowed_by_its_factor(two):
    slow, fast = two[1]["straggler"], two[0]["straggler"]
    assert fast["slept_s"] == 0  # rank 0 never sleeps
    # Rank 1 sleeps (factor - 1) x its fastest step after every step after the first, so each of its
    # steps lasts at least factor x that fastest step: lower bounds only (a sleep never ends early),
    # whatever else the machine runs.
    # Each measured step holds the whole of its sleep, so it lasts at least (factor - 1) x the fastest.
    assert slow["slept_s"] >= 2.0 * 12 * slow["fastest"] > 0
    assert len(slow["steps"]) == 11 and all(d >= 2.0 * slow["fastest"] for d in slow["steps"]), (slow["steps"], slow["fastest"])


# README: "checkpoints/step-NNNNNNNN/ (atomic, checksummed, the last 3 of this run kept)" and the
# Trainer's keep_last setting.
def test_keep_last_prunes_older_checkpoints_of_the_run(tmp_path):
    fit("single", mlp(), classification(), max_steps=5, log_every=5, out=str(tmp_path / "three"), checkpoint_every=1)
    assert sorted(p.name for p in (tmp_path / "three" / "checkpoints").iterdir()) == [f"step-{i:08d}" for i in (3, 4, 5)]
    fit("single", mlp(), classification(), max_steps=5, log_every=5, out=str(tmp_path / "one"), checkpoint_every=1, keep_last=1)
    assert sorted(p.name for p in (tmp_path / "one" / "checkpoints").iterdir()) == ["step-00000005"]


def test_probe_records_what_it_claims():
    """The Probe's record is what the claims above read: check it once in plain PyTorch."""
    model = Probe()
    model(torch.zeros(2, 6))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.zeros(2, 6))
    assert sorted(model.seen) == [("torch.float32", "torch.bfloat16"), ("torch.float32", "torch.float32")]
