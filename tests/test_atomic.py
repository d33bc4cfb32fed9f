"""mtbert.atomic: a failed write leaves the old file and no temporary file behind."""

from __future__ import annotations

import json

import pytest

from mtbert.atomic import atomic_write, atomic_write_json, atomic_write_text


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
