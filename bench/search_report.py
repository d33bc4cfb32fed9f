"""bench/search_efficiency.py's output: the console table, ``DOCS/search_efficiency.json``,
``.md`` (the tables) and ``.png`` (best score against compute), from the runs kept and the
figures carried from an earlier report (``--carry-figures``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from bench.search_grid import first_rung_spread, grid_analysis
from bench.search_methods import DEFAULT_METHOD, METHODS, SAME, SAME_DEFAULTS
from bench.search_runs import this_machine
from bench.search_stats import FIGURES, TARGETS, curve, rank_methods, summarise


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
