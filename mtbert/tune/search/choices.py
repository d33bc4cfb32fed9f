"""The registry of a search's choices: every ``--scheduler`` and ``--search-alg``.

Each choice is a small class that declares what a newcomer needs to know of it -- its
name and ``--help`` line, the choices of the other flag it works with (and why only
those), the optional extra it needs, whether trials reuse Ray's actors under it -- and
builds its Ray object.  The command line (its ``choices`` and ``--help``), the settings'
checks, the Tuner (tuner.py) and bench/search_efficiency.py all read :data:`SCHEDULERS`
and :data:`SEARCHERS` from here (importing this module registers every choice); adding a
scheduler is one module in :mod:`mtbert.tune.search.schedulers` and its line there
(its Ray class, if it needs one of its own, in ``schedulers/ray_classes.py``); a searcher
is one class below, decorated with :func:`~mtbert.tune.search.choice.register`.  The model
is Ray Tune's ``schedulers/`` (a name -> class table) and Optuna's ``pruners/``.

Nothing here imports Ray at module level: ``--help`` reads this registry, and each
``build`` imports the Ray classes it makes.

Schedulers, all on examples seen, comparing trials on ``--rung-metric`` (schedulers/):

* ``asha``: Ray's ASHA (Li et al. 2020) stops the weak trials at the budget's rungs,
  deciding as each trial arrives;
* ``asha-promote``: ASHA as the paper states it: trials pause at the rungs and a freed
  worker promotes the best of the top 1/rf of a rung (or starts a new trial), at most
  synchronous halving's share per rung; the last promotion trains on with every place's
  CPUs (one machine, CPU trials); with Optuna, told each trial's first-rung score
  (schedulers/ray_classes.py, searchers.py);
* ``fifo``: every trial trains its whole budget;
* ``bohb``: ``HyperBandForBOHB`` (Hyperband brackets whose rungs are the budget's;
  trials pause at a rung and resume from their checkpoint);
* ``pbt`` / ``pb2``: population-based training (Jaderberg et al. 2017) / its GP-bandit
  variant (Parker-Holder et al. 2020): at every evaluation the bottom quarter of the
  running trials restart from a top trial's checkpoint with ``lr``, ``dropout`` and the
  SMART lambdas (those the space samples) perturbed inside the space's ranges.

Searchers:

* ``optuna``: Optuna's independent TPE (Bergstra et al. 2011; one density per key, seeded,
  random for the first trials) behind a ``ConcurrencyLimiter``;
* ``optuna-mv``: Optuna's multivariate TPE (Falkner et al. 2018: one joint density over
  the keys, so interacting keys such as lr x batch size are modelled together); with
  either, a proposal that repeats a finished trial's configuration gets that trial's
  score without training (searchers.py);
* ``random``: Ray's random search (``BasicVariantGenerator``), also the population of
  PBT / PB2;
* ``bohb``: ``TuneBOHB`` (Falkner et al. 2018: TPE-like kernel densities per budget).

``bohb`` only works as a pair (the scheduler tells the searcher which trials are
paused); PBT / PB2 take their population from Ray's random search.
"""

from __future__ import annotations

from typing import ClassVar, Sequence

from mtbert.core.errors import ConfigError
from mtbert.tune.search import schedulers  # noqa: F401  (importing it registers every scheduler)
# the registry's tables and defaults: read them from here, where every choice is registered
from mtbert.tune.search.choice import (BOHB_EXTRA, DEFAULT_SCHEDULER,  # noqa: F401
                                       DEFAULT_SEARCHER, SCHEDULERS, SEARCHERS, Choice, register)
from mtbert.tune.search.schedulers.base import SchedulerChoice

#: ``--keep-checkpoints``: what a finished search keeps (retention.py)
KEEP_CHOICES = ("best", "all", "none")


class SearcherChoice(Choice):
    """A ``--search-alg``; :meth:`build` makes Ray's searcher."""
    flag, other_flag = "--search-alg", "--scheduler"
    #: the scheduler when ``--scheduler`` is left out (None: DEFAULT_SCHEDULER)
    default_scheduler: ClassVar[str | None] = None
    #: can be told an earlier search's trials before it proposes (``--extend``)
    learns_from_earlier: ClassVar[bool] = False

    def build(self, seed: int, max_concurrent: int, num_samples: int,
              scheduler: SchedulerChoice, first_rung: int, told_metric: str, earlier=(),
              points=()):
        """Ray's searcher; ``earlier``: extension.EarlierPoint to tell it first (where it
        :attr:`learns_from_earlier`); ``points``: configurations it proposes first, in
        order (Ray's ``points_to_evaluate``)."""
        raise NotImplementedError


