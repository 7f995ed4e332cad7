"""The device check script runs end to end on CPU (``--dry-run``: every section at toy
sizes, the measure-then-predict loop included) and writes its report and hardware profile; rank -> device mapping and the
single-GPU refusal, with CUDA mocked (no GPU needed)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from pcpflow.errors import ConfigError
from pcpflow.rank.devices import pick_backend, pick_device
from pcpflow.testing import compose

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # ~15 s: the whole device script on CPU (the default set keeps the cut run below)
def test_dry_run_reports_every_section(tmp_path):
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(tmp_path), "--budget-s", "900"],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    sections = report["sections"]
    assert {k: v["status"] for k, v in sections.items()} == dict.fromkeys(
        ["env", "hardware", "profile", "attention", "runs", "predict", "roofline"], "ok"
    ), json.dumps(report, indent=1)[:4000]
    # The measure-then-predict loop: a complete profile of what the runs run, each Llama run priced on it.
    assert sections["profile"]["profile_status"] == "complete" and sections["profile"]["exit_code"] == 0
    predicted = {k: v for k, v in sections["predict"].items() if k.startswith("llama3_8b_dims/")}
    assert set(predicted) == {"llama3_8b_dims/40/none", "llama3_8b_dims/40/full_decode_only"}, sections["predict"]
    for row in predicted.values():
        assert row["predicted_ttft_s"] > 0 and row["predicted_tpot_s"] > 0 and row["ttft_error"] is not None, row
    profile = sections["hardware"]["hardware_profile"]
    assert profile["hbm_tbps"] > 0 and set(profile["peak_tflops"]) >= {"bf16"}
    assert "peak_tflops: {bf16:" in (tmp_path / "hardware_measured.yaml").read_text()
    for name in ("gqa_llama3_8b", "mla_16_heads", "gqa_window_1024", "gqa_chunked_2048"):
        att = sections["attention"][name]
        assert att["max_abs_out_diff"] < 0.05 and att["fused_s"] > 0  # bf16 inputs
    runs = sections["runs"]
    graphs = runs["llama3_8b_dims/40/full_decode_only"]
    assert graphs["verify"]["passed"] and graphs["cudagraph"]["graph_forward_steps"] > 0, graphs
    assert graphs["same_tokens_as_eager"] and graphs["tpot_speedup_vs_eager"] > 0, graphs
    sunk = runs["tiny_gqa_sinks_chunked/full_decode_only"]  # sinks and a chunk through the graph kernel
    assert sunk["verify"]["passed"] and sunk["same_tokens_as_eager"], sunk


def test_a_cut_run_still_reports(tmp_path):
    """A budget too small for any timed section: the report says what was skipped."""
    from importlib import util

    spec = util.spec_from_file_location("gpu_check", ROOT / "scripts" / "gpu_check.py")
    gpu_check = util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "1"]) == 0
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert sections["env"]["status"] == "ok"
    assert sections["hardware"]["status"].startswith("skipped")


def test_rank_to_device_follows_local_rank():
    cfg = compose(["pcp=1", "device=cpu"])
    assert pick_device(cfg.device) == torch.device("cpu") and pick_backend(cfg.backend, torch.device("cpu")) == "gloo"
    with mock.patch.object(torch.cuda, "is_available", return_value=True), mock.patch.object(
        torch.cuda, "device_count", return_value=4
    ):
        cfg = compose(["pcp=4"])
        with mock.patch.dict(os.environ, {"LOCAL_RANK": "3"}):
            assert pick_device(cfg.device) == torch.device("cuda", 3)
        assert pick_backend(cfg.backend, torch.device("cuda", 0)) == "nccl"
        with mock.patch.dict(os.environ, {"LOCAL_RANK": "5"}), pytest.raises(RuntimeError, match="no GPU of its own"):
            pick_device(cfg.device)


def test_single_gpu_runs_pcp1_and_refuses_more_ranks():
    with mock.patch.object(torch.cuda, "is_available", return_value=True), mock.patch.object(
        torch.cuda, "device_count", return_value=1
    ):
        compose(["pcp=1"])
        compose(["pcp=2", "device=cpu"])  # multi-rank layouts stay available on CPU
        with pytest.raises(ConfigError) as err:
            compose(["pcp=2"])
        (problem,) = err.value.problems
        assert problem.field == "pcp" and "needs 2 GPUs on this node, 1 visible" in problem.allowed
