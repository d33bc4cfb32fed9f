"""Growing a finished search (``--extend EXPERIMENT``, mtbert/tune/results/extension.py).

The searcher side runs on real Ray searchers and real Optuna studies, without trials:
an extended searcher proposes otherwise than a cold one of the same seed and does not
train the old optimum again; a prior (another budget's) trial's configuration is
trained again.  The driver side runs real searches on the tiny model, a real local Ray
and a real SQLite MLflow store: a first search, its extension (trained fused, ``--fuse
on``) and an extension of the extension; the summary ranks old and new trials together,
the ensemble takes an old trial's kept weights, no old trial trains again, MLflow links
the parents; and every bad ``--extend`` exits 2 with one line and writes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
from pathlib import Path

import pytest

from mtbert.core.errors import ConfigError
from mtbert.tune.results.extension import (EarlierSearch, KnownTrial, differences, earlier_search,
                                           parse_trials, searcher_points)
from mtbert.tune.trial.objective import OBJECTIVE
from mtbert.tune.results.records import TrialRecord, TrialStatus
from mtbert.tune.search.spaces import parse_space
from mtbert.tune.search.tuner import build_searcher
from conftest import sqlite_mlflow_store

# ---------------------------------------------------------------------- the searcher
#: 3 dropouts x 2 batch sizes: 6 configurations, small enough for TPE to repeat itself
STEPPED = {"dropout": {"choice": [0.1, 0.2, 0.3]}, "batch_size": {"choice": [8, 16]}}
MEASURED = {"budget": "smoke", "max_examples": 192, "model": "m", "data_dir": "d",
            "split_seed": 0, "max_train_per_task": 64, "max_eval_per_task": 32}


def _record(tid: str, config: dict, scores: list[float], status=TrialStatus.COMPLETED,
            soft: list[float] | None = None) -> TrialRecord:
    history = [{"examples_seen": 48 * (i + 1), OBJECTIVE: s,
                "val/classes_soft": (soft or scores)[i]} for i, s in enumerate(scores)]
    return TrialRecord(tid, f"trial_{tid}", status, dict(config), history,
                       best={OBJECTIVE: max(scores)}, best_checkpoint=None,
                       examples_seen=48 * len(scores))


def _earlier(records: list[TrialRecord], prior: bool = False) -> EarlierSearch:
    known = [KnownTrial(r, "first", dict(MEASURED), None) for r in records]
    return EarlierSearch("first", None, None, list(STEPPED),
                         joint=[] if prior else known, prior=known if prior else [])


def _searcher(points=(), seed: int = 0):
    space = parse_space({"description": "d", "params": STEPPED}, "test.yaml")
    limiter = build_searcher("optuna", seed=seed, max_concurrent=1, num_samples=8,
                             scheduler="asha", earlier=points)
    assert limiter.set_search_properties(OBJECTIVE, "max", space.param_space())
    return limiter, limiter.searcher


def _propose(limiter, n: int, score=lambda c: 0.0) -> list[tuple]:
    out = []
    for i in range(n):
        config = limiter.suggest(f"new{i}")
        out.append((config["dropout"], config["batch_size"]))
        limiter.on_trial_complete(f"new{i}", {OBJECTIVE: score(config)})
    return out


OLD = [_record("a", {"dropout": 0.1, "batch_size": 8}, [0.40, 0.70]),   # the old optimum
       _record("b", {"dropout": 0.3, "batch_size": 16}, [0.30, 0.35]),
       _record("c", {"dropout": 0.2, "batch_size": 16}, [0.20], TrialStatus.STOPPED_EARLY)]
#: stopped before its first evaluation
UNSCORED = TrialRecord("f", "trial_f", TrialStatus.STOPPED_EARLY, {"dropout": 0.3, "batch_size": 8})


def test_earlier_trials_are_told_as_the_searcher_tells_its_own():
    # Ray's ASHA + Optuna: the objective where the trial ended; stopped ones as pruned
    points = searcher_points(_earlier(OLD), list(STEPPED), False, 48, "val/classes_soft")
    assert [(p.state, p.value) for p in points] == [("complete", 0.70), ("complete", 0.35),
                                                     ("pruned", 0.20)]
    assert points[0].intermediate == (0.40, 0.70) and not any(p.prior for p in points)
    # promoting ASHA: the rung metric at the first rung (96 examples), as a completed trial;
    # a trial that ended before it, as pruned
    soft = [_record("d", {"dropout": 0.1, "batch_size": 8}, [0.4, 0.7], soft=[0.5, 0.6])]
    [p] = searcher_points(_earlier(soft), list(STEPPED), True, 96, "val/classes_soft")
    assert (p.state, p.value) == ("complete", 0.6)
    [p] = searcher_points(_earlier(OLD[2:]), list(STEPPED), True, 96, "val/classes_soft")
    assert p.state == "pruned"
    errored = _record("e", {"dropout": 0.1, "batch_size": 8}, [0.1], TrialStatus.ERROR)
    [p] = searcher_points(_earlier([errored], prior=True), list(STEPPED), False, 48, OBJECTIVE)
    assert (p.state, p.value, p.prior) == ("fail", None, True)
    [p] = searcher_points(_earlier([UNSCORED]), list(STEPPED), True, 96, "val/classes_soft")
    assert (p.state, p.value) == ("pruned", None)    # stopped before its first evaluation


def test_the_driver_says_what_the_searcher_was_told():
    from mtbert.tune.results.extension import told_line
    earlier = _earlier(OLD + [UNSCORED])
    points = searcher_points(earlier, list(STEPPED), True, 96, "val/classes_soft")
    line = told_line(points, earlier, "optuna", True, 96, "val/classes_soft")
    assert ("told 4 earlier trials (2 with their val/classes_soft at the first rung (96 "
            "examples), 2 that ended before it as pruned, 0 failed)") in line
    points = searcher_points(earlier, list(STEPPED), False, 48, OBJECTIVE)
    line = told_line(points, earlier, "optuna", False, 48, OBJECTIVE)
    assert "(2 completed with their val/overall, 2 stopped at a rung as pruned, 0 failed)" in line
    assert "cannot be told" in told_line([], earlier, "random", False, 48, OBJECTIVE)


def test_extended_searcher_proposes_otherwise_and_never_retrains_the_old_optimum():
    cold, _ = _searcher()
    cold_first = _propose(cold, 3)
    points = searcher_points(_earlier(OLD + [UNSCORED]), list(STEPPED), False, 48, OBJECTIVE)
    warm, searcher = _searcher(points)
    study = searcher._ot_study
    assert [t.state.name for t in study.trials] == ["COMPLETE", "COMPLETE", "PRUNED", "PRUNED"]
    assert study.best_trial.params == {"dropout": 0.1, "batch_size": 8}
    warm_first = _propose(warm, 3)
    assert warm_first != cold_first
    told = {(r.config["dropout"], r.config["batch_size"]) for r in OLD[:2]}
    assert not told & set(warm_first), warm_first   # scored twins are answered, not trained


def test_a_prior_trial_is_trained_again_on_the_new_budget():
    """Another budget's score is a prior, not an answer: its configuration trains."""
    only = {"dropout": {"choice": [0.1]}, "batch_size": {"choice": [8]}}
    space = parse_space({"description": "d", "params": only}, "test.yaml")
    for prior, repeats in ((True, 0), (False, 1)):
        earlier = _earlier(OLD[:1], prior=prior)
        points = searcher_points(earlier, list(only), False, 48, OBJECTIVE)
        limiter = build_searcher("optuna", seed=0, max_concurrent=1, num_samples=2,
                                 scheduler="asha", earlier=points)
        limiter.set_search_properties(OBJECTIVE, "max", space.param_space())
        assert limiter.suggest("t0") == {"dropout": 0.1, "batch_size": 8}
        # a joint twin was answered (MAX_ASKS - 1 times) before the repeat trained
        assert (limiter.searcher.repeats_told > 0) == bool(repeats)


