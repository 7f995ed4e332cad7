"""Hugging Face checkpoints: ``model=hf model.path=DIR``.

``DIR`` is a checkpoint directory as ``save_pretrained`` writes it: ``config.json`` plus
safetensors weights (one file, or shards with ``model.safetensors.index.json``).
Supported: the GQA decoders ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
``Qwen3ForCausalLM``, ``Phi3ForCausalLM``, ``SmolLM3ForCausalLM``, ``GraniteForCausalLM``,
``Ministral3ForCausalLM`` (YaRN and each query scaled by its position: ``Ministral3Checkpoint``), Zhipu's
``GlmForCausalLM`` and ``Glm4ForCausalLM`` (GLM-4-0414, GLM-Z1: sandwich norms) and
the mixture-of-experts ``Qwen2MoeForCausalLM``, ``Qwen3MoeForCausalLM``, ``MixtralForCausalLM``,
``Ernie4_5_MoeForCausalLM`` and ``Glm4MoeForCausalLM`` (``hf_llama``: one model, the families' differences — biases, q/k
norms, head_dim, partial RoPE, NoPE layers, multipliers, fused tensors, the MoE fields — in a
table); Gemma 3's text ``Gemma3ForCausalLM``, the language model of its multimodal
``Gemma3ForConditionalGeneration`` (text only: ``hf_checkpoint.LanguageModelOf``, as Mistral
Small 3.1's ``Mistral3ForConditionalGeneration``, and Ministral 3's: a ``ministral3`` text_config; Qwen2-VL's
and Qwen2.5-VL's, and Qwen3-VL's ``Qwen3VLForConditionalGeneration`` / ``Qwen3VLMoeForConditionalGeneration``:
Qwen3 / Qwen3-MoE layers under ``model.language_model.``, interleaved M-RoPE plain on text, the MoE's fused
experts read in either stored layout) and Gemma 2's ``Gemma2ForCausalLM``
(``hf_gemma``: the same GQA layers with Gemma's norms, embedding scale, GELU, RoPE per layer
type and soft-capping); OLMo 2 / 3 (``hf_olmo``: post-norm layers, q/k normed over the whole
projection); AllenAI's OLMoE ``OlmoeForCausalLM`` (``hf_olmoe``: pre-norm layers, q/k normed over the
whole projection, ``clip_qkv``, MoE with softmax top-k weights not renormalised); Cohere 2 (``hf_cohere``: parallel blocks, centered norms, NoPE full layers);
EXAONE 4.0 (``hf_exaone``: post-norm, per-head q/k norms, NoPE full layers); OpenAI's gpt-oss
``GptOssForCausalLM`` (``hf_gptoss``: attention sinks, alternating sliding layers, MoE with biased
experts, its MXFP4 experts dequantized at load); Meta's Llama 4 ``Llama4ForCausalLM`` and the
language model of ``Llama4ForConditionalGeneration`` (``hf_llama4``: chunked attention on the RoPE
layers, NoPE layers with attention temperature tuning, q/k L2 norms after RoPE, MoE with input-scaled
top-1 experts and a shared expert); Tencent's Hunyuan ``HunYuanDenseV1ForCausalLM`` and
``HunYuanMoEV1ForCausalLM`` (``hf_hunyuan``: per-head q/k norms after RoPE, RoPE's fixed NTK alpha, MoE
with a shared expert); ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``, dense or with MoE layers
(``hf_deepseek``); IBM's ``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM`` and Granite 4.0's
``GraniteMoeHybridForCausalLM`` with attention layers only (``hf_granite``: Granite's multipliers, top-k
experts weighted by a softmax over the k, a shared MLP; a hybrid's Mamba2 layers are refused, naming
them). The config is checked when the run config is validated — an unsupported
architecture (other MoE families such as Phi-3.5-MoE are named as such, Gemma 1 with a
reason), a quantized checkpoint, a missing directory or weights are
configuration errors (exit 2, no rank started; gpt-oss's MXFP4 experts are read, widened to the run's dtype); so is, in an executed run, a request past
LongRoPE's original length (``length_problems``). A sliding window (Mistral's
``sliding_window``, Qwen's ``use_sliding_window``, Gemma's sliding layers) is executed:
``AttentionSpec.window``, and so are Llama 4's attention chunks (``window_kind: chunked``).
The weights are cast to the run's ``dtype``; only ``safetensors`` is needed to load them.
A simulated run reads the same architectures' sizes (quantized ones too) and prices full
attention.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import Field, field_validator

from pcpflow.errors import ConfigError, Problem, Settings, missing_extra
from pcpflow.models.common import DecoderLM, build_uninitialized
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_cohere import Cohere2Checkpoint
from pcpflow.models.hf_deepseek import DeepseekCheckpoint
from pcpflow.models.hf_exaone import Exaone4Checkpoint
from pcpflow.models.hf_gemma import Gemma2Checkpoint, Gemma3Checkpoint, Gemma3MultimodalCheckpoint
from pcpflow.models.hf_gptoss import GptOssCheckpoint
from pcpflow.models.hf_granite import GraniteMoeCheckpoint
from pcpflow.models.hf_hunyuan import HunyuanDenseCheckpoint, HunyuanMoECheckpoint
from pcpflow.models.hf_llama import (
    FAMILIES,
    LlamaCheckpoint,
    Ministral3Checkpoint,
    Mistral3Checkpoint,
    Qwen2VLCheckpoint,
    Qwen3VLCheckpoint,
    Qwen3VLMoeCheckpoint,
)
from pcpflow.models.hf_llama4 import Llama4Checkpoint, Llama4MultimodalCheckpoint
from pcpflow.models.hf_olmo import Olmo2Checkpoint, Olmo3Checkpoint
from pcpflow.models.hf_olmoe import OlmoeCheckpoint
from pcpflow.models.hf_weights import (
    Rename,
    checkpoint_files,
    load_checkpoint,
    plan_names,
    read_safetensors_header,
)
from pcpflow.models.hub import resolve_checkpoint
from pcpflow.models.mxfp4 import dense_shape as mxfp4_dense_shape

ARCHITECTURES: dict[str, type[CheckpointConfig]] = {
    **dict.fromkeys(FAMILIES, LlamaCheckpoint),
    "Ministral3ForCausalLM": Ministral3Checkpoint,  # FAMILIES' layers, its own rope settings and defaults
    "DeepseekV2ForCausalLM": DeepseekCheckpoint,
    "DeepseekV3ForCausalLM": DeepseekCheckpoint,
    "Gemma3ForCausalLM": Gemma3Checkpoint,
    "Gemma3ForConditionalGeneration": Gemma3MultimodalCheckpoint,  # its language model: text in, text out
    "Mistral3ForConditionalGeneration": Mistral3Checkpoint,  # the same
    "Qwen2VLForConditionalGeneration": Qwen2VLCheckpoint,  # the same
    "Qwen2_5_VLForConditionalGeneration": Qwen2VLCheckpoint,
    "Qwen3VLForConditionalGeneration": Qwen3VLCheckpoint,  # its language model, tensors under model.language_model.
    "Qwen3VLMoeForConditionalGeneration": Qwen3VLMoeCheckpoint,
    "Gemma2ForCausalLM": Gemma2Checkpoint,
    "Olmo2ForCausalLM": Olmo2Checkpoint,
    "Olmo3ForCausalLM": Olmo3Checkpoint,
    "OlmoeForCausalLM": OlmoeCheckpoint,
    "Cohere2ForCausalLM": Cohere2Checkpoint,
    "Exaone4ForCausalLM": Exaone4Checkpoint,
    "GptOssForCausalLM": GptOssCheckpoint,
    "Llama4ForCausalLM": Llama4Checkpoint,
    "Llama4ForConditionalGeneration": Llama4MultimodalCheckpoint,  # its language model, as Gemma 3's
    "HunYuanDenseV1ForCausalLM": HunyuanDenseCheckpoint,
    "HunYuanMoEV1ForCausalLM": HunyuanMoECheckpoint,
    "GraniteMoeForCausalLM": GraniteMoeCheckpoint,
    "GraniteMoeSharedForCausalLM": GraniteMoeCheckpoint,
    "GraniteMoeHybridForCausalLM": GraniteMoeCheckpoint,  # attention layers only
}
UNSUPPORTED = {
    "GemmaForCausalLM": "Gemma (1) is not supported",
}
"""Architectures refused with a reason of their own (others: a plain "unsupported")."""
_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "glm4_moe": "Glm4MoeForCausalLM",
    "glm": "GlmForCausalLM",
    "glm4": "Glm4ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "seed_oss": "SeedOssForCausalLM",
    "ernie4_5": "Ernie4_5ForCausalLM",
    "ernie4_5_moe": "Ernie4_5_MoeForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "gemma3": "Gemma3ForConditionalGeneration",
    "mistral3": "Mistral3ForConditionalGeneration",
    "ministral3": "Ministral3ForCausalLM",
    "qwen2_vl": "Qwen2VLForConditionalGeneration",
    "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration",
    "qwen3_vl": "Qwen3VLForConditionalGeneration",
    "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration",
    "gemma2": "Gemma2ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "olmo3": "Olmo3ForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "cohere2": "Cohere2ForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}


def read_config_json(path: str | Path) -> dict:
    """A checkpoint directory's config.json as a dict; ValueError saying what is wrong."""
    config_file = Path(path) / "config.json"
    try:
        raw = json.loads(config_file.read_text())
    except FileNotFoundError:
        raise ValueError(f"{config_file} is missing (not a Hugging Face checkpoint?)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{config_file} is not readable JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{config_file} is not a JSON object")
    return raw


