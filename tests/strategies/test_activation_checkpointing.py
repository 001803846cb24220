"""Activation checkpointing in one process: the setting, the patched blocks, the bytes saved, and the planner.

The gradients under every strategy are in tests/strategies/test_activation_checkpointing_models.py.
"""

from __future__ import annotations

import copy
import pickle
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies import checkpointing
from shardwise.strategies.cost.saved import SavedBytes
from tests.support import zoo


def test_values_parse_and_a_bad_one_lists_the_valid_ones() -> None:
    p = checkpointing.parse
    assert p("off") == p(None) == checkpointing.Checkpointing("off") and not p("off").enabled
    assert p("blocks") == checkpointing.Checkpointing("blocks", 1) and p("Blocks:3") == checkpointing.Checkpointing("blocks", 3)
    assert p("ops:2").chosen(5) == [0, 2, 4] and p("blocks").chosen(3) == [0, 1, 2]
    for bad in ("all", "blocks:0", "blocks:x", "off:2", "ops:-1"):
        with pytest.raises(ConfigError, match=r"off, blocks, blocks:K, ops, ops:K") as err:
            p(bad)
        assert repr(bad) in str(err.value)


def test_a_model_without_a_block_list_is_refused_before_launch_naming_it() -> None:
    from shardwise import Trainer

    mlp = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"Sequential has no list of repeated blocks.*nn\.ModuleList"):
        checkpointing.check(mlp, "blocks")
    checkpointing.check(mlp, "off")  # nothing to find when off
    data = [(torch.randn(4), torch.randn(2)) for _ in range(8)]
    trainer = Trainer(activation_checkpointing="blocks", max_steps=1, global_batch_size=4, loss_fn=nn.functional.mse_loss, progress_bar=False)
    with pytest.raises(ConfigError, match="activation_checkpointing: Sequential has no list"):
        trainer._check(mlp, data)
    with pytest.raises(ConfigError, match="'every'"):
        Trainer(activation_checkpointing="every", max_steps=1, global_batch_size=4, loss_fn=nn.functional.mse_loss)._check(zoo.NanoGPT(), data)


def test_patched_blocks_keep_every_name_and_survive_pickle_and_deepcopy() -> None:
    model = zoo.build("nanogpt")
    names = list(model.state_dict())
    modules = [n for n, _ in model.named_modules()]
    assert checkpointing.apply(model, "blocks:2") == ["transformer.h.0", "transformer.h.2"]
    assert list(model.state_dict()) == names and [n for n, _ in model.named_modules()] == modules
    assert checkpointing.checkpointed(model) == ["transformer.h.0", "transformer.h.2"]
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert checkpointing.checkpointed(other) == ["transformer.h.0", "transformer.h.2"]
        block = other.transformer.h[0]
        assert block.forward.module is block  # bound to the copy, not to the original
    assert checkpointing.apply(model, "blocks") == [f"transformer.h.{i}" for i in range(4)]  # again: one layer of checkpointing
    assert not isinstance(model.transformer.h[0].forward.module.__dict__["forward"].module, checkpointing.Recompute)


