"""Llama-style checkpoints: ``LlamaForCausalLM``, ``MistralForCausalLM``,
``Qwen2ForCausalLM``, ``Qwen3ForCausalLM``, ``Phi3ForCausalLM``, ``SmolLM3ForCausalLM``,
``GraniteForCausalLM``, ``SeedOssForCausalLM``, ``Ernie4_5ForCausalLM``, ``Ministral3ForCausalLM``, ``GlmForCausalLM``, ``Glm4ForCausalLM`` and the mixture-of-experts
``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``, ``Ernie4_5_MoeForCausalLM`` and
``Glm4MoeForCausalLM`` — grouped-query attention with RoPE.

The cache holds roped K of every kv head, then V, as in ``tiny_gqa``. They read the
same config.json fields and differ only where ``FAMILIES`` says (transformers'
``modeling_<family>.py``):

- Llama: biases on q/k/v/o when ``attention_bias``, on the MLP when ``mlp_bias``.
- Mistral: no biases whatever the config says; a sliding window unless ``sliding_window``
  is null (absent: transformers' default, 4096).
- Qwen2: biases on q/k/v always, never on o or the MLP; a sliding window on the layers
  ``>= max_window_layers`` (or those ``layer_types`` names) only when ``use_sliding_window``.
- Qwen3: q/k/v/o biases when ``attention_bias``; an RMSNorm over each head of q and of k
  (``q_norm``, ``k_norm``, eps ``rms_norm_eps``) before RoPE; ``head_dim`` defaults to 128,
  not hidden/heads; a sliding window as Qwen2.
- Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention, its q/k/v biases as ``qkv_bias``
  says (default true); ``sliding_window: 0`` is none; a window on the layers ``layer_types``
  names (else, with ``use_sliding_window``, the even layers below ``max_window_layers``); MoE
  MLPs as Qwen3-MoE's plus a shared expert ``shared_expert_intermediate_size`` wide, its
  output scaled by ``sigmoid(shared_expert_gate(x))``.
- Qwen3-MoE: Qwen3's attention (``head_dim`` defaulting to hidden/heads); a sliding window
  on every layer when ``use_sliding_window``; MoE MLPs on the layers ``decoder_sparse_step``
  picks (``pcpflow.models.hf_moe.gqa_moe_settings``: softmax top-k routing, renormalised when
  ``norm_topk_prob``).
- Phi-3 (Phi-3, Phi-3.5, Phi-4 and Phi-4-mini text models): no biases; q, k and v stored as one
  ``qkv_proj`` (``Rename.stacked``), gate and up as one ``gate_up_proj``, as pcpflow keeps
  them; RoPE on the first ``partial_rotary_factor`` of each head; LongRoPE (``rope_scaling``
  of type ``longrope``, or the older ``su`` / ``yarn`` that ``Phi3Config`` reads as it) within
  the original length (``CheckpointConfig.rope_limit``); a sliding window on every layer
  when ``sliding_window`` is set (default none).
- SmolLM3: Llama's, with no RoPE on the layers ``no_rope_layers`` marks 0 (else every
  ``no_rope_layer_interval``-th, 4); a window (``use_sliding_window``) on those layers only;
  embeddings tied unless config.json says otherwise.
- Seed-OSS (Seed-OSS-36B, 512K context): Llama's, q/k/v biases unless ``attention_bias: false``,
  o's bias as ``attention_out_bias`` says (default none), ``head_dim`` 128 unless given.
- ERNIE 4.5 (dense: ERNIE-4.5-0.3B, 128K context): Llama's, every bias (q/k/v/o and the MLP's) as
  ``use_bias`` says, RoPE on pairs of adjacent dims, ``head_dim`` 128 unless given, embeddings
  tied unless config.json says otherwise.
- ERNIE 4.5 MoE (``Ernie4_5_MoeForCausalLM``: ERNIE-4.5-21B-A3B, -300B-A47B): the dense one's layers (``use_bias``
  must be false), MoE on the layers ``moe_layer_start_index`` / ``_interval`` pick (``hf_moe.ernie_moe_settings``:
  float32 softmax, top-k chosen with the ``moe_statics`` selection bias, renormalised by ``max(sum,
  moe_norm_min)``, rounded to the model's dtype; ``moe_num_shared_experts`` shared experts).
- Granite (Granite 3.x): Llama's, with ``embedding_multiplier`` on the embedding,
  ``residual_multiplier`` on each block's output, ``attention_multiplier`` as the softmax scale
  and the logits divided by ``logits_scaling``.
- Mixtral: Mistral's attention, its sliding window off unless ``sliding_window`` is set;
  every layer MoE (``num_local_experts``, top-``num_experts_per_tok``, always renormalised;
  ``block_sparse_moe`` tensors, experts ``w1``/``w3``/``w2``).
- Ministral 3 (``Ministral3ForCausalLM``; Ministral 3 3B/8B/14B and Devstral Small 2 as the language model of
  ``Mistral3ForConditionalGeneration``): Mistral's layers, its window off unless ``sliding_window`` is set, YaRN
  with mscale / mscale_all_dim, and each query scaled by its position (``llama_4_scaling_beta``:
  ``Ministral3Checkpoint``).
- GLM-4.5 (``Glm4MoeForCausalLM``): q/k/v biases when ``attention_bias`` (never on o), q/k
  norms when ``use_qk_norm``, RoPE on the first ``partial_rotary_factor`` of each head (0.5
  unless set), MoE past ``first_k_dense_replace`` routed as DeepSeek-V3 (its field names), its
  MTP layer (past ``num_hidden_layers``) left out as DeepSeek-V3's is.
- GLM (``GlmForCausalLM``: GLM-4-9B-chat-hf): q/k/v biases unless ``attention_bias: false`` (never on
  o or the MLP), gate and up as one ``gate_up_proj``, ``head_dim`` 128 unless given, RoPE on pairs of
  adjacent dims of the first ``partial_rotary_factor`` of each head (0.5 unless set).
- GLM-4 (``Glm4ForCausalLM``: GLM-4-0414, GLM-Z1): GLM's, with each block's output normed before it is
  added (``post_self_attn_layernorm``, ``post_mlp_layernorm``: ``DecoderLayer``'s sandwich).

A sliding window (``LlamaCheckpoint.window`` on ``sliding_layers``) is the attention spec's
(``AttentionSpec.window``): those layers attend to the last ``window`` keys, as transformers masks them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer
from pcpflow.models.hf_checkpoint import GQACheckpoint, LanguageModelOf
from pcpflow.models.hf_moe import (
    ERNIE_MOE_RENAMES,
    MIXTRAL_RENAMES,
    MOE_RENAMES,
    QWEN2_MOE_RENAMES,
    gqa_moe_settings,
)
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename, layer_norm_rename
from pcpflow.models.layers import QueryScaling, gqa_layers, gqa_spec
from pcpflow.models.moe_config import MoEConfig


@dataclass(frozen=True)
class GQAFamily:
    """How one architecture reads Llama's fields; a bias None: config.json's field decides
    (``attention_bias`` for q/k/v and o, ``mlp_bias`` for the MLP)."""

    qkv_bias: bool | None = None
    o_bias: bool | None = None
    mlp_bias: bool | None = None
    qk_norm: bool | None = False  # None: config.json's use_qk_norm decides
    head_dim: int | None = None  # when config.json gives none (None: hidden_size / heads)
    rotary_factor: float = 1.0  # the share of a head RoPE rotates where config.json gives no partial_rotary_factor
    sliding: Literal["never", "every_layer", "use_sliding_window", "use_sliding_window_every_layer",
                     "use_sliding_window_alternate", "use_sliding_window_nope"] = "never"
    reads_qkv_bias: bool = False  # config.json's qkv_bias, when given, decides q/k/v biases (Qwen2-MoE)
    default_window: int | None = 4096  # transformers' sliding_window where config.json gives none
    tied_default: bool = False  # tie_word_embeddings where config.json gives none
    nope: bool = False  # layers without RoPE: no_rope_layers, else every no_rope_layer_interval-th (SmolLM3)
    multipliers: bool = False  # Granite's embedding, residual, attention multipliers and logits scaling
    bias_default: bool = False  # attention_bias where config.json gives none (Seed-OSS: true)
    out_bias_field: bool = False  # o's bias from attention_out_bias, not attention_bias (Seed-OSS)
    use_bias: bool = False  # every bias (q/k/v/o, MLP) from config.json's use_bias (ERNIE 4.5)
    interleaved_rope: bool = False  # RoPE on pairs of adjacent dims (ERNIE 4.5, GLM)
    sandwich: bool = False  # each block's output normed before it is added (GLM-4)


FAMILIES = {
    "LlamaForCausalLM": GQAFamily(),
    "MistralForCausalLM": GQAFamily(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer"),
    "Qwen2ForCausalLM": GQAFamily(qkv_bias=True, o_bias=False, mlp_bias=False, sliding="use_sliding_window"),
    "Qwen3ForCausalLM": GQAFamily(mlp_bias=False, qk_norm=True, head_dim=128, sliding="use_sliding_window"),
    "Qwen2MoeForCausalLM": GQAFamily(qkv_bias=True, o_bias=False, mlp_bias=False, sliding="use_sliding_window_alternate",
                                     reads_qkv_bias=True),
    "Qwen3MoeForCausalLM": GQAFamily(mlp_bias=False, qk_norm=True, sliding="use_sliding_window_every_layer"),
    "MixtralForCausalLM": GQAFamily(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer",
                                    default_window=None),
    "Ministral3ForCausalLM": GQAFamily(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer",
                                       default_window=None),
    "Glm4MoeForCausalLM": GQAFamily(o_bias=False, mlp_bias=False, qk_norm=None, rotary_factor=0.5),
    "Phi3ForCausalLM": GQAFamily(qkv_bias=False, o_bias=False, mlp_bias=False, sliding="every_layer",
                                 default_window=None),
    "SmolLM3ForCausalLM": GQAFamily(sliding="use_sliding_window_nope", default_window=None, tied_default=True,
                                    nope=True),
    "GraniteForCausalLM": GQAFamily(multipliers=True),
    "SeedOssForCausalLM": GQAFamily(head_dim=128, bias_default=True, out_bias_field=True),
    "Ernie4_5ForCausalLM": GQAFamily(head_dim=128, tied_default=True, use_bias=True, interleaved_rope=True),
    "GlmForCausalLM": GQAFamily(o_bias=False, mlp_bias=False, head_dim=128, rotary_factor=0.5, bias_default=True,
                                interleaved_rope=True),
    "Glm4ForCausalLM": GQAFamily(o_bias=False, mlp_bias=False, head_dim=128, rotary_factor=0.5, bias_default=True,
                                 interleaved_rope=True, sandwich=True),
    "Ernie4_5_MoeForCausalLM": GQAFamily(head_dim=128, tied_default=True, use_bias=True, interleaved_rope=True),
}

DEFAULT_MAX_WINDOW_LAYERS = 28
"""transformers' Qwen ``max_window_layers`` (layers from it on slide)."""


