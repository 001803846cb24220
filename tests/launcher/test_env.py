"""Reading the job's layout from torchrun's, Slurm's, Kubeflow's and mpirun's environment variables."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env, first_slurm_host, standalone_env
from shardwise.launcher.torchrun import prepare


def test_no_launcher_is_one_plain_process():
    env = detect_env({})
    assert (env.rank, env.world_size, env.distributed) == (0, 1, False)


def test_torchrun_variables():
    env = detect_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node7", "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (3, 8, 1, "node7", 1234, "torchrun")
    with pytest.raises(ConfigError, match="RANK='x' is not an integer"):
        detect_env({"RANK": "x", "WORLD_SIZE": "2"})


def test_slurm_variables_and_node_lists():
    env = detect_env({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_JOB_NODELIST": "gpu[003-004,010]", "SLURM_JOB_ID": "4242"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.source) == (5, 8, 1, "gpu003", "slurm")
    assert env.master_port == 15000 + 4242
    assert first_slurm_host("cpu01,cpu02") == "cpu01"
    assert detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"}).distributed is False  # an interactive allocation


def test_torchrun_defaults_that_work():
    environ: dict[str, str] = {}
    args = prepare(["--nproc-per-node", "2", "train.py", "--lr", "3"], environ)
    assert args.standalone and environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    assert args.training_script == "train.py" and args.training_script_args == ["--lr", "3"]
    elastic = prepare(["--nnodes", "1:2", "--rdzv-endpoint", "host:29400", "train.py"], {})
    assert elastic.rdzv_backend == "c10d" and elastic.rdzv_conf == "last_call_timeout=2"  # the README's "a 2 s last_call_timeout", not the module's constant
    assert not elastic.standalone
    flags = ["--nnodes", "1:2", "--rdzv-endpoint", "host:29400", "--rdzv-conf", "last_call_timeout=9"]
    mine = prepare([*flags, "train.py"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert mine.rdzv_conf == "last_call_timeout=9"


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--nnodes", "x"], "--nnodes takes a node count N or an elastic range MIN:MAX"),
        (["--nnodes", "2:1"], "got '2:1'"),
        (["--nnodes", "0:2"], "got '0:2'"),
        (["--nnodes", "1:2:3"], "got '1:2:3'"),
        # several machines on a dynamic rendezvous, no endpoint: each node would wait alone on its localhost
        (["--nnodes", "2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "1:2"], "--nnodes 1:2 with --rdzv-backend c10d needs --rdzv-endpoint"),
        (["--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:abc"], "a port from 1 to 65535; got 'head:abc'"),
    ],
)
def test_torchrun_flags_that_cannot_work_across_machines_are_refused(flags, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        prepare([*flags, "train.py"], {})


def test_torchrun_multinode_flags_pass_through():
    args = prepare(["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29400", "t.py"], {})
    assert (args.nnodes, args.rdzv_backend, args.rdzv_endpoint, args.standalone) == ("2", "c10d", "head:29400", False)
    static = prepare(["--nnodes", "2", "--node-rank", "1", "--master-addr", "head", "--master-port", "29500", "t.py"], {})
    assert static.rdzv_backend == "static" and not static.standalone  # the static backend takes --master-addr, no endpoint


# -- Kubeflow PyTorchJob: the variables the training operator v1 sets on each pod ------------------
def _pod(index: int, pods: int, nproc: int | None = None, **extra: str) -> dict[str, str]:
    """A pod's environment as the operator writes it (envvar.go, master.go): the master is pod 0,
    worker i is pod i + 1; WORLD_SIZE is pods x nprocPerNode; PET_NNODES the number of pods."""
    env = {
        "MASTER_ADDR": "job-master-0",
        "PET_MASTER_ADDR": "job-master-0",
        "MASTER_PORT": "23456",
        "PET_MASTER_PORT": "23456",
        "WORLD_SIZE": str(pods * (nproc or 1)),
        "RANK": str(index),
        "PET_NODE_RANK": str(index),
        "PET_NNODES": str(pods),
        "PYTHONUNBUFFERED": "1",
    }
    if nproc is not None:
        env["PET_NPROC_PER_NODE"] = str(nproc)
    env.update(extra)
    return env


def test_a_pytorchjob_pod_with_one_process_is_one_rank():
    for index in range(3):
        env = detect_env(_pod(index, 3))
        assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port, env.source) == (index, 3, 0, "job-master-0", 23456, "kubeflow")
    assert detect_env(_pod(1, 2, nproc=1)).rank == 1
    # Only the PET_ variables: the master's address and port are read from them.
    pet_only = {k: v for k, v in _pod(1, 2).items() if k.startswith("PET_")}
    assert (detect_env(pet_only).rank, detect_env(pet_only).world_size, detect_env(pet_only).master_addr) == (1, 2, "job-master-0")


def test_a_pytorchjob_pod_under_torchrun_or_spawn_is_the_launchers_rank():
    # torchrun (the pod's command) sets each worker's own RANK/WORLD_SIZE/LOCAL_RANK over the pod's.
    worker = _pod(1, 2, nproc=2, RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", TORCHELASTIC_RUN_ID="job")
    env = detect_env(worker)
    assert (env.rank, env.world_size, env.local_rank, env.source) == (3, 4, 1, "torchrun")
    spawned = _pod(0, 1, nproc=2, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", SHARDWISE_LAUNCHER="spawn")
    assert (detect_env(spawned).rank, detect_env(spawned).source) == (1, "spawn")


def test_a_one_pod_job_starts_its_own_processes():
    # One pod with nprocPerNode 2 is one machine: nothing to join, `--nproc 2` starts the processes.
    assert detect_env(_pod(0, 1, nproc=2)).distributed is False
    assert detect_env(_pod(0, 1)).distributed is False


@pytest.mark.parametrize(
    "env,message",
    [
        (_pod(1, 2, nproc=2), "2 pods x 2 processes: each pod's processes are numbered by torchrun"),
        (_pod(0, 2, PET_NNODES="1:4"), "elastic (PET_NNODES=1:4)"),
        (_pod(0, 2, nproc=1, PET_NPROC_PER_NODE="auto"), "PET_NPROC_PER_NODE='auto'"),
        (_pod(0, 2, WORLD_SIZE="3"), "WORLD_SIZE=3 but PET_NNODES x PET_NPROC_PER_NODE = 2 x 1"),
        (_pod(2, 2), "PET_NODE_RANK=2 is outside the job's 2 pods"),
    ],
)
def test_a_pytorchjob_that_shardwise_cannot_number_is_one_clear_line(env, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        detect_env(env)


# -- mpirun: the variables Open MPI and MPICH / Intel MPI (Hydra) set on each process they start -----------
_MASTER = {"MASTER_ADDR": "node1", "MASTER_PORT": "29511"}


def _openmpi(rank: int, size: int, per_node: int, **extra: str) -> dict[str, str]:
    """What Open MPI's mpirun sets on rank ``rank`` of ``size``, ``per_node`` ranks per machine (plus the user's -x)."""
    env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(size), "OMPI_COMM_WORLD_LOCAL_RANK": str(rank % per_node)}
    env.update(OMPI_COMM_WORLD_LOCAL_SIZE=str(per_node), OMPI_COMM_WORLD_NODE_RANK=str(rank // per_node), OMPI_UNIVERSE_SIZE=str(size))
    return env | extra


def _hydra(rank: int, size: int, per_node: int, **extra: str) -> dict[str, str]:
    """What MPICH's and Intel MPI's Hydra (mpiexec / mpirun) set on rank ``rank`` of ``size`` (plus the user's -genv)."""
    env = {"PMI_RANK": str(rank), "PMI_SIZE": str(size), "MPI_LOCALRANKID": str(rank % per_node), "MPI_LOCALNRANKS": str(per_node), "PMI_FD": "7"}
    return env | extra


@pytest.mark.parametrize("family", [_openmpi, _hydra], ids=["openmpi", "mpich"])
def test_mpirun_variables_are_each_process_place(family):
    for rank in range(4):  # 2 machines x 2 processes
        env = detect_env(family(rank, 4, 2, **_MASTER))
        assert (env.rank, env.world_size, env.local_rank, env.local_world_size, env.source) == (rank, 4, rank % 2, 2, "mpirun")
        assert (env.master_addr, env.master_port, env.distributed) == ("node1", 29511, True)
    # a job of one process is a plain one (`mpirun -np 1 shardwise train --nproc 2` starts its own 2): nothing to rendezvous
    assert detect_env(family(0, 1, 1)).distributed is False
    # a process shardwise or torchrun started inside the mpirun job is that launcher's rank
    spawned = detect_env(family(0, 1, 1, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1", SHARDWISE_LAUNCHER="spawn"))
    assert (spawned.rank, spawned.world_size, spawned.source) == (1, 2, "spawn")


def test_mpirun_inside_a_slurm_allocation_is_mpiruns_job_and_sruns_pmi_is_slurms():
    # mpirun's ranks inherit the SLURM_* of mpirun's own step (one task): the MPI variables say where each rank is
    allocation = {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_JOB_NODELIST": "gpu[01-02]", "SLURM_JOB_ID": "7"}
    for family in (_openmpi, _hydra):
        env = detect_env(family(3, 4, 2, **_MASTER) | allocation)
        assert (env.rank, env.world_size, env.source) == (3, 4, "mpirun")
    # `srun --mpi=pmi2` sets PMI_RANK/PMI_SIZE equal to Slurm's own: Slurm's job, its master from the node list, no MASTER_* needed
    env = detect_env(_hydra(1, 2, 1) | allocation | {"SLURM_PROCID": "1"})
    assert (env.rank, env.world_size, env.master_addr, env.source) == (1, 2, "gpu01", "slurm")


@pytest.mark.parametrize(
    ("environ", "says"),
    [
        # mpirun does not set MASTER_ADDR/MASTER_PORT: the error names them and how to export them with this family's mpirun
        (_openmpi(1, 2, 2), "MASTER_ADDR and MASTER_PORT are not set: mpirun does not say where rank 0's rendezvous is"),
        (_openmpi(1, 2, 2, MASTER_ADDR="h"), "-x MASTER_ADDR=HOST -x MASTER_PORT=29500 shardwise train"),
        (_hydra(0, 2, 1, MASTER_PORT="29500"), "MASTER_ADDR is not set"),
        (_hydra(0, 2, 1), "-genv MASTER_ADDR HOST -genv MASTER_PORT 29500 shardwise train"),
        (_openmpi(0, 2, 2, MASTER_ADDR="h", MASTER_PORT="70000"), "MASTER_PORT=70000 is no port"),
        (_openmpi(0, 2, 2, MASTER_ADDR="h", MASTER_PORT="x"), "MASTER_PORT='x' is not an integer"),
        # an environment no mpirun writes
        (_openmpi(2, 2, 2, **_MASTER), "OMPI_COMM_WORLD_RANK=2 OMPI_COMM_WORLD_SIZE=2"),
        (_hydra(0, 0, 1, **_MASTER), "PMI_RANK=0 PMI_SIZE=0"),
        (_hydra(0, 1, 1, PMI_RANK="-1"), "PMI_RANK=-1 PMI_SIZE=1"),
        (_openmpi(3, 4, 2, OMPI_COMM_WORLD_LOCAL_RANK="2", **_MASTER), "OMPI_COMM_WORLD_LOCAL_RANK=2 OMPI_COMM_WORLD_LOCAL_SIZE=2 in a job of 4"),
        (_hydra(1, 2, 4, **_MASTER), "MPI_LOCALRANKID=1 MPI_LOCALNRANKS=4 in a job of 2"),
        ({"OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE is not set"),
        ({"PMI_RANK": "one", "PMI_SIZE": "2"}, "PMI_RANK='one' is not an integer"),
    ],
)
def test_an_mpirun_environment_that_cannot_work_is_one_clear_line(environ, says):
    with pytest.raises(ConfigError, match=re.escape(says)):
        detect_env(environ)


class _GPUs:
    """torch.cuda as a machine with ``count`` GPUs would answer (for the parent-side check only)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, count: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("accelerator", ["cuda", "auto"])
def test_more_processes_than_gpus_is_refused_before_launch(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, accelerator: str) -> None:
    from shardwise import Trainer

    _GPUs(monkeypatch, 1)
    trainer = Trainer(strategy="ddp", nproc=2, max_steps=1, accelerator=accelerator, out=str(tmp_path / "run"), loss_fn=lambda out, b: out.sum())
    expected = (
        r"nproc=2 processes on this machine, but torch sees 1 CUDA device and each process needs a GPU of its own .*"
        r"Start at most 1 process per machine \(nproc=1\), or set accelerator='cpu'"
    )
    with pytest.raises(ConfigError, match=expected):
        trainer.fit(torch.nn.Linear(2, 2), torch.utils.data.TensorDataset(torch.randn(8, 2), torch.randn(8, 2)))
    assert not (tmp_path / "run").exists()  # refused before anything was written or started


def test_processes_within_the_gpus_or_on_the_cpu_pass_the_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.launcher.env import check_gpus

    _GPUs(monkeypatch, 2)
    check_gpus("cuda", 2)
    check_gpus("auto", 1)
    check_gpus("cpu", 8)  # gloo on the CPU: any number
    with pytest.raises(ConfigError, match="nproc=3 processes on this machine, but torch sees 2 CUDA devices"):
        check_gpus("auto", 3)
    _GPUs(monkeypatch, 0)
    check_gpus("auto", 4)  # no GPU: 'auto' is the CPU


class _Reads(dict[str, str]):
    """An environment that records every name looked up in it."""

    def __init__(self, env: dict[str, str]) -> None:
        super().__init__(env)
        self.read: set[str] = set()

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def __getitem__(self, key: str) -> str:
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        self.read.add(key)
        return super().get(key, default)


_JOBS = {
    "torchrun": {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "h",
        "MASTER_PORT": "2940",
        "TORCHELASTIC_RUN_ID": "x",
    },
    "slurm": {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "2", "SLURM_JOB_ID": "7", "SLURM_NODELIST": "n[1-2]"},
    "kubeflow": {"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_NPROC_PER_NODE": "1", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "23456"},
    "open mpi": {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": "1", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"},
    "mpich": {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "5"},
}


@pytest.mark.parametrize("launcher", sorted(_JOBS))
def test_standalone_env_removes_every_variable_detect_env_reads_to_join_a_job(launcher: str) -> None:
    # Every name detect_env looks up under this launcher (set or not) is dropped, so a command's own child
    # (bench scaling's runs, tune's trials) is one plain process; other variables pass through.
    extra = {"MASTER_ADDR": "h", "MASTER_PORT": "29400"} if launcher in ("open mpi", "mpich") else {}
    env = _Reads({**_JOBS[launcher], **extra, "PATH": "/bin", "OMP_NUM_THREADS": "3"})
    assert detect_env(env).distributed
    child = standalone_env({k: "v" for k in env.read} | {"PATH": "/bin", "OMP_NUM_THREADS": "3", **_JOBS[launcher]})
    assert child == {"PATH": "/bin", "OMP_NUM_THREADS": "3"}, f"{launcher}: left {sorted(set(child) - {'PATH', 'OMP_NUM_THREADS'})}"
    assert detect_env(standalone_env(env)) == detect_env({})


def test_bench_scaling_and_tune_pass_on_the_standalone_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from shardwise.tools.tune.target import Target

    for name, value in {**_JOBS["slurm"], **_JOBS["kubeflow"], "RANK": "1", "PMI_FD": "5"}.items():
        monkeypatch.setenv(name, value)
    trial = Target(recipe="digits", own={}, dims={}).env(threads=1)
    assert not {"SLURM_PROCID", "SLURM_NTASKS", "PET_NNODES", "PET_NODE_RANK", "RANK", "PMI_FD"} & set(trial)
    import argparse
    import subprocess

    from shardwise.tools.bench import scaling

    seen: dict[str, str] = {}

    def run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.update(kw["env"])  # type: ignore[arg-type]
        return subprocess.CompletedProcess(cmd, 1, "", "stopped here")

    monkeypatch.setattr(scaling.subprocess, "run", run)
    args = argparse.Namespace(max_steps=5, log_every=1, threads=None, timeout=5.0, recipe="digits")
    assert scaling.run_one(args, scaling.Config("ddp", 2, 8), Path("unused")) == {"error": "stopped here"}
    assert seen and not {"SLURM_PROCID", "SLURM_NTASKS", "PET_NNODES", "PET_NODE_RANK", "RANK", "PMI_FD"} & set(seen)
