"""Building blocks shared by pcpflow's models: norm, rotary embedding (with Hugging Face's
llama3 / YaRN scalings), MLP, the decoder stack, and the seeded init that makes float32
and float64 builds of the tiny models the same model."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Literal

import torch
from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass
from torch import nn

from pcpflow.models.base import AttentionBackend, AttentionSpec, CausalLM


class RMSNorm(nn.Module):
    """RMS norm scaled by ``weight``; ``unit_offset`` (Gemma): by ``1 + weight``, the weight
    stored as its offset from one; ``scale_first`` (OLMo 2): scaled before it is rounded to
    the input dtype (as Gemma's is); ``centered`` (Cohere's LayerNorm, which has no bias): of
    ``x - mean(x)``, scaled first."""

    def __init__(self, dim: int, eps: float, *, unit_offset: bool = False, scale_first: bool = False,
                 centered: bool = False):
        super().__init__()
        self.eps, self.unit_offset, self.centered = eps, unit_offset, centered
        self.scale_first = scale_first or unit_offset or centered
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = narrow_to_float32(x)
        if self.centered:
            h = h - h.mean(-1, keepdim=True)
        return self.scaled(h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype)

    def scaled(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The normalized ``h`` scaled and rounded to ``dtype``."""
        # NOTE: bf16/fp16 normalize in float32, then scale in the input dtype (as
        # transformers' Llama/DeepSeek RMSNorm) or, Gemma's and OLMo's, scale in float32 and
        # then round; float32/float64 compute in place.
        if self.scale_first:
            return (h * (int(self.unit_offset) + self.weight.to(h.dtype))).to(dtype)
        return self.weight * h.to(dtype)


