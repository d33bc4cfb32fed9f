"""The Ray Tune search itself: the Tuner (new or restored) with the chosen searcher and
scheduler (choices.py: what each ``--search-alg`` and ``--scheduler`` means and builds),
and Ctrl-C.

Each trial keeps its 2 best checkpoints by the objective and its latest (what a finished
search keeps: retention.py); a trial whose worker died is retried from its last
checkpoint (``FailureConfig``).  Actors are reused between trials (``reuse_actors``, not with
Hyperband-for-BOHB and PBT / PB2, which pause trials in turns, nor on a cluster joined
with ``--address``; see trainable.py for how a stopped trial's thread ends then).
"""

from __future__ import annotations

import signal
from typing import Any, Sequence

from mtbert.core.errors import ConfigError
from mtbert.tune.search.budgets import Budget
from mtbert.tune.search.choices import SCHEDULERS, scheduler_choice, searcher_choice
from mtbert.tune.trial.objective import MODE, OBJECTIVE, rung_metric_keys


#: the promoting scheduler's decisions, one JSON line each, in the experiment folder
RUNG_DECISIONS_FILE = "rung_decisions.jsonl"


def trial_name(trial) -> str:
    """Trial names and folder names: ``trial_<id>``."""
    return f"trial_{trial.trial_id}"


def build_searcher(name: str, seed: int, max_concurrent: int, num_samples: int,
                   scheduler: str = "asha", first_rung: int = 0,
                   rung_metric: str | Sequence[str] = OBJECTIVE, earlier=(), points=()):
    """The ``--search-alg``; under a scheduler that frees paused trials' places
    (``asha-promote``; Optuna only) behind a RunningTrialsLimiter told each trial's
    ``rung_metric`` (the first rung's, where one per rung) at ``first_rung`` examples.
    ``earlier``: extension.EarlierPoint it is told first (``--extend``:
    extension.points_for_searcher); ``points``: configurations it proposes first, in
    order (``--points``: Ray's ``points_to_evaluate``)."""
    return searcher_choice(name).build(seed, max_concurrent, num_samples,
                                       scheduler_choice(scheduler), first_rung,
                                       _per_rung(rung_metric)[0], earlier=list(earlier),
                                       points=[dict(p) for p in points])


def build_scheduler(name: str, budget: Budget, space=None,
                    rung_metric: str | Sequence[str] = OBJECTIVE, workers: int = 1,
                    num_samples: int = 0, last_leg_cpus: float = 0.0):
    """The ``--scheduler``, comparing trials on ``rung_metric`` (a value of RUNG_METRICS;
    ``asha-promote`` also takes one per decision rung, the last for the later ones);
    ``asha-promote`` promotes into a free one of ``workers`` places, at most synchronous
    halving's share of ``num_samples`` per rung, and resumes the trial of its last
    promotion with ``last_leg_cpus`` CPUs (0: unchanged)."""
    choice = scheduler_choice(name)
    metrics = _per_rung(rung_metric)
    if len(metrics) > 1 and not choice.per_rung_metrics:
        takes = " or ".join(n for n, c in SCHEDULERS.items() if c.per_rung_metrics)
        raise ConfigError(f"--rung-metric {','.join(metrics)}: one metric per rung needs "
                          f"--scheduler {takes}, got --scheduler {name}")
    return choice.build(budget, space, metrics, workers, num_samples, last_leg_cpus)


def _per_rung(rung_metric: str | Sequence[str]) -> tuple[str, ...]:
    """One result key, or one per decision rung, as a tuple."""
    return (rung_metric,) if isinstance(rung_metric, str) else tuple(rung_metric)


def last_leg_cpus(settings, max_concurrent: int) -> float:
    """The CPUs ``asha-promote`` gives the trial it promotes last
    (docs/bench/search_efficiency.md, "Promoting ASHA"): every place's, on one machine with
    CPU trials; on a cluster (``--address``) a trial's CPUs stay on one node and GPU trials
    gain nothing from threads, nor fused trials (their trainer actor trains): 0, unchanged."""
    if settings.address or settings.gpus_per_trial or getattr(settings, "fused", False):
        return 0.0
    return max_concurrent * settings.cpus_per_trial


