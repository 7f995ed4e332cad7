"""Faults end the job promptly, non-zero, with the root cause in result.json: a stalled
rank, a rank that leaves early, Ctrl-C / SIGTERM, under pcpflow's launch and torchrun;
parallel sweeps (joblib) and two torchrun agents ("two nodes") work.

Faults come from ``tests/pcpflow_test_plugins/faults.py`` (raise / exit / stall / signal
on rank R at step S). Each case is a real launch (10-40 s on a busy 2-core machine), so
the default set is small; the rest are ``slow``.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
QUIET = ["output.progress=false", "output.plots=false", "workload.num_requests=3", "workload.output_len=[3,5]"]
FAULTS = "plugins=[pcpflow_test_plugins.faults]"

pytestmark = pytest.mark.dist


def fault(cls: str, **fields) -> str:
    """The override that inserts one fault stage (after ``forward`` unless told)."""
    fields.setdefault("after", "forward")
    body = ", ".join(f"{k}: {json.dumps(v) if isinstance(v, bool) else v}" for k, v in fields.items())
    return f"+pipeline.extra=[{{kind: 'pcpflow_test_plugins.faults:{cls}', {body}}}]"


def env(marker: str = "") -> dict[str, str]:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PCPFLOW_TEST_MARKER": marker or uuid.uuid4().hex}
    e["PYTHONPATH"] = os.pathsep.join([str(REPO), str(TESTS), os.environ.get("PYTHONPATH", "")])
    return e


def launch(cmd: list[str], *, timeout: float = 240, e: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    r = subprocess.run(cmd, env=e or env(), capture_output=True, text=True, timeout=timeout, cwd=REPO)
    return r, time.monotonic() - t0


def pcpflow(*args: str, **kw):
    return launch([sys.executable, "-m", "pcpflow", *args, *QUIET], **kw)


def torchrun(*args: str, nproc: int = 2, **kw):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m", "pcpflow"]
    return launch([*cmd, *args, *QUIET], **kw)


def result(run_dir: Path) -> dict:
    return json.loads((run_dir / "result.json").read_text())


def alive_with(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and proc.name != str(os.getpid()):
            try:
                if f"PCPFLOW_TEST_MARKER={marker}".encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def assert_none_left(marker: str) -> None:
    """Every rank process carrying ``marker`` is gone within 10 s."""
    deadline = time.monotonic() + 10
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert alive_with(marker) == []


# ------------------------------------------------------------------------------ pcpflow's launch
@pytest.mark.slow  # NOTE: waits out a collective timeout (~15 s)
@pytest.mark.parametrize("launcher", ["pcpflow", "torchrun"])
def test_a_stalled_rank_is_named_within_the_collective_timeout(tmp_path, launcher):
    marker = uuid.uuid4().hex
    start = pcpflow if launcher == "pcpflow" else torchrun
    r, elapsed = start("pcp=2", "collective_timeout_s=5", f"hydra.run.dir={tmp_path}", FAULTS,
                       fault("Stall", rank=1, step=1, seconds=200), e=env(marker))
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["status"] == "failed" and res["failed_rank"] == 1
    assert res["error"].startswith("rank 1 failed: stalled") and "at step 1 (extra[0]:test_stall)" in res["error"]
    assert "collective_timeout_s=5" in res["error"]
    # start-up (~10-20 s here) + 5 s timeout + 3 s grace, far below the 200 s stall
    assert elapsed < 120, elapsed
    # NOTE: the fork server (its own log file, not the driver's pipes) leaves once it sees the
    # driver gone, a moment after; no rank may be left at all.
    assert_none_left(marker)


@pytest.mark.slow  # NOTE: the stall test above covers the board; this is the ring's p2p wait
@pytest.mark.parametrize("die", [False, True])
def test_a_rank_that_stalls_or_dies_inside_the_ring_is_named(tmp_path, die):
    # A point-to-point wait is a collective like the others: its peers time out (or see the
    # connection close), and the progress board names the rank, in the forward stage. The
    # death runs in a ring of three, where the failed rank's two neighbours differ.
    marker, p = uuid.uuid4().hex, 3 if die else 2
    ring = (f"pcp={p}", f"dcp={p}", "pipeline.forward.cp_attention=ring_pass_kv", "collective_timeout_s=5")
    r, elapsed = pcpflow(*ring, f"hydra.run.dir={tmp_path}", FAULTS,
                         fault("RingFault", after="slots", rank=1, step=1, hop=1, seconds=200, die=die), e=env(marker))
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["status"] == "failed" and res["failed_rank"] == 1, res["error"]
    # NOTE: a rank that dies is placed by its last heartbeat (twice a second, and at each step's
    # start): the step is certain, the stage may be an earlier one.
    what, where = ("died without a Python error", "at step 1") if die else ("stalled", "at step 1 (forward)")
    assert res["error"].startswith(f"rank 1 failed: {what}") and where in res["error"], res["error"]
    assert elapsed < 120, elapsed  # start-up + 5 s timeout + 3 s grace, far below the 200 s stall
    assert_none_left(marker)


@pytest.mark.slow
def test_a_frozen_rank_is_named_as_stalled_within_the_timeout_and_a_few_seconds(tmp_path):
    """A rank stopped by SIGSTOP (a debugger, a hung driver) beats no heartbeat and never
    answers SIGTERM: its peers time out, the board sees its process stopped, and the agent
    kills it after a short grace instead of waiting 30 s."""
    marker, stamp = uuid.uuid4().hex, tmp_path / "stopped_at"
    run_dir = tmp_path / "run"
    r, _ = pcpflow("pcp=2", "collective_timeout_s=5", f"hydra.run.dir={run_dir}", FAULTS,
                   fault("SendSignal", rank=1, step=1, signal="SIGSTOP", stamp=str(stamp)), e=env(marker))
    ended = time.time()
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(run_dir)
    assert res["failed_rank"] == 1 and res["error"].startswith("rank 1 failed: stalled: its process is stopped"), res["error"]
    assert "collective_timeout_s=5" in res["error"] and "at step 1" in res["error"]
    # 5 s timeout + the board's 3 s grace + the agent's 3 s shutdown grace + a busy machine
    assert ended - float(stamp.read_text()) < 5 + 15, ended - float(stamp.read_text())
    assert_none_left(marker)


@pytest.mark.parametrize("agent_saw_the_kill_first", [True, False])
def test_a_peers_diagnosis_names_a_killed_rank_whichever_the_agent_saw_first(tmp_path, agent_saw_the_kill_first):
    """The frozen-rank race, by hand: rank 0 diagnoses rank 1 (stopped), SIGKILLs it, then writes
    its error file. The agent stamps rank 1's death in whole seconds, before or after that file."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from pcpflow.driver.launch import RankFailure

    said = "[rank 1] stalled: its process is stopped (SIGSTOP or a debugger); waited 5 s; last seen at step 1"
    error = tmp_path / "0" / "error.json"
    error.parent.mkdir()
    error.write_text(json.dumps({"message": {"message": f"RankError: {said}", "extraInfo": {"py_callstack": "tb"}}}))
    killed = ProcessFailure(local_rank=1, pid=2, exitcode=-signal.SIGKILL, error_file=str(tmp_path / "1" / "none.json"))
    killed.timestamp = int(error.stat().st_mtime) + (-1 if agent_saw_the_kill_first else 1)
    failure = RankFailure.root_cause(ChildFailedError("job", {1: killed}), [error], tmp_path)
    assert (failure.rank, failure.message, failure.details) == (1, said.removeprefix("[rank 1] "), "")


