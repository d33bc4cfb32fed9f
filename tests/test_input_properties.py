"""Property-based tests (Hypothesis) of the readers and parsers of user input: the CS 224N
task-file reader, TrainConfig (``from_dict``, ``--set``, ``--config`` YAML) and the
search-space parser.

The property, for any input: either the rows / values come back exactly, or a
:class:`DataError` / :class:`ConfigError` names the line or the key -- never another
exception, and never fewer rows without each missing one named as skipped.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from mtbert.core.config import TrainConfig, coerce_value, field_kind, parse_set_args
from mtbert.data import read_task_file
from mtbert.core.errors import ConfigError, DataError
from mtbert.core.tasks import TASKS

#: 80 fixed examples per test in the suite (a few seconds); for a deeper random search run
#: MTBERT_PROPERTY_EXAMPLES=5000 python -m pytest tests/test_input_properties.py
_DEEP = os.environ.get("MTBERT_PROPERTY_EXAMPLES")
FAST = settings(max_examples=int(_DEEP or 80), deadline=None, derandomize=not _DEEP,
                suppress_health_check=[HealthCheck.too_slow])
WORK = Path(tempfile.mkdtemp(prefix="mtbert-properties-"))


# ---------------------------------------------------------------------- task files
WORDS = st.text(alphabet="abcxyzABCXYZ0189.,;:'!?-()`&$%é中ßΩ\u200b", min_size=1, max_size=8)


@st.composite
def task_files(draw):
    """(task, labelled, header line, [(row line, (id, sentences, label))]) of a valid file,
    some fields quoted with doubled quotes as in the real files."""
    task = draw(st.sampled_from(sorted(TASKS)))
    spec = TASKS[task]
    labelled = draw(st.booleans()) if task != "qqp" else True
    columns = ["", "id", *spec.text_columns] + ([spec.label_column] if labelled else [])
    rows = []
    for i in range(draw(st.integers(1, 15))):
        sentences = [" ".join(draw(st.lists(WORDS, min_size=1, max_size=3)))
                     for _ in spec.text_columns]
        label = None
        if labelled:
            label = float(draw(st.integers(0, spec.num_classes - 1))) if spec.label_kind == "class" \
                else float(draw(st.integers(0, 1))) if spec.label_kind == "binary" \
                else draw(st.integers(0, 50)) / 10
        cells, expected = [str(i), f"row{i}"], []
        for sentence in sentences:
            if draw(st.booleans()):  # """text""" reads as "text", as in the real files
                cells.append(f'"""{sentence}"""')
                expected.append(f'"{sentence}"')
            else:
                cells.append(sentence)
                expected.append(sentence)
        if labelled:
            cells.append(f"{label:g}")
        rows.append(("\t".join(cells), (f"row{i}", expected, label)))
    return task, labelled, "\t".join(columns), rows


DAMAGE = st.sampled_from([b'"', b'"', b"\t", b"\n", b"\r", b"\r\n", b"\x00", b"\xff", b"\xc3",
                          b" ", b'""', b"\t\t", "é".encode(), b"\n\n"])


@st.composite
def damage(draw, data: bytes):
    """Up to three random edits of ``data``: insert bytes, delete a span, or truncate."""
    for _ in range(draw(st.integers(0, 3))):
        kind = draw(st.sampled_from(["insert", "insert", "delete", "truncate"]))
        at = draw(st.integers(0, len(data)))
        if kind == "insert":
            data = data[:at] + draw(DAMAGE | st.binary(min_size=1, max_size=3)) + data[at:]
        elif kind == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 8)):]
        else:
            data = data[:at]
    return data


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@FAST
@given(st.data())
def test_damaged_task_file_rows_come_back_exactly_or_each_loss_is_named(data):
    task, labelled, header, rows = data.draw(task_files())
    original = (header + "\n" + "\n".join(line for line, _ in rows) + "\n").encode()
    damaged = data.draw(damage(original))
    tolerance = data.draw(st.sampled_from([0.0, 0.05, 0.5, 1.0]))
    path = WORK / "task.csv"
    path.write_bytes(damaged)
    expected = {line: row for line, row in rows}  # the text of a valid line -> its row
    warnings = _Warnings()
    logging.getLogger("mtbert.data").addHandler(warnings)
    try:
        table = read_task_file(path, TASKS[task], labelled, bad_row_tolerance=tolerance)
    except DataError as exc:
        event("DataError")
        assert str(exc).startswith(f"{path}"), exc
        n_lines = damaged.count(b"\n") + 1
        assert exc.line is not None and 1 <= exc.line <= n_lines + 1, exc
        assert f"line {exc.line}" in str(exc) or exc.line == 1, exc
        return
    finally:
        logging.getLogger("mtbert.data").removeHandler(warnings)
    lines = [line.removesuffix("\r") for line in damaged.decode("utf-8").split("\n")]
    data_lines = [n for n, line in enumerate(lines[1:], start=2) if line.strip()]
    event(f"rows read, {'some' if table.skipped else 'none'} skipped")
    # every data line is used or named as skipped, never both, never neither
    assert sorted(table.lines + table.skipped) == data_lines
    assert len(table.ids) == len(table.lines) == len(table.texts[0])
    for n in table.skipped:
        assert any(f"{path}, line {n}:" in m for m in warnings.messages), (n, warnings.messages)
    if lines[0] != header:
        return  # a damaged header that still names every column: only the accounting holds
    # a line that is still one of the valid lines comes back exactly as that row
    for i, n in enumerate(table.lines):
        if lines[n - 1] in expected:
            row_id, sentences, label = expected[lines[n - 1]]
            got = [t[i] for t in table.texts]
            assert table.ids[i] == row_id
            assert got == sentences
            if labelled:
                assert math.isclose(float(table.labels[i]), label, abs_tol=1e-6)
    for n in table.skipped:  # a valid line is never skipped
        assert lines[n - 1] not in expected, (n, lines[n - 1])


# ---------------------------------------------------------------------- config values
FIELDS = TrainConfig.field_names()
ODD_TEXT = st.sampled_from(["nan", "NaN", ".nan", "inf", "-inf", ".inf", "-.inf", "Infinity",
                            "1e400", "-1e400", "1_000", "0x10", "1e-3", "3.0", "3.5", "-1",
                            "true", "off", "yes", "null", "~", "", " ", "[1, 2]", "{a: 1}",
                            "cycle", "summed", "round_robin", "9" * 40, "1e308", "2.5e-324",
                            "!!python/object:os.system", "&a [*a]", "'quoted'", "\"dq\"",
                            "a: b: c", "- x", "\x00", "é", "%", "@x", "`x`"])
VALUES = st.one_of(
    st.none(), st.booleans(),
    st.integers(), st.integers(min_value=-2**70, max_value=2**70).map(lambda i: i * 10**300),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=20), ODD_TEXT,
    st.lists(st.integers(), max_size=2), st.dictionaries(st.text(max_size=3), st.integers(),
                                                         max_size=2))


def _check_config(cfg_or_error, values: dict, where: str):
    """Success: each value is the coerced input, and numbers are finite; failure: a
    ConfigError naming one of the given keys."""
    if isinstance(cfg_or_error, ConfigError):
        assert cfg_or_error.key in values, (cfg_or_error, cfg_or_error.key, list(values))
        assert cfg_or_error.key in str(cfg_or_error), cfg_or_error
        return
    cfg = cfg_or_error
    for key, value in values.items():
        got = getattr(cfg, key)
        assert got == coerce_value(key, value, source=where) or key in ("cache_dir",)
        if field_kind(key) in ("int", "float"):
            assert math.isfinite(got) and not isinstance(got, bool), (key, got)
    # and it survives the round trip through the YAML written into every run folder
    assert TrainConfig.from_dict(yaml.safe_load(cfg.to_yaml())) == cfg


def _build(make):
    try:
        return make()
    except ConfigError as exc:
        return exc


@FAST
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=4))
def test_config_from_dict_takes_values_exactly_or_names_the_key(values):
    _check_config(_build(lambda: TrainConfig.from_dict(values, source="test")), values, "test")


@FAST
@given(st.sampled_from(FIELDS), st.one_of(st.text(max_size=20), ODD_TEXT))
def test_set_flag_takes_values_exactly_or_names_the_key(key, raw):
    parsed = _build(lambda: parse_set_args([f"{key}={raw}"]))
    if isinstance(parsed, ConfigError):
        assert parsed.key == key
        return
    assert list(parsed) == [key]
    _check_config(_build(lambda: TrainConfig.from_dict(parsed, source="--set")), parsed, "--set")


@FAST
@given(st.dictionaries(st.sampled_from(FIELDS), VALUES, min_size=1, max_size=4))
def test_config_yaml_file_takes_values_exactly_or_names_the_key(values):
    path = WORK / "config.yaml"
    path.write_text(yaml.safe_dump(values), encoding="utf-8")
    result = _build(lambda: TrainConfig.from_yaml(path))
    if isinstance(result, ConfigError):
        assert result.key in values or str(path) in str(result), result
        if result.key is not None:
            assert result.key in values, (result.key, list(values))
        return
    _check_config(result, yaml.safe_load(path.read_text(encoding="utf-8")), str(path))


# ---------------------------------------------------------------------- search spaces
SPACE_KEYS = st.one_of(st.sampled_from(FIELDS), st.text(min_size=1, max_size=8))
BOUNDS = st.one_of(st.integers(-10, 10**6), st.floats(allow_nan=True, allow_infinity=True),
                   ODD_TEXT, st.booleans(), st.none())
SPECS = st.one_of(
    VALUES,
    st.builds(lambda d, b: {d: b}, st.sampled_from(["uniform", "loguniform", "randint"]),
              st.lists(BOUNDS, min_size=0, max_size=3)),
    st.builds(lambda c: {"choice": c}, st.lists(VALUES, max_size=4)),
    st.builds(lambda v: {"fixed": v}, VALUES),
    st.dictionaries(st.text(max_size=8), VALUES, max_size=2))
SPACES = st.one_of(
    st.fixed_dictionaries({"description": st.one_of(st.text(max_size=20), VALUES),
                           "params": st.dictionaries(SPACE_KEYS, SPECS, max_size=4)}),
    st.dictionaries(st.text(max_size=12), VALUES, max_size=3), VALUES)


@FAST
@given(SPACES)
def test_space_values_come_back_exactly_or_the_error_names_the_key(doc):
    from mtbert.tune.search.spaces import parse_space

    path = WORK / "space.yaml"
    try:
        space = parse_space(doc, path)
    except ConfigError as exc:  # SpaceError is a ConfigError
        message = str(exc)
        assert message.startswith(f"{path}:"), message
        params = doc.get("params") if isinstance(doc, dict) else None
        named = [str(k) for k in (params or {}) if f"{path}: {k}:" in message]
        top = any(f"{path}: {k}" in message for k in ("description", "params", "expected"))
        assert named or top or (isinstance(doc, dict) and any(f": {k}:" in message for k in doc)), \
            message
        if exc.key is not None:
            assert exc.key in map(str, params or {}), (exc.key, message)
        return
    for key, spec in doc["params"].items():
        p = space.params[str(key)]
        if p.dist == "fixed":
            raw = spec["fixed"] if isinstance(spec, dict) else spec
            assert p.value == coerce_value(str(key), raw)
        elif p.dist == "choice":
            assert list(p.choices) == [coerce_value(str(key), v) for v in spec["choice"]]
        else:
            low, high = spec[p.dist]
            assert (p.low, p.high) == (float(low), float(high)) or \
                (p.low, p.high) == (int(float(low)), int(float(high)))


@pytest.mark.parametrize("doc", [
    {"description": "d", "params": {"seed": 10**400}},
    {"description": "d", "params": {"seed": {"choice": [1, 10**400]}}},
    {"description": "d", "params": {"lr": {"uniform": [1e-5, 10**400]}}},
])
def test_space_huge_numbers_are_a_named_error(doc):
    """Hypothesis' BOUNDS above stop at 10**6 so the known bug below does not mask others."""
    from mtbert.tune.search.spaces import parse_space

    with pytest.raises(ConfigError, match=r"space\.yaml: (lr|seed):"):
        parse_space(doc, WORK / "space.yaml")
