"""Model FLOPs counted on meta tensors, PaLM's formula where counting fails, and the device peaks (MFU)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.strategies.cost import flops
from shardwise.tools.recipes.charlm import CharGPT


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    out = model(batch[0])
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), batch[1].reshape(-1))


def test_linear_and_mlp_counts_equal_the_hand_formula() -> None:
    """Per sample: forward 2 in out a weight matrix; backward 2 in out for the weight's gradient and 2 in out for
    the input's, which the first layer (its input needs none) does not compute. Biases add no matmul FLOPs."""
    lin = nn.Linear(6, 16)
    assert flops.count(lin, torch.randn(5, 6)).flops_per_sample == 4 * 6 * 16
    mlp = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    c = flops.count(mlp, (torch.randn(8, 6), torch.randint(0, 3, (8,))), _ce)
    assert c.method == "FlopCounterMode" and c.tokens_per_sample == 0
    assert c.flops_per_sample == 6 * (6 * 16 + 16 * 3) - 2 * 6 * 16  # 672
    assert c.per_step(32) == 32 * 672
    # an embedding before the layers: every linear's input needs its gradient, so 3 x forward exactly
    emb = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    ids = torch.randint(0, 10, (4, 7))
    c = flops.count(emb, (ids, torch.randint(0, 3, (4, 7))), _ce)
    assert c.flops_per_sample == 3 * 2 * (6 * 16 + 16 * 3) * 7 and c.tokens_per_sample == 7


def _gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(100, block_size=64, d_model=128, n_heads=4, n_layers=4)


def test_small_gpt_counted_within_a_few_percent_of_palm() -> None:
    """A 4-layer GPT: the count (matmuls and attention's two batched products, forward and backward) against
    PaLM's (6 N + 12 L H Q T) T per sample, N every parameter outside the embedding tables."""
    model, T = _gpt(), 64
    batch = (torch.randint(0, 100, (2, T)), torch.randint(0, 100, (2, T)))
    c = flops.count(model, batch, _ce)
    n = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed."))
    assert flops.matmul_params(model) == n
    palm = (6 * n + 12 * 4 * 128 * T) * T
    assert c.method == "FlopCounterMode" and c.tokens_per_sample == T
    assert abs(c.flops_per_sample / palm - 1) < 0.02  # biases and norms are in N, not in the count
    assert c.flops_per_sample > 6 * n * T + 0.8 * 12 * 4 * 128 * T * T - 2 * 100 * 128 * T  # attention is counted


class _Reads(CharGPT):
    """A GPT whose forward reads a value (``.item()``): meta tensors have none to give."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.max().item() < 0:
            raise AssertionError
        return super().forward(idx)


def test_formula_where_counting_fails_and_none_without_one() -> None:
    torch.manual_seed(0)
    model, T = _Reads(100, block_size=32, d_model=64, n_heads=4, n_layers=3), 32
    c = flops.count(model, (torch.randint(0, 100, (1, T)), torch.randint(0, 100, (1, T))), _ce)
    assert c.method.startswith("6N+attention (counting failed: ") and "item" in c.method
    assert c.flops_per_sample == (6 * flops.matmul_params(model) + 12 * 3 * 64 * T) * T
    assert not any(p.grad is not None for p in model.parameters())

    class Odd(nn.Module):  # neither token ids nor blocks
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x) * x.sum().item()

    c = flops.count(Odd(), torch.randn(3, 4))
    assert c.flops_per_sample is None and c.per_step(8) is None
    assert c.method.startswith("not counted (counting failed: ") and "no formula: the batch has no token ids" in c.method


class _Counting(nn.Sequential):
    """Counts its training forwards in a Python attribute (as the non-finite tests' models pick their bad step)."""

    calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return super().forward(x)


def test_counting_leaves_the_model_and_the_random_stream_alone() -> None:
    """No .grad, no weight or buffer change (a BatchNorm in training mode updates only meta copies), no Python
    attribute the forward changes, the mode the model had, and the random stream where it was."""
    torch.manual_seed(0)
    model = _Counting(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3)).eval()
    model.calls = 0
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = (torch.randn(4, 6), torch.randint(0, 3, (4,)))
    rng = torch.get_rng_state()
    c = flops.count(model, batch, _ce)
    assert c.method == "FlopCounterMode" and c.flops_per_sample == 6 * (6 * 8 + 8 * 3) - 2 * 6 * 8
    assert all(p.grad is None for p in model.parameters()) and not model.training and model.calls == 0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(rng, torch.get_rng_state())
    # a model built on the meta device counts the same
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 3))
    assert flops.count(meta, (torch.randn(4, 6), torch.randint(0, 3, (4,))), _ce).flops_per_sample == c.flops_per_sample


