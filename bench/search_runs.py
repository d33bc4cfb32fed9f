"""The methods bench/search_efficiency.py compares (``METHODS``: a searcher / scheduler
pair of the driver, mtbert/tune/search/choices.py, or a baseline: report 004's hand grid,
random search at the full budget) and their runs on Ray from the driver's own builders
(:func:`run_method`; ``earlier`` trials told first as ``--extend`` tells them:
bench/search_extension.py), each kept in ``OUT/runs.json`` as it finishes.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.common import this_machine
from mtbert.core.atomic import atomic_write_text
from mtbert.tune.search.budgets import Budget
from mtbert.tune.search.choices import (DEFAULT_SCHEDULER, DEFAULT_SEARCHER, SCHEDULERS,
                                        default_rung_metric)
from mtbert.tune.trial.objective import MODE, OBJECTIVE, RUNG_METRICS, rung_metric_keys

SOFT = RUNG_METRICS["overall_soft"]
#: report 004's grid
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
ASHA_PROMOTE = "promoting ASHA on"

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
    # on the classifiers' gold-class probabilities alone (STS r is noise at 224 examples)
    "asha_tpe_indep_cls": Method("ASHA on classes_soft + independent TPE", "asha", "optuna",
                                 rung_metric="classes_soft"),
    # ASHA as Li et al. state it: trials pause at the rungs and are promoted when a worker
    # frees; TPE told every trial's first-rung score
    "asha_promote_soft": Method(f"{ASHA_PROMOTE} overall_soft + independent TPE, no quota",
                                "asha-promote", "optuna", rung_metric="overall_soft",
                                superseded="before the rung quotas"),
    # the same with each rung's promotions capped at synchronous halving's (9 -> 3 -> 1)
    "asha_promote_soft_quota": Method(f"{ASHA_PROMOTE} overall_soft + independent TPE, "
                                      "sampling all", "asha-promote", "optuna",
                                      rung_metric="overall_soft", superseded=ENDS),
    "asha_promote_cls": Method(f"{ASHA_PROMOTE} classes_soft + independent TPE, no quota",
                               "asha-promote", "optuna", rung_metric="classes_soft",
                               superseded="before the rung quotas"),
    "asha_promote_cls_quota": Method(f"{ASHA_PROMOTE} classes_soft + independent TPE, "
                                     "sampling all", "asha-promote", "optuna",
                                     rung_metric="classes_soft", superseded=ENDS),
    # as the driver runs it since: no trial sampled once the first rung has promoted its
    # share, and the last promotion trains on with both workers' CPUs
    "asha_promote_cls_last": Method(f"{ASHA_PROMOTE} classes_soft + independent TPE, last leg "
                                    "on both CPUs", "asha-promote", "optuna",
                                    rung_metric="classes_soft", last_leg=True),
    "asha_promote_soft_last": Method(f"{ASHA_PROMOTE} overall_soft + independent TPE, last leg "
                                     "on both CPUs", "asha-promote", "optuna",
                                     rung_metric="overall_soft", last_leg=True),
    # the first rung on classes_soft (SST and QQP gold-class probabilities rank the grid's
    # configurations as their full trainings do at 224 examples, rho 0.95-0.98), the
    # second on overall_soft (STS r carries signal at 672: rho 0.65-0.88)
    "asha_promote_staged_last": Method(f"{ASHA_PROMOTE} classes_soft, then overall_soft + "
                                       "independent TPE, last leg on both CPUs",
                                       "asha-promote", "optuna",
                                       rung_metric="classes_soft,overall_soft", last_leg=True),
    # the last promotion filling both places (the rung's two best trained on, 1 CPU each)
    "asha_promote_cls_fill": Method(f"{ASHA_PROMOTE} classes_soft + independent TPE, both "
                                    "places' finalists", "asha-promote", "optuna",
                                    rung_metric="classes_soft",
                                    superseded="a fill_places option, measured and removed"),
    # the first rung at full/3 (666 examples), where the grid's runs show the dropout
    # signal (0.51-0.52 at dropout <= 0.2 against 0.44-0.47 at >= 0.3); full/9 has none
    "asha_tpe_late": Method("ASHA (rungs full/3, full) + mv TPE", "asha", "optuna-mv",
                            first_rung=3),
    # deciding once, at full/3, among fewer trials: 6 -> 2 finalists (6 x 666 + 2 x 1,334
    # = 6,664 examples, a third of the grid's), or 5 -> 1 (4,664)
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


#: the driver's default pair
DEFAULT_METHOD = next(k for k, m in METHODS.items() if not m.superseded and (
    m.scheduler, m.searcher, m.first_rung, m.space, m.rung_metric) == (
        DEFAULT_SCHEDULER, DEFAULT_SEARCHER, 9, "ranges", default_rung_metric(DEFAULT_SCHEDULER)))
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


def grid_space() -> dict:
    """Report 004's grid as Ray's param space."""
    from ray import tune
    return {"dropout": tune.grid_search(list(DROPOUTS)),
            "smart_lambda_sst": tune.grid_search(list(LAMBDAS))}


def search_setup(name: str, args, seed: int, earlier=()):
    """(param_space, TuneConfig kwargs, budget) of one method, from the driver's builders;
    ``earlier``: extension.EarlierPoint its searcher is told first (``--extend``)."""
    from mtbert.tune.search.spaces import parse_space
    from mtbert.tune.search.tuner import build_scheduler, build_searcher
    method = METHODS[name]
    budget = bench_budget(args, method)
    space = parse_space(SPACES[method.space], "bench/search_efficiency.py")
    if method.searcher == "grid":
        return grid_space(), dict(num_samples=1, scheduler=build_scheduler("fifo", budget),
                                  search_alg=build_searcher("random", seed, args.workers, 1)), \
            budget
    population = SCHEDULERS[method.scheduler].population
    n = {"fifo": len(DROPOUTS) * len(LAMBDAS)}.get(
        method.scheduler, args.population if population else method.trials or args.trials)
    # PBT: every trial of the population is in the searcher's hands (Ray's resources
    # bound how many train at once), as the driver does
    searcher = build_searcher(method.searcher, seed, 0 if population else args.workers, n,
                              method.scheduler, budget.grace_period,
                              rung_metric_keys(method.rung_metric), earlier=earlier)
    return space.param_space(), dict(
        num_samples=n, scheduler=build_scheduler(method.scheduler, budget, space,
                                                 rung_metric_keys(method.rung_metric),
                                                 args.workers, n,
                                                 # (GPU trials keep theirs, as in the driver)
                                                 args.workers if method.last_leg
                                                 and not args.gpus_per_trial else 0),
        search_alg=searcher), budget


def run_method(name: str, seed: int, data, base: dict, args, storage: Path, earlier=(),
               experiment: str | None = None, records: bool = False) -> dict:
    """One search, in Ray's experiment ``experiment`` (default ``NAME-seedSEED``) under
    ``storage``; ``earlier``: as for :func:`search_setup`; ``records``: the run also holds
    its trials as the driver records them (``"records"``: records.TrialRecord, taken
    before its folders are removed), for a later search to be told."""
    from ray import tune

    from mtbert.tune.trial import work_folders
    from mtbert.tune.results.records import collect_trials
    from mtbert.tune.settings import run_fields
    from mtbert.tune.trial.trainable import train_trial
    from mtbert.tune.search.tuner import make_tuner, reuses_actors
    space, tune_kwargs, budget = search_setup(name, args, seed, earlier)
    trial_base = {**base, **run_fields(budget, METHODS[name].scheduler), "seed": seed,
                  "eval_at_start": False}
    # PBT restores a trial from another's checkpoint some time after choosing it: all kept
    keep = None if SCHEDULERS[METHODS[name].scheduler].population else 1
    trainable = tune.with_resources(
        tune.with_parameters(train_trial, data=data, base=trial_base),
        {"cpu": 1, "gpu": args.gpus_per_trial})
    tuner = make_tuner(trainable, space, name=experiment or f"{name}-seed{seed}",
                       storage_path=str(storage),
                       # the driver's choice (Ray's default is no reuse)
                       reuse_actors=reuses_actors(METHODS[name].scheduler, None),
                       num_to_keep=keep, verbose=1, **tune_kwargs)
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
    if records:
        run["records"] = collect_trials(grid, budget.max_examples, budget.rungs())
    return run


def dev_score(checkpoint_dir: str, data, device: str = "cpu") -> dict:
    """dev overall (and its standard error) of a checkpoint, on the bench's dev rows."""
    from mtbert.run.inference import as_label
    from mtbert.tune.results.finalists import predict_member, score_split
    preds = predict_member(checkpoint_dir, data, device, splits=("dev",))["dev"]
    m = score_split(data, "dev", {t: as_label(t, p) for t, p in preds.items()})
    return {"dev": m["dev/overall"], "dev_se": m["dev/overall_se"]}


