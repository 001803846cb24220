"""Context parallelism: float64 parity with single, ring and all-to-all bytes against their formulas, refusals.

Two launches: 2 processes (cp 2 under ddp, zero3 and zero1; ring and Ulysses) and 4 processes
(cp 2 x tp 2; cp 4), each over Llama, GPT-2 or nanoGPT, and Qwen2 (`cells.py`), 5 SGD steps with every
step clipped, against `single` on the same model.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardwise import launch
from shardwise.errors import ConfigError
from shardwise.strategies.context_parallel.cost import attention_bytes
from shardwise.strategies.context_parallel.ring import ring_bytes, ulysses_bytes
from shardwise.strategies.cost.model_spec import transformer_spec
from shardwise.strategies.data_parallel.ddp import DDP
from shardwise.strategies.tensor_parallel import TensorParallel
from tests.strategies.context_parallel import cells
from tests.support import harness, zoo

TWO = [
    ("llama", "ddp", {"cp": 2}),
    ("gpt2", "ddp", {"cp": 2}),
    ("qwen2", "ddp", {"cp": 2}),
    ("nanogpt", "ddp", {"cp": 2}),
    ("llama", "ddp", {"cp": 2, "cp_style": "ulysses"}),
    ("nanogpt", "zero3", {"cp": 2, "cp_style": "ulysses"}),
    ("gpt2", "zero1", {"cp": 2}),
]
OWN_LOSS = [("llama", "ddp", {"cp": 2}, {"own_loss": True}), ("gpt2", "ddp", {"cp": 2, "cp_style": "ulysses"}, {"own_loss": True})]
"""transformers' own loss (labels shifted inside the model, in float32): the shift made before the split."""
OWN_STEP = [("llama_step", "ddp", {"cp": 2}, {"own_loss": True}), ("nanogpt_targets", "ddp", {"cp": 2}, {"own_loss": True})]
"""Models with a training_step: Llama returning ``self(**batch).loss``, nanoGPT calling ``self(x, y)``."""
OWN_TOL = 1e-6
"""transformers computes its loss in float32 (`zoo.causal_lm_loss64`): parity to float32 rounding."""
FOUR = [
    ("llama", "tp", {"tp": 2, "cp": 2}),
    ("gpt2", "tp", {"tp": 2, "cp": 2}),
    ("qwen2", "tp", {"tp": 2, "cp": 2}),
    ("llama", "ddp", {"cp": 4}),  # a ring of 4: blocks from earlier and later ranks, grouped kv heads
    ("qwen2", "ddp", {"cp": 4, "cp_style": "ulysses"}),  # 2 kv heads over 4 ranks: repeated first
]
_REFS: dict[tuple[str, bool], tuple[dict[str, Any], dict[str, torch.Tensor]]] = {}
_RESULTS: dict[str, list[Any]] = {}


def _reference(name: str, own_loss: bool = False) -> dict[str, torch.Tensor]:
    return _single(name, own_loss)[1]


def _single(name: str, own_loss: bool = False) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """single's (summary, final state) for ``name``."""
    if (name, own_loss) not in _REFS:
        _REFS[name, own_loss] = cells.train(name, own_loss=own_loss)  # type: ignore[assignment]
    return _REFS[name, own_loss]


def _two() -> list[Any]:
    """The 2-process launch's results (TWO, OWN_LOSS, then OWN_STEP), run once for the tests that read them."""
    if "two" not in _RESULTS:
        _RESULTS["two"] = launch(cells.run, TWO + OWN_LOSS + OWN_STEP, nproc=2, threads_per_proc=1, timeout=800)[0]
    return _RESULTS["two"]


def _kv_heads(name: str) -> tuple[int, int]:
    """(heads, key/value heads) of the cell's model; head dim 8 in every one (hidden 32, 4 heads)."""
    return (4, 2) if name in ("llama", "qwen2") else (4, 4)