@pytest.mark.slow
def test_a_rank_leaving_with_code_0_is_the_root_cause_not_its_peer(tmp_path):
    r, _ = pcpflow("pcp=2", "collective_timeout_s=20", f"hydra.run.dir={tmp_path}", FAULTS, fault("Exit", rank=1, step=2, code=0))
    assert r.returncode == 1
    res = result(tmp_path)
    assert res["error"] == "rank 1 failed: exited early (sys.exit(0)) at step 2 (extra[0]:test_exit)", res["error"]
    assert "Connection closed" not in r.stderr.split("pcpflow: rank")[-1]


@pytest.mark.slow
def test_a_rank_that_dies_without_unwinding_is_named(tmp_path):
    r, _ = pcpflow("pcp=2", "collective_timeout_s=20", f"hydra.run.dir={tmp_path}", FAULTS,
                   fault("Exit", rank=1, step=2, code=0, hard=True))
    assert r.returncode == 1
    err = result(tmp_path)["error"]
    assert err.startswith("rank 1 failed: died without a Python error") and "step 2" in err, err


@pytest.mark.parametrize("sig", ["SIGINT", "SIGHUP"])
def test_ctrl_c_at_pcp_1_is_interrupted_with_a_result(tmp_path, sig):
    # pcp=1 runs in the driver's own process: the signal goes to the driver itself. SIGHUP: a
    # closed terminal or ssh session (its default action would kill the driver with no result).
    r, _ = pcpflow("pcp=1", f"hydra.run.dir={tmp_path}", FAULTS, fault("SendSignal", rank=0, step=1, signal=sig))
    code = 128 + getattr(signal, sig)
    assert r.returncode == code, r.stderr[-2000:]
    assert f"pcpflow: interrupted by {sig}" in r.stderr and "Traceback" not in r.stderr
    res = result(tmp_path)
    assert res["status"] == "failed" and res["error"] == f"interrupted by {sig}" and res["exit_code"] == code
    # what it got through: step 0 (the signal came inside step 1), not every token
    progress = res["progress"]
    assert progress["last_step"] in (0, 1) and 1 <= progress["num_generated"] < progress["num_to_generate"], progress


