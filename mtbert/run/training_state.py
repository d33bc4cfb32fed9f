"""The files of a training checkpoint, and writing them off the training thread.

    CHECKPOINT/encoder/config.json        the encoder's transformers config
    CHECKPOINT/encoder/model.safetensors  the encoder's weights (``AutoModel.from_pretrained``)
    CHECKPOINT/heads.safetensors          the other weights: task heads, pair layer, cosine maps
    CHECKPOINT/state.pt                   the rest of what an exact resume needs: AdamW's
                                          moments and steps, the LR scheduler, the loss
                                          weighting, the SMART teacher, batchers, counters,
                                          RNG states (``torch.load(weights_only=True)``)
    CHECKPOINT/config.yaml, metrics.json, history.json, predictions/   (small)

The weights are the layout of an exported model (:mod:`mtbert.run.model_files`) without the
tokenizer, so keeping a checkpoint's weights is a file copy.  Each tensor is stored once:
state-dict entries that are the same tensor (tied weights) are written once and named
in the file's metadata (``mtbert_aliases``).  Nothing the trainer rebuilds is stored (data
order, schedule plan: pure functions of the seed and the counters); the SMART teacher
is an EMA of the weights (θ̃ ← β θ̃ + (1 − β) θ, :mod:`mtbert.techniques.smart`), a function of the
whole trajectory, so it is kept.

:class:`HostCopy` snapshots the tensors into host buffers reused from one checkpoint to
the next (pinned, copied without blocking on CUDA); :class:`CheckpointWriter` runs the
write (and the report that hands the checkpoint on) on a background thread while
training goes on, one at a time, in order.  :func:`state_mismatch` is the error for a
checkpoint whose state does not fit the run built from a config.
"""

from __future__ import annotations

import copy
import json
import threading
import time
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch

from mtbert.core.config import RESUME_MAY_CHANGE, TrainConfig, coerce_value, read_yaml_file
from mtbert.core.errors import ConfigError, DataError, MtbertError, first_line

STATE_FILE = "state.pt"
#: the weights layout, shared with an exported model (model_files.py): the encoder as a
#: Hugging Face folder, everything else in one safetensors file
ENCODER_DIR = "encoder"
HEADS_FILE = "heads.safetensors"
ENCODER_WEIGHTS = f"{ENCODER_DIR}/model.safetensors"
ENCODER_CONFIG = f"{ENCODER_DIR}/config.json"
WEIGHT_FILES = (ENCODER_CONFIG, ENCODER_WEIGHTS, HEADS_FILE)
#: the large files of a checkpoint (what ``--keep-checkpoints best|none`` removes)
TRAINING_STATE_FILES = (STATE_FILE, *WEIGHT_FILES)
#: what every state.pt holds (what goes in: mtbert.run.checkpoint)
STATE_KEYS = ("optimizer", "lr_scheduler", "loss_combiner", "regulariser", "batchers",
              "counters", "torch_rng", "cuda_rng")
STATE_EXPECTED = "expected a training state written by python -m mtbert.train"
ALIASES_KEY = "mtbert_aliases"


# ---------------------------------------------------------------------- weights
def encoder_config_json(encoder) -> str:
    """The encoder's ``config.json`` as ``save_pretrained`` writes it (its class named)."""
    config = copy.deepcopy(encoder.config)
    config.architectures = [type(encoder).__name__]
    return config.to_json_string()


