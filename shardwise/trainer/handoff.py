"""How ``Trainer.fit`` hands the model to its worker processes, and the trained weights back.

Each worker runs the user's script up to ``fit`` (`shardwise.launcher.worker`), so it has built the
model already: the parent sends a `WorkerModel` instead of the model's bytes, holding a fingerprint
of the parent's model (names, shapes, dtypes, and a hash of the values; shapes only on the meta
device). A worker whose own model has the same fingerprint trains it; one whose model differs (the
script trained or loaded weights the worker did not, or built it from an unseeded generator), or
whose run of the script stopped before (at another launch), loads the parent's model from a file
the parent wrote (``torch.save``, memory-mapped). Where no script is re-run (a notebook,
``python -c``, a call inside ``if __name__ == "__main__":``), the model travels in the payload.

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
from shardwise.launcher.spawn import built_by_script, model_calls, reruns_script
from shardwise.strategies import materialize

RETURN_LIMIT_BYTES = 1 << 30  # 'auto' brings back at most this much when the run writes checkpoints


def fingerprint(model: nn.Module) -> str:
    """The model's class, and names, shapes, dtypes and values of its state (values hashed; meta tensors by shape only)."""
    h = hashlib.blake2b(digest_size=16)
    # the class: same weights in another class (its own training_step) differ; not its module (a script is __mp_main__ in a worker)
    h.update(type(model).__qualname__.encode())
    for name, module in model.named_modules():  # plain settings too: Dropout(p), a scale, a config's flags
        h.update(f"{name}:{type(module).__qualname__}:{_settings(module)}".encode())
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


def _plain(value: Any, depth: int = 0) -> Any:
    """``value`` as plain data when it is (numbers, strings, None, and tuples, lists, dicts of them), else None."""
    if value is None or isinstance(value, (bool, int, float, complex, str)):
        return value
    if depth < 3 and isinstance(value, (tuple, list)):
        items = [_plain(v, depth + 1) for v in value]
        return items if all(i is not None or v is None for i, v in zip(items, value, strict=True)) else None
    if depth < 3 and isinstance(value, dict):
        return {str(k): _plain(v, depth + 1) for k, v in value.items()}
    return None


def _as_dict(value: Any) -> dict[str, Any] | None:
    to_dict = getattr(value, "to_dict", None)
    if isinstance(value, (nn.Module, torch.Tensor)) or not callable(to_dict):
        return None
    try:
        out = to_dict()
    except Exception:  # noqa: BLE001 - an object whose to_dict needs arguments: not a config
        return None
    return out if isinstance(out, dict) else None


def _settings(module: nn.Module) -> str:
    """A module's own plain attributes (``Dropout.p``, ``eps``, a user's ``scale``) and a config's values
    (``to_dict()``, as transformers' configs have): a model that differs only in them is another model."""
    out = []
    for key, value in sorted(vars(module).items()):
        if key.startswith("_") or key == "training":
            continue
        plain = _plain(_as_dict(value)) if _as_dict(value) is not None else _plain(value)
        if plain is not None or value is None:
            out.append(f"{key}={plain!r}")
    return ",".join(out)


def model_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()) if not t.is_meta)


@dataclasses.dataclass(frozen=True)
class WorkerModel:
    """Stands for the model in the workers' payload (see the module docstring)."""

    fingerprint: str
    module_file: str  # the parent's model, pickled, for a worker whose own model differs or that built none
    kind: str  # the parent's model class, for messages
    first: bool = True  # the script's first call with a model: the one a worker's run of the script stops at

    def resolve(self) -> nn.Module:
        own = built_by_script("model") if self.first else None  # a later call: the worker's run stopped at an earlier one
        if isinstance(own, nn.Module) and fingerprint(own) == self.fingerprint:
            return own
        del own  # the script's model is not the one fit was given (trained or loaded since), or it stopped elsewhere
        try:
            model = torch.load(self.module_file, map_location="cpu", mmap=True, weights_only=False)
        except Exception as exc:
            raise LaunchError(f"the worker could not load the {self.kind} fit was given ({type(exc).__name__}: {exc})") from exc
        if not isinstance(model, nn.Module):
            raise LaunchError(f"the worker loaded a {type(model).__name__}, not the {self.kind} fit was given")
        return model


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
    folder = tempfile.TemporaryDirectory(prefix="shardwise-model-")
    path = Path(folder.name) / "model.pt"
    try:
        torch.save(model, path)  # read only by a worker whose own model differs; written tensor by tensor, no copy held
    except Exception:  # noqa: BLE001 - a module plain pickle refuses (a lambda inside): the launcher's payload carries it
        folder.cleanup()
        return model, None
    return WorkerModel(fingerprint(model), str(path), type(model).__name__, first=model_calls() == 1), folder


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
