"""The Ray Tune search itself: searcher, scheduler, the Tuner (new or restored), Ctrl-C.

Searchers (``--search-alg``):

* ``optuna``: Optuna's independent TPE (Bergstra et al. 2011; one density per key, seeded,
  random for the first trials) behind a ``ConcurrencyLimiter``;
* ``optuna-mv``: Optuna's multivariate TPE (Falkner et al. 2018: one joint density over
  the keys, so interacting keys such as lr x batch size are modelled together); with
  either, a proposal that repeats a finished trial's configuration gets that trial's
  score without training (searchers.py);
* ``random``: Ray's random search (``BasicVariantGenerator``), also the population of
  PBT / PB2;
* ``bohb``: ``TuneBOHB`` (Falkner et al. 2018: TPE-like kernel densities per budget).

Schedulers (``--scheduler``), all on examples seen, comparing trials on ``--rung-metric``
(schedulers.py):

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

``bohb`` only works as a pair (the scheduler tells the searcher which trials are
paused); PBT / PB2 take their population from Ray's random search.  Each trial keeps its
2 best checkpoints by the objective and its latest (what a finished search keeps:
retention.py); a trial whose worker died is retried from its last checkpoint
(``FailureConfig``).  Actors are reused between trials (``reuse_actors``, not with
Hyperband-for-BOHB and PBT / PB2, which pause trials in turns, nor on a cluster joined
with ``--address``; see trainable.py for how a stopped trial's thread ends then).
"""

from __future__ import annotations

import importlib
import signal
from typing import Any, Sequence

from mtbert.errors import ConfigError
from mtbert.tune.budgets import Budget
from mtbert.tune.records import MODE, OBJECTIVE, rung_metric_keys

#: the default search: promoting ASHA (deciding on records.default_rung_metric) + Optuna's
#: independent TPE, what bench/search_efficiency.py ranks first among the pairs it measured
#: over 3 seeds (docs/bench/search_efficiency.md)
DEFAULT_SCHEDULER = "asha-promote"
DEFAULT_SEARCHER = "optuna"
SCHEDULERS = ("asha", "asha-promote", "fifo", "bohb", "pbt", "pb2")
SEARCHERS = ("optuna", "optuna-mv", "random", "bohb")
#: schedulers that perturb running trials (they need evaluations at a fixed interval)
POPULATION_SCHEDULERS = ("pbt", "pb2")
#: schedulers that pause trials in turns and resume them from their checkpoints (no actor
#: reuse).  ``asha-promote`` pauses too, and reuses actors: a trial pauses where a new or
#: promoted one takes its place (bench: 9 trials 226 -> 203 s with reuse, the same decisions)
PAUSING_SCHEDULERS = ("bohb", *POPULATION_SCHEDULERS)
#: what PBT / PB2 perturb, where the space samples it; other keys are sampled once
MUTABLE_KEYS = ("lr", "dropout", "smart_lambda_sst", "smart_lambda_qqp", "smart_lambda_sts")
#: a choice -> the modules it needs beyond the core install, and the extra that has them
OPTIONAL_PACKAGES = {"bohb": (("hpbandster", "ConfigSpace"), "bohb"),
                     "pb2": (("sklearn",), "pb2")}


def trial_name(trial) -> str:
    """Trial names and folder names: ``trial_<id>``."""
    return f"trial_{trial.trial_id}"


# ---------------------------------------------------------------------- choices
def resolve_scheduler(scheduler: str | None, search_alg: str | None) -> str:
    """``--scheduler``, or (left out) the one ``--search-alg`` works with: ``bohb`` for
    TuneBOHB, Ray's ``asha`` for random search (promoting ASHA's searcher must free a
    paused trial's place, which Ray's random search cannot), else the default."""
    if scheduler is not None:
        return scheduler
    return {"bohb": "bohb", "random": "asha"}.get(search_alg or "", DEFAULT_SCHEDULER)


