"""Llama checkpoints (``LlamaForCausalLM``): grouped-query attention with RoPE.

The cache holds roped K of every kv head, then V, as in ``tiny_gqa``. Biases on the
attention and MLP projections are loaded when the config asks for them
(``attention_bias`` / ``mlp_bias``).
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import gqa_layers, gqa_spec


class LlamaCheckpoint(CheckpointConfig):
    """The config.json fields of a Llama checkpoint that pcpflow uses."""

    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    mlp_bias: bool = False

    renames: ClassVar[tuple[Rename, ...]] = (
        *DECODER_RENAMES,
        attention_rename("q_proj.{wb}", "q_proj.{wb}"),
        attention_rename("k_proj.{wb}", "k_proj.{wb}"),
        attention_rename("v_proj.{wb}", "v_proj.{wb}"),
        attention_rename("o_proj.{wb}", "o_proj.{wb}"),
    )

    @model_validator(mode="after")
    def _heads(self) -> LlamaCheckpoint:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.dim % 2:
            raise ValueError(f"head_dim ({self.dim}) must be even for RoPE")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def attn_spec(self) -> AttentionSpec:
        return gqa_spec(self.num_attention_heads, self.kv_heads, self.dim)

    def build_layers(self) -> list[DecoderLayer]:
        return gqa_layers(
            self.num_hidden_layers, hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
            num_kv_heads=self.kv_heads, head_dim=self.dim, intermediate_size=self.intermediate_size,
            eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            bias=self.attention_bias, mlp_bias=self.mlp_bias,
        )
