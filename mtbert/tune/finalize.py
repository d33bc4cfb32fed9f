"""After ``Tuner.fit()``: trial records, the ensemble of the top trials, summary files.

Selection uses only the validation split carved from train; dev metrics are computed
for the finalists (the ensemble members, which include the best trial) and reported,
never used to select.  Each member's *best* checkpoint (by validation overall) is
loaded with :func:`~mtbert.trainer.load_checkpoint_model` and predicts the val, dev and
test splits of the data the driver already loaded; :mod:`mtbert.ensemble` combines
them (``vote``: SST/QQP by mode with ties to the best member, STS by median;
``greedy``: Caruana forward selection with replacement on val, per task).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mtbert.tune.report import TrialRecord
from mtbert.tune.tracking import rung_reached, summarize_error

OBJECTIVE = "val/overall"
SPLITS = ("val", "dev", "test")


def _scalars(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
            and math.isfinite(float(v))}


def trial_id_of(result) -> str:
    tid = (result.metrics or {}).get("trial_id")
    if tid:
        return str(tid)
    name = Path(result.path).name
    return name[len("trial_"):] if name.startswith("trial_") else name


def collect_trials(result_grid, max_examples: int, rungs: list[int],
                   ended: set[str] | None = None) -> list[TrialRecord]:
    """One :class:`TrialRecord` per trial of the ResultGrid (plain data, no Ray objects).

    ``ended``: the trials Tune reported as ended (the driver's tracker records each end);
    a trial short of ``max_examples`` that did not end was interrupted (Ctrl-C), not
    stopped by ASHA. None: every trial short of the budget counts as stopped early."""
    records = []
    for result in result_grid:
        tid = trial_id_of(result)
        history: list[dict[str, float]] = []
        df = result.metrics_dataframe
        if df is not None and len(df) and OBJECTIVE in df.columns:
            keep = [c for c in df.columns if c.startswith(("val/", "train/"))
                    or c in ("examples_seen", "timestamp", "training_iteration")]
            for row in df[keep].to_dict("records"):
                history.append(_scalars(row))
            history = _dedup_history(history)
        best, best_path = {}, None
        for path, metrics in _checkpoints(result):
            score = metrics.get(OBJECTIVE)
            if score is None or not math.isfinite(score):
                continue
            if not best or score > best[OBJECTIVE]:
                best, best_path = _scalars(metrics), path
        seen = int((result.metrics or {}).get("examples_seen", 0))
        # after a driver crash Ray's restored last result can lag its own result log
        seen = max([seen] + [int(h["examples_seen"]) for h in history if "examples_seen" in h])
        if result.error is not None:
            status = "error"
        elif seen < max_examples:
            status = "stopped_early" if ended is None or tid in ended else "interrupted"
        else:
            status = "completed"
        config = {k: v for k, v in (result.config or {}).items()}
        records.append(TrialRecord(
            trial_id=tid, name=Path(result.path).name, status=status, config=config,
            history=history, best=best, best_checkpoint=best_path, examples_seen=seen,
            rung_reached=rung_reached(seen, rungs),
            error=summarize_error(str(result.error)) if result.error is not None else ""))
    return records


def _checkpoints(result) -> list[tuple[str, dict]]:
    """(path, metrics) of the trial's checkpoints that exist: those Ray lists, and any
    other ``checkpoint_*`` folder of the trial (its ``metrics.json``).

    After a driver crash Ray's restored list can lag the trial folder: it may name a
    checkpoint that ``num_to_keep`` has deleted since, and miss newer ones."""
    import pyarrow.fs
    fs = getattr(result, "filesystem", None) or pyarrow.fs.LocalFileSystem()
    out: dict[str, dict] = {}
    for checkpoint, metrics in (result.best_checkpoints or []):
        if fs.get_file_info(checkpoint.path).type != pyarrow.fs.FileType.NotFound:
            out[checkpoint.path] = metrics
    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(result.path))
    except (OSError, FileNotFoundError):
        infos = []
    for info in infos:
        name = info.path.rstrip("/").rsplit("/", 1)[-1]
        if (info.type != pyarrow.fs.FileType.Directory or not name.startswith("checkpoint_")
                or info.path in out):
            continue
        try:
            with fs.open_input_stream(f"{info.path}/metrics.json") as fh:
                out[info.path] = json.loads(fh.read().decode("utf-8"))
        except (OSError, FileNotFoundError, ValueError):
            continue
    return sorted(out.items())


def _dedup_history(history: list[dict[str, float]]) -> list[dict[str, float]]:
    """One evaluation per ``examples_seen`` (the last one): a trial resumed after a driver
    crash from an older checkpoint than its last report redoes those evaluations, and
    Ray's result log keeps both copies."""
    by_seen: dict[float, dict[str, float]] = {}
    for h in history:
        key = h.get("examples_seen", float(len(by_seen)))
        by_seen.pop(key, None)
        by_seen[key] = h
    return list(by_seen.values())


def ranked(records: list[TrialRecord]) -> list[TrialRecord]:
    """Trials with a usable best checkpoint, best validation overall first."""
    ok = [r for r in records if r.best_checkpoint and math.isfinite(r.best_score)]
    return sorted(ok, key=lambda r: (-r.best_score, r.trial_id))


# ---------------------------------------------------------------------- predictions
def predict_member(checkpoint_dir: str, data, device: str = "cpu") -> dict[str, dict[str, np.ndarray]]:
    """{split: {task: raw prediction}} of one best checkpoint on val, dev and test."""
    import torch

    from mtbert.data import encoding_for
    from mtbert.tasks import TASK_NAMES
    from mtbert.trainer import load_checkpoint_model, predict_split

    cfg, model = load_checkpoint_model(checkpoint_dir, device=device)
    dev = torch.device(device)
    out: dict[str, dict[str, np.ndarray]] = {}
    for split_name in SPLITS:
        out[split_name] = {}
        for task in TASK_NAMES:
            split = data.split(task, split_name)
            if split is None:
                continue
            out[split_name][task] = predict_split(
                model, split, encoding_for(task, cfg.pair_encoding), data.pad_id,
                cfg.eval_batch_size, dev, autocast=dev.type == "cuda")
    return out


def score_split(data, split_name: str, labels: dict[str, np.ndarray]) -> dict[str, Any]:
    """Metrics (``{split}/sst_acc`` ... ``{split}/overall``) of label arrays."""
    from mtbert.metrics import split_metrics, task_metrics
    per_task = {t: task_metrics(t, pred, data.split(t, split_name).labels)
                for t, pred in labels.items()}
    return split_metrics(split_name, per_task)


@dataclass
class EnsembleResult:
    method: str
    members: list[str]                       # candidate trial ids, best first
    weights: dict[str, list[int]]            # per task, aligned with members (0 = unused)
    labels: dict[str, dict[str, np.ndarray]]  # split -> task -> ensemble labels
    metrics: dict[str, Any] = field(default_factory=dict)          # val + dev
    best_single: dict[str, Any] = field(default_factory=dict)      # val + dev of member 0

    @property
    def selected(self) -> list[str]:
        """Members with a non-zero weight in at least one task (all of them for vote)."""
        return [m for i, m in enumerate(self.members)
                if any(w[i] > 0 for w in self.weights.values())]

    def weights_by_member(self) -> dict[str, dict[str, int]]:
        return {task: {m: int(c) for m, c in zip(self.members, w) if c}
                for task, w in self.weights.items()}


def build_ensemble(member_ids: list[str], preds: dict[str, dict[str, dict[str, np.ndarray]]],
                   data, method: str = "vote") -> EnsembleResult:
    """Combine members (best first); ``preds[trial_id][split][task]`` = raw predictions."""
    from mtbert.ensemble import combine, greedy_task_selection, task_labels
    from mtbert.tasks import TASK_NAMES

    weights: dict[str, list[int]] = {}
    for task in TASK_NAMES:
        if method == "greedy":
            gold = data.split(task, "val").labels
            sel = greedy_task_selection(task, [preds[m]["val"][task] for m in member_ids], gold)
            weights[task] = sel.counts
        else:
            weights[task] = [1] * len(member_ids)
    labels: dict[str, dict[str, np.ndarray]] = {}
    for split_name in SPLITS:
        labels[split_name] = {}
        for task in TASK_NAMES:
            if task not in preds[member_ids[0]][split_name]:
                continue
            member_preds = [preds[m][split_name][task] for m in member_ids]
            labels[split_name][task] = combine(task, member_preds, weights[task])
    metrics, single = {}, {}
    best = member_ids[0]
    for split_name in ("val", "dev"):
        metrics.update(score_split(data, split_name, labels[split_name]))
        single.update(score_split(data, split_name, {
            t: task_labels(t, p) for t, p in preds[best][split_name].items()}))
    return EnsembleResult(method, list(member_ids), weights, labels, metrics, single)


def write_ensemble_predictions(folder: Path, data, result: EnsembleResult) -> Path:
    """CS 224N CSVs (``{task}-{split}-output.csv``) + Parquet of the ensemble labels.

    QQP holds the voted 0/1 class (also in the Parquet ``probability`` column)."""
    from mtbert.predictions import write_predictions
    folder.mkdir(parents=True, exist_ok=True)
    for split_name, by_task in result.labels.items():
        if by_task:
            write_predictions(folder, split_name, {t: data.split(t, split_name) for t in by_task},
                              {t: np.asarray(v, dtype=np.float64) if t != "sst" else v
                               for t, v in by_task.items()})
    return folder


def write_member_predictions(folder: Path, data, preds: dict[str, dict[str, np.ndarray]]) -> Path:
    from mtbert.predictions import write_predictions
    folder.mkdir(parents=True, exist_ok=True)
    for split_name, by_task in preds.items():
        if by_task:
            write_predictions(folder, split_name, {t: data.split(t, split_name) for t in by_task},
                              by_task)
    return folder


# ---------------------------------------------------------------------- summary
def scalar(metrics: dict[str, Any]) -> dict[str, float]:
    return _scalars(metrics)


def summary_markdown(summary: dict[str, Any]) -> str:
    lines = [f"# Search `{summary['experiment']}`", "",
             f"space `{summary['space']['name']}` ({summary['space']['description']}), "
             f"budget `{summary['budget']['name']}`, search `{summary['search_alg']}` "
             f"(seed {summary['seed']}), objective `{summary['objective']}` (max, validation "
             "split carved from train; dev is reported, never used to select).", "",
             "| trials | completed | stopped early (ASHA) | errored |",
             "| --- | --- | --- | --- |",
             "| {trials} | {completed} | {stopped_early} | {errored} |".format(**summary["counts"]),
             ""]
    lines += ["## Top trials", "", "| rank | trial | status | examples | val overall | sst | qqp | "
              "sts r | params |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for i, t in enumerate(summary["top_trials"], 1):
        b = t["val"]
        params = ", ".join(f"{k}={_fmt(v)}" for k, v in t["searched"].items())
        lines.append(f"| {i} | {t['trial_id']} | {t['status']} | {t['examples_seen']} | "
                     f"{b.get('val/overall', float('nan')):.4f} | {b.get('val/sst_acc', float('nan')):.3f} | "
                     f"{b.get('val/qqp_acc', float('nan')):.3f} | {b.get('val/sts_corr', float('nan')):.3f} | "
                     f"{params} |")
    ens = summary.get("ensemble")
    best = summary.get("best_trial")
    if best:
        lines += ["", "## Best trial vs ensemble", "", "| | val overall | dev overall | dev sst | "
                  "dev qqp | dev sts r |", "| --- | --- | --- | --- | --- | --- |"]
        rows = [(f"best trial {best['trial_id']}", best["val"], best.get("dev", {}))]
        if ens:
            rows.append((f"ensemble ({ens['method']}, {len(ens['members'])} members)",
                         ens["val"], ens["dev"]))
        for label, val, dev in rows:
            lines.append(f"| {label} | {val.get('val/overall', float('nan')):.4f} | "
                         f"{dev.get('dev/overall', float('nan')):.4f} | "
                         f"{dev.get('dev/sst_acc', float('nan')):.3f} | "
                         f"{dev.get('dev/qqp_acc', float('nan')):.3f} | "
                         f"{dev.get('dev/sts_corr', float('nan')):.3f} |")
        lines += ["", f"Best config: `{json.dumps(best['searched'], default=str)}`"]
    if ens:
        lines += ["", f"Ensemble members: {', '.join(ens['members'])}; weights per task "
                  f"{json.dumps(ens['weights'])}; predictions in `{ens['predictions']}`."]
        if ens["method"] == "greedy":
            lines += ["", "Greedy selection was made on the validation split, so the "
                      "ensemble's val score is optimistic: compare on dev."]
    imp = summary.get("importances") or {}
    for name, values in imp.items():
        if values and "_error" not in values:
            lines += ["", f"## Importances ({name})", ""]
            lines += [f"- {k}: {v:.3f}" for k, v in values.items()]
    errors = [t for t in summary["trials"] if t["status"] == "error"]
    if errors:
        lines += ["", "## Errors", ""] + [f"- {t['trial_id']}: {t['error']}" for t in errors]
    lines += ["", "Report: " + ", ".join(f"`{Path(p).name}`" for p in
                                         summary.get("report_files", {}).values()), ""]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def console_table(summary: dict[str, Any]) -> str:
    """The end-of-search table for the terminal."""
    head = f"{'rank':>4}  {'trial':<14} {'status':<13} {'examples':>8}  {'val':>7} {'sst':>6} " \
           f"{'qqp':>6} {'sts':>6}  {'dev':>7}  params"
    lines = [head, "-" * len(head)]
    for i, t in enumerate(summary["top_trials"], 1):
        b, d = t["val"], t.get("dev", {})
        params = " ".join(f"{k}={_fmt(v)}" for k, v in t["searched"].items())
        dev = f"{d['dev/overall']:.4f}" if "dev/overall" in d else "      -"
        lines.append(f"{i:>4}  {t['trial_id']:<14} {t['status']:<13} {t['examples_seen']:>8}  "
                     f"{b.get('val/overall', float('nan')):.4f} {b.get('val/sst_acc', float('nan')):6.3f} "
                     f"{b.get('val/qqp_acc', float('nan')):6.3f} {b.get('val/sts_corr', float('nan')):6.3f}  "
                     f"{dev:>7}  {params}")
    ens = summary.get("ensemble")
    if ens:
        v, d = ens["val"], ens["dev"]
        lines.append(f"{'ens':>4}  {ens['method'] + ' x' + str(len(ens['members'])):<14} "
                     f"{'':<13} {'':>8}  {v.get('val/overall', float('nan')):.4f} "
                     f"{v.get('val/sst_acc', float('nan')):6.3f} {v.get('val/qqp_acc', float('nan')):6.3f} "
                     f"{v.get('val/sts_corr', float('nan')):6.3f}  {d.get('dev/overall', float('nan')):.4f}  "
                     f"members={','.join(ens['members'])}")
    c = summary["counts"]
    interrupted = (f", {c['interrupted']} interrupted before the end"
                   if c.get("interrupted") else "")
    if c.get("not_started"):
        interrupted += f", {c['not_started']} never started"
    lines.append(f"trials: {c['trials']} ({c['completed']} completed, {c['stopped_early']} "
                 f"stopped early by ASHA, {c['errored']} errored{interrupted})")
    return "\n".join(lines)


def record_dict(r: TrialRecord, searched_keys: list[str]) -> dict[str, Any]:
    d = asdict(r)
    d.pop("history")
    d["best_val_overall"] = r.best_score if math.isfinite(r.best_score) else None
    d["searched"] = {k: r.config[k] for k in searched_keys if k in r.config}
    d["evaluations"] = len(r.history)
    return d