def resolve_search_alg(scheduler: str, search_alg: str | None) -> str:
    """The searcher for ``--scheduler`` (``--search-alg`` left out: the one it works with),
    or ConfigError naming both flags for a pair that does not work together."""
    paired = {"bohb": "bohb", "pbt": "random", "pb2": "random"}.get(scheduler)
    if scheduler == "asha-promote" and search_alg in ("random", "bohb"):
        raise ConfigError(f"--scheduler asha-promote needs --search-alg optuna or optuna-mv "
                          f"(or leave --search-alg out), got --search-alg {search_alg}: its "
                          "searcher must free a paused trial's place")
    if search_alg is None:
        return paired or DEFAULT_SEARCHER
    if paired and search_alg != paired:
        why = ("HyperBandForBOHB and TuneBOHB only work as a pair" if scheduler == "bohb"
               else "population-based training perturbs trials Ray's random search started")
        raise ConfigError(f"--scheduler {scheduler} needs --search-alg {paired} (or leave "
                          f"--search-alg out), got --search-alg {search_alg}: {why}")
    if search_alg == "bohb" and scheduler != "bohb":
        raise ConfigError(f"--search-alg bohb needs --scheduler bohb, got --scheduler "
                          f"{scheduler}: TuneBOHB and HyperBandForBOHB only work as a pair")
    return search_alg


def check_optional_packages(scheduler: str, search_alg: str) -> None:
    """The packages the chosen scheduler and searcher import are installed; else one
    ConfigError naming the extra to install (before Ray starts)."""
    for flag, choice in (("--scheduler", scheduler), ("--search-alg", search_alg)):
        modules, extra = OPTIONAL_PACKAGES.get(choice, ((), ""))
        missing = []
        for module in modules:
            try:
                importlib.import_module(module)
            except ImportError:
                missing.append(module)
        if missing:
            raise ConfigError(f"{flag} {choice} needs {', '.join(modules)} (missing: "
                              f"{', '.join(missing)}): pip install 'mtbert-tune[{extra}]'")


def mutations(space, scheduler: str) -> dict[str, Any]:
    """What PBT / PB2 perturb: each of :data:`MUTABLE_KEYS` the space samples, over the
    space's own values -- PBT: the list of choices (it moves to a neighbour) or the Ray
    domain (x 0.8 / 1.2, clipped back into the range by :func:`clip_to_space`); PB2:
    ``[low, high]`` of the ranges (its GP bandit is continuous; choices stay as sampled)."""
    out: dict[str, Any] = {}
    for key in MUTABLE_KEYS:
        p = space.searched.get(key)
        if p is None or p.dist == "randint":
            continue
        if scheduler == "pb2":
            if p.dist != "choice":
                out[key] = [p.low, p.high]
        else:
            out[key] = sorted(p.choices) if p.dist == "choice" else p.to_tune()
    if not out:
        what = "as a range" if scheduler == "pb2" else ""
        raise ConfigError(f"--scheduler {scheduler}: the space {space.name} samples none of "
                          f"{', '.join(MUTABLE_KEYS)} {what}: nothing to perturb (use "
                          "--scheduler asha, or a space that searches them)".replace("  ", " "))
    return out


class _ClipToSpace:
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