def _expected(name: str, cp: int, tp: int, style: str) -> dict[str, int]:
    """Bytes rank 0 sends over the run: per step one micro-batch of the global batch (dp 1), 2 layers."""
    b, s, d = harness.GLOBAL_BATCH, zoo.SEQ, 8
    heads, kv = _kv_heads(name)
    heads, kv = heads // tp, kv // tp
    calls = harness.STEPS * 2
    k_bytes = b * kv * (s // cp) * d * 8
    if style == "ring":
        fwd, bwd = ring_bytes(k_bytes, cp)
        return {"cp/ring_attention": calls * fwd, "cp/ring_attention_backward": calls * bwd}
    q_bytes = b * heads * (s // cp) * d * 8
    kv_sent = k_bytes if kv % cp == 0 else q_bytes  # key/value heads repeated when they do not divide
    per_call = 2 * (2 * ulysses_bytes(q_bytes, cp) + 2 * ulysses_bytes(kv_sent, cp))  # q, k, v, out; forward and backward
    return {"cp/all_to_all": calls * per_call}


def _first_norm(name: str) -> float:
    """The first global batch's gradient norm at the initial weights (what the first step clips)."""
    from shardwise.data.batches import call_model

    model = cells.build(name)
    data = zoo.dataset(cells.data_name(name), harness.SAMPLES)
    batch = torch.utils.data.default_collate([data[i] for i in range(harness.GLOBAL_BATCH)])
    loss_fn = zoo.parity_loss_fn(cells.data_name(name))
    assert loss_fn is not None
    loss_fn(call_model(model, batch), batch).backward()
    return float(torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])))


def _check_cells(cell_list: list[tuple[Any, ...]], results: list[Any]) -> None:
    for (name, strategy, options), (summary, state) in zip(cell_list, results, strict=True):
        tp = options.get("tp", 1)
        diff = harness.max_difference(state, _reference(name))
        assert diff <= harness.TOL, f"{name} {strategy} {options}: largest parameter difference from single {diff:.3g}"
        # the loss the run reports is the mean over every token of the global batch, as single's
        want = _single(name)[0]["train_loss"]
        assert summary["train_loss"] == pytest.approx(want, rel=1e-9), f"{name} {strategy} {options}: reported loss {summary['train_loss']} != single's {want}"
        moved = harness.max_difference(_reference(name), cells.build(name).state_dict(), integers=False)
        assert moved > 1e-4 and _first_norm(name) > 2 * harness.CLIP, f"{name}: training did not move the weights, or clipping is untested"
        by_op = summary["comm"]["by_op"]
        style = options.get("cp_style", "ring")
        expected = _expected(name, options["cp"], tp, style)
        for key, want in expected.items():
            assert by_op[key]["sent_bytes"] == want, f"{name} {strategy} {options}: {key} sent {by_op[key]['sent_bytes']}, formula {want}"
        # the planner's figure (cost.py, from the model's sizes) is the same bytes
        spec = transformer_spec(name, layers=2, hidden=32, heads=4, vocab=zoo.VOCAB, seq=zoo.SEQ, act_bytes=8)
        planned = harness.STEPS * attention_bytes(spec, harness.GLOBAL_BATCH, options["cp"], style, kv_heads=_kv_heads(name)[1], tp=tp)
        assert planned == sum(expected.values()), f"{name} {options}: cost.attention_bytes {planned} != recorded {sum(expected.values())}"


@pytest.mark.timeout(900)
def test_cp2_matches_single_and_bytes_match_the_formulas() -> None:
    _check_cells(TWO, _two()[: len(TWO)])


@pytest.mark.timeout(900)
def test_the_model_s_own_loss_is_the_loss_of_all_tokens() -> None:
    for (name, _, options, _), (summary, state) in zip(OWN_LOSS, _two()[len(TWO) : len(TWO) + len(OWN_LOSS)], strict=True):
        diff = harness.max_difference(state, _reference(name, own_loss=True))
        assert diff <= OWN_TOL, f"{name} {options} with the model's own loss: largest parameter difference from single {diff:.3g}"
        # the value too: each rank's loss of its tokens is made the loss of all tokens (its gradient unchanged)
        want = _single(name, own_loss=True)[0]["train_loss"]
        assert summary["train_loss"] == pytest.approx(want, rel=OWN_TOL), f"{name} {options}: reported loss {summary['train_loss']} != single's {want}"


