"""Gemma 3 text checkpoints: ``Gemma3ForCausalLM`` (config.json ``model_type: gemma3_text``,
e.g. gemma-3-270m, gemma-3-1b) — grouped-query attention with RoPE, as transformers'
``modeling_gemma3.py`` computes it:

- every norm (the layers', the final one, the per-head q/k norms before RoPE) scales by
  ``1 + weight`` in float32 and then rounds (the stored weights are offsets from one), and
  each layer is a sandwich: ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``;
- the embedding is multiplied by ``sqrt(hidden_size)`` rounded to the weights' dtype;
- the MLP's activation is tanh-approximated GELU (``hidden_activation: gelu_pytorch_tanh``);
- the softmax scale is ``query_pre_attn_scalar ** -0.5``, ``head_dim`` is config.json's (256
  unless given); q/k/v/o biases only when ``attention_bias``; embeddings tied unless
  ``tie_word_embeddings: false``;
- each layer is ``sliding_attention`` or ``full_attention`` (``layer_types``, else every
  ``sliding_window_pattern``-th layer full, 6 unless given), with its own RoPE: full layers
  ``rope_theta`` (1e6) and ``rope_scaling`` (linear x8 on the larger models), sliding layers
  ``rope_local_base_freq`` (1e4) — as transformers 4 writes them, or transformers 5's
  ``rope_parameters`` keyed by layer type.

A sliding layer attends to the last ``sliding_window`` keys (itself included:
``AttentionSpec.window``). The logits are soft-capped when
``final_logit_softcapping`` is set; ``attn_logit_softcapping`` (which transformers' Gemma 3
does not apply) and ``use_bidirectional_attention`` are refused by name.

The multimodal Gemma 3 (``Gemma3ForConditionalGeneration``: 4B, 12B, 27B) runs its language
model on text (``Gemma3MultimodalCheckpoint``: ``text_config``, tensors under ``language_model.``).

Gemma 2 (``Gemma2ForCausalLM``, ``Gemma2Checkpoint``): the same, without q/k norms, one RoPE
for every layer (``rope_theta``, ``rope_scaling``), the even layers sliding unless
``layer_types`` says otherwise, attention scores soft-capped (``attn_logit_softcapping``, 50)
and logits too (``final_logit_softcapping``, 30).

Gemma 1 (``GemmaForCausalLM``, ``GemmaCheckpoint``: gemma-2b, gemma-7b): Gemma 2's norms,
embedding scale, MLP and RoPE in Llama's pre-norm layers, every layer full, the softmax scale
``head_dim ** -0.5``, nothing soft-capped.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, GatedMLP, RopeScaling, RotaryEmbedding
from pcpflow.models.hf_checkpoint import (
    GQACheckpoint,
    LanguageModelOf,
    head_problems,
    layer_kinds,
    read_rope,
)
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename, layer_norm_rename
from pcpflow.models.layers import GQAAttention, gqa_spec

LayerType = Literal["sliding_attention", "full_attention"]


class Gemma3Checkpoint(GQACheckpoint):
    """The config.json fields of a Gemma 3 text checkpoint that pcpflow uses (transformers'
    ``Gemma3TextConfig`` defaults)."""

    num_key_value_heads: int = Field(4, gt=0)
    head_dim: int = Field(256, gt=0)
    query_pre_attn_scalar: float = Field(256, gt=0)
    hidden_activation: Literal["gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    hidden_act: Any = None  # NOTE: transformers' Gemma 3 reads hidden_activation only
    tie_word_embeddings: bool = True
    max_position_embeddings: int = Field(131072, gt=0)
    sliding_window: int = Field(4096, gt=0)
    sliding_window_pattern: int = Field(6, gt=0)
    layer_types: list[LayerType] | None = None
    local_rope_theta: float = Field(10000.0, gt=0)  # the sliding layers' RoPE
    local_rope_scaling: RopeScaling | None = None
    attn_logit_softcapping: float | None = Field(None, gt=0)
    final_logit_softcapping: float | None = Field(None, gt=0)
    use_bidirectional_attention: bool | None = False

    moe: ClassVar[None] = None  # dense
    qk_norm: ClassVar[bool] = True  # q/k norms before RoPE (Gemma 2: none)
    sandwich: ClassVar[bool] = True  # each block's output normed too (Gemma 1: Llama's pre-norm layers)
    attn_softcap: ClassVar[bool] = False  # whether transformers' attention applies attn_logit_softcapping
    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if "layernorm" not in r.hf),
        # NOTE: transformers' post_attention_layernorm norms the attention's output; the MLP's
        # input norm is its pre_feedforward_layernorm (pcpflow's post_attention_norm)
        layer_norm_rename("input_layernorm", "input_norm"),
        layer_norm_rename("post_attention_layernorm", "attn_out_norm"),
        layer_norm_rename("pre_feedforward_layernorm", "post_attention_norm"),
        layer_norm_rename("post_feedforward_layernorm", "mlp_out_norm"),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        attention_rename("q_norm.weight", "q_norm.weight"),
        attention_rename("k_norm.weight", "k_norm.weight"),
    )

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Full layers' RoPE into ``rope_theta`` / ``rope_scaling``, sliding layers' into
        ``local_rope_theta`` / ``local_rope_scaling``, as transformers'
        ``Gemma3TextConfig.convert_rope_params_to_dict`` reads them."""
        params = raw.pop("rope_parameters", None)
        scaling = raw.pop("rope_scaling", None)
        if params is None:  # transformers 4: rope_scaling is the full layers'
            params, where = {"full_attention": scaling or {}}, {"full_attention": "rope_scaling"}
        else:
            where = {t: f"rope_parameters.{t}" for t in ("full_attention", "sliding_attention")}
            if not isinstance(params, dict) or not params or set(params) - set(where):
                raise ValueError(
                    "rope_parameters of a Gemma 3 config.json maps each layer type (full_attention, "
                    f"sliding_attention) to its RoPE settings; got {params!r}"
                )
        raw["rope_theta"], raw["rope_scaling"] = read_rope(
            params.get("full_attention") or {}, where["full_attention"], raw,
            default_theta=raw.get("rope_theta") or 1_000_000.0,
        )
        raw["local_rope_theta"], raw["local_rope_scaling"] = read_rope(
            params.get("sliding_attention") or {}, "rope_parameters.sliding_attention", raw,
            default_theta=raw.get("rope_local_base_freq") or 10_000.0,
        )
        return raw

    @model_validator(mode="after")
    def _what_pcpflow_runs(self) -> Gemma3Checkpoint:
        problems = []
        if self.attn_logit_softcapping is not None and not self.attn_softcap:
            problems.append(f"attn_logit_softcapping={self.attn_logit_softcapping} is not supported (Gemma 2's "
                            f"soft-capped attention scores, which transformers' {self.architecture} does not "
                            "apply); its released checkpoints have none")
        if self.use_bidirectional_attention:
            problems.append("use_bidirectional_attention=true is not supported (every token also sees later ones, "
                            "as in an embedding model); pcpflow generates with causal attention")
        problems += head_problems(self.num_attention_heads, self.num_key_value_heads, self.head_dim, self.layer_types,
                                  self.num_hidden_layers)
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def kinds(self) -> list[LayerType]:
        """Each layer's type as transformers reads it: ``layer_types``, else layer ``i`` slides
        unless ``(i + 1) % sliding_window_pattern == 0``."""
        return layer_kinds(self.layer_types, self.num_hidden_layers, self.sliding_window_pattern)

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind == "sliding_attention"]

    @property
    def window(self) -> int | None:
        """The sliding layers' window (the most recent keys a query sees, itself included:
        transformers masks keys at ``kv <= q - sliding_window``); None: no layer slides."""
        return self.sliding_window if self.sliding_layers else None

    @property
    def softmax_scale(self) -> float:
        return self.query_pre_attn_scalar**-0.5

    def attn_spec(self) -> AttentionSpec:
        spec = gqa_spec(self.num_attention_heads, self.kv_heads, self.dim, scale=self.softmax_scale)
        return dataclasses.replace(spec, softcap=self.attn_logit_softcapping if self.attn_softcap else None,
                                   window=self.window, window_layers=tuple(self.sliding_layers))

    def lm_options(self) -> dict[str, Any]:
        return {"embed_scale": self.hidden_size**0.5, "unit_offset": True,
                "final_logit_softcapping": self.final_logit_softcapping}

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        rope = {"full_attention": (self.rope_theta, self.rope_scaling),
                "sliding_attention": (self.local_rope_theta, self.local_rope_scaling)}
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.dim, rope[kind][0], scaling=rope[kind][1]),
                    bias=self.attention_bias, qk_norm_eps=eps if self.qk_norm else None, unit_offset=True,
                ),
                h, self.intermediate_size, eps,
                mlp=GatedMLP(h, self.intermediate_size, activation="gelu_tanh"),
                sandwich=self.sandwich, unit_offset=True,
            )
            for kind in self.kinds
        ]


