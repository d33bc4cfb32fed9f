"""Pre-training stages run before multitask fine-tuning (``pretrain`` in the config).

* ``simcse`` — unsupervised SimCSE (Gao et al. 2021; report 001 eq. 5, report 003
  eq. 1): every distinct sentence of the three training splits is encoded twice with
  independent dropout masks; the two views are the positive pair, the other sentences
  of the batch the negatives:
  ``ℓ_i = −log exp(sim(z_i, z'_i)/τ) / Σ_j exp(sim(z_i, z'_j)/τ)``, sim = cosine,
  τ = ``simcse_temp``.
* ``simcse_sup`` — the same loss with z_i = sentence a and z'_i = sentence b of the QQP
  duplicate pairs (label 1); the other pairs' b sentences are the negatives.
* ``qqp`` — further pre-training on QQP alone (report 004 §4.2): the QQP task loss,
  training the encoder and the QQP head (``pair_shared``, ``qqp_out``), which then
  carry over into multitask fine-tuning.

Sentence vectors are pooled as the model pools (``MultitaskModel._hidden`` /
``_pool``: mean or [CLS]); the token ids come from ``data`` (never re-tokenised).
``pretrain_examples`` sentences (simcse), pairs (simcse_sup) or QQP rows (qqp) are
seen, in batches of ``pretrain_batch_size``, with AdamW at constant ``pretrain_lr``
(no weight decay) and gradient clipping at norm 1. Data order comes from
``numpy.random.default_rng([seed, stage])`` and dropout from a torch generator seeded
with ``seed`` inside ``torch.random.fork_rng`` (a trial's model, whose masks are a hash of
its mask stream's seed: that seed drawn from it each step), so the stage leaves torch's
global RNG untouched: a run that loads the stage from the cache continues exactly like the run
that computed it.

Cache. The trained modules' states are stored in
``<cache_dir>/pretrain/<stage>-<key>.pt`` where the key hashes everything that changes
the result: the stage, the model name and a fingerprint of the initial weights of the
trained modules, the pre-training fields, ``simcse_temp`` (SimCSE stages), seed,
max_length, dropout, pooling, pair encoding and shared layer (qqp), the device type,
and the token ids, labels and row ids of the training rows the stage reads (so the
file contents, the validation split and ``max_train_per_task`` are all covered).
The file is written to a temp file and ``os.replace``d under an exclusive
``fcntl.flock`` on ``<stage>-<key>.lock``; a process that finds no file takes the lock,
looks again (another trial may just have written it) and only then computes, so
trials racing for the same stage compute it once and never see a partial file.
Files load with ``torch.load(weights_only=True)``; an unreadable one is recomputed.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from mtbert.core.atomic import atomic_write
from mtbert.core.config import TrainConfig, default_cache_dir
from mtbert.core.devices import uses_bf16
from mtbert.data import MultitaskData, collate, encoding_for, pad_rows
from mtbert.model.dropout_rate import mask_stream_of
from mtbert.techniques.losses import task_loss
from mtbert.techniques.trial_update import TrialUpdate
from mtbert.core.tasks import TASK_NAMES

CACHE_VERSION = "1"
STAGES = ("simcse", "simcse_sup", "qqp")
_STAGE_CODE = {"simcse": 1, "simcse_sup": 2, "qqp": 3}


@dataclass
class PretrainResult:
    """What :func:`run_pretraining` did: ``hit`` = loaded from the cache."""
    stage: str
    key: str
    path: Path
    hit: bool
    losses: list[float] = field(default_factory=list)  # one per step (empty on a hit)
    examples: int = 0                                   # examples seen (0 on a hit)
    seconds: float = 0.0


# ---------------------------------------------------------------------- the loss
def simcse_loss(z1: torch.Tensor, z2: torch.Tensor, temp: float) -> torch.Tensor:
    """Mean over i of −log softmax_j(cos(z1_i, z2_j)/τ)[i] (in-batch negatives)."""
    z1 = F.normalize(z1.float(), dim=-1)
    z2 = F.normalize(z2.float(), dim=-1)
    sim = z1 @ z2.T / temp
    return F.cross_entropy(sim, torch.arange(len(z1), device=z1.device))


def sentence_vectors(model: nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The pooled sentence vector the model uses (mean or [CLS], ``model.pooling``)."""
    return model._pool(model._hidden(ids, mask, None, None), mask)


# ---------------------------------------------------------------------- stage data
def simcse_sentences(data: MultitaskData) -> list[np.ndarray]:
    """Every distinct sentence (token row [CLS] .. [SEP]) of the three training splits."""
    seen: set[bytes] = set()
    out = []
    for task in TASK_NAMES:
        tokens = data.splits[task]["train"].tokens
        for column in (tokens.a, tokens.b):
            if column is None:
                continue
            for i in range(len(column)):
                row = column[i]
                key = row.tobytes()
                if key not in seen:
                    seen.add(key)
                    out.append(row)
    return out


