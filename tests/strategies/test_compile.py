"""``compile=`` under every strategy: a compiled run ends where the same run uncompiled ends.

Models: charlm's CharGPT (`shardwise.tools.recipes.charlm`, SDPA attention, on Python's documentation
text) and the zoo's Hugging Face Llama, 2 layers, float32, 5 SGD steps clipped at every step
(tests/support/charlm_model.py). "Agree" is the relative difference max |a - b| / max |b| over
every parameter after the 5 steps, b the uncompiled run's: at most 1e-5 in float32, 0 in float64.

Backends: Inductor (C++ code generation: the real thing, 10-30 s to compile a graph set cold, cached
in the machine's Inductor cache afterwards) for single and ddp on charlm, and for tp on charlm where
the collective counter's cost is measured; ``on:aot_eager`` (Dynamo and AOTAutograd, no code
generation) everywhere else, context parallelism (ring attention) and expert parallelism (Mixtral)
included. hsdp is not here: it needs 4 processes (2 x 2), too slow for this file;
it compiles per block as zero3 does (``Strategy.compile_unit == "blocks"``).

All 2-process cells run in ONE launch (``results``); each launch's and each cell's time is printed.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from tests.support import charlm_model as cm
from tests.support import harness

pytest.importorskip("transformers", reason="the model tests need transformers: pip install -e '.[dev]'")
pytestmark = [pytest.mark.dist, pytest.mark.timeout(600)]

TOL = 1e-5
ARGS = {"compile": "off"}
PP = {"pp": 2, "schedule": "1f1b", "microbatches": 4}
MAIN = [(m, s, o) for m in ("charlm", "llama") for s, o in (("ddp", {}), ("zero3", {}), ("tp", {"tp": 2}), ("pipeline", PP))]
MORE = [("charlm", s, {}) for s in ("zero1", "zero2", "local-sgd", "diloco")]
INDUCTOR = {("charlm", "ddp"), ("charlm", "single")}


def backend(name: str, strategy: str, options: dict[str, Any]) -> str:
    """Inductor for charlm's single and plain ddp (cp's ring breaks the graph into many: aot_eager there)."""
    return "on" if (name, strategy) in INDUCTOR and not options else "on:aot_eager"


def pair(name: str, strategy: str, options: dict[str, Any], **extra: Any) -> list[cm.Cell]:
    """The cell uncompiled and compiled; the compiled one clears Dynamo's caches first (``_reset``), so it compiles
    as a new process would and reports its own graphs (a graph cached by an earlier cell of the launch is reused
    without a word: zero1 after ddp reported graphs 0 and compile_s 0)."""
    compiled = {"compile": backend(name, strategy, options), "_reset": True, **extra}
    return [(name, strategy, options, {"compile": "off", **extra}), (name, strategy, options, compiled)]


RECOMPILE: cm.Cell = ("charlm", "ddp", {}, {"compile": "on:aot_eager", "_reset": True, "_samples": 44, "max_steps": None, "max_epochs": 1, "drop_last": False})
"""44 samples, global batch 8: five batches of 4 per rank, then one of 2 (``drop_last=False``); Dynamo's caches cleared
first, as in a process's first run."""
TP_INDUCTOR: cm.Cell = ("charlm", "tp", {"tp": 2}, {"compile": "on"})
F64 = pair("charlm", "zero3", {}, precision="64")
CHECKPOINTED = [("charlm", s, {}, {"compile": "on:aot_eager", "activation_checkpointing": ac}) for s, ac in (("ddp", "ops"), ("zero3", "blocks"))]
META: cm.Cell = ("charlm", "zero3", {}, {"compile": "on:aot_eager", "_meta": True})
CP = pair("charlm", "ddp", {"cp": 2})
EP = pair("mixtral", "ddp", {"ep": 2}, precision="64")
TORCH_BLOCKS = pair("torchenc", "zero3", {}, precision="64")
"""Blocks of torch's own class (``nn.TransformerEncoderLayer``): Dynamo skips torch's files, and tracing such a block's
whole call broke at FSDP2's hooks, so zero3 compiled none of them (graphs 0) before `compiling.compile_in_place`
compiled their forward instead."""


def resume_cells(root: str) -> list[cm.Cell]:
    """A compiled ddp run of 3 steps that saves a checkpoint, then the run resumed from it uncompiled to step 5."""
    first = ("charlm", "ddp", {}, {"compile": "on:aot_eager", "max_steps": 3, "checkpoint_every": 3, "out": f"{root}/compiled"})
    second = ("charlm", "ddp", {}, {"compile": "off", "resume": f"{root}/compiled/checkpoints/step-00000003", "out": f"{root}/resumed"})
    return [first, second]


def cells(root: str) -> list[cm.Cell]:
    parity = [c for m in MAIN + MORE for c in pair(*m)]
    return [RECOMPILE, *parity, TP_INDUCTOR, *F64, *CHECKPOINTED, META, *resume_cells(root), *CP, *EP, *TORCH_BLOCKS]


@pytest.fixture(scope="module")
def root(tmp_path_factory: Any) -> str:
    return str(tmp_path_factory.mktemp("compile"))


