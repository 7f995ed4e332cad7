"""The one builder of attention metadata: where each token's KV goes on this rank and what
each query row reads. The ``slots`` stage builds the target's, a drafter the metadata of
rows it makes up, and the verifier places the reference's KV with the same slot rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from pcpflow.layouts.dcp_context import ContextGather
from pcpflow.layouts.layout import BatchLayout
from pcpflow.layouts.slots import (
    Window,
    as_window,
    compute_slot_mapping,
    dcp_local_seq_lens,
    expand_to_gathered,
)
from pcpflow.layouts.tensors import int64_tensor


class KVGeometry(Protocol):
    """What the slot rule reads of the KV settings (``kv.*``)."""

    block_size: int
    interleave: int


@dataclass
class AttentionMetadata:
    """Where KV goes and what each query reads, written by ``slots``.

    ``gathered_slot_mapping`` covers the PCP-gathered view (rank-major, each rank padded):
    the slot this rank writes for each gathered row, or -1 (not the canonical writer,
    not this DCP rank's position, or padding). Row metadata (``row_*``) covers the rows
    whose attention this rank computes.
    """

    gathered_slot_mapping: torch.Tensor  # int64 [pcp_size * num_padded_tokens]
    block_tables: torch.Tensor  # int64 [R, max_blocks]: the global batch's block tables
    local_row_req_indices: torch.Tensor  # int64 [num_padded_tokens]
    local_row_context_lens: torch.Tensor  # int64 [num_padded_tokens]: keys each local row
    # reads from this rank's cache (its DCP shard when dcp > 1); 0 on padding rows
    gathered_row_req_indices: torch.Tensor | None = None  # [pcp*N] when dcp > 1
    gathered_row_context_lens: torch.Tensor | None = None  # [pcp*N] when dcp > 1
    # What the DCP context path of the rest rows gathers (dcp > 1; None: queries path only).
    dcp_context: ContextGather | None = None
    # The rest rows' DCP path the target's forward took ("queries" | "context"), set by
    # ``forward``: attention work is counted by it, a draft prefill over these rows follows it.
    dcp_rest: str | None = None
    # How the target's attention crossed the ranks ("allgather" | "ring_pass_kv" |
    # "ring_pass_q"), set by ``forward``: attention work and metrics.jsonl follow it.
    cp_attention: str | None = None
    # A window (``AttentionSpec.windowed``, sliding or chunked; None: none): the first key each
    # row reads on a windowed layer, in the index space of its context lens above: ``local_row_starts``
    # beside ``local_row_context_lens`` (this rank's DCP shard when dcp > 1),
    # ``gathered_row_starts`` beside ``gathered_row_context_lens``, ``context_row_starts`` the
    # local rows' in their whole context (the DCP context path's).
    window: Window | None = None
    local_row_starts: torch.Tensor | None = None
    gathered_row_starts: torch.Tensor | None = None
    context_row_starts: torch.Tensor | None = None


def rank_slot_mapping(
    positions: np.ndarray,
    req_indices: np.ndarray,
    block_tables: np.ndarray,
    kv: KVGeometry,
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


def gathered_rows(layout: BatchLayout, req_indices: np.ndarray, context_lens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int64 ``[P*N]`` each: the request (block-table row) and the keys of every row of the
    padded gathered view, 0 on padding rows; rank ``r``'s own rows are ``layout.rank_rows(r)``."""
    pad, gidx = layout.is_padding, layout.padded_gather_idx
    return (np.where(pad, 0, np.asarray(req_indices, dtype=np.int64)[gidx]),
            np.where(pad, 0, np.asarray(context_lens, dtype=np.int64)[gidx]))


def build_attention_metadata(
    layout: BatchLayout,
    positions: np.ndarray,
    req_indices: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray | None = None,
    *,
    kv: KVGeometry,
    pcp_rank: int,
    dcp_size: int,
    dcp_rank: int,
    device: torch.device,
    seq_lens: np.ndarray | None = None,
    window: Window | int | None = None,
) -> AttentionMetadata:
    """Metadata of tokens ``[T]`` (``positions``, block-table row ``req_indices``) planned by
    ``layout``, for PCP rank ``pcp_rank`` and DCP rank ``dcp_rank``.

    ``context_lens`` [T]: keys each token's query reads (default ``position + 1``, causal).
    ``seq_lens`` [R] (each request's ``num_computed + num_scheduled``): with dcp > 1, also
    prepare the rest rows' context path (``ContextGather``); without it they take the
    queries path. ``window``: the model's window (``AttentionSpec.windowed``; an int: a
    sliding one): each row's first key on a windowed layer (``Window.starts`` of its position) too."""
    window = as_window(window)
    positions = np.asarray(positions, dtype=np.int64)
    req_indices = np.asarray(req_indices, dtype=np.int64)
    ctx_lens = positions + 1 if context_lens is None else np.asarray(context_lens, dtype=np.int64)
    slots = rank_slot_mapping(positions, req_indices, block_tables, kv, dcp_size=dcp_size, dcp_rank=dcp_rank)
    row_req, row_ctx = gathered_rows(layout, req_indices, ctx_lens)
    rows = layout.rank_rows(pcp_rank)
    row_start = None if window is None else gathered_rows(layout, req_indices, window.starts(positions))[1]
    whole_start = row_start
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
        if row_start is not None:  # NOTE: the shard's keys before the start: positions only grow along a shard
            row_start = dcp_local_seq_lens(row_start, dcp_size, dcp_rank, kv.interleave)

    def to(a: np.ndarray) -> torch.Tensor:
        return int64_tensor(a, device)

    def maybe(a: np.ndarray | None) -> torch.Tensor | None:
        return None if a is None else to(a)

    return AttentionMetadata(
        gathered_slot_mapping=to(expand_to_gathered(slots, layout)),
        block_tables=to(block_tables),
        local_row_req_indices=to(row_req[rows]),
        local_row_context_lens=to(row_ctx[rows]),
        gathered_row_req_indices=to(row_req) if dcp_size > 1 else None,
        gathered_row_context_lens=to(row_ctx) if dcp_size > 1 else None,
        dcp_context=context,
        window=window,
        local_row_starts=maybe(None if row_start is None else row_start[rows]),
        gathered_row_starts=maybe(row_start if dcp_size > 1 else None),
        context_row_starts=maybe(whole_start[rows] if dcp_size > 1 and whole_start is not None else None),
    )
