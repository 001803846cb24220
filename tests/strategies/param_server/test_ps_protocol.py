"""The parameter server's wire format, partition and staleness bookkeeping, without processes."""

from __future__ import annotations

import pytest
import torch

from shardwise.comm.codecs import get_codec
from shardwise.errors import ConfigError
from shardwise.strategies.param_server.protocol import (
    CTRL_TAG,
    HEADER_BYTES,
    KIND,
    LENGTH,
    LOAD,
    LR,
    PULL_TAG,
    PUSH,
    PUSH_TAG,
    STATS_TAG,
    STEP,
    VERSION,
    WORKER,
    GradientCoder,
    ServerStats,
    Tags,
    header,
    pack,
    partition_by_bytes,
    path_bytes,
    path_of,
    payload_of,
    unpack_header,
)
from shardwise.trainer.straggler import Straggler, parse_straggler


def test_partition_is_balanced_by_bytes_deterministic_and_complete() -> None:
    sizes = [4096, 64, 4096, 16, 1024, 1024, 8]
    for k in (1, 2, 3):
        bins = partition_by_bytes(sizes, k)
        assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
        assert bins == partition_by_bytes(sizes, k)
        assert all(b == sorted(b) for b in bins)
    # Largest first onto the lightest: 4096 | 4096, then 1024 | 1024, then 64, 16, 8 even it out.
    assert [sum(sizes[i] for i in b) for b in partition_by_bytes(sizes, 2)] == [4096 + 1024 + 64, 4096 + 1024 + 16 + 8]
    assert partition_by_bytes([400, 40, 400, 10], 2) == [[0, 1], [2, 3]]


def test_a_message_is_a_header_then_the_payload_bytes() -> None:
    grad = torch.arange(5, dtype=torch.float64) / 3
    msg = pack(header(PUSH, 2, 17, 0.125, 9), grad, HEADER_BYTES + 40)
    assert msg.dtype == torch.uint8 and msg.numel() == HEADER_BYTES + 40
    head = unpack_header(msg)
    assert (head[KIND], head[WORKER], head[STEP], head[LR], head[VERSION]) == (PUSH, 2, 17, 0.125, 9)
    assert torch.equal(payload_of(msg, torch.float64, 5), grad)


@pytest.mark.parametrize("spec", [None, "fp16", "int8", "topk:0.25", "randomk:0.25", "sign"])
def test_gradient_coder_round_trips_and_sizes_every_payload_the_same(spec: str | None) -> None:
    codec = get_codec(spec) if spec else None
    sender, receiver = GradientCoder(64, torch.float32, codec), GradientCoder(64, torch.float32, codec)
    g = torch.randn(64, generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        before = sender.state.residual.clone() if sender.state.residual is not None else torch.zeros_like(g)
        payload = sender.encode(g)
        nbytes = payload.numel() * payload.element_size()
        assert nbytes == sender.payload_bytes
        got = receiver.decode(pack(header(PUSH, 0, 0, 0.1, 0), payload, HEADER_BYTES + sender.payload_bytes))
        if codec is None:
            assert torch.equal(got, g)
        elif codec.error_feedback:
            # The server decodes exactly what the worker meant to send: sent + kept back = gradient + old residual.
            assert sender.state.residual is not None
            assert torch.allclose(got + sender.state.residual, g + before, atol=1e-6)
        else:
            assert torch.allclose(got, g, atol=1e-2)
    if spec is not None:
        assert sender.payload_bytes <= 64 * 4 // 2  # at most half the dense float32 bytes


def test_server_stats_histograms_and_tensor_round_trip() -> None:
    st = ServerStats(3)
    for s, v in [(0, 0), (1, 2), (1, 3), (70, 100)]:
        st.record(s, v)
    st.updates, st.lost = 4, [2]
    back = ServerStats.from_tensor(st.to_tensor(), 3)
    assert back == st
    rep = back.report()
    assert rep["staleness_hist"] == {"0": 1, "1": 2, "63": 1} and rep["max_staleness"] == 70 and rep["lost_workers"] == [2]


def test_straggler_spec() -> None:
    assert parse_straggler("1:3") == (1, 3.0)
    for bad in ("1", "x:3", "1:0.5", "-1:2"):
        with pytest.raises(ConfigError, match="RANK:FACTOR"):
            parse_straggler(bad)
    assert Straggler.from_spec("0:2.5").factor == 2.5


def test_a_checkpoint_path_travels_as_its_utf8_bytes_after_a_header_with_its_length() -> None:
    path = "/tmp/runs/ünïcode run/checkpoints/.tmp-step-00000008"
    raw = path_bytes(path)
    assert raw.dtype == torch.uint8 and raw.numel() == len(path.encode())
    assert path_of(raw) == path
    head = unpack_header(pack(header(LOAD, 1, 8, 0.0, 0, raw.numel()), None, HEADER_BYTES))
    assert head[KIND] == LOAD and head[STEP] == 8 and head[LENGTH] == raw.numel()


def test_each_session_has_tags_of_its_own() -> None:
    # A later session in the same processes (a second fit) must never match a message or a receive
    # left from an earlier one (a worker declared lost): no tag is shared between sessions.
    sessions = [Tags.of_session(n) for n in range(50)]
    tags = [t for s in sessions for t in (s.push, s.pull, s.stats, s.ctrl)]
    assert len(set(tags)) == len(tags) == 200
    assert sessions[0] == Tags(PUSH_TAG, PULL_TAG, STATS_TAG, CTRL_TAG)


def test_a_server_drops_silent_workers_it_owes_nothing_but_never_worker_zero() -> None:
    # No process group: the bookkeeping alone. Worker 0 reports the run and pauses alone (evaluation,
    # checkpoints): dropping it would end the session under it, and its death ends the run anyway.
    import time

    from shardwise.comm.collectives import Group
    from shardwise.comm.recorder import Recorder
    from shardwise.strategies.param_server.server import Server

    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    coder = GradientCoder(4, torch.float64, None)
    for mode, staleness in (("async", None), ("ssp", 1), ("sync", None)):
        server = Server(
            params,
            lambda p: torch.optim.SGD(p, lr=0.1),
            index=0,
            worker_ranks=[0, 1, 2, 3],
            mode=mode,
            staleness=staleness,
            coder=coder,
            message_bytes=HEADER_BYTES + 32,
            reply_bytes=HEADER_BYTES + 32,
            worker_timeout_s=5.0,
            recorder=Recorder(),
            group=Group("ps"),
            tags=Tags.of_session(0),
        )
        now = time.monotonic()
        server.last_seen = [now - 3600, now - 3600, now - 3600, now]  # 0, 1, 2 silent for an hour, 3 just spoke
        if mode == "ssp":  # worker 2 is two clocks ahead: it waits for an answer we owe it
            server.held, server.completed = {2}, [0, 0, 2, 0]
        server._check_silent()
        assert server.stats.lost == ([1] if mode == "ssp" else [1, 2]), mode
        assert 0 in server.live and 3 in server.live, mode
