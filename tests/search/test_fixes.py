"""Searches the probes found wrong: each case worked by hand or checked against an invariant."""

from __future__ import annotations

import csv

from pcpflow.testing import cli, compose

TRACE = ["model=llama3_8b", "hardware=h100_sxm", "workload=trace",
         "workload.path=/work/shared/traces/mooncake_conversation.jsonl", "workload.length_scale=0.1"]
SEARCH = ["mode=search", "search.jobs=1", "output.progress=false"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_goodput_is_never_above_what_the_layout_serves_at_once(tmp_path):
    """On a compressed trace, attainment need not fall as the rate rises; the goodput is still
    requests served within their SLOs, so at most the layout's served rate with every request
    arriving at once (the burst: mode=simulate with the timestamps scaled to nothing)."""
    trace = [*TRACE, "workload.max_requests=40"]
    slo = ["slo.ttft_s=0.5", "slo.tpot_s=0.05"]
    r = cli(*SEARCH, *trace, *slo, "search.gpus=4", "simulate.objective=goodput_per_gpu",
            "search.candidates=['tp=2 pcp=2 dcp=1 decode.mode=sharded cudagraph_mode=piecewise',"
            "'tp=4 pcp=1 cudagraph_mode=piecewise']", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    from pcpflow.simulate.engine import simulate_run

    for row in _rows(tmp_path / "search.csv"):
        cfg = compose(["mode=simulate", *trace, *slo, *row["overrides"].split(), "workload.time_scale=1e-9"])
        served = simulate_run(cfg)["metrics"]["throughput"]["requests_s"]
        assert 0 < float(row["goodput_per_gpu"]) * int(row["gpus"]) <= served * (1 + 1e-6), row["overrides"]
