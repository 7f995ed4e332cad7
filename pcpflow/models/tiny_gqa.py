"""A tiny Llama-style model with grouped-query attention (GQA).

The cache holds one entry per token: roped K of every kv head, then V
(``[kv_heads * head_dim | kv_heads * head_dim]``); query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec
from pcpflow.models.common import DecoderLayer, DecoderLM, RotaryEmbedding


class GQAAttention(nn.Module):
    def __init__(self, cfg: TinyGQA.Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        kv_width = cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_width, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        q = self.rotary.apply(q, cos, sin)
        k = self.rotary.apply(k, cos, sin)
        out = attn(layer, q, torch.cat([k.flatten(1), self.v_proj(h)], dim=-1))
        return self.o_proj(out.flatten(1))


class TinyGQA(DecoderLM):
    class Config(BaseModel):
        """A tiny Llama-style GQA model with seeded random weights."""

        model_config = ConfigDict(extra="forbid", frozen=True)

        name: Literal["tiny_gqa"] = "tiny_gqa"
        vocab_size: int = Field(256, gt=0, description="vocabulary size")
        hidden_size: int = Field(64, gt=0, description="residual stream width")
        num_layers: int = Field(2, gt=0, description="decoder layers")
        num_heads: int = Field(4, gt=0, description="query heads")
        num_kv_heads: int = Field(2, gt=0, description="key/value heads (divides num_heads)")
        head_dim: int = Field(16, gt=0, multiple_of=2, description="per-head dim (all rotated)")
        intermediate_size: int = Field(128, gt=0, description="MLP inner width")
        rope_theta: float = Field(10000.0, gt=0, description="rotary base")
        rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
        tie_word_embeddings: bool = Field(False, description="LM head shares the embedding")
        init_gain: float = Field(
            1.0, gt=0, description="linear weights are N(0, init_gain^2 / fan_in)"
        )
        logit_gain: float = Field(
            4.0, gt=0, description="untied LM head is N(0, logit_gain^2 / hidden_size)"
        )

        @model_validator(mode="after")
        def _heads_divide(self) -> TinyGQA.Config:
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads})"
                )
            return self

    def __init__(self, config: TinyGQA.Config):
        c = config
        kv_width = c.num_kv_heads * c.head_dim
        spec = AttentionSpec(
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            qk_dim=c.head_dim,
            v_dim=c.head_dim,
            v_offset=kv_width,
            entry_dim=2 * kv_width,
            scale=1.0 / math.sqrt(c.head_dim),
        )
        layers = [
            DecoderLayer(GQAAttention(c), c.hidden_size, c.intermediate_size, c.rms_norm_eps)
            for _ in range(c.num_layers)
        ]
        super().__init__(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            layers=layers,
            attn_spec=spec,
            eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings,
        )
        self.config = config
