"""The search report: plots (matplotlib, Agg) of the trials and of their importances.

* ``best_so_far.png`` -- best validation overall so far against training examples
  spent by the whole search (all trials' results in wall-clock order), every
  evaluation as a dot, ASHA stops marked with an x;
* ``learning_curves.png`` -- validation overall against examples seen, one line per
  trial (dashed = stopped early by ASHA, red x = error, a band of ± one standard error);
* ``importances.png`` / ``importances.json`` -- the hyperparameter importances that
  :mod:`mtbert.tune.results.importances` computes with Optuna;
* ``sst_confusion.png`` -- a confusion matrix plot (per trial and for the ensemble).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from mtbert.tune.results.importances import param_importances
from mtbert.tune.trial.objective import OBJECTIVE
from mtbert.tune.results.records import TrialRecord, TrialStatus


def _plt():
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # "tight": legends beside the axes too
    _plt().close(fig)
    return path


def best_so_far_plot(trials: list[TrialRecord], path: Path, metric: str = OBJECTIVE) -> Path:
    return _save(best_so_far_figure(trials, metric), path)


def best_so_far_figure(trials: list[TrialRecord], metric: str = OBJECTIVE):
    plt = _plt()
    events = []  # (timestamp, trial, examples_seen, value)
    for t in trials:
        for h in t.history:
            if metric in h:
                events.append((h.get("timestamp", 0.0), t, int(h.get("examples_seen", 0)),
                               float(h[metric])))
    events.sort(key=lambda e: (e[0], e[2]))
    seen_by_trial: dict[str, int] = {}
    spent, xs, ys, best_x, best_y = 0, [], [], [], []
    best = -math.inf
    stops_x, stops_y = [], []
    last_event = {t.trial_id: max((i for i, e in enumerate(events) if e[1] is t), default=None)
                  for t in trials}
    for i, (_, t, seen, value) in enumerate(events):
        spent += max(0, seen - seen_by_trial.get(t.trial_id, 0))
        seen_by_trial[t.trial_id] = seen
        xs.append(spent)
        ys.append(value)
        best = max(best, value)
        best_x.append(spent)
        best_y.append(best)
        if t.status == TrialStatus.STOPPED_EARLY and last_event[t.trial_id] == i:
            stops_x.append(spent)
            stops_y.append(value)
    fig, ax = plt.subplots(figsize=(9, 4))
    ax.scatter(xs, ys, s=12, color="0.6", label="evaluation (any trial)")
    ax.step(best_x, best_y, where="post", color="C0", lw=2, label="best so far")
    if stops_x:
        ax.scatter(stops_x, stops_y, marker="x", color="C3", s=40, label="stopped by ASHA")
    ax.set_xlabel("training examples spent by the search")
    ax.set_ylabel(f"validation {metric.split('/')[-1]}")
    ax.set_title("Best so far")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    return fig


def learning_curves_plot(trials: list[TrialRecord], path: Path, metric: str = OBJECTIVE,
                         rungs: list[int] | None = None) -> Path:
    return _save(learning_curves_figure(trials, metric, rungs), path)


def learning_curves_figure(trials: list[TrialRecord], metric: str = OBJECTIVE,
                           rungs: list[int] | None = None):
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 4))
    for i, r in enumerate(rungs or []):
        ax.axvline(r, color="0.75", lw=0.8, ls=":", label="ASHA rung" if i == 0 else None)
    for i, t in enumerate(trials):
        pts = [(h["examples_seen"], h[metric]) for h in t.history if metric in h]
        if not pts:
            continue
        x, y = zip(*pts)
        style = "--" if t.status == TrialStatus.STOPPED_EARLY else "-"
        ax.plot(x, y, style, marker=".", color=f"C{i % 10}", lw=1.2,
                label=f"{t.trial_id} ({t.status})")
        se = [h.get(f"{metric}_se", math.nan) for h in t.history if metric in h]
        if all(math.isfinite(v) for v in se):  # ± one standard error over the rows scored
            ax.fill_between(x, [v - e for v, e in zip(y, se)], [v + e for v, e in zip(y, se)],
                            color=f"C{i % 10}", alpha=0.12, lw=0)
        if t.status == TrialStatus.ERROR:
            ax.scatter([x[-1]], [y[-1]], marker="x", color="red", s=40)
    ax.set_xlabel("examples seen by the trial")
    ax.set_ylabel(f"validation {metric.split('/')[-1]}")
    ax.set_title("Learning curves (dashed = stopped early by ASHA; bands: ± 1 standard error)")
    ax.grid(alpha=0.3)
    if len(trials) <= 12:  # beside the axes, never over a curve
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def importances_plot(importances: dict[str, dict[str, float]], path: Path) -> Path | None:
    fig = importances_figure(importances)
    return None if fig is None else _save(fig, path)


def importances_figure(importances: dict[str, dict[str, float]]):
    usable = {k: v for k, v in importances.items() if v and "_error" not in v}
    if not usable:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(usable), figsize=(5 * len(usable), 3.5), squeeze=False)
    for ax, (name, imp) in zip(axes[0], usable.items()):
        items = sorted(imp.items(), key=lambda kv: kv[1])
        ax.barh([k for k, _ in items], [v for _, v in items], color="C0")
        ax.set_title(f"importance ({name})")
        ax.set_xlabel("importance (share of the score's variance)")
        ax.set_ylabel("hyperparameter")
        ax.set_xlim(0, 1)
    return fig


def confusion_plot(confusion: list[list[int]] | np.ndarray, path: Path, title: str) -> Path:
    plt = _plt()
    cm = np.asarray(confusion)
    fig, ax = plt.subplots(figsize=(4.2, 3.8))
    ax.imshow(cm, cmap="Blues")
    for i in range(cm.shape[0]):
        for j in range(cm.shape[1]):
            ax.text(j, i, str(cm[i, j]), ha="center", va="center",
                    color="white" if cm[i, j] > cm.max() / 2 else "black", fontsize=8)
    ax.set_xlabel("predicted sentiment")
    ax.set_ylabel("gold sentiment")
    ax.set_xticks(range(cm.shape[1]))
    ax.set_yticks(range(cm.shape[0]))
    ax.set_title(title, fontsize=9)
    return _save(fig, path)


def write_report(trials: list[TrialRecord], distributions: dict[str, Any], folder: Path,
                 metric: str = OBJECTIVE, rungs: list[int] | None = None) -> dict[str, Any]:
    """All report files into ``folder``; returns {name: path} and the importances."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {"best_so_far": str(best_so_far_plot(trials, folder / "best_so_far.png", metric)),
             "learning_curves": str(learning_curves_plot(trials, folder / "learning_curves.png",
                                                         metric, rungs))}
    importances = param_importances(trials, distributions)
    (folder / "importances.json").write_text(json.dumps(importances, indent=2), encoding="utf-8")
    files["importances_json"] = str(folder / "importances.json")
    plot = importances_plot(importances, folder / "importances.png")
    if plot:
        files["importances"] = str(plot)
    return {"files": files, "importances": importances}
