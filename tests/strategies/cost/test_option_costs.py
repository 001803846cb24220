"""The planner prices context parallelism (``cp``) and expert parallelism (``ep``): the candidates it proposes, their
activations, expert memory and bytes against each family's own formulas (`context_parallel.cost`,
`expert_parallel.cost`), and ``plan --validate`` on one cp and one ep candidate (measured bytes beside predicted).

Models: `option_models.llama_long` (2 layers, hidden 16, 256-token samples) and `option_models.mixtral` (2 layers,
hidden 16, 4 experts top-2), float32 as the planner measures them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli import main
from shardwise.strategies.context_parallel.cost import activation_bytes, attention_bytes, output_bytes
from shardwise.strategies.cost.cluster import Cluster, load_profile
from shardwise.strategies.cost.estimate import Settings
from shardwise.strategies.expert_parallel.cost import expected_all_to_all_sent, expert_bytes_per_rank
from shardwise.tools.advisor.candidates import plan_all
from shardwise.tools.advisor.models import PlannedModel, load_model

LLAMA = "tests.strategies.cost.option_models:llama_long"
MIXTRAL = "tests.strategies.cost.option_models:mixtral"
BATCH = 4
FP32_ADAM = 16  # bytes a parameter: its value, gradient and Adam's two slots, fp32


@functools.cache
def _model(factory: str) -> PlannedModel:
    return load_model(factory)


def _records(factory: str, nproc: int) -> dict[str, dict[str, Any]]:
    planned = _model(factory)
    cluster = Cluster(load_profile("cpu"), nproc, 1, load=0.0)
    return {r["label"]: r for r in plan_all(planned.spec, cluster, Settings(global_batch=BATCH), planned.module)}


def _sent(record: dict[str, Any], group: str) -> float:
    return sum(c["sent_bytes"] for c in record["comm_breakdown"] if c["group"] == group)


def test_cp_candidates_hold_half_the_activations_and_send_the_ring_s_bytes() -> None:
    spec = _model(LLAMA).spec
    assert (spec.seq, spec.heads, spec.kv_heads) == (256, 4, 2)  # from the sample and the config
    two = _records(LLAMA, 2)
    assert {"ddp(cp=2)", "zero3(cp=2)", "ddp(cp=2,cp_style=ulysses)"} <= set(two)
    single = two["single"]["memory_breakdown"]["activations"]
    for label, style in (("ddp(cp=2)", "ring"), ("zero3(cp=2)", "ring"), ("ddp(cp=2,cp_style=ulysses)", "ulysses")):
        rec = two[label]
        assert rec["fits"], rec["reason"]
        # dp 1 x cp 2: both ranks share the global batch, each runs half of every sequence
        acts = rec["memory_breakdown"]["activations"]
        assert acts == pytest.approx(activation_bytes(spec, BATCH, 2)["total"])
        assert 0.4 < acts / single < 0.6, (label, acts, single)
        # the ring's (or the all-to-all's) bytes, and half the logits each rank gathers whole
        assert _sent(rec, "cp") == attention_bytes(spec, BATCH, 2, style, kv_heads=2) + output_bytes(spec, BATCH) / 2 > output_bytes(spec, BATCH) / 2
    # the same layout without cp holds every token's activations; with cp 2 x tp 2 on four, tp's allreduces join the ring
    four = _records(LLAMA, 4)
    tp = four["tp(tp=2,cp=2)"]
    assert tp["mesh"] == {"dp": 1, "pp": 1, "cp": 2, "tp": 2}
    assert _sent(tp, "cp") == attention_bytes(spec, BATCH, 2, "ring", kv_heads=2, tp=2) + output_bytes(spec, BATCH) / 2 and _sent(tp, "tp") > 0
    # a short-sequence model gets none
    assert not [k for k in _records(MIXTRAL, 2) if "cp=" in k]


def test_ep_candidates_divide_the_experts_and_send_the_all_to_all_s_bytes() -> None:
    spec = _model(MIXTRAL).spec
    assert (spec.moe_layers, spec.experts, spec.top_k, spec.expert_params) == (2, 4, 2, 2 * 4 * (2 * 24 * 16 + 16 * 24))
    for nproc, ep in ((2, 2), (4, 4), (4, 2)):
        recs = _records(MIXTRAL, nproc)
        for strategy in ("ddp", "zero3"):
            rec = recs[f"{strategy}(ep={ep})"]
            assert rec["fits"], rec["reason"]
            mem = rec["memory_breakdown"]
            assert mem["experts"] == expert_bytes_per_rank(spec.expert_params, FP32_ADAM, ep)
            dense = (spec.params - spec.expert_params) * FP32_ADAM / (nproc if strategy == "zero3" else 1)
            assert mem["model_state"] == pytest.approx(dense + mem["experts"])
            tokens = BATCH // nproc * spec.seq
            assert _sent(rec, "ep") == expected_all_to_all_sent(tokens, 2, spec.hidden, 4, 4, ep, layers=2) > 0
            # the expert gradients are summed over the ranks that hold the same experts (none when ep is every rank)
            assert (_sent(rec, "ep_outer") > 0) == (ep < nproc)
    assert not [k for k in _records(LLAMA, 2) if "ep=" in k]  # no experts, no ep candidate


@pytest.fixture
def _short_step_timing(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.tools.advisor import models

    monkeypatch.setattr(models, "TIMED_RUNS", 1)
    monkeypatch.setattr(models, "TIMED_TARGET_S", 0.3)


def _validate(tmp_path: Path, factory: str, label: str) -> dict[str, Any]:
    out = tmp_path / "validate.json"
    flags = ["plan", "--validate", "--model", factory, "--nproc", "2", "--device", "cpu", "--steps", "10", "--global-batch", str(BATCH)]
    assert main([*flags, "--only", label, "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())
    assert row["label"] == label and row["measured_step_s"] > 0, row
    return row


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("_short_step_timing")
def test_validate_measures_a_cp_and_an_ep_candidate_s_bytes(tmp_path: Path) -> None:
    cp = _validate(tmp_path, LLAMA, "ddp(cp=2)")
    # the ring's bytes and the logits' gather are exact: measured per step equal predicted
    assert cp["measured_comm_bytes_by_group"]["cp"] == cp["predicted_comm_bytes_by_group"]["cp"] > 0
    # ddp's allreduce is over dp x cp (both ranks here): the gradients' bytes as planned
    assert cp["measured_comm_bytes_by_group"]["dp"] == pytest.approx(cp["predicted_comm_bytes_by_group"]["dp"])
    assert cp["measured_activation_bytes"] == pytest.approx(cp["predicted_activation_bytes"], rel=0.35)
    ep = _validate(tmp_path, MIXTRAL, "ddp(ep=2)")
    # the all-to-all's: expected under balanced routing; a random router's tokens go to the other rank about half the time
    measured, predicted = ep["measured_comm_bytes_by_group"]["ep"], ep["predicted_comm_bytes_by_group"]["ep"]
    assert 0.5 < measured / predicted < 1.5, (measured, predicted)
    assert ep["measured_model_state_bytes"] == pytest.approx(ep["predicted_model_state_bytes"])
