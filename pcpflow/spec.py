"""Speculative decoding: what a draft stage needs to propose tokens under PCP and DCP.

A drafter is a stage in the ``draft`` slot. It runs on every rank after ``restore`` and
sets ``state.draft_token_ids`` ``[R, k]`` (``-1`` = none): per batch row, the tokens it
proposes to follow the request's newest token. The scheduler verifies them next step
(``pcpflow.scheduler``). The scheduler is global, so **every rank must propose the same
tokens**: every input to a proposal must be identical on all ranks — a restored
(all-gathered) tensor, or a replicated computation on such inputs.

One drafting step has three parts (``stages/mtp.py`` reads top to bottom as an example):

1. **Draft prefill**, on the PCP-local batch, like the target's forward: the draft model
   runs on ``state.local``'s rows (per-token inputs taken from the global batch through
   the layout with ``to_local``, e.g. ``next_token_ids``) with ``prefill_attention``:
   ``CPAttention`` over the target's layout and slot mapping, on the draft's own caches
   (``allocate_caches``), so its KV is gathered over PCP and sharded over DCP exactly like
   the target's. ``restore_hidden`` brings its hidden states back to the global batch.
2. **Where drafting starts**, ``draft_start``: per request that sampled this step, how
   many drafts were accepted, the token whose sample is the newest token, and the newest
   token with its position (greedy verification, ``scheduler.accept_drafts``).
3. **Later draft steps, replicated**: every rank runs every request's next draft rows
   (``replicated_attention``: a layout of decode rows only, KV written by every rank into
   its full cache, or into its DCP shard with partials merged over DCP).

``scatter_proposals`` turns the proposals into ``state.draft_token_ids``. Draft
collectives are accounted as ``draft_<purpose>`` (``draft_kv_gather``, ``draft_restore``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pcpflow.comm import Comm
from pcpflow.cp_attention import CPAttention
from pcpflow.layout import BatchLayout, plan_layout
from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer
from pcpflow.scheduler import accept_drafts
from pcpflow.slots import compute_slot_mapping, dcp_local_seq_lens, expand_to_gathered
from pcpflow.stage import StageConfig
from pcpflow.state import AttentionMetadata

if TYPE_CHECKING:
    from pcpflow.batch import GlobalBatch
    from pcpflow.context import RankContext
    from pcpflow.models.base import CausalLM
    from pcpflow.state import StepState


class DraftConfig(StageConfig):
    """Base of a drafter's ``Config``: the scheduler reserves room for and verifies up to
    ``num_speculative_tokens`` drafts per request."""

    num_speculative_tokens: int = Field(2, ge=1, description="tokens proposed per request and step")


# -- what the step decided -----------------------------------------------------------------


class DraftStart(NamedTuple):
    """Where drafting starts, for the M batch rows that sampled this step (finishing
    prefills and decodes with tokens scheduled), in batch order."""

    rows: np.ndarray  # int64 [M]: batch rows
    num_accepted: np.ndarray  # int64 [M]: drafts accepted this step (0 for prefills)
    last_token_indices: np.ndarray  # int64 [M]: global token whose sample is the newest token
    next_token_ids: np.ndarray  # int64 [M]: the newest token (the target's last sample)
    next_positions: np.ndarray  # int64 [M]: its position (= num_computed_tokens after update)


def draft_start(batch: GlobalBatch, sampled_token_ids: np.ndarray) -> DraftStart:
    """Greedy verification of this step's drafts (the scheduler's own ``accept_drafts``),
    as a drafter needs it: a decode row with drafts d_1..d_k and samples s_0..s_k that
    accepts a drafts continues from s_a, sampled at its token a, at position c + a + 1."""
    sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
    acc = accept_drafts(batch, sampled)
    rows = np.flatnonzero(acc.num_new_tokens > 0)
    accepted = acc.num_accepted[rows]
    sample = acc.sample_start[rows] + accepted
    last = batch.logits_indices[sample]
    return DraftStart(rows, accepted, last, sampled[sample], batch.positions[last] + 1)


def next_token_ids(
    batch: GlobalBatch,
    sampled_token_ids: np.ndarray,
    prompts: Mapping[int, np.ndarray] | None = None,
) -> np.ndarray:
    """int64 ``[T]``: the token that follows each global token (what an MTP head embeds).

    Where the token is sampled (a finishing prompt's last token, every token of a decode
    row) it is the sample — for verified drafts that is the accepted draft itself, and
    past the first rejection it is the target's correction. Elsewhere it is the next
    input token; the last token of an unfinished prompt chunk is followed by the prompt
    token after the chunk (from ``prompts``, req_id -> prompt ids; -1 without it).
    """
    sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
    out = np.full(batch.num_tokens, -1, dtype=np.int64)
    out[:-1] = batch.input_ids[1:]
    q, c = batch.num_scheduled_tokens, batch.num_computed_tokens
    ends = batch.query_start_loc[1:][q > 0] - 1
    out[ends] = -1
    unfinished = np.flatnonzero(batch.is_prefilling & (q > 0) & (c + q < batch.prompt_lens))
    if prompts is not None:
        for r in unfinished.tolist():
            out[batch.query_start_loc[r + 1] - 1] = prompts[int(batch.req_ids[r])][c[r] + q[r]]
    out[batch.logits_indices] = sampled
    return out


def scatter_proposals(num_reqs: int, rows: np.ndarray, proposals: np.ndarray) -> np.ndarray:
    """``state.draft_token_ids``: ``proposals [M, k]`` of batch ``rows``, -1 elsewhere."""
    proposals = np.asarray(proposals, dtype=np.int64)
    out = np.full((num_reqs, proposals.shape[1] if proposals.ndim == 2 else 0), -1, dtype=np.int64)
    out[rows] = proposals
    return out


def request_prompts(ctx: RankContext) -> dict[int, np.ndarray]:
    """req_id -> prompt token ids of the run's workload (the same on every rank)."""
    return {r.req_id: r.prompt_token_ids for r in ctx.requests}


