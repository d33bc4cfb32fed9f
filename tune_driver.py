#!/usr/bin/env python
"""Distributed hyperparameter search for multitask BERT: ``python tune_driver.py --space smart``.

A thin CLI; everything lives in :mod:`mtbert.tune` (see ``--help`` and
``--list-spaces``).  Exit 0 on success, 2 on bad input (one ``error: ...`` line on
stderr, nothing written), 1 when no trial produced a checkpoint.
"""

import sys

from mtbert.tune.cli import main

if __name__ == "__main__":
    sys.exit(main())
