"""One (method, seed) run of bench/search_efficiency.py on Ray, from the driver's own
builders (``mtbert.tune.search.tuner``: searcher, scheduler, actor reuse; the driver's trainable),
and every run asked for, each kept in ``OUT/runs.json`` as it finishes.  A run's searcher
can be told an earlier search's trials first (``earlier``, as ``--extend`` tells the
driver's: bench/search_extension.py).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

from mtbert.tune.search.choices import SCHEDULERS
from mtbert.tune.trial.objective import MODE, OBJECTIVE, rung_metric_keys
from bench.search_methods import (DROPOUTS, LAMBDAS, METHODS, SAME, SOFT, SPACES, bench_base,
                                  bench_budget)


def search_setup(name: str, args, seed: int, earlier=()):
    """(param_space, TuneConfig kwargs, budget) of one method, from the driver's builders;
    ``earlier``: extension.EarlierPoint its searcher is told first (``--extend``)."""
    from ray import tune

    from mtbert.tune.search.spaces import parse_space
    from mtbert.tune.search.tuner import build_scheduler, build_searcher
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
    kept = {"args": {k: getattr(args, k) for k in SAME}, "runs": runs}
    tmp = runs_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(kept, default=str), encoding="utf-8")
    tmp.replace(runs_file)  # every finished run is kept, even if a later one fails


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


def this_machine(gpu: bool = False) -> dict:
    """Where a run ran: CPUs, platform (and the GPU's name where trials used one)."""
    facts = {"cpu_count": os.cpu_count(), "platform": platform.platform(),
             "processor": platform.processor() or platform.machine()}
    if gpu:
        import torch
        facts["gpu"] = torch.cuda.get_device_name()
    return facts
