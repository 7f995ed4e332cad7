"""The pairs of a sliding-window or chunked layer (``attention_work``, ``ring_attention_work``
and the simulator's ``_busiest_shard`` with ``window``), against a brute force.

The brute force walks the gathered rows of a random layout one by one (prefills split and
replicated, decodes replicated and sharded, cached prefixes, padding, dcp 1..4, interleave
1..3) and, for each row at position p, enumerates the keys ``max(0, p + 1 - W) .. p`` it
sees on each rank (a DCP shard's: the keys k with ``(k // I) % D`` its rank), by the rules
each count documents; ``W = None`` sees ``0 .. p`` (today's count, so the brute force is
checked against the unchanged code too). Windows: 1, 2, a few keys, and larger than every
context (then equal to no window); chunked ones (``Window(C, "chunked")``) the same sizes, a
row at p seeing ``p - p % C .. p``.
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.accounting import attention_work, ring_attention_work
from pcpflow.layouts.layout import plan_layout
from pcpflow.layouts.ring import REPLICATED, STAYS, TRAVELS, plan_ring
from pcpflow.layouts.slots import Window
from pcpflow.parallel.grid import RankGrid
from pcpflow.simulate.price import _busiest_shard

PROPERTY = settings(max_examples=80, deadline=None, database=None)
WINDOWS = (None, 1, 2, 3, 5, 8, 1000, *(Window(c, "chunked") for c in (1, 2, 3, 5, 8, 1000)))


@st.composite
def batches(draw):
    p = draw(st.integers(1, 4))
    num = draw(st.integers(1, 5))
    q, c, pre = [], [], []
    for _ in range(num):
        is_pre = draw(st.booleans())
        q.append(draw(st.integers(1, 24)) if is_pre else draw(st.integers(1, 3)))
        c.append(draw(st.integers(0, 20)) if is_pre else draw(st.integers(1, 20)))
        pre.append(is_pre)
    return dict(q=np.array(q), c=np.array(c), pre=np.array(pre), p=p, interleave=draw(st.integers(1, 3)),
                shard=draw(st.booleans()), dcp=draw(st.sampled_from([1, p])), mask=draw(st.booleans()))


def _positions(q, c):
    return np.repeat(c, q) + np.arange(q.sum()) - np.repeat(np.cumsum(q) - q, q)


def _rows(layout, positions, q):
    """Every real gathered row: (rank, local row, request, position)."""
    n = layout.padded_num_tokens
    tok_req = np.repeat(np.arange(len(q)), q)
    out = []
    for g in np.flatnonzero(~layout.is_padding):
        tok = layout.padded_gather_idx[g]
        out.append((int(g // n), int(g % n), int(tok_req[tok]), int(positions[tok])))
    return out


def _keys(pos, window):
    """The keys a row at ``pos`` sees."""
    if isinstance(window, Window):
        assert window.kind == "chunked"
        return range(pos - pos % window.size, pos + 1)
    return range(0 if window is None else max(0, pos + 1 - window), pos + 1)


def _on_shard(keys, d, dcp, interleave):
    return sum(1 for k in keys if (k // interleave) % dcp == d)


def brute_attention_work(layout, positions, q, *, dcp, interleave, window, mode, mask):
    """Without DCP each rank its rows over their keys; with DCP each rank its replicated
    decode copies over its shard, the rest rows by path: every gathered one over each shard
    (queries), or each rank its own over their keys (context)."""
    p, nd = layout.pcp_size, layout.num_replicated_decode_tokens
    work = [0] * p
    for r, local, req, pos in _rows(layout, positions, q):
        if mask is not None and not mask[req]:
            continue
        keys = _keys(pos, window)
        if dcp == 1 or (local >= nd and mode == "context"):
            work[r] += len(keys)
        elif local < nd:
            work[r] += _on_shard(keys, r, dcp, interleave)
        else:
            for d in range(dcp):
                work[d] += _on_shard(keys, d, dcp, interleave)
    return work


@PROPERTY
@given(batches())
def test_attention_work_through_a_window_is_the_brute_force(case):
    q, c, p, dcp, inter = case["q"], case["c"], case["p"], case["dcp"], case["interleave"]
    layout = plan_layout(q, case["pre"], pcp_size=p, dcp_size=dcp, shard_decodes=case["shard"], num_computed_tokens=c)
    positions = _positions(q, c)
    mask = ~case["pre"] if case["mask"] else None
    for mode in ("queries", "context") if dcp > 1 else ("queries",):
        for w in WINDOWS:
            got = attention_work(layout, positions, dcp_size=dcp, interleave=inter, request_mask=mask, dcp_rest=mode,
                                 window=w)
            want = brute_attention_work(layout, positions, q, dcp=dcp, interleave=inter, window=w, mode=mode, mask=mask)
            assert got.tolist() == want, (mode, w)


def test_a_window_wider_than_every_context_is_no_window_and_a_window_of_one_is_a_row_each():
    q, c = np.array([13, 1, 7]), np.array([4, 30, 0])
    pre = np.array([True, False, True])
    for dcp, mode in ((1, "queries"), (2, "queries"), (2, "context")):
        layout = plan_layout(q, pre, pcp_size=2, dcp_size=dcp, num_computed_tokens=c)
        kw = dict(dcp_size=dcp, interleave=2, dcp_rest=mode)
        full = attention_work(layout, _positions(q, c), **kw)
        assert attention_work(layout, _positions(q, c), window=31, **kw).tolist() == full.tolist()
        assert attention_work(layout, _positions(q, c), window=30, **kw).sum() < full.sum()
    # W = 1: every row its own key, once: on its rank without DCP (the decode on both ranks)
    layout = plan_layout(q, pre, pcp_size=2, dcp_size=1, num_computed_tokens=c)
    assert attention_work(layout, _positions(q, c), dcp_size=1, interleave=1, window=1).tolist() == [
        int(r) for r in layout.per_rank_num_tokens]


@st.composite
def tp_batches(draw):
    case = draw(batches())
    tp = draw(st.sampled_from([2, 4]))
    p = min(case["p"], 2)
    dcp = tp * p if p > 1 else draw(st.sampled_from([d for d in (2, 4) if tp % d == 0]))
    return dict(case, p=p, tp=tp, dcp=dcp)


@PROPERTY
@given(tp_batches())
def test_busiest_shard_over_tp_ranks_through_a_window_is_the_brute_force(case):
    """DCP over TP ranks: member ``d = pcp_rank * dcp_tp + tp_local`` scores every gathered
    row (each rank's copy of a replicated decode) over its shard; a PCP rank's figure is its
    busiest member's."""
    q, c, p, inter = case["q"], case["c"], case["p"], case["interleave"]
    grid = RankGrid(tp=case["tp"], pcp=p, dcp=case["dcp"])
    layout = plan_layout(q, case["pre"], pcp_size=p, dcp_size=grid.layout_dcp, shard_decodes=case["shard"],
                         num_computed_tokens=c)
    positions = _positions(q, c)
    mask = ~case["pre"] if case["mask"] else None
    rows = _rows(layout, positions, q)
    for w in WINDOWS:
        member = [sum(_on_shard(_keys(pos, w), d, grid.dcp, inter) for _, _, req, pos in rows
                      if mask is None or mask[req]) for d in range(grid.dcp)]
        want = [max(member[r * grid.dcp_tp:(r + 1) * grid.dcp_tp]) for r in range(p)]
        got = _busiest_shard(layout, positions, grid, inter, "queries", mask, window=w)
        assert got.tolist() == want, w


@st.composite
def ring_batches(draw):
    case = draw(batches())
    return dict(case, p=max(case["p"], 2), variant=draw(st.sampled_from(["pass_kv", "pass_q"])))


def brute_ring_work(layout, positions, q, c, *, variant, interleave, window):
    """A staying row scores its keys on its rank; a travelling row, on every rank j, the cached
    keys (before its request's first new token) j owns and the new keys j's travelling rows
    hold of its request; a row every rank holds, on every rank, the keys that rank owns."""
    p = layout.pcp_size
    plan = plan_ring(layout, positions, variant=variant, interleave=interleave)
    rows = _rows(layout, positions, q)
    kind = {(r, local): int(plan.kind[r * layout.padded_num_tokens + local]) for r, local, _, _ in rows}
    travelling = {(r, req, pos) for r, local, req, pos in rows if kind[r, local] == TRAVELS}
    work, total = [0] * p, 0
    for r, local, req, pos in rows:
        keys = _keys(pos, window)
        if kind[r, local] == STAYS:
            work[r] += len(keys)
        elif kind[r, local] == TRAVELS:
            for j in range(p):
                work[j] += sum(1 for k in keys if (k < c[req] and (k // interleave) % p == j)
                               or (j, req, k) in travelling)
        elif r == 0:  # REPLICATED: rank 0's copy stands for every rank's
            assert kind[r, local] == REPLICATED
            for j in range(p):
                work[j] += _on_shard(keys, j, p, interleave)
        else:
            continue
        total += len(keys)
    return work, total


@PROPERTY
@given(ring_batches())
def test_ring_attention_work_through_a_window_is_the_brute_force(case):
    """Per rank by the ring's rules, and in all: every row scores each key of its window
    exactly once, somewhere on the ring."""
    q, c, p, inter = case["q"], case["c"], case["p"], case["interleave"]
    layout = plan_layout(q, case["pre"], pcp_size=p, dcp_size=p, shard_decodes=case["shard"], num_computed_tokens=c)
    positions = _positions(q, c)
    for w in WINDOWS:
        got = ring_attention_work(layout, positions, variant=case["variant"], interleave=inter, window=w)
        want, total = brute_ring_work(layout, positions, q, c, variant=case["variant"], interleave=inter, window=w)
        assert got.tolist() == want, w
        assert int(got.sum()) == total == sum(len(_keys(int(x), w)) for x in positions), w
