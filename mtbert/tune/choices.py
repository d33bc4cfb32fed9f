"""The registry of a search's choices: every ``--scheduler`` and ``--search-alg``.

Each choice is a small class that declares what a newcomer needs to know of it -- its
name and ``--help`` line, the choices of the other flag it works with (and why only
those), the optional extra it needs, whether trials reuse Ray's actors under it -- and
builds its Ray object.  The command line (its ``choices`` and ``--help``), the settings'
checks, the Tuner (tuner.py) and bench/search_efficiency.py all read :data:`SCHEDULERS`
and :data:`SEARCHERS`; adding a scheduler is one class here, decorated with
:func:`register` (its Ray class, if it needs one, in schedulers.py).  The model is Ray
Tune's ``schedulers/`` (a name -> class table) and Optuna's ``pruners/``.

Nothing here imports Ray at module level: ``--help`` reads this registry, and each
``build`` imports the Ray classes it makes.

Schedulers, all on examples seen, comparing trials on ``--rung-metric`` (schedulers.py):

* ``asha``: Ray's ASHA (Li et al. 2020) stops the weak trials at the budget's rungs,
  deciding as each trial arrives;
* ``asha-promote``: ASHA as the paper states it: trials pause at the rungs and a freed
  worker promotes the best of the top 1/rf of a rung (or starts a new trial), at most
  synchronous halving's share per rung; the last promotion trains on with every place's
  CPUs (one machine, CPU trials); with Optuna, told each trial's first-rung score
  (schedulers.py, searchers.py);
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

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

from mtbert.config import PERTURBED
from mtbert.errors import ConfigError
from mtbert.tune.budgets import Budget
from mtbert.tune.records import DEFAULT_RUNG_METRIC

#: the default search: promoting ASHA (deciding on its ``default_rung_metric``) + Optuna's
#: independent TPE, what bench/search_efficiency.py ranks first among the pairs it measured
#: over 3 seeds (docs/bench/search_efficiency.md)
DEFAULT_SCHEDULER = "asha-promote"
DEFAULT_SEARCHER = "optuna"
#: ``--keep-checkpoints``: what a finished search keeps (retention.py)
KEEP_CHOICES = ("best", "all", "none")


@dataclass(frozen=True)
class Extra:
    """The modules a choice needs beyond the core install, and the extra that has them."""
    name: str
    modules: tuple[str, ...]


class Choice:
    """What every choice declares."""
    flag: ClassVar[str]
    other_flag: ClassVar[str]
    name: ClassVar[str]
    #: its part of the flag's ``--help``
    help: ClassVar[str]
    #: None: the core install has what it imports
    extra: ClassVar[Extra | None] = None
    #: the other flag's choices it works with (empty: all), and why only those
    works_with: ClassVar[tuple[str, ...]] = ()
    why_only: ClassVar[str] = ""

    def help_line(self) -> str:
        pair = (f" (with {self.other_flag} {' / '.join(self.works_with)})" if self.works_with
                else "")
        extra = f" (pip install 'mtbert-tune[{self.extra.name}]')" if self.extra else ""
        return f"{self.name}: {self.help}{pair}{extra}"

    def check_installed(self) -> None:
        """ConfigError naming the extra to install, if one of its modules is missing."""
        if self.extra is None:
            return
        missing = []
        for module in self.extra.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                missing.append(module)
        if missing:
            raise ConfigError(f"{self.flag} {self.name} needs {', '.join(self.extra.modules)} "
                              f"(missing: {', '.join(missing)}): pip install "
                              f"'mtbert-tune[{self.extra.name}]'")


class SchedulerChoice(Choice):
    """A ``--scheduler``: see the attributes; :meth:`build` makes Ray's scheduler."""
    flag, other_flag = "--scheduler", "--search-alg"
    #: the searcher when ``--search-alg`` is left out
    default_searcher: ClassVar[str] = DEFAULT_SEARCHER
    #: the ``--rung-metric`` when it is left out (records.RUNG_METRICS, comma-joined)
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


