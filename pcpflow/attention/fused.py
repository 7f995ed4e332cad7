"""Fused paged attention with the log-sum-exp the DCP merge needs.

Same contract as ``pcpflow.attention.paged.paged_attention`` (``out [N, H, v_dim]``, natural-log
``lse [N, H]``, ``0`` / ``-inf`` for rows without context), computed by one fused kernel
call per tile instead of explicit scores:

- ``flex``: ``torch.nn.attention.flex_attention`` with the mask as a ``score_mod`` and
  its log-sum-exp (``return_aux=AuxRequest(lse=True)``, or ``return_lse`` before torch
  2.9); runs eagerly on any device (CPU in CI, float64 on CUDA), fused under
  ``torch.compile``. The default off CUDA.
- ``sdpa``: the flash/efficient SDPA kernels that return their log-sum-exp (CUDA:
  ``_scaled_dot_product_efficient_attention`` with a mask bias, the default there for
  float32 / bf16; CPU: ``_scaled_dot_product_flash_attention_for_cpu``); K/V heads are
  repeated for GQA/MLA and V is zero-padded to the query dim (these kernels want one
  head size).

The paged cache is read through a **gather**: rows are grouped into *segments* (a run of
one request's consecutive rows; a decode is a segment of one row), and each tile of
segments gathers its requests' blocks into dense ``[t, kv_heads, ctx, dim]`` keys and
values, masked per row by its context length. docs/gpu.md has the measurement behind
the gather (vs. flex's block-table ``mask_mod`` over the whole cache).

``fused_decode_attention`` is the static-shape variant CUDA graphs capture: one row per
segment, every row reads the same number of blocks; no data-dependent shapes or host syncs.
"""

from __future__ import annotations

import warnings

import torch

from pcpflow.attention.paged import accumulation_dtype, paged_attention, softcapped
from pcpflow.models.base import AttentionSpec

KERNELS = ("flex", "sdpa")

_MAX_SEGMENT_ROWS = 512
"""Rows of one request that share one gather (a mask of rows x context per segment)."""

_TILE_ELEMENTS = 1 << 24
"""Rough bound on the elements one tile materializes (gathered K/V + mask)."""