def test_trials_are_ranked_together_only_where_measured_alike():
    doc = {"format": 1, "experiment": "first", "parent_run_id": "p", "trials": [
        {**KnownTrial(OLD[0], "first", dict(MEASURED), "/w").to_dict()},
        {**KnownTrial(OLD[1], "zero", {**MEASURED, "budget": "small"}, None).to_dict()}]}
    earlier = earlier_search(parse_trials(json.dumps(doc), "t.json"), MEASURED, list(STEPPED))
    assert [k.record.trial_id for k in earlier.joint] == ["a"]
    assert [k.record.trial_id for k in earlier.prior] == ["b"]
    assert earlier.prior_reason == ["budget small -> smoke"]
    assert differences(MEASURED, MEASURED) == []
    [joint] = earlier.joint_records()
    assert (joint.origin, joint.best_checkpoint, joint.best_score) == ("first", "/w", 0.70)


@pytest.mark.parametrize("text, expected", [
    ("{", "is not valid JSON"), ('{"format": 2, "trials": []}', "expected format 1"),
    ('{"format": 1, "trials": [{"trial_id": "x"}]}', "trial 1 is damaged")])
def test_a_damaged_trials_file_is_one_error_naming_it(text, expected):
    with pytest.raises(ConfigError, match=expected) as err:
        parse_trials(text, "/exp/trials.json")
    assert "/exp/trials.json" in str(err.value)


