"""Codec invariants: error feedback loses nothing, top-k keeps k, int8 within scale/2, 16-bit within an ulp."""

from __future__ import annotations

import math

import pytest
import torch

from shardwise.comm.codecs import NAMES, Cast, CodecState, Encoded, Int8, PowerSGD, Sparse, get_codec, pack_bits, unpack_bits
from shardwise.errors import ConfigError

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _gradients(dtype: torch.dtype, n: int = 997, steps: int = 4) -> list[torch.Tensor]:
    """Gradients with hard cases: zeros, tiny values next to large ones, ties, a constant run."""
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-6, 2, (n,), generator=g)
        x[::11] = 0.0
        x[5:25] = 0.25  # a tie block
        x[3] = 1e-30 if dtype in (torch.float32, torch.float64) else 1e-7
        out.append(x.to(dtype))
    return out


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "topk:0.05", "randomk:0.05"])
@pytest.mark.parametrize("dtype", FLOATS)
def test_error_feedback_loses_nothing_exactly(spec, dtype):
    codec = get_codec(spec, error_feedback=True)
    state = CodecState(seed=3)
    for grad in _gradients(dtype):
        old = state.residual.clone() if state.residual is not None else torch.zeros_like(grad)
        encs, sent = codec.compress(grad, state, pieces=3 if spec == "int8" else 1)
        assert sent.dtype == grad.dtype and state.residual.dtype == grad.dtype
        assert torch.equal(sent + state.residual, grad + old)


@pytest.mark.parametrize("dtype", (torch.float32, torch.float64))
def test_sign_error_feedback_is_exact_up_to_one_rounding(dtype):
    # Only two levels (+-scale): x - scale rounds when |x| is far below scale, by at most an ulp.
    codec = get_codec("sign")
    state = CodecState()
    for grad in _gradients(dtype):
        old = state.residual.clone() if state.residual is not None else torch.zeros_like(grad)
        corrected = grad + old
        _, sent = codec.compress(grad, state)
        err = (sent + state.residual - corrected).abs()
        assert (err <= torch.finfo(dtype).eps * (corrected.abs() + sent.abs())).all()
        assert set(sent.abs().unique().tolist()) == {sent.abs().max().item()}  # one magnitude: the scale


def test_error_feedback_delivers_everything_over_time():
    """With a constant gradient, what top-k sends over T steps plus the residual is T times the gradient."""
    codec = get_codec("topk:0.1")
    state = CodecState()
    grad = torch.linspace(-1, 1, 50, dtype=torch.float64)
    total = torch.zeros_like(grad)
    for _ in range(200):
        total += codec.compress(grad, state)[1]
    assert torch.allclose(total + state.residual, 200 * grad, rtol=0, atol=1e-12)
    # The memory stays bounded (Stich et al. 2018): nothing piles up without being sent.
    assert state.residual.abs().max() <= grad.numel() / 5 * grad.abs().max()
    assert (total != 0).sum() >= 48


@pytest.mark.parametrize("ratio", [0.01, 0.1, 0.5, 1.0])
def test_topk_keeps_exactly_k_of_the_largest(ratio):
    codec = get_codec(f"topk:{ratio}")
    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    (enc,), sent = codec.compress(x, CodecState())
    k = max(1, math.floor(ratio * 1000))
    assert enc.parts["idx"].numel() == k == len(set(enc.parts["idx"].tolist()))
    assert int((sent != 0).sum()) == k
    kept = sent != 0
    assert torch.equal(sent[kept], x[kept])
    if ratio < 1:
        assert x[kept].abs().min() >= x[~kept].abs().max()
    assert enc.nbytes == k * (4 + 4)  # int32 index + float32 value


