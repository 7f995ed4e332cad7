"""CUDA graphs with vLLM's modes: which size a step runs at, and the decode graphs.

``cudagraph_mode`` (vLLM's ``CUDAGraphMode``): ``none`` | ``piecewise`` |
``full_decode_only`` | ``full_and_piecewise`` | ``full``. Each step is *dispatched*
(``dispatch``): from the largest rank-local token count (the seed's
``get_num_tokens_for_dispatch``) to the smallest capture size that holds it, and a
runtime mode: ``full`` for uniform decode batches where the mode has full graphs (and
for every batch under ``full``), ``piecewise`` where the mode has piecewise graphs, else
``none``. A batch larger than the largest capture size runs unpadded, eagerly. Every
rank's rows are padded to that size by the plan (padded rows: slot PAD_SLOT_ID, never
written, never restored), the one padding mechanism pcpflow has.

On CPU every mode runs that padding and dispatch eagerly. On CUDA at world size 1 with
the fused kernel, ``full`` decode steps are captured and replayed (``DecodeGraphs``);
piecewise graphs (everything but attention, split by torch.compile) are not captured:
those steps run eagerly at their padded size. Collectives over gloo cannot be captured,
so nothing is captured at world size > 1 (docs/gpu.md).
"""

from __future__ import annotations

from bisect import bisect_left
from typing import TYPE_CHECKING, Literal

import torch

from pcpflow.errors import Problem
from pcpflow.pipeline.state import BatchDescriptor

if TYPE_CHECKING:
    from pcpflow.config.run import RunConfig
    from pcpflow.layouts.layout import BatchLayout
    from pcpflow.pipeline.context import RankContext
    from pcpflow.pipeline.state import StepState
    from pcpflow.scheduling.batch import GlobalBatch

CUDAGRAPH_MODES = ("none", "piecewise", "full_decode_only", "full_and_piecewise", "full")
# The modes with a full graph for uniform decode steps: only they ask is_uniform_decode.
FULL_DECODE_MODES = ("full_decode_only", "full_and_piecewise", "full")
CUDAGraphMode = Literal["none", "piecewise", "full_decode_only", "full_and_piecewise", "full"]

FULL_WITH_PCP = (
    "MRV2 PCP supports full CUDA graphs for decode-only routines: a PCP prefill is "
    "dispatched apart from the decodes. Use full_decode_only, full_and_piecewise, "
    "piecewise, or none"
)
"""vLLM's reason (``PCPManager.validate_config``) for refusing ``full`` with pcp > 1."""


def default_capture_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> list[int]:
    """vLLM's default list: 1, 2, 4, multiples of 8 below 256, then multiples of 16, up to
    ``min(2 * max_num_seqs, 512)``, and never past one step's token budget."""
    largest = min(2 * max_num_seqs, 512, max_num_batched_tokens)
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)]
    return [s for s in sizes if s <= largest]


def capture_sizes(cfg: RunConfig) -> list[int]:
    """The run's capture sizes, ascending (``cudagraph_capture_sizes``, else vLLM's)."""
    if cfg.cudagraph_capture_sizes is not None:
        return sorted(set(cfg.cudagraph_capture_sizes))
    s = cfg.scheduler
    return default_capture_sizes(s.max_num_seqs, s.max_num_batched_tokens)


def num_tokens_for_dispatch(layout: BatchLayout) -> int:
    """The largest real rank-local batch before graph padding."""
    return max(layout.per_rank_num_tokens.tolist()) if layout.pcp_size else 0  # NOTE: P ints: no numpy call


def is_uniform_decode(batch: GlobalBatch) -> bool:
    """Every scheduled request decodes the same number of tokens (1, or 1 + drafts):
    what a full decode graph was captured for. The same on every rank (global batch)."""
    scheduled = batch.num_scheduled_tokens > 0
    q = batch.num_scheduled_tokens[scheduled]
    if not q.size or batch.is_prefilling[scheduled].any():
        return False
    return bool((q == q[0]).all())


def dispatch(mode: str, num_tokens: int, uniform_decode: bool, sizes: list[int]) -> BatchDescriptor:
    """vLLM's dispatcher over pcpflow's modes (see module docstring)."""
    if mode == "none" or not sizes or num_tokens > sizes[-1] or num_tokens == 0:
        return BatchDescriptor("none", None)
    padded = sizes[bisect_left(sizes, num_tokens)]  # NOTE: sizes ascend (capture_sizes)
    if uniform_decode and mode in FULL_DECODE_MODES:
        return BatchDescriptor("full", padded)
    if mode in ("piecewise", "full_and_piecewise"):
        return BatchDescriptor("piecewise", padded)
    if mode == "full":
        return BatchDescriptor("full", padded)
    return BatchDescriptor("none", None)


def cudagraph_problems(cfg: RunConfig) -> list[Problem]:
    """``full`` with pcp > 1 (vLLM's reason), capture sizes past the buffers."""
    problems = []
    if cfg.cudagraph_mode == "full" and cfg.pcp > 1:
        problems.append(Problem("cudagraph_mode", "full", FULL_WITH_PCP))
    sizes, budget = cfg.cudagraph_capture_sizes, cfg.scheduler.max_num_batched_tokens
    if sizes is not None and (not sizes or min(sizes) < 1 or max(sizes) > budget):
        problems.append(
            Problem(
                "cudagraph_capture_sizes",
                sizes,
                f"a non-empty list of sizes in [1, scheduler.max_num_batched_tokens={budget}] "
                "(a padded step must fit the persistent buffers)",
            )
        )
    return problems


