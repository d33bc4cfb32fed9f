"""What a search measures and reports: the objective it maximises, what its schedulers may
compare trials on at their rungs, and the counters every trial's report carries.  Plain
data, no Ray: the trial's side (trainable.py) and the search's side (schedulers, records,
summary, MLflow) read the same names from here."""

from __future__ import annotations

from mtbert.core.errors import ConfigError

#: what the search maximises: the overall score on the validation split carved from train
OBJECTIVE = "val/overall"
MODE = "max"
#: what a scheduler may compare trials on at its rungs (``--rung-metric``): the objective,
#: or its smooth stand-in (metrics.py: each accuracy replaced by the mean probability of the
#: gold class), which separates trials before their hard accuracies leave the majority class
RUNG_METRICS = {"overall": OBJECTIVE, "overall_soft": "val/overall_soft",
                "classes_soft": "val/classes_soft"}
#: the ``--rung-metric`` where it is left out, unless the scheduler's choice declares its own
#: (choices.py: ``asha-promote``, the default scheduler, decides its first rung on the
#: classifiers' probabilities and its later rungs on overall_soft)
DEFAULT_RUNG_METRIC = "overall_soft"


def rung_metric_keys(rung_metric: str) -> tuple[str, ...]:
    """The result keys a ``--rung-metric`` compares trials on, one per decision rung from
    the first, the last one also at any later rung: one name of :data:`RUNG_METRICS`, or
    names joined by commas (``classes_soft,overall_soft``: the first rung on the
    classifiers' gold-class probabilities, where STS r is still noise, the later ones on
    overall_soft).  ConfigError naming the flag for anything else."""
    names = [n.strip() for n in str(rung_metric).split(",")]
    unknown = [n for n in names if n not in RUNG_METRICS]
    if unknown:
        raise ConfigError(f"--rung-metric {rung_metric}: unknown {', '.join(map(repr, unknown))};"
                          f" expected one of {', '.join(RUNG_METRICS)}, or several joined by "
                          "commas (one per rung, e.g. classes_soft,overall_soft)")
    return tuple(RUNG_METRICS[n] for n in names)


def rung_metric_label(rung_metric: str) -> str:
    """What a ``--rung-metric`` decides on, as the summary and MLflow name it:
    ``val/overall_soft``, or ``val/classes_soft,val/overall_soft`` (one per rung)."""
    return ",".join(rung_metric_keys(rung_metric))


#: each trial's running best of the objective, reported beside it (sorting trials by it in
#: Ray's table or MLflow agrees with the search's ranking; the parent run has it too)
BEST_OBJECTIVE = f"best/{OBJECTIVE}"
#: run counters sent with every evaluation besides the ``val/*``, ``train/*`` and ``time/*``
#: metrics (the current learning rate goes as ``train/lr``: ``lr`` is a hyperparameter)
RUN_KEYS = ("examples_seen", "epoch", "optimizer_steps", "train_seconds", "checkpoints_written",
            "checkpoint_bytes")
