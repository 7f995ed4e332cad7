"""What pcpflow reads from a Hugging Face checkpoint's ``config.json``.

Each supported family has a pydantic model of the config.json fields it uses (others are
ignored) with transformers' defaults; ``CheckpointConfig.parse`` validates a config.json
dict into it and reports problems as one ``ValueError`` message. RoPE settings come in two
spellings — ``rope_theta`` + ``rope_scaling`` (transformers 4) or ``rope_parameters``
(transformers 5) — and are read into ``rope_theta`` and a ``RopeScaling``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, RopeScaling
from pcpflow.models.hf_weights import Rename
from pcpflow.models.layers import gqa_spec

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
LONGROPE_ALIASES = {"Phi3ForCausalLM": ("su", "yarn")}
"""Rope types an architecture's config.json may spell LongRoPE as (transformers' ``Phi3Config``
reads its older ``su`` and ``yarn`` as ``longrope``)."""


class CheckpointConfig(BaseModel):
    """The decoder fields shared by Llama and DeepSeek config.json files. Strict: a number
    given as a string (``"hidden_size": "64"``) is refused, as transformers would misread it."""

    model_config = ConfigDict(extra="ignore", frozen=True, strict=True)

    architecture: str
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    max_position_embeddings: int = Field(2048, gt=0)
    rms_norm_eps: float = Field(1e-6, gt=0)
    tie_word_embeddings: bool = False
    hidden_act: Literal["silu", "swish"] = "silu"  # NOTE: transformers' ACT2FN: swish is SiLU
    attention_bias: bool = False
    rope_theta: float = Field(10000.0, gt=0)
    rope_scaling: RopeScaling | None = None
    quantization_config: dict[str, Any] | None = None
    allow_quantized: bool = False  # a simulated run reads the sizes of quantized checkpoints too

    renames: ClassVar[tuple[Rename, ...]] = ()
    skip: ClassVar[tuple[str, ...]] = ()  # stored tensors pcpflow leaves out (regexes: a vision tower)
    full_qk_norm: ClassVar[bool] = False  # q and k normed over the whole projection (OLMo 2 and 3)
    gated_mlp: ClassVar[bool] = True  # the dense MLP's gate and up projections (False: up alone, StarCoder2, Phi)
    layer_norm: ClassVar[bool] = False  # the norms are LayerNorms with a bias (StarCoder2, Phi, StableLM)
    dequantized: ClassVar[tuple[str, ...]] = ()  # quant methods the loader widens to the run's dtype (gpt-oss: mxfp4)

    @model_validator(mode="before")
    @classmethod
    def _read_rope(cls, raw: Any) -> Any:
        if not isinstance(raw, dict):
            return raw
        raw = dict(raw)
        quant = raw.get("quantization_config")
        if quant is not None and not isinstance(quant, dict):
            raise ValueError(f"quantization_config must be a mapping (quant_method, ...); got {type(quant).__name__} {quant!r}")
        return cls._rope_fields(raw)

    @classmethod
    def _rope_fields(cls, raw: dict[str, Any]) -> dict[str, Any]:
        """``raw`` with its RoPE settings read into ``rope_theta`` and ``rope_scaling``."""
        key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
        params = raw.pop("rope_parameters", None) or raw.pop("rope_scaling", None) or {}
        raw.pop("rope_scaling", None)
        if isinstance(params, dict) and params.get("partial_rotary_factor") is not None:
            # NOTE: transformers 5 keeps it with the rope's settings
            raw.setdefault("partial_rotary_factor", params["partial_rotary_factor"])
        raw["rope_theta"], scaling = read_rope(params, key, raw, default_theta=raw.get("rope_theta") or 10000.0)
        if scaling is not None:
            raw["rope_scaling"] = scaling
        return raw

    @model_validator(mode="after")
    def _not_quantized(self) -> CheckpointConfig:
        if self.quant_method is not None and self.quant_method not in self.dequantized and not self.allow_quantized:
            raise ValueError(f"quantized checkpoints ({self.quant_method}) are not supported; use an unquantized "
                             "(bf16/fp16/fp32) checkpoint")
        return self

    @model_validator(mode="after")
    def _longrope_factors(self) -> CheckpointConfig:
        s = self.rope_scaling
        if s is not None and s.rope_type == "longrope":
            for key in ("short_factor", "long_factor"):
                if len(getattr(s, key)) != self.rope_dims // 2:
                    raise ValueError(f"longrope {key} has {len(getattr(s, key))} numbers; RoPE rotates "
                                     f"{self.rope_dims} dims of a head, one number per pair: {self.rope_dims // 2}")
        return self

    @property
    def rope_dims(self) -> int:  # pragma: no cover
        """The dims of a head RoPE rotates."""
        raise NotImplementedError

    @property
    def rope_limit(self) -> int | None:
        """The longest request pcpflow runs exactly as transformers does (None: no limit):
        LongRoPE's original length, past which transformers ropes a whole forward with
        ``long_factor`` — prompts and cached keys included — where pcpflow ropes each
        position once, as it is written."""
        s = self.rope_scaling
        return s.original_max_position_embeddings if s is not None and s.rope_type == "longrope" else None

    @property
    def quant_method(self) -> str | None:
        q = self.quantization_config
        return None if not q else str(q.get("quant_method", "?"))

    @classmethod
    def parse(cls, raw: dict[str, Any], architecture: str, *, allow_quantized: bool = False) -> CheckpointConfig:
        """The checkpoint config of a config.json dict; ValueError naming every problem."""
        try:
            return cls.model_validate({**raw, "architecture": architecture, "allow_quantized": allow_quantized})
        except ValidationError as exc:
            problems = []
            for err in exc.errors(include_url=False):
                where = ".".join(str(p) for p in err["loc"])
                msg = err["msg"].removeprefix("Value error, ")
                if where and err["type"] not in ("value_error", "missing"):  # NOTE: a missing key's input is the whole config
                    msg += f" (got {err.get('input')!r})"
                problems.append(f"{where}: {msg}" if where else msg)
            raise ValueError(f"config.json of a {architecture}: " + "; ".join(problems)) from None

    # what a family provides
    def attn_spec(self) -> AttentionSpec:  # pragma: no cover
        raise NotImplementedError

    def build_layers(self) -> list[DecoderLayer]:  # pragma: no cover
        raise NotImplementedError

    def lm_options(self) -> dict[str, Any]:
        """``DecoderLM``'s options beyond layers, sizes and eps (Gemma: its embedding scale and norms)."""
        return {}


