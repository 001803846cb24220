"""`TextShards`: JSON lines and Parquet text through a tokenizer function equal tokenizing by hand;
the token cache is reused (constructing again calls the tokenizer on the probe alone), rebuilt for
an edited source or another tokenizer; refusals name the fix."""

from __future__ import annotations

import gzip
import json
import sys

import numpy as np
import pytest

from shardwise.data import TextShards, TokenShards
from shardwise.errors import ConfigError

SEP = 0


def tok(text: str) -> list[int]:
    return [ord(c) % 61 + 3 for c in text]


class Counting:
    def __init__(self, fn=tok) -> None:
        self.fn, self.calls = fn, 0

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return self.fn(text)


DOCS = [["the cat sat", "on a mat", ""], ["lorem ipsum dolor sit amet", "x"], ["parquet rows", "are read", "in batches"]]


def _write(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.jsonl").write_text("".join(json.dumps({"text": t, "id": i}) + "\n" for i, t in enumerate(DOCS[0])) + "\n")
    with gzip.open(src / "b.jsonl.gz", "wt") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in DOCS[1])
    return src


def _by_hand(docs: list[str]) -> list[int]:
    return [t for d in docs if d for t in [*tok(d), SEP]]


def test_jsonl_and_parquet_equal_tokenizing_by_hand_and_the_cache_is_reused(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    pa = pytest.importorskip("pyarrow")
    src = _write(tmp_path)
    pq.write_table(pa.table({"text": DOCS[2]}), src / "c.parquet")
    counting = Counting()
    data = TextShards(src, counting, 5, sep=SEP, cache_dir=tmp_path / "cache")
    assert data.tokenized == 3 and [f.rsplit("/", 1)[1].split("-")[0] for f in data.files] == ["a", "b", "c"]
    for f, docs in zip(data.files, DOCS, strict=True):
        assert np.load(f).tolist() == _by_hand(docs)
    flat = [_by_hand(d) for d in DOCS]
    expected = [s[j * 5 : j * 5 + 6] for s in flat for j in range((len(s) - 1) // 5)]
    assert len(data) == len(expected) and all(data[i][0].tolist() == e[:-1] and data[i][1].tolist() == e[1:] for i, e in enumerate(expected))

    again = Counting()
    cached = TextShards(src, again, 5, sep=SEP, cache_dir=tmp_path / "cache")
    assert cached.tokenized == 0 and again.calls == 1 + 3 and cached.files == data.files  # the probe and each file's first document alone
    with open(src / "a.jsonl", "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    edited = TextShards(src, tok, 5, sep=SEP, cache_dir=tmp_path / "cache")
    assert edited.tokenized == 1 and np.load(edited.files[0]).tolist() == _by_hand([*DOCS[0], "one more"])
    other = TextShards(src, lambda t: [ord(c) % 50 + 1 for c in t], 5, sep=SEP, cache_dir=tmp_path / "cache")
    assert other.tokenized == 3
    assert isinstance(other, TokenShards) and "3 source files" in repr(other)


def test_a_glob_picks_files_and_refusals_name_the_fix(tmp_path, monkeypatch):
    src = _write(tmp_path)
    data = TextShards(str(src / "*.jsonl"), tok, 4, sep=SEP, cache_dir=tmp_path / "cache")
    assert len(data.sources) == 1 and data.sources[0].endswith("a.jsonl")
    with pytest.raises(ConfigError, match="has no 'body' field.*text_key="):
        TextShards(src / "a.jsonl", tok, 4, sep=SEP, text_key="body", cache_dir=tmp_path / "cache")
    (src / "notes.txt").write_text("hi")
    with pytest.raises(ConfigError, match="neither JSON lines"):
        TextShards([src / "notes.txt"], tok, 4, sep=SEP, cache_dir=tmp_path / "cache")
    (src / "d.parquet").write_bytes(b"")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if pyarrow were not installed
    with pytest.raises(ConfigError, match=r"needs pyarrow.*pip install 'shardwise\[datasets\]'"):
        TextShards(src / "d.parquet", tok, 4, sep=SEP, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob(".*tmp"))  # the failed files left nothing half-written


def test_a_tokenizer_that_changes_only_long_documents_gets_a_new_cache_and_bad_outputs_are_named(tmp_path):
    """A truncating tokenizer agrees with the plain one on the short probe text; the key also holds each file's
    first document's ids (and ``tokenizer_id``), so it is tokenized anew, not served the plain one's cache."""
    long_doc = "word " * 80  # 400 characters
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": long_doc}) + "\n" + json.dumps({"text": "short"}) + "\n")
    cache = tmp_path / "cache"
    plain = TextShards(tmp_path / "a.jsonl", tok, 8, sep=0, cache_dir=cache)
    cut = TextShards(tmp_path / "a.jsonl", lambda t: tok(t)[:200], 8, sep=0, cache_dir=cache)  # the probe is shorter: same ids
    assert cut.tokenized == 1 and cut.tokens < plain.tokens
    named = TextShards(tmp_path / "a.jsonl", tok, 8, sep=0, cache_dir=cache, tokenizer_id="plain v2")
    assert named.tokenized == 1 and named.tokens == plain.tokens
    with pytest.raises(ConfigError, match=r"tokenize returned a mapping with keys \['attention_mask', 'input_ids'\].*tok\(t\)\[\"input_ids\"\]"):
        TextShards(tmp_path / "a.jsonl", lambda t: {"input_ids": tok(t), "attention_mask": [1]}, 8, sep=0, cache_dir=cache)
    with pytest.raises(ConfigError, match=r"tokenize returned text .* not token ids"):
        TextShards(tmp_path / "a.jsonl", lambda t: t.split(), 8, sep=0, cache_dir=cache)
    with pytest.raises(ConfigError, match=r"negative id \(-1\)"):
        TextShards(tmp_path / "a.jsonl", lambda t: [-1, *tok(t)], 8, sep=0, cache_dir=cache)
