"""Checkpoints whose norms are LayerNorms with a bias (``nn.LayerNorm``), as transformers computes
them:

- **StarCoder2** (``Starcoder2ForCausalLM``: starcoder2-3b/7b/15b): pre-norm layers, an MLP without a
  gate (``c_fc``, ``hidden_act``, ``c_proj``), biases on every projection (``use_bias``), RoPE on the
  whole head, every layer sliding over ``sliding_window`` keys when one is given; eps
  ``norm_epsilon``; tied embeddings unless ``tie_word_embeddings: false``.
- **Phi** (``PhiForCausalLM``: phi-1, phi-1_5, phi-2): *parallel* layers, ``x + attn(ln(x)) +
  mlp(ln(x))`` on one LayerNorm; q/k/v and the output (``dense``) biased; RoPE on the first
  ``partial_rotary_factor`` of each head (0.5 unless given; phi-2 0.4), the rest passed; the MLP
  ``fc1``, ``hidden_act`` (``gelu_new``), ``fc2``, biased; the final norm ``final_layernorm``; an LM head
  with a bias. ``qk_layernorm`` is refused by name (no released Phi sets it).
- **StableLM** (``StableLmForCausalLM``: stablelm-3b-4e1t, stablelm-2-1_6b and its chat model):
  pre-norm layers (``use_parallel_residual``: Phi's parallel ones), Llama's gated MLP without biases,
  q/k/v biases where ``use_qkv_bias``, RoPE on the first ``partial_rotary_factor`` (0.25 unless given);
  ``qk_layernorm`` (StableLM 2 12B's LayerNorm per head) is refused by name.
- **Nemotron** (``NemotronForCausalLM``: Nemotron-Mini-4B, Minitron-4B/8B): pre-norm layers on Nemotron's
  ``LayerNorm1P`` (a bias, scaled by ``1 + weight``: ``OffsetLayerNorm``, eps ``norm_eps``), an MLP without
  a gate (``up_proj``, ``relu2``: squared ReLU, ``down_proj``), biases where ``attention_bias`` /
  ``mlp_bias``, ``head_dim`` as given (else hidden / heads), RoPE on the first ``partial_rotary_factor``
  (0.5 unless given).
- **GPT-NeoX** (``GPTNeoXForCausalLM``: Pythia 70M-12B, GPT-NeoX-20B): parallel layers whose attention and
  MLP each read a LayerNorm of their own, ``x + attn(ln1(x)) + mlp(ln2(x))`` (``use_parallel_residual``;
  false: pre-norm layers), q, k and v in one ``query_key_value`` a head at a time (split at load), every
  head its own keys and values, biases on every projection, RoPE on the first ``rotary_pct`` (0.25) of each
  head with base ``rotary_emb_base``, an MLP without a gate (``dense_h_to_4h``, ``gelu`` / ``gelu_fast``,
  ``dense_4h_to_h``), untied ``embed_in`` / ``embed_out``.
- **GPT-J** (``GPTJForCausalLM``: gpt-j-6b and its fine-tunes): Phi's parallel layers on one LayerNorm,
  q/k/v/o without biases, RoPE on adjacent pairs of the first ``rotary_dim`` (64) dims of each head, an MLP
  without a gate (``fc_in``, ``gelu_new``, ``fc_out``, biased), an LM head with a bias; GPT-2's field names.

Each family's ``head_dim`` is hidden / heads (Nemotron's may be given) and its LayerNorm eps its own field; ``hidden_act`` is
read as transformers' ``ACT2FN`` reads it (``gelu``: the exact, erf GELU; ``gelu_new``: the tanh
approximation written out; ``gelu_pytorch_tanh``: torch's).
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, model_validator

from pcpflow.models.common import DecoderLayer, GatedMLP, PlainMLP, RotaryEmbedding
from pcpflow.models.hf_checkpoint import HeadsOfHidden
from pcpflow.models.hf_weights import Rename, attention_rename
from pcpflow.models.layers import GQAAttention

HF_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu", "gelu_new": "gelu_new", "silu": "silu",
                  "swish": "silu", "relu2": "relu2", "gelu_fast": "gelu_fast"}
"""config.json's ``hidden_act`` -> pcpflow's activation (``pcpflow.models.common.ACTIVATIONS``)."""


def norm_rename(hf: str, ours: str) -> Rename:
    """A LayerNorm's weight and bias: ``<hf>.{wb}`` -> ``<ours>.{wb}``."""
    return Rename(f"{hf}.{{wb}}", f"{ours}.{{wb}}")


