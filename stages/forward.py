"""forward: the model over this rank's rows, attention through CPAttention.

``dcp_rest`` picks how the rows past the replicated-decode prefix attend under DCP
(``pcpflow.cp_attention``): ``queries`` (gather the queries, merge partials), ``context``
(gather their requests' KV shards, attend locally) or ``auto`` (per step, the one that
moves fewer bytes, priced by ``pcpflow.accounting.plan_dcp_rest``). Every path is exact.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pcpflow.cp_attention import CPAttention
from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import StepState


@register
class ModelForward(Stage):
    kind = "model"
    slots = ("forward",)

    class Config(StageConfig):
        kind: Literal["model"] = "model"
        dcp_rest: Literal["auto", "queries", "context"] = Field(
            "auto",
            description="DCP path of the rest rows (prefill chunks, sharded decodes): "
            "queries | context | auto (per step, fewer bytes moved)",
        )

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
            dcp_rest=self.config.dcp_rest,
            dcp_comm_backend=ctx.config.dcp_comm_backend,
            dcp_heads=ctx.dcp_heads,
        )
        state.attn.dcp_rest = backend.dcp_rest.mode
        with torch.no_grad():
            state.hidden, state.aux_hidden = ctx.model(
                local.input_ids, local.positions, backend, tuple(sorted(ctx.aux_layers))
            )
        return state
