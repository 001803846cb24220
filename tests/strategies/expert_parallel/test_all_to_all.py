"""`comm.all_to_all` on 2 ranks: values, the recorded bytes against the formula, and its autograd form.

Rank r sends ``splits[r][j]`` rows (of ``W`` float64 values, row j of a known pattern) to rank j.
Formula (collectives.py): payload = rows_in x row_bytes; sent = (rows_in - splits[r][r]) x row_bytes;
received = (rows_out - splits[r][r]) x row_bytes, where rows_out = sum_j splits[j][r]. The autograd
form records the same exchange again in backward with the splits swapped.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from shardwise import launch
from shardwise.comm import Recorder, all_to_all, all_to_all_autograd
from shardwise.errors import ConfigError

pytestmark = pytest.mark.dist

W = 3
SPLITS = [[2, 3], [1, 0]]  # rank 0 keeps 2 rows and sends 3 to rank 1; rank 1 sends 1 row to rank 0


def _rows(src: int, dst: int) -> torch.Tensor:
    n = SPLITS[src][dst]
    return torch.arange(n * W, dtype=torch.float64).reshape(n, W) + 100 * src + 10 * dst


def _worker() -> dict[str, object]:
    r = dist.get_rank()
    x = torch.cat([_rows(r, j) for j in range(2)])
    outs = [SPLITS[j][r] for j in range(2)]
    rec = Recorder()
    y = all_to_all(x, SPLITS[r], outs, recorder=rec)
    want = torch.cat([_rows(j, r) for j in range(2)])
    t = rec.totals()["all_to_all"]
    leaf = x.clone().requires_grad_(True)
    rec2 = Recorder()
    z = all_to_all_autograd(leaf, SPLITS[r], outs, recorder=rec2)
    (z * torch.arange(1, z.shape[0] + 1, dtype=torch.float64)[:, None]).sum().backward()
    equal = all_to_all(torch.arange(4.0).double() + 10 * r)  # equal splits: 2 rows each way
    try:
        all_to_all(torch.zeros(3, dtype=torch.float64))
        refused = ""
    except ConfigError as exc:
        refused = str(exc)
    return {
        "values": torch.equal(y, want),
        "bytes": (int(t["payload_bytes"]), int(t["sent_bytes"]), int(t["received_bytes"])),
        "grad": leaf.grad,
        "grad_bytes": (int(rec2.totals()["all_to_all"]["count"]), int(rec2.totals()["all_to_all"]["sent_bytes"])),
        "equal": equal.tolist(),
        "refused": refused,
    }


def test_all_to_all_values_bytes_and_gradient() -> None:
    results = launch(_worker, nproc=2, threads_per_proc=1, timeout=120)
    row = W * 8
    for r, res in enumerate(results):
        assert res["values"], f"rank {r} received the wrong rows"
        rows_in = sum(SPLITS[r])
        rows_out = sum(SPLITS[j][r] for j in range(2))
        keep = SPLITS[r][r]
        assert res["bytes"] == (rows_in * row, (rows_in - keep) * row, (rows_out - keep) * row)
        # backward: forward + backward, each moving this rank's rows: sent = forward's sent + backward's (its received)
        assert res["grad_bytes"] == (2, (rows_in - keep) * row + (rows_out - keep) * row)
        assert "split into 2 equal pieces" in res["refused"]
    # the gradient of row i of rank r's output is i + 1; it returns to the row's sender, in order
    g0 = results[0]["grad"]
    g1 = results[1]["grad"]
    # rank 0's rows: 2 kept (rank 0 output rows 1,2), 3 to rank 1 (rank 1 output rows 1..3 after 0 own rows)
    assert g0[:, 0].tolist() == [1.0, 2.0, 1.0, 2.0, 3.0]
    # rank 1's row to rank 0 is rank 0's output row 3
    assert g1[:, 0].tolist() == [3.0]
    assert results[0]["equal"] == [0.0, 1.0, 10.0, 11.0]
    assert results[1]["equal"] == [2.0, 3.0, 12.0, 13.0]
