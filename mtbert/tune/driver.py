"""One search, top to bottom: ``python tune_driver.py --space NAME`` (see :mod:`.cli`).

settings (checked before anything starts) -> load and tokenise the data once -> Ray
(start or join; how many trials at once) -> experiment folder and MLflow parent run ->
``Tuner.fit()`` (one function trainable per trial, fed from Ray's object store) ->
collect the trials -> the finalists' best checkpoints predict -> ensemble -> report
plots -> summary -> MLflow -> upload (URI storage).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

from mtbert.core.atomic import atomic_write_text
from mtbert.core.config import TrainConfig
from mtbert.data import load_data
from mtbert.tune.results import finalists as fin
from mtbert.tune.trial import work_folders
from mtbert.tune.results.callback import MlflowTrialCallback, close_unended_runs
from mtbert.tune.results.extension import (TRIALS_FILE, KnownTrial, points_for_searcher,
                                           searcher_told_line, trials_document)
from mtbert.tune.infra.cluster import dashboard_lines, plan_resources, ray_for_search
from mtbert.tune.infra.location import STAGED_CHECKPOINTS, reset_staging
from mtbert.tune.results.mlflow_results import (log_ensemble_run, log_search_metrics,
                                                log_trial_results, note_search, runs_view_key,
                                                share_runs_view, ui_links)
from mtbert.tune.infra.mps import MPS_LOG_FOLDER, cuda_mps, local_gpu
from mtbert.tune.trial.objective import OBJECTIVE, rung_metric_label
from mtbert.tune.results.records import collect_trials, ranked
from mtbert.tune.results.report import write_report
from mtbert.tune.results.retention import keep_what_was_asked
from mtbert.tune.search.tuner import InterruptWatch, build_tuner
from mtbert.tune.saved_settings import SETTINGS_FILE
from mtbert.tune.settings import SearchSettings, resume_command
from mtbert.tune.results.summary import (MlflowRefs, SearchSummary, build_summary,
                                         first_ready_s, phases_line)
from mtbert.tune.infra.tracking import SearchTracker
from mtbert.tune.trial.fused_trainable import train_fused_trial
from mtbert.tune.trial.trainer_pool import TrainerPool
from mtbert.tune.trial.trainable import train_trial


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
        return finish(settings, data, grid, tracker, parent_run, interrupted, phases)


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


def load_search_data(settings: SearchSettings):
    """The data every trial trains on, read and tokenised once (trials get it from Ray's
    object store); ConfigError/DataError name the file and line."""
    print(f"[tune] loading and tokenising {settings.base['data_dir']} once "
          f"(model {settings.base['model']}) ...", flush=True)
    return load_data(TrainConfig.from_dict(settings.base, source="driver"))


def start_experiment(settings: SearchSettings, max_concurrent: int) -> tuple[SearchTracker, str]:
    """The experiment folder with its settings file, and the search's MLflow parent run."""
    location = settings.location
    if location.storage_uri and not settings.resume:
        reset_staging(location.exp_dir)  # a stale staging copy of an earlier search
    location.exp_dir.mkdir(parents=True, exist_ok=True)
    if not settings.resume:
        location.write(SETTINGS_FILE, json.dumps(settings.saved(), indent=2, default=str))
    elif location.exp_uri:  # the local staging copy, for the MLflow artifact below
        (location.exp_dir / SETTINGS_FILE).write_text(location.read(SETTINGS_FILE),
                                                      encoding="utf-8")
    tracker = SearchTracker(settings.mlflow_uri, f"mtbert/{settings.space.name}",
                            location.exp_uri or location.exp_dir, fresh=not settings.resume)
    budget = settings.budget
    tags = {"space": settings.space.name, "budget": budget.name,
            "ray_experiment": location.ray_experiment}
    if settings.mlflow_fallback:
        tags["mlflow_fallback_from"] = settings.mlflow_fallback
    tags.update(extension_tags(settings))
    parent = tracker.start_parent(settings.experiment,
                                  parent_params(settings, max_concurrent), tags)
    tracker.log_artifact(parent, location.exp_dir / SETTINGS_FILE)
    print(f"[tune] experiment {location.ray_experiment}  |  MLflow {settings.mlflow_uri} "
          f"(experiment mtbert/{settings.space.name}, parent run {parent})", flush=True)
    view = share_runs_view(tracker, list(settings.space.searched))
    for line in ui_links(settings.mlflow_uri, tracker.experiment_id(), parent, view):
        print(f"[tune] MLflow {line}", flush=True)
    growth = settings.base["eval_growth"]
    evaluated = (f"evaluated at {budget.eval_every} x {growth:g}^k and the end"
                 if growth > 1 else f"evaluated every {budget.eval_every}")
    print(f"[tune] space {settings.space.name}: {', '.join(settings.space.searched)}; budget "
          f"{budget.name}: {budget.max_examples} examples/trial, {evaluated}, rungs grace "
          f"{budget.grace_period} rf {budget.reduction_factor:g}; scheduler "
          f"{settings.scheduler} on {rung_metric_label(settings.rung_metric)}, searcher "
          f"{settings.search_alg}; {settings.num_samples} "
          f"trials, {max_concurrent} at once", flush=True)
    if settings.extends is not None:
        print(f"[tune] {searcher_told_line(settings)}", flush=True)
    return tracker, parent


