"""Task schedules: orders, counts, and the sampling frequencies p_i (chi-square tests)."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy import stats

from mtbert.techniques.task_schedules import Annealed, build_schedule, super_batches

SIZES = {"sst": 267, "qqp": 422, "sts": 189}  # batches per task at batch 32 on the real train splits


def frequencies_match(plan, expected_p: dict[str, float]) -> float:
    counts = Counter(task for step in plan for task in step)
    observed = np.array([counts[t] for t in expected_p])
    expected = np.array(list(expected_p.values())) * len(plan)
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.parametrize("name,alpha", [("proportional", 1.0), ("sqrt", 0.5)])
def test_sampled_schedules_follow_their_probabilities(name, alpha):
    sched = build_schedule(name, SIZES, epochs=3, steps_per_epoch=20000)
    plan = sched.plan(1, np.random.default_rng(0))
    assert len(plan) == 20000
    weights = {t: n ** alpha for t, n in SIZES.items()}
    expected = {t: w / sum(weights.values()) for t, w in weights.items()}
    assert frequencies_match(plan, expected) > 0.001
    # and the test has power: the other schedule's probabilities are rejected
    other_alpha = 0.5 if alpha == 1.0 else 1.0
    other = {t: n ** other_alpha for t, n in SIZES.items()}
    other_p = {t: w / sum(other.values()) for t, w in other.items()}
    assert frequencies_match(plan, other_p) < 1e-6


def test_annealed_alpha_goes_from_1_to_0_2():
    sched = Annealed(SIZES, epochs=5, steps_per_epoch=20000)
    assert [sched.alpha(e) for e in range(1, 6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])
    for epoch in (1, 5):
        alpha = sched.alpha(epoch)
        weights = {t: n ** alpha for t, n in SIZES.items()}
        expected = {t: w / sum(weights.values()) for t, w in weights.items()}
        assert sched.probs(epoch) == pytest.approx(list(expected.values()))
        assert frequencies_match(sched.plan(epoch, np.random.default_rng(epoch)), expected) > 0.001
    assert Annealed(SIZES, epochs=1).alpha(1) == 1.0


def test_sampled_default_steps_per_epoch_is_total_batches():
    assert len(build_schedule("sqrt", SIZES, 1).plan(1, np.random.default_rng(0))) == sum(SIZES.values())


def test_sequential_round_robin_and_random_order():
    seq = build_schedule("sequential", SIZES, 1).plan(1, np.random.default_rng(0))
    assert seq == [("sst",)] * 267 + [("qqp",)] * 422 + [("sts",)] * 189
    trunc = build_schedule("round_robin", SIZES, 1, round_robin_mode="truncate").plan(1, None)
    cycle = build_schedule("round_robin", SIZES, 1, round_robin_mode="cycle").plan(1, None)
    assert trunc == [("sst", "qqp", "sts")] * 189 and len(cycle) == 422
    shuffled = build_schedule("random_order", SIZES, 1).plan(1, np.random.default_rng(0))
    assert Counter(t for (t,) in shuffled) == Counter(SIZES)
    assert shuffled != sorted(shuffled)  # actually mixed
    again = build_schedule("random_order", SIZES, 1).plan(1, np.random.default_rng(0))
    assert shuffled == again


def test_super_batches_hold_at_most_one_batch_per_task():
    plan = [("sst",), ("qqp",), ("sst",), ("sts",), ("qqp",), ("sts",), ("sts",)]
    assert super_batches(plan) == [("sst", "qqp"), ("sst", "sts", "qqp"), ("sts",), ("sts",)]
    rr = [("sst", "qqp", "sts")] * 3
    assert super_batches(rr) == rr


def test_every_task_needs_a_batch():
    with pytest.raises(ValueError):
        build_schedule("sqrt", {"sst": 0, "qqp": 3, "sts": 2}, 1)
