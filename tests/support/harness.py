"""The model matrix's mechanics, shared by tests/strategies/*/test_matrix_*.py.

A cell is (model name, strategy, strategy options). Every cell trains the same float64
model from one seed for ``STEPS`` AdamW steps on the same global batches with a clip norm so
small that every step clips, and is compared with ``single`` (the reference, itself checked
against a hand-written loop in test_batches.py). Many cells run in one launch
(``run_cells``), so the matrix costs a few process starts, not one per cell.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from shardwise import Trainer, launch
from tests.support import zoo

STEPS = 5
GLOBAL_BATCH = 8
SAMPLES = 64
CLIP = 0.2
"""Below the first step's gradient norm of every model (asserted by ``assert_matches_single``),
so clipping acts: a strategy that clips a local shard's norm, or forgets to clip, differs."""
TOL = 1e-9

Cell = tuple[Any, ...]
"""(model name, strategy name, strategy options[, Trainer settings])."""


def sgd(params: Any) -> torch.optim.Optimizer:
    # SGD with momentum, not Adam: Adam divides each gradient by its own root mean square, so it
    # barely sees a gradient's scale and a wrong clip (a shard's norm, a missing clip) would pass.
    # SGD's step is proportional to the clipped gradient, and it adds no noise of its own (Adam
    # turns the rounding noise of an attention key's bias, zero in exact arithmetic, into steps).
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def trainer(name: str, strategy: str = "single", options: dict[str, Any] | None = None, *, own_loss: bool = False, **settings: Any) -> Trainer:
    """The Trainer every cell uses (float64, clipping, the model's float64 loss; with ``own_loss``
    no loss_fn: the loss the model returns for a batch with labels)."""
    base: dict[str, Any] = dict(
        strategy=strategy,
        strategy_options=dict(options or {}),
        global_batch_size=GLOBAL_BATCH,
        max_steps=STEPS,
        precision="64",
        clip_grad_norm=CLIP,
        seed=0,
        progress_bar=False,
        log_every=1,
    )
    base.update(settings)
    return Trainer(optimizer=sgd, loss_fn=None if own_loss else zoo.parity_loss_fn(name), **base)


def train(
    name: str, strategy: str = "single", options: dict[str, Any] | None = None, *, val: int = 0, **settings: Any
) -> tuple[dict[str, Any], dict[str, torch.Tensor] | None]:
    """Train one cell in this process (alone for ``single``, or as one rank of a running job);
    ``val`` samples of validation data when not 0.

    Returns the summary and, on rank 0, the consolidated model state (None on other ranks)."""
    model = zoo.build(name)
    t = trainer(name, strategy, options, **settings)
    t._check(model, zoo.dataset(name, SAMPLES))
    val_data = zoo.dataset(name, val, seed=1) if val else None
    summary, state = t._fit(model, zoo.dataset(name, SAMPLES), val_data, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return summary, state


def _cells_worker(cells: Sequence[Cell], settings: dict[str, Any]) -> list[tuple[dict[str, Any], dict[str, torch.Tensor] | None]]:
    return [train(c[0], c[1], c[2], **{**settings, **(c[3] if len(c) > 3 else {})}) for c in cells]


def run_cells(cells: Sequence[Cell], nproc: int = 2, **settings: Any) -> dict[Cell, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
    """Run ``cells`` one after another in one launch of ``nproc`` processes; rank 0's results."""
    results = launch(_cells_worker, list(cells), settings, nproc=nproc, threads_per_proc=1, timeout=600)
    return {_key(c): r for c, r in zip(cells, results[0], strict=True)}  # type: ignore[misc]


def _key(cell: Cell) -> Any:
    return tuple(tuple(sorted(part.items())) if isinstance(part, dict) else part for part in cell)


def result(results: dict[Any, Any], cell: Cell) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    return results[_key(cell)]  # type: ignore[no-any-return]


_REFERENCES: dict[Any, dict[str, torch.Tensor]] = {}


def reference(name: str, **settings: Any) -> dict[str, torch.Tensor]:
    """``single``'s final state for ``name`` (computed once per test process and settings)."""
    key = (name, tuple(sorted(settings.items())))
    if key not in _REFERENCES:
        _REFERENCES[key] = train(name, **settings)[1]  # type: ignore[assignment]
    return _REFERENCES[key]


def max_difference(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], *, integers: bool = True) -> float:
    """Largest absolute difference over every floating tensor; the key sets must be equal, and
    integer buffers (BatchNorm's batch counter) equal too unless ``integers`` is False."""
    missing, extra = sorted(set(ref) - set(state)), sorted(set(state) - set(ref))
    assert not missing and not extra, f"state keys differ from single's: missing {missing[:5]}, extra {extra[:5]}"
    worst = 0.0
    for k, v in ref.items():
        got = state[k]
        assert got.shape == v.shape, f"{k}: shape {tuple(got.shape)} != single's {tuple(v.shape)}"
        if v.is_floating_point():
            worst = max(worst, (got.double() - v.double()).abs().max().item() if v.numel() else 0.0)
        elif integers:
            assert torch.equal(got, v), f"{k}: integer buffer {got.tolist()} differs from single's {v.tolist()}"
    return worst


def assert_matches_single(name: str, state: dict[str, torch.Tensor], tol: float = TOL, what: str = "", **settings: Any) -> float:
    """The cell's parameters within ``tol`` of single's (trained with the same ``settings``) after
    STEPS steps, and training moved them."""
    ref = reference(name, **settings)
    diff = max_difference(state, ref)
    assert diff <= tol, f"{name} {what}: largest parameter difference from single {diff:.3g} > {tol:g}"
    moved = max_difference(ref, zoo.build(name).state_dict(), integers=False)
    assert moved > 1e-4, f"{name}: training did not move the parameters ({moved:.3g})"
    norm = first_grad_norm(name)
    assert norm > 2 * CLIP, f"{name}: first gradient norm {norm:.3g} does not exceed the clip norm {CLIP}: clipping untested"
    return diff


def first_grad_norm(name: str) -> float:
    """The gradient norm of the first global batch at the initial weights (what the first step clips)."""
    model = zoo.build(name)
    data = zoo.dataset(name, SAMPLES)
    batch = torch.utils.data.default_collate([data[i] for i in range(GLOBAL_BATCH)])
    loss_fn = zoo.parity_loss_fn(name)
    from shardwise.data.batches import call_model, loss_from_output

    output = call_model(model, batch)
    (loss_fn(output, batch) if loss_fn else loss_from_output(output, batch)).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))