def test_a_key_the_space_does_not_have_is_an_error_unless_every_trial_has_it_anyway():
    """check_known_trials, the rules beside a value outside its distribution (the driver
    tests below): a trainer field the space neither searches nor fixes passes only where
    the base config gives every trial that very value; a searched key must have a value;
    a quniform value off its step is refused only where the searcher is told it."""
    from mtbert.tune.results.extension import check_known_trials
    space = parse_space({"description": "d", "params": {
        "dropout": {"uniform": [0.0, 0.3]}, "smart_lambda_sst": {"quniform": [0, 4, 1]}}},
        "s.yaml")
    base = {"seed": 3, "max_length": 32}

    def check(config: dict, told: bool = True) -> None:
        row = KnownTrial(_record("t9", config, [0.5]), "first", dict(MEASURED), None)
        check_known_trials({"trials": [row.to_dict()]}, space, base, "f/trials.json", told)

    check({"dropout": 0.1, "smart_lambda_sst": 2.0, "seed": 3, "max_length": "32"})
    check({"dropout": 0.1, "smart_lambda_sst": 2.4}, told=False)   # PBT's x 1.2, not told
    for config, message in [
            ({"dropout": 0.1, "smart_lambda_sst": 2.0, "seed": 4},
             "seed=4: not a key of the space it was searched in (dropout, smart_lambda_sst), "
             "and every trial of this search trains with seed=3"),
            ({"dropout": 0.1, "smart_lambda_sst": 2.0, "lr": 1e-4},
             "lr=0.0001: not a key of the space it was searched in (dropout, "
             "smart_lambda_sst); a trial of that space trained with the trainer's default"),
            ({"dropout": 0.1}, "no value of smart_lambda_sst, which its space searches "
                               "(quniform [0, 4, step 1])"),
            ({"dropout": 0.1, "smart_lambda_sst": 2.4},
             "smart_lambda_sst=2.4 is not on the space's quniform [0, 4, step 1]"),
            ({"dropout": float("nan"), "smart_lambda_sst": 2.0}, "dropout=nan is not finite")]:
        with pytest.raises(ConfigError) as err:
            check(config)
        assert str(err.value).startswith(f"f/trials.json: trial t9: {message}"), err.value


