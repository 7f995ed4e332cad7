"""Serving settings from the command line: bad input is one report listing every problem
(exit 2, nothing run), settings of simulated serving are refused in executed runs, and a
simulated run holds requests by their lengths: a million of them in bounded memory, an
impossible workload refused before anything is built, a pipe read once."""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from pathlib import Path

import pytest

from pcpflow.driver.cli import compose_raw
from pcpflow.driver.job import prepare_job
from pcpflow.errors import ConfigError
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import cli, compose

REPO = Path(__file__).resolve().parents[2]
HEAD = REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"
SIM = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "output.plots=false", "output.progress=false"]


def problems(overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        prepare_job(compose_raw(overrides))
    return {p.field: f"{p.given} | {p.allowed}" for p in exc.value.problems}


def test_every_bad_serving_value_is_listed_and_exits_2():
    r = cli(*SIM, "workload.request_rate=0", "workload.max_concurrency=0", "slo.ttft_s=0", "slo.tpot_s=-1",
            "serving.replicas=0", "serving.router=nearest")
    assert r.returncode == 2, r.stderr
    for field in ("workload.request_rate", "workload.max_concurrency", "slo.ttft_s", "slo.tpot_s", "serving.replicas",
                  "serving.router"):
        assert f"  - {field}: got" in r.stderr, field
    assert "least_loaded" in r.stderr  # the allowed routers are named
    assert "kv.num_blocks" not in r.stderr  # the derived settings' placeholders are not reported
    assert "(6 problem(s))" in r.stderr


def test_a_rate_of_nan_is_named_as_no_rate():
    for workload in (["workload=synthetic"], ["workload=explicit", "workload.prompt_lens=[8]"]):
        found = problems([*SIM, *workload, "workload.request_rate=nan"])
        assert found == {"workload.request_rate": "nan | a rate > 0 in requests/s, or inf (all at once); "
                                                  "nan is not a rate"}


def test_simulated_serving_is_refused_in_executed_runs():
    found = problems(["workload.request_rate=2", "serving.replicas=2", "serving.router=least_loaded"])
    assert "mode=simulate" in found["workload.request_rate"]
    assert "mode=simulate" in found["serving"] and "serving.replicas" in found["serving"]


@pytest.mark.parametrize(
    "overrides, field, says",
    [
        (SIM + ["workload.request_rate=inf", "workload.arrival_every=1"], "workload.request_rate", "exclude each other"),
        (SIM + ["workload=explicit", "workload.arrival_steps=[0,1,2]", "workload.request_rate=5"], "workload.request_rate",
         "arrival_steps"),
        (SIM + ["workload=trace", f"workload.path={HEAD}", "workload.request_rate=3"], "workload.request_rate",
         "workload=synthetic"),
        (SIM + ["serving.replicas=2"], "serving.replicas", "in time"),
        (SIM + ["serving.replicas=2", "serving.router=prefix_aware", "workload.request_rate=1",
                "kv.prefix_caching=false"], "serving.router", "kv.prefix_caching=true"),
    ],
)
def test_arrivals_and_routers_that_cannot_work(overrides, field, says):
    found = problems(overrides)
    assert field in found and says in found[field], found


def test_a_trace_replayed_in_time_needs_timestamps(tmp_path):
    path = tmp_path / "no_ts.jsonl"
    path.write_text("".join(json.dumps({"input_length": 100, "output_length": 5, "hash_ids": [i]}) + "\n" for i in range(3)))
    found = problems(SIM + ["workload=trace", f"workload.path={path}"])
    assert "workload.path" in found and "timestamp" in found["workload.path"]
    # replayed in steps (or executed) it arrives at once
    cfg = compose(SIM + ["workload=trace", f"workload.path={path}", "workload.step_ms=50"])
    assert cfg.workload.step_ms == 50


def test_a_request_that_can_never_fit_is_named():
    found = problems(["workload=explicit", "workload.prompt_lens=[10,500,20]", "workload.output_lens=[4]",
                      "kv.num_blocks=8"])
    assert "request 1 needs 32 blocks" in found["kv.num_blocks"]


# -- issue 25: bounded memory in simulated runs ------------------------------------------------


def _peak(fn) -> tuple[float, float]:
    """(seconds, peak MiB traced) of ``fn()``."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return time.perf_counter() - t0, peak / 2**20


def test_a_hundred_million_requests_are_refused_before_any_is_built():
    result = []
    _, peak = _peak(lambda: result.append(cli(*SIM, "workload.num_requests=100000000")))
    r = result[0]
    assert r.returncode == 2 and "workload.num_requests" in r.stderr and "GiB" in r.stderr, r.stderr
    assert peak < 200, peak  # nothing per request was allocated


@pytest.mark.parametrize("tokens", [1_000_000_000, 4_000_000_000])
def test_a_giant_prompt_is_judged_from_its_length(tokens):
    """A 1e9- and a 4e9-token prompt: validated from the length alone (no token array), and
    refused (exit 2) with what it would need."""
    result = []
    seconds, peak = _peak(lambda: result.append(cli(*SIM, "workload=explicit", f"workload.prompt_lens=[{tokens}]")))
    r = result[0]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "GiB" in r.stderr
    assert peak < 200, peak


def test_two_hundred_thousand_requests_by_their_lengths():
    cfg = compose(SIM + ["workload.num_requests=200000", "workload.prompt_len=[100,400]", "workload.output_len=[2,8]",
                         "max_steps=20"])
    holder = []
    _, peak = _peak(lambda: holder.append(SimulatedRun(cfg, None, keep_records=False).run()))
    # a few hundred bytes per request (lengths, arrival, scheduling state, timing columns):
    # the token ids of these prompts alone would be 400 MB
    assert peak < 150, peak
    assert holder[0]["requests"] is None  # too many for result.json: requests.csv holds them in a run dir


MILLION = """
import resource, sys, tempfile
from pathlib import Path
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose
cfg = compose(sys.argv[1:])
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = Path(tempfile.mkdtemp())
result = SimulatedRun(cfg, out, keep_records=False).run()
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
rows = sum(1 for _ in open(out / result["requests_file"]))
print(grown // 1024, rows)
"""


@pytest.mark.slow
def test_a_million_requests_in_bounded_memory():
    import subprocess
    import sys

    overrides = SIM + ["workload.num_requests=1000000", "workload.prompt_len=[100,400]", "workload.output_len=[2,8]",
                       "max_steps=30"]
    out = subprocess.run([sys.executable, "-c", MILLION, *overrides], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    grown_mib, rows = map(int, out.stdout.split())
    assert rows == 1_000_001  # a header, then a row each (requests.csv)
    assert grown_mib < 1024, grown_mib  # the token ids alone would be 2 GB


def test_a_trace_from_a_pipe_is_read_once(tmp_path):
    """A process substitution (``<(...)``) is a pipe: it can be read once. Validation, the
    run's preparation and (executed) the ranks all read the same content."""
    fifo = tmp_path / "trace.fifo"
    os.mkfifo(fifo)
    text = "".join(HEAD.read_text().splitlines(keepends=True)[:5])
    writer = threading.Thread(target=lambda: fifo.write_text(text), daemon=True)
    writer.start()
    r = cli(*SIM, "workload=trace", f"workload.path={fifo}", "workload.max_requests=5", "workload.length_scale=0.01",
            f"hydra.run.dir={tmp_path / 'run'}")
    writer.join(timeout=5)
    assert r.returncode == 0, r.stderr
    assert json.loads((tmp_path / "run" / "result.json").read_text())["metrics"]["serving"]["finished"] == 5
    # an executed run's ranks read a regular copy of what the pipe gave
    fifo2 = tmp_path / "trace2.fifo"
    os.mkfifo(fifo2)
    threading.Thread(target=lambda: fifo2.write_text(text), daemon=True).start()
    cfg = compose(["workload=trace", f"workload.path={fifo2}", "workload.max_requests=5"])
    assert Path(cfg.workload.path).is_file() and Path(cfg.workload.path).read_text() == text
