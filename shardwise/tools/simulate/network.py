"""A discrete-event simulation of data-parallel training steps on 1 to thousands of workers.

What it answers: how throughput, step time and scaling efficiency change with the worker count,
the gradient exchange (an allreduce's rounds, or parameter servers' pushes and pulls), the network
and stragglers, before any cluster is rented. `shardwise simulate` is its command
(`shardwise.tools.simulate.commands`); its event loops are `shardwise.tools.simulate.events`. The
model (rounds, placement and contention, parameter servers, overlap, local SGD) and its sources:
docs/simulator.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from shardwise.comm.traffic import children, fold_role, pow2_floor, real_rank, split_sizes
from shardwise.errors import ConfigError
from shardwise.tools.simulate.events import collective_loop, ps_loop

SERVERS = "ps"
"""The exchange through parameter servers (push and pull), beside the allreduce algorithms."""
ALGORITHMS = ("ring", "tree", "recursive_doubling", "hierarchical", SERVERS)
MODES = ("sync", "async", "local_sgd")
BACKWARD_SHARE = 2 / 3
"""The backward's share of a step's compute (about twice the forward; docs/simulator.md, *Overlap*)."""


@dataclass(frozen=True, kw_only=True)
class Network:
    """Link speeds: the node's NIC (between nodes) and the link inside a node."""

    alpha_s: float
    """Latency of one message between nodes, seconds."""
    beta_s_per_byte: float
    """Seconds per byte through a node's NIC (1 / bandwidth in bytes per second)."""
    gpus_per_node: int = 1
    """Workers per node, sharing its NIC; 1 puts every worker on its own node."""
    intra_alpha_s: float | None = None
    """Latency inside a node (default: ``alpha_s``)."""
    intra_beta_s_per_byte: float | None = None
    """Seconds per byte inside a node (default: ``beta_s_per_byte``)."""

    @classmethod
    def from_gbps(
        cls, bandwidth_gbps: float, latency_us: float, gpus_per_node: int = 1, intra_gbps: float | None = None, intra_latency_us: float | None = None
    ) -> Network:
        """Bandwidths in Gbit/s (10^9 bits per second) and latencies in microseconds."""
        for name, v in (("--bandwidth-gbps", bandwidth_gbps), ("--intra-gbps", intra_gbps)):
            if v is not None and not v > 0:
                raise ConfigError(f"{name} must be a positive bandwidth in Gbit/s; got {v}")
        for name, v in (("--latency-us", latency_us), ("--intra-latency-us", intra_latency_us)):
            if v is not None and not v >= 0:
                raise ConfigError(f"{name} must be a latency >= 0 microseconds; got {v}")
        if gpus_per_node < 1:
            raise ConfigError(f"--gpus-per-node must be >= 1; got {gpus_per_node}")
        return cls(
            alpha_s=latency_us * 1e-6,
            beta_s_per_byte=8 / (bandwidth_gbps * 1e9),
            gpus_per_node=gpus_per_node,
            intra_alpha_s=None if intra_latency_us is None else intra_latency_us * 1e-6,
            intra_beta_s_per_byte=None if intra_gbps is None else 8 / (intra_gbps * 1e9),
        )

    @property
    def a_in(self) -> float:
        return self.alpha_s if self.intra_alpha_s is None else self.intra_alpha_s

    @property
    def b_in(self) -> float:
        return self.beta_s_per_byte if self.intra_beta_s_per_byte is None else self.intra_beta_s_per_byte


@dataclass(frozen=True, kw_only=True)
class Straggler:
    """Per-step compute-time factors: ``constant``, ``normal:SIGMA``, ``lognormal:SIGMA`` (mean 1),
    ``slow:FRACTION:FACTOR`` (that fraction of workers, chosen once, always FACTOR times slower)."""

    kind: str = "constant"
    sigma: float = 0.0
    fraction: float = 0.0
    factor: float = 1.0

    @classmethod
    def parse(cls, spec: str) -> Straggler:
        parts = spec.split(":")
        hint = "use constant, normal:SIGMA, lognormal:SIGMA or slow:FRACTION:FACTOR (e.g. lognormal:0.2, slow:0.01:3)"
        try:
            if parts == ["constant"]:
                return cls()
            if parts[0] in ("normal", "lognormal") and len(parts) == 2 and float(parts[1]) >= 0:
                return cls(kind=parts[0], sigma=float(parts[1]))
            if parts[0] == "slow" and len(parts) == 3 and 0 <= float(parts[1]) <= 1 and float(parts[2]) > 0:
                return cls(kind="slow", fraction=float(parts[1]), factor=float(parts[2]))
        except ValueError:
            pass
        raise ConfigError(f"--straggler {spec!r} is not a straggler distribution; {hint}")

    def factors(self, steps: int, p: int, rng: np.random.Generator) -> np.ndarray:
        """A ``steps x p`` array of compute-time multipliers."""
        if self.kind == "normal":
            return np.maximum(0.05, 1 + self.sigma * rng.standard_normal((steps, p)))
        if self.kind == "lognormal":
            return np.exp(self.sigma * rng.standard_normal((steps, p)) - self.sigma**2 / 2)
        out = np.ones((steps, p))
        if self.kind == "slow":
            slow = rng.permutation(p)[: math.ceil(self.fraction * p - 1e-9)]
            out[:, slow] = self.factor
        return out