def scheduler_choice(name: str) -> SchedulerChoice:
    if name not in SCHEDULERS:
        raise ConfigError(f"--scheduler {name}: unknown; expected one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]


def searcher_choice(name: str) -> SearcherChoice:
    if name not in SEARCHERS:
        raise ConfigError(f"--search-alg {name}: unknown; expected one of {', '.join(SEARCHERS)}")
    return SEARCHERS[name]


# ---------------------------------------------------------------------- searchers
class _Optuna(SearcherChoice):
    multivariate: ClassVar[bool] = False
    learns_from_earlier = True

    def build(self, seed, max_concurrent, num_samples, scheduler, first_rung, told_metric,
              earlier=(), points=()):
        import optuna
        from ray.tune.search import ConcurrencyLimiter

        # deferred: ray, optuna
        from mtbert.tune.search.searchers import DistinctOptunaSearch, RunningTrialsLimiter
        startup = max(2, min(10, num_samples // 3))
        # explicit: Optuna 5 makes TPE multivariate by default, Optuna 4 did not.
        # group=False: every trial samples the same keys (static spaces), where the group
        # decomposition is one group, i.e. plain multivariate TPE (and an
        # ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup,
                                             multivariate=self.multivariate, group=False)
        searcher = DistinctOptunaSearch(sampler=sampler, earlier=earlier,
                                        points_to_evaluate=list(points) or None)
        if scheduler.frees_paused_places:
            return RunningTrialsLimiter(searcher, max_concurrent, first_rung=first_rung,
                                        told_metric=told_metric)
        return ConcurrencyLimiter(searcher, max_concurrent=max_concurrent)


@register
class Optuna(_Optuna):
    name = "optuna"
    help = "Optuna's independent TPE (seeded)"


@register
class OptunaMultivariate(_Optuna):
    name = "optuna-mv"
    help = "its multivariate TPE"
    multivariate = True


@register
class Random(SearcherChoice):
    name = "random"
    help = "random search (baseline)"
    # promoting ASHA's searcher must free a paused trial's place, which Ray's random
    # search cannot: Ray's ASHA instead
    default_scheduler = "asha"

    def build(self, seed, max_concurrent, num_samples, scheduler, first_rung, told_metric,
              earlier=(), points=()):
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent,
                                     points_to_evaluate=list(points) or None)


@register
class Bohb(SearcherChoice):
    name = "bohb"
    help = "TuneBOHB"
    extra = BOHB_EXTRA
    works_with = ("bohb",)
    why_only = "TuneBOHB and HyperBandForBOHB only work as a pair"
    default_scheduler = "bohb"

    def build(self, seed, max_concurrent, num_samples, scheduler, first_rung, told_metric,
              earlier=(), points=()):
        from ray.tune.search.bohb import TuneBOHB
        # its own limit counts running trials only: a trial HyperBand paused at a rung
        # frees its place (a ConcurrencyLimiter would count it and stall the bracket)
        return TuneBOHB(seed=seed, max_concurrent=max_concurrent,
                        points_to_evaluate=list(points) or None)


# ---------------------------------------------------------------------- resolving
def resolve_scheduler(scheduler: str | None, search_alg: str | None) -> str:
    """``--scheduler``, or (left out) the one ``--search-alg`` works with, else the
    default."""
    if scheduler is not None:
        return scheduler
    paired = SEARCHERS[search_alg].default_scheduler if search_alg in SEARCHERS else None
    return paired or DEFAULT_SCHEDULER


def resolve_search_alg(scheduler: str, search_alg: str | None) -> str:
    """The searcher for ``--scheduler`` (``--search-alg`` left out: the one it works with),
    or ConfigError naming both flags for a pair that does not work together."""
    sched = scheduler_choice(scheduler)
    if search_alg is None:
        return sched.default_searcher
    if sched.works_with and search_alg not in sched.works_with:
        raise ConfigError(f"--scheduler {scheduler} needs --search-alg "
                          f"{' or '.join(sched.works_with)} (or leave --search-alg out), got "
                          f"--search-alg {search_alg}: {sched.why_only}")
    searcher = searcher_choice(search_alg)
    if searcher.works_with and scheduler not in searcher.works_with:
        raise ConfigError(f"--search-alg {search_alg} needs --scheduler "
                          f"{' or '.join(searcher.works_with)}, got --scheduler {scheduler}: "
                          f"{searcher.why_only}")
    return search_alg


def check_optional_packages(scheduler: str, search_alg: str) -> None:
    """The packages the chosen scheduler and searcher import are installed; else one
    ConfigError naming the extra to install (before Ray starts)."""
    scheduler_choice(scheduler).check_installed()
    searcher_choice(search_alg).check_installed()


def default_rung_metric(scheduler: str) -> str:
    """The ``--rung-metric`` of a ``--scheduler`` where the flag is left out."""
    return scheduler_choice(scheduler).default_rung_metric


def check_per_rung(metrics: Sequence[str], scheduler: str, rung_metric: str) -> None:
    """ConfigError for several rung metrics under a scheduler that takes one."""
    if len(metrics) > 1 and not scheduler_choice(scheduler).per_rung_metrics:
        takes = " or ".join(n for n, c in SCHEDULERS.items() if c.per_rung_metrics)
        raise ConfigError(f"--rung-metric {rung_metric}: one metric per rung needs --scheduler "
                          f"{takes}, got --scheduler {scheduler}; give it one metric")
