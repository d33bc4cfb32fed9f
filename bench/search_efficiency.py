"""Search efficiency over seeds: report 004's hand grid vs random vs the automatic searches.

Every method (bench/search_runs.py) on the same data slice, model, budget unit (one full
training = ``--full-examples``), trainable and workers; each (method, seed) run kept in
``OUT/runs.json`` (later calls add to it: the settings must match).  From all runs: the
compute every trial spent up to each report and the best score so far (:func:`curve`),
each (method, seed) against the same seed's grid (:func:`seed_figures`), their mean +- sd
over the seeds (:func:`summarise`), the targets, the ranking of the candidates for the
driver's default (:func:`rank_methods`), what decides the grid (:func:`grid_analysis`),
written to ``DOCS/search_efficiency.json``, ``.md`` and ``.png``
(docs/bench/search_efficiency.md says what they are).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

from bench.common import REPO, RESULTS, add_data_arguments, shared_options, this_machine
from bench.search_runs import (DEFAULT_METHOD, DROPOUTS, LAMBDAS, METHODS, SAME,
                               SAME_DEFAULTS, bench_budget, run_all)


# ---------------------------------------------------------------------- the figures
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
    trials = [tr for tr in run["trials"] if tr["reports"]]  # a trial failed before its first
    events = sorted((r["at"], r["score"]) for tr in trials for r in tr["reports"])
    best, points = -math.inf, []
    for t, score in events:
        best = max(best, score)
        points.append({
            "wall_s": t - run["started"],
            "examples": sum(_examples_at(tr, t) for tr in trials),
            "trial_s": sum(min(max(t - tr["entered_at"], 0.0),
                               tr["reports"][-1]["at"] - tr["entered_at"]) for tr in trials),
            "best": best})
    return points


def full_training_s(run: dict) -> float:
    """One full-budget training: the median span (entry to last report) of the trials."""
    return statistics.median(tr["reports"][-1]["at"] - tr["entered_at"] for tr in run["trials"]
                             if tr["reports"])


def seed_figures(run: dict, grid: dict) -> dict:
    """One (method, seed) against the same seed's grid."""
    points, grid_points = curve(run), curve(grid)
    target, grid_total = grid_points[-1]["best"], grid_points[-1]
    hit = next((p for p in points if p["best"] >= target - 1e-12), None)  # reached it
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


def rank_methods(summary: dict, min_seeds: int = 3) -> list[dict]:
    """The candidates for the driver's default, best first: the scheduler/searcher pairs
    on the continuous space (not the baselines: the hand grid, random at the full budget;
    not a pair on another space: the space is the user's, not a default; not a pair
    measured with code since changed, ``Method.superseded``) with at least
    ``min_seeds`` seeds, ranked by the targets met per seed (mean over the seeds), then by
    the selected trial's dev (mean), then by fewer training examples (mean)."""
    rows = []
    for name, s in summary.items():
        m = METHODS.get(name)  # fifo: the baselines (every trial to the full budget)
        if m and (m.scheduler == "fifo" or m.space != "ranges" or m.superseded) \
                or len(s["seeds"]) < min_seeds:
            continue
        met = [sum(bool(test(f.get(key))) for key, test, _ in TARGETS) for f in s["per_seed"]]
        rows.append({"method": name, "label": s["label"], "seeds": s["seeds"],
                     "targets_met_per_seed": met,
                     "targets_met_mean": statistics.fmean(met),
                     "selected_dev_mean": s["selected_dev"]["mean"],
                     "examples_mean": s["examples"]["mean"]})
    return sorted(rows, key=lambda r: (-r["targets_met_mean"],
                                       -(r["selected_dev_mean"] or -math.inf),
                                       r["examples_mean"] or math.inf))


# ---------------------------------------------------------------------- the grid
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


# ---------------------------------------------------------------------- the report
def _fmt(stat: dict, digits: int = 2) -> str:
    if stat["mean"] is None:
        return f"never ({stat.get('reached', 0)}/{stat['n']})"
    return f"{stat['mean']:.{digits}f} ± {stat['sd']:.{digits}f}"


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
    analysis = grid_analysis(runs.get("grid", {}))
    first_rungs = {name: {seed: first_rung_spread(run) for seed, run in sorted(by_seed.items())}
                   for name, by_seed in runs.items() if name != "grid"}
    first_rungs.update({name: c["first_rung"] for name, c in carried.items()})
    ranking = rank_methods(summary)
    tables = markdown_tables(summary, ranking)
    if ranking and ranking[0]["method"] != DEFAULT_METHOD:
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
        "targets": {key: text for key, _, text in TARGETS},
        # each method's rungs and evaluation points at these settings
        "budgets": {name: {"rungs": b.rungs(), "grace_period": b.grace_period,
                           "eval_every": b.eval_every, "eval_growth": b.eval_growth}
                    for name, b in ((n, bench_budget(args, m)) for n, m in METHODS.items())}}
    docs.mkdir(parents=True, exist_ok=True)
    plot(runs, docs / "search_efficiency.png",
         f"best validation overall vs compute, each seed a line ({args.full_examples} examples "
         f"per full training, {args.workers} workers, MiniLM, "
         + (f"{args.gpus_per_trial:g} GPU each)" if args.gpus_per_trial else "CPU)"))
    (docs / "search_efficiency.json").write_text(json.dumps(result, indent=2), encoding="utf-8")
    curves = {name: {str(seed): curve(run) for seed, run in by_seed.items()}
              for name, by_seed in runs.items()}  # what the plot draws, beside runs.json
    (Path(args.out) / "curves.json").write_text(json.dumps(curves), encoding="utf-8")
    (docs / "search_efficiency.md").write_text(tables, encoding="utf-8")
    print(f"[bench] wrote {docs / 'search_efficiency.json'} (the figures, ranking, grid "
          f"analysis and first-rung spreads), .md (the tables) and .png; the curves in "
          f"{Path(args.out) / 'curves.json'}")


