"""What every ``--scheduler`` and ``--search-alg`` choice declares (:class:`Choice`), and the
two tables a choice registers in by its flag (:func:`register`): the registry the command
line, the settings' checks, the Tuner and the benches read."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, ClassVar

from mtbert.core.errors import ConfigError

#: the default search: promoting ASHA (deciding on its ``default_rung_metric``) + Optuna's
#: independent TPE, what bench/search_efficiency.py ranks first among the pairs it measured
#: over 3 seeds (docs/bench/search_efficiency.md)
DEFAULT_SCHEDULER = "asha-promote"
DEFAULT_SEARCHER = "optuna"


@dataclass(frozen=True)
class Extra:
    """The modules a choice needs beyond the core install, and the extra that has them."""
    name: str
    modules: tuple[str, ...]


class Choice:
    """What every choice declares."""
    flag: ClassVar[str]
    other_flag: ClassVar[str]
    name: ClassVar[str]
    #: its part of the flag's ``--help``
    help: ClassVar[str]
    #: None: the core install has what it imports
    extra: ClassVar[Extra | None] = None
    #: the other flag's choices it works with (empty: all), and why only those
    works_with: ClassVar[tuple[str, ...]] = ()
    why_only: ClassVar[str] = ""

    def help_line(self) -> str:
        pair = (f" (with {self.other_flag} {' / '.join(self.works_with)})" if self.works_with
                else "")
        extra = f" (pip install 'mtbert-tune[{self.extra.name}]')" if self.extra else ""
        return f"{self.name}: {self.help}{pair}{extra}"

    def check_installed(self) -> None:
        """ConfigError naming the extra to install, if one of its modules is missing."""
        if self.extra is None:
            return
        missing = []
        for module in self.extra.modules:
            try:
                importlib.import_module(module)
            except ImportError:
                missing.append(module)
        if missing:
            raise ConfigError(f"{self.flag} {self.name} needs {', '.join(self.extra.modules)} "
                              f"(missing: {', '.join(missing)}): pip install "
                              f"'mtbert-tune[{self.extra.name}]'")


#: the pair's extra (both halves import it)
BOHB_EXTRA = Extra("bohb", ("hpbandster", "ConfigSpace"))

SCHEDULERS: dict[str, Any] = {}
SEARCHERS: dict[str, Any] = {}


def register(cls: type[Choice]) -> type[Choice]:
    """Class decorator: put one instance of ``cls`` in its flag's table by its name."""
    table = SCHEDULERS if cls.flag == "--scheduler" else SEARCHERS
    table[cls.name] = cls()
    return cls
