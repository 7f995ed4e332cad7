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

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding, yarn_mscale
from pcpflow.models.layers import MLAAttention, mla_spec
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.moe import build_mlp, moe_config_problems
from pcpflow.models.moe_config import MoEConfig

LATENT_NORM_EPS = 1e-6
"""eps of the q_a / kv_a norms (transformers and DeepSeek's own code: the RMSNorm default)."""

_FIRST_K_DENSE_DEFAULT = {"DeepseekV2ForCausalLM": 0, "DeepseekV3ForCausalLM": 3}

# transformers' defaults of the MoE fields a config.json may omit
_MOE_DEFAULTS = {
    "DeepseekV3ForCausalLM": dict(
        n_routed_experts=256, num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1,
        n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, topk_method="noaux_tc",
    ),
    "DeepseekV2ForCausalLM": dict(
        n_routed_experts=64, num_experts_per_tok=None, moe_intermediate_size=1407, n_shared_experts=2,
        n_group=None, topk_group=None, norm_topk_prob=False, routed_scaling_factor=1.0, topk_method="greedy",
    ),
}
_MLP = "model.layers.{i}.mlp."
MOE_RENAMES = (
    Rename(_MLP + "gate.weight", "layers.{i}.mlp.gate.weight"),
    Rename(_MLP + "gate.e_score_correction_bias", "layers.{i}.mlp.gate.e_score_correction_bias"),
    Rename(_MLP + "experts.{j}.gate_proj.weight", "layers.{i}.mlp.experts.{j}.gate_up_proj.weight", (0, 2)),
    Rename(_MLP + "experts.{j}.up_proj.weight", "layers.{i}.mlp.experts.{j}.gate_up_proj.weight", (1, 2)),
    Rename(_MLP + "experts.{j}.down_proj.weight", "layers.{i}.mlp.experts.{j}.down_proj.weight"),
    Rename(_MLP + "shared_experts.gate_proj.weight", "layers.{i}.mlp.shared_experts.gate_up_proj.weight", (0, 2)),
    Rename(_MLP + "shared_experts.up_proj.weight", "layers.{i}.mlp.shared_experts.gate_up_proj.weight", (1, 2)),
    Rename(_MLP + "shared_experts.down_proj.weight", "layers.{i}.mlp.shared_experts.down_proj.weight"),
)
"""Routed experts (one tensor per expert and projection, as DeepSeek and transformers'
``save_pretrained`` store them), router and shared experts."""


def _moe_settings(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``MoEConfig`` fields of a DeepSeek config.json dict, None when every layer is
    dense; ValueError naming an unsupported MoE variant."""
    arch = raw.get("architecture")
    if raw.get("n_routed_experts") is None or raw["first_k_dense_replace"] >= raw.get("num_hidden_layers", 0):
        return None
    get = {**_MOE_DEFAULTS.get(arch, {}), **{k: v for k, v in raw.items() if v is not None}}.get
    if get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={get('moe_layer_freq')} is not supported (transformers makes every layer past first_k_dense_replace MoE); supported: 1")
    method, scoring = get("topk_method"), get("scoring_func", "sigmoid" if arch == "DeepseekV3ForCausalLM" else "softmax")
    if arch == "DeepseekV3ForCausalLM":
        if method not in ("noaux_tc", None) or scoring != "sigmoid":
            raise ValueError(
                f"DeepSeek-V3 MoE routing topk_method={method!r} scoring_func={scoring!r} is not "
                "supported; supported: topk_method 'noaux_tc' with scoring_func 'sigmoid'"
            )
        groups, norm = (get("n_group") or 1, get("topk_group") or 1), bool(get("norm_topk_prob"))
    else:
        if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
            raise ValueError(
                f"DeepSeek-V2 MoE routing topk_method={method!r} scoring_func={scoring!r} is not "
                "supported; supported: topk_method 'greedy' or 'group_limited_greedy' with softmax"
            )
        groups = (get("n_group") or 1, get("topk_group") or 1) if method == "group_limited_greedy" else (1, 1)
        norm = False  # NOTE: transformers' DeepseekV2TopkRouter ignores norm_topk_prob
    if get("num_experts_per_tok") is None:
        raise ValueError("num_experts_per_tok is required for MoE layers")
    moe = dict(
        num_experts=get("n_routed_experts"),
        top_k=get("num_experts_per_tok"),
        intermediate_size=get("moe_intermediate_size"),
        num_shared_experts=get("n_shared_experts") or 0,
        n_group=groups[0],
        topk_group=groups[1],
        norm_topk_prob=norm,
        routed_scaling_factor=get("routed_scaling_factor"),
        scoring_func=scoring,
        first_k_dense_replace=raw["first_k_dense_replace"],
    )
    problems = moe_config_problems(MoEConfig(**moe), field="moe")
    if problems:
        raise ValueError("; ".join(f"{p.field}={p.given}: {p.allowed}" for p in problems))
    return moe


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
    moe: MoEConfig | None = None  # from the MoE fields (``_moe_settings``)

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

    @model_validator(mode="before")
    @classmethod
    def _moe_defaults(cls, raw: Any) -> Any:
        # NOTE: transformers' defaults when a config.json omits them (both mean MoE layers)
        if isinstance(raw, dict):
            raw = dict(raw)
            defaults = _MOE_DEFAULTS.get(raw.get("architecture"), {})
            raw.setdefault("n_routed_experts", defaults.get("n_routed_experts", 64))
            if raw.get("first_k_dense_replace") is None:
                raw["first_k_dense_replace"] = _FIRST_K_DENSE_DEFAULT.get(
                    raw.get("architecture"), 0
                )
            raw["moe"] = _moe_settings(raw)
        return raw

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
        return mla_spec(self.num_attention_heads, self.kv_lora_rank, self.qk_rope_head_dim, self.softmax_scale())

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
        return MLAAttention(
            hidden_size=self.hidden_size,
            num_heads=self.num_attention_heads,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            nope_dim=self.qk_nope_head_dim,
            rope_dim=self.qk_rope_head_dim,
            v_dim=self.v_head_dim,
            rotary=RotaryEmbedding(
                self.qk_rope_head_dim, self.rope_theta, scaling=self.rope_scaling, interleaved=self.interleaved_rope
            ),
            latent_norm_eps=LATENT_NORM_EPS,
            bias=self.attention_bias,
        )
