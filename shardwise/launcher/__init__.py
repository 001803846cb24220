"""Starting processes and joining them: local spawn, torchrun, or an external launcher."""

from shardwise.launcher.env import DistEnv, backend_for, choose_device, connect, detect_env
from shardwise.launcher.spawn import RemoteTraceback, launch

__all__ = ["DistEnv", "RemoteTraceback", "backend_for", "choose_device", "connect", "detect_env", "launch"]
