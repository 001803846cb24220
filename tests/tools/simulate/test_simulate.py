"""The simulator against closed forms: single collectives (Thakur et al. 2005), stragglers, async PS, local SGD.

Each expectation is computed by hand from the alpha-beta model (Hockney 1994), independently of
the simulator's round schedules; no timing here.
"""

from __future__ import annotations

import math

import pytest

from shardwise.errors import ConfigError
from shardwise.tools.simulate.network import Exchange, Network, Straggler, collective_rounds, simulate

ALPHA, BETA = 5e-6, 1e-9  # 5 us, 1 GB/s
NET = Network(alpha_s=ALPHA, beta_s_per_byte=BETA)  # one worker per node: no NIC sharing
N = 4 * 2**20  # bytes (1 Mi float32 elements, divisible by every p below)


@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
def test_ring_equals_closed_form(p: int) -> None:
    pre, glob, post = collective_rounds("ring", p, N, 4, NET)
    assert not pre and not post
    assert sum(glob) == pytest.approx(2 * (p - 1) * ALPHA + 2 * (p - 1) / p * N * BETA, rel=1e-12)


@pytest.mark.parametrize("p", [2, 4, 8, 32])
def test_recursive_doubling_equals_closed_form(p: int) -> None:
    assert sum(collective_rounds("recursive_doubling", p, N, 4, NET)[1]) == pytest.approx(math.log2(p) * (ALPHA + N * BETA), rel=1e-12)


@pytest.mark.parametrize("p", [3, 6, 12])
def test_recursive_doubling_fold_adds_two_rounds(p: int) -> None:
    """MPICH's fold for non-powers of two: one round in, lg p' rounds, one round out."""
    lg = int(math.log2(p)) if p & (p - 1) == 0 else int(math.floor(math.log2(p)))
    assert sum(collective_rounds("recursive_doubling", p, N, 4, NET)[1]) == pytest.approx((lg + 2) * (ALPHA + N * BETA), rel=1e-12)


@pytest.mark.parametrize("p", [2, 3, 4, 7, 8, 100])
def test_tree_equals_closed_form(p: int) -> None:
    assert sum(collective_rounds("tree", p, N, 4, NET)[1]) == pytest.approx(2 * math.ceil(math.log2(p)) * (ALPHA + N * BETA), rel=1e-12)


def test_nic_sharing_slows_recursive_doubling_across_nodes() -> None:
    """8 ranks, 4 per node: the distance-4 exchange puts 4 flows on each NIC; distances 1, 2 stay inside."""
    net = Network(alpha_s=ALPHA, beta_s_per_byte=BETA, gpus_per_node=4, intra_alpha_s=1e-6, intra_beta_s_per_byte=0.1e-9)
    got = sum(collective_rounds("recursive_doubling", 8, N, 4, net)[1])
    assert got == pytest.approx(2 * (1e-6 + N * 0.1e-9) + (ALPHA + 4 * N * BETA), rel=1e-12)


def test_hierarchical_equals_closed_form() -> None:
    """g ranks per node, P nodes: 2(g-1) intra rounds of N/g, then 2(P-1) rounds of N/(gP) with g rings per NIC."""
    g, nodes = 4, 8
    net = Network(alpha_s=ALPHA, beta_s_per_byte=BETA, gpus_per_node=g, intra_alpha_s=1e-6, intra_beta_s_per_byte=0.1e-9)
    pre, glob, post = collective_rounds("hierarchical", g * nodes, N, 4, net)
    intra = 2 * (g - 1) * (1e-6 + N / g * 0.1e-9)
    inter = 2 * (nodes - 1) * (ALPHA + N / (g * nodes) * g * BETA)
    assert sum(pre) + sum(post) == pytest.approx(intra, rel=1e-12)
    assert sum(glob) == pytest.approx(inter, rel=1e-12)
    r = simulate(g * nodes, params=N / 4, compute_s=0.01, net=net, exchange=Exchange(algorithm="hierarchical"), steps=3)
    assert r.step_s == pytest.approx(0.01 + intra + inter, rel=1e-9)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "recursive_doubling", "hierarchical"])
def test_one_worker_has_efficiency_one(algorithm: str) -> None:
    r = simulate(1, params=1e6, compute_s=0.05, net=NET, exchange=Exchange(algorithm=algorithm))
    assert (r.efficiency, r.step_s, r.exchange_s, r.idle_mean_s) == (pytest.approx(1.0), pytest.approx(0.05), 0.0, pytest.approx(0.0))