# -- the draft prefill on the PCP-local batch ---------------------------------------------


def to_local(state: StepState, values: np.ndarray) -> torch.Tensor:
    """A per-global-token int array ``[T]`` as this rank's local rows (``values[gather]``,
    0 on padding), on the local batch's device."""
    local = state.local
    assert local is not None, "to_local runs after buffers"
    picked = torch.from_numpy(np.ascontiguousarray(np.asarray(values)[local.gather_idx]))
    return picked.to(local.input_ids.device).masked_fill(local.is_padding, 0)


def prefill_attention(
    ctx: RankContext, state: StepState, caches: list[torch.Tensor], spec: AttentionSpec
) -> CPAttention:
    """The attention backend of a draft prefill over this step's tokens: the target's
    layout and slot mapping (``state.attn``), the draft's own ``caches``; under DCP its
    rest rows take the path the target's took."""
    assert state.layout is not None and state.attn is not None, "the draft slot runs after slots"
    return CPAttention(
        layout=state.layout,
        meta=state.attn,
        caches=caches,
        spec=spec,
        block_size=ctx.block_size,
        pcp=draft_comm(ctx.pcp),
        dcp=draft_comm(ctx.dcp),
        dcp_rest=state.attn.dcp_rest or "auto",
        dcp_comm_backend=ctx.config.dcp_comm_backend,
        dcp_heads=draft_comm(ctx.dcp_heads),
    )


def restore_hidden(
    ctx: RankContext, state: StepState, hidden: torch.Tensor, tokens: np.ndarray | None = None
) -> torch.Tensor:
    """Local draft hidden states ``[N, d]`` back in global order: all-gathered over PCP
    (accounted as ``draft_restore``) and indexed by ``hidden_restore_idx``, as the target's
    are. ``tokens`` (global token indices) picks rows: ``[len(tokens), d]``; default all."""
    layout = state.layout
    assert layout is not None
    gathered = ctx.pcp.all_gather(hidden, "draft_restore")
    idx = layout.hidden_restore_idx if tokens is None else layout.hidden_restore_idx[tokens]
    return gathered.index_select(0, torch.from_numpy(np.ascontiguousarray(idx)).to(gathered.device))