def build_searcher(name: str, seed: int, max_concurrent: int, num_samples: int,
                   scheduler: str = "asha", first_rung: int = 0,
                   rung_metric: str | Sequence[str] = OBJECTIVE):
    """The ``--search-alg``; under ``asha-promote`` (Optuna only) behind a
    RunningTrialsLimiter told each trial's ``rung_metric`` (the first rung's, where one per
    rung) at ``first_rung`` examples."""
    if name == "random":
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)
    if name == "bohb":
        from ray.tune.search.bohb import TuneBOHB
        # its own limit counts running trials only: a trial HyperBand paused at a rung
        # frees its place (a ConcurrencyLimiter would count it and stall the bracket)
        return TuneBOHB(seed=seed, max_concurrent=max_concurrent)
    import optuna
    from ray.tune.search import ConcurrencyLimiter

    from mtbert.tune.searchers import DistinctOptunaSearch, RunningTrialsLimiter
    startup = max(2, min(10, num_samples // 3))
    # explicit: Optuna 5 makes TPE multivariate by default, Optuna 4 did not.  group=False:
    # every trial samples the same keys (static spaces), where the group decomposition is
    # one group, i.e. plain multivariate TPE (and an ExperimentalWarning)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup,
                                         multivariate=name == "optuna-mv", group=False)
    if scheduler == "asha-promote":
        return RunningTrialsLimiter(DistinctOptunaSearch(sampler=sampler), max_concurrent,
                                    first_rung=first_rung,
                                    told_metric=_per_rung(rung_metric)[0])
    return ConcurrencyLimiter(DistinctOptunaSearch(sampler=sampler),
                              max_concurrent=max_concurrent)


def build_scheduler(name: str, budget: Budget, space=None,
                    rung_metric: str | Sequence[str] = OBJECTIVE, workers: int = 1,
                    num_samples: int = 0, last_leg_cpus: float = 0.0):
    """The ``--scheduler``, comparing trials on ``rung_metric`` (a value of RUNG_METRICS;
    ``asha-promote`` also takes one per decision rung, the last for the later ones);
    ``asha-promote`` promotes into a free one of ``workers`` places, at most synchronous
    halving's share of ``num_samples`` per rung, and resumes the trial of its last
    promotion with ``last_leg_cpus`` CPUs (0: unchanged)."""
    from ray.tune import schedulers
    metrics = _per_rung(rung_metric)
    if len(metrics) > 1 and name != "asha-promote":
        raise ConfigError(f"--rung-metric {','.join(metrics)}: one metric per rung needs "
                          f"--scheduler asha-promote, got --scheduler {name}")
    if name == "asha-promote":
        from mtbert.tune.schedulers import PromotingASHA
        return PromotingASHA(budget, metrics, workers, num_samples or budget.num_samples,
                             last_leg_cpus)
    rung_metric = metrics[0]
    if name == "fifo":
        return schedulers.FIFOScheduler()
    if name == "bohb":
        from mtbert.tune.schedulers import HyperBandOnRungs
        return HyperBandOnRungs(budget, rung_metric)
    if name in POPULATION_SCHEDULERS:
        from mtbert.tune.schedulers import PB2ToTheEnd, PBTToTheEnd
        found = mutations(space, name)
        # synch: the population is compared at the same examples seen.  With more trials
        # than run at once they take turns; asynchronous PBT then compares the trial
        # reporting with the others' earlier scores, which it nearly always beats (in a
        # smoke search it never exploited once)
        common = dict(budget=budget, metric=rung_metric, quantile_fraction=0.25,
                      log_config=True, synch=True)
        if name == "pb2":
            return PB2ToTheEnd(hyperparam_bounds=found, **common)
        bounds = {k: (p.low, p.high) for k, p in space.searched.items()
                  if k in found and p.dist != "choice"}
        return PBTToTheEnd(hyperparam_mutations=found, resample_probability=0.25,
                           custom_explore_fn=_ClipToSpace(bounds), **common)
    from mtbert.tune.schedulers import ASHAOnExamples
    return ASHAOnExamples(budget, rung_metric)


def _per_rung(rung_metric: str | Sequence[str]) -> tuple[str, ...]:
    """One result key, or one per decision rung, as a tuple."""
    return (rung_metric,) if isinstance(rung_metric, str) else tuple(rung_metric)


def last_leg_cpus(settings, max_concurrent: int) -> float:
    """The CPUs ``asha-promote`` gives the trial it promotes last
    (docs/bench/search_efficiency.md, "Promoting ASHA"): every place's, on one machine with
    CPU trials; on a cluster (``--address``) a trial's CPUs stay on one node and GPU trials
    gain nothing from threads: 0, unchanged."""
    if settings.address or settings.gpus_per_trial:
        return 0.0
    return max_concurrent * settings.cpus_per_trial


def reuses_actors(scheduler: str, address: str | None) -> bool:
    """Whether trials reuse Ray's actors (worker processes with torch and the encoder
    loaded).  Not with the schedulers that pause trials in turns (PAUSING_SCHEDULERS):
    a PBT smoke search (2 trials taking turns on one slot) hung in a clean-clone CI run
    with actors reused, every actor gone and Tune waiting on one.  Not on a cluster
    (``--address``), where a node can die: a trial about to start on a cached actor of a
    node just lost was retried on that same dead actor, twice in 40 ms
    (ActorUnavailableError), and errored with ``--max-failures`` spent."""
    return scheduler not in PAUSING_SCHEDULERS and not address


def build_tuner(settings, trainable, callbacks: list[Any], max_concurrent: int):
    """(A new Tuner for the search, its scheduler), or (the restored one on ``--resume``,
    None: Ray unpickles its own copy of the scheduler)."""
    from ray import tune
    location = settings.location
    param_space = settings.space.param_space()
    if settings.resume and tune.Tuner.can_restore(location.ray_experiment):
        print(f"[tune] resuming {location.ray_experiment} (Tuner.restore)", flush=True)
        return tune.Tuner.restore(location.ray_experiment, trainable=trainable,
                                  resume_unfinished=True, resume_errored=False,
                                  param_space=param_space), None
    scheduler = build_scheduler(settings.scheduler, settings.budget, settings.space,
                                rung_metric_keys(settings.rung_metric), max_concurrent,
                                settings.num_samples, last_leg_cpus(settings, max_concurrent))
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE, mode=MODE, num_samples=settings.num_samples,
            # PBT's population is every trial at once (Ray runs as many as fit and pauses
            # them in turn); a searcher's limit would shrink it to the trials running
            search_alg=build_searcher(
                settings.search_alg, settings.seed,
                0 if settings.scheduler in POPULATION_SCHEDULERS else max_concurrent,
                settings.num_samples, settings.scheduler, settings.budget.grace_period,
                rung_metric_keys(settings.rung_metric)),
            scheduler=scheduler,
            reuse_actors=reuses_actors(settings.scheduler, settings.address),
            trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(
            name=settings.experiment, storage_path=location.ray_storage,
            # PBT / PB2 keep every checkpoint while they run: a trial restores another's
            # latest checkpoint some time after PBT chose it, and by then a top-2 rule can
            # have deleted it (Ray warns so); --keep-checkpoints prunes them at the end
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=None if settings.scheduler in POPULATION_SCHEDULERS else 2,
                checkpoint_score_attribute=OBJECTIVE, checkpoint_score_order=MODE),
            failure_config=tune.FailureConfig(max_failures=settings.max_failures),
            callbacks=callbacks)), scheduler


class InterruptWatch:
    """Whether ``Tuner.fit()`` ended on Ctrl-C (SIGINT) rather than with the search done.

    Tune installs its own SIGINT handler for the run and, on the first stop signal, puts
    back the handler that was there before (``ray.tune.tune._setup_signal_catching``); the
    fit then returns normally.  This watch installs a marker handler first: finding the
    marker in place after the fit means Tune was stopped by a signal.  A second Ctrl-C
    while Tune winds down reaches the marker, which stops hard (KeyboardInterrupt)."""

    def __enter__(self) -> "InterruptWatch":
        self._previous = signal.getsignal(signal.SIGINT)
        self.interrupted = False

        def marker(signum, frame):
            raise KeyboardInterrupt
        self._marker = marker
        signal.signal(signal.SIGINT, marker)
        return self

    def __exit__(self, *exc) -> None:
        self.interrupted = signal.getsignal(signal.SIGINT) is self._marker
        signal.signal(signal.SIGINT, self._previous)
