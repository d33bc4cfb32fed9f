"""The figures of bench/search_efficiency.py's runs: the compute every trial spent up to
each report and the best score so far (:func:`curve`), each (method, seed) against the same
seed's grid (:func:`seed_figures`), their mean +- sd over the seeds (:func:`summarise`),
the targets, and the ranking of the candidates for the driver's default
(:func:`rank_methods`).
"""

from __future__ import annotations

import math
import statistics

from bench.search_methods import METHODS


def _examples_at(trial: dict, t: float) -> float:
    """Training examples trial has seen by time t (linear between its reports)."""
    prev_t, prev_e = trial["entered_at"], 0
    for r in trial["reports"]:
        if t <= r["at"]:
            span = r["at"] - prev_t
            done = max(t - prev_t, 0.0) / span if span > 0 else 1.0
            return prev_e + (r["examples"] - prev_e) * done
        prev_t, prev_e = r["at"], r["examples"]
    return prev_e


def curve(run: dict) -> list[dict]:
    """Best score so far vs the compute spent by every trial up to each report: examples
    (interpolated within a trial between its reports) and trial-seconds (time from the
    trial function's entry -- start-up, training, evaluation -- to that moment)."""
    events = sorted((r["at"], r["score"]) for tr in run["trials"] for r in tr["reports"])
    best, points = -math.inf, []
    for t, score in events:
        best = max(best, score)
        points.append({
            "wall_s": t - run["started"],
            "examples": sum(_examples_at(tr, t) for tr in run["trials"]),
            "trial_s": sum(min(max(t - tr["entered_at"], 0.0),
                               tr["reports"][-1]["at"] - tr["entered_at"])
                           for tr in run["trials"]),
            "best": best})
    return points


def full_training_s(run: dict) -> float:
    """One full-budget training: the median span (entry to last report) of the trials."""
    return statistics.median(tr["reports"][-1]["at"] - tr["entered_at"] for tr in run["trials"])


def first_reaching(points: list[dict], target: float) -> dict | None:
    return next((p for p in points if p["best"] >= target - 1e-12), None)


def seed_figures(run: dict, grid: dict) -> dict:
    """One (method, seed) against the same seed's grid."""
    points, grid_points = curve(run), curve(grid)
    target, grid_total = grid_points[-1]["best"], grid_points[-1]
    hit = first_reaching(points, target)
    out = {"seed": run["seed"], "trials": run["num_trials"], "errors": run["errors"],
           "best_val": points[-1]["best"], "examples": points[-1]["examples"],
           "trial_s": points[-1]["trial_s"], "wall_s": run["wall_s"],
           "grid_best_val": target,
           "examples_to_grid_best_ratio": None if hit is None else
           hit["examples"] / grid_total["examples"],
           "trial_s_to_grid_best_ratio": None if hit is None else
           hit["trial_s"] / grid_total["trial_s"],
           "wall_vs_one_training": run["wall_s"] / full_training_s(grid)}
    sel, grid_sel = run.get("selected"), grid.get("selected")
    if sel and grid_sel:
        out.update({"selected_dev": sel["dev"], "selected_dev_se": sel["dev_se"],
                    "selected_config": sel.get("config"),
                    "selected_val": sel["val"], "selected_val_se": sel["val_se"],
                    "grid_selected_dev": grid_sel["dev"], "grid_selected_dev_se": grid_sel["dev_se"],
                    "dev_within_one_se_of_grid": sel["dev"] >= grid_sel["dev"] - grid_sel["dev_se"]})
    return out


def mean_sd(values: list) -> dict:
    """Mean and sample sd over the seeds; None where any seed has None (never reached)."""
    if not values or any(v is None for v in values):
        return {"mean": None, "sd": None, "n": len(values),
                "reached": sum(v is not None for v in values)}
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "sd": sd, "n": len(values)}


FIGURES = ("best_val", "examples_to_grid_best_ratio", "trial_s_to_grid_best_ratio",
           "wall_vs_one_training", "selected_dev", "examples", "wall_s")


def summarise(runs: dict[str, dict[int, dict]]) -> dict:
    """Per method: its per-seed figures against the grid and their mean +- sd."""
    grids = runs.get("grid", {})
    out = {}
    for name, by_seed in runs.items():
        per_seed = [seed_figures(by_seed[s], grids[s]) for s in sorted(by_seed) if s in grids]
        if per_seed:
            m = METHODS[name]
            out[name] = {"label": m.label,
                         "space": "grid" if m.searcher == "grid" else m.space,  # SPACES key
                         "seeds": [f["seed"] for f in per_seed],
                         "per_seed": per_seed,
                         **{k: mean_sd([f.get(k) for f in per_seed]) for k in FIGURES}}
    return out


#: the benchmark's targets, checked per seed: (figure, test, what it says)
TARGETS = (
    ("examples_to_grid_best_ratio", lambda v: v is not None and v <= 1 / 3,
     "reaches the grid's best with <= 1/3 of its examples"),
    ("wall_vs_one_training", lambda v: v is not None and v <= 2,
     "whole search <= 2x one full training's wall time"),
    ("dev_within_one_se_of_grid", lambda v: v is True,
     "selected trial's dev >= the grid's selected dev - one se"),
)


def targets_met(per_seed: dict) -> int:
    """How many of :data:`TARGETS` one (method, seed) meets."""
    return sum(bool(test(per_seed.get(key))) for key, test, _ in TARGETS)


#: the baselines the searches are measured against (every trial to the full budget)
BASELINES = tuple(k for k, m in METHODS.items() if m.scheduler == "fifo")


def rank_methods(summary: dict, min_seeds: int = 3) -> list[dict]:
    """The candidates for the driver's default, best first: the scheduler/searcher pairs
    on the continuous space (not the baselines: the hand grid, random at the full budget;
    not a pair on another space: the space is the user's, not a default; not a pair
    measured with code since changed, ``Method.superseded``) with at least
    ``min_seeds`` seeds, ranked by the targets met per seed (mean over the seeds), then by
    the selected trial's dev (mean), then by fewer training examples (mean)."""
    rows = []
    for name, s in summary.items():
        other_space = name in METHODS and METHODS[name].space != "ranges"
        superseded = name in METHODS and METHODS[name].superseded
        if name in BASELINES or other_space or superseded or len(s["seeds"]) < min_seeds:
            continue
        met = [targets_met(f) for f in s["per_seed"]]
        rows.append({"method": name, "label": s["label"], "seeds": s["seeds"],
                     "targets_met_per_seed": met,
                     "targets_met_mean": statistics.fmean(met),
                     "selected_dev_mean": s["selected_dev"]["mean"],
                     "examples_mean": s["examples"]["mean"]})
    return sorted(rows, key=lambda r: (-r["targets_met_mean"],
                                       -(r["selected_dev_mean"] or -math.inf),
                                       r["examples_mean"] or math.inf))