def test_randomk_keeps_exactly_k_distinct_entries_drawn_from_the_seed():
    codec = get_codec("randomk:0.1")
    assert codec.exchange == "allreduce"  # every rank draws the same indices: the values can be summed
    x = torch.randn(500, generator=torch.Generator().manual_seed(0)) + 10  # no zeros
    (a,), sent = codec.compress(x, CodecState(seed=1))
    (b,), _ = codec.compress(x, CodecState(seed=1))
    (c,), _ = codec.compress(x, CodecState(seed=2))
    idx = a.local["idx"]
    assert idx.numel() == 50 == len(set(idx.tolist())) == int((sent != 0).sum())
    assert torch.equal(idx, b.local["idx"]) and not torch.equal(idx, c.local["idx"])
    assert torch.equal(sent[idx], x[idx]) and torch.equal(a.parts["val"], x[idx])
    # On the wire: the k values and the 8-byte seed they were drawn from, never the indices.
    assert set(a.parts) == {"val", "seed"} and a.nbytes == 50 * 4 + 8


def test_randomk_ranks_with_one_seed_draw_the_same_fresh_indices_every_call():
    """The shared-randomness exchange: equal seeds agree call after call, and each call draws anew."""
    codec = get_codec("randomk:0.05")
    ranks = [CodecState(seed=11) for _ in range(3)]
    seen = []
    for step in range(4):
        grads = [torch.randn(1000, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(3)]
        encs = [codec.compress(g, st)[0][0] for g, st in zip(grads, ranks, strict=True)]
        assert all(torch.equal(e.local["idx"], encs[0].local["idx"]) for e in encs)
        seen.append(set(encs[0].local["idx"].tolist()))
        # Summing the values is the sum of the sparse tensors: what the allreduce exchange relies on.
        total = torch.zeros(1000)
        total[encs[0].local["idx"]] = sum(e.parts["val"] for e in encs)
        assert torch.allclose(total, sum(codec.decode(e) for e in encs), rtol=0, atol=1e-6)
    assert all(seen[i] != seen[j] for i in range(4) for j in range(i))


def test_a_randomk_payload_decodes_from_its_bytes_alone():
    """A standalone message (a parameter-server push) carries the seed; the receiver draws the indices again."""
    codec = get_codec("randomk:0.1")
    x = torch.randn(300, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    state = CodecState(seed=5)
    codec.compress(x, state)  # advance the stream: the second call's seed is not the first
    (enc,), sent = codec.compress(x, state)
    template = codec.encode(torch.zeros(300, dtype=torch.float64), CodecState())
    back = template.unpack_like(enc.pack())
    assert back.local == {} and torch.equal(codec.decode(back), sent)


@pytest.mark.parametrize("dtype", FLOATS)
def test_int8_error_is_at_most_half_a_step_of_each_chunk(dtype):
    codec = Int8()
    for x in _gradients(dtype, steps=2):
        x = x.clone()
        x[100:200] *= 1000  # chunks with very different ranges
        encs, sent = codec.compress(x, CodecState(), pieces=4)
        for enc, piece, got in zip(encs, x.tensor_split(4), sent.tensor_split(4), strict=True):
            scale, zp = enc.parts["meta"].tolist()
            assert enc.parts["q"].dtype == torch.uint8 and zp == int(zp) and 0 <= zp <= 255
            err = (piece.double() - got.double()).abs()
            # scale / 2, plus the rounding of the result to the tensor's own dtype.
            assert (err <= scale / 2 * (1 + 1e-6) + torch.finfo(dtype).eps * piece.double().abs()).all()
            assert (got[piece == 0] == 0).all()  # zero is on the grid
            assert enc.nbytes == piece.numel() + (16 if dtype == torch.float64 else 8)


def test_int8_constant_and_empty_and_all_zero_chunks():
    codec = Int8()
    for x in (torch.full((10,), 3.5), torch.full((10,), -2.0), torch.zeros(10), torch.zeros(0)):
        (enc,), sent = codec.compress(x, CodecState(), 1)
        assert torch.allclose(sent, x, atol=float(enc.parts["meta"][0]) / 2 + 1e-7)


def test_fp16_and_bf16_are_within_one_ulp_and_fp16_saturates():
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float() * 100
    for name, wire in (("fp16", torch.float16), ("bf16", torch.bfloat16)):
        (enc,), sent = get_codec(name).compress(x, CodecState())
        assert enc.parts["x"].dtype == wire and enc.nbytes == 2 * x.numel()
        towards = torch.where(x > sent, torch.tensor(math.inf), torch.tensor(-math.inf)).to(wire)
        ulp = (torch.nextafter(sent.to(wire), towards).float() - sent).abs()
        assert ((x - sent).abs() <= ulp).all()
    big = torch.tensor([1e6, -1e6, 70000.0])
    (_,), sent = get_codec("fp16").compress(big, CodecState())
    assert sent.tolist() == [65504.0, -65504.0, 65504.0]  # no inf on the wire


def test_sign_packs_one_bit_per_element_and_a_scale():
    for n in (1, 7, 8, 9, 1001):
        bits = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
        assert torch.equal(unpack_bits(pack_bits(bits), n), bits)
    x = torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0])
    (enc,), sent = get_codec("sign").compress(x, CodecState())
    assert enc.nbytes == 1 + 4
    assert sent.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0]  # mean |x| = 1


