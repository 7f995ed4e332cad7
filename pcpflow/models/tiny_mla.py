"""A tiny DeepSeek-style model with multi-head latent attention (MLA).

The cache holds one entry per token: the normalized compressed latent ``c_kv`` and the
roped, head-shared ``k_pe``. Queries are absorbed into latent space
(``q_nope @ W_UK`` per head), so the backend sees one "kv head" whose keys are the whole
entry and whose values are the latent; the latent output goes through ``W_UV`` per head.
This equals standard MLA, where ``k_nope = W_UK c_kv`` and ``v = W_UV c_kv``.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec
from pcpflow.models.common import DecoderLayer, DecoderLM, RMSNorm, RotaryEmbedding


class MLAAttention(nn.Module):
    def __init__(self, cfg: TinyMLA.Config):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        q_out = cfg.num_heads * (self.nope_dim + self.rope_dim)
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, q_out, bias=False)
        self.kv_a_proj = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_norm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, cfg.num_heads * (self.nope_dim + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(self.rope_dim, cfg.rope_theta)

    def query(self, h: torch.Tensor) -> torch.Tensor:
        """``[N, hidden] -> [N, heads, nope + rope]`` (rope part not yet rotated)."""
        if self.q_lora_rank is None:
            q = self.q_proj(h)
        else:
            q = self.q_b_proj(self.q_a_norm(self.q_a_proj(h)))
        return q.unflatten(-1, (self.num_heads, self.nope_dim + self.rope_dim))

    def w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, nope, kv_lora_rank]`` and ``W_UV [heads, v_dim, kv_lora_rank]``."""
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope_dim + self.v_dim))
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        q_nope, q_pe = self.query(h).split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj(h).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        q_pe = self.rotary.apply(q_pe, cos, sin)
        k_pe = self.rotary.apply(k_pe[:, None], cos, sin)[:, 0]
        w_uk, w_uv = self.w_uk_uv()
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        kv = torch.cat([self.kv_a_norm(latent), k_pe], dim=-1)
        out_latent = attn(layer, torch.cat([q_latent, q_pe], dim=-1), kv)
        out = torch.einsum("nhl,hvl->nhv", out_latent, w_uv)
        return self.o_proj(out.flatten(1))


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

    def __init__(self, config: TinyMLA.Config):
        c = config
        spec = AttentionSpec(
            num_heads=c.num_heads,
            num_kv_heads=1,
            qk_dim=c.kv_lora_rank + c.qk_rope_head_dim,
            v_dim=c.kv_lora_rank,
            v_offset=0,
            entry_dim=c.kv_lora_rank + c.qk_rope_head_dim,
            scale=1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim),
        )
        layers = [
            DecoderLayer(MLAAttention(c), c.hidden_size, c.intermediate_size, c.rms_norm_eps)
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
