"""Task schedules: which task's batch comes next.

A schedule knows the number of batches per task and the epoch number, nothing of
the model. ``plan(epoch, rng)`` returns the epoch's steps; each step is a tuple of
task names trained together (one task for most schedules, all three for
round-robin). Under ``update=summed`` the trainer turns each step into one
super-batch (at most one batch per task) with :func:`super_batches`.

Sampling probabilities (report 001, eqs. 1-4; Stickland & Murray 2019):
  proportional p_i ∝ N_i;  sqrt p_i ∝ √N_i;  annealed p_i ∝ N_i^α with
  α = 1 − 0.8·(e − 1)/(E − 1), e = 1..E the epoch.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

Step = tuple[str, ...]


class Schedule:
    name = "base"

    def __init__(self, num_batches: dict[str, int], epochs: int, steps_per_epoch: int = 0):
        if any(n <= 0 for n in num_batches.values()):
            raise ValueError(f"every task needs at least one batch, got {num_batches}")
        self.num_batches = dict(num_batches)
        self.tasks = list(num_batches)
        self.epochs = epochs
        self.steps_per_epoch = steps_per_epoch or sum(num_batches.values())

    def plan(self, epoch: int, rng: np.random.Generator) -> list[Step]:
        """Steps of epoch ``epoch`` (1-based)."""
        raise NotImplementedError


class Sequential(Schedule):
    """All SST batches, then all QQP, then all STS, every epoch."""
    name = "sequential"

    def plan(self, epoch, rng):
        return [(t,) for t in self.tasks for _ in range(self.num_batches[t])]


class RoundRobin(Schedule):
    """One batch of every task per step; ``truncate`` stops at the smallest task,
    ``cycle`` runs to the largest, the smaller tasks starting over."""
    name = "round_robin"

    def __init__(self, num_batches, epochs, steps_per_epoch=0, mode: str = "cycle"):
        super().__init__(num_batches, epochs, steps_per_epoch)
        self.mode = mode

    def plan(self, epoch, rng):
        counts = self.num_batches.values()
        steps = min(counts) if self.mode == "truncate" else max(counts)
        return [tuple(self.tasks)] * steps


class RandomOrder(Schedule):
    """All batches of all tasks, shuffled together."""
    name = "random_order"

    def plan(self, epoch, rng):
        steps = [(t,) for t in self.tasks for _ in range(self.num_batches[t])]
        return [steps[i] for i in rng.permutation(len(steps))]


class Sampled(Schedule):
    """``steps_per_epoch`` independent draws of a task with probabilities ``probs(epoch)``."""

    def probs(self, epoch: int) -> np.ndarray:
        sizes = np.array([self.num_batches[t] for t in self.tasks], dtype=np.float64)
        weights = sizes ** self.alpha(epoch)
        return weights / weights.sum()

    def alpha(self, epoch: int) -> float:
        raise NotImplementedError

    def plan(self, epoch, rng):
        draws = rng.choice(len(self.tasks), size=self.steps_per_epoch, p=self.probs(epoch))
        return [(self.tasks[i],) for i in draws]


class Proportional(Sampled):
    name = "proportional"

    def alpha(self, epoch):
        return 1.0


class SquareRoot(Sampled):
    name = "sqrt"

    def alpha(self, epoch):
        return 0.5


class Annealed(Sampled):
    name = "annealed"

    def alpha(self, epoch):
        if self.epochs <= 1:
            return 1.0
        return 1.0 - 0.8 * (epoch - 1) / (self.epochs - 1)


SCHEDULES: dict[str, type[Schedule]] = {
    cls.name: cls for cls in (Sequential, RoundRobin, Proportional, SquareRoot, Annealed, RandomOrder)
}


def build_schedule(name: str, num_batches: dict[str, int], epochs: int,
                   steps_per_epoch: int = 0, round_robin_mode: str = "cycle") -> Schedule:
    if name == "round_robin":
        return RoundRobin(num_batches, epochs, steps_per_epoch, mode=round_robin_mode)
    return SCHEDULES[name](num_batches, epochs, steps_per_epoch)


def super_batches(steps: Sequence[Step]) -> list[Step]:
    """Group a plan into super-batches holding at most one batch per task: consecutive
    task batches join the current group until a task would repeat."""
    groups: list[Step] = []
    current: list[str] = []
    for step in steps:
        for task in step:
            if task in current:
                groups.append(tuple(current))
                current = []
            current.append(task)
    if current:
        groups.append(tuple(current))
    return groups