def test_payloads_pack_into_one_message_and_back_at_any_offset():
    x = torch.randn(33, dtype=torch.float64)
    for spec in ("int8", "topk:0.2", "randomk:0.2", "sign", "fp16"):
        (enc,), _ = get_codec(spec).compress(x, CodecState())
        raw = enc.pack()
        assert raw.dtype == torch.uint8 and raw.numel() == enc.nbytes
        shifted = torch.cat([torch.zeros(3, dtype=torch.uint8), raw])[3:]  # a payload at an odd offset
        back = enc.unpack_like(shifted)
        assert set(back.parts) == set(enc.parts)
        assert all(torch.equal(back.parts[k], enc.parts[k]) for k in enc.parts)


def test_names_options_and_defaults():
    assert isinstance(get_codec("fp16"), Cast) and not get_codec("fp16").error_feedback
    assert get_codec("int8").error_feedback and get_codec("sign").error_feedback
    topk = get_codec("topk:0.01")
    assert isinstance(topk, Sparse) and topk.ratio == 0.01 and topk.spec == "topk:0.01" and topk.exchange == "allgather"
    assert get_codec("randomk:0.1").exchange == "allreduce" and get_codec("sign").exchange == "allgather"
    assert not get_codec("topk:0.01", error_feedback=False).error_feedback
    assert get_codec("powersgd:4") == PowerSGD(4) and PowerSGD(4).spec == "powersgd:4"
    assert len(NAMES) == 7


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("int4", r"unknown compression codec 'int4'\. Did you mean 'int8'\? Known codecs: fp16, bf16, int8, topk:RATIO"),
        ("tpok:0.1", r"Did you mean 'topk'\?"),
        ("zstd", r"unknown compression codec 'zstd'\. Known codecs"),
        ("topk", r"codec 'topk' needs a ratio of entries to keep, e.g. 'topk:0.01'; got 'topk'"),
        ("topk:0", r"the ratio of codec 'topk' must be in \(0, 1\] \(a fraction of entries to keep\), e.g. 'topk:0.01'; got 0 in 'topk:0'"),
        ("randomk:1.5", r"must be in \(0, 1\].*got 1.5"),
        ("topk:-0.1", r"must be in \(0, 1\].*got -0.1"),
        ("topk:lots", r"codec 'topk' needs a number as its ratio, e.g. 'topk:0.01'; got 'lots'"),
        ("powersgd", r"codec 'powersgd' needs a whole-number rank >= 1, e.g. 'powersgd:4'; got 'powersgd'"),
        ("powersgd:0", r"whole-number rank >= 1"),
        ("fp16:2", r"codec 'fp16' takes no argument; got 'fp16:2'"),
        ("", r"a codec is named by a string"),
    ],
)
def test_bad_codec_names_and_options_are_clear_errors(spec, message):
    with pytest.raises(ConfigError, match=message):
        get_codec(spec)


