"""A tiny Llama-style model with grouped-query attention (GQA).

The cache holds one entry per token: roped K of every kv head, then V
(``[kv_heads * head_dim | kv_heads * head_dim]``); query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pcpflow.models.common import DecoderLayer, DecoderLM, RotaryEmbedding
from pcpflow.models.layers import GQAAttention, gqa_spec


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
        spec = gqa_spec(c.num_heads, c.num_kv_heads, c.head_dim)
        layers = [
            DecoderLayer(
                GQAAttention(
                    hidden_size=c.hidden_size,
                    num_heads=c.num_heads,
                    num_kv_heads=c.num_kv_heads,
                    head_dim=c.head_dim,
                    rotary=RotaryEmbedding(c.head_dim, c.rope_theta),
                ),
                c.hidden_size,
                c.intermediate_size,
                c.rms_norm_eps,
            )
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
