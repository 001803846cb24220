"""The calibration fit (alpha-beta, Hockney 1994 / Thakur et al. 2005) and the profile file it writes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.cli import main
from shardwise.strategies.cost.cluster import load_profile
from shardwise.tools.advisor.calibrate import ALPHA_FLOOR_S, fit_profile, nnls_fit

SIZES = [1 << 10, 1 << 14, 1 << 18, 1 << 22]


def test_the_fit_recovers_alpha_and_beta_from_exact_times() -> None:
    alpha, beta, rounds = 30e-6, 1 / 2e9, 2
    times = [rounds * alpha + s * beta for s in SIZES]
    f = nnls_fit([rounds] * 4, SIZES, times)
    assert f["alpha"] == pytest.approx(alpha, rel=1e-6) and f["beta"] == pytest.approx(beta, rel=1e-6)
    assert f["max_rel_error"] < 1e-6 and not f["alpha_fixed"]


def test_an_alpha_below_the_floor_is_replaced_by_the_smallest_message() -> None:
    """Pure bandwidth data drives least squares to alpha ~ 0 (a latency like 4.7e-16 s); the fit must refuse it."""
    beta, rounds = 1 / 1e9, 2
    times = [s * beta for s in SIZES]
    f = nnls_fit([rounds] * 4, SIZES, times)
    assert f["alpha_fixed"] and f["alpha"] >= ALPHA_FLOOR_S
    assert f["alpha"] == pytest.approx(max(ALPHA_FLOOR_S, SIZES[0] * beta / rounds / 2))
    assert f["beta"] > 0


def test_a_fitted_profile_is_read_back_by_device_path(tmp_path: Path) -> None:
    rows = []
    for name, rounds in (("all_reduce", 2), ("all_reduce/ring", 2), ("all_gather", 1), ("broadcast", 1)):
        rows += [{"collective": name, "size_bytes": s, "rounds": rounds, "sent_bytes": s, "time_s": rounds * 20e-6 + s / 1e9} for s in SIZES]
    profile = fit_profile(rows, {"median": 2e10, "by_size": {}, "threads": 1}, 1e-3)
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps(profile))
    loaded = load_profile(str(path))
    assert loaded.flops["32"] == 2e10 and loaded.step_overhead_s == 1e-3
    assert loaded.collectives["all_reduce/ring"].alpha == pytest.approx(20e-6, rel=1e-6)
    assert profile["calibration"]["fits"]["all_gather"]["max_rel_error"] < 1e-6
    assert (
        main(["plan", "--params", "1e6", "--layers", "2", "--hidden", "128", "--seq", "16", "--nproc", "2", "--device", str(path), "--global-batch", "8"]) == 0
    )
