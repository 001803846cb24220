"""The tensor-parallel cells of the model matrix: HF Llama, HF GPT-2, a nanoGPT-style GPT with tied
embeddings, BERT and ViT under tp (degree 2), tp + sequence parallelism, and dp2 x tp2.

Every cell trains 5 float64 steps with a clip that acts (tests/support/harness.py) and must match
`single` within 1e-9; ``check_replicas=True`` hashes the replicated parameters across the tp ranks
after every step and fails the run on the first that differs. One 2-process launch runs all
models' tp and tp + SP cells and one resume per model (3 steps, a checkpoint, resumed to 5: equal
bit for bit to the uninterrupted cell); one 4-process launch runs dp2 x tp2 for all models. The
consolidated weights load into a fresh model with ``strict=True``, and a tp checkpoint (DCP shards,
GPT-2's fused q|k|v permuted in the run) exports to the original layout.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.strategies.tensor_parallel import TensorParallel
from tests.support import harness, zoo

pytest.importorskip("transformers")

MODELS = ("llama", "gpt2", "nanogpt", "bert", "vit")
RESUME_SP = {"llama": True, "gpt2": False, "nanogpt": True, "bert": False, "vit": True}
"""Which mode each model's resume check runs in (both modes across the five models)."""


def _opts(sp: bool) -> dict[str, Any]:
    return {"tp": 2, "sequence_parallel": sp, "check_replicas": True}


def _tp_worker(models: tuple[str, ...], root: str) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for name in models:
        for sp in (False, True):
            # The cell of the resume mode also writes a checkpoint at step 3; a second run resumes from it.
            extra = {"out": os.path.join(root, name), "checkpoint_every": 3} if sp == RESUME_SP[name] else {}
            summary, state = harness.train(name, "tp", _opts(sp), **extra)
            out[(name, sp)] = (summary.get("tp"), state)
        step3 = os.path.join(root, name, "checkpoints", "step-00000003")
        out[(name, "resumed")] = harness.train(name, "tp", _opts(RESUME_SP[name]), out=os.path.join(root, name + "-resumed"), resume=step3)[1]
    _adamw_tp_worker(root)  # GPT-2 with AdamW, for test_gpt2_fused_optimizer_state_...
    return out


# -- GPT-2's fused c_attn: its optimizer state saved in the original layout (AdamW's two moments) --------


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)


def _adamw_fit(strategy: str, options: dict[str, Any] | None = None, **settings: Any) -> torch.nn.Module:
    from shardwise import Trainer

    model = zoo.build("gpt2")
    t = Trainer(
        optimizer=adamw,
        loss_fn=zoo.parity_loss_fn("gpt2"),
        strategy=strategy,
        strategy_options=dict(options or {}),
        global_batch_size=harness.GLOBAL_BATCH,
        precision="64",
        clip_grad_norm=harness.CLIP,
        seed=0,
        progress_bar=False,
        **settings,
    )
    t._check(model, zoo.dataset("gpt2", harness.SAMPLES))
    t._fit(model, zoo.dataset("gpt2", harness.SAMPLES), None, return_state=True)
    return model


def _adamw_tp_worker(root: str) -> None:
    """GPT-2 under tp=2 with AdamW: 3 steps and a (sharded) checkpoint at step 3."""
    _adamw_fit("tp", {"tp": 2}, max_steps=3, checkpoint_every=3, out=os.path.join(root, "gpt2-adamw-tp"))


def _moments(step_dir: str) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's state per parameter name, whole, from a checkpoint of any strategy."""
    from shardwise.checkpoint import files, parameter_names
    from shardwise.checkpoint.names import optimizer_state_by_name
    from shardwise.checkpoint.sharded import read_sharded_full

    path = Path(step_dir)
    if (path / "dcp").is_dir():
        osd = read_sharded_full(path)["optimizer"]
    else:
        model = zoo.build("gpt2")
        osd = optimizer_state_by_name(files.read(path, 0)[0]["optimizer"], parameter_names(model, adamw(model.parameters())))
    return {name: {k: v for k, v in entry.items() if k in ("exp_avg", "exp_avg_sq")} for name, entry in osd["state"].items()}