def _saved_and_grads(model: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> tuple[int, dict[str, torch.Tensor]]:
    probe = SavedBytes(model.parameters())
    with probe.hooks():
        loss = zoo.nanogpt_loss(model(b[0]), b)
    loss.backward()
    return probe.peak, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def test_saved_activations_drop_as_the_planner_predicts_and_gradients_do_not_change() -> None:
    """SavedBytes (what ``plan --validate`` measures) on one forward and loss of a nanoGPT: blocks keep only
    their inputs, ops their linears' outputs too, blocks:2 half the blocks; the planner's activations for
    the same model, from `measured_spec` without checkpointing, equal the measured peaks (blocks: plus the one
    block a backward recomputes at a time, which SavedBytes does not see)."""
    from shardwise.strategies.cost.cluster import Cluster, load_profile
    from shardwise.strategies.cost.estimate import Settings, Shape, estimate
    from shardwise.strategies.cost.model_spec import measured_spec

    b = zoo.batch("nanogpt", 4)
    peaks, grads = {}, {}
    for mode in ("off", "blocks", "blocks:2", "ops"):
        model = zoo.build("nanogpt")
        checkpointing.apply(model, mode)
        peaks[mode], grads[mode] = _saved_and_grads(model, b)
    for mode in ("blocks", "blocks:2", "ops"):
        assert grads[mode].keys() == grads["off"].keys()
        assert all(torch.equal(grads[mode][k], v) for k, v in grads["off"].items()), mode
    assert peaks["blocks"] < peaks["ops"] < peaks["off"] and peaks["blocks"] < peaks["blocks:2"] < peaks["off"]
    assert peaks["blocks"] < 0.2 * peaks["off"], peaks  # 4 blocks of 8-byte activations, each keeping one s x h input

    spec = measured_spec("nanogpt", zoo.build("nanogpt"), b[0], 4, act_bytes=8, loss=lambda out: zoo.nanogpt_loss(out, b))
    cluster = Cluster(load_profile("h100-80gb"), 1)
    settings = Settings(4, "64", "sgd")
    predicted = {k: estimate(spec, cluster, settings, Shape("single", recompute_every=k)).memory["activations"] for k in (0, 1, 2)}
    layer = spec.layer_activation_bytes(4)
    assert predicted[0] == pytest.approx(peaks["off"], rel=1e-9)
    assert predicted[1] - layer == pytest.approx(peaks["blocks"], rel=1e-9)
    assert predicted[2] - layer == pytest.approx(peaks["blocks:2"], rel=1e-9)


def _plan(params: float, seq: int, batch: int, memory_bytes: float, host: bool = True) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """`shardwise plan`'s records and recommendation for a GPT of ``params`` on 8 H100s with ``memory_bytes`` each."""
    from shardwise.strategies.cost.cluster import Cluster, load_profile
    from shardwise.strategies.cost.estimate import Settings
    from shardwise.strategies.cost.model_spec import from_param_count
    from shardwise.tools.advisor.candidates import plan_all
    from shardwise.tools.advisor.recommend import recommend

    spec, settings = from_param_count(params, seq=seq), Settings(batch, "bf16-mixed", "adam")
    device = load_profile("h100-80gb")
    cluster = Cluster(replace(device, memory_bytes=memory_bytes, host=device.host if host else None), 8)
    records = plan_all(spec, cluster, settings)
    return records, recommend(records, spec, cluster, settings)


def _plain(r: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, Any]:
    """The record of ``r``'s layout without activation checkpointing and offload."""
    options = {k: v for k, v in r["options"].items() if k != "offload"}
    return next(p for p in records if p["strategy"] == r["strategy"] and p["options"] == options and p["activation_checkpointing"] == "off")


def _saver(r: dict[str, Any]) -> bool:
    return r["activation_checkpointing"] != "off" or bool(r["options"].get("offload"))


def test_plan_proposes_activation_checkpointing_where_a_layout_fits_only_with_it_and_says_its_cost() -> None:
    from shardwise.tools.advisor.commands import saver_note

    roomy, _ = _plan(7e9, 4096, 16, 1e15, host=False)
    assert not any(_saver(r) for r in roomy if r["world_size"] > 1 and r["strategy"] not in ("local-sgd", "diloco", "ps"))
    assert all(not _plain(r, roomy)["fits"] for r in roomy if _saver(r))  # proposed only where the plain layout does not fit
    least = min(r["memory_per_rank_bytes"] for r in roomy if r["fits"] and r["world_size"] > 1)
    records, advice = _plan(7e9, 4096, 16, 0.95 * least, host=False)  # no plain layout fits now
    assert not any(r["fits"] for r in records if not _saver(r) and r["world_size"] > 1)
    chosen = advice["choice_record"]
    assert chosen is not None and chosen["activation_checkpointing"] == "blocks" and advice["choice"].endswith(" +ac=blocks"), advice["choice"]
    plain = _plain(chosen, records)
    assert chosen["step_time_s"] > plain["step_time_s"] and chosen["time_breakdown"]["recompute_s"] > 0
    assert chosen["memory_breakdown"]["activations"] < 0.5 * plain["memory_breakdown"]["activations"]
    note = saver_note(chosen, records)
    assert "fits only with --activation-checkpointing blocks" in note and "longer than" in note and "recompute" in note, note


def test_plan_proposes_cpu_offload_where_only_it_fits_and_says_its_cost() -> None:
    from shardwise.tools.advisor.commands import saver_note

    roomy, _ = _plan(30e9, 512, 8, 1e15)
    zero3 = next(r for r in roomy if r["label"] == "zero3")["memory_breakdown"]
    records, advice = _plan(30e9, 512, 8, 1.5 * (zero3["buffers"] + zero3["activations"]))  # below any model state
    assert not any(r["fits"] for r in records if not r["options"].get("offload"))
    offloaded = [r for r in records if r["fits"]]
    assert offloaded and {r["strategy"] for r in offloaded} <= {"zero2", "zero3", "fsdp", "hsdp"}
    best = advice["choice_record"]
    assert best["options"]["offload"] is True and best["time_breakdown"]["offload_s"] > 0
    plain = _plain(best, records)
    assert best["step_time_s"] > plain["step_time_s"] and best["memory_breakdown"]["host"] == plain["memory_breakdown"]["model_state"]
    assert "fits only with --offload" in saver_note(best, records)
