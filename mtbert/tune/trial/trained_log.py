"""How far each run of a trial trained: a file per run in the trial folder, so that the
examples a trial trained past its last report (before a stop or a pause) and again after a
restore are counted (records.py adds them up as ``examples_trained``)."""

from __future__ import annotations

import json
import os
import sys
import threading
import time

#: the folder of a trial (beside its checkpoints) where each of its runs says how far it
#: trained (:class:`TrainedLog`)
TRAINED_FOLDER = "mtbert_trained"


class TrainedLog:
    """How far one run of a trial trained: a file in its trial folder,
    ``mtbert_trained/<start ns>-<pid>.json`` = ``{"from": examples seen at its start,
    "to": as far as it trained, "how": ..., "at": Unix time}``.

    A run is a trial's training from its start, or from the checkpoint Ray restored it
    from (a paused trial resumed, a retry after a worker failure, PBT's exploit), to
    where it ended: it is written at the start, at each report and where the run ends --
    its end, a stop or a pause (the stop reaches the trainer at its next step), an error,
    its worker's exit.  So the examples a trial trained after its last report before a
    stop or a pause, and those it trained again from an earlier checkpoint, are counted
    (:attr:`TrialRecord.examples_trained`); a worker killed outright leaves its run's
    last report.  ``fs``: the storage's pyarrow filesystem; ``trial_path``: the trial
    folder on it.  The trial's checkpoint thread, its training thread and the worker's
    exit may write it: one at a time, ``to`` never going back.  A write that fails is a
    warning on the worker's log, never the trial's failure."""

    def __init__(self, fs, trial_path: str, start: int):
        self.fs = fs
        self.folder = f"{str(trial_path).rstrip('/')}/{TRAINED_FOLDER}"
        self.path = f"{self.folder}/{time.time_ns()}-{os.getpid()}.json"
        self.start = self.to = int(start)
        self._lock = threading.Lock()
        self.write(self.start, "started")

    def write(self, examples: int, how: str) -> None:
        with self._lock:
            self.to = max(self.to, int(examples))
            doc = {"from": self.start, "to": self.to, "how": how, "at": time.time()}
            try:
                self.fs.create_dir(self.folder, recursive=True)
                with self.fs.open_output_stream(self.path + ".tmp") as out:
                    out.write(json.dumps(doc).encode("utf-8"))
                self.fs.move(self.path + ".tmp", self.path)  # never half a file
            except OSError as exc:
                print(f"[mtbert] warning: could not write {self.path} ({exc}): the examples "
                      "this run trained are counted to its last report", file=sys.stderr,
                      flush=True)
