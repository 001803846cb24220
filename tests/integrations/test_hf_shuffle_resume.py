"""A Hugging Face stream shuffled with a buffer resumes exactly under the default ``resume="auto"``: its
``state_dict`` keeps the position but not the buffer (a resume by it loses the buffered samples), so
`StreamLoader` replays it, and says why in the run's first lines. An unshuffled stream resumes by its state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwise.data.stream import StreamLoader, state_loses_samples
from shardwise.trainer.streams import notes

datasets = pytest.importorskip("datasets", reason="needs the datasets extra: pip install 'shardwise[datasets]'")


def _stream(tmp: Path, shuffle: bool):  # type: ignore[no-untyped-def]
    for k in range(3):
        (tmp / f"part-{k}.jsonl").write_text("".join(json.dumps({"id": 10 * k + i}) + "\n" for i in range(10)))
    ds = datasets.load_dataset("json", data_files=sorted(str(p) for p in tmp.glob("*.jsonl")), split="train", streaming=True)
    return (ds.shuffle(seed=3, buffer_size=8) if shuffle else ds).with_format("torch")


def _ids(loader: StreamLoader, steps: int) -> list[list[int]]:
    out, it = [], iter(loader)
    for _ in range(steps):
        out.append([int(i) for micro in next(it) for i in micro["id"]])
    return out


@pytest.mark.parametrize("shuffle", [False, True])
def test_auto_resumes_exactly_replaying_a_shuffle_buffer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shuffle: bool) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    whole = _ids(StreamLoader(_stream(tmp_path, shuffle), global_batch=4), 6)
    first = StreamLoader(_stream(tmp_path, shuffle), global_batch=4)
    assert _ids(first, 2) == whole[:2]
    state = first.state_dict()
    again = StreamLoader(_stream(tmp_path, shuffle), global_batch=4)
    again.load_state_dict(state)
    assert _ids(again, 4) == whole[2:], "a resumed shuffled stream must see the samples of the uninterrupted run"
    assert state_loses_samples(again.source) is shuffle
    assert again.uses_state is not shuffle
    said = " ".join(notes(again))
    assert ("shuffle buffer is not in its state_dict" in said) is shuffle and ("loads" in said) is not shuffle
    assert sorted(i for step in whole for i in step) == sorted(set(i for step in whole for i in step)), "a sample seen twice"
