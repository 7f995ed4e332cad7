"""slots: the paged-KV slot of every gathered row, and what each query row reads.

The slot mapping is computed once on the global batch (with this rank's DCP shard:
other ranks' positions get -1) and expanded to the PCP-gathered view, where only the
canonical writer of each token keeps its slot (``pcpflow.layouts.slots.expand_to_gathered``).
With DCP it also sets up the context path of the rest rows (``ContextGather``: its
index arithmetic runs once per step, and only if a forward takes that path). The
arithmetic is ``pcpflow.attention.metadata``'s, shared with the drafters and the verifier.
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
        state.attn = build_attention_metadata(
            layout,
            b.positions,
            b.req_indices,
            b.block_tables,
            kv=ctx.config.kv,
            pcp_rank=ctx.pcp_rank,
            dcp_size=ctx.dcp_size,
            dcp_rank=ctx.dcp_rank,
            device=ctx.device,
            seq_lens=b.seq_lens,
            window=ctx.model.attn_spec.windowed(),
        )
        return state
