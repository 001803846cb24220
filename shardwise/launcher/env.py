"""Where this process stands in a distributed job, and joining its process group.

This is the only module of shardwise that reads the environment (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT, SLURM_*, a Kubeflow PyTorchJob's PET_*, and mpirun's
OMPI_COMM_WORLD_* or PMI_*: `mpi_env`); everything else receives a `DistEnv` value.

Kubeflow's PyTorchJob (training operator v1, ``pkg/controller.v1/pytorch/envvar.go`` and
``master.go``) gives every pod MASTER_ADDR/MASTER_PORT and the same as PET_MASTER_ADDR/
PET_MASTER_PORT, RANK = PET_NODE_RANK = the pod's index (the master 0, worker i is i + 1),
PET_NNODES = the number of pods ("MIN:MAX" under an elastic policy), PET_NPROC_PER_NODE when
the job sets nprocPerNode, and WORLD_SIZE = pods x nprocPerNode. The PET_* names are torchrun's
own flags as environment variables, so a pod whose command is torchrun needs nothing from us
(its workers carry torchrun's RANK and TORCHELASTIC_RUN_ID). A pod that runs shardwise itself
is read here: one process per pod joins as rank PET_NODE_RANK of PET_NNODES; one pod with N
processes starts them as any single machine does (``--nproc N``); several pods with several
processes each, or an elastic range, need torchrun to number the processes, and say so.
"""

from __future__ import annotations

import atexit
import datetime
import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from shardwise.errors import ConfigError, LaunchError

DEFAULT_TIMEOUT_S = 300.0
"""Seconds a collective may wait for its peers before it fails (instead of hanging)."""

_SETTLE_S = 0.05
"""Seconds the backend's threads get at exit to let go of their last collective's tensors."""
_settle_registered = False


def _settle_backend_threads() -> None:
    """At exit, before Python finalizes: give the backend's worker threads the GIL once more.

    A gloo worker thread frees each finished collective after the caller has moved on;
    freeing a tensor that Python has already dropped takes the GIL. When that happens
    after the interpreter began finalizing, the thread is killed mid-destructor and the
    whole process aborts ("terminate called without an active exception", exit -6) after
    a run that succeeded: about one run in six of a short script under torchrun whose
    last line follows the last collective within milliseconds. The group itself cannot
    be freed first (torch's DDP keeps it alive after ``destroy_process_group``), so the
    threads are given time instead; atexit handlers run before finalization starts.
    """
    time.sleep(_SETTLE_S)


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """This process's place in the job."""

    rank: int
    """Global rank, 0 .. world_size-1."""
    world_size: int
    """Number of processes in the job."""
    local_rank: int = 0
    """Rank among the processes on this machine (selects the GPU)."""
    local_world_size: int = 1
    """Number of processes on this machine."""
    master_addr: str = "127.0.0.1"
    """Address of rank 0's rendezvous store."""
    master_port: int = 29500
    """Port of rank 0's rendezvous store."""
    source: str = "none"
    """Who set this up: 'none' (one plain process), 'spawn' (shardwise.launch),
    'torchrun', 'slurm', 'kubeflow' (a PyTorchJob pod's own process), 'mpirun' (Open MPI's
    or MPICH's / Intel MPI's), or 'existing' (a process group already initialized)."""

    @property
    def distributed(self) -> bool:
        return self.source != "none"


def _int(environ: Mapping[str, str], key: str, default: int | None = None) -> int:
    raw = environ.get(key)
    if raw is None:
        if default is None:
            raise ConfigError(f"environment variable {key} is not set; it is needed with the other distributed variables")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment variable {key}={raw!r} is not an integer") from None


def user_threads(environ: Mapping[str, str] | None = None) -> int | None:
    """The thread count a user set in ``OMP_NUM_THREADS`` (its first level when it lists several), else None
    (also for a value that is not a whole number >= 1, which OpenMP ignores too)."""
    raw = (os.environ if environ is None else environ).get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(raw) if raw.isdigit() and int(raw) >= 1 else None