class LlamaCheckpoint(GQACheckpoint):
    """The config.json fields of a Llama-style checkpoint that pcpflow uses."""

    num_key_value_heads: int | None = Field(None, gt=0)
    head_dim: int | None = Field(None, gt=0)
    mlp_bias: bool = False
    sliding_window: int | None = Field(None, gt=0)
    use_sliding_window: bool = False
    max_window_layers: int = Field(DEFAULT_MAX_WINDOW_LAYERS, ge=0)
    layer_types: list[str] | None = None
    use_qk_norm: bool = False
    qkv_bias: bool | None = None  # Qwen2-MoE's
    partial_rotary_factor: float | None = Field(None, gt=0, le=1)
    no_rope_layers: list[int] | None = None  # SmolLM3: 1 a layer with RoPE, 0 one without
    no_rope_layer_interval: int = Field(4, gt=0)
    embedding_multiplier: float = 1.0  # Granite's four
    residual_multiplier: float = 1.0
    attention_multiplier: float = Field(1.0, gt=0)
    logits_scaling: float = Field(1.0, gt=0)
    attention_out_bias: bool = False  # Seed-OSS's o bias
    use_bias: bool = False  # ERNIE 4.5's, every bias
    moe: MoEConfig | None = None  # Qwen3-MoE, Mixtral, GLM-4.5: from their MoE fields (``hf_moe.gqa_moe_settings``)

    renames: ClassVar[tuple[Rename, ...]] = (
        *DECODER_RENAMES,
        attention_rename("q_proj.{wb}", "q_proj.{wb}"),
        attention_rename("k_proj.{wb}", "k_proj.{wb}"),
        attention_rename("v_proj.{wb}", "v_proj.{wb}"),
        attention_rename("o_proj.{wb}", "o_proj.{wb}"),
        attention_rename("q_norm.weight", "q_norm.weight"),
        attention_rename("k_norm.weight", "k_norm.weight"),
        # Phi-3: q, k and v stacked in one tensor, gate and up in one (pcpflow's own layout)
        Rename("model.layers.{i}.self_attn.qkv_proj.weight", "layers.{i}.self_attn.q_proj.weight",
               stacked=("layers.{i}.self_attn.k_proj.weight", "layers.{i}.self_attn.v_proj.weight")),
        Rename("model.layers.{i}.mlp.gate_up_proj.weight", "layers.{i}.mlp.gate_up_proj.weight"),
        # GLM-4's sandwich norms, on the attention's and the MLP's outputs
        layer_norm_rename("post_self_attn_layernorm", "attn_out_norm"),
        layer_norm_rename("post_mlp_layernorm", "mlp_out_norm"),
        *MOE_RENAMES,
        *QWEN2_MOE_RENAMES,
        *MIXTRAL_RENAMES,
        *ERNIE_MOE_RENAMES,
    )

    @model_validator(mode="before")
    @classmethod
    def _family_fields(cls, raw: Any) -> Any:
        """What a family reads beyond the fields themselves: its MoE settings, its defaults."""
        if isinstance(raw, dict):
            raw = dict(raw)
            if raw.get("sliding_window") == 0 and raw.get("architecture") == "Qwen2MoeForCausalLM":
                raw["sliding_window"] = None  # NOTE: what Qwen2MoeConfig writes for no window
            family = FAMILIES.get(raw.get("architecture"))
            if family is not None and family.tied_default:
                raw.setdefault("tie_word_embeddings", True)
            if family is not None and family.bias_default:
                raw.setdefault("attention_bias", True)
            try:
                raw["moe"] = cls.moe_settings(raw)
            except TypeError:  # a field of the wrong type: the field's own validation names it
                raw["moe"] = None
        return raw

    @classmethod
    def moe_settings(cls, raw: dict[str, Any]) -> dict[str, Any] | None:
        """``MoEConfig`` fields of the config.json dict ``raw`` (None: dense)."""
        return gqa_moe_settings(raw, raw.get("architecture"))

    @model_validator(mode="after")
    def _heads(self) -> LlamaCheckpoint:
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.kv_heads})"
            )
        if self.dim % 2:
            raise ValueError(f"head_dim ({self.dim}) must be even for RoPE")
        rope = self.no_rope_layers
        if self.family.nope and rope is not None and (len(rope) != self.num_hidden_layers or set(rope) - {0, 1}):
            raise ValueError(f"no_rope_layers must give each of the {self.num_hidden_layers} layers 1 (RoPE) or 0 "
                             f"(none); got {rope}")
        if self.rope_dims % 2:
            raise ValueError(f"RoPE's dims (head_dim {self.dim} x partial_rotary_factor {self.rotary_factor}) "
                             f"must be even; got {self.rope_dims}")
        return self

    @property
    def family(self) -> GQAFamily:
        return FAMILIES[self.architecture]

    @property
    def dim(self) -> int:
        return self.head_dim or self.family.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def rotary_factor(self) -> float:
        return self.partial_rotary_factor if self.partial_rotary_factor is not None else self.family.rotary_factor

    @property
    def rope_dims(self) -> int:
        """The dims of a head RoPE rotates (transformers' ``int(head_dim * partial_rotary_factor)``)."""
        return int(self.dim * self.rotary_factor)

    @property
    def sliding_layers(self) -> list[int]:
        """The layers transformers gives a sliding window of ``window`` tokens."""
        sliding = self.family.sliding
        given = self.window_size
        if sliding == "never" or given is None or (sliding.startswith("use_") and not self.use_sliding_window):
            return []
        layers = range(self.num_hidden_layers)
        if sliding.endswith("every_layer"):
            return list(layers)
        if self.layer_types is not None:
            return [i for i in layers if i < len(self.layer_types) and self.layer_types[i] == "sliding_attention"]
        if sliding.endswith("alternate"):  # NOTE: Qwen2MoeConfig's layer_types when it writes none
            return [i for i in layers if i % 2 == 0 and i < self.max_window_layers]
        if sliding.endswith("nope"):  # NOTE: SmolLM3Config's: the layers without RoPE
            return [i for i in layers if not self.rope_layers[i]]
        return [i for i in layers if i >= self.max_window_layers]

    @property
    def window(self) -> int | None:
        """The sliding window (the most recent keys a query sees, itself included) of the
        layers that have one; None: every layer sees the whole sequence."""
        if not self.sliding_layers:
            return None
        return self.window_size

    @property
    def window_size(self) -> int | None:
        """config.json's ``sliding_window``, else the family's transformers default."""
        return self.sliding_window if "sliding_window" in self.model_fields_set else self.family.default_window

    @property
    def rope_layers(self) -> list[bool]:
        """Which layers rotate q and k: all, but SmolLM3's NoPE layers (``no_rope_layers``, else
        every ``no_rope_layer_interval``-th, as ``SmolLM3Config`` makes them)."""
        n = self.num_hidden_layers
        if not self.family.nope:
            return [True] * n
        if self.no_rope_layers is not None:
            return [bool(x) for x in self.no_rope_layers]
        return [(i + 1) % self.no_rope_layer_interval != 0 for i in range(n)]

    @property
    def query_scaling(self) -> QueryScaling | None:
        """Every query scaled by its position (Ministral 3's: ``Ministral3Checkpoint``); None: none."""
        return None

    def attn_spec(self) -> AttentionSpec:
        scale = self.attention_multiplier if self.family.multipliers else None  # NOTE: Granite's softmax scale
        spec = gqa_spec(self.num_attention_heads, self.kv_heads, self.dim, scale=scale)
        return dataclasses.replace(spec, window=self.window, window_layers=tuple(self.sliding_layers))

    def lm_options(self) -> dict[str, Any]:
        if not self.family.multipliers:
            return {}
        return {"embedding_multiplier": self.embedding_multiplier, "logits_scaling": self.logits_scaling}

    def build_layers(self) -> list[DecoderLayer]:
        f = self.family

        def given(fixed: bool | None, field: bool) -> bool:
            return field if fixed is None else fixed

        qkv = self.qkv_bias if f.reads_qkv_bias and self.qkv_bias is not None else given(f.qkv_bias, self.attention_bias)
        out = self.attention_out_bias if f.out_bias_field else given(f.o_bias, self.attention_bias)
        mlp = given(f.mlp_bias, self.mlp_bias)
        if f.use_bias:  # NOTE: ERNIE 4.5's one field for every bias
            qkv = out = mlp = self.use_bias
        return gqa_layers(
            self.num_hidden_layers, hidden_size=self.hidden_size, num_heads=self.num_attention_heads,
            num_kv_heads=self.kv_heads, head_dim=self.dim, intermediate_size=self.intermediate_size,
            eps=self.rms_norm_eps, rope_theta=self.rope_theta, rope_scaling=self.rope_scaling,
            bias=qkv, o_bias=out, mlp_bias=mlp, qk_norm=given(f.qk_norm, self.use_qk_norm), moe=self.moe,
            rotary_dim=self.rope_dims, rope_layers=self.rope_layers,
            residual_multiplier=self.residual_multiplier if f.multipliers else None,
            interleaved_rope=f.interleaved_rope, query_scaling=self.query_scaling, sandwich=f.sandwich,
        )


