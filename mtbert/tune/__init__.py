"""Distributed hyperparameter search: the only package that imports Ray, Optuna and MLflow.

Run it with ``python tune_driver.py --space NAME`` (``--help``, ``--list-spaces``)::

    python tune_driver.py --space smart                         # small budget, MiniLM
    python tune_driver.py --space smoke --budget smoke \\
        --model tests/tiny-bert --data-dir /tmp/tiny-data       # a minute, for a first look
    python tune_driver.py --space full --budget full --gpus-per-trial 0.5 --address auto
    python tune_driver.py --resume --experiment smart-small-20250101-120000

Modules:

* :mod:`~mtbert.tune.spaces`    -- YAML search spaces (``search_spaces/``), validated
  against :class:`~mtbert.config.TrainConfig`, mapped to Ray Tune / Optuna distributions;
* :mod:`~mtbert.tune.budgets`   -- ``smoke | small | medium | full``: examples per trial,
  evaluation interval, ASHA grace period / reduction factor, data slice, defaults;
* :mod:`~mtbert.tune.trainable` -- the function trainable around the Trainer
  (``tune.report`` + ``tune.Checkpoint`` after each evaluation, ``get_checkpoint`` on retry);
* :mod:`~mtbert.tune.driver`    -- CLI, validation (exit 2, nothing written), Ray / Tuner
  setup (Optuna TPE behind a ConcurrencyLimiter or random search; ASHA on examples seen;
  best-k checkpoints by ``val/overall``; FailureConfig retries), the end-of-search steps;
* :mod:`~mtbert.tune.tracking` + :mod:`~mtbert.tune.callback` -- MLflow parent / child /
  ensemble runs, logged from the driver by a ``ray.tune.Callback``;
* :mod:`~mtbert.tune.finalize`  -- trial records, ensemble of the top-k best checkpoints
  (:mod:`mtbert.ensemble`), summary.json / summary.md;
* :mod:`~mtbert.tune.report`    -- best-so-far and learning-curve plots, Optuna importances.

Outputs of a search ``<storage>/<experiment>/`` (default ``./ray_results/...``):
Ray's trial folders and checkpoints, ``summary.json``, ``summary.md``,
``best_so_far.png``, ``learning_curves.png``, ``importances.{png,json}``,
``ensemble/predictions/*-output.csv`` (CS 224N format) and ``best_trial/predictions``.

Comparing runs in MLflow (default store ``sqlite:///<storage>/mlflow.db``, no server)::

    mlflow ui --backend-store-uri sqlite:///$PWD/ray_results/mlflow.db --host 127.0.0.1

then open http://127.0.0.1:5000, experiment ``mtbert/<space>``: each search is a parent
run (expand it for one child run per trial plus the ensemble run).  Select the children
and *Compare*: parallel coordinates of the params against ``val/overall``, the
``val/overall`` history per trial (x axis = step = examples seen; short curves are the
trials ASHA stopped, tag ``stopped_early``), and the tags ``status`` / ``rung_reached``
/ ``error_reason``.  The parent run's artifacts hold ``report/best_so_far.png``,
``report/learning_curves.png``, ``report/importances.png`` and ``summary.md``.
"""
