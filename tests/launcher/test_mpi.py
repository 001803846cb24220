"""Jobs started by ``mpirun``, as its processes see them: two processes started by this test with
the variables Open MPI (OMPI_COMM_WORLD_*) or MPICH / Intel MPI (PMI_*, MPI_LOCALRANKID) set on
each rank, and MASTER_ADDR/MASTER_PORT as ``mpirun -x`` / ``-genv`` export them; no MPI is
installed or used (shardwise's ranks meet over torch's TCP store, as under Slurm). The detection
itself, and every environment it refuses, is in test_env.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "support" / "scripts"
_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SHARDWISE_LAUNCHER", "TORCHELASTIC_RUN_ID")
_FOREIGN = ("PET_", "SLURM_", "OMPI_", "PMI_", "MPI_LOCAL")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_env(rank_vars: dict[str, str], port: int | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS and not k.startswith(_FOREIGN)}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **rank_vars)
    if port is not None:
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def _openmpi(rank: int) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}


def _hydra(rank: int) -> dict[str, str]:
    return {"PMI_RANK": str(rank), "PMI_SIZE": "2", "MPI_LOCALRANKID": str(rank), "MPI_LOCALNRANKS": "2"}


def _mpirun(args: list[str], family, cwd: Path, port: int | None = None, **extra: str) -> list[tuple[int, str, str]]:
    """Start ``python ARGS`` as rank 0 and rank 1 of a 2-process mpirun job; each one's exit code, stdout, stderr."""
    port = _free_port() if port is None else port
    procs = [
        subprocess.Popen([sys.executable, *args], cwd=cwd, env=_rank_env(family(r), port) | extra, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        outputs = [p.communicate(timeout=240) for p in procs]
        return [(p.returncode, o, e) for p, (o, e) in zip(procs, outputs, strict=True)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def test_two_shardwise_train_processes_started_with_openmpis_variables_train_one_job(tmp_path):
    out = tmp_path / "run"
    steps = 6
    ranks = _mpirun(["-m", "shardwise", "train", "--recipe", "digits", "--strategy", "ddp", "--max-steps", str(steps), "--out", str(out)], _openmpi, tmp_path)
    for rank, (code, _, stderr) in enumerate(ranks):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    (_, out0, _), (_, out1, _) = ranks
    # one job of 2: rank 0 announces it once, rank 1 trains silently, nothing was spawned (2 processes in all)
    assert out0.count("shardwise: 2 processes, backend gloo") == 1 and "shardwise: 2 processes" not in out1, (out0[-2000:], out1[-2000:])
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["world_size"], summary["steps"], summary["strategy"]) == (2, steps, "ddp")
    assert [r["role"] for r in summary["memory"]["ranks"]] == ["dp0", "dp1"]  # both ranks ran the fit and reported
    assert summary["comm"]["by_op"]["dp/all_reduce"]["count"] == steps  # their gradients met every step


def test_launch_in_processes_started_with_mpichs_variables_joins_their_job(tmp_path):
    count = tmp_path / "count"
    ranks = _mpirun([str(SCRIPTS / "unguarded_launch.py")], _hydra, tmp_path, COUNT_FILE=str(count))
    for rank, (code, _, stderr) in enumerate(ranks):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    # `launch(main, nproc=2)` ran main once in each mpirun process (2 runs, not 2 x 2), each its own rank of 2
    assert sorted(count.read_text().split()) == ["0", "1"]
    assert "results [(0, 2, 3.0)]" in ranks[0][1] and "results [(1, 2, 3.0)]" in ranks[1][1], (ranks[0][1], ranks[1][1])


def test_mpirun_without_master_addr_and_port_is_one_line_naming_them(tmp_path, monkeypatch, capsys):
    """``shardwise train`` as rank 1 of an Open MPI job whose mpirun exported no MASTER_* (run here, through the
    command's own ``main``: no second torch import)."""
    from shardwise.cli import main

    for key in [*_LAUNCH_VARS, *(k for k in os.environ if k.startswith(_FOREIGN))]:
        monkeypatch.delenv(key, raising=False)
    for key, value in _openmpi(1).items():
        monkeypatch.setenv(key, value)
    code = main(["train", "--recipe", "digits", "--max-steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err, err[-3000:]
    (line,) = err.strip().splitlines()
    assert line.startswith("shardwise: error: rank 1 of 2 started by mpirun") and "MASTER_ADDR and MASTER_PORT are not set" in line
    assert "`mpirun -np 2 -x MASTER_ADDR=HOST -x MASTER_PORT=29500 shardwise train ...`" in line
    assert not (tmp_path / "run").exists()  # refused before anything was written