@pytest.mark.timeout(900)
def test_cp2_with_tp2_and_cp4_match_single() -> None:
    results = launch(cells.run, FOUR, nproc=4, threads_per_proc=1, timeout=800)[0]
    _check_cells(FOUR, results)


@pytest.mark.timeout(900)
def test_a_model_s_training_step_goes_through_cp() -> None:
    """The forward a training_step calls is split (ring bytes as the formula, outputs gathered, the loss
    all-reduced over cp) and the weights are single's: before, the Trainer's call of training_step
    dropped cp's forward (Llama: ring attention over unsplit inputs, 4.8e-4 off; nanoGPT: nothing split)."""
    for (name, _, options, _), (summary, state) in zip(OWN_STEP, _two()[len(TWO) + len(OWN_LOSS) :], strict=True):
        family = "llama" if name == "llama_step" else "nanogpt"
        diff = harness.max_difference(state, _reference(family, own_loss=family == "llama"))
        tol = OWN_TOL if family == "llama" else harness.TOL
        assert diff <= tol, f"{name} {options}: largest parameter difference from single {diff:.3g}"
        want = _single(family, own_loss=family == "llama")[0]["train_loss"]
        assert summary["train_loss"] == pytest.approx(want, rel=tol), f"{name} {options}: reported loss {summary['train_loss']} != single's {want}"
        by_op = summary["comm"]["by_op"]
        for key, want in _expected(family, 2, 1, "ring").items():
            assert by_op.get(key, {}).get("sent_bytes") == want, f"{name}: {key} {by_op.get(key)}, formula {want}"
        assert "cp/all_gather" in by_op and "cp/all_reduce" in by_op, f"{name}: no gather or loss reduction over cp: {sorted(by_op)}"


# -- refusals, in the parent ----------------------------------------------------------------------


def _sample(name: str, seq: int = zoo.SEQ) -> Any:
    b = zoo.batch(cells.data_name(name), 1)
    return {k: v[:, :seq] for k, v in b.items()} if isinstance(b, dict) else tuple(t[:, :seq] for t in b)


def test_refuses_a_sequence_that_does_not_split_into_2cp_chunks() -> None:
    with pytest.raises(ConfigError, match=r"sequence length 14 is not divisible by 8"):
        DDP(cp=4).check_sample(cells.build("llama"), _sample("llama", 14), DDP(cp=4).plan(4))


def test_refuses_sliding_windows_dropout_and_padding() -> None:
    model = cells.build("qwen2")
    model.config.use_sliding_window, model.config.sliding_window = True, 4
    with pytest.raises(ConfigError, match=r"sliding-window attention \(window 4\)"):
        DDP(cp=2).check_sample(model, _sample("qwen2"), DDP(cp=2).plan(2))
    dropping = cells.build("gpt2")
    dropping.config.attn_pdrop = 0.1
    with pytest.raises(ConfigError, match=r"attention dropout \(attn_pdrop=0.1\)"):
        DDP(cp=2).check_sample(dropping, _sample("gpt2"), DDP(cp=2).plan(2))
    padded = dict(_sample("llama"), attention_mask=torch.tensor([[0] * 4 + [1] * 12]))
    with pytest.raises(ConfigError, match=r"attention_mask with padding"):
        DDP(cp=2).check_sample(cells.build("llama"), padded, DDP(cp=2).plan(2))