MISTRAL_TEXT_DEFAULTS = dict(vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                             num_attention_heads=32, num_key_value_heads=8)
"""transformers' ``MistralConfig`` defaults of what ``LlamaCheckpoint`` requires (its 4096-key
window where ``text_config`` gives no ``sliding_window`` is the family's own default)."""


class Mistral3Checkpoint(LanguageModelOf, LlamaCheckpoint):
    """The language model of a multimodal Mistral 3 checkpoint (``Mistral3ForConditionalGeneration``,
    config.json ``model_type: mistral3``: Mistral Small 3.1 / 3.2), run on text alone
    (``LanguageModelOf``): a Mistral model from ``text_config``; without an image transformers'
    forward is exactly its text model's. A ``ministral3`` text_config (Ministral 3, Devstral Small 2)
    is ``Ministral3MultimodalCheckpoint``'s."""

    text_architecture: ClassVar[str] = "MistralForCausalLM"
    # NOTE: ministral3 for the message only: ``parse`` hands such a config.json on
    text_model_types: ClassVar[tuple[str, ...]] = ("mistral", "ministral3")
    text_defaults: ClassVar[dict[str, Any]] = MISTRAL_TEXT_DEFAULTS
    renames: ClassVar[tuple[Rename, ...]] = LanguageModelOf.prefixed(LlamaCheckpoint.renames)

    @classmethod
    def parse(cls, raw: dict[str, Any], architecture: str, *, allow_quantized: bool = False):
        text = raw.get("text_config")
        if isinstance(text, dict) and text.get("model_type") == "ministral3":
            return Ministral3MultimodalCheckpoint.parse(raw, architecture, allow_quantized=allow_quantized)
        return super().parse(raw, architecture, allow_quantized=allow_quantized)


