"""A trial's config: the search's base values merged with the values its searcher sampled.

What a Ray worker needs of the search's settings, and nothing more: :func:`trial_config`
is the one merge (the trainable, the MLflow callback and the summary use it), so a worker
imports this module, not the command line's settings (:mod:`~mtbert.tune.settings`).
"""

from __future__ import annotations

from typing import Any

from mtbert.core.config import TrainConfig
from mtbert.core.errors import ConfigError


def trial_config(base: dict[str, Any], sampled: dict[str, Any]) -> TrainConfig:
    """A trial's TrainConfig: the base values, then its sampled ones (never scoring dev:
    dev is scored for the ensemble's finalists only).  Raises ConfigError."""
    return TrainConfig.from_dict({**base, **sampled, "eval_dev": False}, source="trial config")


def trial_config_values(base: dict[str, Any], sampled: dict[str, Any]) -> dict[str, Any]:
    """Every TrainConfig field of a trial (defaults included); the raw values if invalid."""
    try:
        return trial_config(base, sampled).to_dict()
    except ConfigError:
        return {**base, **sampled, "eval_dev": False}
