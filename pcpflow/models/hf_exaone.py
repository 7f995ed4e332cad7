"""EXAONE 4.0 checkpoints (``Exaone4ForCausalLM``: EXAONE-4.0-32B, -1.2B), as transformers'
``modeling_exaone4.py`` computes them:

- each layer is *post-norm*, as OLMo 2's: ``x + norm(attn(x))``, then ``x + norm(mlp(x))``;
- an RMSNorm over each head of q and of k before RoPE (as Qwen3's); every norm Llama's (scaled
  after rounding);
- with a ``sliding_window``, the ``sliding_attention`` layers (``layer_types``, else every layer
  but each ``sliding_window_pattern``-th: an int, or a string such as ``"LLLG"`` whose length it
  is) attend through it and rotate q and k, the full ones have no position embedding (NoPE);
  without one every layer is full and rotates;
- ``head_dim`` as config.json gives it, else hidden / heads; no biases; untied unless
  ``tie_word_embeddings``.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from pcpflow.models.common import DecoderLayer, RotaryEmbedding
from pcpflow.models.hf_checkpoint import HeadsOfHidden, layer_kinds
from pcpflow.models.hf_weights import DECODER_RENAMES, Rename, attention_rename, layer_norm_rename
from pcpflow.models.layers import GQAAttention

LayerType = Literal["sliding_attention", "full_attention"]


class Exaone4Checkpoint(HeadsOfHidden):
    """The config.json fields of an EXAONE 4.0 checkpoint that pcpflow uses (transformers'
    ``Exaone4Config`` defaults)."""

    head_dim: int | None = Field(None, gt=0)
    rms_norm_eps: float = Field(1e-5, gt=0)
    sliding_window: int | None = Field(4096, gt=0)
    sliding_window_pattern: int | str = 4
    layer_types: list[LayerType] | None = None

    moe: ClassVar[None] = None  # dense
    renames: ClassVar[tuple[Rename, ...]] = (
        *(r for r in DECODER_RENAMES if "layernorm" not in r.hf),
        layer_norm_rename("post_attention_layernorm", "attn_out_norm"),
        layer_norm_rename("post_feedforward_layernorm", "mlp_out_norm"),
        *(attention_rename(f"{p}.weight", f"{p}.weight") for p in ("q_proj", "k_proj", "v_proj", "o_proj")),
        attention_rename("q_norm.weight", "q_norm.weight"),
        attention_rename("k_norm.weight", "k_norm.weight"),
    )

    @property
    def dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kinds(self) -> list[str]:
        """``layer_types``; else, with a window, every layer but each pattern-th slides; without
        one, every layer is full."""
        if self.layer_types is None and self.sliding_window is None:
            return ["full_attention"] * self.num_hidden_layers
        pattern = self.sliding_window_pattern
        return layer_kinds(self.layer_types, self.num_hidden_layers, len(pattern) if isinstance(pattern, str) else pattern)

    def build_layers(self) -> list[DecoderLayer]:
        h, eps = self.hidden_size, self.rms_norm_eps
        # NOTE: "global NoPE" only in a model with a window (Exaone4Attention's rule)
        nope = {"full_attention"} if self.sliding_window is not None else set()
        return [
            DecoderLayer(
                GQAAttention(
                    hidden_size=h, num_heads=self.num_attention_heads, num_kv_heads=self.kv_heads, head_dim=self.dim,
                    rotary=None if kind in nope else RotaryEmbedding(self.dim, self.rope_theta, scaling=self.rope_scaling),
                    qk_norm_eps=eps,
                ),
                h, self.intermediate_size, eps,
                sandwich=True, pre_norm=False,
            )
            for kind in self.kinds
        ]
