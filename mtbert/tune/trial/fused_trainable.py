"""The fused path's Tune trainable (``--fuse on``): a thin trial, a fraction of a CPU and
no GPU, whose training runs in a trainer actor (:mod:`.group_trainer`).

It hands its config (and the checkpoint Tune restores it from) to the trainer with room --
a group of its structure first, then the fewest trials -- and forwards that trial's reports
and checkpoints to ``tune.report``, so schedulers, the MLflow callback and the records see
one trial per trial as on the unfused path.  The trainer holds the trial at each report
until it is forwarded here.  When Tune ends this trial (a scheduler's stop or pause, an
error), it leaves its group on the way out; should its process end first, the trainer
drops it once it stops polling.  Should the trainer die (Ray's actor error on a call, or
the restarted trainer not knowing the trial), the trial fails and Tune retries it from its
last checkpoint (``--max-failures``), into the trainer Ray restarted under the same name
or another that answers; should no trainer be able to come back, the trial fails once,
saying so, and is not retried.
"""

from __future__ import annotations

import contextlib
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from mtbert.core.errors import ConfigError
from mtbert.tune.trial.trainable import FAILED_MARKER, TrialFailed, mark_failed
from mtbert.tune.trial.trained_log import TrainedLog
from mtbert.tune.trial.trial_config import trial_config

#: seconds between polls while the trial trains; between heartbeats while tune.report waits
POLL_S = 0.1
HEARTBEAT_S = 2.0
#: seconds a trainer has to answer before it is taken as restarting (its constructor runs
#: again: the data from Ray's object store, the imports)
ANSWER_S = 120.0
#: seconds between writes of how far a trial trained in its trainer (_TrainedWrites)
TRAINED_WRITE_S = 0.5
#: how the trainer's errors that no retry can mend begin (group_trainer)
DETERMINISTIC = ("non-finite loss", "ConfigError", "cannot train fused")


class TrainerLost(RuntimeError):
    """The trial's trainer died: Tune retries the trial from its last checkpoint."""


#: how a TrainerLost error ends
RETRIED = "; Tune retries this trial from its last checkpoint"


def train_fused_trial(config: dict[str, Any], base: dict[str, Any] | None = None,
                      ended: dict[str, dict[str, str]] | None = None,
                      trainers: tuple[str, ...] = ()) -> None:
    """Function trainable (module doc); ``base``, ``ended`` as :func:`.trainable.train_trial`
    takes them, ``trainers``: the trainer actors' names (with_parameters)."""
    entered_at = time.time()
    import ray  # deferred: ray
    from ray import tune

    trial_id = tune.get_context().get_trial_id()
    done = (ended or {}).get(trial_id)
    if done is not None:  # ended before the driver restarted (--resume)
        if done["status"] == "FAILED":
            raise TrialFailed(done.get("error_reason") or "failed before the search was resumed")
        return
    marker = Path(tune.get_context().get_trial_dir()) / FAILED_MARKER
    if marker.is_file():  # a retry of a deterministic failure: fail again at once
        raise TrialFailed(marker.read_text(encoding="utf-8"))
    try:
        cfg = trial_config(base or {}, config).to_dict()
    except ConfigError as exc:
        raise TrialFailed(f"invalid trial config: {exc}") from None
    try:
        trainer = _pick_trainer(trainers, cfg)
        ray.get(trainer.join.remote(trial_id, cfg, tune.get_checkpoint()))
    except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError, ValueError) as exc:
        raise _lost(trainers, marker, "its trainer died as this trial joined", exc) from None
    beating = threading.Event()
    threading.Thread(target=_heartbeat, args=(trainer, trial_id, beating), daemon=True).start()
    left = False
    try:
        here = ray.get_runtime_context().get_node_id()
        local = ray.get(trainer.node_id.remote()) == here
        left = _forward(trainer, trial_id, entered_at, tune, marker,
                        {} if local else {"thin_trial_node_id": here})
    except ray.exceptions.RayActorError as exc:
        left = True  # nothing to leave: the trainer and its groups are gone
        raise _lost(trainers, marker, "its trainer died", exc) from None
    except TrainerLost:
        left = True
        raise
    finally:
        beating.set()
        if not left:  # stopped or paused by Tune, or an error here: leave the group
            try:
                ray.get(trainer.leave.remote(trial_id), timeout=10)
            except Exception:
                pass


def _pick_trainer(names: tuple[str, ...], cfg: dict[str, Any]):
    """The trainer this trial joins: of those that answer, the one with a group of its
    structure, then the least loaded; a dead or restarting trainer is passed over."""
    import ray  # deferred: ray
    handles, failure = [], None
    for name in names:
        try:
            handles.append(ray.get_actor(name))
        except ValueError as exc:  # gone for good
            failure = exc
    calls = [h.fit_score.remote(cfg) for h in handles]
    scores = {}
    for i, call in enumerate(calls):
        try:
            scores[i] = ray.get(call, timeout=ANSWER_S)
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
            failure = exc
    if not scores:
        raise failure
    return handles[max(scores, key=scores.__getitem__)]


