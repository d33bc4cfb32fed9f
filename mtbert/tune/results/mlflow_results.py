"""What a search leaves in MLflow when it ends, and the links that open it there.

* each trial's run: its config, how it ended, its best checkpoint's validation
  predictions and SST confusion plot, and for finalists their predictions and dev scores;
* the ensemble's run (a child of the parent): members and weights, val/dev metrics
  beside the best single member's, its predictions;
* the parent run: trial counts, the examples trained, the best trial's and the
  ensemble's scores, the plots, and ``summary.md`` as its note (the run's page shows it);
* links: MLflow 3's UI opens an experiment on its GenAI view unless the URL asks for
  ``workflowType=machine_learning`` (inside the ``#`` fragment); a shared view state
  (experiment tag ``mlflow.sharedViewState.KEY``, the UI's "share view") preselects the
  columns and sorts the runs by ``best/val/overall``;
* what has not reached MLflow yet (the tracker's outbox) for the summary.

Each write goes through the tracker: in a search, queued in its outbox and sent in the
background (tracking.py), so a run is named by its id or, while its creation waits there,
by the trial (``tracker.run_of``).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

from mtbert.run.metrics import confusion_matrix, scalar_metrics
from mtbert.tune.results.finalists import write_member_predictions
from mtbert.tune.trial.objective import BEST_OBJECTIVE, OBJECTIVE
from mtbert.tune.results.report import confusion_plot
from mtbert.tune.infra.tracking import SearchTracker
from mtbert.tune.trial.trial_config import trial_config_values

#: where ``mlflow ui`` serves a local store (its default port)
LOCAL_UI = "http://127.0.0.1:5000"


def ui_base(tracking_uri: str) -> str:
    """The web UI of a tracking URI: the server itself, or ``mlflow ui`` for a local store."""
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) \
        else LOCAL_UI


def runs_view_key(searched: list[str]) -> str:
    """The shared view's key: one per set of searched params."""
    return "mtbert-" + hashlib.sha1(",".join(searched).encode()).hexdigest()[:10]


def share_runs_view(tracker: SearchTracker, searched: list[str]) -> str:
    """Tag the experiment with a shared view (the best score first, then the searched
    params) and return its key, for :func:`ui_links`."""
    key = runs_view_key(searched)
    columns = [f"metrics.`{BEST_OBJECTIVE}`", f"metrics.`{OBJECTIVE}`",
               *(f"params.`{k}`" for k in searched)]
    state = {"selectedColumns": columns, "orderByKey": f"metrics.`{BEST_OBJECTIVE}`",
             "orderByAsc": False}
    tracker.set_experiment_tag(f"mlflow.sharedViewState.{key}", json.dumps(state))
    return key


def ui_links(tracking_uri: str, experiment_id: str, parent_run: str,
             view_key: str | None = None) -> list[str]:
    """The lines that open the search in the MLflow UI, in the runs view."""
    base = ui_base(tracking_uri)
    lines = []
    if base == LOCAL_UI:
        lines.append(f"mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 "
                     "--port 5000")
    view = f"&viewStateShareKey={view_key}" if view_key else ""
    lines.append(f"runs, best first: {base}/#/experiments/{experiment_id}/runs"
                 f"?workflowType=machine_learning{view}")
    lines.append(f"this search: {base}/#/experiments/{experiment_id}/runs/{parent_run}"
                 "?workflowType=machine_learning")
    return lines


