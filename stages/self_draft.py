"""draft: ``self`` — the target proposes its own greedy continuation.

The draft model *is* the target (same weights) with its own paged KV cache: its prefill
runs every token of the step on the PCP-local batch (``spec.prefill_attention``: the
target's layout and slot mapping, the draft's caches), then k replicated steps each
decode one token per request, starting from the newest token. So every proposal is what
the target would sample, and verification accepts them all — the exactness tests'
full-acceptance case.

``error_rate`` replaces a seeded fraction of proposals with another token, drawn from
``(seed + seed_offset, step)`` over the batch rows: identical on every rank and for any
PCP/DCP layout, so partial acceptance and rollback run with real numbers.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field

from pcpflow import spec
from pcpflow.pipeline.stage import Stage, register
from pcpflow.pipeline.state import StepState


@register
class SelfDraft(Stage):
    kind = "self"
    slots = ("draft",)

    class Config(spec.DraftConfig):
        kind: Literal["self"] = "self"
        error_rate: float = Field(
            0.0, ge=0.0, le=1.0, description="fraction of proposals replaced by a wrong token"
        )
        seed_offset: int = Field(2, description="the corruption draws from seed + seed_offset")

        def cache_entry_width(self, model) -> int:
            return model.num_layers * model.attn_spec.entry_dim

        def work(self, num_target_layers: int) -> spec.DraftWork:
            # NOTE: the target's layers over the step's rows, then k decodes of every drafting request
            return spec.DraftWork(layer=None, num_layers=num_target_layers, prefill="attend", restore=False,
                                  steps=self.num_speculative_tokens, rows_per_request=1, head_after_prefill=False,
                                  prefill_proj=0, step_proj=0, error_rate=self.error_rate,
                                  seed_offset=self.seed_offset)

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        model = ctx.model
        self.caches = spec.allocate_caches(ctx, model.attn_spec, model.num_layers)

    def own_kv(self):
        model = self.ctx.model
        return [(getattr(model, "full_attn_spec", model.attn_spec), self.caches)]

    @torch.no_grad()
    def __call__(self, state: StepState) -> StepState:
        ctx, model, b, local = self.ctx, self.ctx.model, state.batch, state.local
        assert local is not None
        model(
            local.input_ids,
            local.positions,
            spec.prefill_attention(ctx, state, self.caches, model.attn_spec),
        )

        start = spec.draft_start(b, state.sampled_token_ids)
        k = self.config.num_speculative_tokens
        drafts = np.empty((len(start.rows), k), dtype=np.int64)
        tokens, positions, dev = start.next_token_ids, start.next_positions, local.input_ids.device
        for j in range(k if len(start.rows) else 0):
            # One replicated decode step per draft: every rank, every drafting request.
            attn = spec.replicated_attention(
                ctx, b.block_tables, start.rows, positions, self.caches, model.attn_spec
            )
            hidden, _ = model(
                torch.from_numpy(tokens).to(dev), torch.from_numpy(positions).to(dev), attn
            )
            drafts[:, j] = spec.greedy(model, hidden)
            tokens, positions = drafts[:, j], positions + 1
        state.draft_token_ids = spec.scatter_proposals(
            b.num_reqs, start.rows, self._corrupt(b, start.rows, drafts)
        )
        return state

    def _corrupt(self, batch, rows: np.ndarray, drafts: np.ndarray) -> np.ndarray:
        rate = self.config.error_rate
        if rate == 0.0:
            return drafts
        k = self.config.num_speculative_tokens
        rng, u = spec.draft_draws(self.ctx.config.seed + self.config.seed_offset, batch.step, batch.num_reqs, k)
        wrong = (u < rate)[rows]
        shift = rng.integers(1, self.ctx.model.vocab_size, size=(batch.num_reqs, k))[rows]
        return np.where(wrong, (drafts + shift) % self.ctx.model.vocab_size, drafts)
