"""MLflow tracking of a search, all from the driver process (trial workers need no MLflow).

Layout in the MLflow experiment ``mtbert/<space>``:

* one **parent run** per search (run name = the Ray experiment name): the driver's
  arguments, the budget and the space as params; the best/ensemble metrics, the search
  report plots, ``summary.json`` and ``summary.md`` at the end;
* one **child run** per trial (tag ``mlflow.parentRunId``): every TrainConfig field
  of the trial as a param; ``val/*``, ``train/*``, ``examples_seen`` ... per evaluation
  (step = examples seen); tags ``trial_id``, ``status``, ``stopped_early``,
  ``rung_reached``, ``error_reason``; artifacts ``config.yaml``, the best checkpoint's
  validation predictions (Parquet), the SST confusion-matrix plot, and for ensemble
  members their dev/test predictions;
* one **ensemble run** (also a child of the parent, tag ``kind=ensemble``).

:class:`~mtbert.tune.results.callback.MlflowTrialCallback` is a ``ray.tune.Callback``: Tune calls it in the driver on
every trial start/result/completion/error.  Run ids and the last logged step of each
trial are kept in ``<experiment dir>/mtbert_mlflow.json``, so a resumed search
(``Tuner.restore``) reuses its runs and never logs a step twice; which trials ended, and
how, is read from the same file by :mod:`~mtbert.tune.infra.trial_ends` (``tracker.ends``).  With a URI
``--storage-path`` (``s3://...``) that file is read and written there through
``pyarrow.fs``, so a search resumed from another machine finds its runs too.

The search's driver writes to MLflow in the background (``background=True``): each write
is an operation queued in the experiment's outbox (:mod:`~mtbert.tune.infra.outbox`,
``<experiment dir>/mlflow_outbox/``) and sent in order by a thread of its own, so an MLflow
server that is slow or away holds up neither Tune's loop nor the search's end (which waits
a bounded time for it: ``MTBERT_MLFLOW_FLUSH_S``).  Operations name runs by what they are
(:data:`PARENT`, :data:`ENSEMBLE`, :func:`trial_ref`), resolved when sent, since a trial's
run may be created while the server is away; the state file (run ids, last steps, ends) is
still written at once, where it lives.  Only the experiment and a new search's parent
run are made at once, at the start (the server was just checked, and the parent's id is
printed).
"""

from __future__ import annotations

import collections
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable

from mtbert.core.atomic import atomic_write_text, check_creatable
from mtbert.core.errors import MtbertError
from mtbert.run.metrics import scalar_metrics
from mtbert.tune.infra import location as loc
from mtbert.tune.infra.outbox import (OUTBOX_DIR, Outbox, discard, flush_seconds, outbox_for,
                                      release)
from mtbert.tune.infra.trial_ends import TrialEnds

STATE_FILE = "mtbert_mlflow.json"
#: state file -> its state, shared by every tracker of this process: on ``Tuner.restore``
#: Ray unpickles the callback (and its tracker) from the experiment, beside the driver's own
#: tracker; both must see the same run ids, or the driver's end-of-search steps would miss
#: the trials started after the restore and overwrite the file with stale ids
_SHARED_STATES: dict[str, dict[str, Any]] = {}
#: state file -> the lock over its state (the trackers of this process and the outbox's
#: sender thread, which records the run ids it creates)
_SHARED_LOCKS: dict[str, threading.RLock] = {}


class TrackingError(MtbertError):
    """The MLflow tracking URI is unusable (bad scheme, unreachable server, bad path)."""


# ---------------------------------------------------------------------- URIs
def default_tracking_uri(storage_path: Path) -> str:
    return f"sqlite:///{(Path(storage_path) / 'mlflow.db').resolve()}"