# ---------------------------------------------------------------------- the driver
def _main(argv: list[str]) -> tuple[int, str, str]:
    from mtbert.tune.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    return rc, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def searches(shared_ray, tmp_path_factory, tiny_model_dir, tiny_data_dir):
    """first (3 trials) -> second (--extend first, 2 more, on the fused path: ``--fuse on``)
    -> third (--extend second, 1).  The first two store at a URI (``--storage-path
    file:///...``, as a cluster gives ``s3://...``): the second reads the first's settings
    and trials.json from it and downloads the old weights it ensembles; the third extends
    a local copy."""
    root = tmp_path_factory.mktemp("extend")
    storage = root / "ray_results"
    common = ["--storage-path", storage.as_uri(),
              "--mlflow-uri", sqlite_mlflow_store(root / "m.db"), "--max-concurrent", "1"]
    first = _main(["--space", "smoke", "--budget", "smoke", "--model", tiny_model_dir,
                   "--data-dir", tiny_data_dir, "--num-samples", "3", "--experiment", "first",
                   "--seed", "0", "--scheduler", "asha", *common])
    # every trial with weights is a candidate and (vote) a member: an old kept one too
    second = _main(["--extend", "first", "--num-samples", "2", "--experiment", "second",
                    "--ensemble-top-k", "5", "--ensemble", "vote", "--fuse", "on", *common])
    # the storage is copied elsewhere and the second search's original removed (nothing
    # may read it); its trials.json is made as searches wrote it before they named
    # weights relative to the experiment folder: absolute paths, under the folder gone
    moved = root / "moved"
    shutil.copytree(storage, moved)
    shutil.rmtree(storage / "second")
    written = json.loads((moved / "second" / "trials.json").read_text())  # as at the URI
    doc = copy.deepcopy(written)
    for row in doc["trials"]:
        if row["weights"]:
            row["weights"] = os.path.normpath(storage / "second" / row["weights"])
    (moved / "second" / "trials.json").write_text(json.dumps(doc))
    # every earlier trial whose weights are at hand is a candidate and (vote) a member
    third = _main(["--extend", "second", "--num-samples", "1", "--experiment", "third",
                   "--ensemble-top-k", "6", "--ensemble", "vote", *common[2:],
                   "--storage-path", str(moved)])
    out = {"storage": storage, "uri": f"sqlite:///{root / 'm.db'}", "common": common,
           "moved": moved, "absolute": doc, "second_as_written": written}
    for name, (rc, stdout, stderr) in (("first", first), ("second", second), ("third", third)):
        assert rc == 0, (name, stderr[-3000:])
        exp = (moved if name != "first" else storage) / name
        out[name] = {"dir": exp, "stdout": stdout,
                     "summary": json.loads((exp / "summary.json").read_text()),
                     "trials": json.loads((exp / "trials.json").read_text())}
    return out


def _own(summary: dict) -> list[dict]:
    return [t for t in summary["trials"] if not t["origin"]]


def test_the_extension_ranks_old_and_new_trials_together(searches):
    first, second = searches["first"]["summary"], searches["second"]["summary"]
    rows = second["trials"]
    assert sorted(t["trial_id"] for t in rows if t["origin"] == "first") == \
        sorted(t["trial_id"] for t in first["trials"])
    assert len(_own(second)) == 2 and second["counts"]["trials"] == 2
    scores = [t["val"]["val/overall"] for t in second["top_trials"]]
    assert scores == sorted(scores, reverse=True) and len(scores) == 5
    best = max(rows, key=lambda t: t["best_val_overall"] or -1)
    assert second["best_trial"]["trial_id"] == best["trial_id"]
    assert second["extends"]["experiment"] == "first"
    assert second["extends"]["joint_trials"] == 3 and second["extends"]["told"] == 3
    assert "searcher was told 3 earlier trials" in searches["second"]["stdout"]
    assert "Extends search `first`" in (searches["second"]["dir"] / "summary.md").read_text()


