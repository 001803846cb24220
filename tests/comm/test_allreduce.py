"""Every allreduce algorithm and every compressed exchange: values, bit-identical ranks, exact traffic.

One launch per world size p in {2, 3, 4} runs the whole matrix (algorithms x ops
x dtypes x sizes, sizes not divisible by p included, the ring also with small
pipelined segments, and a subgroup at p = 4); each worker returns its failures
and a digest of every result, and the parent asserts no failures and equal
digests across ranks.
"""

from __future__ import annotations

import hashlib

import pytest
import torch
import torch.distributed as dist

import shardwise.comm.algorithms as algorithms
from shardwise import launch
from shardwise.comm.algorithms import ALGORITHMS, allreduce
from shardwise.comm.codecs import Cast, CodecState, get_codec
from shardwise.comm.collectives import Group
from shardwise.comm.compressed import compressed_allreduce, compressed_traffic
from shardwise.comm.recorder import Recorder
from shardwise.comm.traffic import allreduce_traffic
from shardwise.errors import ConfigError

pytestmark = pytest.mark.dist

FLOATS = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
INTS = (torch.int64, torch.int8)
SIZES = (1, 5, 13, 1001)


def _input(j: int, n: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Rank j's tensor: every rank can rebuild every other rank's, so each checks the reference alone."""
    g = torch.Generator().manual_seed(10_000 * salt + 100 * j + n)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-30, 30, (n,), generator=g).to(dtype)


def _reference(xs: list[torch.Tensor], op: str) -> torch.Tensor:
    stack = torch.stack([x.double() for x in xs])
    return {"sum": stack.sum(0), "avg": stack.mean(0), "min": stack.min(0).values, "max": stack.max(0).values}[op]


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha1(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _check(fails: list[str], digests: list[str], label: str, out: torch.Tensor, xs: list[torch.Tensor], op: str) -> None:
    digests.append(_digest(out))
    ref = _reference(xs, op)
    if not out.dtype.is_floating_point or op in ("min", "max"):
        if not torch.equal(out.double(), ref):  # integers and min/max: exact
            fails.append(f"{label}: not exact, off by {(out.double() - ref).abs().max().item()}")
        return
    # Each of the p-1 additions rounds once (half an ulp of the partial sum), the average once more.
    p = len(xs)
    eps = torch.finfo(out.dtype).eps
    bound = p * eps * torch.stack([x.double().abs() for x in xs]).sum(0) / (p if op == "avg" else 1) + eps * ref.abs()
    err = (out.double() - ref).abs()
    if (err > bound).any():
        fails.append(f"{label}: error {err.max().item():.3g} above the bound {bound[err.argmax()].item():.3g}")


def _check_traffic(fails: list[str], label: str, rec: Recorder, op: str, want: object) -> None:
    tot = rec.totals()[op]
    got = (tot["count"], tot["sent_bytes"], tot["received_bytes"], tot["steps"])
    exp = (1, want.sent, want.received, want.steps)  # type: ignore[attr-defined]
    if got != exp:
        fails.append(f"{label}: recorded (count, sent, received, steps) {got}, formula {exp}")


def _algorithm_matrix(group: Group, fails: list[str], digests: list[str], tag: str) -> None:
    p, r = group.size, group.rank
    for algo in ALGORITHMS:
        for dtype in FLOATS + INTS:
            for op in ("sum", "avg", "min", "max"):
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for n in SIZES:
                    xs = [_input(j, n, dtype, 1) for j in range(p)]
                    out = xs[r].clone()
                    rec = Recorder()
                    allreduce(out, op, algorithm=algo, group=group, recorder=rec)
                    label = f"{tag} {algo} {op} {dtype} n={n}"
                    _check(fails, digests, label, out, xs, op)
                    _check_traffic(fails, label, rec, f"all_reduce:{algo}", allreduce_traffic(algo, n, out.element_size(), p, r))


def _pipelined_ring(fails: list[str], digests: list[str]) -> None:
    """Segments of 24 bytes: many segments in flight per round, some pieces split unevenly."""
    p, r = dist.get_world_size(), dist.get_rank()
    algorithms.RING_SEGMENT_BYTES = 24
    try:
        for dtype in (torch.float32, torch.int64, torch.bfloat16):
            for n in (7, 100, 1001):
                xs = [_input(j, n, dtype, 2) for j in range(p)]
                out = xs[r].clone().view(-1, 1) if n % 2 else xs[r].clone()
                rec = Recorder()
                allreduce(out, "sum", algorithm="ring", recorder=rec)
                _check(fails, digests, f"pipelined ring {dtype} n={n}", out.view(-1), xs, "sum")
                _check_traffic(fails, f"pipelined ring n={n}", rec, "all_reduce:ring", allreduce_traffic("ring", n, out.element_size(), p, r))
    finally:
        algorithms.RING_SEGMENT_BYTES = 8 << 20


def _codec_matrix(fails: list[str], digests: list[str]) -> None:
    """Each rank replays every rank's codec (same inputs, same seeds) to know the exact expected result.

    Every rank's state has the same seed, as the DDP hook gives them: random-k's exchange
    sums values at indices that all ranks draw alike. The second step of the codecs whose
    exchange is an allreduce (fp16, bf16, randomk) runs over our ring instead of native.
    """
    p, r = dist.get_world_size(), dist.get_rank()
    for spec in ("fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "sign"):
        codec = get_codec(spec)
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            for n in (1, 13, 1001):
                states = [CodecState(seed=7) for j in range(p)]
                mine = CodecState(seed=7)
                for step in range(2):  # the second step carries the first step's residual
                    xs = [_input(j, n, dtype, 3 + step) for j in range(p)]
                    prescale = p if isinstance(codec, Cast) else 1  # the 16-bit casts average before the sum
                    pieces = p if codec.exchange == "scatter-gather" else 1  # int8: one range per destination
                    sents = [codec.compress(xs[j] / prescale, states[j], pieces)[1] for j in range(p)]
                    out = xs[r].clone()
                    rec = Recorder()
                    algo = "ring" if step == 1 and codec.exchange == "allreduce" else "native"
                    compressed_allreduce(out, codec, mine, op="avg", recorder=rec, algorithm=algo)
                    digests.append(_digest(out))
                    label = f"{spec} {dtype} n={n} step {step}"
                    ref = sum(s.double() for s in sents) / (1 if prescale > 1 else p)
                    # Sums of p terms in the tensor's dtype (or the 16-bit wire type) round p times.
                    eps = max(torch.finfo(dtype).eps, torch.finfo(codec.wire).eps if isinstance(codec, Cast) else 0.0)
                    tol = 4 * p * eps * (1 + ref.abs().max().item())
                    if codec.exchange == "scatter-gather":
                        # The owner quantizes the sum again: half a step of a range at most twice its largest value.
                        tol += torch.stack([s.double() for s in sents]).abs().sum(0).max().item() / p / 255
                    err = (out.double() - ref).abs().max().item()
                    if err > tol:
                        fails.append(f"{label}: off the replayed reference by {err:.3g} (tolerance {tol:.3g})")
                    _check_traffic(fails, label, rec, f"compressed:{codec.spec}", compressed_traffic(codec, n, dtype, p, r, algo))


def _subgroup(fails: list[str], digests: list[str]) -> None:
    """Ranks {1, 3} and {0, 2} reduce in their own groups at the same time: group ranks are translated."""
    pairs = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    r = dist.get_rank()
    group = Group(f"pair{r % 2}", pairs[r % 2])
    for algo in ("ring", "rabenseifner", "tree", "master-worker"):
        n = 11
        xs = [_input(2 * j + r % 2, n, torch.float64, 5) for j in range(2)]
        out = xs[group.rank].clone()
        rec = Recorder()
        allreduce(out, "sum", algorithm=algo, group=group, recorder=rec)
        ref = xs[0] + xs[1]
        if not torch.equal(out, ref):
            fails.append(f"subgroup {group.name} {algo}: wrong sum")
        _check_traffic(fails, f"subgroup {algo}", rec, f"all_reduce:{algo}", allreduce_traffic(algo, n, 8, 2, group.rank))


def _matrix() -> tuple[list[str], list[str]]:
    fails: list[str] = []
    digests: list[str] = []
    world = Group()
    _algorithm_matrix(world, fails, digests, "world")
    _pipelined_ring(fails, digests)
    _codec_matrix(fails, digests)
    if dist.get_world_size() == 4:
        _subgroup(fails, [])
    return fails, digests


@pytest.mark.parametrize("p", [2, 3, 4])
def test_every_algorithm_and_codec_is_correct_and_moves_the_formula_bytes(p):
    results = launch(_matrix, nproc=p, threads_per_proc=1)
    for rank, (fails, _) in enumerate(results):
        assert fails == [], f"rank {rank} of {p}:\n" + "\n".join(fails[:20])
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests), "ranks ended with different bits"
    # The whole matrix ran: 7 algorithms x (4 float dtypes x 4 ops + 2 int dtypes x 3 ops) x 4 sizes,
    # 9 pipelined rings, 6 codecs x 3 dtypes x 3 sizes x 2 steps.
    assert len(digests[0]) == 7 * (4 * 4 + 2 * 3) * 4 + 9 + 6 * 3 * 3 * 2


def test_bad_inputs_are_clear_errors_before_any_communication():
    with pytest.raises(ConfigError, match=r"unknown allreduce algorithm 'rign'\. Did you mean 'ring'\? Known algorithms: ring, recursive-doubling"):
        allreduce(torch.ones(3), algorithm="rign")
    with pytest.raises(ConfigError, match=r"op 'avg' needs a floating-point tensor; got torch.int64"):
        allreduce(torch.ones(3, dtype=torch.int64), "avg")
    with pytest.raises(ConfigError, match=r"unknown reduce op 'prod'; choose one of sum, avg, min, max"):
        allreduce(torch.ones(3), "prod")
    with pytest.raises(ConfigError, match=r"supports dtypes .* got torch.complex64"):
        allreduce(torch.ones(3, dtype=torch.complex64))
    with pytest.raises(ConfigError, match=r"codec 'topk:0.1' compresses floating-point gradients; got a tensor of dtype torch.int32"):
        compressed_allreduce(torch.ones(3, dtype=torch.int32), get_codec("topk:0.1"), CodecState())
    with pytest.raises(ConfigError, match=r"codec 'int8' has its own exchange \(scatter-gather\); allreduce='ring'"):
        compressed_allreduce(torch.ones(3), get_codec("int8"), CodecState(), algorithm="ring")
    with pytest.raises(ConfigError, match=r"compressed allreduce sums or averages; got op 'max'"):
        compressed_allreduce(torch.ones(3), get_codec("fp16"), CodecState(), op="max")