@contextmanager
def bench_ray(args, out: Path):
    """A sitting of runs: (data, base, storage, machine) with Ray started for them --
    the bench's data slices loaded once, the TrainConfig fields every trial shares, where
    Ray's trial folders go, the machine kept with each run."""
    import ray

    from mtbert.core.config import TrainConfig
    from mtbert.data import load_data
    from mtbert.tune.infra import cluster
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
        yield data, base, storage, machine
    finally:
        ray.shutdown()


def settle_run(run: dict, args, storage: Path, experiment: str, label: str) -> None:
    """Say how a finished run went; remove its Ray trial folders unless a trial failed
    (their error files) or ``--keep-trials``."""
    print(f"[bench] {label}: {run['num_trials']} trials in {run['wall_s']:.0f} s", flush=True)
    if run["errors"]:
        print(f"[bench] {label}: {run['errors']} trials failed (Ray's error files under "
              f"{storage / experiment}); its figures are marked, run it again", flush=True)
    elif not args.keep_trials:
        # runs.json holds every figure (the selected checkpoint's dev included);
        # the trials' checkpoints (~0.3 GB each, PBT keeps all) would fill a disk
        shutil.rmtree(storage / experiment, ignore_errors=True)


def keep_runs(runs_file: Path, args, runs: dict) -> None:
    """runs.json: every run so far, with the settings they share (``SAME``)."""
    # whole or not at all: every finished run is kept, even if a later one fails
    atomic_write_text(runs_file, json.dumps({"args": {k: getattr(args, k) for k in SAME},
                                             "runs": runs}, default=str))


def run_all(args, runs: dict, runs_file: Path, out: Path, command: str) -> dict:
    """Run every (seed, method) asked for; each finished run is added to runs.json."""
    with bench_ray(args, out) as (data, base, storage, machine):
        for seed in args.seed_list:
            for name in args.method_list:
                print(f"[bench] seed {seed}: {METHODS[name].label} ...", flush=True)
                run = run_method(name, seed, data, base, args, storage)
                runs.setdefault(name, {})[seed] = {**run, "command": command,
                                                   "machine": machine}
                settle_run(run, args, storage, f"{name}-seed{seed}", f"seed {seed} {name}")
                keep_runs(runs_file, args, runs)
    return runs
