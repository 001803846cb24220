"""The tp collective counter's sampling: which steps run under the dispatch mode, and that the
steps it replays record exactly what counting them would have."""

from __future__ import annotations

from collections import Counter

import torch

from shardwise.comm.recorder import CommEvent, Recorder
from shardwise.strategies.counting import StepCounts, batch_signature


def _log(n: int, size: int = 64) -> list[tuple[tuple[str, str, str], CommEvent | None]]:
    return [(("tp", "all_reduce", "forward"), CommEvent("all_reduce", "tp", 2, size, size, size, 0.0)) for _ in range(n)]


def test_a_signature_is_the_shapes_dtypes_and_plain_values_of_the_batch():
    a = [(torch.zeros(4, 8, dtype=torch.long), torch.zeros(4, 8, dtype=torch.long))]
    assert batch_signature(a) == batch_signature([(torch.ones(4, 8, dtype=torch.long), torch.ones(4, 8, dtype=torch.long))])
    assert batch_signature(a) != batch_signature([(torch.zeros(4, 9, dtype=torch.long), torch.zeros(4, 9, dtype=torch.long))])
    assert batch_signature(a) != batch_signature([(torch.zeros(4, 8), torch.zeros(4, 8, dtype=torch.long))])
    assert batch_signature(a) != batch_signature(a * 2)  # two micro-batches
    m = [{"input_ids": torch.zeros(2, 3, dtype=torch.long), "use_cache": False}]
    assert batch_signature(m) != batch_signature([{"input_ids": torch.zeros(2, 3, dtype=torch.long), "use_cache": True}])
    assert batch_signature(m) != batch_signature([{"labels": torch.zeros(2, 3, dtype=torch.long), "use_cache": False}])


def test_steps_are_counted_until_two_agree_then_replayed_and_verified():
    counts = StepCounts(verify_every=4)
    sig = ("s",)
    plan = []
    for _ in range(9):
        count = counts.must_count(sig)
        plan.append(count)
        if count:
            counts.counted_step(sig, _log(3))
        else:
            counts.replay(sig, None, Counter())
    # steps 1 and 2 counted (the first may do one-time work), 3 replayed, 4 and 8 verified
    assert plan == [True, True, False, True, False, False, False, True, False]
    assert (counts.counted, counts.replayed, counts.every_step) == (4, 5, False)


def test_a_first_step_with_extra_collectives_is_not_replayed():
    counts = StepCounts()
    sig = ("s",)
    assert counts.must_count(sig)
    counts.counted_step(sig, _log(5))  # lazy set-up issued two more
    assert counts.must_count(sig)
    counts.counted_step(sig, _log(3))
    assert counts.must_count(sig)  # the two counts disagreed: not confirmed, counted again
    counts.counted_step(sig, _log(3))
    assert not counts.must_count(sig)


def test_replay_records_what_counting_recorded():
    recorder, counted = Recorder(), Counter[tuple[str, str, str]]()
    counts = StepCounts()
    sig = ("s",)
    for _ in range(2):
        counts.must_count(sig)
        log = _log(3, size=100)
        for key, event in log:
            counted[key] += 1
            assert event is not None
            recorder.add(event)
        counts.counted_step(sig, log)
    assert not counts.must_count(sig)
    counts.replay(sig, recorder, counted)
    assert counted[("tp", "all_reduce", "forward")] == 9
    total = recorder.report(3)["by_op"]["tp/all_reduce"]
    assert total["count"] == 9 and total["payload_bytes"] == 900


def test_a_verification_that_disagrees_turns_replay_off():
    counts = StepCounts(verify_every=3)
    sig = ("s",)
    for _ in range(2):
        counts.must_count(sig)
        counts.counted_step(sig, _log(2))
    assert counts.must_count(sig)  # step 3: verification
    counts.counted_step(sig, _log(4))  # the values, not the shapes, decided the collectives
    assert counts.every_step
    assert all(counts.must_count(sig) for _ in range(10))
    assert counts.summary() == "every step"


def test_ever_new_shapes_count_every_step():
    counts = StepCounts(max_signatures=3)
    for i in range(4):
        sig = ("s", i)
        assert counts.must_count(sig)
        counts.counted_step(sig, _log(1))
    assert counts.every_step