def architecture_of(raw: dict) -> str:
    """The architecture a config.json names (``architectures[0]``, else its ``model_type``)."""
    archs = raw.get("architectures")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ValueError(f"architectures must be a list of class names; got {archs!r}")
    if archs:
        return archs[0]
    model_type = raw.get("model_type")
    return _MODEL_TYPES.get(model_type, f"model_type={model_type!r}") if isinstance(model_type, str) else f"model_type={model_type!r}"


def read_checkpoint_config(path: str | Path, *, sizes_only: bool = False) -> CheckpointConfig:
    """The checkpoint config of ``path``'s config.json alone (strictly validated); ValueError
    saying what is wrong. ``sizes_only`` (a simulated run): quantized checkpoints are read too."""
    raw = read_config_json(path)
    arch = architecture_of(raw)
    if arch not in ARCHITECTURES and _is_moe(raw, arch):
        moe_families = ("Mixtral", "Deepseek", "GptOss", "Llama4", "HunYuanMoE", "Olmoe")
        supported = [a for a in ARCHITECTURES if "Moe" in a or a.startswith(moe_families)]
        raise ValueError(
            f"unsupported architecture {arch}: a mixture-of-experts variant pcpflow does not route; "
            f"supported MoE checkpoints: {', '.join(supported)}"
        )
    if arch not in ARCHITECTURES:
        why = f": {UNSUPPORTED[arch]}" if arch in UNSUPPORTED else ""
        raise ValueError(f"unsupported architecture {arch}{why}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch].parse(raw, arch, allow_quantized=sizes_only)


def read_checkpoint(path: str | Path) -> CheckpointConfig:
    """The checkpoint config of the directory ``path``; ValueError saying what is wrong
    (no directory, no/invalid config.json, unsupported architecture or feature, no
    safetensors weights)."""
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"no checkpoint directory at {path}")
    checkpoint = read_checkpoint_config(path)
    checkpoint_files(path)  # raises if there are no weights
    return checkpoint


