"""``shardwise plan``'s numbers against the papers they come from, read from the planner's own output.

Each check runs the command in-process (`shardwise.cli.main` with ``--json``) and compares a
candidate's record with a figure computed here from the paper's formula: ZeRO's table 1
(Rajbhandari et al. 2020), the PTD-P bubble (Narayanan et al. 2021, section 2.2), Megatron's four
allreduces per layer (Shoeybi et al. 2019, section 3), the ring allreduce's ``2(p-1)/p n`` bytes
(Thakur et al. 2005) and Korthikanti et al.'s activation bytes per layer (2023, eq. 1).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardwise.cli import main
from shardwise.errors import ConfigError
from shardwise.strategies import Batch, get_strategy


def plan(tmp_path: Path, *flags: str) -> dict[str, Any]:
    out = tmp_path / "plan.json"
    assert main(["plan", *flags, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def find(doc: dict[str, Any], label: str) -> dict[str, Any]:
    (rec,) = [r for r in doc["candidates"] if r["label"] == label]
    return rec


ZERO_TABLE_1 = ["--params", "7.5e9", "--nproc", "64", "--device", "h100-80gb", "--precision", "bf16-mixed", "--optimizer", "adam"]


def test_zero_paper_table_1_model_state_per_device(tmp_path: Path) -> None:
    """Rajbhandari et al. 2020, table 1: 7.5B parameters, N_d = 64, K = 12: 120 / 31.4 / 16.6 / 1.88 GB."""
    doc = plan(tmp_path, *ZERO_TABLE_1)
    psi, n, k = 7.5e9, 64, 12
    paper = {"ddp(allreduce=native)": "120", "zero1": "31.4", "zero2": "16.6", "zero3": "1.88"}
    formula = {"ddp(allreduce=native)": (2 + 2 + k) * psi, "zero1": 4 * psi + k * psi / n, "zero2": 2 * psi + (2 + k) * psi / n, "zero3": (2 + 2 + k) * psi / n}
    for label, digits in paper.items():
        got = find(doc, label)["memory_breakdown"]["model_state"]
        assert got == pytest.approx(formula[label], rel=1e-12)
        assert f"{got / 1e9:.3g}" == digits, (label, got)


def test_pipeline_bubble_in_the_plan_is_ptd_p(tmp_path: Path) -> None:
    """Narayanan et al. 2021, section 2.2: (p-1)/(m+p-1), and (p-1)/(v m + p - 1) interleaved."""
    doc = plan(tmp_path, "--params", "1e9", "--nproc", "8", "--device", "h100-80gb", "--global-batch", "64")
    checked = 0
    for rec in doc["candidates"]:
        if rec["strategy"] != "pipeline" or rec["mesh"]["pp"] < 2:
            continue
        p, m = rec["mesh"]["pp"], rec["options"]["microbatches"]
        v = rec["options"].get("virtual_stages") or 1
        want = (p - 1) / (v * m + p - 1)
        t = rec["time_breakdown"]
        assert t["bubble_fraction"] == pytest.approx(want)
        assert t["bubble_s"] / (t["compute_s"] + t["bubble_s"]) == pytest.approx(want)
        checked += 1
    assert checked >= 6


def test_megatron_tensor_parallel_allreduces_per_layer(tmp_path: Path) -> None:
    """Shoeybi et al. 2019, section 3: two allreduces of the b s h activations in forward and two in backward per layer."""
    layers, hidden, seq, batch = 12, 1024, 512, 16
    doc = plan(
        tmp_path,
        "--params",
        "2e8",
        "--layers",
        str(layers),
        "--hidden",
        str(hidden),
        "--seq",
        str(seq),
        "--nproc",
        "8",
        "--device",
        "h100-80gb",
        "--global-batch",
        str(batch),
    )
    for tp in (2, 4, 8):
        rec = find(doc, f"tp(tp={tp})")
        dp = 8 // tp
        (tp_ar,) = [c for c in rec["comm_breakdown"] if c["group"] == "tp"]
        assert tp_ar["op"] == "all_reduce" and tp_ar["count"] == 4 * layers
        act = batch // dp * seq * hidden * 2  # bf16 activations
        assert tp_ar["payload_bytes"] == act
        assert tp_ar["sent_bytes"] == pytest.approx(4 * layers * 2 * (tp - 1) / tp * act)


def test_ring_allreduce_bytes_in_the_plan(tmp_path: Path) -> None:
    """Ring allreduce sends 2(p-1)/p n bytes per rank (Thakur et al. 2005), read from ddp's record."""
    doc = plan(tmp_path, "--params", "6.4e7", "--nproc", "16", "--device", "h100-80gb", "--global-batch", "64")
    n_bytes = 2 * 6.4e7  # bf16 gradients
    for label in ("ddp(allreduce=ring)", "ddp(allreduce=native)", "ddp(allreduce=rabenseifner)"):
        (ar,) = find(doc, label)["comm_breakdown"]
        assert ar["sent_bytes"] == pytest.approx(2 * 15 / 16 * n_bytes), label
    # and the rounds: tree sends the whole vector once per child and once to its parent (root: lg p children)
    (tree,) = find(doc, "ddp(allreduce=tree)")["comm_breakdown"]
    assert tree["sent_bytes"] == pytest.approx(4 * n_bytes)


