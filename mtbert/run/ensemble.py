"""Ensembling on prediction arrays: pure functions, no Ray, no MLflow, no model.

Members are always ordered best first (by validation score); that order breaks ties.

* :func:`mode_vote` -- classification (SST classes, QQP 0/1): the most voted label per
  row; a tie goes to the tied label voted by the best-ranked member that voted for
  one of the tied labels (so with the best member among the tied voters, its vote).
* :func:`weighted_median` -- regression (STS scores): the median of the members'
  scores per row.
* :func:`greedy_selection` -- Caruana et al. 2004, "Ensemble Selection from Libraries
  of Models": start from the best single member, then repeatedly add (with
  replacement) the member whose addition most improves the validation score; keep
  the best-scoring prefix.  Members picked k times carry weight k in the vote/median.

Per task the rule is :data:`COMBINE_RULE`: SST and QQP by mode, STS by median.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from mtbert.run.metrics import accuracy, pearson

COMBINE_RULE = {"sst": "mode", "qqp": "mode", "sts": "median"}


def _stack(preds: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
    arr = np.asarray(preds)
    if arr.ndim != 2:
        raise ValueError(f"expected (members, rows) predictions, got shape {arr.shape}")
    if arr.shape[0] == 0:
        raise ValueError("need at least one member")
    return arr


def _weights(weights: Sequence[float] | None, members: int) -> np.ndarray:
    if weights is None:
        return np.ones(members, dtype=np.float64)
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (members,) or np.any(w < 0) or not np.any(w > 0):
        raise ValueError(f"weights must be {members} non-negative numbers, not all 0; got {weights}")
    return w


def mode_vote(votes: Sequence[np.ndarray] | np.ndarray,
              weights: Sequence[float] | None = None) -> np.ndarray:
    """Row-wise (weighted) mode of integer labels; ``votes[0]`` is the best member.

    Ties: among the labels with the top count, pick the one voted by the
    best-ranked member (lowest index, non-zero weight) that voted for a tied label.
    """
    v = _stack(votes).astype(np.int64)
    w = _weights(weights, v.shape[0])
    labels = np.unique(v)
    # counts[l, r] = total weight voting labels[l] on row r
    counts = np.stack([((v == lab) * w[:, None]).sum(axis=0) for lab in labels])
    best = counts.max(axis=0)
    # weight of each member's own label on each row
    own = counts[np.searchsorted(labels, v), np.arange(v.shape[1])[None, :]]
    tied = np.isclose(own, best[None, :]) & (w[:, None] > 0)
    first = np.argmax(tied, axis=0)  # best-ranked member voting a top label
    return v[first, np.arange(v.shape[1])]


def weighted_median(scores: Sequence[np.ndarray] | np.ndarray,
                    weights: Sequence[int] | None = None) -> np.ndarray:
    """Row-wise median; integer ``weights`` repeat members (greedy selection counts)."""
    s = _stack(scores).astype(np.float64)
    if weights is None:
        return np.median(s, axis=0)
    w = np.asarray(weights)
    if w.shape != (s.shape[0],) or np.any(w < 0) or not np.any(w > 0) \
            or not np.all(np.equal(np.mod(w, 1), 0)):
        raise ValueError(f"median weights must be {s.shape[0]} non-negative integers; got {weights}")
    return np.median(np.repeat(s, w.astype(np.int64), axis=0), axis=0)


def task_labels(task: str, pred: np.ndarray) -> np.ndarray:
    """A member's raw output -> what is voted on (QQP probability -> 0/1 class)."""
    pred = np.asarray(pred)
    if task == "qqp":
        return (pred >= 0.5).astype(np.int64)
    if task == "sst":
        return pred.astype(np.int64)
    return pred.astype(np.float64)


def combine(task: str, member_preds: Sequence[np.ndarray],
            weights: Sequence[float] | None = None) -> np.ndarray:
    """Ensemble prediction of one task: SST/QQP class by mode, STS score by median.

    Returns labels (SST class, QQP 0/1 class, STS score), members best first.
    """
    labelled = [task_labels(task, p) for p in member_preds]
    if COMBINE_RULE[task] == "mode":
        return mode_vote(labelled, weights)
    return weighted_median(labelled, weights)


def task_score(task: str, labels: np.ndarray, gold: np.ndarray) -> float:
    """The task's metric on labels: SST/QQP accuracy, STS Pearson r."""
    if task == "sts":
        return pearson(labels, gold)
    return accuracy(labels, np.asarray(gold))


@dataclass
class Selection:
    """Greedy selection result: ``counts[i]`` = times member ``i`` was picked."""
    counts: list[int]
    score: float
    history: list[float] = field(default_factory=list)

    def members(self) -> list[int]:
        return [i for i, c in enumerate(self.counts) if c > 0]


def greedy_selection(member_preds: Sequence[np.ndarray], gold: np.ndarray,
                     score: Callable[[np.ndarray], float],
                     combine_fn: Callable[[Sequence[np.ndarray], Sequence[int]], np.ndarray],
                     rounds: int | None = None) -> Selection:
    """Forward selection with replacement (Caruana et al. 2004) on a validation split.

    ``member_preds`` best first; ``score(labels)`` is higher-is-better on ``gold``'s
    rows; ``combine_fn(preds, counts)`` combines members weighted by counts.  Starts
    from member 0 (the best single model); each round adds the member that gives
    the highest score (ties: the least picked so far, then the lowest index); after ``rounds`` rounds (default
    ``2 * members``) returns the counts of the best round (earliest on ties).
    """
    n = len(member_preds)
    if n == 0:
        raise ValueError("need at least one member")
    rounds = 2 * n if rounds is None else rounds
    counts = [0] * n
    counts[0] = 1
    current = score(combine_fn(member_preds, counts))
    best = Selection(list(counts), current, [current])
    history = [current]
    for _ in range(rounds):
        trial_scores = []
        for i in range(n):
            trial = list(counts)
            trial[i] += 1
            trial_scores.append(score(combine_fn(member_preds, trial)))
        # ties: the member picked fewest times so far, then the best-ranked one (with
        # mode voting a 2-member ensemble always equals its best member, so without
        # this a hill-climb from one model could never leave it)
        pick = max(range(n), key=lambda i: (trial_scores[i], -counts[i], -i))
        counts[pick] += 1
        history.append(trial_scores[pick])
        if trial_scores[pick] > best.score:
            best = Selection(list(counts), trial_scores[pick])
    best.history = history
    return best


def greedy_task_selection(task: str, member_preds: Sequence[np.ndarray], gold: np.ndarray,
                          rounds: int | None = None) -> Selection:
    """:func:`greedy_selection` with the task's combine rule and metric."""
    return greedy_selection(
        member_preds, gold,
        score=lambda labels: task_score(task, labels, gold),
        combine_fn=lambda preds, counts: combine(task, preds, counts),
        rounds=rounds)