class _HandAttention(nn.Module):
    """Attention written out by hand (softmax of q k^T): no routing reaches it."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        mask = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).tril()
        return torch.softmax((q @ k.transpose(1, 2)).masked_fill(~mask, float("-inf")), -1) @ v


class _HandModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.attn, self.head = nn.Embedding(64, 8), _HandAttention(), nn.Linear(8, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(self.emb(idx)))


def test_refuses_an_attention_the_routing_does_not_reach() -> None:
    with pytest.raises(ConfigError, match=r"1 attention module\(s\) compute theirs another way: \['attn'\]"):
        DDP(cp=2).check_sample(_HandModel(), _sample("nanogpt"), DDP(cp=2).plan(2))


def test_refuses_bad_options() -> None:
    with pytest.raises(ConfigError, match=r"cp \(context-parallel degree\) must be a whole number >= 1; got 0"):
        DDP(cp=0)
    with pytest.raises(ConfigError, match=r"cp_style must be one of ring, ulysses; got 'star'"):
        TensorParallel(cp=2, cp_style="star")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"world size 3 is not divisible by cp 2"):
        DDP(cp=2).plan(3)
    with pytest.raises(ConfigError, match=r"'ulysses' splits attention heads over cp; 4 heads do not divide by cp 8"):
        DDP(cp=8, cp_style="ulysses").check_sample(cells.build("gpt2"), _sample("gpt2"), DDP(cp=8).plan(8))


def test_layout_puts_cp_between_dp_and_tp() -> None:
    layout = TensorParallel(tp=2, cp=2).plan(8)
    assert dict(layout.degrees) == {"dp": 2, "pp": 1, "cp": 2, "tp": 2} and layout.data_parallel == 2


# -- a model's own training_step, in the parent ---------------------------------------------------


class _Cut(torch.utils.data.Dataset):
    """nanoGPT's samples cut to ``seq`` tokens."""

    def __init__(self, seq: int) -> None:
        self.data, self.seq = zoo.dataset("nanogpt_targets", 8), seq

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        return x[: self.seq], y[: self.seq]


def _fit_check(model: nn.Module, data: Any) -> None:
    """``fit``'s checks before launch (nothing runs) under ddp cp=2 on 2 processes, the model's own loss."""
    harness.trainer("nanogpt_targets", "ddp", {"cp": 2}, own_loss=True, nproc=2)._check(model, data)


class _DroppingAttention(zoo.CausalSelfAttention):
    """nanoGPT's attention with its dropout inside scaled_dot_product_attention while training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(self.n_embd, dim=2))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class _NoCall(zoo.NanoGPTTargets):
    def training_step(self, batch: Any) -> torch.Tensor:
        return self.lm_head.weight.sum()


def test_a_training_step_model_is_checked_before_launch() -> None:
    """Divisibility, dropout and a step that never calls the model: refused in the parent for a model
    whose training_step calls ``self(x, y)`` (the check runs on that call's arguments); 16 tokens pass."""
    _fit_check(cells.build("nanogpt_targets"), _Cut(16))
    with pytest.raises(ConfigError, match=r"sequence length 14 is not divisible by 4"):
        _fit_check(cells.build("nanogpt_targets"), _Cut(14))
    dropping = cells.build("nanogpt_targets")
    for block in dropping.transformer.h:  # type: ignore[union-attr]
        block.attn.__class__ = _DroppingAttention
    with pytest.raises(ConfigError, match=r"scaled_dot_product_attention call.*dropout_p=0.1"):
        _fit_check(dropping, _Cut(16))
    torch.manual_seed(0)
    with pytest.raises(ConfigError, match=r"training_step returned without calling the model"):
        _fit_check(_NoCall(layers=1).double(), _Cut(16))


def test_a_training_step_keeps_cp_s_forward_and_workers_train_the_parent_s_class() -> None:
    """The two causes of the trial's wrong run: the Trainer's call of training_step through a wrapper
    (`call_through`) removed an instance's forward (cp's); and a worker re-running the script took its
    own model of the same weights but another class (the training_step one) for the parent's plain one."""
    from shardwise.engine.engine import call_through
    from shardwise.trainer.handoff import fingerprint

    model, seen = cells.build("nanogpt_targets"), []

    def own(*a: Any, **k: Any) -> Any:
        seen.append(a)
        return type(model).forward(model, *a, **k)

    model.forward = own
    wrapper = nn.Sequential(model)  # a wrapper that calls the module's forward, as DDP does
    wrapper.forward = lambda b: model(b)  # type: ignore[method-assign]
    call_through(wrapper, model, "training_step", zoo.batch("nanogpt_targets", 2))
    assert len(seen) == 1 and model.__dict__.get("forward") is own
    assert fingerprint(cells.build("llama_step")) != fingerprint(cells.build("llama"))
