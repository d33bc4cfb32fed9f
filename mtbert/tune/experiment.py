"""What a search opens before Tune's loop: the experiment folder with its settings file
(``--resume`` and ``--extend`` read it), the MLflow parent run with the search's settings
as its params and its link to an extended search, and the lines that say where to watch
it and what it searches.  The tracker it returns writes to MLflow in the background,
through the experiment's outbox (on ``--resume``, the writes an earlier run left unsent
go first)."""

from __future__ import annotations

import json

from mtbert.tune.infra.location import reset_staging
from mtbert.tune.infra.outbox import OUTBOX_DIR
from mtbert.tune.infra.tracking import SearchTracker
from mtbert.tune.results.extension import searcher_told_line
from mtbert.tune.results.mlflow_results import share_runs_view, ui_links
from mtbert.tune.saved_settings import SETTINGS_FILE
from mtbert.tune.settings import SearchSettings
from mtbert.tune.trial.objective import OBJECTIVE, rung_metric_label


def start_experiment(settings: SearchSettings, max_concurrent: int) -> tuple[SearchTracker, str]:
    """The experiment folder with its settings file, and the search's MLflow parent run."""
    location = settings.location
    if location.storage_uri and not settings.resume:
        reset_staging(location.exp_dir)  # a stale staging copy of an earlier search
    location.exp_dir.mkdir(parents=True, exist_ok=True)
    if not settings.resume:
        location.write(SETTINGS_FILE, json.dumps(settings.saved(), indent=2, default=str))
    elif location.exp_uri:  # the local staging copy, for the MLflow artifact below
        (location.exp_dir / SETTINGS_FILE).write_text(location.read(SETTINGS_FILE),
                                                      encoding="utf-8")
    # MLflow writes from here on are sent in the background, in order (tracking.py)
    tracker = SearchTracker(settings.mlflow_uri, f"mtbert/{settings.space.name}",
                            location.exp_uri or location.exp_dir, fresh=not settings.resume,
                            background=True, outbox_dir=location.exp_dir / OUTBOX_DIR)
    budget = settings.budget
    tags = {"space": settings.space.name, "budget": budget.name,
            "ray_experiment": location.ray_experiment}
    if settings.mlflow_fallback:
        tags["mlflow_fallback_from"] = settings.mlflow_fallback
    tags.update(extension_tags(settings))
    parent = tracker.start_parent(settings.experiment,
                                  parent_params(settings, max_concurrent), tags)
    tracker.log_artifact(parent, location.exp_dir / SETTINGS_FILE)
    print(f"[tune] experiment {location.ray_experiment}  |  MLflow {settings.mlflow_uri} "
          f"(experiment mtbert/{settings.space.name}, parent run {parent})", flush=True)
    view = share_runs_view(tracker, list(settings.space.searched))
    for line in ui_links(settings.mlflow_uri, tracker.experiment_id(), parent, view):
        print(f"[tune] MLflow {line}", flush=True)
    growth = settings.base["eval_growth"]
    evaluated = (f"evaluated at {budget.eval_every} x {growth:g}^k and the end"
                 if growth > 1 else f"evaluated every {budget.eval_every}")
    print(f"[tune] space {settings.space.name}: {', '.join(settings.space.searched)}; budget "
          f"{budget.name}: {budget.max_examples} examples/trial, {evaluated}, rungs grace "
          f"{budget.grace_period} rf {budget.reduction_factor:g}; scheduler "
          f"{settings.scheduler} on {rung_metric_label(settings.rung_metric)}, searcher "
          f"{settings.search_alg}; {settings.num_samples} "
          f"trials, {max_concurrent} at once", flush=True)
    if settings.extends is not None:
        print(f"[tune] {searcher_told_line(settings)}", flush=True)
    return tracker, parent


def extension_tags(settings: SearchSettings) -> dict[str, str]:
    """The parent run's link to the search it extends (``--extend``): its experiment and
    parent run, and a note MLflow shows on the run's page."""
    earlier = settings.extends
    if earlier is None:
        return {}
    how = (f"{len(earlier.joint)} of its trials are ranked with this search's"
           + (f"; {len(earlier.prior)} told to the searcher as prior only "
              f"({', '.join(earlier.prior_reason)})" if earlier.prior else ""))
    return {"extends": earlier.experiment, "extends_run_id": earlier.parent_run_id or "",
            "mlflow.note.content": f"Extends search {earlier.experiment} (parent run "
                                   f"{earlier.parent_run_id}): {how}."}


def parent_params(settings: SearchSettings, max_concurrent: int) -> dict:
    """The search's settings as the MLflow parent run's params."""
    s, budget = settings, settings.budget
    params = {"space": s.space.name, "budget": budget.name, "num_samples": s.num_samples,
              "max_concurrent": max_concurrent, "cpus_per_trial": s.cpus_per_trial,
              "gpus_per_trial": s.gpus_per_trial, "search_alg": s.search_alg,
              "scheduler": s.scheduler, "rung_metric": rung_metric_label(s.rung_metric),
              "seed": s.seed,
              "split_seed": s.base.get("split_seed", 0), "model": s.base["model"],
              "data_dir": s.base["data_dir"], "ensemble": s.ensemble,
              "ensemble_top_k": s.top_k, "max_failures": s.max_failures,
              "gpus_rule": s.resources.rule if s.resources else "",
              "cuda_mps": s.resources.mps if s.resources else "",
              "trial_threads": s.trial_threads,
              "address": s.address or "local", "objective": OBJECTIVE,
              "storage": s.location.ray_storage, "extends": s.extend or ""}
    params.update({f"budget.{k}": v for k, v in budget.to_dict().items() if k != "name"})
    params.update({f"space.{key}": p.describe() for key, p in s.space.params.items()})
    return params
