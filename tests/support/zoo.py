"""Other people's models, built from small configs with random weights (no download).

The strategies are tested on the models users train, not only on shardwise's own:
Hugging Face transformers' Llama (causal LM, RMSNorm, rotary, grouped kv heads), GPT-2
(Conv1D, fused q|k|v, tied embeddings), BERT (an encoder with a classification head),
ViT (a vision transformer), ResNet (a convnet with BatchNorm), and a nanoGPT-style GPT
written here the way people write it by hand (a ModuleDict, its own LayerNorm class,
fused q|k|v, lm_head tied to the token embedding).

``build(name)`` gives the model in float64 from one seed; ``dataset(name, n)`` gives
samples the way users feed them: a dict with ``labels`` for the Hugging Face models
(``model(**batch).loss``), an ``(idx, targets)`` pair for nanoGPT (with ``loss_fn``).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

VOCAB = 64
SEQ = 16
HF_MODELS = ("llama", "gpt2", "bert", "vit", "resnet")
MODELS = HF_MODELS + ("nanogpt",)


# -- a nanoGPT-style GPT, written as people write it ------------------------------------------------
class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (not ``nn.LayerNorm``: rules by class miss it)."""

    def __init__(self, dim: int, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(d, 3 * d)  # fused q|k|v
        self.c_proj = nn.Linear(d, d)
        self.n_head, self.n_embd = heads, d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(d, 4 * d)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln_2 = LayerNorm(d)
        self.mlp = MLP(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    def __init__(self, vocab: int = VOCAB, block_size: int = SEQ, d: int = 32, heads: int = 4, layers: int = 4) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(vocab, d),
                wpe=nn.Embedding(block_size, d),
                h=nn.ModuleList([Block(d, heads) for _ in range(layers)]),
                ln_f=LayerNorm(d),
            )
        )
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * layers))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class NanoGPTTargets(NanoGPT):
    """nanoGPT as Karpathy writes it: ``forward(idx, targets=None)`` asserts the length (so torch.fx
    cannot trace it), returns ``(logits, loss)`` with targets and the last position's logits without;
    ``training_step`` calls ``self(x, y)``."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:  # type: ignore[override]
        b, t = idx.size()
        assert t <= SEQ, f"Cannot forward sequence of length {t}, block size is only {SEQ}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits, loss = self.lm_head(x[:, [-1], :]), None
        return logits, loss

    def training_step(self, batch: Any) -> torch.Tensor:
        x, y = batch
        _, loss = self(x, y)
        assert loss is not None
        return loss


class NanoGPTFunctionalHead(NanoGPT):
    """nanoGPT with its head written as code, not a module: ``x @ self.transformer.wte.weight.t()`` in the
    root's forward (a tied head the way many hand-written GPTs have it), and a vocabulary large enough that
    the embedding is a sizeable share of the model (an FSDP unit of its own, were the read not seen)."""

    def __init__(self, layers: int = 4) -> None:
        super().__init__(vocab=4 * VOCAB, layers=layers)
        del self.lm_head
        self.transformer.wte = nn.Embedding(4 * VOCAB, 32)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.transformer.ln_f(x) @ self.transformer.wte.weight.t()


def nanogpt_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """The loss a nanoGPT user writes: next-token cross-entropy over every position."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