def reuses_actors(scheduler: str, address: str | None) -> bool:
    """Whether trials reuse Ray's actors (worker processes with torch and the encoder
    loaded): not with the schedulers that pause trials in turns (Hyperband for BOHB, PBT,
    PB2: their choice's ``reuses_actors``), where Tune came to wait on an actor gone; not
    on a cluster (``--address``), where a trial about to start on a cached actor of a lost
    node is retried on that dead actor until its ``--max-failures`` are spent
    (docs/search.md, "Ray workers")."""
    return scheduler_choice(scheduler).reuses_actors and not address


def build_tuner(settings, trainable, callbacks: list[Any], max_concurrent: int,
                earlier: Sequence = ()):
    """(A new Tuner for the search, its scheduler), or (the restored one on ``--resume``,
    None: Ray unpickles its own copy of the scheduler).  ``earlier``: the points its
    searcher is told first (``--extend``: extension.points_for_searcher)."""
    from ray import tune
    location = settings.location
    param_space = settings.space.param_space()
    if settings.resume and tune.Tuner.can_restore(location.ray_experiment):
        print(f"[tune] resuming {location.ray_experiment} (Tuner.restore)", flush=True)
        return tune.Tuner.restore(location.ray_experiment, trainable=trainable,
                                  resume_unfinished=True, resume_errored=False,
                                  param_space=param_space), None
    population = scheduler_choice(settings.scheduler).population
    scheduler = build_scheduler(settings.scheduler, settings.budget, settings.space,
                                rung_metric_keys(settings.rung_metric), max_concurrent,
                                settings.num_samples, last_leg_cpus(settings, max_concurrent))
    if hasattr(scheduler, "decisions_file"):  # (kept through a --resume: Ray pickles it)
        scheduler.decisions_file = location.exp_dir / RUNG_DECISIONS_FILE
        scheduler.decisions_file.unlink(missing_ok=True)  # a new search under an old name
    return make_tuner(
        trainable, param_space, name=settings.experiment, storage_path=location.ray_storage,
        num_samples=settings.num_samples,
        # PBT's population is every trial at once (Ray runs as many as fit and pauses
        # them in turn); a searcher's limit would shrink it to the trials running
        search_alg=build_searcher(
            settings.search_alg, settings.seed, 0 if population else max_concurrent,
            settings.num_samples, settings.scheduler, settings.budget.grace_period,
            rung_metric_keys(settings.rung_metric), earlier, settings.points),
        scheduler=scheduler, reuse_actors=reuses_actors(settings.scheduler, settings.address),
        # every checkpoint is kept while the search runs (--keep-checkpoints prunes them
        # at the end): a checkpoint a top-2 rule deletes can still be the one Ray's newest
        # experiment snapshot names as a trial's latest (snapshots are up to a second
        # old), and a --resume after the driver died then cannot restore that trial (seen
        # in CI: "Could not recover from checkpoint as it does not exist on storage
        # anymore", three failures, the trial errored); PBT / PB2 restore another trial's
        # checkpoint some time after choosing it, which such a rule can delete too
        num_to_keep=None, max_failures=settings.max_failures,
        callbacks=callbacks), scheduler


def make_tuner(trainable, param_space: dict, *, name: str, storage_path: str,
               num_samples: int, search_alg=None, scheduler=None, reuse_actors: bool = False,
               num_to_keep: int | None = 2, max_failures: int = 0,
               callbacks: list[Any] | None = None, **run_config: Any):
    """The one way a Tuner is made (the driver's, and the benches' that time it): trials
    named ``trial_<id>`` and compared on the objective, each keeping its ``num_to_keep``
    best checkpoints by it (None: all), its result logs kept whole when it starts again
    (result_logs.py); ``run_config``: more of Ray's RunConfig (``verbose``, ``stop``)."""
    from ray import tune

    from mtbert.tune.search.result_logs import result_loggers  # deferred: ray
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE, mode=MODE, num_samples=num_samples, search_alg=search_alg,
            scheduler=scheduler, reuse_actors=reuse_actors,
            trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(
            name=name, storage_path=storage_path,
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=num_to_keep, checkpoint_score_attribute=OBJECTIVE,
                checkpoint_score_order=MODE),
            failure_config=tune.FailureConfig(max_failures=max_failures),
            callbacks=[*(callbacks or []), *result_loggers()], **run_config))


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