@pytest.fixture(scope="module")
def results(root: str) -> dict[Any, Any]:
    return cm.run_cells(cells(root), nproc=2, label="every strategy")


def get(results: dict[Any, Any], cell: cm.Cell) -> tuple[dict[str, Any], dict[str, torch.Tensor], list[int]]:
    return results[cm.key(cell)]  # type: ignore[no-any-return]


def assert_agree(name: str, state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor], what: str, tol: float = TOL) -> float:
    """``state`` within ``tol`` (relative) of ``ref``, and training moved the weights by far more than that."""
    diff = cm.relative_difference(state, ref)
    assert diff <= tol, f"{name} {what}: compiled differs from uncompiled by {diff:.3g} (relative) > {tol:g}"
    moved = cm.relative_difference(ref, cm.build(name, "64" if next(iter(ref.values())).dtype == torch.float64 else "32").state_dict())
    assert moved > 100 * tol, f"{name} {what}: training moved the weights by only {moved:.3g}"
    return diff


@pytest.mark.parametrize("cell", MAIN + MORE, ids=lambda c: f"{c[0]}-{c[1]}")
def test_compiled_run_matches_the_uncompiled_run(results: dict[Any, Any], cell: tuple[str, str, dict[str, Any]]) -> None:
    off, on = pair(*cell)
    _, ref, _ = get(results, off)
    summary, state, _ = get(results, on)
    assert_agree(cell[0], state, ref, f"{cell[1]} {on[3]['compile']}")
    section = summary["compile"]
    expected = "blocks" if cell[1] in ("zero2", "zero3", "tp", "pipeline") else "model"
    assert section["mode"] == expected and section["backend"] == ("inductor" if on[3]["compile"] == "on" else "aot_eager")
    assert section["compiled"] and section["graphs"] >= 1, section  # named as compiled, and a graph was made
    assert "compile" not in get(results, off)[0]


def test_blocks_of_torch_s_own_class_compile_under_zero3_and_agree_exactly(results: dict[Any, Any]) -> None:
    _, ref, _ = get(results, TORCH_BLOCKS[0])
    summary, state, _ = get(results, TORCH_BLOCKS[1])
    assert assert_agree("torchenc", state, ref, "zero3 float64", tol=0.0) == 0.0
    section = summary["compile"]
    assert section["mode"] == "blocks" and section["compiled"] == ["layers.0", "layers.1"], section
    assert section["graphs"] >= 1 and section["graph_breaks"] == 0, section  # one graph for both blocks, unbroken


@pytest.mark.parametrize("name, backend_", [("charlm", "on"), ("llama", "on:aot_eager"), ("charlm", "blocks:aot_eager")])
def test_single_compiled_matches_uncompiled(name: str, backend_: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process: Dynamo's caches cleared, so the compiled run compiles (frames, graphs and seconds reported)."""
    monkeypatch.setenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "0")  # Inductor sets it before loading each kernel library:
    monkeypatch.delenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR")  # removed again after the test
    start = time.perf_counter()
    _, ref = cm.train(name, compile="off")
    torch._dynamo.reset()
    summary, state = cm.train(name, compile=backend_)
    print(f"\n[compile single {name} {backend_}] {time.perf_counter() - start:.1f}s", flush=True)
    assert state is not None and ref is not None
    assert_agree(name, state, ref, f"single {backend_}")
    section = summary["compile"]
    assert (
        section["mode"] == backend_.split(":")[0].replace("on", "model") and section["frames"] >= 1 and section["graphs"] >= 1 and section["compile_s"] > 0
    ), section
    assert section["graph_breaks"] == 0 and section["recompiles"] == 0 and section["eager_fallbacks"] == 0, section


def test_single_checkpointed_blocks_compile_exactly() -> None:
    """Activation checkpointing's blocks under a compiled model (in this process): the same weights as uncompiled."""
    _, ref = cm.train("charlm", compile="off")
    summary, state = cm.train("charlm", compile="on:aot_eager", activation_checkpointing="blocks")
    assert state is not None and ref is not None and summary["compile"]["compiled"] == ["CharGPT"]
    assert assert_agree("charlm", state, ref, "single + activation checkpointing", tol=0.0) == 0.0


def test_float64_aot_eager_is_exact(results: dict[Any, Any]) -> None:
    """AOTAutograd without code generation runs the same aten operators in the same order: not a bit differs."""
    _, ref, _ = get(results, F64[0])
    _, state, _ = get(results, F64[1])
    assert next(iter(state.values())).dtype == torch.float64
    assert assert_agree("charlm", state, ref, "zero3 float64", tol=0.0) == 0.0


def test_a_smaller_last_batch_recompiles_and_the_report_says_why(results: dict[Any, Any]) -> None:
    summary, _, _ = get(results, RECOMPILE)
    assert summary["steps"] == 6
    section = summary["compile"]
    assert section["recompiles"] >= 1, section
    reasons = " | ".join(section["recompile_reasons"])
    assert "size mismatch" in reasons and "expected 4, actual 2" in reasons, reasons
    assert section["compile_s"] > 0 and section["graphs"] >= 2, section
    # the rates leave out the slowest rank's compile seconds (one max all-reduce), so the throughput figure is at
    # least rank 0's own (the compile section is rank 0's; no evaluation here compiles after training)
    assert summary["throughput"]["compile_s"] >= section["compile_s"] - 0.05, (summary["throughput"], section)


