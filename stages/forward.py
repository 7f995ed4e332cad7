"""forward: the model over this rank's rows, attention through CPAttention.

``dcp_rest`` picks how the rows past the replicated-decode prefix attend under DCP
(``pcpflow.attention.context_parallel``): ``queries`` (gather the queries, merge partials), ``context``
(gather their requests' KV shards, attend locally) or ``auto`` (per step, the one that
moves fewer bytes, priced by ``pcpflow.layouts.accounting.plan_dcp_rest``). Every path is exact.

``attention`` picks the paged-attention kernel: ``reference`` (plain torch, any device),
``fused`` (``pcpflow.attention.fused``: flex_attention / SDPA with log-sum-exp) or
``auto`` (fused on CUDA). Steps the plan dispatched as ``full`` CUDA-graph steps run
through ``pcpflow.rank.cudagraph.DecodeGraphs`` at world size 1 with the fused kernel
(captured and replayed on CUDA, the same static forward eagerly elsewhere).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from pcpflow.attention.context_parallel import CPAttention
from pcpflow.attention.fused import attention_kernel, resolve_attention
from pcpflow.errors import Problem
from pcpflow.parallel.moe_dispatch import moe_forward
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


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
        attention: Literal["reference", "fused", "auto"] = Field(
            "auto",
            description="paged-attention kernel: reference (plain torch) | fused "
            "(flex_attention / SDPA with log-sum-exp) | auto (fused on CUDA, else reference)",
        )

    @classmethod
    def check_run(cls, config, run) -> list[Problem]:
        # NOTE: DCP over TP ranks gathers queries: a rank's contexts live on other PCP ranks' TP shards too.
        if config.dcp_rest == "context" and run.dcp > 1 and run.grid.dcp_tp > 1:
            return [Problem("pipeline.forward.dcp_rest", config.dcp_rest,
                            f"the context path needs DCP inside PCP only; dcp={run.dcp} spans "
                            f"{run.grid.dcp_tp} TP ranks: use queries or auto")]
        return []

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.kernel = attention_kernel(config.attention, ctx.device)
        self.graphs = None
        fused = resolve_attention(config.attention, ctx.device) == "fused"
        # NOTE: the reference run stays eager: verification compares graphs with it. MoE
        # routing sizes its expert batches from the data (nonzero), which no graph holds.
        has_moe = any("MoE" in type(m).__name__ for m in ctx.model.modules())
        eligible = fused and ctx.world.size == 1 and not ctx.is_reference and not has_moe
        if eligible and ctx.config.cudagraph_mode != "none":
            from pcpflow.rank.cudagraph import DecodeGraphs

            self.graphs = DecodeGraphs(ctx, None, capture=ctx.device.type == "cuda")

    def __call__(self, state: StepState) -> StepState:
        ctx, local = self.ctx, state.local
        assert local is not None and state.attn is not None and state.layout is not None
        mode = state.dispatch.runtime_mode if state.dispatch is not None else "none"
        counts = ctx.extras.setdefault("cudagraph", {"steps": {}, "graph_forward_steps": 0})
        counts["steps"][mode] = counts["steps"].get(mode, 0) + 1
        if self.graphs is not None and mode == "full" and is_uniform_decode_only(state) and not ctx.aux_layers:
            state.attn.dcp_rest = "queries"
            state.hidden, state.aux_hidden = self.graphs(state), {}
            counts["graph_forward_steps"] += 1
            counts["captured"], counts["replayed"] = self.graphs.num_captured, self.graphs.num_replayed
            return state
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
            kernel=self.kernel,
            dcp_heads=ctx.dcp_heads,
        )
        state.attn.dcp_rest = backend.dcp_rest.mode
        with torch.no_grad(), moe_forward(ctx, state):
            state.hidden, state.aux_hidden = ctx.model(
                local.input_ids, local.positions, backend, tuple(sorted(ctx.aux_layers))
            )
        return state


def is_uniform_decode_only(state: StepState) -> bool:
    """A full step under mode ``full`` may hold prefills: only decodes are captured."""
    b = state.batch
    return not bool(b.is_prefilling[b.num_scheduled_tokens > 0].any())