def narrow_to_float32(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 as float32 (what norms compute in); wider dtypes as they are."""
    return x.float() if x.dtype in (torch.bfloat16, torch.float16) else x


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """float64 ``[rotary_dim // 2]`` inverse frequencies ``theta^(-2i/rotary_dim)``."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64, device="cpu") / rotary_dim
    return theta**-exponents


@pydantic_dataclass(frozen=True, config=ConfigDict(strict=True))
class RopeScaling:
    """A RoPE frequency scaling, with Hugging Face's names and defaults (``rope_scaling`` /
    ``rope_parameters`` of a config.json). Validated (strictly: a number is a JSON number)
    when made, so that a bad config.json is refused before any rank starts."""

    rope_type: Literal["linear", "llama3", "yarn", "longrope"]
    factor: float
    original_max_position_embeddings: int | None = None  # llama3, yarn, longrope
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    mscale: float | None = None  # yarn: cos/sin attention factor numerator
    mscale_all_dim: float | None = None  # yarn: its denominator (DeepSeek: softmax mscale too)
    attention_factor: float | None = None  # yarn, longrope: explicit cos/sin factor
    truncate: bool = True  # yarn: round the correction range outwards
    short_factor: list[float] | None = None  # longrope: per-frequency divisors up to the original length
    long_factor: list[float] | None = None  # longrope: past it (pcpflow runs requests up to it only)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 when scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def scaled_rope(
    rotary_dim: int, theta: float, scaling: RopeScaling | None
) -> tuple[torch.Tensor, float]:
    """float64 inverse frequencies and the factor cos/sin are multiplied by, for ``scaling``
    (None: plain RoPE, factor 1). The formulas are those of transformers'
    ``modeling_rope_utils``, evaluated in float64."""
    inv_freq = rope_inv_freq(rotary_dim, theta)
    if scaling is None:
        return inv_freq, 1.0
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor, 1.0
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if scaling.rope_type == "longrope":
        return _longrope(inv_freq, scaling)
    return _yarn(inv_freq, rotary_dim, theta, scaling)


def _longrope(inv_freq: torch.Tensor, s: RopeScaling) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3) within the original length: each frequency divided by its
    ``short_factor``; cos/sin get ``sqrt(1 + ln(factor) / ln(original length))``. transformers
    switches every position of a forward to ``long_factor`` once the forward reaches past the
    original length, so pcpflow runs requests up to it only (``CheckpointConfig.rope_limit``)."""
    old_len = s.original_max_position_embeddings
    assert old_len is not None and s.short_factor is not None, "longrope needs short_factor and its original length"
    if s.attention_factor is not None:
        factor = s.attention_factor
    else:
        factor = 1.0 if s.factor <= 1 else math.sqrt(1 + math.log(s.factor) / math.log(old_len))
    return inv_freq / torch.tensor(s.short_factor, dtype=torch.float64, device="cpu"), factor


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by ``factor``, short ones kept, a smooth blend
    in between."""
    old_len = s.original_max_position_embeddings
    assert old_len is not None, "llama3 scaling needs original_max_position_embeddings"
    wavelen = 2 * math.pi / inv_freq
    low_freq_wavelen = old_len / s.low_freq_factor
    high_freq_wavelen = old_len / s.high_freq_factor
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(
    inv_freq: torch.Tensor, rotary_dim: int, theta: float, s: RopeScaling
) -> tuple[torch.Tensor, float]:
    """YaRN (NTK-by-parts): dims that rotate more than ``beta_fast`` times over the original
    length keep their frequency, those under ``beta_slow`` are interpolated (divided by
    ``factor``), a linear ramp between; cos/sin get the attention factor."""
    old_len = s.original_max_position_embeddings
    assert old_len is not None, "yarn scaling needs original_max_position_embeddings"

    def correction_dim(num_rotations: float) -> float:
        return (
            rotary_dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))
        )

    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # NOTE: as transformers does, to avoid a division by zero
    dims = torch.arange(rotary_dim // 2, dtype=torch.float64, device="cpu")
    interpolation = ((dims - low) / (high - low)).clamp(0, 1)
    inv_freq = (inv_freq / s.factor) * interpolation + inv_freq * (1 - interpolation)
    if s.attention_factor is not None:
        factor = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        factor = yarn_mscale(s.factor, s.mscale) / yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        factor = yarn_mscale(s.factor)
    return inv_freq, factor


class RotaryEmbedding(nn.Module):
    """Rotary embedding over the last dim of ``[N, heads, dim]``: neox-style (rotate the
    two halves) or, with ``interleaved``, GPT-J-style (rotate pairs ``(x0, x1), (x2, x3)``,
    DeepSeek's layout; the output is de-interleaved, as transformers' DeepSeek-V3 does —
    queries and keys get the same permutation, so their dot products are unchanged)."""

    def __init__(
        self,
        rotary_dim: int,
        theta: float,
        *,
        scaling: RopeScaling | None = None,
        interleaved: bool = False,
    ):
        super().__init__()
        # NOTE: a plain attribute, not a buffer: it stays float64 whatever the model dtype,
        # so cos/sin of a float32 model are the float64 ones rounded once.
        self.inv_freq, self.attention_factor = scaled_rope(rotary_dim, theta, scaling)
        self.interleaved, self.dim = interleaved, rotary_dim

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq.to(positions.device)
        angles = positions.to(torch.float64)[:, None] * inv_freq  # [N, dim/2]
        cos, sin = angles.cos(), angles.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype)[:, None], sin.to(dtype)[:, None]

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.interleaved:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def gelu_new(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation written out, as transformers' ``NewGELUActivation`` (``gelu_new``,
    Phi's): the same function as ``gelu(approximate="tanh")``, not the same roundings."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def gelu_fast(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation as transformers' ``FastGELUActivation`` writes it (GPT-NeoX-20B's
    ``gelu_fast``: its constant rounded, its cube factored)."""
    return 0.5 * x * (1.0 + torch.tanh(x * 0.7978845608 * (1.0 + 0.044715 * x * x)))


def relu_squared(x: torch.Tensor) -> torch.Tensor:
    """``relu(x) ** 2`` (Nemotron's ``relu2``, as transformers' ``ReLUSquaredActivation``)."""
    return torch.square(nn.functional.relu(x))


ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu_tanh": functools.partial(nn.functional.gelu, approximate="tanh"),  # transformers' gelu_pytorch_tanh
    "gelu": nn.functional.gelu,  # the exact (erf) GELU: transformers' gelu outside Gemma
    "gelu_new": gelu_new,
    "relu2": relu_squared,
    "gelu_fast": gelu_fast,
}


GLU = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""A gated linear unit's elementwise part: ``(gate, up) -> hidden`` (what ``down_proj`` reads)."""


def act_glu(act: Callable[[torch.Tensor], torch.Tensor], gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``act(gate) * up``: SwiGLU with ``act`` SiLU, GeGLU with GELU."""
    return act(gate) * up


def swiglu_clamped(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss's GLU (transformers' ``GptOssExperts._apply_gate``): ``gate`` clamped above at
    ``limit``, ``up`` to ``[-limit, limit]``, then ``(up + 1) * gate * sigmoid(alpha * gate)``.
    NOTE: the ``+ 1`` (a residual on up) is why this is a function of both halves rather
    than an activation of ``gate`` alone; the products are in transformers' order."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GatedMLP(nn.Module):
    """``down(glu(gate(x), up(x)))``; ``glu`` by default ``act(gate) * up``, ``act`` SiLU (Gemma:
    tanh-approximated GELU). Gate and up are one fused projection, ``[gate rows; up rows]``."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        activation: Literal["silu", "gelu_tanh"] = "silu",
        glu: GLU | None = None,
    ):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.glu = glu if glu is not None else functools.partial(act_glu, ACTIVATIONS[activation])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.glu(gate, up))


