"""Ray reuses a trial's worker for the next trial (``reuse_actors``) only once the trial it
stopped has ended; the trainable gives a slow step the time to end (trainable.py,
``wait_for_the_step_on_reuse``).  Real Ray, one CPU, a function trainable whose step
outlasts Ray's default wait of 2 s."""

from __future__ import annotations

import time

import pytest

STEP_S = 4.0  # one "training step" after the first report: longer than Ray's default 2 s


def _slow_step_trial(config: dict) -> None:
    """As train_trial runs the Trainer: the report goes from another thread (the trainer's
    checkpoint thread) while this one trains on; a stop raises SystemExit(0) in that
    report, and this thread raises it again at its next step -- here after STEP_S."""
    import threading

    from ray import tune

    from mtbert.tune.trial.trainable import wait_for_the_step_on_reuse
    wait_for_the_step_on_reuse()  # what train_trial does first
    stopped = []

    def report(step: int) -> None:
        try:
            tune.report({"step": step, "score": config["x"]})
        except SystemExit:
            stopped.append(step)

    for step in (1, 2):
        reporter = threading.Thread(target=report, args=(step,))
        reporter.start()
        time.sleep(STEP_S)  # the step in progress when Ray stops the trial (stop: step 1)
        reporter.join()
        if stopped:
            raise SystemExit(0)


@pytest.fixture(scope="module")
def one_cpu_ray():
    import sys

    import ray
    from ray import cloudpickle
    if ray.is_initialized():
        pytest.skip("needs its own one-CPU Ray session")
    # the workers cannot import this test module: its trainable travels by value
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_a_reused_worker_waits_for_the_stopped_trials_step(one_cpu_ray, tmp_path):
    """Trial 1 is stopped after its first report, in a step of 4 s; trial 2 reuses its
    worker.  With Ray's 2 s wait the reset failed and trial 2 errored (Ray 2.60 then never
    tells the searcher: the main job ran on one worker after it); with the trainable's wait
    both trials run on the one worker."""
    from ray import tune
    tuner = tune.Tuner(
        _slow_step_trial, param_space={"x": tune.grid_search([1, 2])},
        tune_config=tune.TuneConfig(reuse_actors=True, metric="score", mode="max"),
        run_config=tune.RunConfig(name="reuse", storage_path=str(tmp_path), verbose=0,
                                  stop={"step": 1}))
    started = time.time()
    grid = tuner.fit()
    assert grid.num_errors == 0, [str(r.error) for r in grid if r.error]
    assert sorted(r.metrics["score"] for r in grid) == [1, 2]
    assert all(r.metrics["step"] == 1 for r in grid)
    # the second trial started after the first one's step ended, on the same worker
    assert time.time() - started >= STEP_S
    assert len({r.metrics["pid"] for r in grid}) == 1
