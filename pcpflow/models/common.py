"""Building blocks shared by the tiny models: norm, rotary embedding, MLP, the decoder
stack, and the seeded init that makes float32 and float64 builds the same model."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec, CausalLM


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """float64 ``[rotary_dim // 2]`` inverse frequencies ``theta^(-2i/rotary_dim)``.

    NOTE: llama3 scaling and YaRN only rescale these (YaRN also scales the softmax), so
    they belong here as options when a model needs them."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim
    return theta**-exponents


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) rotary embedding over the last dim of ``[N, heads, dim]``."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        # NOTE: a plain attribute, not a buffer: it stays float64 whatever the model dtype,
        # so cos/sin of a float32 model are the float64 ones rounded once.
        self.inv_freq = rope_inv_freq(rotary_dim, theta)

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq  # [N, dim/2]
        return angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``.

    ``self_attn(h, positions, layer, attn)`` is the model's attention: its projections
    around exactly one call to the engine's backend ``attn``."""

    def __init__(self, self_attn: nn.Module, hidden_size: int, intermediate_size: int, eps: float):
        super().__init__()
        self.input_norm = RMSNorm(hidden_size, eps)
        self.self_attn = self_attn
        self.post_attention_norm = RMSNorm(hidden_size, eps)
        self.mlp = GatedMLP(hidden_size, intermediate_size)

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_norm(x), positions, layer, attn)
        return x + self.mlp(self.post_attention_norm(x))


class DecoderLM(CausalLM):
    """Embedding, a stack of ``DecoderLayer``, final norm and LM head; subclasses supply
    the attention block per layer and the ``AttentionSpec``."""

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        layers: list[DecoderLayer],
        attn_spec: AttentionSpec,
        eps: float,
        tie_word_embeddings: bool,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = len(layers)
        self.attn_spec = attn_spec
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(hidden_size, eps)
        self.lm_head = (
            None if tie_word_embeddings else nn.Linear(hidden_size, vocab_size, bias=False)
        )

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        x = self.embed(input_ids)
        aux = {}
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, i, attn)
            if i in aux_layers:
                aux[i] = x
        return self.norm(x), aux

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return hidden @ weight.T

    @classmethod
    def from_config(
        cls, config, *, dtype: torch.dtype, seed: int, device: torch.device | str = "cpu"
    ) -> DecoderLM:
        """The model of ``config`` (which has ``init_gain`` and ``logit_gain``) with weights
        from ``seed``; see ``build_seeded``."""
        return build_seeded(
            lambda: cls(config),
            seed=seed,
            dtype=dtype,
            device=device,
            linear_gain=config.init_gain,
            lm_head_gain=config.logit_gain,
        )


def build_seeded(
    make: Callable[[], nn.Module],
    *,
    seed: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    linear_gain: float = 1.0,
    embed_std: float = 1.0,
    lm_head_gain: float = 1.0,
) -> nn.Module:
    """Build ``make()`` with weights drawn in float64 from ``torch.Generator(seed)`` and then
    cast, so every dtype and device gets the same model (the global RNG is untouched).

    Linear weights are ``N(0, gain^2 / fan_in)`` (``lm_head_gain`` for a module named
    ``lm_head``), embeddings ``N(0, embed_std^2)``, norm weights one.
    """
    with torch.device("meta"):
        model = make()
    model = model.to_empty(device="cpu").to(torch.float64)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, module in model.named_modules():
            if isinstance(module, nn.Linear):
                gain = lm_head_gain if name.split(".")[-1] == "lm_head" else linear_gain
                std = gain / math.sqrt(module.in_features)
                module.weight.copy_(_randn(module.weight.shape, gen) * std)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.copy_(_randn(module.weight.shape, gen) * embed_std)
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif any(True for _ in module.parameters(recurse=False)):
                raise TypeError(f"build_seeded does not know how to init {name} ({type(module)})")
    return model.to(device=device, dtype=dtype)


def _randn(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)
