"""The one training loop: trials started, stepped by one engine, evaluated and finished.

A :class:`TrainingGroup` trains the trials in it, a step at a time, each trial a
:class:`~mtbert.run.trial_run.TrialRun`:

* a solo trial with its own engine (:class:`~mtbert.loop.trainer.Trainer`: the eager step,
  or its captured CUDA graphs), a group of one -- ``Trainer.fit`` is this loop;
* trials of one structure (:func:`fuse_key`: the model and its heads, the pair encoding,
  the losses and the gradient combiner, each task's batch size, the data) fused into one
  stacked engine (:mod:`mtbert.step.stacked_trials`);
* a trial that cannot fuse (:func:`unfusable` says why, in one line), trained alone with its
  own engine in the fused path's trainer (``mtbert/tune/trial/group_trainer.py``).

Each trial of a fused group is a :class:`~mtbert.run.trial_run.TrialRun` built as its solo
run builds it (initial weights from its seed, pre-training, batchers, schedule, LR
schedule, optimizer), so each keeps everything a solo run has: its batches in its order,
its evaluations, history, checkpoints, reports and predictions, in its own folder (the
files of a solo run; a checkpoint resumes solo or in a group).  Only the step is shared:
the group's engine (:func:`group_step`) is the eager step (:mod:`mtbert.step.step_engine`)
of the trials stacked on a trial axis, or, for a group of one, of the trial alone, as its
solo run steps it.  Each trial advances one optimizer step per group step.

Events (driven a step at a time): between steps a trial joins (``add``, fresh or resumed),
is stopped (``remove``) or paused (``pause``: a checkpoint of where it stands, to resume
from).  A trial that reaches its end, diverges (a non-finite loss, found at its next check)
or fails in its own part (its batches, evaluation, report) leaves alone.  A leaving
trial's weights and moments become its own tensors again, and the group re-forms at its
next step: the trials still there are stacked anew.  The others train on as without the
event: the trials share no weight, so a trial's slice of the step (its gradient, its
clipping norm, its update) depends on its own weights and batches only -- a NaN stays in
its slice -- and only the padding changes, which moves the sums by rounding at most
(``tests/test_fused.py``: float64, within 1e-8 of the solo runs).  An error in the shared
step itself ends the group.

Each trial draws from its own random stream (``TrialRun.generator``,
:mod:`mtbert.core.trial_streams`): its masks' seed, SMART noise and PCGrad task orders, as
its solo run draws them, and its dropout masks are its own; a joining trial's
construction (which seeds torch's global generator) moves no other trial's stream.  Not
fused yet: ``torch.compile`` and CUDA graphs of the stacked step (it is eager; on CUDA the
trials train with ``step_mode=eager``), and encoders other than BERT's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Hashable

import torch

from mtbert.loop import graph_reuse
from mtbert.core.config import DATA_PER_SEARCH, FUSED_PER_TRIAL, TrainConfig
from mtbert.data import MultitaskData, SharedBuckets
from mtbert.step.fused_model import FUSABLE_MODEL_TYPES
from mtbert.core.pretrained import load_model_config
from mtbert.step.stacked_trials import StackedTrials
from mtbert.step.step_engine import EagerStep, OneTrial, StepEngine
from mtbert.core.tasks import TASK_NAMES
from mtbert.run.trial_run import Batches, TrialRun


def fuse_key(cfg: TrainConfig) -> tuple:
    """Trials with equal keys train as one fused model: the step's structure
    (:func:`mtbert.loop.graph_reuse.structure`, less :data:`~mtbert.core.config.FUSED_PER_TRIAL`: the
    fixed loss weights), each task's batch size, the length buckets (a step's trials share
    one: ``SharedBuckets``) and the settings that shape the data (one ``MultitaskData``
    serves the group: :data:`~mtbert.core.config.DATA_PER_SEARCH`)."""
    structure = tuple(item for item in graph_reuse.structure(cfg)
                      if item[0] not in FUSED_PER_TRIAL)
    data = tuple(sorted((k, v) for k, v in cfg.to_dict().items() if k in DATA_PER_SEARCH))
    return structure + (("task_batch_sizes", tuple(cfg.task_batch_size(t) for t in TASK_NAMES)),
                        ("length_buckets", (cfg.length_bucketing, cfg.bucket_batches)),
                        ("data", data))


def unfusable(cfg: TrainConfig) -> str | None:
    """Why ``cfg`` trains alone (one line), or None when it can fuse."""
    if cfg.compile != "none":
        return f"compile={cfg.compile}: torch.compile of the fused step is not built"
    if cfg.step_mode == "graphs":
        return "step_mode=graphs: the fused step runs eagerly (no fused CUDA graphs yet)"
    model_type = getattr(load_model_config(cfg.model), "model_type", None)
    if model_type not in FUSABLE_MODEL_TYPES:
        return (f"model_type {model_type!r}: the fused step is built for "
                f"{', '.join(FUSABLE_MODEL_TYPES)} encoders")
    return None


def plan_groups(cfgs: list[TrainConfig]) -> list[tuple[list[int], str | None]]:
    """(indices of the configurations, why they train alone or None) per group, in the
    order of their first configuration: a fusable structure's configurations together, an
    unfusable one's each alone."""
    groups: dict[tuple, list[int]] = {}
    reasons: dict[int, str] = {}
    for i, cfg in enumerate(cfgs):
        reason = unfusable(cfg)
        if reason is not None:
            reasons[i] = reason
            groups[("alone", i)] = [i]
        else:
            groups.setdefault(fuse_key(cfg), []).append(i)
    return [(members, reasons.get(members[0])) for members in groups.values()]