LAYERNORM_RENAMES = (
    Rename("model.embed_tokens.weight", "embed_tokens.weight"),
    Rename("lm_head.weight", "lm_head.weight"),
    norm_rename("model.layers.{i}.input_layernorm", "layers.{i}.input_norm"),
    *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
)
"""Embedding, LM head, each layer's input LayerNorm and attention: the names the three share."""


class LayerNormCheckpoint(HeadsOfHidden):
    """What the LayerNorm families share: their eps (``layer_norm_eps``, held as ``rms_norm_eps``),
    ``hidden_act``, the share of a head RoPE rotates, and how a layer is built from the family's
    switches (``parallel``, ``gated``, the biases)."""

    hidden_act: str = "gelu_new"
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    eps_field: ClassVar[str] = "layer_norm_eps"
    moe: ClassVar[None] = None  # dense
    layer_norm: ClassVar[bool] = True
    qk_layernorm_refused: ClassVar[str] = ""  # why a family's qk_layernorm=true is refused

    @model_validator(mode="before")
    @classmethod
    def _eps(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            raw = {**raw, "rms_norm_eps": raw.get(cls.eps_field, 1e-5)}
        return raw

    @model_validator(mode="after")
    def _activation_and_rope(self) -> LayerNormCheckpoint:
        if getattr(self, "qk_layernorm", False):  # NOTE: Phi's and StableLM's field
            raise ValueError(f"qk_layernorm=true is not supported ({self.qk_layernorm_refused})")
        if self.hidden_act not in HF_ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} is not supported; supported: {', '.join(HF_ACTIVATIONS)}")
        if self.rope_dims % 2 or not 2 <= self.rope_dims <= self.dim:
            raise ValueError(f"RoPE's dims ({self.rope_dims} of a head of {self.dim}: partial_rotary_factor, or GPT-J's "
                             "rotary_dim) must be even, at least 2 and at most the head")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_attention_heads if self.multi_head else super().kv_heads

    @property
    def rope_dims(self) -> int:
        """transformers' ``int(head_dim * partial_rotary_factor)``: the first dims of a head, rotated."""
        return int(self.dim * self.partial_rotary_factor)

    # a family's switches
    parallel: ClassVar[bool] = False
    gated_mlp: ClassVar[bool] = False
    unit_offset: ClassVar[bool] = False  # the norms scale by 1 + weight (Nemotron's LayerNorm1P)
    parallel_mlp_norm: ClassVar[bool] = False  # a parallel layer's MLP reads a norm of its own (GPT-NeoX)
    interleaved_rope: ClassVar[bool] = False  # RoPE rotates adjacent pairs (GPT-J's rotate_every_two)
    multi_head: ClassVar[bool] = False  # every head its own keys and values, num_key_value_heads unread (GPT-NeoX, GPT-J)

    def biases(self) -> tuple[bool, bool, bool]:  # pragma: no cover
        """(q/k/v, o, MLP) biases."""
        raise NotImplementedError

    def is_parallel(self) -> bool:
        return self.parallel

    def lm_options(self) -> dict[str, Any]:
        return {"norm_bias": True, "unit_offset": self.unit_offset}

    def build_layers(self) -> list[DecoderLayer]:
        h, qkv, out, mlp_bias = self.hidden_size, *self.biases()
        act = HF_ACTIVATIONS[self.hidden_act]

        def mlp():
            if self.gated_mlp:
                return GatedMLP(h, self.intermediate_size, bias=mlp_bias, activation=act)
            return PlainMLP(h, self.intermediate_size, bias=mlp_bias, activation=act)

        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=RotaryEmbedding(self.rope_dims, self.rope_theta, scaling=self.rope_scaling,
                                           interleaved=self.interleaved_rope),
                    bias=qkv, o_bias=out,
                ),
                h, self.intermediate_size, self.rms_norm_eps, mlp=mlp(),
                parallel=self.is_parallel(), norm_bias=True, unit_offset=self.unit_offset,
                parallel_mlp_norm=self.parallel_mlp_norm,
            )
            for _ in range(self.num_hidden_layers)
        ]