EMBEDDING, HEAD = "embed_tokens.weight", "lm_head.weight"  # pcpflow's names of the two


def stored_names(path: Path) -> list[str]:
    """The tensor names of the checkpoint at ``path``, from its safetensors headers."""
    return [k for f in checkpoint_files(path) for k in read_safetensors_header(f) if k != "__metadata__"]


def tying(checkpoint: CheckpointConfig, names: list[str]) -> tuple[bool, tuple[Rename, ...]]:
    """Whether the LM head shares the embedding, and the renames to load with, as
    transformers ties them under ``tie_word_embeddings``: a head stored beside the embedding
    is loaded as its own (transformers keeps a stored head that differs from the embedding;
    one equal to it computes the same), a head stored alone is the embedding too."""
    renames = checkpoint.renames
    stored = {r.ours: r.hf for r in renames}  # NOTE: a multimodal checkpoint's sit under language_model.
    head, embedding = stored[HEAD], stored[EMBEDDING]
    if not checkpoint.tie_word_embeddings or {head, embedding} <= set(names):
        return False, renames
    if head in names:
        return True, tuple(Rename(head, EMBEDDING) if r.hf == head else r for r in renames)
    return True, renames


def _is_moe(raw: dict, arch: str) -> bool:
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
    return "moe" in arch.lower() or "mixtral" in arch.lower() or any(raw.get(k) for k in keys)


