"""A tiny DeepSeek-style model with multi-head latent attention (MLA): the cache holds
the normalized latent plus the roped key, queries absorbed into latent space
(``pcpflow.models.layers.MLAAttention``)."""

from __future__ import annotations

from pcpflow.models.common import DecoderLayer, DecoderLM
from pcpflow.models.config import TinyMLAConfig
from pcpflow.models.layers import mla_attention, mla_cache_spec
from pcpflow.models.moe import build_mlp


class TinyMLA(DecoderLM):
    Config = TinyMLAConfig

    def __init__(self, config: TinyMLA.Config):
        c = config
        layers = [
            DecoderLayer(
                mla_attention(c, c.hidden_size),
                c.hidden_size,
                c.intermediate_size,
                c.rms_norm_eps,
                mlp=build_mlp(c.moe, i, c.hidden_size, c.intermediate_size),
            )
            for i in range(c.num_layers)
        ]
        super().__init__(layers=layers, attn_spec=mla_cache_spec(c), **c.lm_dims())
        self.config = config