class Starcoder2Checkpoint(LayerNormCheckpoint):
    """The config.json fields of a StarCoder2 checkpoint that pcpflow uses (transformers'
    ``Starcoder2Config`` defaults)."""

    tie_word_embeddings: bool = True
    hidden_act: str = "gelu_pytorch_tanh"
    use_bias: bool = True
    sliding_window: int | None = Field(None, gt=0)
    max_position_embeddings: int = Field(4096, gt=0)
    eps_field: ClassVar[str] = "norm_epsilon"

    renames: ClassVar[tuple[Rename, ...]] = (
        *LAYERNORM_RENAMES,
        norm_rename("model.norm", "norm"),
        norm_rename("model.layers.{i}.post_attention_layernorm", "layers.{i}.post_attention_norm"),
        Rename("model.layers.{i}.mlp.c_fc.{wb}", "layers.{i}.mlp.up_proj.{wb}"),
        Rename("model.layers.{i}.mlp.c_proj.{wb}", "layers.{i}.mlp.down_proj.{wb}"),
    )

    @property
    def kinds(self) -> list[str]:
        """Every layer slides when ``sliding_window`` is given (transformers' sliding-window mask)."""
        kind = "full_attention" if self.sliding_window is None else "sliding_attention"
        return [kind] * self.num_hidden_layers

    def biases(self) -> tuple[bool, bool, bool]:
        return self.use_bias, self.use_bias, self.use_bias


class PhiCheckpoint(LayerNormCheckpoint):
    """The config.json fields of a Phi (1, 1.5, 2) checkpoint that pcpflow uses (transformers'
    ``PhiConfig`` defaults)."""

    partial_rotary_factor: float = Field(0.5, gt=0, le=1)
    qk_layernorm: bool = False
    parallel: ClassVar[bool] = True
    qk_layernorm_refused: ClassVar[str] = "LayerNorms of each head's q and k; phi-1, phi-1_5 and phi-2 have false"

    renames: ClassVar[tuple[Rename, ...]] = (
        *LAYERNORM_RENAMES,
        norm_rename("model.final_layernorm", "norm"),
        Rename("lm_head.bias", "lm_head_bias"),
        attention_rename("dense.{wb}", "o_proj.{wb}"),
        Rename("model.layers.{i}.mlp.fc1.{wb}", "layers.{i}.mlp.up_proj.{wb}"),
        Rename("model.layers.{i}.mlp.fc2.{wb}", "layers.{i}.mlp.down_proj.{wb}"),
    )

    def biases(self) -> tuple[bool, bool, bool]:
        return True, True, True

    def lm_options(self) -> dict[str, Any]:
        return {**super().lm_options(), "lm_head_bias": True}