def eager(cfg: TrainConfig) -> TrainConfig:
    """The trial's config as its fused run trains it: the step is eager."""
    return cfg if cfg.step_mode == "eager" else cfg.replace(step_mode="eager")


def group_step(trials: list[TrialRun]) -> EagerStep:
    """The engine of a group's trials: the eager step (:mod:`mtbert.step.step_engine`) of
    their stack (:class:`~mtbert.step.stacked_trials.StackedTrials`) or, for a group of
    one, of the trial alone (:class:`~mtbert.step.step_engine.OneTrial`:
    N = 1 skips the trial axis, as HFTA's B = 0 is the plain module; its tensors its own,
    copies of its slices of the stack it leaves, if any): then the same ops, draws and
    arithmetic as its solo run.  A trial that joins re-forms the group, and the next
    stack takes each trial's state in as it is."""
    if len(trials) == 1:
        own_tensors(trials[0])
        return EagerStep(OneTrial(trials[0]))
    return EagerStep(StackedTrials(trials))


def own_tensors(trial: TrialRun) -> None:
    """``trial``'s model weights, loss weights, SMART teacher and optimizer state become
    tensors of its own (copies of its slices of a :class:`~mtbert.step.stacked_trials.StackedTrials`'),
    which no engine steps."""
    with torch.no_grad():
        for p in [*trial.model.parameters(), *trial.loss_combiner.parameters()]:
            p.data = p.data.clone()
    if trial.regulariser is not None and trial.regulariser.teacher is not None:
        trial.regulariser.teacher = {k: t.clone() for k, t in trial.regulariser.teacher.items()}
    for p, state in trial.optimizer.state.items():
        trial.optimizer.state[p] = {k: v.clone() for k, v in state.items()}


@dataclass
class TrialEnd:
    """How a trial left its group: ``finished`` (its final metrics), ``failed`` (the error
    that ended it: a non-finite loss, an error in its own evaluation or report),
    ``stopped`` (by its ``stop_requested`` or report -- ``error`` the SystemExit -- or by
    :meth:`TrainingGroup.remove`), ``paused`` (the checkpoint it resumes from)."""
    reason: str
    metrics: dict | None = None
    error: BaseException | None = None
    checkpoint: Path | None = None

    @property
    def result(self) -> dict | BaseException | "TrialEnd":
        """What :meth:`TrainingGroup.fit` returns for it: the final metrics, the error, or
        this record (stopped or paused by the group's owner)."""
        if self.metrics is not None:
            return self.metrics
        return self.error if self.error is not None else self


