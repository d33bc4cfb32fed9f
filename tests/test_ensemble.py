"""Ensemble voting on hand-made predictions: exact results, ties included."""

from __future__ import annotations

import numpy as np
import pytest

from mtbert.run.ensemble import (combine, greedy_selection, greedy_task_selection, mode_vote,
                             task_labels, weighted_median)


def test_mode_vote_majority():
    votes = [[0, 1, 2, 3],
             [0, 1, 4, 3],
             [1, 1, 4, 2]]
    assert mode_vote(votes).tolist() == [0, 1, 4, 3]


def test_mode_vote_tie_goes_to_best_member():
    # row 0: 2-2 tie of labels 2 and 1; the best member (index 0) voted 2 -> 2
    # row 1: label 4 has two votes, a clear mode -> 4
    # row 2: 2-2 tie of label 3 (members 1, 2) and 1 (members 0, 3) -> best member's 1
    votes = [[2, 4, 1],
             [1, 0, 3],
             [2, 3, 3],
             [1, 4, 1]]
    assert mode_vote(votes).tolist() == [2, 4, 1]
    three_way = [[4], [0], [3]]
    assert mode_vote(three_way).tolist() == [4]


def test_mode_vote_tie_when_best_member_is_outvoted():
    # labels 1 and 2 tie with two votes each; the best member voted 3 (not tied):
    # the next-best member voting a tied label decides (member 1 -> 2)
    votes = [[3], [2], [1], [1], [2]]
    assert mode_vote(votes).tolist() == [2]


def test_mode_vote_weights_and_zero_weight_members():
    votes = [[0, 0], [1, 1], [2, 1]]
    assert mode_vote(votes, weights=[1, 2, 1]).tolist() == [1, 1]
    # a zero-weight member never breaks ties: 0 (w=1) vs 2 (w=1), member 1 has w=0
    assert mode_vote([[0], [1], [2]], weights=[1, 0, 1]).tolist() == [0]
    assert mode_vote([[5], [1], [2]], weights=[0, 1, 1]).tolist() == [1]


def test_qqp_votes_on_thresholded_probabilities():
    probs = [np.array([0.9, 0.4, 0.5, 0.2]),
             np.array([0.1, 0.6, 0.49, 0.3]),
             np.array([0.2, 0.7, 0.51, 0.8]),
             np.array([0.8, 0.1, 0.0, 0.9])]
    # row 0: 1,0,0,1 tie -> best member's 1; row 1: 0,1,1,0 tie -> 0;
    # row 2: 1,0,1,0 tie -> 1; row 3: 0,0,1,1 tie -> 0
    assert combine("qqp", probs).tolist() == [1, 0, 1, 0]
    assert task_labels("qqp", np.array([0.5, 0.4999])).tolist() == [1, 0]


def test_sts_median():
    scores = [np.array([1.0, 5.0, 2.0]),
              np.array([2.0, 0.0, 2.5]),
              np.array([4.0, 3.0, 3.5])]
    assert combine("sts", scores).tolist() == [2.0, 3.0, 2.5]
    # even member count: the mean of the two middle values
    assert weighted_median(scores[:2]).tolist() == [1.5, 2.5, 2.25]
    # integer weights repeat members: [1,1,1,2,4] -> 1 ... [5,5,5,0,3] -> 5
    assert weighted_median(scores, [3, 1, 1]).tolist() == [1.0, 5.0, 2.0]


def test_sst_combine_and_bad_input():
    assert combine("sst", [np.array([0, 4]), np.array([1, 4]), np.array([1, 3])]).tolist() == [1, 4]
    with pytest.raises(ValueError):
        mode_vote([[0, 1], [1]])
    with pytest.raises(ValueError):
        mode_vote([[0]], weights=[0])
    with pytest.raises(ValueError):
        weighted_median([[1.0]], weights=[0.5])


def test_greedy_selection_with_replacement():
    gold = np.array([0, 1, 2, 3, 4, 0])
    a = np.array([0, 1, 2, 3, 0, 1])   # 4/6, the best single member
    b = np.array([0, 1, 0, 0, 4, 0])   # 4/6: right where a is wrong on rows 4-5
    c = np.array([1, 2, 2, 3, 4, 0])   # 4/6
    sel = greedy_task_selection("sst", [a, b, c], gold)
    # any pair ties and so equals the best member a; the tie-break then adds the
    # least-picked member b, and {a, b, c} has a 2-of-3 majority on every gold label
    assert sel.score == 1.0
    assert sel.counts == [1, 1, 1]
    assert sel.members() == [0, 1, 2]
    assert sel.history[0] == pytest.approx(4 / 6)


def test_greedy_selection_keeps_best_prefix_and_single_best():
    gold = np.array([1.0, 2.0, 3.0, 4.0])
    good = np.array([1.0, 2.0, 3.0, 4.0])
    bad = np.array([4.0, 3.0, 2.0, 1.0])
    sel = greedy_task_selection("sts", [good, bad], gold, rounds=3)
    # adding anything never beats r=1 -> the first (single best) round is kept
    assert sel.counts == [1, 0]
    assert sel.score == pytest.approx(1.0)
    assert len(sel.history) == 4


def test_greedy_selection_generic_interface():
    calls = []

    def combine_fn(preds, counts):
        calls.append(tuple(counts))
        return sum(c * p for c, p in zip(counts, preds)) / sum(counts)

    preds = [np.array([0.0]), np.array([1.0])]
    # score = closeness to 0.75: best = 1 x member0 + 3 x member1
    sel = greedy_selection(preds, np.array([0.75]), lambda x: -abs(float(x[0]) - 0.75),
                           combine_fn, rounds=4)
    assert sel.counts == [1, 3]
    assert calls[0] == (1, 0)
