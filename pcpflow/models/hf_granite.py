"""IBM Granite's mixture-of-experts and Granite 4.0 checkpoints: ``GraniteMoeForCausalLM``
(granite-3.0/3.1-1b-a400m, -3b-a800m), ``GraniteMoeSharedForCausalLM`` and, with attention layers
only, ``GraniteMoeHybridForCausalLM`` (Granite 4.0: granite-4.0-micro, -350m, -1b). Their attention,
norms and multipliers are Granite 3's (``hf_llama``: ``embedding_multiplier``, ``residual_multiplier``
on each block's output, ``attention_multiplier`` as the softmax scale, logits divided by
``logits_scaling``; q/k/v/o biases as ``attention_bias`` says); their MLPs are transformers'
``modeling_granitemoe*.py``:

- every layer MoE (``block_sparse_moe``): the router's top ``num_experts_per_tok`` logits weighted
  by a softmax over those k alone (``hf_moe.granite_moe_settings``), ``num_local_experts`` experts
  ``intermediate_size`` wide stored as one tensor per projection (``hf_moe.GRANITE_MOE_RENAMES``);
- GraniteMoeShared and the hybrid add a ``shared_mlp`` (``shared_intermediate_size`` wide; gate and
  up in one ``input_linear``) to the experts' sum, unscaled: pcpflow's shared experts; a hybrid
  without experts (``num_local_experts: 0``, the released attention-only Granite 4.0 models) has the
  shared MLP alone, which is then the layer's MLP (``intermediate_size`` here: its width);
- a hybrid's ``layer_types`` (transformers 4: ``attention`` / ``mamba``; 5: ``full_attention`` /
  ``linear_attention``; ``layers_block_type`` its alias; absent, every layer is Mamba) must name
  attention on every layer: Mamba2 layers (the ``-h-`` models) are refused, naming them. Its
  attention ropes only with ``position_embedding_type: rope`` (``nope`` or absent: no position
  embedding, as transformers).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import model_validator

from pcpflow.models.hf_llama import GQAFamily, LlamaCheckpoint
from pcpflow.models.hf_moe import GQA_MOE_DEFAULTS, GRANITE_MOE_RENAMES
from pcpflow.models.hf_weights import Rename

HYBRID = "GraniteMoeHybridForCausalLM"
GRANITE_MOE = GQAFamily(mlp_bias=False, multipliers=True)
"""Granite 3's attention and multipliers; the MLPs (experts, shared MLP) have no biases."""
ATTENTION, MAMBA = ("attention", "full_attention"), ("mamba", "linear_attention")
"""A hybrid layer's kinds as transformers 4 and 5 spell them."""

SHARED_MLP_AS_MLP = (
    Rename("model.layers.{i}.shared_mlp.input_linear.weight", "layers.{i}.mlp.gate_up_proj.weight"),
    Rename("model.layers.{i}.shared_mlp.output_linear.weight", "layers.{i}.mlp.down_proj.weight"),
)
"""A hybrid without experts: its shared MLP is the layer's MLP (gate then up, as pcpflow's)."""


class GraniteMoeCheckpoint(LlamaCheckpoint):
    """The config.json fields of a Granite MoE or attention-only Granite 4.0 checkpoint."""

    position_embedding_type: Literal["rope", "nope"] | None = None  # the hybrid's (GraniteMoe always ropes)

    @model_validator(mode="before")
    @classmethod
    def _granite_fields(cls, raw: Any) -> Any:
        """``layers_block_type`` as ``layer_types``; a hybrid without experts sized by its shared MLP."""
        if isinstance(raw, dict):
            raw = dict(raw)
            if raw.get("layer_types") is None and raw.get("layers_block_type") is not None:
                raw["layer_types"] = raw["layers_block_type"]  # NOTE: GraniteMoeHybridConfig's attribute_map
            if raw.get("architecture") == HYBRID and raw.get("num_local_experts") == 0:
                shared = raw.get("shared_intermediate_size", GQA_MOE_DEFAULTS[HYBRID]["shared_intermediate_size"])
                if type(shared) is int and shared > 0:
                    raw["intermediate_size"] = shared  # NOTE: the dense MLP's width, as the card and layers read it
        return raw

    @model_validator(mode="after")
    def _hybrid_layers(self) -> GraniteMoeCheckpoint:
        if self.architecture != HYBRID:
            return self
        kinds, n = self.layer_types, self.num_hidden_layers
        if kinds is None:
            raise ValueError(f"layer_types is required: without it transformers' GraniteMoeHybridConfig makes all {n} "
                             "layers Mamba2 (mamba), which pcpflow does not run; supported: every layer attention")
        if len(kinds) != n:
            raise ValueError(f"layer_types has {len(kinds)} entries; num_hidden_layers is {n}")
        unknown = sorted({k for k in kinds if k not in ATTENTION + MAMBA})
        if unknown:
            raise ValueError(f"layer_types: unknown layer type(s) {unknown}; a hybrid layer is one of "
                             f"{ATTENTION + MAMBA}")
        mamba = [i for i, k in enumerate(kinds) if k in MAMBA]
        if mamba:
            raise ValueError(f"layer_types names {len(mamba)} of {n} layers mamba ({_some(mamba)}): Mamba2 state-space "
                             "layers (Granite 4.0's -h- models), which pcpflow does not run (its caches hold attention "
                             "keys and values); supported: every layer attention (granite-4.0-micro, -350m, -1b)")
        return self

    @property
    def family(self) -> GQAFamily:
        return GRANITE_MOE

    @property
    def rope_layers(self) -> list[bool]:
        rope = self.architecture != HYBRID or self.position_embedding_type == "rope"
        return [rope] * self.num_hidden_layers

    @property
    def renames(self) -> tuple[Rename, ...]:  # type: ignore[override]
        """Granite's MoE tensors, or (a hybrid without experts) its shared MLP as the layer's MLP."""
        return (*(GRANITE_MOE_RENAMES if self.moe is not None else SHARED_MLP_AS_MLP), *LlamaCheckpoint.renames)


def _some(layers: list[int], limit: int = 8) -> str:
    return "layers " + ", ".join(map(str, layers[:limit])) + (", ..." if len(layers) > limit else "")