def test_tp_counts_the_same_collectives_and_the_counter_skips_compiled_operators(results: dict[Any, Any]) -> None:
    """The counter's mode (``ignore_compile_internals``) is off while Dynamo traces and sees only what compiled code
    dispatches: under Inductor the collectives and extern kernels, not every operator of the block (under
    aot_eager the graph's aten operators still dispatch one by one, so there it sees as many as eager)."""
    eager, _, eager_calls = get(results, ("charlm", "tp", {"tp": 2}, {"compile": "off"}))
    inductor, state, calls = get(results, TP_INDUCTOR)
    aot, _, aot_calls = get(results, ("charlm", "tp", {"tp": 2}, {"compile": "on:aot_eager", "_reset": True}))
    counts = eager["tp"]["collectives_per_step"]
    assert counts and counts == inductor["tp"]["collectives_per_step"] == aot["tp"]["collectives_per_step"], (counts, inductor["tp"])
    assert len(eager_calls) == len(calls) >= 2, (eager_calls, calls)  # the counted steps (the rest replay)
    assert calls[-1] * 2 < eager_calls[-1], f"the counter ran Python on {calls[-1]} operators in a compiled step, {eager_calls[-1]} eager"
    assert aot_calls[-1] >= eager_calls[-1] // 2
    assert_agree("charlm", state, get(results, ("charlm", "tp", {"tp": 2}, {"compile": "off"}))[1], "tp inductor")


@pytest.mark.parametrize("cell", CHECKPOINTED, ids=lambda c: f"{c[1]}-{c[3]['activation_checkpointing']}")
def test_activation_checkpointing_with_compile_is_exact(results: dict[Any, Any], cell: cm.Cell) -> None:
    _, ref, _ = get(results, ("charlm", cell[1], {}, {"compile": "off"}))
    summary, state, _ = get(results, cell)
    assert summary["compile"]["compiled"]
    assert assert_agree("charlm", state, ref, f"{cell[1]} + activation checkpointing", tol=0.0) == 0.0


def test_a_meta_device_model_under_zero3_compiles(results: dict[Any, Any]) -> None:
    """charlm built under ``shardwise.meta_init`` (each rank fills its share) trains compiled as the eager-built model does."""
    _, ref, _ = get(results, ("charlm", "zero3", {}, {"compile": "off"}))
    summary, state, _ = get(results, META)
    assert summary["compile"]["mode"] == "blocks"
    assert_agree("charlm", state, ref, "zero3 meta-built")


def test_a_compiled_runs_checkpoint_resumes_uncompiled(results: dict[Any, Any], root: str) -> None:
    """Names are unchanged by compile (no ``_orig_mod.``): the checkpoint of a compiled run loads into an uncompiled one."""
    first, second = resume_cells(root)
    assert get(results, first)[0]["steps"] == 3
    summary, state, _ = get(results, second)
    assert not any("_orig_mod" in k for k in state)
    _, ref, _ = get(results, ("charlm", "ddp", {}, {"compile": "off"}))
    assert_agree("charlm", state, ref, "resumed uncompiled")


def test_context_parallel_compiles_with_graph_breaks_at_the_ring(results: dict[Any, Any]) -> None:
    """cp=2 on ddp: the model compiles whole; Dynamo does not compile the ring's point-to-point sends (isend/irecv),
    so it breaks the graph there and runs them eagerly (reported as graph breaks): slower, not wrong."""
    _, ref, _ = get(results, CP[0])
    summary, state, _ = get(results, CP[1])
    assert_agree("charlm", state, ref, "ddp cp=2 (ring attention)")
    print(f"\n[compile cp] {summary['compile']}", flush=True)
    assert summary["compile"]["mode"] == "model" and summary["compile"]["graph_breaks"] >= 1


def test_expert_parallel_compiles_exactly(results: dict[Any, Any]) -> None:
    """ep=2 on ddp, Mixtral in float64 (aot_eager): the tokens' all-to-all inside the compiled model; not a bit differs."""
    _, ref, _ = get(results, EP[0])
    summary, state, _ = get(results, EP[1])
    assert summary["compile"]["mode"] == "model"
    assert assert_agree("mixtral", state, ref, "ddp ep=2", tol=0.0) == 0.0


def test_the_clip_acts_at_every_step() -> None:
    """The parity is of clipped steps (a strategy that clipped wrongly would differ): charlm's first gradient norm
    exceeds the clip norm."""
    model = cm.build("charlm")
    data = cm.dataset("charlm")
    batch = torch.utils.data.default_collate([data[i] for i in range(harness.GLOBAL_BATCH)])
    cm.charlm_loss(model(batch[0]), batch).backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    assert norm > 2 * harness.CLIP
