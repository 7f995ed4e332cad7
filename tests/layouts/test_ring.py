"""pcpflow.layouts.ring: the ring schedule, run symbolically.

Every rank's view (``rank_ring``) is executed on (request, position) labels instead of
tensors: packages are built, sent, received and forwarded exactly as
``pcpflow.attention.ring`` does with their index arrays. Over random batches (prefills
split and replicated, decodes replicated and sharded, cached prefixes, padding, every
interleave) at P = 2..5 and both variants:

- every query row meets every key of its request at or before its position exactly once
  (the union of its P partial results), and nothing else: causality and no double count;
- a key read from a rank's paged cache is either cached (before this step) or written on
  that rank before the loop;
- every new token's KV is written exactly once, on its DCP owner, at the owner's slot;
- what a rank sends at each hop is what its successor expects, and the all-to-all's sizes
  agree on both sides.
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.layout import plan_layout
from pcpflow.layouts.ring import (
    REPLICATED,
    STAYS,
    plan_ring,
    rank_ring,
    request_num_computed,
)
from pcpflow.layouts.slots import compute_slot_mapping, dcp_global_positions, dcp_local_seq_lens

PROPERTY = settings(max_examples=120, deadline=None, database=None)
BLOCK = 4


def batch(q, c, prefilling):
    q, c = np.asarray(q, np.int64), np.asarray(c, np.int64)
    req = np.repeat(np.arange(len(q)), q)
    pos = c[req] + (np.arange(len(req)) - np.repeat(np.cumsum(q) - q, q))
    seq = c + q
    blocks = -(-seq // BLOCK) + 1
    # distinct physical blocks per request (any table works; these make slot clashes visible)
    first = np.cumsum(blocks) - blocks
    width = int(blocks.max())
    tables = first[:, None] + np.minimum(np.arange(width)[None, :], blocks[:, None] - 1)
    return q, c, np.asarray(prefilling, bool), req, pos, tables


def run_symbolically(q, c, prefilling, *, p, interleave, shard, variant):
    """(keys met per query row, KV writes, cache reads outside the cached prefix)."""
    q, c, prefilling, req_t, pos_t, tables = batch(q, c, prefilling)
    layout = plan_layout(q, prefilling, pcp_size=p, dcp_size=p, shard_decodes=shard, num_computed_tokens=c)
    plan = plan_ring(layout, pos_t, variant=variant, interleave=interleave)
    assert (request_num_computed(layout, pos_t)[q > 0] == c[q > 0]).all()
    views = [rank_ring(plan, r, tables, BLOCK) for r in range(p)]
    n = layout.padded_num_tokens

    def label(rank, rows):
        g = np.asarray(rows, np.int64) + rank * n
        return list(zip(plan.req[g].tolist(), plan.pos[g].tolist()))

    def cache_keys(rank, k, count):
        return [(k, int(x)) for x in dcp_global_positions(np.arange(count), p, rank, interleave)]

    written_before_loop = {r: set() for r in range(p)}
    writes = []  # (rank, (req, pos), slot)
    for r, v in enumerate(views):
        for key, slot in zip(label(r, v.write_rows), v.write_slots.tolist()):
            writes.append((r, key, slot))
            written_before_loop[r].add(key)
    met = {}  # (holder rank or "replicated", req, pos) -> Counter of keys
    outside = []

    def read_cache(r, k, qpos, count):
        keys = cache_keys(r, k, count)
        for key in keys:
            if key[1] >= c[k] and key not in written_before_loop[r]:
                outside.append((r, key, qpos))
        return keys

    # packages: origin -> (kv labels, query labels), as built before the loop
    packages = {}
    for o, v in enumerate(views):
        block = [None] * v.block_len
        # a cached entry's label: the position whose slot it is on this rank
        slot_to_key = {}
        for k in range(len(q)):
            lps = np.arange(dcp_local_seq_lens(c[k], p, o, interleave))
            for lp in lps.tolist():
                slot_to_key[int(tables[k, lp // BLOCK] * BLOCK + lp % BLOCK)] = (k, int(dcp_global_positions(lp, p, o, interleave)))
        for at, slot in zip(v.block_cached_at.tolist(), v.block_cached_slots.tolist()):
            block[at] = slot_to_key[slot]
        for at, key in zip(v.block_new_at.tolist(), label(o, v.block_new_rows)):
            block[at] = key
        assert None not in block
        packages[o] = (block + label(o, v.delivery_rows), label(o, v.travel_rows))

    partial_sources = Counter()
    for r, v in enumerate(views):
        local_keys = label(r, v.travel_rows)
        # replicated rows, over this rank's cache
        for (k, qp), n_c in zip(label(r, v.replicated_rows), v.replicated_cache_lens.tolist()):
            met.setdefault(("rep", k, qp), Counter()).update(read_cache(r, k, qp, n_c))
            partial_sources[("rep", k, qp)] += 1
        for h, hop in enumerate(v.hops):
            o = hop.origin
            assert o == (r - h) % p
            kv, qs = packages[o]
            if h:
                kv = kv[: hop.recv_kv]
                assert len(qs) == hop.recv_q
                prev = views[(r - 1) % p].hops[h - 1]
                assert (prev.send_kv, prev.send_q) == (hop.recv_kv, hop.recv_q)
                for at, slot in zip(hop.write_at.tolist(), hop.write_slots.tolist()):
                    writes.append((r, kv[at], slot))
            block = packages[o][0][: views[o].block_len]
            for (k, qp), row_len in zip(label(r, v.stay_rows), hop.stay_lens.tolist()):
                keys = [block[i] for i in hop.block_tables[k, :row_len].tolist()]
                met.setdefault((r, k, qp), Counter()).update(keys)
                partial_sources[(r, k, qp)] += 1
            assert label(o, views[o].travel_rows) == list(zip(hop.visit_req.tolist(), hop.visit_pos.tolist()))
            for (k, qp), n_c, n_l in zip(qs, hop.visit_cache_lens.tolist(), hop.visit_local_lens.tolist()):
                keys = read_cache(r, k, qp, n_c)
                keys += [local_keys[i] for i in v.local_tables[k, :n_l].tolist()]
                met.setdefault((o, k, qp), Counter()).update(keys)
                partial_sources[(o, k, qp)] += 1
        # all-to-all: rank r sends each rank t its visitors' partials and its replicated rows'
        assert v.all2all_send.tolist() == [len(views[t].travel_rows) + len(v.replicated_rows) for t in range(p)]
        assert v.all2all_recv.tolist() == [views[s].all2all_send[r] for s in range(p)]
    return layout, plan, met, partial_sources, writes, outside, (q, c, req_t, pos_t, tables)


@st.composite
def batches(draw):
    p = draw(st.integers(2, 5))
    num = draw(st.integers(1, 6))
    q, c, pre = [], [], []
    for _ in range(num):
        is_pre = draw(st.booleans())
        cached = draw(st.integers(0, 30))
        if is_pre:
            q.append(draw(st.integers(1, 40)))
        else:
            q.append(draw(st.integers(1, 3)))  # decode, or 1 + k verify rows
            cached = max(cached, 1)
        c.append(cached)
        pre.append(is_pre)
    return dict(
        q=q, c=c, prefilling=pre, p=p,
        interleave=draw(st.sampled_from([1, 2, 4])),
        shard=draw(st.booleans()),
        variant=draw(st.sampled_from(["pass_kv", "pass_q"])),
    )


@PROPERTY
@given(batches())
def test_every_query_meets_every_key_of_its_request_once_and_causally(case):
    layout, plan, met, sources, writes, outside, (q, c, req_t, pos_t, tables) = run_symbolically(**case)
    p = case["p"]
    # every real row of every rank is a query row with P partial results
    n = layout.padded_num_tokens
    for g in np.flatnonzero(plan.kind > 0):
        k, qp = int(plan.req[g]), int(plan.pos[g])
        # a replicated row: each rank attends its own copy over its own keys, every rank
        # merges all P; any other row: its holder merges the P partials
        key = ("rep", k, qp) if plan.kind[g] == REPLICATED else (int(g // n), k, qp)
        want = Counter((k, x) for x in range(qp + 1))
        got = met[key]
        assert sources[key] == p, key
        assert got == want, (key, sorted(got - want), sorted(want - got))
    assert not outside, outside[:5]
    # every new token written once, on its owner, at its slot
    new = Counter((int(k), int(x)) for k, x in zip(req_t, pos_t))
    got = Counter(key for _, key, _ in writes)
    assert got == new
    for r, (k, x), slot in writes:
        assert (x // case["interleave"]) % p == r
        want = compute_slot_mapping([x], [k], tables, BLOCK, dcp_size=p, dcp_rank=r, interleave=case["interleave"])
        assert slot == int(want[0])


def test_pass_kv_full_prefill_sends_blocks_and_no_queries():
    # P=2, I=1, one 8-token prefill, nothing cached: chunks of 2, rank 0 holds positions
    # 0,1,6,7 and rank 1 holds 2..5. Rank 0 owns even positions, rank 1 odd ones.
    layout = plan_layout([8], [True], pcp_size=2, dcp_size=2)
    plan = plan_ring(layout, np.arange(8), variant="pass_kv", interleave=1)
    assert plan.kind.tolist() == [STAYS] * 8
    assert plan.block_len.tolist() == [4, 4] and plan.num_travel.tolist() == [0, 0]
    assert not plan.has_all2all
    tables = np.arange(8)[None, :]
    r0 = rank_ring(plan, 0, tables, 4)
    # hop 0: rank 0's own block [0 1 6 7]; its rows (positions 0 1 6 7) read 1 2 3 4 of it
    assert r0.hops[0].stay_lens.tolist() == [1, 2, 3, 4]
    # hop 1: rank 1's block [2 3 4 5]: positions 0, 1 read none of it; 6, 7 all of it
    assert r0.hops[1].stay_lens.tolist() == [0, 0, 4, 4]
    assert (r0.hops[0].send_kv, r0.hops[1].recv_kv) == (4, 4)
    # rank 0 writes 0 and 6 itself, and 2 and 4 from rank 1's block (rows 0 and 2 of it)
    assert r0.write_rows.tolist() == [0, 2]
    assert r0.hops[1].write_at.tolist() == [0, 2]


def test_pass_q_with_a_cached_prefix_sends_queries_and_new_kv_only_as_far_as_its_owner():
    # P=4, I=1, a 2-token continuation after 10 cached tokens: replicated under DCP
    # (7 * ceil(2/8) >= 2), but sharded decodes keep it on rank 0 alone: it travels.
    layout = plan_layout([2], [True], pcp_size=4, dcp_size=4, shard_decodes=True, num_computed_tokens=[10])
    plan = plan_ring(layout, np.array([10, 11]), variant="pass_q", interleave=1)
    assert plan.num_travel.tolist() == [2, 0, 0, 0] and plan.num_replicated == 0
    # positions 10 and 11 belong to ranks 2 and 3: 2 and 3 hops from rank 0
    assert plan.delivery_len[0].tolist() == [2, 2, 2, 1, 0]
    assert [int(plan.kv_rows_sent(0, h)) for h in range(3)] == [2, 2, 1]
    # every rank reads its shard of the 10 cached tokens for both queries
    for r in range(4):
        view = rank_ring(plan, r, np.arange(8)[None, :], 4)
        hop = view.hops[r]  # rank 0's package reaches rank r at iteration r
        assert hop.visit_cache_lens.tolist() == [int(dcp_local_seq_lens(10, 4, r, 1))] * 2
        assert hop.visit_local_lens.tolist() == ([1, 2] if r == 0 else [0, 0])


@pytest.mark.parametrize("variant", ["pass_kv", "pass_q"])
def test_replicated_decodes_need_no_hop(variant):
    layout = plan_layout([1, 1], [False, False], pcp_size=3, dcp_size=3, num_computed_tokens=[5, 9])
    plan = plan_ring(layout, np.array([5, 9]), variant=variant, interleave=1)
    assert plan.num_replicated == 2 and plan.num_travel.sum() == 0 and plan.block_len.sum() == 0
    view = rank_ring(plan, 1, np.arange(4)[None, :].repeat(2, 0), 4)
    assert all(h.send_kv == 0 and h.send_q == 0 for h in view.hops)
    assert view.all2all_send.tolist() == [2, 2, 2]
