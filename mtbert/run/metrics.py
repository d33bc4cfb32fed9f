"""Metrics: accuracy, precision/recall/F1, Pearson r, the SST confusion matrix, overall.

overall = (SST acc + QQP acc + (STS r + 1) / 2) / 3  (the CS 224N leaderboard).

Every score comes with its standard error over the rows scored (``*_se``): what separates
two trials' scores from noise on a small validation split.

overall_soft = (SST p_gold + QQP p_gold + (STS r + 1) / 2) / 3, where ``p_gold`` is the mean
probability the model gives each row's gold class (the accuracy expected when sampling
from the model).  It moves with every step, where a hard accuracy sits on the majority
class for the first hundreds of examples: what a scheduler's early rungs can rank on.

classes_soft = (SST p_gold + QQP p_gold) / 2: the classifiers' part of overall_soft.  In
the first steps the STS head's r is noise (docs/bench/search_efficiency.md, reason 2: rank
correlation with the full trainings -0.73 to 0.67 at 224 examples, where both p_gold rank 0.95-0.98), and
through (r + 1) / 2 it moves overall_soft more than the two probabilities do.
"""

from __future__ import annotations

import math

import numpy as np


def overall_score(sst_acc: float, qqp_acc: float, sts_corr: float) -> float:
    return (sst_acc + qqp_acc + (sts_corr + 1.0) / 2.0) / 3.0


def accuracy_standard_error(acc: float, n: int) -> float:
    """Binomial: sqrt(p (1 - p) / n)."""
    return math.sqrt(acc * (1.0 - acc) / n) if n > 0 and math.isfinite(acc) else float("nan")


def pearson_standard_error(r: float, n: int) -> float:
    """Fisher's z = atanh r has standard error 1 / sqrt(n - 3); by the delta method
    (dr/dz = 1 - r^2) r's is (1 - r^2) / sqrt(n - 3)."""
    return (1.0 - r * r) / math.sqrt(n - 3) if n > 3 and math.isfinite(r) else float("nan")


def overall_standard_error(sst_se: float, qqp_se: float, sts_se: float) -> float:
    """overall's, the three tasks' rows being independent: the STS term is (r + 1) / 2."""
    return math.sqrt(sst_se ** 2 + qqp_se ** 2 + (sts_se / 2.0) ** 2) / 3.0


def scalar_metrics(metrics: dict, finite: bool = False) -> dict[str, float]:
    """The numeric entries of a metrics dict (drops the confusion matrix, texts and flags):
    what trackers can plot.  ``finite``: also drop NaN and inf (what a ranking can use)."""
    out = {k: float(v) for k, v in metrics.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool)}
    return {k: v for k, v in out.items() if math.isfinite(v)} if finite else out


