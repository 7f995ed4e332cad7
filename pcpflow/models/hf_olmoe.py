"""AllenAI's OLMoE checkpoints (``OlmoeForCausalLM``: OLMoE-1B-7B-0924 / -0125 and their -Instruct), as
transformers' ``modeling_olmoe.py`` computes them:

- Llama's *pre-norm* layers (``input_layernorm``, ``post_attention_layernorm``: unlike OLMo 2's
  post-norm ones) and RMSNorm, scaled after it rounds (``OlmoeRMSNorm``: Llama's, not OLMo 2's);
- q and k each normed over the whole projection (all heads at once, as OLMo 2's, but rounded before
  the scale) before RoPE; under tensor parallelism the mean square is the TP group's
  (``ShardedRMSNorm``); ``head_dim`` is hidden / heads (the norms are that wide);
- ``clip_qkv`` (null in the released configs): q and k after their norms, and v, clamped to
  ``[-clip_qkv, clip_qkv]`` before RoPE;
- q/k/v/o biases when ``attention_bias``; untied unless ``tie_word_embeddings``;
- every MLP a mixture of experts (``hf_moe.olmoe_moe_settings``): the softmax of the router's logits
  over all ``num_experts``, its top ``num_experts_per_tok`` *not* renormalised unless
  ``norm_topk_prob`` (false in the released configs), experts ``intermediate_size`` wide, no shared
  expert; stored one tensor per expert or fused (``hf_moe.OLMOE_MOE_RENAMES``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import HeadsOfHidden
from pcpflow.models.hf_moe import OLMOE_MOE_RENAMES, olmoe_moe_settings
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import GQAAttention
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig


class OlmoeCheckpoint(HeadsOfHidden):
    """The config.json fields of an OLMoE checkpoint that pcpflow uses (``OlmoeConfig`` defaults)."""

    rms_norm_eps: float = Field(1e-5, gt=0)
    clip_qkv: float | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)  # NOTE: OlmoeConfig has none; refused unless hidden / heads
    moe: MoEConfig | None = None

    full_qk_norm: ClassVar[bool] = True
    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if ".mlp." not in r.hf),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        attention_rename("q_norm.weight", "q_norm.weight"),
        attention_rename("k_norm.weight", "k_norm.weight"),
        *OLMOE_MOE_RENAMES,
    )

    @model_validator(mode="before")
    @classmethod
    def _experts(cls, raw: Any) -> Any:
        return {**raw, "moe": olmoe_moe_settings(raw)} if isinstance(raw, dict) else raw

    @model_validator(mode="after")
    def _head_dim(self) -> OlmoeCheckpoint:
        if self.head_dim is not None and self.head_dim != self.dim:
            raise ValueError(f"head_dim={self.head_dim} is not supported; supported: hidden_size / num_attention_heads "
                             f"({self.dim}), as transformers' OlmoeAttention norms q over hidden_size")
        return self

    def build_layers(self) -> list[DecoderLayer]:
        h, eps, moe = self.hidden_size, self.rms_norm_eps, self.moe
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling),
                    bias=self.attention_bias, qk_norm_eps=eps, qk_norm_width="full", full_norm_scale_first=False,
                    clip_qkv=self.clip_qkv,
                ),
                h, self.intermediate_size, eps,
                mlp=build_mlp(moe, i, h, self.intermediate_size),
            )
            for i in range(self.num_hidden_layers)
        ]
