"""What a ``--scheduler`` declares besides every choice's: its default searcher and rung
metric, whether its trials reuse Ray's actors, pause in turns or perturb each other; and
:meth:`SchedulerChoice.build`, which makes its Ray scheduler."""

from __future__ import annotations

from typing import ClassVar

from mtbert.tune.search.budgets import Budget
from mtbert.tune.search.choice import DEFAULT_SEARCHER, Choice
from mtbert.tune.trial.objective import DEFAULT_RUNG_METRIC


class SchedulerChoice(Choice):
    """A ``--scheduler``: see the attributes; :meth:`build` makes Ray's scheduler."""
    flag, other_flag = "--scheduler", "--search-alg"
    #: the searcher when ``--search-alg`` is left out
    default_searcher: ClassVar[str] = DEFAULT_SEARCHER
    #: the ``--rung-metric`` when it is left out (objective.RUNG_METRICS, comma-joined)
    default_rung_metric: ClassVar[str] = DEFAULT_RUNG_METRIC
    #: takes one rung metric per decision rung
    per_rung_metrics: ClassVar[bool] = False
    #: trials reuse Ray's actors (not where trials pause in turns: tuner.reuses_actors)
    reuses_actors: ClassVar[bool] = True
    #: perturbs running trials: they evaluate at a fixed interval, the population is every
    #: trial at once (no searcher limit), every checkpoint is kept while it runs
    population: ClassVar[bool] = False
    #: pauses trials at rungs and frees their places: Optuna runs behind a limit on the
    #: trials running, told each trial's first-rung score (searchers.RunningTrialsLimiter)
    frees_paused_places: ClassVar[bool] = False

    def check_space(self, space) -> None:
        """ConfigError if the space gives it nothing to work on."""

    def build(self, budget: Budget, space, metrics: tuple[str, ...], workers: int,
              num_samples: int, last_leg_cpus: float):
        """Ray's scheduler, comparing trials on ``metrics`` (one, or one per decision
        rung where :attr:`per_rung_metrics`)."""
        raise NotImplementedError
