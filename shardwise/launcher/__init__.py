"""Starting processes and joining them: local spawn, torchrun, or an external launcher.

The only reader of the environment (`env.py`: `detect_env`, `connect`); `spawn.py` is
`shardwise.launch`, `worker.py` a spawned rank, `zygote.py` the fork server, `lifeline.py` ties
workers to their leader, `torchrun.py` is `shardwise run`. Design notes (how a script runs once
per worker without a main guard, the zygote, failures, workers dying with their leader, torchrun's
changed defaults, joining an external launcher): docs/launcher.md.
"""

from shardwise.launcher.env import DistEnv, backend_for, choose_device, connect, detect_env
from shardwise.launcher.spawn import RemoteTraceback, launch

__all__ = ["DistEnv", "RemoteTraceback", "backend_for", "choose_device", "connect", "detect_env", "launch"]
