"""``shardwise preprocess``: charlm's tokenization through ``shardwise.data.map`` equals the recipe's
own ``vocab.encode(text)`` at 1 and 2 workers (checked inside `run`), and the last run is cached."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwise.errors import ConfigError
from shardwise.tools.preprocess import encode_piece, parse_workers, run


def test_charlm_tokenization_is_the_recipes_at_1_and_2_workers_and_then_cached(tmp_path: Path) -> None:
    rows = run("charlm", [1, 2], cache_dir=str(tmp_path))
    assert [(r["workers"], r["cache"]) for r in rows] == [(1, False), (2, False), (2, True), (2, True)]
    # one chunk per 8,192-character piece of the text (57 for this machine's Python's 465,047 characters;
    # another Python's help topics have another length)
    from shardwise.tools.recipes.charlm import python_docs_text

    pieces = -(-len(python_docs_text()) // 8192)
    assert rows[2]["computed_chunks"] == pieces and rows[3]["cached_chunks"] == pieces and rows[3]["computed_chunks"] == 0


def test_encode_piece_is_the_vocabulary_lookup() -> None:
    assert encode_piece("cab", "abc").tolist() == [2, 0, 1]
    assert encode_piece("", "abc").dtype == torch.long


def test_bad_input_is_one_line() -> None:
    with pytest.raises(ConfigError, match="whole numbers >= 1"):
        parse_workers("0,x")
    with pytest.raises(ConfigError, match="knows the data steps of charlm, digits"):
        run("mnist", [1])