MINISTRAL3_ROPE = dict(rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=16384,
                       beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)
"""``Ministral3Config``'s rope settings where config.json gives none (a ``rope_theta`` beside them unread,
as transformers leaves it)."""


class Ministral3Checkpoint(LlamaCheckpoint):
    """Ministral 3 (``Ministral3ForCausalLM``, config.json ``model_type: ministral3``), as transformers'
    ``modeling_ministral3.py`` computes it: Mistral's layers (``FAMILIES``) with, after RoPE, the query
    of the row at position ``p`` scaled by ``1 + beta * ln(1 + floor(p / original_max_position_embeddings))``
    (``QueryScaling``): ``llama_4_scaling_beta`` and the original length are read from the rope settings,
    where transformers keeps them (the released ones: YaRN x16 over 16384 tokens, beta 0.1).
    ``Ministral3Config``'s defaults where config.json is silent."""

    vocab_size: int = Field(131072, gt=0)
    hidden_size: int = Field(4096, gt=0)
    intermediate_size: int = Field(14336, gt=0)
    num_hidden_layers: int = Field(34, gt=0)
    num_attention_heads: int = Field(32, gt=0)
    num_key_value_heads: int | None = Field(8, gt=0)
    head_dim: int | None = Field(128, gt=0)
    max_position_embeddings: int = Field(262144, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    llama_4_scaling_beta: float | None = None  # the rope settings'
    llama_4_scaling_length: int | None = Field(None, gt=0)  # the rope settings' original_max_position_embeddings

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """``MINISTRAL3_ROPE`` where config.json gives no rope settings; the query scaling's two numbers
        taken from them before they are read as RoPE's (an original length that yarn, llama3 and longrope
        leave out is the model's, as transformers fills it in; other types have none)."""
        if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
            raw["rope_parameters"] = dict(MINISTRAL3_ROPE)
        params = raw.get("rope_parameters") or raw.get("rope_scaling")
        raw.setdefault("max_position_embeddings", cls.model_fields["max_position_embeddings"].default)
        raw = super()._rope_fields(raw)
        if isinstance(params, dict):
            length = params.get("original_max_position_embeddings")
            if length is None and raw.get("rope_scaling") is not None:
                length = raw["rope_scaling"].original_max_position_embeddings
            raw.update(llama_4_scaling_beta=params.get("llama_4_scaling_beta"), llama_4_scaling_length=length)
        return raw

    @model_validator(mode="after")
    def _query_scaling_given(self) -> Ministral3Checkpoint:
        # NOTE: transformers' forward fails without either (None in its arithmetic)
        if self.llama_4_scaling_beta is None:
            raise ValueError("rope_parameters has no llama_4_scaling_beta, by which Ministral 3 scales every query "
                             "(0: none)")
        if self.llama_4_scaling_length is None:
            raise ValueError("rope_parameters has no original_max_position_embeddings, the period of Ministral 3's "
                             "query scaling (transformers fills it in for yarn, llama3 and longrope only)")
        return self

    @property
    def query_scaling(self) -> QueryScaling | None:
        if not self.llama_4_scaling_beta:
            return None  # NOTE: beta 0 scales by exactly 1
        return QueryScaling(self.llama_4_scaling_length, self.llama_4_scaling_beta, "ministral3")


class Ministral3MultimodalCheckpoint(LanguageModelOf, Ministral3Checkpoint):
    """The language model of a multimodal Ministral 3 checkpoint (``Mistral3ForConditionalGeneration``
    with a ``ministral3`` text_config: Ministral 3 3B / 8B / 14B, Devstral Small 2), run on text alone
    (``LanguageModelOf``): a ``Ministral3ForCausalLM`` from ``text_config`` (``Ministral3Config``'s
    defaults where it is silent), its tensors under ``language_model.``, the Pixtral tower unread;
    ``tie_word_embeddings`` from the top level (``Mistral3Config``'s default, true)."""

    text_architecture: ClassVar[str] = "Ministral3ForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("ministral3",)
    renames: ClassVar[tuple[Rename, ...]] = LanguageModelOf.prefixed(LlamaCheckpoint.renames)


QWEN2_VL_TEXT_DEFAULTS = dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                              num_attention_heads=64, num_key_value_heads=8, rope_theta=1_000_000.0,
                              max_window_layers=80)
