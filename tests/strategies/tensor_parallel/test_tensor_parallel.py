"""Tensor parallelism (``tp``) equals the single-process reference, issues exactly Megatron's
collectives, and its checkpoints move to and from ``single``.

A tiny float64 CharGPT (vocabulary 11, block 8, d_model 16, 2 heads, 2 layers), 5 AdamW steps
with accumulation and clipping. One launch per world size runs every fit of that size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from shardwise import Trainer, launch
from shardwise.errors import ConfigError
from shardwise.tools.recipes.charlm import CharGPT
from tests.support.models import max_diff

pytestmark = [pytest.mark.dist, pytest.mark.timeout(300)]

VOCAB, BLOCK, D, HEADS, LAYERS = 11, 8, 16, 2, 2
COMMON = dict(precision="64", global_batch_size=8, accumulate=2, max_steps=5, log_every=5, progress_bar=False, clip_grad_norm=0.05)


def tiny_gpt(layers: int = LAYERS, heads: int = HEADS, seed: int = 0) -> CharGPT:
    torch.manual_seed(seed)
    return CharGPT(VOCAB, BLOCK, D, heads, layers).double()


def chars(n: int = 64, seed: int = 3) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, BLOCK + 1), generator=g)
    return TensorDataset(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())


def lm_loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
    """charlm's loss without its cast to float32: parity at 1e-9 needs the float64 logits."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), batch[1].reshape(-1))


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)


def _fit(
    strategy: str, *, out: Path | None = None, resume: str | None = None, max_steps: int = 5, dropout: float = 0.0, **options: Any
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    model = tiny_gpt()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = dropout
        if hasattr(m, "dropout") and isinstance(m.dropout, float):
            m.dropout = dropout
    trainer = Trainer(
        strategy=strategy,
        optimizer=adamw,
        loss_fn=lm_loss,
        strategy_options=options,
        **{**COMMON, "max_steps": max_steps},
        out=str(out) if out else None,
        resume=resume,
    )
    summary = trainer.fit(model, chars(), chars(20, seed=4))
    return _whole(model), summary


def _whole(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone() for k, v in model.state_dict().items()}


def _count(layers: int, sequence_parallel: bool) -> tuple[dict[tuple[str, str, str], int], dict[str, int]]:
    """Collectives of one forward and backward of a tp=2 model with ``layers`` blocks: ours, and
    torch's own ``CommDebugMode``'s totals by operator (an independent count)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    from shardwise.strategies.tensor_parallel import count_collectives, parallelize

    model = tiny_gpt(layers)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    parallelize(model, mesh["tp"], sequence_parallel=sequence_parallel)
    x, y = chars(4).tensors
    with CommDebugMode() as torch_mode, count_collectives(tp=mesh.get_group()) as counts:
        lm_loss(model(x), (x, y)).backward()
    return dict(counts), {str(op).split(".")[-1]: n for op, n in torch_mode.get_comm_counts().items()}


def _one_step_grads(sequence_parallel: bool) -> float:
    """Gradients of one tp=2 step equal the whole model's (the sequence-parallel norm weights reduced)."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.strategies.tensor_parallel import parallelize, reduce_partial_grads

    ref, model = tiny_gpt(), tiny_gpt()
    parallelize(model, init_device_mesh("cpu", (2,)), sequence_parallel=sequence_parallel)
    x, y = chars(4).tensors
    lm_loss(model(x), (x, y)).backward()
    lm_loss(ref(x), (x, y)).backward()
    reduce_partial_grads(model)
    got = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in model.named_parameters()}
    return max_diff({n: p.grad for n, p in ref.named_parameters()}, got)


