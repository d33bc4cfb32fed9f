"""One trial trained to its end: a :class:`~mtbert.run.trial_run.TrialRun` and its own step
engine (:mod:`mtbert.step.step_engine`), trained by the one loop
(:class:`~mtbert.loop.training_group.TrainingGroup`, a group of one). No Ray here.

The :class:`Trainer` is the one-trial run the command line (``python -m mtbert.train``)
and the search's trainable build: the trial's state and bookkeeping are the
:class:`~mtbert.run.trial_run.TrialRun`'s (data order, schedule, counters, evaluations,
checkpoints, reports, NaN check); the step is eager -- the
:class:`~mtbert.step.step_engine.EagerStep` of the one trial, as a group of one steps it --
or from captured CUDA graphs (``step_mode``, :class:`~mtbert.step.step_graphs.StepGraphs`),
which a worker keeps for its next trial of the same structure (:mod:`mtbert.loop.graph_reuse`).
:func:`train_fused` trains several configurations, those of one structure fused.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from mtbert.core.config import TrainConfig
from mtbert.core.devices import resolve_device
from mtbert.data import MultitaskData, real_rows
from mtbert.loop import graph_reuse
from mtbert.loop.training_group import TrainingGroup, plan_groups
from mtbert.model.model import MultitaskModel
from mtbert.run.trial_run import (Batches, NonFiniteLossError, ReportFn, RunParts,  # noqa: F401
                                  TrialRun, next_eval_point)
from mtbert.step.step_engine import EagerStep, OneTrial
from mtbert.step.step_graphs import StepGraphs, eager_reason, graphs_wanted


class Trainer(TrialRun):
    """One trial stepped by its own engine: eager, or captured CUDA graphs."""

    def __init__(self, cfg: TrainConfig, data: MultitaskData, out_dir: str | Path,
                 report: ReportFn | None = None, resume_from: str | Path | None = None,
                 model: MultitaskModel | None = None, checkpoints: bool = True,
                 stop_requested: Callable[[], bool] | None = None,
                 threads_wanted: Callable[[], int] | None = None,
                 start_scores: StartScores | None = None):
        """See :class:`~mtbert.run.trial_run.TrialRun` for the arguments."""
        setup_started = time.perf_counter()
        graphs = graphs_wanted(cfg, resolve_device(cfg.device))
        # graphs: what this worker's previous trainer of the same structure captured
        kept = graph_reuse.take(graph_reuse.structure(cfg)) if graphs and model is None else None
        super().__init__(cfg, data, out_dir, report=report, resume_from=resume_from,
                         model=model, checkpoints=checkpoints, stop_requested=stop_requested,
                         threads_wanted=threads_wanted, start_scores=start_scores,
                         capturable=graphs,
                         reused=kept.parts if kept is not None else None)
        self._reusable = model is None  # a caller's own model is not left for another
        self.eager_step = EagerStep(OneTrial(self))
        # step_mode=graphs: the step from captured CUDA graphs (after any restore: it takes
        # the optimizer's param groups as they are then)
        self.step_graphs = (StepGraphs(self, log=self.log,
                                       kept=kept.step_graphs if kept is not None else None)
                            if graphs else None)
        self.timings["setup_s"] = time.perf_counter() - setup_started

    @property
    def engine(self):
        """The step engine: the step graphs where there are any, else the eager step."""
        return self.step_graphs if self.step_graphs is not None else self.eager_step

    def step_name(self) -> str:
        if self.step_graphs is not None:
            return "graphs"
        reason = eager_reason(self.cfg, self.device)
        return f"eager ({reason})" if reason else "eager"

    def engine_metrics(self) -> dict:
        return self.step_graphs.stats.as_metrics() if self.step_graphs is not None else {}

    def leave_for_reuse(self) -> None:
        """A graphed trainer that ended (budget spent, stopped, diverged) leaves its model
        and graphs to this process's next trainer (:mod:`mtbert.loop.graph_reuse`); it takes no
        step after this (its step graphs let go of it, so it can be freed)."""
        if self.step_graphs is not None and self.dropout_rate is not None and self._reusable:
            self.step_graphs.release()  # this trainer steps no more
            graph_reuse.keep(graph_reuse.KeptStep(graph_reuse.structure(self.cfg),
                                                  RunParts.of(self), self.step_graphs))

    # ------------------------------------------------------------------ training
    def fit(self) -> dict:
        """Train to ``max_examples`` or ``epochs`` (the one loop: a
        :class:`~mtbert.loop.training_group.TrainingGroup` of this trial and its own
        engine); returns the final metrics.  Raises what ended it: ``SystemExit`` (stopped
        by its report or ``stop_requested``), :class:`NonFiniteLossError` (diverged), an
        error of its own part or of its engine."""
        (result,) = self.as_group().fit()  # an error in the engine's step is raised, the run closed
        ended = isinstance(result, BaseException)
        if not ended or isinstance(result, (SystemExit, NonFiniteLossError)):
            self.leave_for_reuse()  # finished, stopped or diverged: its graphs go on
        if ended:
            raise result
        return result

    def as_group(self) -> TrainingGroup:
        """This trial in the one loop: a group of one, stepped by its own engine."""
        group = TrainingGroup()
        group.add(self, engine=self.engine)
        return group

    def train_batches(self, batches: Batches) -> None:
        """One schedule step on host ``batches``: one optimizer step on the super-batch
        (``update=summed``) or one per task batch; no evaluation or other bookkeeping."""
        for step in self.update_steps(batches):
            self.count_update(self.engine.step({self: step})[self])
        self.examples_seen += sum(real_rows(b) for b in batches.values())

    def optimizer_step(self, batches: Batches) -> None:
        """One eager optimizer step on device ``batches`` ({task: batch}); counts no
        examples (``train_batches`` does, and takes the graphed step where it runs)."""
        self.count_update(self.eager_step.step({self: batches})[self])


def train_fused(cfgs: list[TrainConfig], data: MultitaskData, out_dirs: list[str | Path],
                log=print) -> list[dict | BaseException]:
    """Train every configuration into its folder (``out_dirs[i]``, the files of a solo
    run): each fusable structure's configurations as one :class:`TrainingGroup`, the others
    alone (the reason logged).  Returns each one's final metrics or the error that stopped
    it, in the order of ``cfgs``."""
    results: list[dict | BaseException | None] = [None] * len(cfgs)
    for members, reason in plan_groups(cfgs):
        if reason is not None or len(members) == 1:
            i = members[0]
            if reason is not None:
                log(f"[mtbert] {out_dirs[i]}: trains alone: {reason}")
            try:
                results[i] = Trainer(cfgs[i], data, out_dirs[i]).fit()
            except NonFiniteLossError as exc:
                results[i] = exc
            continue
        log(f"[mtbert] {len(members)} trials fused: {', '.join(str(out_dirs[i]) for i in members)}")
        group = TrainingGroup([cfgs[i] for i in members], data, [out_dirs[i] for i in members])
        for i, result in zip(members, group.fit()):
            results[i] = result
    return results