def first_slurm_host(nodelist: str) -> str:
    """First host name of a Slurm node list such as ``gpu[003-005,007],cpu01``."""
    m = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if not m:
        raise ConfigError(f"cannot read the Slurm node list {nodelist!r}; set MASTER_ADDR explicitly")
    prefix, _, ranges = m.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def detect_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Read this process's place in the job from the environment.

    torchrun (and Ray Train, and anything that follows torch's convention) sets
    RANK and WORLD_SIZE; a Kubeflow PyTorchJob sets them per pod with its PET_*
    variables (read by `kubeflow_env`); mpirun sets OMPI_COMM_WORLD_* (Open MPI) or PMI_*
    (MPICH, Intel MPI; read by `mpi_env`, before Slurm's: under mpirun inside an allocation the
    SLURM_* a rank inherits describe mpirun's step, not the rank); Slurm's srun sets SLURM_PROCID
    and SLURM_NTASKS. With none of them, this is a single plain process.
    """
    env = os.environ if environ is None else environ
    if dist.is_available() and dist.is_initialized():
        return DistEnv(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            source="existing",
        )
    if any(k in env for k in _PYTORCHJOB) and not any(k in env for k in _LAUNCHED):
        return kubeflow_env(env)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK"),
            world_size=_int(env, "WORLD_SIZE"),
            local_rank=_int(env, "LOCAL_RANK", 0),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT", 29500),
            source=env.get("SHARDWISE_LAUNCHER", "torchrun"),
        )
    mpi = mpi_env(env)
    if mpi is not None:
        return mpi
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env and _int(env, "SLURM_NTASKS") > 1:
        addr = env.get("MASTER_ADDR") or first_slurm_host(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
        job = _int(env, "SLURM_JOB_ID", 0)
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            world_size=_int(env, "SLURM_NTASKS"),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            local_world_size=_int(env, "SLURM_NTASKS_PER_NODE", 1) if env.get("SLURM_NTASKS_PER_NODE", "").isdigit() else 1,
            master_addr=addr,
            # A port derived from the job id lets every task agree without talking.
            master_port=_int(env, "MASTER_PORT", 15000 + job % 20000),
            source="slurm",
        )
    return DistEnv(rank=0, world_size=1, source="none")


_PYTORCHJOB = ("PET_NNODES", "PET_NODE_RANK", "PET_NPROC_PER_NODE")
"""Variables only a Kubeflow PyTorchJob sets on a pod (torchrun reads them as its flags)."""
_LAUNCHED = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "SHARDWISE_LAUNCHER")
"""Set by a launcher on each process it starts: such a process is a rank, whatever its pod says."""


def kubeflow_env(env: Mapping[str, str]) -> DistEnv:
    """This process's place in a Kubeflow PyTorchJob, read from the variables the operator sets on the pod."""
    nnodes_raw = env.get("PET_NNODES", env.get("WORLD_SIZE", "1"))
    if ":" in nnodes_raw:
        raise ConfigError(
            f"this PyTorchJob is elastic (PET_NNODES={nnodes_raw}): its processes are numbered by torchrun; "
            "make the container command `torchrun -m shardwise train ...` (torchrun reads the PET_* variables)"
        )
    nnodes = _int(env, "PET_NNODES", _int(env, "WORLD_SIZE", 1))
    nproc_raw = env.get("PET_NPROC_PER_NODE", "1")
    if not nproc_raw.isdigit() or int(nproc_raw) < 1:
        raise ConfigError(
            f"PET_NPROC_PER_NODE={nproc_raw!r}: shardwise needs a whole number of processes per pod; set nprocPerNode "
            "to a number, or make the container command `torchrun -m shardwise train ...`"
        )
    nproc = int(nproc_raw)
    node_rank = _int(env, "PET_NODE_RANK", _int(env, "RANK", 0))
    if "WORLD_SIZE" in env and _int(env, "WORLD_SIZE") != nnodes * nproc:
        raise ConfigError(
            f"the PyTorchJob's variables disagree: WORLD_SIZE={env['WORLD_SIZE']} but PET_NNODES x PET_NPROC_PER_NODE = "
            f"{nnodes} x {nproc}; set them as the training operator does (WORLD_SIZE = pods x processes per pod)"
        )
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"PET_NODE_RANK={node_rank} is outside the job's {nnodes} pods (PET_NNODES); set it to 0 .. {nnodes - 1}")
    if nproc > 1 and nnodes > 1:
        raise ConfigError(
            f"this PyTorchJob runs {nnodes} pods x {nproc} processes: each pod's processes are numbered by torchrun; "
            "make the container command `torchrun -m shardwise train ...` (torchrun reads the PET_* variables)"
        )
    if nnodes * nproc == 1 or nproc > 1:
        # One pod: its processes are this machine's to start, as anywhere else (`--nproc N`).
        return DistEnv(rank=0, world_size=1, source="none")
    return DistEnv(
        rank=node_rank,
        world_size=nnodes,
        master_addr=env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT", _int(env, "PET_MASTER_PORT", 29500)),
        source="kubeflow",
    )


_MPI_FAMILIES = {
    # rank, size, local rank, local size: what each family's launcher sets on every process it starts
    "Open MPI": ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
    "MPICH / Intel MPI": ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
}
_EXPORT = {  # how each family's mpirun exports a variable to every process
    "Open MPI": "mpirun -np {n} -x MASTER_ADDR=HOST -x MASTER_PORT=29500 shardwise train ...",
    "MPICH / Intel MPI": "mpirun -np {n} -genv MASTER_ADDR HOST -genv MASTER_PORT 29500 shardwise train ...",
}


def mpi_env(env: Mapping[str, str]) -> DistEnv | None:
    """This process's place in a job started by ``mpirun`` / ``mpiexec``, or None when none started it.

    Open MPI sets OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE on each process; MPICH's and
    Intel MPI's Hydra set PMI_RANK/PMI_SIZE and MPI_LOCALRANKID/MPI_LOCALNRANKS. Neither sets where
    rank 0's rendezvous store is, so MASTER_ADDR and MASTER_PORT come from the environment (exported
    with ``mpirun -x`` or ``-genv``); missing, they are a `ConfigError` saying how. A job of one
    process is a plain process (``mpirun -np 1 shardwise train --nproc 2`` starts its own 2). srun's
    PMI plugin sets PMI_RANK/PMI_SIZE too: where they agree with SLURM_PROCID/SLURM_NTASKS, the
    job is Slurm's and is read as such (the master from the node list).
    """
    family = next((f for f, names in _MPI_FAMILIES.items() if names[0] in env or names[1] in env), None)
    if family is None:
        return None
    rank_key, size_key, local_key, local_size_key = _MPI_FAMILIES[family]
    rank, size = _int(env, rank_key), _int(env, size_key)
    if family != "Open MPI" and env.get("SLURM_PROCID") == env[rank_key] and env.get("SLURM_NTASKS") == env[size_key]:
        return None  # srun's PMI: Slurm's job
    if size < 1 or not 0 <= rank < size:
        raise ConfigError(
            f"{family}'s variables disagree: {rank_key}={rank} {size_key}={size} (a rank is 0 .. size-1 of a job of at least 1); "
            "start the command with mpirun, which sets them, or set both consistently"
        )
    local_rank, local_size = _int(env, local_key, 0), _int(env, local_size_key, 1)
    if local_size < 1 or not 0 <= local_rank < local_size or local_size > size:
        raise ConfigError(
            f"{family}'s variables disagree: {local_key}={local_rank} {local_size_key}={local_size} in a job of {size} ({size_key}); "
            f"the local rank is 0 .. local size-1 and the local size at most {size}; start the command with mpirun, which sets them"
        )
    if size == 1:
        return DistEnv(rank=0, world_size=1, source="none")
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    if missing:
        raise ConfigError(
            f"rank {rank} of {size} started by mpirun ({family}'s {rank_key}/{size_key}), but {' and '.join(missing)} "
            f"{'is' if len(missing) == 1 else 'are'} not set: mpirun does not say where rank 0's rendezvous is. Export MASTER_ADDR "
            f"(rank 0's host) and MASTER_PORT (a free port there) to every rank, e.g. `{_EXPORT[family].format(n=size)}`"
        )
    port = _int(env, "MASTER_PORT")
    if not 1 <= port <= 65535:
        raise ConfigError(f"MASTER_PORT={port} is no port; set it to a free port from 1 to 65535 on rank 0's host (MASTER_ADDR)")
    return DistEnv(
        rank=rank, world_size=size, local_rank=local_rank, local_world_size=local_size, master_addr=env["MASTER_ADDR"], master_port=port, source="mpirun"
    )


_JOINS = (
    *("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK"),  # torch's convention (torchrun's)
    *_LAUNCHED,
    *_PYTORCHJOB,
    *("PET_MASTER_ADDR", "PET_MASTER_PORT"),  # `kubeflow_env`
    *(name for names in _MPI_FAMILIES.values() for name in names),  # `mpi_env`
    *("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NODELIST"),
)
"""Every variable `detect_env` reads to place a process in a job (a test reads detect_env under each launcher and
checks that none it read is missing here)."""
_JOIN_PREFIXES = ("OMPI_COMM_WORLD_", "PMI_")
"""mpirun's per-rank families whole (MPICH's PMI_FD and PMI_PORT would connect a child to mpirun's process manager)."""


def standalone_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """``environ`` (default: this process's) less every variable that would make a child process join this
    process's job (torchrun's, Slurm's task, Kubeflow's PET_*, mpirun's; `_JOINS`): for a command that starts a
    job of its own (``shardwise bench scaling``'s runs, ``shardwise tune hparams``'s trials)."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k not in _JOINS and not k.startswith(_JOIN_PREFIXES)}


def choose_device(accelerator: str, env: DistEnv) -> torch.device:
    """The device this rank computes on: 'auto' takes CUDA when present."""
    if accelerator not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"accelerator must be 'auto', 'cpu' or 'cuda'; got {accelerator!r}")
    if accelerator == "cuda" and not torch.cuda.is_available():
        raise ConfigError("accelerator='cuda' was asked for but torch sees no CUDA device; use accelerator='cpu' or 'auto'")
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    # modulo: under Slurm each task often sees only its own GPU (CUDA_VISIBLE_DEVICES per task)
    index = env.local_rank % max(torch.cuda.device_count(), 1)
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def check_gpus(accelerator: str, local_processes: int) -> None:
    """Refuse to start more processes than this machine has GPUs when they would run on CUDA.

    Each process takes the GPU of its local rank and NCCL joins them; two processes on one GPU
    fail inside NCCL ("Duplicate GPU detected"), from a worker, after the launch. ``launch``
    calls this in the parent, where its workers all see the same devices, so the mistake is
    refused before anything starts. (Under Slurm or torchrun the processes are not ours: a task
    may see only its own GPU, so nothing is checked there.)
    """
    if accelerator == "cpu" or (accelerator == "auto" and not torch.cuda.is_available()):
        return
    count = torch.cuda.device_count()
    if local_processes <= count:
        return
    chosen = "accelerator='cuda'" if accelerator == "cuda" else "accelerator='auto' (CUDA, since torch sees a GPU)"
    raise ConfigError(
        f"nproc={local_processes} processes on this machine, but torch sees {count} CUDA device{'s' if count != 1 else ''} "
        f"and each process needs a GPU of its own ({chosen}; "
        f"NCCL refuses two processes on one GPU). Start at most {count} process{'es' if count != 1 else ''} per machine "
        f"(nproc={count}), or set accelerator='cpu' (--accelerator cpu) to run {local_processes} processes on the CPU with gloo"
    )


def backend_for(device: torch.device) -> str:
    """gloo on CPU, NCCL on CUDA."""
    return "nccl" if device.type == "cuda" else "gloo"


_JOINED = "shardwise/joined"


def all_joined(store: dist.Store, world_size: int) -> None:
    """Return once every rank's ``init_process_group`` has returned (the last to arrive sets the key the others wait
    for, in the launch's store; its timeout is the collective timeout).

    Gloo's full-mesh connect can return on one rank while its peer is still completing its side of their
    connection. A rank that went straight on, ran a function with no collective and exited closed that connection
    under its peer, which then failed to join with "Connection closed by peer" although nothing had failed: the
    zygote tests' recurring failure in full suites (their functions only read the rank)."""
    if store.add(_JOINED, 1) == world_size:
        store.set(_JOINED + "/all", "1")
    store.wait([_JOINED + "/all"])


def connect(env: DistEnv, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S) -> bool:
    """Join the job's default process group; return True if this call created it.

    An existing process group (the user's, or torchrun's script that already
    called init_process_group) is used as it is. A worker of torchrun is tied to its
    agent first: torchrun stops its workers on SIGTERM/SIGHUP, but an agent killed with
    SIGKILL would leave them training alone.
    """
    if "TORCHELASTIC_RUN_ID" in os.environ:
        from shardwise.launcher.lifeline import die_with_parent

        die_with_parent()
    if not env.distributed or (dist.is_initialized()):
        return False
    backend = backend_for(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False, timeout=timeout) if env.source == "spawn" else None
        if store is not None:
            dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size, timeout=timeout)
            all_joined(store, env.world_size)
        elif env.source == "torchrun":
            # torchrun's own convention: env:// reads its variables, including the agent-store
            # sharing flag (TORCHELASTIC_USE_AGENT_STORE).
            dist.init_process_group(backend, init_method="env://", rank=env.rank, world_size=env.world_size, timeout=timeout)
        else:
            dist.init_process_group(
                backend,
                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                rank=env.rank,
                world_size=env.world_size,
                timeout=timeout,
            )
    except Exception as exc:  # pragma: no cover - depends on the network
        raise LaunchError(
            f"rank {env.rank} of {env.world_size} could not join the process group at "
            f"{env.master_addr}:{env.master_port} with {backend} ({exc}); check MASTER_ADDR/MASTER_PORT "
            "and that every rank was started"
        ) from exc
    global _settle_registered
    if not _settle_registered:
        atexit.register(_settle_backend_threads)
        _settle_registered = True
    return True
