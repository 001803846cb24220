"""Hygiene for every test (after Lightning's): a test that leaks environment variables,
a process group, or child processes fails."""

from __future__ import annotations

import functools
import os
import signal
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

# One thread per process: the suite runs several processes on two cores.
torch.set_num_threads(1)


# Set by pytest itself, and by torch on first use of its compiler stack (optimizers import it).
# The two KMP_ ones: set on first import by some builds of scikit-learn's OpenMP runtime (seen on a GPU machine's image).
_SET_BY_OTHERS = {"PYTEST_CURRENT_TEST", "TORCHINDUCTOR_CACHE_DIR", "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR", "KMP_DUPLICATE_LIB_OK", "KMP_INIT_AT_FORK"}


def _children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            cmd = (stat.parent / "cmdline").read_bytes()
            # multiprocessing's resource tracker and shardwise's zygote (the process launch forks its
            # ranks from) live as long as the interpreter, by design.
            if b"resource_tracker" not in cmd and b"forkserver" not in cmd and b"shardwise.launcher.zygote" not in cmd:
                out.add(int(stat.parent.name))
    return out


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1)


@pytest.fixture(autouse=True)
def hygiene(request):
    env_before = dict(os.environ)
    children_before = _children() if Path("/proc").exists() else set()
    main = threading.current_thread() is threading.main_thread()
    handlers = {sig: signal.getsignal(sig) for sig in _SIGNALS} if main else {}
    deterministic = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    yield
    # A test that leaves torch's deterministic mode on (an in-process run with deterministic=True) makes a
    # later test of the same worker fail on an op without a deterministic kernel (int8 quantized linear did):
    # put it back, and name the test.
    if (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()) != deterministic:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        warnings.warn(f"{request.node.nodeid} left torch.use_deterministic_algorithms changed (put back)", stacklevel=1)
    # A test that leaves a signal's handler changed (twice, in full runs, SIGINT was ignored in a worker that later ran the
    # Ctrl-C and zygote tests, which pass alone): put it back, and say which test it was (pytest's warnings summary).
    changed_signals = [sig.name for sig, h in handlers.items() if signal.getsignal(sig) is not h]
    for sig, h in handlers.items():
        if signal.getsignal(sig) is not h and h is not None:
            signal.signal(sig, h)
    if changed_signals:
        warnings.warn(f"{request.node.nodeid} left the handlers of {changed_signals} changed (put back)", stacklevel=1)
    leaked_group = dist.is_available() and dist.is_initialized()
    if leaked_group:
        dist.destroy_process_group()
    env_after = dict(os.environ)
    changed = {k for k in set(env_before) | set(env_after) if env_before.get(k) != env_after.get(k) and k not in _SET_BY_OTHERS}
    os.environ.clear()
    os.environ.update(env_before)
    leaked_children = (_children() - children_before) if Path("/proc").exists() else set()
    assert not leaked_group, "the test left a process group initialized"
    assert not changed, f"the test changed environment variables: {sorted(changed)}"
    assert not leaked_children, f"the test left child processes running: {sorted(leaked_children)}"


@pytest.fixture(autouse=True, scope="session")
def _one_step_timing_per_model() -> Any:
    """The planner's step timing (`shardwise.tools.advisor.models.time_steps`: each size timed for seconds, at each
    thread count) done once per model, sizes, threads and loss/optimizer in a test process, then reused: digits' took
    13 CPU-s a call and the advisor's tests plan digits alike five times. Bypassed while a test replaces what it runs
    (`time_step`, `timed_fit`, the clock) or changes how it times (the ``TIMED_*`` constants)."""
    from shardwise.tools.advisor import models, validate

    original, parts = models.time_steps, (models.time_step, validate.timed_fit, models._now)
    settings = ("TIMED_STEPS", "TIMED_TARGET_S", "TIMED_MAX_STEPS", "TIMED_RUNS", "TIMED_BUDGET_S")
    cache: dict[tuple[Any, ...], Any] = {}

    def shape(obj: Any) -> tuple[Any, ...]:
        if isinstance(obj, torch.nn.Module):
            return (type(obj).__qualname__, *((n, tuple(p.shape)) for n, p in obj.named_parameters()))
        if callable(obj):
            return (getattr(obj, "__module__", None), getattr(obj, "__qualname__", type(obj).__qualname__))
        first = obj[0] if hasattr(obj, "__getitem__") and hasattr(obj, "__len__") and len(obj) else None
        item = first if isinstance(first, tuple | list) else (first,)
        return (type(obj).__qualname__, len(obj) if hasattr(obj, "__len__") else None, *(tuple(getattr(t, "shape", ())) for t in item))

    def cached(model: Any, data: Any, loss_fn: Any, make_optimizer: Any, sizes: Any, threads: Any = (1,), best: bool = False) -> Any:
        if (models.time_step, validate.timed_fit, models._now) != parts:
            return original(model, data, loss_fn, make_optimizer, sizes, threads, best)
        try:
            key = (shape(model), shape(data), shape(loss_fn), shape(make_optimizer), tuple(sizes), tuple(sorted(set(threads))), best)
        except Exception:  # a data set whose first item or length cannot be read cheaply: not cached
            return original(model, data, loss_fn, make_optimizer, sizes, threads, best)
        key += tuple(getattr(models, name) for name in settings)
        if key not in cache:
            cache[key] = original(model, data, loss_fn, make_optimizer, sizes, threads, best)
        return list(cache[key])

    models.time_steps = cached
    yield
    models.time_steps = original