class StableLmCheckpoint(LayerNormCheckpoint):
    """The config.json fields of a StableLM checkpoint that pcpflow uses (transformers'
    ``StableLmConfig`` defaults)."""

    hidden_act: str = "silu"
    partial_rotary_factor: float = Field(0.25, gt=0, le=1)
    use_qkv_bias: bool = False
    qk_layernorm: bool = False
    use_parallel_residual: bool = False
    max_position_embeddings: int = Field(4096, gt=0)
    gated_mlp: ClassVar[bool] = True
    qk_layernorm_refused: ClassVar[str] = ("StableLM 2 12B's LayerNorm per head of q and k; stablelm-3b-4e1t and "
                                           "stablelm-2-1_6b have false")

    renames: ClassVar[tuple[Rename, ...]] = (
        *LAYERNORM_RENAMES,
        norm_rename("model.norm", "norm"),
        norm_rename("model.layers.{i}.post_attention_layernorm", "layers.{i}.post_attention_norm"),
        Rename("model.layers.{i}.mlp.gate_proj.weight", "layers.{i}.mlp.gate_up_proj.weight", (0, 2)),
        Rename("model.layers.{i}.mlp.up_proj.weight", "layers.{i}.mlp.gate_up_proj.weight", (1, 2)),
        Rename("model.layers.{i}.mlp.down_proj.weight", "layers.{i}.mlp.down_proj.weight"),
    )

    def is_parallel(self) -> bool:
        return self.use_parallel_residual

    def biases(self) -> tuple[bool, bool, bool]:
        return self.use_qkv_bias, False, False


class NemotronCheckpoint(LayerNormCheckpoint):
    """The config.json fields of a Nemotron checkpoint that pcpflow uses (transformers'
    ``NemotronConfig`` defaults)."""

    hidden_act: str = "relu2"
    partial_rotary_factor: float = Field(0.5, gt=0, le=1)
    head_dim: int | None = Field(None, gt=0)
    mlp_bias: bool = False
    max_position_embeddings: int = Field(4096, gt=0)
    eps_field: ClassVar[str] = "norm_eps"
    unit_offset: ClassVar[bool] = True
    reads_head_dim: ClassVar[bool] = True  # NOTE: Minitron-8B's 128 is not hidden / heads

    renames: ClassVar[tuple[Rename, ...]] = (
        *LAYERNORM_RENAMES,
        norm_rename("model.norm", "norm"),
        norm_rename("model.layers.{i}.post_attention_layernorm", "layers.{i}.post_attention_norm"),
        Rename("model.layers.{i}.mlp.up_proj.{wb}", "layers.{i}.mlp.up_proj.{wb}"),
        Rename("model.layers.{i}.mlp.down_proj.{wb}", "layers.{i}.mlp.down_proj.{wb}"),
    )

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, self.mlp_bias


class GPTNeoXCheckpoint(LayerNormCheckpoint):
    """The config.json fields of a GPT-NeoX checkpoint that pcpflow uses (transformers'
    ``GPTNeoXConfig`` defaults; its older ``rotary_pct`` and ``rotary_emb_base`` read as
    ``partial_rotary_factor`` and ``rope_theta``, where ``rope_parameters`` does not give them)."""

    hidden_act: str = "gelu"
    partial_rotary_factor: float = Field(0.25, gt=0, le=1)
    attention_bias: bool = True
    use_parallel_residual: bool = True
    parallel_mlp_norm: ClassVar[bool] = True
    multi_head: ClassVar[bool] = True
    skip: ClassVar[tuple[str, ...]] = (r"gpt_neox\.layers\.\d+\.attention\.(masked_)?bias",)  # NOTE: old mask buffers

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        if raw.get("rope_theta") is None and raw.get("rotary_emb_base") is not None:
            raw["rope_theta"] = raw["rotary_emb_base"]
        raw = super()._rope_fields(raw)
        if raw.get("rotary_pct") is not None:
            raw.setdefault("partial_rotary_factor", raw["rotary_pct"])
        return raw

    @property
    def renames(self) -> tuple[Rename, ...]:  # type: ignore[override]
        """The tensors under ``gpt_neox.``; ``query_key_value`` a head's q, k and v in turn."""
        layer = "gpt_neox.layers.{i}"
        return (
            Rename("gpt_neox.embed_in.weight", "embed_tokens.weight"),
            Rename("embed_out.weight", "lm_head.weight"),
            norm_rename("gpt_neox.final_layer_norm", "norm"),
            norm_rename(f"{layer}.input_layernorm", "layers.{i}.input_norm"),
            norm_rename(f"{layer}.post_attention_layernorm", "layers.{i}.post_attention_norm"),
            Rename(f"{layer}.attention.query_key_value.{{wb}}", "layers.{i}.self_attn.q_proj.{wb}",
                   stacked=("layers.{i}.self_attn.k_proj.{wb}", "layers.{i}.self_attn.v_proj.{wb}"), head_rows=self.dim),
            Rename(f"{layer}.attention.dense.{{wb}}", "layers.{i}.self_attn.o_proj.{wb}"),
            Rename(f"{layer}.mlp.dense_h_to_4h.{{wb}}", "layers.{i}.mlp.up_proj.{wb}"),
            Rename(f"{layer}.mlp.dense_4h_to_h.{{wb}}", "layers.{i}.mlp.down_proj.{wb}"),
        )

    def is_parallel(self) -> bool:
        return self.use_parallel_residual

    def biases(self) -> tuple[bool, bool, bool]:
        return self.attention_bias, self.attention_bias, True


