"""Budgets: how much each trial trains and how ASHA spends it (``--budget``).

The fidelity unit is *training examples seen* (the trainer's ``examples_seen``): a
trial trains until ``max_examples`` and is scored on the validation split every
``eval_every * eval_growth**k`` examples and at the end; ASHA (Li et al. 2020) looks at
a trial at the rungs ``grace_period * reduction_factor**k`` and keeps the top
``1/reduction_factor``. With ``eval_every = grace_period`` and ``eval_growth =
reduction_factor`` the evaluations fall on the rungs: none is spent between them (at
the small budgets of a CPU an evaluation costs as much as a tenth of the training).
``smoke`` evaluates at a fixed interval so tests see several reports per trial.

Every trial trains under the warm-up-stable-decay LR schedule (``lr_schedule=wsd``,
mtbert/techniques/lr_schedules.py) with a warm-up of ``warmup_examples`` that ends before the first
rung: at every rung but the last the trials are at the same, constant LR -- comparable,
and a promoted trial continues at the LR it was judged at -- and only a trial that
reaches ``max_examples`` decays (the last ``decay_ratio`` of its steps).  A space's
fixed values or ``--set`` may choose another schedule.

``max_train_per_task`` caps each task's training rows so an epoch stays small and
``epochs`` passes fit the budget (schedules like ``sequential`` and ``annealed`` see
whole epochs); ``max_eval_per_task`` caps the validation, dev and test rows scored
(0 = all; with a cap the CS 224N test CSVs cover only the first rows).

``smoke`` is for the tiny test model, or a slice of the real data with MiniLM; ``small``
and ``medium`` are sized for a 2-core CPU, ``full`` (all the data, 3 epochs a trial) for
GPU nodes.  Their measured wall times: README's budget table and docs/search.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mtbert.core.errors import ConfigError


@dataclass(frozen=True)
class Budget:
    name: str
    description: str
    max_examples: int        # per trial, ASHA's max_t (0 = epochs x train rows, after loading)
    epochs: int
    eval_every: int          # examples to the first validation evaluation (= report)
    eval_growth: float       # later evaluations at eval_every * eval_growth^k (+ the end)
    grace_period: int        # ASHA: examples before a trial can be stopped
    reduction_factor: float  # ASHA: keep the top 1/rf at each rung
    warmup_examples: int     # LR warm-up of every trial, in examples (< grace_period)
    max_train_per_task: int  # training rows per task (0 = all)
    max_eval_per_task: int   # val/dev/test rows per task (0 = all)
    num_samples: int         # default number of trials
    ensemble_top_k: int      # default ensemble size

    def to_dict(self) -> dict:
        return asdict(self)

    def trial_fields(self) -> dict:
        """TrainConfig fields every trial of this budget gets."""
        return {"epochs": self.epochs, "max_examples": self.max_examples,
                "eval_every": self.eval_every, "eval_growth": self.eval_growth,
                "lr_schedule": "wsd", "warmup_examples": self.warmup_examples}

    def data_fields(self) -> dict:
        """TrainConfig fields that shape the data loaded once by the driver."""
        return {"max_train_per_task": self.max_train_per_task,
                "max_eval_per_task": self.max_eval_per_task}

    def resolved(self, total_train_rows: int) -> "Budget":
        """Fill ``max_examples`` (0 = ``epochs`` passes over the loaded training rows)."""
        if self.max_examples:
            return self
        max_examples = max(self.epochs * total_train_rows, self.grace_period)
        return Budget(**{**asdict(self), "max_examples": max_examples})

    def rungs(self) -> list[int]:
        """ASHA milestones in examples, as Ray's ASHA computes them (one bracket)."""
        out, k = [], 0
        while self.grace_period * self.reduction_factor ** k <= self.max_examples:
            out.append(int(self.grace_period * self.reduction_factor ** k))
            k += 1
        return out


BUDGETS: dict[str, Budget] = {b.name: b for b in (
    Budget("smoke", "tests and a first try: ~1-2 min with the tiny model or a 64-row slice",
           max_examples=192, epochs=2, eval_every=48, eval_growth=1,
           grace_period=48, reduction_factor=3, warmup_examples=0,
           max_train_per_task=64, max_eval_per_task=32, num_samples=4, ensemble_top_k=3),
    Budget("small", "~11 min on 2 CPU cores with MiniLM in bf16 (17 in float32): 1,000 "
                    "train rows per task, 2 epochs",
           max_examples=6000, epochs=2, eval_every=1000, eval_growth=2,
           grace_period=1000, reduction_factor=2, warmup_examples=500,
           max_train_per_task=1000, max_eval_per_task=300, num_samples=8, ensemble_top_k=3),
    Budget("medium", "~40-90 min on 2 CPU cores with MiniLM: 4,000 train rows per task, 2 epochs",
           max_examples=24000, epochs=2, eval_every=4000, eval_growth=2,
           grace_period=4000, reduction_factor=2, warmup_examples=1000,
           max_train_per_task=4000, max_eval_per_task=1000, num_samples=12, ensemble_top_k=5),
    Budget("full", "all the data, 3 epochs per trial: for GPU nodes",
           max_examples=0, epochs=3, eval_every=10000, eval_growth=3,
           grace_period=10000, reduction_factor=3, warmup_examples=5000,
           max_train_per_task=0, max_eval_per_task=0, num_samples=32, ensemble_top_k=5),
)}


def get_budget(name: str) -> Budget:
    try:
        return BUDGETS[name]
    except KeyError:
        raise ConfigError(f"--budget {name}: unknown budget; choose one of "
                          f"{', '.join(BUDGETS)}") from None
