"""The one builder of attention metadata: where each token's KV goes on this rank and what
each query row reads. The ``slots`` stage builds the target's, a drafter the metadata of
rows it makes up, and the verifier places the reference's KV with the same slot rule.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pcpflow.layouts.dcp_context import ContextGather
from pcpflow.layouts.layout import BatchLayout
from pcpflow.layouts.slots import compute_slot_mapping, dcp_local_seq_lens, expand_to_gathered
from pcpflow.pipeline.state import AttentionMetadata

if TYPE_CHECKING:
    from pcpflow.config.run import KVConfig


def rank_slot_mapping(
    positions: np.ndarray,
    req_indices: np.ndarray,
    block_tables: np.ndarray,
    kv: KVConfig,
    *,
    dcp_size: int = 1,
    dcp_rank: int = 0,
) -> np.ndarray:
    """int64 ``[T]``: the slot of each token in this DCP rank's cache, -1 where another DCP
    rank holds the position (``pcpflow.layouts.slots.compute_slot_mapping``)."""
    return compute_slot_mapping(
        positions,
        req_indices,
        block_tables,
        kv.block_size,
        dcp_size=dcp_size,
        dcp_rank=dcp_rank,
        interleave=kv.interleave,
    )


def build_attention_metadata(
    layout: BatchLayout,
    positions: np.ndarray,
    req_indices: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray | None = None,
    *,
    kv: KVConfig,
    pcp_rank: int,
    dcp_size: int,
    dcp_rank: int,
    device: torch.device,
    seq_lens: np.ndarray | None = None,
) -> AttentionMetadata:
    """Metadata of tokens ``[T]`` (``positions``, block-table row ``req_indices``) planned by
    ``layout``, for PCP rank ``pcp_rank`` and DCP rank ``dcp_rank``.

    ``context_lens`` [T]: keys each token's query reads (default ``position + 1``, causal).
    ``seq_lens`` [R] (each request's ``num_computed + num_scheduled``): with dcp > 1, also
    prepare the rest rows' context path (``ContextGather``); without it they take the
    queries path."""
    positions = np.asarray(positions, dtype=np.int64)
    req_indices = np.asarray(req_indices, dtype=np.int64)
    ctx_lens = positions + 1 if context_lens is None else np.asarray(context_lens, dtype=np.int64)
    slots = rank_slot_mapping(positions, req_indices, block_tables, kv, dcp_size=dcp_size, dcp_rank=dcp_rank)
    pad, gidx = layout.is_padding, layout.padded_gather_idx
    row_req = np.where(pad, 0, req_indices[gidx])
    row_ctx = np.where(pad, 0, ctx_lens[gidx])
    rows = layout.rank_rows(pcp_rank)
    context = None
    if dcp_size > 1:
        if seq_lens is not None:
            context = ContextGather(
                layout,
                seq_lens,
                block_tables,
                row_ctx[rows],
                block_size=kv.block_size,
                dcp_size=dcp_size,
                dcp_rank=dcp_rank,
                interleave=kv.interleave,
                device=device,
            )
        row_ctx = dcp_local_seq_lens(row_ctx, dcp_size, dcp_rank, kv.interleave)

    def to(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)

    return AttentionMetadata(
        gathered_slot_mapping=to(expand_to_gathered(slots, layout)),
        block_tables=to(block_tables),
        local_row_req_indices=to(row_req[rows]),
        local_row_context_lens=to(row_ctx[rows]),
        gathered_row_req_indices=to(row_req) if dcp_size > 1 else None,
        gathered_row_context_lens=to(row_ctx) if dcp_size > 1 else None,
        dcp_context=context,
    )