class GPTJCheckpoint(LayerNormCheckpoint):
    """The config.json fields of a GPT-J checkpoint that pcpflow uses (transformers' ``GPTJConfig``
    defaults; its names ``n_embd``, ``n_head``, ``n_layer``, ``n_positions``, ``n_inner`` (null: four
    times ``n_embd``), ``activation_function`` and ``layer_norm_epsilon`` read as the other families')."""

    rotary_dim: int = Field(64, gt=0)  # NOTE: null is refused: transformers' GPT-J then builds tables hidden-wide
    eps_field: ClassVar[str] = "layer_norm_epsilon"
    parallel: ClassVar[bool] = True
    interleaved_rope: ClassVar[bool] = True
    multi_head: ClassVar[bool] = True
    skip: ClassVar[tuple[str, ...]] = (r"transformer\.h\.\d+\.attn\.(masked_)?bias",)  # NOTE: old mask buffers

    renames: ClassVar[tuple[Rename, ...]] = (
        Rename("transformer.wte.weight", "embed_tokens.weight"),
        Rename("lm_head.weight", "lm_head.weight"),
        Rename("lm_head.bias", "lm_head_bias"),
        norm_rename("transformer.ln_f", "norm"),
        norm_rename("transformer.h.{i}.ln_1", "layers.{i}.input_norm"),
        *(Rename(f"transformer.h.{{i}}.attn.{p}_proj.weight", f"layers.{{i}}.self_attn.{p}_proj.weight") for p in "qkv"),
        Rename("transformer.h.{i}.attn.out_proj.weight", "layers.{i}.self_attn.o_proj.weight"),
        Rename("transformer.h.{i}.mlp.fc_in.{wb}", "layers.{i}.mlp.up_proj.{wb}"),
        Rename("transformer.h.{i}.mlp.fc_out.{wb}", "layers.{i}.mlp.down_proj.{wb}"),
    )

    @model_validator(mode="before")
    @classmethod
    def _gpt2_names(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            names = {"n_embd": "hidden_size", "n_head": "num_attention_heads", "n_layer": "num_hidden_layers",
                     "n_positions": "max_position_embeddings", "activation_function": "hidden_act"}
            raw = {**raw, **{ours: raw[theirs] for theirs, ours in names.items() if theirs in raw}}
            raw.setdefault("hidden_act", "gelu_new")
            hidden = raw.get("hidden_size", 4096)
            raw["intermediate_size"] = raw.get("n_inner") or (4 * hidden if type(hidden) is int else hidden)
        return raw

    @property
    def rope_dims(self) -> int:
        """The first ``rotary_dim`` dims of a head, in adjacent pairs."""
        return self.rotary_dim

    def lm_options(self) -> dict[str, Any]:
        return {**super().lm_options(), "lm_head_bias": True}

    def biases(self) -> tuple[bool, bool, bool]:
        return False, False, True
