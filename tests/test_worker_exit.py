"""A trial worker's exit waits for its training thread to leave the GPU
(``mtbert.tune.trial.worker_exit``).  CI has no GPU: where a test needs the process to count
as using CUDA, it says so (``gpu=True``, or in a child process the module's two CUDA
checks replaced), and the waiting is real: real threads, a real ``atexit`` at a real
process exit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from mtbert.tune.trial import worker_exit


@pytest.fixture(autouse=True)
def no_trial_running():
    yield
    worker_exit._off_gpu.set()
    worker_exit._exit_begun.clear()


def test_the_exit_waits_for_the_trial_thread():
    worker_exit.trial_started()
    left_at = []

    def step_then_stop():
        time.sleep(0.4)
        left_at.append(time.perf_counter())
        worker_exit.off_the_gpu()
    threading.Thread(target=step_then_stop).start()
    started = time.perf_counter()
    assert worker_exit.wait_before_exit(timeout=10, gpu=True)
    assert left_at and time.perf_counter() >= left_at[0] >= started + 0.35


def test_a_thread_that_never_leaves_is_waited_for_at_most_the_timeout(capfd):
    worker_exit.trial_started()
    started = time.perf_counter()
    assert worker_exit.wait_before_exit(timeout=0.3, gpu=True) is False
    assert 0.25 <= time.perf_counter() - started < 5
    assert "still on the GPU 0.3 s into the worker's exit" in capfd.readouterr().err


def test_the_exit_tells_a_thread_that_was_never_stopped_to_stop():
    """Tune stopped the trial between its reports: its thread steps on, unaware, until the
    exit marks that it has begun; it stops at its next step, long before the timeout."""
    worker_exit.trial_started()
    steps = []

    def step_until_told():
        while not worker_exit.exit_requested():
            steps.append(time.perf_counter())
            time.sleep(0.01)
        worker_exit.off_the_gpu()
    threading.Thread(target=step_until_told, daemon=True).start()
    time.sleep(0.2)
    assert steps and not worker_exit.exit_requested()
    started = time.perf_counter()
    assert worker_exit.wait_before_exit(timeout=20, gpu=True)
    assert time.perf_counter() - started < 2
    assert worker_exit.exit_requested()


def test_a_trainer_stops_at_the_step_where_it_is_asked_to(tiny_config, tmp_path):
    from mtbert.data import load_data
    from mtbert.loop.trainer import Trainer

    cfg = tiny_config(epochs=3, eval_dev=False, eval_every=0, schedule="round_robin")
    asked = []

    def stop_after_five_steps() -> bool:
        asked.append(1)
        return len(asked) >= 5
    trainer = Trainer(cfg, load_data(cfg), tmp_path, stop_requested=stop_after_five_steps)
    with pytest.raises(SystemExit) as stopped:
        trainer.fit()
    assert stopped.value.code == 0
    # 5 schedule steps of round-robin, each one optimizer step per task
    assert len(asked) == 5 and trainer.step_in_epoch == 5 and trainer.optimizer_steps == 15
    # no evaluation after the start's: stopped before epoch 1 ended
    assert [h["examples_seen"] for h in trainer.history] == [0] * len(trainer.history)


def test_nothing_waits_without_cuda_or_without_a_trial():
    worker_exit.trial_started()
    started = time.perf_counter()
    assert worker_exit.wait_before_exit(timeout=10, gpu=False)
    worker_exit.off_the_gpu()  # on a CPU: no device to wait for, the mark is set
    assert worker_exit.wait_before_exit(timeout=10, gpu=True)
    assert time.perf_counter() - started < 1


def test_a_process_exit_waits_for_its_trial_thread(tmp_path):
    """sys.exit (as Ray's exit_actor raises) while a daemon trial thread still steps: the
    atexit handler holds the exit until the thread marks itself off the GPU."""
    mark = tmp_path / "left"
    child = textwrap.dedent(f"""
        import sys, threading, time
        from mtbert.tune.trial import worker_exit
        worker_exit._cuda_in_use = lambda: True  # as on a GPU worker
        worker_exit._synchronize = lambda: None
        worker_exit.trial_started()
        def step_then_stop():
            time.sleep(0.5)
            open({str(mark)!r}, "w").write("off")
            worker_exit.off_the_gpu()
            threading.Event().wait()  # parks, as a stopped trial's thread does
        threading.Thread(target=step_then_stop, daemon=True).start()
        sys.exit(0)
    """)
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert mark.read_text() == "off"  # a daemon thread is gone once the process is


def test_a_ray_actor_ended_as_tune_ends_it_runs_the_exit_wait(shared_ray, tmp_path):
    """Tune ends a stopped trial's actor with ``__ray_terminate__`` (``kill=False``): the
    worker process exits through Python's atexit, so the wait above runs there, and tells
    the trial thread, which was never told of the stop, to stop."""
    import ray

    mark = tmp_path / "waited"

    @ray.remote(num_cpus=0)
    class Worker:
        def start(self, mark_path):
            from mtbert.tune.trial import worker_exit
            worker_exit._cuda_in_use = lambda: True  # as on a GPU worker
            worker_exit._synchronize = lambda: None
            worker_exit.trial_started()

            def step_until_told():
                while not worker_exit.exit_requested():
                    time.sleep(0.01)
                with open(mark_path, "w") as f:
                    f.write("off")
                worker_exit.off_the_gpu()
                threading.Event().wait()
            threading.Thread(target=step_until_told, daemon=True).start()
            return "started"

        def pid(self):
            return os.getpid()

    worker = Worker.remote()
    assert ray.get(worker.start.remote(str(mark))) == "started"
    pid = ray.get(worker.pid.remote())
    started = time.monotonic()
    ended = worker.__ray_terminate__.remote()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(ended, timeout=60)
    while process_alive(pid) and time.monotonic() < started + 60:
        time.sleep(0.1)
    assert not process_alive(pid)
    assert mark.read_text() == "off"  # told by the exit, before the process was gone
    # at its next step, not at the wait's timeout (worker_exit.EXIT_WAIT_S, 30 s)
    assert time.monotonic() - started < 15


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
