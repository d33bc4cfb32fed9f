"""Growing a finished search: ``--extend EXPERIMENT`` (what it continues from).

Every finished search writes ``trials.json`` beside its summary: each trial it knows --
its own and those it inherited -- with its sampled config, its evaluations, how it
ended, its MLflow run, the search it trained in (``origin``), what its scores were
measured on (``measured_on``: budget, model, data, validation split) and where its
weights are (``weights``: a folder :func:`mtbert.run.inference.load_checkpoint_model` reads,
or null where ``--keep-checkpoints`` removed them).

A search started with ``--extend EXPERIMENT`` reads that file and classifies each trial:

* **joint**: measured on the same budget, model, data and split as the new search --
  the new searcher is told it, and it is ranked (and may be ensembled, where its weights
  were kept) together with the new trials;
* **prior**: measured on anything else (a CPU ``small`` search feeding a GPU ``full``
  one) -- the searcher is told it as prior information only; it is never ranked with
  the new trials, and a proposal equal to it is trained, not answered from it.

What the searcher is told of a trial is what the new search's own searcher will be told
of its trials (:func:`searcher_points`), so that old and new values are on one scale:
behind ``asha-promote`` (searchers.RunningTrialsLimiter) the rung metric at the first
rung, as a completed Optuna trial; otherwise the objective where the trial ended, as a
completed trial if it trained its whole budget and as a *pruned* trial (with its
evaluations as intermediate values) if the scheduler stopped it at a rung (one stopped
before its first evaluation: pruned, without a value); an errored trial is a failed one.  Nothing of the earlier search is trained again.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from mtbert.core.config import TrainConfig, coerce_value
from mtbert.core.errors import ConfigError
from mtbert.tune.search.choices import scheduler_choice, searcher_choice
from mtbert.tune.trial.objective import OBJECTIVE, rung_metric_keys
from mtbert.tune.results.records import TrialRecord, TrialStatus

#: every finished search's trials (own and inherited), what ``--extend`` reads
TRIALS_FILE = "trials.json"
TRIALS_FORMAT = 1
#: what a trial's scores depend on besides its config: two trials are ranked together
#: only where these are equal
MEASURED_ON_KEYS = ("budget", "max_examples", "model", "data_dir", "split_seed",
                    "max_train_per_task", "max_eval_per_task")


def measured_on(budget, base: dict[str, Any]) -> dict[str, Any]:
    """What a search's trial scores were measured on (see :data:`MEASURED_ON_KEYS`)."""
    return {"budget": budget.name, "max_examples": int(budget.max_examples),
            "model": base["model"], "data_dir": base["data_dir"],
            "split_seed": int(base.get("split_seed", 0)),
            "max_train_per_task": int(base.get("max_train_per_task", 0)),
            "max_eval_per_task": int(base.get("max_eval_per_task", 0))}


def differences(earlier: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """``key earlier -> now`` for each :data:`MEASURED_ON_KEYS` that differs."""
    return [f"{k} {earlier.get(k)} -> {now.get(k)}" for k in MEASURED_ON_KEYS
            if earlier.get(k) != now.get(k)]


@dataclass
class KnownTrial:
    """A trial of an earlier search as ``trials.json`` keeps it."""
    record: TrialRecord
    origin: str                      # the experiment it trained in
    measured_on: dict[str, Any]
    weights: str | None              # a loadable folder, or None (not kept)

    def to_dict(self) -> dict[str, Any]:
        r = asdict(self.record)
        r["status"] = str(self.record.status)
        return {**r, "origin": self.origin, "measured_on": self.measured_on,
                "weights": self.weights}


@dataclass
class EarlierSearch:
    """What ``--extend`` continues from: the earlier search and its known trials, split
    into those ranked with the new trials (``joint``) and those told as prior only."""
    experiment: str
    parent_run_id: str | None
    tracking_uri: str | None
    searched: list[str] = field(default_factory=list)      # the space's searched keys
    joint: list[KnownTrial] = field(default_factory=list)
    prior: list[KnownTrial] = field(default_factory=list)
    prior_reason: list[str] = field(default_factory=list)   # what differs, for the summary

    @property
    def known(self) -> list[KnownTrial]:
        return self.joint + self.prior

    def joint_records(self) -> list[TrialRecord]:
        """The joint trials as records to rank: ``best_checkpoint`` is where their weights
        are (None where they were not kept); ``origin`` names their search."""
        out = []
        for t in self.joint:
            r = TrialRecord(**{**asdict(t.record), "status": t.record.status})
            r.best_checkpoint, r.origin = t.weights, t.origin
            out.append(r)
        return out


# ---------------------------------------------------------------------- the file
def trials_document(experiment: str, parent_run_id: str | None, tracking_uri: str,
                    complete: bool, trials: list[KnownTrial]) -> str:
    return json.dumps({"format": TRIALS_FORMAT, "experiment": experiment,
                       "parent_run_id": parent_run_id, "tracking_uri": tracking_uri,
                       "complete": complete, "trials": [t.to_dict() for t in trials]},
                      indent=1, default=str)


def parse_trials(text: str, name: str) -> dict[str, Any]:
    """``trials.json`` checked: ConfigError naming the file and what is wrong."""
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--extend: {name} is not valid JSON ({exc}); it is written when "
                          "a search finishes") from None
    if not isinstance(doc, dict) or doc.get("format") != TRIALS_FORMAT \
            or not isinstance(doc.get("trials"), list):
        raise ConfigError(f"--extend: {name}: expected format {TRIALS_FORMAT} with a list of "
                          "'trials'")
    for i, row in enumerate(doc["trials"]):
        try:
            _known_trial(row)
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"--extend: {name}: trial {i + 1} is damaged ({exc!r})") from None
    return doc


