"""The Ray Tune search itself: searcher, scheduler, the Tuner (new or restored), Ctrl-C.

* searcher: Optuna TPE (Bergstra et al. 2011; seeded, random for the first trials)
  behind a ``ConcurrencyLimiter``, or Ray's random search;
* scheduler: ASHA (Li et al. 2020) on examples seen -- stops the weak trials at the
  budget's rungs -- or FIFO (every trial trains its whole budget);
* each trial keeps its 2 best checkpoints by the objective and its latest (what a
  finished search keeps: retention.py); a trial whose worker died
  is retried from its last checkpoint (``FailureConfig``).
"""

from __future__ import annotations

import signal
from typing import Any

from mtbert.tune.budgets import Budget
from mtbert.tune.records import MODE, OBJECTIVE


def trial_name(trial) -> str:
    """Trial names and folder names: ``trial_<id>``."""
    return f"trial_{trial.trial_id}"


def build_searcher(name: str, seed: int, max_concurrent: int, num_samples: int):
    if name == "random":
        from ray.tune.search.basic_variant import BasicVariantGenerator
        return BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent)
    import optuna
    from ray.tune.search import ConcurrencyLimiter
    from ray.tune.search.optuna import OptunaSearch
    startup = max(2, min(10, num_samples // 3))
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)
    return ConcurrencyLimiter(OptunaSearch(sampler=sampler), max_concurrent=max_concurrent)


def build_scheduler(name: str, budget: Budget):
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
    if name == "fifo":
        return FIFOScheduler()
    return ASHAScheduler(time_attr="examples_seen", max_t=budget.max_examples,
                         grace_period=budget.grace_period,
                         reduction_factor=budget.reduction_factor)


def build_tuner(settings, trainable, callbacks: list[Any], max_concurrent: int):
    """A new Tuner for the search, or the restored one on ``--resume``."""
    from ray import tune
    location = settings.location
    param_space = settings.space.param_space()
    if settings.resume and tune.Tuner.can_restore(location.ray_experiment):
        print(f"[tune] resuming {location.ray_experiment} (Tuner.restore)", flush=True)
        return tune.Tuner.restore(location.ray_experiment, trainable=trainable,
                                  resume_unfinished=True, resume_errored=False,
                                  param_space=param_space)
    return tune.Tuner(
        trainable, param_space=param_space,
        tune_config=tune.TuneConfig(
            metric=OBJECTIVE, mode=MODE, num_samples=settings.num_samples,
            search_alg=build_searcher(settings.search_alg, settings.seed, max_concurrent,
                                      settings.num_samples),
            scheduler=build_scheduler(settings.scheduler, settings.budget),
            trial_name_creator=trial_name, trial_dirname_creator=trial_name),
        run_config=tune.RunConfig(
            name=settings.experiment, storage_path=location.ray_storage,
            checkpoint_config=tune.CheckpointConfig(
                num_to_keep=2, checkpoint_score_attribute=OBJECTIVE,
                checkpoint_score_order=MODE),
            failure_config=tune.FailureConfig(max_failures=settings.max_failures),
            callbacks=callbacks))


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