class Gemma2Checkpoint(Gemma3Checkpoint):
    """The config.json fields of a Gemma 2 checkpoint (transformers' ``Gemma2Config`` defaults):
    Gemma 3's layers without q/k norms, one RoPE for all of them, the even layers sliding (a
    pattern of 2), attention scores and logits soft-capped."""

    sliding_window_pattern: int = Field(2, gt=0)
    max_position_embeddings: int = Field(8192, gt=0)
    attn_logit_softcapping: float | None = Field(50.0, gt=0)
    final_logit_softcapping: float | None = Field(30.0, gt=0)

    qk_norm: ClassVar[bool] = False
    attn_softcap: ClassVar[bool] = True

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """One RoPE for every layer, read as any Llama-style config.json's."""
        raw = super(Gemma3Checkpoint, cls)._rope_fields(raw)
        raw["local_rope_theta"], raw["local_rope_scaling"] = raw["rope_theta"], raw.get("rope_scaling")
        return raw


class GemmaCheckpoint(Gemma2Checkpoint):
    """The config.json fields of a Gemma (1) checkpoint (``GemmaForCausalLM``: gemma-2b, -7b, their
    ``-it``; transformers' ``GemmaConfig`` defaults): Gemma 2's norms (``1 + weight``), embedding
    scale, GELU-tanh MLP and one RoPE in Llama's pre-norm layers (no sandwich), every layer
    full attention, the softmax scale ``head_dim ** -0.5``, no soft-capping. The MLP's
    activation is ``hidden_act`` (the released configs' ``"gelu"`` is read by transformers as the
    tanh approximation, as ``gelu_pytorch_tanh``); ``hidden_activation`` is not read."""

    num_key_value_heads: int = Field(16, gt=0)
    hidden_act: Literal["gelu", "gelu_pytorch_tanh"] = "gelu_pytorch_tanh"
    hidden_activation: Any = None
    attn_logit_softcapping: float | None = Field(None, gt=0)
    final_logit_softcapping: float | None = Field(None, gt=0)

    sandwich: ClassVar[bool] = False
    attn_softcap: ClassVar[bool] = False
    renames: ClassVar[tuple[Rename, ...]] = (
        *DECODER_RENAMES,
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
    )

    @model_validator(mode="after")
    def _no_softcap(self) -> GemmaCheckpoint:
        if self.final_logit_softcapping is not None:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping} is not supported: transformers' "
                             "GemmaForCausalLM does not soft-cap its logits (Gemma 2 and 3 do); Gemma checkpoints "
                             "have none")
        return self

    @property
    def kinds(self) -> list[LayerType]:
        """Every layer attends to every earlier key (Gemma 1 has no sliding layers)."""
        return ["full_attention"] * self.num_hidden_layers

    @property
    def softmax_scale(self) -> float:
        return self.dim**-0.5