def _known_trial(row: dict[str, Any]) -> KnownTrial:
    fields = {k: row[k] for k in TrialRecord.__dataclass_fields__ if k in row}
    fields["status"] = TrialStatus(row["status"])
    record = TrialRecord(**fields)
    if not isinstance(record.config, dict) or not isinstance(row["measured_on"], dict):
        raise TypeError("config and measured_on must be mappings")
    if not isinstance(record.history, list) or not all(
            isinstance(h, dict) and _number(h.get("examples_seen", 0)) for h in record.history):
        raise TypeError("history must be a list of evaluations, each with a number of "
                        "examples_seen")
    if not isinstance(record.best, dict) or not _number(record.examples_seen) \
            or not isinstance(row.get("weights"), (str, type(None))):
        raise TypeError("best must be a mapping, examples_seen a number, weights a path or "
                        "null")
    return KnownTrial(record, str(row["origin"]), dict(row["measured_on"]), row.get("weights"))


def check_known_trials(doc: dict[str, Any], space, base: dict[str, Any], name: str,
                       told: bool) -> None:
    """Every trial of a parsed ``trials.json`` is a point of the space it was searched in
    (``space``: that search's saved spaces.SearchSpace), before anything starts: each
    searched key has a value of its distribution (the field's type and valid range, the
    range, one of the choices; with ``told`` -- the searcher is told the trials -- on a
    ``quniform`` step too, or Optuna refuses it), a fixed key the space's value.  A key
    the space does not have is an error too, unless it is a TrainConfig field that
    ``base`` (every trial's config) sets to that very value: it says nothing then.
    ConfigError naming ``name`` (the file), the trial and the key."""
    for i, row in enumerate(doc["trials"]):
        trial = f"{name}: trial {row.get('trial_id') or i + 1}"
        config = row["config"]
        for key, param in space.searched.items():
            if key not in config:
                raise ConfigError(f"{trial}: no value of {key}, which its space searches "
                                  f"({param.describe()})", key=key)
        for key, value in config.items():
            problem = _not_of_the_space(str(key), value, space, base, told)
            if problem:
                raise ConfigError(f"{trial}: {problem}", key=str(key))


def _not_of_the_space(key: str, value: Any, space, base: dict[str, Any],
                      told: bool) -> str | None:
    """What is wrong with one value of an earlier trial's config (None: nothing)."""
    param = space.params.get(key)
    if param is not None:
        return param.rejects(value, on_grid=told)
    known = ", ".join(space.params)
    if key not in TrainConfig.field_names():
        return (f"{key}: not a key of the space it was searched in ({known}) nor of the "
                "trainer's config")
    if key in base:
        try:
            if coerce_value(key, value) == coerce_value(key, base[key]):
                return None  # what every trial of this search has anyway
        except ConfigError:
            pass
        return (f"{key}={value!r}: not a key of the space it was searched in ({known}), and "
                f"every trial of this search trains with {key}={base[key]!r}")
    return (f"{key}={value!r}: not a key of the space it was searched in ({known}); a "
            "trial of that space trained with the trainer's default")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def earlier_search(doc: dict[str, Any], now: dict[str, Any],
                   searched: list[str]) -> EarlierSearch:
    """The trials of a parsed ``trials.json``, classified against ``now`` (the new
    search's :func:`measured_on`); ``searched``: the space's searched keys."""
    earlier = EarlierSearch(doc.get("experiment") or "", doc.get("parent_run_id"),
                            doc.get("tracking_uri"), list(searched))
    reasons: dict[str, None] = {}
    for row in doc["trials"]:
        known = _known_trial(row)
        diff = differences(known.measured_on, now)
        if diff:
            earlier.prior.append(known)
            reasons.update(dict.fromkeys(diff))
        else:
            earlier.joint.append(known)
    earlier.prior_reason = list(reasons)
    return earlier