def check_adamw_resume(root: str) -> None:
    """The tp checkpoint holds single's moments at step 3, and resumed under single to step 5 they
    equal an uninterrupted single run's. The moments of c_attn's k bias (its gradient is zero in
    exact arithmetic: softmax ignores a constant added to a query's scores) are rounding noise,
    below the absolute tolerances; a q|k|v block of another head swapped in differs by far more."""
    single = os.path.join(root, "gpt2-adamw-single")
    _adamw_fit("single", max_steps=5, checkpoint_every=3, keep_last=2, out=single)
    tp3 = os.path.join(root, "gpt2-adamw-tp", "checkpoints", "step-00000003")
    resumed = os.path.join(root, "gpt2-adamw-resumed")
    _adamw_fit("single", max_steps=5, checkpoint_every=5, out=resumed, resume=tp3)
    pairs = [
        (tp3, os.path.join(single, "checkpoints", "step-00000003")),
        (os.path.join(resumed, "checkpoints", "step-00000005"), os.path.join(single, "checkpoints", "step-00000005")),
    ]
    for got_dir, want_dir in pairs:
        got, want = _moments(got_dir), _moments(want_dir)
        assert sorted(got) == sorted(want)
        fused = [n for n in got if ".attn.c_attn." in n]
        assert len(fused) == 8 and sum(n.endswith(".bias") for n in fused) == 4  # every c_attn weight and bias, 4 layers
        for name in want:
            for key, atol in (("exp_avg", 1e-12), ("exp_avg_sq", 1e-18)):
                torch.testing.assert_close(got[name][key], want[name][key], rtol=1e-7, atol=atol, msg=lambda m, n=name, k=key: f"{n} {k}: {m}")


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[Any, Any], str]:
    from shardwise import launch

    root = str(tmp_path_factory.mktemp("tp_matrix"))
    results = launch(_tp_worker, MODELS, root, nproc=2, threads_per_proc=1, timeout=600)
    return results[0], root


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_tp_matches_single(tp_runs: tuple[dict[Any, Any], str], name: str, sp: bool) -> None:
    summary, state = tp_runs[0][(name, sp)]
    harness.assert_matches_single(name, state, what=f"tp2{' + sp' if sp else ''}")
    assert summary["plan"], "nothing was split"
    assert summary["sequence_parallel"] is sp


def test_what_each_model_split(tp_runs: tuple[dict[Any, Any], str]) -> None:
    plans = {name: tp_runs[0][(name, False)][0]["plan"] for name in MODELS}
    # Llama: its own declared plan (q, k, v, o; gate, up, down) in each of 4 layers.
    assert len(plans["llama"]) == 28 and plans["llama"]["model.layers.3.self_attn.k_proj"] == "colwise"
    # GPT-2: the fused Conv1D c_attn split by heads, c_proj by rows.
    assert plans["gpt2"]["transformer.h.0.attn.c_attn"] == "colwise" and plans["gpt2"]["transformer.h.0.attn.c_proj"] == "rowwise"
    # nanoGPT: its attention reshapes with its input's width (c // n_head), so it stays whole; the MLP splits.
    assert sorted(plans["nanogpt"]) == sorted(f"transformer.h.{i}.mlp.{n}" for i in range(4) for n in ("c_fc", "c_proj"))
    # BERT and ViT: q/k/v colwise, attention.output.dense rowwise, intermediate.dense / output.dense.
    assert plans["bert"]["bert.encoder.layer.0.attention.output.dense"] == "rowwise"
    assert plans["bert"]["bert.encoder.layer.0.intermediate.dense"] == "colwise"
    assert len(plans["vit"]) == 24
    sections = {name: tp_runs[0][(name, True)][0] for name in MODELS}
    assert sections["llama"]["plan_source"] == "declared" and sections["gpt2"]["plan_source"] == "auto"
    assert sections["gpt2"]["fused"] == [f"transformer.h.{i}.attn.c_attn" for i in range(4)]
    assert sections["nanogpt"]["whole"] == [f"transformer.h.{i}.attn" for i in range(4)]
    # Under sequence parallelism every norm inside a block has its gradient summed over tp, whatever its class.
    assert sorted(sections["llama"]["grad_summed"]) == sorted(
        f"model.layers.{i}.{n}.weight" for i in range(4) for n in ("input_layernorm", "post_attention_layernorm")
    )
    assert len(sections["nanogpt"]["grad_summed"]) == 16 and len(sections["bert"]["grad_summed"]) == 16