class PlainMLP(nn.Module):
    """``down(act(up(x)))``: an MLP without a gate (StarCoder2's ``c_fc`` / ``c_proj``, Phi's ``fc1`` /
    ``fc2``), biases on both where ``bias``."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, activation: str = "gelu_tanh"):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act = ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class OffsetLayerNorm(nn.LayerNorm):
    """A LayerNorm scaled by ``1 + weight`` (the weight stored as its offset from one), as
    Nemotron's ``LayerNorm1P``: ``weight + 1`` in the weight's dtype, then torch's layer norm."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.layer_norm(x, self.normalized_shape, self.weight + 1.0, self.bias, self.eps)


def make_norm(dim: int, eps: float, *, bias: bool = False, unit_offset: bool = False, scale_first: bool = False,
              centered: bool = False) -> nn.Module:
    """A decoder's norm: ``RMSNorm`` (its options), or with ``bias`` torch's ``LayerNorm`` (a weight
    and a bias, as StarCoder2, Phi and StableLM use it: the same function in every dtype; with
    ``unit_offset``, Nemotron's ``OffsetLayerNorm``)."""
    if bias:
        return OffsetLayerNorm(dim, eps=eps) if unit_offset else nn.LayerNorm(dim, eps=eps)
    return RMSNorm(dim, eps, unit_offset=unit_offset, scale_first=scale_first, centered=centered)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; with
    ``sandwich`` (Gemma) each block's output is normed too, ``x + norm(attn(norm(x)))``, and
    without ``pre_norm`` (OLMo 2: ``sandwich`` alone) only the outputs, ``x + norm(attn(x))``;
    ``parallel`` (Cohere): ``x + attn(norm(x)) + mlp(norm(x))``, one norm; with ``parallel_mlp_norm``
    (GPT-NeoX) the MLP reads a norm of its own, ``x + attn(norm1(x)) + mlp(norm2(x))``.
    ``unit_offset`` / ``scale_first`` / ``centered``: the norms' (``RMSNorm``); ``norm_bias``: the
    norms are LayerNorms with a bias (``make_norm``);
    ``residual_multiplier`` (Granite): each block's output is scaled by it before it is added.

    ``self_attn(h, positions, layer, attn)`` is the model's attention: its projections
    around exactly one call to the engine's backend ``attn``."""

    def __init__(
        self,
        self_attn: nn.Module,
        hidden_size: int,
        intermediate_size: int,
        eps: float,
        mlp_bias: bool = False,
        mlp: nn.Module | None = None,
        *,
        sandwich: bool = False,
        unit_offset: bool = False,
        residual_multiplier: float | None = None,
        pre_norm: bool = True,
        scale_first: bool = False,
        centered: bool = False,
        parallel: bool = False,
        norm_bias: bool = False,
        parallel_mlp_norm: bool = False,
    ):
        super().__init__()
        self.residual_multiplier, self.parallel = residual_multiplier, parallel
        self.parallel_mlp_norm = parallel_mlp_norm

        def norm() -> nn.Module:
            return make_norm(hidden_size, eps, bias=norm_bias, unit_offset=unit_offset, scale_first=scale_first,
                             centered=centered)

        self.input_norm = norm() if pre_norm else nn.Identity()
        self.self_attn = self_attn
        # NOTE: the MLP's input norm (Gemma's pre_feedforward_layernorm); a parallel block has none of its own
        self.post_attention_norm = norm() if pre_norm and (parallel_mlp_norm or not parallel) else nn.Identity()
        # NOTE: ``mlp`` replaces the dense MLP (a mixture-of-experts block, pcpflow.models.moe)
        self.mlp = mlp if mlp is not None else GatedMLP(hidden_size, intermediate_size, bias=mlp_bias)
        self.attn_out_norm, self.mlp_out_norm = (norm(), norm()) if sandwich else (nn.Identity(), nn.Identity())

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, layer: int, attn: AttentionBackend
    ) -> torch.Tensor:
        if self.parallel:  # NOTE: Cohere's: attention and MLP read one norm of x, both added to it
            h = self.input_norm(x)
            mlp_in = self.post_attention_norm(x) if self.parallel_mlp_norm else h
            return x + self.self_attn(h, positions, layer, attn) + self.mlp(mlp_in)
        x = x + self._scaled(self.attn_out_norm(self.self_attn(self.input_norm(x), positions, layer, attn)))
        return x + self._scaled(self.mlp_out_norm(self.mlp(self.post_attention_norm(x))))

    def _scaled(self, h: torch.Tensor) -> torch.Tensor:
        # NOTE: Granite's residual_multiplier, a Python float times the block's output, as transformers
        return h if self.residual_multiplier is None else h * self.residual_multiplier


