"""slots: the paged-KV slot of every gathered row, and what each query row reads.

The slot mapping is computed once on the global batch (with this rank's DCP shard:
other ranks' positions get -1) and expanded to the PCP-gathered view, where only the
canonical writer of each token keeps its slot (``pcpflow.slots.expand_to_gathered``).
With DCP it also sets up the context path of the rest rows (``ContextGather``: its
index arithmetic runs once per step, and only if a forward takes that path).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from pcpflow.dcp_context import ContextGather
from pcpflow.slots import compute_slot_mapping, dcp_local_seq_lens, expand_to_gathered
from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import AttentionMetadata, StepState


@register
class PagedSlots(Stage):
    kind = "paged"
    slots = ("slots",)

    class Config(StageConfig):
        kind: Literal["paged"] = "paged"

    def __call__(self, state: StepState) -> StepState:
        b, layout, ctx = state.batch, state.layout, self.ctx
        assert layout is not None, "slots runs after plan"
        kv, dcp = ctx.config.kv, ctx.dcp
        slot_mapping = compute_slot_mapping(
            b.positions,
            b.req_indices,
            b.block_tables,
            kv.block_size,
            dcp_size=dcp.size,
            dcp_rank=dcp.rank,
            interleave=kv.interleave,
        )
        gathered = expand_to_gathered(slot_mapping, layout)
        pad, gidx = layout.is_padding, layout.padded_gather_idx
        row_req = np.where(pad, 0, b.req_indices[gidx])
        # Causal: a row reads every key up to and including its own position.
        row_ctx = np.where(pad, 0, b.positions[gidx] + 1)
        rows = layout.rank_rows(ctx.pcp_rank)
        context = None
        if dcp.size > 1:
            context = ContextGather(
                layout,
                b.seq_lens,
                b.block_tables,
                row_ctx[rows],
                block_size=kv.block_size,
                dcp_size=dcp.size,
                dcp_rank=dcp.rank,
                interleave=kv.interleave,
                device=ctx.device,
            )
            row_ctx = dcp_local_seq_lens(row_ctx, dcp.size, dcp.rank, kv.interleave)
        to = lambda a: torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(ctx.device)
        state.attn = AttentionMetadata(
            gathered_slot_mapping=to(gathered),
            block_tables=to(b.block_tables),
            local_row_req_indices=to(row_req[rows]),
            local_row_context_lens=to(row_ctx[rows]),
            gathered_row_req_indices=to(row_req) if dcp.size > 1 else None,
            gathered_row_context_lens=to(row_ctx) if dcp.size > 1 else None,
            dcp_context=context,
        )
        return state
