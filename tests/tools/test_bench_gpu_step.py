"""benchmarks/gpu_step.py at its small size on the CPU, so that it cannot rot before a GPU runs it at full size.

The README's block (``--size small``, ``aot_eager``: Dynamo and AOTAutograd without code generation, a
few seconds of compile where Inductor takes ~10-30 s here) runs as written only here (test_readme_shell
leaves it to this file: RUN_ELSEWHERE); its ``--json`` rows and printed table are checked. The FLOPs per
token are checked against torch's FlopCounterMode and GPT-2's known shapes, the clock and the peak table
on made-up inputs, and the hand loop's batch order against the Trainer's.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from shardwise.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
README_COMMAND = "python benchmarks/gpu_step.py --size small "
README_BLOCK = "python benchmarks/gpu_step.py --size small --device cpu --compile-backend aot_eager --threads 1 --pairs 2 --json gpu_step.json\n"
COLUMNS = {
    "side",
    "device",
    "params",
    "tokens_per_s",
    "mfu",
    "summary_mfu",
    "ratio",
    "ratio_min",
    "ratio_max",
    "compile_s",
    "peak_memory_bytes",
    "final_loss",
    "step_s",
}


@pytest.fixture(scope="module")
def bench() -> Iterator[ModuleType]:
    spec = importlib.util.spec_from_file_location("gpu_step", ROOT / "benchmarks" / "gpu_step.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_step"] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("gpu_step", None)


def _readme_block() -> str:
    """The README's block once the section is in (the lead inserts it), else the text it is to have."""
    from tests.readme.test_readme import blocks

    found = [code for _, code in blocks("bash") if README_COMMAND in code]
    assert len(found) <= 1, found
    return found[0] if found else README_BLOCK


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_the_readme_block_runs_the_benchmark_at_the_small_size(tmp_path: Path) -> None:
    from tests.readme.test_readme import RUN_ELSEWHERE, env

    code = _readme_block()
    assert code.split() == README_BLOCK.split()
    if code is not README_BLOCK:
        assert RUN_ELSEWHERE.get(README_COMMAND, "").endswith(os.path.basename(__file__))
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")  # commands run from the clone's root
    proc = subprocess.run(["bash", "-e", "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_step.json").read_text())
    rows = report["rows"]
    assert [r["side"] for r in rows] == ["shardwise", "hand"]
    ours, hand = rows
    for r in rows:
        assert COLUMNS <= set(r), COLUMNS - set(r)
        for key in (
            "tokens_per_s",
            "step_s",
            "mfu",
            "ratio",
            "ratio_min",
            "ratio_max",
            "compile_s",
            "peak_memory_bytes",
            "final_loss",
            "flops_per_token",
            "peak_flops_per_s",
        ):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert 0 < r["mfu"] < 1, r
        # shardwise's own figure (its FLOP count, its step time, its cached peak of this CPU): present and positive
        assert r["summary_mfu"] is None or (r["side"] == "shardwise" and 0 < r["summary_mfu"] < math.inf), r
        assert r["tokens_per_s"] == pytest.approx(r["tokens_per_step"] / r["step_s"])
        assert r["mfu"] == pytest.approx(r["flops_per_token"] * r["tokens_per_s"] / r["peak_flops_per_s"])
        assert r["peak_memory_bytes"] > 100 * 2**20  # VmHWM of an interpreter with torch: hundreds of MB
        assert r["device"].startswith("cpu") and r["precision"] == "32" and r["compile"] == "on:aot_eager"
    assert ours["params"] == hand["params"] == 470_528  # 2 blocks of 12 d^2 + 13 d, d 128; 512 x 128 tied; 64 x 128 positions; final norm
    assert ours["compile_s"] > 0 and hand["compile_s"] > 0  # each side's first run compiled from a reset cache
    ratios = [a / b for a, b in zip(ours["runs_step_s"], hand["runs_step_s"], strict=True)]
    assert len(ratios) == report["pairs"] == 2 and all(r["step_s"] == statistics.median(r["runs_step_s"]) for r in rows)
    assert (ours["ratio"], ours["ratio_min"], ours["ratio_max"]) == pytest.approx((statistics.median(ratios), min(ratios), max(ratios)))
    assert hand["ratio"] == 1.0
    assert report["losses_agree"] and report["loss_gap"] <= report["loss_rtol"] == 1e-4
    assert ours["final_loss"] == pytest.approx(hand["final_loss"], rel=1e-4)
    printed = proc.stdout
    for word in (
        "side",
        "params",
        "tokens/s",
        "MFU",
        "MFU(summary)",
        "step ms",
        "ratio (range)",
        "compile s",
        "peak MB",
        "peak MB: VmHWM",
        "final loss",
        "losses agree: yes",
    ):
        assert word in printed, (word, printed)
    assert f"{hand['tokens_per_s']:,.0f}" in printed and f"{ours['ratio']:.3f}x" in printed