# -- later draft steps, replicated --------------------------------------------------------


def replicated_layout(num_rows: int, ctx: RankContext) -> BatchLayout:
    """``num_rows`` decode rows on every PCP rank (rank 0 the canonical writer)."""
    return plan_layout(
        np.ones(num_rows, dtype=np.int64),
        np.zeros(num_rows, dtype=bool),
        pcp_size=ctx.pcp_size,
        dcp_size=ctx.layout_dcp_size,
        shard_decodes=False,
    )


def replicated_attention(
    ctx: RankContext,
    block_tables: np.ndarray,
    req_indices: np.ndarray,
    positions: np.ndarray,
    caches: list[torch.Tensor],
    spec: AttentionSpec,
    context_lens: np.ndarray | None = None,
) -> CPAttention:
    """The attention backend of rows that every rank computes alike: row ``i`` is at
    ``positions[i]`` of block-table row ``req_indices[i]`` and reads ``context_lens[i]``
    entries (default ``position + 1``: causal; more reads later rows of its block, which
    must be written in the same call). Every rank writes the rows' KV into its cache (its
    DCP shard with dcp > 1, partials merged across DCP), so every rank gets the same output.
    """
    positions = np.asarray(positions, dtype=np.int64)
    req_indices = np.asarray(req_indices, dtype=np.int64)
    layout = replicated_layout(len(positions), ctx)
    ctx_lens = positions + 1 if context_lens is None else np.asarray(context_lens, dtype=np.int64)
    meta = attention_metadata(ctx, layout, positions, req_indices, block_tables, ctx_lens)
    return CPAttention(
        layout=layout,
        meta=meta,
        caches=caches,
        spec=spec,
        block_size=ctx.block_size,
        pcp=draft_comm(ctx.pcp),
        dcp=draft_comm(ctx.dcp),
        dcp_comm_backend=ctx.config.dcp_comm_backend,
        dcp_heads=draft_comm(ctx.dcp_heads),
    )


