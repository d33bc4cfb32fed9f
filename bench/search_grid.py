"""What decides report 004's grid in bench/search_efficiency.py's runs: how alike the
seeds rank its configurations, the effect of each knob, how much is noise
(:func:`grid_analysis`), the chance a search that knew the best configuration reaches the
grid's best (:func:`reach_ceiling`), and the spread of a run's first evaluations
(:func:`first_rung_spread`).
"""

from __future__ import annotations

import statistics

from bench.search_methods import DROPOUTS, LAMBDAS


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
