"""DeepSeek-V2 / V3 checkpoints (``DeepseekV2ForCausalLM``, ``DeepseekV3ForCausalLM``):
multi-head latent attention (MLA), dense MLP layers.

The cache holds, per token, the normalized latent ``c_kv`` and the roped, head-shared
``k_pe``; queries are absorbed into latent space (``q_nope @ W_UK``) and the latent output
goes through ``W_UV`` (``pcpflow.models.layers.MLAAttention``). What transformers does and pcpflow follows:

- RoPE pairs: V2 always rotates interleaved pairs; V3 does when ``rope_interleave`` (the
  default), else rotate-half.
- YaRN: cos/sin carry YaRN's attention factor, and when ``mscale_all_dim`` is set the
  softmax scale is multiplied by ``yarn_mscale(factor, mscale_all_dim) ** 2``.
- The ``q_a`` / ``kv_a`` norms use eps 1e-6 whatever ``rms_norm_eps`` says.

Mixture-of-experts layers (``n_routed_experts`` set, layers ``>= first_k_dense_replace``)
load into ``pcpflow.models.moe.MoEMLP`` with transformers' routing: V3 sigmoid scores with
``e_score_correction_bias`` and groups (``topk_method`` ``noaux_tc``), V2 softmax scores
(``greedy`` or ``group_limited_greedy``; transformers' V2 never renormalises the top-k
weights, so neither does pcpflow). Other variants (``moe_layer_freq`` != 1, another
``topk_method`` / ``scoring_func``) are rejected by name when the config is validated.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding, yarn_mscale
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_moe import MOE_DEFAULTS, MOE_RENAMES, moe_settings
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import MLAAttention, mla_attention, mla_cache_spec
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig

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
    mlp_bias: bool = False  # DeepSeek-V2's config has it (biases on every MLP, the experts' too)
    n_routed_experts: int | None = None
    first_k_dense_replace: int = Field(ge=0)
    moe: MoEConfig | None = None  # from the MoE fields (``hf_moe.moe_settings``)

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
        *MOE_RENAMES,
    )

    @field_validator("mlp_bias")
    @classmethod
    def _no_mlp_bias(cls, value: bool) -> bool:
        if value:
            raise ValueError("MLP biases (mlp_bias: true) are not supported for DeepSeek checkpoints (pcpflow's DeepSeek "
                             "MLPs and experts have none; no released checkpoint sets it)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _moe_defaults(cls, raw: Any) -> Any:
        # NOTE: transformers' defaults when a config.json omits them (both mean MoE layers)
        if isinstance(raw, dict):
            raw = dict(raw)
            defaults = MOE_DEFAULTS.get(raw.get("architecture"), {})
            raw.setdefault("n_routed_experts", defaults.get("n_routed_experts", 64))
            if raw.get("first_k_dense_replace") is None:
                raw["first_k_dense_replace"] = _FIRST_K_DENSE_DEFAULT.get(
                    raw.get("architecture"), 0
                )
            try:
                raw["moe"] = moe_settings(raw)
            except TypeError:  # a field of the wrong type: the field's own validation names it
                raw["moe"] = None
        return raw

    @property
    def rope_dims(self) -> int:
        return self.qk_rope_head_dim

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
        return mla_cache_spec(self, num_heads=self.num_attention_heads, scale=self.softmax_scale())

    def build_layers(self) -> list[DecoderLayer]:
        return [
            DecoderLayer(
                self._attention(),
                self.hidden_size,
                self.intermediate_size,
                self.rms_norm_eps,
                mlp=build_mlp(self.moe, i, self.hidden_size, self.intermediate_size),
            )
            for i in range(self.num_hidden_layers)
        ]

    def _attention(self) -> MLAAttention:
        rotary = RotaryEmbedding(
            self.qk_rope_head_dim, self.rope_theta, scaling=self.rope_scaling, interleaved=self.interleaved_rope
        )
        return mla_attention(self, self.hidden_size, num_heads=self.num_attention_heads, rotary=rotary,
                             latent_norm_eps=LATENT_NORM_EPS, bias=self.attention_bias)
