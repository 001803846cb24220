"""Pipeline parallelism equals the single-process reference (float64, a tiny CharGPT, AdamW,
clipping on): every schedule at pp=2, pp=2 x dp=2 at world size 4, checkpoints that move
between ``pipeline`` and ``single``, evaluation through the wrapped model, and the errors that
must reach every rank instead of hanging the others. The activations and gradients sent
between stages are in the recorder, byte for byte as the formula gives them.

One launch per world size runs every fit of that size (a process start costs ~2.5 s here).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

from shardwise import Engine, Trainer, launch
from shardwise.errors import ConfigError
from shardwise.strategies.pipeline import PipelineRun
from shardwise.tools.recipes.charlm import CharGPT
from tests.support.models import max_diff

pytestmark = pytest.mark.dist

COMMON = dict(precision="64", global_batch_size=8, max_steps=5, log_every=5, progress_bar=False, clip_grad_norm=0.5)
VAL = 21  # odd: at dp=2 the evaluation shards differ by one sample


def gpt() -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(11, 8, 16, 2, 4).double()


def tokens(n: int = 64, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randint(0, 11, (n, 8), generator=g), torch.randint(0, 11, (n, 8), generator=g))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def lm_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """charlm's loss in the model's own dtype (the recipe's casts to float32, which would cap parity at ~1e-7)."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def char_accuracy(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return (output.argmax(-1) == batch[1]).double().mean()


class Consolidate:
    """Keeps the whole trained weights (a collective: every rank calls it at the end of fit)."""

    state: dict[str, torch.Tensor]

    def on_fit_end(self, trainer: Any, engine: Engine, summary: dict[str, Any]) -> None:
        self.state = engine.consolidated_state_dict(engine._model)  # type: ignore[arg-type]


def fit(strategy: str, options: dict[str, Any] | None = None, **settings: Any) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    grab = Consolidate()
    model = gpt()
    trainer = Trainer(
        strategy=strategy,
        optimizer=adamw,
        loss_fn=lm_loss,
        metrics={"accuracy": char_accuracy},
        strategy_options=options or {},
        callbacks=[grab],
        **{**COMMON, **settings},
    )
    summary = trainer.fit(model, tokens(), tokens(VAL, seed=3))
    state = getattr(grab, "state", None) or {k: v.detach().clone() for k, v in model.state_dict().items()}
    return state, summary


PP2 = {
    "gpipe": dict(pp=2, microbatches=4, schedule="gpipe"),
    "1f1b": dict(pp=2, microbatches=4, schedule="1f1b"),
    "interleaved": dict(pp=2, microbatches=4, schedule="interleaved", virtual_stages=2),
}


def _engine_checks() -> dict[str, Any]:
    """Bring-your-own-loop: the wrapped model's forward, and a batch that does not split."""
    out: dict[str, Any] = {}
    engine = Engine(strategy="pipeline", strategy_options=dict(pp=2, microbatches=4, schedule="1f1b"), precision="64")
    model, _ = engine.setup(gpt(), adamw)
    x = tokens(6).tensors[0]  # 6 rows: a batch the evaluation path takes, the schedule does not
    model.eval()
    with torch.no_grad():
        out["forward"] = model(x)
    try:
        engine.forward_backward(model, [tokens(6).tensors], lambda m, b: lm_loss(m(b[0]), b))
    except ConfigError as exc:
        out["indivisible"] = str(exc)
    model.train()
    try:
        model(x)
    except RuntimeError as exc:
        out["grad_forward"] = str(exc)
    out["names"] = sorted(k for k, _ in model.named_parameters())
    run = engine.parallel
    assert isinstance(run, PipelineRun)
    out["stage_layers"] = run.stage_layers
    return out


WIDTH = 5  # every boundary of `chain` carries WIDTH features, wherever the stages are cut
TRAFFIC_STEPS = 3


def chain() -> nn.Module:
    """Four Linear(WIDTH, WIDTH) layers with tanh between them, float64: four stages at most."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(4):
        layers += [nn.Linear(WIDTH, WIDTH)] + ([nn.Tanh()] if i < 3 else [])
    return nn.Sequential(*layers).double()


def mse(output: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.mse_loss(output, batch[1])


def _traffic(options: dict[str, Any]) -> dict[str, Any]:
    """A run with no evaluation and no checkpoint: every pp/send and pp/recv is the schedule's."""
    g = torch.Generator().manual_seed(2)
    data = TensorDataset(torch.randn(32, WIDTH, generator=g, dtype=torch.float64), torch.randn(32, WIDTH, generator=g, dtype=torch.float64))
    trainer = Trainer(
        strategy="pipeline",
        strategy_options=options,
        optimizer=adamw,
        loss_fn=mse,
        precision="64",
        global_batch_size=8,
        max_steps=TRAFFIC_STEPS,
        log_every=TRAFFIC_STEPS,
        progress_bar=False,
    )
    summary = trainer.fit(chain(), data)
    return {"by_op": summary["comm"]["by_op"], "stage_layers": summary["pipeline"]["stage_layers"]}


def _world_of_two(tmp: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, options in PP2.items():
        out[name] = fit("pipeline", options)
    out["1f1b-accumulate"] = fit("pipeline", PP2["1f1b"], accumulate=2)
    # A pipeline run that stops at step 3 (single resumes it in the test process) ...
    out["stopped"] = fit("pipeline", PP2["gpipe"], max_steps=3, out=f"{tmp}/pipe")
    # ... and a pipeline run that resumes single's step-3 checkpoint.
    out["resumed"] = fit("pipeline", PP2["1f1b"], max_steps=6, out=f"{tmp}/single", resume="auto")
    out["engine"] = _engine_checks()
    out["traffic"] = {name: _traffic(options) for name, options in PP2.items()}
    return out


FOUR = {  # tensor parallel inside the stages, then the pipeline, then data parallel
    "ddp": dict(PP2["1f1b"], dp_strategy="ddp"),
    "interleaved-ddp": dict(PP2["interleaved"], dp_strategy="ddp"),
    "fsdp": dict(PP2["gpipe"], dp_strategy="fsdp"),
    "tp": dict(PP2["1f1b"], tp=2),
    "tp-sequence-parallel": dict(PP2["gpipe"], tp=2, sequence_parallel=True),
}


def _world_of_four() -> dict[str, Any]:
    return {case: fit("pipeline", options) for case, options in FOUR.items()}


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    return {"5": fit("single"), "6": fit("single", max_steps=6)}


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("pipeline")
    fit("single", max_steps=3, out=str(tmp / "single"))  # single's checkpoint at step 3, for the pipeline to resume
    return launch(_world_of_two, str(tmp), nproc=2, threads_per_proc=1), tmp  # type: ignore[return-value]


@pytest.fixture(scope="module")
def four() -> list[dict[str, Any]]:
    return launch(_world_of_four, nproc=4, threads_per_proc=1)  # type: ignore[no-any-return]


def _check_parity(result: tuple[dict[str, torch.Tensor], dict[str, Any]], ref: tuple[dict[str, torch.Tensor], dict[str, Any]]) -> None:
    got, summary = result
    want, ref_summary = ref
    assert list(got) == list(want)  # original names, in the model's order
    assert max_diff(want, got) < 1e-9
    assert abs(summary["train_loss"] - ref_summary["train_loss"]) < 1e-9
    assert summary["val_samples"] == VAL
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], abs=1e-9)
    assert summary["val_accuracy"] == pytest.approx(ref_summary["val_accuracy"], abs=1e-12)


