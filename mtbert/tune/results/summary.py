"""The search summary: a typed record built by one pure function, and its renderings.

:func:`build_summary` takes the trial records, the finalists' dev scores, the ensemble
and the report files and returns a :class:`SearchSummary`; ``summary.json`` is its
:meth:`~SearchSummary.to_dict`, ``summary.md`` its :meth:`~SearchSummary.markdown`, and
the table printed at the end of a search its :meth:`~SearchSummary.console_table`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from mtbert.run.metrics import scalar_metrics
from mtbert.tune.trial.objective import MODE, OBJECTIVE, rung_metric_label
from mtbert.tune.results.records import TrialRecord, TrialStatus
from mtbert.tune.trial.trial_config import trial_config_values

NAN = float("nan")


@dataclass(frozen=True)
class Counts:
    trials: int
    completed: int
    stopped_early: int
    errored: int
    interrupted: int
    # trials asked for that never ran: not sampled yet when the search was interrupted
    # (--resume runs them), or lost to a driver crash (see the driver's warning); every
    # scheduler samples every trial asked for, so a complete search has none
    not_started: int
    # trials whose worker failed (a node lost, a process killed, a GPU fault) and that Ray
    # restored from their last checkpoint at least once (--max-failures)
    restored: int = 0


def duration(seconds: float) -> str:
    """``9 min 24 s``, ``31 s``, ``1 h 2 min``."""
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60} min"


def phases_line(p: dict[str, float]) -> str:
    """Where the command's wall time went (``SearchSummary.phases``)."""
    ready = (f" (the first trial ready {duration(p['first_ready_s'])} into it)"
             if "first_ready_s" in p else "")
    return (f"Wall time {duration(p['total_s'])}: data {duration(p['data_s'])}, Ray and "
            f"MLflow {duration(p['setup_s'])}, Tune's loop {duration(p['tune_s'])}{ready}, "
            f"finalists, ensemble and report {duration(p['finish_s'])}")


def first_ready_s(records: Iterable[TrialRecord], tune_started_at: float) -> float | None:
    """Seconds into Tune's loop at which the first of its trials had its Trainer ready
    (``time/entered_at`` + ``time/startup_s`` of their reports): how long the loop waited
    for its first worker to start.  Every report kept of each trial counts (its history
    and its best: a trial paused at a rung and resumed has its best from a later run than
    its first).  None where no trial entered within this loop (the trials of an earlier
    search or run have earlier entries)."""
    ready = [row["time/entered_at"] + row["time/startup_s"] - tune_started_at
             for r in records for row in (*r.history, r.best)
             if "time/startup_s" in row and row.get("time/entered_at", 0.0) >= tune_started_at]
    return min(ready) if ready else None


