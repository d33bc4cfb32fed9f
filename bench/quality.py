"""Quality of a finished search on the *whole* validation split and dev files, beside the
zero-shot MiniLM baseline and the published reports (docs/bench/quality.md says how each
row is scored).  Writes ``quality.json``, prints the table.
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
SCORES = ("overall", "sst_acc", "qqp_acc", "sts_corr")


def _scores(metrics: dict, split: str) -> dict[str, float]:
    return {k: float(metrics[f"{split}/{k}"]) for k in SCORES}


def load_full_data(base: dict, data_dir: str):
    """The search's data settings (model, max length, split seed) with every eval row."""
    from mtbert.core.config import TrainConfig
    from mtbert.data import load_data
    keep = {k: base[k] for k in ("model", "max_length", "val_fraction", "split_seed",
                                 "bad_row_tolerance") if k in base}
    return load_data(TrainConfig.from_dict({**keep, "data_dir": data_dir, "max_train_per_task": 0,
                                            "max_eval_per_task": 0}, source="quality"))


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
    from mtbert.core.pretrained import load_encoder
    from mtbert.run.metrics import accuracy, overall_score, pearson
    encoder = load_encoder(data.model).eval()
    train_sst = data.split("sst", "train").labels.astype(np.int64)
    majority = int(np.bincount(train_sst, minlength=5).argmax())
    cos_val = _cosines(encoder, data.split("qqp", "val"), data.pad_id)
    cut = best_threshold(cos_val, data.split("qqp", "val").labels)
    out: dict[str, dict[str, float]] = {}
    for name in ("val", "dev"):
        sst, qqp, sts = data.split("sst", name), data.split("qqp", name), data.split("sts", name)
        cos_qqp = cos_val if name == "val" else _cosines(encoder, qqp, data.pad_id)
        scores = {"sst_acc": accuracy(np.full(len(sst.labels), majority), sst.labels),
                  "qqp_acc": accuracy((cos_qqp > cut).astype(np.int64), qqp.labels),
                  "sts_corr": pearson(_cosines(encoder, sts, data.pad_id), sts.labels)}
        out[name] = {"overall": overall_score(*scores.values()), **scores}
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
    lines = ["| | val overall | val SST | val QQP | val STS r | dev overall | dev SST | dev QQP "
             "| dev STS r |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, val, dev in rows:
        cells = ["–" if part is None else f"{part[k]:.3f}" for part in (val, dev) for k in SCORES]
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

    from mtbert.core.atomic import atomic_write_json
    from mtbert.core.config import TrainConfig
    from mtbert.core.errors import MtbertError
    from mtbert.core.tasks import TASK_NAMES
    torch.set_num_threads(args.threads)
    exp_dir = Path(args.experiment_dir) if args.experiment_dir else None
    if exp_dir is not None and not (exp_dir / "summary.json").is_file():
        print(f"error: {exp_dir}: no summary.json (not a finished search)", file=sys.stderr)
        return 2
    settings = exp_dir / "mtbert_search.json" if exp_dir is not None else None
    base = (json.loads(settings.read_text(encoding="utf-8")).get("base", {})
            if settings is not None and settings.is_file() else {}) or TrainConfig().__dict__
    try:
        data = load_full_data(base, args.data_dir)
    except MtbertError as exc:  # bad data folder or model: one line, exit 2, nothing written
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sizes = {t: {s: len(data.split(t, s)) for s in ("train", "val", "dev")} for t in TASK_NAMES}
    print(f"[quality] rows: {sizes}", flush=True)
    t0 = time.perf_counter()
    result: dict = {"rows": sizes, "zero_shot": zero_shot(data), "report_004_dev": REPORT_004_DEV}
    print(f"[quality] zero-shot baseline in {time.perf_counter() - t0:.0f} s", flush=True)
    zs = result["zero_shot"]
    rows = [("zero-shot MiniLM (SST: majority class)", zs["val"], zs["dev"])]
    if exp_dir is not None:
        s = result["search"] = rescore_search(exp_dir, data)
        rows.append((f"best trial `{s['best_trial']}`", s["best"]["val"], s["best"]["dev"]))
        rows += [(f"ensemble: {method} over the top {len(s['candidates'])} "
                  f"({len(e['members'])} used)", e["val"], e["dev"])
                 for method, e in s["ensembles"].items()]
    rows.append(("report 004 (BERT-base, GPU, full QQP)", None, REPORT_004_DEV))
    out = Path(args.out)
    atomic_write_json(out / "quality.json", result)
    print(table(rows))
    print(f"[quality] wrote {out / 'quality.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
