"""What a drafter works with: where drafting starts after this step's verification, the
tokens that follow each global token, proposals in the step state, local rows and restored
hidden states, the draft's caches and its decoder layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, Literal, NamedTuple

import numpy as np
import torch
from pydantic import Field

from pcpflow.errors import Settings
from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer
from pcpflow.pipeline.stage import StageConfig
from pcpflow.scheduling.scheduler import accept_drafts

if TYPE_CHECKING:
    from pcpflow.models.base import CausalLM
    from pcpflow.pipeline.context import RankContext
    from pcpflow.pipeline.state import StepState
    from pcpflow.scheduling.batch import GlobalBatch


class DraftConfig(StageConfig):
    """Base of a drafter's ``Config``: the scheduler reserves room for and verifies up to
    ``num_speculative_tokens`` drafts per request."""

    num_speculative_tokens: int = Field(2, ge=1, description="tokens proposed per request and step")
    kv_reads_next_token: ClassVar[bool] = False
    """Whether the drafter's own KV entry at position p reads the token at p + 1 (MTP, EAGLE:
    its row at p embeds the next token). Such an entry is not a function of the tokens up to
    p, so a prefix-cache hit gives up the blocks whose last entry may have read another
    request's next token, its last block at least, which are computed again
    (``Scheduler(draft_kv_reads_next_token=...)``).
    False for drafters without a cache of their own, or whose entry at p reads positions
    <= p only (``self``, ``dspark``)."""

    def cache_entry_width(self, model: CausalLM) -> int:
        """Elements one token takes in this drafter's own caches (``Stage.own_kv``), all its
        layers together, for ``model`` the target (whole, before TP): what the host-memory
        check adds to each slot of ``kv.num_blocks`` before any rank starts. 0: no cache
        of its own (a plugin that keeps one and leaves this at 0 is not counted)."""
        return 0

    def work(self, num_target_layers: int) -> DraftWork | None:
        """What one drafting step runs, for a simulated run to count and price
        (``pcpflow.simulate.drafting``); None: this drafter is not simulated (``mode=simulate``
        refuses it). ``num_target_layers``: the target's layers."""
        return None


class DraftWork(NamedTuple):
    """One drafting step as a simulated run counts and prices it (``DraftConfig.work``): a
    prefill over the step's local rows (the target's layout), then ``steps`` forwards that
    every rank runs alike over every drafting request's rows (``replicated_attention``).
    Drafting requests are the rows that sampled this step (``draft_start``)."""

    layer: MLALayerConfig | None  # the drafter's decoder layer; None: the target's own layers and cache
    num_layers: int  # layers of ``layer`` (unused when None)
    prefill: Literal["attend", "write"]  # attend over its cache, or only write its KV (DSpark's context)
    restore: bool  # the prefill's hidden rows all-gathered over PCP (``restore_hidden``: draft_restore)
    steps: int  # replicated forwards after the prefill
    rows_per_request: int  # rows a drafting request has in each (its positions in a row)
    head_after_prefill: bool  # the LM head on the drafting rows once the prefill is done (MTP's first draft)
    prefill_proj: int  # an input projection to the hidden size on every prefill row, from this many hiddens (0: none)
    step_proj: int  # the same on every replicated row
    error_rate: float | None = None  # proposals are the target's own, but this seeded share (``self``)
    seed_offset: int = 0  # its draws come from seed + seed_offset