def default_kernel(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """sdpa on CUDA (the efficient kernel: float32 / bf16 / fp16), flex elsewhere."""
    narrow = dtype in (torch.float32, torch.bfloat16, torch.float16)
    return "sdpa" if device.type == "cuda" and narrow else "flex"


def fused_paged_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    spec: AttentionSpec,
    block_tables: torch.Tensor,
    row_req_indices: torch.Tensor,
    row_context_lens: torch.Tensor,
    block_size: int,
    starts: torch.Tensor | None = None,
    *,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_attention``'s result through a fused kernel (see module docstring); ``starts``:
    each row's first key (a sliding window), None: 0."""
    kernel = kernel or default_kernel(q.device, q.dtype)
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")
    num_rows, num_heads, _ = q.shape
    out_dtype, acc = q.dtype, accumulation_dtype(q.dtype)
    out = q.new_zeros(num_rows, num_heads, spec.v_dim)
    lse = torch.full((num_rows, num_heads), float("-inf"), dtype=acc, device=q.device)
    if num_rows == 0 or cache.shape[0] == 0 or block_tables.shape[-1] == 0:
        return out, lse
    req = row_req_indices.to(device=q.device, dtype=torch.long)
    ctx = row_context_lens.to(device=q.device, dtype=torch.long)
    tables = block_tables.to(device=q.device, dtype=torch.long)
    first = None if starts is None else starts.to(device=q.device, dtype=torch.long)
    blocked = cache.reshape(-1, block_size, spec.entry_dim)
    for seg_rows in _segments(req, ctx):
        seg_ctx = torch.where(seg_rows >= 0, ctx[seg_rows.clamp(min=0)], 0)
        seg_start = None if first is None else torch.where(seg_rows >= 0, first[seg_rows.clamp(min=0)], 0)
        seg_tables = tables[req[seg_rows.amax(1)]]
        order = torch.argsort(seg_ctx.amax(1), descending=True)
        ctx_sorted = seg_ctx.amax(1)[order].tolist()
        g = seg_rows.shape[1]
        start = 0
        while start < len(ctx_sorted):
            nblocks = min(-(-ctx_sorted[start] // block_size), seg_tables.shape[1])
            width = nblocks * block_size
            per_seg = width * (spec.entry_dim + g) + g * num_heads * (spec.qk_dim + spec.v_dim)
            idx = order[start : start + max(1, _TILE_ELEMENTS // per_seg)]
            start += idx.numel()
            rows = seg_rows[idx]
            o, l = _attend_dense(
                q, blocked, spec, seg_tables[idx, :nblocks], rows, seg_ctx[idx], kernel,
                None if seg_start is None else seg_start[idx],
            )
            keep = rows >= 0
            out[rows[keep]] = o[keep].to(out_dtype)
            lse[rows[keep]] = l[keep].to(acc)
    return out, lse


def fused_decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    spec: AttentionSpec,
    row_block_tables: torch.Tensor,
    row_context_lens: torch.Tensor,
    block_size: int,
    starts: torch.Tensor | None = None,
    *,
    kernel: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One segment per row, static shapes: row ``n`` reads blocks ``row_block_tables[n]``
    (``[N, W]``, any valid block where unused) up to ``row_context_lens[n]`` keys (0 on
    padded rows), from ``starts[n]`` on (a sliding window; None: 0). What a CUDA graph
    captures: no host sync, no data-dependent shape."""
    kernel = kernel or default_kernel(q.device, q.dtype)
    blocked = cache.reshape(-1, block_size, spec.entry_dim)
    o, l = _attend_dense(
        q,
        blocked,
        spec,
        row_block_tables.clamp(0, blocked.shape[0] - 1),
        torch.arange(q.shape[0], device=q.device)[:, None],
        row_context_lens[:, None],
        kernel,
        None if starts is None else starts[:, None],
    )
    return o[:, 0].to(q.dtype), l[:, 0].to(accumulation_dtype(q.dtype))


def _segments(req: torch.Tensor, ctx: torch.Tensor) -> list[torch.Tensor]:
    """``[S, g]`` row-index matrices (``-1`` pads): single rows (runs of one row: decodes)
    in one matrix, longer runs of one request cut into pieces of ``_MAX_SEGMENT_ROWS`` in
    another. Rows without context are left out (their result is final already)."""
    n, device = req.shape[0], req.device
    arange = torch.arange(n, device=device)
    is_start = torch.ones(n, dtype=torch.bool, device=device)
    is_start[1:] = req[1:] != req[:-1]
    run_id = torch.cumsum(is_start.long(), 0) - 1
    run_start = arange[is_start]
    run_len = torch.diff(run_start, append=torch.tensor([n], device=device))[run_id]
    pos = arange - run_start[run_id]
    live = ctx > 0
    groups = []
    single = arange[live & (run_len == 1)]
    if single.numel():
        groups.append(single[:, None])
    multi = arange[live & (run_len > 1)]
    if multi.numel():
        g = min(_MAX_SEGMENT_ROWS, int(run_len[multi].max()))
        key = run_id[multi] * (n // g + 1) + pos[multi] // g
        keys, seg_of_row = torch.unique(key, return_inverse=True)
        seg = torch.full((keys.numel(), g), -1, dtype=torch.long, device=device)
        seg[seg_of_row, pos[multi] % g] = multi
        groups.append(seg)
    return groups


def _attend_dense(q, blocked, spec, tables, rows, row_ctx, kernel, row_start=None):
    """Segments ``rows [t, g]`` (``-1`` pads, context ``row_ctx [t, g]``, 0 on pads, first
    key ``row_start [t, g]``, None: 0) over the blocks ``tables [t, nb]``: ``o [t, g, H,
    v_dim]``, ``lse [t, g, H]``."""
    t, g = rows.shape
    num_blocks, block_size, _ = blocked.shape
    width = tables.shape[1] * block_size
    acc = accumulation_dtype(q.dtype)
    entries = blocked[tables.clamp(0, num_blocks - 1)].reshape(t, width, spec.entry_dim)
    j = torch.arange(width, device=q.device)
    mask = j[None, None, :] < row_ctx[:, :, None]  # [t, g, width]
    if row_start is not None:  # NOTE: a sliding window masks the keys before each row's start
        mask &= j[None, None, :] >= row_start[:, :, None]
    # NOTE: slots past every row's context, or before every row's start, may hold NaN (never
    # written; a hybrid cache's null block) or another request's stale KV; a masked score
    # still multiplies its value, so zero them.
    written = j[None, :] < row_ctx.amax(1)[:, None]
    if row_start is not None:
        first = torch.where(rows >= 0, row_start, row_ctx.amax(1)[:, None]).amin(1)
        written &= j[None, :] >= first[:, None]
    entries = torch.where(written[:, :, None], entries, entries.new_zeros(()))
    keys = spec.keys(entries).transpose(1, 2)  # [t, kvh, width, qk]
    values = spec.values(entries).transpose(1, 2)  # [t, kvh, width, v]
    qt = q[rows.clamp(min=0)].transpose(1, 2)  # [t, H, g, qk]
    # bf16/fp16 stay narrow into the kernel (it accumulates in float32 itself).
    if kernel == "flex" or spec.softcap is not None:  # NOTE: SDPA takes no soft-cap
        o, lse = _flex(qt, keys, values, mask, spec.scale, spec.softcap)
    else:
        o, lse = _sdpa(qt, keys, values, mask, spec)
    # NOTE: rows without a key (no context, or none in their window on this shard): 0 and
    # -inf, whatever the kernel makes of a row masked whole
    has = (row_ctx > (0 if row_start is None else row_start))[:, None, :]
    o = torch.where(has[..., None], o, o.new_zeros(()))
    lse = torch.where(has, lse.to(acc), torch.full((), float("-inf"), dtype=acc, device=q.device))
    return o.transpose(1, 2), lse.transpose(1, 2)


def _flex(q, k, v, mask, scale, softcap=None):
    from torch.nn.attention.flex_attention import flex_attention

    # NOTE: the mask as a score_mod rather than a BlockMask: eager flex vmaps a mask_mod
    # twice (building the block mask, then applying it), a score_mod once, and with
    # whole gathered blocks there are no empty tiles for a block mask to skip.
    neg_inf = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)

    def score_mod(score, b, h, qi, kj):
        return torch.where(mask[b, qi, kj], softcapped(score, softcap), neg_inf)

    kwargs = dict(score_mod=score_mod, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    with warnings.catch_warnings():
        # NOTE: eager flex warns that it is unfused; CPU CI runs it eagerly on purpose.
        warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
        try:
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:  # torch < 2.9
            return flex_attention(q, k, v, return_lse=True, **kwargs)
        o, aux = flex_attention(q, k, v, return_aux=AuxRequest(lse=True), **kwargs)
        return o, aux.lse


def _sdpa(q, k, v, mask, spec):
    h, kvh = q.shape[1], k.shape[1]
    if kvh != h:
        k, v = k.repeat_interleave(h // kvh, 1), v.repeat_interleave(h // kvh, 1)
    dv = v.shape[-1]
    if dv != q.shape[-1]:
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - dv))
    g, width = q.shape[2], k.shape[2]
    # NOTE: both kernels take the mask as an additive bias of the query dtype; the
    # efficient kernel wants it 16-aligned in the key dim, so pad and slice.
    padded = -(-width // 16) * 16
    bias = torch.full((q.shape[0], 1, g, padded), float("-inf"), dtype=q.dtype, device=q.device)
    bias[..., :width].masked_fill_(mask[:, None], 0.0)
    bias = bias[..., :width]
    if q.device.type == "cuda":
        o, lse = torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias.expand(-1, h, -1, -1), True, scale=spec.scale
        )[:2]
        lse = lse[..., :g]
    else:
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, attn_mask=bias, scale=spec.scale
        )
    return o[..., :dv], lse


# --- attention backends (pipeline.forward.attention)
ATTENTION_BACKENDS = ("reference", "fused", "auto")


def resolve_attention(name: str, device: torch.device) -> str:
    """``reference`` | ``fused``: ``auto`` is fused on CUDA, the reference elsewhere."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention must be one of {ATTENTION_BACKENDS}, got {name!r}")
    if name == "auto":
        return "fused" if device.type == "cuda" else "reference"
    return name


def attention_kernel(name: str, device: torch.device):
    """The paged-attention function of backend ``name`` on ``device`` (same contract as
    ``paged_attention``)."""
    if resolve_attention(name, device) == "reference":
        return paged_attention
    return fused_paged_attention