@pytest.mark.parametrize("schedule", list(PP2))
def test_each_schedule_equals_single(schedule, two, reference):
    results, _ = two
    for rank in range(2):
        _check_parity(results[rank][schedule], reference["5"])
    section = results[0][schedule][1]["pipeline"]
    assert section["schedule"] == schedule and section["pp"] == 2 and section["microbatches"] == 4
    assert section["virtual_stages"] == (2 if schedule == "interleaved" else 1)
    v = section["virtual_stages"]
    assert section["bubble_predicted"] == pytest.approx(1 / (v * 4 + 1))
    assert 0.0 <= section["bubble_measured"] <= 1.0 and len(section["per_stage"]) == 2
    assert section["steps_measured"] == 4  # 5 steps, the first left out as warm-up
    assert section["tp"] == 1 and section["dp"] == 1 and section["dp_strategy"] == "ddp"
    # The step's loss gathered from the last stage: one small all_gather over pp per step (and
    # one at setup, when the stages align their clocks).
    assert results[0][schedule][1]["comm"]["by_op"]["pp/all_gather"]["count"] == 5 + 1


def test_accumulated_loader_micro_batches_are_one_pipeline_batch(two, reference):
    results, _ = two
    _check_parity(results[0]["1f1b-accumulate"], reference["5"])


