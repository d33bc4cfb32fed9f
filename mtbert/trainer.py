"""The multitask training loop: step, evaluate, checkpoint, report. No Ray here.

The fidelity unit is *examples seen*. Every ``eval_every`` examples (or each
epoch) the trainer scores the validation split, writes a checkpoint and calls
``report(metrics, checkpoint_dir)``; the Ray adapter plugs in there. With
``eval_at_start`` (default) a fresh run also does so at 0 examples, before its first
optimizer step (after any pre-training stage), so every curve shows where training
started from; a resumed run does not repeat it.

Learning rates: the encoder trains at ``lr``, everything outside it (task heads,
shared pair layer, cosine maps) at ``lr · head_lr_multiplier``; loss-combiner
parameters at ``lr``. Each is split into weight-decay / no-decay groups.

Exact resume: the data order is a pure function of (seed, task, pass, epoch)
(see ``TaskBatcher`` and ``Schedule.plan``), so a checkpoint holds only counters,
plus model/optimizer/LR-scheduler/regulariser state and torch's RNG state (dropout).
"""

from __future__ import annotations

import json
import math
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from transformers import get_linear_schedule_with_warmup

from mtbert.atomic import atomic_write_json
from mtbert.config import TrainConfig
from mtbert.data import MultitaskData, Split, TaskBatcher, collate, encoding_for, eval_batches
from mtbert.errors import ConfigError
from mtbert.gradients import build_gradient_combiner
from mtbert.losses import build_loss_combiner, task_loss
from mtbert.metrics import split_metrics, task_metrics
from mtbert.model import MultitaskModel
from mtbert.schedules import build_schedule, super_batches
from mtbert.smart import build_regulariser
from mtbert.tasks import TASK_NAMES, TASKS

ReportFn = Callable[[dict, str], None]
CHECKPOINT_FILE = "state.pt"


class NonFiniteLossError(RuntimeError):
    """A task loss became NaN or Inf: the run cannot go on."""


def resolve_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device=cuda but no CUDA GPU is available", key="device")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


