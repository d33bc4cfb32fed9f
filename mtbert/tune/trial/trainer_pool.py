"""The fused path's trainer actors over one search: started before Tune's loop, read after
it, stopped with it (:class:`TrainerPool`).

A trainer whose process dies (a crash, ``kill -9``, its GPU lost) is restarted by Ray under
its name (:data:`~.group_trainer.TRAINER_RESTARTS`).  Its constructor takes the tokenised
data from Ray's object store by reference, so the pool holds that reference for the whole
search: Ray keeps an actor's constructor arguments only while someone refers to them (a
restart after they are gone fails with ``ReferenceCountingAssertionError``, ray-project/ray
#53727).  Nothing here fails on a dead or restarting trainer: its line says so.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from mtbert.tune.trial.fused_trainable import first_line
from mtbert.tune.trial.group_trainer import TRAINER_PREFIX, TRAINER_RESTARTS, GroupTrainer

#: the logger of Tune's trial failures (with their tracebacks)
TUNE_CONTROLLER_LOG = "ray.tune.execution.tune_controller"
#: seconds the driver waits for a trainer's answer after Tune's loop (a restarting trainer
#: answers once its constructor has run again: the data, the imports)
ANSWER_S = 60.0


@dataclass
class TrainerPool:
    """The trainer actors of one search and the data reference their restarts need."""
    handles: list[Any]
    data_ref: Any

    @classmethod
    def start(cls, data, count: int, cpus: float, gpus: float, threads: int) -> "TrainerPool":
        """``count`` trainer actors named :data:`TRAINER_PREFIX` + number, each with
        ``cpus`` CPUs and ``gpus`` GPUs; the data put in Ray's object store once for all."""
        import ray  # deferred: ray
        data_ref = ray.put(data)
        actor = ray.remote(GroupTrainer)
        handles = [actor.options(name=f"{TRAINER_PREFIX}{i}", num_cpus=cpus, num_gpus=gpus,
                                 max_concurrency=4, max_restarts=TRAINER_RESTARTS).remote(
                                     data_ref, threads)
                   for i in range(count)]
        logging.getLogger(TUNE_CONTROLLER_LOG).addFilter(ONE_LINE_TRAINER_LOST)
        return cls(handles, data_ref)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f"{TRAINER_PREFIX}{i}" for i in range(len(self.handles)))

    def placement_line(self, wait_s: float = ANSWER_S) -> str:
        """How the trainers placed the trials and how each one's latest join ended (after
        Tune's loop; a trainer that restarted counts from its restart); a trainer that
        does not answer (dead, or still restarting after ``wait_s``) is said so."""
        import ray  # deferred: ray
        parts = []
        for i, handle in enumerate(self.handles):
            try:
                ray.get(handle.tune_ended.remote(), timeout=wait_s)
                p = ray.get(handle.placement.remote(), timeout=wait_s)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                parts.append(f"trainer {i}: no answer ({first_line(exc)})")
                continue
            restarted = f", restarted {p['restarts']}x" if p.get("restarts") else ""
            parts.append(f"trainer {i}: {p['trials']} trials in {p['groups']} groups, at most "
                         f"{p['largest']} at once, {p['alone']} alone (unfusable); ended "
                         f"{p['finished']} finished, {p['stopped']} stopped, {p['failed']} "
                         f"failed, {p['training']} training{restarted}")
        return "fused: " + "; ".join(parts)

    def stop(self, wait_s: float = 30.0) -> None:
        """The trainers end with Tune's loop (not restarted): each removes its working
        folder (every incarnation's) if it answers, then is killed; their names are free
        again before this returns (a ``--resume`` in the same Ray names its trainers alike)."""
        import ray  # deferred: ray
        logging.getLogger(TUNE_CONTROLLER_LOG).removeFilter(ONE_LINE_TRAINER_LOST)
        closing = [h.close.remote() for h in self.handles]
        try:
            ray.wait(closing, num_returns=len(closing), timeout=10)
        except Exception:  # a dead trainer: nothing to close
            pass
        for handle in self.handles:
            ray.kill(handle, no_restart=True)
        deadline = time.time() + wait_s
        for name in self.names:
            while time.time() < deadline:
                try:
                    ray.get_actor(name)
                except ValueError:  # gone
                    break
                time.sleep(0.1)


class _OneLineTrainerLost(logging.Filter):
    """Tune logs each failed run of a trial with its traceback; a run that failed because
    its trainer died (``TrainerLost``: Tune retries it from its checkpoint) is expected,
    so its record keeps one line: Tune's message and the reason."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        lines = [ln.strip() for ln in str(exc).splitlines() if "TrainerLost:" in ln]
        if exc is not None and lines:
            record.msg, record.args = f"{record.getMessage()}: {lines[-1]}", ()
            record.exc_info, record.exc_text = None, None
        return True


ONE_LINE_TRAINER_LOST = _OneLineTrainerLost()
