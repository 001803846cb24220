"""How ``Trainer.fit`` hands the model to its worker processes, and the trained weights back.

Each worker runs the user's script up to ``fit`` (`shardwise.launcher.worker`), so it has built the
model already: the parent sends a `WorkerModel` instead of the model's bytes, holding a fingerprint
of the parent's model (names, shapes, dtypes, and a hash of the values; shapes only on the meta
device). A worker whose own model has the same fingerprint trains it; one whose model differs (the
script trained or loaded weights the worker did not, or built it from an unseeded generator) loads
the parent's weights from a file the parent wrote, memory-mapped. Where no script is re-run (a
notebook, ``python -c``), the model travels pickled as before.

The trained weights come back only when `return_weights` says so: a model built on the meta device
has them in ``out/checkpoints`` only (the launching process never holds the whole model), as does a
model over 1 GiB whose run writes checkpoints, unless ``return_weights="always"``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardwise.errors import ConfigError, LaunchError
from shardwise.launcher.spawn import built_by_script, reruns_script
from shardwise.strategies import materialize

RETURN_LIMIT_BYTES = 1 << 30  # 'auto' brings back at most this much when the run writes checkpoints


def fingerprint(model: nn.Module) -> str:
    """Names, shapes, dtypes and values of the model's state (values hashed; meta tensors by shape only)."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in model.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}:{t.is_meta}".encode())
        if not t.is_meta and t.numel():
            data = t.detach()
            if hasattr(data, "full_tensor"):  # a DTensor: not expected in a model before fit
                data = data.full_tensor()
            flat = data.cpu().contiguous().view(torch.uint8).reshape(-1)
            for i in range(0, flat.numel(), 1 << 24):  # 16 MB at a time: no second copy of a large model
                h.update(flat[i : i + (1 << 24)].numpy().tobytes())
    return h.hexdigest()


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta)


@dataclasses.dataclass(frozen=True)
class WorkerModel:
    """Stands for the model in the workers' payload (see the module docstring)."""

    fingerprint: str
    state_file: str | None  # the parent's weights, for a worker whose own model differs
    kind: str  # the parent's model class, for messages

    def resolve(self) -> nn.Module:
        own = built_by_script("model")
        if not isinstance(own, nn.Module):
            raise LaunchError(
                f"the worker's run of the script reached fit without a model (got {type(own).__name__}): the {self.kind} "
                "passed to fit must be built above the call, at the top level of the script"
            )
        if fingerprint(own) == self.fingerprint:
            return own
        if self.state_file is None:
            raise ConfigError(
                f"the {type(own).__name__} this worker built by running the script up to fit is not the one fit was given "
                f"({self.kind} on the meta device: names or shapes differ). Build the model the same way on every run of the "
                "script (no branch on the process or on randomness before fit)"
            )
        state = torch.load(self.state_file, map_location="cpu", mmap=True, weights_only=True)
        if materialize.has_meta(own):
            own.load_state_dict(state, assign=True)
        else:
            own.load_state_dict(state)
        return own


def for_workers(model: nn.Module, lightning: bool) -> tuple[Any, tempfile.TemporaryDirectory[str] | None]:
    """What the payload carries for ``model``: a `WorkerModel` where the workers re-run the script, else
    the model itself. The second value is the directory of the parent's weights, removed after the run."""
    if lightning or not reruns_script() or called_under_main_guard():
        return model, None  # the workers will not reach this call (no script, or inside `if __name__ == "__main__":`)
    if materialize.has_meta(model):
        if not all(t.is_meta for t in model.parameters()):
            raise ConfigError(
                f"{type(model).__name__} has some parameters on the meta device and some not: build all of them on the "
                "meta device (with torch.device('meta') or shardwise.meta_init()) or none"
            )
        return WorkerModel(fingerprint(model), None, type(model).__name__), None
    folder = tempfile.TemporaryDirectory(prefix="shardwise-weights-")
    path = Path(folder.name) / "model.pt"
    torch.save(model.state_dict(), path)  # read only by a worker whose own model differs
    return WorkerModel(fingerprint(model), str(path), type(model).__name__), folder


def called_under_main_guard() -> bool:
    """True when this call runs inside the script's ``if __name__ == "__main__":`` block (directly or through a
    function called there): a worker's run of the script skips that block, so it builds no model to train."""
    import ast
    import sys

    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__"):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is None:
        return False
    path = frame.f_globals.get("__file__")
    try:
        with open(str(path), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, TypeError, ValueError):
        return False
    line = frame.f_lineno
    for node in tree.body:
        if isinstance(node, ast.If) and "__name__" in ast.unparse(node.test) and "__main__" in ast.unparse(node.test):
            if node.lineno <= line <= (node.end_lineno or node.lineno):
                return True
    return False


def returns_weights(setting: str, model: nn.Module, writes_checkpoints: bool) -> bool:
    """Whether the workers send the trained weights back to ``fit``'s caller (`TrainerConfig.return_weights`)."""
    if setting == "always":
        return True
    if setting == "never":
        return False
    if materialize.has_meta(model):
        return False
    return not (writes_checkpoints and model_bytes(model) > RETURN_LIMIT_BYTES)
