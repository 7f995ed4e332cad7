"""Paged attention and the exact merge of partial attention results, in plain torch.

``paged_attention`` is the reference kernel every forward stage calls: each query row
reads its request's block table up to its context length, so causality (``position+1``)
and DCP sharding (the rank-local count) are both just a context length here. Under DCP
each rank returns a partial result with its log-sum-exp, and ``merge_attention_partials``
combines the shards exactly.

Rows are processed in *segments*: a run of consecutive rows of one request (a prefill
chunk) is cut into segments of ``_SEGMENT_ROWS`` rows that share one gather of the
request's keys; every other row (decodes, short runs) is a segment of its own. A segment
reads its *span*: the blocks from the first one any of its rows needs (its smallest start,
a windowed layer's) to its longest context. Segments are sorted by span and processed in
tiles sized from a memory budget, so there is no Python loop per token or per request.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pcpflow.models.base import AttentionSpec

_SEGMENT_ROWS = 32
"""Rows of one request that share a key gather (runs shorter than this go row by row)."""

_TILE_ELEMENTS = 1 << 20
"""Rough bound on the elements a tile materializes (gathered entries + scores)."""

WORK_FIELDS = ("rows", "pairs", "tiles", "gathered", "scored")
"""``kernel_work``'s columns."""


def paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    spec: AttentionSpec,
    block_tables: torch.Tensor,
    row_req_indices: torch.Tensor,
    row_context_lens: torch.Tensor,
    block_size: int,
    starts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of each query row over its request's paged context.

    Row ``n`` attends over entries ``starts[n] <= j < row_context_lens[n]`` (``starts``: a
    sliding or chunked window's first key in the same index space, None: 0; the blocks before
    the first one a segment's rows need are not read) of block-table row
    ``r = row_req_indices[n]``; entry ``j`` lives at slot
    ``block_tables[r, j // block_size] * block_size + j % block_size`` of ``cache``
    (``[num_slots, entry_dim]``). Returns ``out [N, H, v_dim]`` and ``lse [N, H]``, the
    natural-log log-sum-exp of the scaled scores; rows with no context (or none from their
    start on) get ``out = 0`` and ``lse = -inf``.
    """
    num_rows, num_heads, qk_dim = q.shape
    if (num_heads, qk_dim) != (spec.num_heads, spec.qk_dim):
        raise ValueError(
            f"q is [N, {num_heads}, {qk_dim}] but the spec wants "
            f"[N, {spec.num_heads}, {spec.qk_dim}]"
        )
    if cache.dim() != 2 or cache.shape[1] != spec.entry_dim or cache.shape[0] % block_size:
        raise ValueError(
            f"cache is {list(cache.shape)}, want [num_blocks * {block_size}, {spec.entry_dim}]"
        )
    out_dtype = q.dtype
    # NOTE: narrow dtypes (bf16/fp16) score, softmax and accumulate in float32, as fused
    # attention kernels do; out comes back in the input dtype, lse stays float32 (a merge
    # across DCP shards needs it exact to far more than 8 mantissa bits).
    q = q.to(accumulation_dtype(q.dtype))
    out = q.new_zeros(num_rows, num_heads, spec.v_dim)
    lse = q.new_full((num_rows, num_heads), float("-inf"))
    if num_rows == 0 or cache.shape[0] == 0 or block_tables.shape[-1] == 0:
        return out.to(out_dtype), lse

    row_req_indices = row_req_indices.to(device=q.device, dtype=torch.long)
    row_context_lens = row_context_lens.to(device=q.device, dtype=torch.long)
    block_tables = block_tables.to(device=q.device, dtype=torch.long)
    if starts is not None:
        starts = starts.to(device=q.device, dtype=torch.long)
    blocked_cache = cache.reshape(-1, block_size, spec.entry_dim)
    for seg_rows in _segments(row_req_indices, row_context_lens, starts):
        seg_block_tables = block_tables[row_req_indices[seg_rows.amax(1)]]
        row_ctx = torch.where(seg_rows >= 0, row_context_lens[seg_rows.clamp(min=0)], 0)
        row_start = None if starts is None else torch.where(seg_rows >= 0, starts[seg_rows.clamp(min=0)], 0)
        _attend_segments(q, blocked_cache, spec, seg_block_tables, seg_rows, row_ctx, out, lse, row_start)
    return out.to(out_dtype), lse


def softcapped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """``softcap * tanh(scores / softcap)`` (Gemma 2's attention logits), as transformers
    computes it; ``scores`` when ``softcap`` is None."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for bf16/fp16 (what attention accumulates and log-sum-exps travel in);
    float32 and float64 are their own."""
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


def pack_partials(o: torch.Tensor, lse: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Partial results as one tensor for a collective: ``[rows, H*Dv + H*k]`` in ``dtype``
    (the activations'), the outputs in it and the log-sum-exps, in their accumulation dtype,
    bit for bit beside them (a float32 in two bf16 slots: ``k = 2``; ``k = 1`` when the two
    dtypes agree). The kernels' outputs already are in ``dtype``, so nothing is rounded that
    was not (a merged partial is rounded once, as a kernel's output is), at half the bytes of
    packing both in float32: what vLLM's DCP and Meta's ring send
    (``pcpflow.layouts.accounting.ModelShape.partials_width`` counts it)."""
    lse = lse.to(accumulation_dtype(dtype)).contiguous()
    return torch.cat([o.flatten(1).to(dtype), lse.view(dtype)], dim=1)


def unpack_partials(packed: torch.Tensor, num_heads: int, v_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pack_partials``'s ``[..., rows, H*Dv + H*k]`` -> outputs ``[..., rows, H, Dv]`` (the
    packed dtype) and log-sum-exps ``[..., rows, H]`` (their accumulation dtype)."""
    outs = packed[..., : num_heads * v_dim].unflatten(-1, (num_heads, v_dim))
    lses = packed[..., num_heads * v_dim :].contiguous().view(accumulation_dtype(packed.dtype))
    return outs, lses


def merge_packed_partials(
    packed: torch.Tensor, num_heads: int, v_dim: int, sinks: torch.Tensor | None = None
) -> torch.Tensor:
    """The merged output ``[rows, H, Dv]`` of ``P`` packed partials ``[P, rows, H*Dv + H*k]``
    (through the heads' attention ``sinks``, if any: ``with_sinks``)."""
    return with_sinks(*merge_attention_partials(*unpack_partials(packed, num_heads, v_dim)), sinks)


def with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """Attention whose softmax has one more logit per head that reads no value (gpt-oss's
    attention sinks, ``sinks [H]``): ``out * exp(lse) / (exp(lse) + exp(sink))``, i.e.
    ``out * sigmoid(lse - sink)``; ``out`` when ``sinks`` is None. ``out [N, H, Dv]`` and
    ``lse [N, H]`` must cover every key of their rows (a whole context, or partials merged):
    the sink joins a row's softmax once, so a DCP or ring run applies it after its merge, where
    the row's owner holds its heads' sinks. A row without keys stays 0."""
    if sinks is None:
        return out
    keep = torch.sigmoid(lse - sinks.to(device=lse.device, dtype=lse.dtype))
    return (out.to(keep.dtype) * keep[..., None]).to(out.dtype)


def _segments(row_req_indices: torch.Tensor, row_context_lens: torch.Tensor,
              starts: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Group rows into ``[num_segments, g]`` index matrices (``-1`` pads, at least one row
    per segment): rows in runs of at least ``_SEGMENT_ROWS`` consecutive rows of one request
    in segments of that many, every other row alone. Rows without a key (no context, or
    none from their start on) are left out (their result is already final)."""
    n = row_req_indices.shape[0]
    device = row_req_indices.device
    arange = torch.arange(n, device=device)
    is_start = torch.ones(n, dtype=torch.bool, device=device)
    is_start[1:] = row_req_indices[1:] != row_req_indices[:-1]
    run_id = torch.cumsum(is_start.long(), 0) - 1
    run_start = arange[is_start]
    run_len = torch.diff(run_start, append=torch.tensor([n], device=device))
    pos_in_run = arange - run_start[run_id]
    has_context = row_context_lens > (0 if starts is None else starts)
    in_long_run = (run_len[run_id] >= _SEGMENT_ROWS) & has_context

    groups = []
    singles = arange[has_context & ~in_long_run]
    if singles.numel():
        groups.append(singles[:, None])
    long_rows = arange[in_long_run]
    if long_rows.numel():
        # NOTE: a segment per (run, block of _SEGMENT_ROWS positions); rows without
        # context inside a long run leave a pad in their segment.
        g = _SEGMENT_ROWS
        key = run_id[long_rows] * (n // g + 1) + pos_in_run[long_rows] // g
        seg_keys, seg_of_row = torch.unique(key, return_inverse=True)
        seg_rows = torch.full((seg_keys.numel(), g), -1, dtype=torch.long, device=device)
        seg_rows[seg_of_row, pos_in_run[long_rows] % g] = long_rows
        groups.append(seg_rows)
    return groups


def _tiles(seg_blocks: list[int], per_key: int, block_size: int, max_blocks: int) -> Iterator[tuple[int, int, int]]:
    """``(first, stop, blocks)`` of each tile over segments sorted by the blocks they read
    (their span), longest first: a tile takes as many segments as ``_TILE_ELEMENTS`` holds at
    its first segment's span (``per_key`` elements a key and segment), at least one."""
    first, n = 0, len(seg_blocks)
    while first < n:
        blocks = min(seg_blocks[first], max_blocks)
        stop = min(n, first + max(1, _TILE_ELEMENTS // (blocks * block_size * per_key)))
        yield first, stop, blocks
        first = stop


def kernel_work(row_req, row_context_lens, *, num_heads: int, entry_dim: int, block_size: int,
                max_blocks: int | None = None, starts=None) -> np.ndarray:
    """float64 ``[2, 5]``: what ``paged_attention`` does with these rows (from ``starts``, a
    windowed layer's first keys; None: 0), counted without running it (numpy, no loop per
    row): for its rows alone (``g = 1``, row 0) and its long runs' segments (``g =
    _SEGMENT_ROWS``, row 1): ``WORK_FIELDS``, the rows with a key, the pairs they score (their
    keys from start to context), the tiles, the entries the tiles gather (each segment at its
    tile's padded span) and the pairs they score (``g`` times that: pads included).
    ``max_blocks``: the block table's width (no cap when None)."""
    req = np.asarray(row_req, dtype=np.int64)
    ctx = np.asarray(row_context_lens, dtype=np.int64)
    first = np.zeros_like(ctx) if starts is None else np.asarray(starts, dtype=np.int64)
    out = np.zeros((2, len(WORK_FIELDS)))
    n = req.shape[0]
    if n == 0:
        return out
    g = _SEGMENT_ROWS
    is_start = np.ones(n, dtype=bool)
    is_start[1:] = req[1:] != req[:-1]
    run_id = np.cumsum(is_start) - 1
    run_start = np.flatnonzero(is_start)
    run_len = np.diff(run_start, append=n)
    has = ctx > first
    long = (run_len[run_id] >= g) & has
    rows = np.flatnonzero(long)
    seg_ctx = seg_first = np.zeros(0, dtype=np.int64)
    if rows.size:  # a segment per (run, block of g positions): contiguous in row order
        key = run_id[rows] * (n // g + 1) + (rows - run_start[run_id[rows]]) // g
        at = np.flatnonzero(np.diff(key, prepend=-1))
        seg_ctx, seg_first = np.maximum.reduceat(ctx[rows], at), np.minimum.reduceat(first[rows], at)
    for i, (size, alone, c, f) in enumerate(((1, has & ~long, ctx[has & ~long], first[has & ~long]),
                                             (g, long, seg_ctx, seg_first))):
        if not c.size:
            continue
        per_key = size * num_heads * 2 + entry_dim
        blocks = -(-c // block_size)
        if max_blocks is not None:
            blocks = np.minimum(blocks, max_blocks)
        span = np.sort(np.maximum(blocks - f // block_size, 1))[::-1]
        # NOTE: a segment whose padded span fills more than half the tile budget is a tile of
        # its own (longest first: a prefix); the rest go through the kernel's own loop.
        k = int(np.count_nonzero(2 * span * block_size * per_key > _TILE_ELEMENTS))
        tiles, gathered = k, int(span[:k].sum()) * block_size
        for a, b, nb in _tiles(span[k:].tolist(), per_key, block_size, max_blocks or int(span.max())):
            tiles += 1
            gathered += (b - a) * nb * block_size
        out[i] = alone.sum(), (ctx - first)[alone].sum(), tiles, gathered, size * gathered
    return out


def _attend_segments(
    q: torch.Tensor,
    blocked_cache: torch.Tensor,
    spec: AttentionSpec,
    seg_block_tables: torch.Tensor,
    seg_rows: torch.Tensor,
    row_ctx: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    row_start: torch.Tensor | None = None,
) -> None:
    """Attend every segment (``seg_rows [S, g]``, ``-1`` pads; a segment's rows share one
    request, whose block table is ``seg_block_tables[s]``; ``row_ctx [S, g]`` is each row's
    context, 0 on pads; ``row_start [S, g]`` its first key, None: 0) over ``blocked_cache
    [num_blocks, block_size, entry_dim]`` and write the rows' results into ``out`` / ``lse``.
    A segment reads its span: the blocks from its smallest start's to its longest context."""
    num_kv_heads, num_heads = spec.num_kv_heads, spec.num_heads
    group = num_heads // num_kv_heads
    num_blocks, block_size, _ = blocked_cache.shape
    max_blocks = seg_block_tables.shape[1]
    g = seg_rows.shape[1]
    valid_row = seg_rows >= 0
    safe_rows = seg_rows.clamp(min=0)
    seg_ctx = row_ctx.amax(1)
    ctx_blocks = torch.clamp((seg_ctx + block_size - 1) // block_size, max=max_blocks)
    if row_start is None:
        seg_first = first_block = torch.zeros_like(seg_ctx)
    else:
        seg_first = torch.where(valid_row, row_start, seg_ctx[:, None]).amin(1)
        first_block = seg_first // block_size
    spans = (ctx_blocks - first_block).clamp(min=1)
    # Sorted by span (then context: the order by context alone when every start is 0), each
    # tile is padded to its first segment's span (in blocks).
    _, order = torch.sort(spans * (int(seg_ctx.max()) + 1) + seg_ctx, descending=True)
    seg_blocks = spans[order]
    per_key = g * num_heads * 2 + spec.entry_dim  # scores + probs + gathered entry
    for first, stop, span in _tiles(seg_blocks.tolist(), per_key, block_size, max_blocks):
        width = span * block_size
        idx = order[first:stop]
        t = idx.numel()

        # NOTE: whole blocks are gathered (contiguous copies), keys outside a row's window are
        # masked; unused block-table entries (e.g. -1) are clamped, never read.
        cols = torch.clamp(first_block[idx, None] + torch.arange(span, device=q.device), max=max_blocks - 1)
        blocks = seg_block_tables[idx].gather(1, cols).clamp(0, num_blocks - 1)
        entries = blocked_cache[blocks].view(t, width, spec.entry_dim).to(q.dtype)
        j = first_block[idx, None] * block_size + torch.arange(width, device=q.device)  # [t, width]: key index
        # NOTE: slots past a segment's context, or before the first key any of its rows reads,
        # were never written for it or may be stale (NaN, another request's KV, anything):
        # zero them, since a masked score still multiplies its value (0 * NaN = NaN).
        written = (j < seg_ctx[idx, None]) & (j >= seg_first[idx, None])
        entries = torch.where(written[:, :, None], entries, entries.new_zeros(()))
        keys = spec.keys(entries).permute(0, 2, 3, 1)  # [t, kvh, qk_dim, width]
        values = spec.values(entries).permute(0, 2, 1, 3)  # [t, kvh, width, v_dim]

        qt = q[safe_rows[idx]].view(t, g, num_kv_heads, group, spec.qk_dim)
        qt = qt.permute(0, 2, 1, 3, 4).reshape(t, num_kv_heads, g * group, spec.qk_dim)
        scores = softcapped(torch.matmul(qt, keys) * spec.scale, spec.softcap)  # [t, kvh, g*group, width]
        mask = j[:, None, :] < row_ctx[idx][:, :, None]  # [t, g, width]
        if row_start is not None:  # NOTE: a window: keys before a row's start are masked too
            mask &= j[:, None, :] >= row_start[idx][:, :, None]
        mask = mask[:, None, :, None, :].expand(t, 1, g, group, width).reshape(t, 1, g * group, width)
        scores = scores.masked_fill(~mask, float("-inf"))

        m = scores.amax(-1, keepdim=True)
        m = torch.where(m == float("-inf"), 0.0, m)  # rows without context: exp(-inf) = 0
        p = torch.exp(scores - m)
        s = p.sum(-1, keepdim=True)
        # NOTE: s >= 1 whenever a row has context (its max term is exp(0)), so the clamp
        # only turns 0/0 into 0 for rows without context.
        o = torch.matmul(p, values) / s.clamp_min(torch.finfo(s.dtype).tiny)
        row_lse = (m + torch.log(s)).squeeze(-1)  # [t, kvh, g*group]

        o = o.view(t, num_kv_heads, g, group, spec.v_dim).permute(0, 2, 1, 3, 4)
        row_lse = row_lse.view(t, num_kv_heads, g, group).permute(0, 2, 1, 3)
        keep = valid_row[idx]
        dest = seg_rows[idx][keep]
        out[dest] = o.reshape(t, g, num_heads, spec.v_dim)[keep]
        lse[dest] = row_lse.reshape(t, g, num_heads)[keep]


def merge_attention_partials(
    outs: torch.Tensor, lses: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention over ``P`` disjoint key shards.

    ``outs [P, N, H, Dv]`` and ``lses [P, N, H]`` -> ``out [N, H, Dv]``, ``lse [N, H]``.
    Max-shifted, so any magnitude of lse is safe; shards with ``lse = -inf`` (no keys)
    weigh nothing, and a row that no shard covers gets ``out = 0``, ``lse = -inf``.
    """
    if outs.shape[:-1] != lses.shape:
        raise ValueError(f"outs {list(outs.shape)} does not match lses {list(lses.shape)}")
    m = lses.amax(0)
    m = torch.where(m == float("-inf"), 0.0, m)
    w = torch.exp(lses - m)  # [P, N, H]; 0 for empty shards
    s = w.sum(0)
    # NOTE: where() rather than w * out, so that an empty shard's out never leaks a NaN.
    weighted = torch.where(w[..., None] > 0, w[..., None] * outs, 0.0).sum(0)
    out = weighted / s.clamp_min(torch.finfo(s.dtype).tiny)[..., None]
    return out, m + torch.log(s)