def scalar_metrics(metrics: dict) -> dict[str, float]:
    """The numeric entries (drops the confusion matrix): what trackers can plot."""
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trainer:
    def __init__(self, cfg: TrainConfig, data: MultitaskData, out_dir: str | Path,
                 report: ReportFn | None = None, resume_from: str | Path | None = None,
                 model: MultitaskModel | None = None):
        setup_started = time.perf_counter()
        self.cfg = cfg
        self.data = data
        self.out_dir = Path(out_dir)
        self.report = report
        self.device = resolve_device(cfg.device)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        torch.manual_seed(cfg.seed)
        self.model = (model or MultitaskModel.from_config(cfg)).to(self.device)
        if cfg.pretrain != "none" and resume_from is None:
            from mtbert.pretrain import run_pretraining
            run_pretraining(cfg, data, self.model, self.device, log=self.log)
        if resume_from is None and getattr(self.model, "qqp_cosine_start", False):
            from mtbert.cosine_init import fit_qqp_cosine
            fit = fit_qqp_cosine(self.model, data.split("qqp", "train"), cfg.cosine_fit_rows,
                                 data.pad_id, cfg.eval_batch_size, self.device, cfg.seed)
            self.log(f"[mtbert] siamese QQP head starts at logit = {fit['a']:.3f}·cos "
                     f"{fit['b']:+.3f} (fitted on {fit['rows']} training rows, accuracy "
                     f"{fit['train_accuracy']:.3f})")
        self.loss_combiner = build_loss_combiner(cfg).to(self.device)
        self.grad_combiner = build_gradient_combiner(cfg)
        self.regulariser = build_regulariser(cfg, self.model)
        self.train_splits = {t: data.split(t, "train") for t in TASK_NAMES}
        self.encodings = {t: encoding_for(t, cfg.pair_encoding) for t in TASK_NAMES}
        self.batchers = {
            t: TaskBatcher(self.train_splits[t], cfg.task_batch_size(t), self.encodings[t],
                           cfg.seed, cfg.length_bucketing, cfg.bucket_batches)
            for t in TASK_NAMES}
        self.schedule = build_schedule(cfg.schedule, {t: b.num_batches for t, b in self.batchers.items()},
                                       cfg.epochs, cfg.steps_per_epoch, cfg.round_robin_mode)
        # the fused kernel updates all 22M MiniLM parameters in ~15 ms on one CPU thread,
        # the default for-loop implementation in ~190 ms (a large share of a training step)
        self.optimizer = torch.optim.AdamW(self._param_groups(), lr=cfg.lr, fused=True)
        self.total_steps = self._count_optimizer_steps()
        self.lr_scheduler = get_linear_schedule_with_warmup(
            self.optimizer, int(cfg.warmup_ratio * self.total_steps), self.total_steps)
        self.autocast = self.device.type == "cuda"
        # counters: everything a resume needs besides module/optimizer states
        self.epoch = 1
        self.step_in_epoch = 0
        self.examples_seen = 0
        self.optimizer_steps = 0
        self.next_eval = cfg.eval_every or 0
        self.evaluations = 0
        self.history: list[dict] = []
        self._last_val_predictions: dict[str, np.ndarray] = {}
        self._loss_sums = {t: 0.0 for t in TASK_NAMES}
        self._loss_counts = {t: 0 for t in TASK_NAMES}
        self._last_log = 0.0
        self._start = time.perf_counter()
        self._examples_at_start = 0
        if resume_from is not None:
            self.load_checkpoint(resume_from)
        # where this process's time goes (reported as time/*; not kept across a resume):
        # setup = model load, pre-training stage, optimizer, batchers, checkpoint restore
        self.timings = {"setup_s": time.perf_counter() - setup_started, "train_s": 0.0,
                        "eval_s": 0.0, "checkpoint_s": 0.0}

    # ------------------------------------------------------------------ setup
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

    def _epoch_plan(self, epoch: int) -> list[tuple[str, ...]]:
        rng = np.random.default_rng([self.cfg.seed, 7919, epoch])
        steps = self.schedule.plan(epoch, rng)
        return super_batches(steps) if self.cfg.update == "summed" else steps

    def _count_optimizer_steps(self) -> int:
        """Optimizer steps the run will take (for the LR schedule), nominal batch sizes."""
        steps, examples = 0, 0
        for epoch in range(1, self.cfg.epochs + 1):
            for group in self._epoch_plan(epoch):
                steps += 1 if self.cfg.update == "summed" else len(group)
                examples += sum(self.cfg.task_batch_size(t) for t in group)
                if self.cfg.max_examples and examples >= self.cfg.max_examples:
                    return max(steps, 1)
        return max(steps, 1)

    def log(self, message: str) -> None:
        if self.cfg.progress:
            print(message, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ training
    def fit(self) -> dict:
        """Train to ``max_examples`` or ``epochs``; returns the final metrics."""
        cfg = self.cfg
        self._start = time.perf_counter()
        self._examples_at_start = self.examples_seen
        self.log(f"[mtbert] device={self.device} schedule={cfg.schedule} update={cfg.update} "
                 f"optimizer steps≈{self.total_steps} train rows={self.data.train_sizes()}")
        if cfg.eval_at_start and self.evaluations == 0 and self.examples_seen == 0:
            self._evaluate_and_report()  # where training starts from (not on resume)
        done = self._budget_spent()
        while not done and self.epoch <= cfg.epochs:
            plan = self._epoch_plan(self.epoch)
            while self.step_in_epoch < len(plan):
                step_started = time.perf_counter()
                self._train_group(plan[self.step_in_epoch])
                self.timings["train_s"] += time.perf_counter() - step_started
                self.step_in_epoch += 1
                self._maybe_log()
                if cfg.eval_every and self.examples_seen >= self.next_eval:
                    self.next_eval = next_eval_point(self.examples_seen, cfg.eval_every,
                                                     cfg.eval_growth)
                    self._evaluate_and_report()
                if self._budget_spent():
                    done = True
                    break
            if not done:
                self.epoch += 1
                self.step_in_epoch = 0
                if not cfg.eval_every:
                    self._evaluate_and_report()
        if not self.history or self.history[-1]["examples_seen"] != self.examples_seen:
            self._evaluate_and_report()
        final = dict(self.history[-1])
        self.write_predictions("val", self._last_val_predictions)
        if cfg.eval_dev:
            final.update(self.evaluate("dev", write_predictions=True))
            self.predict_test()
        atomic_write_json(self.out_dir / "metrics.json", final)
        return final

    def _budget_spent(self) -> bool:
        return bool(self.cfg.max_examples) and self.examples_seen >= self.cfg.max_examples

    def _train_group(self, group: tuple[str, ...]) -> None:
        batches = {}
        for task in group:
            indices = self.batchers[task].next_batch()
            batches[task] = self._to_device(collate(self.train_splits[task], indices,
                                                    self.encodings[task], self.data.pad_id))
        if self.cfg.update == "summed":
            self._optimizer_step(batches)
        else:
            for task, batch in batches.items():
                self._optimizer_step({task: batch})
        self.examples_seen += sum(len(b["labels"]) for b in batches.values())

    def _optimizer_step(self, batches: dict[str, dict[str, torch.Tensor]]) -> None:
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        losses = {}
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.autocast):
            for task, batch in batches.items():
                out = self.model(task, batch)
                loss = task_loss(task, out, batch["labels"], self.cfg)
                if self.regulariser is not None:
                    loss = loss + self.regulariser.term(self.model, task, batch, out)
                losses[task] = loss
        for task, loss in losses.items():
            value = float(loss.detach())
            if not math.isfinite(value):
                raise NonFiniteLossError(
                    f"{task} loss became {value} at {self.examples_seen} examples "
                    f"(lr={self.lr_scheduler.get_last_lr()[0]:.3g}); stopping this run")
            self._loss_sums[task] += value
            self._loss_counts[task] += 1
        weighted = self.loss_combiner.weighted(losses)
        penalty = self.loss_combiner.penalty(self.model)
        self.grad_combiner.backward(weighted, self.model.shared_parameters(), penalty)
        if self.cfg.max_grad_norm:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            torch.nn.utils.clip_grad_norm_(params, self.cfg.max_grad_norm)
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer_steps += 1
        if self.regulariser is not None:
            self.regulariser.after_step(self.model)

    def _to_device(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _maybe_log(self) -> None:
        now = time.perf_counter()
        if now - self._last_log < 10:
            return
        self._last_log = now
        rate = (self.examples_seen - self._examples_at_start) / max(now - self._start, 1e-9)
        budget = f"/{self.cfg.max_examples}" if self.cfg.max_examples else ""
        losses = " ".join(f"{t}={self._loss_sums[t] / self._loss_counts[t]:.3f}"
                          for t in TASK_NAMES if self._loss_counts[t])
        self.log(f"[mtbert] epoch {self.epoch} examples {self.examples_seen}{budget} "
                 f"({rate:.1f} ex/s) loss {losses} lr {self.lr_scheduler.get_last_lr()[0]:.2e}")

    # ------------------------------------------------------------------ evaluation
    def _evaluate_and_report(self) -> None:
        eval_started = time.perf_counter()
        metrics = self.evaluate("val")
        saving_started = time.perf_counter()
        self.timings["eval_s"] += saving_started - eval_started
        metrics.update({f"time/{k}": v for k, v in self.timings.items()})
        metrics.update({
            "examples_seen": self.examples_seen, "epoch": self.epoch,
            "optimizer_steps": self.optimizer_steps,
            "lr": self.lr_scheduler.get_last_lr()[0],
            "train_seconds": time.perf_counter() - self._start,
        })
        for t in TASK_NAMES:
            if self._loss_counts[t]:
                metrics[f"train/loss_{t}"] = self._loss_sums[t] / self._loss_counts[t]
        self._loss_sums = {t: 0.0 for t in TASK_NAMES}
        self._loss_counts = {t: 0 for t in TASK_NAMES}
        self.evaluations += 1
        self.history.append(metrics)
        checkpoint_dir = self.save_checkpoint(metrics)
        with open(self.out_dir / "history.jsonl", "a", encoding="utf-8") as fh:
            fh.write(json.dumps(scalar_metrics(metrics)) + "\n")
        self.log(f"[mtbert] eval @ {self.examples_seen} examples: val overall "
                 f"{metrics['val/overall']:.4f} (sst {metrics['val/sst_acc']:.3f}, "
                 f"qqp {metrics['val/qqp_acc']:.3f}, sts {metrics['val/sts_corr']:.3f})")
        if self.report is not None:
            self.report(metrics, str(checkpoint_dir))
        # checkpoint writing and the report (Ray copies the checkpoint to storage there);
        # the figure sent with this report covers the evaluations before it
        self.timings["checkpoint_s"] += time.perf_counter() - saving_started

    def evaluate(self, split_name: str, write_predictions: bool = False) -> dict:
        """Score every task on ``split_name`` (val or dev); returns prefixed metrics."""
        per_task, predictions = {}, {}
        for task in TASK_NAMES:
            split = self.data.split(task, split_name)
            pred = predict_split(self.model, split, self.encodings[task], self.data.pad_id,
                                 self.cfg.eval_batch_size, self.device, self.autocast)
            predictions[task] = pred
            per_task[task] = task_metrics(task, as_label(task, pred), split.labels)
        if split_name == "val":
            self._last_val_predictions = predictions
        if write_predictions:
            self.write_predictions(split_name, predictions)
        return split_metrics(split_name, per_task)

    def predict_test(self) -> None:
        predictions = {}
        for task in TASK_NAMES:
            split = self.data.split(task, "test")
            if split is not None:
                predictions[task] = predict_split(self.model, split, self.encodings[task],
                                                  self.data.pad_id, self.cfg.eval_batch_size,
                                                  self.device, self.autocast)
        self.write_predictions("test", predictions)

    def write_predictions(self, split_name: str, predictions: dict[str, np.ndarray],
                          folder: Path | None = None) -> None:
        from mtbert.predictions import write_predictions
        write_predictions(folder or self.out_dir / "predictions", split_name,
                          {t: self.data.split(t, split_name) for t in predictions}, predictions)

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, metrics: dict | None = None) -> Path:
        """Write ``out_dir/checkpoint`` atomically (tmp folder, then rename)."""
        self.out_dir.mkdir(parents=True, exist_ok=True)
        final = self.out_dir / "checkpoint"
        tmp = self.out_dir / ".checkpoint.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        state = {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "lr_scheduler": self.lr_scheduler.state_dict(),
            "loss_combiner": self.loss_combiner.state_dict(),
            "regulariser": self.regulariser.state_dict() if self.regulariser is not None else {},
            "batchers": {t: b.state_dict() for t, b in self.batchers.items()},
            "counters": {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                         "examples_seen": self.examples_seen,
                         "optimizer_steps": self.optimizer_steps, "next_eval": self.next_eval,
                         "evaluations": self.evaluations},
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        }
        torch.save(state, tmp / CHECKPOINT_FILE)
        (tmp / "config.yaml").write_text(self.cfg.to_yaml(), encoding="utf-8")
        atomic_write_json(tmp / "metrics.json", metrics or {})
        atomic_write_json(tmp / "history.json", [scalar_metrics(m) for m in self.history])
        if self._last_val_predictions:  # the evaluation this checkpoint belongs to
            self.write_predictions("val", self._last_val_predictions, tmp / "predictions")
        old = self.out_dir / ".checkpoint.old"
        shutil.rmtree(old, ignore_errors=True)
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final

    def load_checkpoint(self, checkpoint_dir: str | Path) -> None:
        state = torch.load(Path(checkpoint_dir) / CHECKPOINT_FILE, map_location=self.device,
                           weights_only=True)
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        self.loss_combiner.load_state_dict(state["loss_combiner"])
        if self.regulariser is not None and state["regulariser"]:
            self.regulariser.load_state_dict(state["regulariser"])
        for t, b in self.batchers.items():
            b.load_state_dict(state["batchers"][t])
        for key, value in state["counters"].items():
            setattr(self, key, int(value))
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        history_file = Path(checkpoint_dir) / "history.json"
        if history_file.is_file():
            self.history = json.loads(history_file.read_text(encoding="utf-8"))


