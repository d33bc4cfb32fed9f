"""Quality of a finished search on the *whole* validation split and dev files, beside the
zero-shot MiniLM baseline and the published reports.

    python -m bench.quality --experiment-dir ray_results/EXPERIMENT [--data-dir ../shared/data]
        [--threads 2] [--out bench_results/quality]
    python -m bench.quality --baseline-only            # the zero-shot rows alone

A search scores its trials on the budget's slices (``medium``: 1,000 rows per task); this
re-scores the best trial's and the ensemble members' best checkpoints on every row of the
validation split (10 % of train, the selection split) and of the dev files (SST 1,101,
QQP 20,212 valid rows, STS 863), and rebuilds the ensemble the search chose (same
members, same method) from those predictions.

Zero-shot baseline (no fine-tuning; the packaged MiniLM, mean-pooled sentence
embeddings): STS = cosine of the two sentences (Pearson r is invariant to scaling it to
0..5); QQP = cosine above a threshold, the one threshold fitted for accuracy on the
validation split; SST = the majority class of the training rows (a sentence embedding
without a classifier has no SST prediction: this row is the floor, not a model).

Reports (``../shared/reports``, BERT-base fine-tuned on GPU on the full data, dev
files): report 004's best, the target figure.  Writes ``quality.json`` and
prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import RESULTS, add_data_arguments


# report 004 (../shared/reports), dev files, BERT-base on GPU, full QQP training split
REPORT_004_DEV = {"sst_acc": 0.545, "qqp_acc": 0.908, "sts_corr": 0.894, "overall": 0.800}


def _scores(metrics: dict, split: str) -> dict[str, float]:
    return {k: float(metrics[f"{split}/{k}"]) for k in ("sst_acc", "qqp_acc", "sts_corr", "overall")}


def load_full_data(base: dict, data_dir: str):
    """The search's data settings (model, max length, split seed) with every eval row."""
    from mtbert.core.config import TrainConfig
    from mtbert.data import load_data
    keep = {k: base[k] for k in ("model", "max_length", "val_fraction", "split_seed",
                                 "bad_row_tolerance") if k in base}
    cfg = TrainConfig.from_dict({**keep, "data_dir": data_dir, "max_train_per_task": 0,
                                 "max_eval_per_task": 0}, source="quality")
    return load_data(cfg)


# ---------------------------------------------------------------------- zero-shot baseline
def _cosines(encoder, split, pad_id: int, batch_size: int = 128) -> np.ndarray:
    """Cosine of the mean-pooled embeddings of each row's two sentences, in row order
    (the trainer's own length-ordered siamese batches)."""
    import torch

    from mtbert.data import collate, eval_batches

    def pooled(ids, mask):
        hidden = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * m).sum(1) / m.sum(1).clamp(min=1)

    out = np.zeros(len(split), dtype=np.float64)
    with torch.inference_mode():
        for idx in eval_batches(split, batch_size, "siamese"):
            b = collate(split, idx, "siamese", pad_id)
            a = pooled(b["input_ids_a"], b["attention_mask_a"])
            c = pooled(b["input_ids_b"], b["attention_mask_b"])
            out[idx] = torch.nn.functional.cosine_similarity(a, c, dim=-1).numpy()
    return out


def best_threshold(scores: np.ndarray, gold: np.ndarray) -> float:
    """The cut that maximises accuracy of ``scores > cut`` (midpoints between sorted scores)."""
    s = np.sort(scores)
    cuts = np.concatenate([[s[0] - 1], (s[1:] + s[:-1]) / 2, [s[-1] + 1]])
    acc = [((scores > c) == (gold > 0.5)).mean() for c in cuts]
    return float(cuts[int(np.argmax(acc))])


def zero_shot(data) -> dict[str, dict[str, float]]:
    from mtbert.run.metrics import accuracy, overall_score, pearson
    from mtbert.core.pretrained import load_encoder
    encoder = load_encoder(data.model).eval()
    train_sst = data.split("sst", "train").labels.astype(np.int64)
    majority = int(np.bincount(train_sst, minlength=5).argmax())
    cos_val = _cosines(encoder, data.split("qqp", "val"), data.pad_id)
    cut = best_threshold(cos_val, data.split("qqp", "val").labels)
    out: dict[str, dict[str, float]] = {}
    for name in ("val", "dev"):
        sst = data.split("sst", name).labels
        qqp = data.split("qqp", name)
        sts = data.split("sts", name)
        cos_qqp = cos_val if name == "val" else _cosines(encoder, qqp, data.pad_id)
        scores = {"sst_acc": accuracy(np.full(len(sst), majority), sst),
                  "qqp_acc": accuracy((cos_qqp > cut).astype(np.int64), qqp.labels),
                  "sts_corr": pearson(_cosines(encoder, sts, data.pad_id), sts.labels)}
        scores["overall"] = overall_score(scores["sst_acc"], scores["qqp_acc"], scores["sts_corr"])
        out[name] = scores
    out["settings"] = {"sst_majority_class": majority, "qqp_cosine_threshold": cut}
    return out


