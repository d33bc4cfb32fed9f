"""Ray's OptunaSearch that does not train a configuration it has already scored.

In a space of steps and choices (``quniform``, ``randint``, ``choice``) TPE proposes
configurations it has already tried: the bench's stepped search trained dropout 0.1,
lambda_s 1 twice in one seed, 2,000 examples for a score it had (the trainings are
seeded, so the repeat scored the same to the last digit).  Here a proposal equal to a
finished trial's is told that trial's value at once -- the answer Optuna's FAQ gives for
repeated parameters -- and the sampler is asked again.  After ``MAX_ASKS`` repeats in a
row the repeat trains (TPE can insist on its favourite while other configurations are
left).  In a continuous space proposals never repeat exactly, and nothing changes.
"""

from __future__ import annotations

from optuna.trial import FrozenTrial, TrialState
from ray.tune.search.optuna import OptunaSearch

#: proposals asked for one trial before a repeat is trained after all
MAX_ASKS = 20


class DistinctOptunaSearch(OptunaSearch):
    """``--search-alg optuna`` / ``optuna-mv``: OptunaSearch minus the repeats.

    ``repeats_told`` counts the proposals answered from an earlier trial."""

    repeats_told = 0

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
            if trial.params == params:
                return trial
        return None
