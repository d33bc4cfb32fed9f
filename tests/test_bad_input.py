"""Bad input to the real ``python tune_driver.py`` CLI: one table, one subprocess per case.

Every case must exit 2 with exactly one ``error: ...`` line on stderr that names what is
wrong and where (file and line for data files, file and key for spaces, the flag for the
CLI), before Ray starts, leaving no experiment folder and no MLflow run behind.

The data cases break one file of a copy of the tiny data (the driver reads and validates
the data before it starts Ray); the space cases write one bad YAML file each.  The cases
run in parallel (they are independent processes), each forked from one process that has
imported the driver's modules once (tests/forked_cli.py), so the table costs seconds, not
the ~4 s of imports per case.
"""

from __future__ import annotations

import os
import shutil
import socket
import sqlite3
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
from forked_cli import DRIVER_IMPORTS, ForkedCli

REPO = Path(__file__).resolve().parents[1]
#: what every case's process runs under
ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false", "RAY_ADDRESS": ""}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _replace_line(path: Path, line_no: int, new: str) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    lines[line_no - 1] = new
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _edit_cell(path: Path, line_no: int, column: str, value: str) -> None:
    lines = path.read_text(encoding="utf-8").splitlines()
    header = lines[0].split("\t")
    cells = lines[line_no - 1].split("\t")
    cells[header.index(column)] = value
    lines[line_no - 1] = "\t".join(cells)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _unwritable_dir(root: Path) -> Path:
    """A folder this process cannot create anything in (root ignores chmod: use /proc)."""
    if os.geteuid() == 0:
        return Path("/proc")
    folder = root / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    return folder


@dataclass
class Case:
    id: str
    expected: list[str]                                   # substrings of the one error line
    args: list[str] = field(default_factory=list)         # replace / add CLI flags
    data: Callable[[Path], None] | None = None            # break the copied data folder
    space: str | None = None                              # YAML text of a bad space file
    model: Callable[[Path], None] | None = None           # damage a copy of the tiny model
    max_seconds: float | None = None


D = "{data}"  # placeholders filled per case
S = "{space}"

