"""The parent's check of the mechanism: every cp rank emulated in one process, before launch.

On one sample, in float64, no gradient, on a copy of the model:

1. the whole sequence runs through the cp forward of a group of one (`apply.local_call`, attention
   routed), each attention call recording its q, k and v over the whole sequence;
2. each cp rank r runs exactly as it would under cp (`apply.local_call` with an emulated group of
   rank r: the same zig-zag split of inputs, position ids, position hooks and label shift); at its
   i-th attention call its own q, k and v must equal the recorded call i's at r's true positions (the
   first that differs is named: positions built from the local length, usually ``arange(t)``), and
   its output is its q attending to the recorded whole k/v under the causal mask by true positions;
3. the ranks' per-token outputs, put back in sequence order, must equal the whole run's
   (a module that mixes tokens outside attention: a convolution, a cumulative sum, a token shift).

Any difference above `TOL` (relative to the largest magnitude) is a `ConfigError` before launch.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardwise.comm.collectives import Group
from shardwise.errors import ConfigError
from shardwise.strategies.context_parallel import zigzag
from shardwise.strategies.context_parallel.apply import local_call
from shardwise.strategies.context_parallel.hooks import CPState, position_hooks, route_hf
from shardwise.strategies.context_parallel.ring import SDPA, _expand

TOL = 1e-9
"""Largest relative difference (float64) between an emulated rank and the whole sequence."""

_FIX = (
    "the likely cause: positions built inside forward from the local length (arange(t), t = x.shape[1]), which under cp "
    "are each rank's 0..t-1 instead of its tokens' true positions. Take positions as an input (position_ids for "
    "transformers' models, or a [batch, sequence] tensor argument, split with the tokens), or look them up in an "
    "nn.Embedding fed arange(t) (cp feeds it the true positions); or run without cp"
)


@dataclass(frozen=True)
class _Emulated(Group):
    """Rank ``r`` of a cp group of ``p`` processes, in the parent (nothing is communicated)."""

    p: int = 1
    r: int = 0

    @property
    def size(self) -> int:
        return self.p

    @property
    def rank(self) -> int:
        return self.r


def _double(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.double() if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: _double(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(_double(v) for v in x)
    return x


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference relative to ``want``'s largest magnitude (inf for different shapes)."""
    if got.shape != want.shape:
        return float("inf")
    return float((got - want).abs().max()) / max(float(want.abs().max()), 1e-300)


