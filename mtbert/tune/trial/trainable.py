"""The Ray Tune function trainable: one trial = one :class:`~mtbert.loop.trainer.Trainer` run.

``tune.with_parameters(train_trial, data=..., base=...)`` puts the tokenised
:class:`~mtbert.data.MultitaskData` into Ray's object store once; every trial gets it
from there (no trial reads or tokenises files).  The trial's config is
``TrainConfig.from_dict(base | trial config)`` with ``eval_dev=False`` (dev files are
scored only for the ensemble finalists, by the driver).

After every validation evaluation the trainer writes a checkpoint folder (model state
and that evaluation's validation predictions as Parquet) and calls back, both on its
checkpoint thread while training goes on; the callback
hands the folder to Ray with ``tune.report(scalar metrics, checkpoint=tune.Checkpoint)``
(plus ``node_id``, the Ray node that ran the evaluation) -- Ray
copies it to the storage path before the trainer overwrites it at the next evaluation.
A retried trial (worker lost, ``FailureConfig``) resumes from ``tune.get_checkpoint()``.
Each run of a trial (from its start, or from the checkpoint Ray restored it from) writes
how far it trained into the trial folder (``trained_log.TrainedLog``): at its start, at each
report and where it ends -- a stop or pause reaches the trainer at its next step, and a
worker that Tune ends while its trial trains writes it on its way out -- so the
examples trained after the last report are counted.

Deterministic failures (an invalid config combination, a NaN loss) raise
:class:`TrialFailed` with the reason; the reason is also written to the trial folder so
a retry fails at once instead of training again into the same NaN.
"""

from __future__ import annotations

import atexit
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from mtbert.core.config import PERTURBED
from mtbert.core.errors import ConfigError
from mtbert.run.metrics import scalar_metrics
from mtbert.tune.trial import work_folders, worker_exit
from mtbert.tune.trial.objective import BEST_OBJECTIVE, OBJECTIVE, RUN_KEYS
from mtbert.tune.trial.thread_share import thread_share
from mtbert.tune.trial.trained_log import TrainedLog
from mtbert.tune.trial.trial_config import trial_config

FAILED_MARKER = "mtbert_failed.txt"

# Each report carries the val/*, train/* and run counters (RUN_KEYS) of the evaluation and,
# besides the trainer's time/* seconds (setup, train, eval, checkpoint): time/entered_at
# (Unix time the trial function was entered in its Ray actor, after Ray started the actor
# and fetched the data from the object store), time/startup_s (entry to a ready Trainer:
# imports, model load, setup), time/cpu_s (CPU seconds of the actor process since entry,
# all threads), time/reported_at (Unix time of this report; Ray's timestamp is whole
# seconds) and train/threads (torch's CPU threads the trial trains with at the report: the
# CPUs Ray holds for it, plus its share of its node's free CPUs with grow_threads).

#: first in the report: Ray's progress table shows the first four metrics
HEADLINE = (OBJECTIVE, BEST_OBJECTIVE, "val/sst_acc", "val/qqp_acc", "val/sts_corr")


def ray_metrics(metrics: dict, history: list[dict] = ()) -> dict[str, float]:
    """The scalar metrics of one evaluation as reported to Ray (headline keys first), with
    the running best of the objective over ``history`` (every evaluation so far, this one
    included, as the Trainer keeps them across a resume)."""
    scalars = scalar_metrics(metrics)
    scores = [scalar_metrics(h, finite=True).get(OBJECTIVE) for h in history]
    scores = [s for s in scores if s is not None]
    if scores:
        scalars[BEST_OBJECTIVE] = max(scores)
    if "lr" in scalars:
        scalars["train/lr"] = scalars.pop("lr")
    keep = {k: v for k, v in scalars.items()
            if k.startswith(("val/", "train/", "time/", "best/")) or k in RUN_KEYS}
    ordered = {k: keep[k] for k in HEADLINE if k in keep}
    ordered.update({k: v for k, v in keep.items() if k not in ordered})
    return ordered


class TrialFailed(RuntimeError):
    """A trial that cannot succeed (bad config combination, NaN loss); not worth a retry."""