def duplicate_pairs(data: MultitaskData) -> np.ndarray:
    """Row indices of QQP training pairs labelled duplicate."""
    split = data.splits["qqp"]["train"]
    return np.flatnonzero(np.asarray(split.labels) == 1)


def _index_stream(n: int, batch_size: int, total: int, rng: np.random.Generator):
    """Batches of row indices: seeded permutations, cycled until ``total`` rows are seen;
    a final batch smaller than 2 (no negative) is dropped."""
    seen = 0
    while seen < total:
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            take = min(batch_size, total - seen)
            batch = order[start:start + take]
            if len(batch) < 2 and seen > 0:
                return
            yield batch
            seen += len(batch)
            if seen >= total:
                return


# ---------------------------------------------------------------------- cache key
def _hash_array(h, array: np.ndarray | None) -> None:
    if array is None:
        h.update(b"none")
        return
    array = np.ascontiguousarray(array)
    h.update(f"{array.dtype.str}{array.shape}".encode())
    h.update(array.tobytes())


def _split_fingerprint(h, split) -> None:
    for name, column in sorted(split.tokens.columns().items()):
        h.update(name.encode())
        _hash_array(h, column.values)
        _hash_array(h, column.offsets)
    _hash_array(h, None if split.labels is None else np.asarray(split.labels))
    h.update("\x1f".join(split.ids).encode())


def data_fingerprint(stage: str, data: MultitaskData) -> str:
    """Hash of the token ids, labels and row ids of the training rows ``stage`` reads."""
    h = hashlib.sha256()
    tasks = TASK_NAMES if stage == "simcse" else ("qqp",)
    for task in tasks:
        h.update(task.encode())
        _split_fingerprint(h, data.splits[task]["train"])
    h.update(str(data.pad_id).encode())
    return h.hexdigest()


