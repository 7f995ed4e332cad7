"""Context-parallel attention: what happens between a layer's K/V projection and its
attention output on one rank.

Local rows are ``[replicated decodes (nd rows, identical on every rank) | the rest]``,
padded to N (``pcpflow.layouts.layout``). Per layer:

1. **KV write.** The replicated decode rows are written from the local copy; the rest is
   all-gathered across PCP (every row when decodes are sharded, nothing when the batch
   is decodes only) and written through the gathered slot mapping. The mapping already
   says -1 wherever this rank must not write: not the canonical writer, another DCP
   rank's position, or padding.
2. **Attention.** Without DCP each rank holds the whole KV and attends locally. With DCP
   each rank holds a shard; partial attention over the shard plus its log-sum-exp is
   merged exactly across the DCP group:
   - replicated decode rows: every rank has the query, so it attends over its own shard
     and the partials are all-gathered and merged (every rank gets the result);
   - the rest (prefill chunks, sharded decodes, short replicated prefills) takes one of
     two exact paths per step (``pcpflow.layouts.accounting.plan_dcp_rest``: ``auto`` picks the
     one that moves fewer bytes):
     *queries*: the queries are all-gathered, each rank attends every gathered row over
     its shard, and an all-to-all returns each row's partials to the rank that holds it;
     *context*: each rank sends its shard of the contexts of every request with a rest
     row (``ContextGather``), one all-gather rebuilds those contexts whole on every rank,
     and each rank attends its own rows over them: no partials, no merge. A query row
     (``H x qk_dim``) can be ~100x a cache entry (MLA), so prefills gather the context.
3. **DCP over TP ranks** (the DCP group spans ``dcp_tp > 1`` TP ranks, which hold other
   heads of the same rows): queries are gathered — replicated decodes over heads only
   (the ``dcp_heads`` TP block: every PCP rank has those rows), the rest rows over the
   whole DCP group — attended over every shard, and the results go back to their heads'
   owners by ``dcp_comm_backend``: ``ag_rs`` (vLLM: all-gather the log-sum-exps, each
   shard rescales its outputs, one reduce-scatter sums them at the owner) or ``a2a`` (one
   all-to-all of packed partials, merged at the owner).
"""

from __future__ import annotations

import torch

from pcpflow.attention.metadata import AttentionMetadata
from pcpflow.attention.paged import (
    merge_packed_partials,
    pack_partials,
    paged_attention,
    with_sinks,
)
from pcpflow.layouts.accounting import (
    QUERIES,
    ModelShape,
    attention_rows,
    dcp_tp_size,
    plan_dcp_rest,
)
from pcpflow.layouts.layout import BatchLayout
from pcpflow.models.base import AttentionSpec
from pcpflow.parallel.comm import Comm


