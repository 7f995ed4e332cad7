"""The two attention layers every pcpflow model is built from, with the cache layout
(``AttentionSpec``) each one implies. The tiny models, the Hugging Face loaders and the
drafters all use these, so one definition carries the math that is proven against
transformers.

- ``GQAAttention`` (Llama, Mistral, Qwen2/3): cache entry = roped K of every kv head, then V.
- ``MLAAttention`` (DeepSeek): cache entry = the normalized latent ``c_kv`` and the roped,
  head-shared ``k_pe``. Queries are absorbed into latent space (``q_nope @ W_UK`` per
  head) so the backend sees one "kv head" whose keys are the whole entry and whose values
  are the latent; the latent output goes through ``W_UV`` per head. This equals standard
  MLA, where ``k_nope = W_UK c_kv`` and ``v = W_UV c_kv``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec
from pcpflow.models.common import (
    DecoderLayer,
    RMSNorm,
    RopeScaling,
    RotaryEmbedding,
    narrow_to_float32,
)
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig


def gqa_spec(num_heads: int, num_kv_heads: int, head_dim: int, scale: float | None = None) -> AttentionSpec:
    """The cache of ``GQAAttention``; softmax scale 1/sqrt(head_dim) unless given (Gemma's
    ``query_pre_attn_scalar``)."""
    kv_width = num_kv_heads * head_dim
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        qk_dim=head_dim,
        v_dim=head_dim,
        v_offset=kv_width,
        entry_dim=2 * kv_width,
        scale=1.0 / math.sqrt(head_dim) if scale is None else scale,
    )


def mla_spec(num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> AttentionSpec:
    entry = kv_lora_rank + rope_dim
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=1,
        qk_dim=entry,
        v_dim=kv_lora_rank,
        v_offset=0,
        entry_dim=entry,
        scale=scale,
    )


class WeightlessRMSNorm(nn.Module):
    """An RMS norm without a weight, in float32 at least and rounded back to the input's dtype
    (transformers' ``Llama4TextWeightlessRMSNorm``, the L2 norm of Llama 4's q and k)."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = narrow_to_float32(x)
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