def test_no_old_trial_trains_again(searches):
    """Ray's experiment of the extension (on the fused path) holds its own trials only,
    the examples it trained are theirs, and none repeats an old completed configuration."""
    from ray.tune import ExperimentAnalysis
    first, second = searches["first"]["summary"], searches["second"]["summary"]
    assert "[tune] fused: trainer 0: 2 trials" in searches["second"]["stdout"]
    analysis = ExperimentAnalysis(str(searches["second"]["dir"]),
                                  default_metric=OBJECTIVE, default_mode="max")
    ray_trials = {t.trial_id: t for t in analysis.trials}
    assert set(ray_trials) == {t["trial_id"] for t in _own(second)}
    trained = sum(int(df["examples_seen"].max()) for df in analysis.trial_dataframes.values())
    assert trained == sum(t["examples_seen"] for t in _own(second)) > 0
    old = {json.dumps(t["searched"], sort_keys=True) for t in first["trials"]
           if t["status"] == "completed"}
    assert not old & {json.dumps(t["searched"], sort_keys=True) for t in _own(second)}


def test_the_ensemble_takes_an_old_trials_kept_weights(searches):
    import torch

    from mtbert.run.inference import load_checkpoint_model
    first, second = searches["first"]["summary"], searches["second"]["summary"]
    kept = set(first["models"])                       # the first search's best and members
    ens = second["ensemble"]
    old_members = kept & set(ens["members"])
    assert old_members, (kept, ens)
    for tid in old_members:   # copied into the extension's models/, the same weights
        _, a = load_checkpoint_model(searches["first"]["dir"] / "models" / tid)
        _, b = load_checkpoint_model(searches["second"]["dir"] / "models" / tid)
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name
    # the old trials whose weights the first search removed are ranked, not ensembled
    gone = {t["trial_id"] for t in first["trials"]} - kept
    assert set(second["extends"]["left_out"]) == gone - {t["trial_id"] for t in first["trials"]
                                                         if t["best_val_overall"] is None}
    assert not gone & set(ens["candidates"])


def test_mlflow_links_the_parents_and_keeps_the_old_runs(searches):
    from mlflow import MlflowClient
    client = MlflowClient(tracking_uri=searches["uri"])
    first, second = searches["first"]["summary"], searches["second"]["summary"]
    parent = client.get_run(second["mlflow"]["parent_run_id"])
    assert parent.data.tags["extends"] == "first"
    assert parent.data.tags["extends_run_id"] == first["mlflow"]["parent_run_id"]
    assert "first" in parent.data.tags["mlflow.note.content"]
    runs = client.search_runs([second["mlflow"]["experiment_id"]],
                              "tags.kind = 'trial'", max_results=100)
    by_parent: dict[str, set] = {}
    for r in runs:
        by_parent.setdefault(r.data.tags["mlflow.parentRunId"], set()).add(r.data.tags["trial_id"])
    assert by_parent[first["mlflow"]["parent_run_id"]] == {t["trial_id"] for t in first["trials"]}
    assert by_parent[second["mlflow"]["parent_run_id"]] == {t["trial_id"] for t in _own(second)}
    # an old trial that ranks in the extension links to its own run
    rows = {t["trial_id"]: t for t in first["trials"]}
    for t in second["top_trials"]:
        if t["origin"]:
            assert t["mlflow_run_id"] == rows[t["trial_id"]]["mlflow_run_id"]


def test_extending_twice_chains(searches):
    third = searches["third"]
    origins = [t["origin"] for t in third["trials"]["trials"]]
    assert sorted(origins) == ["first"] * 3 + ["second"] * 2 + ["third"]
    assert third["summary"]["extends"]["told"] == 5
    assert len(third["summary"]["trials"]) == 6
    # every kept weight the chain knows of is a folder that loads, named relative to the
    # experiment folder
    for t in third["trials"]["trials"]:
        if t["weights"]:
            assert not Path(t["weights"]).is_absolute(), t
            assert (third["dir"] / t["weights"] / "config.yaml").is_file(), t


