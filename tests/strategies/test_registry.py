"""The registry speaks only the plan/apply contract: an object that is not a `Strategy` is refused
with the way to write one, and an unknown option names the closest real one."""

from __future__ import annotations

import pytest

import shardwise.strategies as strategies
from shardwise.errors import ConfigError
from shardwise.strategies import Strategy, available, get_strategy, register_strategy


class OldStyle:  # the pre-contract shape: setup() and getattr-probed hooks
    name = "old-style"

    def setup(self, model, make_optimizer, mesh, recorder):  # type: ignore[no-untyped-def]
        raise AssertionError("never called")


def test_an_object_that_is_not_a_strategy_is_refused_with_how_to_write_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(strategies, "_EXTRA", {})  # registered for this test only
    register_strategy("old-style-test", OldStyle)
    with pytest.raises(ConfigError, match=r"must be a shardwise.strategies.Strategy .*plan\(\) and apply\(\).*got OldStyle"):
        get_strategy("old-style-test")
    with pytest.raises(ConfigError, match="got OldStyle"):
        get_strategy(OldStyle())  # type: ignore[arg-type]


def test_every_builtin_strategy_is_on_the_contract() -> None:
    for name in available():
        assert isinstance(get_strategy(name), Strategy), name


def test_an_unknown_option_names_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"strategy 'ddp' has no option 'bucket_cap' \(did you mean 'bucket_cap_mb'\?\)"):
        get_strategy("ddp", bucket_cap=3)
    assert get_strategy("tp", plan={"fc": "colwise"}).tp_plan == {"fc": "colwise"}  # tp's old option name still works


def test_the_package_exports_exactly_its_lazy_names() -> None:
    import shardwise

    assert shardwise.__all__ == sorted(shardwise._EXPORTS)
    for name in shardwise.__all__:
        assert getattr(shardwise, name) is not None, name
    assert shardwise.available_strategies is strategies.available


def test_the_typed_contract_check_names_every_builtin_strategy_and_run() -> None:
    """tests/typecheck_contract.py (checked by mypy in make lint) must keep up with the registry:
    the same strategies, the run class each apply declares, and every concrete Parallel."""
    import inspect

    from shardwise.strategies.contract import Parallel
    from tests.typecheck_contract import BUILTIN, OTHER_RUNS

    assert sorted(BUILTIN) == sorted(strategies._BUILTIN)  # the built-in names (other tests register strategies of their own)
    for name, (cls, run) in BUILTIN.items():
        assert type(get_strategy(name)) is cls, name
        assert cls.apply.__annotations__["return"] == run.__name__, name

    def subclasses(c: type) -> list[type]:
        return [s for d in c.__subclasses__() for s in (d, *subclasses(d))]

    concrete = {c for c in subclasses(Parallel) if c.__module__.startswith("shardwise.") and not inspect.isabstract(c)}
    assert concrete == {run for _, run in BUILTIN.values()} | set(OTHER_RUNS.values())
