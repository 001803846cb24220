"""Hierarchical allreduce on a real two-level mesh: world size 4 as 2 "nodes" of 2 ranks, one launch.

- values: float64 inputs whose sums are exact equal the backend's own allreduce bit for bit
  (sum, avg, min, max), float32 random inputs agree with the float64 reference within rounding,
  int64 exactly; every rank ends with the same bits;
- bytes per level, written out here: for a vector of N bytes a leader receives N in its node's
  reduce, moves the leaders' all-reduce bytes (native over 2 leaders: 2(2-1)/2 N = N each way;
  ring: exact, in 2 rounds), and sends N in its node's broadcast; the other rank of a node
  sends N and receives N, and takes no part in the leaders' all-reduce;
- ddp with ``allreduce="hierarchical"`` (``node_size=2``, and the node size read from
  ``LOCAL_WORLD_SIZE``) trains equal to one process on the whole batch (float64, 1e-12), each
  level's bytes recorded once per step.
"""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwise import launch
from shardwise.comm.collectives import WORLD
from shardwise.comm.hierarchical import NodeLevels, hierarchical_allreduce
from shardwise.comm.mesh import Mesh
from shardwise.comm.recorder import Recorder
from shardwise.comm.traffic import hierarchical_traffic
from shardwise.errors import ConfigError
from shardwise.strategies.data_parallel.ddp import DDP

pytestmark = pytest.mark.dist

P, L = 4, 2


def _input(j: int, n: int, dtype: torch.dtype, exact: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * j + n)
    if not dtype.is_floating_point:
        return torch.randint(-50, 50, (n,), generator=g).to(dtype)
    if exact:  # multiples of 1/64 below 16: every sum of four is exact, in any order
        return (torch.randint(-1024, 1024, (n,), generator=g).double() / 64).to(dtype)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _levels_bytes(rec: Recorder) -> dict[str, tuple[int, int, int, int]]:
    return {k: (int(t["count"]), int(t["sent_bytes"]), int(t["received_bytes"]), int(t["steps"])) for k, t in rec.totals(by_group=True).items()}


def _values_and_bytes(levels: NodeLevels, fails: list[str], digests: list[str]) -> None:
    r = dist.get_rank()
    for dtype, exact, ops in ((torch.float64, True, ("sum", "avg", "min", "max")), (torch.float32, False, ("sum", "avg")), (torch.int64, True, ("sum", "max"))):
        for op in ops:
            for n in (1, 7, 1001):
                xs = [_input(j, n, dtype, exact) for j in range(P)]
                out, native = xs[r].clone(), xs[r].clone()
                rec = Recorder()
                hierarchical_allreduce(out, op, levels, recorder=rec)
                dist.all_reduce(native, op={"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}[op])
                if op == "avg":
                    native /= P
                digests.append(hashlib.sha1(out.numpy().tobytes()).hexdigest())
                label = f"{op} {dtype} n={n}"
                if exact and not torch.equal(out, native):
                    fails.append(f"{label}: differs from the native allreduce by {(out.double() - native.double()).abs().max().item():.3g}")
                if not exact:
                    stack = torch.stack([x.double() for x in xs])
                    ref = stack.sum(0) / (P if op == "avg" else 1)
                    bound = P * torch.finfo(dtype).eps * stack.abs().sum(0) / (P if op == "avg" else 1)
                    if ((out.double() - ref).abs() > bound).any() or ((native.double() - ref).abs() > bound).any():
                        fails.append(f"{label}: off the float64 reference beyond rounding")
                got, want = _levels_bytes(rec), hierarchical_traffic(n, out.element_size(), P, L, r)
                if got != {k: (1, t.sent, t.received, t.steps) for k, t in want.items()}:
                    fails.append(f"{label}: recorded {got}, formula {want}")
    # The levels written out for one case: 1001 float32 (N = 4004 bytes).
    rec = Recorder()
    hierarchical_allreduce(torch.ones(1001), "sum", levels, recorder=rec)
    N = 4004
    want_leader = {"world/node/reduce": (1, 0, N, 0), "world/leaders/all_reduce:native": (1, N, N, 0), "world/node/broadcast": (1, N, 0, 0)}
    want_other = {"world/node/reduce": (1, N, 0, 0), "world/node/broadcast": (1, 0, N, 0)}
    got = {f"world/{k}": v for k, v in _levels_bytes(rec).items()}
    if got != (want_leader if r % L == 0 else want_other):
        fails.append(f"levels of 1001 float32 on rank {r}: {got}")
    rec = Recorder()
    hierarchical_allreduce(torch.ones(1001), "sum", levels, inter="ring", recorder=rec)
    ring = _levels_bytes(rec).get("leaders/all_reduce:ring")
    if ring != ((1, N, N, 2) if r % L == 0 else None):  # ring over 2 leaders: all but one piece of 2, twice, in 2 rounds
        fails.append(f"leaders' ring on rank {r}: {ring}")


_TARGET = torch.linspace(-1, 1, 18, dtype=torch.float64).view(6, 3)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).double()


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(8 * P, 6, generator=torch.Generator().manual_seed(step), dtype=torch.float64)
    return x, torch.tanh(x @ _TARGET)


def _train(options: dict | None, steps: int) -> tuple[list[torch.Tensor], Recorder]:
    """ddp over 4 ranks (each its 8 of the 32 samples), or one process on all 32 (options None)."""
    r = dist.get_rank()
    rec = Recorder()
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if options is not None:
        run = DDP(**options).apply(model, lambda ps: torch.optim.SGD(ps, lr=0.1), Mesh.build(world_size=P, rank=r), rec)
        model, opt = run.model, run.optimizer
    for step in range(steps):
        x, y = _batch(step)
        if options is not None:
            x, y = x[r * 8 : (r + 1) * 8], y[r * 8 : (r + 1) * 8]
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], rec