def check_tracking_uri(uri: str, timeout: float = 5.0) -> None:
    """Fail fast, before anything starts: bad scheme, unwritable SQLite path, dead server."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        if not db.is_absolute():
            db = Path.cwd() / db
        if db.exists() and not db.is_file():
            raise TrackingError(f"--mlflow-uri {uri}: {db} exists and is not a file")
        check_creatable(db.parent, f"--mlflow-uri {uri}")
        return
    if uri.startswith(("http://", "https://")):
        import urllib.error  # only for a server's URI (http.client: --help stays fast)
        import urllib.request
        url = uri.rstrip("/") + "/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (user URI)
                if resp.status >= 400:
                    raise TrackingError(f"--mlflow-uri {uri}: server answered {resp.status} "
                                        f"at {url}")
        except (urllib.error.URLError, OSError, ValueError) as exc:
            reason = getattr(exc, "reason", exc)
            raise TrackingError(f"--mlflow-uri {uri}: MLflow server unreachable ({reason}); "
                                "start it (mlflow server --host 127.0.0.1) or omit --mlflow-uri "
                                "for the local SQLite store") from None
        return
    # MLflow 3's file store (a folder, file:///...) is in maintenance mode: it fails at the
    # first run; a value without a scheme is most often a mistyped URI (http//HOST:5000)
    kind = "a folder (MLflow's file store)" if uri.startswith("file:") or "://" not in uri \
        else "an unsupported scheme"
    raise TrackingError(f"--mlflow-uri {uri}: {kind}; use sqlite:///ABSOLUTE/PATH.db (a local "
                        "store, no server) or http(s)://HOST:PORT (an MLflow server)")


def artifact_root_for(uri: str) -> str | None:
    """Artifacts of a local SQLite store live beside the database (not in ./mlruns)."""
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        return (db.resolve().parent / "mlartifacts").as_uri()
    return None


def open_store_early(uri: str) -> threading.Thread | None:
    """Open a local SQLite store on a thread of its own while Ray starts: a new database's
    tables are created by MLflow's migrations (seconds of CPU), and MLflow keeps one store
    per URI in this process (its tracking-store registry caches them), so the tracker made
    after Ray's start finds it open.  A failure here is left for that tracker to raise."""
    if not uri.startswith("sqlite:///"):
        return None

    def open_store() -> None:
        try:
            from mlflow import MlflowClient
            MlflowClient(tracking_uri=uri).search_experiments(max_results=1)
        except Exception:  # noqa: BLE001 -- the tracker opens it again and says why
            pass

    thread = threading.Thread(target=open_store, name="mtbert-mlflow-store", daemon=True)
    thread.start()
    return thread


# ---------------------------------------------------------------------- tracker
#: the longest tag value MLflow keeps (``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``): a
#: run's note (its summary.md) is cut there
NOTE_LIMIT = 8000
NOTE_CUT = "\n\n(cut at MLflow's length of a note: the whole is the run's artifact summary.md)\n"
#: how an operation names a run, resolved when it is sent (a trial's run may be created
#: while the server is away): the parent, the current ensemble, a trial's by its trial id
PARENT, ENSEMBLE, TRIAL = "@parent", "@ensemble", "@trial:"


def trial_ref(trial_id: str) -> str:
    return TRIAL + trial_id


