"""The MLflow outbox's journal and sender on their own (mtbert/tune/infra/outbox.py), with a
plain function as the sender's ``send``; what it does against a real MLflow server is
tests/test_mlflow_outbox.py's.  Also ``--send-mlflow``'s bad input: one ``error:`` line,
exit 2, nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mtbert.core.errors import ConfigError
from mtbert.tune.infra import outbox as ob


class Receiver:
    """What a send function received, in order; away: it raises ConnectionError."""

    def __init__(self):
        self.got: list[dict] = []
        self.away = False

    def send(self, op: dict) -> None:
        if self.away:
            raise ConnectionError("refused")
        if op["kind"] == "bad":
            raise ValueError("a bad value")
        body = ob.Path(op["folder"], op["file"]).read_text() if op.get("file") else None
        self.got.append({"seq": op["seq"], "kind": op["kind"], "body": body})


def _box(folder: Path, receiver: Receiver) -> ob.Outbox:
    return ob.outbox_for(folder, lambda op: receiver.send({**op, "folder": str(folder)}),
                         lambda exc: isinstance(exc, ConnectionError))


def test_the_journal_is_sent_in_order_and_what_a_killed_process_left_is_read_back(tmp_path):
    folder, receiver = tmp_path / "outbox", Receiver()
    receiver.away = True
    box = _box(folder, receiver)
    with pytest.raises(ob.OutboxBusy):  # one sender an outbox
        ob.Outbox(folder.resolve(), receiver.send, lambda exc: True, None, str)
    note = tmp_path / "note.txt"
    note.write_text("as queued")
    for kind in ("a", "file", "c"):
        box.put({"kind": kind, **({"file": str(note)} if kind == "file" else {})})
    note.write_text("changed after")
    assert not box.flush(0.3) and [op["seq"] for op in box.unsent()] == [1, 2, 3]
    box.close()  # the process killed: its journal stays, a line cut short at its end
    with open(folder / ob.JOURNAL, "a") as fh:
        fh.write('{"seq": 4, "kind": "cut')

    again = _box(folder, receiver)  # (its sender starts at once: still away)
    assert again is not box and [op["seq"] for op in again.unsent()] == [1, 2, 3]
    receiver.away = False
    assert again.flush(10)
    assert receiver.got == [{"seq": 1, "kind": "a", "body": None},
                            {"seq": 2, "kind": "file", "body": "as queued"},
                            {"seq": 3, "kind": "c", "body": None}]
    assert (folder / ob.JOURNAL).read_text() == "" and not (folder / ob.FILES).exists()
    assert json.loads((folder / ob.SENT).read_text()) == {"through": 3}
    assert again.put({"kind": "next"}) == 4 and again.flush(10)
    again.close()


def test_a_refused_write_is_dropped_with_one_warning_and_the_queue_goes_on(tmp_path, capsys):
    receiver = Receiver()
    box = _box(tmp_path / "outbox", receiver)
    for kind in ("a", "bad", "bad", "b"):
        box.put({"kind": kind})
    assert box.flush(10)
    assert [op["kind"] for op in receiver.got] == ["a", "b"]
    err = capsys.readouterr().err
    assert err.count("warning: MLflow refused a write, dropped (bad: ValueError: a bad value)") \
        == 1, err
    box.close()


def test_the_end_s_wait_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv(ob.FLUSH_ENV, raising=False)
    assert ob.flush_seconds() == ob.DEFAULT_FLUSH_S
    monkeypatch.setenv(ob.FLUSH_ENV, "7.5")
    assert ob.flush_seconds() == 7.5
    for bad in ("soon", "-1", "inf", "nan"):
        monkeypatch.setenv(ob.FLUSH_ENV, bad)
        with pytest.raises(ConfigError, match=f"{ob.FLUSH_ENV}="):
            ob.flush_seconds()


@pytest.mark.parametrize("argv, expected", [
    (["--send-mlflow"], "error: --send-mlflow needs --experiment NAME"),
    (["--send-mlflow", "--experiment", "nope"], "error: --send-mlflow: no search nope in "
                                                "--storage-path {storage}"),
    (["--send-mlflow", "--experiment", "nope", "--seed", "1"],
     "error: --send-mlflow takes --experiment and --storage-path only, not --seed"),
])
def test_send_mlflow_bad_input_is_one_error_line_and_exit_2(tmp_path, capsys, argv, expected):
    from mtbert.tune.cli import main

    storage = tmp_path / "ray_results"
    assert main([*argv, "--storage-path", str(storage)]) == 2
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(expected.format(storage=storage)), lines
    assert not storage.exists()
