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
  (:mod:`mtbert.model_files`: ``encoder/`` for ``AutoModel.from_pretrained``,
  ``heads.safetensors``, ``config.yaml``), and every training state (``state.pt``:
  weights, AdamW moments, SMART teacher, RNG) is removed; checkpoint folders keep their
  metrics and validation predictions;
* ``none``: the training states are removed and no weights are kept;
* ``all``: everything stays.
"""

from __future__ import annotations

from pathlib import Path

from mtbert.tune.location import STAGED_CHECKPOINTS, ExperimentLocation

KEEP_CHOICES = ("best", "all", "none")
MODELS_DIR = "models"
PRUNED_FILE = "mtbert_pruned.json"


def export_models(checkpoints: dict[str, str], folder: Path) -> dict[str, Path]:
    """``{trial_id: best checkpoint}`` -> ``{trial_id: exported model folder}``."""
    from mtbert.model_files import export_model
    from mtbert.trainer import load_checkpoint_model
    out = {}
    for trial_id, checkpoint in checkpoints.items():
        cfg, model = load_checkpoint_model(checkpoint)
        out[trial_id] = export_model(model, cfg, folder / trial_id)
    return out


def remove_training_states(location: ExperimentLocation) -> tuple[int, int]:
    """Delete every ``state.pt`` of the experiment (local folder or URI); (files, bytes)."""
    import pyarrow.fs

    from mtbert.trainer import CHECKPOINT_FILE as STATE_FILE
    from mtbert.tune.location import filesystem
    if location.exp_uri:
        fs, root = filesystem(location.exp_uri)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), str(location.exp_dir)
    files, size = 0, 0
    for info in fs.get_file_info(pyarrow.fs.FileSelector(root, recursive=True)):
        if info.type == pyarrow.fs.FileType.File and info.base_name == STATE_FILE:
            fs.delete_file(info.path)
            files, size = files + 1, size + info.size
    staged = location.exp_dir / STAGED_CHECKPOINTS  # local copies of a URI storage's
    for path in staged.rglob(STATE_FILE) if location.exp_uri else ():
        path.unlink()
    return files, size


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
        exported = export_models({i: best_checkpoints[i] for i in ids},
                                 location.exp_dir / MODELS_DIR)
        models = {i: str(path) for i, path in exported.items()}
    files, size = remove_training_states(location)
    kept = sum(folder_bytes(Path(p)) for p in models.values())
    location.write(PRUNED_FILE, json.dumps({"keep_checkpoints": keep, "models": models,
                                            "removed_states": files, "removed_bytes": size}))
    print(f"[tune] --keep-checkpoints {keep}: kept the weights of {len(models)} models "
          f"({kept / 2**20:.1f} MiB) in {location.public(location.exp_dir / MODELS_DIR)}; "
          f"removed {files} training states ({size / 2**20:.1f} MiB)", flush=True)
    best = summary.best_trial and dataclasses.replace(
        summary.best_trial, model=models.get(summary.best_trial.trial_id))
    return dataclasses.replace(summary, keep_checkpoints=keep, models=models, best_trial=best)
