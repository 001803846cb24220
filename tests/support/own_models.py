"""Models written by hand, the way people who do not train a Hugging Face model write them.

Each keeps code in its ``forward`` that a strategy must not skip: functional activations and
scaling between layers, pooling and flatten, a bare ``nn.Parameter`` read in ``forward``,
residual adds, a skip connection that crosses several blocks, one module used twice, and a
nanoGPT-style ``GPT`` as its author wrote it (a config dataclass, an ``assert`` on the sequence
length, optional ``targets`` and a ``(logits, loss)`` return, ``_init_weights`` through
``apply``, the head tied to the token embedding).

``build_own(name)`` gives the model in float64 from one seed; ``own_dataset(name, n)`` gives
``(x, y)`` pairs; ``own_loss(name)`` is the loss a user of that model writes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 32
SEQ = 8
OWN_MODELS = ("mlp", "mlp_zero", "cnn", "postransformer", "skipnet", "sharednet", "gpt")


class FunctionalMLP(nn.Module):
    """Three linears; ReLUs in ``forward``, and optionally the last hidden layer multiplied by 0
    (then nothing reaches the head but its bias: a balanced two-class problem stays at ln 2)."""

    def __init__(self, zero: bool = False, width: int = 16) -> None:
        super().__init__()
        self.zero = zero
        self.fc1 = nn.Linear(8, width)
        self.fc2 = nn.Linear(width, width)
        self.fc3 = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.fc1(x))
        h = F.relu(self.fc2(h))
        if self.zero:
            h = h * 0
        return self.fc3(h)


class SmallCNN(nn.Module):
    """Two convolutions with ReLU and max-pooling, flatten, two linears: the functional part in ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 8, 3, padding=1)
        self.fc1 = nn.Linear(8 * 2 * 2, 16)
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = torch.flatten(x, 1)
        return self.fc2(F.relu(self.fc1(x)))


class Attention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (lin(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm attention and MLP, each added back to the residual stream in ``forward``."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.up = nn.Linear(d, 4 * d)
        self.down = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class PosTransformer(nn.Module):
    """A small transformer whose position table is a bare ``nn.Parameter`` added in ``forward``."""

    def __init__(self, d: int = 16, heads: int = 2, layers: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[: idx.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class SkipNet(nn.Module):
    """An MLP stack whose first block's output is added to the last block's input (a skip across blocks)."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        first = h = torch.tanh(self.blocks[0](h))
        for block in self.blocks[1:-1]:
            h = torch.tanh(block(h))
        h = torch.tanh(self.blocks[-1](h + first))
        return self.out(h)


class SharedNet(nn.Module):
    """One module used twice: ``mix`` runs after the first block and again after the last."""

    def __init__(self, width: int = 16, layers: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(8, width)
        self.mix = nn.Linear(width, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(layers)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.inp(x))
        h = F.relu(self.mix(self.blocks[0](h)))
        for block in self.blocks[1:]:
            h = F.relu(block(h))
        return self.out(torch.tanh(self.mix(h)))


# -- a nanoGPT-style GPT with its author's habits ------------------------------------------------------
@dataclass
class GPTConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = 4
    n_head: int = 2
    n_embd: int = 16
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class GPTMLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class GPTBlock(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = GPTMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([GPTBlock(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x)
            loss = None
        return logits, loss


# -- building, data, losses ------------------------------------------------------------------------------
def build_own(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """The model ``name`` with random weights drawn from ``seed``, in ``dtype``."""
    torch.manual_seed(seed)
    makers: dict[str, Callable[[], nn.Module]] = {
        "mlp": FunctionalMLP,
        "mlp_zero": lambda: FunctionalMLP(zero=True),
        "cnn": SmallCNN,
        "postransformer": PosTransformer,
        "skipnet": SkipNet,
        "sharednet": SharedNet,
        "gpt": lambda: GPT(GPTConfig()),
    }
    if name not in makers:
        raise KeyError(f"unknown model {name!r}; known: {OWN_MODELS}")
    return makers[name]().to(dtype)


def own_sample(name: str, i: int, seed: int = 0, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``i`` of ``name``'s data set: a pure function of seed and index."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    if name in ("mlp", "mlp_zero"):
        return torch.randn(8, generator=g, dtype=dtype), torch.tensor(i % 2)  # balanced two classes
    if name == "cnn":
        return torch.randn(1, 8, 8, generator=g, dtype=dtype), torch.randint(0, 3, (), generator=g)
    if name in ("skipnet", "sharednet"):
        return torch.randn(8, generator=g, dtype=dtype), torch.randint(0, 3, (), generator=g)
    if name in ("postransformer", "gpt"):
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return ids[:-1], ids[1:]
    raise KeyError(f"unknown model {name!r}; known: {OWN_MODELS}")


class OwnSamples(torch.utils.data.Dataset):
    def __init__(self, name: str, n: int, seed: int = 0) -> None:
        self.name, self.n, self.seed = name, n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return own_sample(self.name, i, self.seed)


def own_dataset(name: str, n: int = 32, seed: int = 0) -> OwnSamples:
    return OwnSamples(name, n, seed)


def classification_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(output, batch[1])


def token_loss(output: Any, batch: Any) -> torch.Tensor:
    """Next-token cross-entropy; nanoGPT's ``GPT`` returns ``(logits, loss)`` and the logits are taken."""
    logits = output[0] if isinstance(output, tuple) else output
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def own_loss(name: str) -> Callable[[Any, Any], torch.Tensor]:
    return token_loss if name in ("postransformer", "gpt") else classification_loss


# -- appended for tp's checks before launch (issue 36 item 2) ------------------------------------------------
class HeadAttention(nn.Module):
    """Attention that reshapes with a fixed head width (``view(b, t, -1, head_dim)``): it runs on any
    share of its heads, so tensor parallelism splits it."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class PosBlock(nn.Module):
    """A block that adds its own position table to the residual stream (a whole ``(SEQ, d)`` parameter)."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(SEQ, d) * 0.02)
        self.ln = nn.LayerNorm(d)
        self.attn = HeadAttention(d, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x + self.pos))


class BlockPosTransformer(nn.Module):
    """Exact under tp (its attention reshapes by head width); under sequence parallelism each block's
    position table, whole, meets a sequence-sharded activation: it cannot take it."""

    def __init__(self, d: int = 16, heads: int = 2, layers: int = 2) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList([PosBlock(d, heads) for _ in range(layers)])
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build_blockpos(seed: int = 0, dtype: torch.dtype = torch.float64) -> nn.Module:
    """`BlockPosTransformer` from ``seed``; its data is ``own_dataset("postransformer")``, its loss `token_loss`."""
    torch.manual_seed(seed)
    return BlockPosTransformer().to(dtype)
