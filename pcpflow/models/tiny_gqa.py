"""A tiny Llama-style model with grouped-query attention (GQA).

The cache holds one entry per token: roped K of every kv head, then V
(``[kv_heads * head_dim | kv_heads * head_dim]``); query head ``h`` reads kv head
``h // (num_heads // num_kv_heads)``.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field, model_validator

from pcpflow.models.common import DecoderLM, TinyModelConfig
from pcpflow.models.layers import gqa_layers, gqa_spec


class TinyGQA(DecoderLM):
    class Config(TinyModelConfig):
        """A tiny Llama-style GQA model with seeded random weights."""

        name: Literal["tiny_gqa"] = "tiny_gqa"
        num_kv_heads: int = Field(2, gt=0, description="key/value heads (divides num_heads)")
        head_dim: int = Field(16, gt=0, multiple_of=2, description="per-head dim (all rotated)")
        window: int | None = Field(
            None, gt=0, description="a sliding window: the layers window_layers names attend to the last "
            "`window` keys of each row (itself included), as Mistral's and Gemma's sliding layers; null: none")
        window_layers: list[int] | None = Field(
            None, description="the layers the window applies to (0-based); null: every layer")
        window_kind: Literal["sliding", "chunked"] = Field(
            "sliding", description="how the window reads: sliding (the last `window` keys of each row) | chunked "
            "(Llama 4's chunked attention: a row at position p sees keys p - p % window .. p, its own chunk of "
            "`window` positions up to itself)")
        qk_norm: Literal["none", "head", "full"] = Field(
            "none", description="q and k RMS-normed before RoPE: none | head (each head, as Qwen3) | full (the "
            "whole projection, all heads at once, as OLMo 2: under TP an all-reduce of each row's sum of squares)")
        sinks: bool = Field(
            False, description="attention sinks: one learned softmax logit per query head that reads no value "
            "(gpt-oss's), joined once to each row's whole softmax on every path (DCP and the rings after their merge)")

        @model_validator(mode="after")
        def _window_layers_exist(self) -> TinyGQA.Config:
            bad = [i for i in self.window_layers or () if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"window_layers {bad} are not layers of a {self.num_layers}-layer model "
                                 f"(0 .. {self.num_layers - 1})")
            return self

        def sliding_layers(self) -> tuple[int, ...]:
            """The layers the window applies to (none without a window)."""
            if self.window is None:
                return ()
            return tuple(sorted(set(range(self.num_layers) if self.window_layers is None else self.window_layers)))

        @model_validator(mode="after")
        def _heads_divide(self) -> TinyGQA.Config:
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads})"
                )
            return self

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
