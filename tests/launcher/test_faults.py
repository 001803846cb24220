"""A trial of the fault runner (benchmarks/faults.py) for the two faults no other test makes: rank 0
killed while it publishes a checkpoint, and a checkpoint whose state was replaced by a code-running
pickle (manifest rewritten to match). Each run must end bitwise where the uninterrupted run ends.
The benchmark runs 20 trials of each kind; its figures are in the README."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

STEPS = 30


def _faults():
    spec = importlib.util.spec_from_file_location("faults", Path(__file__).resolve().parents[2] / "benchmarks" / "faults.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    faults = _faults()
    out = tmp_path_factory.mktemp("reference")
    code, text = faults.run(out, STEPS)
    assert code == 0, text[-3000:]
    return faults, faults.final_weights(out)


def test_rank_0_killed_while_publishing_a_checkpoint_resumes_bitwise(reference, tmp_path):
    faults, weights = reference
    what = faults.trial_kill_in_checkpoint(tmp_path, STEPS, random.Random(1))
    assert "exit" not in what and "no write caught" not in what, what
    assert faults.check(tmp_path, weights, STEPS) is None


def test_a_code_running_pickle_in_the_newest_checkpoint_is_skipped_and_never_run(reference, tmp_path):
    faults, weights = reference
    what = faults.trial_corrupt(tmp_path, STEPS, random.Random(1), "foreign")
    assert what == "newest checkpoint foreign", what
    assert faults.check(tmp_path, weights, STEPS) is None
