"""forward: the model over this rank's rows, attention through CPAttention.

``dcp_rest`` picks how the rows past the replicated-decode prefix attend under DCP
(``pcpflow.attention.context_parallel``): ``queries`` (gather the queries, merge partials), ``context``
(gather their requests' KV shards, attend locally) or ``auto`` (per step, the one that
moves fewer bytes, priced by ``pcpflow.layouts.accounting.plan_dcp_rest``). Every path is exact.

``cp_attention`` picks how attention crosses the ranks: ``allgather`` (the paths above,
vLLM's), or a ring over a KV cache sharded over it (dcp = pcp; ``pcpflow.attention.ring``):
``ring_pass_kv`` (keys travel), ``ring_pass_q`` (queries travel, partials come back in one
all-to-all) or ``ring_auto`` (per step, Meta's rule: ``pcpflow.layouts.accounting.
choose_ring_variant``). Decode rows always take pass-Q. The variant a step ran is
``state.attn.cp_attention`` (metrics.jsonl ``cp_attention``).

``attention`` picks the paged-attention kernel: ``reference`` (plain torch, any device),
``fused`` (``pcpflow.attention.fused``: flex_attention / SDPA with log-sum-exp) or
``auto`` (fused on CUDA). Steps the plan dispatched as ``full`` CUDA-graph steps run
through ``pcpflow.rank.cudagraph.DecodeGraphs`` at world size 1 with the fused kernel
(captured and replayed on CUDA, the same static forward eagerly elsewhere).

A hybrid KV cache (``RankContext.kv_groups``) runs one backend per KV group, over its group's
metadata (``StepState.attn_groups``), and the model calls them through ``GroupedAttention``,
which sends each layer to its group's. The step's choices are made once for all groups: the
ring variant (and its plan), and the DCP rest path (it depends on the layout, the lengths and
the layer shape, never on a block table: every group takes it). A decode graph holds a slot
mapping and a table per group the same way (``DecodeGraphs``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import torch
from pydantic import Field

from pcpflow.attention.context_parallel import CPAttention, layer_shape
from pcpflow.attention.fused import attention_kernel, resolve_attention
from pcpflow.attention.ring import RingAttention
from pcpflow.errors import Problem
from pcpflow.layouts.accounting import choose_ring_variant
from pcpflow.layouts.ring import CP_ATTENTION, plan_ring, rank_ring
from pcpflow.models.base import AttentionBackend
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
        cp_attention: Literal[CP_ATTENTION] = Field(  # type: ignore[valid-type]
            "allgather",
            description="how attention crosses the ranks: allgather (vLLM's paths) | ring_pass_kv | "
            "ring_pass_q | ring_auto (Meta's rule per step); rings need dcp = pcp > 1; with disagg=pd "
            "the prefill pool's (the decode pool's: disagg.decode_pool.cp_attention)",
        )
        attention: Literal["reference", "fused", "auto"] = Field(
            "auto",
            description="paged-attention kernel: reference (plain torch) | fused "
            "(flex_attention / SDPA with log-sum-exp) | auto (fused on CUDA, else reference)",
        )

    @classmethod
    def check_run(cls, config, run) -> list[Problem]:
        problems = []
        # NOTE: DCP over TP ranks gathers queries: a rank's contexts live on other PCP ranks' TP shards too.
        if config.dcp_rest == "context" and run.dcp > 1 and run.grid.dcp_tp > 1:
            problems.append(Problem("pipeline.forward.dcp_rest", config.dcp_rest,
                                    f"the context path needs DCP inside PCP only; dcp={run.dcp} spans "
                                    f"{run.grid.dcp_tp} TP ranks: use queries or auto"))
        if config.cp_attention != "allgather":
            if run.pcp == 1 or run.dcp != run.pcp:
                problems.append(Problem("pipeline.forward.cp_attention", config.cp_attention,
                                        f"a ring needs the KV sharded over the ring: pcp > 1 and dcp = pcp; "
                                        f"got pcp={run.pcp} dcp={run.dcp} (use dcp={max(run.pcp, 2)} "
                                        f"pcp={max(run.pcp, 2)}, or cp_attention=allgather)"))
        return problems

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
        if self.config.cp_attention != "allgather" and ctx.dcp.size > 1:
            backend = self._ring(state)
        else:
            backend = self._allgather(state)
        with torch.no_grad(), moe_forward(ctx, state):
            state.hidden, state.aux_hidden = ctx.model(
                local.input_ids, local.positions, backend, tuple(sorted(ctx.aux_layers))
            )
        return state

    def _allgather(self, state: StepState) -> AttentionBackend:
        ctx = self.ctx
        metas = state.attn_groups or (state.attn,)
        backends = [
            CPAttention(
                layout=state.layout,
                meta=meta,
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
            for meta in metas
        ]
        modes = [backend.dcp_rest.mode for backend in backends]
        # NOTE: the path is priced on the layout, lengths and shape alone: one for every group
        assert len(set(modes)) == 1, f"KV groups took different DCP rest paths: {modes}"
        for meta in metas:
            meta.dcp_rest, meta.cp_attention = modes[0], "allgather"
        return self._grouped(backends)

    def _ring(self, state: StepState) -> AttentionBackend:
        ctx, b, layout = self.ctx, state.batch, state.layout
        # NOTE: dcp = pcp (check_run): the DCP group is the PCP group, ranks in the same order.
        assert ctx.dcp.rank == ctx.pcp_rank and ctx.dcp.size == ctx.pcp_size
        spec = ctx.model.attn_spec
        variant = choose_ring_variant(
            self.config.cp_attention, layout, b.positions, shape=layer_shape(spec, ctx.kv_caches)
        )
        plan = plan_ring(layout, b.positions, variant=variant, interleave=ctx.config.kv.interleave)
        metas = state.attn_groups or (state.attn,)
        tables = b.block_tables[None] if state.attn_groups is None else b.group_block_tables
        backends = []
        for meta, table in zip(metas, tables, strict=True):
            meta.cp_attention = f"ring_{variant}"
            backends.append(RingAttention(
                ring=rank_ring(plan, ctx.pcp_rank, table, ctx.block_size, window=spec.windowed()),
                caches=ctx.kv_caches,
                spec=spec,
                block_size=ctx.block_size,
                block_tables=meta.block_tables,
                dcp=ctx.dcp,
                kernel=self.kernel,
            ))
        return self._grouped(backends)

    def _grouped(self, backends: list[AttentionBackend]) -> AttentionBackend:
        """One group's backend as it is; with KV groups, the router over theirs."""
        if len(backends) == 1:
            return backends[0]
        return GroupedAttention(backends, self.ctx.kv_groups.layer_group)


class GroupedAttention:
    """The ``AttentionBackend`` of a hybrid KV cache: layer ``l`` writes and attends through
    its KV group's backend (``KVGroups.layer_group[l]``), i.e. through that group's block tables
    into its cache tensor (``RankContext.kv_caches[l]``, shared with the same place of the other
    groups)."""

    def __init__(self, backends: Sequence[AttentionBackend], layer_group: np.ndarray) -> None:
        self.backends = list(backends)
        self.layer_group = [int(g) for g in layer_group]
        assert max(self.layer_group) < len(self.backends), "a layer's group has no backend"

    def __call__(self, layer: int, q, kv, sinks=None):
        return self.backends[self.layer_group[layer]](layer, q, kv, sinks)


def is_uniform_decode_only(state: StepState) -> bool:
    """A full step under mode ``full`` may hold prefills: only decodes are captured."""
    b = state.batch
    return not bool(b.is_prefilling[b.num_scheduled_tokens > 0].any())
