"""Growing a finished search (the driver's ``--extend``) against one search of twice the size.

On bench/search_efficiency.py's slice, per seed: A, a search of N trials; B, its
extension, told A's trials as ``--extend`` tells them; C, one search of 2N from scratch
(docs/bench/search_extension.md has the figures and the target).  Runs are kept in
``OUT/runs.json``; writes ``DOCS/search_extension.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.common import REPO, RESULTS, commit
from bench.search_efficiency import build_parser as efficiency_parser
from bench.search_efficiency import mean_sd, open_runs
from bench.search_efficiency import parse_args as efficiency_args
from bench.search_runs import (DEFAULT_METHOD, METHODS, SAME, SPACES, bench_budget, bench_ray,
                               keep_runs, run_method, settle_run)

#: the three searches of a seed, in the order they run
ROLES = ("first", "extension", "cold")


def build_parser() -> argparse.ArgumentParser:
    """search_efficiency's settings, with this bench's defaults and meanings."""
    p = efficiency_parser(__doc__.split("\n\n")[0])
    helps = {"trials": "N: trials of the first search and of its extension (the cold "
                       "search has 2N)",
             "methods": "the one searcher/scheduler pair measured (a key of "
                        "search_runs.METHODS whose searcher can be told earlier trials)",
             "out": "keeps runs.json (every run so far) and Ray's trial folders",
             "docs": "where search_extension.json goes",
             "population": argparse.SUPPRESS, "carry_figures": argparse.SUPPRESS}
    for action in p._actions:
        if action.dest in helps:
            action.help = helps[action.dest]
    p.set_defaults(trials=4, methods=DEFAULT_METHOD,
                   out=str(RESULTS / "search_extension"),
                   docs=str(REPO / "docs" / "bench"))
    return p


def parse_args(argv):
    from mtbert.tune.search.choices import SCHEDULERS, searcher_choice
    p, args = efficiency_args(argv, build_parser())
    if len(args.method_list) != 1:
        p.error(f"--methods {args.methods}: one method")
    method = METHODS[args.method_list[0]]
    if method.searcher == "grid" or SCHEDULERS[method.scheduler].population \
            or not searcher_choice(method.searcher).learns_from_earlier:
        p.error(f"--methods {args.methods}: its searcher ({method.searcher}) cannot be told "
                "an earlier search's trials")
    if args.trials < 1:
        p.error(f"--trials {args.trials}: expected at least 1")
    args.method = args.method_list[0]
    return p, args


# ---------------------------------------------------------------------- the runs
def points_for_searcher(records: list, args, name: str) -> list:
    """What the extension's searcher is told of the first search's trials: as the driver
    tells it (mtbert.tune.results.extension.points_for_searcher)."""
    from mtbert.tune.search.choices import SCHEDULERS
    from mtbert.tune.results.extension import earlier_from_records, searcher_points
    from mtbert.tune.trial.objective import rung_metric_keys
    from mtbert.tune.search.spaces import parse_space
    method = METHODS[name]
    searched = list(parse_space(SPACES[method.space], "bench/search_extension.py").searched)
    earlier = earlier_from_records(f"{name}-first", records, searched)
    return searcher_points(earlier, searched, SCHEDULERS[method.scheduler].frees_paused_places,
                           bench_budget(args, method).grace_period,
                           rung_metric_keys(method.rung_metric)[0])


def measure(args, runs: dict, runs_file: Path, out: Path, command: str) -> dict:
    """Every seed asked for: A, B (told A's trials) and C, each run added to runs.json as
    it finishes."""
    name = args.method
    with bench_ray(args, out) as (data, base, storage, machine):
        code = commit()
        for seed in args.seed_list:
            points = ()
            for role in ROLES:
                role_args = argparse.Namespace(**{**vars(args), "trials": args.trials * (
                    2 if role == "cold" else 1)})
                experiment = f"{name}-seed{seed}-{role}"
                print(f"[bench] seed {seed}: {role} search, {role_args.trials} trials of "
                      f"{METHODS[name].label}" + (f", told {len(points)} earlier trials"
                                                   if role == "extension" else "") + " ...",
                      flush=True)
                run = run_method(name, seed, data, base, role_args, storage,
                                 earlier=points if role == "extension" else (),
                                 experiment=experiment, records=role == "first")
                if role == "first":
                    points = points_for_searcher(run.pop("records"), args, name)
                    run["told"] = [asdict(p) for p in points]
                settle_run(run, args, storage, experiment, f"seed {seed} {role}")
                runs.setdefault(role, {})[seed] = {
                    **run, "role": role, "command": command, "machine": machine,
                    "commit": code, "load_avg": list(os.getloadavg())}
                keep_runs(runs_file, args, runs)
    return runs


# ---------------------------------------------------------------------- the figures
def _examples(run: dict) -> int:
    """Training examples the run's trials were measured at (each trial's last report)."""
    return sum(t["reports"][-1]["examples"] for t in run["trials"] if t["reports"])


def _best(trials: list[dict]) -> dict | None:
    return max(trials, key=lambda t: t["best_val"], default=None)


def _config(trial: dict) -> tuple:
    return tuple(sorted(trial["config"].items()))


def reuse_check(first: dict, extension: dict, trials: int) -> dict:
    """What B spent on A's trials: its trials whose configuration equals one of A's (and
    their examples), trial ids shared, and whether B's experiment holds only its own
    (at most N) trials."""
    old = {_config(t) for t in first["trials"]}
    repeats = [t for t in extension["trials"] if _config(t) in old]
    shared = {t["trial"] for t in first["trials"]} & {t["trial"] for t in extension["trials"]}
    return {"extension_trials": extension["num_trials"],
            "repeated_configs": len(repeats),
            "examples_retraining_old": _examples({"trials": repeats}),
            "shared_trial_ids": len(shared),
            "only_own_trials": extension["num_trials"] <= trials and not shared}


def seed_figures(first: dict, extension: dict, cold: dict, trials: int) -> dict:
    """One seed: A and B together against C (run dicts as runs.json keeps them)."""
    both, c_best = _best(first["trials"] + extension["trials"]), _best(cold["trials"])
    picks = [(role, r["selected"]) for role, r in (("first", first), ("extension", extension))
             if r.get("selected")]
    from_role, sel = max(picks, key=lambda p: p[1]["val"], default=(None, None))
    c_sel = cold.get("selected")
    diff = both["best_val"] - c_best["best_val"] if both and c_best else None
    return {
        "seed": first["seed"], "errors": first["errors"] + extension["errors"] + cold["errors"],
        "trials": {"first": first["num_trials"], "extension": extension["num_trials"],
                   "cold": cold["num_trials"]},
        "told": len(first.get("told", [])),
        "best_val": both and both["best_val"], "cold_best_val": c_best and c_best["best_val"],
        "cold_best_val_se": c_best and c_best["best_val_se"], "best_val_diff": diff,
        "within_one_se": None if diff is None else diff >= -c_best["best_val_se"],
        "selected_from": from_role, "selected_config": sel and sel["config"],
        "selected_val": sel and sel["val"],
        "selected_dev": sel and sel["dev"], "selected_dev_se": sel and sel["dev_se"],
        "cold_selected_config": c_sel and c_sel["config"],
        "cold_selected_dev": c_sel and c_sel["dev"],
        "cold_selected_dev_se": c_sel and c_sel["dev_se"],
        "examples_first": _examples(first), "examples_extension": _examples(extension),
        "examples": _examples(first) + _examples(extension), "cold_examples": _examples(cold),
        "wall_s_first": first["wall_s"], "wall_s_extension": extension["wall_s"],
        "wall_s": first["wall_s"] + extension["wall_s"], "cold_wall_s": cold["wall_s"],
        **reuse_check(first, extension, trials)}


FIGURES = ("best_val", "cold_best_val", "best_val_diff", "selected_dev", "cold_selected_dev",
           "examples_first", "examples_extension", "examples", "cold_examples",
           "wall_s_first", "wall_s_extension", "wall_s", "cold_wall_s")


def summarise(per_seed: list[dict]) -> dict:
    """mean +- sd over the seeds, and the target read both ways: per seed (every seed
    within C's best trial's se; this decides) and the mean difference against the
    standard error of the per-seed differences."""
    out = {k: mean_sd([f[k] for f in per_seed]) for k in FIGURES}
    diffs = [f["best_val_diff"] for f in per_seed]
    se = (statistics.stdev(diffs) / math.sqrt(len(diffs))
          if len(diffs) > 1 and None not in diffs else None)
    per_seed_met = bool(per_seed) and all(f["within_one_se"] for f in per_seed)
    out["target"] = {
        "per_seed_within_one_se": [f["within_one_se"] for f in per_seed],
        "per_seed_met": per_seed_met,
        "mean_diff": out["best_val_diff"]["mean"], "se_of_diffs": se,
        "mean_met": None if se is None else out["best_val_diff"]["mean"] >= -se,
        "decides": "per seed", "met": per_seed_met}
    out["no_retraining"] = bool(per_seed) and all(
        f["repeated_configs"] == 0 and f["only_own_trials"] for f in per_seed)
    return out


def figures(runs: dict, trials: int) -> dict:
    """Per seed with all three searches kept, and over them."""
    seeds = sorted(set.intersection(*(set(runs.get(r, {})) for r in ROLES)))
    per_seed = [seed_figures(*(runs[r][s] for r in ROLES), trials) for s in seeds]
    return {"seeds": seeds, "per_seed": per_seed, "summary": summarise(per_seed)}


# ---------------------------------------------------------------------- the report
def write_figures(args, runs: dict, docs: Path) -> None:
    fig = figures(runs, args.trials)
    kept = [runs[r][seed] for seed in fig["seeds"] for r in ROLES]
    doc = {"method": args.method, "label": METHODS[args.method].label,
           "settings": {k: getattr(args, k) for k in SAME},
           "commands": sorted({r["command"] for r in kept}),
           "commits": sorted({str(r.get("commit")) for r in kept}),
           "machines": [dict(t) for t in {tuple(sorted(r["machine"].items())) for r in kept}],
           "runs": [{"seed": r["seed"], "role": r["role"], "started": time.strftime(
               "%Y-%m-%d %H:%M:%S", time.localtime(r["started"])), "wall_s": r["wall_s"],
               "load_avg": r.get("load_avg"), "told": r.get("told")} for r in kept],
           **fig}
    docs.mkdir(parents=True, exist_ok=True)
    (docs / "search_extension.json").write_text(json.dumps(doc, indent=1) + "\n",
                                                encoding="utf-8")
    summary = fig["summary"]
    print(f"[bench] seeds {fig['seeds']}: target (A+B's best val >= C's - one se) per seed "
          f"{summary['target']['per_seed_within_one_se']}; no example re-trains an old "
          f"trial: {summary['no_retraining']}; the figures in {docs / 'search_extension.json'}",
          flush=True)


def main(argv: list[str] | None = None) -> int:
    p, args = parse_args(argv)
    out, docs, runs_file, runs = open_runs(args, p)
    other = {r["method"] for by_seed in runs.values() for r in by_seed.values()} - {args.method}
    if other:
        p.error(f"{runs_file}: its runs measured {', '.join(sorted(other))}; pass another --out")
    if not args.report_only:
        runs = measure(args, runs, runs_file, out,
                       "python -m bench.search_extension " + " ".join(argv or sys.argv[1:]))
    write_figures(args, runs, docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
