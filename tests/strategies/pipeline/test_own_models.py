"""The pipeline on models written by hand (tests/support/own_models.py): each trains equal to
``single`` in float64 at 2 stages (pp 2, GPipe) and 4 stages (pp 2 x ``virtual_stages=2``,
interleaved 1F1B: four processes on this machine's two cores would cost more than the two chunks
per rank), or is refused before launch with a true reason. The code in their ``forward`` runs:
the zero-scaled MLP stays at ln 2 (the old split by children trained it to 0.10); weights tied
across stages (a module used twice, a head tied to the embedding) start from the first owner's
values even when the ranks build different ones; checkpoints load under ``single``.

One 2-process launch runs every cell (about 30 s); the references train in this process.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from shardwise import Trainer, launch
from shardwise.errors import ConfigError
from tests.support.own_models import OWN_MODELS, build_own, own_dataset, own_loss

pytestmark = [pytest.mark.dist, pytest.mark.timeout(400)]

STEPS = 5
SAMPLES = 32
CLIP = 0.2
TOL = 1e-9
TWO = {"pp": 2, "schedule": "gpipe", "microbatches": 2}
FOUR = {"pp": 2, "schedule": "interleaved", "microbatches": 2}  # 2 ranks x 2 chunks: 4 stages
FOUR_REFUSED = ("mlp", "mlp_zero")  # three layers cannot fill four stages
CELLS = [(n, "two") for n in OWN_MODELS] + [(n, "four") for n in OWN_MODELS if n not in FOUR_REFUSED]
TIED = {"sharednet": "mix.weight", "gpt": "lm_head.weight"}  # a weight held by both ranks at 2 stages
ZERO_STEPS = 40


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def trainer(name: str, strategy: str = "single", options: dict[str, Any] | None = None, **settings: Any) -> Trainer:
    base: dict[str, Any] = dict(
        strategy=strategy,
        strategy_options=dict(options or {}),
        global_batch_size=8,
        max_steps=STEPS,
        precision="64",
        clip_grad_norm=CLIP,
        seed=0,
        progress_bar=False,
        log_every=1,
    )
    base.update(settings)
    return Trainer(optimizer=sgd, loss_fn=own_loss(name), **base)


def train(name: str, strategy: str = "single", options: dict[str, Any] | None = None, perturb: str | None = None, **settings: Any) -> Any:
    """One run in this process (alone, or as one rank of a launch): the summary and the whole final
    state (a pipeline's gathered to rank 0; None on the others). ``perturb``: on ranks other than 0 that tensor starts
    different, as a rank that seeds its own model would build it."""
    model = build_own(name)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    if perturb and rank != 0:
        with torch.no_grad():
            model.get_parameter(perturb).add_(1.0)
    t = trainer(name, strategy, options, **settings)
    t._check(model, own_dataset(name, SAMPLES))
    summary, state = t._fit(model, own_dataset(name, SAMPLES), None, return_state=True)
    if strategy == "single":
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return summary, state


def _worker(root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name, stages in CELLS:
        out[(name, stages)] = train(name, "pipeline", TWO if stages == "two" else FOUR)
    for name, tensor in TIED.items():
        out[(name, "perturbed")] = train(name, "pipeline", TWO, perturb=tensor)
    out["zero"] = train("mlp_zero", "pipeline", TWO, max_steps=ZERO_STEPS, clip_grad_norm=None)
    for name in ("postransformer", "sharednet"):
        out[(name, "stopped")] = train(name, "pipeline", TWO, max_steps=3, out=f"{root}/{name}")
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[Any, Any]], Any]:
    root = tmp_path_factory.mktemp("own")
    return launch(_worker, str(root), nproc=2, threads_per_proc=1, timeout=380), root  # type: ignore[return-value]


_REFS: dict[Any, Any] = {}


def reference(name: str, **settings: Any) -> Any:
    key = (name, tuple(sorted(settings.items())))
    if key not in _REFS:
        _REFS[key] = train(name, **settings)
    return _REFS[key]


def max_difference(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert list(state) == list(ref), f"keys differ from single's: {sorted(set(state) ^ set(ref))[:5]} (or their order)"
    return max((state[k].double() - v.double()).abs().max().item() for k, v in ref.items() if v.is_floating_point())


@pytest.mark.parametrize("cell", CELLS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_each_model_trains_equal_to_single(runs, cell):
    results, _ = runs
    ref_summary, ref = reference(cell[0])
    moved = max((ref[k] - v).abs().max().item() for k, v in build_own(cell[0]).state_dict().items())
    assert moved > 1e-3, f"{cell[0]}: single did not move the parameters"
    for rank in range(2):
        summary, state = results[rank][cell]
        assert abs(summary["train_loss"] - ref_summary["train_loss"]) <= TOL
    assert max_difference(results[0][cell][1], ref) <= TOL  # the state is gathered to rank 0
    section = results[0][cell][0]["pipeline"]
    assert len(section["stage_layers"]) == (2 if cell[1] == "two" else 4)


def test_the_split_follows_the_forward(runs):
    """Where each model was cut: gpt's forward has an ``assert`` on a traced size, so it is split by
    its block list, proven equal on a sample; the others by their traced forward."""
    results, _ = runs
    layers = {name: results[0][(name, "two")][0]["pipeline"]["stage_layers"] for name in OWN_MODELS}
    assert layers["cnn"] == [["conv1", "conv2"], ["fc1", "fc2"]]
    assert layers["sharednet"] == [["inp", "blocks.0", "mix"], ["blocks.1", "blocks.2", "blocks.3", "out"]]
    assert layers["gpt"] == [["transformer.h.0", "transformer.h.1"], ["transformer.h.2", "transformer.h.3"]]


@pytest.mark.parametrize("name", FOUR_REFUSED)
def test_four_stages_of_a_three_layer_mlp_are_refused_before_launch(name):
    with pytest.raises(ConfigError, match=r"the model has 3 layers .* but the pipeline needs 4 stages"):
        trainer(name, "pipeline", FOUR, nproc=2)._check(build_own(name), own_dataset(name, SAMPLES))


def test_the_zero_scaled_mlp_stays_at_ln2_as_under_single(runs):
    """Its forward multiplies the last hidden layer by 0: nothing but the head's bias can learn, so
    the loss stays at ln 2 (the split by children skipped the code and reached 0.10)."""
    results, _ = runs
    ref_summary, ref = reference("mlp_zero", max_steps=ZERO_STEPS, clip_grad_norm=None)
    summary, state = results[0]["zero"]
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) <= TOL
    assert abs(summary["train_loss"] - math.log(2)) < 0.01
    assert max_difference(state, ref) <= TOL


@pytest.mark.parametrize("name", list(TIED))
def test_a_weight_tied_across_stages_starts_from_the_first_owners_values(runs, name):
    """Rank 1 builds the tied weight differently: the start-of-run broadcast overwrites its copy with
    rank 0's, so the run equals single started from rank 0's model (which is unperturbed)."""
    results, _ = runs
    _, ref = reference(name)
    _, state = results[0][(name, "perturbed")]
    assert max_difference(state, ref) <= TOL, f"{name}: the run is not single's from rank 0's weights"


@pytest.mark.parametrize("name", ["postransformer", "sharednet"])
def test_a_pipeline_checkpoint_resumes_under_single(runs, name):
    """A bare position table and a module held by two stages keep their names: single resumes the
    pipeline's step-3 checkpoint (model and optimizer) and ends where single's own 5 steps end."""
    results, root = runs
    assert results[0][(name, "stopped")][0]["last_checkpoint"].endswith("step-00000003")
    _, resumed = train(name, out=str(root / name), resume="auto")
    _, ref = reference(name)
    assert max_difference(resumed, ref) <= TOL