def attention_metadata(
    ctx: RankContext,
    layout: BatchLayout,
    positions: np.ndarray,
    req_indices: np.ndarray,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
) -> AttentionMetadata:
    """Slot mapping and row metadata of tokens ``[T]`` planned by ``layout`` (what the
    ``slots`` stage computes for the target), for any rows a drafter makes up."""
    kv, dcp = ctx.config.kv, ctx.dcp
    slots = compute_slot_mapping(
        positions,
        req_indices,
        block_tables,
        kv.block_size,
        dcp_size=dcp.size,
        dcp_rank=dcp.rank,
        interleave=kv.interleave,
    )
    pad, gidx = layout.is_padding, layout.padded_gather_idx
    row_req = np.where(pad, 0, np.asarray(req_indices)[gidx])
    row_ctx = np.where(pad, 0, np.asarray(context_lens)[gidx])
    if dcp.size > 1:
        row_ctx = dcp_local_seq_lens(row_ctx, dcp.size, dcp.rank, kv.interleave)
    rows = layout.rank_rows(ctx.pcp_rank)

    def to(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(ctx.device)

    return AttentionMetadata(
        gathered_slot_mapping=to(expand_to_gathered(slots, layout)),
        block_tables=to(block_tables),
        local_row_req_indices=to(row_req[rows]),
        local_row_context_lens=to(row_ctx[rows]),
        gathered_row_req_indices=to(row_req) if dcp.size > 1 else None,
        gathered_row_context_lens=to(row_ctx) if dcp.size > 1 else None,
    )


class KVWriter:
    """An ``AttentionBackend`` that only writes: a layer called with it stores its KV for
    these rows and gets zeros back (context entries made from target features)."""

    def __init__(self, backend: CPAttention) -> None:
        self.backend = backend

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        self.backend.write(layer, kv)
        spec = self.backend.spec
        return q.new_zeros((q.shape[0], spec.num_heads, spec.v_dim))


# -- small pieces -------------------------------------------------------------------------


class DraftComm(Comm):
    """``comm``'s group, its traffic accounted as ``draft_<purpose>`` so that draft
    collectives never mix with the target's."""

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm.group, comm.rank, comm.size, comm.stats, comm.copies)

    def all_gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_gather(t, f"draft_{purpose}")

    def all_to_all(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_to_all(t, f"draft_{purpose}")

    def broadcast(self, t: torch.Tensor, src: int, purpose: str) -> torch.Tensor:
        return super().broadcast(t, src, f"draft_{purpose}")

    def all_reduce(self, t: torch.Tensor, purpose: str, op: str = "sum") -> torch.Tensor:
        return super().all_reduce(t, f"draft_{purpose}", op)

    def reduce_scatter(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().reduce_scatter(t, f"draft_{purpose}")


def draft_comm(comm: Comm) -> DraftComm:
    """``comm`` with its traffic accounted under ``draft_<purpose>``."""
    return DraftComm(comm)


def shard_drafter(ctx: RankContext, module: nn.Module) -> nn.Module:
    """A draft model cut to this TP rank's heads and MLP slice (``pcpflow.tensor_parallel``),
    its all-reduces accounted as ``draft_tp_all_reduce``."""
    from pcpflow.tensor_parallel import shard_model

    return shard_model(module, draft_comm(ctx.tp), ctx.tp.rank, ctx.tp.size)


def allocate_caches(ctx: RankContext, spec: AttentionSpec, num_layers: int) -> list[torch.Tensor]:
    """A draft model's paged caches: the target's slots (``kv.num_blocks * kv.block_size``
    per layer, so the target's block tables and slot mappings serve it), NaN-filled."""
    shape = (ctx.config.kv.num_blocks * ctx.block_size, spec.entry_dim)
    return [
        torch.full(shape, float("nan"), dtype=ctx.dtype, device=ctx.device)
        for _ in range(num_layers)
    ]


def greedy(model: CausalLM, hidden: torch.Tensor) -> np.ndarray:
    """Argmax token of each normed hidden row under the target's LM head (ties: lowest id)."""
    return model.compute_logits(hidden).argmax(dim=-1).cpu().numpy().astype(np.int64)


class MLALayerConfig(BaseModel):
    """A draft decoder layer with multi-head latent attention (DeepSeek-style, absorbed)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_heads: int = Field(4, gt=0, description="query heads")
    q_lora_rank: int | None = Field(
        None, gt=0, description="query compression rank (None: full q_proj)"
    )
    kv_lora_rank: int = Field(32, gt=0, description="width of the cached latent")
    qk_nope_head_dim: int = Field(16, gt=0, description="per-head query/key dims without rope")
    qk_rope_head_dim: int = Field(16, gt=0, multiple_of=2, description="per-head rope dims")
    v_head_dim: int = Field(16, gt=0, description="per-head value dim")
    intermediate_size: int = Field(128, gt=0, description="MLP inner width")
    rope_theta: float = Field(10000.0, gt=0, description="rotary base")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")


def mla_decoder_layer(cfg: MLALayerConfig, hidden_size: int) -> tuple[DecoderLayer, AttentionSpec]:
    """A pre-norm decoder layer with MLA attention, and the ``AttentionSpec`` of its cache
    (the absorbed MLA cache of the target models: latent then rope key)."""
    from pcpflow.models.common import RotaryEmbedding
    from pcpflow.models.layers import MLAAttention, mla_spec

    attention = MLAAttention(
        hidden_size=hidden_size,
        num_heads=cfg.num_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        nope_dim=cfg.qk_nope_head_dim,
        rope_dim=cfg.qk_rope_head_dim,
        v_dim=cfg.v_head_dim,
        rotary=RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta),
        latent_norm_eps=cfg.rms_norm_eps,
    )
    layer = DecoderLayer(attention, hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
    scale = 1.0 / math.sqrt(cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    return layer, mla_spec(cfg.num_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim, scale)
