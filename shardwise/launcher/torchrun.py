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

Preemption: torchrun's agent passes a SIGTERM on to its workers (which stop at their next log
step with a checkpoint, `shardwise.trainer.preempt`) and waits for them, then raises; SIGUSR1
(Slurm's ``--signal=USR1@60`` reaches every task, the agent included) would end the agent alone
and leave its workers running. ``shardwise run`` turns SIGUSR1 into that SIGTERM, and after
either exits with `EXIT_PREEMPTED` (75) and one line, not the agent's traceback, so a Slurm
script or a supervisor requeues the job and ``--resume auto`` continues it.

Across machines, every node runs the same command with a c10d rendezvous on the first
node (``--nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HEAD:29400
--rdzv-id JOB``); torch numbers the nodes in the order they join (``--node-rank`` is read
only by the static backend). Two mistakes that torch lets through and that then wait out
the 15-minute rendezvous timeout, each node alone, are refused here before anything starts:
a node count that is not ``N`` or ``MIN:MAX``, and a dynamic rendezvous (c10d, etcd) for
several nodes with no endpoint (every node would host its own store on localhost).
Measured on one machine with two agents (``tests/launcher/test_multinode.py``): a run across
the two equals the same run on one machine bit for bit, and after one node is lost under
``--nnodes 1:2 --max-restarts N`` the other restarts at the new size from the last checkpoint.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any

from shardwise.errors import EXIT_PREEMPTED, ConfigError

DEFAULT_LAST_CALL_TIMEOUT_S = 2


def _is_single_node(nnodes: str) -> bool:
    return nnodes.split(":")[-1] == "1"


def node_range(nnodes: str) -> tuple[int, int]:
    """``--nnodes`` as (min, max): ``"2"`` is (2, 2), ``"1:4"`` is (1, 4)."""
    parts = nnodes.split(":")
    if len(parts) in (1, 2) and all(p.strip().isdigit() for p in parts):
        low, high = int(parts[0]), int(parts[-1])
        if 1 <= low <= high:
            return low, high
    raise ConfigError(
        f"--nnodes takes a node count N or an elastic range MIN:MAX with 1 <= MIN <= MAX; got {nnodes!r} "
        "(e.g. --nnodes 2, or --nnodes 1:2 to go on with one node when the other is lost)"
    )


def _check_endpoint(args: argparse.Namespace) -> None:
    """Refuse a multi-node dynamic rendezvous with no endpoint, or an endpoint whose port is not a number."""
    _, most = node_range(args.nnodes)
    if most > 1 and not args.standalone and not args.rdzv_endpoint and args.rdzv_backend != "static":
        raise ConfigError(
            f"--nnodes {args.nnodes} with --rdzv-backend {args.rdzv_backend} needs --rdzv-endpoint HOST:PORT, the same on every "
            'node (HOST: the first node, e.g. $(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)); '
            "without it each node waits alone on its own localhost"
        )
    if args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if host and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"--rdzv-endpoint takes HOST:PORT with a port from 1 to 65535; got {args.rdzv_endpoint!r}")


def prepare(argv: Sequence[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    """Parse torchrun's flags and apply shardwise's defaults; ``environ`` is updated in place."""
    from torch.distributed.run import get_args_parser

    env = os.environ if environ is None else environ
    args = get_args_parser().parse_args(list(argv))
    node_range(args.nnodes)
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
    _check_endpoint(args)
    return args


def _as_sigterm(signum: int, frame: Any) -> None:
    os.kill(os.getpid(), signal.SIGTERM)  # torchrun's own handler then stops the workers


def run(argv: Sequence[str]) -> int:
    """Run a user's script under torchrun; returns the exit code."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import run as torch_run

    args = prepare(argv)
    main_thread = threading.current_thread() is threading.main_thread()  # only there can a handler be set
    before = signal.signal(signal.SIGUSR1, _as_sigterm) if main_thread else None
    try:
        torch_run(args)
    except ChildFailedError as exc:
        # torchrun already printed which rank failed and its traceback.
        first = next(iter(exc.failures.values()), None)
        return first.exitcode if first is not None and first.exitcode else 1
    except SignalException as exc:
        name = signal.Signals(exc.sigval).name
        if exc.sigval != signal.SIGTERM:
            print(f"shardwise run: {name} received: the workers were stopped", file=sys.stderr, flush=True)
            return 128 + int(exc.sigval)
        print(
            f"shardwise run: SIGTERM or SIGUSR1 received: the workers were asked to stop with a checkpoint; exit {EXIT_PREEMPTED} "
            "(requeue on it; --resume auto continues)",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_PREEMPTED
    finally:
        if main_thread:
            signal.signal(signal.SIGUSR1, before)
    return 0