def test_the_flops_per_token_are_palms_count_of_the_model(bench: ModuleType) -> None:
    """6N (N: every weight that multiplies, the tied table once) is FlopCounterMode's count of the
    model's products (it counts no attention on the CPU; biases and norms are the 0.8% above it), and
    N at the two full sizes is GPT-2 small's and medium's, less the position table."""
    from torch.utils.flop_counter import FlopCounterMode

    shape = bench.SIZES["small"]
    model = bench.build_model(shape, 0)
    x, y = bench.make_data(shape, 2, 0)
    with FlopCounterMode(display=False) as counter:
        bench.lm_loss(model(x), y).backward()
    counted = counter.get_total_flops() / x.numel()
    six_n = bench.flops_per_token(bench.matmul_params(model), shape) - 12 * shape["layers"] * shape["d_model"] * shape["block"]
    assert 1.0 <= six_n / counted < 1.01, (six_n, counted)
    for size, (d, layers) in {"125m": (768, 12), "350m": (1024, 24)}.items():
        with torch.device("meta"):
            big = bench.build_model(bench.SIZES[size], 0)
        assert bench.matmul_params(big) == layers * (12 * d * d + 13 * d) + 50304 * d + 2 * d, size
        assert bench.flops_per_token(bench.matmul_params(big), bench.SIZES[size]) == 6 * bench.matmul_params(big) + 12 * layers * d * 1024
    assert bench.matmul_params(big) == pytest.approx(353.8e6, rel=1e-3)


def test_the_clock_times_the_steady_steps_only(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    ticks = iter([10.0, 16.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(ticks))
    clock = bench.Clock(warmup=2, steps=5, device=torch.device("cpu"))
    for step in range(1, 6):
        clock.step_end(step, torch.tensor(float(step)))
    run = clock.into(bench.Run("hand"))
    assert run.step_s == pytest.approx(2.0)  # 6 s over steps 3, 4, 5
    assert run.losses == [1.0, 2.0, 3.0, 4.0, 5.0]


def test_the_hand_loop_draws_the_trainers_batches(bench: ModuleType) -> None:
    from shardwise.data import epoch_permutation

    drawn = list(bench.batch_order(12, 4, 5, seed=3))
    expected = [*epoch_permutation(12, 3, 0).split(4), *epoch_permutation(12, 3, 1).split(4)[:2]]
    assert len(drawn) == 5 and all(torch.equal(a, b) for a, b in zip(drawn, expected, strict=True))


def test_the_peak_comes_from_the_datasheet_or_the_flag(bench: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    args = bench.argparse.Namespace(peak_tflops=None, device="cuda", precision="bf16-mixed")
    for name, peak in (("NVIDIA H200", 989e12), ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA A100-SXM4-40GB", 312e12)):
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, n=name: n)
        assert bench.peak_flops(args)[0] == peak, name
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GeForce RTX 4090")
    assert bench.peak_flops(args) == (None, "no peak figure for NVIDIA GeForce RTX 4090: pass --peak-tflops")
    args.peak_tflops = 165.0
    assert bench.peak_flops(args) == (165e12, "--peak-tflops")


def test_the_loss_gap_is_the_largest_relative_difference(bench: ModuleType) -> None:
    def pair(a: list[float], b: list[float]) -> dict:
        return {"shardwise": bench.Run("shardwise", losses=a), "hand": bench.Run("hand", losses=b)}

    assert bench.loss_gap([pair([2.0, 1.0], [2.0, 1.0])]) == 0.0
    assert bench.loss_gap([pair([2.0, 1.0], [2.0, 1.0]), pair([4.0, 1.01], [4.0, 1.0])]) == pytest.approx(0.01)
    assert bench.loss_gap([pair([2.0], [2.0, 1.0])]) == math.inf


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "5", "--warmup", "4"], r"--steps must exceed --warmup by at least 2 .*got --steps 5 --warmup 4"),
        (["--warmup", "0"], r"--warmup be >= 1"),
        (["--pairs", "0"], r"--pairs must be >= 1; got 0"),
        (["--peak-tflops", "-1"], r"--peak-tflops must be > 0"),
    ],
)
def test_bad_settings_are_refused_before_anything_is_built(bench: ModuleType, argv: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        bench.parse_args(["--device", "cpu", *argv])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_for_without_one_is_refused(bench: ModuleType) -> None:
    with pytest.raises(ConfigError, match=r"--device cuda, but this torch sees no CUDA device"):
        bench.parse_args(["--device", "cuda"])
