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

Cohere (1) checkpoints (``CohereForCausalLM``: Command R, Aya 23, Aya Expanse): the same parallel
layers, every one full attention with interleaved RoPE (``rope_theta``, 500,000 where config.json
gives none, as transformers' ``CohereConfig``); ``use_qk_norm`` (Command R+'s per-head LayerNorms
of q and k, a weight per head) is refused by name.
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

    def _rotary(self, kind: str) -> RotaryEmbedding | None:
        """Only the sliding layers rotate (Cohere2Attention); the full ones are NoPE."""
        return self._interleaved_rope() if kind == "sliding_attention" else None

    def _interleaved_rope(self) -> RotaryEmbedding:
        return RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling, interleaved=True)

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=self._rotary(kind),
                    bias=self.attention_bias,
                ),
                h, self.intermediate_size, eps,
                centered=True, parallel=True,
            )
            for kind in self.kinds
        ]


class CohereCheckpoint(Cohere2Checkpoint):
    """The config.json fields of a Cohere (1) checkpoint that pcpflow uses (transformers'
    ``CohereConfig`` defaults): Cohere 2's layers, every one full and rotated."""

    sliding_window: int | None = None
    use_qk_norm: bool = False

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        params = raw.get("rope_parameters")
        if raw.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
            raw["rope_theta"] = 500_000.0  # NOTE: transformers' CohereConfig.default_theta
        return super()._rope_fields(raw)

    @model_validator(mode="after")
    def _no_qk_norm(self) -> CohereCheckpoint:
        if self.use_qk_norm:
            raise ValueError("use_qk_norm=true is not supported (Command R+'s LayerNorms of q and k, a weight per "
                             "head); Command R, Aya 23 and Aya Expanse have false")
        return self

    @property
    def kinds(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers

    def _rotary(self, kind: str) -> RotaryEmbedding | None:
        return self._interleaved_rope()  # NOTE: every layer (CohereAttention)
