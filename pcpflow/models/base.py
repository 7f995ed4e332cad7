"""What the engine needs from a model, and what a model gets from the engine.

A model owns its weights and per-layer math. It never sees ranks, caches or slot
mappings: each attention layer hands the engine its new cache entries and queries
through an ``AttentionBackend`` and gets the attention output back. The backend does
the PCP gather, the paged cache write, and the (possibly DCP-sharded) attention.

Cache entries are one flat row per token per layer (``AttentionSpec.entry_dim`` wide):
keys are ``entry[:, :num_kv_heads * qk_dim]`` viewed as ``[num_kv_heads, qk_dim]`` and
values ``entry[:, v_offset : v_offset + num_kv_heads * v_dim]``. MLA stores the
normalized latent plus the rope key (one "kv head", values = the latent, queries
absorbed into latent space); GQA stores roped K then V.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import torch
from torch import nn

from pcpflow.layouts.slots import Window


@dataclass(frozen=True)
class AttentionSpec:
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (1 for MLA's latent cache)
    qk_dim: int  # per-head dim of queries and keys as the kernel sees them
    v_dim: int  # per-head value dim
    v_offset: int  # where values start inside a cache entry
    entry_dim: int  # width of one cache entry
    scale: float  # softmax scale applied to q.k
    softcap: float | None = None  # scores s -> softcap * tanh(s / softcap) before the softmax (Gemma 2)
    # A sliding window: the layers ``window_layers`` attend to the last ``window`` keys of each
    # row's context, the row's own included (a row at position p sees keys
    # ``max(0, p + 1 - window) .. p``: ``pcpflow.layouts.slots.window_starts``); the others to all.
    window: int | None = None
    window_layers: tuple[int, ...] = ()
    # ``chunked`` (Llama 4's chunked attention): the window is aligned instead, a row at position p
    # sees keys ``p - p % window .. p`` (its chunk's, up to itself).
    window_kind: Literal["sliding", "chunked"] = "sliding"

    def slides(self, layer: int) -> bool:
        """Whether layer ``layer`` attends through the window (sliding or chunked)."""
        return self.window is not None and layer in self.window_layers

    def windowed(self) -> Window | None:
        """The window of the layers ``slides`` names, with its kind; None when none has one."""
        return None if self.window is None or not self.window_layers else Window(int(self.window), self.window_kind)

    def keys(self, entries: torch.Tensor) -> torch.Tensor:
        """``[..., entry_dim] -> [..., num_kv_heads, qk_dim]``."""
        k = entries[..., : self.num_kv_heads * self.qk_dim]
        return k.unflatten(-1, (self.num_kv_heads, self.qk_dim))

    def values(self, entries: torch.Tensor) -> torch.Tensor:
        """``[..., entry_dim] -> [..., num_kv_heads, v_dim]``."""
        v = entries[..., self.v_offset : self.v_offset + self.num_kv_heads * self.v_dim]
        return v.unflatten(-1, (self.num_kv_heads, self.v_dim))


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Write ``kv`` (``[N, entry_dim]``, this rank's rows) to layer ``layer``'s cache
        and return the attention of ``q`` (``[N, num_heads, qk_dim]``) over each row's
        context: ``[N, num_heads, v_dim]``; ``sinks [num_heads]``: one more softmax logit per
        head that reads no value (gpt-oss's attention sinks), None: none."""
        ...


class CausalLM(nn.Module):
    """Base of pcpflow models (tiny_mla, tiny_gqa, hf)."""

    attn_spec: AttentionSpec
    num_layers: int
    hidden_size: int
    vocab_size: int

    @classmethod
    def from_config(
        cls, config, *, dtype: torch.dtype, seed: int, device: torch.device | str = "cpu"
    ) -> CausalLM:  # pragma: no cover
        """Build the model of ``config`` (its nested pydantic ``Config``); random weights
        come from ``seed`` alone, so every dtype and device gets the same model."""
        raise NotImplementedError

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:  # pragma: no cover
        """Returns the final *normed* hidden states ``[N, hidden]`` and the residual-stream
        hidden states after each layer listed in ``aux_layers``."""
        raise NotImplementedError

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # pragma: no cover
        """``[S, hidden] -> [S, vocab]`` (the LM head on normed hidden states)."""
        raise NotImplementedError
