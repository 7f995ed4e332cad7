"""draft: ``dspark`` — a DSpark/DFlash-style block drafter: k tokens in one forward.

A separate small model (MLA decoder layers, the target's hidden size, its embedding and
LM head shared) conditioned on target features:

- **context**: the hidden states of several target layers (``target_layers``, default
  first / middle / last; the forward stage returns them because this stage adds them to
  ``ctx.aux_layers``) are concatenated and fused by a projection; each draft layer's KV
  entry for a token is its key/value projection of that fused feature. Computed on the
  PCP-local batch for every token of the step and written like the target's KV
  (``spec.prefill_attention`` + ``spec.KVWriter``): the entries are all-gathered over PCP,
  so every rank holds the full draft cache, except that with dcp > 1 each rank keeps
  only its DCP shard, exactly like the target's cache. What moves is one latent entry per
  token and layer, not ``len(target_layers)`` hidden states.
- **block**: per request, k query rows at positions P..P+k-1 after the last accepted
  token: the newest token's embedding, then k-1 mask embeddings. One replicated forward
  (every rank, every request): the rows' KV goes to the cache at those positions and each
  row reads the context and the whole block (bidirectional; ``block_attention=causal``
  reads up to itself). Row j proposes the token at P + j + 1.

Block entries are scratch: the next step's context writes replace those of accepted
tokens before anything reads them. Random seeded weights (``seed + seed_offset``).
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import nn

from pcpflow import spec
from pcpflow.errors import Problem
from pcpflow.models.common import RMSNorm, build_seeded
from pcpflow.pipeline.stage import Stage, register
from pcpflow.pipeline.state import StepState


class DSparkModel(nn.Module):
    def __init__(
        self, hidden_size: int, num_features: int, num_layers: int, layer: spec.MLALayerConfig
    ):
        super().__init__()
        eps = layer.rms_norm_eps
        self.fc = nn.Linear(num_features * hidden_size, hidden_size, bias=False)
        self.fc_norm = RMSNorm(hidden_size, eps)
        self.mask_embed = nn.Embedding(1, hidden_size)
        built = [spec.mla_decoder_layer(layer, hidden_size) for _ in range(num_layers)]
        self.layers = nn.ModuleList(lay for lay, _ in built)
        self.attn_spec = built[0][1]
        self.norm = RMSNorm(hidden_size, eps)

    def write_context(self, features: list[torch.Tensor], positions: torch.Tensor, writer) -> None:
        """Each layer's KV entries of the fused target features (no attention computed)."""
        fused = self.fc_norm(self.fc(torch.cat(features, dim=-1)))
        for i, layer in enumerate(self.layers):
            layer.self_attn(layer.input_norm(fused), positions, i, writer)

    def forward(self, embeds: torch.Tensor, positions: torch.Tensor, attn) -> torch.Tensor:
        x = embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, i, attn)
        return self.norm(x)


@register
class DSparkDraft(Stage):
    kind = "dspark"
    slots = ("draft",)

    class Config(spec.DraftConfig):
        kind: Literal["dspark"] = "dspark"
        target_layers: list[int] | None = Field(
            None,
            min_length=1,
            description="target layers whose hidden states feed the drafter (negative "
            "counts from the end); None: first, middle and last",
        )
        num_layers: int = Field(1, ge=1, description="draft decoder layers")
        block_attention: Literal["bidirectional", "causal"] = Field(
            "bidirectional", description="how the block's rows see each other"
        )
        seed_offset: int = Field(
            3, description="the drafter's weights come from seed + seed_offset"
        )
        layer: spec.MLALayerConfig = Field(default_factory=spec.MLALayerConfig)

        def cache_entry_width(self, model) -> int:
            return self.num_layers * self.layer.cache_entry_dim()

        def work(self, num_target_layers: int) -> spec.DraftWork:
            # NOTE: the context is KV written from fused target features (fc); the block is one
            # replicated forward of k rows per request
            return spec.DraftWork(layer=self.layer, num_layers=self.num_layers, prefill="write", restore=False,
                                  steps=1, rows_per_request=self.num_speculative_tokens, head_after_prefill=False,
                                  prefill_proj=len(self.feature_layers(num_target_layers)), step_proj=0,
                                  seed_offset=self.seed_offset)

        def feature_layers(self, n: int) -> list[int]:
            """The target layers (of ``n``) whose hidden states it reads, in order, once each."""
            layers = self.target_layers if self.target_layers is not None else [0, n // 2, n - 1]
            return sorted({i % n for i in layers})

    @classmethod
    def check_run(cls, config, run) -> list[Problem]:
        n = getattr(run.model, "num_layers", None)
        bad = [i for i in config.target_layers or () if n is not None and not -n <= i < n]
        problems = spec.layer_problems(config.layer, run)
        if bad:
            problems.append(Problem("draft.target_layers", config.target_layers, f"layers of a {n}-layer target: -{n}..{n - 1}"))
        return problems

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.target_layers = config.feature_layers(ctx.model.num_layers)
        ctx.aux_layers.update(self.target_layers)
        self.model = (
            build_seeded(
                lambda: DSparkModel(
                    ctx.model.hidden_size, len(self.target_layers), config.num_layers, config.layer
                ),
                seed=ctx.config.seed + config.seed_offset,
                dtype=ctx.dtype,
                device=ctx.device,
            )
            .eval()
            .requires_grad_(False)
        )
        spec.shard_drafter(ctx, self.model)
        self.caches = spec.allocate_caches(ctx, self.model.attn_spec, config.num_layers)

    def own_kv(self):
        return [(getattr(self.model, "full_attn_spec", self.model.attn_spec), self.caches)]

    @torch.no_grad()
    def __call__(self, state: StepState) -> StepState:
        ctx, drafter, b, local = self.ctx, self.model, state.batch, state.local
        assert local is not None
        writer = spec.KVWriter(spec.prefill_attention(ctx, state, self.caches, drafter.attn_spec))
        drafter.write_context(
            [state.aux_hidden[i] for i in self.target_layers], local.positions, writer
        )

        start = spec.draft_start(b, state.sampled_token_ids)
        k, m = self.config.num_speculative_tokens, len(start.rows)
        drafts = np.empty((m, k), dtype=np.int64)
        if m:
            offsets = np.tile(np.arange(k, dtype=np.int64), m)
            positions = np.repeat(start.next_positions, k) + offsets
            if self.config.block_attention == "bidirectional":
                context_lens = np.repeat(start.next_positions + k, k)
            else:
                context_lens = positions + 1
            attn = spec.replicated_attention(
                ctx,
                b.block_tables,
                np.repeat(start.rows, k),
                positions,
                self.caches,
                drafter.attn_spec,
                context_lens,
            )
            dev = local.input_ids.device
            embeds = drafter.mask_embed.weight.expand(m * k, -1).clone()
            embeds[::k] = ctx.model.embed(torch.from_numpy(start.next_token_ids).to(dev))
            hidden = drafter(embeds, torch.from_numpy(positions).to(dev), attn)
            drafts[:] = spec.greedy(ctx.model, hidden).reshape(m, k)
        state.draft_token_ids = spec.scatter_proposals(b.num_reqs, start.rows, drafts)
        return state