def test_a_moved_search_is_extended_from_its_copy(searches):
    """The second search was copied elsewhere, its original removed, and its trials.json
    named weights by absolute paths under the folder gone (as searches wrote it before
    they were relative): the extension finds them in the copy, and its ensemble takes
    every earlier trial whose weights the second search kept."""
    second, third = searches["second"], searches["third"]["summary"]
    assert not (searches["storage"] / "second").exists()
    gone = [row["weights"] for row in searches["absolute"]["trials"] if row["weights"]
            and row["weights"].startswith(str(searches["storage"] / "second") + os.sep)]
    assert gone and not any(Path(w).exists() for w in gone)
    kept = set(second["summary"]["models"])     # its best and members, in its models/
    assert kept and kept <= set(third["ensemble"]["members"])
    assert not kept & set(third["extends"]["left_out"])
    assert set(third["ensemble"]["members"]) == set(third["ensemble"]["candidates"])
    for tid in kept:  # the weights read from the copy are those the second search kept
        assert (searches["third"]["dir"] / "models" / tid / "config.yaml").is_file()


def test_another_budget_is_a_prior_only(searches, tiny_model_dir):
    # (the default scheduler, promoting ASHA: told at the first rung)
    rc, out, err = _main(["--extend", "first", "--budget", "small", "--num-samples", "1",
                          "--scheduler", "asha-promote", "--experiment", "prior",
                          *searches["common"]])
    assert rc == 0, err[-2000:]
    s = json.loads((searches["storage"] / "prior" / "summary.json").read_text())
    assert s["extends"]["prior_trials"] == 3 and s["extends"]["joint_trials"] == 0
    assert "budget smoke -> small" in s["extends"]["prior_reason"]
    assert s["extends"]["told"] == 3
    assert [t["origin"] for t in s["trials"]] == [""]          # never ranked with them
    assert "as prior only" in out


def test_a_search_on_a_uri_storage_is_extended_from_its_uri(searches):
    """``--storage-path file:///...`` (the fixture's first and second searches): trials.json
    names weights relative to the experiment folder, not by the URI nor a staging path;
    the extension took the old trials' weights it ensembles from the first search's URI
    and kept them at its own (the same weights: test_the_ensemble_takes_an_old_trials_kept
    _weights), and its trials.json names each kept weight as its own or the first's."""
    from mtbert.tune.infra.location import is_uri
    assert is_uri(searches["common"][1])
    first = searches["first"]["trials"]
    kept = {t["trial_id"]: t["weights"] for t in first["trials"] if t["weights"]}
    assert kept and all(w == f"models/{tid}" and not is_uri(w) for tid, w in kept.items())
    assert set(kept) & set(searches["second"]["summary"]["ensemble"]["members"])
    second = searches["moved"] / "second"  # a copy of what the URI held
    weights = [t["weights"] for t in searches["second_as_written"]["trials"] if t["weights"]]
    assert weights and all((second / w / "config.yaml").is_file() for w in weights)
    assert {w.split("/")[0] for w in weights} <= {"models", ".."}   # theirs, or first's


def test_a_resumed_extension_keeps_its_own_settings(searches, tmp_path):
    """``--resume`` of a search started with ``--extend``: its saved settings (here another
    budget than the search it extends) stand, and the earlier trials are read again."""
    from mtbert.tune.cli import build_parser
    from mtbert.tune.saved_settings import SETTINGS_FILE
    from mtbert.tune.settings import resolve_settings
    storage = tmp_path / "rr"
    shutil.copytree(searches["first"]["dir"], storage / "first")
    shutil.copytree(searches["first"]["dir"], storage / "grown",
                    ignore=shutil.ignore_patterns("mtbert_pruned.json", "trials.json"))
    saved = json.loads((storage / "grown" / SETTINGS_FILE).read_text())
    saved["args"].update(extend="first", budget="small", experiment="grown",
                         storage_path=str(storage))
    (storage / "grown" / SETTINGS_FILE).write_text(json.dumps(saved))
    args = build_parser().parse_args(["--resume", "--experiment", "grown",
                                      "--storage-path", str(storage)])
    args.given = frozenset({"resume", "experiment", "storage_path"})
    settings = resolve_settings(args)
    assert (settings.extend, settings.budget.name) == ("first", "small")
    assert len(settings.extend_trials["trials"]) == 3


