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
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from mtbert.core.atomic import atomic_write_text, check_creatable
from mtbert.core.errors import MtbertError
from mtbert.run.metrics import scalar_metrics
from mtbert.tune.infra import location as loc
from mtbert.tune.infra.trial_ends import TrialEnds

STATE_FILE = "mtbert_mlflow.json"
#: state file -> its state, shared by every tracker of this process: on ``Tuner.restore``
#: Ray unpickles the callback (and its tracker) from the experiment, beside the driver's own
#: tracker; both must see the same run ids, or the driver's end-of-search steps would miss
#: the trials started after the restore and overwrite the file with stale ids
_SHARED_STATES: dict[str, dict[str, Any]] = {}


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


# ---------------------------------------------------------------------- tracker
class SearchTracker:
    """Thin wrapper over ``MlflowClient`` keeping run ids in a JSON state file."""

    def __init__(self, tracking_uri: str, experiment_name: str, state_dir: str | Path,
                 fresh: bool = False):
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name
        # a local Path, or a URI string (s3://..., file://...) read/written with pyarrow.fs
        self.state_path: Path | str = (loc.join(str(state_dir), STATE_FILE) if loc.is_uri(str(state_dir))
                                       else Path(state_dir) / STATE_FILE)
        self._client = None
        self._state: dict[str, Any] | None = None
        if fresh:  # a new search: nothing cached from an earlier one at the same place
            _SHARED_STATES.pop(str(self.state_path), None)

    # pickled inside Ray's experiment state: drop the client, keep the settings
    def __getstate__(self):
        return {"tracking_uri": self.tracking_uri, "experiment_name": self.experiment_name,
                "state_path": str(self.state_path)}

    def __setstate__(self, state):
        self.tracking_uri = state["tracking_uri"]
        self.experiment_name = state["experiment_name"]
        path = state["state_path"]
        self.state_path = path if loc.is_uri(path) else Path(path)
        self._client = None
        self._state = None

    @property
    def client(self):
        if self._client is None:
            from mlflow import MlflowClient
            self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    @property
    def state(self) -> dict[str, Any]:
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
        if isinstance(self.state_path, str):
            loc.write_text(self.state_path, json.dumps(self.state, indent=2))
            return
        atomic_write_text(self.state_path, json.dumps(self.state, indent=2))

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
        """Create the search's parent run, or reopen it on resume."""
        run_id = self.state.get("parent_run_id")
        if run_id:
            self.client.update_run(run_id, status="RUNNING")
            self.client.set_tag(run_id, "resumed", "true")
            return run_id
        run = self.client.create_run(self.experiment_id(), run_name=run_name,
                                     tags={"kind": "search", **tags})
        run_id = run.info.run_id
        self.state["parent_run_id"] = run_id
        self.save()
        self.log_params(run_id, params)
        return run_id

    @property
    def parent_run_id(self) -> str | None:
        return self.state.get("parent_run_id")

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        from mlflow.entities import Param
        items = [Param(str(k), _param_str(v)) for k, v in params.items()]
        for i in range(0, len(items), 90):
            self.client.log_batch(run_id, params=items[i:i + 90])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
        from mlflow.entities import Metric
        now = int(time.time() * 1000)
        items = [Metric(k, v, now, int(step)) for k, v in scalar_metrics(metrics).items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(run_id, metrics=items[i:i + 500])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag
        self.client.log_batch(run_id, tags=[RunTag(k, str(v)) for k, v in tags.items()])

    def child_run(self, trial_id: str, trial_name: str, params: dict[str, Any]) -> str:
        """The trial's child run (created once; reused after a restore or a retry)."""
        children = self.state["children"]
        if trial_id in children:
            return children[trial_id]["run_id"]
        run = self.client.create_run(
            self.experiment_id(), run_name=trial_name,
            tags={"mlflow.parentRunId": self.state["parent_run_id"], "kind": "trial",
                  "trial_id": trial_id, "trial_name": trial_name, "status": "RUNNING"})
        run_id = run.info.run_id
        children[trial_id] = {"run_id": run_id, "last_step": -1}
        self.save()
        self.log_params(run_id, params)
        return run_id

    @property
    def ends(self) -> TrialEnds:
        """Which trials ended, and how (trial_ends.py), in this tracker's state."""
        return TrialEnds(self.state)

    def note_retry(self, trial_id: str, failures: int) -> None:
        """Ray restored the trial after its worker failed, for the ``failures``-th time."""
        child = self.ends.note_retry(trial_id, failures)
        self.save()
        self.set_tags(child["run_id"], {"retries": int(failures)})

    def mark_running(self, trial_id: str) -> None:
        """A trial (re)starts: a run closed before a crash/restore is RUNNING again."""
        if self.ends.frozen(trial_id):
            return
        child = self.state["children"].get(trial_id)
        if child and child.get("status") not in (None, "RUNNING"):
            self.client.update_run(child["run_id"], status="RUNNING")
            child["status"] = "RUNNING"
            self.save()

    def log_trial_result(self, trial_id: str, metrics: dict[str, float], step: int) -> bool:
        """Log one evaluation unless this step was logged before (resume); True if logged."""
        child = self.state["children"][trial_id]
        if step <= child.get("last_step", -1) or self.ends.frozen(trial_id):
            return False
        self.log_metrics(child["run_id"], metrics, step)
        child["last_step"] = step
        self.save()
        return True

    def end_trial(self, trial_id: str, status: str, tags: dict[str, Any]) -> None:
        """The trial's end: recorded in the state file first, then written to its run -- a
        driver killed between the two writes resumes knowing the trial ended (it is not
        trained again) and writes the run's end then (:meth:`freeze_ended`); in the other
        order such a kill leaves a run tagged ended whose end a resume does not know."""
        child = self.ends.record(trial_id, status, tags)
        if child is None:
            return
        self.save()
        self._write_end(child)

    def _write_end(self, child: dict[str, Any]) -> None:
        self.set_tags(child["run_id"], child["end_tags"])
        self.client.set_terminated(child["run_id"], status=child["status"])

    def freeze_ended(self) -> dict[str, dict[str, str]]:
        """On resume: the trials that had ended keep their runs as they are
        (:meth:`TrialEnds.freeze`); an end recorded whose run a kill left unwritten is
        written now."""
        ended = self.ends.freeze()
        self.save()
        for trial_id in ended:
            child = self.state["children"][trial_id]
            if ("end_tags" in child
                    and self.client.get_run(child["run_id"]).info.status != child["status"]):
                self._write_end(child)
        return ended

    def ensemble_run(self, run_name: str, params: dict[str, Any]) -> str:
        """The ensemble's run with ``params`` logged.  A search finalised before (Ctrl-C,
        then --resume) keeps its earlier ensemble run when the ensemble is the same; a
        different ensemble gets a new run, and the earlier one (kept: MLflow params are
        immutable, and nothing logged is thrown away) is tagged ``superseded_by``."""
        previous = self.state.get("ensemble_run_id")
        if previous:
            logged = self.client.get_run(previous).data.params
            if logged == {str(k): _param_str(v) for k, v in params.items()}:
                return previous
        tags = {"mlflow.parentRunId": self.state["parent_run_id"], "kind": "ensemble"}
        if previous:
            tags["supersedes"] = previous
        run = self.client.create_run(self.experiment_id(), run_name=run_name, tags=tags)
        self.log_params(run.info.run_id, params)  # before the state names it as current
        if previous:
            self.client.set_tag(previous, "superseded_by", run.info.run_id)
        self.state["ensemble_run_id"] = run.info.run_id
        self.save()
        return run.info.run_id

    def log_artifact(self, run_id: str, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(run_id, str(path), artifact_path)

    def finish(self, run_id: str, status: str = "FINISHED") -> None:
        self.client.set_terminated(run_id, status=status)


def _param_str(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
    return text[:6000]
