"""A worker's captured step, kept for its next trial of the same structure.

Ray reuses a worker process for the next trial (``reuse_actors``); with
``step_mode=graphs`` its trainer has captured a CUDA graph per (task, batch shape) that
reads the model's parameters, the static gradient buffers, the loss weighting's and the
SMART teacher's tensors, and -- as 0-d device tensors -- the dropout rate and SMART's λ_t,
ε and μ (:mod:`mtbert.model.dropout_rate`, :meth:`mtbert.techniques.smart.SmartRegulariser.hold_in_tensors`).
When a trainer ends (its budget spent, stopped by the scheduler, or diverged) it leaves
those here (:func:`keep`); the next trainer in the process whose settings differ only in
what the graphs do not hold (:data:`mtbert.core.config.NOT_IN_STEP_GRAPHS`, the tensor values,
the SMART terms' values but not which are on) takes them (:func:`take`): it copies its own initial weights
into the kept model and its rates into the tensors, in place, builds its own optimizer,
LR schedule and data order, and replays the kept task graphs from its first step
(the optimizer's graphs, whose AdamW state is new, are captured again after two eager
steps).  A trainer of another structure drops what is kept first, so a worker holds one
model at a time.

It trains exactly as a trainer built afresh: the same seed gives the same initial
weights and the same random numbers (``tests/test_graph_reuse.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from mtbert.core.config import NOT_IN_STEP_GRAPHS
from mtbert.core.tasks import TASK_NAMES
from mtbert.run.trial_run import RunParts
from mtbert.step.step_graphs import StepGraphs


def structure(cfg) -> tuple:
    """What a run's captured task graphs are built from: every setting outside
    :data:`~mtbert.core.config.NOT_IN_STEP_GRAPHS`, and which SMART terms are on."""
    fixed = tuple(sorted((k, v) for k, v in cfg.to_dict().items()
                         if k not in NOT_IN_STEP_GRAPHS))
    terms = tuple((t, cfg.smart_lambda(t) > 0) for t in TASK_NAMES)
    return fixed + (("smart_terms", terms), ("smart_mu_on", cfg.smart_mu > 0))


@dataclass
class KeptStep:
    """What a trainer leaves for the next: its run's parts (model with the rate-tensor
    dropouts, loss weighting, SMART regulariser, dropout rate) and its step graphs."""
    structure: tuple
    parts: RunParts
    step_graphs: StepGraphs


_kept: KeptStep | None = None


def keep(step: KeptStep) -> None:
    """Leave ``step`` for this process's next trainer (replacing what was kept)."""
    global _kept
    _kept = step


def take(wanted: tuple) -> KeptStep | None:
    """The kept step if its structure is ``wanted`` (it is no longer kept then); else
    None, and what was kept is dropped (its GPU memory goes back to torch's allocator)."""
    global _kept
    step, _kept = _kept, None
    return step if step is not None and step.structure == wanted else None


def forget() -> None:
    """Drop what is kept."""
    global _kept
    _kept = None