def weights_fingerprint(modules: dict[str, nn.Module]) -> str:
    """Hash of the initial state of the modules the stage trains."""
    h = hashlib.sha256()
    for name, module in modules.items():
        for key, tensor in module.state_dict().items():
            t = tensor.detach().cpu().contiguous()
            h.update(f"{name}.{key}|{t.dtype}|{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def stage_modules(cfg: TrainConfig, model: nn.Module) -> dict[str, nn.Module]:
    """The parts of the model the stage trains (and the cache stores)."""
    if cfg.pretrain == "qqp":
        return {"encoder": model.encoder, "pair_shared": model.pair_shared,
                "qqp_out": model.qqp_out}
    return {"encoder": model.encoder}


def cache_key(cfg: TrainConfig, data: MultitaskData, modules: dict[str, nn.Module],
              device: torch.device) -> str:
    stage = cfg.pretrain
    fields = {
        "version": CACHE_VERSION, "stage": stage, "model": cfg.model,
        "weights": weights_fingerprint(modules), "data": data_fingerprint(stage, data),
        "pretrain_examples": cfg.pretrain_examples, "pretrain_lr": cfg.pretrain_lr,
        "pretrain_batch_size": cfg.pretrain_batch_size, "seed": cfg.seed,
        "max_length": cfg.max_length, "dropout": cfg.dropout, "pooling": cfg.pooling,
        "device": torch.device(device).type,
        "bf16": uses_bf16(cfg.precision, torch.device(device)),
    }
    if any(mask_stream_of(module) is not None for module in modules.values()):
        fields["dropout_kernel"] = "hashed"  # a trial's masks (trial_streams)
    if stage in ("simcse", "simcse_sup"):
        fields["simcse_temp"] = cfg.simcse_temp
    if stage == "qqp":
        fields.update(pair_encoding=cfg.pair_encoding, shared_pair_layer=cfg.shared_pair_layer)
    blob = json.dumps(fields, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------- cache I/O
@contextlib.contextmanager
def _locked(lock_path: Path):
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _try_load(path: Path, key: str, modules: dict[str, nn.Module], device, log) -> bool:
    if not path.is_file():
        return False
    try:
        state = torch.load(path, map_location=device, weights_only=True)
        if state.get("key") != key or set(state["modules"]) != set(modules):
            raise ValueError("key or module set mismatch")
    except Exception as exc:  # unreadable or foreign file: recompute and overwrite
        log(f"[mtbert] pretrain cache {path} unreadable ({exc}); recomputing")
        return False
    for name, module in modules.items():
        module.load_state_dict(state["modules"][name])
    return True


def _save_atomic(state: dict, path: Path) -> None:
    atomic_write(path, lambda tmp: torch.save(state, tmp))


# ---------------------------------------------------------------------- training
def _train_stage(cfg: TrainConfig, data: MultitaskData, model: nn.Module,
                 modules: dict[str, nn.Module], device: torch.device,
                 log) -> tuple[list[float], int]:
    stage = cfg.pretrain
    params = [p for m in modules.values() for p in m.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.pretrain_lr, weight_decay=0.0)
    update = TrialUpdate(optimizer, max_norm=1.0)  # clipped at norm 1, no teacher
    rng = np.random.default_rng([cfg.seed, _STAGE_CODE[stage]])
    autocast = uses_bf16(cfg.precision, device)
    bs = cfg.pretrain_batch_size
    losses: list[float] = []

    if stage == "simcse":
        sentences = simcse_sentences(data)
        stream = _index_stream(len(sentences), bs, cfg.pretrain_examples, rng)

        def step_loss(idx):
            ids, mask = pad_rows([sentences[i] for i in idx], data.pad_id)
            ids, mask = ids.to(device), mask.to(device)
            # one forward of the batch twice: each copy gets its own dropout masks
            z = sentence_vectors(model, torch.cat([ids, ids]), torch.cat([mask, mask]))
            z1, z2 = z.chunk(2)
            return simcse_loss(z1, z2, cfg.simcse_temp)
    elif stage == "simcse_sup":
        tokens = data.splits["qqp"]["train"].tokens
        pairs = duplicate_pairs(data)
        if len(pairs) < 2:
            raise ValueError("pretrain=simcse_sup needs at least 2 QQP duplicate pairs")
        stream = _index_stream(len(pairs), bs, cfg.pretrain_examples, rng)

        def step_loss(idx):
            rows = pairs[idx]
            ids, mask = pad_rows([tokens.a[i] for i in rows] + [tokens.b[i] for i in rows],
                             data.pad_id)
            z = sentence_vectors(model, ids.to(device), mask.to(device))
            za, zb = z.chunk(2)
            return simcse_loss(za, zb, cfg.simcse_temp)
    else:  # qqp
        split = data.splits["qqp"]["train"]
        encoding = encoding_for("qqp", cfg.pair_encoding)
        stream = _index_stream(len(split), bs, cfg.pretrain_examples, rng)

        def step_loss(idx):
            batch = {k: v.to(device) for k, v in collate(split, idx, encoding, data.pad_id).items()}
            out = model("qqp", batch)
            return task_loss("qqp", out, batch["labels"], cfg)

    devices = [device] if device.type == "cuda" else []
    was_training = model.training
    last_log = time.perf_counter()
    seen = 0
    masks = mask_stream_of(model)  # a trial's model: its masks' seed drawn each step
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(cfg.seed)
        model.train()
        try:
            for idx in stream:
                if masks is not None:
                    masks.draw({0: torch.default_generator if device.type == "cpu"
                                else torch.cuda.default_generators[device.index or 0]})
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    loss = step_loss(idx)
                update.clear()
                loss.backward()
                update.step()
                losses.append(float(loss.detach()))
                seen += len(idx)
                if time.perf_counter() - last_log > 10:
                    last_log = time.perf_counter()
                    log(f"[mtbert] pretrain {stage}: {seen}/{cfg.pretrain_examples} examples, "
                        f"loss {losses[-1]:.4f}")
        finally:
            model.train(was_training)
            update.clear()
    return losses, seen


def run_pretraining(cfg: TrainConfig, data: MultitaskData, model: nn.Module, device,
                    log=print) -> PretrainResult | None:
    """Run (or load from the cache) the ``cfg.pretrain`` stage, updating ``model`` in place."""
    if cfg.pretrain == "none":
        return None
    if cfg.pretrain not in STAGES:
        raise ValueError(f"unknown pretrain stage {cfg.pretrain!r}")
    device = torch.device(device)
    start = time.perf_counter()
    modules = stage_modules(cfg, model)
    key = cache_key(cfg, data, modules, device)
    folder = default_cache_dir(cfg.cache_dir) / "pretrain"
    path = folder / f"{cfg.pretrain}-{key}.pt"
    if _try_load(path, key, modules, device, log):
        log(f"[mtbert] pretrain {cfg.pretrain}: loaded from cache {path}")
        return PretrainResult(cfg.pretrain, key, path, True, seconds=time.perf_counter() - start)
    with _locked(folder / f"{cfg.pretrain}-{key}.lock"):
        if _try_load(path, key, modules, device, log):  # another process just wrote it
            log(f"[mtbert] pretrain {cfg.pretrain}: loaded from cache {path}")
            return PretrainResult(cfg.pretrain, key, path, True,
                                  seconds=time.perf_counter() - start)
        losses, examples = _train_stage(cfg, data, model, modules, device, log)
        state = {"key": key, "stage": cfg.pretrain,
                 "modules": {name: {k: v.detach().cpu() for k, v in m.state_dict().items()}
                             for name, m in modules.items()},
                 "losses": losses}
        _save_atomic(state, path)
    seconds = time.perf_counter() - start
    first = f"{losses[0]:.4f}" if losses else "-"
    last = f"{losses[-1]:.4f}" if losses else "-"
    log(f"[mtbert] pretrain {cfg.pretrain}: {examples} examples in {len(losses)} steps, "
        f"loss {first} -> {last}, {seconds:.1f}s; cached at {path}")
    return PretrainResult(cfg.pretrain, key, path, False, losses, examples, seconds)
