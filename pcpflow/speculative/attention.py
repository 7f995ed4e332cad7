"""The attention backends of a drafter: a draft prefill over this step's tokens (the
target's layout and slot mapping, the draft's own caches) and the later draft steps that
every rank computes alike (replicated rows)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pcpflow.attention.context_parallel import CPAttention
from pcpflow.attention.metadata import build_attention_metadata
from pcpflow.layouts import accounting
from pcpflow.layouts.layout import BatchLayout
from pcpflow.models.base import AttentionSpec
from pcpflow.speculative.comm import draft_comm

if TYPE_CHECKING:
    from pcpflow.pipeline.context import RankContext
    from pcpflow.pipeline.state import StepState


def prefill_attention(
    ctx: RankContext, state: StepState, caches: list[torch.Tensor], spec: AttentionSpec
) -> CPAttention:
    """The attention backend of a draft prefill over this step's tokens: the target's
    layout and slot mapping (``state.attn``), the draft's own ``caches``; under DCP its
    rest rows take the path the target's took."""
    assert state.layout is not None and state.attn is not None, "the draft slot runs after slots"
    return CPAttention(
        layout=state.layout,
        meta=state.attn,
        caches=caches,
        spec=spec,
        block_size=ctx.block_size,
        pcp=draft_comm(ctx.pcp),
        dcp=draft_comm(ctx.dcp),
        dcp_rest=state.attn.dcp_rest or "auto",
        dcp_comm_backend=ctx.config.dcp_comm_backend,
        dcp_heads=draft_comm(ctx.dcp_heads),
    )


def replicated_layout(num_rows: int, ctx: RankContext) -> BatchLayout:
    """``num_rows`` decode rows on every PCP rank (rank 0 the canonical writer): the layout
    accounting counts a replicated forward by (``pcpflow.layouts.accounting``)."""
    return accounting.replicated_layout(num_rows, pcp_size=ctx.pcp_size, dcp_size=ctx.layout_dcp_size)


def replicated_attention(
    ctx: RankContext,
    block_tables: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    caches: list[torch.Tensor],
    spec: AttentionSpec,
    context_lens: np.ndarray | None = None,
) -> CPAttention:
    """The attention backend of rows that every rank computes alike: row ``i`` is at
    ``positions[i]`` of block-table row ``req_indices[i]`` and reads ``context_lens[i]``
    entries (default ``position + 1``: causal; more reads later rows of its block, which
    must be written in the same call). Every rank writes the rows' KV into its cache (its
    DCP shard with dcp > 1, partials merged across DCP), so every rank gets the same output.
    """
    positions = np.asarray(positions, dtype=np.int64)
    req_indices = np.asarray(req_indices, dtype=np.int64)
    layout = replicated_layout(len(positions), ctx)
    ctx_lens = positions + 1 if context_lens is None else np.asarray(context_lens, dtype=np.int64)
    meta = build_attention_metadata(
        layout,
        positions,
        req_indices,
        block_tables,
        ctx_lens,
        kv=ctx.config.kv,
        pcp_rank=ctx.pcp_rank,
        dcp_size=ctx.dcp_size,
        dcp_rank=ctx.dcp_rank,
        device=ctx.device,
        window=spec.windowed(),
    )
    return CPAttention(
        layout=layout,
        meta=meta,
        caches=caches,
        spec=spec,
        block_size=ctx.block_size,
        pcp=draft_comm(ctx.pcp),
        dcp=draft_comm(ctx.dcp),
        dcp_comm_backend=ctx.config.dcp_comm_backend,
        dcp_heads=draft_comm(ctx.dcp_heads),
    )


class KVWriter:
    """An ``AttentionBackend`` that only writes: a layer called with it stores its KV for
    these rows and gets zeros back (context entries made from target features)."""

    def __init__(self, backend: CPAttention) -> None:
        self.backend = backend

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self.backend.write(layer, kv)
        spec = self.backend.spec
        return q.new_zeros((q.shape[0], spec.num_heads, spec.v_dim))