"""transformers' ``Qwen2_5_VLTextConfig`` (and ``Qwen2VLTextConfig``) defaults that ``LlamaCheckpoint``'s differ from."""


class Qwen2VLCheckpoint(LanguageModelOf, LlamaCheckpoint):
    """The language model of Qwen2-VL / Qwen2.5-VL (``Qwen2VLForConditionalGeneration``,
    ``Qwen2_5_VLForConditionalGeneration``), run on text alone (``LanguageModelOf``): Qwen2's
    layers from ``text_config`` (or, in older files, the top level), tensors stored as a text
    model's (``model.layers.*``), the ``visual.*`` tower unread. Their multimodal RoPE (M-RoPE)
    rotates the sections of a head (``mrope_section``: time, height, width) by three position
    ids, which text alone makes one and the same: plain RoPE, as ``get_rope_index`` gives a
    prompt without images."""

    text_architecture: ClassVar[str] = "Qwen2ForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("qwen2_vl_text", "qwen2_5_vl_text")
    text_defaults: ClassVar[dict[str, Any]] = QWEN2_VL_TEXT_DEFAULTS
    text_at_top: ClassVar[bool] = True
    tie_default: ClassVar[bool] = False
    skip: ClassVar[tuple[str, ...]] = (r"visual\..*",)

    @classmethod
    def text_fields(cls, text: dict[str, Any]) -> dict[str, Any]:
        """M-RoPE as plain RoPE (its sections must cover a head's rotated half)."""
        key = "rope_parameters" if text.get("rope_parameters") is not None else "rope_scaling"
        rope = text.get(key)
        if not isinstance(rope, dict) or "mrope_section" not in rope:
            return text
        sections = rope["mrope_section"]
        heads = text.get("num_attention_heads", QWEN2_VL_TEXT_DEFAULTS["num_attention_heads"])
        dim = text.get("hidden_size", QWEN2_VL_TEXT_DEFAULTS["hidden_size"]) // heads
        if not (isinstance(sections, list) and all(type(s) is int and s >= 0 for s in sections) and 2 * sum(sections) == dim):
            raise ValueError(f"{key}.mrope_section must split a head's {dim // 2} rotated frequencies; got {sections!r}")
        plain = {k: v for k, v in rope.items() if k not in ("mrope_section", "type", "rope_type", "mrope_interleaved")}
        return {**text, key: {**plain, "rope_type": "default"}}