def mean_with_standard_error(values: np.ndarray) -> tuple[float, float]:
    """The mean of per-row values and its standard error, sd / sqrt(n)."""
    values = np.asarray(values, dtype=np.float64)
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    return float(values.mean()), float(values.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")


def gold_probability(task: str, probabilities: np.ndarray, gold: np.ndarray) -> np.ndarray:
    """Per row, the probability the model gives the gold class: SST ``probabilities`` are
    the 5 class probabilities (rows x 5), QQP's the probability of duplicate (rows)."""
    gold = np.asarray(gold, dtype=np.int64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    if task == "sst":
        return probabilities[np.arange(len(gold)), gold]
    return np.where(gold == 1, probabilities, 1.0 - probabilities)


def accuracy(pred: np.ndarray, gold: np.ndarray) -> float:
    return float(np.mean(np.asarray(pred) == np.asarray(gold))) if len(gold) else float("nan")


def confusion_matrix(pred: np.ndarray, gold: np.ndarray, num_classes: int) -> np.ndarray:
    """``m[i, j]`` = rows of gold class i predicted as class j."""
    m = np.zeros((num_classes, num_classes), dtype=np.int64)
    np.add.at(m, (np.asarray(gold, dtype=np.int64), np.asarray(pred, dtype=np.int64)), 1)
    return m


def precision_recall_f1(confusion: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-class precision, recall and F1 from a confusion matrix (0 where undefined)."""
    tp = np.diag(confusion).astype(np.float64)
    predicted = confusion.sum(0).astype(np.float64)
    actual = confusion.sum(1).astype(np.float64)
    precision = np.divide(tp, predicted, out=np.zeros_like(tp), where=predicted > 0)
    recall = np.divide(tp, actual, out=np.zeros_like(tp), where=actual > 0)
    denom = precision + recall
    f1 = np.divide(2 * precision * recall, denom, out=np.zeros_like(tp), where=denom > 0)
    return precision, recall, f1


def pearson(pred: np.ndarray, gold: np.ndarray) -> float:
    pred, gold = np.asarray(pred, dtype=np.float64), np.asarray(gold, dtype=np.float64)
    if len(gold) < 2 or np.std(pred) == 0 or np.std(gold) == 0:
        return 0.0  # undefined correlation (constant predictions) scores as no correlation
    from scipy import stats  # deferred: scipy.stats takes ~0.7 s to import (CLI --help)

    return float(stats.pearsonr(pred, gold).statistic)


def task_metrics(task: str, pred: np.ndarray, gold: np.ndarray,
                 probabilities: np.ndarray | None = None) -> dict[str, object]:
    """Metrics of one task; ``pred`` is SST class, QQP 0/1 class, STS score.  With the
    classifiers' ``probabilities`` (SST rows x 5, QQP p(duplicate)) also ``<task>_p_gold``
    and its standard error."""
    n = len(gold)
    soft = {}
    if probabilities is not None and task in ("sst", "qqp"):
        p_gold, p_gold_se = mean_with_standard_error(gold_probability(task, probabilities, gold))
        soft = {f"{task}_p_gold": p_gold, f"{task}_p_gold_se": p_gold_se}
    if task == "sst":
        cm = confusion_matrix(pred, gold, 5)
        p, r, f1 = precision_recall_f1(cm)
        acc = accuracy(pred, gold)
        return {"sst_acc": acc, "sst_acc_se": accuracy_standard_error(acc, n),
                "sst_precision_macro": float(p.mean()),
                "sst_recall_macro": float(r.mean()), "sst_f1_macro": float(f1.mean()),
                "sst_confusion": cm.tolist(), **soft}
    if task == "qqp":
        cm = confusion_matrix(pred, gold, 2)
        p, r, f1 = precision_recall_f1(cm)
        acc = accuracy(pred, gold)
        return {"qqp_acc": acc, "qqp_acc_se": accuracy_standard_error(acc, n),
                "qqp_precision": float(p[1]),
                "qqp_recall": float(r[1]), "qqp_f1": float(f1[1]), **soft}
    from scipy import stats  # deferred: scipy.stats takes ~0.7 s to import (CLI --help)

    constant = len(gold) < 2 or np.std(pred) == 0 or np.std(gold) == 0
    r = pearson(pred, gold)
    return {"sts_corr": r, "sts_corr_se": pearson_standard_error(r, n),
            "sts_spearman": 0.0 if constant else float(stats.spearmanr(pred, gold).statistic),
            "sts_mse": float(np.mean((np.asarray(pred) - np.asarray(gold)) ** 2))}


def split_metrics(prefix: str, per_task: dict[str, dict[str, object]]) -> dict[str, object]:
    """Prefix each task's metrics (``val/sst_acc``) and add ``<prefix>/overall`` (and
    ``<prefix>/overall_soft``, ``<prefix>/classes_soft`` where the classifiers' gold
    probabilities are there)."""
    out: dict[str, object] = {}
    for metrics in per_task.values():
        out.update({f"{prefix}/{k}": v for k, v in metrics.items()})
    if all(k in out for k in (f"{prefix}/sst_acc", f"{prefix}/qqp_acc", f"{prefix}/sts_corr")):
        out[f"{prefix}/overall"] = overall_score(out[f"{prefix}/sst_acc"], out[f"{prefix}/qqp_acc"],
                                                 out[f"{prefix}/sts_corr"])
        if all(f"{prefix}/{k}_se" in out for k in ("sst_acc", "qqp_acc", "sts_corr")):
            out[f"{prefix}/overall_se"] = overall_standard_error(
                out[f"{prefix}/sst_acc_se"], out[f"{prefix}/qqp_acc_se"],
                out[f"{prefix}/sts_corr_se"])
    if all(f"{prefix}/{k}" in out for k in ("sst_p_gold", "qqp_p_gold", "sts_corr")):
        out[f"{prefix}/overall_soft"] = overall_score(
            out[f"{prefix}/sst_p_gold"], out[f"{prefix}/qqp_p_gold"], out[f"{prefix}/sts_corr"])
        out[f"{prefix}/overall_soft_se"] = overall_standard_error(
            out[f"{prefix}/sst_p_gold_se"], out[f"{prefix}/qqp_p_gold_se"],
            out[f"{prefix}/sts_corr_se"])
    if all(f"{prefix}/{k}" in out for k in ("sst_p_gold", "qqp_p_gold")):
        out[f"{prefix}/classes_soft"] = (out[f"{prefix}/sst_p_gold"]
                                         + out[f"{prefix}/qqp_p_gold"]) / 2.0
        out[f"{prefix}/classes_soft_se"] = math.hypot(out[f"{prefix}/sst_p_gold_se"],
                                                      out[f"{prefix}/qqp_p_gold_se"]) / 2.0
    return out