def draft_kv_reads_next_token(specs) -> bool:
    """Whether a pipeline's draft stage (``specs``: ``pcpflow.pipeline.assemble.resolve_pipeline``)
    keeps KV entries that read the next token (``DraftConfig.kv_reads_next_token``): the
    scheduler's ``draft_kv_reads_next_token``, on every rank and in every pool alike."""
    draft = next((s for s in specs if s.name == "draft"), None)
    return draft is not None and getattr(draft.config, "kv_reads_next_token", False) is True


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
    input token; the last token of an unfinished prefill chunk is followed by the token after
    the chunk: the batch's ``chunk_next_ids`` (the scheduler's: a prompt token, or a readmitted
    request's output), else from ``prompts`` (req_id -> prompt ids; -1 without it).
    """
    sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
    out = np.full(batch.num_tokens, -1, dtype=np.int64)
    out[:-1] = batch.input_ids[1:]
    q, c = batch.num_scheduled_tokens, batch.num_computed_tokens
    ends = batch.query_start_loc[1:][q > 0] - 1
    out[ends] = -1
    unfinished = np.flatnonzero(batch.is_prefilling & (q > 0) & (c + q < batch.prompt_lens))
    if batch.chunk_next_ids is not None:
        out[batch.query_start_loc[unfinished + 1] - 1] = batch.chunk_next_ids[unfinished]
    elif prompts is not None:
        for r in unfinished.tolist():
            out[batch.query_start_loc[r + 1] - 1] = prompts[int(batch.req_ids[r])][c[r] + q[r]]
    out[batch.logits_indices] = sampled
    return out


def draft_draws(seed: int, step: int, num_reqs: int, k: int) -> tuple[np.random.Generator, np.ndarray]:
    """Uniform draws ``[R, k]`` over a step's batch rows, from ``(seed, step)``, and the
    generator for what follows them: which proposals ``draft=self`` corrupts (``error_rate``)
    and which drafts a simulated run rejects, drawn alike (``pcpflow.simulate.drafting``)."""
    rng = np.random.default_rng([seed & (2**63 - 1), step])
    return rng, rng.random((num_reqs, k))


def scatter_proposals(num_reqs: int, rows: np.ndarray, proposals: np.ndarray) -> np.ndarray:
    """``state.draft_token_ids``: ``proposals [M, k]`` of batch ``rows``, -1 elsewhere."""
    proposals = np.asarray(proposals, dtype=np.int64)
    out = np.full((num_reqs, proposals.shape[1] if proposals.ndim == 2 else 0), -1, dtype=np.int64)
    out[rows] = proposals
    return out


def request_prompts(ctx: RankContext) -> dict[int, np.ndarray]:
    """req_id -> prompt token ids of the run's workload (the same on every rank)."""
    return {r.req_id: r.prompt_token_ids for r in ctx.requests}


# -- local rows and restored hidden states (the draft prefill runs on the PCP-local batch) --


def to_local(state: StepState, values: np.ndarray) -> torch.Tensor:
    """A per-global-token int array ``[T]`` as this rank's local rows (``values[gather]``,
    0 on padding), on the local batch's device."""
    local = state.local
    assert local is not None, "to_local runs after buffers"
    picked = torch.from_numpy(np.ascontiguousarray(np.asarray(values)[local.gather_idx]))
    return picked.to(local.input_ids.device).masked_fill(local.is_padding, 0)


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


class MLALayerConfig(Settings):
    """A draft decoder layer with multi-head latent attention (DeepSeek-style, absorbed)."""

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

    def cache_entry_dim(self) -> int:
        """Width of one entry of this layer's cache (latent then rope key)."""
        from pcpflow.models.layers import mla_cache_spec

        return mla_cache_spec(self).entry_dim

    def tp_problems(self, grid) -> list:
        """What stops this layer from splitting over ``grid.tp`` ranks (MLA: any DCP)."""
        from pcpflow.parallel.tensor_parallel import tp_problems

        return tp_problems(grid, num_heads=self.num_heads, num_kv_heads=None,
                           intermediate_size=self.intermediate_size, what="the drafter (draft.layer)")


def layer_problems(layer: MLALayerConfig, run) -> list:
    """What stops a drafter's ``layer`` from splitting over the run's TP ranks; nothing where
    a simulated run prices the target's own layers in its place (``simulate.draft_layer``)."""
    if getattr(run, "mode", None) == "simulate" and run.simulate.drafter_layers(run.model) == "target":
        return []
    return layer.tp_problems(run.grid)


def mla_decoder_layer(cfg: MLALayerConfig, hidden_size: int) -> tuple[DecoderLayer, AttentionSpec]:
    """A pre-norm decoder layer with MLA attention, and the ``AttentionSpec`` of its cache
    (the absorbed MLA cache of the target models: latent then rope key)."""
    from pcpflow.models.layers import mla_attention, mla_cache_spec

    layer = DecoderLayer(mla_attention(cfg, hidden_size), hidden_size, cfg.intermediate_size, cfg.rms_norm_eps)
    return layer, mla_cache_spec(cfg)