def _in_language_model(renames: tuple[Rename, ...]) -> tuple[Rename, ...]:
    """A text model's renames as Qwen3-VL stores them: ``model.*`` under ``model.language_model.*``
    (transformers 5's own module path), ``lm_head`` at the top."""
    return tuple(dataclasses.replace(r, hf="model.language_model." + r.hf.removeprefix("model."))
                 if r.hf.startswith("model.") else r for r in renames)


QWEN3_VL_MOE_EXPERTS = tuple(
    Rename(f"model.layers.{{i}}.mlp.experts.{hf}", f"layers.{{i}}.mlp.experts.{{j}}.{hf}.weight", experts=True,
           transposed=True, either_layout=True) for hf in ("gate_up_proj", "down_proj"))
"""Qwen3-VL-MoE's experts, every expert of a layer in one tensor per projection: as the released
checkpoints store them, ``x @ W`` (``gate_up_proj [E, hidden, 2I]``, gate the first half of 2I;
``down_proj [E, I, hidden]``), or as transformers 5's ``save_pretrained`` writes them
(``[E, 2I, hidden]``, ``[E, hidden, I]``); transformers reads both, by shape."""

QWEN3_VL_TEXT_DEFAULTS = dict(vocab_size=151936, hidden_size=4096, intermediate_size=22016, num_hidden_layers=32,
                              num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=128000,
                              rope_theta=500000.0)