@pytest.mark.parametrize("spec", ["fp16", "bf16", "int8", "topk:0.1", "randomk:0.1", "sign"])
def test_a_codec_on_an_integer_tensor_is_a_clear_error(spec):
    with pytest.raises(ConfigError, match=rf"codec '{spec}' compresses floating-point gradients; got a tensor of dtype torch.int64"):
        get_codec(spec).compress(torch.ones(4, dtype=torch.int64), CodecState())


def test_a_residual_of_the_wrong_shape_is_refused():
    state = CodecState(residual=torch.zeros(3))
    with pytest.raises(ValueError, match=r"residual \(3,\) torch.float32 does not match the tensor \(4,\)"):
        get_codec("int8").compress(torch.ones(4), state)


def test_encoded_counts_its_bytes():
    enc = Encoded({"a": torch.zeros(3, dtype=torch.float64), "b": torch.zeros(5, dtype=torch.uint8)}, 10, torch.float32)
    assert enc.nbytes == 29 and enc.pack().numel() == 29


def test_sampled_top_k_selection_matches_torch_topk_even_on_adversarial_layouts():
    from shardwise.comm.codecs import _top_k

    n, k = 1 << 17, 1310  # large enough for the sampled threshold (stride 2)
    g = torch.Generator().manual_seed(0)
    layouts = {
        "random": torch.randn(n, generator=g).abs(),
        "sorted": torch.linspace(0, 1, n),
        "spikes off the sample": torch.where(torch.arange(n) % 2 == 1, 100.0, 1.0) * torch.rand(n, generator=g),
        "spikes on the sample": torch.where(torch.arange(n) % 2 == 0, 100.0, 1.0) * torch.rand(n, generator=g),
    }
    for name, a in layouts.items():
        got = _top_k(a, k)
        assert got.numel() == k == len(set(got.tolist())), name
        assert a[got].min() >= torch.topk(a, k).values.min(), name


def test_fast_random_k_draws_k_distinct_uniform_indices():
    from shardwise.comm.codecs import _random_k

    gen = torch.Generator().manual_seed(0)
    n, k = 100_000, 1000  # the sampling path (k much smaller than n)
    counts = torch.zeros(10)
    for _ in range(50):
        idx = _random_k(n, k, gen, torch.device("cpu"))
        assert idx.numel() == k == idx.unique().numel() and 0 <= int(idx.min()) and int(idx.max()) < n
        counts += torch.bincount(idx // (n // 10), minlength=10)
    # 50 000 draws over 10 equal bins: each within 5% of 5 000 (about 7 standard deviations).
    assert ((counts - 5000).abs() < 250).all(), counts


def test_ddp_options_pair_allreduce_algorithms_only_with_codecs_whose_exchange_is_an_allreduce():
    from shardwise.comm.hooks import parse_options

    assert parse_options("ring", None) == ("ring", None) and parse_options("native", "none") == ("native", None)
    for spec in ("fp16", "bf16", "randomk:0.2"):  # summed as they are: any algorithm
        algorithm, codec = parse_options("tree", spec)
        assert algorithm == "tree" and codec is not None and codec.spec == spec
    for spec, exchange in (("int8", "scatter-gather"), ("topk:0.01", "allgather"), ("sign", "allgather"), ("powersgd:2", "powersgd")):
        with pytest.raises(ConfigError, match=rf"compression '{spec}' has its own exchange \({exchange}\), so it cannot run over allreduce='ring'"):
            parse_options("ring", spec)
    with pytest.raises(ConfigError, match=r"unknown allreduce algorithm 'rign'\. Did you mean 'ring'\? Known algorithms: ring"):
        parse_options("rign", None)
