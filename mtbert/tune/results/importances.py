"""Hyperparameter importances of a finished search, from Optuna's evaluators.

fANOVA (Hutter et al. 2014) and PED-ANOVA (Watanabe et al. 2023) run on a study rebuilt
from the finished trials with ``optuna.trial.create_trial`` (value = the trial's best
validation score); evaluators that cannot run (too few trials) report why instead.
"""

from __future__ import annotations

import json
import math
import warnings
from typing import Any

from mtbert.tune.results.records import TrialRecord, TrialStatus


def param_importances(trials: list[TrialRecord],
                      distributions: dict[str, Any]) -> dict[str, dict[str, float]]:
    """{evaluator: {param: importance}} from Optuna; evaluators that cannot run are skipped.

    The study holds one COMPLETE trial per finished trial (errored ones are left
    out) with its sampled params and its best validation score.  Params that took a
    single value in every trial carry no information and are dropped.
    """
    import optuna
    from optuna.importance import FanovaImportanceEvaluator, PedAnovaImportanceEvaluator

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    usable = [t for t in trials if t.status != TrialStatus.ERROR and math.isfinite(t.best_score)]
    keys = [k for k, d in distributions.items() if d is not None
            and len({_hashable(t.config.get(k)) for t in usable}) > 1]
    if len(usable) < 2 or not keys:
        return {}
    study = optuna.create_study(direction="maximize")
    for t in usable:
        params = {k: t.config[k] for k in keys if k in t.config}
        if len(params) != len(keys):
            continue
        try:
            study.add_trial(optuna.trial.create_trial(
                params=params, distributions={k: distributions[k] for k in keys},
                value=t.best_score))
        except ValueError:
            continue  # a value outside the distribution (space changed on resume)
    out: dict[str, dict[str, float]] = {}
    evaluators = {"fanova": FanovaImportanceEvaluator(seed=0),
                  "ped_anova": PedAnovaImportanceEvaluator()}
    for name, evaluator in evaluators.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                imp = optuna.importance.get_param_importances(study, evaluator=evaluator)
            out[name] = {k: float(v) for k, v in imp.items()}
        except Exception as exc:  # noqa: BLE001 -- too few trials etc.: report, don't fail
            out[name] = {"_error": str(exc)[:200]}  # type: ignore[dict-item]
    return out


def _hashable(value: Any) -> Any:
    return json.dumps(value, sort_keys=True, default=str)