def extension_tags(settings: SearchSettings) -> dict[str, str]:
    """The parent run's link to the search it extends (``--extend``): its experiment and
    parent run, and a note MLflow shows on the run's page."""
    earlier = settings.extends
    if earlier is None:
        return {}
    how = (f"{len(earlier.joint)} of its trials are ranked with this search's"
           + (f"; {len(earlier.prior)} told to the searcher as prior only "
              f"({', '.join(earlier.prior_reason)})" if earlier.prior else ""))
    return {"extends": earlier.experiment, "extends_run_id": earlier.parent_run_id or "",
            "mlflow.note.content": f"Extends search {earlier.experiment} (parent run "
                                   f"{earlier.parent_run_id}): {how}."}


def parent_params(settings: SearchSettings, max_concurrent: int) -> dict:
    """The search's settings as the MLflow parent run's params."""
    s, budget = settings, settings.budget
    params = {"space": s.space.name, "budget": budget.name, "num_samples": s.num_samples,
              "max_concurrent": max_concurrent, "cpus_per_trial": s.cpus_per_trial,
              "gpus_per_trial": s.gpus_per_trial, "search_alg": s.search_alg,
              "scheduler": s.scheduler, "rung_metric": rung_metric_label(s.rung_metric),
              "seed": s.seed,
              "split_seed": s.base.get("split_seed", 0), "model": s.base["model"],
              "data_dir": s.base["data_dir"], "ensemble": s.ensemble,
              "ensemble_top_k": s.top_k, "max_failures": s.max_failures,
              "gpus_rule": s.resources.rule if s.resources else "",
              "cuda_mps": s.resources.mps if s.resources else "",
              "trial_threads": s.trial_threads,
              "address": s.address or "local", "objective": OBJECTIVE,
              "storage": s.location.ray_storage, "extends": s.extend or ""}
    params.update({f"budget.{k}": v for k, v in budget.to_dict().items() if k != "name"})
    params.update({f"space.{key}": p.describe() for key, p in s.space.params.items()})
    return params


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


