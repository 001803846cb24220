"""``charlm``: a small decoder-only transformer (GPT-style) trained on characters.

The text is the English documentation that ships with Python itself: the help
topics in the standard library's ``pydoc_data`` package (about 465,000
characters, ~100 distinct). Nothing is downloaded. The topics are joined in
sorted order; the first 90% of the characters train, the last 10% validate (a
split by position, so no window straddles both).

The model is built as a sequence of blocks, which is what pipeline parallelism
splits and what tensor parallelism's usual module names expect::

    embed   (tokens + positions)         -> CharGPT.embed
    blocks  (attention + MLP) x n_layers -> CharGPT.blocks.{i}.attn.{q,k,v,proj}, .mlp.{fc,proj}
    head    (final norm + vocabulary)    -> CharGPT.head

``forward`` applies exactly these children in this order; a pipeline stage is a
contiguous run of them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from shardwise.tools.recipes import Recipe, RecipeParts


class Embed(nn.Module):
    """Token plus learned position embedding."""

    def __init__(self, vocab_size: int, block_size: int, d_model: int, dropout: float) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab_size, d_model)
        self.pos = nn.Embedding(block_size, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.pos.num_embeddings:
            raise ValueError(f"sequence of {t} characters is longer than the model's block size {self.pos.num_embeddings}")
        positions = torch.arange(t, device=idx.device)
        return self.drop(self.tok(idx) + self.pos(positions))


class Attention(nn.Module):
    """Causal multi-head self-attention with separate q, k, v projections.

    The number of heads is read from the projections' output size at run time
    (``size // head_dim``), so the same code runs whole or with its heads split
    across tensor-parallel ranks (q/k/v by columns, ``proj`` by rows).
    """

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.head_dim = d_model // n_heads
        self.q = nn.Linear(d_model, d_model)
        self.k = nn.Linear(d_model, d_model)
        self.v = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float) -> None:
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = Attention(d_model, n_heads, dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Head(nn.Module):
    """Final layer norm and the projection to vocabulary logits."""

    def __init__(self, d_model: int, vocab_size: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


class CharGPT(nn.Module):
    """Decoder-only transformer over characters: ``embed -> blocks -> head``; ``forward(idx)`` gives logits (B, T, vocab)."""

    def __init__(self, vocab_size: int, block_size: int = 64, d_model: int = 128, n_heads: int = 4, n_layers: int = 4, dropout: float = 0.0) -> None:
        super().__init__()
        self.block_size = block_size
        self.embed = Embed(vocab_size, block_size, d_model, dropout)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, dropout) for _ in range(n_layers))
        self.head = Head(d_model, vocab_size)
        self.apply(self._init)
        for name, param in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                nn.init.normal_(param, std=0.02 / math.sqrt(2 * n_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8, generator: torch.Generator | None = None) -> torch.Tensor:
        """Append ``new_tokens`` sampled characters to ``idx`` (B, T) and return the whole sequence."""
        was_training = self.training
        self.eval()
        for _ in range(new_tokens):
            logits = self(idx[:, -self.block_size :])[:, -1, :].float() / max(temperature, 1e-6)
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=generator)
            idx = torch.cat([idx, nxt.to(idx.dtype)], dim=1)
        self.train(was_training)
        return idx


# -- data --------------------------------------------------------------------------------------


def python_docs_text() -> str:
    """The help topics that ship with Python (``pydoc_data.topics``), joined in sorted order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k].strip() for k in sorted(topics))


class CharVocab:
    """Characters <-> ids; the vocabulary is every character of the whole text, sorted."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        unknown = sorted(set(text) - set(self.index))
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {unknown[:10]}")
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids: torch.Tensor) -> str:
        return "".join(self.chars[int(i)] for i in ids.reshape(-1))


class CharWindows(Dataset):
    """``(x, y)`` windows of ``block_size`` characters, ``y`` shifted by one, starting every ``stride`` characters."""

    def __init__(self, ids: torch.Tensor, block_size: int, stride: int) -> None:
        if len(ids) <= block_size:
            raise ValueError(f"text of {len(ids)} characters is too short for windows of {block_size}")
        self.ids, self.block_size = ids, block_size
        self.starts = range(0, len(ids) - block_size - 1 + 1, stride)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.starts[i]
        chunk = self.ids[s : s + self.block_size + 1]
        return chunk[:-1], chunk[1:]


def load_charlm_split(
    block_size: int, val_fraction: float = 0.1, stride: int | None = None, text: str | None = None
) -> tuple[CharVocab, CharWindows, CharWindows]:
    """(vocabulary, train windows, validation windows) from Python's own documentation text."""
    text = python_docs_text() if text is None else text
    vocab = CharVocab(text)
    ids = vocab.encode(text)
    cut = int(len(ids) * (1 - val_fraction))
    stride = stride or block_size
    return vocab, CharWindows(ids[:cut], block_size, stride), CharWindows(ids[cut:], block_size, block_size)


def lm_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """Mean cross entropy of next-character prediction over every position."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]).float(), batch[1].reshape(-1))


def char_accuracy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return (output.argmax(-1) == batch[1]).float().mean()


def adamw(params: Any, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95))


def sample_text(model: nn.Module, vocab: CharVocab, prompt: str = "The ", length: int = 200, temperature: float = 0.8, seed: int = 0) -> str:
    """Text the (trained, whole) model writes after ``prompt``."""
    gen = torch.Generator().manual_seed(seed)
    param = next(model.parameters())
    idx = vocab.encode(prompt).reshape(1, -1).to(param.device)
    out = model.generate(idx, length, temperature=temperature, generator=gen)  # type: ignore[operator]
    return vocab.decode(out[0].cpu())


def build(opts: Mapping[str, Any]) -> RecipeParts:
    vocab, train, val = load_charlm_split(opts["block_size"], opts["val_fraction"], opts["stride"])
    if opts["val_windows"]:
        val = torch.utils.data.Subset(val, range(min(len(val), opts["val_windows"])))  # type: ignore[assignment]
    model = CharGPT(len(vocab), opts["block_size"], opts["d_model"], opts["n_heads"], opts["n_layers"], opts["dropout"])
    return RecipeParts(
        model=model,
        train=train,
        val=val,
        loss_fn=lm_loss,
        metrics={"accuracy": char_accuracy},
        optimizer=functools.partial(adamw, lr=opts["lr"], weight_decay=opts["weight_decay"]),
        after_fit=functools.partial(sample_text, vocab=vocab, length=opts["sample_chars"]) if opts["sample_chars"] else None,
    )


RECIPE = Recipe(
    name="charlm",
    description="character-level GPT on Python's own documentation text (pydoc_data), for pipeline/tensor parallelism",
    build=build,
    options={
        "block_size": 64,
        "d_model": 128,
        "n_heads": 4,
        "n_layers": 4,
        "dropout": 0.0,
        "lr": 1e-3,
        "weight_decay": 0.01,
        "val_fraction": 0.1,
        "stride": 64,
        "val_windows": 256,
        "sample_chars": 200,
    },
    trainer_defaults={"global_batch_size": 32, "max_steps": 300, "log_every": 20, "val_every": 100, "checkpoint_every": 100},
)
