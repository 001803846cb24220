"""``shardwise run [torchrun flags] script.py args...``: torch's own launcher with defaults that work.

torch.distributed.run brings rendezvous, ``--nnodes MIN:MAX`` elasticity and
``--max-restarts``. Measured on torch 2.13 with gloo, two of its defaults fail
users, so shardwise changes them (a flag or variable the user sets wins):

- Restarts reuse the rendezvous TCP store shared with the agent and fail in about
  half the runs with stale gloo addresses; ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``
  gives each restart a fresh store (8 clean restarts of 8).
- An elastic range ``--nnodes MIN:MAX`` waits ``last_call_timeout`` (30 s) at
  every rendezvous for late nodes; shardwise lowers it to
  ``DEFAULT_LAST_CALL_TIMEOUT_S``.
- One machine with no rendezvous endpoint gets ``--standalone`` (a c10d rendezvous
  on a free local port), so two jobs on one machine never collide on port 29500.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

DEFAULT_LAST_CALL_TIMEOUT_S = 2


def _is_single_node(nnodes: str) -> bool:
    return nnodes.split(":")[-1] == "1"


def prepare(argv: Sequence[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse torchrun's flags and apply shardwise's defaults; ``environ`` is updated in place."""
    from torch.distributed.run import get_args_parser

    env = os.environ if environ is None else environ
    args = get_args_parser().parse_args(list(argv))
    env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    if not args.standalone and not args.rdzv_endpoint and _is_single_node(args.nnodes):
        args.standalone = True
    if ":" in args.nnodes:
        if args.rdzv_backend == "static":
            # An elastic range needs a dynamic rendezvous; static refuses ranges.
            args.rdzv_backend = "c10d"
        if "last_call_timeout" not in args.rdzv_conf:
            extra = f"last_call_timeout={DEFAULT_LAST_CALL_TIMEOUT_S}"
            args.rdzv_conf = f"{args.rdzv_conf},{extra}" if args.rdzv_conf else extra
    return args


def run(argv: Sequence[str]) -> int:
    """Run a user's script under torchrun; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torch_run

    args = prepare(argv)
    try:
        torch_run(args)
    except ChildFailedError as exc:
        # torchrun already printed which rank failed and its traceback.
        first = next(iter(exc.failures.values()), None)
        return first.exitcode if first is not None and first.exitcode else 1
    return 0
