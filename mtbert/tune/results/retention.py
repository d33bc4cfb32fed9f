"""What a finished search keeps (``--keep-checkpoints``).

While a search runs, each trial keeps its 2 best checkpoints by the objective and its
latest, whatever the choice: keeping only 1 best made ``--resume`` after a driver crash
fail (measured: a clean-clone CI run) -- Ray's last experiment snapshot may name a
checkpoint that a newer report has since displaced, and a trial restored from a
deleted checkpoint errors; a second kept checkpoint narrows that window.  When a search
has ended with every trial done (never after Ctrl-C or a crash: ``--resume`` needs the
states) and its ensemble and predictions are written:

* ``best`` (default): the weights of the best trial and of each ensemble member, from
  their best checkpoints, go to ``<experiment>/models/<trial id>/``
  (:mod:`mtbert.run.model_files`: ``encoder/`` for ``AutoModel.from_pretrained``,
  ``heads.safetensors``, ``config.yaml``; the checkpoint's weight files copied as they
  are), and every training state (``state.pt``: AdamW moments, SMART teacher, RNG; and
  the weight files ``encoder/`` and ``heads.safetensors``) is removed; checkpoint folders
  keep their metrics and validation predictions;
* ``none``: the training states are removed and no weights are kept;
* ``all``: everything stays.
"""

from __future__ import annotations

from pathlib import Path

from mtbert.tune.infra.location import (PRUNED_FILE, STAGED_CHECKPOINTS, ExperimentLocation,
                                        filesystem)
from mtbert.tune.results.summary import counted

MODELS_DIR = "models"


def export_models(checkpoints: dict[str, str], folder: Path) -> dict[str, Path]:
    """``{trial_id: best checkpoint}`` -> ``{trial_id: exported model folder}`` (copies of
    the checkpoints' weight files)."""
    from mtbert.run.model_files import export_checkpoint  # deferred: torch, transformers
    return {trial_id: export_checkpoint(checkpoint, folder / trial_id)
            for trial_id, checkpoint in checkpoints.items()}


def remove_training_states(location: ExperimentLocation) -> tuple[int, int]:
    """Delete the training-state files (``state.pt`` and the weight files) of every
    checkpoint of the experiment (local folder or URI), not the kept ``models/``;
    (checkpoints, bytes)."""
    import pyarrow.fs

    from mtbert.run.training_state import (ENCODER_DIR, STATE_FILE,  # deferred: torch
                                       TRAINING_STATE_FILES)
    if location.exp_uri:
        fs, root = filesystem(location.exp_uri)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), str(location.exp_dir)
    root = root.rstrip("/")
    states, size, folders = 0, 0, set()
    for info in fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True)):
        rel = info.path[len(root) + 1:]
        if (info.type == pyarrow.fs.FileType.File and not rel.startswith(MODELS_DIR + "/")
                and any(rel == f or rel.endswith("/" + f) for f in TRAINING_STATE_FILES)):
            fs.delete_file(info.path)
            states += rel.rsplit("/", 1)[-1] == STATE_FILE
            size += info.size
            if rel.split("/")[-2:-1] == [ENCODER_DIR]:
                folders.add(info.path.rsplit("/", 1)[0])
    for path in folders:  # the emptied encoder/ folders (no-ops on object stores)
        try:
            fs.delete_dir(path)
        except OSError:
            pass
    staged = location.exp_dir / STAGED_CHECKPOINTS  # local copies of a URI storage's
    for name in TRAINING_STATE_FILES if location.exp_uri else ():
        for path in staged.rglob(name):
            path.unlink()
    return states, size


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def keep_what_was_asked(settings, summary, best_checkpoints: dict[str, str]):
    """After a complete search: export the weights ``--keep-checkpoints`` keeps, remove
    the training states, mark the experiment; returns the summary naming the weights."""
    import dataclasses
    import json

    location, keep = settings.location, settings.keep_checkpoints
    models: dict[str, str] = {}
    if keep == "best" and summary.best_trial is not None:
        ids = dict.fromkeys([summary.best_trial.trial_id,
                             *(summary.ensemble.members if summary.ensemble else [])])
        # an earlier search's best trial (--extend) may have no weights left to keep
        exported = export_models({i: best_checkpoints[i] for i in ids if i in best_checkpoints},
                                 location.exp_dir / MODELS_DIR)
        models = {i: str(path) for i, path in exported.items()}
    files, size = remove_training_states(location)
    kept = sum(folder_bytes(Path(p)) for p in models.values())
    location.write(PRUNED_FILE, json.dumps({"keep_checkpoints": keep, "models": models,
                                            "removed_states": files, "removed_bytes": size}))
    print(f"[tune] --keep-checkpoints {keep}: kept the weights of {counted(len(models), 'model')} "
          f"({kept / 2**20:.1f} MiB) in {location.public(location.exp_dir / MODELS_DIR)}; "
          f"removed {files} training states ({size / 2**20:.1f} MiB)", flush=True)
    best = summary.best_trial and dataclasses.replace(
        summary.best_trial, model=models.get(summary.best_trial.trial_id))
    return dataclasses.replace(summary, keep_checkpoints=keep, models=models, best_trial=best)