class DecoderLM(CausalLM):
    """Embedding, a stack of ``DecoderLayer``, final norm and LM head; subclasses supply
    the attention block per layer and the ``AttentionSpec``. ``embed_scale`` multiplies the
    embedding (Gemma: sqrt(hidden_size), rounded to the weights' dtype), ``embedding_multiplier``
    too (Granite: a Python float); ``logits_scaling`` divides the logits (Granite), ``logit_scale``
    multiplies them (Cohere),
    ``final_logit_softcapping`` caps them, ``cap * tanh(logits / cap)`` (Gemma);
    ``unit_offset``, ``scale_first``, ``centered``, ``norm_bias``: the final norm's (``make_norm``);
    ``lm_head_bias`` (Phi): a bias added to the logits (its own parameter, so a tied head keeps it)."""

    def __init__(
        self,
        *,
        vocab_size: int,
        hidden_size: int,
        layers: list[DecoderLayer],
        attn_spec: AttentionSpec,
        eps: float,
        tie_word_embeddings: bool,
        embed_scale: float | None = None,
        unit_offset: bool = False,
        embedding_multiplier: float | None = None,
        logits_scaling: float | None = None,
        final_logit_softcapping: float | None = None,
        scale_first: bool = False,
        centered: bool = False,
        logit_scale: float | None = None,
        norm_bias: bool = False,
        lm_head_bias: bool = False,
    ):
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = len(layers)
        self.attn_spec = attn_spec
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_scale = embed_scale
        self.embedding_multiplier, self.logits_scaling = embedding_multiplier, logits_scaling
        self.final_logit_softcapping, self.logit_scale = final_logit_softcapping, logit_scale
        self.layers = nn.ModuleList(layers)
        self.norm = make_norm(hidden_size, eps, bias=norm_bias, unit_offset=unit_offset, scale_first=scale_first,
                              centered=centered)
        self.lm_head = (
            None if tie_word_embeddings else nn.Linear(hidden_size, vocab_size, bias=False)
        )
        self.lm_head_bias = nn.Parameter(torch.zeros(vocab_size)) if lm_head_bias else None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.embedding_multiplier is not None:  # NOTE: Granite's: a Python float, as transformers
            x = x * self.embedding_multiplier
        if self.embed_scale is None:
            return x
        # NOTE: the scale rounded to the weights' dtype first, as transformers' Gemma (bf16: sqrt(3072) is 55.5)
        return x * torch.tensor(self.embed_scale, dtype=x.dtype, device=x.device)

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
        logits = hidden @ weight.T
        if self.lm_head_bias is not None:  # NOTE: Phi's, as its nn.Linear adds it
            logits = logits + self.lm_head_bias
        if self.logits_scaling is not None:  # NOTE: Granite's
            logits = logits / self.logits_scaling
        if self.logit_scale is not None:  # NOTE: Cohere's: a Python float times the logits, as transformers
            logits = logits * self.logit_scale
        cap = self.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap  # NOTE: Gemma's, as transformers

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
    ``lm_head``), embeddings ``N(0, embed_std^2)``, norm weights one. On ``meta``: shapes
    only, nothing drawn (the host-memory check sizes models that would not fit).
    """
    if torch.device(device).type == "meta":
        return build_uninitialized(make, "meta").to(dtype)
    model = build_uninitialized(make).to(torch.float64)
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
                module.weight.fill_(0.0 if module.unit_offset else 1.0)
            elif isinstance(module, nn.LayerNorm):
                module.weight.fill_(0.0 if isinstance(module, OffsetLayerNorm) else 1.0)
                module.bias.zero_()
            elif hasattr(module, "seeded_init"):  # e.g. an MoE router (weight and bias)
                module.seeded_init(gen, linear_gain)
            elif any(True for _ in module.parameters(recurse=False)):
                raise TypeError(f"build_seeded does not know how to init {name} ({type(module)})")
    return model.to(device=device, dtype=dtype)


class _SkipInit(torch.overrides.TorchFunctionMode):
    """Drops the in-place initializers modules call in their constructors."""

    INITS = frozenset(
        {getattr(nn.init, f) for f in dir(nn.init) if f.endswith("_") and not f.startswith("_")}
        | {torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.zero_, torch.Tensor.fill_}
    )

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.INITS:
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


def build_uninitialized(make: Callable[[], nn.Module], device: torch.device | str = "cpu") -> nn.Module:
    """``make()`` on ``device`` without running the constructors' weight initializers: every
    caller replaces the weights (seeded draw, checkpoint) or, on ``meta``, reads shapes only.
    NOTE: not built on meta and then ``to_empty``: on meta tensors an initializer and
    ``empty_like`` run torch's Python references, whose first calls import torch._dynamo and
    sympy (~4 s of CPU in every process that builds a model)."""
    with torch.device(device), _SkipInit():
        return make()


def _randn(shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)