CASES = [
    # ------------------------------------------------------------ data files
    Case("data_missing_file", [f"{D}/quora-dev.csv: file not found"],
         data=lambda d: (d / "quora-dev.csv").unlink()),
    Case("data_missing_column", [f"{D}/sts-train.csv, line 1: missing column 'similarity'"],
         data=lambda d: _replace_line(d / "sts-train.csv", 1,
                                      "\tid\tsentence1\tsentence2\tscore")),
    Case("data_bad_label", [f"{D}/ids-sst-train.csv, line 3: sentiment='7'"],
         data=lambda d: _edit_cell(d / "ids-sst-train.csv", 3, "sentiment", "7")),
    Case("data_empty_sentence", [f"{D}/quora-train.csv, line 5: empty or missing 'sentence1'"],
         data=lambda d: _edit_cell(d / "quora-train.csv", 5, "sentence1", "")),
    Case("data_binary_file", [f"{D}/ids-sst-dev.csv, line 1: binary data"],
         data=lambda d: (d / "ids-sst-dev.csv").write_bytes(b"\x00\x01PK\x03\x04" * 64)),
    Case("data_wrong_delimiter", [f"{D}/sts-dev.csv, line 1: missing column"],
         data=lambda d: (d / "sts-dev.csv").write_text(
             (d / "sts-dev.csv").read_text(encoding="utf-8").replace("\t", ","),
             encoding="utf-8")),
    Case("data_not_utf8", [f"{D}/quora-train.csv, line 2: not valid UTF-8"],
         data=lambda d: (d / "quora-train.csv").write_bytes(
             (d / "quora-train.csv").read_bytes().replace(b"How", b"H\xffw", 1))),
    Case("data_empty_file", [f"{D}/sts-train.csv: file is empty"],
         data=lambda d: (d / "sts-train.csv").write_text("", encoding="utf-8")),
    # ------------------------------------------------------------ search spaces
    Case("space_unknown_key", [f"{S}: learnin_rate: unknown trainer config key"],
         space="description: bad\nparams:\n  learnin_rate: {uniform: [0.1, 0.2]}\n"),
    Case("space_bad_distribution", [f"{S}: lr: invalid distribution"],
         space="description: bad\nparams:\n  lr: {gaussian: [1.0e-4, 1.0e-3]}\n"),
    Case("space_min_above_max", [f"{S}: dropout: uniform needs low < high, got [0.3, 0.1]"],
         space="description: bad\nparams:\n  dropout: {uniform: [0.3, 0.1]}\n"),
    Case("space_value_out_of_range",
         [f"{S}: dropout: uniform bound 3 is outside the valid range of dropout"],
         space="description: bad\nparams:\n  dropout: {uniform: [0.1, 3.0]}\n"),
    Case("space_empty_file", [f"{S}: expected a mapping with keys 'description' and 'params'"],
         space=""),
    Case("space_invalid_yaml", [f"{S}: invalid YAML", "line 3, column 7"],
         space="description: bad\nparams:\n  lr: {uniform: [1.0e-4, 1.0e-3]\n  dropout: [\n"),
    # ------------------------------------------------------------ CLI
    Case("cli_unknown_space", ["--space no_such_space: unknown search space", "known spaces:"],
         args=["--space", "no_such_space"]),
    Case("cli_negative_samples", ["--num-samples -3: must be >= 1"],
         args=["--num-samples", "-3"]),
    Case("cli_gpus_without_gpu", ["--gpus-per-trial 1: no CUDA GPU on this machine"],
         args=["--gpus-per-trial", "1"]),
    Case("cli_unknown_budget", ["argument --budget: invalid choice: 'huge'"],
         args=["--budget", "huge"]),
    Case("cli_unreachable_address", ["--address 127.0.0.1:{port}: no Ray cluster reachable",
                                     "Connection refused"],
         args=["--address", "127.0.0.1:{port}"], max_seconds=120),
    Case("cli_malformed_address", ["--address head-node: expected auto, HOST:PORT"],
         args=["--address", "head-node"]),
    Case("cli_missing_model", ["/nonexistent/tiny-bert", "no such model folder"],
         args=["--model", "/nonexistent/tiny-bert"]),
    Case("cli_unwritable_storage", ["--storage-path {unwritable}/ray_results: cannot create a "
                                    "folder under {unwritable}"],
         args=["--storage-path", "{unwritable}/ray_results"]),
    Case("cli_storage_bad_scheme", ["--storage-path ftp://host/results: unsupported scheme 'ftp'"],
         args=["--storage-path", "ftp://host/results"]),
    Case("cli_storage_uri_without_mlflow", ["--storage-path file:///tmp/mtbert-never-created: "
                                            "a URI storage needs --mlflow-uri"],
         args=["--storage-path", "file:///tmp/mtbert-never-created", "--mlflow-uri", None]),
    Case("space_compile_mode_needs_cuda", ["compile=reduce-overhead records CUDA graphs and "
                                           "needs a CUDA device; the device is cpu"],
         space="description: d\nparams:\n  lr: {loguniform: [1.0e-5, 1.0e-4]}\n"
               "  compile: reduce-overhead\n",
         args=[]),
    Case("cli_model_unknown_architecture", ["config.json: model_type 'bertish' is not an "
                                            "architecture"],
         model=lambda m: (m / "config.json").write_text(
             (m / "config.json").read_text().replace('"model_type": "bert"',
                                                     '"model_type": "bertish"'))),
    Case("cli_model_truncated_weights", ["model.safetensors"],
         model=lambda m: (m / "model.safetensors").write_bytes(
             (m / "model.safetensors").read_bytes()[:5000])),
    Case("cli_rung_metric_unknown", ["argument --rung-metric: unknown 'overall_sofft'; "
                                     "expected one of overall, overall_soft, classes_soft"],
         args=["--rung-metric", "classes_soft,overall_sofft"]),
    Case("cli_rung_metric_per_rung_with_ray_asha",
         ["--rung-metric classes_soft,overall_soft: one metric per rung needs --scheduler "
          "asha-promote, got --scheduler asha"],
         args=["--rung-metric", "classes_soft,overall_soft", "--scheduler", "asha"]),
    Case("cli_gpus_nan", ["argument --gpus-per-trial: 'nan' is not a finite number"],
         args=["--gpus-per-trial", "nan"]),
    Case("cli_cpus_inf", ["argument --cpus-per-trial: 'inf' is not a finite number"],
         args=["--cpus-per-trial", "inf"]),
    Case("cli_mlflow_missing_colon", ["--mlflow-uri http//127.0.0.1:5000: a folder (MLflow's "
                                      "file store); use sqlite:///ABSOLUTE/PATH.db"],
         args=["--mlflow-uri", "http//127.0.0.1:5000"]),
    Case("cli_mlflow_file_store", ["--mlflow-uri file:///tmp/mlruns: a folder (MLflow's file "
                                   "store); use sqlite:///ABSOLUTE/PATH.db (a local store, no "
                                   "server) or http(s)://HOST:PORT"],
         args=["--mlflow-uri", "file:///tmp/mlruns"]),
    Case("cli_mlflow_unreachable", ["--mlflow-uri http://127.0.0.1:{port}: MLflow server "
                                    "unreachable"],
         args=["--mlflow-uri", "http://127.0.0.1:{port}"]),
]