@pytest.mark.slow  # NOTE: ~6 s; tests/output/test_rundir.py checks discard_result itself
def test_a_run_killed_outright_leaves_no_older_ok_result_beside_its_config(tmp_path):
    """A run dir that holds an earlier run's ok result.json: the new run (config.json, metrics.jsonl
    its own) is SIGKILLed and writes nothing; the old "ok" must not describe it."""
    run = tmp_path / "run"
    sim = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload.num_requests=3", "output.plots=false"]
    first, _ = pcpflow(*sim, f"hydra.run.dir={run}")
    assert first.returncode == 0 and result(run)["status"] == "ok", first.stderr[-2000:]
    flag = tmp_path / "paused"
    e = {**env(), "PCPFLOW_TEST_PAUSE": "pcpflow.driver.job:_simulate", "PCPFLOW_TEST_PAUSE_FLAG": str(flag)}
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS / "signal_pause"), e["PYTHONPATH"]])
    proc = subprocess.Popen([sys.executable, "-m", "pcpflow", *sim, "seed=7", f"hydra.run.dir={run}", *QUIET], env=e, cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert json.loads((run / "config.json").read_text())["seed"] == 7  # the killed run's
    assert not (run / "result.json").exists()


@pytest.mark.slow
def test_sigterm_to_the_driver_of_ranks_is_interrupted(tmp_path):
    r, _ = pcpflow("pcp=2", f"hydra.run.dir={tmp_path}", FAULTS,
                   fault("SendSignal", rank=1, step=1, signal="SIGTERM", to_parent=True))
    assert r.returncode == 143, r.stderr[-2000:]
    assert result(tmp_path)["error"] == "interrupted by SIGTERM"


@pytest.mark.slow
def test_ctrl_c_stops_a_sweep_and_the_report_lists_what_ran(tmp_path):
    # max_steps=2 never reaches step 2; the second job is interrupted there; the third never runs
    r, _ = pcpflow("-m", "pcp=1", "max_steps=2,3,4", f"hydra.sweep.dir={tmp_path}", FAULTS,
                   fault("SendSignal", rank=0, step=2, signal="SIGINT"))
    assert r.returncode == 130, r.stderr[-2000:]
    assert not (tmp_path / "2").exists()
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and ",ok," in rows[1] and "interrupted by SIGINT" in rows[2]
    assert "sweep interrupted by SIGINT after 1 job(s) and during job 2 (1 of 3 not run)" in r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("to_group", [True, False])
def test_ctrl_c_in_a_joblib_sweep_gives_every_running_job_its_result(tmp_path, to_group):
    """joblib's pool SIGKILLs its workers when the driver is interrupted: the jobs they ran
    (and their ranks) are gone before they can write "interrupted"; the driver writes it,
    reports the sweep and says so (a Ctrl-C reaches the whole group, a SIGTERM maybe the driver only)."""
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    marker = uuid.uuid4().hex
    sig = signal.SIGINT if to_group else signal.SIGTERM
    proc = subprocess.Popen([sys.executable, "-m", "pcpflow", "-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
                             "pcp=1,2", f"hydra.sweep.dir={tmp_path}", *QUIET, "workload.num_requests=300"],
                            env=env(marker), cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)

    def stepping(job: str) -> bool:
        path = tmp_path / job / "metrics.jsonl"
        return path.exists() and path.read_text().count("\n") >= 2

    deadline = time.monotonic() + 240
    while not (stepping("0") and stepping("1")):  # both jobs running at once
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.1)
    (os.killpg if to_group else os.kill)(proc.pid, sig)
    _, err = proc.communicate(timeout=60)
    name = signal.Signals(sig).name
    assert proc.returncode == 128 + sig, err[-3000:]
    assert f"pcpflow: sweep interrupted by {name} after 0 job(s) and during jobs 1, 2" in err, err[-3000:]
    for job in ("0", "1"):
        res = result(tmp_path / job)
        assert res["status"] == "failed" and res["error"] == f"interrupted by {name}" and res["exit_code"] == 128 + sig
        assert not (tmp_path / job / ".pcpflow.lock").exists()
    assert (tmp_path / "sweep.csv").read_text().count(f"interrupted by {name}") == 2
    assert_none_left(marker)