# --- decode graphs: the static-shape forward of a full decode step -------------------


class DecodeGraphs:
    """Full graphs of decode steps on one rank (world size 1), one per padded size.

    The graph reads only persistent storage: the buffers stage's ``input_ids`` /
    ``positions`` and this object's slot mappings, row contexts and row block tables
    (``width`` blocks per row; one mapping and table per KV group of a hybrid cache, a
    layer reading its group's), refreshed before each replay. Writes of padded rows go to
    one spare slot past the cache's last (``pcpflow.pipeline.context.with_pad_slot``). A size is
    captured on the first real step that runs at it: warm-up and capture batches are
    real batches, so they are partitioned exactly like the steps they replay for.
    ``capture=False`` runs the same static forward eagerly (CPU, and for tests).
    """

    def __init__(self, ctx: RankContext, kernel: str | None, *, capture: bool) -> None:
        from pcpflow.pipeline.context import with_pad_slot

        cfg, dev = ctx.config, ctx.device
        self.ctx, self.kernel, self.capture = ctx, kernel, capture
        block = cfg.kv.block_size
        lens = [len(r.prompt_token_ids) + r.max_output_tokens for r in ctx.requests]
        longest = max(lens, default=1)
        longest += cfg.num_speculative_tokens + 1
        self.width = -(-longest // block)
        if ctx.kv_groups is None:  # NOTE: a hybrid table's window entries may outnumber the blocks (null ones)
            self.width = min(self.width, cfg.kv.num_blocks)
        rows = cfg.scheduler.max_num_batched_tokens
        # NOTE: one slot mapping and one table per KV group (a hybrid cache: windowed layers'
        # groups hold their own blocks); a layer reads its group's (``layer_group``).
        groups = ctx.kv_groups
        num_groups = 1 if groups is None else groups.num_groups
        self.layer_group = [0] * ctx.model.num_layers if groups is None else groups.layer_group.tolist()
        self.slots = torch.full((num_groups, rows), -1, dtype=torch.int64, device=dev)
        self.row_ctx = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.row_start = torch.zeros(rows, dtype=torch.int64, device=dev)  # a window's first keys (sliding or chunked)
        self.row_tables = torch.zeros(num_groups, rows, self.width, dtype=torch.int64, device=dev)
        self.caches = [with_pad_slot(c) for c in ctx.kv_caches]
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, int]] = {}
        self.pool = None
        self.num_captured = 0
        self.num_replayed = 0

    def __call__(self, state: StepState) -> torch.Tensor:
        local, attn = state.local, state.attn
        assert local is not None and attn is not None
        n = local.num_padded_tokens
        for g, meta in enumerate(state.attn_groups or (attn,)):
            tables = meta.block_tables[meta.local_row_req_indices, : self.width]
            self.row_tables[g, :n, : tables.shape[1]].copy_(tables)
            self.slots[g, :n].copy_(meta.gathered_slot_mapping[:n])
        self.row_ctx[:n].copy_(attn.local_row_context_lens)
        if attn.local_row_starts is not None:
            self.row_start[:n].copy_(attn.local_row_starts)
        if not self.capture:
            return self._forward(local.input_ids, local.positions)
        if n not in self.graphs:
            self._capture(local.input_ids, local.positions)
        graph, out, ptr = self.graphs[n]
        # NOTE: the graph baked in the buffers' addresses; a new buffer would be ignored.
        assert local.input_ids.data_ptr() == ptr, "input buffers moved since capture"
        graph.replay()
        self.num_replayed += 1
        return out.clone()

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        backend = _StaticDecodeAttention(self, input_ids.shape[0])
        with torch.no_grad():
            hidden, _ = self.ctx.model(input_ids, positions, backend, ())
        return hidden

    def _capture(self, input_ids: torch.Tensor, positions: torch.Tensor) -> None:
        # Warm-up on a side stream (lazy inits, autotuning) as torch's capture recipe asks;
        # the warm-up's KV writes are the step's own (replay writes the same values again).
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._forward(input_ids, positions)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self._forward(input_ids, positions)
        self.graphs[input_ids.shape[0]] = (graph, out, input_ids.data_ptr())
        self.num_captured += 1


class _StaticDecodeAttention:
    """The attention backend inside a decode graph (pcp=1, dcp=1: no collectives)."""

    def __init__(self, graphs: DecodeGraphs, n: int) -> None:
        self.g, self.n = graphs, n

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        from pcpflow.attention.fused import fused_decode_attention
        from pcpflow.attention.paged import with_sinks

        g, n = self.g, self.n
        group = g.layer_group[layer]
        base = g.caches[layer]
        pad = base.shape[0] - 1
        slots = g.slots[group, :n]
        base.index_copy_(0, torch.where(slots >= 0, slots, pad), kv.to(base.dtype))
        ctx = g.ctx
        spec = ctx.model.attn_spec
        out, lse = fused_decode_attention(
            q,
            base[:pad],
            spec,
            g.row_tables[group, :n],
            g.row_ctx[:n],
            ctx.config.kv.block_size,
            g.row_start[:n] if spec.slides(layer) else None,
            kernel=g.kernel,
        )
        return with_sinks(out, lse, sinks)
