"""Context-parallel attention: what happens between a layer's K/V projection and its
attention output on one rank.

Local rows are ``[replicated decodes (nd rows, identical on every rank) | the rest]``,
padded to N (``pcpflow.layout``). Per layer:

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
   - the rest: queries are all-gathered, each rank attends every gathered row over its
     shard, and an all-to-all returns each row's partials to the rank that holds it.
"""

from __future__ import annotations

import numpy as np
import torch

from pcpflow.accounting import attention_rows
from pcpflow.attention import merge_attention_partials, paged_attention
from pcpflow.comm import Comm
from pcpflow.layout import BatchLayout
from pcpflow.models.base import AttentionSpec
from pcpflow.slots import dcp_local_seq_lens
from pcpflow.state import AttentionMetadata


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
    ) -> None:
        self.caches, self.spec, self.block_size = caches, spec, block_size
        self.pcp, self.dcp, self.meta = pcp, dcp, meta
        n, p = layout.padded_num_tokens, layout.pcp_size
        # Rows past the replicated-decode prefix move, if any rank has a real one there
        # (pcpflow.accounting: the one definition of what each layer gathers).
        nd, rest = attention_rows(layout)
        self.nd, self.has_rest = nd, rest > 0
        slots = meta.gathered_slot_mapping.view(p, n)
        self.decode_write = _valid_writes(slots[0, :nd])
        self.rest_write = _valid_writes(slots[:, nd:].reshape(-1)) if self.has_rest else None
        if dcp.size > 1:
            assert meta.gathered_row_req_indices is not None
            assert meta.gathered_row_context_lens is not None
            self.rest_req = meta.gathered_row_req_indices.view(p, n)[:, nd:].reshape(-1)
            self.rest_ctx = meta.gathered_row_context_lens.view(p, n)[:, nd:].reshape(-1)

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.write(layer, kv)
        return self.attend(layer, q)

    def write(self, layer: int, kv: torch.Tensor) -> None:
        """Step 1 alone: write this rank's new entries ``kv`` to layer ``layer``'s cache
        (a drafter that fills its cache from target features calls only this)."""
        cache, nd = self.caches[layer], self.nd
        _write(cache, self.decode_write, kv[:nd])
        if self.rest_write is not None:
            _write(cache, self.rest_write, self.pcp.all_gather(kv[nd:], "kv_gather"))

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Step 2 alone: the attention of ``q`` over layer ``layer``'s cache."""
        cache, nd = self.caches[layer], self.nd
        if self.dcp.size == 1:
            out, _ = self._attend(q, self.meta.local_row_req_indices, self.meta.local_row_context_lens, cache)
            return out
        out = q.new_zeros((q.shape[0], self.spec.num_heads, self.spec.v_dim))
        if nd:
            o, lse = self._attend(
                q[:nd], self.meta.local_row_req_indices[:nd], self.meta.local_row_context_lens[:nd], cache
            )
            gathered = self.dcp.all_gather(_pack(o, lse), "dcp_decode_partials")
            out[:nd] = self._merge(gathered.view(self.dcp.size, nd, -1))
        if self.has_rest:
            rest = q.shape[0] - nd
            q_all = self.dcp.all_gather(q[nd:], "dcp_query_gather")
            o, lse = self._attend(q_all, self.rest_req, self.rest_ctx, cache)
            mine = self.dcp.all_to_all(_pack(o, lse), "dcp_partials")
            out[nd:] = self._merge(mine.view(self.dcp.size, rest, -1))
        return out

    def _attend(self, q, req, ctx, cache):
        return paged_attention(q, cache, self.spec, self.meta.block_tables, req, ctx, self.block_size)

    def _merge(self, packed: torch.Tensor) -> torch.Tensor:
        h, dv = self.spec.num_heads, self.spec.v_dim
        outs = packed[..., : h * dv].unflatten(-1, (h, dv))
        lses = packed[..., h * dv :]
        out, _ = merge_attention_partials(outs, lses)
        return out


def _pack(o: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """One tensor per collective: ``[rows, H*Dv + H]``."""
    return torch.cat([o.flatten(1), lse], dim=1)


def _valid_writes(slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows = torch.nonzero(slots >= 0).flatten()
    return rows, slots[rows]


def _write(cache: torch.Tensor, write: tuple[torch.Tensor, torch.Tensor], kv: torch.Tensor) -> None:
    rows, slots = write
    if rows.numel():
        cache.index_copy_(0, slots, kv.index_select(0, rows).to(cache.dtype))


def attention_work(
    layout: BatchLayout,
    positions: np.ndarray,
    *,
    dcp_size: int,
    interleave: int,
    token_mask: np.ndarray | None = None,
) -> np.ndarray:
    """(query, key) pairs each rank scores this step, from the layout alone.

    Without DCP a rank scores its own rows over their whole context (position + 1 keys).
    With DCP it scores the replicated decode rows and every gathered row over its shard.
    ``token_mask`` (bool [T]) counts only the rows of those global tokens (e.g. decodes).
    """
    p, n, nd = layout.pcp_size, layout.padded_num_tokens, layout.num_replicated_decode_tokens
    rows_ctx = positions[layout.padded_gather_idx] + 1
    skip = layout.is_padding
    if token_mask is not None:
        skip = skip | ~np.asarray(token_mask, dtype=bool)[layout.padded_gather_idx]
    rows_ctx = np.where(skip, 0, rows_ctx).reshape(p, n)
    if dcp_size == 1:
        return rows_ctx.sum(axis=1)
    decode_ctx, rest_ctx = rows_ctx[0, :nd], rows_ctx[:, nd:].ravel()
    return np.array(
        [
            dcp_local_seq_lens(decode_ctx, dcp_size, r, interleave).sum()
            + dcp_local_seq_lens(rest_ctx, dcp_size, r, interleave).sum()
            for r in range(dcp_size)
        ],
        dtype=np.int64,
    )
