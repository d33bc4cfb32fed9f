"""The search proper: the space, the budgets, the registry of schedulers and searchers
(one file a scheduler: :mod:`mtbert.tune.search.schedulers`), and the Ray Tuner built from
them.  Imports :mod:`mtbert.tune.trial` only."""
