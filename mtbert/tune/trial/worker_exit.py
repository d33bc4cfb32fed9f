"""A trial worker's process ends only once its training thread has left the GPU.

When Tune stops a trial that it does not reuse the worker for, it calls the actor's
``stop`` (which does not wait for the training thread) and then ``__ray_terminate__``:
the process exits, running its ``atexit`` handlers, while the training thread may still
have a step's kernels queued or be launching the next graph replay.  Alone on a GPU that
costs nothing.  Under CUDA MPS (``--mps``) a client that ends with work in flight faults
every other client of the GPU: on one H200 (2026-11-27) a trainer beside a process
killed mid-replay failed with ``cudaErrorDevicesUnavailable``, and in a full ``smart``
search the 3 trials still training failed together (illegal address, SIGSEGV in
``cuGraphLaunch``) 8 s after the scheduler ended 5 others; Ray restored them from their
checkpoints.

So a trial marks when it starts (:func:`trial_started`) and when its thread is off the
GPU (:func:`off_the_gpu`: every queued kernel finished; called where the thread parks
for the process to end, and where the trial returns or raises), and the process's exit
waits for that mark, at most :data:`EXIT_WAIT_S`, then waits for the device itself.
Without CUDA in use nothing waits.

The thread must also learn that it is to stop.  A stop that Tune sends while the trial's
report is in flight reaches it through that report (``SystemExit`` at its next step);
but Tune also stops trials between their reports (the promoting scheduler ends, on one
trial's result, the others it will never promote: 5 at once in that search), and such a
thread would only learn of it at its next evaluation, stepping through the whole exit.
So the exit first marks that it has begun (:func:`exit_requested`, which the trainer
asks after every step), and the thread stops at its next step: milliseconds from
graphs, an evaluation at most.
"""

from __future__ import annotations

import atexit
import sys
import threading

#: the longest a worker's exit waits for its training thread to leave the GPU
EXIT_WAIT_S = 30.0

_off_gpu = threading.Event()
_off_gpu.set()
_exit_begun = threading.Event()
_registered = False


def trial_started() -> None:
    """A trial's thread begins using the GPU: the process's exit now waits for it."""
    global _registered
    _off_gpu.clear()
    if not _registered:
        atexit.register(wait_before_exit)
        _registered = True


def off_the_gpu() -> None:
    """The calling trial thread has no more work for the GPU: wait for what it queued."""
    _synchronize()
    _off_gpu.set()


def exit_requested() -> bool:
    """Whether this process's exit has begun: its trial thread should stop now."""
    return _exit_begun.is_set()


def wait_before_exit(timeout: float = EXIT_WAIT_S, gpu: bool | None = None) -> bool:
    """(atexit) Wait for the trial thread to be off the GPU, then for the device; False
    where the thread did not get there in ``timeout`` seconds.  ``gpu``: whether this
    process uses CUDA (default: torch says)."""
    if not (_cuda_in_use() if gpu is None else gpu):
        return True
    _exit_begun.set()  # the trial thread stops at its next step (exit_requested)
    done = _off_gpu.wait(timeout)
    if not done:
        print(f"[mtbert] the trial thread was still on the GPU {timeout:g} s into the "
              "worker's exit", file=sys.stderr, flush=True)
    _synchronize()
    return done


def _cuda_in_use() -> bool:
    torch = sys.modules.get("torch")  # a worker that never imported torch used no GPU
    return torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    if _cuda_in_use():
        sys.modules["torch"].cuda.synchronize()
