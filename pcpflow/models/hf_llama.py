"""Llama checkpoints (``LlamaForCausalLM``): grouped-query attention with RoPE.

The cache holds roped K of every kv head, then V, as in ``tiny_gqa``. Biases on the
attention and MLP projections are loaded when the config asks for them
(``attention_bias`` / ``mlp_bias``).
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename


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
        kv_width = self.kv_heads * self.dim
        return AttentionSpec(
            num_heads=self.num_attention_heads,
            num_kv_heads=self.kv_heads,
            qk_dim=self.dim,
            v_dim=self.dim,
            v_offset=kv_width,
            entry_dim=2 * kv_width,
            scale=1.0 / math.sqrt(self.dim),
        )

    def build_layers(self) -> list[DecoderLayer]:
        return [
            DecoderLayer(
                LlamaAttention(self),
                self.hidden_size,
                self.intermediate_size,
                self.rms_norm_eps,
                mlp_bias=self.mlp_bias,
            )
            for _ in range(self.num_hidden_layers)
        ]


class LlamaAttention(nn.Module):
    def __init__(self, c: LlamaCheckpoint):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.kv_heads, c.dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, c.hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(self.head_dim, c.rope_theta, scaling=c.rope_scaling)

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
