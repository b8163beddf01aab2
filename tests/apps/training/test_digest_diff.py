"""``--digest`` / ``--telemetry`` records and ``mxfp8-digest-diff`` (apps.training.digest_diff).

Runs (in-process, one gloo rank; the tiny GPT compiles once for the module): two identical runs
are identical; another seed differs at the start state; another lr at the main weights after
step 0 (the gradients of step 0 still agree); a run saved at step 2 and resumed is identical to an
uninterrupted one (slow: ~25 s for the five runs). Bad input (a missing file, no digests,
malformed lines, other models, no common point, a file that disagrees with itself) gives exit
status 2 (1 for the disagreement) and says why. The world-size independence of the digests
is tested in tests/torch_side/instruments/test_instruments.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from apps.training import digest_diff
from apps.training.digest_diff import GRAD, STATE, DigestError, compare, load_digests
from apps.training.job import RunOptions, TrainJob
from apps.training.loop import train_rank
from apps.training.metrics import read_metrics, steps

JOB = TrainJob(steps=4, micro_batches=1, batch_size=2, seq_len=32, eval_batches=1, seed=2)


def _run(path, job=JOB, **kw) -> str:
    train_rank(job, RunOptions(progress=False, precompile=False, metrics=str(path), digest=True,
                               **kw))
    return str(path)


@pytest.fixture(scope="module")
def runs(single_rank_world, tmp_path_factory):
    d = tmp_path_factory.mktemp("digest")
    out = {
        "a": _run(d / "a.jsonl", telemetry=True),
        "again": _run(d / "again.jsonl"),
        "seed": _run(d / "seed.jsonl", dataclasses.replace(JOB, seed=3)),
        "lr": _run(d / "lr.jsonl", dataclasses.replace(JOB, lr=2 * JOB.lr)),
    }
    # interrupted after step 1 (checkpoint at 2), resumed into the same metrics file
    _run(d / "resumed.jsonl", dataclasses.replace(JOB, steps=2), save_dir=str(d / "ck"))
    out["resumed"] = _run(d / "resumed.jsonl", resume=str(d / "ck"))
    return out


def _diff(capsys, a, b) -> tuple[int, str, str]:
    code = digest_diff.main([str(a), str(b)])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.slow
def test_identical_runs_are_identical(runs, capsys):
    code, out, _ = _diff(capsys, runs["a"], runs["again"])
    assert code == 0 and out.startswith("identical: 9 points compared"), out
    assert "step 3, after its update" in out


@pytest.mark.slow
def test_another_seed_differs_at_the_start(runs, capsys):
    v = compare(load_digests(runs["a"]), load_digests(runs["seed"]))
    first = v.differences[0]
    assert first.point == (0, STATE) and first.tensor == "main" and v.compared == [(0, STATE)]
    code, out, _ = _diff(capsys, runs["a"], runs["seed"])
    assert code == 1 and "first difference: start, before step 0: group" in out


@pytest.mark.slow
def test_another_lr_differs_at_the_main_weights_after_step_0(runs, capsys):
    v = compare(load_digests(runs["a"]), load_digests(runs["lr"]))
    assert v.compared == [(0, STATE), (0, GRAD), (1, STATE)]
    first = v.differences[0]
    assert first.tensor == "main" and first.group == next(iter(
        load_digests(runs["a"]).points[(1, STATE)]))
    code, out, _ = _diff(capsys, runs["a"], runs["lr"])
    assert code == 1 and "first difference: step 0, after its update" in out
    assert "tensor 'main'" in out and "identical before it: 2 points" in out


@pytest.mark.slow
def test_a_resumed_run_is_identical_to_an_uninterrupted_one(runs, capsys):
    resumed = load_digests(runs["resumed"])
    assert resumed.conflicts == [] and (2, STATE) in resumed.points
    code, out, _ = _diff(capsys, runs["a"], runs["resumed"])
    assert code == 0 and "identical: 9 points" in out, out


@pytest.mark.slow
def test_telemetry_rides_in_the_step_records(runs):
    records = steps(read_metrics(runs["a"]))
    assert len(records) == JOB.steps
    for r in records:
        assert r["telemetry_s"] >= 0 and r["digest_s"] >= 0
        groups = r["telemetry"]
        assert groups and all(set(planes) == {"rowwise", "colwise"} for planes in groups.values())
        for s in (p for planes in groups.values() for p in planes.values()):
            assert sum(s["scale_exp"]["counts"]) + s["nan_scales"] == s["blocks"] > 0
            assert 0 <= s["headroom_bits"]["min"] <= s["headroom_bits"]["max"] < 1
            assert 0 <= s["zero_share"] < 1 and 0 <= s["changed_share"] <= 1


# ---- bad input ----------------------------------------------------------------------------

def _write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


D0 = {"g/mxfp8": {"main": "00", "rowwise": "01"}}


def _step(step, digest):
    return {"kind": "step", "step": step, "loss": 1.0, "tokens_per_s": 1.0, "step_s": 1.0,
            "digest": digest}


def _start(digest, resumed_from=0):
    return {"kind": "run", "world_size": 1, "resumed_from": resumed_from, "digest": digest}


@pytest.mark.parametrize("case, expect", [
    ("missing", "does not exist"),
    ("no_digest", "no digests in this metrics file; train with --digest"),
    ("malformed", "malformed metrics line"),
    ("bad_digest", "'digest' must map group -> tensor -> hex string"),
    ("empty_digest", "bad.jsonl:1: 'digest' hashes no tensor (got {})"),
    ("empty_group", "bad.jsonl:2: 'digest' hashes no tensor (got {'g/mxfp8': {}})"),
    ("other_model", "the runs have different parameter groups"),
    ("other_tensors", "compare runs of the same model and weights recipe"),
    ("disjoint", "no point in common"),
])
def test_bad_input_is_exit_2_with_the_reason(tmp_path, capsys, case, expect):
    good = _write(tmp_path / "good.jsonl", [_start(D0), _step(0, D0)])
    bad = tmp_path / "bad.jsonl"
    if case == "no_digest":
        _write(bad, [{"kind": "run", "world_size": 1}, {**_step(0, D0), "digest": None}])
    elif case == "malformed":
        bad.write_text('{"kind": "run"\n')
    elif case == "bad_digest":
        _write(bad, [_start({"g/mxfp8": ["00"]})])
    elif case == "empty_digest":  # was "identical: 1 points compared"
        _write(bad, [_start({}), _step(0, {})])
    elif case == "empty_group":
        _write(bad, [_start(D0), _step(0, {"g/mxfp8": {}})])
    elif case == "other_model":
        _write(bad, [_start({"h/fp32": {"main": "00"}})])
    elif case == "other_tensors":
        _write(bad, [_start({"g/mxfp8": {"main": "00"}})])
    elif case == "disjoint":
        _write(bad, [_start(D0, resumed_from=5)])
    code, out, err = _diff(capsys, good, bad)
    assert code == 2 and out == "" and expect in err, err
    assert err.startswith("mxfp8-digest-diff: error: ")


@pytest.mark.parametrize(("record", "expect"), [
    (_start(D0, resumed_from="two"), "bad.jsonl:1: a 'run' record's 'resumed_from' must be an "
                                     "integer >= 0, got two"),
    (_start(D0, resumed_from=-1), "'resumed_from' must be an integer >= 0, got -1"),
    ({**_start(D0), "world_size": [2]}, "'world_size' must be an integer >= 1, got [2]"),
    (_step(True, D0), "a 'step' record's 'step' must be an integer >= 0, got True"),
    (None, "bad.jsonl:1: malformed metrics line: nested deeper"),  # None: a deep line
])
def test_malformed_fields_are_bad_input_not_a_difference(tmp_path, capsys, record, expect):
    """A malformed ``resumed_from`` (or a deeply nested line) exited 1, the "runs differ"
    status, with a traceback (TypeError comparing points; RecursionError)."""
    good = _write(tmp_path / "good.jsonl", [_start(D0), _step(0, D0)])
    bad = tmp_path / "bad.jsonl"
    if record is None:  # nested deeper than the JSON reader follows
        bad.write_text('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    else:
        _write(bad, [record, _step(0, D0)])
    code, out, err = _diff(capsys, good, bad)
    assert (code, out) == (2, "") and expect in err, err


def test_two_files_of_empty_digests_are_not_called_identical(tmp_path, capsys):
    """They were: "identical: 1 points compared", of nothing."""
    a = _write(tmp_path / "a.jsonl", [_start({})])
    b = _write(tmp_path / "b.jsonl", [_start({})])
    code, out, err = _diff(capsys, a, b)
    assert (code, out) == (2, "") and "a.jsonl:1: 'digest' hashes no tensor" in err, err


def test_a_file_that_disagrees_with_itself_is_reported(tmp_path, capsys):
    """A resume whose loaded state hashes differently from the state the first run saved."""
    other = {"g/mxfp8": {"main": "02", "rowwise": "01"}}
    a = _write(tmp_path / "a.jsonl", [_start(D0), _step(0, D0), _start(other, resumed_from=1),
                                      _step(1, D0)])
    b = _write(tmp_path / "b.jsonl", [_start(D0), _step(0, other), _step(1, D0)])
    code, out, _ = _diff(capsys, a, b)
    assert code == 1
    assert "step 0, after its update hashes differently at line 3 (the run's start)" in out
    assert "not bit-exact" in out


def test_the_first_difference_is_the_earliest_point_and_tensor(tmp_path):
    d1 = {"g": {"main": "0", "grad": "0", "rowwise": "0"}}
    d2 = {"g": {"main": "0", "grad": "1", "rowwise": "1"}}  # grad before rowwise
    a = load_digests(_write(tmp_path / "a.jsonl", [_start({"g": {"main": "0", "rowwise": "0"}}),
                                                   _step(0, d1)]))
    b = load_digests(_write(tmp_path / "b.jsonl", [_step(0, d2)]))
    v = compare(a, b)
    assert [(d.point, d.tensor) for d in v.differences] == [((0, GRAD), "grad")]
    with pytest.raises(DigestError):
        load_digests(tmp_path / "nowhere.jsonl")