GEMMA3_TEXT_DEFAULTS = dict(vocab_size=262_208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                            num_attention_heads=8)
"""transformers' ``Gemma3TextConfig`` defaults of what ``CheckpointConfig`` requires: a multimodal
config.json's ``text_config`` writes only what differs from them (gemma-3-4b-it: hidden size,
widths, depth, RoPE scaling, window)."""


class Gemma3MultimodalCheckpoint(LanguageModelOf, Gemma3Checkpoint):
    """The language model of a multimodal Gemma 3 checkpoint (``Gemma3ForConditionalGeneration``,
    config.json ``model_type: gemma3``: gemma-3-4b, -12b, -27b), run on text alone
    (``LanguageModelOf``). Without an image transformers' forward is its text model's (causal
    and sliding masks, no bidirectional image blocks), but for one setting: its LM head is not
    soft-capped, so a ``text_config`` with ``final_logit_softcapping`` set is refused rather
    than guessed."""

    text_architecture: ClassVar[str] = "Gemma3ForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("gemma3_text",)
    text_defaults: ClassVar[dict[str, Any]] = GEMMA3_TEXT_DEFAULTS
    renames: ClassVar[tuple[Rename, ...]] = LanguageModelOf.prefixed(Gemma3Checkpoint.renames)

    @model_validator(mode="after")
    def _logits_as_transformers(self) -> Gemma3MultimodalCheckpoint:
        if self.final_logit_softcapping is not None:
            raise ValueError(f"text_config.final_logit_softcapping={self.final_logit_softcapping} is not supported: "
                             "transformers' Gemma3ForConditionalGeneration does not soft-cap its logits (its "
                             "Gemma3ForCausalLM does); released Gemma 3 checkpoints have null")
        return self
