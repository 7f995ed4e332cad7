"""disagg=pd executed: a prefill pool hands each request's KV to a decode pool, exact.

Every run is verified against the single rank (tokens, logits, and every rank of both pools
holding exactly what it owns, the decode ranks' handed-over entries included). The bytes
each handover moved are checked against what the decode ranks' layouts own, computed from
the layout rules (their DCP shards' positions, their TP slices' columns); a corrupted
transfer is caught. Pools run in the session's shared ranks (tests/shared_ranks.py).
"""

from __future__ import annotations

import pytest
import shared_ranks

from pcpflow.config.disagg import pool_config
from pcpflow.layouts.slots import dcp_local_seq_lens
from pcpflow.models import build_model
from pcpflow.parallel.grid import Axis
from pcpflow.parallel.tensor_parallel import local_spec
from pcpflow.testing import compose

QUIET = ["output.plots=false", "output.progress=false", "kv.block_size=4"]
STEM = [(7 * j + 3) % 200 + 1 for j in range(16)]
# Prompts sharing a 16-token stem (prefix hits on the prefill pool: two blocks of 4 x dcp 2),
# arriving over a few steps, through pools too small to take them all at once: the queue
# holds prefill blocks while the decode pool is full, and the decode pool preempts.
FULL = [
    "workload=explicit",
    "workload.prompts=" + str([STEM + [50 + i, 9 * i + 1, 3] for i in range(5)] + [STEM[:11]]).replace(" ", ""),
    "workload.output_lens=[7,5,6,8,4,6]", "workload.arrival_steps=[0,0,1,3,4,4]",
    "kv.prefix_caching=true", "kv.num_blocks=7", "scheduler.max_num_batched_tokens=24",
    "disagg.decode_pool.num_blocks=6", "disagg.decode_pool.max_num_seqs=3",
]
CASES = {
    # the README's second command's geometry: prefill pcp=2 dcp=2 interleave 2, decode tp=2 dcp=2
    # interleave 1 (one decode block draws from both prefill ranks)
    "pcp2_dcp2_i2_to_tp2_dcp2_full": ["pcp=2", "dcp=2", "kv.interleave=2", "disagg=pd", "disagg.decode_pool.tp=2",
                                      "disagg.decode_pool.dcp=2", *FULL],
}
SLOW = {
    "readme_pcp4_to_pcp2_dcp2": ["pcp=4", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2"],
    # GQA with 2 KV heads over a decode tp of 4: each head on two decode ranks, both receive it
    "gqa_pcp2_dcp2_to_tp4": ["model=tiny_gqa", "pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=4",
                             "disagg.transfer=after_prefill"],
    "tp2_pcp2_dcp4_to_tp2_dcp2_i2": ["tp=2", "pcp=2", "dcp=4", "disagg=pd", "disagg.decode_pool.tp=2",
                                     "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=2",
                                     "disagg.transfer=after_prefill"],
    "sharded_decodes_pcp2_dcp2": ["pcp=2", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
                                  "decode=sharded", *FULL],
    "gqa_tp2_to_pcp2_dcp2_i4_full": ["model=tiny_gqa", "tp=2", "pcp=1", "disagg=pd", "disagg.decode_pool.pcp=2",
                                     "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=4", *FULL],
}
FAULTS = "plugins=[pcpflow_test_plugins.faults]"
CORRUPT = ("+pipeline.extra=[{kind: 'pcpflow_test_plugins.faults:TransferFault', after: forward, rank: 3, step: 0, "
           "corrupt: true}]")


@shared_ranks.matrix("disagg/exact")
def _exact():
    cases = [compose([*QUIET, *o]) for o in CASES.values()]
    corrupt = compose([*QUIET, "pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2",
                       "workload=explicit", "workload.prompt_lens=[9,14]", "workload.output_lens=[3]", FAULTS, CORRUPT])
    return [*cases, corrupt]


@shared_ranks.matrix("disagg/exact-slow")
def _exact_slow():
    return [compose([*QUIET, *o]) for o in SLOW.values()]


def owned_bytes(cfg, prompt_len: int) -> int:
    """What the decode pool's ranks own of a prompt's entries, from the layout rules: each
    rank's DCP shard of the positions x its TP slice's cache entry x layers x the dtype."""
    d = pool_config(cfg, "decode")
    model = build_model(cfg.model, dtype=__import__("torch").float64, seed=0, device="meta")
    spec = model.attn_spec
    elem = {"float64": 8, "float32": 4, "bfloat16": 2}[cfg.dtype]
    total = 0
    for r in range(d.grid.world_size):
        mine = int(dcp_local_seq_lens([prompt_len], d.dcp, d.grid.coords(r)[Axis.DCP], d.kv.interleave)[0])
        width = local_spec(spec, r % d.tp, d.tp).entry_dim if d.tp > 1 else spec.entry_dim
        total += mine * width * model.num_layers * elem
    return total


def check(cfg, result):
    assert result["verify"]["passed"], result["verify"]
    assert result["verify"]["kv_match"] and result["verify"]["num_token_mismatches"] == 0
    rows = result["requests"]
    handed = [r for r in rows if r["handover_step"] is not None]
    assert handed, "no request was handed over"
    for r in rows:
        if r["output_len"] > 1:
            # TTFT is the prefill pool's: its first token came before the handover
            assert r["handover_step"] > r["first_token_step"] and r["finish_step"] >= r["handover_step"]
        assert r["transfer_bytes"] == (owned_bytes(cfg, r["prompt_len"]) if r["handover_step"] is not None else 0)
    m = result["metrics"]
    assert m["transfer"]["bytes"] == sum(r["transfer_bytes"] for r in rows) == m["collective_bytes"]["kv_transfer"]
    assert m["transfer"]["requests"] == len(handed)
    assert m["pools"]["prefill"]["tokens"] + m["pools"]["decode"]["tokens"] == m["num_tokens"]
    assert 0 < m["pools"]["prefill"]["utilization"] <= 1 and 0 < m["pools"]["decode"]["utilization"] <= 1


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_both_pools_exact_and_each_decode_rank_receives_what_it_owns(shared_runs):
    (cfg, result), *_ = shared_runs["disagg/exact"]
    check(cfg, result)
    rows = result["requests"]
    # both pools full: some request waited for the decode pool holding its prefill blocks,
    # prefix hits were sent like any block, and the decode pool preempted (recomputed there)
    assert any(r["handover_step"] > r["first_token_step"] + 1 for r in rows if r["handover_step"] is not None)
    assert result["metrics"]["prefix_cache"]["hit_tokens"] >= 16
    assert sum(r["num_preemptions"] for r in rows) >= 1
    assert result["verify"]["positions_recomputed"] >= 16  # the prefix hits, recomputed by the reference


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_a_corrupted_transfer_is_caught(shared_runs):
    _, (_, result) = shared_runs["disagg/exact"]
    assert not result["verify"]["passed"] and not result["verify"]["kv_match"]
    assert result["verify"]["kv_mismatched_slots"] >= 1


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("disagg/exact-slow")
def test_more_pools_exact(shared_runs):
    for cfg, result in shared_runs["disagg/exact-slow"]:
        check(cfg, result)
