"""What an early rung knows: do the scores at ASHA's rungs rank report 004's grid as the
full-budget trainings do?  (docs/bench/search_efficiency.md has its table.)

The grid's configurations per seed, on bench/search_efficiency.py's settings, trained
past the second rung; Spearman's rho of every score at each rung against the same seed's
full-budget val overall (``--runs``), with the scores, in ``OUT/rung_signal.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.search_efficiency import build_parser, parse_args
from bench.search_runs import DEFAULT_METHOD, METHODS, bench_budget, bench_ray, grid_space

#: the scores compared: the objective, its soft stand-in and their parts
SCORES = ("val/overall", "val/overall_soft", "val/sst_acc", "val/sst_p_gold", "val/qqp_acc",
          "val/qqp_p_gold", "val/sts_corr")


def train_to_the_second_rung(args, seeds: list[int]) -> list[dict]:
    from ray import tune

    from mtbert.tune.search.tuner import make_tuner
    from mtbert.tune.settings import run_fields
    from mtbert.tune.trial import work_folders
    from mtbert.tune.trial.trainable import train_trial
    budget = bench_budget(args, METHODS[DEFAULT_METHOD])
    rows = []
    with bench_ray(args, Path(args.out).resolve() / "rung_signal") as (data, base, storage, _):
        for seed in seeds:
            trial_base = {**base, **run_fields(budget, "asha"), "seed": seed,
                          "eval_at_start": False}
            trainable = tune.with_resources(
                tune.with_parameters(train_trial, data=data, base=trial_base), {"cpu": 1})
            tuner = make_tuner(trainable, grid_space(), name=f"seed{seed}",
                               storage_path=str(storage), num_samples=1, num_to_keep=1,
                               stop={"examples_seen": args.stop}, verbose=0)
            for result in tuner.fit():
                for _, row in result.metrics_dataframe.iterrows():
                    rows.append({"seed": seed, "dropout": result.config["dropout"],
                                 "smart_lambda_sst": result.config["smart_lambda_sst"],
                                 "examples": int(row["examples_seen"]),
                                 **{k: float(row[k]) for k in SCORES}})
            work_folders.sweep(wait_s=5.0)
    return rows


def correlations(rows: list[dict], grid_runs: dict) -> list[dict]:
    """Per seed and rung: Spearman's rho of each score with the full-budget val overall."""
    from scipy import stats
    out = []
    for seed in sorted({r["seed"] for r in rows}):
        final = {(t["config"]["dropout"], t["config"]["smart_lambda_sst"]): t["best_val"]
                 for t in grid_runs[str(seed)]["trials"]}
        for rung in sorted({r["examples"] for r in rows if r["seed"] == seed}):
            at = [r for r in rows if r["seed"] == seed and r["examples"] == rung]
            full = [final[(r["dropout"], r["smart_lambda_sst"])] for r in at]
            out.append({"seed": seed, "examples": rung, "configs": len(at), "rho": {
                k: float(stats.spearmanr([r[k] for r in at], full).statistic) for k in SCORES}})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(__doc__.split("\n\n")[0])
    parser.add_argument("--stop", type=int, default=600,
                        help="stop each training at the first evaluation past this many "
                             "examples (600: past the second rung, 666)")
    parser.add_argument("--runs", help="search_efficiency's runs.json with the grid's runs "
                                       "(default OUT/runs.json)")
    p, args = parse_args(argv, parser)
    runs_file = Path(args.runs or Path(args.out) / "runs.json")
    grid_runs = json.loads(runs_file.read_text())["runs"].get("grid", {})
    missing = [s for s in args.seed_list if str(s) not in grid_runs]
    if missing:
        p.error(f"{runs_file}: no grid run for seeds {missing} (run bench/search_efficiency.py "
                "--methods grid first)")
    from mtbert.tune.infra import cluster
    cluster.quiet_environment()
    rows = train_to_the_second_rung(args, args.seed_list)
    table = correlations(rows, grid_runs)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "rung_signal.json").write_text(json.dumps({"rows": rows, "rho": table}, indent=1))
    print(f"[bench] Spearman's rho per seed and rung, and the scores: {out / 'rung_signal.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
