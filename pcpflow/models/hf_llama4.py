"""Meta's Llama 4 checkpoints (``Llama4ForCausalLM``; the language model of
``Llama4ForConditionalGeneration``: Llama-4-Scout-17B-16E, Llama-4-Maverick-17B-128E), as
transformers' ``modeling_llama4.py`` computes them on text:

- GQA with ``head_dim`` as config.json gives it, biases per ``attention_bias``; RoPE as a complex
  product, i.e. on *adjacent* pairs of a head (``RotaryEmbedding(interleaved=True)``), llama3
  scaling in the released models, theta 500,000 by default;
- ``no_rope_layers`` (1: RoPE, 0: NoPE; by default every ``no_rope_layer_interval``-th layer is
  NoPE): on a RoPE layer with ``use_qk_norm``, q and k are normed per head by a weightless RMSNorm
  *after* RoPE; on a NoPE layer with ``attn_temperature_tuning``, q at position ``p`` is scaled by
  ``log1p(floor((p + 1) / floor_scale)) * attn_scale + 1``;
- the ``chunked_attention`` layers (``layer_types``, else the RoPE layers when
  ``attention_chunk_size`` is set) attend within their chunk: a row at position ``p`` sees keys
  ``p - p % C .. p`` (``AttentionSpec.window = C``, ``window_kind = "chunked"``); the others to all;
- MoE on ``moe_layers`` (else every ``interleave_moe_layer_step``-th layer): the top-k experts of
  the router's raw logits, each receiving the input scaled by the sigmoid of its logit, their
  outputs summed unweighted, plus a shared expert (``hf_moe.llama4_moe_settings``); the dense
  layers' MLPs are ``intermediate_size_mlp`` wide;
- Llama's RMSNorm (scaled after rounding), untied unless ``tie_word_embeddings``.

NOTE: pcpflow's ``intermediate_size`` is the dense MLPs' width, as in every other family: here
config.json's ``intermediate_size_mlp``. config.json's ``intermediate_size`` (the routed and the
shared experts' width) is ``moe.intermediate_size``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import (
    GQACheckpoint,
    LanguageModelOf,
    head_problems,
)
from pcpflow.models.hf_moe import LLAMA4_MOE_RENAMES, llama4_moe_settings
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename
from pcpflow.models.layers import GQAAttention, QueryScaling, gqa_spec
from pcpflow.models.moe import build_mlp
from pcpflow.models.moe_config import MoEConfig

LayerType = Literal["chunked_attention", "full_attention"]

LLAMA4_TEXT_DEFAULTS = dict(vocab_size=202048, hidden_size=5120, intermediate_size=8192, num_hidden_layers=48,
                            num_attention_heads=40)
"""``Llama4TextConfig``'s defaults of what ``CheckpointConfig`` requires (a multimodal config.json's
``text_config`` may leave them out)."""


class Llama4Checkpoint(GQACheckpoint):
    """The config.json fields of a Llama 4 text model that pcpflow uses (transformers'
    ``Llama4TextConfig`` defaults)."""

    head_dim: int | None = Field(128, gt=0)
    num_key_value_heads: int | None = Field(8, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    max_position_embeddings: int = Field(131072, gt=0)
    intermediate_size_mlp: int = Field(16384, gt=0)
    no_rope_layers: list[Literal[0, 1]] | None = None
    no_rope_layer_interval: int = Field(4, gt=0)
    attention_chunk_size: int | None = Field(8192, gt=0)
    layer_types: list[LayerType] | None = None
    use_qk_norm: bool = True
    # NOTE: read as transformers tests it (truthiness): configs of transformers 4.51 wrote 4
    attn_temperature_tuning: bool | int = True
    floor_scale: int = Field(8192, gt=0)
    attn_scale: float = 0.1
    moe: MoEConfig | None = None

    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if ".mlp." not in r.hf),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        *LLAMA4_MOE_RENAMES,
    )

    @model_validator(mode="before")
    @classmethod
    def _widths(cls, raw: Any) -> Any:
        """The experts (``moe``) from config.json's MoE fields and its ``intermediate_size``; pcpflow's
        ``intermediate_size`` is the dense MLPs' (``intermediate_size_mlp``)."""
        if not isinstance(raw, dict) or "moe" in raw:
            return raw
        raw = {**raw, "moe": llama4_moe_settings(raw)}
        raw["intermediate_size"] = raw.get("intermediate_size_mlp", 16384)
        return raw

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Theta 500,000 where config.json gives none (``Llama4TextConfig.default_theta``)."""
        params = raw.get("rope_parameters") or raw.get("rope_scaling")
        if raw.get("rope_theta") is None and not (isinstance(params, dict) and params.get("rope_theta") is not None):
            raw["rope_theta"] = 500_000.0
        return super()._rope_fields(raw)

    @model_validator(mode="after")
    def _layers(self) -> Llama4Checkpoint:
        problems = head_problems(self.num_attention_heads, self.kv_heads, self.dim, self.layer_types,
                                 self.num_hidden_layers)
        if self.no_rope_layers and len(self.no_rope_layers) < self.num_hidden_layers:
            problems.append(f"no_rope_layers has {len(self.no_rope_layers)} entries; num_hidden_layers is "
                            f"{self.num_hidden_layers} (one per layer at least, as transformers reads it)")
        elif self.chunked_layers and self.attention_chunk_size is None:
            problems.append(f"layer_types makes layers {self.chunked_layers} chunked_attention, but "
                            "attention_chunk_size is null: give the chunk size")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def rope_layers(self) -> list[bool]:
        """Whether each layer rotates q and k: ``no_rope_layers`` (an empty list is none, as
        transformers reads it), else all but every ``no_rope_layer_interval``-th."""
        if self.no_rope_layers:
            return [bool(r) for r in self.no_rope_layers[: self.num_hidden_layers]]
        return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(self.num_hidden_layers)]

    @property
    def kinds(self) -> list[str]:
        """``layer_types``, else ``Llama4TextConfig``'s: a RoPE layer is chunked when there is a chunk size."""
        if self.layer_types is not None:
            return list(self.layer_types)
        chunked = self.attention_chunk_size is not None
        return ["chunked_attention" if rope and chunked else "full_attention" for rope in self.rope_layers]

    @property
    def chunked_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind == "chunked_attention"]

    @property
    def window(self) -> int | None:
        """The chunked layers' chunk (None: no layer is chunked)."""
        return self.attention_chunk_size if self.chunked_layers else None

    @property
    def sliding_layers(self) -> list[int]:
        """The layers that attend through ``window`` (chunked, ``attn_spec``'s ``window_kind``)."""
        return self.chunked_layers

    @property
    def window_kind(self) -> str:
        """How the ``sliding_layers`` read (a model card's ``window_kind``): within their chunk."""
        return "chunked"

    def attn_spec(self) -> AttentionSpec:
        spec = gqa_spec(self.num_attention_heads, self.kv_heads, self.dim)
        return dataclasses.replace(spec, window=self.window, window_layers=tuple(self.chunked_layers),
                                   window_kind="chunked")

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        tuning = QueryScaling(self.floor_scale, self.attn_scale, "llama4") if self.attn_temperature_tuning else None
        expert_width = self.moe.intermediate_size if self.moe is not None else self.intermediate_size
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling, interleaved=True)
                    if rope else None,
                    bias=self.attention_bias,
                    # NOTE: Llama4TextAttention: the q/k norm on RoPE layers only, the temperature on NoPE ones only
                    rope_l2_eps=eps if rope and self.use_qk_norm else None,
                    query_scaling=None if rope else tuning,
                ),
                h, self.intermediate_size, eps,
                mlp=build_mlp(self.moe, i, h, expert_width),
            )
            for i, rope in enumerate(self.rope_layers)
        ]


class Llama4MultimodalCheckpoint(LanguageModelOf, Llama4Checkpoint):
    """The language model of a multimodal Llama 4 checkpoint (``Llama4ForConditionalGeneration``,
    config.json ``model_type: llama4``: every released Scout and Maverick), run on text alone
    (``LanguageModelOf``): a ``Llama4ForCausalLM`` from ``text_config``, its tensors under
    ``language_model.model.*`` and ``language_model.lm_head``; the ``vision_model`` and the
    ``multi_modal_projector`` are left unread. Without an image transformers' forward is exactly
    its language model's."""

    text_architecture: ClassVar[str] = "Llama4ForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("llama4_text",)
    text_defaults: ClassVar[dict[str, Any]] = LLAMA4_TEXT_DEFAULTS
    tie_default: ClassVar[bool] = False
    skip: ClassVar[tuple[str, ...]] = (r"vision_model\..*", r"multi_modal_projector\..*")
    renames: ClassVar[tuple[Rename, ...]] = LanguageModelOf.prefixed(Llama4Checkpoint.renames)