def train_trial(config: dict[str, Any], data=None, base: dict[str, Any] | None = None,
                ended: dict[str, dict[str, str]] | None = None,
                grow_threads: bool = True) -> None:
    """Function trainable (see module docstring); ``data`` and ``base`` via with_parameters.

    ``ended`` (on ``--resume``): trials the driver had seen end before it died; Ray's
    experiment snapshot may still list them as running, so Tuner.restore would train
    them again -- they return at once (or fail again with their recorded reason).
    ``grow_threads`` (``--trial-threads grow``): a CPU trial trains on its share of its
    node's free CPUs too (:mod:`mtbert.tune.trial.thread_share`)."""
    entered_at, cpu_at_entry = time.time(), time.process_time()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    wait_for_the_step_on_reuse()
    from ray import tune

    done = (ended or {}).get(tune.get_context().get_trial_id())
    if done is not None:
        if done["status"] == "FAILED":
            raise TrialFailed(done.get("error_reason") or "failed before the search was resumed")
        return  # ended before the driver restarted: nothing to train, nothing to report
    trial_dir = Path(tune.get_context().get_trial_dir())
    marker = trial_dir / FAILED_MARKER
    if marker.is_file():  # a retry of a deterministic failure: fail again at once
        raise TrialFailed(marker.read_text(encoding="utf-8"))
    try:
        _run(config, data, base or {}, tune, entered_at, cpu_at_entry, grow_threads)
    except TrialFailed as exc:
        mark_failed(marker, str(exc))
        raise
    except Exception as exc:
        from mtbert.loop.trainer import NonFiniteLossError  # deferred: torch
        if isinstance(exc, NonFiniteLossError):
            mark_failed(marker, f"non-finite loss: {exc}")
            raise TrialFailed(f"non-finite loss: {exc}") from None
        raise


#: seconds Ray waits, when it reuses this worker for another trial, for the trial it
#: stopped or paused to reach its next step and end (Ray's default: 2)
REUSE_WAIT_S = 120


def wait_for_the_step_on_reuse() -> None:
    """Give Ray's ``FunctionTrainable.reset_config`` (read in this worker process, as it
    reuses the worker for another trial) time for the trial it stopped or paused to end:
    its training thread notices the stop only at its next step, and a step can take longer
    than Ray's 2 s (``TUNE_FUNCTION_THREAD_TIMEOUT_S``): a SMART step of 32 examples on
    one CPU thread, or an evaluation in progress.  Past the wait the reset fails, and
    Ray 2.60 then errors the next trial without telling the searcher, whose limit goes on
    counting it (docs/search.md, "Ray workers")."""
    os.environ.setdefault("TUNE_FUNCTION_THREAD_TIMEOUT_S", str(REUSE_WAIT_S))


def _wait_for_the_actor_to_exit(work: Path) -> None:
    """Tune stopped this trial (ASHA) and ends the actor: ``tune.report`` raised
    SystemExit(0) in the trainer's checkpoint thread, which the trainer raised again in
    this thread (Ray's runner thread) at its next step, and Ray ends the actor's process
    now without waiting for it.  Unwinding from here would free the model's tensors while
    the interpreter shuts down: a thread taking the GIL back during ``Py_Finalize`` is
    ended by ``pthread_exit``, whose forced unwind through libtorch's C++ frames calls
    ``std::terminate`` -- the SIGABRT and backtrace seen in smoke searches (traced in
    ``THPVariable_dealloc``).  So nothing is freed: the work folder goes (plain file
    calls), and the thread waits, holding everything, until the process is gone.

    Not so when Ray keeps the actor for another trial (``reuse_actors``): then it is in
    ``FunctionTrainable.reset_config``, waiting (``TUNE_FUNCTION_THREAD_TIMEOUT_S``:
    :data:`REUSE_WAIT_S`) for this thread to end -- a thread that never ends makes the reset fail and the next
    trial error.  The process lives on, so unwinding is safe: SystemExit goes up and the
    Trainer is freed as the stack unwinds.

    Either way the GPU has finished this thread's work first: the process's exit waits
    for that (:mod:`mtbert.tune.trial.worker_exit`; under CUDA MPS a process ending with
    kernels in flight faults the GPU's other trials)."""
    worker_exit.off_the_gpu()
    if _actor_is_being_reset():
        raise SystemExit(0)
    shutil.rmtree(work, ignore_errors=True)
    threading.Event().wait()


def _actor_is_being_reset() -> bool:
    """Whether another thread of this process is in Ray's ``FunctionTrainable.reset_config``
    (it set the stop event this thread woke up to, and waits there for it to end)."""
    me = threading.get_ident()
    for ident, frame in sys._current_frames().items():
        while ident != me and frame is not None:
            code = frame.f_code
            if code.co_name == "reset_config" and code.co_filename.endswith(
                    "function_trainable.py"):
                return True
            frame = frame.f_back
    return False


#: the runs of this worker still training: what the worker's exit writes (TrainedLog)
_RUNS: dict[TrainedLog, Any] = {}
_RUNS_LOCK = threading.Lock()
_RUNS_AT_EXIT: list[bool] = []  # the exit's hook is registered (once per process)


def _running(run: TrainedLog, examples_seen) -> None:
    """``run`` trains: should the worker's process exit before it ends (Tune stopped or
    paused the trial between its reports, and ends the worker without waiting for its
    thread), the exit writes how far it got (``examples_seen()``, read from the thread
    still training: the steps it finished)."""
    with _RUNS_LOCK:
        if not _RUNS_AT_EXIT:
            atexit.register(_write_running)
            _RUNS_AT_EXIT.append(True)
        _RUNS[run] = examples_seen


