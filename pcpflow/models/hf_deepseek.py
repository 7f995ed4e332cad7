"""DeepSeek-V2 / V3 checkpoints (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``):
multi-head latent attention (MLA), dense MLP layers.

The cache holds, per token, the normalized latent ``c_kv`` and the roped, head-shared
``k_pe``; queries are absorbed into latent space (``q_nope @ W_UK``) and the latent output
goes through ``W_UV`` (see ``tiny_mla``). What transformers does and pcpflow follows:

- RoPE pairs: V2 always rotates interleaved pairs; V3 does when ``rope_interleave`` (the
  default), else rotate-half.
- YaRN: cos/sin carry YaRN's attention factor, and when ``mscale_all_dim`` is set the
  softmax scale is multiplied by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
- The ``q_a`` / ``kv_a`` norms use eps 1e-6 whatever ``rms_norm_eps`` says.

Mixture-of-experts layers (``n_routed_experts`` set and ``first_k_dense_replace <
num_hidden_layers``) are not supported yet: such a checkpoint is rejected when the
config is validated.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from pydantic import Field, model_validator
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec
from pcpflow.models.common import DecoderLayer, RMSNorm, RotaryEmbedding, yarn_mscale
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename

LATENT_NORM_EPS = 1e-6
"""eps of the q_a / kv_a norms (transformers and DeepSeek's own code: the RMSNorm default)."""

_FIRST_K_DENSE_DEFAULT = {"DeepseekV2ForCausalLM": 0, "DeepseekV3ForCausalLM": 3}


class DeepseekCheckpoint(CheckpointConfig):
    """The config.json fields of a DeepSeek-V2/V3 checkpoint that pcpflow uses."""

    q_lora_rank: int | None = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0, multiple_of=2)
    v_head_dim: int = Field(gt=0)
    rope_interleave: bool = True
    n_routed_experts: int | None = None
    first_k_dense_replace: int = Field(ge=0)

    renames: ClassVar[tuple[Rename, ...]] = (
        *DECODER_RENAMES,
        attention_rename("q_proj.weight", "q_proj.weight"),
        attention_rename("q_a_proj.{wb}", "q_a_proj.{wb}"),
        attention_rename("q_a_layernorm.weight", "q_a_norm.weight"),
        attention_rename("q_b_proj.weight", "q_b_proj.weight"),
        attention_rename("kv_a_proj_with_mqa.{wb}", "kv_a_proj.{wb}"),
        attention_rename("kv_a_layernorm.weight", "kv_a_norm.weight"),
        attention_rename("kv_b_proj.weight", "kv_b_proj.weight"),
        attention_rename("o_proj.{wb}", "o_proj.{wb}"),
    )

    @model_validator(mode="before")
    @classmethod
    def _moe_defaults(cls, raw: Any) -> Any:
        # NOTE: transformers' defaults when a config.json omits them (both mean MoE layers)
        if isinstance(raw, dict):
            raw = dict(raw)
            raw.setdefault("n_routed_experts", 64)
            if raw.get("first_k_dense_replace") is None:
                raw["first_k_dense_replace"] = _FIRST_K_DENSE_DEFAULT.get(
                    raw.get("architecture"), 0
                )
        return raw

    @model_validator(mode="after")
    def _dense_only(self) -> DeepseekCheckpoint:
        if (
            self.n_routed_experts is not None
            and self.first_k_dense_replace < self.num_hidden_layers
        ):
            k, n = self.first_k_dense_replace, self.num_hidden_layers
            raise ValueError(
                "mixture-of-experts layers are not supported yet: this checkpoint has "
                f"n_routed_experts={self.n_routed_experts} and first_k_dense_replace={k} < "
                f"num_hidden_layers={n}, so {n - k} of its {n} layers are MoE; pcpflow runs "
                "DeepSeek checkpoints whose layers are all dense"
            )
        return self

    @property
    def interleaved_rope(self) -> bool:
        return self.architecture == "DeepseekV2ForCausalLM" or self.rope_interleave

    def softmax_scale(self) -> float:
        scale = 1.0 / math.sqrt(self.qk_nope_head_dim + self.qk_rope_head_dim)
        s = self.rope_scaling
        if s is not None and s.mscale_all_dim:
            scale *= yarn_mscale(s.factor, s.mscale_all_dim) ** 2
        return scale

    def attn_spec(self) -> AttentionSpec:
        entry = self.kv_lora_rank + self.qk_rope_head_dim
        return AttentionSpec(
            num_heads=self.num_attention_heads,
            num_kv_heads=1,
            qk_dim=entry,
            v_dim=self.kv_lora_rank,
            v_offset=0,
            entry_dim=entry,
            scale=self.softmax_scale(),
        )

    def build_layers(self) -> list[DecoderLayer]:
        return [
            DecoderLayer(
                DeepseekMLA(self), self.hidden_size, self.intermediate_size, self.rms_norm_eps
            )
            for _ in range(self.num_hidden_layers)
        ]


class DeepseekMLA(nn.Module):
    """Absorbed MLA with a checkpoint's biases and rope (same math as ``tiny_mla``)."""

    def __init__(self, c: DeepseekCheckpoint):
        super().__init__()
        self.num_heads = c.num_attention_heads
        self.q_lora_rank = c.q_lora_rank
        self.kv_lora_rank = c.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = (
            c.qk_nope_head_dim,
            c.qk_rope_head_dim,
            c.v_head_dim,
        )
        bias = c.attention_bias
        q_out = self.num_heads * (self.nope_dim + self.rope_dim)
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(c.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj = nn.Linear(c.hidden_size, c.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(c.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, c.hidden_size, bias=bias)
        self.rotary = RotaryEmbedding(
            self.rope_dim, c.rope_theta, scaling=c.rope_scaling, interleaved=c.interleaved_rope
        )

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(h)))
        q = q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj(h).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe[:, None], cos, sin)[:, 0]
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope_dim + self.v_dim))
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        kv = torch.cat([self.kv_a_norm(latent), k_pe], dim=-1)
        out_latent = attn(layer, torch.cat([q_latent, q_pe], dim=-1), kv)
        out = torch.einsum("nhl,hvl->nhv", out_latent, w_uv)
        return self.o_proj(out.flatten(1))