class TrainingGroup:
    """Trials of one structure trained together, one engine for all, or one trial with its
    own engine (see the module doc).  Step-driven: :meth:`step_once` / :meth:`run_steps`
    step every trial in the group once; between steps a trial may join (:meth:`add`), leave
    (:meth:`remove`) or pause (:meth:`pause`), and the group re-forms at its next step.  A
    trial that ends -- its end reached, a non-finite loss, an error in its own bookkeeping,
    a stop -- leaves alone; the others go on as they would without it.  :meth:`fit` runs to
    the end.

    ``cfgs``, ``out_dirs``: trials built here (ids 0, 1, ...), each as its solo run builds
    it; ``models``: their initial models (default: built from their seeds);
    ``trial_options``: passed to every :class:`TrialRun` (``report``, ``checkpoints``)."""

    def __init__(self, cfgs: list[TrainConfig] = (), data: MultitaskData | None = None,
                 out_dirs: list[str | Path] = (), models: list | None = None,
                 **trial_options):
        self.trials: dict[Hashable, TrialRun] = {}  # the trials in the group, in join order
        self.ended: dict[Hashable, TrialEnd] = {}
        self.joined: list[Hashable] = []            # every id the group has held, in order
        self.key: tuple | None = None
        self.engine: StepEngine | None = None       # None: (re-)formed at the next step
        self.own_engine: StepEngine | None = None   # a trial's own engine (it trains alone)
        self._started: set[Hashable] = set()
        for i, (cfg, out) in enumerate(zip(cfgs, out_dirs)):
            self.add(TrialRun(eager(cfg), data, out, model=None if models is None
                              else models[i], **trial_options))

    def add(self, trial: TrialRun, trial_id: Hashable | None = None,
            engine: StepEngine | None = None) -> Hashable:
        """``trial`` (fresh or resumed, built with ``step_mode`` eager) joins at the next
        step; returns its id (default: the next integer).  ``engine``: the trial's own (a
        :class:`~mtbert.loop.trainer.Trainer`'s, eager or captured graphs): it trains alone,
        the group's one trial."""
        if self.own_engine is not None or (engine is not None and self.trials):
            raise ValueError("a trial with its own engine trains alone: a group of one")
        key = fuse_key(trial.cfg) if engine is None else ("own engine",)
        if self.key is not None and key != self.key:
            raise ValueError("a fused group's trials must share one structure (fuse_key)")
        trial_id = len(self.joined) if trial_id is None else trial_id
        if trial_id in self.trials or trial_id in self.ended:
            raise ValueError(f"trial id {trial_id!r} is taken in this group")
        self.key, self.own_engine = key, engine
        self.trials[trial_id] = trial
        self.joined.append(trial_id)
        self._reform()
        return trial_id

    def remove(self, trial_id: Hashable) -> TrialEnd:
        """``trial_id`` leaves the group now, as a scheduler stops a trial: the checkpoint it
        is writing is finished and reported, its tensors become its own; the others go on."""
        return self._end(trial_id, TrialEnd("stopped"))

    def pause(self, trial_id: Hashable) -> TrialEnd:
        """``trial_id`` leaves with a checkpoint of where it stands (``checkpoint`` of the
        returned record): a :class:`TrialRun` built with ``resume_from`` there trains on as
        it would have, in this group or another, or alone.  Amid a schedule step (several
        updates under ``update=per_task``) it first takes that step's remaining updates
        alone (the others do not move); should it end meanwhile, the record says how."""
        trial = self.trials[trial_id]
        while trial.mid_schedule_step:
            ended = self._step([trial_id])
            if trial_id in ended:
                return ended[trial_id]
        try:
            checkpoint = trial.save_checkpoint()
        except (Exception, SystemExit) as exc:
            return self._failed(trial_id, exc)
        return self._end(trial_id, TrialEnd("paused", checkpoint=checkpoint))

    def _reform(self) -> None:
        """The members changed: the next step builds the engine of the trials then in the
        group (stacked anew from their slices of this one)."""
        self.engine = None

    def _end(self, trial_id: Hashable, end: TrialEnd) -> TrialEnd:
        trial = self.trials.pop(trial_id)
        if end.reason != "finished":
            trial.close()
        if self.own_engine is None:  # its own engine's tensors are its own
            own_tensors(trial)
        self._reform()
        self.ended[trial_id] = end
        return end

    def _failed(self, trial_id: Hashable, exc: BaseException) -> TrialEnd:
        reason = "stopped" if isinstance(exc, SystemExit) else "failed"
        return self._end(trial_id, TrialEnd(reason, error=exc))

    # ------------------------------------------------------------------ training
    def step_once(self, ids: list[Hashable] | None = None) -> dict[Hashable, TrialEnd]:
        """One fused step of every trial in the group, or of the trials ``ids`` (the others
        held: they do not move); after a trial's last step, its finish (final evaluation,
        predictions, ``metrics.json``).  The trials that ended in it, also in :attr:`ended`."""
        return self._step(list(self.trials) if ids is None else list(ids))

    def run_steps(self, steps: int) -> dict[Hashable, TrialEnd]:
        """Up to ``steps`` fused steps (fewer once no trial is left); the trials that ended."""
        ended: dict[Hashable, TrialEnd] = {}
        for _ in range(steps):
            if not self.trials:
                break
            ended.update(self.step_once())
        return ended

    def fit(self) -> list[dict | BaseException | TrialEnd]:
        """Train every trial to its end; each one's :attr:`TrialEnd.result` in join order:
        its final metrics or the error that ended it."""
        try:
            while self.trials:
                self.step_once()
        finally:
            for trial in self.trials.values():
                trial.close()
        return [self.ended[i].result for i in self.joined if i in self.ended]

    def _step(self, ids: list[Hashable]) -> dict[Hashable, TrialEnd]:
        """One fused step of the trials ``ids``; an error in one trial's own part (its
        batches, bookkeeping, evaluation, report) ends that trial alone, an error in the
        shared step is raised."""
        ended: dict[Hashable, TrialEnd] = {}
        batches: dict[Hashable, Batches] = {}
        buckets = SharedBuckets()  # each task's rows from one length bucket (TaskBatcher)
        for trial_id in ids:
            trial = self.trials[trial_id]
            try:
                if trial_id not in self._started:
                    self._started.add(trial_id)
                    trial.start(None if self.own_engine is not None
                                else f"fused ({len(self.trials)} trials)")
                update = trial.next_update(buckets)
                metrics = trial.finish() if update is None else None
                if update is None:
                    ended[trial_id] = self._end(trial_id, TrialEnd("finished", metrics=metrics))
                else:
                    batches[trial_id] = update
            except (Exception, SystemExit) as exc:
                ended[trial_id] = self._failed(trial_id, exc)
        if not batches:
            return ended
        if self.engine is None:
            self.engine = self.own_engine or group_step(list(self.trials.values()))
        losses = self.engine.step({self.trials[i]: b for i, b in batches.items()})
        for trial_id in batches:
            trial = self.trials[trial_id]
            try:
                trial.stepped(losses[trial])
            except (Exception, SystemExit) as exc:
                ended[trial_id] = self._failed(trial_id, exc)
        return ended
