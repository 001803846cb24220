"""The compile tests' cells: charlm's CharGPT (`shardwise.tools.recipes.charlm`) on Python's own
documentation text, a model of tests/support/zoo (the Hugging Face Llama) or of the expert-parallel
tests' MoE zoo (Mixtral), trained for
``harness.STEPS`` clipped SGD steps with and without ``compile=``, many cells in one launch.

A cell is (model name, strategy, strategy options, Trainer settings); the settings carry
``compile`` and ``precision`` ("32" or "64"). Like the model matrix (tests/support/harness.py),
but the model is built in the precision the cell names, and charlm is one of the models.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardwise import Trainer, launch
from tests.support import harness, zoo

TEXT_CHARS = 20_000
"""The first characters of the documentation text: the vocabulary and the training windows."""
SEQ = 16
LAYERS = 2

Cell = tuple[str, str, dict[str, Any], dict[str, Any]]


def charlm_data(n: int = harness.SAMPLES) -> torch.utils.data.Dataset:
    """``n`` windows of ``SEQ`` characters (inputs, next characters)."""
    from shardwise.tools.recipes.charlm import load_charlm_split, python_docs_text

    _, train, _ = load_charlm_split(SEQ, text=python_docs_text()[:TEXT_CHARS])
    return torch.utils.data.Subset(train, range(n))


def vocab_size() -> int:
    from shardwise.tools.recipes.charlm import python_docs_text

    return len(set(python_docs_text()[:TEXT_CHARS]))


def build(name: str, precision: str = "32", seed: int = 0, meta: bool = False) -> nn.Module:
    """The model ``name`` ("charlm" or a zoo name) with weights drawn from ``seed``, in the precision's dtype;
    ``meta``: charlm built under `shardwise.meta_init` (its storage given by the strategy)."""
    dtype = torch.float64 if precision == "64" else torch.float32
    if name in MOE:
        return _moe().build(name).to(dtype)
    if name == "torchenc":
        torch.manual_seed(seed)
        return TorchEncoderLM(vocab_size()).to(dtype)
    if name != "charlm":
        return zoo.build(name, seed=seed, dtype=dtype, layers=LAYERS)
    import shardwise
    from shardwise.tools.recipes.charlm import CharGPT

    torch.manual_seed(seed)
    if meta:
        with shardwise.meta_init():
            return CharGPT(vocab_size(), block_size=SEQ, d_model=32, n_heads=4, n_layers=LAYERS)
    return CharGPT(vocab_size(), block_size=SEQ, d_model=32, n_heads=4, n_layers=LAYERS).to(dtype)


def dataset(name: str, n: int = harness.SAMPLES) -> Any:
    if name in MOE:
        return _moe().dataset(n)
    return charlm_data(n) if name in ("charlm", "torchenc") else zoo.dataset(name, n)


class TorchEncoderLM(nn.Module):
    """A character model written as many people write one: torch's own ``nn.TransformerEncoderLayer`` blocks, called
    with a causal mask by keyword as ``nn.TransformerEncoder`` calls them, between an embedding and a linear head,
    on charlm's data."""

    def __init__(self, vocab: int, d_model: int = 32, heads: int = 4, layers: int = LAYERS) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.pos = nn.Parameter(torch.randn(SEQ, d_model) * 0.02)
        self.layers = nn.ModuleList(nn.TransformerEncoderLayer(d_model, heads, 2 * d_model, dropout=0.0, batch_first=True) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        mask = nn.Transformer.generate_square_subsequent_mask(idx.shape[1], dtype=h.dtype, device=h.device)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        return self.head(h)


MOE = ("mixtral",)
"""Mixture-of-experts models of tests/strategies/expert_parallel/moe_zoo.py (for ep)."""


def _moe() -> Any:
    from tests.strategies.expert_parallel import moe_zoo

    return moe_zoo


def charlm_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    """Next-character cross entropy in the logits' dtype (charlm's ``lm_loss`` rounds to float32)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[1].reshape(-1))


def loss_fn(name: str) -> Any:
    if name in MOE:
        return _moe().loss_fn
    return charlm_loss if name in ("charlm", "torchenc") else zoo.parity_loss_fn(name)


def trainer(name: str, strategy: str, options: dict[str, Any], **settings: Any) -> Trainer:
    base: dict[str, Any] = dict(
        strategy=strategy,
        strategy_options=dict(options),
        global_batch_size=harness.GLOBAL_BATCH,
        max_steps=harness.STEPS,
        precision="32",
        clip_grad_norm=harness.CLIP,
        seed=0,
        progress_bar=False,
        log_every=1,
    )
    base.update(settings)
    return Trainer(optimizer=harness.sgd, loss_fn=loss_fn(name), **base)


def train(name: str, strategy: str = "single", options: dict[str, Any] | None = None, **settings: Any) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """One cell in this process (alone, or as one rank of a launch): the summary and rank 0's consolidated state.
    Settings that start with ``_`` are the cell's, not the Trainer's: ``_samples`` (the data set's size),
    ``_meta`` (charlm built on the meta device), ``_reset`` (Dynamo's caches cleared first: the cell
    compiles as the first run of a process does)."""
    from shardwise.strategies import materialize

    own = {k: settings.pop(k) for k in list(settings) if k.startswith("_")}
    if own.get("_reset"):
        torch._dynamo.reset()
    model = build(name, str(settings.get("precision", "32")), meta=bool(own.get("_meta")))
    materialize.note_build_state(model)
    t = trainer(name, strategy, options or {}, **settings)
    data = dataset(name, int(own.get("_samples", harness.SAMPLES)))
    t._check(model, data)
    summary, state = t._fit(model, data, None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return summary, state


def _worker(cells: Sequence[Cell]) -> list[tuple[dict[str, Any], dict[str, torch.Tensor] | None, float, list[int]]]:
    """Every cell in turn, the tp collective counter's operator calls counted (`DISPATCHES`)."""
    import shardwise.strategies.tensor_parallel as tp

    tp.collective_counter_mode = _counting_counter_mode  # type: ignore[assignment]
    out = []
    for cell in cells:
        DISPATCHES.clear()
        start = time.perf_counter()
        summary, state = train(cell[0], cell[1], cell[2], **cell[3])
        out.append((summary, state, time.perf_counter() - start, list(DISPATCHES)))
    return out


def run_cells(cells: Sequence[Cell], nproc: int = 2, label: str = "") -> dict[Any, tuple[dict[str, Any], dict[str, torch.Tensor], list[int]]]:
    """``cells`` one after another in one launch of ``nproc`` processes; rank 0's (summary, state, tp counter
    calls per counted step) by `key`.
    Prints the launch's time and each cell's."""
    start = time.perf_counter()
    results = launch(_worker, list(cells), nproc=nproc, threads_per_proc=1, timeout=600)[0]
    print(f"\n[compile cells {label}] one launch of {nproc}: {time.perf_counter() - start:.1f}s", flush=True)
    for cell, (_, _, seconds, _) in zip(cells, results, strict=True):
        print(f"  {seconds:6.1f}s  {cell[0]} {cell[1]} {cell[2] or ''} {cell[3]}", flush=True)
    return {key(c): (r[0], r[1], r[3]) for c, r in zip(cells, results, strict=True)}  # type: ignore[misc]


def key(cell: Cell) -> Any:
    return harness._key(cell)


def relative_difference(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    """max |a - b| over every floating tensor, divided by max |b| (the uncompiled run's largest weight)."""
    scale = max(v.double().abs().max().item() for v in ref.values() if v.is_floating_point() and v.numel())
    return harness.max_difference(state, ref) / scale


DISPATCHES: list[int] = []
"""Calls of the tp collective counter's ``__torch_dispatch__`` in each step it counted (this process)."""


def _counting_counter_mode() -> type:
    from shardwise.strategies.counting import collective_counter_mode

    base = collective_counter_mode()

    class Counted(base):  # type: ignore[misc, valid-type]
        def __enter__(self) -> Any:
            DISPATCHES.append(0)
            return super().__enter__()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            DISPATCHES[-1] += 1
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Counted
