"""One search, top to bottom: ``python tune_driver.py --space NAME`` (see :mod:`.cli`).

settings (checked before anything starts) -> load and tokenise the data once -> Ray
(start or join; how many trials at once; with ``--fuse`` the trainer actors) -> experiment
folder and MLflow parent run (:mod:`.experiment`) -> ``Tuner.fit()`` (one function
trainable per trial, fed from Ray's object store) -> the finish
(:mod:`.results.finish`: collect the trials, the finalists' best checkpoints predict,
ensemble, report plots, summary, MLflow, upload) -> the closing lines and the exit code.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time

from mtbert.core.config import TrainConfig
from mtbert.core.devices import precision_line
from mtbert.data import load_data
from mtbert.tune.experiment import start_experiment
from mtbert.tune.infra.cluster import dashboard_lines, plan_resources, ray_for_search
from mtbert.tune.infra.mps import MPS_LOG_FOLDER, cuda_mps, local_gpu
from mtbert.tune.infra.outbox import OUTBOX_DIR
from mtbert.tune.infra.tracking import SearchTracker, open_store_early
from mtbert.tune.results.callback import MlflowTrialCallback
from mtbert.tune.results.extension import points_for_searcher
from mtbert.tune.results.finish import finish
from mtbert.tune.results.mlflow_results import ui_links
from mtbert.tune.results.summary import SearchSummary, phases_line
from mtbert.tune.search.tuner import InterruptWatch, build_tuner
from mtbert.tune.settings import SearchSettings, resume_command, space_precisions
from mtbert.tune.trial import work_folders
from mtbert.tune.trial.fused_trainable import train_fused_trial
from mtbert.tune.trial.trainable import train_trial
from mtbert.tune.trial.trainer_pool import TrainerPool


def run(settings: SearchSettings) -> int:
    """Run the search; returns the exit code (0, 1: no trial produced a checkpoint, 130:
    interrupted).  Raises ConfigError for what only Ray can tell (its resources)."""
    phases = {"started_at": time.time()}  # where the command's wall time goes (summary)
    data = load_search_data(settings)
    phases["data_s"] = time.time() - phases["started_at"]
    settings = settings.resolved_for(sum(data.train_sizes().values()))
    # MPS outside Ray: its daemon stops only once Ray's workers, its clients, are gone
    mps_logs = settings.location.exp_dir / MPS_LOG_FOLDER / time.strftime(
        "%Y%m%d-%H%M%S", time.gmtime(phases["started_at"]))  # one folder per run (--resume)
    have_gpu = local_gpu(settings.address)
    settings = dataclasses.replace(settings, fused=settings.fuses(have_gpu))
    mps_choice = "off" if settings.fused else settings.mps  # no MPS on the fused path
    open_store_early(settings.mlflow_uri)  # its tables made while Ray starts
    with cuda_mps(mps_choice, settings.address, settings.gpus_per_trial,
                  mps_choice != "off" and have_gpu, mps_logs) as mps, \
            ray_for_search(settings.address, mps.worker_env):
        for line in dashboard_lines():
            print(f"[tune] {line}", flush=True)
        plan = plan_resources(settings.cpus_per_trial, settings.gpus_per_trial,
                              settings.max_concurrent, settings.address, settings.base["model"])
        settings = settings.with_resources(dataclasses.replace(plan, mps=mps.note))
        max_concurrent = plan.trials_at_once
        threads = "; CPU threads grow into free CPUs" if (
            settings.trial_threads == "grow" and not plan.gpus_per_trial) else ""
        pool = None
        if settings.fused:
            settings, pool = start_fused(settings, data, max_concurrent)
        else:
            print(f"[tune] {max_concurrent} trials at once, each {plan.cpus_per_trial:g} CPU "
                  f"and {plan.gpus_per_trial:g} GPU ({plan.rule}); CUDA MPS {mps.note}{threads}",
                  flush=True)
        print(f"[tune] trials' {trial_precision_line(settings, plan.gpus_per_trial)}", flush=True)
        tracker, parent_run = start_experiment(settings, max_concurrent)
        phases["tune_started_at"] = time.time()
        phases["setup_s"] = phases["tune_started_at"] - phases["started_at"] - phases["data_s"]
        try:
            grid, interrupted = fit(settings, data, tracker, max_concurrent,
                                    pool.names if pool else ())
            if pool:
                print(f"[tune] {pool.placement_line()}", flush=True)
        finally:
            if pool:
                pool.stop()
        phases["tune_ended_at"] = time.time()
        phases["tune_s"] = phases["tune_ended_at"] - phases["tune_started_at"]
        summary = finish(settings, data, grid, tracker, parent_run, interrupted, phases)
        return print_outcome(settings, summary)


def trial_precision_line(settings: SearchSettings, gpus_per_trial: float) -> str:
    """What the trials compute in on this machine's trials' device (each trial reports
    its own: ``train/bf16``; on a cluster the workers' devices decide)."""
    import torch

    cuda = gpus_per_trial > 0 and torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    # the space's fixed value or choices, else the base config's (auto by default)
    return "; ".join(precision_line(p, device) for p in
                     space_precisions(settings.space, settings.base.get("precision", "auto")))


def load_search_data(settings: SearchSettings):
    """The data every trial trains on, read and tokenised once (trials get it from Ray's
    object store); ConfigError/DataError name the file and line."""
    print(f"[tune] loading and tokenising {settings.base['data_dir']} once "
          f"(model {settings.base['model']}) ...", flush=True)
    return load_data(TrainConfig.from_dict(settings.base, source="driver"))


#: CPUs of a fused trial's thin trial (it forwards reports; its trainer trains)
THIN_TRIAL_CPUS = 0.25


def start_fused(settings: SearchSettings, data, max_concurrent: int):
    """The fused path: one trainer actor per GPU of the cluster (one with one CPU where it
    has none), started now; the settings with each thin trial's CPUs; the start line."""
    import ray

    resources = ray.cluster_resources()
    gpus = int(resources.get("GPU", 0)) if settings.gpus_per_trial != 0 else 0
    count, cpus = max(1, gpus), 1.0
    thin = min(THIN_TRIAL_CPUS, max(resources.get("CPU", 1.0) - count * cpus, 0.0)
               / max(1, max_concurrent))
    settings = dataclasses.replace(settings, cpus_per_trial=thin)
    pool = TrainerPool.start(data, count, cpus, 1.0 if gpus else 0.0,
                             threads=0 if gpus else int(cpus))
    where = f"one per GPU ({count})" if gpus else "1 on the CPUs (1 CPU)"
    print(f"[tune] fused: {max_concurrent} trials at once, each a thin trial of {thin:g} CPU "
          f"forwarding the reports of trainer actors, {where}; each trainer fuses the "
          f"trials of one structure into a group (up to {max_concurrent} trials per "
          "group); CUDA MPS off", flush=True)
    return settings, pool


def fit(settings: SearchSettings, data, tracker: SearchTracker, max_concurrent: int,
        trainers: tuple[str, ...] = ()):
    """``Tuner.fit()`` (``trainers``: the fused path's trainer actors' names); returns Ray's
    ResultGrid and whether Ctrl-C stopped it."""
    from ray import tune

    # on resume: trials that had ended before the driver died must not train again;
    # Ray replays them from its snapshot, where such a trial may have no result yet
    ended = tracker.freeze_ended() if settings.resume else {}
    if ended:
        os.environ["TUNE_DISABLE_STRICT_METRIC_CHECKING"] = "1"
    if trainers:  # thin trials; the data is in the trainers already
        trainable = tune.with_resources(
            tune.with_parameters(train_fused_trial, base=settings.base, ended=ended,
                                 trainers=trainers),
            {"cpu": settings.cpus_per_trial, "gpu": 0})
    else:
        trainable = tune.with_resources(
            tune.with_parameters(train_trial, data=data, base=settings.base, ended=ended,
                                 grow_threads=settings.trial_threads == "grow"),
            {"cpu": settings.cpus_per_trial, "gpu": settings.gpus_per_trial})
    budget = settings.budget
    callback = MlflowTrialCallback(tracker, settings.base, budget.max_examples, budget.rungs())
    tuner, _ = build_tuner(settings, trainable, [callback], max_concurrent,
                                   points_for_searcher(settings))
    with InterruptWatch() as watch:
        grid = tuner.fit()
    # Ray ends stopped and paused trials' workers before their clean-up runs
    work_folders.sweep(wait_s=5.0)
    return grid, watch.interrupted


def print_outcome(settings: SearchSettings, summary: SearchSummary) -> int:
    """The end-of-search table and where things are; returns the exit code."""
    location, counts = settings.location, summary.counts
    print()
    print(summary.console_table())
    print(f"[tune] summary: {location.public(location.exp_dir / 'summary.json')}  |  "
          f"{location.public(location.exp_dir / 'summary.md')}")
    if summary.phases:
        print(f"[tune] {phases_line(summary.phases)}")
    refs = summary.mlflow
    for line in ui_links(settings.mlflow_uri, refs.experiment_id, refs.parent_run_id,
                         refs.runs_view):
        print(f"[tune] MLflow {line}")
    if summary.mlflow_unsent:
        unsent = summary.mlflow_unsent
        print(f"warning: {unsent['operations']} MLflow writes had not reached "
              f"{settings.mlflow_uri} when the search ended (they wait in "
              f"{settings.location.exp_dir / OUTBOX_DIR}); send them once it answers: "
              f"{unsent['command']}", file=sys.stderr)
    if summary.interrupted:
        print(f"[tune] the search was interrupted: {counts.interrupted} trials did not "
              f"finish and {counts.not_started} had not started; the summary covers what "
              f"ran. Continue it with: {resume_command(settings)}", file=sys.stderr)
    elif counts.not_started:
        # Ray snapshots its searcher apart from its trial list: a trial suggested in the
        # instant before a driver crash can be counted by the restored searcher and yet be
        # missing from the restored trials, so the resumed search ends that many short
        print(f"warning: {counts.not_started} of the {settings.num_samples} trials asked for "
              f"never ran (a trial suggested just before the driver died is lost from Ray's "
              f"snapshot); start another search for more", file=sys.stderr)
    if summary.best_trial is None:
        print(f"error: no trial produced a checkpoint ({counts.errored} errored); see "
              f"{location.exp_dir / 'summary.md'}", file=sys.stderr)
        return 1
    return 130 if summary.interrupted else 0
