"""forward: the model over this rank's rows, attention through CPAttention."""

from __future__ import annotations

from typing import Literal

import torch

from pcpflow.cp_attention import CPAttention
from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import StepState


@register
class ModelForward(Stage):
    kind = "model"
    slots = ("forward",)

    class Config(StageConfig):
        kind: Literal["model"] = "model"

    def __call__(self, state: StepState) -> StepState:
        ctx, local = self.ctx, state.local
        assert local is not None and state.attn is not None and state.layout is not None
        backend = CPAttention(
            layout=state.layout,
            meta=state.attn,
            caches=ctx.kv_caches,
            spec=ctx.model.attn_spec,
            block_size=ctx.block_size,
            pcp=ctx.pcp,
            dcp=ctx.dcp,
        )
        with torch.no_grad():
            state.hidden, state.aux_hidden = ctx.model(
                local.input_ids, local.positions, backend, tuple(sorted(ctx.aux_layers))
            )
        return state
