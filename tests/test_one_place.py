"""One place for each fact: the roles a TrainConfig field plays for the search, the step
graphs and a resume are in the field's own metadata (mtbert/core/config.py) and the lists of
them are derived there, no other module of the package keeps a list of field names of its
own; the tasks are listed in mtbert/core/tasks.py alone; and a field's name is written out
where it is used, never built from pieces (so a search for the name finds every use)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mtbert.core import config
from mtbert.core.config import TrainConfig

PACKAGE = Path(__file__).resolve().parents[1] / "mtbert"
BENCH = PACKAGE.parent / "bench"
FIELDS = set(TrainConfig.field_names())


def test_the_fields_that_shape_the_tokenised_data():
    """What spaces.py refuses to search, and what sets each instead."""
    assert config.DATA_PER_SEARCH == {
        "model": "--model", "data_dir": "--data-dir", "cache_dir": "$MTBERT_CACHE",
        "max_length": "the driver (data is tokenised once per search)",
        "max_train_per_task": "--budget", "max_eval_per_task": "--budget",
        "val_fraction": "the driver (the validation split is fixed per search)",
        "split_seed": "the driver (the validation split is fixed per search)",
        "bad_row_tolerance": "the driver (data is read once per search)",
    }


def test_the_fields_the_budget_or_the_driver_sets():
    assert config.RUN_PER_SEARCH == {
        "epochs": "--budget", "max_examples": "--budget", "eval_every": "--budget",
        "eval_growth": "--budget",
        "eval_at_start": "the driver (every trial's curve starts at 0 examples)",
        "eval_dev": "the driver (trials never score dev)", "device": "--gpus-per-trial",
        "threads": "--cpus-per-trial", "progress": "the driver",
    }


def test_the_fields_a_kept_step_takes_from_the_next_run():
    assert config.NOT_IN_STEP_GRAPHS == frozenset({
        "data_dir", "cache_dir", "val_fraction", "split_seed", "max_train_per_task",
        "max_eval_per_task", "bad_row_tolerance", "length_bucketing", "bucket_batches",
        "epochs", "max_examples", "steps_per_epoch", "schedule", "round_robin_mode",
        "eval_batch_size", "eval_batch_tokens", "eval_every", "eval_at_start", "eval_growth",
        "eval_dev", "threads", "progress", "seed",
        "lr", "head_lr_multiplier", "weight_decay", "lr_schedule", "warmup_ratio",
        "warmup_examples", "decay_ratio", "max_grad_norm", "smart_beta",
        "pretrain", "pretrain_examples", "pretrain_lr", "pretrain_batch_size", "simcse_temp",
        "cosine_fit_rows",
        "batch_size", "batch_size_sst", "batch_size_qqp", "batch_size_sts",
        "dropout", "smart_lambda_sst", "smart_lambda_qqp", "smart_lambda_sts", "smart_eps",
        "smart_mu",
    })


def test_the_fields_pbt_perturbs_in_their_order():
    """The order is Ray's: it draws each field's change in turn."""
    assert config.PERTURBED == ("lr", "dropout", "smart_lambda_sst", "smart_lambda_qqp",
                                "smart_lambda_sts")


def test_the_fields_a_resume_may_change():
    assert config.RESUME_MAY_CHANGE == frozenset({
        "data_dir", "cache_dir", "epochs", "max_examples", "eval_every", "eval_growth",
        "eval_dev", "device", "precision", "threads", "progress"})


def field_name_lists(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """The module-level assignments of ``path`` whose value is a collection (tuple, list,
    set, frozenset, a dict's keys) of two or more strings, every one a TrainConfig field."""
    found = []
    for stmt in ast.parse(path.read_text(encoding="utf-8")).body:
        if not isinstance(stmt, (ast.Assign, ast.AnnAssign)) or stmt.value is None:
            continue
        for node in ast.walk(stmt.value):
            items = (node.keys if isinstance(node, ast.Dict)
                     else node.elts if isinstance(node, (ast.Tuple, ast.List, ast.Set))
                     else None)
            if items is None or len(items) < 2:
                continue
            if all(isinstance(i, ast.Constant) and i.value in FIELDS for i in items):
                found.append(f"{path.relative_to(root).as_posix()}:{stmt.lineno}")
                break
    return found


def test_no_module_but_config_lists_fields_by_name():
    lists = [hit for path in sorted(PACKAGE.rglob("*.py")) if path != PACKAGE / "core" / "config.py"
             for hit in field_name_lists(path)]
    assert lists == []


def test_the_check_finds_a_list_of_fields(tmp_path):
    module = tmp_path / "mtbert" / "m.py"
    module.parent.mkdir()
    module.write_text('A = ("lr", "dropout")\nB = frozenset({"seed", "epochs"})\n'
                      'C = {"model": "--model", "data_dir": "--data-dir"}\n'
                      'D = ("lr", "budget")\nE = ("lr",)\n', encoding="utf-8")
    assert field_name_lists(module, tmp_path) == ["mtbert/m.py:1", "mtbert/m.py:2",
                                                  "mtbert/m.py:3"]


def _sources(*roots: Path):
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def task_lists(path: Path, tree: ast.AST) -> list[str]:
    """Where ``tree`` writes the three task names out as a tuple, list or set."""
    tasks = {"sst", "qqp", "sts"}
    return [f"{path.name}:{node.lineno}" for node in ast.walk(tree)
            if isinstance(node, (ast.Tuple, ast.List, ast.Set))
            and {getattr(e, "value", None) for e in node.elts} == tasks
            and len(node.elts) == len(tasks)]


def test_no_module_but_tasks_lists_the_tasks():
    assert [hit for path, tree in _sources(PACKAGE, BENCH) if path != PACKAGE / "core" / "tasks.py"
            for hit in task_lists(path, tree)] == []


def built_field_names(path: Path, tree: ast.AST) -> list[str]:
    """The f-strings of ``tree`` that can build a TrainConfig field's name
    (``f"smart_lambda_{task}"``): their text, a placeholder standing for any word,
    matches a field's whole name."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.JoinedStr):
            continue
        text = "".join(v.value if isinstance(v, ast.Constant) else "" for v in node.values)
        pattern = re.compile("".join(re.escape(v.value) if isinstance(v, ast.Constant)
                                     else r"\w+" for v in node.values))
        if re.search("[a-z]", text) and any(pattern.fullmatch(f) for f in FIELDS):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_field_name_is_built_from_pieces():
    assert [hit for path, tree in _sources(PACKAGE, BENCH)
            for hit in built_field_names(path, tree)] == []


def test_the_checks_find_a_task_list_and_a_built_name():
    tree = ast.parse('T = ("sst", "qqp", "sts")\nU = ["sts", "sst", "qqp"]\nV = ("sst", "qqp")\n'
                     'a = getattr(cfg, f"smart_lambda_{t}")\nb = f"train/loss_{t}"\n'
                     'c = f"{t}"\n')
    assert task_lists(Path("m.py"), tree) == ["m.py:1", "m.py:2"]
    assert built_field_names(Path("m.py"), tree) == ['m.py:4: f\'smart_lambda_{t}\'']