def _run_ended(run: TrainedLog, examples_seen: int, how: str) -> None:
    """The run's end: written once (a stopped run first, then its ``finally``)."""
    with _RUNS_LOCK:
        if _RUNS.pop(run, None) is None:
            return
    run.write(examples_seen, how)


def _write_running() -> None:
    """(atexit) Each run still training says how far it got (its thread, if it reaches
    its next step before the process ends -- a GPU worker's exit waits for that:
    worker_exit -- writes its end after this)."""
    with _RUNS_LOCK:
        running = list(_RUNS.items())
    for run, examples_seen in running:
        run.write(examples_seen(), "worker exit")


def search_start_scores(storage):
    """Where the search's trials keep their scores at 0 examples
    (:mod:`mtbert.run.start_scores`): ``start_scores`` in the search's folder, where that
    folder is on this machine's file system (local or mounted); None on other storage
    (each trial then scores its own)."""
    import pyarrow.fs

    from mtbert.run.start_scores import StartScores  # deferred: torch
    if not isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem):
        return None
    return StartScores(Path(storage.experiment_fs_path) / "start_scores")


def mark_failed(marker: Path, reason: str) -> None:
    """Write a failed trial's reason where its records read it (best effort)."""
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(reason, encoding="utf-8")
    except OSError:
        pass


def _run(config: dict[str, Any], data, base: dict[str, Any], tune, entered_at: float,
         cpu_at_entry: float, grow_threads: bool) -> None:
    import logging

    import transformers

    from mtbert.loop.trainer import Trainer  # deferred: torch, transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("ray.train._internal.storage").setLevel(logging.WARNING)
    held = tune.get_context().get_trial_resources().required_resources
    if base.get("threads"):  # torch threads = the CPUs Ray holds for this trial
        cpus = held.get("CPU", 0)
        base = {**base, "threads": max(1, int(cpus))} if cpus >= 1 else base
    try:
        cfg = trial_config(base, config)
    except ConfigError as exc:
        raise TrialFailed(f"invalid trial config: {exc}") from None
    work_folders.sweep()  # the folders of this node's earlier trials whose worker is gone
    work = work_folders.make()

    import ray
    node_id = ray.get_runtime_context().get_node_id()  # which node ran it (the IP may be shared)

    startup: dict[str, float] = {}
    # what PBT / PB2 may change between a trial's evaluations, as this run trains with it
    # (MLflow params are written once, at the trial's start)
    perturbable = {f"config/{k}": getattr(cfg, k) for k in PERTURBED}

    def report(metrics: dict, checkpoint_dir: str | None) -> None:
        # the checkpoint folder holds the model state and this evaluation's val predictions
        timing = {"time/entered_at": entered_at, **startup, **perturbable,
                  "train/threads": trainer.threads,
                  "time/cpu_s": time.process_time() - cpu_at_entry,
                  "time/reported_at": time.time()}
        # on the trainer's checkpoint thread, once the checkpoint is written; a stop raises
        # SystemExit(0) here, which the trainer raises again in the training thread
        run.write(trainer.examples_seen, "reported")  # training went on since the evaluation
        tune.report({**ray_metrics(metrics, trainer.history), **timing, "node_id": node_id},
                    checkpoint=(tune.Checkpoint.from_directory(checkpoint_dir)
                                if checkpoint_dir else None))

    worker_exit.trial_started()
    try:
        checkpoint = tune.get_checkpoint()
        resume_from = None
        if checkpoint is not None:
            resume_from = Path(checkpoint.to_directory(str(work / "restored")))
        storage = tune.get_context().get_storage()
        try:
            trainer = Trainer(cfg, data, work / "run", report=report, resume_from=resume_from,
                              stop_requested=worker_exit.exit_requested,
                              threads_wanted=thread_share(held, node_id) if grow_threads
                              else None, start_scores=search_start_scores(storage))
        except ConfigError as exc:  # e.g. a compile mode this worker's device cannot run
            raise TrialFailed(f"invalid trial config: {exc}") from None
        startup["time/startup_s"] = time.time() - entered_at
        run = TrainedLog(storage.storage_filesystem, storage.trial_fs_path,
                         trainer.examples_seen)
        _running(run, lambda: trainer.examples_seen)
        how = "failed"
        try:
            trainer.fit()
            how = "ended"
        except SystemExit as exc:
            if exc.code not in (0, None):
                raise
            _run_ended(run, trainer.examples_seen, "stopped")  # (before the thread parks)
            _wait_for_the_actor_to_exit(work)
        finally:
            _run_ended(run, trainer.examples_seen, how)
    finally:
        worker_exit.off_the_gpu()  # returned or raised: the exit need not wait for it
        shutil.rmtree(work, ignore_errors=True)
