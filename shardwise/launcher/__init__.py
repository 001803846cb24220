"""Starting processes and joining them: local spawn, torchrun, or an external launcher.

Design notes: Processes
=======================

- **Local spawn** (`shardwise.launch`, and `Trainer.fit` with `nproc > 1` outside a launcher):
  the parent serves a `TCPStore` on a port the OS picks (no port races between concurrent
  launches), children join it with `init_process_group(store=...)`. Each child runs
  `shardwise.launcher.worker`, not multiprocessing's spawn: it runs the
  user's script as `__mp_main__` (aliased `__main__`, so pickles of `__main__.X` resolve) the
  way spawn does, but `launch` and `Trainer.fit` first call `stop_if_bootstrapping()`, which
  stops that import at the script's own call. So a script needs no `if __name__ ==
  "__main__":` guard (with one, the guarded block is skipped as usual); the code above the
  call runs once per worker, nothing below it does. Multiprocessing's spawn instead re-ran the
  unguarded call in the child, which died while bootstrapping and left the parent blocked
  forever. `fn` and its arguments are pickled **by value** with plain `pickle` in the parent
  (`launcher.payload`): multiprocessing's own pickler carries torch's reducers, which would put
  every tensor in shared memory, and then every rank steps the same parameters (this bug was
  found by the DDP parity test). What plain pickle refuses (a lambda, a closure, a function a
  library defines inside another, such as the hook transformers' `gradient_checkpointing_enable()`
  registers) and, where there is no script for a worker to run (`python -m pkg`, `python -c`,
  notebooks, REPLs), whatever `__main__` defines, goes again through cloudpickle: by value, except
  what has an importable name. A lambda of the user's script reads the worker's `__main__` globals
  (as a `def` there would), the parent's filling in only names the worker lacks. What neither can
  send is a `LaunchError` naming its path in the arguments (`trainer.loss_fn.<closure>.lock`,
  `model.layers.0._forward_hooks[3]`) and a fix for its kind. Payload, results and errors travel through files in a temporary directory, never
  pipes, so a large result cannot block a child on a pipe the parent is not reading. Each child
  gets `threads_per_proc` intra-op threads (cores / nproc by default).
- **Zygote** (`launcher.zygote`, the default `start_method="forkserver"` on Linux, ranks on the
  CPU; CUDA ranks start fresh until forking them is checked on a GPU; a process's first launch
  with a core per rank starts fresh interpreters too, which import torch side by side and start
  sooner than a zygote importing it alone; `spawn._zygote`): each child is
  a fork of one process per launcher that imported torch, `torch._dynamo` (which torch imports at
  the first optimizer) and the trainer once, and stays for the launcher's later launches. A fresh
  interpreter pays about 3 CPU-seconds for those imports per rank and launch. The zygote runs no
  tensor operation, no CUDA and no thread (checked; otherwise fresh interpreters), so a fork is
  safe; each child gets the launch's stdin/stdout/stderr (passed over a Unix socket), environment,
  working directory and argv, the signal dispositions a fresh interpreter would have, and reseeded
  torch and numpy generators. The zygote ignores SIGINT/SIGTERM/SIGHUP/SIGUSR1/2 (a preemption
  notice to the process group is for the ranks) and ends when its launcher does (its socket
  closes, or its parent changes); its children die with it. `start_method="spawn"` starts fresh
  `python -m shardwise.launcher.worker` interpreters.
- **Failures.** The parent polls its children; the first failure stops the rest at once
  (SIGTERM, SIGKILL after 5 s) and is raised in the parent as the worker's own exception (its
  type unchanged, so `pytest.raises(ConfigError)` holds), raised from `launch` itself and caused
  by a `RemoteTraceback` holding a short report: the first rank to fail (ranks with the same
  error share the line), the exception, the user's frame (the deepest frame outside shardwise,
  torch, the standard library and site-packages), one line naming ranks that failed later with
  another error (usually a peer that lost it in a collective), and the paths of the full
  tracebacks: `out/errors/rank-N.txt` under `Trainer(out=...)`, a new temporary directory
  otherwise (`error_dir=` of `launch`). `timeout` stops a hang and names the ranks still running.
- **Workers die with their leader** (`launcher.lifeline`): SIGKILL of the parent, and SIGTERM
  or SIGHUP (whose default action skips every `finally`), would otherwise leave workers training
  alone. Each spawned worker sets `prctl(PR_SET_PDEATHSIG, SIGKILL)` first thing, tied to its
  parent (the launcher, or the zygote, which follows the launcher) (Linux; the
  parent's pid is checked right after, in case it died already) and starts a thread that exits
  the process when `os.getppid()` changes (every platform, twice a second). Workers stay in the
  parent's process group, so a signal to the group (Ctrl-C in a terminal) reaches them too.
  Under torchrun (`TORCHELASTIC_RUN_ID` set), `connect` ties the worker to torchrun's agent the
  same way: the agent stops its workers itself on SIGTERM/SIGHUP, but not when it is SIGKILLed.
  Tested for each signal and each path (`shardwise train`, `Trainer(nproc=2)` in a script,
  `launch`, `shardwise run`): nothing of the run is alive 10 s after the leader dies.
- **torchrun** (`shardwise run`): torch's own launcher through its own argument parser, with
  three defaults changed: `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` (restarts on a shared store
  fail about half the time on gloo), `--standalone` on one machine, `last_call_timeout=2` for
  `--nnodes MIN:MAX` (30 s by default, paid on every rendezvous).
- **External launcher**: when RANK/WORLD_SIZE (torchrun, Ray) or SLURM_PROCID/SLURM_NTASKS are
  set, nothing is spawned: the `Engine` joins with `init_process_group`. A process group that
  already exists is used as it is (`DistEnv.source == "existing"`). `launch(fn, nproc=N)` then
  joins the job, runs `fn` in this process and returns `[this rank's result]`; `Trainer.fit`
  trains in this process. An `nproc` (`launch`, or `Trainer` with `nproc > 1`) other than the
  job's world size is a `ConfigError`. So one script runs under `python script.py` (it spawns)
  and `shardwise run --nproc-per-node N script.py` (it joins) with `fn` run exactly N times.
"""

from shardwise.launcher.env import DistEnv, backend_for, choose_device, connect, detect_env
from shardwise.launcher.spawn import RemoteTraceback, launch

__all__ = ["DistEnv", "RemoteTraceback", "backend_for", "choose_device", "connect", "detect_env", "launch"]
