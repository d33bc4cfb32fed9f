"""The fused path's trainer (``--fuse on``): one long-lived Ray actor per GPU (one on a
CPU-only cluster) that trains the trials Tune hands it as fused groups
(:class:`~mtbert.loop.training_group.TrainingGroup`, one per :func:`~mtbert.loop.training_group.fuse_key`).

It gets the tokenised data once, when it starts.  A thin Tune trial
(:mod:`.fused_trainable`) joins with its config (and the checkpoint Tune restores it from),
then polls: it takes its trial's reports (scalar metrics, checkpoint folder) and forwards
them to ``tune.report`` (a thin trial on another node takes the folder's files through
Ray, :meth:`GroupTrainer.checkpoint_files`).  A trial with a report not yet forwarded is
held -- not stepped;
the fused step moves only the trials given batches -- so a scheduler's stop acts where it
acts on the unfused path.  Each report's checkpoint folder is moved aside for its thin
trial (the trial's next evaluation writes a new one) and deleted once forwarded.

One loop thread does all torch work: it builds the joining trials, steps each group's
trials that are not held, and ends the trials whose thin trial left or stopped polling for
:data:`STALE_S` seconds (Tune ended its process); the others go on.  A trial that cannot
fuse (:func:`~mtbert.loop.training_group.unfusable`: a compiled or graphed step, an encoder
other than BERT) trains alone in the trainer, a group of one stepped by its own engine
(a :class:`~mtbert.loop.trainer.Trainer`'s), in turn with the groups.

Should the trainer's process die (a crash, ``kill -9``, its GPU lost), Ray restarts the
actor under its name (:data:`TRAINER_RESTARTS`; :mod:`.trainer_pool` keeps what its
constructor needs), empty: its thin trials' calls fail with Ray's actor error or find their
trial unknown (``poll``: ``lost``), they fail, and Tune retries each from its last
checkpoint into the restarted trainer (or another).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mtbert.core.config import PERTURBED, TrainConfig
from mtbert.tune.trial.trainable import ray_metrics

#: the trainers' Ray actor names: this prefix and the trainer's number
TRAINER_PREFIX = "mtbert-fused-trainer-"
#: seconds without a poll after which a trial's thin trial is taken as gone
STALE_S = 20.0
#: seconds the loop waits for work when no trial can step
IDLE_S = 0.05
#: how often Ray restarts a trainer whose process died (-1: each time; the trials' own
#: retries, ``--max-failures``, bound a search that keeps losing it)
TRAINER_RESTARTS = -1


@dataclass
class Seat:
    """One trial in the trainer: its run, its reports and how it ended."""
    cfg: TrainConfig
    restore: Any                 # the tune.Checkpoint it resumes from, or None
    out_dir: Path
    gid: str                     # its id in its group (unique per join)
    reports: list[tuple[dict, str | None]] = field(default_factory=list)
    forwarded: int = 0           # reports its thin trial has passed to tune.report
    end: dict | None = None      # {"reason": finished | failed | stopped, "error": str}
    seen_at: float = field(default_factory=time.time)
    ready_at: float | None = None
    leaving: bool = False
    key: tuple | None = None     # its group's fuse_key once it has joined one
    run: Any = None              # its TrialRun (or Trainer) once built
    trained_from: int = 0        # examples seen when it was built (its restore point)

    @property
    def held(self) -> bool:
        return self.forwarded < len(self.reports)


class GroupTrainer:
    """The actor (module doc); methods other than the loop run on Ray's method thread."""

    def __init__(self, data, threads: int = 0, stale_s: float = STALE_S):
        self.data = data
        self.threads = threads
        self.stale_s = stale_s
        self.seats: dict[str, Seat] = {}     # Tune trial id -> its latest join
        self.departing: list[Seat] = []      # earlier joins of re-joined trials, leaving
        self.groups: dict[tuple, Any] = {}   # fuse_key -> TrainingGroup
        self.joins = 0
        self.largest = 0                     # most trials one group held at once
        self.formed = 0                      # groups formed
        self.alone = 0                       # trials that could not fuse, trained alone
        self.base, self.restarts = _working_folder()
        self.root = self.base / f"run-{self.restarts}"  # this incarnation's
        self.root.mkdir(parents=True)
        self.cond = threading.Condition()
        threading.Thread(target=self._loop, name="fused-loop", daemon=True).start()

    # ------------------------------------------------------------ the thin trials' calls
    def fit_score(self, cfg_values: dict) -> tuple[int, int]:
        """How well a trial fits here (higher first): a group of its structure, then load."""
        from mtbert.loop.training_group import fuse_key  # deferred: torch
        key = fuse_key(TrainConfig.from_dict(cfg_values))
        with self.cond:
            running = sum(s.end is None for s in self.seats.values())
            return int(key in self.groups), -running

    def join(self, trial_id: str, cfg_values: dict, restore=None) -> None:
        """Trial ``trial_id`` trains here (from ``restore``, a tune.Checkpoint, if given);
        a seat it held before and still trains (a retry, or a trial Tune paused and resumes
        before this trainer heard it leave) leaves its group first."""
        with self.cond:
            old = self.seats.get(trial_id)
            if old is not None and old.end is None:
                old.leaving = True
                self.departing.append(old)  # the loop finds it there, no longer in seats
            self.joins += 1
            out_dir = self.root / trial_id / f"join-{self.joins}"
            self.seats[trial_id] = Seat(TrainConfig.from_dict(cfg_values), restore, out_dir,
                                        gid=f"{trial_id}#{self.joins}")
            self.cond.notify_all()

    def poll(self, trial_id: str, forwarded: int) -> tuple[list, dict | None, tuple | None]:
        """The reports after the first ``forwarded`` (those are forwarded: the trial trains
        on); once every report is forwarded or the trial was stopped here, how the trial
        ended (None: it trains; ``lost``: not known here, the trainer restarted); how far
        it trained in this join, (examples at its start, examples now), once it is built
        (the thin trial writes it down: what a trainer's death loses is counted)."""
        with self.cond:
            seat = self.seats.get(trial_id)
            if seat is None:
                return [], {"reason": "lost"}, None
            seat.seen_at = time.time()
            for _, folder in seat.reports[seat.forwarded:forwarded]:
                if folder:
                    shutil.rmtree(folder, ignore_errors=True)
            seat.forwarded = max(seat.forwarded, forwarded)
            self.cond.notify_all()
            pending = seat.reports[forwarded:]
            stopped = seat.end is not None and seat.end["reason"] == "stopped"
            end = seat.end if stopped or not pending else None
            if end is not None:
                shutil.rmtree(seat.out_dir, ignore_errors=True)
            trained = None if seat.run is None else (seat.trained_from, seat.run.examples_seen)
            return pending, end, trained

    def alive(self, trial_id: str) -> None:
        """The thin trial is there (while ``tune.report`` holds it)."""
        with self.cond:
            seat = self.seats.get(trial_id)
            if seat is not None:
                seat.seen_at = time.time()

    def leave(self, trial_id: str) -> None:
        """Tune ended the trial (stop, pause, error): it leaves its group; the others go on."""
        with self.cond:
            seat = self.seats.get(trial_id)
            if seat is not None and seat.end is None:
                seat.leaving = True
                self.cond.notify_all()

    def node_id(self) -> str:
        """The Ray node this trainer runs on."""
        import ray  # deferred: ray
        return ray.get_runtime_context().get_node_id()

    def checkpoint_files(self, folder: str) -> dict[str, bytes]:
        """A report's checkpoint folder as its files (relative path -> bytes), for a thin
        trial on another node, which cannot read this node's disk."""
        root = Path(folder).resolve()
        if not root.is_relative_to(self.root.resolve()):
            raise ValueError(f"{folder} is not a checkpoint folder of this trainer")
        return {str(p.relative_to(root)): p.read_bytes()
                for p in sorted(root.rglob("*")) if p.is_file()}

    def tune_ended(self, wait_s: float = 10.0) -> None:
        """Tune's loop is over: a trial still training here was ended by Tune without a
        word (its thin trial's process ended before its ``leave``), so it leaves now, as
        :data:`STALE_S` would have it leave later; returns once the loop has let them go."""
        deadline = time.time() + wait_s
        with self.cond:
            for seat in self.seats.values():
                if seat.end is None:
                    seat.leaving = True
            self.cond.notify_all()
            while any(s.end is None for s in self.seats.values()) and time.time() < deadline:
                self.cond.wait(0.05)

    def close(self) -> None:
        """The search is over: the working folders of this trainer and of its earlier
        incarnations (their reports never forwarded: their trials resumed from Tune's
        checkpoints) are removed."""
        shutil.rmtree(self.base, ignore_errors=True)

    def training(self) -> list[str]:
        """The trials training here now (Tune's ids)."""
        with self.cond:
            return [tid for tid, s in self.seats.items() if s.end is None]

    def placement(self) -> dict[str, int]:
        """What this trainer trained: trials joined, groups formed, the largest group, the
        trials trained alone, how often its process was restarted, the trials in its groups
        now; how their latest joins ended
        (finished, failed, stopped: Tune ended them or their thin trial went silent) or not
        yet (training)."""
        with self.cond:
            ends = [s.end["reason"] if s.end else "training" for s in self.seats.values()]
            return {"trials": self.joins, "groups": self.formed, "largest": self.largest,
                    "alone": self.alone, "restarts": self.restarts,
                    "grouped": sum(len(g.trials) for g in list(self.groups.values())),
                    **{reason: ends.count(reason)
                       for reason in ("finished", "failed", "stopped", "training")}}

    # ------------------------------------------------------------ the loop thread
    def _loop(self) -> None:
        self._warm()
        while True:
            with self.cond:
                now = time.time()
                for seat in self.seats.values():
                    if seat.end is None and now - seat.seen_at > self.stale_s:
                        seat.leaving = True
                self.departing = [s for s in self.departing if s.end is None]
                leaving = [s for s in (*self.seats.values(), *self.departing)
                           if s.leaving and s.end is None]
                joining = [s for s in self.seats.values()
                           if s.key is None and s.end is None and not s.leaving]
                stepping = {key: [s.gid for s in self.seats.values()
                                  if s.key == key and s.end is None and not s.held]
                            for key in self.groups}
                if not (leaving or joining or any(stepping.values())):
                    self.cond.wait(IDLE_S)
                    continue
            for seat in leaving:
                self._leave(seat)
            for seat in joining:
                self._join(seat)
            for key, ids in stepping.items():
                ids = [i for i in ids if i in self.groups[key].trials]
                if ids:
                    self._step(key, ids)

    def _warm(self) -> None:
        """What the first trial would otherwise wait for, done as the trainer starts (while
        the driver sets up MLflow and Tune): the trainer's imports (torch, transformers,
        the fused trainer) and, on a GPU, the CUDA context."""
        import torch  # deferred: torch

        import mtbert.loop.training_group  # noqa: F401  (deferred: torch, transformers)
        import mtbert.loop.trainer  # noqa: F401
        if self.threads:
            torch.set_num_threads(self.threads)
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")

    def _join(self, seat: Seat) -> None:
        from mtbert.loop.training_group import TrainingGroup, eager, fuse_key, unfusable  # deferred: torch
        from mtbert.loop.trainer import Trainer  # deferred: torch
        from mtbert.run.start_scores import StartScores  # deferred: torch
        from mtbert.run.trial_run import TrialRun  # deferred: torch
        try:
            alone = unfusable(seat.cfg)
            resume_from = None
            if seat.restore is not None:
                resume_from = seat.restore.to_directory(str(seat.out_dir / "restored"))
            build = (Trainer, seat.cfg) if alone else (TrialRun, eager(seat.cfg))
            # the trials of this trainer share their scores at 0 examples
            run = build[0](build[1], self.data, seat.out_dir / "run",
                           report=self._report_to(seat, lambda: run), resume_from=resume_from,
                           start_scores=StartScores(self.root / "start_scores"))
        except Exception as exc:
            self._ended(seat, {"reason": "failed", "error": f"{type(exc).__name__}: {exc}"})
            return
        key = ("alone", seat.gid) if alone else fuse_key(seat.cfg)
        if alone:
            print(f"[tune] trial {seat.gid} trains alone: {alone}", flush=True)
            self.alone += 1
        elif key not in self.groups:
            self.formed += 1
        group = self.groups.setdefault(key, TrainingGroup())
        group.add(run, trial_id=seat.gid, engine=run.engine if alone else None)
        self.largest = max(self.largest, len(group.trials))
        with self.cond:
            seat.key, seat.ready_at = key, time.time()
            seat.run, seat.trained_from = run, run.examples_seen

    def _report_to(self, seat: Seat, run):
        """The trial's report callback (on its checkpoint thread): the scalars as Ray gets
        them, the checkpoint folder moved aside until its thin trial has forwarded it."""
        perturbable = {f"config/{k}": getattr(seat.cfg, k) for k in PERTURBED}

        def report(metrics: dict, checkpoint_dir: str | None) -> None:
            import ray  # deferred: ray
            scalars = {**ray_metrics(metrics, run().history), **perturbable,
                       "time/ready_at": seat.ready_at or time.time(),
                       "node_id": ray.get_runtime_context().get_node_id()}
            kept = None
            with self.cond:
                if checkpoint_dir:
                    kept = seat.out_dir / f"report-{len(seat.reports)}"
                    os.rename(checkpoint_dir, kept)
                seat.reports.append((scalars, None if kept is None else str(kept)))
                self.cond.notify_all()
        return report

    def _step(self, key: tuple, ids: list[str]) -> None:
        group = self.groups[key]
        try:
            ended = group.step_once(ids)
        except Exception as exc:  # in the shared step: the group ends
            error = {"reason": "failed", "error": f"fused step: {type(exc).__name__}: {exc}"}
            ended = {gid: error for gid in group.trials}
            for gid in list(group.trials):
                try:
                    group.remove(gid)
                except Exception:
                    pass
            del self.groups[key]
        else:
            ended = {gid: _how(end) for gid, end in ended.items()}
        by_gid = {s.gid: s for s in (*self.seats.values(), *self.departing)}
        for gid, how in ended.items():
            if gid in by_gid:
                self._ended(by_gid[gid], how)
        if key in self.groups and not group.trials:
            del self.groups[key]

    def _leave(self, seat: Seat) -> None:
        group = self.groups.get(seat.key)
        if group is not None and seat.gid in group.trials:
            try:
                group.remove(seat.gid)
            except Exception:  # its last checkpoint's report failed: it leaves all the same
                pass
            if not group.trials:
                del self.groups[seat.key]
        self._ended(seat, {"reason": "stopped"})

    def _ended(self, seat: Seat, how: dict) -> None:
        with self.cond:
            seat.end, seat.leaving = how, False
            if how["reason"] == "stopped":  # nobody forwards its reports any more
                shutil.rmtree(seat.out_dir, ignore_errors=True)
            self.cond.notify_all()


def _how(end) -> dict:
    """A group's TrialEnd as the thin trial reads it."""
    from mtbert.run.trial_run import NonFiniteLossError  # deferred: torch
    if end.reason == "failed":
        error = end.error
        if isinstance(error, NonFiniteLossError):
            return {"reason": "failed", "error": f"non-finite loss: {error}"}
        return {"reason": "failed", "error": f"{type(error).__name__}: {error}"}
    return {"reason": end.reason}


def _working_folder() -> tuple[Path, int]:
    """The trainer's folder for checkpoints on their way to Tune, kept across its restarts
    (named by its Ray actor id, which a restart keeps), and how many incarnations used it
    before this one (its restarts); outside an actor, a new temporary folder."""
    try:
        import ray  # deferred: ray
        actor_id = ray.get_runtime_context().get_actor_id()
    except Exception:
        actor_id = None
    if not actor_id:
        return Path(tempfile.mkdtemp(prefix="mtbert-fused-")), 0
    base = Path(tempfile.gettempdir()) / f"mtbert-fused-{actor_id}"
    base.mkdir(exist_ok=True)
    return base, sum(1 for p in base.iterdir() if p.name.startswith("run-"))
