"""disagg=pd: the simulated run counts what the executed run counts, step by step.

Arrivals in steps: both run the pools in the same global loop. Every step, the handover's
requests, messages and bytes (at the same dtype: bf16 executed, bf16 KV simulated) and each
pool's per-rank tokens, attention pairs, collective calls and bytes and serving counts are
equal; the requests are timed over the same steps and moved the same bytes. The executed
side writes its metrics.jsonl from the session's shared ranks (tests/shared_ranks.py).

Drafting is not priced (``draft`` is refused with mode=simulate), but the simulator's count
of a handover (``handover_kv``: the target's cache and a shipped drafter's own) is checked
against an executed drafting run, handover by handover.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import shared_ranks

from pcpflow.config.disagg import POOLS, pool_config
from pcpflow.layouts.accounting import RING_PURPOSES
from pcpflow.layouts.transfer import handover_counts
from pcpflow.simulate.pools import PooledRun, handover_kv
from pcpflow.testing import compose

COMMON = ["dtype=bfloat16", "verify=false", "output.plots=false", "output.progress=false", "kv.block_size=4",
          "workload=explicit", "workload.prompt_lens=[5,19,33,3,26,12]", "workload.output_lens=[3,6,2,5,4,1]",
          "workload.arrival_steps=[0,0,1,2,4,4]", "scheduler.max_num_batched_tokens=16", "kv.num_blocks=12",
          "kv.prefix_caching=false", "disagg=pd", "disagg.decode_pool.num_blocks=6", "disagg.decode_pool.max_num_seqs=3"]
CASES = {
    # GQA over prefill TP ranks to a decode pool sharding its KV over PCP with another interleave
    "gqa_tp2_to_pcp2_dcp2_i4_after_prefill": ["model=tiny_gqa", "tp=2", "pcp=1", "disagg.decode_pool.pcp=2",
                                              "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=4",
                                              "disagg.transfer=after_prefill"],
}
RINGS = {
    # Meta's ring in the prefill pool (its KV sharded over the ring), pass-KV over a cached prefix,
    # to a decode pool sharding its KV over PCP: the ring's every-rank sends, step by step
    "mla_ring_pass_kv_pcp2_to_pcp2_dcp2": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv",
                                          "workload.cached_lens=[0,8,0,0,12,0]", "disagg.decode_pool.pcp=2",
                                          "disagg.decode_pool.dcp=2"],
    # pass-Q with TP beside the ring, to a decode pool of one rank
    "gqa_tp2_ring_pass_q_pcp2_to_one": ["model=tiny_gqa", "tp=2", "pcp=2", "dcp=2",
                                        "pipeline.forward.cp_attention=ring_pass_q", "disagg.decode_pool.num_blocks=12"],
    # Meta's decode ring in the decode pool (its queries sharded, each travelling the ring) behind
    # an all-gather prefill pool
    "mla_pcp2_to_pcp2_dcp2_ring_pass_q_sharded": ["pcp=2", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
                                                  "disagg.decode_pool.cp_attention=ring_pass_q", "decode=sharded"],
}
SLOW = {
    "mla_pcp2_dcp2_i2_to_tp2_dcp2_layerwise": ["pcp=2", "dcp=2", "kv.interleave=2", "disagg.decode_pool.tp=2",
                                               "disagg.decode_pool.dcp=2"],
    "mla_pcp2_to_tp2_replicated_latent": ["pcp=2", "disagg.decode_pool.tp=2", "disagg.decode_pool.num_blocks=10"],
    # a hybrid cache in both pools: the windowed layer's blocks given back in each, its handover
    # from the decode pool's first kept entry (8 positions there, 4 on the prefill pool)
    "gqa_hybrid_sliding_to_pcp2_dcp2_i2": ["model=tiny_gqa", "model.window=6", "model.window_layers=[1]",
                                           "kv.hybrid=on", "pcp=1", "disagg.decode_pool.pcp=2",
                                           "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=2",
                                           "kv.num_blocks=20", "disagg.decode_pool.num_blocks=14"],
}
RING_SENT = ("per_rank_collective_calls", "per_rank_collective_bytes")
COUNTED = ("per_rank_tokens", "padded_num_tokens", "collective_calls", "collective_bytes", "num_preempted",
           "prefix_hit_tokens", "prefix_query_tokens", "kv_blocks_used", "num_running", "num_waiting")
TIMED = ("arrival_step", "first_token_step", "finish_step", "ttft_steps", "tpot_steps", "output_len", "handover_step",
         "transfer_bytes")
DRAFTING = {
    # a GQA target (its heads split over the decode TP) and an MLA drafter (whole on both decode TP
    # ranks): two route sets, and the drafter's latent received twice
    "gqa_mtp_pcp2_to_tp2_layerwise": ["model=tiny_gqa", "draft=mtp", "pcp=2", "disagg.decode_pool.tp=2",
                                      "disagg.decode_pool.num_blocks=12"],
}
_DIRS: dict[str, Path] = {}


def _matrix(cases: dict[str, list[str]]):
    out = []
    for name, extra in cases.items():
        _DIRS[name] = Path(tempfile.mkdtemp(prefix=f"pcpflow-{name}-"))
        out.append((compose(COMMON + extra), _DIRS[name]))
    return out


@shared_ranks.matrix("disagg/equality")
def _equality():
    return _matrix(CASES)


@shared_ranks.matrix("disagg/equality-draft")
def _equality_draft():
    return _matrix(DRAFTING)


@shared_ranks.matrix("disagg/equality-rings")
def _equality_rings():
    return _matrix(RINGS)


@shared_ranks.matrix("disagg/equality-slow")
def _equality_slow():
    return _matrix(SLOW)


def _compare(name: str, extra: list[str], executed: dict) -> None:
    steps = [json.loads(line) for line in (_DIRS[name] / "metrics.jsonl").read_text().splitlines()]
    sim = PooledRun(compose(COMMON + extra + ["mode=simulate", "hardware=h100_sxm"]))
    simulated = sim.run()
    assert [s["step"] for s in sim.records] == [s["step"] for s in steps]
    dcp_over_tp = {pool: c.grid.dcp_tp > 1 for pool, c in sim.configs.items()}
    ring = {pool: c.pipeline["forward"]["cp_attention"] != "allgather" for pool, c in sim.configs.items()}
    moved = 0
    for ex, si in zip(steps, sim.records):
        for key in ("req_ids", "tokens", "calls", "bytes"):
            assert si["transfer"].get(key) == ex["transfer"].get(key), (name, ex["step"], key)
        moved += ex["transfer"].get("bytes", 0)
        for pool in ("prefill", "decode"):
            e, s = ex["pools"][pool], si["pools"][pool]
            assert (e is None) == (s is None), (name, ex["step"], pool)
            if e is None:
                continue
            assert s["cp_attention"] == e["cp_attention"] == ("allgather" if not ring[pool] else s["cp_attention"])
            assert ring[pool] == e["cp_attention"].startswith("ring_"), (name, ex["step"], pool)
            for key in COUNTED + (() if dcp_over_tp[pool] else ("per_rank_attention_work",)) + (RING_SENT if ring[pool] else ()):
                assert s[key] == e[key], (name, ex["step"], pool, key)
    assert moved > 0
    for e, s in zip(executed["requests"], simulated["requests"]):
        assert {k: s[k] for k in TIMED} == {k: e[k] for k in TIMED}, (name, e["req_id"])
    for key in ("bytes", "calls", "requests"):
        assert simulated["metrics"]["transfer"][key] == executed["metrics"]["transfer"][key], key
    for pool in ("prefill", "decode"):
        assert simulated["metrics"]["pools"][pool]["tokens"] == executed["metrics"]["pools"][pool]["tokens"]
    assert simulated["metrics"]["cp_attention_steps"] == executed["metrics"]["cp_attention_steps"]
    assert simulated["metrics"]["kv_groups"] == executed["metrics"]["kv_groups"]


@pytest.mark.dist
@pytest.mark.matrix("disagg/equality")
def test_every_step_moves_and_counts_the_same(shared_runs):
    for (_, executed), (name, extra) in zip(shared_runs["disagg/equality"], CASES.items()):
        _compare(name, extra, executed)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("disagg/equality-rings")
def test_a_ring_in_either_pool_sends_and_counts_the_same(shared_runs):
    for (_, executed), (name, extra) in zip(shared_runs["disagg/equality-rings"], RINGS.items()):
        _compare(name, extra, executed)
        lines = [json.loads(line)["pools"] for line in (_DIRS[name] / "metrics.jsonl").read_text().splitlines()]
        cfg = compose(COMMON + extra)
        rings = [pool for pool in POOLS if pool_config(cfg, pool).pipeline["forward"]["cp_attention"] != "allgather"]
        assert rings, name
        for pool in rings:  # each pool that runs a ring sent something over it
            assert any(r[pool] is not None and sum(r[pool]["collective_calls"].get(p, 0) for p in RING_PURPOSES) > 0
                       for r in lines), (name, pool)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("disagg/equality-slow")
def test_more_pools_move_and_count_the_same(shared_runs):
    for (_, executed), (name, extra) in zip(shared_runs["disagg/equality-slow"], SLOW.items()):
        _compare(name, extra, executed)


@pytest.mark.dist
@pytest.mark.matrix("disagg/equality-draft")
def test_a_drafting_handover_moves_what_the_simulator_counts(shared_runs):
    for (cfg, executed), name in zip(shared_runs["disagg/equality-draft"], DRAFTING):
        moved = handover_kv(cfg)  # at simulate.kv_dtype: bf16, the executed run's dtype
        assert len(moved) == 2 and cfg.simulate.kv_dtype == "bf16" and cfg.dtype == "bfloat16"
        steps = [json.loads(line) for line in (_DIRS[name] / "metrics.jsonl").read_text().splitlines()]
        handed = 0
        for ex in steps:
            t = ex["transfer"]
            if not t.get("req_ids"):
                continue
            counts = [handover_counts(n, moved, transfer=cfg.disagg.transfer) for n in t["tokens"]]
            assert (t["calls"], t["bytes"]) == (sum(c for c, _ in counts), sum(b for _, b in counts)), (name, ex["step"])
            handed += len(t["req_ids"])
        rows = executed["requests"]
        assert handed == sum(r["output_len"] > 1 for r in rows) == 5 and executed["metrics"]["draft_proposed"] > 0
        # by hand, per prompt token: the target's 2 KV heads x (16 + 16) x 2 layers, one head per decode
        # rank, and the drafter's latent (32 + 16) on both decode ranks, at 2 bytes
        per_token = 2 * 32 * 2 * 2 + 2 * 48 * 2
        for r in rows:  # a request of one output token finishes on the prefill pool
            assert r["transfer_bytes"] == r["prompt_len"] * per_token * (r["output_len"] > 1), (name, r["req_id"])