class _Emulator:
    """The probe model, its routing, and the attention functions of the whole run and of each rank."""

    def __init__(self, model: nn.Module, strategy: str) -> None:
        self.probe = copy.deepcopy(model).to(torch.float64).eval()
        self.state = CPState(_Emulated(p=1), None)
        self.hf = route_hf(self.probe, self.state) is not None
        self.local: list[torch.Tensor] = []
        self.strategy = strategy
        self.record: list[tuple[torch.Tensor, ...]] = []
        self.where: list[str] = []
        self.stack: list[str] = []
        for name, m in self.probe.named_modules():
            m.register_forward_pre_hook(self._enter(name or "the model"))
            m.register_forward_hook(self._leave)
        position_hooks(self.probe, self.state, self.local)

    def _enter(self, name: str) -> Any:
        def enter(mod: nn.Module, a: Any) -> None:
            self.stack.append(name)

        return enter

    def _leave(self, mod: nn.Module, a: Any, o: Any) -> None:
        self.stack.pop()

    def run(self, args: tuple[Any, ...], kwargs: dict[str, Any], attend: Any) -> tuple[Any, int]:
        self.state.attend = attend  # type: ignore[method-assign]
        return local_call(self.probe.forward, self.state, self.local, self.hf, args, kwargs)

    def whole(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        self.record.append((q, k, v))
        self.where.append(self.stack[-1] if self.stack else "the model")
        return SDPA(q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def rank_attend(self, rank: int, cp: int) -> Any:
        calls = iter(range(len(self.record) + 1))

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            i = next(calls)
            where = self.stack[-1] if self.stack else "the model"
            if i >= len(self.record):
                raise ConfigError(
                    f"{self.strategy}: context parallelism would not be exact: emulated cp rank {rank} calls attention more often "
                    f"than the whole sequence does ({len(self.record)} calls; another at {where!r}); run without cp"
                )
            pos = zigzag.positions(self.state.seq, cp, rank, q.device)
            for label, mine, full in zip("qkv", (q, k, v), self.record[i], strict=True):
                diff = _rel(mine, full[:, :, pos])
                if not diff <= TOL:
                    raise ConfigError(
                        f"{self.strategy}: context parallelism would train this model silently wrong: at attention call {i} "
                        f"({self.where[i]!r}) the {label} of emulated cp rank {rank} of {cp} differs from the whole sequence's at "
                        f"the rank's positions by {diff:.3g} (relative); {_FIX}"
                    )
            _, kf, vf = self.record[i]
            groups = q.shape[1] // kf.shape[1]
            mask = pos[:, None] >= torch.arange(kf.shape[2], device=q.device)[None, :]
            return SDPA(q, _expand(kf, groups), _expand(vf, groups), attn_mask=mask, scale=scale)

        return attend


LOW_PRECISION_TOL = 1e-5
"""Relative tolerance for a scalar output (a loss transformers computes in float32 whatever the logits' dtype)."""


def check_ranks(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], cp: int, strategy: str) -> None:
    """Emulate the ``cp`` ranks on one sample (see the module); a `ConfigError` naming the first difference.

    Every tensor the model returns is compared, as the cp forward hands it on (`apply._finish`): a
    per-token output gathered in sequence order, a scalar loss averaged over the ranks, anything else
    (a pooled or last-token output: a sequence classifier's logits) as each rank has it."""
    em = _Emulator(model, strategy)
    args, kwargs = _double(args), _double(kwargs)
    with torch.no_grad():
        want = _leaves(em.run(args, kwargs, em.whole)[0])
        parts = []
        for rank in range(cp):
            em.state.group = _Emulated(p=cp, r=rank)
            out, n = em.run(args, kwargs, em.rank_attend(rank, cp))
            parts.append(_leaves(out))
    for j, whole in enumerate(want):
        ranks = [p[j] if j < len(p) else None for p in parts]
        if any(r is None for r in ranks):
            return  # outputs of another structure: the attention calls' checks stand alone
        got, per_token = _as_handed_on([r for r in ranks if r is not None], whole, n, cp)
        diff = _rel(got, whole)
        # transformers computes its loss in float32 even for float64 logits (the value rounded so, its dtype
        # float64): a scalar is held to float32's rounding; per-token outputs (the logits) to TOL
        if diff <= (LOW_PRECISION_TOL if whole.dim() == 0 else TOL):
            continue
        if per_token:
            raise ConfigError(
                f"{strategy}: context parallelism would train this model silently wrong: the outputs of the {cp} emulated cp ranks, "
                f"put back in sequence order, differ from the whole sequence's by {diff:.3g} (relative) though every attention call "
                "matched: something outside attention mixes tokens along the sequence (a convolution, a cumulative sum, a token "
                "shift) or depends on the sequence length or on positions built from it; context parallelism splits attention "
                "only. Run without cp"
            )
        raise ConfigError(
            f"{strategy}: context parallelism would train this model silently wrong: its output {j} (shape "
            f"{tuple(whole.shape)}) is not one value per token, and each of the {cp} emulated cp ranks computes it from its "
            f"own chunks of the sequence, {diff:.3g} (relative) away from the whole sequence's (a pooled or last-token output: "
            "a sequence classifier, a forward that returns only the last position). Context parallelism fits models whose "
            "outputs are per token (a language model's logits, its token-mean loss). Run without cp"
        )


def _leaves(out: Any) -> list[torch.Tensor]:
    """The tensors of a model output in order (a tensor, a tuple or list, a transformers ModelOutput)."""
    if isinstance(out, torch.Tensor):
        return [out.detach()]
    if hasattr(out, "keys") and hasattr(out, "values"):
        return [t.detach() for t in out.values() if isinstance(t, torch.Tensor)]
    if isinstance(out, (tuple, list)):
        return [t.detach() for t in out if isinstance(t, torch.Tensor)]
    return []


def _as_handed_on(ranks: list[torch.Tensor], whole: torch.Tensor, n: int, cp: int) -> tuple[torch.Tensor, bool]:
    """The ranks' values of one output as the cp forward hands it on, and whether it is per token."""
    if whole.dim() >= 2 and whole.shape[1] == n * cp and all(r.dim() >= 2 and r.shape[1] == n for r in ranks):
        gathered = torch.cat(ranks, dim=1)
        got = torch.empty_like(gathered)
        got[:, zigzag.rank_order(gathered.shape[1], cp, got.device)] = gathered
        return got, True
    if whole.dim() == 0 and whole.is_floating_point():
        return torch.stack(ranks).mean(), False  # each rank's share of the loss of all tokens, averaged
    worst = max(ranks, key=lambda r: _rel(r, whole))
    return worst, False