@dataclass(frozen=True)
class QueryScaling:
    """q of the row at position ``p`` times ``1 + beta * ln(1 + floor((p + offset) / period))``, in
    float32 at least, as transformers computes it for one of two models:

    - ``llama4``: Llama 4's attention temperature on its NoPE layers (``Llama4TextAttention``:
      ``period`` its ``floor_scale``, ``beta`` its ``attn_scale``): offset 1, ``log1p``, the product
      rounded to q's dtype;
    - ``ministral3``: Ministral 3's ``llama_4_scaling_beta`` over the original length
      (``get_llama_4_attn_scale``): offset 0, ``log(1 + ...)``, the scale rounded to q's dtype
      before the product.

    NOTE: the forms differ only where transformers' do, down to the rounding: ``log1p(n)`` and
    ``log(1 + n)`` of a float32 integer differ in the last bit for some ``n`` (6, 46, ...)."""

    period: float
    beta: float
    form: Literal["llama4", "ministral3"]

    def __call__(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # NOTE: positions straight to float32 (bf16 would round them), as transformers' positions.float()
        t = positions.to(torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype)
        if self.form == "llama4":
            scales = torch.log1p(torch.floor((t + 1.0) / self.period)) * self.beta + 1.0
            return (q * scales[:, None, None]).to(q.dtype)
        scales = 1 + self.beta * torch.log(1 + torch.floor(t / self.period))
        return q * scales.to(q.dtype)[:, None, None]


class GQAAttention(nn.Module):
    """Grouped-query attention. ``bias``: biases on q/k/v, and on o unless ``o_bias`` says
    otherwise (Qwen2: q/k/v only). ``qk_norm_eps``: an RMSNorm over each head's ``head_dim``
    of q and of k (one weight shared by the heads) before RoPE, as Qwen3 (``unit_offset``:
    Gemma's, ``RMSNorm``); None: none; ``qk_norm_width="full"`` (OLMo 2): one RMSNorm over the
    whole projection of q (all heads) and one over k's, scaled before rounding, as
    ``Olmo2RMSNorm`` (``full_norm_scale_first=False``: rounded, then scaled, as OLMoE's
    ``OlmoeRMSNorm``; under TP its mean square is the TP group's: ``ShardedRMSNorm``).
    ``clip_qkv`` (OLMoE): q and k (after their norms) and v clamped to ``[-clip_qkv, clip_qkv]``
    before RoPE, as ``OlmoeAttention``. A
    ``rotary`` narrower than the head rotates its first dims and passes the rest (GLM-4.5's
    partial rotary); None: no position embedding (a NoPE layer). ``sinks``: one learned softmax
    logit per query head that reads no value (gpt-oss's attention sinks, ``self.sinks [H]``),
    handed to the backend, which adds it once to each row's whole softmax.

    ``qk_norm_after_rope`` (Hunyuan): the per-head q/k norms apply to the roped heads instead, so
    that each weight meets a rotated dim.

    Llama 4's: ``rope_l2_eps``, on a layer that rotates, q and k are normed per head *after* RoPE
    by a weightless RMSNorm (``Llama4TextL2Norm``). ``query_scaling``: q of each row scaled by its
    position, after RoPE (Llama 4's attention temperature, Ministral 3's ``llama_4_scaling_beta``:
    ``QueryScaling``)."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        rotary: RotaryEmbedding | None,
        bias: bool = False,
        o_bias: bool | None = None,
        qk_norm_eps: float | None = None,
        unit_offset: bool = False,
        qk_norm_width: Literal["head", "full"] = "head",
        full_norm_scale_first: bool = True,
        qk_norm_after_rope: bool = False,
        clip_qkv: float | None = None,
        sinks: bool = False,
        rope_l2_eps: float | None = None,
        query_scaling: QueryScaling | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.rope_l2_norm = WeightlessRMSNorm(rope_l2_eps) if rope_l2_eps is not None else None
        self.query_scaling = query_scaling
        self.full_qk_norm = qk_norm_eps is not None and qk_norm_width == "full"
        assert not (qk_norm_after_rope and self.full_qk_norm), "a norm over the whole projection comes before RoPE"
        self.qk_norm_after_rope = qk_norm_after_rope
        self.clip_qkv = clip_qkv
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        if self.full_qk_norm:
            self.q_norm = RMSNorm(num_heads * head_dim, qk_norm_eps, scale_first=full_norm_scale_first)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, qk_norm_eps, scale_first=full_norm_scale_first)
        else:
            norm = (lambda: RMSNorm(head_dim, qk_norm_eps, unit_offset=unit_offset)) if qk_norm_eps is not None else nn.Identity
            self.q_norm, self.k_norm = norm(), norm()
        self.rotary = rotary
        self.sinks = nn.Parameter(torch.empty(num_heads)) if sinks else None

    def seeded_init(self, gen: torch.Generator, gain: float) -> None:
        """``build_seeded``'s rule for the sinks (the projections are its own Linears): ``N(0, 1)``,
        a logit on the scores' scale, large enough to take a visible share of a short row's mass."""
        if self.sinks is not None:
            self.sinks.copy_(torch.randn(self.sinks.shape, generator=gen, dtype=torch.float64))

    def forward(
        self, h: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        if self.full_qk_norm:  # NOTE: OLMo 2's: over the whole projection, then split into heads
            q = self.q_norm(self.q_proj(h)).unflatten(-1, (self.num_heads, self.head_dim))
            k = self.k_norm(self.k_proj(h)).unflatten(-1, (self.num_kv_heads, self.head_dim))
        else:
            q = self.q_proj(h).unflatten(-1, (self.num_heads, self.head_dim))
            k = self.k_proj(h).unflatten(-1, (self.num_kv_heads, self.head_dim))
            if not self.qk_norm_after_rope:
                q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(h)
        if self.clip_qkv is not None:  # NOTE: OLMoE's: elementwise, so each TP rank clamps its own heads
            c = self.clip_qkv
            q, k, v = q.clamp(-c, c), k.clamp(-c, c), v.clamp(-c, c)
        if self.rotary is not None:  # NOTE: None: a NoPE layer (SmolLM3's every fourth)
            cos, sin = self.rotary.cos_sin(positions, h.dtype)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if self.qk_norm_after_rope:  # NOTE: Hunyuan's: the roped heads normed
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_l2_norm is not None:  # NOTE: Llama 4's: after RoPE (a norm per head ignores its pair order)
            q, k = self.rope_l2_norm(q), self.rope_l2_norm(k)
        if self.query_scaling is not None:
            q = self.query_scaling(q, positions)
        out = attn(layer, q, torch.cat([k.flatten(1), v], dim=-1), sinks=self.sinks)
        return self.o_proj(out.flatten(1))

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary.dim
        if r == self.head_dim:
            return self.rotary.apply(x, cos, sin)
        return torch.cat([self.rotary.apply(x[..., :r], cos, sin), x[..., r:]], dim=-1)


class MLAAttention(nn.Module):
    """Absorbed multi-head latent attention. ``bias`` applies where DeepSeek checkpoints
    may carry one (q_a, kv_a and o projections); ``latent_norm_eps`` is the eps of the
    q_a / kv_a norms."""

    def __init__(
        self,
        *,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_dim: int,
        rotary: RotaryEmbedding,
        latent_norm_eps: float,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.q_lora_rank, self.kv_lora_rank = num_heads, q_lora_rank, kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = nope_dim, rope_dim, v_dim
        q_out = num_heads * (nope_dim + rope_dim)
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_norm = RMSNorm(q_lora_rank, latent_norm_eps)
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        self.kv_a_proj = nn.Linear(hidden_size, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_norm = RMSNorm(kv_lora_rank, latent_norm_eps)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_dim, hidden_size, bias=bias)
        self.rotary = rotary

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
        # W_UK [heads, nope, latent] and W_UV [heads, v_dim, latent], sliced from kv_b_proj.
        w = self.kv_b_proj.weight.unflatten(0, (self.num_heads, self.nope_dim + self.v_dim))
        w_uk, w_uv = w[:, : self.nope_dim], w[:, self.nope_dim :]
        q_latent = torch.einsum("nhd,hdl->nhl", q_nope, w_uk)
        kv = torch.cat([self.kv_a_norm(latent), k_pe], dim=-1)
        out_latent = attn(layer, torch.cat([q_latent, q_pe], dim=-1), kv)
        out = torch.einsum("nhl,hvl->nhv", out_latent, w_uv)
        return self.o_proj(out.flatten(1))


# ------------------------------------------------------------------------------ builders
def gqa_layers(
    num_layers: int,
    *,
    hidden_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    eps: float,
    rope_theta: float,
    rope_scaling: RopeScaling | None = None,
    bias: bool = False,
    o_bias: bool | None = None,
    mlp_bias: bool = False,
    qk_norm: bool | Literal["head", "full"] = False,
    moe: MoEConfig | None = None,
    rotary_dim: int | None = None,
    rope_layers: list[bool] | None = None,
    residual_multiplier: float | None = None,
    interleaved_rope: bool = False,
    sinks: bool = False,
    query_scaling: QueryScaling | None = None,
    sandwich: bool = False,
) -> list[DecoderLayer]:
    """``num_layers`` pre-norm decoder layers with GQA attention (Llama and its kin, see
    ``GQAAttention``; the tiny GQA model). ``qk_norm``: Qwen3's q/k norms, with ``eps`` (``"full"``:
    OLMo 2's, over the whole projection);
    ``moe``: MoE MLPs on the layers it makes MoE (Qwen3-MoE, Mixtral, GLM-4.5); ``rotary_dim``:
    the dims RoPE rotates (None: all of ``head_dim``); ``rope_layers``: which layers rotate (None:
    all; SmolLM3's NoPE layers do not); ``residual_multiplier``: Granite's (``DecoderLayer``);
    ``interleaved_rope``: RoPE on pairs of adjacent dims (ERNIE 4.5's); ``sinks``: attention sinks
    (gpt-oss's, ``GQAAttention``); ``query_scaling``: every layer's q scaled by position (Ministral 3's);
    ``sandwich``: each block's output normed too (GLM-4's, ``DecoderLayer``)."""
    return [
        DecoderLayer(
            GQAAttention(
                hidden_size=hidden_size,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rotary=(RotaryEmbedding(rotary_dim or head_dim, rope_theta, scaling=rope_scaling,
                                        interleaved=interleaved_rope)
                        if rope_layers is None or rope_layers[i] else None),
                bias=bias,
                o_bias=o_bias,
                qk_norm_eps=eps if qk_norm else None,
                qk_norm_width="full" if qk_norm == "full" else "head",
                sinks=sinks,
                query_scaling=query_scaling,
            ),
            hidden_size,
            intermediate_size,
            eps,
            mlp_bias=mlp_bias,
            mlp=build_mlp(moe, i, hidden_size, intermediate_size),
            residual_multiplier=residual_multiplier,
            sandwich=sandwich,
        )
        for i in range(num_layers)
    ]


def mla_attention(
    c,
    hidden_size: int,
    *,
    num_heads: int | None = None,
    rotary: RotaryEmbedding | None = None,
    latent_norm_eps: float | None = None,
    bias: bool = False,
) -> MLAAttention:
    """MLA attention of a config that names its dims as DeepSeek's config.json does
    (``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
    ``v_head_dim``, ``num_heads``, ``rope_theta``, ``rms_norm_eps``): the tiny MLA model, the
    drafters' layers and DeepSeek checkpoints (which pass their own heads, RoPE and eps)."""
    return MLAAttention(
        hidden_size=hidden_size,
        num_heads=c.num_heads if num_heads is None else num_heads,
        q_lora_rank=c.q_lora_rank,
        kv_lora_rank=c.kv_lora_rank,
        nope_dim=c.qk_nope_head_dim,
        rope_dim=c.qk_rope_head_dim,
        v_dim=c.v_head_dim,
        rotary=rotary or RotaryEmbedding(c.qk_rope_head_dim, c.rope_theta),
        latent_norm_eps=c.rms_norm_eps if latent_norm_eps is None else latent_norm_eps,
        bias=bias,
    )


def mla_cache_spec(c, *, num_heads: int | None = None, scale: float | None = None) -> AttentionSpec:
    """The cache of ``mla_attention(c)``: latent then rope key, softmax scale 1/sqrt(qk dims)
    unless given (DeepSeek's YaRN mscale)."""
    scale = 1.0 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim) if scale is None else scale
    return mla_spec(c.num_heads if num_heads is None else num_heads, c.kv_lora_rank, c.qk_rope_head_dim, scale)
