"""slots: the paged-KV slot of every gathered row, and what each query row reads.

The slot mapping is computed once on the global batch (with this rank's DCP shard:
other ranks' positions get -1) and expanded to the PCP-gathered view, where only the
canonical writer of each token keeps its slot (``pcpflow.layouts.slots.expand_to_gathered``).
With DCP it also sets up the context path of the rest rows (``ContextGather``: its
index arithmetic runs once per step, and only if a forward takes that path). The
arithmetic is ``pcpflow.attention.metadata``'s, shared with the drafters and the verifier.

A hybrid KV cache (``RankContext.kv_groups``: windowed layers give their old blocks back) has
one block table per KV group (``GlobalBatch.group_block_tables``), so one metadata per group
(``StepState.attn_groups``), built alike from its group's tables; ``state.attn`` is group 0's.
"""

from __future__ import annotations

from typing import Literal

from pcpflow.attention.metadata import build_attention_metadata
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class PagedSlots(Stage):
    kind = "paged"
    slots = ("slots",)

    class Config(StageConfig):
        kind: Literal["paged"] = "paged"

    def __call__(self, state: StepState) -> StepState:
        b, layout, ctx = state.batch, state.layout, self.ctx
        assert layout is not None, "slots runs after plan"
        groups = ctx.kv_groups
        if groups is None:
            state.attn = self._metadata(state, b.block_tables)
            return state
        tables = b.group_block_tables
        if tables is None or tables.shape[0] != groups.num_groups:
            raise ValueError(f"a KV cache of {groups.num_groups} groups needs the batch's group_block_tables "
                             f"[{groups.num_groups}, R, W]; got {None if tables is None else list(tables.shape)}")
        state.attn_groups = tuple(self._metadata(state, t) for t in tables)
        state.attn = state.attn_groups[0]
        return state

    def _metadata(self, state: StepState, block_tables):
        b, ctx = state.batch, self.ctx
        return build_attention_metadata(
            state.layout,
            b.positions,
            b.req_indices,
            block_tables,
            kv=ctx.config.kv,
            pcp_rank=ctx.pcp_rank,
            dcp_size=ctx.dcp_size,
            dcp_rank=ctx.dcp_rank,
            device=ctx.device,
            seq_lens=b.seq_lens,
            # NOTE: every group's, a full group's too: its layers do not slide (``spec.slides``),
            # and the backends check one window against the model's
            window=ctx.model.attn_spec.windowed(),
        )