def test_sync_step_is_compute_plus_ring() -> None:
    p, c = 8, 0.1
    r = simulate(p, params=N / 4, compute_s=c, net=NET, batch=16, steps=5)
    ring = 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * N * BETA
    assert r.step_s == pytest.approx(c + ring, rel=1e-9)
    assert r.samples_per_s == pytest.approx(p * 16 / (c + ring), rel=1e-9)
    assert r.efficiency == pytest.approx(c / (c + ring), rel=1e-9)


def test_sync_waits_for_the_slowest_worker() -> None:
    """One of 4 workers 3x slower: every sync step lasts 3c plus the exchange; the others idle 2c."""
    c = 0.1
    r = simulate(4, params=N / 4, compute_s=c, net=NET, straggler=Straggler.parse("slow:0.25:3"), steps=6)
    ring = 6 * ALPHA + 1.5 * N * BETA
    assert r.step_s == pytest.approx(3 * c + ring, rel=1e-9)
    assert r.idle_max_s == pytest.approx(2 * c + ring, rel=1e-9)


def test_async_ps_beats_sync_ps_under_a_straggler() -> None:
    """Communication made negligible (latency 0, 10^6 GB/s): sync PS runs at the slowest worker's pace,
    p B / 3c; async PS lets each worker run at its own, B (3/c + 1/3c)."""
    fast = Network(alpha_s=0.0, beta_s_per_byte=1e-15)
    c, b = 0.1, 32
    kw = dict(params=1e6, compute_s=c, net=fast, batch=b, straggler=Straggler.parse("slow:0.25:3"), steps=30)
    sync = simulate(4, exchange=Exchange(algorithm="ps", servers=2), **kw)  # type: ignore[arg-type]
    asyn = simulate(4, exchange=Exchange(algorithm="ps", servers=2, mode="async"), **kw)  # type: ignore[arg-type]
    assert sync.samples_per_s == pytest.approx(4 * b / (3 * c), rel=1e-6)
    # async: the run ends when the slow worker finishes its 30 steps (90c); the fast ones did 30 each by 30c
    assert asyn.samples_per_s == pytest.approx(4 * 30 * b / (90 * c), rel=1e-6)
    assert asyn.samples_per_s > sync.samples_per_s


def test_sync_ps_incast_closed_form() -> None:
    """One worker per node, k servers, s = N/k beta per shard through a server NIC, p s > N beta.
    Step 1: all push at c + alpha; the server NIC takes them one by one (T = c + alpha + p s), then
    sends the pulls one by one, the last at T + p s + alpha. Later steps are pipelined: worker i is
    released at T + max((i+1) s, N beta) + alpha (its own NIC bounds a pull at N beta), its push
    reaches an idle server and, the pushes spaced s apart, the last completes p s after the first
    can: T' = T + c + 2 alpha + N beta + p s. Wall time: the first step plus 39 such periods."""
    p, k, c = 16, 2, 0.05
    r = simulate(p, params=N / 4, compute_s=c, net=NET, exchange=Exchange(algorithm="ps", servers=k), steps=40)
    s = N / k * BETA
    first = c + 2 * ALPHA + 2 * p * s
    period = c + 2 * ALPHA + N * BETA + p * s
    assert r.step_s == pytest.approx((first + 39 * period) / 40, rel=1e-9)
    assert r.exchange_s == pytest.approx(2 * (ALPHA + p * s), rel=1e-12)  # everyone arriving at once


def test_local_sgd_beats_sync_ddp_on_a_slow_link() -> None:
    """1 Gbit/s, 100 MB of gradients: ddp pays the ring every step, local SGD every H = 8 steps."""
    slow = Network.from_gbps(1, 50)
    p, c, H, params = 8, 0.2, 8, 25e6
    ring = 2 * (p - 1) * 50e-6 + 2 * (p - 1) / p * params * 4 * 8 / 1e9
    ddp = simulate(p, params=params, compute_s=c, net=slow, steps=16)
    local = simulate(p, params=params, compute_s=c, net=slow, exchange=Exchange(mode="local_sgd", sync_every=H), steps=16)
    assert ddp.step_s == pytest.approx(c + ring, rel=1e-9)
    assert local.step_s == pytest.approx(c + ring / H, rel=1e-9)
    assert local.samples_per_s / ddp.samples_per_s == pytest.approx((c + ring) / (c + ring / H), rel=1e-9)


