"""Ray's per-trial result logs (``result.json``, ``progress.csv``), kept whole when a trial
starts again.

Ray 2.60's JSON and CSV loggers, when a trial with a checkpoint starts again (a promoted
trial that was paused, a PBT restart, a retry), copy the storage copy of the log over the
driver's local one (``LoggerCallback._restore_from_remote``).  The storage copy is
refreshed only by the experiment sync (every 10 s or more, later under load), so the rows
the driver wrote since the last sync are lost -- and the search reads each trial's history
from these files (``Result.metrics_dataframe``).  These loggers restore from storage only
where the driver has no local copy: a ``--resume`` in a new Ray session (its staging folder
is new) still starts from what storage holds."""

from __future__ import annotations

from pathlib import Path

from ray.tune.logger import CSVLoggerCallback, JsonLoggerCallback


class _KeepLocalRows:
    """A logger that restores a trial's file from storage only where the driver's local
    copy is missing or empty."""

    def _restore_from_remote(self, file_name: str, trial) -> None:
        local = Path(trial.local_path, file_name)
        if local.is_file() and local.stat().st_size > 0:
            return
        super()._restore_from_remote(file_name, trial)


class JsonRowsLogger(_KeepLocalRows, JsonLoggerCallback):
    """``result.json``: one JSON line per result."""


class CsvRowsLogger(_KeepLocalRows, CSVLoggerCallback):
    """``progress.csv``: one row per result."""


def result_loggers() -> list:
    """The loggers a Tuner runs with in place of Ray's defaults (Ray adds its own JSON and
    CSV loggers only where none of those classes is among the callbacks)."""
    return [JsonRowsLogger(), CsvRowsLogger()]
