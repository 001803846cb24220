"""Context parallelism: the sequence of each sample split over ``cp`` ranks, attention by ring or Ulysses.

Not a strategy of its own: an option (``cp``, ``cp_style``) of ``ddp``, the sharded strategies and
``tp``, applied through `shardwise.strategies.compose` before their data or tensor parallelism. The
cp ranks of one data-parallel coordinate see the same samples and each runs its zig-zag share of
every sequence (`zigzag.py`); attention goes round the ring (`ring.py`), reached through
transformers' attention interface or ``F.scaled_dot_product_attention`` (`hooks.py`); gradients are
averaged over dp x cp. Design notes: docs/strategies/context_parallel.md.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.errors import ConfigError
from shardwise.strategies.context_parallel.apply import apply_context_parallel, check_divisible, sequence_length
from shardwise.strategies.context_parallel.hooks import CPState

STYLES = ("ring", "ulysses")
"""``cp_style``: key/value blocks around the ring, or all-to-all over heads."""

__all__ = ["STYLES", "CPState", "apply_context_parallel", "check_model", "check_options", "cp_layout"]


def check_options(strategy: str, cp: int, style: str) -> None:
    """A `ConfigError` for a cp degree below 1 or an unknown style."""
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ConfigError(f"{strategy}: cp (context-parallel degree) must be a whole number >= 1; got {cp!r}")
    if style not in STYLES:
        raise ConfigError(f"{strategy}: cp_style must be one of {', '.join(STYLES)}; got {style!r}")


def cp_layout(plan: Callable[[int], Any], world_size: int, cp: int, strategy: str) -> Any:
    """The layout ``plan`` gives for ``world_size // cp`` processes, with ``cp`` inserted into its mesh:
    the cp ranks of one data-parallel coordinate share its samples, so the batch split is the same."""
    if cp == 1:
        return plan(world_size)
    if world_size % cp:
        raise ConfigError(f"{strategy}: the world size {world_size} is not divisible by cp {cp}; choose a cp that divides it")
    inner = plan(world_size // cp)
    degrees = dict(inner.degrees)
    if degrees.get("pp", 1) > 1:
        raise ConfigError(f"{strategy}: context parallelism with a pipeline (pp {degrees['pp']}) is not supported; use pp=1 with cp > 1")
    degrees = {"dp": degrees.get("dp", 1), "pp": degrees.get("pp", 1), "cp": cp, "tp": degrees.get("tp", 1)}
    return dataclasses.replace(inner, world_size=world_size, trainers=inner.trainers * cp, degrees=degrees)


def _heads(model: nn.Module) -> tuple[int, int] | None:
    cfg = getattr(model, "config", None)
    h: Any = getattr(cfg, "num_attention_heads", None) or getattr(cfg, "n_head", None)
    kv: Any = getattr(cfg, "num_key_value_heads", None) or h
    return (int(h), int(kv)) if h else None


def check_model(model: nn.Module, batch: Any, cp: int, style: str, strategy: str) -> None:
    """In the parent, on one collated sample: the sequence splits into 2 x cp chunks, and the model run
    with its attention routed through context parallelism's (here: plain causal attention, cp 1) gives
    the model's own output, and no attention-looking module was left out (the backstop); then every cp
    rank, emulated, computes what the whole sequence does at its positions (`emulate.check_ranks`).
    A model with a ``training_step`` is checked on the arguments of its first ``self(...)`` call."""
    if cp == 1:
        return
    args, kwargs = _forward_args(model, batch, cp, strategy)
    check_divisible(sequence_length(args, kwargs), cp)
    cfg = getattr(model, "config", None)
    window = getattr(cfg, "sliding_window", None)
    if window is not None and getattr(cfg, "use_sliding_window", True) and window < sequence_length(args, kwargs):
        raise ConfigError(f"{strategy}: context parallelism cannot be exact for sliding-window attention (window {window}); run without cp")
    for key in ("attention_dropout", "attn_pdrop"):
        if float(getattr(cfg, key, 0.0) or 0.0) > 0:
            raise ConfigError(
                f"{strategy}: context parallelism cannot be exact with attention dropout ({key}={getattr(cfg, key)}); set it to 0 or run without cp"
            )
    heads = _heads(model)
    if style == "ulysses" and heads is not None and heads[0] % cp:
        raise ConfigError(f"{strategy}: cp_style 'ulysses' splits attention heads over cp; {heads[0]} heads do not divide by cp {cp}. Use cp_style='ring'")
    from shardwise.strategies.context_parallel.emulate import check_ranks

    # The mechanism: each cp rank emulated against the whole sequence. On a prefix of CHECK_CHUNK
    # tokens a chunk: positions built wrongly show on any length, and the recorded q/k/v of every
    # layer stay small however long the training sequence is (4k tokens of a 32-layer, 4096-wide
    # model would be ~13 GB in the parent); the routing probe runs on the same prefix. A forward
    # that refuses the shorter sequence is checked whole.
    short = _prefix(args, kwargs, sequence_length(args, kwargs), 2 * cp * CHECK_CHUNK)
    if short is not None:
        try:
            _probe(model, *short, strategy)
            check_ranks(model, *short, cp, strategy)
            return
        except ConfigError:
            raise
        except Exception:  # noqa: BLE001 - the model's own limit on lengths; the whole sample decides
            pass
    _probe(model, args, kwargs, strategy)
    check_ranks(model, args, kwargs, cp, strategy)


def _forward_args(model: nn.Module, batch: Any, cp: int, strategy: str) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The forward's arguments for ``batch``: the batch's own (`model_args`), or for a model with a
    ``training_step`` those of its first ``self(...)`` call (`own_call`: the step stopped there)."""
    from shardwise.data.batches import model_args, own_call

    if not callable(getattr(model, "training_step", None)):
        return model_args(batch)
    name = type(model).__name__
    try:
        called = own_call(model, batch)
    except Exception as exc:  # noqa: BLE001 - the user's step on one sample: said in one line
        raise ConfigError(f"{strategy}: {name}.training_step raised {type(exc).__name__} on a sample before calling the model ({exc})") from None
    if called is None:
        raise ConfigError(
            f"{strategy}: {name}.training_step returned without calling the model (self(...)); context parallelism (cp={cp}) "
            "splits the sequence of the model's forward calls, so nothing would be split. Call self(...) in training_step, or run without cp"
        )
    return called