@pytest.mark.slow
def test_a_joblib_sweep_with_a_failed_job_exits_1_and_runs_the_others(tmp_path):
    # the jobs run in joblib's worker processes: their exit codes come back through result.json
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    r, _ = pcpflow("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "pcp=1", "max_steps=4,2",
                   f"hydra.sweep.dir={tmp_path}", FAULTS, fault("Crash", rank=0, step=3))  # only max_steps=4 reaches step 3
    assert r.returncode == 1, r.stderr[-3000:]
    assert result(tmp_path / "0")["status"] == "failed" and result(tmp_path / "1")["status"] == "ok"
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and "injected failure" in rows[1] and ",ok," in rows[2]


@pytest.mark.slow
def test_joblib_launcher_runs_multi_rank_jobs_in_parallel(tmp_path):
    pytest.importorskip("hydra_plugins.hydra_joblib_launcher")
    r, _ = pcpflow("-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "pcp=1,2", "max_steps=3",
                   f"hydra.sweep.dir={tmp_path}", timeout=400)
    assert r.returncode == 0, r.stderr[-3000:]
    for job in ("0", "1"):
        res = result(tmp_path / job)
        assert res["status"] == "ok" and res["verify"]["passed"], res.get("error")
    assert result(tmp_path / "1")["config"]["pcp"] == 2


# ------------------------------------------------------------------------------ torchrun
@pytest.mark.slow
def test_torchrun_result_blames_the_rank_that_raised(tmp_path):
    r, _ = torchrun("pcp=2", "collective_timeout_s=20", f"hydra.run.dir={tmp_path}", FAULTS, fault("Crash", rank=1, step=2))
    assert r.returncode == 1  # torchrun's own code for any failed worker
    res = result(tmp_path)
    assert res["failed_rank"] == 1 and res["error"].startswith("rank 1 failed: RuntimeError: injected failure on rank 1")
    assert res["exit_code"] == 1 and res["launcher"].startswith("external")


@pytest.mark.slow
def test_torchrun_rank_0_dying_still_writes_a_result(tmp_path):
    r, _ = torchrun("pcp=2", "collective_timeout_s=20", f"hydra.run.dir={tmp_path}", FAULTS,
                    fault("Exit", rank=0, step=2, code=0, hard=True))
    assert r.returncode == 1
    res = result(tmp_path)  # written by rank 1: rank 0 is gone
    assert res["failed_rank"] == 0 and res["error"].startswith("rank 0 failed: died without a Python error"), res


@pytest.mark.slow
def test_torchrun_sigterm_workers_exit_143_and_write_interrupted(tmp_path):
    r, _ = torchrun("pcp=2", f"hydra.run.dir={tmp_path}", FAULTS, fault("SendSignal", rank=1, step=1, signal="SIGTERM", to_parent=True))
    assert r.returncode != 0  # torchrun's own (1, after its SignalException)
    res = result(tmp_path)
    assert res["exit_code"] == 143 and res["error"].startswith("interrupted by SIGTERM (rank ")


@pytest.mark.slow
def test_torchrun_forwards_sighup_and_the_workers_write_interrupted(tmp_path):
    # torchrun's agent forwards SIGHUP (a closed terminal) to its workers: their default action
    # would kill them before any wrote result.json
    r, _ = torchrun("pcp=2", f"hydra.run.dir={tmp_path}", FAULTS, fault("SendSignal", rank=1, step=1, signal="SIGHUP", to_parent=True))
    assert r.returncode != 0
    res = result(tmp_path)
    assert res["exit_code"] == 129 and res["error"].startswith("interrupted by SIGHUP (rank "), res["error"]