def _lost(names: tuple[str, ...], marker: Path, what: str, exc: BaseException) -> Exception:
    """What a trial raises when a trainer call failed: :class:`TrainerLost` (Tune retries it
    from its last checkpoint) while any trainer answers or may still come back; once none
    can (each has died for good: its restart failed, or Ray gave up restarting it), a
    :class:`TrialFailed` saying so, marked so that Tune's retries fail at once."""
    import ray  # deferred: ray
    dead = []
    for name in names:
        try:
            ray.get(ray.get_actor(name).node_id.remote(), timeout=ANSWER_S)
            break  # this one answers: a retry joins it
        except ray.exceptions.ActorDiedError as died:  # no restart left, or its restart failed
            dead.append(f"{name}: {first_line(died)}")
        except ValueError as gone:  # not known to Ray any more
            dead.append(f"{name}: {gone}")
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            break  # restarting: a retry waits for it
    if len(dead) < len(names):
        return TrainerLost(f"{what} ({type(exc).__name__}){RETRIED}")
    reason = f"{what} and no trainer can take it again: " + "; ".join(dead)
    mark_failed(marker, reason)
    return TrialFailed(reason)


def first_line(exc: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0][:200]}" if lines else type(exc).__name__


def _forward(trainer, trial_id: str, entered_at: float, tune, marker: Path,
             remote: dict[str, str]) -> bool:
    """Forward the trial's reports until it ends; True once it has (finished).  ``remote``:
    empty where the trainer shares this node (its checkpoint folders are read where they
    are), else ``{"thin_trial_node_id": this node}``, added to each report."""
    import ray  # deferred: ray
    forwarded = 0
    trained = _TrainedWrites(tune)
    while True:
        reports, end, progress = ray.get(trainer.poll.remote(trial_id, forwarded))
        trained.note(progress, "reported" if reports else "training")
        for scalars, folder in reports:
            startup = {"time/startup_s": scalars.pop("time/ready_at") - entered_at}
            with _checkpoint_here(trainer, folder, bool(remote)) as here:
                tune.report({**scalars, **remote, "time/entered_at": entered_at, **startup,
                             "time/cpu_s": time.process_time(),
                             "time/reported_at": time.time()},
                            checkpoint=tune.Checkpoint.from_directory(here) if here else None)
            forwarded += 1
        if end is not None:
            if end["reason"] == "failed":
                if end["error"].startswith(DETERMINISTIC):  # a retry would fail alike
                    mark_failed(marker, end["error"])
                    raise TrialFailed(end["error"])
                raise RuntimeError(end["error"])
            if end["reason"] == "lost":  # the trainer restarted since the trial joined
                raise TrainerLost(f"its trainer restarted (its process had died){RETRIED}")
            if end["reason"] == "stopped":  # not by Tune: the trainer found it gone
                raise RuntimeError("the trainer dropped this trial: no poll for "
                                   "group_trainer.STALE_S seconds")
            return True
        if not reports:
            time.sleep(POLL_S)


class _TrainedWrites:
    """How far the trial trained in its trainer, in the trial folder as an unfused run
    writes it (:class:`~.trained_log.TrainedLog`), at most every :data:`TRAINED_WRITE_S`
    seconds and at each report: should the trainer die, the examples it trained past the
    trial's last checkpoint -- trained again after the retry -- are counted."""

    def __init__(self, tune):
        self.tune, self.log, self.written_at = tune, None, 0.0

    def note(self, progress: tuple | None, how: str) -> None:
        if progress is None:
            return
        start, now = progress
        if self.log is None:
            storage = self.tune.get_context().get_storage()
            self.log = TrainedLog(storage.storage_filesystem, storage.trial_fs_path, start)
        if now > self.log.to and (how != "training"
                                  or time.time() - self.written_at >= TRAINED_WRITE_S):
            self.log.write(now, how)
            self.written_at = time.time()


@contextlib.contextmanager
def _checkpoint_here(trainer, folder: str | None, remote: bool):
    """A report's checkpoint folder readable on this node while Tune takes it
    (``tune.report`` copies it to the search's storage): the trainer's own folder, or, for
    a trainer on another node, a copy of its files fetched through Ray, removed after."""
    if not folder or not remote:
        yield folder
        return
    import ray  # deferred: ray
    files = ray.get(trainer.checkpoint_files.remote(folder))
    with tempfile.TemporaryDirectory(prefix="mtbert-fused-report-") as copy:
        for name, data in files.items():
            path = Path(copy) / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
        yield copy


def _heartbeat(trainer, trial_id: str, stop: threading.Event) -> None:
    """Tell the trainer this trial is there while ``tune.report`` waits on Tune."""
    while not stop.wait(HEARTBEAT_S):
        trainer.alive.remote(trial_id)