class SearcherChoice(Choice):
    """A ``--search-alg``; :meth:`build` makes Ray's searcher."""
    flag, other_flag = "--search-alg", "--scheduler"
    #: the scheduler when ``--scheduler`` is left out (None: DEFAULT_SCHEDULER)
    default_scheduler: ClassVar[str | None] = None
    #: can be told an earlier search's trials before it proposes (``--extend``)
    learns_from_earlier: ClassVar[bool] = False

    def build(self, seed: int, max_concurrent: int, num_samples: int,
              scheduler: SchedulerChoice, first_rung: int, told_metric: str, earlier=()):
        """Ray's searcher; ``earlier``: extension.EarlierPoint to tell it first (where it
        :attr:`learns_from_earlier`)."""
        raise NotImplementedError


#: the pair's extra (both halves import it)
BOHB_EXTRA = Extra("bohb", ("hpbandster", "ConfigSpace"))

SCHEDULERS: dict[str, SchedulerChoice] = {}
SEARCHERS: dict[str, SearcherChoice] = {}


def register(cls: type[Choice]) -> type[Choice]:
    """Class decorator: put one instance of ``cls`` in its flag's table by its name."""
    table: dict[str, Any] = SCHEDULERS if issubclass(cls, SchedulerChoice) else SEARCHERS
    table[cls.name] = cls()
    return cls


def scheduler_choice(name: str) -> SchedulerChoice:
    if name not in SCHEDULERS:
        raise ConfigError(f"--scheduler {name}: unknown; expected one of {', '.join(SCHEDULERS)}")
    return SCHEDULERS[name]


def searcher_choice(name: str) -> SearcherChoice:
    if name not in SEARCHERS:
        raise ConfigError(f"--search-alg {name}: unknown; expected one of {', '.join(SEARCHERS)}")
    return SEARCHERS[name]


# ---------------------------------------------------------------------- schedulers
@register
class Asha(SchedulerChoice):
    name = "asha"
    help = "stop weak trials at the budget's rungs (Ray's ASHA, deciding as each trial arrives)"

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.schedulers import ASHAOnExamples  # deferred: ray
        return ASHAOnExamples(budget, metrics[0])


@register
class PromotingAsha(SchedulerChoice):
    name = "asha-promote"
    help = "ASHA as Li et al. state it, trials pause at the rungs and the best are promoted"
    works_with = ("optuna", "optuna-mv")
    why_only = "its searcher must free a paused trial's place"
    # its first rung on the classifiers' probabilities and its later rungs on overall_soft:
    # at the bench's first rung (224 examples) STS r ranks the configurations no better
    # than chance, at the second (672) it carries signal; bench/search_efficiency.py ranks
    # this pair first (docs/bench/search_efficiency.md)
    default_rung_metric = "classes_soft,overall_soft"
    per_rung_metrics = True
    # a trial pauses where a new or promoted one takes its place (docs/search.md, "Ray
    # workers")
    reuses_actors = True
    frees_paused_places = True

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.schedulers import PromotingASHA  # deferred: ray
        return PromotingASHA(budget, metrics, workers, num_samples or budget.num_samples,
                             last_leg_cpus)


@register
class Fifo(SchedulerChoice):
    name = "fifo"
    help = "every trial trains its whole budget (a baseline without early stopping)"

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from ray.tune.schedulers import FIFOScheduler
        return FIFOScheduler()


@register
class HyperbandForBohb(SchedulerChoice):
    name = "bohb"
    help = "Hyperband for BOHB on the same rungs"
    extra = BOHB_EXTRA
    works_with = ("bohb",)
    why_only = "HyperBandForBOHB and TuneBOHB only work as a pair"
    default_searcher = "bohb"
    reuses_actors = False  # pauses trials in turns (tuner.reuses_actors)

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.schedulers import HyperBandOnRungs  # deferred: ray
        return HyperBandOnRungs(budget, metrics[0])


