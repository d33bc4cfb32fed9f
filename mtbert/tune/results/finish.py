"""The end of a search, once Tune's loop is done: the trials ranked, the finalists' best
checkpoints predict and are ensembled, the plots, the summary and ``trials.json`` written,
MLflow told (each trial's results, the ensemble run, the parent run's metrics and page)
and the parent run ended, the kept weights chosen (``--keep-checkpoints``) and the
experiment uploaded (URI storage).  The MLflow writes go through the tracker's outbox:
the end waits for them while MLflow takes them (giving up after ``MTBERT_MLFLOW_FLUSH_S``
seconds without one taken), and where the server has not taken them all the summary says
what is unsent and the command that sends it.  ``settings`` is the command line's
``SearchSettings``."""

from __future__ import annotations

import dataclasses
import time

from mtbert.core.atomic import atomic_write_text
from mtbert.tune.infra.location import STAGED_CHECKPOINTS
from mtbert.tune.infra.outbox import OUTBOX_DIR
from mtbert.tune.infra.tracking import SearchTracker
from mtbert.tune.results import finalists as fin
from mtbert.tune.results.callback import close_unended_runs
from mtbert.tune.results.extension import (TRIALS_FILE, KnownTrial, points_for_searcher,
                                           trials_document)
from mtbert.tune.results.mlflow_results import (log_ensemble_run, log_search_metrics,
                                                log_trial_results, note_search, runs_view_key,
                                                unsent_note)
from mtbert.tune.results.records import collect_trials, ranked
from mtbert.tune.results.report import write_report
from mtbert.tune.results.retention import keep_what_was_asked
from mtbert.tune.results.summary import (MlflowRefs, SearchSummary, build_summary,
                                         first_ready_s, read_rung_decisions)
from mtbert.tune.search.tuner import RUNG_DECISIONS_FILE


def finish(settings, data, grid, tracker: SearchTracker, parent_run: str, interrupted: bool,
           phases: dict[str, float] | None = None) -> SearchSummary:
    """Rank the trials, ensemble the finalists, write the report and summary, log them and
    upload; the summary.  ``phases``: the wall clock of the command so far (see
    ``SearchSummary.phases``)."""
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
    preds = fin.predict_finalists(finalists, data, finalist_device(settings))
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
                            interrupted, left_out, len(points_for_searcher(settings)),
                            read_rung_decisions(exp_dir / RUNG_DECISIONS_FILE))

    log_trial_results(tracker, records, settings.base, data, preds, dev_of)
    if ensemble is not None:
        log_ensemble_run(tracker, f"{settings.experiment}-ensemble", ensemble, settings.top_k,
                         exp_dir / "ensemble" / "predictions", data.split("sst", "val").labels)
    log_search_metrics(tracker, parent_run, summary)
    sent = tracker.flush()  # (the runs it made named in the summary)
    complete = not summary.interrupted and not summary.counts.not_started
    if complete and settings.keep_checkpoints != "all":
        summary = keep_what_was_asked(settings, summary,
                                      {r.trial_id: r.best_checkpoint for r in finalists})
    summary = summary.with_mlflow_runs(tracker.run_ids(), tracker.state.get("ensemble_run_id"))
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
    # an interrupted search's parent run is KILLED until --resume reopens and finishes it
    tracker.finish(parent_run, "KILLED" if summary.interrupted
                   else "FINISHED" if finalists else "FAILED")
    summary = wait_for_mlflow(settings, tracker, summary, patient=sent)
    location.upload(skip=(STAGED_CHECKPOINTS, OUTBOX_DIR))  # (the outbox: this machine's)
    return summary


def wait_for_mlflow(settings, tracker: SearchTracker, summary: SearchSummary,
                    patient: bool) -> SearchSummary:
    """The queued MLflow writes sent (``patient``: waiting ``MTBERT_MLFLOW_FLUSH_S`` for
    MLflow to take one; else, its server away at the first wait, no more); where some are
    not, the summary with ``mlflow_unsent``, and summary.json and summary.md rewritten with
    it (not the copies queued for MLflow: those are right once everything reaches it)."""
    sent = tracker.flush(None if patient else 0.0)
    unsent = None if sent else unsent_note(tracker, settings.send_mlflow_command())
    tracker.close()  # (what is unsent stays in the outbox, for --send-mlflow)
    if unsent is None:  # (sent, or in the meantime)
        return summary
    summary = dataclasses.replace(summary, mlflow_unsent=unsent)
    for name, text in (("summary.json", summary.to_json()), ("summary.md", summary.markdown())):
        atomic_write_text(settings.location.exp_dir / name, text)
    return summary


def known_trials(settings, records, summary: SearchSummary,
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


def finalist_device(settings) -> str:
    """Where the finalists predict: a GPU where the trials had one."""
    import torch
    return "cuda" if settings.gpus_per_trial > 0 and torch.cuda.is_available() else "cpu"
