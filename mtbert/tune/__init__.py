"""Distributed hyperparameter search: the only package that imports Ray, Optuna and MLflow.

Run it with ``python tune_driver.py --space NAME`` (``--help``, ``--list-spaces``)::

    python tune_driver.py --space smart                         # small budget, MiniLM
    python tune_driver.py --space smoke --budget smoke \\
        --model tests/tiny-bert --data-dir /tmp/tiny-data       # a minute, for a first look
    python tune_driver.py --space full --budget full --gpus-per-trial 0.5 --address auto
    python tune_driver.py --resume --experiment smart-small-20250101-120000

A search, as :func:`mtbert.tune.driver.run` reads: :mod:`~mtbert.tune.cli` parses the
arguments, :mod:`~mtbert.tune.settings` checks them into one frozen ``SearchSettings``
(exit 2, nothing written, on bad input), the driver loads and tokenises the data once,
starts or joins Ray (:mod:`~mtbert.tune.infra.cluster`), opens the MLflow parent run
(:mod:`~mtbert.tune.infra.tracking`), runs the Tuner (:mod:`~mtbert.tune.search.tuner`: Optuna TPE
+ ASHA over :mod:`~mtbert.tune.trial.trainable` trials, each mirrored into MLflow by
:mod:`~mtbert.tune.results.callback`), collects the trials (:mod:`~mtbert.tune.results.records`), lets
the finalists' best checkpoints predict and ensembles them (:mod:`~mtbert.tune.results.finalists`),
writes the plots (:mod:`~mtbert.tune.results.report`) and the summary
(:mod:`~mtbert.tune.results.summary`), logs to MLflow and uploads (:mod:`~mtbert.tune.infra.location`).

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
