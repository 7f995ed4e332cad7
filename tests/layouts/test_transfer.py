"""pcpflow.layouts.transfer: the re-layout rule of a handover, by hand (the worked example of
docs/disaggregation.md) and as a property over random lengths, pools and interleaves: the
entries each decode rank receives are exactly what its layout owns, computed here from the
layout rules alone (the grid's DCP ranks, the KV heads of each TP rank, (p // I) % dcp)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.slots import compute_slot_mapping
from pcpflow.layouts.transfer import (
    MovedKV,
    PoolKV,
    handover_counts,
    rank_bytes,
    route_sizes,
    transfer_counts,
    transfer_routes,
)
from pcpflow.parallel.grid import Axis, RankGrid
from pcpflow.parallel.tensor_parallel import kv_heads_of
from pcpflow.parallel.transfer import pool_kv

PROPERTY = settings(max_examples=120, deadline=None, database=None)


def _by_dst(routes):
    return {d: sorted((r.src, r.positions.tolist(), r.heads) for r in routes if r.dst == d)
            for d in sorted({r.dst for r in routes})}


def test_the_worked_example():
    # docs/disaggregation.md: 10 tokens of an MLA model. Prefill pool pcp=2 dcp=2 interleave 2:
    # rank 0 holds 0 1 4 5 8 9, rank 1 holds 2 3 6 7. Decode pool tp=2 dcp=2 interleave 1 (DCP
    # over its two TP ranks): rank 0 owns the even positions, rank 1 the odd ones.
    src = pool_kv(RankGrid(tp=1, pcp=2, dcp=2), 2, None)
    dst = pool_kv(RankGrid(tp=2, pcp=1, dcp=2), 1, None)
    assert src == PoolKV((0, 1), ((0,), (0,)), 2, 2) and dst == PoolKV((0, 1), ((0,), (0,)), 2, 1)
    routes = transfer_routes(10, src, dst)
    assert _by_dst(routes) == {
        0: [(0, [0, 4, 8], (0,)), (1, [2, 6], (0,))],
        1: [(0, [1, 5, 9], (0,)), (1, [3, 7], (0,))],
    }
    # Where they land: decode rank 0's positions 0 2 4 6 8 are its local 0..4; with its block
    # table [5, 9] (block_size 4) they go to slots 20 21 22 23 36: block 5 holds positions
    # 0 (from prefill rank 0), 2 (rank 1), 4 (rank 0), 6 (rank 1).
    pos = np.array([0, 2, 4, 6, 8])
    slots = compute_slot_mapping(pos, np.zeros(5, np.int64), np.array([[5, 9]]), 4, dcp_size=2, dcp_rank=0, interleave=1)
    assert slots.tolist() == [20, 21, 22, 23, 36]
    # ... read on prefill rank 0 (its table [7, 3]) at slots 28 (position 0), 30 (4), 12 (8).
    slots = compute_slot_mapping(np.array([0, 4, 8]), np.zeros(3, np.int64), np.array([[7, 3]]), 4,
                                 dcp_size=2, dcp_rank=0, interleave=2)
    assert slots.tolist() == [28, 30, 12]
    # 61 layers of a 576-wide bf16 latent (DeepSeek-V3): 10 entries a layer, one message per
    # route and layer (layerwise) or per route (after_prefill).
    assert transfer_counts(routes, group_bytes=576 * 2, num_layers=61, transfer="layerwise") == (4 * 61, 10 * 61 * 1152)
    assert transfer_counts(routes, group_bytes=576 * 2, num_layers=61, transfer="after_prefill") == (4, 10 * 61 * 1152)
    # Drafting: DeepSeek-V3's MTP layer (one more 576-wide latent layer) moves by the same 4 routes,
    # in messages of its own: 4 more layerwise (one layer), 4 more after_prefill.
    moved = [MovedKV(src, dst, 61, 1152), MovedKV(src, dst, 1, 1152)]
    assert handover_counts(10, moved, transfer="layerwise") == (4 * 61 + 4, 10 * 62 * 1152)
    assert handover_counts(10, moved, transfer="after_prefill") == (4 + 4, 10 * 62 * 1152)


def test_mla_is_sent_to_every_tp_rank_and_replicated_holders_share_the_sending():
    # MLA's latent has no heads: each of the decode pool's 4 TP ranks receives all 6 positions
    # (the only duplication); the prefill pool holds everything on both PCP ranks (dcp=1), so
    # decode ranks 0 and 2 hear from prefill rank 0, 1 and 3 from rank 1.
    routes = transfer_routes(6, pool_kv(RankGrid(pcp=2), 1, None), pool_kv(RankGrid(tp=4), 1, None))
    assert [(r.src, r.dst, r.positions.tolist()) for r in routes] == [
        (0, 0, list(range(6))), (1, 1, list(range(6))), (0, 2, list(range(6))), (1, 3, list(range(6)))]
    sent, got = rank_bytes(routes, group_bytes=1, num_layers=1, num_src=2, num_dst=4)
    assert sent.tolist() == [12, 12] and got.tolist() == [6, 6, 6, 6]


def test_gqa_heads_come_from_the_tp_ranks_that_hold_them():
    # 4 KV heads; prefill tp=2 (heads 0 1 | 2 3), decode tp=4 (one head each): decode rank t
    # receives head t from the prefill TP rank holding it. Decode tp=8 (two ranks per head):
    # each head goes twice, counted.
    src = pool_kv(RankGrid(tp=2), 1, 4)
    routes = transfer_routes(3, src, pool_kv(RankGrid(tp=4), 1, 4))
    assert [(r.src, r.dst, r.heads) for r in routes] == [(0, 0, (0,)), (0, 1, (1,)), (1, 2, (2,)), (1, 3, (3,))]
    routes = transfer_routes(3, src, pool_kv(RankGrid(tp=8), 1, 4))
    assert [r.heads for r in routes] == [(0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,)]
    assert sum(r.num_entries for r in routes) == 2 * 3 * 4


def _pool(draw, max_ranks: int = 8):
    tp = draw(st.sampled_from([1, 2, 4]))
    pcp = draw(st.sampled_from([1, 2, 3, 4]))
    grid = RankGrid(tp=tp, pcp=pcp, dcp=draw(st.sampled_from(RankGrid(tp=tp, pcp=pcp).allowed_dcp())))
    interleave = draw(st.sampled_from([1, 2, 4]))
    return grid, interleave


@st.composite
def _case(draw):
    mla = draw(st.booleans())
    kv_heads = None if mla else draw(st.sampled_from([1, 2, 4, 8]))
    (sg, si), (dg, di) = _pool(draw), _pool(draw)
    # GQA: DCP over TP ranks needs ranks sharing KV heads (the grid's checks refuse the rest)
    for g in (sg, dg):
        if kv_heads is not None and (kv_heads % g.tp and g.tp % kv_heads):
            kv_heads = g.tp
        if kv_heads is not None and g.dcp_tp > 1 and max(1, g.tp // kv_heads) % g.dcp_tp:
            kv_heads = None  # NOTE: not a config the checks let through for GQA: take MLA
    return draw(st.integers(1, 200)), sg, si, dg, di, kv_heads


def _holds(grid: RankGrid, interleave: int, kv_heads, rank: int, length: int) -> set[tuple[int, int]]:
    """(position, head group) a pool rank keeps, from the layout rules alone."""
    d = grid.coords(rank)[Axis.DCP]
    heads = [0] if kv_heads is None else list(kv_heads_of(rank % grid.tp, grid.tp, kv_heads))
    return {(p, h) for p in range(length) if (p // interleave) % grid.dcp == d for h in heads}


@PROPERTY
@given(_case())
def test_each_decode_rank_receives_exactly_what_it_owns_from_ranks_that_hold_it(case):
    n, sg, si, dg, di, kv_heads = case
    routes = transfer_routes(n, pool_kv(sg, si, kv_heads), pool_kv(dg, di, kv_heads))
    for d in range(dg.world_size):
        got = [(int(p), h) for r in routes if r.dst == d for p in r.positions for h in r.heads]
        assert len(got) == len(set(got)), "an entry sent twice to one rank"
        assert set(got) == _holds(dg, di, kv_heads, d, n)
    for r in routes:
        sent = {(int(p), h) for p in r.positions for h in r.heads}
        assert sent and sent <= _holds(sg, si, kv_heads, r.src, n), "sent by a rank that does not hold it"
    # the bytes: what the decode ranks own, no more (the duplication of TP ranks holding the same slice counted)
    owned = sum(len(_holds(dg, di, kv_heads, d, n)) for d in range(dg.world_size))
    assert transfer_counts(routes, group_bytes=3, num_layers=2, transfer="after_prefill") == (len(routes), owned * 3 * 2)
    # the simulator's arrays: the same routes, entries counted from one period of the rules
    sizes = route_sizes(n, pool_kv(sg, si, kv_heads), pool_kv(dg, di, kv_heads))
    assert list(zip(sizes.src.tolist(), sizes.dst.tolist(), sizes.entries.tolist())) == [
        (r.src, r.dst, r.num_entries) for r in routes]
    # from a start (a hybrid cache's windowed layers): the same, less the positions before it
    start = (7 * n) // 11
    routes = transfer_routes(n, pool_kv(sg, si, kv_heads), pool_kv(dg, di, kv_heads), start)
    for d in range(dg.world_size):
        got = {(int(p), h) for r in routes if r.dst == d for p in r.positions for h in r.heads}
        assert got == {(p, h) for p, h in _holds(dg, di, kv_heads, d, n) if p >= start}
    sizes = route_sizes(n, pool_kv(sg, si, kv_heads), pool_kv(dg, di, kv_heads), start)
    assert list(zip(sizes.src.tolist(), sizes.dst.tolist(), sizes.entries.tolist())) == [
        (r.src, r.dst, r.num_entries) for r in routes]


@pytest.mark.parametrize("n", [1, 5, 4096, 131_071])
def test_route_sizes_of_long_requests(n):
    """Counted per period, the entries equal the routes' positions at any length."""
    src, dst = pool_kv(RankGrid(tp=2, pcp=4, dcp=4), 4, 2), pool_kv(RankGrid(tp=4, dcp=2), 3, 2)
    routes = transfer_routes(n, src, dst)
    sizes = route_sizes(n, src, dst)
    assert sizes.entries.tolist() == [r.num_entries for r in routes] and sizes.dst.tolist() == [r.dst for r in routes]
    # by hand: 2 KV heads over 4 decode TP ranks, each head on the 2 DCP ranks sharing it, each
    # position on one of them: every (position, head) entry lands once
    assert int(sizes.entries.sum()) == n * 2


def test_bad_pools_are_refused():
    with pytest.raises(ValueError, match="2 DCP ranks but 1 head slices"):
        PoolKV((0, 1), ((0,),), 2, 1)
    with pytest.raises(ValueError, match="transfer 'eager'"):
        transfer_counts([], group_bytes=1, num_layers=1, transfer="eager")
