"""A tiny DeepSeek-style model with multi-head latent attention (MLA): the cache holds
the normalized latent plus the roped key, queries absorbed into latent space
(``pcpflow.models.layers.MLAAttention``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from pcpflow.models.common import DecoderLayer, DecoderLM, TinyModelConfig
from pcpflow.models.layers import mla_attention, mla_cache_spec
from pcpflow.models.moe import build_mlp, dense_sentinel
from pcpflow.models.moe_config import MoEConfig


class TinyMLA(DecoderLM):
    class Config(TinyModelConfig):
        """A tiny DeepSeek-V2-style MLA model with seeded random weights."""

        name: Literal["tiny_mla"] = "tiny_mla"
        q_lora_rank: int | None = Field(
            48, gt=0, description="rank of the query compression (None: a full q_proj)"
        )
        kv_lora_rank: int = Field(32, gt=0, description="width of the cached latent c_kv")
        qk_nope_head_dim: int = Field(16, gt=0, description="per-head query/key dims without rope")
        qk_rope_head_dim: int = Field(
            16, gt=0, multiple_of=2, description="per-head query/key dims with rope (shared k_pe)"
        )
        v_head_dim: int = Field(16, gt=0, description="per-head value dim")
        moe: MoEConfig | None = Field(
            None, description="mixture-of-experts layers (None, or num_experts 0: dense MLPs)"
        )

        _dense_moe = field_validator("moe", mode="before")(dense_sentinel)

    def __init__(self, config: TinyMLA.Config):
        c = config
        layers = [
            DecoderLayer(
                mla_attention(c, c.hidden_size),
                c.hidden_size,
                c.intermediate_size,
                c.rms_norm_eps,
                mlp=build_mlp(c.moe, i, c.hidden_size, c.intermediate_size),
            )
            for i in range(c.num_layers)
        ]
        super().__init__(layers=layers, attn_spec=mla_cache_spec(c), **c.lm_dims())
        self.config = config