def counted(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural but for one: "1 model", "3 models"."""
    return f"{n} {noun}{'' if n == 1 else 's'}"


#: summary.md's line on ``Counts.restored`` trials
RESTORED_LINE = ("{n} of the trials had their worker fail and were restored from their last "
                 "checkpoint by Ray (`--max-failures`; each trial's MLflow run has a "
                 "`retries` tag)")
#: summary.md's line on the search's compute (``SearchSummary.examples_trained``)
TRAINED_LINE = ("{n:,} examples trained by this search's trials, every one counted: those "
                "trained after a trial's last evaluation before the scheduler stopped or "
                "paused it, and those trained again after a restore from a checkpoint")
def count_trials(records: list[TrialRecord], num_samples: int) -> Counts:
    by = [r.status for r in records]
    return Counts(trials=len(records), completed=by.count(TrialStatus.COMPLETED),
                  stopped_early=by.count(TrialStatus.STOPPED_EARLY),
                  errored=by.count(TrialStatus.ERROR),
                  interrupted=by.count(TrialStatus.INTERRUPTED),
                  not_started=max(0, num_samples - len(records)),
                  restored=sum(1 for r in records if r.retries))


@dataclass(frozen=True)
class TrialRow:
    """One trial in ``summary.json``'s ``trials`` (its record less the history)."""
    trial_id: str
    name: str
    status: TrialStatus
    config: dict[str, Any]
    best: dict[str, float]
    best_checkpoint: str | None
    examples_seen: int
    rung_reached: int
    error: str
    mlflow_run_id: str | None
    best_val_overall: float | None
    searched: dict[str, Any]
    evaluations: int
    origin: str = ""                 # the earlier search it trained in (--extend), or ""
    examples_trained: int = 0        # over all its runs (records.TrialRecord)
    # the examples seen at each evaluation, as the history holds them; those of them taken
    # from its checkpoints (missing from Ray's result log); results lost from Ray's log
    # that no checkpoint holds (records.trial_record)
    evaluated_at: list[int] = dataclasses.field(default_factory=list)
    rows_filled: list[int] = dataclasses.field(default_factory=list)
    rows_missing: int = 0
    precision: str = ""              # what it computed in: bf16 | fp32 ("" unreported)


@dataclass(frozen=True)
class RankedTrial:
    """A row of the top-trials table."""
    trial_id: str
    status: TrialStatus
    examples_seen: int
    val: dict[str, float]
    dev: dict[str, float]
    searched: dict[str, Any]
    mlflow_run_id: str | None
    origin: str = ""


@dataclass(frozen=True)
class ExtensionSummary:
    """What a search started with ``--extend`` continued from (extension.py)."""
    experiment: str
    parent_run_id: str | None
    joint_trials: int                # ranked and ensembled with this search's trials
    prior_trials: int                # told to the searcher as prior only
    prior_reason: list[str]          # what they were measured on differently
    told: int                        # earlier trials the searcher was told
    left_out: dict[str, str]         # better-ranked trials not ensembled, and why


@dataclass(frozen=True)
class BestTrial:
    trial_id: str
    name: str
    status: TrialStatus
    searched: dict[str, Any]
    config: dict[str, Any]           # every TrainConfig field the trial trained with
    val: dict[str, float]
    dev: dict[str, float]
    examples_seen_at_best: float | None
    checkpoint: str | None
    mlflow_run_id: str | None
    predictions: str | None
    model: str | None = None         # its exported weights (--keep-checkpoints best)
    origin: str = ""                 # the earlier search it trained in (--extend), or ""


@dataclass(frozen=True)
class EnsembleSummary:
    method: str
    members: list[str]               # selected (non-zero weight), best first
    candidates: list[str]
    weights: dict[str, dict[str, int]]
    val: dict[str, float]
    dev: dict[str, float]
    predictions: str


@dataclass(frozen=True)
class MlflowRefs:
    tracking_uri: str
    experiment_id: str | None
    parent_run_id: str
    runs_view: str | None = None        # the shared view key (mlflow_results.ui_links)
    ensemble_run_id: str | None = None


@dataclass(frozen=True)
class SearchSummary:
    experiment: str
    experiment_dir: str
    space: dict[str, Any]
    budget: dict[str, Any]
    search_alg: str
    scheduler: str
    rung_metric: str                 # what the scheduler compared trials on
    seed: int
    num_samples: int
    resources: dict[str, Any]        # per trial CPUs and GPU share, trials at once, the rule
    objective: str
    mode: str
    counts: Counts
    interrupted: bool
    best_trial: BestTrial | None
    ensemble: EnsembleSummary | None
    top_trials: list[RankedTrial]
    trials: list[TrialRow]
    importances: dict[str, dict[str, float]]
    report_files: dict[str, str]
    mlflow: MlflowRefs
    keep_checkpoints: str = "all"
    models: dict[str, str] = dataclasses.field(default_factory=dict)  # trial id -> folder
    extends: ExtensionSummary | None = None
    # the command's wall clock: started_at, tune_started_at, tune_ended_at (Unix seconds);
    # data_s (load, tokenise), setup_s (Ray, resources, MLflow parent run), tune_s
    # (Tune's loop), finish_s (finalists, ensemble, report, to this summary), total_s;
    # first_ready_s (seconds into Tune's loop when the first trial's Trainer was ready)
    phases: dict[str, float] = dataclasses.field(default_factory=dict)
    # the compute: every example this search's trials trained (records.TrialRecord's
    # examples_trained: past a stop or a pause too, and again after a restore)
    examples_trained: int = 0
    # the promoting scheduler's decisions in the order taken (--scheduler asha-promote;
    # ray_classes.PromotingASHA): {decision: scored | promoted | stopped, trial_id, rung
    # (examples), metric, value (the trial's score there), compared (promoted: every
    # score of the rung it was chosen from)}
    rung_decisions: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    # what had not reached MLflow when the search ended (its server away past the wait):
    # {operations: N, runs: {parent | ensemble | trial id | experiment: N}, command: the
    # command that sends them}; None once everything is in MLflow
    mlflow_unsent: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def markdown(self) -> str:
        return _markdown(self)

    def console_table(self) -> str:
        return _console_table(self)

    def with_mlflow_runs(self, runs: dict[str, str],
                         ensemble_run_id: str | None) -> "SearchSummary":
        """The summary with the MLflow run ids known now (``runs``: trial id -> run id)
        where it had none: a run made while MLflow was away."""
        def row(item):
            return dataclasses.replace(item, mlflow_run_id=item.mlflow_run_id
                                       or runs.get(item.trial_id))
        return dataclasses.replace(
            self, trials=[row(t) for t in self.trials], top_trials=[row(t) for t in self.top_trials],
            best_trial=self.best_trial and row(self.best_trial),
            mlflow=dataclasses.replace(self.mlflow, ensemble_run_id=ensemble_run_id
                                       or self.mlflow.ensemble_run_id))

    def with_public_paths(self, public: Callable[[str | None], str | None],
                          stored: dict[str, str]) -> "SearchSummary":
        """The summary with local staging paths replaced by where users find the files:
        ``public(path)`` for the experiment's files, ``stored[trial_id]`` for checkpoints."""
        best = self.best_trial and dataclasses.replace(
            self.best_trial, checkpoint=stored.get(self.best_trial.trial_id,
                                                   self.best_trial.checkpoint),
            predictions=public(self.best_trial.predictions))
        ensemble = self.ensemble and dataclasses.replace(
            self.ensemble, predictions=public(self.ensemble.predictions))
        trials = [dataclasses.replace(t, best_checkpoint=stored.get(t.trial_id,
                                                                    t.best_checkpoint))
                  if t.best_checkpoint else t for t in self.trials]
        best = best and dataclasses.replace(best, model=public(best.model))
        return dataclasses.replace(
            self, experiment_dir=public(self.experiment_dir), best_trial=best,
            models={k: public(v) for k, v in self.models.items()},
            ensemble=ensemble, trials=trials,
            report_files={k: public(v) for k, v in self.report_files.items()})


def _prefixed(metrics: dict[str, float], prefix: str) -> dict[str, float]:
    return {k: v for k, v in metrics.items() if k.startswith(prefix)}


def extension_summary(settings, left_out: dict[str, str], told: int) -> ExtensionSummary | None:
    """What the search continued from (``--extend``), or None."""
    e = settings.extends
    if e is None:
        return None
    return ExtensionSummary(e.experiment, e.parent_run_id, len(e.joint), len(e.prior),
                            e.prior_reason, told, dict(left_out))


def build_summary(settings, records: list[TrialRecord], ranked: list[TrialRecord],
                  dev_of: dict[str, dict[str, float]], ensemble, report: dict[str, Any],
                  mlflow: MlflowRefs, interrupted: bool,
                  left_out: dict[str, str] | None = None,
                  told: int = 0, rung_decisions: list[dict[str, Any]] = ()) -> SearchSummary:
    """The summary of a finished (or interrupted) search; ``ensemble`` is an
    :class:`~mtbert.tune.results.finalists.EnsembleResult` or None; ``report`` is what
    :func:`~mtbert.tune.results.report.write_report` returned.  ``records`` are this search's
    trials; ``ranked`` may hold an earlier search's too (``--extend``), and
    ``left_out`` the better-ranked ones the ensemble could not take; ``told``: how many
    earlier trials the searcher was told; ``rung_decisions``: the promoting scheduler's
    (:func:`read_rung_decisions`)."""
    exp_dir = settings.location.exp_dir
    searched_keys = list(settings.space.searched)
    counts = count_trials(records, settings.num_samples)

    def searched(r: TrialRecord) -> dict[str, Any]:
        return {k: r.config[k] for k in searched_keys if k in r.config}

    top = [RankedTrial(r.trial_id, r.status, r.examples_seen, _prefixed(r.best, "val/"),
                       dev_of.get(r.trial_id, {}), searched(r), r.mlflow_run_id, r.origin)
           for r in ranked[:max(settings.top_k, 5)]]
    best = ranked[0] if ranked else None
    best_trial = None if best is None else BestTrial(
        trial_id=best.trial_id, name=best.name, status=best.status, searched=searched(best),
        config=trial_config_values(settings.base, best.config),
        val=_prefixed(best.best, "val/"), dev=dev_of.get(best.trial_id, {}),
        examples_seen_at_best=best.best.get("examples_seen"),
        checkpoint=best.best_checkpoint, mlflow_run_id=best.mlflow_run_id,
        predictions=(str(exp_dir / "best_trial" / "predictions")
                     if best.trial_id in dev_of else None), origin=best.origin)
    ensemble_summary = None
    if ensemble is not None:
        metrics = scalar_metrics(ensemble.metrics, finite=True)
        ensemble_summary = EnsembleSummary(
            method=ensemble.method, members=ensemble.selected, candidates=ensemble.members,
            weights=ensemble.weights_by_member(), val=_prefixed(metrics, "val/"),
            dev=_prefixed(metrics, "dev/"),
            predictions=str(exp_dir / "ensemble" / "predictions"))
    own = {r.trial_id for r in records}
    inherited = settings.extends.joint_records() if settings.extends else []
    trials = [TrialRow(r.trial_id, r.name, r.status, r.config, r.best, r.best_checkpoint,
                       r.examples_seen, r.rung_reached, r.error, r.mlflow_run_id,
                       r.best_score if math.isfinite(r.best_score) else None, searched(r),
                       len(r.history), r.origin, r.examples_trained, r.evaluated_at,
                       list(r.rows_filled), r.rows_missing, ran_in(r))
              for r in records + [r for r in inherited if r.trial_id not in own]]
    space = settings.space
    return SearchSummary(
        experiment=settings.experiment, experiment_dir=str(exp_dir),
        space={"name": space.name, "path": space.path, **space.to_dict()},
        budget=settings.budget.to_dict(), search_alg=settings.search_alg,
        scheduler=settings.scheduler, rung_metric=rung_metric_label(settings.rung_metric),
        seed=settings.seed, num_samples=settings.num_samples,
        resources=asdict(settings.resources) if settings.resources else {},
        objective=OBJECTIVE, mode=MODE, counts=counts,
        interrupted=interrupted or counts.interrupted > 0, best_trial=best_trial,
        ensemble=ensemble_summary, top_trials=top, trials=trials,
        importances=report["importances"], report_files=report["files"], mlflow=mlflow,
        extends=extension_summary(settings, left_out or {}, told),
        examples_trained=sum(r.examples_trained for r in records),
        rung_decisions=list(rung_decisions))


def ran_in(record: TrialRecord) -> str:
    """The precision a trial computed in, from its last report (``train/bf16``)."""
    reported = [h["train/bf16"] for h in record.history if "train/bf16" in h]
    return "" if not reported else "bf16" if reported[-1] else "fp32"


def read_rung_decisions(path: Path) -> list[dict[str, Any]]:
    """The decisions a promoting scheduler wrote, one JSON line each ([] where it wrote
    none; a line cut short by a killed driver is left out)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        if isinstance(entry, dict):
            out.append(entry)
    return out


# ---------------------------------------------------------------------- renderings
def _fmt(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def _with_se(scores: dict[str, float], key: str) -> str:
    """``0.6624 ± 0.0161``: a score and its standard error over the rows scored."""
    value, se = scores.get(key, NAN), scores.get(f"{key}_se")
    return f"{value:.4f}" if se is None else f"{value:.4f} ± {se:.4f}"


def _scores(val: dict[str, float], prefix: str = "val") -> tuple[float, ...]:
    return tuple(val.get(f"{prefix}/{k}", NAN) for k in ("overall", "sst_acc", "qqp_acc",
                                                         "sts_corr"))


def _markdown(s: SearchSummary) -> str:
    c = s.counts
    lines = [f"# Search `{s.experiment}`", "",
             f"space `{s.space['name']}` ({s.space['description']}), budget "
             f"`{s.budget['name']}`, searcher `{s.search_alg}` (seed {s.seed}), scheduler "
             f"`{s.scheduler}` (deciding on `{s.rung_metric}`), objective `{s.objective}` "
             "(max, validation split carved from train; dev is reported, never used to "
             "select).", ""]
    if s.resources:
        r = s.resources
        lines += [f"{r['trials_at_once']} trials at once, each {r['cpus_per_trial']:g} CPU and "
                  f"{r['gpus_per_trial']:g} GPU ({r['rule']}); CUDA MPS "
                  f"{r.get('mps') or 'not recorded'}.", ""]
    ran = [t.precision for t in s.trials if t.precision]
    if ran:
        lines += ["Precision: " + ", ".join(f"{ran.count(p)} trials {p}"
                                            for p in sorted(set(ran))) + ".", ""]
    if s.phases:
        lines += [phases_line(s.phases) + ".", ""]
    lines += ["| trials | completed | stopped early (ASHA) | errored | never started |",
             "| --- | --- | --- | --- | --- |",
             f"| {c.trials} | {c.completed} | {c.stopped_early} | {c.errored} | "
             f"{c.not_started} |", ""]
    if c.restored:
        lines += [f"{RESTORED_LINE.format(n=c.restored)}.", ""]
    if s.examples_trained:
        lines += [TRAINED_LINE.format(n=s.examples_trained) + ".", ""]
    lines += _extension_lines(s.extends, c.trials) + unsent_lines(s.mlflow_unsent)
    lines += ["## Top trials", "", "| rank | trial | status | examples | val overall ± se | sst | "
              "qqp | sts r | params |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, t in enumerate(s.top_trials, 1):
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t.searched.items())
        overall, sst, qqp, sts = _scores(t.val)
        lines.append(f"| {i} | {_marked(t.trial_id, t.origin)} | {t.status} | {t.examples_seen} | "
                     f"{_with_se(t.val, 'val/overall')} | "
                     f"{sst:.3f} | {qqp:.3f} | {sts:.3f} | {params} |")
    ens, best = s.ensemble, s.best_trial
    if best:
        lines += ["", "## Best trial vs ensemble", "", "| | val overall ± se | dev overall ± se | "
                  "dev sst | dev qqp | dev sts r |", "| --- | --- | --- | --- | --- | --- |"]
        rows = [(f"best trial {_marked(best.trial_id, best.origin)}", best.val, best.dev)]
        if ens:
            rows.append((f"ensemble ({ens.method}, {counted(len(ens.members), 'member')})",
                         ens.val, ens.dev))
        for label, val, dev in rows:
            overall, sst, qqp, sts = _scores(dev, "dev")
            lines.append(f"| {label} | {_with_se(val, 'val/overall')} | "
                         f"{_with_se(dev, 'dev/overall')} | "
                         f"{sst:.3f} | {qqp:.3f} | {sts:.3f} |")
        lines += ["", f"Best config: `{json.dumps(best.searched, default=str)}`"]
    if ens:
        lines += ["", f"Ensemble members: {', '.join(ens.members)}; weights per task "
                  f"{json.dumps(ens.weights)}; predictions in `{ens.predictions}`."]
        if ens.method == "greedy":
            lines += ["", "Greedy selection was made on the validation split, so the "
                      "ensemble's val score is optimistic: compare on dev."]
    for name, values in s.importances.items():
        if values and "_error" not in values:
            lines += ["", f"## Importances ({name})", ""]
            lines += [f"- {k}: {v:.3f}" for k, v in values.items()]
    if s.models:
        lines += ["", f"Weights kept (`--keep-checkpoints {s.keep_checkpoints}`; load with "
                  "`mtbert.run.model_files.load_model(FOLDER)`): "
                  + ", ".join(f"{tid} in `{path}`" for tid, path in s.models.items()) + "."]
    elif s.keep_checkpoints == "none":
        lines += ["", "No weights kept (`--keep-checkpoints none`)."]
    lines += _rung_lines(s.rung_decisions)
    gaps = [t for t in s.trials if t.rows_missing]
    if gaps:
        lines += ["", "Evaluations missing from Ray's result log and from the trial's "
                  "checkpoints: " + ", ".join(f"{t.trial_id} ({t.rows_missing})" for t in gaps)
                  + "; their curves have gaps."]
    errors = [t for t in s.trials if t.status == TrialStatus.ERROR]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {t.trial_id}: {t.error}" for t in errors]
    lines += ["", "Report: " + ", ".join(f"`{Path(p).name}`" for p in s.report_files.values()),
              ""]
    return "\n".join(lines)


def _rung_lines(decisions: list[dict[str, Any]]) -> list[str]:
    """summary.md's table of the promoting scheduler's promotions and stops."""
    shown = [d for d in decisions if d.get("decision") in ("promoted", "stopped")]
    if not shown:
        return []
    lines = ["", "## Rung decisions", "", "| rung | trial | decision | score | compared with |",
             "| --- | --- | --- | --- | --- |"]
    for d in shown:
        compared = ", ".join(f"{t} {_fmt(v)}" for t, v in (d.get("compared") or {}).items()
                             if t != d["trial_id"])
        lines.append(f"| {d.get('rung')} | {d['trial_id']} | {d['decision']} | "
                     f"{_fmt(d.get('value'))} | {compared} |")
    return lines


#: summary.md's section on what had not reached MLflow (``SearchSummary.mlflow_unsent``)
UNSENT_HEADING = "## Not yet in MLflow"


def unsent_lines(unsent: dict[str, Any] | None) -> list[str]:
    """summary.md's section on the MLflow writes still unsent, and the command that sends
    them (one paragraph under :data:`UNSENT_HEADING`: :func:`without_unsent` removes it)."""
    if not unsent:
        return []
    runs = ", ".join(f"{run} {n}" for run, n in unsent["runs"].items())
    return [UNSENT_HEADING, "", f"{counted(unsent['operations'], 'write')} had not reached "
            f"MLflow when the search ended (by run: {runs}); they wait in the experiment's "
            f"`mlflow_outbox/`. Send them once the server answers: `{unsent['command']}`.", ""]


def without_unsent(markdown: str) -> str:
    """summary.md once its MLflow writes are all sent: :func:`unsent_lines`' section gone."""
    lines = markdown.split("\n")
    if UNSENT_HEADING not in lines:
        return markdown
    i = lines.index(UNSENT_HEADING)
    return "\n".join(lines[:i] + lines[i + 4:])


def sent_summary(doc: dict[str, Any], runs: dict[str, str],
                 ensemble_run_id: str | None) -> dict[str, Any]:
    """summary.json (as read) once its MLflow writes are all sent: no ``mlflow_unsent``, and
    the run ids known now (``runs``: trial id -> run id) where it had none."""
    doc = json.loads(json.dumps(doc))
    doc["mlflow_unsent"] = None
    for row in [*doc.get("trials", []), *doc.get("top_trials", []), doc.get("best_trial")]:
        if isinstance(row, dict) and not row.get("mlflow_run_id"):
            row["mlflow_run_id"] = runs.get(row.get("trial_id"))
    refs = doc.get("mlflow")
    if isinstance(refs, dict) and not refs.get("ensemble_run_id"):
        refs["ensemble_run_id"] = ensemble_run_id
    return doc


def _marked(trial_id: str, origin: str) -> str:
    """A trial id, marked ``*`` where it trained in an earlier search (``--extend``)."""
    return f"{trial_id}*" if origin else trial_id


def _extension_lines(e: ExtensionSummary | None, new_trials: int) -> list[str]:
    """summary.md's paragraph on the search it extends."""
    if e is None:
        return []
    prior = (f"; {counted(e.prior_trials, 'trial')} measured on another "
             f"{', '.join(e.prior_reason)} went to the searcher as prior information only "
             "and are not ranked here" if e.prior_trials else "")
    lines = [f"Extends search `{e.experiment}` (MLflow parent run `{e.parent_run_id}`): its "
             f"{counted(e.joint_trials, 'trial')} are ranked and ensembled with this search's "
             f"{new_trials} (marked `*`; none was trained again); the searcher was told "
             f"{counted(e.told, 'earlier trial')} before it proposed{prior}.", ""]
    if e.left_out:
        lines += ["Not in the ensemble though ranked above its last candidate: "
                  + "; ".join(f"{tid} ({why})" for tid, why in e.left_out.items()) + ".", ""]
    return lines


def _console_table(s: SearchSummary) -> str:
    head = f"{'rank':>4}  {'trial':<14} {'status':<13} {'examples':>8}  {'val':>7} {'sst':>6} " \
           f"{'qqp':>6} {'sts':>6}  {'dev':>7}  params"
    lines = [head, "-" * len(head)]
    for i, t in enumerate(s.top_trials, 1):
        params = " ".join(f"{k}={_fmt(v)}" for k, v in t.searched.items())
        dev = f"{t.dev['dev/overall']:.4f}" if "dev/overall" in t.dev else "      -"
        overall, sst, qqp, sts = _scores(t.val)
        lines.append(f"{i:>4}  {_marked(t.trial_id, t.origin):<14} {t.status:<13} "
                     f"{t.examples_seen:>8}  "
                     f"{overall:.4f} {sst:6.3f} {qqp:6.3f} {sts:6.3f}  {dev:>7}  {params}")
    ens = s.ensemble
    if ens:
        overall, sst, qqp, sts = _scores(ens.val)
        lines.append(f"{'ens':>4}  {ens.method + ' x' + str(len(ens.members)):<14} "
                     f"{'':<13} {'':>8}  {overall:.4f} {sst:6.3f} {qqp:6.3f} {sts:6.3f}  "
                     f"{ens.dev.get('dev/overall', NAN):.4f}  members={','.join(ens.members)}")
    c = s.counts
    tail = f", {c.interrupted} interrupted before the end" if c.interrupted else ""
    if c.not_started:
        tail += f", {c.not_started} never started"
    if c.restored:
        tail += f", {c.restored} restored after a worker failure"
    lines.append(f"trials: {c.trials} ({c.completed} completed, {c.stopped_early} "
                 f"stopped early by ASHA, {c.errored} errored{tail})")
    origins = sorted({t.origin for t in s.top_trials if t.origin})
    if origins:
        lines.append(f"* trained in an earlier search ({', '.join(origins)}), extended "
                     "with --extend: not trained again")
    elif s.extends and s.extends.prior_trials:
        lines.append(f"--extend {s.extends.experiment}: {s.extends.prior_trials} earlier "
                     "trials told to the searcher as prior only, not ranked here")
    return "\n".join(lines)