@pytest.mark.slow
def test_torchrun_a_rank_killed_mid_run_is_named_in_result_json(tmp_path):
    # torchrun SIGTERMs the survivor ~0.1 s after the death: its report must not be cut short
    marker = uuid.uuid4().hex
    r, elapsed = torchrun("pcp=2", "collective_timeout_s=20", f"hydra.run.dir={tmp_path}", FAULTS,
                          fault("SendSignal", rank=1, step=1, signal="SIGKILL"), e=env(marker))
    assert r.returncode == 1
    res = result(tmp_path)
    assert res["failed_rank"] == 1 and res["error"].startswith("rank 1 failed: died without a Python error"), res
    assert "at step 1" in res["error"] and elapsed < 120
    # the dead rank cannot say it: the survivor that wrote result.json does, once
    assert [line for line in r.stderr.splitlines() if line.startswith("pcpflow: ")] == [f"pcpflow: {res['error']}"], r.stderr[-3000:]
    assert_none_left(marker)


@pytest.mark.slow
def test_torchrun_ctrl_c_while_rank_0_composes_ends_at_once_with_a_result(tmp_path):
    """Rank 1 waits for rank 0's config; a Ctrl-C then must end both within seconds (not
    torchrun's 30 s kill of a rank deaf in a blocking store wait), each with one line, and
    the run dir says interrupted."""
    marker, flag, run = uuid.uuid4().hex, tmp_path / "paused", tmp_path / "run"
    e = {**env(marker), "PCPFLOW_TEST_PAUSE": "pcpflow.driver.job:prepare_job", "PCPFLOW_TEST_PAUSE_FLAG": str(flag)}
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS / "signal_pause"), e["PYTHONPATH"]])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pcpflow",
           "pcp=2", f"hydra.run.dir={run}", *QUIET]
    proc = subprocess.Popen(cmd, env=e, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 180
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 10, err[-3000:]
    assert "pcpflow: interrupted by SIGINT (rank 0)" in err and "pcpflow: interrupted by SIGINT (rank 1)" in err
    assert "KeyboardInterrupt" not in err, err[-3000:]
    res = result(run)
    assert res["exit_code"] == 130 and res["error"] == "interrupted by SIGINT before the run started"
    assert_none_left(marker)


def test_torchrun_ctrl_c_while_a_rank_imports_torch_is_one_line_and_a_result(tmp_path):
    """The rank's handler is installed before it imports torch and the engine (seconds): a Ctrl-C
    then is one line and exit 130, and rank 0 leaves result.json in a run dir the command names
    (an older result there kept aside), not a KeyboardInterrupt traceback."""
    flag, run = tmp_path / "paused", tmp_path / "run"
    run.mkdir()
    (run / "result.json").write_text(json.dumps({"status": "ok", "error": None, "exit_code": 0}))
    e = {**env(), "PCPFLOW_TEST_PAUSE": "pcpflow.driver.cli:torchrun_main", "PCPFLOW_TEST_PAUSE_FLAG": str(flag),
         "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"}
    e["PYTHONPATH"] = os.pathsep.join([str(TESTS / "signal_pause"), e["PYTHONPATH"]])
    proc = subprocess.Popen([sys.executable, "-m", "pcpflow", "pcp=2", f"hydra.run.dir={run}"], env=e, cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-3000:]
    assert err.strip() == f"pcpflow: interrupted by SIGINT before the run started (rank 0); result.json: {run / 'result.json'}"
    res = result(run)
    assert res["exit_code"] == 130 and res["error"] == "interrupted by SIGINT before the run started"
    assert json.loads((run / "result.previous.json").read_text())["status"] == "ok"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("pcp, per_node, extra", [(2, 1, ["dcp=2", "decode=sharded"]), (4, 2, [])])
def test_two_torchrun_agents_rendezvous_as_two_nodes(tmp_path, pcp, per_node, extra):
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", str(per_node),
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", uuid.uuid4().hex[:8],
           "-m", "pcpflow", f"pcp={pcp}", *extra, "max_steps=6", f"hydra.run.dir={tmp_path}", *QUIET]
    agents = [subprocess.Popen(cmd, env=env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    try:
        outs = [a.communicate(timeout=400)[0] for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                a.send_signal(signal.SIGTERM)
    assert [a.returncode for a in agents] == [0, 0], outs[0][-2000:] + outs[1][-2000:]
    res = result(tmp_path)
    assert res["status"] == "ok" and res["verify"]["passed"] and res["verify"]["tokens_match"]
    assert res["config"]["pcp"] == pcp and res["metrics"]["num_steps"] == 6
    assert sorted(p.name for p in tmp_path.glob("result*.json")) == ["result.json"]


# ------------------------------------------------------------------------------ start-up
def _slow_start_cfg(seconds: float, **top):
    from pcpflow.testing import compose

    overrides = ["pcp=2", FAULTS, fault("SlowStart", rank=1, seconds=seconds), "max_steps=2", *QUIET]
    return compose([*overrides, *(f"{k}={v}" for k, v in top.items())])


@pytest.mark.slow
def test_start_up_has_its_own_timeout():
    """A start-up longer than collective_timeout_s is fine (the first collective after it
    would have timed out with one timeout for both); longer than startup_timeout_s is not."""
    from pcpflow.testing import run

    sys.path.insert(0, str(TESTS))
    (ok,) = run([_slow_start_cfg(6, collective_timeout_s=2, startup_timeout_s=60)])
    assert ok["verify"]["passed"]
    with pytest.raises(Exception, match=r"\[rank 1\] did not finish start-up within startup_timeout_s=3 during start-up"):
        run([_slow_start_cfg(100, collective_timeout_s=30, startup_timeout_s=3)])


@pytest.mark.slow
def test_a_rank_stopped_in_start_up_is_named_within_the_collective_timeout(tmp_path):
    """Start-up may take startup_timeout_s (600 s), but a stopped process is no slow load: its
    heartbeat stops, and the job ends within collective_timeout_s + a few s, naming it."""
    marker = uuid.uuid4().hex
    r, elapsed = pcpflow("pcp=2", "collective_timeout_s=5", f"hydra.run.dir={tmp_path}", FAULTS,
                         fault("SlowStart", rank=1, seconds=1, stop=True), e=env(marker))
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["failed_rank"] == 1 and res["error"].startswith("rank 1 failed: stalled: its process is stopped"), res["error"]
    assert res["error"].endswith("during start-up") and elapsed < 90, (res["error"], elapsed)
    assert_none_left(marker)


# ------------------------------------------------------------------------------ disagg=pd
@pytest.mark.slow
@pytest.mark.parametrize("rank,die", [(1, False), (2, True)])
def test_a_rank_that_stalls_or_dies_mid_transfer_names_the_request_in_flight(tmp_path, rank, die):
    """A prefill rank stalling inside a handover's send, or a decode rank dying inside its
    receive: the other pool's ranks wait on point-to-point messages, time out (or see the
    connection close), and the board names the rank, placed in the transfer; result.json
    says which request was moving."""
    marker = uuid.uuid4().hex
    r, elapsed = pcpflow("pcp=2", "dcp=2", "disagg=pd", "collective_timeout_s=5", f"hydra.run.dir={tmp_path}", FAULTS,
                         fault("TransferFault", rank=rank, step=0, call=1, seconds=200, die=die), e=env(marker))
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["status"] == "failed" and res["failed_rank"] == rank, res["error"]
    how = "died without a Python error" if die else "stalled"
    assert res["error"].startswith(f"rank {rank} failed: {how}"), res["error"]
    # NOTE: the rank marks (and pushes) the transfer before it moves a byte: a death is placed too
    req = res["transfer_in_flight"]
    assert f"(transfer of request {req})" in res["error"] and req in (0, 1, 2)
    assert elapsed < 120, elapsed  # start-up + 5 s timeout + 3 s grace, far below the 200 s stall
    assert_none_left(marker)


@pytest.mark.slow
def test_a_fault_fires_on_its_global_rank_under_disagg(tmp_path):
    """A fault's ``rank`` is the global rank, not a pool's own numbering: rank 2 is the
    decode pool's first rank (pool rank 0, as prefill's rank 0 is), and only it fails."""
    r, _ = pcpflow("pcp=2", "disagg=pd", f"hydra.run.dir={tmp_path}", FAULTS, fault("Crash", rank=2, step=1))
    assert r.returncode == 1, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["status"] == "failed" and res["failed_rank"] == 2, res["error"]
    assert res["error"].startswith("rank 2 failed") and "injected failure" in res["error"], res["error"]


@pytest.mark.slow
def test_torchrun_starts_both_pools(tmp_path):
    r, _ = torchrun("pcp=2", "disagg=pd", f"hydra.run.dir={tmp_path}", nproc=3)
    assert r.returncode == 0, r.stderr[-2000:]
    res = result(tmp_path)
    assert res["status"] == "ok" and res["verify"]["passed"] and res["metrics"]["transfer"]["requests"] >= 1
    r, _ = torchrun("pcp=2", "disagg=pd", f"hydra.run.dir={tmp_path}/wrong", nproc=2)
    assert "both pools' ranks (2 prefill + 1 decode = 3) must equal the 2 ranks torchrun started" in r.stderr
