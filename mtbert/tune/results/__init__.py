"""What a search keeps once Ray is done: the trial records, an earlier search's trials
(``--extend``), the finalists' predictions and the ensemble, the summary, the plots and
importances, the MLflow runs, the kept weights.  Above trial, search and infra."""
