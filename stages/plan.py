"""plan: where each token runs (DualChunkSwap across PCP ranks), via pcpflow.layout."""

from __future__ import annotations

from functools import partial
from typing import Literal

from pydantic import Field

from pcpflow.layout import plan_layout
from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import StepState


@register
class DualChunkSwapPlan(Stage):
    kind = "dual_chunk_swap"
    slots = ("plan",)

    class Config(StageConfig):
        kind: Literal["dual_chunk_swap"] = "dual_chunk_swap"
        pad_to_multiple: int = Field(
            1,
            ge=1,
            description="pad every rank's rows up to a multiple of this (as CUDA-graph "
            "sizes do); 1 = pad only to the largest rank",
        )

    def __call__(self, state: StepState) -> StepState:
        cfg, b = self.ctx.config, state.batch
        plan = partial(
            plan_layout,
            b.num_scheduled_tokens,
            b.is_prefilling,
            pcp_size=self.ctx.pcp_size,
            dcp_size=self.ctx.layout_dcp_size,
            shard_decodes=cfg.shard_decodes,
            num_computed_tokens=b.num_computed_tokens,
            decode_assignment=cfg.decode.assignment,
        )
        layout = plan()
        m = self.config.pad_to_multiple
        if m > 1:
            largest = layout.padded_num_tokens
            # Never past the persistent buffers (one step's whole token budget).
            padded = max(largest, min(-(-largest // m) * m, cfg.scheduler.max_num_batched_tokens))
            if padded != largest:
                layout = plan(padded_num_tokens=padded)
        state.layout = layout
        return state
