"""What a training checkpoint holds: taken from a run's stateful parts while training goes
on, and put back into them on resume.

The folder, its files and their errors are :mod:`mtbert.run.training_state`'s; this module
decides what goes in and the order of a resume: the model's weights, then the optimizer,
the LR schedule (with this run's configured rates, so that a resume may change ``lr``),
the loss weighting and the SMART regulariser -- a mismatch there is the config's fault
(:func:`~mtbert.run.training_state.state_mismatch` names the settings that differ) -- then
the batchers, counters and RNG states, whose failure means a damaged file, then the
history of evaluations.

A checkpoint is taken in two halves (:meth:`CheckpointFolder.snapshot`): the state is
copied to host buffers at once, on the training thread, and the job returned writes the
folder later, on the checkpoint thread (:class:`~mtbert.run.training_state.CheckpointWriter`).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from mtbert.core.atomic import atomic_write_json
from mtbert.core.config import TrainConfig
from mtbert.core.errors import DataError, first_line
from mtbert.core.trial_streams import trial_generator
from mtbert.techniques.lr_schedules import take_configured_lrs
from mtbert.run.training_state import (HEADS_FILE, STATE_EXPECTED, STATE_FILE, HostCopy,
                                   encoder_config_json, folder_bytes, read_training_state,
                                   read_weights, state_mismatch, write_checkpoint_folder,
                                   write_weights)

ReportFn = Callable[[dict, str | None], None]  # metrics, checkpoint folder (None: none)

#: the trainer's counters a resume takes back (everything else it rebuilds from them)
COUNTERS = ("epoch", "step_in_epoch", "examples_seen", "optimizer_steps", "next_eval",
            "evaluations")
#: what a failure to load a part's state is called in the error (the model's is "model")
PART_NAMES = {"optimizer": "optimizer", "lr_scheduler": "LR scheduler",
              "loss_combiner": "loss weighting", "regulariser": "SMART regulariser"}


@dataclass
class TrainingParts:
    """The stateful parts of a run that its checkpoint holds besides the counters."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    lr_scheduler: Any
    loss_combiner: torch.nn.Module
    regulariser: Any | None
    batchers: dict[str, Any]
    #: the train losses since the last evaluation, ``{"sums": {task: float}, "counts":
    #: {task: int}}`` (zero at an evaluation; a run paused between evaluations goes on with
    #: them); restored in place
    running_losses: dict[str, dict] | None = None
    #: the trial's random stream (:mod:`mtbert.core.trial_streams`); restored in place
    generator: torch.Generator | None = None

    def state(self) -> dict[str, Any]:
        """Their states (the weights apart), as ``state.pt`` holds them."""
        holders = {part: getattr(self, part) for part in PART_NAMES}  # no regulariser: None
        state = {**{part: holder.state_dict() if holder is not None else {}
                    for part, holder in holders.items()},
                 "batchers": {t: b.state_dict() for t, b in self.batchers.items()}}
        if self.running_losses is not None:
            state["running_losses"] = self.running_losses
        return state


@dataclass
class CheckpointContents:
    """The rest of what one checkpoint holds, as the training thread has it."""
    counters: dict[str, int]
    config_yaml: str
    history: list[dict]                                  # scalar metrics per evaluation
    write_val_predictions: Callable[[Path], None] | None  # into the given folder