class SearchTracker:
    """The search's MLflow writes, and the run ids kept in a JSON state file.

    Each write is an operation (:meth:`_send` carries it out).  ``background=False``
    sends each at once and raises as MLflow does (direct uses, the unit tests);
    ``background=True`` (the search's driver) queues it in the outbox in ``outbox_dir``
    (default ``<state_dir>/mlflow_outbox``; required for a URI ``state_dir``), whose
    sender thread sends them in order (outbox.py).  The state file is written at once
    either way."""

    def __init__(self, tracking_uri: str, experiment_name: str, state_dir: str | Path,
                 fresh: bool = False, background: bool = False,
                 outbox_dir: str | Path | None = None):
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        # a local Path, or a URI string (s3://..., file://...) read/written with pyarrow.fs
        self.state_path: Path | str = (loc.join(str(state_dir), STATE_FILE) if loc.is_uri(str(state_dir))
                                       else Path(state_dir) / STATE_FILE)
        self.background = background
        self.outbox_dir = (Path(outbox_dir) if outbox_dir is not None else None
                           if loc.is_uri(str(state_dir)) else Path(state_dir) / OUTBOX_DIR)
        if background and self.outbox_dir is None:
            raise ValueError("a background tracker of a URI state folder needs outbox_dir")
        self._client = None
        self._state: dict[str, Any] | None = None
        self._outbox = None
        if fresh:  # a new search: nothing cached from an earlier one at the same place
            _SHARED_STATES.pop(str(self.state_path), None)
            if background:
                discard(self.outbox_dir)
        if background:
            self.outbox  # noqa: B018 (a journal's unsent operations are sent first)

    # pickled inside Ray's experiment state: drop the client, keep the settings
    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "experiment_name": self.experiment_name,
                "state_path": str(self.state_path), "background": self.background,
                "outbox_dir": str(self.outbox_dir) if self.outbox_dir else None}

    def __setstate__(self, state):
        self.tracking_uri = state["tracking_uri"]
        self.experiment_name = state["experiment_name"]
        path = state["state_path"]
        self.state_path = path if loc.is_uri(path) else Path(path)
        self.background = bool(state.get("background")) and bool(state.get("outbox_dir"))
        self.outbox_dir = Path(state["outbox_dir"]) if state.get("outbox_dir") else None
        self._client = None
        self._state = None
        self._outbox = None

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient  # deferred: mlflow
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def lock(self) -> threading.RLock:
        """Guards the state shared by this process's trackers of the file and the sender."""
        return _SHARED_LOCKS.setdefault(str(self.state_path), threading.RLock())

    @property
    def state(self) -> dict[str, Any]:
        with self.lock:
            if self._state is None and str(self.state_path) in _SHARED_STATES:
                self._state = _SHARED_STATES[str(self.state_path)]
            if self._state is None:
                if isinstance(self.state_path, str):
                    text = loc.read_text(self.state_path)
                elif self.state_path.is_file():
                    text = self.state_path.read_text(encoding="utf-8")
                else:
                    text = None
                self._state = (json.loads(text) if text is not None
                               else {"tracking_uri": self.tracking_uri, "children": {}})
                _SHARED_STATES[str(self.state_path)] = self._state
            return self._state

    def save(self) -> None:
        with self.lock:
            text = json.dumps(self.state, indent=2)
            if isinstance(self.state_path, str):
                loc.write_text(self.state_path, text)
            else:
                atomic_write_text(self.state_path, text)

    # ------------------------------------------------------------------ the outbox
    @property
    def outbox(self) -> Outbox:
        if self._outbox is None or self._outbox.closed:
            probe = ((lambda: server_answers(self.tracking_uri))
                     if self.tracking_uri.startswith(("http://", "https://")) else None)
            self._outbox = outbox_for(self.outbox_dir, self._send, transient_error, probe,
                                      self.describe)
        return self._outbox

    def _submit(self, op: dict[str, Any], then: Callable[[], None] | None = None) -> None:
        """Send ``op`` now (raising as MLflow does), or queue it in the outbox; ``then``
        (what the caller records of it) once it is sent, or in the journal and not yet
        sendable (:meth:`Outbox.put`): a write is never recorded before it is kept."""
        if self.background:
            self.outbox.put(op, then)
        else:
            self._send(op)
            if then is not None:
                then()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait for the queued writes to reach MLflow, giving up once it has taken none for
        ``timeout`` seconds (default: outbox.flush_seconds); whether all did."""
        if not self.background:
            return True
        return self.outbox.flush(flush_seconds() if timeout is None else timeout)

    def close(self) -> None:
        """The search is over: this process stops sending the outbox, leaving what is
        unsent in its journal (``--send-mlflow`` sends it)."""
        if self.background:
            release(self.outbox_dir)
            self._outbox = None

    def unsent(self) -> dict[str, Any] | None:
        """What has not reached MLflow yet: ``{"operations": N, "runs": {run: N}}`` (a
        run named ``parent``, ``ensemble``, by its trial id, or ``experiment``), or None."""
        ops = self.outbox.unsent() if self.background else []
        if not ops:
            return None
        return {"operations": len(ops),
                "runs": dict(collections.Counter(self.op_label(op) for op in ops))}

    def op_label(self, op: dict[str, Any]) -> str:
        """The run an operation writes to, named as :meth:`run_label` names it."""
        if op["kind"] == "trial_run":
            return op["trial_id"]
        return "ensemble" if op["kind"] == "ensemble_run" else self.run_label(op.get("run"))

    def run_label(self, run: str | None) -> str:
        """How a run is named to users: parent, ensemble, a trial id, or the run id."""
        state = self.state
        if run is None:
            return "experiment"
        if run == PARENT or run == state.get("parent_run_id"):
            return "parent"
        if run == ENSEMBLE or run == state.get("ensemble_run_id"):
            return "ensemble"
        if run.startswith(TRIAL):
            return run[len(TRIAL):]
        return next((tid for tid, c in state["children"].items() if c.get("run_id") == run),
                    run)

    def describe(self, op: dict[str, Any]) -> str:
        return f"{op['kind']} of {self.op_label(op)}"

    # ------------------------------------------------------------------ runs
    def experiment_id(self) -> str:
        if "experiment_id" not in self.state:
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                exp_id = self.client.create_experiment(
                    self.experiment_name, artifact_location=artifact_root_for(self.tracking_uri))
            else:
                exp_id = exp.experiment_id
            self.state["experiment_id"] = exp_id
            self.save()
        return self.state["experiment_id"]

    def start_parent(self, run_name: str, params: dict[str, Any], tags: dict[str, str]) -> str:
        """Create the search's parent run (at once: its id is printed as the search
        starts, the server just checked), or reopen it on resume."""
        run_id = self.state.get("parent_run_id")
        if run_id:
            self._submit({"kind": "status", "run": run_id, "status": "RUNNING"})
            self.set_tags(run_id, {"resumed": "true"})
            return run_id
        run = self.client.create_run(self.experiment_id(), run_name=run_name,
                                     tags={"kind": "search", **tags})
        run_id = run.info.run_id
        with self.lock:
            self.state["parent_run_id"] = run_id
            self.save()
        self.log_params(run_id, params)
        return run_id

    @property
    def parent_run_id(self) -> str | None:
        return self.state.get("parent_run_id")

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        self._submit({"kind": "params", "run": run_id, "params": _param_items(params)})

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0,
                    then: Callable[[], None] | None = None, **marks: Any) -> None:
        """``metrics`` at ``step`` (``then``, ``marks``: as :meth:`_submit` and the
        operation carry them)."""
        items = [[k, v] for k, v in scalar_metrics(metrics).items()]
        if items:  # the time is taken now: a write sent twice is the same point
            self._submit({"kind": "metrics", "run": run_id, "metrics": items,
                          "step": int(step), "timestamp": int(time.time() * 1000), **marks},
                         then)

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        self._submit({"kind": "tags", "run": run_id, "tags": {k: str(v) for k, v in tags.items()}})

    def set_note(self, run_id: str, markdown: str) -> None:
        """The run's note (tag ``mlflow.note.content``, the text its page shows), cut where
        it is longer than MLflow keeps."""
        if len(markdown) > NOTE_LIMIT:
            markdown = markdown[:NOTE_LIMIT - len(NOTE_CUT)] + NOTE_CUT
        self.set_tags(run_id, {"mlflow.note.content": markdown})

    def set_experiment_tag(self, key: str, value: str) -> None:
        self._submit({"kind": "experiment_tag", "key": key, "value": value})

    def child_run(self, trial_id: str, trial_name: str, params: dict[str, Any]) -> str:
        """The trial's child run (created once; reused after a restore or a retry): its run
        id, or while its creation waits in the outbox, :func:`trial_ref`."""
        with self.lock:
            children = self.state["children"]
            child = children.get(trial_id)
            if child is None:
                child = children[trial_id] = {"run_id": None, "last_step": -1}
                self.save()
            elif child.get("run_id") or self._creating(trial_id):
                return self.run_of(trial_id)
            self._submit({"kind": "trial_run", "trial_id": trial_id, "name": trial_name,
                          "params": _param_items(params)})
            return self.run_of(trial_id)

    def _creating(self, trial_id: str) -> bool:
        """Its run's creation waits in the outbox."""
        return self.background and any(op["kind"] == "trial_run" and op["trial_id"] == trial_id
                                       for op in self.outbox.unsent())

    def run_of(self, trial_id: str) -> str | None:
        """The trial's run id, :func:`trial_ref` while its creation is unsent, None where
        the trial has no run."""
        child = self.state["children"].get(trial_id)
        return None if child is None else child.get("run_id") or trial_ref(trial_id)

    def run_ids(self) -> dict[str, str]:
        """``{trial_id: run id}`` of the trials whose runs MLflow has made."""
        with self.lock:
            return {tid: c["run_id"] for tid, c in self.state["children"].items()
                    if c.get("run_id")}

    @property
    def ends(self) -> TrialEnds:
        """Which trials ended, and how (trial_ends.py), in this tracker's state."""
        return TrialEnds(self.state)

    def note_retry(self, trial_id: str, failures: int) -> None:
        """Ray restored the trial after its worker failed, for the ``failures``-th time."""
        with self.lock:
            self.ends.note_retry(trial_id, failures)
            self.save()
        self.set_tags(self.run_of(trial_id), {"retries": int(failures)})

    def mark_running(self, trial_id: str) -> None:
        """A trial (re)starts: a run closed before a crash/restore is RUNNING again."""
        if self.ends.frozen(trial_id):
            return
        with self.lock:
            child = self.state["children"].get(trial_id)
            if not child or child.get("status") in (None, "RUNNING"):
                return
            child["status"] = "RUNNING"
            self.save()
        self._submit({"kind": "status", "run": self.run_of(trial_id), "status": "RUNNING"})

    def log_trial_result(self, trial_id: str, metrics: dict[str, float], step: int) -> bool:
        """Log one evaluation unless this step was logged before (resume); True if logged.
        The state file's ``last_step`` is written once the evaluation is in the outbox's
        journal, before it can be sent: a driver killed in between leaves it in the journal
        (its resume sends it, and :meth:`_last_step` reads it there), never recorded and
        lost (one CI run lost a trial's point at 102 examples that way)."""
        with self.lock:
            child = self.state["children"][trial_id]
            if step <= self._last_step(trial_id) or self.ends.frozen(trial_id):
                return False

            def recorded():
                child["last_step"] = step
                self.save()
            self.log_metrics(self.run_of(trial_id), metrics, step, then=recorded,
                             evaluation=trial_id)
        return True

    def _last_step(self, trial_id: str) -> int:
        """The furthest evaluation of the trial logged: the state file's, or one a killed
        driver had put in the journal (unsent) without recording it."""
        last = self.state["children"][trial_id].get("last_step", -1)
        if self.background:
            queued = [op["step"] for op in self.outbox.found
                      if op.get("kind") == "metrics" and op.get("evaluation") == trial_id]
            last = max([last, *queued])
        return last

    def end_trial(self, trial_id: str, status: str, tags: dict[str, Any]) -> None:
        """The trial's end: recorded in the state file first, then written to its run -- a
        driver killed between the two writes resumes knowing the trial ended (it is not
        trained again) and writes the run's end then (:meth:`freeze_ended`); in the other
        order such a kill leaves a run tagged ended whose end a resume does not know."""
        with self.lock:
            child = self.ends.record(trial_id, status, tags)
            if child is None:
                return
            self.save()
        self._write_end(child)

    def _write_end(self, child: dict[str, Any], check: bool = False) -> None:
        """The run's end tags and status (``check``: only where its status differs)."""
        trial_id = next(t for t, c in self.state["children"].items() if c is child)
        self._submit({"kind": "end", "run": self.run_of(trial_id), "tags": child["end_tags"],
                      "status": child["status"], "check": check})

    def freeze_ended(self) -> dict[str, dict[str, str]]:
        """On resume: the trials that had ended keep their runs as they are
        (:meth:`TrialEnds.freeze`); an end recorded whose run a kill left unwritten is
        written (when sent: the run's status is read then)."""
        with self.lock:
            ended = self.ends.freeze()
            self.save()
        for trial_id in ended:
            child = self.state["children"][trial_id]
            if "end_tags" in child:
                self._write_end(child, check=True)
        return ended

    def ensemble_run(self, run_name: str, params: dict[str, Any]) -> str:
        """The ensemble's run with ``params`` logged: its id, or :data:`ENSEMBLE` in the
        background.  A search finalised before (Ctrl-C, then --resume) keeps its earlier
        ensemble run when the ensemble is the same; a different ensemble gets a new run,
        and the earlier one (kept: MLflow params are immutable, and nothing logged is
        thrown away) is tagged ``superseded_by``."""
        self._submit({"kind": "ensemble_run", "name": run_name, "params": _param_items(params),
                      "key": uuid.uuid4().hex})
        return ENSEMBLE if self.background else self.state["ensemble_run_id"]

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        """``path`` (copied into the outbox as it is now, in the background)."""
        self._submit({"kind": "artifact", "run": run_id, "file": str(path),
                      "artifact_path": artifact_path})

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self._submit({"kind": "terminate", "run": run_id, "status": status})

    # ------------------------------------------------------------------ sending
    def _send(self, op: dict[str, Any]) -> None:
        """Carry out one operation in MLflow; sending one twice changes nothing more."""
        kind = op["kind"]
        if kind == "trial_run":
            return self._send_trial_run(op)
        if kind == "ensemble_run":
            return self._send_ensemble_run(op)
        if kind == "experiment_tag":
            return self.client.set_experiment_tag(self.experiment_id(), op["key"], op["value"])
        run_id = self._resolve(op["run"])
        if kind == "params":
            self._log_param_items(run_id, op["params"])
        elif kind == "metrics":
            from mlflow.entities import Metric  # deferred: mlflow
            items = [Metric(k, v, op["timestamp"], op["step"]) for k, v in op["metrics"]]
            for i in range(0, len(items), 500):
                self.client.log_batch(run_id, metrics=items[i:i + 500])
        elif kind == "tags":
            self._log_tags(run_id, op["tags"])
        elif kind == "status":
            self.client.update_run(run_id, status=op["status"])
        elif kind == "end":
            if op.get("check") and self.client.get_run(run_id).info.status == op["status"]:
                return None
            self._log_tags(run_id, op["tags"])
            self.client.set_terminated(run_id, status=op["status"])
        elif kind == "terminate":
            self.client.set_terminated(run_id, status=op["status"])
        elif kind == "artifact":
            path = Path(op["file"])
            self.client.log_artifact(run_id, str(path if path.is_absolute()
                                                 else self.outbox_dir / path),
                                     op.get("artifact_path"))
        else:
            raise ValueError(f"unknown MLflow operation {kind!r}")
        return None

    def _resolve(self, run: str) -> str:
        """The run id an operation names (PARENT, ENSEMBLE, a trial_ref or an id)."""
        if not run.startswith("@"):
            return run
        state = self.state
        run_id = (state.get("parent_run_id") if run == PARENT
                  else state.get("ensemble_run_id") if run == ENSEMBLE
                  else state["children"].get(run[len(TRIAL):], {}).get("run_id"))
        if not run_id:
            raise LookupError(f"no MLflow run for {self.run_label(run)}: its creation did "
                              "not reach MLflow")
        return run_id

    def _send_trial_run(self, op: dict[str, Any]) -> None:
        """A trial's run: the one already under the parent with its trial id (created by
        a process killed before it recorded the id), else a new one; then its params."""
        trial_id, parent = op["trial_id"], self.state["parent_run_id"]
        found = self.client.search_runs(
            [self.experiment_id()], max_results=1,
            filter_string=f"tags.trial_id = '{_quoted(trial_id)}' and "
                          f"tags.`mlflow.parentRunId` = '{_quoted(parent)}'")
        if found:
            run_id = found[0].info.run_id
        else:
            run_id = self.client.create_run(
                self.experiment_id(), run_name=op["name"],
                tags={"mlflow.parentRunId": parent, "kind": "trial", "trial_id": trial_id,
                      "trial_name": op["name"], "status": "RUNNING"}).info.run_id
        with self.lock:
            self.state["children"].setdefault(trial_id, {"last_step": -1})["run_id"] = run_id
            self.save()
        self._log_param_items(run_id, op["params"])

    def _send_ensemble_run(self, op: dict[str, Any]) -> None:
        """The ensemble's run (see :meth:`ensemble_run`); the new one is tagged with the
        operation's key, so that a second send finds it instead of making another."""
        previous = self.state.get("ensemble_run_id")
        params = dict(op["params"])
        if previous and self.client.get_run(previous).data.params == params:
            return
        found = self.client.search_runs(
            [self.experiment_id()], max_results=1,
            filter_string=f"tags.`{OP_KEY_TAG}` = '{_quoted(op['key'])}'")
        if found:
            run_id = found[0].info.run_id
        else:
            tags = {"mlflow.parentRunId": self.state["parent_run_id"], "kind": "ensemble",
                    OP_KEY_TAG: op["key"]}
            if previous:
                tags["supersedes"] = previous
            run_id = self.client.create_run(self.experiment_id(), run_name=op["name"],
                                            tags=tags).info.run_id
        self._log_param_items(run_id, op["params"])  # before the state names it as current
        if previous:
            self.client.set_tag(previous, "superseded_by", run_id)
        with self.lock:
            self.state["ensemble_run_id"] = run_id
            self.save()

    def _log_param_items(self, run_id: str, items: list[list[str]]) -> None:
        from mlflow.entities import Param  # deferred: mlflow
        params = [Param(k, v) for k, v in items]
        for i in range(0, len(params), 90):
            self.client.log_batch(run_id, params=params[i:i + 90])

    def _log_tags(self, run_id: str, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag  # deferred: mlflow
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


#: the tag of an ensemble run naming the operation that created it
OP_KEY_TAG = "mtbert.outbox_op"


def transient_error(exc: BaseException) -> bool:
    """Whether MLflow may take the write later: the server unreachable, timed out or
    answering 5xx / 429 -- not a 4xx (a bad value, a run that does not exist) nor an
    error of ours."""
    from mlflow.exceptions import MlflowException  # deferred: mlflow
    if isinstance(exc, MlflowException):
        status = exc.get_http_status_code()
        return not 400 <= status < 500 or status in (408, 429)
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(status, int):  # requests' HTTPError (an artifact upload)
        return not 400 <= status < 500 or status in (408, 429)
    return isinstance(exc, (ConnectionError, TimeoutError)) or (
        isinstance(exc, OSError) and type(exc).__module__.startswith(("requests", "urllib3")))


def server_answers(uri: str, timeout: float = 2.0) -> bool:
    """Whether the MLflow server at ``uri`` answers its health check now."""
    import urllib.error  # only for a server's URI (http.client: --help stays fast)
    import urllib.request
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health",  # noqa: S310 (user URI)
                                    timeout=timeout) as resp:
            return resp.status < 400
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _param_items(params: dict[str, Any]) -> list[list[str]]:
    return [[str(k), _param_str(v)] for k, v in params.items()]


def _quoted(text: str) -> str:
    """A value inside a search filter's single quotes."""
    return str(text).replace("\\", "\\\\").replace("'", "\\'")


def _param_str(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:6000]
