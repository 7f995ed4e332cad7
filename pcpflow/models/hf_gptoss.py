"""OpenAI's gpt-oss checkpoints (``GptOssForCausalLM``: gpt-oss-20b, gpt-oss-120b), as
transformers' ``modeling_gpt_oss.py`` computes them:

- attention with biases on q, k, v and o, GQA (``head_dim`` as config.json gives it), and an
  *attention sink* per query head (``self_attn.sinks``): one more logit in every row's softmax
  that reads no value (``GQAAttention(sinks=True)``: pcpflow adds it once to each row's whole
  softmax, after a DCP or ring merge);
- the ``sliding_attention`` layers (``layer_types``, else every other layer from the first)
  attend through ``sliding_window`` keys (128 in the released models), the others to all;
- RoPE on the two halves of each head, YaRN by default (factor 32 over 4096 positions, the
  correction range not rounded: ``truncate: false``), theta 150,000;
- every MLP is a mixture of experts (``hf_moe.gqa_moe_settings``): a router with a bias, the
  top-k chosen on its raw logits and weighted by a softmax over the chosen ones; experts with
  biases and a clamped SwiGLU, ``(up + 1) * gate * sigmoid(1.702 gate)`` (gate clamped above,
  up on both sides, at ``swiglu_limit``); no shared expert;
- every norm scales before rounding to the model's dtype (``GptOssRMSNorm``); untied unless
  ``tie_word_embeddings``.

The released checkpoints store the experts in MXFP4 (``quantization_config.quant_method:
mxfp4``): the loader dequantizes them to the run's dtype as transformers does without a
Triton kernel (``hf_moe``); every other quantization is refused.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import GQACheckpoint, head_problems, layer_kinds
from pcpflow.models.hf_moe import GPT_OSS_MOE_RENAMES, gqa_moe_settings
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import GQAAttention, gqa_spec
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig

LayerType = Literal["sliding_attention", "full_attention"]

YARN_DEFAULT = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                "original_max_position_embeddings": 4096}
"""``GptOssConfig``'s RoPE when config.json gives none."""


class GptOssCheckpoint(GQACheckpoint):
    """The config.json fields of a gpt-oss checkpoint that pcpflow uses (transformers'
    ``GptOssConfig`` defaults)."""

    head_dim: int = Field(64, gt=0)
    num_key_value_heads: int = Field(8, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    attention_bias: bool = True
    sliding_window: int | None = Field(128, gt=0)
    layer_types: list[LayerType] | None = None
    moe: MoEConfig

    dequantized: ClassVar[tuple[str, ...]] = ("mxfp4",)

    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if ".mlp." not in r.hf),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        attention_rename("sinks", "sinks"),
        *GPT_OSS_MOE_RENAMES,
    )

    @model_validator(mode="before")
    @classmethod
    def _experts(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and "moe" not in raw:
            raw = {**raw, "moe": gqa_moe_settings(raw, "GptOssForCausalLM")}
        return raw

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """YaRN and theta 150,000 where config.json is silent (``GptOssConfig``)."""
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_parameters"] = dict(YARN_DEFAULT)
        params = raw.get("rope_parameters") or raw.get("rope_scaling")
        if isinstance(params, dict) and params.get("rope_theta") is None and raw.get("rope_theta") is None:
            raw["rope_theta"] = 150_000.0
        return super()._rope_fields(raw)

    @model_validator(mode="after")
    def _heads(self) -> GptOssCheckpoint:
        problems = head_problems(self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.layer_types,
                                 self.num_hidden_layers)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def kinds(self) -> list[str]:
        """``layer_types``, else ``GptOssConfig``'s: layer ``i`` slides unless ``(i + 1) % 2 == 0``."""
        return layer_kinds(self.layer_types, self.num_hidden_layers, 2)

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind == "sliding_attention"]

    @property
    def window(self) -> int | None:
        return self.sliding_window if self.sliding_layers else None

    def attn_spec(self) -> AttentionSpec:
        spec = gqa_spec(self.num_attention_heads, self.kv_heads, self.dim)
        return dataclasses.replace(spec, window=self.window, window_layers=tuple(self.sliding_layers))

    def lm_options(self) -> dict[str, Any]:
        return {"scale_first": True}

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling),
                    bias=self.attention_bias, sinks=True,
                ),
                h, self.intermediate_size, eps,
                mlp=build_mlp(self.moe, i, h, self.intermediate_size),
                scale_first=True,
            )
            for i in range(self.num_hidden_layers)
        ]
