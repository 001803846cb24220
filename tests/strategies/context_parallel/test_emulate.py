"""The parent's emulated-rank check (`context_parallel/emulate.py`): models cp would train silently wrong
are refused before launch, naming the attention call; the exact families pass it.

The hole it closes: a model that builds rotary positions from ``arange(t)`` inside forward gives
under cp each rank positions 0..t-1 instead of its tokens' own, while a check at cp=1 sees nothing.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardwise.errors import ConfigError
from shardwise.strategies.data_parallel.ddp import DDP
from tests.strategies.context_parallel import cells
from tests.support import zoo


def _rotate(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [b, h, t, d] at positions ``pos`` ([t] or [b, t])."""
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=x.dtype) / d))
    ang = pos.to(x.dtype)[..., None] * inv
    cos, sin = ang.cos(), ang.sin()
    if ang.dim() == 3:  # [b, t, d/2]: one row of positions per sample
        cos, sin = cos[:, None], sin[:, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class _RotaryAttention(nn.Module):
    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.heads = heads

    def forward(self, x: torch.Tensor, pos: torch.Tensor | None) -> torch.Tensor:
        b, t, c = x.shape
        if pos is None:
            pos = torch.arange(t, device=x.device)  # the hole: the local length under cp
        q, k, v = (p(x).view(b, t, self.heads, c // self.heads).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(_rotate(q, pos), _rotate(k, pos), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c))


class _RotaryGPT(nn.Module):
    """A hand-written GPT with rotary positions and no position embedding; ``shift`` adds a token shift
    (each token plus its predecessor) after the last attention: sequence mixing outside attention."""

    def __init__(self, shift: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(zoo.VOCAB, 16)
        self.blocks = nn.ModuleList(_RotaryAttention() for _ in range(2))
        self.head = nn.Linear(16, zoo.VOCAB)
        self.shift = shift

    def forward(self, idx: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x, pos)
        if self.shift:
            x = x + torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        out: torch.Tensor = self.head(x)
        return out


def _check(model: nn.Module, sample: Any, cp: int = 2, style: Any = "ring") -> None:
    DDP(cp=cp, cp_style=style).check_sample(model, sample, DDP(cp=cp).plan(cp))


def _tokens() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = zoo.batch("nanogpt", 1)
    return x, y


def test_refuses_rotary_positions_built_from_arange_inside_forward() -> None:
    for cp, style in ((2, "ring"), (4, "ulysses")):
        with pytest.raises(ConfigError, match=rf"at attention call 0 \('blocks.0'\) the q of emulated cp rank 0 of {cp} differs .*arange\(t\)"):
            _check(_RotaryGPT().double(), _tokens(), cp, style)


def test_passes_the_same_model_given_its_positions_as_an_input() -> None:
    """The message's advice holds: positions as a [batch, sequence] argument are split with the tokens."""
    x, y = _tokens()
    _check(_RotaryGPT().double(), (x, torch.arange(x.shape[1]).expand_as(x), y))
    _check(_RotaryGPT(), (x, torch.arange(x.shape[1]).expand_as(x), y), cp=4)  # float32 weights: the check runs in float64


def test_refuses_sequence_mixing_outside_attention() -> None:
    x, y = _tokens()
    with pytest.raises(ConfigError, match=r"outputs of the 2 emulated cp ranks, put back in sequence order, differ .* though every attention call matched"):
        _check(_RotaryGPT(shift=True).double(), (x, torch.arange(x.shape[1]).expand_as(x), y))


@pytest.mark.parametrize("name", cells.FAMILIES)
def test_the_exact_families_pass(name: str) -> None:
    b = zoo.batch(cells.data_name(name), 1)
    for cp in (2, 4):
        _check(cells.build(name), b, cp)


def test_a_long_sequence_is_checked_on_a_prefix_and_still_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A 256-token sample is emulated on its first 2 x cp x CHECK_CHUNK tokens (the recorded q/k/v stay
    small), which still shows positions built from arange(t); a model given its positions passes."""
    from shardwise.strategies import context_parallel as cp_pkg
    from shardwise.strategies.context_parallel import emulate

    seen: list[int] = []
    real = emulate.check_ranks
    monkeypatch.setattr(emulate, "check_ranks", lambda m, a, k, *rest: (seen.append(a[0].shape[1]), real(m, a, k, *rest))[1])
    x = torch.randint(0, zoo.VOCAB, (1, 256), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"the q of emulated cp rank 0 of 2 differs .*arange\(t\)"):
        _check(_RotaryGPT().double(), (x, x))
    _check(_RotaryGPT().double(), (x, torch.arange(256).expand_as(x), x))
    assert seen == [2 * 2 * cp_pkg.CHECK_CHUNK] * 2


def test_refuses_an_output_that_is_not_per_token() -> None:
    """A sequence classifier pools its last token: each cp rank would pool the last of its own chunks
    (its loss and logits differ from the whole sequence's); refused before launch, not averaged."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=zoo.VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
    )
    cfg.num_labels, cfg.pad_token_id = 3, 0
    torch.manual_seed(0)
    model = transformers.LlamaForSequenceClassification(cfg).double()
    ids = torch.randint(1, zoo.VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ConfigError, match=r"its output 0 \(shape \(\)\) is not one value per token.*sequence classifier"):
        _check(model, {"input_ids": ids, "labels": torch.tensor([1])})
    with pytest.raises(ConfigError, match=r"its output 0 \(shape \(1, 3\)\) is not one value per token"):
        _check(model, {"input_ids": ids})
