"""What the planner reads from a model: parameters, FLOPs and activations, checked by hand."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from shardwise.plan.model_spec import measured_spec, transformer_spec


def test_measured_spec_of_an_mlp_counts_its_matmuls() -> None:
    """Forward 2 w FLOPs per sample per weight matrix; backward 4 w, except the first layer's input gradient (2 w)."""
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    spec = measured_spec("mlp", model, torch.randn(8, 64), 8)
    w1, w2 = 64 * 32, 32 * 10
    assert spec.params == w1 + 32 + w2 + 10
    assert spec.flops_per_sample == 6 * (w1 + w2) - 2 * w1
    # activations: each leaf's output, 4 bytes an element: 32 + 32 + 10 per sample, over the 2 blocks with parameters
    assert spec.layers == 2
    assert spec.act_bytes_per_layer_sample * spec.layers + spec.act_bytes_other_sample == (32 + 32 + 10) * 4


def test_transformer_flops_are_narayanan_eq_3() -> None:
    """Narayanan et al. 2021, eq. 3 (without recomputation, 72 in place of 96): 72 s L h^2 (1 + s/(6h) + V/(12 L h))."""
    s, layers, h, v = 128, 4, 256, 1000
    spec = transformer_spec("gpt", layers=layers, hidden=h, heads=4, vocab=v, seq=s)
    assert spec.flops_per_sample == pytest.approx(72 * s * layers * h * h * (1 + s / (6 * h) + v / (12 * layers * h)), rel=1e-12)
