"""plan: where each token runs (DualChunkSwap across PCP ranks), via pcpflow.layouts.layout.

The step is dispatched here (``pcpflow.rank.cudagraph.dispatch``): from the largest rank's
real row count to a CUDA-graph size, and every rank's rows are padded to it.
"""

from __future__ import annotations

from typing import Literal

from pcpflow.layouts.layout import pad_layout, plan_layout
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState
from pcpflow.rank.cudagraph import (
    FULL_DECODE_MODES,
    capture_sizes,
    dispatch,
    is_uniform_decode,
    num_tokens_for_dispatch,
)


@register
class DualChunkSwapPlan(Stage):
    kind = "dual_chunk_swap"
    slots = ("plan",)

    class Config(StageConfig):
        kind: Literal["dual_chunk_swap"] = "dual_chunk_swap"

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.sizes = capture_sizes(ctx.config)

    def __call__(self, state: StepState) -> StepState:
        cfg, b = self.ctx.config, state.batch
        layout = plan_layout(
            b.num_scheduled_tokens,
            b.is_prefilling,
            pcp_size=self.ctx.pcp_size,
            dcp_size=self.ctx.layout_dcp_size,
            shard_decodes=cfg.shard_decodes,
            num_computed_tokens=b.num_computed_tokens,
            decode_assignment=cfg.decode.assignment,
        )
        mode = cfg.cudagraph_mode
        uniform = mode in FULL_DECODE_MODES and is_uniform_decode(b)
        desc = dispatch(mode, num_tokens_for_dispatch(layout), uniform, self.sizes)
        if desc.num_tokens is not None and desc.num_tokens != layout.padded_num_tokens:
            layout = pad_layout(layout, desc.num_tokens)
        state.layout, state.dispatch = layout, desc
        return state
