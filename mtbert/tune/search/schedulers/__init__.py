"""One module a ``--scheduler``: its choice (name, ``--help`` line, the searchers it works
with, its defaults, its builder), registered by :func:`~mtbert.tune.search.choice.register`
as the module is imported.  The Ray subclasses the builders make are in
:mod:`~mtbert.tune.search.schedulers.ray_classes` (they import Ray; the choices must not:
``--help`` reads them).

Adding a scheduler: one module here, and its line below.
"""

# the registry: one line a scheduler (importing a module registers its choice)
from mtbert.tune.search.schedulers import asha  # noqa: F401
from mtbert.tune.search.schedulers import promoting_asha  # noqa: F401
from mtbert.tune.search.schedulers import fifo  # noqa: F401
from mtbert.tune.search.schedulers import bohb  # noqa: F401
from mtbert.tune.search.schedulers import pbt  # noqa: F401
from mtbert.tune.search.schedulers import pb2  # noqa: F401