class _Population(SchedulerChoice):
    """PBT / PB2: the searcher is Ray's random search, whose trials they perturb."""
    works_with = ("random",)
    why_only = "population-based training perturbs trials Ray's random search started"
    default_searcher = "random"
    reuses_actors = False  # pauses trials in turns (tuner.reuses_actors)
    population = True

    def check_space(self, space) -> None:
        self.mutations(space)

    def mutations(self, space) -> dict[str, Any]:
        """What it perturbs: each of :data:`~mtbert.config.PERTURBED` the space samples,
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


@register
class Pbt(_Population):
    name = "pbt"
    help = ("population-based training of lr, dropout and the SMART lambdas, perturbed at "
            "every evaluation")

    def _mutations(self, space) -> dict[str, Any]:
        """PBT: the list of choices (it moves to a neighbour) or the Ray domain (x 0.8 /
        1.2, clipped back into the range by :class:`ClipToSpace`)."""
        return {key: sorted(p.choices) if p.dist == "choice" else p.to_tune()
                for key, p in self._sampled(space)}

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.schedulers import PBTOnEvalIntervals  # deferred: ray
        found = self.mutations(space)
        bounds = {k: (p.low, p.high) for k, p in space.searched.items()
                  if k in found and p.dist != "choice"}
        return PBTOnEvalIntervals(hyperparam_mutations=found, resample_probability=0.25,
                                  custom_explore_fn=ClipToSpace(bounds),
                                  **self._common(budget, metrics[0]))


@register
class Pb2(_Population):
    name = "pb2"
    help = "PBT's GP-bandit variant on the same keys"
    extra = Extra("pb2", ("sklearn",))

    def _mutations(self, space) -> dict[str, Any]:
        """PB2: ``[low, high]`` of the ranges (its GP bandit is continuous; choices stay
        as sampled)."""
        return {key: [p.low, p.high] for key, p in self._sampled(space) if p.dist != "choice"}

    def build(self, budget, space, metrics, workers, num_samples, last_leg_cpus):
        from mtbert.tune.schedulers import PB2OnEvalIntervals  # deferred: ray
        return PB2OnEvalIntervals(hyperparam_bounds=self.mutations(space),
                                  **self._common(budget, metrics[0]))


class ClipToSpace:
    """PBT's ``custom_explore_fn``: a perturbed range value is put back into the space's
    [low, high] (x 1.2 of a dropout near the top would leave it; repeated, leave the valid
    range).  A class, not a closure, so Ray can pickle the scheduler with the experiment."""

    def __init__(self, bounds: dict[str, tuple[float, float]]):
        self.bounds = bounds

    def __call__(self, config: dict) -> dict:
        for key, (low, high) in self.bounds.items():
            if key in config:
                config[key] = min(max(config[key], low), high)
        return config


# ---------------------------------------------------------------------- searchers
class _Optuna(SearcherChoice):
    multivariate: ClassVar[bool] = False
    learns_from_earlier = True

    def build(self, seed, max_concurrent, num_samples, scheduler, first_rung, told_metric,
              earlier=()):
        import optuna
        from ray.tune.search import ConcurrencyLimiter

        # deferred: ray, optuna
        from mtbert.tune.searchers import DistinctOptunaSearch, RunningTrialsLimiter
        startup = max(2, min(10, num_samples // 3))
        # explicit: Optuna 5 makes TPE multivariate by default, Optuna 4 did not.
        # group=False: every trial samples the same keys (static spaces), where the group
        # decomposition is one group, i.e. plain multivariate TPE (and an
        # ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup,
                                             multivariate=self.multivariate, group=False)
        searcher = DistinctOptunaSearch(sampler=sampler, earlier=earlier)
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
              earlier=()):
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)


@register
class Bohb(SearcherChoice):
    name = "bohb"
    help = "TuneBOHB"
    extra = BOHB_EXTRA
    works_with = ("bohb",)
    why_only = "TuneBOHB and HyperBandForBOHB only work as a pair"
    default_scheduler = "bohb"

    def build(self, seed, max_concurrent, num_samples, scheduler, first_rung, told_metric,
              earlier=()):
        from ray.tune.search.bohb import TuneBOHB
        # its own limit counts running trials only: a trial HyperBand paused at a rung
        # frees its place (a ConcurrencyLimiter would count it and stall the bracket)
        return TuneBOHB(seed=seed, max_concurrent=max_concurrent)


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
