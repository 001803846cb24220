"""The config machine (`shardwise.config`): a dataclass's fields become argparse flags, TOML keys and help."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Literal

import pytest

from shardwise import config
from shardwise.config import REQUIRED, add_arguments, flag, from_mapping, given, settings_of
from shardwise.errors import ConfigError

GROUP = ("where it runs", "Settings of the place the demo runs in.")


@dataclass(frozen=True, kw_only=True)
class Demo:
    """A settings class with every kind of field the commands use."""

    source: str = flag(help="what to read", positional=True)
    count: int = flag(3)
    """How many times (a docstring is the help when the flag gives none)."""
    rate: float | None = flag(None, "the rate, 100% or less")
    mode: Literal["fast", "slow"] = "fast"
    """How to go about it."""
    verbose: bool = flag(False, "say more")
    sizes: list[int] | None = flag(None, "sizes to try", nargs="+")
    batch: int | None = flag(None, "samples per step", names=("--batch", "--batch-size"))
    target: str = flag(help="where the output goes", required=True)
    set: list[str] = flag(help="one override (repeatable)", action="append", metavar="KEY=VALUE", default_factory=list)
    device: str = flag("cpu", "the device", choices=("cpu", "cuda"), group=GROUP)
    hidden: int = field(default=7, metadata={"shown": False})


def parser(cls: type = Demo, **kwargs: object) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="demo")
    add_arguments(p, cls, **kwargs)  # type: ignore[arg-type]
    return p


def actions(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in p._actions if a.dest != "help"}


def test_each_field_kind_gives_the_expected_flag():
    a = actions(parser())
    assert list(a) == ["source", "count", "rate", "mode", "verbose", "sizes", "batch", "target", "set", "device", "hidden"]
    assert a["source"].option_strings == [] and a["source"].help == "what to read"
    assert (a["count"].option_strings, a["count"].type, a["count"].default) == (["--count"], int, 3)
    assert a["count"].help == "How many times (a docstring is the help when the flag gives none)."
    assert (a["rate"].type, a["rate"].default, a["rate"].help) == (float, None, "the rate, 100%% or less")  # argparse %-formats help
    assert (a["mode"].choices, a["mode"].type, a["mode"].default) == (["fast", "slow"], None, "fast")
    assert isinstance(a["verbose"], argparse._StoreTrueAction) and a["verbose"].default is False
    assert (a["sizes"].nargs, a["sizes"].type) == ("+", int)
    assert a["batch"].option_strings == ["--batch", "--batch-size"] and a["batch"].type is int
    assert a["target"].required and a["target"].default is None
    assert isinstance(a["set"], argparse._AppendAction) and a["set"].metavar == "KEY=VALUE" and a["set"].default == []
    assert a["device"].choices == ["cpu", "cuda"]
    assert (a["hidden"].option_strings, a["hidden"].type, a["hidden"].help) == (["--hidden"], int, None)  # a plain field: a flag, no help
    p = parser()
    assert next(g for g in p._action_groups if g.title == GROUP[0])._group_actions == [a_ for a_ in p._actions if a_.dest == "device"]
    assert "100% or less" in p.format_help()


def test_parsed_values_have_the_fields_types_and_build_the_class():
    args = parser().parse_args(
        ["in.txt", "--count", "5", "--rate", "0.5", "--mode", "slow", "--verbose", "--sizes", "1", "2"]
        + ["--batch-size", "8", "--target", "out", "--set", "a=1", "--set", "b=2", "--device", "cuda"]
    )
    built = Demo(**vars(args))
    assert built == Demo(source="in.txt", count=5, rate=0.5, mode="slow", verbose=True, sizes=[1, 2], batch=8, target="out", set=["a=1", "b=2"], device="cuda")
    defaults = Demo(**vars(parser().parse_args(["in.txt", "--target", "out"])))
    assert defaults == Demo(source="in.txt", target="out")


def test_a_bad_value_on_the_command_line_is_one_line_naming_the_flag(capsys):
    for argv, said in (
        (["x", "--target", "o", "--count", "many"], "demo: error: argument --count: invalid int value: 'many'"),
        (["x", "--target", "o", "--mode", "quick"], "demo: error: argument --mode: invalid choice: 'quick' (choose from"),
        (["x"], "demo: error: the following arguments are required: --target"),
    ):
        with pytest.raises(SystemExit) as exc:
            parser().parse_args(argv)
        assert exc.value.code == 2
        last = capsys.readouterr().err.strip().splitlines()[-1]
        assert last.startswith(said), last


def test_unset_flags_default_to_none_and_given_reads_only_what_was_given():
    p = parser(unset=True)
    assert {d: a.default for d, a in actions(p).items() if d != "source"} == dict.fromkeys(
        ["count", "rate", "mode", "verbose", "sizes", "batch", "target", "set", "device", "hidden"]
    )
    assert given(Demo, p.parse_args(["x", "--target", "o", "--count", "4"])) == {"source": "x", "target": "o", "count": 4}


def test_marked_only_and_only_choose_the_fields():
    assert "hidden" not in actions(parser(marked_only=True))
    assert list(actions(parser(only=("count", "device")))) == ["count", "device"]


def test_settings_are_the_toml_keys_with_type_default_and_help():
    s = {x.name: x for x in settings_of(Demo)}
    assert list(s) == [f.name for f in dataclasses.fields(Demo)]
    assert (s["count"].default, s["count"].help, s["count"].flag) == (3, "How many times (a docstring is the help when the flag gives none).", "--count")
    assert s["source"].default is REQUIRED and s["set"].default == []
    assert s["mode"].choices == ("fast", "slow") and s["verbose"].switch and config.type_name(s["rate"].type) == "float | None"


def test_toml_values_are_converted_and_a_bad_one_is_one_clear_line():
    built = from_mapping(Demo, {"source": "in", "target": "out", "count": "4", "rate": "none", "sizes": "1, 2", "verbose": "yes"}, "demo")
    assert (built.count, built.rate, built.sizes, built.verbose) == (4, None, [1, 2], True)
    with pytest.raises(ConfigError) as bad:
        from_mapping(Demo, {"source": "in", "target": "out", "count": "many"}, "demo")
    assert str(bad.value) == "[demo] count (--count) must be a whole number; got 'many'"
    with pytest.raises(ConfigError, match=r"^\[demo\] mode \(--mode\) must be one of: fast, slow; got 'slwo' \(did you mean 'slow'\?\)$"):
        from_mapping(Demo, {"source": "in", "target": "out", "mode": "slwo"}, "demo")
    with pytest.raises(ConfigError, match=r"^unknown \[demo\] keys: cuont \(did you mean count\?\); known: batch, count, "):
        from_mapping(Demo, {"source": "in", "target": "out", "cuont": 4}, "demo")
    with pytest.raises(ConfigError, match=r"must be a whole number; got True"):  # True is not a count
        from_mapping(Demo, {"source": "in", "target": "out", "count": True}, "demo")


def test_the_trainer_settings_flags_toml_keys_and_help_come_from_trainer_config():
    from shardwise.trainer.config import TrainerConfig, add_flags, flag_values

    p = argparse.ArgumentParser()
    add_flags(p)
    docs = config.field_docs(TrainerConfig)
    flagged = {f.name for f in dataclasses.fields(TrainerConfig) if "cli" in f.metadata}
    a = actions(p)
    assert set(a) == flagged and {"max_steps", "nproc", "loggers", "drop_last", "on_nonfinite"} <= flagged
    for name in flagged - {"drop_last"}:  # --keep-last-batch is drop_last=False: its own help
        assert a[name].help == docs[name].replace("``", "").replace("%", "%%"), name
        assert a[name].default is None  # not given: the TOML value stands
    assert a["loggers"].option_strings == ["--logger"] and a["max_steps"].type is int and a["accelerator"].choices == ["auto", "cpu", "cuda"]
    args = p.parse_args(["--max-steps", "5", "--logger", "csv", "--keep-last-batch", "--on-nonfinite", "skip"])
    assert flag_values(args) == {"max_steps": 5, "loggers": "csv"}
    assert args.set == ["trainer.drop_last=false", "trainer.on_nonfinite=skip"]  # these go the way of --set, in order
    assert TrainerConfig(**flag_values(args)).loggers == ("csv",)
