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


def first_line(exc: BaseException, limit: int = 200) -> str:
    """``Type: first line of the message`` (with the next line when the first only
    introduces it, as torch's ``load_state_dict`` does), at most ``limit`` characters:
    how an error from a library is quoted inside one of ours."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    text = lines[0] if lines else ""
    if text.endswith(":") and len(lines) > 1:
        text = f"{text} {lines[1]}"
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
