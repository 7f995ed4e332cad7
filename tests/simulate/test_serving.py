"""Simulated serving: replicas behind a router, arrivals in time, the serving metrics."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pcpflow.output.metrics import MetricsRecorder
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import NEVER_PRIVATE, RequestTable
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.serving import Router
from pcpflow.testing import compose

SIM = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "output.plots=false", "output.progress=false"]


def _replicas(prompts, n=2, prefix_caching=True, kind="round_robin"):
    table = RequestTable(
        prompt_lens=np.array([len(p) for p in prompts]), output_lens=np.full(len(prompts), 2),
        arrival_steps=np.zeros(len(prompts), dtype=np.int64), cached_lens=np.zeros(len(prompts), dtype=np.int64),
        tokens=np.concatenate([np.array(p) for p in prompts]),
    )
    first = None
    scheds = []
    for _ in range(n):
        s = Scheduler(table, max_num_batched_tokens=64, max_num_seqs=4, feed=False, share=first,
                      kv=KVCacheManager(32, 4, prefix_caching=prefix_caching))
        first = first or s
        scheds.append(s)
    return scheds, Router(kind, scheds)


def test_round_robin_in_turn():
    scheds, router = _replicas([[1] * 5] * 5)
    assert [router.route(i) for i in range(5)] == [0, 1, 0, 1, 0]
    assert [s.num_waiting for s in scheds] == [3, 2]


def test_least_loaded_counts_queued_and_running_tokens():
    scheds, router = _replicas([[1] * 12, [2] * 3, [3] * 3, [4] * 3], kind="least_loaded")
    assert router.route(0) == 0  # both empty: ties to the lowest index
    assert router.route(1) == 1  # 12 queued tokens on 0, none on 1
    assert router.route(2) == 1  # 12 against 3
    assert Router.load(scheds[1]) == 6
    b = scheds[0].schedule()  # replica 0 runs request 0: its 12 tokens move from queued to held
    scheds[0].update(b, np.array([9]))
    assert Router.load(scheds[0]) == 12
    assert router.route(3) == 1  # 12 against 6


def test_prefix_aware_prefers_the_replica_holding_the_prefix():
    stem = list(range(10, 22))  # 12 tokens: 3 blocks of 4
    scheds, router = _replicas([stem + [1], [7] * 20, stem + [2, 3], [8] * 5], kind="prefix_aware")
    assert router.route(0) == 0 and router.route(1) == 1
    b = scheds[0].schedule()
    scheds[0].update(b, np.array([5]))  # replica 0 now caches the stem's 3 blocks
    for s in scheds[1:]:
        b = s.schedule()
        s.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
    assert Router.cached_tokens(scheds[0], 2) == 12 and Router.cached_tokens(scheds[1], 2) == 0
    assert Router.load(scheds[0]) > 0
    assert router.route(2) == 0  # the prefix wins over load
    assert router.route(3) == 1  # no prefix anywhere: the least loaded


def test_two_replicas_serve_two_halves_as_one_serves_one():
    """Eight identical requests, all at once, round robin over two replicas: each replica
    runs what one replica runs with four of them, so the latencies are the same and the
    throughput doubles."""
    work = ["workload=explicit", "workload.prompt_lens=[3000]", "workload.output_lens=[40]",
            "workload.request_rate=inf", "scheduler.max_num_seqs=4"]
    two = SimulatedRun(compose(SIM + work + ["workload.prompt_lens=[3000,3000,3000,3000,3000,3000,3000,3000]",
                                             "serving.replicas=2"])).run()
    one = SimulatedRun(compose(SIM + work + ["workload.prompt_lens=[3000,3000,3000,3000]"])).run()
    m2, m1 = two["metrics"], one["metrics"]
    assert m2["serving"]["requests_per_replica"] == [4, 4]
    assert m2["num_steps"] == 2 * m1["num_steps"]
    for key in ("ttft", "tpot"):
        assert m2[key]["mean_s"] == pytest.approx(m1[key]["mean_s"], rel=1e-12)
    assert m2["throughput"]["requests_s"] == pytest.approx(2 * m1["throughput"]["requests_s"], rel=1e-12)
    assert m2["throughput"]["output_tok_s_per_gpu"] == pytest.approx(m1["throughput"]["output_tok_s_per_gpu"], rel=1e-12)
    assert m2["simulate"]["gpus"] == 2 * m1["simulate"]["gpus"]


def test_closed_loop_keeps_max_concurrency_in_flight():
    cfg = compose(SIM + ["workload=explicit", "workload.prompt_lens=[500,500,500,500,500,500]",
                         "workload.output_lens=[20]", "workload.request_rate=inf", "workload.max_concurrency=2"])
    sim = SimulatedRun(cfg)
    result = sim.run()
    assert max(r["num_running"] + r["num_waiting"] for r in sim.records) == 2
    rows = result["requests"]
    # request i > 1 enters when request i - 2 finishes (slots free in finishing order)
    finish = sorted(r["finish_step"] for r in rows)
    assert [r["arrival_step"] for r in rows[2:]] == [f + 1 for f in finish[:4]]


def test_serving_metrics_by_hand():
    """Four requests: arrivals 0, 1, 2, 3 s; TTFT 0.5, 1.5, 0.2, (none: unfinished);
    TPOT 0.05, 0.2, (one token). Span: first arrival (0) to last finish (4.0 s)."""
    rec = MetricsRecorder(None, pcp_size=1, num_to_generate=0)
    nan = np.nan
    cols = {
        "req_id": np.arange(4), "arrival_s": np.array([0.0, 1.0, 2.0, 3.0]),
        "finish_s": np.array([2.0, 4.0, 2.2, nan]), "ttft_s": np.array([0.5, 1.5, 0.2, nan]),
        "tpot_s": np.array([0.05, 0.2, nan, nan]), "output_len": np.array([31, 12, 1, 0]),
        "queue_s": np.array([0.1, 0.3, 0.0, 0.2]),
    }
    m = rec.serving_metrics(cols, prompt_lens=np.array([100, 200, 50, 10]), gpus=2, ttft_slo_s=1.0, tpot_slo_s=0.1)
    t = m["throughput"]
    assert t["span_s"] == 4.0 and t["requests_s"] == 3 / 4
    assert t["output_tok_s"] == 44 / 4 and t["output_tok_s_per_gpu"] == 44 / 8
    assert t["total_tok_s"] == (44 + 350) / 4
    # request 0 meets both, 1 misses TTFT and TPOT, 2 meets TTFT and has no TPOT: 2 of 3
    assert m["goodput"]["req_s"] == 2 / 4 and m["goodput"]["share"] == pytest.approx(2 / 3)
    assert m["queue_s"] == pytest.approx(0.15)
    none = rec.serving_metrics(cols, prompt_lens=np.array([100, 200, 50, 10]), gpus=2)
    assert none["goodput"]["req_s"] is None  # no SLO: no goodput


def test_serving_plot_draws_what_the_run_measured(tmp_path):
    from pcpflow.output.serving_plot import write_serving_plot
    from pcpflow.testing import cli

    run = tmp_path / "run"
    r = cli(*SIM, "workload.num_requests=12", "workload.request_rate=20", f"hydra.run.dir={run}", "output.plots=true",
            "slo.ttft_s=0.05", "slo.tpot_s=0.02")
    assert r.returncode == 0, r.stderr
    assert (run / "serving.png").exists()
    drawn = write_serving_plot(run)
    result = json.loads((run / "result.json").read_text())
    m = result["metrics"]
    assert drawn["replicas"] == [0]
    assert drawn["quantiles"]["ttft_s"] == pytest.approx((m["ttft"]["p50_s"], m["ttft"]["p99_s"]))
    assert drawn["quantiles"]["tpot_s"] == pytest.approx((m["tpot"]["p50_s"], m["tpot"]["p99_s"]))
    # each SLO with the share of the requests (those with the latency) at or below it
    for key, slo in (("ttft_s", 0.05), ("tpot_s", 0.02)):
        v = [row[key] for row in result["requests"] if row[key] is not None]
        assert drawn["slo"][key] == pytest.approx((slo, sum(x <= slo for x in v) / len(v)))


def test_a_burst_in_time_and_arrivals_in_steps_are_two_request_tables():
    # JSON writes request_rate=inf as null: the workload's table, built once per workload, must
    # not be the burst's (arrivals at 0 s, in time) for the same workload arriving in steps
    from pcpflow.scheduling.workload import ExplicitWorkload
    from pcpflow.simulate.prepare import requests_of

    burst = ExplicitWorkload(kind="explicit", prompt_lens=[40, 40], output_lens=[2], request_rate=float("inf"))
    steps = ExplicitWorkload(kind="explicit", prompt_lens=[40, 40], output_lens=[2])
    assert requests_of(burst, 1000, 0).arrival_s.tolist() == [0.0, 0.0]
    assert requests_of(steps, 1000, 0).arrival_s is None
    assert requests_of(burst, 1000, 0).arrival_s.tolist() == [0.0, 0.0]


TRACE_HEAD = Path(__file__).resolve().parents[2] / "scripts" / "data" / "mooncake_conversation_head.jsonl"


@pytest.mark.parametrize("overrides", [
    ["kv.num_blocks=1600", "serving.replicas=2", "serving.router=prefix_aware"],
    ["kv.num_blocks=1600", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
     "disagg.decode_pool.num_blocks=800"],
])
def test_private_blocks_change_nothing_a_run_reports(monkeypatch, overrides):
    """Blocks only their own request can ask for stay out of the prefix cache's dict
    (``RequestTable.private_from``) until that request is preempted. The reference: the same
    run with every block indexed. Every step record and request column is equal, with
    preemptions and prefix hits in the run and private blocks indexed for readmissions."""
    cfg = compose(SIM + ["workload=trace", f"workload.path={TRACE_HEAD}", "workload.max_requests=250",
                         "workload.length_scale=0.2", "workload.time_scale=0.3", "pcp=2", *overrides])
    indexed = []
    index = KVCacheManager.index

    def counting(self, req_id):
        indexed.append(int(np.count_nonzero(self._unindexed[self.blocks_of(req_id)])))  # its own private blocks
        index(self, req_id)

    monkeypatch.setattr(KVCacheManager, "index", counting)

    def run():
        sim = SimulatedRun(cfg)
        result = sim.run()
        return result["metrics"], sim.records, sim._request_columns()

    metrics, records, cols = run()
    monkeypatch.setattr(RequestTable, "private_from", lambda self, u: np.full(len(self), NEVER_PRIVATE))
    ref_metrics, ref_records, ref_cols = run()
    assert metrics["preemptions"] > 0 and metrics["prefix_cache"]["hit_tokens"] > 0
    assert max(indexed) > 0  # a request held private blocks when it was preempted (or handed over)
    assert records == ref_records
    for k in cols:
        np.testing.assert_array_equal(cols[k], ref_cols[k])
    for k in ("ttft", "tpot", "throughput", "kv_usage", "prefix_cache", "preemptions", "goodput"):
        assert metrics[k] == ref_metrics[k], k


def test_a_run_cut_short_says_how_many_requests_finished():
    """max_steps=3 with outputs of 8 tokens: no request can have finished (one token a step at
    most), where the whole run finishes all three."""
    base = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=explicit",
            "workload.prompt_lens=[64,64,64]", "workload.output_lens=[8]", "output.plots=false", "output.progress=false"]
    full = SimulatedRun(compose(base)).run()["metrics"]
    cut = SimulatedRun(compose([*base, "max_steps=3"])).run()["metrics"]
    assert (full["num_requests"], full["num_finished_requests"]) == (3, 3)
    assert (cut["num_requests"], cut["num_finished_requests"], cut["num_steps"]) == (3, 0, 3)