def test_activation_bytes_per_layer_are_korthikanti(tmp_path: Path) -> None:
    """Korthikanti et al. 2023, eq. 1: s b h (34 + 5 a s / h) bytes per layer (16-bit), times the layers."""
    cfg = {"hidden_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8, "intermediate_size": 2048, "vocab_size": 1000, "max_position_embeddings": 256}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    doc = plan(tmp_path, "--model", str(path), "--nproc", "2", "--device", "h100-80gb", "--global-batch", "8")
    s, h, a, layers, b = 256, 512, 8, 6, 4
    per_layer = s * b * h * (34 + 5 * a * s / h)
    other = s * b * h * 2 + s * b * 1000 * 4  # embedding output (bf16) and fp32 logits
    assert find(doc, "zero1")["memory_breakdown"]["activations"] == pytest.approx(layers * per_layer + other)
    # parameters: 6 layers of 4 h^2 + 2 h f + 2 h, embeddings V h (tied) and the final norm
    assert doc["model"]["params"] == 6 * (4 * h * h + 2 * h * 2048 + 2 * h) + 1000 * h + h


def test_a_refused_candidate_carries_its_strategys_own_message(tmp_path: Path) -> None:
    doc = plan(tmp_path, *ZERO_TABLE_1)
    rec = find(doc, "ps(servers=1,mode=sync)")
    with pytest.raises(ConfigError) as exc:
        get_strategy("ps", servers=1, mode="sync").plan(64, batch=Batch(512))
    assert rec["fits"] is False and rec["refused_by_plan"] and rec["reason"] == str(exc.value)
    for key in ("strategy", "fits", "memory_per_rank_bytes", "comm_bytes_per_step", "step_time_s", "memory_breakdown", "comm_breakdown", "time_breakdown"):
        assert all(key in r for r in doc["candidates"]), key


def test_recommendation_follows_the_guide(tmp_path: Path) -> None:
    small = plan(tmp_path, "--params", "1e8", "--nproc", "8", "--device", "h100-80gb", "--global-batch", "64", "--seq", "512")
    assert small["recommendation"]["rule"] == "ddp" and small["recommendation"]["choice"].startswith("ddp")
    big = plan(tmp_path, *ZERO_TABLE_1, "--accumulate", "8")
    assert big["recommendation"]["rule"] == "zero12" and big["recommendation"]["choice"] in ("zero1", "zero2")
    huge = plan(tmp_path, "--params", "1e11", "--nproc", "64", "--nodes", "8", "--device", "h100-80gb", "--accumulate", "8")
    assert huge["recommendation"]["rule"] in ("zero3", "tp")
    flaky = plan(tmp_path, "--params", "1e8", "--nproc", "8", "--device", "h100-80gb", "--global-batch", "64", "--seq", "512", "--unreliable")
    assert flaky["recommendation"]["rule"] == "unreliable"


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--model", "nosuchmodel", "--nproc", "2"], "unknown --model 'nosuchmodel'"),
        (["--params", "1e9", "--nproc", "0"], "--nproc must be >= 1"),
        (["--params", "1e9", "--nproc", "8", "--nodes", "3"], "--nodes 3"),
        (["--params", "1e9", "--nproc", "8", "--device", "nosuch-gpu"], "unknown device 'nosuch-gpu'"),
        (["--params", "1e6", "--nproc", "2", "--validate"], "--validate trains the model: give a built-in recipe"),
    ],
)
def test_bad_flags_are_one_line_errors(flags: list[str], needle: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err, err


def test_a_device_file_missing_a_field_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gpu.toml"
    path.write_text('name = "x"\nmemory_bytes = 1e10\nflops = {"32" = 1e12}\nefficiency = 0.5\nmemory_bandwidth = 1e12\n[intra]\nalpha = 1e-6\nbeta = 1e-10\n')
    assert main(["plan", "--params", "1e9", "--nproc", "8", "--device", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing inter" in err and "\n" not in err, err


def test_activations_per_rank_keep_what_tp_does_not_split_and_gpipe_keeps_every_head() -> None:
    """A measured model's block bytes under tp: the whole part plus the split part / tp; outside the
    blocks (the head and the loss), GPipe's last stage holds every micro-batch's at once, 1F1B one."""
    from shardwise.strategies.cost.cluster import A100_40GB, Cluster
    from shardwise.strategies.cost.estimate import Settings, Shape, estimate
    from shardwise.strategies.cost.model_spec import ModelSpec

    layer, split, other = 1000.0, 600.0, 300.0
    spec = ModelSpec("m", params=8000, layers=4, layer_params=1000, hidden=8, act_bytes_per_layer_sample=layer, act_bytes_other_sample=other)
    spec = replace(spec, act_bytes_tp_split_per_layer_sample=split)
    cluster, settings = Cluster(A100_40GB, 4), Settings(32)

    def acts(shape: Shape) -> float:
        return estimate(spec, cluster, settings, shape).memory["activations"]

    assert acts(Shape("tp", tp=2)) == pytest.approx(4 * (layer - split + split / 2) * 32 + other * 32)
    micro = 32 / 8  # pp 2, 8 micro-batches, 2 layers a stage
    assert acts(Shape("pipeline", pp=2, microbatches=8, schedule="gpipe")) == pytest.approx(2 * layer * micro * 8 + other * micro * 8)
    assert acts(Shape("pipeline", pp=2, microbatches=8, schedule="1f1b")) == pytest.approx(2 * layer * micro * 2 + other * micro)
    assert acts(Shape("pipeline", pp=2, tp=2, microbatches=8, schedule="1f1b")) == pytest.approx(2 * (layer - split / 2) * micro * 2 + other * micro)


def _peak_chunks(actions: list[tuple[str, int]]) -> int:
    """Most chunk activations held at once by a rank running ``actions`` in order: a forward keeps
    its chunk's activations until that chunk's backward of the same micro-batch frees them."""
    held = peak = 0
    for kind, _ in actions:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _torch_interleaved_order(p: int, v: int, m: int, rank: int) -> list[tuple[str, int]]:
    """Rank ``rank``'s forwards and backwards in torch's own ``ScheduleInterleaved1F1B`` (its
    ``pipeline_order``, computed without stages or a process group)."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    sched = ScheduleInterleaved1F1B.__new__(ScheduleInterleaved1F1B)
    sched.pp_group_size, sched.n_local_stages, sched._n_microbatches = p, v, m
    sched.number_of_rounds = max(1, m // p)
    sched.microbatches_per_round = m // sched.number_of_rounds
    ops = [a for a in sched._calculate_single_rank_operations(rank) if a is not None]
    return [(a.computation_type.value, a.microbatch_index) for a in ops]


@pytest.mark.parametrize(("p", "v", "m"), [(2, 2, 4), (2, 3, 6), (4, 2, 8), (4, 3, 8), (3, 2, 9)])
def test_interleaved_activations_are_the_peak_counted_from_the_schedule(p: int, v: int, m: int) -> None:
    """Interleaved 1F1B: the first rank holds ``v p + p - 1`` chunk activations at its peak (its
    warm-up of ``(v - 1) p + 2 (p - 1)`` forwards and one more before the first backward; Narayanan
    et al. 2021, section 2.2.2), each chunk ``L / (p v)`` layers: ``L (1 + (p - 1)/(p v))`` layers'
    worth (Korthikanti et al. 2023, section 4.2.3). Counted here from torch's action order and from
    the simulator's; the planner's activation bytes must be that count times a layer's bytes."""
    from shardwise.strategies.cost.cluster import A100_40GB, Cluster
    from shardwise.strategies.cost.estimate import Settings, Shape, estimate
    from shardwise.strategies.cost.model_spec import ModelSpec
    from shardwise.tools.simulate.pipeline import schedule_order

    ours = [("FB"[d], j) for d, _, j in schedule_order("interleaved", p, m, v, 0)]
    peaks = [_peak_chunks(_torch_interleaved_order(p, v, m, r)) for r in range(p)]
    assert peaks[0] == _peak_chunks(ours) == v * p + p - 1  # the hand count, in torch's and our order
    assert max(peaks) == peaks[0]  # the first rank holds the most: it is the one the planner sizes

    layers, layer, other = p * v * 2, 1000.0, 300.0  # two layers a chunk
    spec = ModelSpec("m", params=8000, layers=layers, layer_params=1000, hidden=8, act_bytes_per_layer_sample=layer, act_bytes_other_sample=other)
    micro = 32 / m
    got = estimate(spec, Cluster(A100_40GB, p), Settings(32), Shape("pipeline", pp=p, microbatches=m, schedule="interleaved", virtual=v)).memory["activations"]
    chunk_layers = layers / (p * v)
    assert got == pytest.approx(peaks[0] * chunk_layers * layer * micro + other * micro, rel=1e-12)


def test_hsdp_shards_the_model_state_over_its_shard_group_only(tmp_path: Path) -> None:
    """HSDP (replicate x shard): ZeRO-3's (2 + 2 + K) psi / N with N the shard group, not the world."""
    doc = plan(tmp_path, "--params", "7.5e9", "--nproc", "16", "--nodes", "2", "--device", "h100-80gb", "--precision", "bf16-mixed", "--optimizer", "adam")
    hsdp = find(doc, "hsdp(replicate=2,shard=8)")
    assert hsdp["memory_breakdown"]["model_state"] == pytest.approx(16 * 7.5e9 / 8, rel=1e-12)
    assert find(doc, "zero3")["memory_breakdown"]["model_state"] == pytest.approx(16 * 7.5e9 / 16, rel=1e-12)