def _flag_pairs(args: list) -> dict[str, object]:
    return {args[i]: args[i + 1] for i in range(0, len(args), 2)}


@pytest.fixture(scope="module")
def cli(tmp_path_factory):
    """``python tune_driver.py`` processes forked after the driver's imports."""
    with ForkedCli(DRIVER_IMPORTS, tmp_path_factory.mktemp("forked-cli"), ENV, REPO) as server:
        yield server


def _run_case(cli: ForkedCli, case: Case, root: Path, model: str, tiny_data: str) -> dict:
    root.mkdir(parents=True)
    data = Path(tiny_data)
    if case.data is not None:
        data = root / "data"
        shutil.copytree(tiny_data, data)
        case.data(data)
    if case.model is not None:
        shutil.copytree(model, root / "model")
        case.model(root / "model")
        model = str(root / "model")
    space_file = root / "space.yaml"
    subst = {"data": str(data), "space": str(space_file), "port": str(_free_port()),
             "unwritable": str(_unwritable_dir(root)) if case.id == "cli_unwritable_storage"
             else ""}
    storage = root / "ray_results"
    db = root / "mlflow.db"
    flags: dict[str, object] = {
        "--space": "smoke", "--budget": "smoke", "--model": model, "--data-dir": str(data),
        "--storage-path": str(storage), "--mlflow-uri": f"sqlite:///{db}",
        "--experiment": "bad-input", "--num-samples": "2"}
    if case.space is not None:
        space_file.write_text(case.space, encoding="utf-8")
        flags["--space"] = str(space_file)
    for flag, value in _flag_pairs(case.args).items():
        if value is None:
            flags.pop(flag, None)
        else:
            flags[flag] = value.format(**subst)
    argv = [a for kv in flags.items() for a in kv]
    start = time.perf_counter()
    out = cli.run([sys.executable, "tune_driver.py", *argv], cwd=REPO, env=ENV, timeout=180)
    return {"rc": out.returncode, "stderr": out.stderr, "stdout": out.stdout,
            "seconds": time.perf_counter() - start, "storage": storage, "db": db,
            "expected": [e.format(**subst) for e in case.expected]}


@pytest.fixture(scope="module")
def outcomes(cli, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    root = tmp_path_factory.mktemp("bad-input")
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {c.id: pool.submit(_run_case, cli, c, root / c.id, tiny_model_dir,
                                     tiny_data_dir)
                   for c in CASES}
        return {cid: f.result() for cid, f in futures.items()}


def test_table_covers_the_issue():
    kinds = {c.id.split("_", 1)[0] for c in CASES}
    assert kinds == {"data", "space", "cli"} and len(CASES) >= 20
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_exits_2_with_one_clear_line_and_nothing_written(outcomes, case):
    o = outcomes[case.id]
    lines = o["stderr"].strip().splitlines()
    assert o["rc"] == 2, (o["rc"], o["stderr"][-2000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), o["stderr"][-2000:]
    for expected in o["expected"]:
        assert expected in lines[0], (expected, lines[0])
    # nothing written: no storage folder (so no experiment folder), no MLflow run
    assert not o["storage"].exists(), sorted(p.name for p in o["storage"].rglob("*"))
    if o["db"].exists():
        with sqlite3.connect(o["db"]) as conn:
            assert conn.execute("select count(*) from runs").fetchone()[0] == 0
    # before Ray: nothing in the output says Ray or a trial started
    assert "Ray dashboard" not in o["stdout"] and "trial_" not in o["stdout"]
    if case.max_seconds:
        assert o["seconds"] < case.max_seconds, o["seconds"]


@pytest.mark.parametrize("content,expected", [
    ("{\"args\": {", "is not valid JSON"),
    ("", "is not valid JSON"),
    ("{\"args\": {}, \"space_path\": \"x.yaml\"}", "has no 'space' (dict)"),
])
def test_resume_with_a_damaged_settings_file(cli, tmp_path, content, expected):
    """``--resume`` of a search whose saved settings are damaged: one line naming the
    file, exit 2, the file left as it was."""
    exp = tmp_path / "ray_results" / "damaged"
    exp.mkdir(parents=True)
    settings = exp / "mtbert_search.json"
    settings.write_text(content, encoding="utf-8")
    out = cli.run([sys.executable, "tune_driver.py", "--resume", "--experiment", "damaged",
                   "--storage-path", str(tmp_path / "ray_results")], cwd=REPO,
                  env={**os.environ, "HF_HUB_OFFLINE": "1", "RAY_ADDRESS": ""}, timeout=120)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"error: --resume: {settings}") and expected in lines[0]
    assert settings.read_text(encoding="utf-8") == content
    assert sorted(p.name for p in exp.iterdir()) == ["mtbert_search.json"]