# ---------------------------------------------------------------------- the command line
def build_parser(description: str = __doc__.split("\n\n")[0]) -> argparse.ArgumentParser:
    """The bench's settings (bench/search_extension.py gives its own description and
    defaults)."""
    p = argparse.ArgumentParser(description=description)
    add_data_arguments(p)
    p.add_argument("--full-examples", type=int, default=2000,
                   help="one full-budget training, in training examples")
    p.add_argument("--train-rows", type=int, default=1000, help="training rows per task")
    p.add_argument("--eval-rows", type=int, default=300, help="validation/dev rows per task")
    p.add_argument("--trials", type=int, default=9,
                   help="configurations per automatic search (9, 3, 1 over the 3 rungs)")
    p.add_argument("--population", type=int, default=4, help="PBT's population")
    p.add_argument("--lr", type=float, default=1.5e-4, help="fixed for every trial (the small "
                   "search's best: at 5e-5 2,000 examples barely move MiniLM off chance)")
    p.add_argument("--batch-size", type=int, default=16, help="fixed for every trial")
    p.add_argument("--warmup-examples", type=int, default=96,
                   help="LR warm-up (wsd schedule), before ASHA's first rung (full / 9)")
    p.add_argument("--workers", type=int, default=2, help="trials at once (1 CPU each)")
    p.add_argument("--gpus-per-trial", type=float, default=0.0, help="each trial's share of a "
                   "GPU (0 = train on the CPU), e.g. 0.125 with --workers 8")
    p.add_argument("--methods", default=",".join(k for k, m in METHODS.items()
                                                 if not m.superseded))
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default=str(RESULTS / "search_efficiency"),
                   help="keeps runs.json (every run so far) and Ray's trial folders")
    p.add_argument("--docs", default=str(REPO / "docs"),
                   help="where search_efficiency.json and .png go")
    p.add_argument("--keep-trials", action="store_true", help="keep each run's Ray trial "
                   "folders (checkpoints) under OUT, not only a failed run's")
    p.add_argument("--no-dashboard", action="store_true", help="start Ray without its "
                   "dashboard (where its packages, ray[default], are missing)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: the figures of the runs kept in OUT/runs.json")
    p.add_argument("--carry-figures", metavar="JSON", help="a search_efficiency.json written "
                   "earlier: the figures of its methods that OUT/runs.json lacks are written "
                   "and ranked beside the runs', marked carried")
    return p


def parse_args(argv, p: argparse.ArgumentParser | None = None):
    p = p or build_parser()
    args = p.parse_args(argv)
    shared_options(p, args, [k for k, m in METHODS.items() if not m.superseded],
                   "unknown or superseded (kept as measured, not run again)")
    if args.gpus_per_trial and not args.report_only:
        import torch
        if not torch.cuda.is_available():
            p.error(f"--gpus-per-trial {args.gpus_per_trial}: this machine has no CUDA GPU "
                    "(torch.cuda.is_available() is False); use 0 to train on the CPU")
    if args.full_examples < 9 or args.warmup_examples >= args.full_examples // 9:
        p.error("--warmup-examples must end before ASHA's first rung (--full-examples / 9)")
    return p, args


def open_runs(args, p) -> tuple[Path, Path, Path, dict[str, dict[int, dict]]]:
    """A bench's output folders and the runs kept so far, which must share this call's
    settings: (OUT, DOCS, OUT/runs.json, runs) (the quiet environment of the driver set
    first)."""
    from mtbert.tune.infra import cluster

    cluster.quiet_environment()
    out, docs = Path(args.out).resolve(), Path(args.docs).resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs_file = out / "runs.json"
    if not runs_file.is_file():
        return out, docs, runs_file, {}
    kept = json.loads(runs_file.read_text(encoding="utf-8"))
    differ = [k for k in SAME if kept["args"].get(k, SAME_DEFAULTS.get(k)) != getattr(args, k)]
    if differ:
        p.error(f"{runs_file}: its runs used other settings ({', '.join(differ)}); "
                "pass another --out")
    return out, docs, runs_file, {m: {int(s): r for s, r in by_seed.items()}
                                  for m, by_seed in kept["runs"].items()}


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    out, docs, runs_file, runs = open_runs(args, p)
    if not args.report_only:
        runs = run_all(args, runs, runs_file, out,
                       "python -m bench.search_efficiency " + " ".join(argv or sys.argv[1:]))
    write_figures(args, runs, docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