def test_gpt2_fused_optimizer_state_is_saved_in_the_original_layout_and_resumes_under_single(tp_runs: tuple[dict[Any, Any], str]) -> None:
    """GPT-2's c_attn (q|k|v stacked, permuted per rank in the run): AdamW's exp_avg and exp_avg_sq
    of its weight and bias, in a tp checkpoint and after resuming it under single, equal single's."""
    check_adamw_resume(tp_runs[1])


@pytest.mark.parametrize("name", MODELS)
def test_a_tp_checkpoint_resumes_bit_exact_and_loads_into_a_fresh_model(tp_runs: tuple[dict[Any, Any], str], name: str) -> None:
    runs = tp_runs[0]
    resumed, uninterrupted = runs[(name, "resumed")], runs[(name, RESUME_SP[name])][1]
    assert set(resumed) == set(uninterrupted)
    for k, v in uninterrupted.items():
        assert torch.equal(resumed[k], v), f"{name}: {k} differs after resume"
    fresh = zoo.build(name, seed=1)
    fresh.load_state_dict(uninterrupted, strict=True)
    for k, v in fresh.state_dict().items():
        assert torch.equal(v, uninterrupted[k]), k


def test_a_tp_checkpoint_exports_in_the_original_layout(tp_runs: tuple[dict[Any, Any], str], tmp_path: Any) -> None:
    """GPT-2's c_attn is permuted in the run (each rank's shard holds its heads' q, k, v); the
    sharded checkpoint and its export hold the original layout: they equal 3 steps of `single`."""
    safetensors = pytest.importorskip("safetensors.torch")
    from shardwise.checkpoint import export_safetensors

    root = tp_runs[1]
    step3 = os.path.join(root, "gpt2", "checkpoints", "step-00000003")
    export_safetensors(step3, tmp_path / "gpt2.safetensors")
    exported = safetensors.load_file(str(tmp_path / "gpt2.safetensors"))
    single3 = harness.train("gpt2", max_steps=3)[1]
    assert single3 is not None
    for k, v in exported.items():
        assert (v.double() - single3[k].double()).abs().max().item() <= harness.TOL, k
    model = zoo.build("gpt2", seed=1)
    model.load_state_dict(exported, strict=True)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied after loading


def test_dp2_x_tp2_matches_single() -> None:
    cells = [(name, "tp", {"tp": 2, "check_replicas": True}) for name in MODELS]
    results = harness.run_cells(cells, nproc=4)
    for cell in cells:
        summary, state = harness.result(results, cell)
        assert summary["tp"]["dp"] == 2 and summary["tp"]["degree"] == 2
        harness.assert_matches_single(cell[0], state, what="dp2 x tp2")


def test_resnet_under_tp_is_refused_before_launch_with_a_true_reason() -> None:
    model = zoo.build("resnet")
    for sp in (False, True):
        with pytest.raises(
            ConfigError, match=r"ResNetForImageClassification is a convolutional network .* tensor parallelism splits linear layers, not convolutions"
        ):
            TensorParallel(tp=2, sequence_parallel=sp).plan(2, model=model)
    t = harness.trainer("resnet", "tp", {"tp": 2}, nproc=2)
    with pytest.raises(ConfigError, match="convolutional network"):
        t.fit(model, zoo.dataset("resnet", harness.SAMPLES))