def _ddp(fails: list[str]) -> None:
    r, steps = dist.get_rank(), 5
    single, _ = _train(None, steps)
    n = sum(p.numel() for p in single)  # one bucket
    before = os.environ.get("LOCAL_WORLD_SIZE", "")
    os.environ["LOCAL_WORLD_SIZE"] = "2"  # as two machines of 2 processes would have it: node_size 0 reads it
    for options in ({"allreduce": "hierarchical", "node_size": 2}, {"allreduce": "hierarchical"}):
        params, rec = _train(options, steps)
        worst = max((a - b).abs().max().item() for a, b in zip(params, single, strict=True))
        if worst > 1e-12:
            fails.append(f"ddp {options}: parameters after {steps} steps differ from one process by {worst:.3g}")
        got = _levels_bytes(rec)
        want = {k: (steps, steps * t.sent, steps * t.received, steps * t.steps) for k, t in hierarchical_traffic(n, 8, P, L, r).items()}
        if got != want:
            fails.append(f"ddp {options}: recorded {got}, {steps} x the formula {want}")
    os.environ["LOCAL_WORLD_SIZE"] = before


def _worker() -> tuple[list[str], list[str]]:
    fails: list[str] = []
    digests: list[str] = []
    levels = NodeLevels.build(WORLD, node_size=L)
    r = dist.get_rank()
    assert levels.nodes == 2 and levels.leader == (r % L == 0) and levels.node is not None and levels.node.size == L
    assert (levels.leaders is not None) == levels.leader
    _values_and_bytes(levels, fails, digests)
    _ddp(fails)
    try:
        NodeLevels.build(WORLD, node_size=3)
        fails.append("node size 3 of world 4: no error")
    except ConfigError as exc:
        if "node size 3 does not divide the world size 4" not in str(exc):
            fails.append(f"node size 3: {exc}")
    return fails, digests


def test_hierarchical_on_two_nodes_of_two_equals_native_and_single_with_each_level_s_bytes():
    results = launch(_worker, nproc=P, threads_per_proc=1)
    for rank, (fails, _) in enumerate(results):
        assert fails == [], f"rank {rank}:\n" + "\n".join(fails[:20])
    digests = [d for _, d in results]
    assert all(d == digests[0] for d in digests) and len(digests[0]) == 3 * (4 + 2 + 2), "ranks ended with different bits"


def test_ddp_refuses_bad_hierarchical_options_before_any_process_starts():
    with pytest.raises(ConfigError, match=r"node_size applies to allreduce='hierarchical'"):
        DDP(node_size=2)
    with pytest.raises(ConfigError, match=r"allreduce='hierarchical' reduces uncompressed buckets; got compression 'fp16'"):
        DDP(allreduce="hierarchical", compression="fp16")
    with pytest.raises(ConfigError, match=r"node_size 3 does not divide the world size 4"):
        DDP(allreduce="hierarchical", node_size=3).plan(4)
    with pytest.raises(ConfigError, match=r"Did you mean 'hierarchical'\?"):
        DDP(allreduce="hierarchial")


def test_the_planner_prices_hierarchical_as_its_three_levels():
    """2 nodes of 8 H100s, fp32 gradients of 1e8 parameters (N = 400 MB): a reduce of N inside each
    node and a broadcast back (ceil(lg 8) = 3 rounds each, on NVLink), the two leaders' allreduce of N
    (2(2-1)/2 N, 2 rounds, on InfiniBand); on one node it is not proposed."""
    from shardwise.strategies.cost.cluster import H100_80GB, Cluster
    from shardwise.strategies.cost.estimate import estimate
    from shardwise.strategies.cost.model_spec import ModelSpec
    from shardwise.strategies.cost.terms import Settings, Shape
    from shardwise.strategies.data_parallel.cost import candidates

    spec = ModelSpec("m", params=1e8, layers=4, layer_params=2.5e7, hidden=8, act_bytes_per_layer_sample=1.0, act_bytes_other_sample=1.0)
    cluster, N = Cluster(H100_80GB, 16, nodes=2), 4e8
    got = estimate(spec, cluster, Settings(64), Shape("ddp", dp=16, algorithm="hierarchical")).collectives
    intra, inter = H100_80GB.intra, H100_80GB.inter
    want = [("reduce", "node", 8, N, intra.time(3, N)), ("all_reduce", "leaders", 2, N, inter.time(2, N)), ("broadcast", "node", 8, N, intra.time(3, N))]
    assert [(c.op, c.group, c.size, c.sent_bytes) for c in got] == [w[:4] for w in want]
    assert [c.seconds for c in got] == pytest.approx([w[4] for w in want], rel=1e-12)
    ring = estimate(spec, cluster, Settings(64), Shape("ddp", dp=16)).collectives[0]
    assert ring.seconds == pytest.approx(inter.time(30, 2 * 15 / 16 * N)) and sum(c.seconds for c in got) < ring.seconds
    labels = [c.label for c in candidates(cluster, spec, 64)]
    assert "ddp(allreduce=hierarchical)" in labels and "ddp(allreduce=hierarchical)" not in [c.label for c in candidates(Cluster(H100_80GB, 8), spec, 64)]