def split_weights(model_state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """A MultitaskModel state dict -> (encoder weights under the encoder's own names, the
    rest under the model's names): the two files above."""
    encoder = {k[len("encoder."):]: v for k, v in model_state.items() if k.startswith("encoder.")}
    heads = {k: v for k, v in model_state.items() if not k.startswith("encoder.")}
    return encoder, heads


def save_tensors(path: Path, tensors: dict[str, torch.Tensor]) -> int:
    """safetensors file of ``tensors`` on the CPU, each tensor once (a key whose tensor is
    the same object as an earlier key's is an alias in the metadata); returns its bytes."""
    from safetensors.torch import save_file
    unique: dict[str, torch.Tensor] = {}
    aliases: dict[str, str] = {}
    first_of: dict[int, str] = {}
    for key, tensor in tensors.items():
        source = first_of.setdefault(id(tensor), key)
        if source != key:
            aliases[key] = source
        else:
            unique[key] = tensor.detach().cpu().contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(unique, str(path), metadata={"format": "pt", ALIASES_KEY: json.dumps(aliases)})
    return path.stat().st_size


def load_tensors(path: Path, device: torch.device | str = "cpu",
                 expected: str = STATE_EXPECTED) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file written by :func:`save_tensors` (aliases
    restored as the same tensor); a missing or damaged file is a DataError naming it."""
    from safetensors import safe_open
    if not path.is_file():
        folder = path.parent.parent if path.parent.name == ENCODER_DIR else path.parent
        older = folder / STATE_FILE
        hint = (" (a checkpoint written before the weights were stored apart from state.pt "
                "cannot be read by this version: train again)" if older.is_file() else "")
        raise DataError(f"{path}: missing{hint}; {expected}", path=str(path))
    try:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
            aliases = json.loads((f.metadata() or {}).get(ALIASES_KEY, "{}"))
        for alias, source in aliases.items():
            tensors[alias] = tensors[source]
    except Exception as exc:  # noqa: BLE001 -- SafetensorError, OSError, JSON, KeyError: unusable
        raise DataError(f"{path}: damaged or not a safetensors file ({first_line(exc)}); "
                        f"{expected}", path=str(path)) from None
    return tensors


def write_weights(folder: Path, model_state: dict[str, torch.Tensor], encoder_config: str) -> int:
    """The weight files of ``folder`` (encoder folder and heads); returns their bytes."""
    encoder, heads = split_weights(model_state)
    (folder / ENCODER_DIR).mkdir(parents=True, exist_ok=True)
    (folder / ENCODER_CONFIG).write_text(encoder_config, encoding="utf-8")
    return (len(encoder_config) + save_tensors(folder / ENCODER_WEIGHTS, encoder)
            + save_tensors(folder / HEADS_FILE, heads))


def read_weights(folder: Path, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """The MultitaskModel state dict of a checkpoint (or exported model) folder."""
    encoder = load_tensors(folder / ENCODER_WEIGHTS, device)
    return {**{f"encoder.{k}": v for k, v in encoder.items()},
            **load_tensors(folder / HEADS_FILE, device)}


# ---------------------------------------------------------------------- state.pt
def check_training_state(path: Path) -> None:
    """The cheap part of :func:`read_training_state` (no ``torch.load``): ``path`` is a
    whole torch file -- torch saves a zip archive, so an empty or truncated file (whose
    zip directory, at the end, is gone) is a :class:`DataError` naming it."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise DataError(f"{path}: cannot read it ({exc.strerror})", path=str(path)) from None
    if size == 0:
        raise DataError(f"{path}: empty file; {STATE_EXPECTED}", path=str(path))
    if not zipfile.is_zipfile(path):
        raise DataError(f"{path}: damaged or not a torch file (not a whole zip archive: "
                        f"truncated?); {STATE_EXPECTED}", path=str(path))


def check_checkpoint(folder: Path) -> None:
    """Cheap checks of a checkpoint folder before anything loads: ``state.pt`` is a
    whole torch file and each weight file is there and not empty."""
    check_training_state(folder / STATE_FILE)
    for name in (ENCODER_WEIGHTS, HEADS_FILE):
        path = folder / name
        if not path.is_file() or path.stat().st_size == 0:
            load_tensors(path)  # the DataError naming it (missing, or empty = damaged)


def read_training_state(path: Path, device: torch.device | str = "cpu") -> dict:
    """``torch.load(weights_only=True)`` of a checkpoint's ``state.pt``; an empty,
    truncated or foreign file is a :class:`DataError` naming it."""
    check_training_state(path)
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    # a damaged file fails in many ways (the zip reader's RuntimeError, EOFError,
    # UnpicklingError, KeyError on garbage bytes, ...): each means it cannot be used
    except Exception as exc:  # noqa: BLE001
        raise DataError(f"{path}: damaged or not a torch file ({first_line(exc)}); "
                        f"{STATE_EXPECTED}", path=str(path)) from None
    missing = [k for k in STATE_KEYS if not isinstance(state, dict) or k not in state]
    if missing:
        raise DataError(f"{path}: not a training state (no {missing[0]!r} entry); "
                        f"{STATE_EXPECTED}", path=str(path))
    return state


def write_checkpoint_folder(final: Path, fill: Callable[[Path], None]) -> Path:
    """``fill(tmp)`` writes a new checkpoint folder beside ``final``, which then replaces
    ``final`` by renames: readers see the old checkpoint or the new, never a partial one."""
    import shutil
    tmp = final.parent / f".{final.name}.tmp"
    old = final.parent / f".{final.name}.old"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fill(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)
    return final


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


# ---------------------------------------------------------------------- off the training thread
class HostCopy:
    """Copies of nested dicts/lists of tensors in host memory, into buffers kept from one
    call to the next (same place in the structure, same shape and dtype).  From CUDA the
    buffers are pinned and filled without blocking: the copies queue on the current
    stream before any later in-place update, and :meth:`ready` waits for them."""

    def __init__(self):
        self._buffers: dict[tuple, torch.Tensor] = {}
        self._event = None

    def copy(self, value: Any) -> Any:
        seen: dict[tuple, torch.Tensor] = {}
        out = self._copy(value, (), seen)
        if any(same[-1].type == "cuda" for same in seen):
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def _copy(self, value: Any, where: tuple, seen: dict) -> Any:
        if isinstance(value, torch.Tensor):
            tensor = value.detach()
            same = (tensor.data_ptr(), tensor.dtype, tuple(tensor.shape), tensor.stride(),
                    tensor.device)
            if same in seen and tensor.numel():  # a tied tensor: one copy, stored once
                return self._buffers[seen[same]]
            buffer = self._buffers.get(where)
            if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                buffer = torch.empty(tensor.shape, dtype=tensor.dtype,
                                     pin_memory=tensor.device.type == "cuda")
                self._buffers[where] = buffer
            buffer.copy_(tensor, non_blocking=tensor.device.type == "cuda")
            seen[same] = where
            return buffer
        if isinstance(value, dict):
            return {k: self._copy(v, (*where, k), seen) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            items = [self._copy(v, (*where, i), seen) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)
        return copy.deepcopy(value)

    def ready(self) -> None:
        """Wait until the copies of the last :meth:`copy` have landed."""
        if self._event is not None:
            self._event.synchronize()


#: how long a failed job's thread waits for the training thread to take its error (s)
HAND_OVER_S = 600.0


class CheckpointWriter:
    """Runs checkpoint jobs (write, then report) on a background thread, one at a time
    and in order: :meth:`submit` waits for the previous job first.  A job's error --
    including the ``SystemExit`` with which Ray's report stops a trial -- is raised again
    in the training thread by its next :meth:`poll` (every step) or :meth:`wait`.  Until
    then the (non-daemon) job thread stays, so a process that exits does not finish
    while training code still runs (a thread in libtorch during interpreter shutdown
    aborts the process)."""

    def __init__(self):
        self._error: BaseException | None = None
        self._finished = threading.Event()
        self._finished.set()
        self._taken = threading.Event()
        self._thread: threading.Thread | None = None
        self.busy_s = 0.0  # seconds the jobs ran (off the training thread)

    def submit(self, job: Callable[[], None]) -> None:
        self.wait()
        self._finished.clear()
        self._taken.clear()
        self._thread = threading.Thread(target=self._run, args=(job,),
                                        name="mtbert-checkpoint", daemon=False)
        self._thread.start()

    def _run(self, job: Callable[[], None]) -> None:
        started = time.perf_counter()
        try:
            job()
        except BaseException as exc:  # noqa: BLE001 -- handed to the training thread
            self._error = exc
            self.busy_s += time.perf_counter() - started
            self._finished.set()
            self._taken.wait(HAND_OVER_S)
            return
        self.busy_s += time.perf_counter() - started
        self._finished.set()

    def poll(self) -> None:
        """Raise the error of a finished job, if any (cheap: every training step)."""
        if self._error is not None:
            error, self._error = self._error, None
            self._taken.set()
            # the job's thread ends at once now; joined, it no longer holds the job (and
            # through it the trainer) once the error is out
            self._thread.join()
            raise error

    def wait(self) -> None:
        """Wait for the running job; raise its error."""
        self._finished.wait()
        self.poll()

    def close(self) -> None:
        """On the training thread's own error: let the running job end, drop its error."""
        self._finished.wait()
        self._error = None
        self._taken.set()


def state_mismatch(checkpoint_dir: Path, cfg: TrainConfig, part: str, exc: BaseException,
                   state_file: Path | None = None) -> MtbertError:
    """The error for a checkpoint whose ``part`` state (in ``state_file``, default its
    ``state.pt``) does not fit the run built from ``cfg``: the settings that differ from
    the checkpoint's ``config.yaml``, if any."""
    state_file = state_file or checkpoint_dir / STATE_FILE
    saved_file = checkpoint_dir / "config.yaml"
    try:
        saved = read_yaml_file(saved_file, "checkpoint config")
    except ConfigError:
        saved = None
    current = cfg.to_dict()
    differ = []
    for key, value in (saved.items() if isinstance(saved, dict) else ()):
        if key in current:
            try:
                value = coerce_value(key, value)
            except ConfigError:
                pass
            if value != current[key]:
                differ.append((key, value))
    shaping = [d for d in differ if d[0] not in RESUME_MAY_CHANGE] or differ
    reason = f"the {part} state does not fit: {first_line(exc)}"
    if not shaping:
        return DataError(f"{state_file}: {reason}; {STATE_EXPECTED} with this config",
                         path=str(state_file))
    listed = ", ".join(f"{key}={value!r} there, {current[key]!r} now" for key, value in shaping)
    return ConfigError(f"{state_file}: written under a different config: {listed} (see "
                       f"{saved_file}); resume with the checkpoint's settings ({reason})",
                       key=shaping[0][0])
