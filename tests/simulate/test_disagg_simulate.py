"""disagg=pd simulated: the handover priced on the links between the pools (by hand), the
overlap of disagg.transfer, TTFT and TPOT as the pools make them, and the pools on their own
clocks when requests arrive in time (the queue between them modelled)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pcpflow.simulate.pools import PooledRun
from pcpflow.testing import compose

# NOTE: the point-to-point share is fitted (and refitted); the hand-worked prices pin it to 0.5
BASE = ["mode=simulate", "pcp=1", "model=llama3_8b", "hardware=h100_sxm", "disagg=pd", "simulate.p2p_efficiency=0.5",
        "output.plots=false", "output.progress=false"]


def run(*overrides: str) -> tuple[PooledRun, dict]:
    sim = PooledRun(compose([*BASE, *overrides]))
    return sim, sim.run()


def one_request(*overrides: str, prompt: int = 4096):
    return run("workload=explicit", f"workload.prompt_lens=[{prompt}]", "workload.output_lens=[2]", *overrides)


def test_pools_on_one_node_talk_over_nvlink_by_hand():
    # llama3_8b: 32 layers, 8 KV heads of 128 (K and V: 512 B a head in bf16). Prefill tp=2,
    # decode tp=2 (4 ranks: one node of 8): decode rank t takes heads 4t..4t+3 from prefill rank t,
    # 4096 x 4 x 512 x 32 B each, after the prefill as one message over NVLink: NCCL's NVLink
    # Simple hop latency 3.4 us + bytes at p2p_gbps 360 x the p2p share 0.5.
    _, res = one_request("tp=2", "disagg.decode_pool.tp=2", "disagg.transfer=after_prefill")
    t = res["metrics"]["transfer"]
    per_route = 4096 * 4 * 512 * 32
    assert (t["bytes"], t["calls"]) == (2 * per_route, 2)
    assert t["s"] == pytest.approx(3.4e-6 + per_route / (360e9 * 0.5), rel=1e-9)
    assert res["metrics"]["simulate"]["decode_pool_first_gpu"] == 2


def test_pools_on_separate_nodes_go_through_the_nics_by_hand():
    # tp=8 and tp=8: 16 GPUs, the decode pool on the second node. Each decode rank t gets head t
    # (4096 x 512 x 32 B) from prefill rank t through the NICs: the network's Simple hop latency
    # 14 us; NCCL opens min(4, p2p channels) channels to a net peer (ceil(50 / 14) = 4, a power of
    # two; the ring's 2 network channels doubled give 4 p2p channels), each at 14 GB/s x 0.5.
    _, res = one_request("tp=8", "disagg.decode_pool.tp=8", "disagg.transfer=after_prefill")
    t = res["metrics"]["transfer"]
    per_route = 4096 * 512 * 32
    assert (t["bytes"], t["calls"]) == (8 * per_route, 8)
    assert t["s"] == pytest.approx(14e-6 + per_route / (4 * 14e9 * 0.5), rel=1e-9)
    assert res["metrics"]["simulate"]["decode_pool_first_gpu"] == 8
    assert res["metrics"]["simulate"]["gpus"] == 16 and res["metrics"]["simulate"]["nodes"] == 2


def test_ttft_is_the_prefill_and_the_transfer_counts_in_the_first_tpot():
    for transfer in ("after_prefill", "layerwise"):
        sim, res = one_request("tp=8", "disagg.decode_pool.tp=8", f"disagg.transfer={transfer}")
        (req,) = res["requests"]
        first, second = sim.records
        prefill_s = first["pools"]["prefill"]["step_s"]
        assert req["ttft_s"] == pytest.approx(prefill_s)
        assert second["transfer"]["req_ids"] == [0] and second["pools"]["prefill"] is None
        assert req["tpot_s"] == pytest.approx(second["transfer"]["s"] + second["pools"]["decode"]["step_s"])
        assert req["transfer_s"] == pytest.approx(second["transfer"]["s"]) and req["transfer_s"] > 0
        if transfer == "after_prefill":
            whole = req["transfer_s"]
        else:  # a message per layer (31 more NIC hop latencies); 31 of 32 leave while the prefill computes
            layers = whole + 31 * 14e-6
            assert req["transfer_s"] == pytest.approx(layers - min(layers, prefill_s) * 31 / 32)
            assert res["metrics"]["transfer"]["hidden_s"] == pytest.approx(layers - req["transfer_s"])


def test_pools_on_their_own_clocks_with_the_queue_between_them():
    # Requests arrive at once (in time); a decode pool of one seat: the queue holds the rest
    # while it decodes, the prefill pool runs ahead on its own clock, everything finishes.
    sim, res = run("workload=explicit", "workload.prompt_lens=[3000,200,5000,800]", "workload.output_lens=[40,30,20,10]",
                   "workload.request_rate=inf", "disagg.decode_pool.max_num_seqs=1")
    rows, cols = res["requests"], sim.columns
    assert all(r["finish_step"] is not None for r in rows) and sim.decode.num_running == 0
    steps = [(r["time_s"], r["step_s"], "prefill" if r["pools"]["prefill"] else "decode") for r in sim.records]
    prefill_end = max(t + s for t, s, pool in steps if pool == "prefill")
    assert any(pool == "decode" and t < prefill_end for t, _, pool in steps), "the decode pool waited for the prefill pool"
    assert res["metrics"]["pools"]["decode"]["utilization"] > 0
    # one seat: each request waits for the one before it to finish before it is handed over
    order = sorted(range(len(rows)), key=lambda i: rows[i]["handover_step"])
    for before, after in zip(order, order[1:]):
        # its transfer starts once the seat is free: its last token after the other's, by its transfer at least
        assert cols["finish_s"][after] >= cols["finish_s"][before] + rows[after]["transfer_s"]
        assert cols["finish_s"][after] == pytest.approx(cols["first_token_s"][after] + cols["tpot_s"][after] * (rows[after]["output_len"] - 1))
    assert sim._handover.waited.sum() >= 1


def test_both_pools_full_in_time_finish():
    sim, res = run("workload.num_requests=24", "workload.request_rate=50", "kv.num_blocks=400",
                   "disagg.decode_pool.num_blocks=600", "disagg.decode_pool.max_num_seqs=4",
                   "scheduler.max_num_batched_tokens=4096")
    assert all(r["finish_step"] is not None for r in res["requests"])
    assert res["metrics"]["transfer"]["requests"] == sum(r["output_len"] > 1 for r in res["requests"])
    assert sim._handover.waited.sum() >= 1


TRACE_HEAD = Path(__file__).resolve().parents[2] / "scripts" / "data" / "mooncake_conversation_head.jsonl"


@pytest.mark.parametrize("overrides", [
    # by hand: 4 prompts of 300, each looked up once, on its first admission: 1,200 tokens
    ("workload=explicit", "workload.prompt_lens=[300,300,300,300]", "workload.output_lens=[20]",
     "workload.request_rate=10"),
    # shared prefixes: prefix hits on the prefill pool
    ("workload=trace", f"workload.path={TRACE_HEAD}", "workload.max_requests=30", "workload.length_scale=0.1"),
    # both pools short of blocks: preemptions, some in a schedule() that then ran nothing
    ("workload.num_requests=30", "workload.request_rate=100", "workload.prompt_len=[500,2000]",
     "workload.output_len=[50,200]", "kv.num_blocks=400", "disagg.decode_pool.num_blocks=300"),
], ids=["explicit", "trace", "preempting"])
def test_serving_counts_in_time_are_the_requests_own(overrides):
    """Each pool on its own clock: a step record counts the preemptions and prefix lookups
    of the one ``schedule()`` that made it, so the run's totals are the requests' own. A
    request counts as looked up once, on its first admission (the prefill pool's), with its
    whole prompt; a readmission after a preemption (on either pool) counts only in its
    ``num_preemptions``, as with one pool (``StepStats.prefix_query_tokens``)."""
    sim, res = run(*overrides)
    m, rows = res["metrics"], res["requests"]
    assert sim.timed and all(r["finish_step"] is not None for r in rows)
    assert m["prefix_cache"]["query_tokens"] == sum(r["prompt_len"] for r in rows)
    assert m["prefix_cache"]["hit_tokens"] == sum(r["prefix_hit_tokens"] for r in rows)
    assert m["preemptions"] == sum(r["num_preemptions"] for r in rows)
    if overrides[0] == "workload=explicit":
        assert m["prefix_cache"]["query_tokens"] == 1200
    if overrides[0] == "workload=trace":
        assert m["prefix_cache"]["hit_tokens"] > 0
    if overrides[0] == "workload.num_requests=30":
        ran_nothing = [r for r in sim.records if r["num_preempted"] and not any(r["pools"].values())]
        assert m["preemptions"] > 0 and ran_nothing


@pytest.mark.parametrize("overrides", [
    # the fuzzer's case: two long prompts chunked, one short; its decode pool counted its own steps
    ("workload=explicit", "workload.prompt_lens=[5000,5000,100]", "workload.output_lens=[2]",
     "workload.request_rate=inf", "scheduler.max_num_batched_tokens=1024"),
    ("workload.num_requests=12", "workload.request_rate=50", "disagg.decode_pool.max_num_seqs=2"),
], ids=["at-once", "poisson"])
def test_step_columns_in_time_are_the_runs_steps(overrides):
    """Each pool on its own clock: a request's steps are metrics.jsonl's (either pool's), so
    its first token's step is the prefill step that sampled it, its finish the decode step
    that did, its handover the record of its transfer, in that order; TTFT and TPOT in steps
    count those steps."""
    sim, res = run("pcp=2", *overrides)
    cols, records = sim.columns, sim.records
    assert [r["step"] for r in records] == list(range(res["metrics"]["num_steps"]))
    for r in res["requests"]:
        i = r["req_id"]
        first, finish, handover = records[r["first_token_step"]], records[r["finish_step"]], records[r["handover_step"]]
        assert first["pools"]["prefill"] is not None
        assert first["time_s"] + first["step_s"] == pytest.approx(cols["first_token_s"][i], abs=1e-12)
        assert finish["pools"]["decode"] is not None
        assert finish["time_s"] + finish["step_s"] == pytest.approx(cols["finish_s"][i], abs=1e-12)
        assert i in handover["transfer"]["req_ids"]
        assert records[r["arrival_step"]]["time_s"] >= cols["arrival_s"][i]
        assert r["arrival_step"] <= r["first_token_step"] < r["handover_step"] < r["finish_step"]
        assert r["ttft_steps"] == r["first_token_step"] - r["arrival_step"] + 1
        assert r["tpot_steps"] == pytest.approx((r["finish_step"] - r["first_token_step"]) / (r["output_len"] - 1))