@pytest.mark.parametrize(
    ("name", "profile"),
    [
        ("NVIDIA H100 80GB HBM3", "h100-80gb"),
        ("NVIDIA H200", "h200"),
        ("NVIDIA A100-SXM4-40GB", "a100-40gb"),
        ("NVIDIA A100 80GB PCIe", "a100-40gb"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200 NVL", None),
        ("Tesla T4", None),
    ],
)
def test_gpu_names_map_to_profiles(name: str, profile: str | None) -> None:
    assert flops.gpu_profile(name) == profile


def test_gpu_peaks_by_precision() -> None:
    h200 = "NVIDIA H200"
    assert flops.gpu_peak(h200, "bf16-mixed", tf32=False)[0] == 989e12
    assert flops.gpu_peak(h200, "16-mixed", tf32=False)[0] == 989e12
    assert flops.gpu_peak(h200, "32", tf32=False)[0] == 67e12
    assert flops.gpu_peak(h200, "32", tf32=True)[0] == 494e12
    assert flops.gpu_peak(h200, "64", tf32=True)[0] == 34e12
    assert flops.gpu_peak("NVIDIA A100-SXM4-80GB", "32", tf32=True)[0] == 156e12
    peak, source = flops.gpu_peak("NVIDIA H100 80GB HBM3", "bf16-mixed", tf32=False)
    assert peak == 989e12 and "datasheet" in source
    assert flops.gpu_peak("Tesla T4", "bf16-mixed", tf32=False) == (None, "no peak figure for Tesla T4: set peak_tflops")
    assert flops.peak_for(torch.device("cpu"), "32", override_tflops=2.5) == (2.5e12, "peak_tflops setting (2.5 TFLOP/s)")


def test_cpu_peak_keeps_the_largest_figure_ever_measured(tmp_path) -> None:
    """Load only lowers a measurement: each call measures again and the file keeps the larger figure."""
    peak, source = flops.cpu_peak("32", threads=1, cache_dir=tmp_path)
    assert 1e8 < peak < 1e13 and "measured now" in source
    table = json.loads((tmp_path / "cpu_peak.json").read_text())
    (key,) = table
    assert "1 threads" in key and "float32" in key and torch.__version__ in key
    table[key]["flops_per_s"] = 1e15  # more than this CPU does: kept, and what is returned
    (tmp_path / "cpu_peak.json").write_text(json.dumps(table))
    again, source = flops.cpu_peak("32", threads=1, cache_dir=tmp_path)
    assert again == 1e15 and "the largest measured" in source
    assert json.loads((tmp_path / "cpu_peak.json").read_text())[key]["flops_per_s"] == 1e15
    table[key]["flops_per_s"] = 123.0  # a figure measured on a loaded machine: replaced by this measurement
    (tmp_path / "cpu_peak.json").write_text(json.dumps(table))
    low, source = flops.cpu_peak("32", threads=1, cache_dir=tmp_path)
    assert low > 1e8 and "measured now, above the figure kept" in source
    assert json.loads((tmp_path / "cpu_peak.json").read_text())[key]["flops_per_s"] == low
    assert not list(tmp_path.glob(".cpu_peak.*"))  # written through a temporary file, renamed


def test_cpu_peak_merges_what_another_process_wrote_while_it_measured(tmp_path, monkeypatch) -> None:
    """Two processes measuring different keys at once: the second to write keeps the first's key."""
    path = tmp_path / "cpu_peak.json"
    path.write_text(json.dumps({"old key": {"flops_per_s": 5.0, "n": 128}}))
    measure = flops._timed

    def measured_while_another_wrote(dtype: torch.dtype, threads: int, budget_s: float = 0.15) -> tuple[float, int]:
        path.write_text(json.dumps({"old key": {"flops_per_s": 5.0, "n": 128}, "other key": {"flops_per_s": 7.0, "n": 256}}))
        return measure(dtype, threads, budget_s)

    monkeypatch.setattr(flops, "_timed", measured_while_another_wrote)
    peak, _ = flops.cpu_peak("64", threads=1, cache_dir=tmp_path)
    table = json.loads(path.read_text())
    assert table["other key"]["flops_per_s"] == 7.0 and table["old key"]["flops_per_s"] == 5.0
    assert [table[k]["flops_per_s"] for k in table if "float64" in k] == [peak]
