"""Reading the job's layout from torchrun's and Slurm's environment variables."""

from __future__ import annotations

import pytest

from shardwise.errors import ConfigError
from shardwise.launcher.env import detect_env, first_slurm_host
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
    mine = prepare(["--nnodes", "1:2", "--rdzv-conf", "last_call_timeout=9", "train.py"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"})
    assert mine.rdzv_conf == "last_call_timeout=9"