# -- Hugging Face models from small configs ------------------------------------------------------------
def _hf(name: str, layers: int) -> nn.Module:
    try:
        import transformers as tf
    except ImportError as exc:  # pragma: no cover - the test extra installs it
        raise ImportError("the model tests need transformers: pip install -e '.[dev]'") from exc
    common: dict[str, Any] = {"attn_implementation": "eager"}
    if name == "llama":
        cfg = tf.LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            tie_word_embeddings=False,
            **common,
        )
        return tf.LlamaForCausalLM(cfg)
    if name == "gpt2":
        cfg = tf.GPT2Config(
            vocab_size=VOCAB,
            n_positions=SEQ,
            n_embd=32,
            n_layer=layers,
            n_head=4,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
            **common,
        )
        return tf.GPT2LMHeadModel(cfg)  # lm_head tied to wte
    if name == "qwen2_alt":  # blocks that differ by position: sliding and full attention alternating
        cfg = tf.Qwen2Config(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=SEQ,
            use_sliding_window=True,
            sliding_window=4,
            layer_types=["sliding_attention", "full_attention"] * (layers // 2) + ["sliding_attention"] * (layers % 2),
            tie_word_embeddings=False,
            **common,
        )
        return tf.Qwen2ForCausalLM(cfg)
    if name == "bert":
        cfg = tf.BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=SEQ,
            num_labels=3,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        return tf.BertForSequenceClassification(cfg)
    if name == "vit":
        cfg = tf.ViTConfig(
            image_size=16,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=layers,
            num_attention_heads=4,
            intermediate_size=64,
            num_labels=10,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        return tf.ViTForImageClassification(cfg)
    if name == "resnet":
        cfg = tf.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=10)
        return tf.ResNetForImageClassification(cfg)
    raise KeyError(f"unknown model {name!r}; known: {MODELS}")


def build(name: str, *, seed: int = 0, dtype: torch.dtype = torch.float64, layers: int = 4) -> nn.Module:
    """The model ``name`` with random weights drawn from ``seed``, in ``dtype``."""
    torch.manual_seed(seed)
    hand = {"nanogpt": NanoGPT, "nanogpt_targets": NanoGPTTargets, "nanogpt_fhead": NanoGPTFunctionalHead}
    model = hand[name](layers=layers) if name in hand else _hf(name, layers)
    return model.to(dtype)


def sample(name: str, i: int, seed: int = 0) -> Any:
    """Sample ``i`` of the data set for ``name`` (a pure function of seed and index)."""
    g = torch.Generator().manual_seed(seed * 100_003 + i)
    if name in ("llama", "gpt2", "qwen2_alt"):
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "labels": ids.clone()}
    if name == "bert":
        ids = torch.randint(0, VOCAB, (SEQ,), generator=g)
        return {"input_ids": ids, "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": torch.randint(0, 3, (), generator=g)}
    if name in ("vit", "resnet"):
        return {"pixel_values": torch.randn(3, 16, 16, generator=g, dtype=torch.float64), "labels": torch.randint(0, 10, (), generator=g)}
    if name in ("nanogpt", "nanogpt_targets", "nanogpt_fhead"):
        ids = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
        return ids[:-1], ids[1:]
    raise KeyError(f"unknown model {name!r}; known: {MODELS}")


class Samples(torch.utils.data.Dataset):
    """``n`` samples of ``name``'s data (dicts for Hugging Face models, pairs for nanoGPT)."""

    def __init__(self, name: str, n: int, seed: int = 0) -> None:
        self.name, self.n, self.seed = name, n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return sample(self.name, i, self.seed)


def dataset(name: str, n: int = 32, seed: int = 0) -> Samples:
    return Samples(name, n, seed)


def batch(name: str, n: int = 4, seed: int = 0) -> Any:
    """``n`` samples collated as a DataLoader would."""
    return torch.utils.data.default_collate([sample(name, i, seed) for i in range(n)])


def loss_fn(name: str) -> Callable[[Any, Any], torch.Tensor] | None:
    """What a user passes as ``loss_fn``: none for Hugging Face models (``model(**batch).loss``)."""
    return nanogpt_loss if name in ("nanogpt", "nanogpt_fhead") else None


def hf_loss(model: nn.Module, b: Any) -> torch.Tensor:
    """The reference loss of one batch, written the way a transformers user writes it."""
    if isinstance(b, dict):
        return model(**b).loss
    return nanogpt_loss(model(b[0]), b)


def causal_lm_loss64(output: Any, batch: Any) -> torch.Tensor:
    """transformers' causal-LM loss (labels shifted by one) kept in the logits' dtype.

    transformers computes its own loss in float32 even for float64 logits, which caps
    parity at float32 rounding; the float64 parity tests pass this instead."""
    logits = output.logits
    labels = batch["labels"]
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def parity_loss_fn(name: str) -> Callable[[Any, Any], torch.Tensor] | None:
    """The loss for float64 parity: float64 throughout (the model's own loss where it is float64 already)."""
    if name in ("llama", "gpt2", "qwen2_alt"):
        return causal_lm_loss64
    return loss_fn(name)
