"""What ``--resume`` and ``--extend`` take from an earlier run of the driver: the saved
settings of a search (``mtbert_search.json``, written when it starts) and, for
``--extend``, the finished search's trials (``trials.json``).  On ``--resume`` the saved
settings win over the command line, so the data, space and budget cannot drift; on
``--extend`` the values of :data:`EXTEND_INHERITS` not given are inherited.  Each problem
is a :class:`~mtbert.core.errors.ConfigError` naming the flag and the file."""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mtbert.core.errors import ConfigError
from mtbert.tune.infra import location as loc
from mtbert.tune.results.extension import TRIALS_FILE, parse_trials
from mtbert.tune.search.spaces import SearchSpace, load_space, parse_space

SETTINGS_FILE = "mtbert_search.json"
#: CLI values a resumed search takes from the new command line, not from its saved settings
#: (not ``fuse``: Tune restores a search with the trainable it started with, fused or not)
_RESUME_OWN = ("resume", "address", "mlflow_fallback_local", "mps", "trial_threads")
#: CLI values a search started with ``--extend`` takes from the earlier search unless given
#: (the space is checked equal when given; another budget, model or data makes the earlier
#: trials prior information only: extension.py)
EXTEND_INHERITS = ("space", "budget", "data_dir", "model", "search_alg", "scheduler",
                   "rung_metric", "seed", "ensemble", "keep_checkpoints", "mlflow_uri")


@dataclass(frozen=True)
class EarlierSettings:
    """What ``--extend`` read of the earlier search."""
    saved: dict[str, Any]        # its saved settings
    trials: dict[str, Any]       # its parsed trials.json, each trial's weights resolved
    #                              against the folder read (ExperimentLocation.resolved)
    space: SearchSpace           # the space it searched
    trials_name: str             # the trials file as errors name it


def merge_saved_settings(args: argparse.Namespace, storage: Path,
                         storage_uri: str | None) -> dict[str, Any]:
    """``--resume``: the saved settings of the search (they replace the CLI values)."""
    if not args.experiment:
        raise ConfigError("--resume needs --experiment NAME (the search to continue)")
    where = loc.ExperimentLocation(storage, args.experiment, storage_uri)
    text = where.read(SETTINGS_FILE)
    if text is None:
        raise ConfigError(f"--resume: no search to resume in {where.ray_experiment} "
                          f"(no {SETTINGS_FILE})")
    saved = parse_saved_settings(text, f"{where.ray_experiment}/{SETTINGS_FILE}", "--resume")
    if where.read(loc.PRUNED_FILE) is not None:
        raise ConfigError(f"--resume: {where.ray_experiment} finished and its training states "
                          f"were removed (--keep-checkpoints {saved['args'].get('keep_checkpoints')}"
                          "): nothing to resume; start a new search with another --experiment")
    # a search saved before --rung-metric existed decided on the objective (Tuner.restore
    # brings back that scheduler; the summary must name what it decides on)
    saved["args"].setdefault("rung_metric", "overall")
    # the original settings win: the data, space and budget must not drift
    for key, value in saved["args"].items():
        if key not in _RESUME_OWN:
            setattr(args, key, value)
    return saved


def parse_saved_settings(text: str, name: str, flag: str) -> dict[str, Any]:
    """A search's saved settings, checked: what ``--resume`` / ``--extend`` (``flag``)
    need of them is there."""
    try:
        saved = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"{flag}: {name} is not valid JSON ({exc}); it is written when "
                          "a search starts: restore it, or start a new search") from None
    needed = {"args": dict, "space": dict, "space_path": str}
    for key, kind in needed.items():
        if not isinstance(saved, dict) or not isinstance(saved.get(key), kind):
            raise ConfigError(f"{flag}: {name} has no {key!r} ({kind.__name__}); it is "
                              "written when a search starts: restore it, or start a new "
                              "search")
    return saved


def earlier_settings(args: argparse.Namespace, storage: Path, storage_uri: str | None,
                    ) -> EarlierSettings:
    """``--extend NAME``: what the earlier search left (:class:`EarlierSettings`), the
    values of :data:`EXTEND_INHERITS` not given on the command line (``args.given``, set
    by the CLI) taken from it.
    ConfigError for a search that is not there, not finished, damaged, or of another
    space."""
    name = args.extend
    where = loc.ExperimentLocation(storage, name, storage_uri)
    folder = where.ray_experiment  # the URI copy where there is one
    text = where.read(SETTINGS_FILE)
    if text is None:
        raise ConfigError(f"--extend {name}: no search in {folder} (no {SETTINGS_FILE}); "
                          f"give the --experiment name of a finished search in --storage-path "
                          f"{args.storage_path}")
    saved = parse_saved_settings(text, f"{folder}/{SETTINGS_FILE}", f"--extend {name}")
    trials_text = where.read(TRIALS_FILE)
    if trials_text is None:
        raise ConfigError(f"--extend {name}: {folder} has no {TRIALS_FILE}, written when "
                          "a search finishes: finish it first (--resume --experiment "
                          f"{name}), then extend it")
    trials_name = f"--extend {name}: {folder}/{TRIALS_FILE}"
    trials = parse_trials(trials_text, f"{folder}/{TRIALS_FILE}")
    if not trials.get("complete", False):
        raise ConfigError(f"--extend {name}: the search did not finish (interrupted, or trials "
                          f"never started): finish it with --resume --experiment {name}, "
                          "then extend it")
    for row in trials["trials"]:  # relative to the folder read (absolute: before they were)
        row["weights"] = where.resolved(row.get("weights"),
                                        (str(trials.get("experiment") or name),
                                         str(row.get("origin") or "")))
    space = parse_space(saved["space"], saved["space_path"])
    if args.resume:  # the extension's own saved settings were merged: they stand
        return EarlierSettings(saved, trials, space, trials_name)
    given = getattr(args, "given", frozenset())
    if "space" in given and args.space is not None:
        asked = load_space(args.space)
        if asked.to_dict() != space.to_dict():
            keys = sorted(set(asked.params) ^ set(space.params)
                          | {k for k in set(asked.params) & set(space.params)
                             if asked.to_dict()["params"][k] != space.to_dict()["params"][k]})
            raise ConfigError(f"--extend {name}: it searched space {space.name!r}, not "
                              f"--space {args.space} ({asked.name!r}); they differ in "
                              f"{', '.join(keys) or 'their description'}")
    for key in EXTEND_INHERITS:
        if key not in given and key in saved["args"]:
            setattr(args, key, saved["args"][key])
    return EarlierSettings(saved, trials, space, trials_name)
