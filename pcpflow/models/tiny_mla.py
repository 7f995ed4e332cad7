"""A tiny DeepSeek-style model with multi-head latent attention (MLA): the cache holds
the normalized latent plus the roped key, queries absorbed into latent space
(``pcpflow.models.layers.MLAAttention``)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pcpflow.models.common import DecoderLayer, DecoderLM, RotaryEmbedding
from pcpflow.models.layers import MLAAttention, mla_spec
from pcpflow.models.moe import build_mlp, dense_sentinel
from pcpflow.models.moe_config import MoEConfig


class TinyMLA(DecoderLM):
    class Config(BaseModel):
        """A tiny DeepSeek-V2-style MLA model with seeded random weights."""

        model_config = ConfigDict(extra="forbid", frozen=True)

        name: Literal["tiny_mla"] = "tiny_mla"
        vocab_size: int = Field(256, gt=0, description="vocabulary size")
        hidden_size: int = Field(64, gt=0, description="residual stream width")
        num_layers: int = Field(2, gt=0, description="decoder layers")
        num_heads: int = Field(4, gt=0, description="query heads")
        q_lora_rank: int | None = Field(
            48, gt=0, description="rank of the query compression (None: a full q_proj)"
        )
        kv_lora_rank: int = Field(32, gt=0, description="width of the cached latent c_kv")
        qk_nope_head_dim: int = Field(16, gt=0, description="per-head query/key dims without rope")
        qk_rope_head_dim: int = Field(
            16, gt=0, multiple_of=2, description="per-head query/key dims with rope (shared k_pe)"
        )
        v_head_dim: int = Field(16, gt=0, description="per-head value dim")
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
        moe: MoEConfig | None = Field(
            None, description="mixture-of-experts layers (None, or num_experts 0: dense MLPs)"
        )

        _dense_moe = field_validator("moe", mode="before")(dense_sentinel)

    def __init__(self, config: TinyMLA.Config):
        c = config
        scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        spec = mla_spec(c.num_heads, c.kv_lora_rank, c.qk_rope_head_dim, scale)
        layers = [
            DecoderLayer(
                mla_attention(c),
                c.hidden_size,
                c.intermediate_size,
                c.rms_norm_eps,
                mlp=build_mlp(c.moe, i, c.hidden_size, c.intermediate_size),
            )
            for i in range(c.num_layers)
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


def mla_attention(c: TinyMLA.Config) -> MLAAttention:
    return MLAAttention(
        hidden_size=c.hidden_size,
        num_heads=c.num_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        nope_dim=c.qk_nope_head_dim,
        rope_dim=c.qk_rope_head_dim,
        v_dim=c.v_head_dim,
        rotary=RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta),
        latent_norm_eps=c.rms_norm_eps,
    )
