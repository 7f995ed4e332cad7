"""Ctrl-C in the middle of a profile: one line, exit 130, and the file keeps what was
measured, saying "partial" and what it lacks; a simulated run then refuses it, naming that."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from pcpflow.testing import cli

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def test_ctrl_c_keeps_a_partial_profile(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pcpflow", "mode=profile", "pcp=2", "profile.quick=true", f"hydra.run.dir={run}",
         "output.progress=false"],
        cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    path, deadline = run / "hardware.yaml", time.monotonic() + 180

    def measured() -> list:
        try:
            return list((yaml.safe_load(path.read_text()) or {}).get("tables") or {})
        except (OSError, yaml.YAMLError):
            return []

    while "gemm" not in measured():  # launch, memory and a GEMM table done: attention is next
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the profile never got that far"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and "interrupted by SIGINT" in lines[0] and "(partial)" in lines[0], err[-3000:]
    doc = yaml.safe_load(path.read_text())
    assert doc["measured"]["status"] == "partial" and "collectives" in doc["measured"]["missing"]
    assert doc["tables"]["gemm"]["float32"]["seconds"] and "gemm:float32" not in doc["measured"]["missing"]
    r = cli("mode=simulate", "hardware=measured", f"hardware.path={path}", "dtype=float32", "model=tiny_gqa", "pcp=2",
            f"hydra.run.dir={tmp_path / 'sim'}")
    assert r.returncode == 2 and "partial" in r.stderr and "collectives" in r.stderr, r.stderr


def test_a_quick_profile_of_two_ranks_measures_every_section(tmp_path):
    """A whole quick profile at pcp=2, its ranks bound to cores of their own: complete, every
    section's table, the waits for the slowest rank among them, and a simulated run prices on it."""
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "pcpflow", "mode=profile", "pcp=2", "profile.quick=true", "cpu_bind=cores",
                        f"hydra.run.dir={run}", "output.progress=false"],
                       cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}, text=True,
                       capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = yaml.safe_load((run / "hardware.yaml").read_text())
    assert doc["measured"]["status"] == "complete" and not doc["measured"]["missing"]
    assert doc["measured"]["cpu_bind"] == "cores"
    tables = doc["tables"]
    assert {"gemm", "attention", "memory", "launch", "host", "collectives", "sync"} <= set(tables)
    sync = tables["sync"]
    # the work as it ran: the grid's 0.5 and 4 ms, its repeats sized by one timed call; a machine
    # busy with other work stretches both alike, so their ratio (8) is what is checked
    assert len(sync["work_s"]) == len(sync["excess_s"]) == 2 and min(sync["excess_s"]) >= 0
    assert 0 < sync["work_s"][0] and 4 < sync["work_s"][1] / sync["work_s"][0] < 16
    assert sync["fixed_us"] >= 0 and sync["per_work"] >= 0
    sim = cli("mode=simulate", "hardware=measured", f"hardware.path={run / 'hardware.yaml'}", "dtype=float32",
              "model=tiny_gqa", "pcp=2", f"hydra.run.dir={tmp_path / 'sim'}", "output.plots=false")
    assert sim.returncode == 0, sim.stderr[-3000:]
