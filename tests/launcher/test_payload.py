"""What launch sends to its workers (shardwise.launcher.payload): plain pickle where it works, lambdas and
closures by value, a script's lambdas living in the worker's __main__, and what cannot be pickled named by
its path in the arguments, with a fix for its kind. In this process: no worker is started."""

from __future__ import annotations

import pickle
import threading
import types
from typing import Any

import pytest
import torch
from torch import nn

from shardwise import Trainer
from shardwise.errors import LaunchError
from shardwise.launcher import payload
from shardwise.trainer.loop import _fit_worker


def _module_level(x: int) -> int:
    return x + 1


def _train(model: nn.Module) -> None:
    pass


def _roundtrip(fn: Any, *args: Any, main_spec: tuple[str, str] | None = ("path", "/nowhere.py"), **kwargs: Any) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    loaded: tuple[Any, tuple[Any, ...], dict[str, Any]] = pickle.loads(payload.dumps(fn, args, kwargs, main_spec))
    return loaded


def test_what_plain_pickle_sends_is_sent_unchanged():
    model = nn.Linear(2, 1)
    sent = payload.dumps(_module_level, (model,), {}, None)
    assert sent == pickle.dumps((_module_level, (model,), {}), protocol=pickle.HIGHEST_PROTOCOL)


def test_lambdas_closures_and_partials_of_them_cross_by_value():
    scale = 3.0

    def loss(output: torch.Tensor, batch: Any) -> torch.Tensor:  # a closure over scale
        return scale * output.sum()

    fn, (opt, loss_back, collate), _ = _roundtrip(_module_level, lambda p: torch.optim.SGD(p, lr=0.1), loss, lambda s: torch.stack(s))
    assert fn is _module_level  # still by reference: only what plain pickle refused went by value
    assert isinstance(opt([nn.Parameter(torch.ones(1))]), torch.optim.SGD)
    assert loss_back(torch.ones(2), None).item() == 6.0
    assert collate([torch.ones(1), torch.zeros(1)]).tolist() == [[1.0], [0.0]]


def _make_locked_loss() -> Any:
    lock = threading.Lock()

    def loss(output: torch.Tensor, batch: Any) -> torch.Tensor:
        with lock:
            return output.sum()

    return loss


def test_a_lock_in_the_loss_closure_is_named_by_its_path_with_a_fix():
    trainer = Trainer(strategy="ddp", nproc=2, loss_fn=_make_locked_loss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.raises(LaunchError) as info:
        payload.dumps(_fit_worker, (trainer, nn.Linear(2, 1), [torch.ones(2)], None), {}, None)
    message = str(info.value)
    assert "could not send trainer.loss_fn.<closure>.lock to the worker processes: it is a _thread.lock" in message
    assert "create it in each worker" in message


def test_an_open_file_held_by_a_hook_deep_in_the_model_is_named_with_the_hook():
    model = nn.Sequential(nn.Linear(2, 2), nn.Sequential(nn.ReLU(), nn.Linear(2, 1)))
    model[1][0].register_forward_hook(lambda m, i, o: None)  # picklable by value: not the culprit
    with open(__file__) as f:  # noqa: PTH123
        handle = model[1][1].register_forward_hook(lambda m, i, o: f.read(0) and None)
        with pytest.raises(LaunchError) as info:
            payload.dumps(_train, (model,), {}, None)
    message = str(info.value)
    # the hook's key in the module's dict (its handle's id, which counts every hook this process registered)
    assert f"could not send model.1.1._forward_hooks[{handle.id}].<closure>.f " in message, message
    assert "it is a _io.TextIOWrapper" in message
    assert "open it inside the function" in message and "hook registered on model.1.1 (_forward_hooks)" in message and "handle.remove()" in message


def test_transformers_gradient_checkpointing_hook_crosses():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(cfg)
    with pytest.warns(FutureWarning):
        model.gradient_checkpointing_enable()
    hooks = model.transformer.wte._forward_hooks
    assert hooks  # the local function enable_input_require_grads registers, which plain pickle refuses:
    with pytest.raises(AttributeError, match="local object.*make_inputs_require_grads"):
        pickle.dumps(model)
    _, (back,), _ = _roundtrip(_module_level, model)
    assert [h.__name__ for h in back.transformer.wte._forward_hooks.values()] == ["make_inputs_require_grads"]
    assert back.transformer.h[0].gradient_checkpointing and back.transformer.h[0]._gradient_checkpointing_func is not None


def test_a_scripts_lambda_reads_the_workers_globals_and_brings_those_the_worker_lacks(monkeypatch):
    # The parent's __main__ (a script) defines a lambda reading two globals; the worker's __main__ (the
    # same script, run up to the call) has its own value of one of them (an object each worker opens for
    # itself, e.g. a file) and lacks the other (set under `if __name__ == "__main__":`).
    parent = types.ModuleType("__main__")
    parent.__file__ = "/nowhere/script.py"
    exec("HANDLE = object()\nLR = 0.5\nfn = lambda: (HANDLE, LR)", vars(parent))  # noqa: S102
    parent.HANDLE = threading.Lock()  # unpicklable: the worker must use its own
    monkeypatch.setitem(__import__("sys").modules, "__main__", parent)
    sent = payload.dumps(_module_level, (parent.fn,), {}, ("path", "/nowhere/script.py"))
    worker = types.ModuleType("__main__")
    worker.HANDLE = "the worker's own"
    monkeypatch.setitem(__import__("sys").modules, "__main__", worker)
    _, (fn,), _ = pickle.loads(sent)
    assert fn() == ("the worker's own", 0.5)
    assert fn.__globals__ is vars(worker) and worker.LR == 0.5
    assert fn.__code__.co_filename == "<string>"  # the code's own file name, not cloudpickle's "<dynamic-code>"
