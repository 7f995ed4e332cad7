"""pcpflow.output.rundir: result.json and config.json are strict JSON that any reader takes."""

from __future__ import annotations

import json

import numpy as np

from pcpflow.driver.cli import main
from pcpflow.output.rundir import dumps, load_frozen_config


def _strict_loads(text: str):
    """json.loads that refuses Infinity and NaN, as strict readers (JavaScript, jq) do."""
    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(text, parse_constant=refuse)


def test_a_float_that_is_not_finite_is_written_as_the_string_python_reads_back():
    text = dumps({"rate": float("inf"), "low": -np.inf, "nan": [np.float64("nan")], "ok": np.float32(0.5),
                  "arr": np.array([1.0, np.inf])})
    got = _strict_loads(text)
    assert got == {"rate": "inf", "low": "-inf", "nan": ["nan"], "ok": 0.5, "arr": [1.0, "inf"]}
    assert float(got["rate"]) == float("inf") and np.isnan(float(got["nan"][0]))


def test_request_rate_inf_gives_strict_json_that_loads_back(tmp_path):
    """workload.request_rate=inf (all at once, as documented) in result.json and config.json."""
    code = main(["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload.num_requests=3",
                 "workload.request_rate=inf", "output.plots=false", "output.progress=false",
                 f"hydra.run.dir={tmp_path}"])
    assert code == 0
    for name in ("result.json", "config.json"):
        text = (tmp_path / name).read_text()
        assert "Infinity" not in text, name
        _strict_loads(text)
    assert _strict_loads((tmp_path / "result.json").read_text())["config"]["workload"]["request_rate"] == "inf"
    assert load_frozen_config(tmp_path).workload.request_rate == float("inf")


def test_a_run_that_takes_a_dir_drops_the_older_result(tmp_path):
    """An older run's ok beside a new run's config would describe a run that never finished
    (one killed outright writes nothing)."""
    from pcpflow.output.rundir import discard_result, result_of, write_result

    write_result(tmp_path, result_of({}, {"seed": 0}))
    discard_result(tmp_path)
    assert not (tmp_path / "result.json").exists()


def test_a_refused_command_keeps_the_older_result_aside(tmp_path):
    """Bad input loses nothing: the older run's result is result.previous.json, and result.json
    says the command was refused; a second refusal keeps the same older result aside."""
    from pcpflow.output.rundir import failed_result, result_of, write_refusal, write_result

    write_result(tmp_path, result_of({}, {"seed": 0}))
    older = (tmp_path / "result.json").read_text()
    for typo in ("pcp=x", "pcp=y"):
        write_refusal(tmp_path, failed_result(f"{typo}: invalid", {"overrides": [typo]}, 2))
        assert (tmp_path / "result.previous.json").read_text() == older
        assert json.loads((tmp_path / "result.json").read_text())["error"] == f"{typo}: invalid"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json", "result.previous.json"]


def test_a_write_cut_short_leaves_the_previous_result_whole_and_no_temporary_file(tmp_path, monkeypatch):
    import os

    import pytest

    from pcpflow.output.rundir import result_of, write_result
    from pcpflow.signals import Interrupted

    write_result(tmp_path, result_of({}, {"seed": 0}))
    before = (tmp_path / "result.json").read_text()

    def interrupted(*_):
        raise Interrupted(2)  # the signal lands between the write and the rename

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(Interrupted):
        write_result(tmp_path, result_of({}, {"seed": 1}))
    assert (tmp_path / "result.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["result.json"]


def test_progress_of_a_run_that_did_not_finish_is_its_last_whole_step(tmp_path):
    from pcpflow.output.rundir import progress_of

    assert progress_of(tmp_path) == {"progress": {"last_step": None, "num_generated": 0, "num_to_generate": None}}
    lines = [json.dumps({"step": s, "num_generated": 3 * s, "num_to_generate": 30}) for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 4, "num_gen')  # a crash cut the last one
    assert progress_of(tmp_path) == {"progress": {"last_step": 3, "num_generated": 9, "num_to_generate": 30}}


def test_a_run_that_takes_a_dir_drops_the_older_metrics_too(tmp_path):
    from pcpflow.output.rundir import discard_result, progress_of

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 99, "num_generated": 5, "num_to_generate": 5}) + "\n")
    discard_result(tmp_path)
    assert progress_of(tmp_path)["progress"]["last_step"] is None


def test_a_ctrl_c_before_the_run_started_keeps_the_older_result_aside(tmp_path, capsys):
    import signal

    from pcpflow.driver.cli import interrupted_before_the_job
    from pcpflow.output.rundir import result_of, write_result
    from pcpflow.signals import Interrupted

    write_result(tmp_path, result_of({}, {"seed": 0}))
    older = (tmp_path / "result.json").read_text()
    assert interrupted_before_the_job(Interrupted(signal.SIGINT), tmp_path) == 130
    assert (tmp_path / "result.previous.json").read_text() == older
    assert json.loads((tmp_path / "result.json").read_text())["error"] == "interrupted by SIGINT before the run started"
    assert "interrupted by SIGINT before the run started" in capsys.readouterr().err
