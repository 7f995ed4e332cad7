"""Cohere 2 checkpoints (``Cohere2ForCausalLM``: Command R7B, Command A), as transformers'
``modeling_cohere2.py`` computes them:

- each layer is *parallel*: ``x + attn(norm(x)) + mlp(norm(x))``, one norm of its input;
- the norms are Cohere's LayerNorm: centered, no bias, scaled in float32 before rounding
  (``RMSNorm(centered=True)``), eps ``layer_norm_eps``;
- ``sliding_attention`` layers (``layer_types``, else three of every ``sliding_window_pattern``
  = 4: every fourth layer is full) attend through a window of ``sliding_window`` keys and rotate
  q and k by interleaved pairs (GPT-J style; pcpflow's interleaved RoPE permutes q and k alike,
  so their dot products are transformers'); the full layers have no position embedding (NoPE);
- the logits are multiplied by ``logit_scale``; embeddings tied unless ``tie_word_embeddings:
  false``; ``head_dim`` hidden / heads; biases on q/k/v/o when ``attention_bias``.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import HeadsOfHidden, layer_kinds
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import GQAAttention

LayerType = Literal["sliding_attention", "full_attention"]


class Cohere2Checkpoint(HeadsOfHidden):
    """The config.json fields of a Cohere 2 checkpoint that pcpflow uses (transformers'
    ``Cohere2Config`` defaults)."""

    tie_word_embeddings: bool = True
    max_position_embeddings: int = Field(8192, gt=0)
    logit_scale: float = 0.0625
    sliding_window: int | None = Field(4096, gt=0)
    sliding_window_pattern: int = Field(4, gt=0)
    layer_types: list[LayerType] | None = None

    moe: ClassVar[None] = None  # dense
    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if "post_attention_layernorm" not in r.hf),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    )

    @model_validator(mode="before")
    @classmethod
    def _layer_norm_eps(cls, raw: Any) -> Any:
        """Cohere's norms read ``layer_norm_eps`` (1e-5 unless given), held as ``rms_norm_eps``."""
        if isinstance(raw, dict):
            raw = {**raw, "rms_norm_eps": raw.get("layer_norm_eps", 1e-5)}
        return raw

    @property
    def kinds(self) -> list[str]:
        """``layer_types``, else layer ``i`` slides unless ``(i + 1) % sliding_window_pattern == 0``."""
        return layer_kinds(self.layer_types, self.num_hidden_layers, self.sliding_window_pattern)

    def lm_options(self) -> dict[str, Any]:
        return {"centered": True, "logit_scale": self.logit_scale}

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    # NOTE: only the sliding layers rotate (Cohere2Attention); the full ones are NoPE
                    rotary=(RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling, interleaved=True)
                            if kind == "sliding_attention" else None),
                    bias=self.attention_bias,
                ),
                h, self.intermediate_size, eps,
                centered=True, parallel=True,
            )
            for kind in self.kinds
        ]
