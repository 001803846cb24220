"""The peak-memory reader (`shardwise.launcher.memory`) and the per-rank prediction (`shardwise.strategies.cost.peak`) on a known layout."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from shardwise.launcher.memory import as_row, from_row, host_memory, parse_status, snapshot
from shardwise.strategies.cost.cluster import load_profile, profile_from_mapping
from shardwise.strategies.cost.peak import Tensors, coordinates, predict_rank, role, share, stage_of, tensors_of
from shardwise.trainer.logging import batch_seq, format_memory, optimizer_slots

STATUS = "Name:\tpython\nVmPeak:\t 900000 kB\nVmHWM:\t  524288 kB\nVmRSS:\t  262144 kB\nThreads:\t4\nVmSwap:\t0 kB\n"


def test_vmhwm_and_vmrss_are_read_in_bytes(tmp_path: Path) -> None:
    fields = parse_status(STATUS)
    assert fields["VmHWM"] == 512 * 2**20 and fields["VmRSS"] == 256 * 2**20 and "Threads" not in fields
    path = tmp_path / "status"
    path.write_text(STATUS)
    assert host_memory(path) == {"peak_bytes": 512 * 2**20, "rss_bytes": 256 * 2**20, "source": "VmHWM"}


def test_without_proc_the_peak_is_ru_maxrss(tmp_path: Path) -> None:
    got = host_memory(tmp_path / "no-such-status")
    assert got["source"] == "ru_maxrss" and got["rss_bytes"] is None and got["peak_bytes"] > 2**20  # an interpreter with torch: MBs
    here = snapshot(torch.device("cpu"))
    assert here["source"] == "VmHWM" and here["peak_bytes"] >= here["rss_bytes"] > 0  # this machine is Linux
    assert "cuda_max_allocated_bytes" not in here
    none = {"cuda_max_allocated_bytes": None, "cuda_max_reserved_bytes": None}
    assert from_row(as_row(here)) == {"peak_bytes": here["peak_bytes"], "rss_bytes": here["rss_bytes"], **none}


# A model with a known layout: embedding 100 elements, blocks of 50, head 100 (4 bytes each).
T = Tensors(
    params={"embed.weight": (100, 4), "blocks.0.w": (40, 4), "blocks.0.b": (10, 4), "blocks.1.w": (40, 4), "blocks.1.b": (10, 4), "head.weight": (100, 4)},
    blocks="blocks",
)


def test_ranks_are_laid_out_dp_major_tp_fastest_and_stages_split_the_blocks() -> None:
    assert coordinates(3, {"dp": 1, "pp": 2, "tp": 2}) == {"dp": 0, "pp": 1, "tp": 1}
    assert coordinates(2, {"dp": 2, "tp": 2}) == {"dp": 1, "pp": 0, "tp": 0}
    assert role(2, {"pp": 2, "tp": 2}) == "pp1 tp0" and role(1, {"dp": 2}) == "dp1"
    assert [stage_of(T, n, 2) for n in T.params] == [0, 0, 0, 1, 1, 1]
    assert share(T, {"pp": 1}, {"pp": 2})["bytes"] == 4 * 150
    assert share(T, {"tp": 0}, {"tp": 2}, ["blocks.0", "blocks.1"])["elements"] == 200 + 50  # the split linears halve, the rest whole


def test_zero3_meta_built_is_a_shard_of_state_plus_the_root_and_the_largest_unit_gathered() -> None:
    p = predict_rank(T, "zero3", 1, {"dp": 2}, units=["blocks.0", "blocks.1"], built_whole=False, baseline=1000.0)
    root, unit = 4 * 200, 4 * 50
    assert p["params"] == p["grads"] == 4 * 300 / 2 and p["optimizer"] == 0
    assert p["transient"] == 2 * root + 4 * unit and p["build"] == 0 and p["activations"] == 0
    assert p["peak"] == 1000 + 4 * 300 + 2 * root + 4 * unit == 1000 + p["above_baseline"]
    eager = predict_rank(T, "zero3", 1, {"dp": 2}, units=["blocks.0", "blocks.1"], built_whole=True, baseline=1000.0)
    assert eager["build"] == 4 * 300 + 4 * 150 and eager["peak"] == 1000 + max(eager["build"], eager["train"])


def test_ddp_pipeline_and_tp_shares() -> None:
    ddp = predict_rank(T, "ddp", 0, {"dp": 2}, optimizer_slots=1, built_whole=True)
    # params, gradients (DDP's buckets), momentum; three of the largest tensor (the 400-byte embedding) forming gradients
    assert ddp["transient"] == 3 * 400 and ddp["train"] == 3 * 4 * 300 + 3 * 400 and ddp["peak"] == ddp["train"]
    first, last = (predict_rank(T, "pipeline", r, {"pp": 2}, built_whole=False) for r in (0, 1))
    assert first["params"] == last["params"] == 4 * 150 and first["peak"] == 2 * 4 * 150 + 3 * 400
    tp = predict_rank(T, "tp", 1, {"tp": 2}, units=["blocks.0", "blocks.1"], built_whole=False)
    assert tp["params"] == 4 * (200 + 50)


def test_activations_follow_korthikanti_and_the_logits_stay_on_the_last_stage() -> None:
    t = Tensors(params=T.params, blocks="blocks", config={"hidden": 8, "heads": 2, "vocab": 10})
    one = predict_rank(t, "single", 0, {}, micro_batch=3, seq=4, built_whole=False)
    per_token = 8 * (34 + 5 * 2 * 4 / 8)
    assert one["activations"] == 2 * per_token * 12 * 2 + 3 * 4 * 12 * 10
    first = predict_rank(t, "pipeline", 0, {"pp": 2}, micro_batch=3, seq=4, built_whole=False)
    assert first["activations"] == 2 * per_token * 12 * 1


def test_tensors_of_a_module_counts_meta_parameters_and_finds_the_block_list() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(10, 4), nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)))
    t = tensors_of(model)
    assert t.blocks == "1" and t.bytes == 4 * (40 + 3 * 20) and t.block_of("1.2.weight") == 2 and t.block_of("0.weight") is None


def test_optimizer_slots_sample_length_and_the_table() -> None:
    w = [nn.Parameter(torch.zeros(2))]
    assert [optimizer_slots(o) for o in (torch.optim.SGD(w, lr=1), torch.optim.SGD(w, lr=1, momentum=0.9), torch.optim.Adam(w))] == [0, 1, 2]
    # a collated batch: (batch, tokens) ids; class labels (batch,) are not a sequence
    assert batch_seq({"input_ids": torch.zeros(4, 7, dtype=torch.long)}) == 7 and batch_seq((torch.zeros(4, 3), torch.zeros(4, dtype=torch.long))) == 0
    pred = predict_rank(T, "ddp", 0, {"dp": 2}, baseline=100.0)
    row = {"rank": 0, "role": "dp0", "start": {"peak_bytes": 2e8}, "end": {"peak_bytes": 3e8}, "predicted": pred}
    launcher = {"peak_bytes": 4e8, "predicted": {"peak": 5e8}}
    text = format_memory({"source": "VmHWM", "runtime_baseline_bytes": 100.0, "ranks": [row, None], "launcher": launcher})
    assert "rank 0" in text and "dp0" in text and "launcher" in text and "300" in text


def test_the_runtime_baseline_is_a_profile_field() -> None:
    assert load_profile("cpu").runtime_baseline_bytes > 100e6  # measured by --calibrate: torch alone is more
    raw = load_profile("cpu").to_json()
    raw["runtime_baseline_bytes"] = 123.0
    assert profile_from_mapping(raw).runtime_baseline_bytes == 123.0
    with pytest.raises(Exception, match="--calibrate --only"):
        from shardwise.tools.advisor.calibrate import recalibrate

        recalibrate(raw, ["no-such-key"])
