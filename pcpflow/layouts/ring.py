"""The ring schedule of one step over a KV cache sharded over the ring (dcp = pcp): numpy
only, no torch. ``pcpflow.attention.ring`` runs it; ``pcpflow.layouts.accounting`` counts it.

Meta's ring attention (arXiv 2411.01783) on pcpflow's layout. P ranks form a ring (rank r
sends to r+1 and receives from r-1); every key of a request is attended exactly once by
every query of that request that may see it (position <= the query's), on one rank:

- a **cached** key (position < num_computed) lives on its DCP owner ``(p // I) % P``, in the
  paged cache, where the interleave placed it;
- a **new** key (this step's tokens) lives, for this step, on the rank that holds its row
  (DualChunkSwap for split prefills, the owner of a sharded decode), in that rank's KV rows.
  Rows every rank holds alike (replicated decodes, short prefills under ``decode=replicated``)
  are written to their owners' caches first and read from there.

Each real row of the padded gathered view is one of (``RowKind``):

- ``REPLICATED``: every rank holds it alike: no query moves; each rank attends it over its
  own keys, and the partial results go to every rank (they all hold the row);
- ``STAYS`` (pass-KV's rows): a split prefill's row under ``pass_kv``: its query stays, the
  *blocks* of its request's keys travel: rank j's block is, per request, its cached shard
  then its new rows; every block visits every rank, whose rows attend it;
- ``TRAVELS`` (pass-Q's rows): every other row (under ``pass_q`` every split prefill's,
  sharded decodes always): its query travels the ring and is attended on each rank over
  that rank's keys; one all-to-all after the loop returns the partial results to the row.

What one hop carries (rank r at iteration h sends the package of origin ``o = (r - h) % P``
to r+1, for h < P-1): ``ring_send_kv`` the origin's block (pass-KV) followed by the new KV
entries of its travelling rows that ranks further on own (each is dropped once it reached
its owner: sorted by hops to go, the payload shrinks from the end), ``ring_send_q`` the
origin's travelling queries. No query is padded: a receiver sizes its buffers from this
plan, identical on every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pcpflow.layouts.layout import BatchLayout
from pcpflow.layouts.slots import (
    Window,
    as_window,
    compute_slot_mapping,
    dcp_global_positions,
    dcp_local_seq_lens,
    dcp_shard_lens,
)

CP_ATTENTION = ("allgather", "ring_pass_kv", "ring_pass_q", "ring_auto")
"""``pipeline.forward.cp_attention``: today's all-gather paths, or a ring (``ring_auto``:
Meta's rule per step, ``pcpflow.layouts.accounting.choose_ring_variant``)."""

RING_VARIANTS = ("pass_kv", "pass_q")

PAD, REPLICATED, STAYS, TRAVELS = 0, 1, 2, 3
"""``RingPlan.kind`` of each gathered row (module docstring)."""


def request_num_computed(layout: BatchLayout, positions) -> np.ndarray:
    """int64 [R]: tokens of each request already in the KV cache (the position of its first
    scheduled token; 0 for a request without tokens this step)."""
    q = np.diff(layout.query_start_loc)
    pos = np.asarray(positions, dtype=np.int64)
    if not pos.shape[0]:
        return np.zeros(q.shape[0], dtype=np.int64)
    first = np.minimum(layout.query_start_loc[:-1], pos.shape[0] - 1)
    return np.where(q > 0, pos[first], 0)


