"""The project's error types: each is bad input that the CLIs turn into exit code 2."""

from __future__ import annotations


class MtbertError(Exception):
    """Base class: a clear, user-facing error about bad input (CLI exit code 2)."""


class ConfigError(MtbertError):
    """An unknown or invalid configuration key/value; ``key`` names the field."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


class DataError(MtbertError):
    """A malformed data file; the message names the file, the line and what was expected."""

    def __init__(self, message: str, path: str | None = None, line: int | None = None):
        super().__init__(message)
        self.path = path
        self.line = line
