"""``shardwise.data.map``: the same results in input order whatever the worker count, a cache hit
on the second call (counted by a file each call of the function writes), and one-line refusals."""

from __future__ import annotations

import functools
import importlib.util
import os
from pathlib import Path

import pytest
import torch

from shardwise.data import map as pmap
from shardwise.data.parallel import function_key
from shardwise.errors import ConfigError


def square_and_tag(item: int, log_dir: str | None = None) -> tuple[int, str]:
    """A result that shows its input (order is checked by value); with ``log_dir``, one file per call."""
    if log_dir is not None:
        Path(log_dir, f"{os.getpid()}-{item}").touch()
    return item * item, f"item-{item}"


def token_ids(text: str) -> torch.Tensor:
    return torch.tensor([ord(c) for c in text], dtype=torch.int64)


def test_the_same_results_in_input_order_for_1_2_and_3_workers(tmp_path: Path) -> None:
    items = list(range(37))[::-1]  # 37: no worker count divides it; descending, so order is not sorting
    expected = [(i * i, f"item-{i}") for i in items]  # the plain list comprehension, by hand
    for workers in (1, 2, 3):
        out = pmap(square_and_tag, items, workers=workers, cache=False, chunk_size=5)
        assert list(out) == expected
        assert out.computed_chunks == 8 and out.cached_chunks == 0  # ceil(37 / 5)


def test_tensor_results_are_identical_across_worker_counts(tmp_path: Path) -> None:
    text = "The quick brown fox jumps over the lazy dog. " * 20
    pieces = [text[i : i + 17] for i in range(0, len(text), 17)]
    one = pmap(token_ids, pieces, workers=1, cache=False)
    two = pmap(token_ids, pieces, workers=2, cache=False)
    three = pmap(token_ids, pieces, workers=3, cache=False)
    assert torch.equal(torch.cat(list(one)), torch.tensor([ord(c) for c in text]))
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(one, two, three, strict=True))


def test_the_second_call_reads_the_cache_and_calls_fn_no_more(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    calls.mkdir()
    fn = functools.partial(square_and_tag, log_dir=str(calls))
    items = list(range(23))
    first = pmap(fn, items, workers=2, cache_dir=tmp_path / "cache")
    assert len(list(calls.iterdir())) == 23 and first.computed_chunks == first.cached_chunks + 23 == 23  # ceil(23 / 64) = 1 item a chunk
    second = pmap(fn, items, workers=3, cache_dir=tmp_path / "cache")  # another worker count: the same keys
    assert list(second) == list(first)
    assert len(list(calls.iterdir())) == 23, "the cached run called fn again"
    assert second.cached_chunks == 23 and second.computed_chunks == 0
    assert second.describe().startswith("23 items: cached")
    # One new item: only its chunk is computed.
    third = pmap(fn, [*items, 99], workers=1, cache_dir=tmp_path / "cache")
    assert len(list(calls.iterdir())) == 24 and third.computed_chunks == 1 and third[-1] == (99 * 99, "item-99")
    # A new version is a new key: everything again.
    pmap(fn, items, workers=1, cache_dir=tmp_path / "cache", version=2)
    assert len(list(calls.iterdir())) == 47


def test_the_key_follows_the_function_and_its_bound_arguments() -> None:
    a = function_key(functools.partial(square_and_tag, log_dir="a"))
    assert a == function_key(functools.partial(square_and_tag, log_dir="a"))
    assert a != function_key(functools.partial(square_and_tag, log_dir="b"))
    assert function_key(token_ids) != function_key(square_and_tag)
    assert function_key(token_ids, version=1) != function_key(token_ids)


def test_a_damaged_cache_file_is_recomputed(tmp_path: Path) -> None:
    pmap(token_ids, ["ab", "cd"], cache_dir=tmp_path)
    for f in (tmp_path / "map").rglob("*.pt"):
        f.write_bytes(b"not a torch file")
    again = pmap(token_ids, ["ab", "cd"], cache_dir=tmp_path)
    assert again.computed_chunks == 2 and [t.tolist() for t in again] == [[97, 98], [99, 100]]


def test_the_default_cache_is_in_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    out = pmap(token_ids, ["x"])
    assert out.cache_dir == Path(".shardwise-cache") and list((tmp_path / ".shardwise-cache").rglob("*.pt"))


@pytest.mark.parametrize("workers", [1, 2])
def test_a_lambda_or_a_nested_function_is_refused_in_one_line(workers: int) -> None:
    def nested(x: int) -> int:
        return x

    for fn in (lambda x: x, nested):
        with pytest.raises(ConfigError, match="picklable function") as err:
            pmap(fn, [1, 2], workers=workers, cache=False)
        assert "\n" not in str(err.value)


def test_bad_arguments_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="workers must be a whole number >= 1; got 0"):
        pmap(token_ids, ["a"], workers=0)
    with pytest.raises(ConfigError, match="backend must be"):
        pmap(token_ids, ["a"], backend="dask")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="single str"):
        pmap(token_ids, "abc")
    with pytest.raises(ConfigError, match="cache=False"):
        pmap(object.__new__, [object], cache_dir=tmp_path)  # an object the cache cannot keep safely


def test_the_ray_backend_gives_the_same_results_on_a_local_ray_instance(tmp_path: Path) -> None:
    # a test extra (dev installs ray[train]): missing, this fails rather than skips, so CI cannot pass without testing it
    assert importlib.util.find_spec("ray") is not None, "the ray extra is missing: pip install -e '.[dev]' (or '.[ray]')"
    items = list(range(11))
    out = pmap(square_and_tag, items, workers=2, backend="ray", cache_dir=tmp_path, chunk_size=3)
    assert list(out) == [(i * i, f"item-{i}") for i in items] and out.computed_chunks == 4
    # The processes backend reads what Ray wrote: the key does not depend on the backend.
    assert pmap(square_and_tag, items, workers=1, cache_dir=tmp_path, chunk_size=3).cached_chunks == 4


def test_without_ray_the_ray_backend_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_ray(name: str, *args: object, **kwargs: object) -> object:
        if name == "ray":
            raise ImportError("No module named 'ray'")
        return real_import(name, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(builtins, "__import__", no_ray)
    with pytest.raises(ConfigError, match=r"pip install 'shardwise\[ray\]'"):
        pmap(token_ids, ["a"], backend="ray", cache=False)