@dataclass(frozen=True, kw_only=True)
class Exchange:
    """How gradients are exchanged."""

    algorithm: str = "ring"
    mode: str = "sync"
    servers: int = 1
    """Parameter servers (``ps`` only)."""
    sync_every: int = 1
    """Local SGD's H: average every H steps."""
    overlap: float = 0.0
    """Share of the backward during which gradient buckets are already reduced (0 to 1)."""

    @property
    def through_servers(self) -> bool:
        """Whether gradients go through parameter servers (`SERVERS`) rather than an allreduce."""
        return self.algorithm == SERVERS

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ConfigError(f"--algorithm {self.algorithm!r} is not simulated; choose one of {', '.join(ALGORITHMS)}")
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode!r} is unknown; choose one of {', '.join(MODES)}")
        if self.mode == "async" and not self.through_servers:
            raise ConfigError(f"--mode async needs parameter servers (--algorithm ps); got --algorithm {self.algorithm}")
        if self.mode == "local_sgd" and self.through_servers:
            raise ConfigError("--mode local_sgd averages with an allreduce; choose --algorithm ring, tree, recursive_doubling or hierarchical")
        if self.servers < 1:
            raise ConfigError(f"--servers must be >= 1; got {self.servers}")
        if self.sync_every < 1:
            raise ConfigError(f"--sync-every must be >= 1; got {self.sync_every}")
        if not 0 <= self.overlap <= 1:
            raise ConfigError(f"--overlap is a fraction of the backward, from 0 to 1; got {self.overlap}")
        if self.overlap and self.through_servers:
            raise ConfigError("--overlap models an allreduce overlapping the backward; use ring, tree, recursive_doubling or hierarchical, or drop --overlap")


@dataclass(frozen=True)
class Result:
    """One simulated worker count."""

    workers: int
    step_s: float
    """Wall time over steps (mean time per step)."""
    samples_per_s: float
    efficiency: float
    """samples/s over ``workers x batch / compute_s`` (one worker without communication)."""
    exchange_s: float
    """One gradient exchange with every worker arriving together (0 for one worker)."""
    idle_mean_s: float
    """Per worker and step: wall time not computing, averaged over workers."""
    idle_max_s: float


# ---- collectives: the time of each round --------------------------------------------------------


def round_time(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray | float, net: Network) -> float:
    """The time of one round whose messages go ``src[i] -> dst[i]`` with ``nbytes[i]`` bytes:
    the slowest message, a cross-node one slowed by the number of flows sharing its NICs."""
    g = net.gpus_per_node
    b = np.broadcast_to(np.asarray(nbytes, dtype=float), src.shape)
    ns, nd = src // g, dst // g
    cross = ns != nd
    t = 0.0
    if (~cross).any():
        t = net.a_in + float(b[~cross].max()) * net.b_in
    if cross.any():
        out_f = np.bincount(ns[cross])
        in_f = np.bincount(nd[cross])
        share = np.maximum(out_f[ns[cross]], in_f[nd[cross]])
        t = max(t, net.alpha_s + float((b[cross] * share).max()) * net.beta_s_per_byte)
    return t


def _ring_rounds(ranks: np.ndarray, piece_bytes: float, rounds: int, net: Network) -> list[float]:
    """``rounds`` identical rounds of a ring over ``ranks`` (rank i sends to i+1) with pieces of ``piece_bytes``."""
    if len(ranks) < 2 or rounds == 0:
        return []
    return [round_time(ranks, np.roll(ranks, -1), piece_bytes, net)] * rounds


def collective_rounds(algorithm: str, p: int, nbytes: float, itemsize: int, net: Network) -> tuple[list[float], list[float], list[float]]:
    """Round times of one allreduce of ``nbytes`` over ranks ``0..p-1``: (per-node phase before,
    global phase, per-node phase after); the per-node phases are empty except for hierarchical."""
    if p == 1:
        return [], [], []
    n = max(1, int(round(nbytes / itemsize)))
    ranks = np.arange(p)
    if algorithm == "ring":
        piece = split_sizes(n, p)[0] * itemsize  # the largest piece bounds each round
        return [], _ring_rounds(ranks, piece, 2 * (p - 1), net), []
    if algorithm == "tree":
        return [], _tree_rounds(p, nbytes, net), []
    if algorithm == "recursive_doubling":
        return [], _recursive_doubling_rounds(p, nbytes, net), []
    if algorithm == "hierarchical":
        g = min(net.gpus_per_node, p)
        nodes = p // g
        local = np.arange(g)
        pre = _ring_rounds(local, split_sizes(n, g)[0] * itemsize, g - 1, net)  # reduce-scatter in the node
        shard = split_sizes(n, g)[0]
        # one ring per local rank across the nodes, all at once: g flows share each NIC
        src = np.arange(p)
        dst = (src + g) % p
        glob = [round_time(src, dst, split_sizes(shard, nodes)[0] * itemsize, net)] * (2 * (nodes - 1)) if nodes > 1 else []
        return pre, glob, list(pre)  # the all-gather mirrors the reduce-scatter
    raise ConfigError(f"--algorithm {algorithm!r} is not a collective; choose ring, tree, recursive_doubling or hierarchical")