CHECK_CHUNK = 8
"""Tokens per zig-zag chunk in the parent's emulated-rank check (a prefix of the sample)."""


def _prefix(args: tuple[Any, ...], kwargs: dict[str, Any], seq: int, keep: int) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """The call on the first ``keep`` tokens (every tensor whose dim 1 is the sequence, as the cp split
    cuts them), or None when the sequence is no longer than that."""
    if seq <= keep:
        return None

    def cut(v: Any) -> Any:
        return v[:, :keep] if isinstance(v, torch.Tensor) and v.dim() >= 2 and v.shape[1] == seq else v

    return tuple(cut(a) for a in args), {k: cut(v) for k, v in kwargs.items()}


def _probe(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], strategy: str) -> None:
    """Run ``model`` on the sample twice, as it is and with attention routed; refuse a difference or an unreached attention."""
    import copy

    probe = copy.deepcopy(model)
    state = apply_context_parallel(probe, _Alone("cp"), None)
    calls: dict[int, str] = {}
    stack: list[int] = []
    hooks = []

    def enter(mod: nn.Module, a: Any) -> None:
        stack.append(id(mod))

    def leave(mod: nn.Module, a: Any, o: Any) -> None:
        stack.pop()

    for name, m in probe.named_modules():
        calls[id(m)] = name
        hooks.append(m.register_forward_pre_hook(enter))
        hooks.append(m.register_forward_hook(leave))
    reached: set[int] = set()
    original_attend = state.attend

    def attend(*a: Any) -> torch.Tensor:
        reached.update(stack)
        return original_attend(*a)

    state.attend = attend  # type: ignore[method-assign,assignment]
    was = model.training
    model.eval(), probe.eval()
    try:
        with torch.no_grad():
            want = _first_tensor(model(*args, **kwargs))
            got = _first_tensor(probe(*args, **kwargs))
    finally:
        model.train(was)
        for h in hooks:
            h.remove()
    missed = [calls[id(m)] for m in probe.modules() if _looks_like_attention(m) and id(m) not in reached]
    if missed:
        raise ConfigError(
            f"{strategy}: context parallelism reaches attention through transformers' attention interface or "
            f"F.scaled_dot_product_attention, and {len(missed)} attention module(s) compute theirs another way: {missed[:4]}; "
            "route them through F.scaled_dot_product_attention(..., is_causal=True), or run without cp"
        )
    if want is not None and got is not None and not torch.allclose(want, got, rtol=1e-5, atol=1e-6):
        diff = (want - got).abs().max().item()
        raise ConfigError(
            f"{strategy}: with attention routed through context parallelism the model's output differs from its own by {diff:.3g}: "
            "its attention is not plain causal attention (a mask, a window, a bias, or positions the split cannot follow). Run without cp"
        )
    _train_mode(probe, args, kwargs)


def _train_mode(probe: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """The routed probe run once in training mode (no gradients, the random state restored): what only
    training does to attention (dropout in ``scaled_dot_product_attention`` or transformers' attention
    call) is refused here, before launch, not at the workers' first step. Other errors are left to the run."""
    probe.train()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            probe(*args, **kwargs)
    except ConfigError:
        raise
    except Exception:  # noqa: BLE001 - the model's own training-mode needs; the eval-mode checks above decided
        pass


class _Alone(Group):
    """A group of this process alone, whatever group the parent is in (the probe's)."""

    @property
    def size(self) -> int:
        return 1

    @property
    def rank(self) -> int:
        return 0


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out.detach().double()
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits.detach().double()
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0].detach().double()
    return None


def _looks_like_attention(m: nn.Module) -> bool:
    """An attention module by structure: it holds query and key projections (separate, or one fused
    q|k|v linear named for attention), and no child does."""
    own = {n for n, _ in m.named_children()}
    separate = any(q in own for q in ("q_proj", "query", "wq", "q")) and any(k in own for k in ("k_proj", "key", "wk", "k"))
    fused = any(f in own for f in ("c_attn", "qkv_proj", "query_key_value", "qkv", "Wqkv", "in_proj"))
    return separate or fused