def _listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


#: an earlier trial that is no point of the space it was searched in (smoke: lr
#: loguniform [1e-4, 5e-3], dropout uniform [0, 0.3], batch_size choice 8, 16, warmup_ratio
#: fixed 0): (the change to its config, what the error says after "trial ID: ")
NOT_OF_THE_SPACE = {
    "out_of_range": ({"dropout": 0.5}, "dropout=0.5 is outside the space's uniform [0, 0.3]"),
    "wrong_type": ({"lr": "0.001"}, "lr='0.001' is not a number"),
    "unknown_key": ({"colour": "red"}, "colour: not a key of the space it was searched in "
                                       "(lr, dropout, batch_size, warmup_ratio) nor of the "
                                       "trainer's config"),
    "not_a_choice": ({"batch_size": 12}, "batch_size=12 is not one of the space's choices "
                                         "(8, 16)"),
    "not_fixed": ({"warmup_ratio": 0.1}, "warmup_ratio=0.1: the space fixes it at 0.0"),
}


@pytest.mark.parametrize("case", ["missing", "other_space", "damaged_settings",
                                  "damaged_trials", "unfinished", "with_resume",
                                  *NOT_OF_THE_SPACE])
def test_a_bad_extend_exits_2_with_one_line_and_writes_nothing(searches, case, tmp_path):
    """Every bad ``--extend`` is one ``error:`` line and nothing written: no experiment
    folder, no MLflow store or run.  An earlier trial outside its space was told to
    Optuna once Ray, the folder and the parent run were up, and died in its add_trial."""
    storage = searches["storage"]
    if case in NOT_OF_THE_SPACE:
        storage = tmp_path / "rr"
        shutil.copytree(searches["first"]["dir"], storage / "first")
        path = storage / "first" / "trials.json"
        doc = json.loads(path.read_text())
        doc["trials"][1]["config"].update(NOT_OF_THE_SPACE[case][0])
        path.write_text(json.dumps(doc))
        trial = doc["trials"][1]["trial_id"]
    if case in ("damaged_settings", "damaged_trials", "unfinished"):
        storage = tmp_path / "rr"
        shutil.copytree(searches["first"]["dir"], storage / "first")
        name = {"damaged_settings": "mtbert_search.json", "damaged_trials": "trials.json",
                "unfinished": "trials.json"}[case]
        path = storage / "first" / name
        text = path.read_text()
        path.write_text(text.replace('"complete": true', '"complete": false')
                        if case == "unfinished" else text[: len(text) // 2])
    before = _listing(storage)
    argv = {"missing": ["--extend", "nowhere"],
            "other_space": ["--extend", "first", "--space", "smart"],
            "with_resume": ["--extend", "first", "--resume"]}.get(case, ["--extend", "first"])
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    rc, out, err = _main([*argv, "--storage-path", str(storage), "--mlflow-uri", uri,
                          "--experiment", "next"])
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    expected = {"missing": "no search in", "other_space": "it searched space 'smoke'",
                "damaged_settings": "mtbert_search.json is not valid JSON",
                "damaged_trials": "trials.json is not valid JSON",
                "unfinished": "did not finish", "with_resume": "give one of them"}.get(case)
    if case in NOT_OF_THE_SPACE:
        expected = (f"--extend first: {storage / 'first' / 'trials.json'}: trial {trial}: "
                    f"{NOT_OF_THE_SPACE[case][1]}")
    assert expected in lines[0]
    assert _listing(storage) == before and not (tmp_path / "m.db").exists()
