"""A hybrid KV cache executed exactly (``kv.hybrid=on``: windowed layers give the blocks their
window left back to the pool, ``pcpflow.scheduling.kv_groups``): every rank's caches, aliased
by KV group place, must hold what the single-rank reference (one group) writes, at the slots of
each layer's group's table, and the tokens must be the reference's, at pcp 1 and 2, with DCP
(both decode modes, the context path), a ring and tp=2, drafters, CUDA-graph modes, and two
pools (``disagg=pd``: the bytes each handover moved checked against the layout rules, windowed
layers' positions only from the decode pool's first kept entry), for sliding and chunked windows.

The workloads make the windows free blocks and the pool hand them out again: prompts of 13-60
tokens in chunks of at most 32, windows of 8 and 12 keys, blocks of 4, and a pool small enough
that running requests are preempted (their prefixes recomputed by the reference) or prompts
sharing a stem (prefix hits). Each case's tables are replayed here (the scheduler is numpy
only) to show that blocks were given back and reused: a case where none were would prove
nothing. A misplaced write in a window group must fail verification, naming a windowed layer.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import shared_ranks
import torch
from exactness import dense_reference_agrees

from pcpflow.config.disagg import pool_config
from pcpflow.layouts.slots import Window, dcp_local_seq_lens
from pcpflow.models import build_model
from pcpflow.parallel.grid import Axis
from pcpflow.parallel.tensor_parallel import local_spec
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import build_requests
from pcpflow.testing import compose

FAULTS = "pcpflow_test_plugins.faults"
SLIDING = ["model.window=12", "model.window_layers=[1,2]"]  # groups (0, 3) full, (1, 2) windowed
CHUNKED = ["model.window=8", "model.window_layers=[0,2,3]", "model.window_kind=chunked"]  # (1,), (0,), (2,), (3,)
BASE = ["model=tiny_gqa", "model.num_layers=4", "dtype=float64", "kv.block_size=4", "kv.hybrid=on",
        "scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=3", "output.plots=false",
        "output.progress=false"]
LENGTHS = ["workload=explicit", "workload.prompt_lens=[41,57,48,13,60]", "workload.output_lens=[6]",
           "workload.arrival_steps=[0,0,1,2,3]"]
STEM = [(7 * j + 3) % 256 for j in range(24)]
STEMS = ["workload=explicit", f"workload.prompts={json.dumps([STEM + [100 + i, 50 + i, 7 + i] for i in range(5)])}",
         "workload.output_lens=[9]", "workload.arrival_steps=[0,2,2,3,5]", "kv.prefix_caching=true"]
# name -> overrides; "preempted" cases have too few blocks for every seat at once
CASES = {
    "pcp1_sliding_preempted": ["pcp=1", *LENGTHS, *SLIDING, "kv.num_blocks=40"],
    "pcp1_chunked_prefix_hits": ["pcp=1", *STEMS, *CHUNKED, "kv.num_blocks=48"],
    "pcp2_dcp2_replicated_sliding": ["pcp=2", "dcp=2", "decode=replicated", *LENGTHS, *SLIDING, "kv.num_blocks=24"],
    "pcp2_dcp2_sharded_chunked": ["pcp=2", "dcp=2", "decode=sharded", *LENGTHS, *CHUNKED, "kv.num_blocks=32"],
    "pcp2_dcp2_context_path": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context", "kv.interleave=2", *LENGTHS,
                               *SLIDING, "kv.num_blocks=24"],
    "pcp2_dcp2_ring_pass_kv": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv", *LENGTHS, *CHUNKED,
                               "kv.num_blocks=32"],
    "pcp2_dcp2_sharded_prefix_hits": ["pcp=2", "dcp=2", "decode=sharded", *STEMS, *SLIDING, "kv.num_blocks=24"],
    "tp2_sliding": ["tp=2", "pcp=1", *LENGTHS, *SLIDING, "kv.num_blocks=40"],
    "tp2_pcp2_dcp4_chunked": ["tp=2", "pcp=2", "dcp=4", "model.num_kv_heads=1", "decode=sharded", *LENGTHS,
                              *CHUNKED, "kv.num_blocks=32"],
    # drafters' own caches go by the full group's table (group 0); MTP's entry reads the next
    # token, so its prefix hits are cut (Scheduler._drafter_hit_of); the self drafter's windowed
    # layers read their window from its own caches
    "pcp2_dcp2_mtp_prefix_hits": ["pcp=2", "dcp=2", "draft=mtp", *STEMS, *SLIDING, "kv.num_blocks=40"],
    "pcp1_self_draft_chunked": ["pcp=1", "draft=self", "draft.num_speculative_tokens=2", *LENGTHS, *CHUNKED,
                                "kv.num_blocks=60"],
    # CUDA-graph modes: decode steps through the graph body (a slot mapping and a table per
    # group; eager on CPU), and every step padded to a capture size (padded rows never written)
    "pcp1_decode_graphs_sliding": ["pcp=1", "cudagraph_mode=full_decode_only", "pipeline.forward.attention=fused",
                                   *LENGTHS, *SLIDING, "kv.num_blocks=40"],
    "pcp2_dcp2_piecewise_chunked": ["pcp=2", "dcp=2", "decode=sharded", "cudagraph_mode=full_and_piecewise",
                                    *LENGTHS, *CHUNKED, "kv.num_blocks=32"],
    # two pools (disagg=pd): the handover moves a window group's entries from the first one the
    # decode pool keeps (its entries of block_size x dcp positions; the prefill pool keeps them
    # whole, also where its own entries are smaller), through each layer's group's table
    "disagg_pcp2_dcp2_to_tp2_dcp2_sliding_prefix_hits": ["pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=2",
                                                         "disagg.decode_pool.dcp=2", "model.num_kv_heads=1", *STEMS,
                                                         *SLIDING,
                                                         "kv.num_blocks=40", "disagg.decode_pool.num_blocks=40"],
    "disagg_pcp1_to_pcp2_dcp2_i2_chunked_after_prefill": ["pcp=1", "disagg=pd", "disagg.decode_pool.pcp=2",
                                                          "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=2",
                                                          "disagg.transfer=after_prefill", *LENGTHS, *CHUNKED,
                                                          "kv.num_blocks=56", "disagg.decode_pool.num_blocks=48"],
}
GRAPHS = "pcp1_decode_graphs_sliding"
DRAFTING = {"pcp2_dcp2_mtp_prefix_hits", "pcp1_self_draft_chunked"}
# a write of the window group (1) one slot off, on rank 1 at step 4
FAULT = ["pcp=2", "dcp=2", *LENGTHS, *SLIDING, "kv.num_blocks=24", f"plugins=[{FAULTS}]",
         f"+pipeline.extra=[{{kind: '{FAULTS}:MisplacedKVWrite', after: slots, rank: 1, step: 4, group: 1}}]"]


@shared_ranks.matrix("hybrid_kv/slow")
def _hybrid_runs():
    return [compose(BASE + overrides) for overrides in (*CASES.values(), FAULT)]


def _groups(cfg) -> KVGroups:
    m = cfg.model
    return KVGroups.of(m.num_layers, m.window_layers, Window(m.window, m.window_kind))


def given_back_and_reused(cfg) -> tuple[int, int]:
    """Replaying the run's scheduler: the window groups' table entries that pointed at the null
    block at some step (blocks given back), and the blocks that went from one (group, request,
    entry) to another while the run held them (reused)."""
    groups = _groups(cfg)
    kv = KVCacheManager(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp, prefix_caching=cfg.kv.prefix_caching,
                        groups=groups)
    requests = build_requests(cfg.workload, vocab_size=cfg.model.vocab_size, seed=cfg.seed)
    scheduler = Scheduler(requests, max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                          max_num_seqs=cfg.scheduler.max_num_seqs, kv=kv)
    owner = np.full(cfg.kv.num_blocks + 1, -1, dtype=np.int64)
    nulled = reused = 0
    for batch in StepLoop(scheduler).batches():
        tables = batch.group_block_tables
        assert tables is not None and tables.shape[0] == groups.num_groups
        assert (tables[0] == batch.block_tables).all()
        held = -(-batch.seq_lens // kv.tokens_per_block)
        g, r, e = np.nonzero(np.broadcast_to(np.arange(tables.shape[-1]) < held[:, None], tables.shape))
        block = tables[g, r, e]
        nulled += int((block == kv.null_block).sum())
        assert not ((block == kv.null_block) & ~np.asarray(groups.windowed)[g]).any(), "a full group left a block"
        key = (g * 1000 + batch.req_ids[r]) * 1000 + e
        real = block != kv.null_block
        reused += int(((owner[block[real]] >= 0) & (owner[block[real]] != key[real])).sum())
        owner[block[real]] = key[real]
        scheduler.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64))
    return nulled, reused


def handover_bytes(cfg, n: int) -> tuple[int, int]:
    """(bytes a handover of a prompt of ``n`` tokens moves, bytes it would move keeping every
    block), from the layout rules: each decode rank's DCP shard of the positions x its TP
    slice's entry x layers, a windowed layer's positions only from the decode pool's entry
    holding the first key the next query (at n) reads."""
    d = pool_config(cfg, "decode")
    window = Window(cfg.model.window, cfg.model.window_kind)
    per_entry = cfg.kv.block_size * d.dcp
    start = int(window.starts(np.int64(n))) // per_entry * per_entry
    windowed = len(cfg.model.window_layers)
    spec = build_model(cfg.model, dtype=torch.float64, seed=0, device="meta").attn_spec
    moved = everything = 0
    for r in range(d.grid.world_size):
        dcp_rank = d.grid.coords(r)[Axis.DCP]
        owned = lambda k: int(dcp_local_seq_lens([k], d.dcp, dcp_rank, d.kv.interleave)[0])  # noqa: E731
        width = local_spec(spec, r % d.tp, d.tp).entry_dim * 8  # float64
        moved += width * (owned(n) * (cfg.model.num_layers - windowed) + (owned(n) - owned(start)) * windowed)
        everything += width * owned(n) * cfg.model.num_layers
    return moved, everything


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.matrix("hybrid_kv/slow")
def test_a_hybrid_kv_cache_is_exact_on_every_path(shared_runs):
    runs = shared_runs["hybrid_kv/slow"]
    assert len(runs) == len(CASES) + 1
    for name, (cfg, result) in zip(CASES, runs):
        v, m = result["verify"], result["metrics"]
        assert v["passed"] and v["tokens_match"] and v["kv_match"], (name, v["failures"])
        assert v["kv_mismatched_slots"] == 0 and v["kv_entries_checked"] > 0, name
        assert v["max_abs_logit_diff"] <= 1e-9 and v["max_abs_kv_diff"] <= 1e-9, (name, v)
        assert m["kv_groups"] == _groups(cfg).describe(), (name, m["kv_groups"])
        assert dense_reference_agrees(cfg, result), f"{name}: tokens differ from the dense reference"
        if name in DRAFTING:  # NOTE: its steps follow the drafts accepted: no replay; drafts were checked
            assert m["draft_proposed"] > 0 and v["draft_kv_match"] and v["draft_kv_entries_checked"] > 0, (name, v)
        elif name.startswith("disagg"):  # NOTE: two schedulers: the bytes moved instead
            handed = [r for r in result["requests"] if r["handover_step"] is not None]
            assert handed, name
            for r in handed:
                want, everything = handover_bytes(cfg, r["prompt_len"])
                assert r["transfer_bytes"] == want < everything, (name, r, want, everything)
        else:
            nulled, reused = given_back_and_reused(cfg)
            assert nulled > 0 and reused > 0, (name, nulled, reused)
        if "preempted" in name:
            assert m["preemptions"] >= 1, name
        if "prefix_hits" in name:
            assert m["prefix_cache"]["hit_tokens"] > 0 and v["positions_recomputed"] >= m["prefix_cache"]["hit_tokens"]
        if "ring" in name:
            assert set(m["cp_attention_steps"]) == {"ring_pass_kv"}, m["cp_attention_steps"]
        if name == GRAPHS:
            g = m["cudagraph"]
            assert g["graph_forward_steps"] == g["steps"]["full"] > 0, g
        if "piecewise" in name:  # NOTE: steps past the largest capture size (6 here) run eagerly ("none")
            assert m["cudagraph"]["steps"]["full"] > 0 and m["cudagraph"]["steps"]["piecewise"] > 0, m["cudagraph"]


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.matrix("hybrid_kv/slow")
def test_a_misplaced_write_of_a_window_group_fails_naming_a_windowed_layer(shared_runs):
    cfg, result = shared_runs["hybrid_kv/slow"][-1]
    v = result["verify"]
    assert not v["passed"] and not v["kv_match"] and v["kv_mismatched_slots"] >= 1, v
    first = v["kv_mismatches"][0]
    assert first["rank"] == 1 and first["step"] >= 4 and first["req_id"] >= 0, first
    assert first["layer"] in cfg.model.window_layers, first
