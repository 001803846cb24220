"""A torchx component: ``shardwise train`` as a torchx job, on torchx's ``dist.ddp`` conventions.

torchx describes a job as an ``AppDef``: roles, each a command run on ``num_replicas`` hosts.
``dist.ddp`` (torchx's built-in for data-parallel training) makes one role whose command is
torchrun, ``-j NNODESxNPROC`` processes, a c10d rendezvous on the first host. `train` is that
role with ``python -m shardwise train ARGS`` as the program, so every torchx scheduler
(local_cwd, local_docker, kubernetes, slurm, ...) runs shardwise the way it runs any torchrun
job; each worker joins as torchrun's rank (``shardwise.launcher.env.detect_env``).

From Python, with torchx's runner (the local scheduler runs in the current directory)::

    from torchx.runner import get_runner
    from shardwise.integrations.torchx import train

    app = train("--recipe", "digits", "--strategy", "ddp", "--out", "runs/digits", j="1x2")
    with get_runner() as runner:
        handle = runner.run(app, scheduler="local_cwd")
        print(runner.wait(handle, wait_interval=1).state)  # SUCCEEDED

From the ``torchx`` command, which takes a custom component as ``FILE:FUNCTION``::

    torchx run -s local_cwd "$(python -c 'import shardwise.integrations.torchx as m; print(m.__file__)')":train \\
        -j 1x2 --recipe digits --strategy ddp --out runs/digits

The role's command is ``bash -c "torchrun ..."``, as in ``dist.ddp``: the image (or, for the
local schedulers, the PATH) must hold torchrun and shardwise. torchrun's workers share its
rendezvous store unless TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which this component sets (as
``shardwise run`` does: a restart on a shared store fails about half the time on gloo); pass
``env`` to change it. Needs torchx: ``pip install 'shardwise[torchx]'``.

This module keeps torchx's own annotation style (``typing.Optional``/``Dict``/``List``, no
postponed annotations): torchx builds the component's command-line flags from the annotations
at run time and checks them by reading the source.
"""

from typing import Dict, List, Optional  # noqa: UP035 - torchx reads these names from the source

from shardwise.errors import ConfigError

try:
    import torchx.specs as specs
    from torchx.components import dist
except ImportError:  # pragma: no cover - depends on the installation
    raise ConfigError("the torchx component needs torchx, which is not installed: pip install 'shardwise[torchx]'") from None

__all__ = ["train"]

_ENV_DEFAULTS = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def train(
    *train_args: str,
    j: str = "1x2",
    image: str = "shardwise",
    name: str = "/",
    h: Optional[str] = None,  # noqa: UP045 - torchx reads this annotation from the source
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 1024,  # noqa: N803 - torchx's flag name
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    max_retries: int = 0,
    rdzv_port: int = 29500,
    mounts: Optional[List[str]] = None,  # noqa: UP006, UP045
) -> specs.AppDef:
    """``shardwise train`` on ``NNODES x NPROC`` torchrun processes (torchx's dist.ddp with shardwise as the program).

    Args:
        train_args: arguments of ``shardwise train`` (e.g. --recipe digits --strategy ddp --out runs/x)
        j: {nnodes}x{nproc_per_node}, or {min_nnodes}:{nnodes}x{nproc_per_node} for an elastic job
        image: container image with shardwise installed (the local schedulers ignore it)
        name: job name, as dist.ddp takes it: {experimentname}/{runname}, {experimentname}/, /{runname} or {runname}
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        cpu: number of cpus per replica
        gpu: number of gpus per replica
        memMB: cpu memory in MB per replica
        env: environment variables of the run (e.g. ENV1=v1,ENV2=v2)
        max_retries: the number of scheduler retries allowed
        rdzv_port: the port on the first host for the rendezvous store (multi-node only)
        mounts: mounts for container schedulers (type=<bind/volume>,src=/host,dst=/job[,readonly])
    """
    return dist.ddp(
        "train",
        *train_args,
        m="shardwise",
        image=image,
        name=name,
        h=h,
        cpu=cpu,
        gpu=gpu,
        memMB=memMB,
        j=j,
        env={**_ENV_DEFAULTS, **(env or {})},
        max_retries=max_retries,
        rdzv_port=rdzv_port,
        mounts=mounts,
    )
