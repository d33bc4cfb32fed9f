"""The methods bench/search_efficiency.py compares, and what every run of it shares.

``METHODS``: each a searcher / scheduler pair of the driver (mtbert/tune/search/choices.py) or a
baseline (report 004's hand grid, random search at the full budget), with its rungs,
space and rung metric; ``SPACES``: the two spaces the automatic searches sample;
:func:`bench_budget` and :func:`bench_base`: the driver's Budget and the TrainConfig
fields every trial of the bench shares; ``SAME``: the settings the runs of one
comparison must share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mtbert.tune.search.budgets import Budget
from mtbert.tune.search.choices import (DEFAULT_SCHEDULER, DEFAULT_SEARCHER, SCHEDULERS,
                                        default_rung_metric)
from mtbert.tune.trial.objective import RUNG_METRICS

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
    rung_metric: str = "overall"  # a --rung-metric of the driver (objective.rung_metric_keys)
    # measured with driver code that has changed since (named here): its runs are kept as
    # measured, but neither ranked nor the default -- a re-run would measure today's code
    superseded: str = ""
    # asha-promote: its last promotion resumes with every worker's CPU, as the driver's
    # does on one machine (mtbert.tune.search.tuner.build_tuner)
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


def bench_base(args) -> dict:
    """The TrainConfig fields every trial of the bench shares (data slices, model, lr,
    batch, one CPU thread)."""
    from mtbert.core.config import default_cache_dir
    return {"model": args.model, "data_dir": str(Path(args.data_dir).resolve()),
            "cache_dir": str(default_cache_dir("").resolve()),
            "max_train_per_task": args.train_rows, "max_eval_per_task": args.eval_rows,
            "lr": args.lr, "batch_size": args.batch_size,
            "progress": False, "eval_dev": False, "threads": 1,
            "device": "cuda" if args.gpus_per_trial else "cpu"}
