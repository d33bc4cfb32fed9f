"""mtbert.core.atomic: a failed write leaves the old file and no temporary file behind."""

from __future__ import annotations

import json

import pytest

from mtbert.core.atomic import atomic_write, atomic_write_json, atomic_write_text


def test_failed_write_keeps_the_old_content_and_leaves_no_litter(tmp_path):
    target = tmp_path / "sub" / "state.json"
    atomic_write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}

    def half_then_fail(tmp):
        with open(tmp, "w") as fh:
            fh.write('{"a": 2, "trunc')
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write(target, half_then_fail)
    assert json.loads(target.read_text()) == {"a": 1}
    assert sorted(p.name for p in target.parent.iterdir()) == ["state.json"]


def test_replaces_content_and_writes_floats_of_numpy_kind(tmp_path):
    import numpy as np
    target = tmp_path / "m.json"
    atomic_write_text(target, "old")
    atomic_write_json(target, {"x": np.float32(0.5)})
    assert json.loads(target.read_text()) == {"x": 0.5}
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_a_uri_write_that_fails_keeps_the_old_file_whole(tmp_path):
    """location.write_text (settings and MLflow state under a URI storage, file:// here):
    a write that fails leaves the previous file as it was and no temporary beside it; a
    write that succeeds replaces it (the driver-killed resume read an empty state file
    when the file was opened, and so emptied, before the write)."""
    from mtbert.tune.infra import location as loc
    target = tmp_path / "state.json"
    uri = target.as_uri()
    loc.write_text(uri, '{"a": 1}')
    with pytest.raises(UnicodeEncodeError):
        loc.write_text(uri, '{"a": "\ud800"}')  # a lone surrogate cannot be UTF-8
    assert loc.read_text(uri) == '{"a": 1}'
    loc.write_text(uri, '{"a": 2}')
    assert loc.read_text(uri) == '{"a": 2}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json"]
