"""The ``model:`` configs, without torch: the run config imports them, and ``python -m pcpflow
--help`` answers without importing torch (``tests/test_structure.py``; a run's validation
imports it with the stages). Each model class builds its own (``TinyGQA.Config is
TinyGQAConfig``); a Hugging Face checkpoint is read (``pcpflow.models.hf_registry``, torch's
import) only where ``model=hf`` is validated.

To add a model: its config here, with a ``name`` literal, joined to ``ModelConfig``; its class
(``from_config(config, *, dtype, seed, device)``) in ``pcpflow.models.model_classes``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pcpflow.errors import ConfigError, Problem, Settings
from pcpflow.models.card import ModelCard
from pcpflow.models.hub import resolve_checkpoint
from pcpflow.models.moe_config import MoEConfig, dense_sentinel


class TinyModelConfig(Settings):
    """What every tiny model with seeded random weights has (``tiny_gqa``, ``tiny_mla``)."""

    vocab_size: int = Field(256, gt=0, description="vocabulary size")
    hidden_size: int = Field(64, gt=0, description="residual stream width")
    num_layers: int = Field(2, gt=0, description="decoder layers")
    num_heads: int = Field(4, gt=0, description="query heads")
    intermediate_size: int = Field(128, gt=0, description="MLP inner width")
    rope_theta: float = Field(10000.0, gt=0, description="rotary base")
    rms_norm_eps: float = Field(1e-6, gt=0, description="RMSNorm epsilon")
    tie_word_embeddings: bool = Field(False, description="LM head shares the embedding")
    init_gain: float = Field(1.0, gt=0, description="linear weights are N(0, init_gain^2 / fan_in)")
    logit_gain: float = Field(4.0, gt=0, description="untied LM head is N(0, logit_gain^2 / hidden_size)")

    def lm_dims(self) -> dict[str, Any]:
        """``DecoderLM``'s keyword arguments besides the layers and the cache spec."""
        return {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "eps": self.rms_norm_eps,
                "tie_word_embeddings": self.tie_word_embeddings}


class TinyGQAConfig(TinyModelConfig):
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
    def _window_layers_exist(self) -> TinyGQAConfig:
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
    def _heads_divide(self) -> TinyGQAConfig:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        return self


class TinyMLAConfig(TinyModelConfig):
    """A tiny DeepSeek-V2-style MLA model with seeded random weights."""

    name: Literal["tiny_mla"] = "tiny_mla"
    q_lora_rank: int | None = Field(
        48, gt=0, description="rank of the query compression (None: a full q_proj)"
    )
    kv_lora_rank: int = Field(32, gt=0, description="width of the cached latent c_kv")
    qk_nope_head_dim: int = Field(16, gt=0, description="per-head query/key dims without rope")
    qk_rope_head_dim: int = Field(
        16, gt=0, multiple_of=2, description="per-head query/key dims with rope (shared k_pe)"
    )
    v_head_dim: int = Field(16, gt=0, description="per-head value dim")
    moe: MoEConfig | None = Field(
        None, description="mixture-of-experts layers (None, or num_experts 0: dense MLPs)"
    )

    _dense_moe = field_validator("moe", mode="before")(dense_sentinel)


class HFConfig(Settings):
    """A Hugging Face checkpoint directory (config.json + safetensors)."""

    name: Literal["hf"] = "hf"
    path: str | None = Field(
        None,
        validate_default=True,
        description=(
            "the checkpoint (required): a directory with config.json + *.safetensors (a "
            "`save_pretrained` or `hf download` one; a relative path resolves against the "
            "working directory when the config is validated), or a Hugging Face Hub id "
            "owner/name[@revision], read from the Hugging Face cache and downloaded into it "
            "when missing (not with HF_HUB_OFFLINE=1)"
        ),
    )

    @field_validator("path")
    @classmethod
    def _readable_checkpoint(cls, path: str | None) -> str:
        if path is None or not str(path).strip():
            raise ValueError(
                "the checkpoint directory is required: give model.path=<dir> (config.json "
                "+ *.safetensors; scripts/make_tiny_hf_checkpoint.py builds a tiny one)"
            )
        # NOTE: resolved once, in the driver, so that ranks started elsewhere read the
        # same directory (a Hub id's snapshot, downloaded here: pcpflow.models.hub).
        path = resolve_checkpoint(str(path), weights=True)
        from pcpflow.models.hf_registry import read_checkpoint  # NOTE: imports torch: hf runs only

        read_checkpoint(path)
        return path


ModelConfig = Annotated[TinyMLAConfig | TinyGQAConfig | HFConfig | ModelCard, Field(discriminator="name")]


def vocab_size_of(config: ModelConfig) -> int:
    """The vocabulary size a config implies, without building the model (the driver
    checks explicit prompt ids against it before any rank starts)."""
    if not isinstance(config, HFConfig):
        return config.vocab_size
    from pcpflow.models.hf_registry import read_checkpoint

    try:
        return read_checkpoint(config.path or "").vocab_size
    except ValueError as exc:
        raise ConfigError([Problem("model.path", config.path, str(exc))]) from None
