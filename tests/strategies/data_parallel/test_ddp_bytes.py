"""ddp's recorded bytes are what DDP actually reduces, bucket by bucket, not a sum of parameter sizes.

One launch of 2 processes runs four small Engine loops (a launch costs seconds here). The
bucket sizes to compare with come from DDP's own logging data (the reducer's buckets, before
and after it rebuilds them at the end of the first step), not from shardwise.
"""

from __future__ import annotations

import pytest
import torch

from shardwise import Engine, launch

pytestmark = pytest.mark.dist

P = 2
STEPS = 3
CAP_MB = 0.3  # small enough for two buckets once DDP rebuilds them after the first step


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)).double()


def _loop(model: torch.nn.Module, **options) -> dict:
    engine = Engine(strategy="ddp", accelerator="cpu", precision="64", strategy_options={"bucket_cap_mb": CAP_MB, **options})
    engine.recorder.keep_events = True
    wrapped, opt = engine.setup(model, lambda params: torch.optim.SGD(params, lr=0.1))
    g = torch.Generator().manual_seed(engine.rank)  # each rank its own data: an unsynced gradient differs
    for _ in range(STEPS):
        with engine.no_sync(wrapped):  # accumulation: the first micro-batch must not be reduced
            engine.backward(wrapped(torch.randn(4, 64, generator=g, dtype=torch.float64)).square().mean())
        engine.backward(wrapped(torch.randn(4, 64, generator=g, dtype=torch.float64)).square().mean())
        engine.step(opt)
        opt.zero_grad()
    logged = wrapped._get_ddp_logging_data()  # the reducer's own account of its buckets
    return {
        "events": [(e.op, e.group, e.payload_bytes, e.sent_bytes, e.received_bytes, e.seconds) for e in engine.recorder.events],
        "first_buckets": [int(s) for s in logged["bucket_sizes"].split(",")],
        "rebuilt_buckets": [int(s) for s in logged["rebuilt_bucket_sizes"].split(",")],
        "params": {k: v.detach().clone() for k, v in engine.unwrap(wrapped).named_parameters()},
    }


def _cases() -> dict:
    plain = _loop(_model())
    ignored_model = _model()
    ignored_model._ddp_params_and_buffers_to_ignore = ["4.bias"]  # DDP's own switch: leave this parameter unsynced
    ignored = _loop(ignored_model)
    frozen_model = _model()
    frozen_model[0].weight.requires_grad_(False)
    frozen = _loop(frozen_model)
    timed = _loop(_model(), record_buckets=True)
    return {"plain": plain, "ignored": ignored, "frozen": frozen, "timed": timed}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return launch(_cases, nproc=P, threads_per_proc=1, timeout=150)  # below the test's 180 s: a hang names its ranks


def _param_bytes(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n not in skip)


def _check_buckets(run: dict, *, ordered: bool = True) -> list[int]:
    """Each event is one real bucket, with the ring allreduce's bytes: 2(p-1)/p of the bucket each way.

    Untimed events are recorded as each bucket is launched, in DDP's order; timed ones as each
    completes, and two buckets in flight may complete in either order."""
    expected = run["first_buckets"] + run["rebuilt_buckets"] * (STEPS - 1)
    payloads = [e[2] for e in run["events"]]
    assert (payloads if ordered else sorted(payloads)) == (expected if ordered else sorted(expected)), (payloads, expected)
    for op, group, payload, sent, received, _ in run["events"]:
        assert (op, group) == ("all_reduce", "dp")
        assert sent == received == 2 * (P - 1) * payload // P
    return payloads


def test_a_normal_run_records_each_real_bucket_with_the_ring_formula(results):
    for rank in range(P):
        run = results[rank]["plain"]
        _check_buckets(run)
        assert len(run["rebuilt_buckets"]) == 2  # the cap did split the gradients: two events a step after the first
        assert sum(run["rebuilt_buckets"]) == sum(run["first_buckets"]) == _param_bytes(_model())
        assert all(e[5] is None for e in run["events"])  # untimed by default (the reduction overlaps backward)
    assert all(torch.equal(results[0]["plain"]["params"][k], results[1]["plain"]["params"][k]) for k in results[0]["plain"]["params"])


def test_a_parameter_left_out_of_sync_is_left_out_of_the_bytes(results):
    full = _param_bytes(_model())
    for rank in range(P):
        ignored = results[rank]["ignored"]
        payloads = _check_buckets(ignored)
        # 4.bias (10 float64 = 80 bytes) is never reduced, so every step records 80 bytes fewer.
        assert sum(payloads) == STEPS * (full - 80)
        frozen = results[rank]["frozen"]
        payloads = _check_buckets(frozen)
        assert sum(payloads) == STEPS * (full - 64 * 256 * 8)  # a frozen weight has no gradient to send
    # The ignored bias really was not averaged: the ranks, fed different data, disagree on it alone.
    a, b = results[0]["ignored"]["params"], results[1]["ignored"]["params"]
    assert not torch.equal(a["4.bias"], b["4.bias"])
    assert all(torch.equal(a[k], b[k]) for k in a if k != "4.bias")


def test_record_buckets_times_every_bucket(results):
    for rank in range(P):
        run = results[rank]["timed"]
        _check_buckets(run, ordered=False)
        assert all(e[5] is not None and e[5] > 0 for e in run["events"])
