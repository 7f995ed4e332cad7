"""A tiny Llama-style model with grouped-query attention (GQA).

The cache holds one entry per token: roped K of every kv head, then V
(``[kv_heads * head_dim | kv_heads * head_dim]``); query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import dataclasses

from pcpflow.models.common import DecoderLM
from pcpflow.models.config import TinyGQAConfig
from pcpflow.models.layers import gqa_layers, gqa_spec


class TinyGQA(DecoderLM):
    Config = TinyGQAConfig

    def __init__(self, config: TinyGQA.Config):
        c = config
        layers = gqa_layers(
            c.num_layers, hidden_size=c.hidden_size, num_heads=c.num_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, intermediate_size=c.intermediate_size, eps=c.rms_norm_eps, rope_theta=c.rope_theta,
            qk_norm=False if c.qk_norm == "none" else c.qk_norm, sinks=c.sinks,
        )
        spec = gqa_spec(c.num_heads, c.num_kv_heads, c.head_dim)
        spec = dataclasses.replace(spec, window=c.window, window_layers=c.sliding_layers(), window_kind=c.window_kind)
        super().__init__(layers=layers, attn_spec=spec, **c.lm_dims())
        self.config = config
