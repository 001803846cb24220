"""One Mixtral MoE block under ep=2 on 2 ranks against the block whole: outputs, gradients, bytes.

Each rank feeds its own T tokens. Outputs equal the whole block's on the same tokens; the input
gradients too; an expert slice's gradient on its owner equals the whole block's gradient of the sum
of both ranks' losses, restricted to that slice (before `reduce_grads`' dp scaling).

Bytes (dispatch.py's formula), rank r, H hidden, float64, n = E / ep local experts: with
``out_r`` = (token, expert) pairs of rank r routed to the other rank's experts and ``in_r`` = pairs of
the other rank routed to r's experts (both counted here from the router, replicated):
forward sends counts (ep - 1) x n x 8, dispatch out_r x H x 8, combine in_r x H x 8; backward sends
the gradients back: in_r x H x 8 and out_r x H x 8. Received is the mirror: the same total.
Five all-to-all events in all: three in forward, two in backward.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise import launch
from shardwise.comm import Recorder
from shardwise.comm.mesh import Mesh
from shardwise.strategies import compose
from shardwise.strategies.expert_parallel import cost
from tests.strategies.expert_parallel import moe_zoo

pytest.importorskip("transformers")
pytestmark = pytest.mark.dist

T, H = 12, 16


def _tokens(r: int) -> torch.Tensor:
    return torch.randn(1, T, H, generator=torch.Generator().manual_seed(10 + r), dtype=torch.float64)


def _worker() -> dict[str, object]:
    r = dist.get_rank()
    whole = moe_zoo.build("mixtral").model.layers[0].mlp
    block = moe_zoo.build("mixtral").model.layers[0].mlp
    xs = [_tokens(j).requires_grad_(True) for j in range(2)]
    ys = [whole(x) for x in xs]
    sum(((y * (j + 1)).sum() for j, y in enumerate(ys)), torch.zeros(())).backward()
    routed = [whole.gate(x.detach().reshape(-1, H))[2] // 2 for x in xs]  # owner rank of each (token, expert) pair
    rec = Recorder(keep_events=True)
    ep = compose.expert_parallel(block, 2, Mesh.build(world_size=2, rank=r), rec)
    x = _tokens(r).requires_grad_(True)
    y = block(x)
    ((y * (r + 1)).sum()).backward()
    n = 2
    grads_ok = all(
        torch.allclose(p.grad, dict(whole.experts.named_parameters())[name.split(".")[-1]].grad[r * n : (r + 1) * n], rtol=0, atol=1e-12)
        for name, p in ep.params.items()
    )
    t = rec.totals()["all_to_all"]
    return {
        "y": (y - ys[r]).abs().max().item(),
        "dx": (x.grad - xs[r].grad).abs().max().item(),
        "grads_ok": grads_ok,
        "out": int((routed[r] != r).sum()),
        "in": int((routed[1 - r] == r).sum()),
        "bytes": (int(t["count"]), int(t["sent_bytes"]), int(t["received_bytes"])),
    }


def test_dispatch_and_combine_equal_the_whole_block_and_move_the_formulas_bytes() -> None:
    results = launch(_worker, nproc=2, threads_per_proc=1, timeout=120)
    for r, res in enumerate(results):
        assert res["y"] <= 1e-12 and res["dx"] <= 1e-12, (r, res)
        assert res["grads_ok"], f"rank {r}: expert gradients differ from the whole block's"
        assert res["out"] > 0 and res["in"] > 0, "the tokens must cross ranks for the bytes to mean anything"
        counts = (2 - 1) * 2 * 8
        rows = (res["out"] + res["in"]) * H * 8  # type: ignore[operator]
        assert res["bytes"] == (5, counts + 2 * rows, counts + 2 * rows), (r, res)
        assert cost.all_to_all_sent(res["out"], res["in"], H, 8, 4, 2) == counts + 2 * rows  # type: ignore[arg-type]
    # balanced routing: 12 tokens x top-2, half of them remote, 4 row exchanges of H float64 each
    assert cost.expected_all_to_all_sent(T, 2, H, 8, 4, 2) == 16 + 4 * 12 * H * 8
    assert cost.expert_bytes_per_rank(1000, 16.0, 4) == 4000.0
