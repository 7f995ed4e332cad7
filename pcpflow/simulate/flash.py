"""Prefill attention by shape: FlashAttention-3's published forward throughput, applied to the
query runs and key sets each kernel call actually holds.

**The source.** FlashAttention-3 (Shah et al., arXiv 2407.08608), Figure 5 (c) and (d):
forward, BF16, head dim 128, on an H100 80GB SXM5 with its clock fixed at 1830 MHz, where its
dense BF16 peak is 989 TF/s (the paper's Appendix C.1); batch x sequence length = 16K tokens,
16 heads of 128; FLOPs counted as ``4 x seqlen^2 x head dim x heads``, halved with the causal
mask. The figure is also the repository's ``assets/flash3_fp16_fwd.png``. TF/s:

==========  ===  ===  ===  ===  ===  ===
seqlen      512  1k   2k   4k   8k   16k
==========  ===  ===  ===  ===  ===  ===
non-causal  467  565  625  638  646  648
causal      292  423  521  579  602  616
==========  ===  ===  ===  ===  ===  ===

A point is a share of that peak (``figure / 989``) and prices a kernel on any profile at
``share x peak[activation dtype]``. Between published lengths the share is interpolated
linearly in log2(length); past 16K it stays at the 16K figure (the plateau); below 512 (not
published) a query tile is taken to cost what it costs at 512 keys, so the share falls as
``keys / 512``. With 16K tokens a batch the figure's kernels hold thousands of query tiles, so
its drop at short lengths is each tile's key loop being short, not idle SMs: the length that
looks it up is the key loop's.

**The shapes.** A *block* is one query run (consecutive rows of one request on one rank, in
one kernel call) over the keys that call gives it. Per block: ``n`` rows, ``k_first`` keys the
first row sees, ``k_last`` keys the last row sees, ``pairs`` scored. Its ``n x k_first`` pairs
every row sees run at the non-causal share of ``k_last`` (the loop's length); the rest, the
causal part, at the causal share of ``k_last - k_first`` (the masked span). A square causal
block ``s x s`` is the figure's causal point at ``s``, a square full one its non-causal point.
Rows run in whole query tiles of 128 (``kBlockM`` at head dim 128, ``hopper/tile_size.h``). A
call over several runs is a varlen call, and FlashAttention-3 then packs the query heads that
share a KV head into the tile's rows (PackGQA: ``hopper/heuristics.h``, ``should_pack_gqa``
returns true for varlen queries): a run of ``n`` rows with ``g`` query heads per KV head costs
``ceil(n g / 128) x 128 / (n g)`` times its pairs (``g = 1`` for multi-head attention, MLA's
expanded prefill among them).

``engine_blocks`` gives the engine's calls (pcpflow's all-gather paths: one call per rank over
its rows, the whole context or its DCP shard); ``ring_blocks`` a ring's (``RingPlan``): per
rank and iteration, the staying rows over the block of that iteration's origin (pass-KV) and
the visiting rows over this rank's keys (pass-Q), and after the loop the rows every rank holds.
Their pairs are the executed counts' (``tests/simulate/test_simulate_flash.py`` checks them
against ``ring_attention_work`` and ``attention_work``); a step's FLOPs are priced from those
counts, the blocks giving each call's rate.

**A sliding layer** (``window``): a row at ``p`` sees the keys ``max(0, p + 1 - window) .. p``.
Each query run is cut where its window starts to slide (``window_runs``): the rows before see
every key before them (the blocks above), the *band* after them the last ``window`` keys each, a
block without a causal part at the band's mean keys (``_band``): FlashAttention-3's local
attention loops each query tile over the key blocks of its window only.

**A chunked layer** (``Window(C, "chunked")``, Llama 4's): a row at ``p`` sees the keys ``p - p %
C .. p``. Each query run is cut where a chunk begins (``chunk_runs``); a piece is a causal block
over the keys of its chunk up to each row, as a prefill starting at the chunk's first position
would be: FlashAttention-3's local attention skips the key blocks before each query block's
chunk start. In a ring a piece meets only its own chunk's keys (cached and new).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from pcpflow.layouts.layout import BatchLayout, TokenPositions, as_positions
from pcpflow.layouts.ring import REPLICATED, STAYS, TRAVELS, RingPlan
from pcpflow.layouts.slots import Window, as_window, chunk_runs, dcp_shard_len_sums, dcp_shard_lens

SOURCE = "FlashAttention-3, arXiv 2407.08608, Figure 5 (c), (d): BF16, head dim 128, H100 SXM5 at 989 TF/s"
SEQLENS = np.array([512, 1024, 2048, 4096, 8192, 16384], dtype=np.float64)
NON_CAUSAL_TFLOPS = np.array([467, 565, 625, 638, 646, 648], dtype=np.float64)
CAUSAL_TFLOPS = np.array([292, 423, 521, 579, 602, 616], dtype=np.float64)
MEASURED_PEAK_TFLOPS = 989.0  # arXiv 2407.08608 App. C.1: 1830 MHz, "989 TFLOPS FP16 theoretical max"
QUERY_TILE = 128  # FlashAttention-3's kBlockM at head dim 128
_LOG2_SEQLENS = np.log2(SEQLENS)


def share(keys, *, causal: bool) -> np.ndarray:
    """Share of the dense peak FlashAttention-3 reaches when each query tile loops over
    ``keys`` keys (module docstring)."""
    k = np.asarray(keys, dtype=np.float64)
    table = CAUSAL_TFLOPS if causal else NON_CAUSAL_TFLOPS
    # NOTE: minimum/maximum, not np.clip: the same, at a fraction of its overhead on short arrays
    x = np.log2(np.minimum(np.maximum(k, SEQLENS[0]), SEQLENS[-1]))
    s = np.interp(x, _LOG2_SEQLENS, table) / MEASURED_PEAK_TFLOPS
    return np.where(k < SEQLENS[0], s * np.maximum(k, 0.0) / SEQLENS[0], s)


@dataclass(frozen=True)
class Blocks:
    """Query runs over key sets, one entry each: their bin (a rank, or rank x iteration),
    rows, keys the first and the last row see, and pairs scored."""

    bin: np.ndarray
    rows: np.ndarray
    k_first: np.ndarray
    k_last: np.ndarray
    pairs: np.ndarray

    def peak_pairs(self, group: int = 1) -> np.ndarray:
        """Each block's pairs as priced at the peak: its time is this x FLOPs a pair / peak.
        ``group``: query heads per KV head, packed into the query tiles (PackGQA)."""
        n = self.rows.astype(np.float64) * group
        kf, kl, pairs = (a.astype(np.float64) for a in (self.k_first, self.k_last, self.pairs))
        full = np.minimum(self.rows * kf, pairs)
        masked = pairs - full
        nc, c = share(kl, causal=False), share(kl - kf, causal=True)
        t = np.where(full > 0, full / np.where(nc > 0, nc, 1.0), 0.0)
        t = t + np.where(masked > 0, masked / np.where(c > 0, c, 1.0), 0.0)
        tiles = np.where(n > 0, -(-n // QUERY_TILE) * QUERY_TILE / np.maximum(n, 1.0), 0.0)
        return t * tiles

    def per_bin(self, size: int, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """(pairs, pairs at the peak) summed per bin, float64 ``[size]``."""
        return (np.bincount(self.bin, weights=self.pairs.astype(np.float64), minlength=size),
                np.bincount(self.bin, weights=self.peak_pairs(group), minlength=size))


def _segments(layout: BatchLayout, positions) -> tuple[np.ndarray, ...]:
    """Every rank's query runs (its segments, adjacent ones of a request joined): rank,
    request, first position, rows, first local row."""
    segs = layout.segments
    lens = [len(s) for s in segs]
    rank = np.repeat(np.arange(layout.pcp_size, dtype=np.int64), lens)
    cat = lambda f: np.concatenate([getattr(s, f) for s in segs]) if sum(lens) else np.zeros(0, np.int64)  # noqa: E731
    start, n, req, local = cat("global_start"), cat("length"), cat("req_idx"), cat("local_start")
    pos = as_positions(positions)
    if isinstance(pos, TokenPositions):  # NOTE: a segment is one request's: no search for it
        a = pos.of_requests(start, req)
    else:
        a = pos[np.minimum(start, max(pos.shape[0] - 1, 0))] if pos.shape[0] else start
    if rank.shape[0] > 1:
        # NOTE: adjacent segments of one request (rank P-1's chunks P-1 and P) are one run.
        new = np.ones(rank.shape[0], dtype=bool)
        new[1:] = (rank[1:] != rank[:-1]) | (req[1:] != req[:-1]) | (a[1:] != a[:-1] + n[:-1])
        first = np.flatnonzero(new)
        n = np.add.reduceat(n, first)
        rank, req, a, local = rank[first], req[first], a[first], local[first]
    return rank, req, a, n, local


def engine_blocks(layout: BatchLayout, positions, is_prefilling, *, dcp_size: int, interleave: int,
                  dcp_rest: str, window: Window | int | None = None) -> Blocks | None:
    """The prefill rows' calls of pcpflow's all-gather paths, binned by DCP shard: without
    DCP (or on the context path) each rank's rows over their whole context ``[0, p]``; on
    the queries path every gathered prefill row over each shard. None without prefill rows.
    ``window``: one sliding layer's calls (``window_runs``; an int: a sliding window), or one
    chunked layer's (each run cut into its chunks' pieces, ``chunk_runs``)."""
    rank, req, a, n, _ = _segments(layout, positions)
    keep = np.asarray(is_prefilling, dtype=bool)[req] & (n > 0)
    if not keep.any():
        return None
    rank, a, n = rank[keep], a[keep], n[keep]
    whole = dcp_size == 1 or dcp_rest == "context"
    w = as_window(window)
    if w is None:
        return _context_blocks(rank, a, n) if whole else _shard_blocks(a, n, dcp_size, interleave)
    if w.chunked:
        run, ca, cn, start = chunk_runs(a, n, w.size)
        if whole:  # NOTE: a piece's rows see keys start .. q: a causal block at positions shifted by start
            return _context_blocks(rank[run], ca - start, cn)
        return _shard_blocks(ca, cn, dcp_size, interleave, start)
    window = w.size
    ramp, b, nb = window_runs(a, n, window)
    if whole:
        band = Blocks(rank, nb, np.full_like(nb, window), np.full_like(nb, window), nb * window)
        return _rows_only(_concat([_context_blocks(rank, a, ramp), band]))
    # the band's rows over each shard d: [D, runs], shard-major; row q sees the shard's [q + 1 - W, q]
    pairs = (dcp_shard_len_sums(b + nb, dcp_size, interleave) - dcp_shard_len_sums(b, dcp_size, interleave)
             - dcp_shard_len_sums(np.maximum(b + nb - window, 0), dcp_size, interleave)
             + dcp_shard_len_sums(np.maximum(b - window, 0), dcp_size, interleave))
    shard = np.repeat(np.arange(dcp_size, dtype=np.int64), b.shape[0])
    return _rows_only(_concat([_shard_blocks(a, ramp, dcp_size, interleave),
                               _band(shard, np.tile(nb, dcp_size), pairs.ravel())]))


def _context_blocks(rank, a, n) -> Blocks:
    """Runs of ``n`` rows at ``a ..`` on ``rank`` over their whole context ``[0, p]``."""
    return Blocks(rank, n, a + 1, a + n, n * a + n * (n + 1) // 2)


def _shard_blocks(a, n, dcp_size: int, interleave: int, start=None) -> Blocks:
    """Runs of ``n`` rows at ``a ..`` over each DCP shard of their context, shard-major;
    ``start``: of the positions from ``start`` on only (a chunk's pieces: ``chunk_runs``)."""
    kf, kl = dcp_shard_lens(a + 1, dcp_size, interleave), dcp_shard_lens(a + n, dcp_size, interleave)
    pairs = dcp_shard_len_sums(a + n, dcp_size, interleave) - dcp_shard_len_sums(a, dcp_size, interleave)
    if start is not None:  # NOTE: each row leaves out the shard's L(start) entries before it
        before = dcp_shard_lens(start, dcp_size, interleave)
        kf, kl, pairs = kf - before, kl - before, pairs - n * before
    shard = np.repeat(np.arange(dcp_size, dtype=np.int64), a.shape[0])
    return Blocks(shard, np.tile(n, dcp_size), kf.ravel(), kl.ravel(), pairs.ravel())


def window_runs(a, n, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A sliding layer's query runs of ``n`` rows at ``a ..``, each cut where its window
    starts to slide: (``ramp``, ``b``, ``nb``): its first ``ramp`` rows (positions below
    ``window``) see every key at or before them, as without a window (the blocks' shapes
    above); the ``nb`` rows at ``b ..`` after them each see the ``window`` keys up to
    themselves (over a shard: that range's entries, about ``window / D``), every row as many,
    a band the kernel loops over in full (``_band``)."""
    ramp = np.minimum(np.maximum(window - a, 0), n)
    return ramp, a + ramp, n - ramp


def _band(bin_, nb, pairs) -> Blocks:
    """Band blocks (``window_runs``) of ``nb`` rows scoring ``pairs``: each row over the
    band's mean keys (rounded up), a block without a causal part."""
    keys = np.where(nb > 0, -(-pairs // np.maximum(nb, 1)), 0)
    return Blocks(bin_, nb, keys, keys, pairs)


@dataclass(frozen=True)
class RingBlocks:
    """A ring's attention: in the loop per rank and iteration (bin ``rank * P + h``), after
    it per rank (the rows every rank holds); prefill rows as ``Blocks``, decode rows as pairs
    (split-KV: priced by the keys they read)."""

    loop: Blocks
    loop_decode_pairs: np.ndarray  # [P, P]
    after: Blocks
    after_decode_pairs: np.ndarray  # [P]


def ring_blocks(plan: RingPlan, layout: BatchLayout, positions, is_prefilling,
                window: Window | int | None = None) -> RingBlocks:
    """The calls a ring's step makes (module docstring), from its plan and the layout.
    ``window``: one sliding layer's calls (``window_runs``: each run's rows before its window
    slides as without one, the band after them over the keys of each row's window; an int: a
    sliding window), or one chunked layer's (``_chunked_ring_blocks``)."""
    p, inter = plan.pcp_size, plan.interleave
    rank, req, a, n, local = _segments(layout, positions)
    real = n > 0
    rank, req, a, n, local = rank[real], req[real], a[real], n[real], local[real]
    kind = plan.kind[rank * plan.padded_num_tokens + local] if rank.shape[0] else np.zeros(0, np.int8)
    prefill = np.asarray(is_prefilling, dtype=bool)[req]
    w = as_window(window)
    if w is not None and w.chunked:
        return _chunked_ring_blocks(plan, rank, req, a, n, kind, prefill, w.size)
    window = None if w is None else w.size
    h = np.arange(p, dtype=np.int64)
    qn = n
    if window is not None:
        qn, b, nb = window_runs(a, n, window)
    parts = []  # (blocks, their runs)

    # pass-KV: staying run i meets, at iteration h, the block of origin (rank_i - h) % P: its
    # cached shard of the request (every entry before the run) and its new runs.
    st = np.flatnonzero(kind == STAYS)
    origin = (rank[st, None] - h[None, :]) % p
    at_st = np.broadcast_to(rank[st, None], origin.shape)
    cached = plan.block_cached[origin, req[st, None]]
    kv_iteration = lambda qi, kj: (rank[qi] - rank[kj]) % p  # noqa: E731
    kv = _runs_over(st, rank, req, a, n, iteration=kv_iteration, qn=qn)
    parts.append((_blocks(st, at_st, h, qn, cached, kv, p), st))

    # pass-Q: travelling run i visits rank (rank_i + h) % P at iteration h: that rank's cached
    # shard of the request (every entry before the run) and its own travelling runs' new KV.
    tr = np.flatnonzero(kind == TRAVELS)
    host = (rank[tr, None] + h[None, :]) % p
    cached = np.take_along_axis(dcp_shard_lens(plan.num_computed[req[tr]], p, inter).T, host, axis=1)
    q_iteration = lambda qi, kj: (rank[kj] - rank[qi]) % p  # noqa: E731
    q = _runs_over(tr, rank, req, a, n, iteration=q_iteration, qn=qn)
    parts.append((_blocks(tr, host, h, qn, cached, q, p), tr))

    if window is not None:  # the bands: cached keys and new runs within each row's window
        # (runs, the rank whose cache they read, the rank they run on, iteration)
        for rows, cache, on, iteration in ((st, origin, at_st, kv_iteration), (tr, host, host, q_iteration)):
            cached = _cached_in_window(plan.num_computed[req[rows]], cache, b[rows], nb[rows], window, p, inter)
            runs = _runs_over(rows, rank, req, a, n, iteration=iteration, qa=b, qn=nb, window=window)
            parts.append((_band_blocks(rows, on, h, nb, cached, runs, p), rows))

    pre_parts, dec = _split_prefill(parts, prefill, p)

    # Rows every rank holds: after the loop, each rank over its shard of [0, p] (rank 0's copies).
    rp = np.flatnonzero((kind == REPLICATED) & (rank == 0))
    ar, nr, pre = a[rp], qn[rp], prefill[rp]
    # every rank r at once: [P, rows]
    kf, kl = dcp_shard_lens(ar + 1, p, inter), dcp_shard_lens(ar + nr, p, inter)
    pairs = dcp_shard_len_sums(ar + nr, p, inter) - dcp_shard_len_sums(ar, p, inter)
    after = Blocks(np.repeat(h, int(pre.sum())), np.tile(nr[pre], p), kf[:, pre].ravel(), kl[:, pre].ravel(),
                   pairs[:, pre].ravel())
    after_dec = pairs[:, ~pre].sum(axis=1).astype(np.float64)
    if window is not None:  # the bands over each rank's shard of their windows
        br, nbr = b[rp], nb[rp]
        band = (dcp_shard_len_sums(br + nbr, p, inter) - dcp_shard_len_sums(br, p, inter)
                - dcp_shard_len_sums(np.maximum(br + nbr - window, 0), p, inter)
                + dcp_shard_len_sums(np.maximum(br - window, 0), p, inter))
        after = _concat([after, _band(np.repeat(h, int(pre.sum())), np.tile(nbr[pre], p), band[:, pre].ravel())])
        after_dec = after_dec + band[:, ~pre].sum(axis=1)
        return RingBlocks(_rows_only(_concat(pre_parts)), dec.reshape(p, p), _rows_only(after), after_dec)
    return RingBlocks(_concat(pre_parts), dec.reshape(p, p), after, after_dec)


def _split_prefill(parts, prefill, p: int) -> tuple[list[Blocks], np.ndarray]:
    """The loop's ``(blocks, rows)`` parts split by their rows' kind: the prefill rows' blocks, and
    the decode rows' pairs summed per (rank, iteration) bin, ``[p * p]``."""
    pre_parts, dec = [], np.zeros(p * p)
    for blocks, rows in parts:
        if blocks is None:
            continue
        is_pre = np.repeat(prefill[rows], p)
        pre_parts.append(Blocks(blocks.bin[is_pre], blocks.rows[is_pre], blocks.k_first[is_pre],
                                blocks.k_last[is_pre], blocks.pairs[is_pre]))
        dec += np.bincount(blocks.bin[~is_pre], weights=blocks.pairs[~is_pre].astype(np.float64), minlength=p * p)
    return pre_parts, dec


def _chunked_ring_blocks(plan: RingPlan, rank, req, a, n, kind, prefill, size: int) -> RingBlocks:
    """``ring_blocks`` of a chunked layer: every run (query and key runs alike) cut where chunks
    of ``size`` begin (``chunk_runs``); a query piece meets the key pieces of its own chunk only
    (matched by request and chunk) and the cached entries from its chunk's start on, so each
    piece is a block of the loop as a run is without a window."""
    p, inter = plan.pcp_size, plan.interleave
    run, a, n, start = chunk_runs(a, n, size)
    rank, req, kind, prefill = rank[run], req[run], kind[run], prefill[run]
    group = req * (int(start.max(initial=0)) // size + 1) + start // size  # NOTE: a (request, chunk) key
    h = np.arange(p, dtype=np.int64)
    computed = plan.num_computed[req]
    # [P, pieces]: each shard's cached entries from the piece's chunk start on
    cached_in_chunk = dcp_shard_lens(computed, p, inter) - dcp_shard_lens(np.minimum(start, computed), p, inter)
    parts = []

    st = np.flatnonzero(kind == STAYS)
    origin = (rank[st, None] - h[None, :]) % p
    at_st = np.broadcast_to(rank[st, None], origin.shape)
    cached = np.take_along_axis(cached_in_chunk[:, st].T, origin, axis=1)
    kv = _runs_over(st, rank, group, a, n, iteration=lambda qi, kj: (rank[qi] - rank[kj]) % p)
    parts.append((_blocks(st, at_st, h, n, cached, kv, p), st))

    tr = np.flatnonzero(kind == TRAVELS)
    host = (rank[tr, None] + h[None, :]) % p
    cached = np.take_along_axis(cached_in_chunk[:, tr].T, host, axis=1)
    q = _runs_over(tr, rank, group, a, n, iteration=lambda qi, kj: (rank[kj] - rank[qi]) % p)
    parts.append((_blocks(tr, host, h, n, cached, q, p), tr))

    pre_parts, dec = _split_prefill(parts, prefill, p)

    # Rows every rank holds: after the loop, each rank over its shard of [chunk start, p].
    rp = np.flatnonzero((kind == REPLICATED) & (rank == 0))
    pre = prefill[rp]
    b = _shard_blocks(a[rp], n[rp], p, inter, start[rp])  # shard-major: [P, rows]
    keep = np.tile(pre, p)
    after = Blocks(b.bin[keep], b.rows[keep], b.k_first[keep], b.k_last[keep], b.pairs[keep])
    after_dec = b.pairs.reshape(p, -1)[:, ~pre].sum(axis=1).astype(np.float64)
    return RingBlocks(_concat(pre_parts), dec.reshape(p, p), after, after_dec)


def _concat(parts: list[Blocks]) -> Blocks:
    if not parts:
        z = np.zeros(0, dtype=np.int64)
        return Blocks(z, z, z, z, z)
    return Blocks(*(np.concatenate([getattr(b, f) for b in parts]) for f in ("bin", "rows", "k_first", "k_last", "pairs")))


def _rows_only(b: Blocks) -> Blocks:
    """``b`` without its blocks of no rows (a sliding layer's runs without a ramp or a band)."""
    keep = b.rows > 0
    return Blocks(b.bin[keep], b.rows[keep], b.k_first[keep], b.k_last[keep], b.pairs[keep])


def _runs_over(runs, rank, req, a, n, *, iteration, qa=None, qn=None, window: int | None = None):
    """Each (query run, key run) pair of ``runs`` of one request: (query run, iteration, keys
    its first row sees, keys its last row sees, pairs), the key run contiguous ``[b, b + m)``.
    The query runs' rows: ``qn`` (default ``n``) at ``qa ..`` (default ``a``); ``window``: each
    row's keys of the run within its window only (the pairs; its first and last row's keys
    as without one)."""
    if not runs.shape[0]:
        return None
    queries = runs
    order = np.argsort(req[runs], kind="stable")
    keys = runs[order]
    kreq = req[keys]
    lo = np.searchsorted(kreq, req[queries], side="left")
    hi = np.searchsorted(kreq, req[queries], side="right")
    count = hi - lo
    qi = np.repeat(queries, count)
    first = np.repeat(lo - np.cumsum(count) + count, count)
    kj = keys[np.arange(qi.shape[0], dtype=np.int64) + first]
    b, m = a[kj], n[kj]
    aq, nq = (a if qa is None else qa)[qi], (n if qn is None else qn)[qi]
    kf = np.clip(aq - b + 1, 0, m)
    kl = np.clip(aq + nq - b, 0, m)
    pairs = _run_sum(aq + nq - b, m) - _run_sum(aq - b, m)
    if window is not None:  # NOTE: row x leaves out the run's keys before x + 1 - window: _run_sum shifted
        pairs = pairs - _run_sum(aq + nq - window - b, m) + _run_sum(aq - window - b, m)
    return qi, iteration(qi, kj), kf, kl, pairs


def _run_sum(u, m):
    """``sum_{x < b + u} clip(x - b + 1, 0, m)`` over positions x >= b: what a contiguous key
    run ``[b, b + m)`` gives the rows before position ``b + u``."""
    u = np.asarray(u, dtype=np.int64)
    v = np.clip(u, 0, m)
    return v * (v + 1) // 2 + np.maximum(u - m, 0) * m


def _blocks(rows, rank_at, h, n, cached, runs, p: int) -> Blocks | None:
    """``[len(rows), P]`` blocks (run, iteration) on ``rank_at`` [rows, P]: the constant
    ``cached`` keys (before every row) plus the contiguous ``runs`` (``_runs_over``)."""
    if not rows.shape[0]:
        return None
    k = rows.shape[0]
    index = np.full(int(rows.max()) + 1, -1, dtype=np.int64)
    index[rows] = np.arange(k, dtype=np.int64)
    nq = np.repeat(n[rows][:, None], p, axis=1)
    kf = cached.astype(np.int64).copy()
    kl = kf.copy()
    pairs = nq * kf
    if runs is not None:
        qi, it, f, last, pr = runs
        flat = index[qi] * p + it
        kf = kf.ravel() + np.bincount(flat, weights=f, minlength=k * p).astype(np.int64)
        kl = kl.ravel() + np.bincount(flat, weights=last, minlength=k * p).astype(np.int64)
        pairs = pairs.ravel() + np.bincount(flat, weights=pr, minlength=k * p).astype(np.int64)
    binned = (rank_at * p + h[None, :]).ravel()
    return Blocks(binned, nq.ravel(), np.ravel(kf), np.ravel(kl), np.ravel(pairs))


def _cached_in_window(computed, at, b, nb, window: int, p: int, inter: int) -> np.ndarray:
    """``[rows, P]``: the pairs band runs (``nb`` rows at ``b ..``, each at least ``window``)
    score over the cached shard (positions below ``computed``) of rank ``at`` [rows, P]: row
    x its entries in ``[x + 1 - window, computed)``, ``L(c) - L(min(y, c))`` with ``y = x + 1 -
    window`` (``L = dcp_local_seq_lens``), summed over ``y`` in ``(lo, hi]``."""
    lo, hi = np.maximum(b - window, 0), np.maximum(b + nb - window, 0)
    full = dcp_shard_lens(computed, p, inter)  # [P, rows]
    below = (dcp_shard_len_sums(np.minimum(hi, computed), p, inter) - dcp_shard_len_sums(np.minimum(lo, computed), p, inter)
             + full * (np.maximum(hi - computed, 0) - np.maximum(lo - computed, 0)))
    return np.take_along_axis((nb * full - below).T, at, axis=1)


def _band_blocks(rows, rank_at, h, nb, cached, runs, p: int) -> Blocks | None:
    """``[len(rows), P]`` band blocks (run, iteration) on ``rank_at``: the ``cached`` pairs
    (``_cached_in_window``) plus the key ``runs``' (``_runs_over`` with a window), as ``_band``."""
    if not rows.shape[0]:
        return None
    k = rows.shape[0]
    index = np.full(int(rows.max()) + 1, -1, dtype=np.int64)
    index[rows] = np.arange(k, dtype=np.int64)
    pairs = cached.astype(np.int64).ravel()
    if runs is not None:
        qi, it, _, _, pr = runs
        pairs = pairs + np.bincount(index[qi] * p + it, weights=pr, minlength=k * p).astype(np.int64)
    binned = (rank_at * p + h[None, :]).ravel()
    return _band(binned, np.repeat(nb[rows], p), pairs)