class CheckpointFolder:
    """``out_dir/checkpoint``: snapshots of a run taken on the training thread, each
    written by the job it returns, and the figures of what was written (``stats``)."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.stats = {"checkpoints_written": 0, "checkpoint_bytes": 0,
                      "checkpoint_write_s": 0.0, "report_s": 0.0}
        self._host_copy: HostCopy | None = None  # its buffers, made by the first snapshot
        self._encoder_config = ""

    def snapshot(self, parts: TrainingParts, contents: CheckpointContents,
                 metrics: dict | None) -> Callable[[], Path]:
        """Copy the training state to host buffers now (:class:`HostCopy`); the returned
        function writes it, with ``contents`` and ``metrics``, to ``out_dir/checkpoint``
        (atomically) and may run on another thread while training goes on."""
        if self._host_copy is None:
            self._host_copy = HostCopy()
            self._encoder_config = encoder_config_json(parts.model.encoder)
        snapshot = self._host_copy.copy({"weights": parts.model.state_dict(), "state": {
            **parts.state(), "counters": dict(contents.counters),
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            **({"trial_rng": parts.generator.get_state()} if parts.generator is not None
               else {}),
        }})
        host_copy, encoder_config = self._host_copy, self._encoder_config
        self.out_dir.mkdir(parents=True, exist_ok=True)

        def fill(tmp: Path) -> None:
            host_copy.ready()
            write_weights(tmp, snapshot["weights"], encoder_config)
            torch.save(snapshot["state"], tmp / STATE_FILE)
            (tmp / "config.yaml").write_text(contents.config_yaml, encoding="utf-8")
            atomic_write_json(tmp / "metrics.json", metrics or {})
            atomic_write_json(tmp / "history.json", contents.history)
            if contents.write_val_predictions is not None:
                contents.write_val_predictions(tmp / "predictions")

        def write() -> Path:
            started = time.perf_counter()
            final = write_checkpoint_folder(self.out_dir / "checkpoint", fill)
            self.stats["checkpoints_written"] += 1
            self.stats["checkpoint_bytes"] += folder_bytes(final)
            self.stats["checkpoint_write_s"] += time.perf_counter() - started
            return final
        return write

    def write_and_report(self, write: Callable[[], Path] | None, metrics: dict,
                         report: ReportFn | None) -> None:
        """A checkpoint job (on the writer thread): write the checkpoint (``write``, a
        :meth:`snapshot`'s job; None: none), then report it with the figures so far
        (bytes, seconds writing and reporting)."""
        checkpoint_dir = write() if write is not None else None
        if report is not None:
            started = time.perf_counter()
            report({**metrics, "checkpoints_written": self.stats["checkpoints_written"],
                    "checkpoint_bytes": self.stats["checkpoint_bytes"],
                    "time/checkpoint_write_s": self.stats["checkpoint_write_s"],
                    "time/report_s": self.stats["report_s"]},
                   None if checkpoint_dir is None else str(checkpoint_dir))
            self.stats["report_s"] += time.perf_counter() - started


def evaluation_writes_checkpoint(checkpoints: bool, reporting: bool, examples_seen: int) -> bool:
    """Whether an evaluation writes a checkpoint: only where it is read -- by the report
    callback (Ray persists it and resumes from it) or by a later resume of the run's folder
    (``checkpoints``: ``--resume``).  Not the 0-example evaluation's for a report callback:
    nothing resumes from or ranks an untrained model, and each checkpoint Ray keeps and
    later deletes is one more that a search restored after a driver crash can find gone."""
    return (checkpoints or reporting) and not (reporting and examples_seen == 0)


def restore_checkpoint(checkpoint_dir: Path, parts: TrainingParts, cfg: TrainConfig,
                       device: torch.device, configured_lrs: list[float]
                       ) -> tuple[dict[str, int], list[dict] | None]:
    """Put a checkpoint's state back into ``parts`` and torch's RNGs, in the order the
    module docstring gives; returns its counters and its history (None where it has
    none).  A part that does not fit is a ConfigError naming the settings that differ (a
    DataError when none do); a damaged file is a DataError naming it."""
    state_file = checkpoint_dir / STATE_FILE
    state = read_training_state(state_file, device)
    weights = read_weights(checkpoint_dir, device)
    part = "model"
    try:
        parts.model.load_state_dict(weights)
        for part in PART_NAMES:
            holder = getattr(parts, part)
            if part == "regulariser" and (holder is None or not state[part]):
                continue
            holder.load_state_dict(state[part])
            if part == "lr_scheduler":
                take_configured_lrs(holder, configured_lrs)
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
        held_in = HEADS_FILE if part == "model" else STATE_FILE
        raise state_mismatch(checkpoint_dir, cfg, PART_NAMES.get(part, part), exc,
                             checkpoint_dir / held_in) from None
    try:
        for t, batcher in parts.batchers.items():
            batcher.load_state_dict(state["batchers"][t])
        counters = {key: int(value) for key, value in state["counters"].items()}
        if parts.running_losses is not None and "running_losses" in state:  # (older: none)
            parts.running_losses.update({k: dict(v) for k, v in
                                         state["running_losses"].items()})
        torch.set_rng_state(state["torch_rng"].cpu())
        if state["cuda_rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda_rng"]])
        if parts.generator is not None:  # (older checkpoints: the global state was it)
            parts.generator.set_state(state["trial_rng"].cpu() if "trial_rng" in state
                                      else trial_generator(parts.generator.device).get_state())
    except (RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise DataError(f"{state_file}: damaged training state ({first_line(exc)}); "
                        f"{STATE_EXPECTED}", path=str(state_file)) from None
    return counters, read_history(checkpoint_dir / "history.json")


def read_history(history_file: Path) -> list[dict] | None:
    """A checkpoint's ``history.json`` (None where there is none); unreadable or not a list
    of evaluations is a DataError naming the file."""
    if not history_file.is_file():
        return None
    try:
        history = json.loads(history_file.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError
        raise DataError(f"{history_file}: unreadable ({first_line(exc)}); expected the "
                        "JSON list of evaluations", path=str(history_file)) from None
    if not isinstance(history, list) or not all(isinstance(h, dict) for h in history):
        raise DataError(f"{history_file}: expected a JSON list of evaluations, got "
                        f"{type(history).__name__}", path=str(history_file))
    return history