def read_rope(params: Any, key: str, raw: dict[str, Any], *, default_theta: float) -> tuple[float, RopeScaling | None]:
    """(theta, scaling; None: plain RoPE) of one mapping of RoPE settings as config.json spells
    them (``rope_type``, ``factor``, ...; ``key``: its place in config.json, for messages)."""
    if not isinstance(params, dict):
        raise ValueError(f"{key} must be a mapping (rope_type, factor, ...); got {type(params).__name__} {params!r}")
    params = dict(params)
    theta = params.pop("rope_theta", None) or default_theta
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in LONGROPE_ALIASES.get(raw.get("architecture"), ()):
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    if rope_type == "longrope":
        _read_longrope(params, raw)
    if params.get("factor") is None:
        raise ValueError(f"rope scaling {rope_type!r} needs a 'factor'")
    known = set(RopeScaling.__dataclass_fields__)
    kwargs = {k: v for k, v in params.items() if k in known and v is not None}
    kwargs["rope_type"] = rope_type
    if rope_type in ("llama3", "yarn", "longrope"):
        # NOTE: as transformers: the original length defaults to the model's
        kwargs.setdefault(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings") or raw.get("max_position_embeddings", 2048),
        )
    try:
        return theta, RopeScaling(**kwargs)
    except ValidationError as exc:
        bad = "; ".join(f"{key}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors(include_url=False))
        raise ValueError(bad) from None

def _read_longrope(params: dict[str, Any], raw: dict[str, Any]) -> None:
    """LongRoPE's settings as transformers reads them: ``short_factor`` and ``long_factor``
    lists of numbers, ``factor`` (when absent) the ratio of ``max_position_embeddings`` to the
    original length."""
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not (isinstance(value, list) and value and all(type(x) in (int, float) for x in value)):
            raise ValueError(f"longrope needs {key}: a list of numbers (one per rotated frequency); got {value!r}")
        params[key] = [float(x) for x in value]
    original = params.get("original_max_position_embeddings") or raw.get("original_max_position_embeddings")
    if original is not None:
        params["original_max_position_embeddings"] = original
    longest = raw.get("max_position_embeddings", 2048)
    if params.get("factor") is None and type(original) is int and original > 0 and type(longest) is int:
        params["factor"] = longest / original


def head_problems(heads: int, kv_heads: int, head_dim: int, layer_types: list | None, num_layers: int) -> list[str]:
    """What a GQA config.json's heads and layer types must satisfy (Gemma, OLMo)."""
    problems = []
    if heads % kv_heads:
        problems.append(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})")
    if head_dim % 2:
        problems.append(f"head_dim ({head_dim}) must be even for RoPE")
    if layer_types is not None and len(layer_types) != num_layers:
        problems.append(f"layer_types has {len(layer_types)} entries; num_hidden_layers is {num_layers}")
    return problems


def layer_kinds(layer_types: list[str] | None, num_layers: int, pattern: int) -> list[str]:
    """Each layer's attention as transformers lays it out for Gemma 3, OLMo 3 and Cohere 2:
    ``layer_types``, else layer ``i`` slides unless ``(i + 1) % pattern == 0``."""
    if layer_types is not None:
        return list(layer_types)
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]


class GQACheckpoint(CheckpointConfig):
    """A checkpoint of grouped-query attention (every family but DeepSeek's MLA): its KV heads and
    head width as transformers defaults them."""

    @property
    def kv_heads(self) -> int:
        """GQA's key/value heads: ``num_key_value_heads``, all heads where a family leaves it out."""
        return getattr(self, "num_key_value_heads", None) or self.num_attention_heads

    @property
    def dim(self) -> int:
        """A GQA head's width: ``head_dim``, else ``hidden_size / num_attention_heads`` (transformers')."""
        return getattr(self, "head_dim", None) or self.hidden_size // self.num_attention_heads

    @property
    def rope_dims(self) -> int:
        """The dims of a head RoPE rotates: all of them, unless a family rotates a part."""
        return self.dim


