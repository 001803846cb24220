"""Pipeline schedules in the event simulation against closed forms and hand-worked timelines.

Bubble and activation counts: Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC 2021, sections 2.2.1 and 2.2.2. Send costs: the
alpha-beta model (Hockney 1994). Every expectation is written out here, not taken from the code.
"""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError
from shardwise.strategies.cost.bubble import predicted_bubble
from shardwise.tools.simulate.network import Network, Straggler
from shardwise.tools.simulate.pipeline import simulate_pipeline

TF, TB = 1.0, 2.0  # backward twice the forward


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 8), (4, 4), (4, 8), (8, 16), (3, 7)])
def test_bubble_equals_the_formula(schedule: str, p: int, m: int) -> None:
    """Equal stages, free sends: every stage idles (p - 1)/(m + p - 1) of a step of (m + p - 1)(t_f + t_b)."""
    r = simulate_pipeline(schedule, p, m, forward_s=TF, backward_s=TB)
    assert r.step_s == pytest.approx((m + p - 1) * (TF + TB), rel=1e-12)
    for b in r.bubble:
        assert b == pytest.approx((p - 1) / (m + p - 1), rel=1e-9)
    assert r.predicted_bubble == pytest.approx(predicted_bubble(schedule, p, m), rel=1e-12)


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (2, 4, 3), (4, 4, 2), (4, 8, 2), (4, 8, 4), (3, 9, 2), (8, 16, 4)])
@pytest.mark.parametrize(("tf", "tb"), [(1.0, 2.0), (1.0, 1.0), (2.0, 1.0)])
def test_interleaved_bubble_equals_the_formula(p: int, m: int, v: int, tf: float, tb: float) -> None:
    """v chunks per rank: idle (p - 1)(t_f + t_b)/v beside m (t_f + t_b) of work, (p - 1)/(v m + p - 1) of the step."""
    r = simulate_pipeline("interleaved", p, m, chunks=v, forward_s=tf, backward_s=tb)
    assert r.step_s == pytest.approx((m + (p - 1) / v) * (tf + tb), rel=1e-9)
    for b in r.bubble:
        assert b == pytest.approx((p - 1) / (v * m + p - 1), rel=1e-9)


@pytest.mark.parametrize(("p", "m"), [(2, 6), (4, 8), (5, 12)])
def test_1f1b_holds_p_minus_s_micro_batches_gpipe_holds_m(p: int, m: int) -> None:
    assert simulate_pipeline("1f1b", p, m, forward_s=TF, backward_s=TB).peak_in_flight == [float(p - s) for s in range(p)]
    assert simulate_pipeline("gpipe", p, m, forward_s=TF, backward_s=TB).peak_in_flight == [float(m)] * p


@pytest.mark.parametrize(("p", "m"), [(2, 4), (4, 8), (6, 6)])
def test_gpipe_send_cost_adds_two_sends_per_boundary(p: int, m: int) -> None:
    """Send c = alpha + bytes beta < t_f: micro-batch 0 reaches the last stage after (p - 1)(t_f + c), the
    last gradient reaches stage 0 after (p - 1)(t_b + c): the step grows by 2 (p - 1) c."""
    net = Network(alpha_s=0.05, beta_s_per_byte=1e-9)
    nbytes = 50e6
    c = 0.05 + nbytes * 1e-9
    r = simulate_pipeline("gpipe", p, m, forward_s=TF, backward_s=TB, activation_bytes=nbytes, net=net)
    assert r.send_s == pytest.approx(c, rel=1e-12)
    assert r.step_s == pytest.approx((m + p - 1) * (TF + TB) + 2 * (p - 1) * c, rel=1e-12)


def test_1f1b_send_cost_by_hand() -> None:
    """p = 2, m = 4, t_f = t_b = 1, send c. Stage 0: F0 [0,1], F1 [1,2], B0 [3+2c, 4+2c], F2, B1 [5+2c, 6+2c],
    F3, B2 [7+4c, 8+4c], B3 [9+4c, 10+4c]; stage 1 waits 2c for each forward after the first, so
    1F1B loses 4c where GPipe loses 2c (10 + 2c)."""
    c = 0.2
    net = Network(alpha_s=c, beta_s_per_byte=0.0)
    assert simulate_pipeline("1f1b", 2, 4, forward_s=1.0, backward_s=1.0, net=net).step_s == pytest.approx(10 + 4 * c, rel=1e-12)
    assert simulate_pipeline("gpipe", 2, 4, forward_s=1.0, backward_s=1.0, net=net).step_s == pytest.approx(10 + 2 * c, rel=1e-12)


