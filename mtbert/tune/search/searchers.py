"""The driver's Optuna searcher, and the limit it runs behind under a pausing ASHA.

:class:`DistinctOptunaSearch` is Ray's OptunaSearch that does not train a configuration
it has already scored.  In a space of steps and choices (``quniform``, ``randint``,
``choice``) TPE proposes configurations it has already tried: the bench's stepped
search trained dropout 0.1, lambda_s 1 twice in one seed, 2,000 examples for a score it
had (the trainings are seeded, so the repeat scored the same to the last digit).  Here
a proposal equal to a finished trial's is told that trial's value at once -- the answer
Optuna's FAQ gives for repeated parameters -- and the sampler is asked again.  After
``MAX_ASKS`` repeats in a row the repeat trains (TPE can insist on its favourite while
other configurations are left).  In a continuous space proposals never repeat exactly,
and nothing changes.

:class:`RunningTrialsLimiter` replaces Ray's ConcurrencyLimiter under ``--scheduler
asha-promote`` (see its docstring).
"""

from __future__ import annotations

from optuna.trial import FrozenTrial, TrialState
from ray.tune.search import ConcurrencyLimiter
from ray.tune.search.optuna import OptunaSearch

#: proposals asked for one trial before a repeat is trained after all
MAX_ASKS = 20


class DistinctOptunaSearch(OptunaSearch):
    """``--search-alg optuna`` / ``optuna-mv``: OptunaSearch minus the repeats, told the
    trials of an earlier search first (``earlier``: extension.EarlierPoint, ``--extend``).

    ``repeats_told`` counts the proposals answered from an earlier trial.  An earlier
    trial told as prior only (another budget) answers no repeat: its configuration is
    trained again on this search's budget."""

    repeats_told = 0

    def __init__(self, *args, earlier=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.earlier = list(earlier)

    def set_search_properties(self, metric, mode, config, **spec) -> bool:
        done = super().set_search_properties(metric, mode, config, **spec)
        if done:  # the study exists now (a restored searcher brings its own: False)
            for point in self.earlier:
                self._tell_earlier(point)
        return done

    def _tell_earlier(self, point) -> None:
        """One earlier trial as an Optuna trial of this study (completed, pruned with its
        evaluations as intermediate values, or failed)."""
        import optuna

        state = {"complete": TrialState.COMPLETE, "pruned": TrialState.PRUNED,
                 "fail": TrialState.FAIL}[point.state]
        self._ot_study.add_trial(optuna.trial.create_trial(
            state=state, value=None if state == TrialState.FAIL else point.value,
            params=point.params, distributions=self._space,
            intermediate_values=dict(enumerate(point.intermediate)) or None,
            user_attrs={"earlier_trial": point.trial_id, "prior": point.prior}))

    def suggest(self, trial_id: str):
        for _ in range(MAX_ASKS - 1):
            config = super().suggest(trial_id)
            # Ray keeps the Optuna trial it asked for under the Tune trial's id
            asked = self._ot_trials[trial_id]
            twin = self._scored_twin(asked.params)
            if twin is None:
                return config
            self._ot_study.tell(asked, twin.value)
            del self._ot_trials[trial_id]  # the next super().suggest asks a new one
            self.repeats_told += 1
        return super().suggest(trial_id)  # the last ask trains, repeat or not

    def _scored_twin(self, params: dict) -> FrozenTrial | None:
        for trial in self._ot_study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
            if trial.params == params and not trial.user_attrs.get("prior"):
                return trial
        return None


class RunningTrialsLimiter(ConcurrencyLimiter):
    """The searcher of ``--scheduler asha-promote``: a limit on the trials *running*, and
    the searcher told each trial's score at the first rung.

    * A ConcurrencyLimiter counts a paused trial as live until it ends; with trials paused
      at rungs it would stop proposing while workers stand idle.  Here the scheduler's
      ``on_pause`` frees a trial's place and ``on_unpause`` takes one.
    * Optuna learns only from finished trials, and under a pausing scheduler most trials
      finish at the end of the search.  So each trial is told to the searcher once, at its
      first result at or past ``first_rung`` (every trial reaches it), with the rung
      metric's value as the objective: every value the searcher sees is at the same
      budget and on the metric the rungs decide on (as BOHB models each budget apart).
      Its later results and its end are not told again."""

    def __init__(self, searcher, max_concurrent: int, first_rung: int, told_metric: str):
        super().__init__(searcher, max_concurrent=max_concurrent)
        self.first_rung, self.told_metric = first_rung, told_metric
        self.told: set[str] = set()

    def on_pause(self, trial_id: str) -> None:
        self.live_trials.discard(trial_id)

    def on_unpause(self, trial_id: str) -> None:
        self.live_trials.add(trial_id)

    def on_trial_result(self, trial_id: str, result: dict) -> None:
        if trial_id not in self.told and result.get("examples_seen", 0) >= self.first_rung:
            self._tell(trial_id, result)

    def on_trial_complete(self, trial_id: str, result: dict | None = None,
                          error: bool = False) -> None:
        self.live_trials.discard(trial_id)
        if trial_id not in self.told:  # ended (errored) before its first rung
            self._tell(trial_id, result, error)

    def _tell(self, trial_id: str, result: dict | None, error: bool = False) -> None:
        self.told.add(trial_id)
        if result and self.told_metric in result:
            result = {**result, self.searcher.metric: result[self.told_metric]}
        self.searcher.on_trial_complete(trial_id, result=result, error=error)