def _engine_loop(**options: Any) -> dict[str, torch.Tensor]:
    """A loop of the user's own on `Engine` (engine.backward, no_sync, clip, step): 3 steps of 8
    samples, two micro-batches per rank; with ``options=None`` the same loop in plain torch."""
    import contextlib

    from shardwise import Engine

    x, y = chars().tensors
    if options.pop("reference", False):
        model = tiny_gpt()
        opt = adamw(model.parameters())
        for step in range(3):
            lm_loss(model(x[step * 8 : (step + 1) * 8]), (None, y[step * 8 : (step + 1) * 8])).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
            opt.zero_grad()
        return _whole(model)
    engine = Engine(strategy="tp", precision="64", strategy_options=options)
    model, opt = engine.setup(tiny_gpt(), adamw)
    dp, r = engine.mesh.size("dp"), engine.mesh.coordinate("dp")
    per = 8 // dp
    for step in range(3):
        for micro in range(2):
            lo = step * 8 + r * per + micro * per // 2
            with engine.no_sync(model) if micro == 0 else contextlib.nullcontext():
                engine.backward(lm_loss(model(x[lo : lo + per // 2]), (None, y[lo : lo + per // 2])) / 2)
        engine.clip_grad_norm(model, opt, 0.05)
        engine.step(opt)
        opt.zero_grad()
    out = _whole(model)
    engine.close()
    return out


class Stage(torch.nn.Module):
    """A pipeline stage holding only block 1 of the model, under its original name ``blocks.1``."""

    def __init__(self, model: CharGPT) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleDict({"1": model.blocks[1]})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks.values():
            x = block(x)
        return x


def _partial_model(sequence_parallel: bool) -> tuple[float, float, list[str]]:
    """parallelize on a stage (block 1 alone): its output and input gradient equal the whole block's."""
    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.strategies.tensor_parallel import parallelize

    ref, stage = Stage(tiny_gpt()), Stage(tiny_gpt())
    parallelize(stage, init_device_mesh("cpu", (2,)), sequence_parallel=sequence_parallel)
    x = torch.randn(4, BLOCK, D, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = stage(xs), ref(xr)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    return (out - want).abs().max().item(), (xs.grad - xr.grad).abs().max().item(), sorted(stage._shardwise_tp["plan"])


def _uneven_sequence() -> tuple[float, float, str | None]:
    """Sequence parallelism on a sequence of 7 at tp=2 (shards of 4 and 3, as ViT's 17 tokens): the
    output and the embedding's gradient equal the unsplit model's; a sequence of 1 is refused."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from shardwise.strategies.tensor_parallel import parallelize, reduce_partial_grads

    ref = tiny_gpt()
    model = parallelize(copy.deepcopy(ref), init_device_mesh("cpu", (2,)), sequence_parallel=True)
    x = chars(4).tensors[0][:, :7]
    out, want = model(x), ref(x)
    out.pow(2).sum().backward()
    want.pow(2).sum().backward()
    reduce_partial_grads(model)
    grads = max(
        (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).sub(q.grad).abs().max().item()
        for p, q in zip(model.parameters(), ref.parameters(), strict=True)
    )
    try:
        model(x[:, :1])
    except ValueError as exc:
        return (out - want).abs().max().item(), grads, str(exc)
    return (out - want).abs().max().item(), grads, None


LLAMA_LAYERS, LLAMA_BATCH, LLAMA_STEPS = 2, 4, 2


def _fit_llama(**options: Any) -> dict[str, Any] | None:
    """tests/support/zoo.py's Hugging Face Llama (float64, hidden 32, 4 heads, 2 key/value heads,
    sequence 16) under tp=2, through its declared plan and its own loss; the summary."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return None
    from tests.support import zoo

    trainer = Trainer(
        strategy="tp",
        optimizer=adamw,
        strategy_options={"tp": 2, **options},
        precision="64",
        global_batch_size=LLAMA_BATCH,
        max_steps=LLAMA_STEPS,
        log_every=LLAMA_STEPS,
        progress_bar=False,
        clip_grad_norm=0.05,
    )
    return trainer.fit(zoo.build("llama", layers=LLAMA_LAYERS), zoo.dataset("llama", LLAMA_BATCH * LLAMA_STEPS))  # type: ignore[no-any-return]


def _world_of_two(root: Path) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for sp in (False, True):
        out[("llama", sp)] = _fit_llama(sequence_parallel=sp)
    out["tp"] = _fit("tp", tp=2)
    out["tp_sp"] = _fit("tp", tp=2, sequence_parallel=True)
    out["dp2_tp1"] = _fit("tp", tp=1)  # degenerate: tp of one, data parallel over two
    out["tp_plan"] = _fit(
        "tp", plan={"blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.proj": "rowwise", "blocks.*.mlp.fc": "colwise", "blocks.*.mlp.proj": "rowwise"}
    )
    for layers in (1, 2):
        for sp in (False, True):
            out[("count", layers, sp)] = _count(layers, sp)
    for sp in (False, True):
        out[("grads", sp)] = _one_step_grads(sp)
        out[("dropout", sp)] = _fit("tp", max_steps=3, dropout=0.2, sequence_parallel=sp)
    out["uneven"] = _uneven_sequence()
    for sp in (False, True):
        out[("stage", sp)] = _partial_model(sp)
    out["engine_sp"] = _engine_loop(tp=2, sequence_parallel=True)
    # A head count that tp does not divide: refused in setup, on every rank, before any step.
    try:
        Trainer(strategy="tp", loss_fn=lm_loss, **COMMON).fit(CharGPT(VOCAB, BLOCK, 12, 3, 1).double(), chars())
        out["heads"] = None
    except ConfigError as exc:
        out["heads"] = str(exc)
    try:
        Trainer(strategy="tp", loss_fn=lm_loss, **{**COMMON, "precision": "16-mixed"}).fit(tiny_gpt().float(), chars())
        out["fp16"] = None
    except ConfigError as exc:
        out["fp16"] = str(exc)
    # Checkpoints: tp writes one at step 3 (single resumes it in the parent); tp resumes single's.
    out["tp_first"] = _fit("tp", out=root / "tp_ckpt", max_steps=3)
    out["from_single"] = _fit("tp", out=root / "from_single", resume=str(root / "single_ckpt/checkpoints/step-00000003"), sequence_parallel=True)
    return out


def _world_of_four() -> dict[Any, Any]:
    return {
        "ddp": _fit("tp", tp=2, dp_strategy="ddp"),
        "fsdp": _fit("tp", tp=2, dp_strategy="fsdp"),
        "fsdp_sp": _fit("tp", tp=2, dp_strategy="fsdp", sequence_parallel=True),
        "engine_ddp_sp": _engine_loop(tp=2, sequence_parallel=True, dp_strategy="ddp"),
    }


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("tp")


@pytest.fixture(scope="module")
def reference(root) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    _fit("single", out=root / "single_ckpt", max_steps=3)  # the checkpoint tp resumes
    return _fit("single")


@pytest.fixture(scope="module")
def two(root, reference) -> list[dict[Any, Any]]:
    return launch(_world_of_two, root, nproc=2, threads_per_proc=1)  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def four() -> list[dict[Any, Any]]:
    return launch(_world_of_four, nproc=4, threads_per_proc=1)  # type: ignore[no-any-return]


def _check_parity(result: tuple[dict[str, torch.Tensor], dict[str, Any]], ref: tuple[dict[str, torch.Tensor], dict[str, Any]], resumed: bool = False) -> float:
    got, summary = result
    want, ref_summary = ref
    diff = max_diff(want, got)
    assert diff < 1e-9
    if not resumed:  # a resumed run logs the mean loss of the steps it ran
        assert abs(summary["train_loss"] - ref_summary["train_loss"]) < 1e-9
    assert summary["val_loss"] == pytest.approx(ref_summary["val_loss"], abs=1e-9)
    assert summary["val_samples"] == 20  # tp ranks evaluate the same shard: each sample still counts once
    return diff


@pytest.mark.parametrize("run", ["tp", "tp_sp", "tp_plan"])
def test_tp2_equals_single(run, two, reference):
    _check_parity(two[0][run], reference)
    section = two[0][run][1]["tp"]
    assert section["degree"] == 2 and section["dp"] == 1
    assert section["sequence_parallel"] == (run == "tp_sp")
    assert section["plan"] == {
        f"blocks.{i}.{n}": s
        for i in range(LAYERS)
        for n, s in (
            ("attn.q", "colwise"),
            ("attn.k", "colwise"),
            ("attn.v", "colwise"),
            ("attn.proj", "rowwise"),
            ("mlp.fc", "colwise"),
            ("mlp.proj", "rowwise"),
        )
    }


def test_tp_of_one_is_data_parallel(two, reference):
    for rank in range(2):
        _check_parity(two[rank]["dp2_tp1"], reference)
    assert two[0]["dp2_tp1"][1]["tp"]["degree"] == 1 and two[0]["dp2_tp1"][1]["tp"]["dp"] == 2
    assert two[0]["dp2_tp1"][1]["comm"]["by_op"]["dp/all_reduce"]["count"] == 5


@pytest.mark.parametrize("run", ["ddp", "fsdp", "fsdp_sp"])
def test_dp2_by_tp2_equals_single(run, four, reference):
    for rank in range(4):
        _check_parity(four[rank][run], reference)
    section = four[0][run][1]["tp"]
    assert section["degree"] == 2 and section["dp"] == 2 and section["dp_strategy"] == run.split("_")[0]


def _agrees_with_comm_debug_mode(ours: dict[tuple[str, str, str], int], theirs: dict[str, int]) -> None:
    names = {"all_reduce": "all_reduce", "all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}
    totals: dict[str, int] = {}
    for (_, kind, _), n in ours.items():
        totals[names[kind]] = totals.get(names[kind], 0) + n
    assert totals == {k: v for k, v in theirs.items() if v}


def test_parallelize_on_a_pipeline_stage_keeps_names_and_equals_the_whole_block(two):
    for sp in (False, True):
        out_diff, grad_diff, plan = two[0][("stage", sp)]
        assert out_diff < 1e-12 and grad_diff < 1e-12
        assert plan == ["blocks.1.attn.k", "blocks.1.attn.proj", "blocks.1.attn.q", "blocks.1.attn.v", "blocks.1.mlp.fc", "blocks.1.mlp.proj"]


def test_a_loop_of_ones_own_on_engine_finishes_gradients_before_clip_and_step(two, four):
    # engine.backward, not forward_backward: partial norm gradients and the dp average still happen.
    want = _engine_loop(reference=True)
    assert max_diff(want, two[0]["engine_sp"]) < 1e-9
    for rank in range(4):
        assert max_diff(want, four[rank]["engine_ddp_sp"]) < 1e-9


def test_one_block_is_two_allreduces_forward_and_two_backward(two):
    one, both = two[0][("count", 1, False)][0], two[0][("count", 2, False)][0]
    for layers in (1, 2):
        _agrees_with_comm_debug_mode(*two[0][("count", layers, False)])
    for phase in ("forward", "backward"):
        assert both[("tp", "all_reduce", phase)] - one[("tp", "all_reduce", phase)] == 2
        assert both[("tp", "all_reduce", phase)] == 2 * LAYERS
    assert set(both) == {("tp", "all_reduce", "forward"), ("tp", "all_reduce", "backward")}  # nothing else


def test_sequence_parallel_block_is_all_gather_reduce_scatter_pairs(two):
    one, both = two[0][("count", 1, True)][0], two[0][("count", 2, True)][0]
    for layers in (1, 2):
        _agrees_with_comm_debug_mode(*two[0][("count", layers, True)])
    for phase in ("forward", "backward"):
        for kind in ("all_gather", "reduce_scatter"):
            assert both[("tp", kind, phase)] - one[("tp", kind, phase)] == 2
        # Per block 2 pairs; plus one all-gather leaving the sequence-sharded region (forward) and
        # its mirror entering it (backward, the gradient of the first block's input).
        assert both[("tp", "all_gather", phase)] == 2 * LAYERS + 1
        assert both[("tp", "reduce_scatter", phase)] == 2 * LAYERS
    assert not any(kind == "all_reduce" for _, kind, _ in both)


def test_one_step_gradients_equal_the_whole_model(two):
    assert two[0][("grads", False)] < 1e-12
    assert two[0][("grads", True)] < 1e-12


def test_dropout_keeps_the_replicated_parameters_identical_across_tp_ranks(two, reference):
    for sp in (False, True):
        ranks = [two[r][("dropout", sp)][0] for r in range(2)]
        # Embedding, norms and head are computed whole on both ranks: the same masks, the same updates.
        assert max_diff(ranks[0], ranks[1]) == 0.0
        assert two[0][("dropout", sp)][1]["train_loss"] != pytest.approx(reference[1]["train_loss"], abs=1e-3)  # dropout was on


def test_summary_reports_the_collectives_per_step(two, four):
    per_step = two[0]["tp"][1]["tp"]["collectives_per_step"]
    # accumulate=2: two forward/backward passes per step, each 2 allreduces per block each way.
    assert per_step == {"tp/all_reduce": {"forward": 2 * 2 * LAYERS, "backward": 2 * 2 * LAYERS}}
    comm = two[0]["tp"][1]["comm"]["by_op"]
    assert comm["tp/all_reduce"]["count"] == 5 * (8 * LAYERS + 1)  # + the clip norm's scalar per step
    sp = two[0]["tp_sp"][1]["tp"]["collectives_per_step"]
    assert sp["tp/all_gather"] == {"forward": 2 * (2 * LAYERS + 1), "backward": 2 * (2 * LAYERS + 1)}
    assert sp["tp/reduce_scatter"] == {"forward": 2 * 2 * LAYERS, "backward": 2 * 2 * LAYERS}
    ddp = four[0]["ddp"][1]["comm"]["by_op"]
    assert ddp["dp/all_reduce"]["count"] == 5  # one coalesced gradient allreduce per step (one dtype)


def megatron(*, batch: int, passes: int, seq: int, hidden: int, layers: int, itemsize: int, p: int, sequence_parallel: bool) -> dict[str, tuple[int, int]]:
    """Megatron's tp collectives per step, ``{op: (count, bytes sent by one rank)}``, for ``passes``
    forward/backward passes of ``batch`` samples each (accumulation) and library collectives'
    bandwidth-optimal bytes (an allreduce of n bytes sends 2(p-1)/p n, an all-gather or
    reduce-scatter of a buffer of n bytes (p-1)/p n).

    Per transformer block, each pass: 2 allreduces of the activation (batch x seq x hidden) in
    forward (after the row-split attention output and MLP output: Megatron's g) and 2 in backward
    (the input gradients of the column-split sublayers: f). Sequence parallelism replaces each
    allreduce by an all-gather and a reduce-scatter of the same activation (the same bytes), plus
    one all-gather leaving the sequence-sharded region in forward and its mirror in backward.
    """
    act = batch * seq * hidden * itemsize
    if not sequence_parallel:
        return {"all_reduce": (passes * 4 * layers, passes * 4 * layers * 2 * (p - 1) * act // p)}
    piece = (p - 1) * act // p
    return {"all_gather": (passes * (4 * layers + 2), passes * (4 * layers + 2) * piece), "reduce_scatter": (passes * 4 * layers, passes * 4 * layers * piece)}


def _tp_traffic(summary: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """What the recorder saw on the tp group per step: ``{op: (count, bytes sent)}`` (received is the same)."""
    steps = summary["steps"]
    out = {}
    for key, t in summary["comm"]["by_op"].items():
        if key.startswith("tp/"):
            assert t["received_bytes"] == t["sent_bytes"], key
            out[key.split("/")[1]] = (t["count"] / steps, t["sent_bytes"] / steps)
    return out


def _extras(norm_bytes: int, p: int = 2) -> dict[str, tuple[int, int]]:
    """The allreduces beside Megatron's, per step: the clip's squared norm (one float64 scalar over tp)
    and, under sequence parallelism, the norm weights' partial gradients (one coalesced allreduce)."""
    clip = (1, 2 * (p - 1) * 8 // p)
    if not norm_bytes:
        return {"all_reduce": clip}
    return {"all_reduce": (clip[0] + 1, clip[1] + 2 * (p - 1) * norm_bytes // p)}


def _plus(a: dict[str, tuple[int, int]], b: dict[str, tuple[int, int]]) -> dict[str, tuple[int, int]]:
    return {k: (a.get(k, (0, 0))[0] + b.get(k, (0, 0))[0], a.get(k, (0, 0))[1] + b.get(k, (0, 0))[1]) for k in {*a, *b}}


def test_recorded_tp_bytes_per_step_are_megatrons_formula_on_charlm(two):
    # charlm's CharGPT, float64: 8 samples per step on each rank in 2 passes of 4 (accumulate=2), sequence 8, width 16.
    shape = dict(batch=COMMON["global_batch_size"] // COMMON["accumulate"], passes=COMMON["accumulate"], seq=BLOCK, hidden=D, layers=LAYERS, itemsize=8, p=2)
    norms = LAYERS * 2 * 2 * D * 8  # per block ln1 and ln2, weight and bias
    for rank in range(2):
        plain = _tp_traffic(two[rank]["tp"][1])
        assert plain == _plus(megatron(**shape, sequence_parallel=False), _extras(0))
        # By hand: 2 passes x 2 blocks x 4 allreduces x (4 x 8 x 16 x 8 = 4096 bytes), plus the clip's 8: 65544 bytes a step.
        assert plain["all_reduce"][1] == 2 * 2 * 4 * 4096 + 8 == 65544
        sp = _tp_traffic(two[rank]["tp_sp"][1])
        assert sp == _plus(megatron(**shape, sequence_parallel=True), _extras(norms))
        # The same bytes as the allreduces, plus the region's edges (half an activation each way, each pass).
        assert sp["all_gather"][1] + sp["reduce_scatter"][1] == plain["all_reduce"][1] - 8 + 2 * 4096


def test_recorded_tp_bytes_per_step_are_megatrons_formula_on_hf_llama(two):
    # transformers is in the test extras (pip install -e '.[dev]'): its absence is a broken set-up, not a skip.
    assert two[0][("llama", False)] is not None, "transformers is not installed; install the test extras: pip install -e '.[dev]'"
    from tests.support import zoo

    # Grouped-query attention shrinks k and v, not the activations between the pairs: the same formula.
    shape = dict(batch=LLAMA_BATCH, passes=1, seq=zoo.SEQ, hidden=32, layers=LLAMA_LAYERS, itemsize=8, p=2)
    norms = LLAMA_LAYERS * 2 * 32 * 8  # per block input_layernorm and post_attention_layernorm (RMSNorm: weight only)
    for rank in range(2):
        plain, sp = two[rank][("llama", False)], two[rank][("llama", True)]
        assert plain["steps"] == sp["steps"] == LLAMA_STEPS
        assert sorted(sp["tp"]["grad_summed"]) == sorted(
            f"model.layers.{i}.{n}.weight" for i in range(LLAMA_LAYERS) for n in ("input_layernorm", "post_attention_layernorm")
        )
        assert _tp_traffic(plain) == _plus(megatron(**shape, sequence_parallel=False), _extras(0))
        # By hand: 1 pass x 2 blocks x 4 allreduces x (4 x 16 x 32 x 8 = 16384 bytes), plus the clip's 8.
        assert _tp_traffic(plain)["all_reduce"][1] == 2 * 4 * 16384 + 8 == 131080
        assert _tp_traffic(sp) == _plus(megatron(**shape, sequence_parallel=True), _extras(norms))


def test_a_tp_checkpoint_resumes_under_single_and_single_resumes_under_tp(two, root, reference):
    # tp (3 steps, sharded checkpoint) -> single (to step 5) equals 5 single steps.
    first = two[0]["tp_first"][1]
    assert first["steps"] == 3 and first["last_checkpoint"].endswith("step-00000003")
    assert (Path(first["last_checkpoint"]) / "dcp").is_dir()  # DTensors: written with DCP
    resumed = _fit("single", out=root / "tp_to_single", resume=first["last_checkpoint"])
    assert resumed[1]["resumed_from"].endswith("step-00000003")
    _check_parity(resumed, reference, resumed=True)
    # single (3 steps, plain checkpoint) -> tp with sequence parallelism (to step 5).
    from_single = two[0]["from_single"]
    assert from_single[1]["resumed_from"].endswith("step-00000003")
    _check_parity(from_single, reference, resumed=True)


# -- bad inputs --------------------------------------------------------------------------------


def test_tp_that_does_not_divide_the_world_size_is_a_config_error_before_launch():
    with pytest.raises(ConfigError, match=r"tp 3 does not divide the world size 4; valid shapes: dp4 x tp1, dp2 x tp2, dp1 x tp4"):
        Trainer(strategy="tp", nproc=4, strategy_options={"tp": 3}, loss_fn=lm_loss).fit(tiny_gpt(), chars())


def test_heads_that_do_not_divide_by_tp_is_a_config_error(two):
    for rank in range(2):
        assert two[rank]["heads"] is not None
        assert (
            "blocks.0.attn.q has 3 attention heads, which do not split across tp=2 ranks "
            "(attention is split by whole heads, key/value heads included); choose tp in [1, 3]" in two[rank]["heads"]
        )


def test_fp16_with_its_grad_scaler_is_refused_before_the_first_step(two):
    assert "strategy 'tp' does not run with precision '16-mixed'" in two[0]["fp16"] and "use precision 'bf16-mixed'" in two[0]["fp16"]


def test_an_uneven_sequence_splits_exactly_and_one_too_short_is_refused(two):
    for rank in range(2):
        out, grads, refusal = two[rank]["uneven"]
        assert out < 1e-12 and grads < 1e-12, (out, grads)
        assert (
            refusal is not None
            and "sequence parallelism splits dim 1 (the sequence) of the blocks' input (batch, sequence, features) across tp=2 ranks; got (4, 1, 16)" in refusal
        )


def test_bad_plans_are_config_errors():
    with pytest.raises(ConfigError, match=r"plan\['blocks.0.mlp.fc'\] = 'colwize' is not a style. Did you mean 'colwise'\?"):
        Trainer(strategy="tp", nproc=2, strategy_options={"plan": {"blocks.0.mlp.fc": "colwize"}}, loss_fn=lm_loss).fit(tiny_gpt(), chars())
    with pytest.raises(ConfigError, match="dp_strategy must be 'ddp' or 'fsdp'; got 'zero'"):
        Trainer(strategy="tp", nproc=2, strategy_options={"dp_strategy": "zero"}, loss_fn=lm_loss).fit(tiny_gpt(), chars())