def test_sends_on_one_node_use_the_intra_node_link() -> None:
    """4 stages, 2 per node: boundaries 0-1 and 2-3 inside a node (cost a_in), 1-2 across (alpha)."""
    net = Network(alpha_s=0.3, beta_s_per_byte=0.0, gpus_per_node=2, intra_alpha_s=0.01)
    r = simulate_pipeline("gpipe", 4, 8, forward_s=TF, backward_s=TB, net=net)
    assert r.step_s == pytest.approx(11 * (TF + TB) + 2 * (0.3 + 2 * 0.01), rel=1e-12)


@pytest.mark.parametrize("k", [0, 1, 2, 3])
def test_a_straggling_stage_bounds_the_step(k: int) -> None:
    """Stage k x = 3 times slower, p = 4, m = 8. GPipe: all forwards then all backwards, a flow shop in
    each phase: sum of one micro-batch's times plus (m - 1) times the slowest, m x (t_f + t_b) + (p - 1)(t_f + t_b).
    1F1B: stage k never waits once started (the fast stages' round trip fits in its own work), so
    the step is its m x (t_f + t_b) plus the k upstream forwards before it starts and the k
    upstream backwards after it ends: m x (t_f + t_b) + k (t_f + t_b)."""
    p, m, x = 4, 8, 3.0
    f, b = [TF] * p, [TB] * p
    f[k], b[k] = x * TF, x * TB
    gpipe = simulate_pipeline("gpipe", p, m, forward_s=f, backward_s=b)
    one = simulate_pipeline("1f1b", p, m, forward_s=f, backward_s=b)
    assert gpipe.step_s == pytest.approx(m * x * (TF + TB) + (p - 1) * (TF + TB), rel=1e-12)
    assert one.step_s == pytest.approx(m * x * (TF + TB) + k * (TF + TB), rel=1e-12)
    assert min(gpipe.step_s, one.step_s) >= m * x * (TF + TB)


def test_straggler_distribution_picks_the_slow_stage() -> None:
    """slow:0.25:3 on 4 stages makes one stage 3x slower (which one: recomputed from the same seeded
    draws); the 1F1B step is then the hand value of the test above for that stage."""
    import numpy as np

    r = simulate_pipeline("1f1b", 4, 8, forward_s=TF, backward_s=TB, straggler=Straggler.parse("slow:0.25:3"), seed=0)
    draws = Straggler.parse("slow:0.25:3").factors(8, 4, np.random.default_rng(0))
    (k,) = np.flatnonzero(draws[0] == 3.0)
    assert r.step_s == pytest.approx(8 * 3 * (TF + TB) + k * (TF + TB), rel=1e-12)
    assert r.bubble[k] == pytest.approx(1 - 8 * 3 * (TF + TB) / r.step_s, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"schedule": "zb"}, "--pipeline 'zb' is not a schedule"),
        ({"schedule": "1f1b", "microbatches": 2}, "needs at least as many micro-batches as stages"),
        ({"schedule": "interleaved", "chunks": 1}, "needs --chunks >= 2"),
        ({"schedule": "interleaved", "chunks": 2, "microbatches": 6}, "use a multiple of 4"),
        ({"schedule": "gpipe", "chunks": 2}, "--chunks 2 needs --pipeline interleaved"),
        ({"schedule": "gpipe", "forward_s": [1.0, 1.0]}, "one per stage (4)"),
    ],
)
def test_bad_input_is_one_clear_line(kwargs: dict[str, object], fragment: str) -> None:
    args: dict[str, object] = {"schedule": "gpipe", "stages": 4, "microbatches": 8, "forward_s": 1.0, "backward_s": 2.0, **kwargs}
    with pytest.raises(ConfigError, match=fragment.replace("(", r"\(").replace(")", r"\)")) as info:
        simulate_pipeline(**args)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
