"""Bad configurations, fuzzed: every combination of the Trainer's options either trains or is refused
with a ConfigError before any process starts; never another exception, a worker's traceback or a hang.

Hypothesis draws configurations from the options a user sets (strategy, processes, batch, accumulation,
precision, and each strategy's own options, valid values and plausible mistakes alike). Each one is
checked in this process as ``Trainer.fit`` checks it before launching (`Trainer._check`: the
strategy's plan, the mesh, the batch split, the model). The configurations that pass are then run, a
few steps each, inside one launch per world size (the Trainer joins the launch's group in-process, so
a hundred runs cost one process start), each under a short collective timeout: one that fails there
is a configuration the parent should have refused, and the test names it.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise.errors import ConfigError

pytestmark = pytest.mark.dist

# Each strategy's options as users set them: valid values and the mistakes people make.
OPTIONS: dict[str, dict[str, list[Any]]] = {
    "single": {},
    "ddp": {
        "allreduce": ["native", "ring", "tree", "recursive-doubling", "rabenseifner", "master-worker", "all-to-all", "rings"],
        "compression": [None, "fp16", "bf16", "int8", "topk:0.1", "randomk:0.5", "sign", "powersgd:2", "topk:2", "gzip"],
        "bucket_cap_mb": [0.001, 25.0, -1.0],
        "find_unused_parameters": [False, True],
    },
    "zero1": {"offload": [False, True]},
    "zero2": {"wrap": ["auto", "root", "blocks"], "mixed_precision": [None, "bf16", "fp8"]},
    "zero3": {"wrap": ["auto", "root", "nothing.here"], "mixed_precision": [None, "bf16"]},
    "fsdp": {"wrap": ["auto", "root"], "offload": [False, True]},
    "hsdp": {"replicate": [None, 1, 2, 3], "shard": [None, 1, 2]},
    "tp": {"tp": [1, 2, 3, 4], "sequence_parallel": [False, True], "dp_strategy": ["ddp", "fsdp", "zero9"]},
    "pipeline": {
        "pp": [1, 2, 3, 4, 5],
        "microbatches": [None, 1, 2, 3, 4, 6],
        "schedule": ["gpipe", "1f1b", "interleaved", "zero-bubble"],
        "virtual_stages": [None, 1, 2],
        "tp": [1, 2],
    },
    "ps": {"servers": [0, 1, 2], "mode": ["sync", "async", "eventual"], "staleness": [0, 2]},
    "central": {"compression": [None, "fp16"]},
    "local-sgd": {"sync_every": [0, 1, 3]},
    "diloco": {"sync_every": [1, 4], "outer_lr": [0.7, -1.0], "outer_momentum": [0.0, 0.9, 1.5]},
    "gossip": {"sync_every": [1, 2]},
}
WORLDS = (2, 4, 1)  # hypothesis leans to the first choices: the multi-process ones first
SEEN: dict[int, list[dict[str, Any]]] = {n: [] for n in WORLDS}  # configurations the parent accepted, by world size
REFUSED: list[str] = []


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)  # names the automatic tensor-parallel plan finds
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.tanh(self.fc1(x)))


class Net(nn.Module):
    """Four blocks in a ModuleList (pipeline stages, FSDP units, tensor-parallel pairs) between an input and a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.layers = nn.ModuleList(Block(8) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def ce(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return nn.functional.cross_entropy(output.float(), batch[1])


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(96, 6, generator=g), torch.randint(0, 3, (96,), generator=g))


@st.composite
def configurations(draw: Any) -> dict[str, Any]:
    strategy = draw(st.sampled_from(sorted(OPTIONS)))
    chosen = {name: draw(st.sampled_from(values)) for name, values in OPTIONS[strategy].items() if draw(st.booleans())}
    return {
        "strategy": strategy,
        "strategy_options": chosen,
        "nproc": draw(st.sampled_from(WORLDS)),
        "global_batch_size": draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16])),
        "accumulate": draw(st.sampled_from([1, 1, 2, 3])),
        "precision": draw(st.sampled_from(["32", "32", "64", "bf16-mixed", "16-mixed", "8"])),
    }


def _trainer(cfg: dict[str, Any], **extra: Any) -> Trainer:
    return Trainer(**cfg, loss_fn=ce, max_steps=2, log_every=1, progress_bar=False, model_summary=False, timeout_s=30, **extra)


@settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(configurations())
def test_the_parent_accepts_or_refuses_with_a_config_error(cfg):
    try:
        trainer = _trainer(cfg)
        trainer._check(Net(), data())
    except ConfigError as exc:
        text = str(exc)
        assert text.strip() and len(text) < 2000, text  # a message, not a dump
        REFUSED.append(text)
        return
    except Exception:  # anything else is a traceback a user would see for a configuration mistake
        pytest.fail(f"{cfg} raised a non-ConfigError in the parent:\n{traceback.format_exc()}")
    SEEN[cfg["nproc"]].append(cfg)


def _run_all(configs: list[dict[str, Any]]) -> list[tuple[int, str]]:
    """Inside each launched process: train every configuration for 2 steps; the first failure ends the
    loop (a failed collective can leave the group unusable) and is returned with its index."""
    failures = []
    for i, cfg in enumerate(configs):
        try:
            _trainer(cfg).fit(Net(), data())  # nproc is the launch's world: the Trainer joins it
        except Exception:
            failures.append((i, traceback.format_exc(limit=6)))
            break
    return failures


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", WORLDS)
def test_every_accepted_configuration_trains(world):
    if not any(SEEN.values()):
        test_the_parent_accepts_or_refuses_with_a_config_error()  # this test alone: draw the configurations here
    configs = SEEN[world]
    assert len(configs) >= 5, f"only {len(configs)} accepted configurations at world size {world}; the fuzz space is too narrow"
    results = launch(_run_all, configs, nproc=world, timeout=800, collective_timeout_s=30)
    for rank, failures in enumerate(results):
        for i, text in failures:
            pytest.fail(f"rank {rank}: {configs[i]} passed the parent's checks but failed to train:\n{text}")


def _overflow_on_rank_1() -> tuple[bool, bool, float]:
    from shardwise import Engine

    engine = Engine(strategy="local-sgd", strategy_options={"sync_every": 100}, accelerator="cpu", precision="16-mixed")
    model, opt = engine.setup(nn.Linear(4, 1), lambda p: torch.optim.SGD(p, lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.ones(2, 4) * (1e30 if engine.rank == 1 else 1e-3)  # rank 1's gradients overflow; rank 0's are fine
    with engine.autocast():
        loss = model(x).float().pow(2).mean()
    engine.backward(loss)
    stepped = engine.step(opt)
    same = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    return stepped, same, float(engine.precision.scaler.get_scale())


def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    # The replicas step apart (local SGD), so only the agreed verdict keeps rank 0 from stepping
    # while rank 1 skips; both scales halve alike.
    (s0, same0, scale0), (s1, same1, scale1) = launch(_overflow_on_rank_1, nproc=2, timeout=120)
    assert (s0, s1) == (False, False) and same0 and same1 and scale0 == scale1 == 32768.0