class HFModel(DecoderLM):
    """A Llama-style (Llama, Mistral, Ministral 3, Qwen2/3, Phi-3, SmolLM3, Granite, Qwen2/3-MoE, Mixtral, GLM-4.5), Gemma 2/3,
    OLMo 2/3, OLMoE, Cohere 2, EXAONE 4, gpt-oss, Llama 4, Hunyuan, DeepSeek or Granite MoE / 4.0 model with the weights of
    a Hugging Face checkpoint."""

    class Config(Settings):
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
            read_checkpoint(path)
            return path

    def __init__(self, checkpoint: CheckpointConfig, *, tied: bool | None = None):
        c = checkpoint
        super().__init__(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            layers=c.build_layers(),
            attn_spec=c.attn_spec(),
            eps=c.rms_norm_eps,
            tie_word_embeddings=c.tie_word_embeddings if tied is None else tied,
            **c.lm_options(),
        )
        self.checkpoint = checkpoint

    @classmethod
    def from_config(
        cls, config: HFModel.Config, *, dtype: torch.dtype, seed: int, device="cpu"
    ) -> HFModel:
        """The checkpoint's model with its weights cast to ``dtype`` (``seed`` is unused); on
        ``meta``, its shapes only (no weights read)."""
        assert config.path is not None
        checkpoint = read_checkpoint(config.path)
        tied, renames = tying(checkpoint, stored_names(Path(config.path)))
        model = build_uninitialized(lambda: cls(checkpoint, tied=tied), device).to(dtype)
        if torch.device(device).type != "meta":
            load_checkpoint(model, Path(config.path), renames, num_layers=checkpoint.num_hidden_layers,
                            skip=checkpoint.skip)
        return model

    @classmethod
    def vocab_size_of(cls, config: HFModel.Config) -> int:
        try:
            return read_checkpoint(config.path or "").vocab_size
        except ValueError as exc:
            raise ConfigError([Problem("model.path", config.path, str(exc))]) from None