# ---------------------------------------------------------------------- the search
def rescore_search(exp_dir: Path, data) -> dict:
    """Best trial and ensemble of the search in ``exp_dir`` on every val/dev row."""
    from mtbert.run.metrics import scalar_metrics
    from mtbert.run.model_files import HEADS_FILE
    from mtbert.tune.results import finalists
    summary = json.loads((exp_dir / "summary.json").read_text(encoding="utf-8"))
    # a finished search keeps (--keep-checkpoints best, the default) only the exported
    # weights of its best trial and ensemble members in models/ID: a checkpoint's weight
    # files without the training state
    kept = summary.get("models") or {}
    checkpoints = {t["trial_id"]: kept.get(t["trial_id"]) or t.get("best_checkpoint")
                   for t in summary["trials"]}
    ens = summary.get("ensemble") or {}
    candidates = ens.get("candidates") or [summary["best_trial"]["trial_id"]]
    # candidates the ensemble did not select have no weights left after a pruned search
    members = [tid for tid in candidates
               if checkpoints.get(tid) and (Path(checkpoints[tid]) / HEADS_FILE).is_file()]
    if len(members) < len(candidates):
        print(f"[quality] weights gone (not kept by the search) for "
              f"{sorted(set(candidates) - set(members))}: both ensembles are rebuilt from "
              f"{members}", flush=True)
    preds = {}
    for tid in members:
        t0 = time.perf_counter()
        preds[tid] = finalists.predict_member(checkpoints[tid], data)
        print(f"[quality] {tid}: predicted val/dev/test in {time.perf_counter() - t0:.0f} s",
              flush=True)
    best_id = summary["best_trial"]["trial_id"]
    assert members[0] == best_id, (members, best_id)  # candidates come best first
    # both combination rules on the same candidates (greedy selects on this full
    # validation split, so its val figures are optimistic; dev is not)
    ensembles, best = {}, {}
    for method in ("vote", "greedy"):
        e = finalists.build_ensemble(members, preds, data, method)
        best = scalar_metrics(e.best_single, finite=True)  # member 0 alone: the best trial
        metrics = scalar_metrics(e.metrics, finite=True)
        ensembles[method] = {"members": e.selected, "weights": e.weights_by_member(),
                             **{s: _scores(metrics, s) for s in ("val", "dev")}}
    return {"experiment": summary["experiment"], "budget": summary["budget"]["name"],
            "best_trial": best_id, "best_searched": summary["best_trial"]["searched"],
            "search_slices": {"val": summary["best_trial"]["val"],
                              "dev": summary["best_trial"]["dev"],
                              "ensemble_val": ens.get("val"), "ensemble_dev": ens.get("dev")},
            "search_ensemble_method": ens.get("method", "vote"), "candidates": members,
            "best": {s: _scores(best, s) for s in ("val", "dev")}, "ensembles": ensembles}


def table(rows: list[tuple[str, dict | None, dict | None]]) -> str:
    head = ("| | val overall | val SST | val QQP | val STS r | dev overall | dev SST | dev QQP "
            "| dev STS r |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for name, val, dev in rows:
        cells = []
        for part in (val, dev):
            for k in ("overall", "sst_acc", "qqp_acc", "sts_corr"):
                cells.append("–" if part is None else f"{part[k]:.3f}")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--experiment-dir", help="a finished search's folder (with summary.json)")
    p.add_argument("--baseline-only", action="store_true", help="only the zero-shot rows")
    add_data_arguments(p, model=False)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(RESULTS / "quality"))
    args = p.parse_args(argv)
    if not args.baseline_only and not args.experiment_dir:
        p.error("--experiment-dir is required (or --baseline-only)")
    import torch
    torch.set_num_threads(args.threads)
    base: dict = {}
    exp_dir = Path(args.experiment_dir) if args.experiment_dir else None
    if exp_dir is not None:
        if not (exp_dir / "summary.json").is_file():
            print(f"error: {exp_dir}: no summary.json (not a finished search)", file=sys.stderr)
            return 2
        settings = json.loads((exp_dir / "mtbert_search.json").read_text(encoding="utf-8")) \
            if (exp_dir / "mtbert_search.json").is_file() else {}
        base = settings.get("base", {})
    if not base:
        from mtbert.core.config import TrainConfig
        base = TrainConfig().__dict__
    from mtbert.core.errors import MtbertError
    from mtbert.core.tasks import TASK_NAMES
    try:
        data = load_full_data(base, args.data_dir)
    except MtbertError as exc:  # bad data folder or model: one line, exit 2, nothing written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = {t: {s: len(data.split(t, s)) for s in ("train", "val", "dev")}
             for t in TASK_NAMES}
    print(f"[quality] rows: {sizes}", flush=True)
    t0 = time.perf_counter()
    result: dict = {"rows": sizes, "zero_shot": zero_shot(data), "report_004_dev": REPORT_004_DEV}
    print(f"[quality] zero-shot baseline in {time.perf_counter() - t0:.0f} s", flush=True)
    if exp_dir is not None:
        result["search"] = rescore_search(exp_dir, data)
    from mtbert.core.atomic import atomic_write_json
    out = Path(args.out)
    atomic_write_json(out / "quality.json", result)
    zs = result["zero_shot"]
    rows = [("zero-shot MiniLM (SST: majority class)", zs["val"], zs["dev"])]
    if "search" in result:
        s = result["search"]
        rows.append((f"best trial `{s['best_trial']}`", s["best"]["val"], s["best"]["dev"]))
        for method, e in s["ensembles"].items():
            rows.append((f"ensemble: {method} over the top {len(s['candidates'])} "
                         f"({len(e['members'])} used)", e["val"], e["dev"]))
    rows.append(("report 004 (BERT-base, GPU, full QQP)", None, REPORT_004_DEV))
    print(table(rows))
    print(f"[quality] wrote {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