def test_stages_split_chargpt_by_parameter_count(two):
    results, _ = two
    assert results[0]["engine"]["stage_layers"] == [["embed", "blocks.0", "blocks.1"], ["blocks.2", "blocks.3", "head"]]
    names0, names1 = results[0]["engine"]["names"], results[1]["engine"]["names"]
    assert all(n.startswith(("embed.", "blocks.0.", "blocks.1.")) for n in names0)
    assert all(n.startswith(("blocks.2.", "blocks.3.", "head.")) for n in names1)
    assert sorted(names0 + names1) == sorted(k for k, _ in gpt().named_parameters())


def test_the_wrapped_model_evaluates_like_the_model_on_every_rank(two):
    results, _ = two
    want = gpt().eval()(tokens(6).tensors[0])
    for rank in range(2):
        torch.testing.assert_close(results[rank]["engine"]["forward"], want, rtol=0, atol=1e-12)
        assert "does not carry gradients" in results[rank]["engine"]["grad_forward"]


def test_an_indivisible_batch_is_refused_on_every_rank_inside_forward_backward(two):
    results, _ = two
    for rank in range(2):
        assert "per-rank batch of 6 samples does not split into 4 equal pipeline micro-batches" in results[rank]["engine"]["indivisible"]


def test_a_pipeline_checkpoint_resumes_under_single(two, reference):
    results, tmp = two
    stopped = results[0]["stopped"][1]
    assert stopped["steps"] == 3 and stopped["last_checkpoint"].endswith("step-00000003")
    resumed = fit("single", max_steps=6, out=str(tmp / "pipe"), resume="auto")
    assert resumed[1]["resumed_from"].endswith("step-00000003")
    assert max_diff(reference["6"][0], resumed[0]) < 1e-9


def test_a_single_checkpoint_resumes_under_pipeline(two, reference):
    results, _ = two
    for rank in range(2):
        state, summary = results[rank]["resumed"]
        assert summary["resumed_from"].endswith("step-00000003") and summary["steps"] == 6
        assert max_diff(reference["6"][0], state) < 1e-9


@pytest.mark.parametrize("case", list(FOUR))
def test_2d_compositions_at_world_size_four_equal_single(case, four, reference):
    for rank in range(4):
        _check_parity(four[rank][case], reference["5"])
    summary = four[0][case][1]
    assert summary["world_size"] == 4 and summary["pipeline"]["pp"] == 2
    tp = FOUR[case].get("tp", 1)
    assert summary["pipeline"]["tp"] == tp and summary["pipeline"]["dp"] == 4 // (2 * tp)
    if case.endswith("ddp"):  # pp2 x dp2: each stage's gradients averaged across dp in one allreduce per step
        assert summary["comm"]["by_op"]["dp/all_reduce"]["count"] == 5


@pytest.mark.parametrize("schedule", list(PP2))
def test_stage_to_stage_bytes_are_recorded_as_the_formula_gives_them(schedule, two):
    """Per step and per stage boundary: microbatches x one micro-batch's activation forward, and
    the same bytes of gradient backward. At pp=2 every boundary joins the two ranks, so each rank
    sends one of the two over every boundary (interleaved: 4 stages, 3 boundaries) and receives the other."""
    results, _ = two
    options = PP2[schedule]
    m, stages = options["microbatches"], 2 * options.get("virtual_stages", 1)
    activation = (8 // m) * WIDTH * 8  # a micro-batch of 8 // m rows, WIDTH float64 features
    boundaries = stages - 1
    per_rank = TRAFFIC_STEPS * m * activation * boundaries
    sent = []
    for rank in range(2):
        traffic = results[rank]["traffic"][schedule]
        assert len(traffic["stage_layers"]) == stages
        send, recv = traffic["by_op"]["pp/send"], traffic["by_op"]["pp/recv"]
        assert send["sent_bytes"] == send["payload_bytes"] == per_rank and send["received_bytes"] == 0
        assert recv["received_bytes"] == recv["payload_bytes"] == per_rank and recv["sent_bytes"] == 0
        assert send["count"] == recv["count"] == TRAFFIC_STEPS * m * boundaries  # one message per micro-batch per boundary and direction
        sent.append(send["sent_bytes"])
    assert sum(sent) / TRAFFIC_STEPS / boundaries == 2 * m * activation  # forward and backward, per step, per boundary
