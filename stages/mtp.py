"""draft: ``mtp`` — a DeepSeek-style multi-token-prediction head drafting k tokens.

The head is one transformer layer over ``[norm(embed(next token)), norm(target hidden)]``
(projected back to the hidden size), with its own paged KV cache, then its own final
norm and the target's LM head (embedding and LM head are shared with the target). Its
row at position p reads the target's hidden at p and the token at p + 1, and predicts
the token at p + 2.

Each step, on every rank:

1. draft prefill on the PCP-local batch: the head over every token of the step (next
   token ids from ``spec.next_token_ids``, taken to local rows through the layout),
   attention over the target's layout and slot mapping on the head's cache; the outputs
   at each request's last accepted token are restored (``draft_restore``) — identical on
   every rank — and give the first draft;
2. drafts 2..k, replicated: the head again, one row per request at the next position,
   fed its own output hidden as the "target hidden" and its last draft as the token.

Random seeded weights (``seed + seed_offset``): a faithful mechanism, not a good drafter.
"""

from __future__ import annotations

from typing import ClassVar, Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from pcpflow import spec
from pcpflow.models.common import RMSNorm, build_seeded
from pcpflow.pipeline.stage import Stage, register
from pcpflow.pipeline.state import StepState


class MTPHead(nn.Module):
    def __init__(self, hidden_size: int, layer: spec.MLALayerConfig):
        super().__init__()
        eps = layer.rms_norm_eps
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.layer, self.attn_spec = spec.mla_decoder_layer(layer, hidden_size)
        self.norm = RMSNorm(hidden_size, eps)  # DeepSeek's shared_head.norm

    def forward(self, embeds, hidden, positions, attn) -> torch.Tensor:
        """The head's output hidden (before its final norm)."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        return self.layer(x, positions, 0, attn)


@register
class MTPDraft(Stage):
    kind = "mtp"
    slots = ("draft",)

    class Config(spec.DraftConfig):
        kind: Literal["mtp"] = "mtp"
        kv_reads_next_token: ClassVar[bool] = True  # NOTE: its row at p embeds the token at p + 1
        seed_offset: int = Field(1, description="the head's weights come from seed + seed_offset")
        layer: spec.MLALayerConfig = Field(default_factory=spec.MLALayerConfig)

        def cache_entry_width(self, model) -> int:
            return self.layer.cache_entry_dim()

        def work(self, num_target_layers: int) -> spec.DraftWork:
            # NOTE: eh_proj ([embed, hidden] -> hidden) before its layer on every row; the first
            # draft from the restored prefill rows, drafts 2..k one replicated step each
            return spec.DraftWork(layer=self.layer, num_layers=1, prefill="attend", restore=True,
                                  steps=self.num_speculative_tokens - 1, rows_per_request=1, head_after_prefill=True,
                                  prefill_proj=2, step_proj=2, seed_offset=self.seed_offset)

    @classmethod
    def check_run(cls, config, run) -> list:
        return spec.layer_problems(config.layer, run)

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.head = (
            build_seeded(
                lambda: MTPHead(ctx.model.hidden_size, config.layer),
                seed=ctx.config.seed + config.seed_offset,
                dtype=ctx.dtype,
                device=ctx.device,
            )
            .eval()
            .requires_grad_(False)
        )
        spec.shard_drafter(ctx, self.head)
        self.caches = spec.allocate_caches(ctx, self.head.attn_spec, 1)
        self.prompts = spec.request_prompts(ctx)

    def own_kv(self):
        return [(getattr(self.head, "full_attn_spec", self.head.attn_spec), self.caches)]

    @torch.no_grad()
    def __call__(self, state: StepState) -> StepState:
        ctx, model, head, b = self.ctx, self.ctx.model, self.head, state.batch
        assert state.local is not None and state.hidden is not None

        next_ids = spec.next_token_ids(b, state.sampled_token_ids, self.prompts)
        attn = spec.prefill_attention(ctx, state, self.caches, head.attn_spec)
        x = head(
            model.embed(spec.to_local(state, next_ids)), state.hidden, state.local.positions, attn
        )

        start = spec.draft_start(b, state.sampled_token_ids)
        k = self.config.num_speculative_tokens
        drafts = np.empty((len(start.rows), k), dtype=np.int64)
        if len(start.rows):
            hidden = spec.restore_hidden(ctx, state, x, tokens=start.last_token_indices)
            positions = b.positions[start.last_token_indices]
            for j in range(k):
                if j:
                    positions = positions + 1
                    attn = spec.replicated_attention(
                        ctx, b.block_tables, start.rows, positions, self.caches, head.attn_spec
                    )
                    embeds = model.embed(torch.from_numpy(drafts[:, j - 1]).to(hidden.device))
                    hidden = head(
                        embeds, hidden, torch.from_numpy(positions).to(hidden.device), attn
                    )
                drafts[:, j] = spec.greedy(model, head.norm(hidden))
        state.draft_token_ids = spec.scatter_proposals(b.num_reqs, start.rows, drafts)
        return state
