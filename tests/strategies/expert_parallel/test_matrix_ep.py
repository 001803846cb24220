"""Expert parallelism against ``single`` on six MoE families (float64, 5 SGD steps, a clip that acts).

One 2-process launch: ``ddp`` with ``ep=2`` (each rank 2 of 4 experts) for Mixtral, Qwen2-MoE,
OLMoE, GraniteMoE, Qwen3-MoE and DeepSeek-V3, Mixtral with its load-balancing loss on, ``zero3`` and ``zero2`` with ``ep=2``
(the zero3 cell on Mixtral with its experts' forward arguments renamed: matched by position), GPT-OSS,
and two resumes (ddp and zero3: a checkpoint at step 3, a second run from it to step 5, so the
experts' whole optimizer state is saved and sliced again). One 4-process launch: ``ep=2`` inside dp 4
(dp_outer 2) for the four families, ``ep=4`` (dp_outer 1) for OLMoE, ``hsdp`` (2 x 2) and ``zero3``
with ``ep=2``, and the load-balancing cell again; the ep=4 cell with ``accumulate=2`` and an evaluation
on 12 samples (3 forwards a rank). Not 13: trainer/evaluate.py's padding forward for a rank with
fewer evaluation batches is skipped (``keys = keys or eval_fn(...)``), so the ranks' all-to-alls
would not meet (reported, not fixed here). Within 1e-9 of ``single`` on the same global batch.

The router's auxiliary loss: transformers computes it per forward, on that forward's tokens (the
fraction of tokens each expert gets times its mean router probability). Under dp each rank
computes it on its own slice, so a dp run of N ranks equals ``single`` with ``accumulate=N`` (each
micro-batch's loss, auxiliary term included, computed on its own N-th of the batch), not
``single`` on the whole batch at once; that is what the ``_aux`` cells are compared with.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shardwise import launch
from tests.strategies.expert_parallel import moe_zoo
from tests.support import harness

pytest.importorskip("transformers")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(500)]  # two launches of 8-10 cells: ~40 s each alone, 3-5x on a loaded machine

Cell = tuple[str, str, dict[str, Any], dict[str, Any]]
FOUR: list[Cell] = [(f, "ddp", {"ep": 2}, {}) for f in moe_zoo.FAMILIES] + [
    ("olmoe", "ddp", {"ep": 4}, {"accumulate": 2, "val": 12}),  # micro-batches, and an evaluation (its forwards exchange tokens too)
    ("mixtral_aux", "ddp", {"ep": 2}, {}),
    ("qwen2_moe", "hsdp", {"ep": 2}, {}),
    ("granitemoe", "zero3", {"ep": 2}, {}),
]
_REFS: dict[tuple[str, int], Any] = {}


def _reference(name: str, nproc: int) -> Any:
    accumulate = nproc if name.endswith("_aux") else 1
    if (name, accumulate) not in _REFS:
        _REFS[(name, accumulate)] = moe_zoo.train(name, accumulate=accumulate)
    return _REFS[(name, accumulate)]


def _two(root: Path) -> list[Cell]:
    cells: list[Cell] = [(f, "ddp", {"ep": 2}, {}) for f in moe_zoo.FAMILIES + moe_zoo.MORE]
    cells += [("mixtral_aux", "ddp", {"ep": 2}, {}), ("olmoe", "zero2", {"ep": 2}, {})]
    cells += [("mixtral_renamed", "zero3", {"ep": 2}, {}), ("gpt_oss", "ddp", {"ep": 2}, {})]
    for name, strategy in (("mixtral", "ddp"), ("qwen2_moe", "zero3")):
        first = str(root / strategy)
        cells.append((name, strategy, {"ep": 2}, {"out": first, "checkpoint_every": 3}))
        cells.append((name, strategy, {"ep": 2}, {"out": first + "-resumed", "resume": first + "/checkpoints/step-00000003"}))
    return cells


def _check(cells: list[Cell], states: list[Any], nproc: int) -> dict[str, float]:
    diffs = {}
    for (name, strategy, opts, settings), state in zip(cells, states, strict=True):
        ref = _reference(name, nproc)
        diff = harness.max_difference(state, ref)
        what = f"{name} {strategy} ep={opts['ep']} on {nproc} ranks{' (resumed)' if 'resume' in settings else ''}"
        diffs[what] = diff
        assert diff <= harness.TOL, f"{what}: {diff:.3g} off single"
        assert harness.max_difference(ref, moe_zoo.build(name).state_dict(), integers=False) > 1e-4, f"{name}: training did not move"
    return diffs


def test_ep2_on_two_ranks_matches_single(tmp_path: Path) -> None:
    cells = _two(tmp_path)
    states = launch(moe_zoo.run_cells, cells, nproc=2, threads_per_proc=1, timeout=600)[0]
    _check(cells, states, 2)
    for name in ("mixtral", "qwen2_moe", "olmoe", "granitemoe", "mixtral_aux"):
        assert moe_zoo.first_grad_norm(name) > 2 * harness.CLIP, f"{name}: the clip does not act"


def test_ep_inside_dp_on_four_ranks_matches_single() -> None:
    states = launch(moe_zoo.run_cells, FOUR, nproc=4, threads_per_proc=1, timeout=600)[0]
    _check(FOUR, states, 4)