# Every multi-process test (marked ``dist``) has a hard timeout so a hang fails instead of stalling
# CI; shardwise.launch also stops all workers as soon as one fails.
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("dist") is not None and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(180))
    if hasattr(config, "workerinput"):  # an xdist worker (whose own --dist reads "no")
        _longest_first(items)


# -- How `make test` (pytest -n 3 --dist loadfile) shares the tests out among its worker processes --
#
# xdist's loadfile hands each worker whole files, most tests first, and tops a worker up while it
# still has two tests queued. The suite's time is in a few long units (README blocks of minutes
# each, multi-machine and preemption runs), so: each README block is a unit of its own (they share
# nothing), units go out longest first (an estimate, below), and a worker gets its next unit only
# when it has one test left, so no long unit waits queued behind another while a worker idles.
# The tests that start a local Ray instance go last, as one unit: Ray's processes slow down ~10x
# when other work holds the two cores (the README's Ray Train block: 33 s alone, 312 s beside two
# busy loops; 180-470 s in full runs), and at the end the other workers are finishing short units.
# What runs, and in which process a module's tests run together, is unchanged.

_BLOCK_FILES = ("tests/readme/test_readme.py", "tests/readme/test_readme_shell.py")
_SECONDS_BY_MARK = {"e2e": 15.0, "dist": 6.0}
"""A test's estimated seconds in a full run by its mark (anything else: 0.3 s)."""
_LONGER = {
    "tests/launcher/test_multinode.py": 300.0,
    "tests/launcher/test_launch_paths.py": 200.0,
    "tests/launcher/test_preempt_cli.py": 180.0,
    "tests/integrations/test_orchestrators.py": 160.0,  # with the Flyte retry test (issue 39, 45 s of it, machine shared)
    "tests/launcher/test_zygote.py": 130.0,
    "tests/launcher/test_faults.py": 110.0,
    "tests/readme/test_readme_claims.py": 100.0,
    "tests/tools/test_bench_scaling.py": 50.0,  # runs the README's bench scaling block (RUN_ELSEWHERE)
}
"""Files that take much longer than their marks say (seconds in full runs, from --durations).
Only the order of the units reads these: a file that moved counts by its marks."""
_README_BLOCKS = {
    "for strategy, options in": 130.0,
    'with torch.device("meta")': 80.0,
    "compress distill": 80.0,
    "load_digits": 60.0,
    "shardwise predict": 50.0,
    "shardwise plot": 45.0,
    "--nproc 4": 40.0,
    "launch(main": 35.0,
    "EarlyStopping": 35.0,
    "--validate": 35.0,
    "bench comm": 30.0,
    "tune hparams": 30.0,
}
"""README blocks by a piece of their text (their line numbers move): estimated seconds, the
longest that matches (a block that matches none counts as an e2e test)."""


_RAY = ("tests/integrations/test_ray_train.py", "tests/data/test_data_map.py::test_the_ray_backend_gives_the_same_results_on_a_local_ray_instance")
"""The tests that start a local Ray instance, besides the README's Ray Train block (found by its text)."""


@functools.cache
def _ray_blocks() -> frozenset[str]:
    from tests.readme.test_readme import CASES

    return frozenset(f"line{line}-{'with-guard' if guard else 'as-written'}" for line, code, guard in CASES if "import ray" in code)


def _unit(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    if path in _RAY or nodeid in _RAY or (path == _BLOCK_FILES[0] and nodeid.endswith("]") and nodeid.rsplit("[", 1)[1][:-1] in _ray_blocks()):
        return "ray"
    return nodeid if path in _BLOCK_FILES else path


def _estimate(item: pytest.Item) -> float:
    code = getattr(item, "callspec", None) and item.callspec.params.get("code")
    if isinstance(code, str) and item.nodeid.split("::", 1)[0] in _BLOCK_FILES:
        return max([s for k, s in _README_BLOCKS.items() if k in code], default=_SECONDS_BY_MARK["e2e"])
    return max((s for m, s in _SECONDS_BY_MARK.items() if item.get_closest_marker(m) is not None), default=0.3)


def _longest_first(items: list[pytest.Item]) -> None:
    """The units longest first (every worker sorts alike, as xdist requires; the tests of a unit
    keep their order)."""
    cost: dict[str, float] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        unit = _unit(item.nodeid)
        cost[unit] = cost.get(unit, 0.0) + _estimate(item)
        first.setdefault(unit, i)
    for unit in cost:
        cost[unit] = -1.0 if unit == "ray" else max(cost[unit], _LONGER.get(unit, 0.0))
    order = {i: (-cost[_unit(item.nodeid)], first[_unit(item.nodeid)], i) for i, item in enumerate(items)}
    items[:] = [items[i] for i in sorted(order, key=order.__getitem__)]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LongestFirst(LoadFileScheduling):
        def __init__(self, config: pytest.Config, log: Any = None) -> None:
            config.option.loadscopereorder = False  # keep the workers' order: longest first
            super().__init__(config, log)

        def _split_scope(self, nodeid: str) -> str:
            return _unit(nodeid)

        def _reschedule(self, node: Any) -> None:
            # A worker runs a test once it knows the next one (xdist's worker loop), so one queued test is enough.
            if not node.shutting_down and self.workqueue and self._pending_of(self.assigned_work[node]) > 1:
                return
            super()._reschedule(node)

    return LongestFirst(config, log)
