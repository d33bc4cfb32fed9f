"""Reading the CS 224N files: each row validated (a bad row is an error naming the file,
line and field, or skipped within ``bad_row_tolerance``), into a :class:`RawTable`."""

from __future__ import annotations

import csv
import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from mtbert.core.errors import DataError
from mtbert.core.tasks import TaskSpec

log = logging.getLogger("mtbert.data")

@dataclass
class RawTable:
    """Validated rows of one file; ``lines[i]`` is the line row ``i`` was read from and
    ``skipped`` the lines of the bad rows skipped under ``bad_row_tolerance``."""
    path: str
    checksum: str
    ids: list[str]
    texts: list[list[str]]           # one list per text column
    labels: np.ndarray | None        # None for test-student files
    lines: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)


def file_checksum(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def read_task_file(path: str | Path, spec: TaskSpec, labelled: bool,
                   bad_row_tolerance: float = 0.0) -> RawTable:
    """Read one tab-separated file, one row per line, and validate every row.

    Raises :class:`DataError` naming the file, the line and what was expected.
    Each line is parsed on its own by the csv module (tab delimiter, doubled-quote
    fields, strict quoting), so a row is always exactly one line: a stray opening
    quote makes its own line a bad row instead of swallowing the lines after it.
    ``bad_row_tolerance`` is the share of data lines (non-blank lines after the header)
    that may be malformed (broken quoting, empty sentence, bad label) and are then
    skipped with a warning naming each line: the real quora-dev.csv has 2 rows of
    20,214 whose broken quoting swallowed the label. A file with more bad rows than
    that fails on its first one. Rows used + rows skipped = the file's data lines.
    """
    path = Path(path)
    raw, text = read_text_file(path, spec)
    lines = [line.removesuffix("\r") for line in text.split("\n")]  # CRLF files too
    header = [h.strip() for h in split_line(lines[0], path, 1)]
    required = ["id", *spec.text_columns] + ([spec.label_column] if labelled else [])
    missing = [c for c in required if c not in header]
    if missing:
        hint = " (is the file tab-separated?)" if len(header) <= 1 else ""
        raise DataError(f"{path}, line 1: missing column {missing[0]!r}; expected tab-separated "
                        f"columns {', '.join(required)}, found {header}{hint}",
                        path=str(path), line=1)
    col = {name: header.index(name) for name in required}

    ids: list[str] = []
    texts: list[list[str]] = [[] for _ in spec.text_columns]
    labels: list[float] = []
    row_lines: list[int] = []
    bad: list[DataError] = []
    data_lines = 0
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue  # blank line: not a row
        data_lines += 1
        try:
            cells = split_line(line, path, number)
            check_cell_count(cells, header, col, path, number)
            parsed = _parse_row(cells, col, spec, labelled, path, number)
        except DataError as exc:
            bad.append(exc)
            continue
        ids.append(parsed[0])
        for j, sentence in enumerate(parsed[1]):
            texts[j].append(sentence)
        if labelled:
            labels.append(parsed[2])
        row_lines.append(number)
    if bad:
        if len(bad) > int(bad_row_tolerance * data_lines) or not ids:
            more = f" ({len(bad) - 1} more bad rows of {data_lines})" if len(bad) > 1 else ""
            first = bad[0]
            raise DataError(f"{first}{more}", path=first.path, line=first.line)
        for exc in bad:
            log.warning("skipping bad row (within tolerance %.2g): %s", bad_row_tolerance, exc)
    if not ids:
        raise DataError(f"{path}, line 2: no data rows after the header", path=str(path), line=2)
    label_array = None
    if labelled:
        dtype = np.float32 if spec.label_kind == "score" else np.int64
        label_array = np.asarray(labels, dtype=dtype)
    return RawTable(str(path), file_checksum(raw), ids, texts, label_array, row_lines,
                    [exc.line for exc in bad])


def read_text_file(path: Path, spec: TaskSpec) -> tuple[bytes, str]:
    """The bytes and UTF-8 text of one task file; a missing, unreadable, binary, non-UTF-8
    or empty file is a :class:`DataError` naming it (and the line, where there is one)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise DataError(f"{path}: file not found (expected the {spec.name} file "
                        f"{path.name} of the CS 224N data)", path=str(path)) from None
    except OSError as exc:
        raise DataError(f"{path}: cannot read file ({exc.strerror})", path=str(path)) from None
    if b"\x00" in raw:
        line = raw[: raw.index(b"\x00")].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: binary data (NUL byte); expected a tab-separated "
                        "UTF-8 text file", path=str(path), line=line)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise DataError(f"{path}, line {line}: not valid UTF-8 (byte {raw[exc.start]:#04x}); "
                        "expected a UTF-8 text file", path=str(path), line=line) from None
    if not text.strip():
        raise DataError(f"{path}: file is empty; expected a header line and rows",
                        path=str(path), line=1)
    return raw, text


#: csv's messages in strict mode -> what is wrong with the line, in the user's terms
_CSV_PROBLEMS = {
    "unexpected end of data": "a quoted field opens and does not close on this line "
                              "(a stray quote?)",
    "expected after": "text after the closing quote of a quoted field",
    "new-line character": "a carriage return (\\r) inside an unquoted field",
}


def split_line(line: str, path: Path, number: int) -> list[str]:
    """The cells of one line (tab-separated, doubled-quote fields); a field never spans
    lines, and any quoting error is a :class:`DataError` naming the line."""
    try:
        return next(csv.reader((line,), delimiter="\t", strict=True))
    except csv.Error as exc:
        problem = next((text for key, text in _CSV_PROBLEMS.items() if key in str(exc)),
                       f"malformed CSV ({exc})")
        raise DataError(f"{path}, line {number}: {problem}; expected one tab-separated row "
                        "per line", path=str(path), line=number) from None


def check_cell_count(cells: list[str], header: list[str], col: dict[str, int], path: Path,
                     number: int) -> None:
    """A row has the header's number of cells (empty cells past the end aside): a row or a
    header that gained or lost a tab would otherwise be read with shifted columns."""
    count = len(cells)
    while count > len(header) and not cells[count - 1].strip():
        count -= 1
    if count == len(header):
        return
    missing = [name for name, i in col.items() if i >= count]
    detail = f"; empty or missing {missing[0]!r}" if missing else ""
    raise DataError(f"{path}, line {number}: {count} tab-separated cells, expected "
                    f"{len(header)} as in the header (line 1){detail}", path=str(path), line=number)


def _parse_row(row: list[str], col: dict[str, int], spec: TaskSpec, labelled: bool,
               path: Path, line: int) -> tuple[str, list[str], float | None]:
    def cell(name: str) -> str:
        i = col[name]
        return row[i].strip() if i < len(row) else ""
    row_id = cell("id")
    if not row_id:
        raise DataError(f"{path}, line {line}: empty id; expected a row id", path=str(path), line=line)
    sentences = []
    for name in spec.text_columns:
        if not cell(name):
            raise DataError(f"{path}, line {line}: empty or missing {name!r}; expected a "
                            "non-empty sentence", path=str(path), line=line)
        sentences.append(cell(name))
    label = _parse_label(cell(spec.label_column), spec, path, line) if labelled else None
    return row_id, sentences, label


def _parse_label(value: str, spec: TaskSpec, path: Path, line: int) -> float:
    expected = f"{spec.label_column} must be {spec.describe_label()}"
    try:
        number = float(value.strip())
    except ValueError:
        raise DataError(f"{path}, line {line}: {spec.label_column}={value.strip()!r}; {expected}",
                        path=str(path), line=line) from None
    ok = np.isfinite(number)
    if spec.label_kind == "class":
        ok = ok and number.is_integer() and 0 <= number < spec.num_classes
    elif spec.label_kind == "binary":
        ok = ok and number in (0.0, 1.0)
    else:
        ok = ok and 0.0 <= number <= 5.0
    if not ok:
        raise DataError(f"{path}, line {line}: {spec.label_column}={value.strip()!r}; {expected}",
                        path=str(path), line=line)
    return number