# ---------------------------------------------------------------------- inference
def as_label(task: str, pred: np.ndarray) -> np.ndarray:
    """Model output -> the metric's label space (QQP probability -> 0/1)."""
    return (pred >= 0.5).astype(np.int64) if task == "qqp" else pred


@torch.no_grad()
def predict_split(model: MultitaskModel, split: Split, encoding: str, pad_id: int,
                  batch_size: int, device: torch.device, autocast: bool = False) -> np.ndarray:
    """Predictions for every row of ``split`` in row order (SST class, QQP probability,
    STS score)."""
    model.eval()
    out = np.zeros(len(split), dtype=np.float64)
    for indices in eval_batches(split, batch_size, encoding):
        batch = {k: v.to(device) for k, v in collate(split, indices, encoding, pad_id).items()
                 if k != "labels"}
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
            out[indices] = model.predict(split.task, batch).float().cpu().numpy()
    return out.astype(np.int64) if TASKS[split.task].label_kind == "class" else out


def load_checkpoint_model(checkpoint_dir: str | Path, device: str = "cpu",
                          ) -> tuple[TrainConfig, MultitaskModel]:
    """The config and model weights of a checkpoint folder (for the ensemble)."""
    checkpoint_dir = Path(checkpoint_dir)
    cfg = TrainConfig.from_yaml(checkpoint_dir / "config.yaml")
    model = MultitaskModel.from_config(cfg)
    state = torch.load(checkpoint_dir / CHECKPOINT_FILE, map_location=device, weights_only=True)
    model.load_state_dict(model.complete_legacy_state(state["model"]))
    return cfg, model.to(device).eval()
