"""One trial's run: its state and bookkeeping, apart from the engine that steps it.

A :class:`TrialRun` holds everything of one trial but the step: its model (built from its
seed) and its optimizer, LR schedule, loss weighting and regulariser (what a step engine
updates), its data order (batchers) and task schedule, its counters, reports and NaN
check, and when it evaluates and checkpoints.  Beside it, the scoring and the records of an
evaluation (:mod:`mtbert.run.evaluation`) and what a checkpoint holds, its writing and
reporting and its restore (:mod:`mtbert.run.checkpoint`).  A step engine
(:mod:`mtbert.step.step_engine`) trains its updates, driven by the one training loop
(:class:`~mtbert.loop.training_group.TrainingGroup`): the eager or graphed engine of a
:class:`~mtbert.loop.trainer.Trainer`, or the fused one of a group.  The run is
step-driven::

    trial.start(step_name)                 # progress line; evaluation at 0 examples
    while (batches := trial.next_update()) is not None:
        losses = engine.step({trial: batches})[trial]
        trial.stepped(losses)              # count, LR schedule; evaluate, report, stop
    trial.finish()                         # final evaluation, predictions, metrics.json

The fidelity unit is *examples seen*. Every ``eval_every`` examples (or each
epoch) the run scores the validation split, writes a checkpoint and calls
``report(metrics, checkpoint_dir)``; the Ray adapter plugs in there. With
``eval_at_start`` (default) a fresh run also does so at 0 examples, before its first
optimizer step (after any pre-training stage), so every curve shows where training
started from; a resumed run does not repeat it, and a run handed ``start_scores``
reads it where a run with the same weights kept it (:mod:`mtbert.run.start_scores`).

Learning rates: the encoder trains at ``lr``, everything outside it (task heads,
shared pair layer, cosine maps) at ``lr · head_lr_multiplier``; loss-combiner
parameters at ``lr``. Each is split into weight-decay / no-decay groups.

Exact resume: the data order is a pure function of (seed, task, batches drawn, epoch)
(see ``TaskBatcher`` and ``Schedule.plan``), so a checkpoint holds only counters and the
running train-loss sums, plus model/optimizer/LR-scheduler/regulariser state and the
trial's random stream (:attr:`TrialRun.generator`: its masks' seeds, SMART's noise, PCGrad's
orders).

No host synchronisation per step (on a GPU the CPU then queues step k+1 while the GPU
runs step k): each step's task losses stay on the device; they are copied to the host,
summed and checked for NaN/Inf at the next log line (every ~10 s) or evaluation, which
stops a diverged run there with the task, examples and lr of its first bad step.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from mtbert.core.atomic import atomic_write_json
from mtbert.run.checkpoint import (COUNTERS, CheckpointContents, CheckpointFolder, ReportFn,
                               TrainingParts, evaluation_writes_checkpoint, restore_checkpoint)
from mtbert.core.config import TrainConfig
from mtbert.model.cosine_init import fit_qqp_cosine
from mtbert.data import (MultitaskData, SharedBuckets, TaskBatcher, collate, encoding_for,
                         eval_rows, eval_token_cap, real_rows)
from mtbert.core.devices import (check_compile_mode, check_step_mode, compile_model,
                                 resolve_device, to_device, uses_bf16)
from mtbert.model.dropout_rate import DropoutRate, hold_dropout_in_tensor
from mtbert.model.fused_attention import draw_attention_from
from mtbert.techniques.gradients import build_gradient_combiner
from mtbert.run.evaluation import Scoring, append_history, progress_line, train_losses
from mtbert.techniques.losses import build_loss_combiner
from mtbert.techniques.lr_schedules import build_lr_scheduler
from mtbert.run.metrics import scalar_metrics
from mtbert.run.start_scores import StartScores
from mtbert.model.model import MultitaskModel
from mtbert.techniques.pretrain import run_pretraining
from mtbert.techniques.task_schedules import build_schedule, super_batches
from mtbert.techniques.smart import SmartRegulariser, build_regulariser
from mtbert.core.tasks import TASK_NAMES
from mtbert.core.trial_streams import MaskStream, trial_generator
from mtbert.run.training_state import CheckpointWriter

Batches = dict[str, dict[str, torch.Tensor]]  # {task: batch}: one optimizer step's


class NonFiniteLossError(RuntimeError):
    """A task loss became NaN or Inf: the run cannot go on."""


def static_max_length(cfg: TrainConfig, device: torch.device, max_length: int) -> int:
    """The static max length, 0 for batch padding.  ``pad_lengths``: static lengths and
    fixed batch sizes where shapes are costly (CUDA), the batch's longest row where padding
    is compute (CPU)."""
    buckets = cfg.pad_lengths == "buckets" or (cfg.pad_lengths == "auto"
                                               and device.type == "cuda")
    return max_length if buckets else 0


def next_eval_point(seen: int, every: int, growth: float = 1.0) -> int:
    """The first evaluation point after ``seen`` examples: multiples of ``every``
    (growth 1), or the geometric points round(every · growth^k) -- ASHA's rungs when
    ``growth`` is its reduction factor, so no evaluation is spent between rungs."""
    if growth <= 1.0:
        return (seen // every + 1) * every
    point, k = every, 0
    while point <= seen:
        k += 1
        point = int(round(every * growth ** k))
    return point


@dataclass
class RunParts:
    """What a run that ended leaves for the next run of the same structure in its process
    (a captured step reads these tensors): its model (with the rate-tensor dropouts), loss
    weighting, SMART regulariser (or None) and dropout rate."""
    model: MultitaskModel
    loss_combiner: torch.nn.Module
    regulariser: SmartRegulariser | None
    dropout_rate: DropoutRate

    @classmethod
    def of(cls, run: TrialRun) -> RunParts:
        return cls(run.model, run.loss_combiner, run.regulariser, run.dropout_rate)


class TrialRun:
    """One trial's state and bookkeeping (see the module doc); no step of its own."""

    def __init__(self, cfg: TrainConfig, data: MultitaskData, out_dir: str | Path,
                 report: ReportFn | None = None, resume_from: str | Path | None = None,
                 model: MultitaskModel | None = None, checkpoints: bool = True,
                 stop_requested: Callable[[], bool] | None = None, capturable: bool = False,
                 reused: RunParts | None = None,
                 threads_wanted: Callable[[], int] | None = None,
                 start_scores: StartScores | None = None):
        """``checkpoints=False``: evaluations write no ``out_dir/checkpoint`` unless a
        ``report`` callback takes it (for callers that never resume, e.g. benchmarks).
        ``stop_requested``: asked after every schedule step; True stops the run there with
        ``SystemExit(0)``, as a stop from Ray's report does.  ``threads_wanted``: asked
        after every schedule step; the torch CPU threads to train on from there
        (:attr:`threads`).  ``capturable``: every value a step reads lives in a device
        tensor (a capturable optimizer, the dropout rate and SMART's values), so that an
        engine may capture the step; ``reused``: the model, loss weighting, regulariser and
        dropout rate an earlier run of the same structure left, which this run takes with
        its own initial values.  ``start_scores``: where the evaluation at 0 examples is
        read if a run with the same weights kept it, and kept otherwise (a search's
        trials share one)."""
        setup_started = time.perf_counter()
        self.cfg = cfg
        self.data = data
        self.out_dir = Path(out_dir)
        self.report = report
        self.checkpoints = checkpoints
        self.stop_requested = stop_requested
        self.threads_wanted = threads_wanted
        self.start_scores = start_scores
        self.device = resolve_device(cfg.device)
        check_compile_mode(cfg.compile, self.device)
        check_step_mode(cfg.step_mode, self.device)
        self.static_max_length = static_max_length(cfg, self.device, data.max_length)
        self.eval_max_tokens = eval_token_cap(cfg.eval_batch_tokens, self.device.type)
        self.eval_rows = eval_rows(cfg.eval_batch_size, self.device.type)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self.threads = torch.get_num_threads()  # of this thread, the one that trains
        torch.manual_seed(cfg.seed)
        self._build_model(model or MultitaskModel.from_config(cfg), reused, capturable)
        if resume_from is None:
            self._prepare_fresh_model()
        self._build_loss_parts(reused, capturable)
        self._build_batching()
        # the fused kernel updates all 22M MiniLM parameters in ~15 ms on one CPU thread,
        # the default for-loop implementation in ~190 ms (a large share of a training step)
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=cfg.lr, fused=True,
                                           capturable=capturable)
        self.configured_lrs = [group["lr"] for group in self.optimizer.param_groups]
        self.total_steps, total_examples = self._count_optimizer_steps()
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg, self.total_steps,
                                               total_examples / self.total_steps)
        self.autocast = uses_bf16(cfg.precision, self.device)  # bf16 autocast
        compile_model(self.model, cfg.compile)
        self._start_counters()
        #: the trial's random stream (:mod:`mtbert.core.trial_streams`): every draw of its
        #: steps; from the global generator's state now (a resume: the checkpoint's)
        self.generator = trial_generator(self.device)
        #: its dropout masks, seeded from the stream as each step begins
        self.mask_stream = self.dropouts.masks
        if self.regulariser is not None:
            self.regulariser.draw_from(self.generator, self.mask_stream)
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        # where this process's time goes (reported as time/*; not kept across a resume):
        # setup = model load, pre-training stage, optimizer, batchers, checkpoint restore
        self.timings = {"setup_s": time.perf_counter() - setup_started, "train_s": 0.0,
                        "eval_s": 0.0, "checkpoint_s": 0.0}
        # checkpoints are snapshot here and written (and reported) on a background thread
        self.checkpoint_folder = CheckpointFolder(self.out_dir)
        self.checkpoint_writer = CheckpointWriter()

    # ------------------------------------------------------------------ setup
    def _build_model(self, fresh: MultitaskModel, reused: RunParts | None,
                     capturable: bool) -> None:
        """The model on the device: ``fresh``, or the reused one with ``fresh``'s weights
        copied in (in place: a captured step reads those tensors).  On CUDA and where the
        step is capturable the ``dropout`` rate is a device tensor
        (:mod:`mtbert.model.dropout_rate`)."""
        self.dropout_rate = None
        if reused is not None:
            reused.model.load_state_dict(fresh.state_dict())
            reused.dropout_rate.fill(self.cfg.dropout)
            self.model, self.dropout_rate = reused.model, reused.dropout_rate
            self.dropouts = self.dropout_rate
            return
        self.model = fresh.to(self.device)
        if capturable or self.device.type == "cuda":
            self.dropout_rate = hold_dropout_in_tensor(self.model, self.cfg.dropout,
                                                       self.device)
        #: the dropouts the ``dropout`` setting governs (the trial's masks)
        self.dropouts = self.dropout_rate or hold_dropout_in_tensor(
            self.model, self.cfg.dropout, self.device, number=True)
        self.dropouts.masks = MaskStream(1, self.device)
        draw_attention_from(self.model, self.dropouts.masks, self.device)

    def _build_loss_parts(self, reused: RunParts | None, capturable: bool) -> None:
        """Loss weighting, gradient combiner and SMART regulariser; reused parts' weighting
        and regulariser take this run's initial state and values in place."""
        cfg = self.cfg
        self.loss_combiner = build_loss_combiner(cfg).to(self.device)
        self.grad_combiner = build_gradient_combiner(cfg)
        if reused is None:
            self.regulariser = build_regulariser(cfg, self.model)
            if capturable and self.regulariser is not None:
                self.regulariser.hold_in_tensors(self.device)
            return
        reused.loss_combiner.load_state_dict(self.loss_combiner.state_dict())
        self.loss_combiner, self.regulariser = reused.loss_combiner, reused.regulariser
        if self.regulariser is not None:
            self.regulariser.refill(cfg, self.model)

    def _build_batching(self) -> None:
        """Each task's training split, encoding and batcher, and the task schedule."""
        cfg, data = self.cfg, self.data
        self.train_splits = {t: data.split(t, "train") for t in TASK_NAMES}
        self.encodings = {t: encoding_for(t, cfg.pair_encoding) for t in TASK_NAMES}
        self.batchers = {
            t: TaskBatcher(self.train_splits[t], cfg.task_batch_size(t), self.encodings[t],
                           cfg.seed, cfg.length_bucketing, cfg.bucket_batches)
            for t in TASK_NAMES}
        self.schedule = build_schedule(cfg.schedule,
                                       {t: b.num_batches for t, b in self.batchers.items()},
                                       cfg.epochs, cfg.steps_per_epoch, cfg.round_robin_mode)

    def _start_counters(self) -> None:
        """The counters: everything a resume needs besides module and optimizer states,
        and the running figures of the progress lines."""
        self.epoch = 1
        self.step_in_epoch = 0
        self.examples_seen = 0
        self.optimizer_steps = 0
        self.next_eval = self.cfg.eval_every or 0
        self.evaluations = 0
        self.history: list[dict] = []
        self._last_val_predictions: dict[str, np.ndarray] = {}
        self._loss_sums = {t: 0.0 for t in TASK_NAMES}
        self._loss_counts = {t: 0 for t in TASK_NAMES}
        # losses of the steps since the last check, still on the device, with the
        # (task, examples seen before the step, lr) that a NonFiniteLossError names
        self._pending_losses: list[torch.Tensor] = []
        self._pending_where: list[tuple[str, int, float]] = []
        self._last_log = 0.0
        self._start = time.perf_counter()
        self._examples_at_start = 0
        # the schedule step in progress: its optimizer steps not yet taken (the tasks each
        # trains; drawn when taken), its real rows so far, when it began; its epoch plan
        self._queued: list[tuple[str, ...]] = []
        self._step_rows = 0
        self._step_started = 0.0
        self._plan: tuple[int, list[tuple[str, ...]]] | None = None


    def _prepare_fresh_model(self) -> None:
        """The stages a fresh run's model goes through before training: the pre-training
        stage (``cfg.pretrain``: SimCSE / supervised SimCSE / QQP, cached by key) and the
        siamese QQP head's fit to the cosine.  They stay in the Trainer rather than with
        its callers because they need what the Trainer sets up first (device, threads,
        seed), must run before the optimizer takes the parameters, and must not run on a
        resume -- which only the Trainer knows; each caller would repeat all of that."""
        cfg, data = self.cfg, self.data
        if cfg.pretrain != "none":
            run_pretraining(cfg, data, self.model, self.device, log=self.log)
        if getattr(self.model, "qqp_cosine_start", False):
            fit = fit_qqp_cosine(self.model, data.split("qqp", "train"), cfg.cosine_fit_rows,
                                 data.pad_id, eval_rows(cfg.eval_batch_size, self.device.type),
                                 self.device, cfg.seed)
            self.log(f"[mtbert] siamese QQP head starts at logit = {fit['a']:.3f}·cos "
                     f"{fit['b']:+.3f} (fitted on {fit['rows']} training rows, accuracy "
                     f"{fit['train_accuracy']:.3f})")

    def _param_groups(self) -> list[dict]:
        """Encoder (lr) and heads (lr · head_lr_multiplier), each split into weight decay
        and no decay (biases, LayerNorm, scalars); loss-combiner parameters (lr, no decay).
        Every group is named; the first is the encoder's decayed weights (the ``lr``
        reported)."""
        cfg = self.cfg
        head_ids = {id(p) for _, p in self.model.head_parameters()}
        groups = {name: [] for name in ("encoder", "encoder_no_decay", "heads", "heads_no_decay")}
        for name, p in self.model.named_parameters():
            if not p.requires_grad:
                continue
            module = "heads" if id(p) in head_ids else "encoder"
            no_decay = p.ndim < 2 or "LayerNorm" in name or name.endswith("bias")
            groups[module + ("_no_decay" if no_decay else "")].append(p)
        out = []
        for name, params in groups.items():
            lr = cfg.lr * (cfg.head_lr_multiplier if name.startswith("heads") else 1.0)
            decay = 0.0 if name.endswith("no_decay") else cfg.weight_decay
            if params:
                out.append({"params": params, "lr": lr, "weight_decay": decay, "name": name})
        extra = [p for p in self.loss_combiner.parameters() if p.requires_grad]
        if extra:
            out.append({"params": extra, "lr": cfg.lr, "weight_decay": 0.0,
                        "name": "loss_combiner"})
        return out

    def epoch_plan(self, epoch: int) -> list[tuple[str, ...]]:
        """Epoch ``epoch``'s schedule steps: a tuple of tasks each (super-batches under
        ``update=summed``); a pure function of the seed and the epoch."""
        rng = np.random.default_rng([self.cfg.seed, 7919, epoch])
        steps = self.schedule.plan(epoch, rng)
        return super_batches(steps) if self.cfg.update == "summed" else steps

    def _count_optimizer_steps(self) -> tuple[int, int]:
        """Optimizer steps the run will take and the examples they train on (for the LR
        schedule), at nominal batch sizes."""
        steps, examples = 0, 0
        for epoch in range(1, self.cfg.epochs + 1):
            for group in self.epoch_plan(epoch):
                steps += 1 if self.cfg.update == "summed" else len(group)
                examples += sum(self.cfg.task_batch_size(t) for t in group)
                if self.cfg.max_examples and examples >= self.cfg.max_examples:
                    return max(steps, 1), max(examples, 1)
        return max(steps, 1), max(examples, 1)

    def log(self, message: str) -> None:
        if self.cfg.progress:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ training
    def step_name(self) -> str:
        """What steps this run, for the progress line (an engine's owner says)."""
        return "eager"

    def engine_metrics(self) -> dict:
        """Figures of the engine that steps this run, added to every report."""
        return {}

    def start(self, step_name: str | None = None) -> None:
        """Before the first step (of this process): the timers, the progress line (the
        step named ``step_name``, default :meth:`step_name`), and the evaluation at 0
        examples of a fresh run (where training starts from)."""
        cfg = self.cfg
        self._start = time.perf_counter()
        self._examples_at_start = self.examples_seen
        self.log(f"[mtbert] device={self.device} bf16={self.autocast} "
                 f"step={step_name or self.step_name()} "
                 f"schedule={cfg.schedule} update={cfg.update} "
                 f"optimizer steps≈{self.total_steps} train rows={self.data.train_sizes()}")
        if cfg.eval_at_start and self.evaluations == 0 and self.examples_seen == 0:
            self._evaluate_and_report(at_start=True)

    def next_update(self, buckets: SharedBuckets | None = None) -> Batches | None:
        """The host batches ({task: batch}) of this run's next optimizer step, or None when
        it has trained to its end (then :meth:`finish`).  Each update draws its own batches
        when it is taken (the batchers advance), each task's from the length bucket a fused
        step shares (``buckets``; the trials trained together in the step), default its own
        batcher's next."""
        if not self._queued:
            tasks = self._next_schedule_step()
            if tasks is None:
                return None
            self._step_started = time.perf_counter()
            self._step_rows = 0
            self._queued = self.update_tasks(tasks)
        batches = self.next_batches(self._queued.pop(0), buckets)
        self._step_rows += sum(real_rows(b) for b in batches.values())
        return batches

    @property
    def mid_schedule_step(self) -> bool:
        """Whether optimizer steps of the current schedule step are still to be taken (a
        checkpoint is taken only between schedule steps)."""
        return bool(self._queued)

    def stepped(self, losses: dict[str, torch.Tensor]) -> None:
        """After an engine trained the update :meth:`next_update` gave: the step counted;
        after a schedule step's last update, its bookkeeping: the stop check, the progress
        line, the evaluation and report where one is due, the budget, the next epoch.
        Raises SystemExit (stopped) or NonFiniteLossError (diverged) to end the run."""
        self.count_update(losses)
        if not self._queued:
            self.examples_seen += self._step_rows
            self._end_schedule_step()

    def count_update(self, losses: dict[str, torch.Tensor]) -> None:
        """One optimizer step taken: its losses noted (checked on the host later), the LR
        schedule moved on."""
        self._note_losses(losses)
        self.lr_scheduler.step()
        self.optimizer_steps += 1

    def _epoch_steps(self) -> list[tuple[str, ...]]:
        if self._plan is None or self._plan[0] != self.epoch:
            self._plan = (self.epoch, self.epoch_plan(self.epoch))
        return self._plan[1]

    def _next_schedule_step(self) -> tuple[str, ...] | None:
        """The tasks of the next schedule step; None once the budget is spent or the epochs
        are done."""
        while not self._budget_spent() and self.epoch <= self.cfg.epochs:
            plan = self._epoch_steps()
            if self.step_in_epoch < len(plan):
                return plan[self.step_in_epoch]
            self._next_epoch()  # a run resumed from its epoch's last step
        return None

    def _end_schedule_step(self) -> None:
        cfg = self.cfg
        self.timings["train_s"] += time.perf_counter() - self._step_started
        self.step_in_epoch += 1
        self.checkpoint_writer.poll()  # a failed or stopped (Ray) checkpoint report
        if self.stop_requested is not None and self.stop_requested():
            raise SystemExit(0)
        if self.threads_wanted is not None:
            self._train_on_threads(self.threads_wanted())
        self._maybe_log()
        if cfg.eval_every and self.examples_seen >= self.next_eval:
            self.next_eval = next_eval_point(self.examples_seen, cfg.eval_every,
                                             cfg.eval_growth)
            self._evaluate_and_report()
        if not self._budget_spent() and self.step_in_epoch >= len(self._epoch_steps()):
            self._next_epoch()

    def _train_on_threads(self, threads: int) -> None:
        if threads != self.threads:
            self.log(f"[mtbert] {self.examples_seen} examples: {self.threads} -> {threads} "
                     f"CPU threads")
            torch.set_num_threads(threads)
            self.threads = threads

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0
        if not self.cfg.eval_every:
            self._evaluate_and_report()

    def finish(self) -> dict:
        """After the last step: the final evaluation (unless the last step had one), the
        val / dev / test predictions, the last checkpoint written, ``metrics.json``."""
        cfg = self.cfg
        if not self.history or self.history[-1]["examples_seen"] != self.examples_seen:
            self._evaluate_and_report()
        final = dict(self.history[-1])
        self.write_predictions("val", self._last_val_predictions)
        if cfg.eval_dev:  # while the last checkpoint is written
            final.update(self.evaluate("dev", write_predictions=True))
            self.predict_test()
        waited = time.perf_counter()
        self.checkpoint_writer.wait()  # the last checkpoint is written and reported
        self.timings["checkpoint_s"] += time.perf_counter() - waited
        atomic_write_json(self.out_dir / "metrics.json", final)
        return final

    def close(self) -> None:
        """A run that ends without :meth:`finish` (stopped, diverged, failed): the checkpoint
        being written is finished and reported first."""
        self.checkpoint_writer.close()

    def _budget_spent(self) -> bool:
        return bool(self.cfg.max_examples) and self.examples_seen >= self.cfg.max_examples

    def next_batches(self, group: tuple[str, ...], buckets: SharedBuckets | None = None
                     ) -> dict[str, dict[str, torch.Tensor]]:
        """The next host batch of each task in ``group`` (advances the batchers), from the
        length bucket ``buckets`` shares (default: the batcher's own next); with static
        lengths also a fixed row count per task (filler rows of weight 0)."""
        def drawn(task: str) -> np.ndarray:
            batcher = self.batchers[task]
            return batcher.next_batch(None if buckets is None else buckets.take(task, batcher))

        return {task: collate(self.train_splits[task], drawn(task),
                              self.encodings[task], self.data.pad_id, self.static_max_length,
                              rows=self.cfg.task_batch_size(task) if self.static_max_length
                              else 0)
                for task in group}

    def update_tasks(self, tasks: tuple[str, ...]) -> list[tuple[str, ...]]:
        """A schedule step's optimizer steps, as the tasks each trains: all of them at once
        (``update=summed``, a super-batch) or each task alone."""
        return [tasks] if self.cfg.update == "summed" else [(t,) for t in tasks]

    def update_steps(self, batches: dict[str, dict[str, torch.Tensor]]
                     ) -> list[dict[str, dict[str, torch.Tensor]]]:
        """A schedule step's optimizer steps on host ``batches``: the super-batch
        (``update=summed``) or each task batch alone."""
        return [{t: batches[t] for t in group} for group in self.update_tasks(tuple(batches))]


    def _note_losses(self, losses: dict[str, torch.Tensor]) -> None:
        lr = self.lr_scheduler.get_last_lr()[0]
        for task, loss in losses.items():  # no host sync: checked in check_losses
            self._pending_losses.append(loss.detach().float())
            self._pending_where.append((task, self.examples_seen, lr))


    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return to_device(batch, self.device)

    def check_losses(self) -> None:
        """Copy the pending step losses to the host (one transfer), add them to the running
        sums, and raise NonFiniteLossError at the first NaN/Inf one."""
        if not self._pending_losses:
            return
        values = torch.stack(self._pending_losses).cpu().numpy().astype(np.float64)
        where = self._pending_where
        self._pending_losses, self._pending_where = [], []
        bad = np.flatnonzero(~np.isfinite(values))
        if len(bad):
            task, examples, lr = where[bad[0]]
            raise NonFiniteLossError(f"{task} loss became {values[bad[0]]} at {examples} examples "
                                     f"(lr={lr:.3g}); stopping this run")
        for (task, _, _), value in zip(where, values):
            self._loss_sums[task] += float(value)
            self._loss_counts[task] += 1

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < 10:
            return
        self._last_log = now
        self.check_losses()
        rate = (self.examples_seen - self._examples_at_start) / max(now - self._start, 1e-9)
        budget = f"/{self.cfg.max_examples}" if self.cfg.max_examples else ""
        losses = " ".join(f"{t}={self._loss_sums[t] / self._loss_counts[t]:.3f}"
                          for t in TASK_NAMES if self._loss_counts[t])
        self.log(f"[mtbert] epoch {self.epoch} examples {self.examples_seen}{budget} "
                 f"({rate:.1f} ex/s) loss {losses} lr {self.lr_scheduler.get_last_lr()[0]:.2e}")

    # ------------------------------------------------------------------ evaluation
    def _evaluate_and_report(self, at_start: bool = False) -> None:
        self.check_losses()  # a diverged run stops here, before it is scored or saved
        eval_started = time.perf_counter()
        if at_start and self.start_scores is not None:  # kept by a run with these weights
            metrics, self._last_val_predictions, _ = self.start_scores.scores(
                self.model, self.scoring())
        else:
            metrics = self.evaluate("val")
        saving_started = time.perf_counter()
        self.timings["eval_s"] += saving_started - eval_started
        # the previous evaluation's checkpoint is written and reported before this one is
        # recorded (its report reads the history up to itself)
        self.checkpoint_writer.wait()
        metrics.update({f"time/{k}": v for k, v in self.timings.items()})
        metrics.update(self.engine_metrics())
        metrics.update({
            "examples_seen": self.examples_seen, "epoch": self.epoch,
            "optimizer_steps": self.optimizer_steps,
            "train/bf16": float(self.autocast),  # 1: bf16 autocast (precision), 0: float32
            "lr": self.lr_scheduler.get_last_lr()[0],
            "train_seconds": time.perf_counter() - self._start,
        })
        metrics.update(train_losses(self._loss_sums, self._loss_counts))
        self._loss_sums = {t: 0.0 for t in TASK_NAMES}
        self._loss_counts = {t: 0 for t in TASK_NAMES}
        self.evaluations += 1
        self.history.append(metrics)
        write = (self._checkpoint_job(metrics)  # the snapshot: host copies, taken now
                 if evaluation_writes_checkpoint(self.checkpoints, self.report is not None,
                                                 self.examples_seen)
                 else None)
        append_history(self.out_dir, metrics)
        self.log(progress_line(self.examples_seen, metrics))
        if write is not None or self.report is not None:
            # written, then reported (Ray copies it to storage there), while training goes on
            self.checkpoint_writer.submit(
                lambda: self.checkpoint_folder.write_and_report(write, metrics, self.report))
        # what checkpoints cost the training thread: the snapshot and any wait for the
        # previous one; the figure sent with this report covers the evaluations before it
        self.timings["checkpoint_s"] += time.perf_counter() - saving_started

    def scoring(self) -> Scoring:
        """How this run's model is scored, with the run's values as they are now."""
        return Scoring(self.data, self.encodings, self.device, self.autocast,
                       self.static_max_length, self.eval_rows, self.eval_max_tokens)

    def evaluate(self, split_name: str, write_predictions: bool = False) -> dict:
        """Score every task on ``split_name`` (val or dev); returns prefixed metrics."""
        metrics, predictions = self.scoring().score(self.model, split_name)
        if split_name == "val":
            self._last_val_predictions = predictions
        if write_predictions:
            self.write_predictions(split_name, predictions)
        return metrics

    def predict_test(self) -> None:
        self.write_predictions("test", self.scoring().predict_test(self.model))

    def write_predictions(self, split_name: str, predictions: dict[str, np.ndarray],
                          folder: Path | None = None) -> None:
        self.scoring().write_predictions(folder or self.out_dir / "predictions", split_name,
                                         predictions)

    # ------------------------------------------------------------------ checkpoints
    def _training_parts(self) -> TrainingParts:
        return TrainingParts(self.model, self.optimizer, self.lr_scheduler, self.loss_combiner,
                             self.regulariser, self.batchers,
                             {"sums": self._loss_sums, "counts": self._loss_counts},
                             self.generator)

    def save_checkpoint(self) -> Path:
        """``out_dir/checkpoint`` of the run as it stands, written now (after the one being
        written): a run resumed from it trains on as this one would have, its running train
        losses included.  Taken between schedule steps (see :attr:`mid_schedule_step`)."""
        if self._queued:
            raise RuntimeError("a checkpoint is taken between schedule steps")
        self.check_losses()
        self.checkpoint_writer.wait()
        return self._checkpoint_job(None)()

    def _checkpoint_job(self, metrics: dict | None) -> Callable[[], Path]:
        """Snapshot the run now; the returned function writes it (:mod:`mtbert.run.checkpoint`)
        and may run on another thread while training goes on."""
        predictions = self._last_val_predictions  # the evaluation this checkpoint belongs to
        contents = CheckpointContents(
            counters={key: getattr(self, key) for key in COUNTERS},
            config_yaml=self.cfg.to_yaml(),
            history=[scalar_metrics(m) for m in self.history],
            write_val_predictions=(
                (lambda folder: self.write_predictions("val", predictions, folder))
                if predictions else None))
        return self.checkpoint_folder.snapshot(self._training_parts(), contents, metrics)

    def load_checkpoint(self, checkpoint_dir: str | Path) -> None:
        """Restore a checkpoint this trainer writes at an evaluation. A damaged file is a
        :class:`DataError` naming it; a checkpoint whose model or optimizer state does not
        fit this run is a :class:`ConfigError` naming the settings that differ."""
        parts = self._training_parts()
        counters, history = restore_checkpoint(Path(checkpoint_dir), parts, self.cfg,
                                               self.device, self.configured_lrs)
        self._loss_sums = dict(parts.running_losses["sums"])
        self._loss_counts = dict(parts.running_losses["counts"])
        for key, value in counters.items():
            setattr(self, key, value)
        if history is not None:
            self.history = history