# ------------------------------------------------------------------------------ before a run
def checkpoint_problems(model_config: Any) -> list[Problem]:
    """A Hugging Face checkpoint's safetensors files are whole, are safetensors, and hold
    exactly the tensors (names and shapes) its config.json implies: all from the headers
    (a few kB each). Its generation settings (EOS ids, repetition penalty) are readable."""
    if getattr(model_config, "name", None) != "hf" or not model_config.path:
        return []
    from pcpflow.tokens.text import has_tokenizer

    missing = missing_extra(("safetensors", *(("transformers",) if has_tokenizer(model_config) else ())), "hf")
    if missing:
        return [Problem("model", "hf", f"a checkpoint needs {missing}")]

    path = Path(model_config.path)
    try:
        files = checkpoint_files(path)
    except (ValueError, OSError) as exc:
        return [Problem("model.path", str(path), str(exc))]
    problems, shapes, names = [], {}, []
    for f in files:
        try:
            header = read_safetensors_header(f)
        except ValueError as exc:
            problems.append(Problem("model.path", str(f), f"a whole safetensors file; {exc}"))
            continue
        shapes.update({k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"})
        names += [k for k in header if k != "__metadata__"]
    if problems:
        return problems
    from pcpflow.tokens.text import generation_problems

    return _tensor_problems(path, shapes, names) + generation_problems(model_config)


def length_problems(model_config: Any, longest: int) -> list[Problem]:
    """A checkpoint's limits against the run's longest request (``longest``: prompt plus
    output plus speculative tokens): LongRoPE, in executed runs (past its original length
    transformers ropes with other frequencies: ``CheckpointConfig.rope_limit``). A sliding
    window or Llama 4's attention chunks are no limit: executed runs attend through them
    (``AttentionSpec.window``, ``window_kind``), simulated ones price their layers by their own
    pairs (``ModelCard.sliding_window``, ``window_kind``)."""
    if getattr(model_config, "name", None) != "hf" or not model_config.path:
        return []
    path = model_config.path
    try:
        checkpoint = read_checkpoint_config(path, sizes_only=True)  # NOTE: config.json is all it reads
    except ValueError:
        return []  # the model's own validation reports it
    problems = []
    limit = checkpoint.rope_limit
    if limit is not None and longest > limit:
        problems.append(Problem("model.path", str(path), (
            f"requests within LongRoPE's original length: config.json's rope scaling is longrope with "
            f"original_max_position_embeddings={limit}, and the longest request reaches {longest} tokens; "
            f"past that length transformers ropes every position of a forward, the cached prompt's too, "
            f"with long_factor, which pcpflow does not (it ropes each position once, with short_factor): "
            f"requests of at most {limit} tokens (prompt + output + speculative tokens) run exactly"
        )))
    return problems


def _some(names: list[str], limit: int = 5) -> str:
    return ", ".join(names[:limit]) + (f" ... ({len(names)} in all)" if len(names) > limit else "")


def _tensor_problems(path: Path, shapes: dict[str, tuple[int, ...]], names: list[str]) -> list[Problem]:
    """Tensors the model needs and the checkpoint lacks, tensors with no place in the model
    (by the loader's rules: ``hf_weights.plan_names``), tensors stored twice, and tensors
    whose shape differs from the parameter config.json gives them."""
    try:
        checkpoint = read_checkpoint(path)
        tied, renames = tying(checkpoint, names)
        model = build_uninitialized(lambda: HFModel(checkpoint, tied=tied), "meta")
    except Exception:  # config.json problems are the model's own validation's to report
        return []
    params = {name: tuple(p.shape) for name, p in model.state_dict().items()}
    plan = plan_names(names, [n for n, _ in model.named_parameters()], renames,
                      num_layers=checkpoint.num_hidden_layers, skip=checkpoint.skip)
    problems = []
    if plan.unfilled:
        stored = {int(m.group(1)) for n in names if (m := re.search(r"(?:^|\.)(?:model|language_model)\.layers\.(\d+)\.", n))}
        hint = ""
        if len(stored) < checkpoint.num_hidden_layers:
            hint = f" (config.json says num_hidden_layers={checkpoint.num_hidden_layers}; the weights hold {len(stored)} layer(s))"
        problems.append(Problem("model.path", str(path), f"a checkpoint with every tensor config.json implies; "
                                f"{len(plan.unfilled)} missing: {_some(plan.unfilled)}{hint}"))
    if plan.unknown:
        problems.append(Problem("model.path", str(path), f"only tensors the model has a place for; "
                                f"{len(plan.unknown)} have none: {_some(plan.unknown)}"))
    if plan.twice:
        problems.append(Problem("model.path", str(path), f"each tensor stored once; "
                                f"{len(plan.twice)} stored more than once: {_some(plan.twice)}"))
    for base, (blocks, scales) in plan.mxfp4.items():  # NOTE: an MXFP4 pair is checked as its dense tensor
        if len(shapes[blocks]) != 4 or shapes[scales] != shapes[blocks][:-1]:
            problems.append(Problem("model.path", str(path), f"MXFP4 {blocks} {list(shapes[blocks])} and {scales} "
                                    f"{list(shapes[scales])}: want blocks [E, rows, G, B] and scales [E, rows, G]"))
        else:
            shapes[base] = mxfp4_dense_shape(shapes[blocks])
    for hf_name, targets in plan.targets.items():
        shapes_of = [params.get(name) for name, _ in targets]
        shape = shapes.get(hf_name)
        if None in shapes_of or shape is None:
            continue
        want = plan.rules[hf_name].read_as(tuple(shape), shapes_of).checkpoint_shape(shapes_of)
        if tuple(shape) != want:
            problems.append(Problem("model.path", str(path), f"tensor {hf_name} has shape {list(shape)}; config.json implies {list(want)}"))
    return problems[:10]