def log_trial_results(tracker: SearchTracker, records, base: dict[str, Any], data,
                      preds: dict[str, dict], dev_of: dict[str, dict[str, float]]) -> None:
    """Per trial run: its config, how it ended (how far it got and every example it
    trained, which Ray's last result can undercount), the evaluations Ray dropped (kept in
    the record from their checkpoints: records.trial_record), its best checkpoint's
    validation predictions and SST confusion plot; for finalists (``preds``: trial id ->
    its val/dev/test predictions) those predictions and its dev scores."""
    import yaml

    with tempfile.TemporaryDirectory(prefix="mtbert-mlflow-") as tmp:
        for r in records:
            run = tracker.run_of(r.trial_id)  # (its id, or its name while unsent)
            if run is None:
                continue
            run_dir = Path(tmp) / r.trial_id
            run_dir.mkdir()
            config_file = run_dir / "config.yaml"
            config_file.write_text(yaml.safe_dump(trial_config_values(base, r.config),
                                                  sort_keys=False), encoding="utf-8")
            tracker.log_artifact(run, config_file)
            tracker.set_tags(run, {"best_val_overall": f"{r.best_score:.6f}",
                                   "status": r.status})
            if not tracker.ends.frozen(r.trial_id):  # (ended before a --resume: kept as it was)
                tracker.set_tags(run, {"examples_seen": r.examples_seen,
                                       "rung_reached": r.rung_reached,
                                       "examples_trained": r.examples_trained})
            for h in r.history:  # (a step logged before, or of a frozen run, is not logged)
                if "examples_seen" in h:
                    tracker.log_trial_result(r.trial_id, {
                        k: v for k, v in h.items()
                        if k.startswith(("val/", "train/")) or k == "examples_seen"},
                        int(h["examples_seen"]))
            if r.best_checkpoint:
                ckpt = Path(r.best_checkpoint)
                for f in sorted((ckpt / "predictions").glob("val-*.parquet")):
                    tracker.log_artifact(run, f, "predictions")
                metrics_file = ckpt / "metrics.json"
                if metrics_file.is_file():
                    m = json.loads(metrics_file.read_text(encoding="utf-8"))
                    if "val/sst_confusion" in m:
                        png = confusion_plot(m["val/sst_confusion"], run_dir / "sst_confusion.png",
                                             f"{r.trial_id}: val SST at {m.get('examples_seen')} ex.")
                        tracker.log_artifact(run, png)
            if r.trial_id in preds:
                folder = write_member_predictions(run_dir / "finalist", data, preds[r.trial_id])
                for f in sorted(folder.glob("*")):
                    tracker.log_artifact(run, f, "finalist_predictions")
                if dev_of.get(r.trial_id):
                    tracker.log_metrics(run, dev_of[r.trial_id], step=r.examples_seen)


def log_ensemble_run(tracker: SearchTracker, name: str, ensemble, top_k: int,
                     predictions: Path, val_sst_gold) -> str:
    """The ensemble's run (a child of the parent): its members and weights as params,
    val/dev metrics beside the best single member's, predictions, SST confusion plot."""
    run = tracker.ensemble_run(name, {
        "method": ensemble.method, "members": ",".join(ensemble.selected),
        "candidates": ",".join(ensemble.members),
        "weights": json.dumps(ensemble.weights_by_member()), "top_k": top_k})
    tracker.log_metrics(run, scalar_metrics(ensemble.metrics, finite=True))
    tracker.log_metrics(run, {f"best_single/{k}": v for k, v in
                              scalar_metrics(ensemble.best_single, finite=True).items()})
    for f in sorted(predictions.glob("*")):
        tracker.log_artifact(run, f, "predictions")
    if "sst" in ensemble.labels.get("val", {}):
        with tempfile.TemporaryDirectory(prefix="mtbert-mlflow-") as tmp:
            cm = confusion_matrix(ensemble.labels["val"]["sst"], val_sst_gold, 5)
            tracker.log_artifact(run, confusion_plot(cm, Path(tmp) / "sst_confusion.png",
                                                     "ensemble: val SST"))
    tracker.finish(run)
    return run


def log_search_metrics(tracker: SearchTracker, parent_run: str, summary) -> None:
    """The parent run: trial counts, the best trial's and the ensemble's scores, the
    best trial's id, and the report files."""
    c = summary.counts
    metrics = {"trials_completed": c.completed, "trials_stopped_early": c.stopped_early,
               "trials_errored": c.errored,
               "trials_restored": c.restored, "examples_trained": summary.examples_trained}
    if summary.best_trial:
        b = summary.best_trial
        metrics.update({f"best/{k}": v for k, v in {**b.val, **b.dev}.items()})
        tracker.set_tags(parent_run, {"best_trial_id": b.trial_id})
    if summary.ensemble:
        e = summary.ensemble
        metrics.update({f"ensemble/{k}": v for k, v in {**e.val, **e.dev}.items()})
    tracker.log_metrics(parent_run, metrics)
    for path in summary.report_files.values():
        tracker.log_artifact(parent_run, path, "report")


def unsent_note(tracker: SearchTracker, command: str) -> dict[str, Any] | None:
    """What has not reached MLflow (``SearchSummary.mlflow_unsent``) and the command that
    sends it, or None."""
    unsent = tracker.unsent()
    return None if unsent is None else {**unsent, "command": command}


def note_search(tracker: SearchTracker, parent_run: str, markdown: str) -> None:
    """The parent run's note (tag ``mlflow.note.content``: the description its MLflow page
    shows): the search's ``summary.md``, cut where it is longer than MLflow keeps."""
    tracker.set_note(parent_run, markdown)