# ---------------------------------------------------------------------- the searcher
@dataclass(frozen=True)
class EarlierPoint:
    """One earlier trial as a searcher is told it (Optuna's terms: ``state`` is
    ``complete``, ``pruned`` or ``fail``)."""
    params: dict[str, Any]
    state: str
    value: float | None
    intermediate: tuple[float, ...] = ()
    prior: bool = False
    trial_id: str = ""


def searcher_points(earlier: EarlierSearch, searched: list[str], at_first_rung: bool,
                    first_rung: int, told_metric: str) -> list[EarlierPoint]:
    """What the new searcher is told of each known trial (see the module docstring):
    ``at_first_rung``: the searcher is told ``told_metric`` at ``first_rung`` examples
    (promoting ASHA), else the objective where the trial ended."""
    points = []
    for known, prior in [(k, False) for k in earlier.joint] + [(k, True) for k in earlier.prior]:
        r = known.record
        if any(k not in r.config for k in searched):
            continue  # cannot be placed in this space
        params = {k: r.config[k] for k in searched}
        metric = told_metric if at_first_rung else OBJECTIVE
        curve = [float(h[metric]) for h in r.history
                 if isinstance(h.get(metric), (int, float)) and math.isfinite(h[metric])
                 and h.get("examples_seen", 0) > 0]
        if r.status == TrialStatus.ERROR or not curve:
            # stopped before its first evaluation: pruned without a value, as a searcher
            # is told a trial that ended with no result; an error: failed
            state = "fail" if r.status == TrialStatus.ERROR else "pruned"
            points.append(EarlierPoint(params, state, None, prior=prior, trial_id=r.trial_id))
            continue
        if at_first_rung:
            at = [float(h[metric]) for h in r.history if h.get("examples_seen", 0) >= first_rung
                  and isinstance(h.get(metric), (int, float)) and math.isfinite(h[metric])]
            value = at[0] if at else curve[-1]
            state = "complete" if at else "pruned"
        else:
            value = curve[-1]
            state = "complete" if r.status == TrialStatus.COMPLETED else "pruned"
        points.append(EarlierPoint(params, state, value, tuple(curve), prior, r.trial_id))
    return points


def told_line(points: list[EarlierPoint], earlier: EarlierSearch, searcher: str,
              at_first_rung: bool, first_rung: int, told_metric: str) -> str:
    """The driver's line on what the searcher was told (``points``: none where it cannot
    be told; the other arguments as for :func:`searcher_points`)."""
    if not earlier.known:
        return f"--extend {earlier.experiment}: it has no trials to continue from"
    if not points:
        return (f"--extend {earlier.experiment}: --search-alg {searcher} cannot be told "
                f"earlier trials; its {len(earlier.joint)} trials are ranked, not told")
    by = {s: sum(p.state == s for p in points) for s in ("complete", "pruned", "fail")}
    if at_first_rung:
        how = (f"{by['complete']} with their {told_metric} at the first rung ({first_rung:,} "
               f"examples), {by['pruned']} that ended before it as pruned")
    else:
        how = (f"{by['complete']} completed with their {OBJECTIVE}, {by['pruned']} stopped "
               "at a rung as pruned")
    prior = sum(p.prior for p in points)
    tail = (f"; {prior} of them as prior only ({', '.join(earlier.prior_reason)})"
            if prior else "")
    return (f"--extend {earlier.experiment}: the searcher was told {len(points)} earlier "
            f"trials ({how}, {by['fail']} failed){tail}")


def earlier_from_records(experiment: str, records: list[TrialRecord], searched: list[str],
                         parent_run_id: str | None = None) -> EarlierSearch:
    """An earlier search held in memory (a bench's first run): every trial joint, no
    weights."""
    return EarlierSearch(experiment, parent_run_id, None, list(searched),
                         joint=[KnownTrial(r, experiment, {}, None) for r in records])


# ---------------------------------------------------------------------- what the searcher is told
def points_for_searcher(settings) -> list[EarlierPoint]:
    """What the searcher of a search started with ``--extend`` is told of the earlier
    trials: as it will be told its own (:func:`searcher_points`); none where the
    searcher cannot be told (random, BOHB)."""
    if settings.extends is None or not searcher_choice(settings.search_alg).learns_from_earlier:
        return []
    return searcher_points(settings.extends, list(settings.space.searched),
                           *_searcher_feedback(settings))


def searcher_told_line(settings) -> str:
    """The driver's line on what the searcher of an ``--extend`` search was told."""
    return told_line(points_for_searcher(settings), settings.extends, settings.search_alg,
                     *_searcher_feedback(settings))


def _searcher_feedback(settings) -> tuple[bool, int, str]:
    """(told at the first rung, the first rung in examples, the metric told): as the
    searcher is told each trial of its own search."""
    return (scheduler_choice(settings.scheduler).frees_paused_places,
            settings.budget.grace_period, rung_metric_keys(settings.rung_metric)[0])