@dataclass(frozen=True, eq=False)
class RingPlan:
    """One step's ring (module docstring), the same on every rank. Per gathered row of the
    padded view (``[P*N]``, rank-major); per request (``[R]``); per rank (``[P]``)."""

    variant: str  # "pass_kv" | "pass_q"
    pcp_size: int
    padded_num_tokens: int
    interleave: int
    kind: np.ndarray  # int8 [P*N]: PAD | REPLICATED | STAYS | TRAVELS
    req: np.ndarray  # int64 [P*N]: batch request of the row (0 on padding)
    pos: np.ndarray  # int64 [P*N]: its position (0 on padding)
    owner: np.ndarray  # int64 [P*N]: DCP rank that stores its KV
    num_computed: np.ndarray  # int64 [R]
    kv_ring: np.ndarray  # bool [R]: the request's keys travel in blocks (pass-KV)
    cache_limit: np.ndarray  # int64 [R]: keys below it are read from the paged caches
    block_cached: np.ndarray  # int64 [P, R]: cached entries of each request in each block
    block_new: np.ndarray  # int64 [P, R]: new rows of each request in each block
    num_travel: np.ndarray  # int64 [P]: travelling rows (queries) of each rank
    delivery_len: np.ndarray  # int64 [P, P+1]: [o, h]: new KV entries of o's travelling
    #   rows that still have >= h hops to go (h >= 1; column 0 = column 1)
    num_replicated: int  # rows every rank holds (the same count on every rank)

    @property
    def block_len(self) -> np.ndarray:
        """int64 [P]: entries in each rank's block (0 under pass-Q)."""
        return (self.block_cached + self.block_new).sum(axis=1)

    def kv_rows_sent(self, origin: np.ndarray | int, h: np.ndarray | int) -> np.ndarray:
        """KV entries of ``origin``'s package sent at iteration ``h`` (to the rank ``h + 1``
        hops past the origin): its block and its deliveries with more than ``h`` hops to go."""
        return self.block_len[origin] + self.delivery_len[origin, np.asarray(h) + 1]

    @property
    def has_all2all(self) -> bool:
        """Whether some row's partial results must travel back after the loop."""
        return bool(self.num_travel.sum() + self.num_replicated)

    def rows(self, rank: int, kind: int) -> np.ndarray:
        """Local rows of ``rank`` of ``kind``, in local order."""
        n = self.padded_num_tokens
        return np.flatnonzero(self.kind[rank * n : (rank + 1) * n] == kind)

    def block_segments(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, length) [R] of each request's segment in ``rank``'s block: its cached
        shard, then its new rows, requests in batch order."""
        length = self.block_cached[rank] + self.block_new[rank]
        return np.cumsum(length) - length, length

    def block_positions(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(request, position) of every entry of ``rank``'s block, in block order."""
        cached = self.block_cached[rank]
        req_c = np.repeat(np.arange(cached.shape[0], dtype=np.int64), cached)
        lp = np.arange(req_c.shape[0], dtype=np.int64) - np.repeat(np.cumsum(cached) - cached, cached)
        pos_c = dcp_global_positions(lp, self.pcp_size, rank, self.interleave)
        stays = self.rows(rank, STAYS) + rank * self.padded_num_tokens
        req = np.concatenate([req_c, self.req[stays]])
        pos = np.concatenate([pos_c, self.pos[stays]])
        order = np.lexsort((pos, req))  # requests in batch order, cached before new
        return req[order], pos[order]

    def delivery_order(self, rank: int) -> tuple[np.ndarray, np.ndarray]:
        """(local rows, hops to go) of ``rank``'s travelling rows whose KV another rank owns,
        in the order they travel: most hops to go first, so each hop drops its tail."""
        rows = self.rows(rank, TRAVELS)
        hops = (self.owner[rows + rank * self.padded_num_tokens] - rank) % self.pcp_size
        keep = hops > 0
        rows, hops = rows[keep], hops[keep]
        order = np.argsort(-hops, kind="stable")
        return rows[order], hops[order]


