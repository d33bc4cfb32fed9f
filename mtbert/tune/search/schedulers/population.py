"""What PBT and PB2 share: the population is Ray's random search's trials, perturbed in the
keys of :data:`~mtbert.core.config.PERTURBED` the space samples."""

from __future__ import annotations

from typing import Any

from mtbert.core.config import PERTURBED
from mtbert.core.errors import ConfigError
from mtbert.tune.search.budgets import Budget
from mtbert.tune.search.schedulers.base import SchedulerChoice


class Population(SchedulerChoice):
    """PBT / PB2: the searcher is Ray's random search, whose trials they perturb."""
    works_with = ("random",)
    why_only = "population-based training perturbs trials Ray's random search started"
    default_searcher = "random"
    reuses_actors = False  # pauses trials in turns (tuner.reuses_actors)
    population = True

    def check_space(self, space) -> None:
        self.mutations(space)

    def mutations(self, space) -> dict[str, Any]:
        """What it perturbs: each of :data:`~mtbert.core.config.PERTURBED` the space samples,
        over the space's own values; ConfigError where there is none."""
        out = self._mutations(space)
        if not out:
            what = "as a range" if self.name == "pb2" else ""
            raise ConfigError(f"--scheduler {self.name}: the space {space.name} samples none of "
                              f"{', '.join(PERTURBED)} {what}: nothing to perturb (use "
                              "--scheduler asha, or a space that searches them)"
                              .replace("  ", " "))
        return out

    def _mutations(self, space) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _sampled(space):
        """(key, param) of each mutable key the space samples (not as integers)."""
        for key in PERTURBED:
            p = space.searched.get(key)
            if p is not None and p.dist != "randint":
                yield key, p

    @staticmethod
    def _common(budget: Budget, metric: str) -> dict[str, Any]:
        # synch: the population is compared at the same examples seen.  With more trials
        # than run at once they take turns; asynchronous PBT would compare the trial
        # reporting with the others' earlier scores, which it nearly always beats
        return dict(budget=budget, metric=metric, quantile_fraction=0.25, log_config=True,
                    synch=True)
