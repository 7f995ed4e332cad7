"""Tencent's Hunyuan checkpoints (``HunYuanDenseV1ForCausalLM``: Hunyuan-0.5B, -1.8B, -4B, -7B;
``HunYuanMoEV1ForCausalLM``: Hunyuan-A13B), as transformers' ``modeling_hunyuan_v1_dense.py`` and
``modeling_hunyuan_v1_moe.py`` compute them:

- Llama's pre-norm layers and RMSNorm (scaled after rounding); GQA with ``head_dim`` as config.json
  gives it (else hidden / heads); q/k/v/o biases when ``attention_bias``, none on the MLPs;
- an RMSNorm over each head of q and of k (``query_layernorm``, ``key_layernorm``) *after* RoPE, on
  every layer (transformers builds them whatever ``use_qk_norm`` says);
- RoPE: the released configs write ``rope_scaling: {type: dynamic, alpha: A, ...}``, which transformers
  reads as a fixed NTK stretch of the base (its ``ntk_alpha``, also accepted by that name): theta
  becomes ``theta * A ** (d / (d - 2))`` for heads of ``d`` dims, at every length, and the other keys
  (``factor``, ``beta_fast``, ...) are unread; ``linear``, ``llama3``, ``yarn`` and ``longrope`` scale as
  in every family; ``dynamic`` without an alpha (dynamic NTK: the base rescaled by each forward's
  length past ``max_position_embeddings``) is refused;
- untied unless ``tie_word_embeddings``;
- Hunyuan-A13B: every layer mixture-of-experts (``hf_moe.hunyuan_moe_settings``): the softmax of
  ``num_experts`` router logits (``gate.wg``, in float32), the top ``moe_topk`` renormalised, plus one
  shared expert (``shared_mlp``) added unweighted; routed and shared experts ``intermediate_size`` wide.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import GQACheckpoint, head_problems
from pcpflow.models.hf_moe import HUNYUAN_MOE_RENAMES, hunyuan_moe_settings
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import GQAAttention, gqa_spec
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig

NTK_ALPHA_TYPES = ("dynamic", "ntk_alpha")
"""Rope types ``HunYuanDenseV1RotaryEmbedding`` reads as a fixed NTK alpha when an ``alpha`` is given."""

ATTENTION_RENAMES = (
    *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    attention_rename("query_layernorm.weight", "q_norm.weight"),
    attention_rename("key_layernorm.weight", "k_norm.weight"),
)


class HunyuanCheckpoint(GQACheckpoint):
    """The config.json fields both Hunyuan architectures share (``HunYuanDenseV1Config`` /
    ``HunYuanMoEV1Config`` defaults)."""

    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    rope_alpha: float | None = None  # the NTK alpha of rope_scaling (``_rope_fields``)

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """An NTK alpha (rope type ``dynamic`` with an ``alpha``, or ``ntk_alpha``) into ``rope_alpha``
        and plain RoPE, as ``HunYuanDenseV1RotaryEmbedding`` reads it; other types as every family's."""
        key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
        params, raw["rope_alpha"] = raw.get(key), None  # NOTE: read from the rope settings alone
        kind = (params.get("rope_type") or params.get("type")) if isinstance(params, dict) else None
        if kind in NTK_ALPHA_TYPES:
            alpha = params.get("alpha")
            if not alpha:  # NOTE: transformers' own test: a missing or zero alpha is dynamic NTK
                raise ValueError(
                    f"{key} of type {kind!r} without an alpha is not supported (dynamic NTK: transformers rescales "
                    "RoPE by each forward's length past max_position_embeddings); supported: a fixed NTK alpha, "
                    "as the released Hunyuan checkpoints give it ({'type': 'dynamic', 'alpha': ...}), "
                    "linear, llama3, yarn, longrope")
            if type(alpha) not in (int, float) or alpha <= 0:
                raise ValueError(f"{key}.alpha must be a positive number; got {alpha!r}")
            theta = {"rope_theta": params["rope_theta"]} if params.get("rope_theta") is not None else {}
            raw[key], raw["rope_alpha"] = {"rope_type": "default", **theta}, float(alpha)
        return super()._rope_fields(raw)

    @model_validator(mode="after")
    def _heads(self) -> HunyuanCheckpoint:
        problems = head_problems(self.num_attention_heads, self.kv_heads, self.dim, None, self.num_hidden_layers)
        if self.rope_alpha is not None and self.dim <= 2:
            problems.append(f"an NTK alpha stretches RoPE by alpha ** (head_dim / (head_dim - 2)): head_dim must "
                            f"exceed 2; got {self.dim}")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def rope_base(self) -> float:
        """RoPE's theta, stretched by the NTK alpha as transformers' ``compute_ntk_alpha_rope_parameters``."""
        if self.rope_alpha is None:
            return self.rope_theta
        return self.rope_theta * self.rope_alpha ** (self.dim / (self.dim - 2))

    def attn_spec(self) -> AttentionSpec:
        return gqa_spec(self.num_attention_heads, self.kv_heads, self.dim)

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.dim, self.rope_base, scaling=self.rope_scaling),
                    bias=self.attention_bias, qk_norm_eps=eps, qk_norm_after_rope=True,
                ),
                h, self.intermediate_size, eps,
                mlp=build_mlp(self.moe, i, h, self.intermediate_size),
            )
            for i in range(self.num_hidden_layers)
        ]


class HunyuanDenseCheckpoint(HunyuanCheckpoint):
    """``HunYuanDenseV1ForCausalLM``: Llama's MLPs."""

    moe: ClassVar[None] = None
    renames: ClassVar[tuple[Rename, ...]] = (*DECODER_RENAMES, *ATTENTION_RENAMES)


class HunyuanMoECheckpoint(HunyuanCheckpoint):
    """``HunYuanMoEV1ForCausalLM``: every MLP a mixture of experts with a shared expert."""

    moe: MoEConfig | None = None

    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if ".mlp." not in r.hf),
        *ATTENTION_RENAMES,
        *HUNYUAN_MOE_RENAMES,
    )

    @model_validator(mode="before")
    @classmethod
    def _experts(cls, raw: Any) -> Any:
        return {**raw, "moe": hunyuan_moe_settings(raw)} if isinstance(raw, dict) else raw