class CPAttention:
    """The ``AttentionBackend`` of one step on one rank (see module docstring)."""

    def __init__(
        self,
        *,
        layout: BatchLayout,
        meta: AttentionMetadata,
        caches: list[torch.Tensor],
        spec: AttentionSpec,
        block_size: int,
        pcp: Comm,
        dcp: Comm,
        dcp_rest: str = "auto",
        dcp_comm_backend: str = "ag_rs",
        kernel=paged_attention,
        dcp_heads: Comm | None = None,
    ) -> None:
        """``dcp_rest``: the rest rows' DCP path policy, ``auto`` | ``queries`` | ``context``
        (``context`` and ``auto`` need ``meta.dcp_context``; without it ``auto`` queries).
        ``kernel``: ``paged_attention`` or a function with its contract
        (``pcpflow.attention.fused.attention_kernel``)."""
        self.kernel = kernel
        self.caches, self.spec, self.block_size = caches, spec, block_size
        self.pcp, self.dcp, self.meta = pcp, dcp, meta
        if spec.windowed() is not None and meta.window != spec.windowed():
            raise ValueError(f"the model's layers {list(spec.window_layers)} attend through {spec.windowed()}, but "
                             f"the attention metadata was built for window={meta.window}")
        n, p = layout.padded_num_tokens, layout.pcp_size
        # Rows past the replicated-decode prefix move, if any rank has a real one there
        # (pcpflow.layouts.accounting: the one definition of what each layer gathers).
        nd, rest = attention_rows(layout)
        self.nd, self.has_rest = nd, rest > 0
        slots = meta.gathered_slot_mapping.view(p, n)
        self.decode_write = _valid_writes(slots[0, :nd])
        self.rest_write = _valid_writes(slots[:, nd:].reshape(-1)) if self.has_rest else None
        self.dcp_rest = QUERIES
        self.dcp_tp = dcp_tp_size(pcp.size, dcp.size)
        self.dcp_comm_backend = dcp_comm_backend
        if self.dcp_tp > 1:
            assert meta.gathered_row_req_indices is not None
            assert meta.gathered_row_context_lens is not None
            # NOTE: without the heads group (a caller that does not pass it) at pcp > 1,
            # decode rows take the whole-group path with the rest: exact, more bytes.
            self.dcp_heads = dcp if dcp_heads is None and p == 1 else dcp_heads
            self.heads_rows = nd if self.dcp_heads is not None else 0
            # DCP member m (ascending global rank: PCP-major) holds PCP rank m // dcp_tp's
            # rows and TP block rank m % dcp_tp's heads.
            member = torch.arange(dcp.size, device=meta.block_tables.device)
            self.member_pcp, self.member_heads = member // self.dcp_tp, member % self.dcp_tp
            start = self.heads_rows
            self.member_req = meta.gathered_row_req_indices.view(p, n)[self.member_pcp, start:].reshape(-1)
            self.member_ctx = meta.gathered_row_context_lens.view(p, n)[self.member_pcp, start:].reshape(-1)
            self.member_start = _cut(meta.gathered_row_starts, lambda g: g.view(p, n)[self.member_pcp, start:].reshape(-1))
        elif dcp.size > 1 and self.has_rest:
            plan = meta.dcp_context
            if plan is not None and dcp_rest != "queries":
                self.dcp_rest = plan_dcp_rest(
                    layout,
                    plan.seq_lens,
                    policy=dcp_rest,
                    dcp_size=dcp.size,
                    interleave=plan.interleave,
                    shape=layer_shape(spec, caches),
                )
            elif dcp_rest == "context":
                raise ValueError("dcp_rest='context' needs AttentionMetadata.dcp_context")
        if self.dcp_rest.mode == "context":
            assert meta.dcp_context is not None
            self.context = meta.dcp_context.tensors
            # NOTE: the plan's own count must be the one accounting priced and decided by.
            assert self.context.send_slots.numel() == self.dcp_rest.context_rows
        elif dcp.size > 1 and self.dcp_tp == 1:
            assert meta.gathered_row_req_indices is not None
            assert meta.gathered_row_context_lens is not None
            self.rest_req = meta.gathered_row_req_indices.view(p, n)[:, nd:].reshape(-1)
            self.rest_ctx = meta.gathered_row_context_lens.view(p, n)[:, nd:].reshape(-1)
            self.rest_start = _cut(meta.gathered_row_starts, lambda g: g.view(p, n)[:, nd:].reshape(-1))

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.write(layer, kv)
        return self.attend(layer, q, sinks)

    def write(self, layer: int, kv: torch.Tensor) -> None:
        """Step 1 alone: write this rank's new entries ``kv`` to layer ``layer``'s cache
        (a drafter that fills its cache from target features calls only this)."""
        cache, nd = self.caches[layer], self.nd
        _write(cache, self.decode_write, kv[:nd])
        if self.rest_write is not None:
            _write(cache, self.rest_write, self.pcp.all_gather(kv[nd:], "kv_gather"))

    def attend(self, layer: int, q: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Step 2 alone: the attention of ``q`` over layer ``layer``'s cache (through the
        sliding window on the layers ``AttentionSpec.window_layers`` names, and the heads'
        attention ``sinks`` if given: applied once per row, where its result is whole)."""
        cache, nd, meta = self.caches[layer], self.nd, self.meta
        slides = self.spec.slides(layer)
        local_start = meta.local_row_starts if slides else None
        if self.dcp.size == 1:
            return with_sinks(*self._attend(q, meta.local_row_req_indices, meta.local_row_context_lens, cache,
                                             local_start), sinks)
        if self.dcp_tp > 1:
            return self._attend_over_tp(q, cache, slides, sinks)
        out = q.new_zeros((q.shape[0], self.spec.num_heads, self.spec.v_dim))
        if nd:
            o, lse = self._attend(
                q[:nd], meta.local_row_req_indices[:nd], meta.local_row_context_lens[:nd], cache,
                None if local_start is None else local_start[:nd],
            )
            gathered = self.dcp.all_gather(pack_partials(o, lse, q.dtype), "dcp_decode_partials")
            out[:nd] = self._merge(gathered.view(self.dcp.size, nd, -1), sinks)
        if self.has_rest and self.dcp_rest.mode == "context":
            c = self.context
            shard = self.dcp.all_gather(cache.index_select(0, c.send_slots), "dcp_context_gather")
            contexts = shard.index_select(0, c.source)
            out[nd:] = with_sinks(*self.kernel(
                q[nd:],
                contexts,
                self.spec,
                c.block_tables,
                self.meta.local_row_req_indices[nd:],
                c.row_context_lens[nd:],
                self.block_size,
                meta.context_row_starts[nd:] if slides else None,
            ), sinks)
        elif self.has_rest:
            rest = q.shape[0] - nd
            q_all = self.dcp.all_gather(q[nd:], "dcp_query_gather")
            o, lse = self._attend(q_all, self.rest_req, self.rest_ctx, cache, self.rest_start if slides else None)
            mine = self.dcp.all_to_all(pack_partials(o, lse, q.dtype), "dcp_partials")
            out[nd:] = self._merge(mine.view(self.dcp.size, rest, -1), sinks)
        return out

    def _attend_over_tp(self, q: torch.Tensor, cache: torch.Tensor, slides: bool, sinks: torch.Tensor | None) -> torch.Tensor:
        """Step 3 (module docstring). Replicated decode rows are the same on every PCP
        rank: their queries are gathered over heads only (the ``dcp_heads`` TP block);
        the rest rows of every member are gathered over the whole DCP group."""
        nd, meta = self.heads_rows, self.meta
        out = q.new_zeros((q.shape[0], self.spec.num_heads, self.spec.v_dim))
        if nd:
            t = self.dcp_heads.size
            q_heads = self.dcp_heads.all_gather(q[:nd], "dcp_decode_query_gather")
            req = meta.local_row_req_indices[:nd].repeat(t)
            ctx = meta.local_row_context_lens[:nd].repeat(t)
            start = meta.local_row_starts[:nd].repeat(t) if slides else None
            out[:nd] = self._to_owners(q_heads, req, ctx, start, cache, self.member_heads, t, "dcp_decode", sinks)
        if self.has_rest or nd < self.nd:
            q_rest = self.dcp.all_gather(q[nd:], "dcp_query_gather")
            member = torch.arange(self.dcp.size, device=q.device)
            out[nd:] = self._to_owners(q_rest, self.member_req, self.member_ctx, self.member_start if slides else None,
                                       cache, member, self.dcp.size, "dcp", sinks)
        return out

    def _to_owners(self, q_blocks, req, ctx, starts, cache, owner_block, b: int, prefix: str, sinks) -> torch.Tensor:
        """Attend ``b`` blocks of query rows (from ``starts``, a sliding layer's) over this
        rank's shard and give DCP member ``m`` the merged result of block ``owner_block[m]``
        (its rows and heads), by ``dcp_comm_backend``; the owner applies its heads' ``sinks``."""
        d, h, dv = self.dcp.size, self.spec.num_heads, self.spec.v_dim
        o, lse = self._attend(q_blocks, req, ctx, cache, starts)
        rows = q_blocks.shape[0] // b
        o, lse = o.view(b, rows, h, dv), lse.view(b, rows, h)
        if self.dcp_comm_backend == "a2a":
            send = pack_partials(o[owner_block].flatten(0, 1), lse[owner_block].flatten(0, 1), q_blocks.dtype)
            mine = self.dcp.all_to_all(send, f"{prefix}_partials")
            return self._merge(mine.view(d, rows, -1), sinks).to(q_blocks.dtype)
        lses = self.dcp.all_gather(lse.flatten(0, 1), f"{prefix}_lse_gather").view(d, b, rows, h)
        total = torch.logsumexp(lses, dim=0)  # -inf where no shard has a key
        w = torch.where(lse == float("-inf"), 0.0, torch.exp(lse - total))[..., None]
        # NOTE: where() so that an empty shard's weight never multiplies a NaN.
        scaled = torch.where(w > 0, w * o.to(w.dtype), 0.0)
        out = self.dcp.reduce_scatter(scaled[owner_block].flatten(0, 1), f"{prefix}_output_reduce_scatter")
        # NOTE: the reduce-scatter sums this member's block over every shard: its whole lse is the block's total.
        return with_sinks(out, total[owner_block[self.dcp.rank]], sinks).to(q_blocks.dtype)

    def _attend(self, q, req, ctx, cache, starts=None):
        return self.kernel(q, cache, self.spec, self.meta.block_tables, req, ctx, self.block_size, starts)

    def _merge(self, packed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        return merge_packed_partials(packed, self.spec.num_heads, self.spec.v_dim, sinks)


def layer_shape(spec: AttentionSpec, caches: list[torch.Tensor]) -> ModelShape:
    """The per-layer sizes that price the DCP paths (hidden size and depth do not)."""
    return ModelShape(
        hidden_size=0,
        num_layers=1,
        entry_dim=spec.entry_dim,
        num_heads=spec.num_heads,
        qk_dim=spec.qk_dim,
        v_dim=spec.v_dim,
        dtype_bytes=caches[0].element_size() if caches else 1,
    )


def _cut(starts: torch.Tensor | None, cut) -> torch.Tensor | None:
    """A sliding window's row starts (``AttentionMetadata``) cut as a path cuts its rows'
    context lens; None without a window."""
    return None if starts is None else cut(starts)


def _valid_writes(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.nonzero(slots >= 0).flatten()
    return rows, slots[rows]


def _write(cache: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor) -> None:
    rows, slots = write
    if rows.numel():
        cache.index_copy_(0, slots, kv.index_select(0, rows).to(cache.dtype))
