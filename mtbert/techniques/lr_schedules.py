"""Learning-rate schedules (``cfg.lr_schedule``), built from transformers' own.

* ``linear`` -- linear warm-up, then linear decay to 0 at the run's last step (BERT's).
* ``wsd`` -- warm-up-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): linear
  warm-up, a constant LR, and a linear decay to 0 over the last ``decay_ratio`` of the
  run's steps.  What a search needs: before the decay every trial trains at the same LR
  whatever its budget, so a trial judged at an early rung is comparable with the others
  there, and a trial promoted to the next rung continues at the LR it stopped at.
* ``constant`` -- linear warm-up, then constant.

The warm-up is ``warmup_examples`` training examples when set (the same for every trial
and budget, so it can end before the first rung), else ``warmup_ratio`` of the steps.
"""

from __future__ import annotations

import math

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import (get_constant_schedule_with_warmup, get_linear_schedule_with_warmup,
                          get_wsd_schedule)

from mtbert.core.config import TrainConfig


def warmup_steps(cfg: TrainConfig, total_steps: int, examples_per_step: float) -> int:
    """Optimizer steps of the warm-up: ``warmup_examples`` rounded up to whole steps, or
    ``warmup_ratio`` of ``total_steps``."""
    if cfg.warmup_examples:
        return min(total_steps, math.ceil(cfg.warmup_examples / max(examples_per_step, 1e-12)))
    return int(cfg.warmup_ratio * total_steps)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg: TrainConfig, total_steps: int,
                       examples_per_step: float) -> LambdaLR:
    warmup = warmup_steps(cfg, total_steps, examples_per_step)
    if cfg.lr_schedule == "linear":
        return get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    if cfg.lr_schedule == "constant":
        return get_constant_schedule_with_warmup(optimizer, warmup)
    decay = min(round(cfg.decay_ratio * total_steps), total_steps - warmup)
    return get_wsd_schedule(optimizer, warmup, decay, num_training_steps=total_steps,
                            decay_type="linear")


def take_configured_lrs(scheduler: LambdaLR, configured_lrs: list[float]) -> None:
    """After a restore: the LR schedule scales *this* run's configured learning rates, not
    the checkpoint's (population-based training restores a trial from another's checkpoint
    with a mutated ``lr``).  Same LR as before where the config did not change."""
    optimizer = scheduler.optimizer
    scheduler.base_lrs = list(configured_lrs)
    step = scheduler.last_epoch
    lrs = [base * factor(step) for base, factor in zip(configured_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(optimizer.param_groups, configured_lrs, lrs):
        group["initial_lr"], group["lr"] = base, lr
    scheduler._last_lr = lrs