"""transformers' ``Qwen3VLTextConfig`` defaults that ``LlamaCheckpoint``'s differ from (its
``head_dim`` 128 is Qwen3's own)."""
QWEN3_VL_MOE_TEXT_DEFAULTS = dict(vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                                  num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=128000,
                                  rope_theta=500000.0, num_experts=60, num_experts_per_tok=4,
                                  moe_intermediate_size=1408, decoder_sparse_step=1)
"""transformers' ``Qwen3VLMoeTextConfig`` defaults that ``LlamaCheckpoint``'s and Qwen3-MoE's differ from."""


class Qwen3VLCheckpoint(LanguageModelOf, LlamaCheckpoint):
    """The language model of Qwen3-VL (``Qwen3VLForConditionalGeneration``: Qwen3-VL-2B ... 32B),
    run on text alone (``LanguageModelOf``): Qwen3's layers (per-head q/k norms, ``head_dim`` 128
    unless given) from ``text_config``, tensors under ``model.language_model.``, the
    ``model.visual.*`` tower unread. Its interleaved multimodal RoPE (``mrope_section``,
    ``mrope_interleaved``) takes the frequencies of a head from three position ids, which text
    alone makes one and the same: plain RoPE with the same frequencies. DeepStack adds visual
    features to the first layers' hidden states at image positions only: nothing on text."""

    text_architecture: ClassVar[str] = "Qwen3ForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_text",)
    text_defaults: ClassVar[dict[str, Any]] = QWEN3_VL_TEXT_DEFAULTS
    tie_default: ClassVar[bool] = False
    skip: ClassVar[tuple[str, ...]] = (r"model\.visual\..*",)
    renames: ClassVar[tuple[Rename, ...]] = _in_language_model(LlamaCheckpoint.renames)

    @classmethod
    def text_fields(cls, text: dict[str, Any]) -> dict[str, Any]:
        """M-RoPE's keys left out (its rope type read as any family's); no sliding window, which
        transformers' Qwen3-VL attention never applies whatever the text config says."""
        key = "rope_parameters" if text.get("rope_parameters") is not None else "rope_scaling"
        rope = text.get(key)
        text = {k: v for k, v in text.items() if k not in ("use_sliding_window", "sliding_window", "layer_types")}
        if isinstance(rope, dict):
            text[key] = {k: v for k, v in rope.items() if k not in ("mrope_section", "mrope_interleaved")}
        return text