def finish(settings: SearchSettings, data, grid, tracker: SearchTracker, parent_run: str,
           interrupted: bool, phases: dict[str, float] | None = None) -> int:
    """Rank the trials, ensemble the finalists, write the report and summary, log them.
    ``phases``: the wall clock of the command so far (see ``SearchSummary.phases``)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    budget, location = settings.budget, settings.location
    exp_dir = location.exp_dir
    records = collect_trials(grid, budget.max_examples, budget.rungs(),
                             ended=set(tracker.ends.ended()),
                             ended_before=tracker.ends.before_resume(),
                             retries=tracker.ends.retries())
    close_unended_runs(tracker, records)
    inherited = settings.extends.joint_records() if settings.extends else []
    ranking = ranked(records + inherited)
    finalists, left_out = fin.ensemble_candidates(ranking, settings.top_k)
    stored = location.stage_best_checkpoints(records, {r.trial_id for r in finalists})
    location.stage_earlier_weights(finalists)
    preds = fin.predict_finalists(finalists, data, _finalist_device(settings))
    ensemble = None
    if finalists:
        ensemble = fin.build_ensemble([r.trial_id for r in finalists], preds, data,
                                      settings.ensemble)
        fin.write_ensemble_predictions(exp_dir / "ensemble" / "predictions", data, ensemble)
    if ranking and ranking[0].trial_id in preds:
        fin.write_member_predictions(exp_dir / "best_trial" / "predictions", data,
                                     preds[ranking[0].trial_id])
    dev_of = fin.dev_metrics(preds, data)
    report = write_report(records + inherited, settings.space.optuna_distributions(), exp_dir,
                          rungs=budget.rungs())
    refs = MlflowRefs(settings.mlflow_uri, tracker.experiment_id(), parent_run,
                      runs_view=runs_view_key(list(settings.space.searched)))
    summary = build_summary(settings, records, ranking, dev_of, ensemble, report, refs,
                            interrupted, left_out, len(points_for_searcher(settings)))

    log_trial_results(tracker, records, settings.base, data, preds, dev_of)
    if ensemble is not None:
        log_ensemble_run(tracker, f"{settings.experiment}-ensemble", ensemble, settings.top_k,
                         exp_dir / "ensemble" / "predictions", data.split("sst", "val").labels)
    log_search_metrics(tracker, parent_run, summary)
    complete = not summary.interrupted and not summary.counts.not_started
    if complete and settings.keep_checkpoints != "all":
        summary = keep_what_was_asked(settings, summary,
                                      {r.trial_id: r.best_checkpoint for r in finalists})
    summary = dataclasses.replace(summary, mlflow=dataclasses.replace(
        summary.mlflow, ensemble_run_id=tracker.state.get("ensemble_run_id")))
    if location.exp_uri:  # name where the files live for users: the URI, not the staging copy
        summary = summary.with_public_paths(location.public, stored)
    if phases:
        now = time.time()
        ready = first_ready_s(records, phases["tune_started_at"])
        summary = dataclasses.replace(summary, phases={
            **phases, "finish_s": now - phases["tune_ended_at"],
            "total_s": now - phases["started_at"],
            **({"first_ready_s": ready} if ready is not None else {})})
        # the wall time's parts beside the scores, to compare searches in MLflow
        tracker.log_metrics(parent_run, {f"time/{k}": v for k, v in summary.phases.items()
                                         if k.endswith("_s")})
    trials = known_trials(settings, records, summary, complete, stored)
    for name, text in (("summary.json", summary.to_json()), ("summary.md", summary.markdown()),
                       (TRIALS_FILE, trials_document(settings.experiment, parent_run,
                                                     settings.mlflow_uri, complete, trials))):
        atomic_write_text(exp_dir / name, text)
        tracker.log_artifact(parent_run, exp_dir / name)
    note_search(tracker, parent_run, summary.markdown())  # what its MLflow page says
    location.upload(skip=(STAGED_CHECKPOINTS,))
    # an interrupted search's parent run is KILLED until --resume reopens and finishes it
    tracker.finish(parent_run, "KILLED" if summary.interrupted
                   else "FINISHED" if finalists else "FAILED")
    return print_outcome(settings, summary)


def known_trials(settings: SearchSettings, records, summary: SearchSummary,
                 complete: bool, stored: dict[str, str] | None = None) -> list[KnownTrial]:
    """What ``trials.json`` keeps for a later ``--extend``: this search's trials and those
    it inherited, each with where its weights now are -- the exported model
    (``--keep-checkpoints best``), its best checkpoint while training states are kept
    (``all``, or a search that did not finish; on a URI storage the checkpoint's URI,
    ``stored``, not its local staging copy), else none -- named relative to the
    experiment folder (``location.relative``: ``models/<trial>``, ``../first/...``)."""
    states_kept = settings.keep_checkpoints == "all" or not complete
    stored = stored or {}
    relative = settings.location.relative
    own = [KnownTrial(r, settings.experiment, settings.measured_on(), relative(
        summary.models.get(r.trial_id)
        or (stored.get(r.trial_id, r.best_checkpoint) if states_kept else None)))
        for r in records]
    earlier = settings.extends.known if settings.extends else []
    return own + [dataclasses.replace(t, weights=relative(summary.models.get(t.record.trial_id)
                                                          or t.weights)) for t in earlier]


def _finalist_device(settings: SearchSettings) -> str:
    import torch
    return "cuda" if settings.gpus_per_trial > 0 and torch.cuda.is_available() else "cpu"


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