def plan_ring(layout: BatchLayout, positions, *, variant: str, interleave: int) -> RingPlan:
    """The ring of one step under ``variant`` (``RING_VARIANTS``): ``positions`` (int [T])
    of the global batch, ``interleave`` the DCP interleave; the ring is the layout's PCP
    group, over which the KV is sharded (dcp = pcp)."""
    if variant not in RING_VARIANTS:
        raise ValueError(f"unknown ring variant {variant!r}; known: {', '.join(RING_VARIANTS)}")
    p, n = layout.pcp_size, layout.padded_num_tokens
    pos_t = np.asarray(positions, dtype=np.int64)
    q = np.diff(layout.query_start_loc)
    num_reqs = q.shape[0]
    tok_req = np.repeat(np.arange(num_reqs, dtype=np.int64), q)
    pad = layout.is_padding
    gidx = layout.padded_gather_idx
    req = np.where(pad, 0, tok_req[gidx]) if tok_req.shape[0] else np.zeros(p * n, dtype=np.int64)
    pos = np.where(pad, 0, pos_t[gidx]) if pos_t.shape[0] else np.zeros(p * n, dtype=np.int64)
    shared = layout.replicated & ~layout.shard_decodes  # every rank holds the rows alike
    kv_ring = (variant == "pass_kv") & ~layout.replicated & (q > 0)
    kind = np.where(shared[req], REPLICATED, np.where(kv_ring[req], STAYS, TRAVELS)).astype(np.int8)
    kind[pad] = PAD
    computed = request_num_computed(layout, pos_t)
    rank_of_row = np.arange(p * n, dtype=np.int64) // max(n, 1)
    owner = (pos // interleave) % p

    block_cached = dcp_shard_lens(computed, p, interleave) * kv_ring
    block_new = np.zeros((p, num_reqs), dtype=np.int64)
    stays = kind == STAYS
    np.add.at(block_new, (rank_of_row[stays], req[stays]), 1)
    travels = kind == TRAVELS
    num_travel = np.bincount(rank_of_row[travels], minlength=p).astype(np.int64)
    hops = (owner - rank_of_row) % p
    # delivery_len[o, h] = travelling rows of o with >= max(h, 1) hops to go
    counts = np.zeros((p, p + 1), dtype=np.int64)
    np.add.at(counts, (rank_of_row[travels], hops[travels]), 1)
    at_least = counts[:, ::-1].cumsum(axis=1)[:, ::-1]  # [o, h]: rows with >= h hops
    delivery_len = at_least.copy()
    delivery_len[:, 0] = at_least[:, 1]
    num_rep = np.bincount(rank_of_row[kind == REPLICATED], minlength=p)
    assert (num_rep == num_rep[0]).all(), f"replicated rows differ by rank: {num_rep.tolist()}"
    return RingPlan(
        variant=variant,
        pcp_size=p,
        padded_num_tokens=n,
        interleave=interleave,
        kind=kind,
        req=req,
        pos=pos,
        owner=owner,
        num_computed=computed,
        kv_ring=kv_ring,
        cache_limit=np.where(shared, computed + q, computed),
        block_cached=block_cached,
        block_new=block_new,
        num_travel=num_travel,
        delivery_len=delivery_len,
        num_replicated=int(num_rep[0]) if p else 0,
    )


def _count_at_or_below(keys: np.ndarray, req: np.ndarray, pos: np.ndarray, scale: int) -> np.ndarray:
    """For each (req, pos): how many of ``keys`` (``request * scale + position``) belong to
    that request with a position <= pos."""
    keys = np.sort(keys)
    return np.searchsorted(keys, req * scale + pos, side="right") - np.searchsorted(keys, req * scale, side="left")


def _rank_in_request(req: np.ndarray, num_reqs: int) -> tuple[np.ndarray, np.ndarray]:
    """For rows whose requests each form one contiguous run: (index of each row inside its
    request's run, [R] first row of each request's run; 0 where it has none)."""
    first = np.zeros(num_reqs, dtype=np.int64)
    uniq, at = np.unique(req, return_index=True)
    first[uniq] = at
    return np.arange(req.shape[0], dtype=np.int64) - first[req], first


def _segment_tables(start: np.ndarray, length: np.ndarray) -> np.ndarray:
    """int64 [R, W]: block tables of block size 1 over segments ``[start, start + length)``
    of a flat buffer (entries past a segment repeat its last one; never read)."""
    width = max(int(length.max()) if length.shape[0] else 0, 1)
    i = np.arange(width, dtype=np.int64)
    return start[:, None] + np.minimum(i[None, :], np.maximum(length - 1, 0)[:, None])


@dataclass(frozen=True, eq=False)
class Hop:
    """What rank r does with the package of ``origin`` (iteration ``(r - origin) % P``)."""

    origin: int
    recv_kv: int  # KV entries of the package received before this iteration (iteration > 0)
    recv_q: int  # travelling queries in it
    send_kv: int  # KV entries sent on after this iteration (0 at the last)
    send_q: int  # queries sent on after this iteration (0 at the last)
    block_tables: np.ndarray  # [R, W]: the origin's block (block size 1)
    stay_lens: np.ndarray  # [n_stay]: entries of that block each of this rank's staying rows reads
    write_at: np.ndarray  # rows of the package whose KV this rank owns and writes here
    write_slots: np.ndarray  # their slots in this rank's cache
    visit_req: np.ndarray  # [recv_q]: request of each visiting query
    visit_pos: np.ndarray  # [recv_q]: its position
    visit_cache_lens: np.ndarray  # [recv_q]: entries of this rank's shard it reads (paged)
    visit_local_lens: np.ndarray  # [recv_q]: entries of this rank's travelling rows' KV it reads
    # A window (``rank_ring``'s ``window``, sliding or chunked): the first entry each of those
    # reads reads on a windowed layer (the entries before it hold positions before the window).
    stay_starts: np.ndarray | None = None
    visit_cache_starts: np.ndarray | None = None
    visit_local_starts: np.ndarray | None = None


@dataclass(frozen=True, eq=False)
class RankRing:
    """One rank's part of a ``RingPlan``: local row indices, slots and per-hop reads."""

    rank: int
    variant: str
    replicated_rows: np.ndarray  # local rows every rank holds
    replicated_req: np.ndarray
    replicated_cache_lens: np.ndarray  # entries of this rank's shard each reads
    stay_rows: np.ndarray  # local rows whose query stays (pass-KV)
    stay_req: np.ndarray
    travel_rows: np.ndarray  # local rows whose query travels (pass-Q), in send order
    travel_req: np.ndarray
    local_tables: np.ndarray  # [R, W]: block tables (size 1) over the travelling rows' KV
    write_rows: np.ndarray  # local rows whose KV this rank owns: written before the loop
    write_slots: np.ndarray
    block_len: int
    block_cached_at: np.ndarray  # rows of this rank's block filled from its cache...
    block_cached_slots: np.ndarray  # ... from these slots
    block_new_at: np.ndarray  # rows of its block filled from its staying rows' KV...
    block_new_rows: np.ndarray  # ... these local rows
    delivery_rows: np.ndarray  # local rows whose KV follows the block (hops to go, descending)
    hops: tuple[Hop, ...]  # iteration h: the package of origin (rank - h) % P
    all2all_send: np.ndarray  # [P]: partial rows sent to each rank (itself included)
    all2all_recv: np.ndarray  # [P]: partial rows received from each rank
    has_all2all: bool
    window: Window | None = None  # the window the reads' starts below are for (None: none)
    replicated_cache_starts: np.ndarray | None = None  # a window's first entry of the shard each reads


def rank_ring(plan: RingPlan, rank: int, block_tables, block_size: int, window: Window | int | None = None) -> RankRing:
    """Rank ``rank``'s view of ``plan``; ``block_tables`` (int [R, max_blocks]) are the global
    batch's, ``block_size`` the cache's. ``window``: the model's window (``AttentionSpec.windowed``;
    an int: a sliding one); each read then also says where a windowed layer's starts (its
    entries are in position order per request, so the entries before the window are a prefix:
    counted as the reads are)."""
    window = as_window(window)
    p, n, i_ = plan.pcp_size, plan.padded_num_tokens, plan.interleave
    tables = np.asarray(block_tables, dtype=np.int64)
    base = rank * n
    scale = int(plan.pos.max(initial=0)) + 2

    def my_slots(req: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return compute_slot_mapping(pos, req, tables, block_size, dcp_size=p, dcp_rank=rank, interleave=i_)

    rep = plan.rows(rank, REPLICATED)
    stay = plan.rows(rank, STAYS)
    travel = plan.rows(rank, TRAVELS)
    real = np.flatnonzero(plan.kind[base : base + n] != PAD)
    mine = real[plan.owner[real + base] == rank]
    rep_req, rep_pos = plan.req[rep + base], plan.pos[rep + base]
    stay_req, stay_pos = plan.req[stay + base], plan.pos[stay + base]
    travel_req, travel_pos = plan.req[travel + base], plan.pos[travel + base]

    # This rank's block: per request, its cached shard (local positions 0..c-1), then its new rows.
    start, _ = plan.block_segments(rank)
    cached = plan.block_cached[rank]
    c_req = np.repeat(np.arange(cached.shape[0], dtype=np.int64), cached)
    lp = np.arange(c_req.shape[0], dtype=np.int64) - np.repeat(np.cumsum(cached) - cached, cached)
    block_cached_at = start[c_req] + lp
    block_cached_slots = tables[c_req, lp // block_size] * block_size + lp % block_size if c_req.shape[0] else c_req
    num_reqs = cached.shape[0]
    block_new_at = start[stay_req] + cached[stay_req] + _rank_in_request(stay_req, num_reqs)[0]
    delivery_rows, _ = plan.delivery_order(rank)

    # Travelling rows' KV stays here for this step: visitors read it as a block of their own.
    t_first = _rank_in_request(travel_req, num_reqs)[1]
    t_len = np.bincount(travel_req, minlength=num_reqs).astype(np.int64)
    local_tables = _segment_tables(t_first, t_len)
    travel_keys = travel_req * scale + travel_pos
    slides = window is not None

    def before(keys: np.ndarray, req: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
        """Entries of ``keys`` of each row's request before its window (positions < its start)."""
        return _count_at_or_below(keys, req, window.starts(pos) - 1, scale) if slides else None

    def shard_before(req: np.ndarray, pos: np.ndarray) -> np.ndarray | None:
        """Entries of this rank's cached shard of each row's request before its window."""
        if not slides:
            return None
        return dcp_local_seq_lens(np.minimum(window.starts(pos), plan.cache_limit[req]), p, rank, i_)

    hops = []
    for h in range(p):
        o = (rank - h) % p
        ob = o * n
        o_start, o_len = plan.block_segments(o)
        b_req, b_pos = plan.block_positions(o)
        stay_lens = _count_at_or_below(b_req * scale + b_pos, stay_req, stay_pos, scale)
        if h:
            # the origin's new block entries this rank owns, then its deliveries ending here
            o_stay = plan.rows(o, STAYS) + ob
            own = plan.owner[o_stay] == rank
            o_req = plan.req[o_stay]
            at_new = o_start[o_req] + plan.block_cached[o, o_req] + _rank_in_request(o_req, num_reqs)[0]
            d_rows, d_hops = plan.delivery_order(o)
            received = int(plan.kv_rows_sent(o, h - 1))
            ends = d_hops == h  # the tail of what arrived
            at_del = received - np.count_nonzero(ends) + np.arange(np.count_nonzero(ends), dtype=np.int64)
            write_at = np.concatenate([at_new[own], at_del])
            w_rows = np.concatenate([o_stay[own], d_rows[ends] + ob])
            write_slots = my_slots(plan.req[w_rows], plan.pos[w_rows])
        else:
            write_at = write_slots = np.zeros(0, dtype=np.int64)
        v = plan.rows(o, TRAVELS) + ob
        v_req, v_pos = plan.req[v], plan.pos[v]
        visit_cache = dcp_local_seq_lens(np.minimum(v_pos + 1, plan.cache_limit[v_req]), p, rank, i_)
        last = h == p - 1
        hops.append(
            Hop(
                origin=o,
                recv_kv=int(plan.kv_rows_sent(o, h - 1)) if h else 0,
                recv_q=int(plan.num_travel[o]) if h else 0,
                send_kv=0 if last else int(plan.kv_rows_sent(o, h)),
                send_q=0 if last else int(plan.num_travel[o]),
                block_tables=_segment_tables(o_start, o_len),
                stay_lens=stay_lens,
                write_at=write_at,
                write_slots=write_slots,
                visit_req=v_req,
                visit_pos=v_pos,
                visit_cache_lens=visit_cache,
                visit_local_lens=_count_at_or_below(travel_keys, v_req, v_pos, scale),
                stay_starts=before(b_req * scale + b_pos, stay_req, stay_pos),
                visit_cache_starts=shard_before(v_req, v_pos),
                visit_local_starts=before(travel_keys, v_req, v_pos),
            )
        )
    send = plan.num_travel + plan.num_replicated
    recv = np.full(p, plan.num_travel[rank] + plan.num_replicated, dtype=np.int64)
    return RankRing(
        rank=rank,
        variant=plan.variant,
        replicated_rows=rep,
        replicated_req=rep_req,
        replicated_cache_lens=dcp_local_seq_lens(np.minimum(rep_pos + 1, plan.cache_limit[rep_req]), p, rank, i_),
        stay_rows=stay,
        stay_req=stay_req,
        travel_rows=travel,
        travel_req=travel_req,
        local_tables=local_tables,
        write_rows=mine,
        write_slots=my_slots(plan.req[mine + base], plan.pos[mine + base]),
        block_len=int(plan.block_len[rank]),
        block_cached_at=block_cached_at,
        block_cached_slots=block_cached_slots,
        block_new_at=block_new_at,
        block_new_rows=stay,
        delivery_rows=delivery_rows,
        hops=tuple(hops),
        all2all_send=send.astype(np.int64),
        all2all_recv=recv,
        has_all2all=plan.has_all2all,
        window=window,
        replicated_cache_starts=shard_before(rep_req, rep_pos),
    )
