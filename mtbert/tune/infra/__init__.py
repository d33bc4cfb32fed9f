"""Where a search runs and what it talks to: Ray (local or a cluster), the CUDA MPS daemon,
the experiment's storage location and the MLflow store.  Imports nothing of the other
search packages."""
