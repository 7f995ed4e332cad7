"""OLMo 2 and OLMo 3 checkpoints (``Olmo2ForCausalLM``, ``Olmo3ForCausalLM``: AllenAI's fully open
models), as transformers' ``modeling_olmo2.py`` / ``modeling_olmo3.py`` compute them:

- each layer is *post-norm*: ``x + norm(attn(x))``, then ``x + norm(mlp(x))`` (no norm on a
  block's input; ``post_attention_layernorm`` and ``post_feedforward_layernorm``);
- q and k are each normed over the whole projection (all heads at once, ``q_norm`` as wide as
  ``num_attention_heads x head_dim``) before RoPE; under tensor parallelism each rank holds its
  heads' columns and the mean square is the TP group's (``ShardedRMSNorm``: one all-reduce of a
  number a row, ``tp_qk_norm``);
- every norm scales in float32 before it rounds (``RMSNorm(scale_first=True)``);
- ``head_dim`` is hidden / heads; q/k/v/o biases when ``attention_bias``; untied unless
  ``tie_word_embeddings``.

OLMo 3 adds a sliding window (``sliding_window``, 4096 unless given; null: none) on the layers
``layer_types`` names ``sliding_attention`` (by default three of every four: every fourth layer
is full), and RoPE by layer type: ``rope_theta`` and ``rope_scaling`` (YaRN on the long-context
models) on the full layers, plain RoPE at 500,000 on the sliding ones; or transformers 5's
``rope_parameters`` keyed by layer type.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import Field

from pcpflow.models.common import DecoderLayer, RopeScaling, RotaryEmbedding
from pcpflow.models.hf_checkpoint import HeadsOfHidden, layer_kinds, read_rope
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename, layer_norm_rename
from pcpflow.models.layers import GQAAttention

LayerType = Literal["sliding_attention", "full_attention"]


class Olmo2Checkpoint(HeadsOfHidden):
    """The config.json fields of an OLMo 2 checkpoint that pcpflow uses (transformers'
    ``Olmo2Config`` defaults)."""

    rms_norm_eps: float = Field(1e-5, gt=0)

    moe: ClassVar[None] = None  # dense
    full_qk_norm: ClassVar[bool] = True

    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if "layernorm" not in r.hf),
        # NOTE: OLMo's post_attention_layernorm norms the attention's output (pcpflow's attn_out_norm)
        layer_norm_rename("post_attention_layernorm", "attn_out_norm"),
        layer_norm_rename("post_feedforward_layernorm", "mlp_out_norm"),
        *(attention_rename(f"{p}.{{wb}}", f"{p}.{{wb}}") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        attention_rename("q_norm.weight", "q_norm.weight"),
        attention_rename("k_norm.weight", "k_norm.weight"),
    )

    def rope(self, kind: LayerType) -> tuple[float, RopeScaling | None]:
        """The RoPE (theta, scaling) of a layer of ``kind``."""
        return self.rope_theta, self.rope_scaling

    def lm_options(self) -> dict[str, Any]:
        return {"scale_first": True}

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps

        def rotary(kind: LayerType) -> RotaryEmbedding:
            theta, scaling = self.rope(kind)
            return RotaryEmbedding(self.dim, theta, scaling=scaling)

        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=rotary(kind),
                    bias=self.attention_bias, qk_norm_eps=eps, qk_norm_width="full",
                ),
                h, self.intermediate_size, eps,
                sandwich=True, pre_norm=False, scale_first=True,
            )
            for kind in self.kinds
        ]


class Olmo3Checkpoint(Olmo2Checkpoint):
    """OLMo 3 (transformers' ``Olmo3Config`` defaults): OLMo 2's layers, a sliding window on
    the ``sliding_attention`` layers, RoPE by layer type (module docstring)."""

    sliding_window: int | None = Field(4096, gt=0)
    layer_types: list[LayerType] | None = None
    local_rope_theta: float = Field(500_000.0, gt=0)  # the sliding layers' RoPE
    local_rope_scaling: RopeScaling | None = None

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """Full layers' RoPE into ``rope_theta`` / ``rope_scaling``, sliding layers' into
        ``local_rope_theta`` / ``local_rope_scaling``, as ``Olmo3Config.convert_rope_params_to_dict``
        reads them: ``rope_scaling`` and ``rope_theta`` are the full layers'."""
        params = raw.pop("rope_parameters", None)
        scaling = raw.pop("rope_scaling", None)
        theta = raw.get("rope_theta") or 500_000.0
        if params is None:
            params, where = {"full_attention": scaling or {}}, {"full_attention": "rope_scaling"}
        else:
            where = {t: f"rope_parameters.{t}" for t in ("full_attention", "sliding_attention")}
            if not isinstance(params, dict) or not params or set(params) - set(where):
                raise ValueError("rope_parameters of an OLMo 3 config.json maps each layer type (full_attention, "
                                 f"sliding_attention) to its RoPE settings; got {params!r}")
        raw["rope_theta"], raw["rope_scaling"] = read_rope(params.get("full_attention") or {}, where["full_attention"],
                                                           raw, default_theta=theta)
        # NOTE: as transformers 5 reads a transformers 4 config.json (its top-level rope_theta is
        # consumed by the full layers), the sliding layers' default is Olmo3Config's 500,000; the
        # released OLMo 3 checkpoints have 500,000 for both
        raw["local_rope_theta"], raw["local_rope_scaling"] = read_rope(
            params.get("sliding_attention") or {}, "rope_parameters.sliding_attention", raw, default_theta=500_000.0)
        return raw

    @property
    def kinds(self) -> list[str]:
        """``layer_types``, else transformers' default: layer ``i`` slides unless ``(i + 1) % 4 == 0``."""
        return layer_kinds(self.layer_types, self.num_hidden_layers, 4)

    def rope(self, kind: LayerType) -> tuple[float, RopeScaling | None]:
        if kind == "sliding_attention":
            return self.local_rope_theta, self.local_rope_scaling
        return self.rope_theta, self.rope_scaling