def _tree_rounds(p: int, nbytes: float, net: Network) -> list[float]:
    """Binomial reduce to rank 0 (leaves first), then the mirror-image broadcast; every edge carries N."""
    ranks = np.arange(p)
    up = []
    m = 1
    while m < p:
        senders = ranks[(ranks % (2 * m) == m)]
        assert all(k in children(k - m, p) for k in senders[:4].tolist())  # the tree of traffic.children
        up.append(round_time(senders, senders - m, nbytes, net))
        m <<= 1
    return up + up[::-1]


def _recursive_doubling_rounds(p: int, nbytes: float, net: Network) -> list[float]:
    """MPICH's fold for non-powers of two (one round each way), then lg p' butterfly exchanges."""
    pof2 = pow2_floor(p)
    roles = [fold_role(r, p) for r in range(p)]
    active = np.array([r for r, (role, _) in enumerate(roles) if role != "idle"])
    virtual = np.array([roles[r][1] for r in active])
    fold = []
    if pof2 < p:
        idle = np.array([r for r, (role, _) in enumerate(roles) if role == "idle"])
        fold = [round_time(idle, idle + 1, nbytes, net)]
    rounds = []
    m = 1
    while m < pof2:
        partner = np.array([real_rank(int(v ^ m), p) for v in virtual])
        rounds.append(round_time(active, partner, nbytes, net))
        m <<= 1
    return fold + rounds + fold


# ---- the public functions ----------------------------------------------------------------------


def simulate(
    workers: int,
    *,
    params: float,
    compute_s: float,
    net: Network,
    exchange: Exchange = Exchange(),
    batch: int = 32,
    bytes_per_param: int = 4,
    straggler: Straggler = Straggler(),
    steps: int = 20,
    seed: int = 0,
) -> Result:
    """Simulate ``steps`` training steps on ``workers`` workers (see the module docstring).

    >>> net = Network.from_gbps(25, 0)
    >>> r = simulate(4, params=25e6, compute_s=0.1, net=net)   # ring: 2 x 3/4 x 100 MB at 25 Gbit/s
    >>> round(r.step_s, 4), round(r.efficiency, 3)
    (0.148, 0.676)
    """
    _check(workers, params, compute_s, batch, steps, exchange, net)
    p, H = workers, exchange.sync_every
    steps = H * -(-steps // H)  # whole averaging periods
    nbytes = params * bytes_per_param
    compute = compute_s * straggler.factors(steps, p, np.random.default_rng(seed))
    g = min(net.gpus_per_node, p)
    if exchange.through_servers:
        k = exchange.servers
        shard_s, nic_s = nbytes / k * net.beta_s_per_byte, g * nbytes * net.beta_s_per_byte
        end = ps_loop(compute, net.alpha_s, shard_s, nic_s, exchange.mode == "async")
        exchange_s = 2 * (net.alpha_s + max(p * shard_s, nic_s))
    else:
        pre, glob, post = collective_rounds(exchange.algorithm, p, nbytes, bytes_per_param, net)
        end = collective_loop(compute, g, pre, glob, post, H, lead=exchange.overlap * BACKWARD_SHARE * compute)
        exchange_s = sum(pre) + sum(glob) + sum(post)
    wall = float(end.max())
    idle = (wall - compute.sum(axis=0)) / steps
    rate = p * steps * batch / wall
    return Result(
        workers=p,
        step_s=wall / steps,
        samples_per_s=rate,
        efficiency=rate / (p * batch / compute_s),
        exchange_s=exchange_s,
        idle_mean_s=float(idle.mean()),
        idle_max_s=float(idle.max()),
    )


def sweep(workers: list[int], **kwargs: object) -> list[Result]:
    """`simulate` at each worker count (same keyword arguments)."""
    return [simulate(p, **kwargs) for p in workers]  # type: ignore[arg-type]


def _check(p: int, params: float, compute_s: float, batch: int, steps: int, exchange: Exchange, net: Network) -> None:
    if not 1 <= p <= 1 << 20:
        raise ConfigError(f"--workers must be between 1 and 1048576; got {p}")
    if not params > 0:
        raise ConfigError(f"--params must be a positive parameter count (e.g. 25.5e6); got {params}")
    if not compute_s > 0:
        raise ConfigError(f"--compute-ms must be a positive time per step; got {compute_s * 1e3} ms")
    if batch < 1 or steps < 1:
        raise ConfigError(f"--batch and --steps must be >= 1; got batch {batch}, steps {steps}")
    g = net.gpus_per_node
    if exchange.algorithm == "hierarchical" and p > g and p % g:
        raise ConfigError(f"hierarchical allreduce needs whole nodes: {p} workers is not a multiple of --gpus-per-node {g}; use a multiple of {g}")
