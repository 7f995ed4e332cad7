"""A tiny Llama-style model with grouped-query attention (GQA).

The cache holds one entry per token: roped K of every kv head, then V
(``[kv_heads * head_dim | kv_heads * head_dim]``); query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pcpflow.models.common import DecoderLM, TinyModelConfig
from pcpflow.models.layers import gqa_layers, gqa_spec


class TinyGQA(DecoderLM):
    class Config(TinyModelConfig):
        """A tiny Llama-style GQA model with seeded random weights."""

        name: Literal["tiny_gqa"] = "tiny_gqa"
        num_kv_heads: int = Field(2, gt=0, description="key/value heads (divides num_heads)")
        head_dim: int = Field(16, gt=0, multiple_of=2, description="per-head dim (all rotated)")

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
        layers = gqa_layers(
            c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, intermediate_size=c.intermediate_size, eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        )
        super().__init__(layers=layers, attn_spec=gqa_spec(c.num_heads, c.num_kv_heads, c.head_dim), **c.lm_dims())
        self.config = config