@pytest.mark.parametrize(("params", "overlap"), [(8 * N / 4, 0.5), (8 * N / 4, 1.0), (N / 4, 0.5)])
def test_overlap_hides_part_of_the_exchange(params: float, overlap: float) -> None:
    """The ring may start F x t_b before compute ends, t_b = 2/3 of compute: a step is
    max(c, c - F (2/3) c + ring). 32 MiB: the ring (58.8 ms) outlasts the overlap window (33.3 or
    66.7 ms at c = 0.1 s) in the first case only; 4 MiB: the ring (7.4 ms) hides entirely."""
    p, c = 8, 0.1
    ring = 2 * (p - 1) * ALPHA + 2 * (p - 1) / p * params * 4 * BETA
    r = simulate(p, params=params, compute_s=c, net=NET, exchange=Exchange(overlap=overlap), steps=5)
    assert r.step_s == pytest.approx(max(c, c - overlap * (2 / 3) * c + ring), rel=1e-9)
    assert simulate(p, params=params, compute_s=c, net=NET, steps=5).step_s == pytest.approx(c + ring, rel=1e-9)  # overlap 0: as before


def test_overlap_with_a_straggler_starts_at_the_slowest_workers_window() -> None:
    """One of 4 workers 3x slower: the ring starts when it reaches 3c - F (2/3) 3c and the step
    lasts max(3c, that + ring)."""
    c, F = 0.1, 0.25
    ring = 6 * ALPHA + 1.5 * 8 * N * BETA
    r = simulate(4, params=8 * N / 4, compute_s=c, net=NET, straggler=Straggler.parse("slow:0.25:3"), exchange=Exchange(overlap=F), steps=6)
    assert r.step_s == pytest.approx(max(3 * c, 3 * c - F * (2 / 3) * 3 * c + ring), rel=1e-9)


def test_lognormal_straggler_costs_the_expected_maximum() -> None:
    """Sync steps last the maximum of p draws: the simulated mean step equals the mean of the
    drawn per-step maxima (recomputed here from the same seeded draws) plus the exchange."""
    import numpy as np

    p, c, steps = 64, 0.1, 50
    r = simulate(p, params=1e6, compute_s=c, net=NET, straggler=Straggler.parse("lognormal:0.3"), steps=steps, seed=7)
    draws = c * Straggler.parse("lognormal:0.3").factors(steps, p, np.random.default_rng(7))
    ring = sum(collective_rounds("ring", p, 4e6, 4, NET)[1])
    assert r.step_s == pytest.approx(draws.max(axis=1).mean() + ring, rel=1e-9)
    assert r.step_s > c * 1.3  # the max of 64 lognormal(0.3) draws is well above the mean


def test_4096_workers_complete() -> None:
    net = Network.from_gbps(25, 10, gpus_per_node=8, intra_gbps=300)
    for alg in ("ring", "hierarchical", "ps"):
        r = simulate(4096, params=25.5e6, compute_s=0.12, net=net, exchange=Exchange(algorithm=alg, servers=64), steps=5)
        assert r.workers == 4096 and 0 < r.efficiency < 1


@pytest.mark.parametrize(
    ("make", "fragment"),
    [
        (lambda: Exchange(algorithm="butterfly"), "--algorithm 'butterfly' is not simulated"),
        (lambda: Exchange(mode="async"), "--mode async needs parameter servers"),
        (lambda: Exchange(algorithm="ps", mode="local_sgd"), "--mode local_sgd averages with an allreduce"),
        (lambda: Straggler.parse("lognormal"), "--straggler 'lognormal' is not a straggler distribution"),
        (lambda: Network.from_gbps(0, 10), "--bandwidth-gbps must be a positive"),
        (
            lambda: simulate(12, params=1e6, compute_s=0.1, net=Network.from_gbps(25, 10, gpus_per_node=8), exchange=Exchange(algorithm="hierarchical")),
            "multiple of 8",
        ),
        (lambda: simulate(0, params=1e6, compute_s=0.1, net=NET), "--workers must be between 1"),
        (lambda: Exchange(overlap=1.5), "--overlap is a fraction of the backward, from 0 to 1; got 1.5"),
        (lambda: Exchange(algorithm="ps", overlap=0.5), "--overlap models an allreduce overlapping"),
    ],
)
def test_bad_input_is_one_clear_line(make: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(")) as info:
        make()  # type: ignore[operator]
    assert "\n" not in str(info.value)
