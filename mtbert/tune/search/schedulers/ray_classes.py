"""Ray's ASHA, Hyperband-for-BOHB and population-based training, fitted to budgets in
examples, and a promoting ASHA (:class:`PromotingASHA`) built on Ray's scheduler
interface, each deciding on its own metric (``--rung-metric``).

Every scheduler here compares trials on the metric it is built with, while the Tuner's
metric -- the search's objective, which the searcher, the checkpoints and Ray's progress
table use -- stays ``val/overall``.  Ray hands the Tuner's metric to every part and refuses
(ValueError) a scheduler built with its own; :class:`_OwnMetric` keeps its own.

``--scheduler bohb``: :class:`HyperBandOnRungs`.  Ray derives Hyperband's brackets from ``max_t`` alone (s_max = round(log_eta max_t),
bracket s starting at max_t * eta^-s): counted in examples that makes a dozen brackets
whose first milestone is a few examples.  Here time is counted in grace periods
(``rungs_seen`` = examples seen / grace period, added to each result before Hyperband
reads it) and ``max_t`` is the budget's last rung in those units (eta^s): the smallest
bracket starts at the grace period and every milestone is one of the budget's rungs
(grace * eta^k).  Trials that survive the last rung train on to the budget's end
(``stop_last_trials=False``), like ASHA's.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

from ray.tune.schedulers import (ASHAScheduler, FIFOScheduler, HyperBandForBOHB,
                                 PopulationBasedTraining, TrialScheduler)
from ray.tune.schedulers.pb2 import PB2

from mtbert.tune.search.budgets import Budget
from mtbert.tune.trial.objective import MODE

#: the time attribute Hyperband reads (examples seen / grace period)
RUNGS_SEEN = "rungs_seen"
#: the time attribute PBT / PB2 read (whole evaluation intervals)
INTERVALS_SEEN = "intervals_seen"


class _OwnMetric:
    """A scheduler that keeps the metric and mode it was built with when the Tuner passes
    the search's own (Ray's set_search_properties refuses both being set)."""

    def set_search_properties(self, metric, mode, **spec) -> bool:
        return super().set_search_properties(None if self._metric else metric,
                                             None if self._mode else mode, **spec)


class ASHAOnExamples(_OwnMetric, ASHAScheduler):
    """``--scheduler asha``: ASHA's rungs at the budget's (grace period x rf^k examples)."""

    def __init__(self, budget: Budget, metric: str):
        super().__init__(time_attr="examples_seen", metric=metric, mode=MODE,
                         max_t=budget.max_examples, grace_period=budget.grace_period,
                         reduction_factor=budget.reduction_factor)


class HyperBandOnRungs(_OwnMetric, HyperBandForBOHB):
    def __init__(self, budget: Budget, metric: str):
        self.grace = budget.grace_period
        last = budget.rungs()[-1] / self.grace
        # a hair above eta^s: Ray's int(max_t * eta**-s) is int(0.999...) = 0 for 27 * 3**-3
        super().__init__(time_attr=RUNGS_SEEN, metric=metric, mode=MODE,
                         max_t=last * (1 + 1e-9), reduction_factor=budget.reduction_factor,
                         stop_last_trials=False)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        result[RUNGS_SEEN] = result.get("examples_seen", 0) / self.grace
        return super().on_trial_result(tune_controller, trial, result)


class _OnEvalIntervals:
    """PBT / PB2 timed in whole evaluation intervals, letting a trial at its budget's end
    finish.

    * Time is ``intervals_seen`` = floor(examples seen / ``eval_every``), added to each
      result, with a perturbation interval of 1: an evaluation falls on the first step
      past its point (54, 100, 146 examples for every 48), and synchronous PBT on examples
      would wait for a time none of the paused trials is below.
    * A trial's last report continues: exploiting there would send a finished trial back
      to another's earlier checkpoint, again each time it reaches the end."""

    def __init__(self, budget: Budget, metric: str, **kwargs):
        self.max_examples, self.interval = budget.max_examples, budget.eval_every
        super().__init__(time_attr=INTERVALS_SEEN, perturbation_interval=1, metric=metric,
                         mode=MODE, **kwargs)

    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        seen = result.get("examples_seen", 0)
        result[INTERVALS_SEEN] = int(seen // self.interval)
        if seen >= self.max_examples:
            return TrialScheduler.CONTINUE  # the trainable returns after this report
        return super().on_trial_result(tune_controller, trial, result)


class PBTOnEvalIntervals(_OwnMetric, _OnEvalIntervals, PopulationBasedTraining):
    """``--scheduler pbt``."""


class PB2OnEvalIntervals(_OwnMetric, _OnEvalIntervals, PB2):
    """``--scheduler pb2``."""


class PromotingASHA(_OwnMetric, FIFOScheduler):
    """``--scheduler asha-promote``: ASHA as Li et al. (2020) state it (Algorithm 2), with
    trials that pause at a rung and are promoted later, where Ray's ASHA decides on arrival.

    A trial pauses at each *decision rung* (a budget rung with at least as much training
    after it as before) and is scored there on that rung's ``--rung-metric``.  A freed worker goes to the best
    promotable trial of the highest rung that has one (in the top floor(n_k / rf) of the
    n_k trials that reached rung k, not yet promoted from it), else to a new trial.  A rung
    promotes at most synchronous halving's share (floor(N_k / rf), N_0 = ``num_samples``).
    The searcher gives every trial asked for, as Li et al.'s ASHA draws a new trial
    whenever it cannot promote: each is scored at the first rung (and told to the
    searcher there), promoted where its rung's share allows.  Once the deciding (highest)
    rung's share is used the search is decided: the trials promoted from a lower rung and
    still running to the next are stopped, and where no trial is left to try the promoted
    one trains on with their CPUs (``last_leg_cpus``).  With nothing left to run, the best
    trial of the highest rung that promoted none trains the whole budget, and the trials
    still paused are stopped.

    On ``--resume`` its records start afresh (Ray saves no scheduler's state): the trials
    paused at a rung train on to the next one and are judged there.  Its searcher is a
    :class:`~mtbert.tune.search.searchers.RunningTrialsLimiter`: a paused trial frees its place
    and a promoted one takes the place of the trial whose arrival promoted it.  Why each
    rule, with the measurements: docs/search.md, docs/bench/search_efficiency.md.

    Each decision is written down as it is taken (:attr:`decisions`, and one JSON line each
    in :attr:`decisions_file` where set, which the search's summary reads): a trial
    ``scored`` at a rung, ``promoted`` from it (with every score of the rung it was
    compared with), ``stopped``."""

    _supports_buffered_results = False  # decisions at every rung, as results arrive
    #: where each decision is appended as a JSON line (None: kept in memory only)
    decisions_file: Path | None = None

    def __init__(self, budget: Budget, metric: str | Sequence[str], workers: int,
                 num_samples: int, last_leg_cpus: float = 0.0):
        super().__init__()
        self.last_leg_cpus = last_leg_cpus  # 0: every trial keeps its CPUs
        # the metric of each decision rung (one for all, or one per rung: the last repeats)
        self.rung_metrics = (metric,) if isinstance(metric, str) else tuple(metric)
        self._metric, self._mode = self.rung_metrics[0], MODE
        self.rf = budget.reduction_factor
        self.workers = workers
        self.max_examples = budget.max_examples
        self.rungs = [m for m in budget.rungs() if 2 * m <= budget.max_examples]
        # promotions from rung k, at most: synchronous halving's n_k / rf, n_0 = num_samples
        self.quota, reaching = [], num_samples
        for _ in self.rungs:
            reaching = int(reaching // self.rf)
            self.quota.append(reaching)
        # the rung whose promotions train the whole budget: the highest with a share
        self.deciding = max((k for k, q in enumerate(self.quota) if q > 0), default=-1)
        self.scores: list[dict[str, float]] = [{} for _ in self.rungs]  # rung k: id -> score
        self.promoted: list[set[str]] = [set() for _ in self.rungs]
        self._widen: dict[str, float] = {}  # trial id -> CPUs to resume it with
        self.decisions: list[dict] = []

    # ------------------------------------------------------------------ decisions
    def on_trial_result(self, tune_controller, trial, result: dict) -> str:
        seen = result.get("examples_seen", 0)
        k = self._rung_reached(trial.trial_id, seen)
        if k is None or (self.max_examples and seen >= self.max_examples):
            # (the whole budget: the trial ends, whatever a resumed search's fresh records
            # hold -- it resumed from its checkpoint at a rung and reported only here)
            return TrialScheduler.CONTINUE
        score = result.get(self.rung_metrics[min(k, len(self.rung_metrics) - 1)])
        self.scores[k][trial.trial_id] = (score if isinstance(score, (int, float))
                                          and score == score else float("-inf"))
        self._decided("scored", trial.trial_id, k)
        chosen = self._best_promotable(tune_controller, arriving=trial)
        if chosen is not None and chosen[0] is trial:
            self._promote(tune_controller, *chosen, arriving=trial)
            if trial.trial_id not in self._widen:
                return TrialScheduler.CONTINUE  # it keeps its place
            # it goes on with more CPUs: Ray changes a trial's resources only while it is
            # not running, so it pauses and is resumed at once from this rung's checkpoint
            tune_controller.search_alg.searcher.on_pause(trial.trial_id)
            tune_controller.search_alg.searcher.on_unpause(trial.trial_id)
            return TrialScheduler.PAUSE
        tune_controller.search_alg.searcher.on_pause(trial.trial_id)
        if chosen is not None:  # the freed place goes to it, not to a new trial
            self._promote(tune_controller, *chosen, arriving=trial)
        return TrialScheduler.PAUSE

    def choose_trial_to_run(self, tune_controller):
        trials = tune_controller.get_trials()
        self._free_places_of_ended(tune_controller, trials)
        promoted = [t for t in trials if t.status == t.PAUSED and self._was_promoted(t)]
        if promoted:
            return self._resumed(promoted[0])
        pending = [t for t in trials if t.status == t.PENDING]
        if pending:
            return pending[0]
        busy = sum(t.status == t.RUNNING for t in trials)
        if busy < self.workers:  # a place no new trial took: the searcher has given all
            chosen = self._best_promotable(tune_controller)
            if chosen is not None:
                return self._resumed(self._promote(tune_controller, *chosen))
        if busy == 0 and tune_controller.search_alg.is_finished():
            last = self._first_of_an_unpromoted_rung(tune_controller)
            if last is not None:
                return self._resumed(last)
            for t in trials:
                if t.status == t.PAUSED:
                    self._stop(tune_controller, t)
        return None

    @staticmethod
    def _free_places_of_ended(tune_controller, trials) -> None:
        """Ray 2.60 errors a trial whose reused worker failed to reset without telling the
        searcher, whose limit would count it as running for the rest of the search: an
        errored trial still counted is ended in the searcher too."""
        searcher = tune_controller.search_alg.searcher
        live = getattr(searcher, "live_trials", set())
        for t in trials:
            if t.trial_id in live and t.status == t.ERROR:
                searcher.on_trial_complete(t.trial_id, error=True)

    def debug_string(self) -> str:
        counts = ", ".join(f"{m}: {len(s)} reached / {len(p)} promoted"
                           for m, s, p in zip(self.rungs, self.scores, self.promoted))
        return f"Promoting ASHA (rf {self.rf:g}) at rungs {counts or 'none'}."

    # ------------------------------------------------------------------ bookkeeping
    def _rung_reached(self, trial_id: str, examples_seen: int) -> int | None:
        """The highest decision rung this result reached that the trial has no score at."""
        reached = [k for k, m in enumerate(self.rungs)
                   if examples_seen >= m and trial_id not in self.scores[k]]
        return reached[-1] if reached else None

    def _best_promotable(self, tune_controller, arriving=None):
        """(trial, rung) to promote: the highest rung first, the best score first; a trial
        qualifies while paused at that rung (or ``arriving`` at it)."""
        if self.decided:
            return None
        by_id = {t.trial_id: t for t in tune_controller.get_trials()}
        for k in reversed(range(len(self.rungs))):
            if len(self.promoted[k]) >= self.quota[k]:
                continue
            ranked = sorted(self.scores[k], key=self.scores[k].get, reverse=True)
            for trial_id in ranked[:int(len(ranked) // self.rf)]:
                trial = by_id.get(trial_id)
                if trial_id in self.promoted[k] or trial is None:
                    continue
                if trial is arriving or self._paused_at(trial, k):
                    return trial, k
        return None

    def _first_of_an_unpromoted_rung(self, tune_controller):
        """At the end, the best trial paused at the highest rung that promoted none (fewer
        than rf trials reached it), promoted: some trial trains the whole budget."""
        by_id = {t.trial_id: t for t in tune_controller.get_trials()}
        for k in reversed(range(len(self.rungs))):
            if not self.scores[k]:
                continue
            if self.promoted[k]:
                return None  # a trial went on from the highest rung reached
            for trial_id in sorted(self.scores[k], key=self.scores[k].get, reverse=True):
                trial = by_id.get(trial_id)
                if trial is not None and self._paused_at(trial, k):
                    return self._promote(tune_controller, trial, k)
            return None  # its trials ended otherwise (errors): nothing to promote
        return None

    def _promote(self, tune_controller, trial, k: int, arriving=None):
        """Promote ``trial`` from rung ``k`` (paused there, or arriving: it keeps its
        place): it takes a running place.  With the deciding rung's share used, the
        trials promoted from a lower rung and still running to the next are stopped, and
        this one is to resume with the CPUs they held where no trial is left to try."""
        self.promoted[k].add(trial.trial_id)
        self._decided("promoted", trial.trial_id, k, compared=dict(self.scores[k]))
        if trial.status != trial.RUNNING:
            tune_controller.search_alg.searcher.on_unpause(trial.trial_id)
        if self.decided:
            self._end_the_rest(tune_controller, trial, arriving)
        return trial

    @property
    def decided(self) -> bool:
        """The deciding rung has promoted its share: no other trial can train past it
        (with no rung's share, the end rule's promotion decides: fewer than rf trials)."""
        if self.deciding < 0:
            return any(self.promoted)
        return len(self.promoted[self.deciding]) >= self.quota[self.deciding]

    def _resumed(self, trial):
        """``trial``, about to resume, with the CPUs of the last promotion if it is that."""
        cpus = self._widen.pop(trial.trial_id, None)
        if cpus is not None:
            trial.update_resources(with_cpus(trial.placement_group_factory, cpus))
        return trial

    def _end_the_rest(self, tune_controller, last, arriving) -> None:
        """The last promotion: stop the trials promoted from a lower rung and running to
        the next (no rung can promote them further; ``arriving``, whose result is being
        decided, pauses instead), let the trials not yet scored at the first rung run on
        to it (every trial asked for is tried), and, where no trial is left to try, give
        the stopped trials' CPUs, with its own, to ``last`` (see ``last_leg_cpus``)."""
        # the trials promoted by the last rung that promotes any (9 trials, rf 3: 3 -> 1;
        # 8 trials: 2 -> 0, both of the first rung's go on, and the end rule picks one)
        deciding = self.deciding
        kept, stopped_pending = 0.0, False
        to_try = not tune_controller.search_alg.is_finished()
        for t in tune_controller.get_trials():
            if t is last or t.status not in (t.RUNNING, t.PENDING, t.PAUSED):
                continue
            if t.trial_id in self.promoted[deciding]:
                if self._top_rung(t.trial_id) == deciding:  # not yet paused at a later rung
                    kept += trial_cpus(t)  # training, or about to train, the rest
            elif self._top_rung(t.trial_id) < 0:
                to_try |= t is not arriving  # on its way to the first rung: it is tried
            elif t is not arriving and (t.status != t.PAUSED or self._was_promoted(t)):
                # (paused and promoted from a lower rung, not yet resumed: void now)
                stopped_pending |= t.status == t.PENDING
                self._stop(tune_controller, t)
        # Ray 2.60's controller keeps a PENDING trial it stops (staged, its actor not yet
        # started) among its staged trials, so its actor cache goes on holding a cached
        # 1-CPU worker for it; a resumed leg that needs that CPU then waits forever.  The
        # last leg keeps its CPUs then, and while trials are left to try (on a CPU,
        # ``--trial-threads grow`` takes the cores they free as they pause).
        cpus = self.last_leg_cpus - kept
        if (cpus > trial_cpus(last) > 0 and not trial_gpus(last) and not stopped_pending
                and not to_try):
            self._widen[last.trial_id] = cpus

    def _stop(self, tune_controller, trial) -> None:
        self._decided("stopped", trial.trial_id, self._top_rung(trial.trial_id))
        tune_controller.stop_trial(trial)

    def _decided(self, decision: str, trial_id: str, k: int, **more: dict) -> None:
        """Write down a decision about ``trial_id`` at decision rung ``k`` (-1: before the
        first): the rung's examples, metric and the trial's score there."""
        at = k >= 0
        entry = {"decision": decision, "trial_id": trial_id,
                 "rung": self.rungs[k] if at else None,
                 "metric": self.rung_metrics[min(k, len(self.rung_metrics) - 1)] if at else None,
                 "value": _finite(self.scores[k].get(trial_id)) if at else None}
        if "compared" in more:
            entry["compared"] = {t: _finite(v) for t, v in more["compared"].items()}
        self.decisions.append(entry)
        if self.decisions_file is not None:
            with open(self.decisions_file, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(entry) + "\n")

    def _paused_at(self, trial, k: int) -> bool:
        """Paused at rung ``k`` (its highest)."""
        return trial.status == trial.PAUSED and self._top_rung(trial.trial_id) == k

    def _top_rung(self, trial_id: str) -> int:
        return max((k for k, s in enumerate(self.scores) if trial_id in s), default=-1)

    def _was_promoted(self, trial) -> bool:
        """Promoted from the rung it paused at, not yet resumed (when paused)."""
        k = self._top_rung(trial.trial_id)
        return k >= 0 and trial.trial_id in self.promoted[k]


def _finite(value: float | None) -> float | None:
    """A score as JSON keeps it: None where there is none or it is not finite."""
    return value if value is not None and math.isfinite(value) else None


def trial_cpus(trial) -> float:
    return _trial_resource(trial, "CPU")


def trial_gpus(trial) -> float:
    return _trial_resource(trial, "GPU")


def _trial_resource(trial, name: str) -> float:
    resources = trial.placement_group_factory
    return float(resources.required_resources.get(name, 0.0)) if resources else 0.0


def with_cpus(resources, cpus: float):
    """``resources`` (a PlacementGroupFactory) with ``cpus`` CPUs in its first bundle."""
    from ray.tune.execution.placement_groups import PlacementGroupFactory
    first, *rest = resources.bundles
    return PlacementGroupFactory([{**first, "CPU": cpus}, *rest],
                                 strategy=resources.strategy)