class Qwen3VLMoeCheckpoint(Qwen3VLCheckpoint):
    """The language model of Qwen3-VL-MoE (``Qwen3VLMoeForConditionalGeneration``: Qwen3-VL-30B-A3B,
    235B-A22B), on text as ``Qwen3VLCheckpoint``: Qwen3-MoE's layers, its experts fused
    (``QWEN3_VL_MOE_EXPERTS``)."""

    text_architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    text_model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl_moe_text",)
    text_defaults: ClassVar[dict[str, Any]] = QWEN3_VL_MOE_TEXT_DEFAULTS
    renames: ClassVar[tuple[Rename, ...]] = _in_language_model(
        (*(r for r in LlamaCheckpoint.renames if ".experts.{j}." not in r.hf), *QWEN3_VL_MOE_EXPERTS))

    @classmethod
    def moe_settings(cls, raw: dict[str, Any]) -> dict[str, Any] | None:
        """Qwen3-MoE's, routed as transformers' ``Qwen3VLMoeTextTopKRouter``: the top-k always
        renormalised (it reads no ``norm_topk_prob``), then rounded to the model's dtype before they
        scale the experts' outputs."""
        moe = super().moe_settings(raw)
        return None if moe is None else {**moe, "norm_topk_prob": True, "weights_dtype": "model"}
