"""``python tune_driver.py --send-mlflow --experiment NAME``: send the MLflow writes a
search left in its outbox (its MLflow server was away when it ended: its summary names
them and this command).

Exit codes: 0 every write is in MLflow (the summary's note of what was unsent is cleared,
and the summary files sent to the parent run again); 1 the server still does not take
them (one ``error:`` line; run it again once the server answers); 2 bad input: an unknown
experiment, another process sending the outbox (one ``error:`` line, nothing written).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from mtbert.core.atomic import atomic_write_text
from mtbert.core.errors import ConfigError
from mtbert.tune.infra import location as loc
from mtbert.tune.infra.outbox import OUTBOX_DIR, flush_seconds
from mtbert.tune.infra.tracking import SearchTracker, server_answers
from mtbert.tune.results.summary import sent_summary, without_unsent
from mtbert.tune.saved_settings import SETTINGS_FILE, parse_saved_settings

SUMMARY_FILES = ("summary.json", "summary.md")


def experiment_location(experiment: str | None, storage_path: str) -> loc.ExperimentLocation:
    """The search ``--send-mlflow`` names; ConfigError where there is none."""
    if not experiment:
        raise ConfigError("--send-mlflow needs --experiment NAME (the search whose MLflow "
                          "writes to send)")
    if loc.is_uri(storage_path):
        uri = loc.check_uri(storage_path)
        location = loc.ExperimentLocation(loc.staging_root(uri), experiment, uri)
    else:
        location = loc.ExperimentLocation(Path(storage_path).expanduser().resolve(), experiment)
    if location.read(SETTINGS_FILE) is None:
        raise ConfigError(f"--send-mlflow: no search {experiment} in --storage-path "
                          f"{storage_path} (no {location.ray_experiment}/{SETTINGS_FILE})")
    return location


def send(experiment: str | None, storage_path: str) -> int:
    """Send what the search's outbox holds; the exit code (ConfigError for bad input)."""
    flush_s = flush_seconds()
    location = experiment_location(experiment, storage_path)
    saved = parse_saved_settings(location.read(SETTINGS_FILE),
                                 f"{location.ray_experiment}/{SETTINGS_FILE}", "--send-mlflow")
    uri = saved.get("mlflow_uri") or ""
    outbox_dir = location.exp_dir / OUTBOX_DIR
    texts = [location.read(name) for name in SUMMARY_FILES]
    try:
        summary = json.loads(texts[0] or "{}")
    except ValueError:  # (a summary cut short: the writes are sent all the same)
        summary = {}
    if not outbox_dir.is_dir() and not summary.get("mlflow_unsent"):
        print(f"[tune] nothing to send: every MLflow write of {experiment} is in {uri}")
        return 0
    tracker = SearchTracker(uri, f"mtbert/{Path(saved['space_path']).stem}",
                            location.exp_uri or location.exp_dir, background=True,
                            outbox_dir=outbox_dir)
    try:
        tracker.outbox.quiet = True  # (this command's own lines say how it went)
        return send_outbox(tracker, location, summary, texts, flush_s)
    finally:
        tracker.close()


def send_outbox(tracker: SearchTracker, location: loc.ExperimentLocation, summary: dict,
                texts: list[str | None], flush_s: float) -> int:
    """The outbox sent (then the summary without its note, to its files and MLflow); the
    exit code."""
    uri, experiment = tracker.tracking_uri, location.experiment
    count = (tracker.unsent() or {}).get("operations", 0)
    print(f"[tune] sending {count} MLflow writes of {experiment} to {uri} ...", flush=True)
    away = uri.startswith(("http://", "https://")) and count and not server_answers(uri)
    if away or not tracker.flush(flush_s):
        return still_away(tracker, location, uri)
    if summary.get("mlflow_unsent"):  # the summary without its note, in MLflow too
        cleared = sent_summary(summary, tracker.run_ids(), tracker.state.get("ensemble_run_id"))
        markdown = without_unsent(texts[1] or "")
        write_summary(location, json.dumps(cleared, indent=2, default=str), markdown)
        for name in SUMMARY_FILES:
            tracker.log_artifact(tracker.parent_run_id, location.exp_dir / name)
        tracker.set_note(tracker.parent_run_id, markdown)
        if not tracker.flush(flush_s):
            write_summary(location, *texts)  # (the note stands)
            return still_away(tracker, location, uri)
    print(f"[tune] every MLflow write of {experiment} is in {uri}")
    return 0


def still_away(tracker: SearchTracker, location: loc.ExperimentLocation, uri: str) -> int:
    """The server did not take them (the summary's note stands): exit 1."""
    unsent = (tracker.unsent() or {}).get("operations", 0)
    print(f"error: MLflow at {uri} does not take the writes: {unsent} of "
          f"{location.experiment} still wait in {location.exp_dir / OUTBOX_DIR}; run this "
          "again once it answers", file=sys.stderr)
    return 1


def write_summary(location: loc.ExperimentLocation, summary_json: str | None,
                  markdown: str | None) -> None:
    """summary.json and summary.md, locally and (a URI storage) at the URI."""
    for name, text in zip(SUMMARY_FILES, (summary_json, markdown)):
        if text is None:
            continue
        atomic_write_text(location.exp_dir / name, text)
        if location.exp_uri:
            loc.write_text(loc.join(location.exp_uri, name), text)