class HeadsOfHidden(GQACheckpoint):
    """A GQA checkpoint whose ``head_dim`` is hidden / heads and whose layers may slide (OLMo 2/3,
    Cohere 2): its KV heads (all heads unless given), the layer kinds (``kinds``, every layer full
    unless a family says otherwise) and the window of the sliding ones."""

    num_key_value_heads: int | None = Field(None, gt=0)
    reads_head_dim: ClassVar[bool] = False  # a family whose ``head_dim`` field, when given, is the head's width (Nemotron)

    @model_validator(mode="after")
    def _heads(self) -> HeadsOfHidden:
        problems = head_problems(self.num_attention_heads, self.kv_heads, self.dim, getattr(self, "layer_types", None),
                                 self.num_hidden_layers)
        if self.hidden_size % self.num_attention_heads and not self._given_head_dim:
            problems.append(f"hidden_size ({self.hidden_size}) must split into num_attention_heads "
                            f"({self.num_attention_heads}) heads (head_dim is hidden_size / heads)")
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @property
    def _given_head_dim(self) -> int | None:
        return getattr(self, "head_dim", None) if self.reads_head_dim else None

    @property
    def dim(self) -> int:
        return self._given_head_dim or self.hidden_size // self.num_attention_heads

    @property
    def kinds(self) -> list[str]:
        return ["full_attention"] * self.num_hidden_layers

    @property
    def sliding_layers(self) -> list[int]:
        return [i for i, kind in enumerate(self.kinds) if kind == "sliding_attention"]

    @property
    def window(self) -> int | None:
        """The sliding layers' window (the most recent keys a query sees, itself included); None:
        no layer slides (or ``sliding_window`` is null: they attend to every key)."""
        return getattr(self, "sliding_window", None) if self.sliding_layers else None

    def attn_spec(self) -> AttentionSpec:
        spec = gqa_spec(self.num_attention_heads, self.kv_heads, self.dim)
        return dataclasses.replace(spec, window=self.window, window_layers=tuple(self.sliding_layers))


class LanguageModelOf:
    """Mixin: the language model of a multimodal checkpoint (a vision tower beside it), run on
    text alone. Its config.json nests the text model's fields in ``text_config`` (the text
    config class's defaults, ``text_defaults``, where it is silent; ``text_at_top``: or writes
    them beside the vision config, as Qwen2-VL's older files do), its tensors sit under
    ``language_model.`` (``prefixed``), and what it stores for images (``skip``) is left in the
    file. The whole model's ``tie_word_embeddings`` and ``quantization_config`` are read at the
    top, as transformers reads them (``tie_default``: the multimodal config class's default)."""

    text_architecture: ClassVar[str]  # the text model's architecture (its family)
    text_model_types: ClassVar[tuple[str, ...]]  # what text_config.model_type may say
    text_defaults: ClassVar[dict[str, Any]] = {}
    text_at_top: ClassVar[bool] = False
    tie_default: ClassVar[bool] = True
    skip: ClassVar[tuple[str, ...]] = (r"vision_tower\..*", r"multi_modal_projector\..*")

    @classmethod
    def prefixed(cls, renames: tuple[Rename, ...]) -> tuple[Rename, ...]:
        """The text model's renames, under ``language_model.``."""
        return tuple(dataclasses.replace(r, hf=f"language_model.{r.hf}") for r in renames)

    @classmethod
    def text_fields(cls, text: dict[str, Any]) -> dict[str, Any]:
        """The text model's fields as its own config.json would write them (a family reads its own)."""
        return text

    @classmethod
    def parse(cls, raw: dict[str, Any], architecture: str, *, allow_quantized: bool = False):
        where = f"config.json of a {architecture}"
        text = raw.get("text_config")
        if text is None and cls.text_at_top:
            text = {k: v for k, v in raw.items() if k not in ("vision_config", "architectures", "model_type")}
        text = text or {}
        if not isinstance(text, dict):
            raise ValueError(f"{where}: text_config must be a mapping; got {text!r}")
        text = cls.text_fields(text)
        kind = text.get("model_type", cls.text_model_types[0])
        if kind not in cls.text_model_types:
            raise ValueError(f"{where}: text_config.model_type must be {' or '.join(cls.text_model_types)}; got {kind!r}")
        merged = {**cls.text_defaults, **text, "tie_word_embeddings": raw.get("tie_word_embeddings", cls.tie_default)}
        if "quantization_config" in raw:
            merged["quantization_config"] = raw["quantization_config"]
        try:
            return super().parse(merged, cls.text_architecture, allow_quantized=allow_quantized)  # type: ignore[misc]
        except ValueError as exc:
            raise ValueError(str(exc).replace(f"config.json of a {cls.text_architecture}",
                                              f"{where} (its text_config)")) from None
