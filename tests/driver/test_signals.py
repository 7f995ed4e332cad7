"""Ctrl-C and SIGTERM (SIGHUP, SIGQUIT) at every moment of a job: validation, rank start-up, the steps, the
plots, between a sweep's jobs. Each ends within seconds with exit 130 / 143, one line on the
console (no traceback, no launcher chatter), and result.json ``failed`` naming the signal;
a sweep stops and reports the jobs it finished.

The signal goes to the driver's whole process group, as a terminal's Ctrl-C does. A moment
is held open by ``tests/signal_pause`` (a sitecustomize that pauses one driver function and
touches a flag file), so the signal lands exactly there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAUSE = Path(__file__).resolve().parents[1] / "signal_pause"
QUIET = ["output.progress=false", "workload.num_requests=3", "workload.output_len=[3,5]"]

pytestmark = [pytest.mark.slow, pytest.mark.dist]


def _start(args: list[str], tmp_path: Path, pause: str | None) -> tuple[subprocess.Popen, Path]:
    flag = tmp_path / "paused"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PCPFLOW_TEST_PAUSE_FLAG": str(flag),
           "PYTHONPATH": os.pathsep.join([str(PAUSE), str(REPO), os.environ.get("PYTHONPATH", "")])}
    if pause:
        env["PCPFLOW_TEST_PAUSE"] = pause
    proc = subprocess.Popen([sys.executable, "-m", "pcpflow", *args], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    return proc, flag


def _signal_when(proc: subprocess.Popen, ready, signum: int) -> tuple[str, float]:
    """Waits for ``ready()``, signals the process group, returns (stderr, seconds to exit)."""
    deadline = time.monotonic() + 180
    while not ready():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(proc.pid, signum)
    _, err = proc.communicate(timeout=120)
    return err, time.monotonic() - t0


def _assert_one_line(err: str, signame: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err[-3000:]
    assert lines[0].startswith("pcpflow: ") and signame in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(
    ("moment", "pause", "sig"),
    [
        ("run dir", "pcpflow.driver.cli:planned_run_dir", signal.SIGHUP),  # before Hydra has resolved it
        ("hydra", "pcpflow.driver.cli:_task", signal.SIGTERM),  # Hydra started, the job not yet
        ("validation", "pcpflow.driver.job:prepare_job", signal.SIGINT),
        ("start-up", "pcpflow.driver.launch:launch_ranks", signal.SIGTERM),
        ("steps", None, signal.SIGINT),
        ("steps", None, signal.SIGHUP),  # a closed terminal: the resource tracker must not die noisily
        ("steps", None, signal.SIGQUIT),  # Ctrl-\: no core dumped by every process, 131 and a result
        ("plots", "pcpflow.output.report:write_plots", signal.SIGINT),
        ("summary", "pcpflow.output.report:print_summary", signal.SIGTERM),
    ],
)
def test_a_signal_at_any_moment_of_a_run(tmp_path, moment, pause, sig):
    run = tmp_path / "run"
    proc, flag = _start(["pcp=2", f"hydra.run.dir={run}", *QUIET, *(["workload.num_requests=40"] if moment == "steps" else [])],
                        tmp_path, pause)
    ready = (lambda: (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text().count("\n") >= 2) \
        if pause is None else flag.exists
    err, took = _signal_when(proc, ready, sig)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, (moment, proc.returncode, err[-3000:])
    assert took < 10, (moment, took)
    _assert_one_line(err, name)
    result = json.loads((run / "result.json").read_text())
    assert result["status"] == "failed" and result["exit_code"] == 128 + sig and name in result["error"], result["error"]


def test_a_signal_between_the_jobs_of_a_sweep_stops_it_and_reports_what_ran(tmp_path):
    sweep = tmp_path / "sweep"
    # held after the first job returned, before the second starts
    proc, flag = _start(["-m", "pcp=1", "seed=0,1,2", f"hydra.sweep.dir={sweep}", *QUIET], tmp_path, "pcpflow.driver.job:run_job:after")
    err, took = _signal_when(proc, flag.exists, signal.SIGINT)
    assert proc.returncode == 130 and took < 10, err[-3000:]
    line = _assert_one_line(err, "SIGINT")
    assert "after 1 job(s) (2 of 3 not run)" in line and str(sweep / "sweep.md") in line
    rows = (sweep / "sweep.csv").read_text().splitlines()
    assert len(rows) == 2 and ",ok," in rows[1]
    assert not (sweep / "1").exists()
