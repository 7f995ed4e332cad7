"""Which ``CheckpointConfig`` reads a Hugging Face checkpoint's ``config.json``: the supported
architectures by name (``ARCHITECTURES``), and ``read_checkpoint``, which the ``model=hf``
config's validation calls (``pcpflow.models.config``) and ``HFModel`` builds from."""

from __future__ import annotations

import json
from pathlib import Path

from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_cohere import Cohere2Checkpoint, CohereCheckpoint
from pcpflow.models.hf_deepseek import DeepseekCheckpoint
from pcpflow.models.hf_exaone import Exaone4Checkpoint
from pcpflow.models.hf_gemma import (
    Gemma2Checkpoint,
    Gemma3Checkpoint,
    Gemma3MultimodalCheckpoint,
    GemmaCheckpoint,
)
from pcpflow.models.hf_gptoss import GptOssCheckpoint
from pcpflow.models.hf_granite import GraniteMoeCheckpoint
from pcpflow.models.hf_hunyuan import HunyuanDenseCheckpoint, HunyuanMoECheckpoint
from pcpflow.models.hf_layernorm import (
    GPTJCheckpoint,
    GPTNeoXCheckpoint,
    NemotronCheckpoint,
    PhiCheckpoint,
    StableLmCheckpoint,
    Starcoder2Checkpoint,
)
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
from pcpflow.models.hf_weights import checkpoint_files

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
    "GemmaForCausalLM": GemmaCheckpoint,
    "Olmo2ForCausalLM": Olmo2Checkpoint,
    "Olmo3ForCausalLM": Olmo3Checkpoint,
    "OlmoeForCausalLM": OlmoeCheckpoint,
    "Cohere2ForCausalLM": Cohere2Checkpoint,
    "CohereForCausalLM": CohereCheckpoint,
    "Exaone4ForCausalLM": Exaone4Checkpoint,
    "GptOssForCausalLM": GptOssCheckpoint,
    "Llama4ForCausalLM": Llama4Checkpoint,
    "Llama4ForConditionalGeneration": Llama4MultimodalCheckpoint,  # its language model, as Gemma 3's
    "HunYuanDenseV1ForCausalLM": HunyuanDenseCheckpoint,
    "HunYuanMoEV1ForCausalLM": HunyuanMoECheckpoint,
    "GraniteMoeForCausalLM": GraniteMoeCheckpoint,
    "GraniteMoeSharedForCausalLM": GraniteMoeCheckpoint,
    "GraniteMoeHybridForCausalLM": GraniteMoeCheckpoint,  # attention layers only
    "Starcoder2ForCausalLM": Starcoder2Checkpoint,
    "PhiForCausalLM": PhiCheckpoint,
    "StableLmForCausalLM": StableLmCheckpoint,
    "NemotronForCausalLM": NemotronCheckpoint,
    "GPTNeoXForCausalLM": GPTNeoXCheckpoint,
    "GPTJForCausalLM": GPTJCheckpoint,
}
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
    "cohere": "CohereForCausalLM",
    "exaone4": "Exaone4ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
    "llama4_text": "Llama4ForCausalLM",
    "llama4": "Llama4ForConditionalGeneration",
    "hunyuan_v1_dense": "HunYuanDenseV1ForCausalLM",
    "hunyuan_v1_moe": "HunYuanMoEV1ForCausalLM",
    "granitemoe": "GraniteMoeForCausalLM",
    "granitemoeshared": "GraniteMoeSharedForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "starcoder2": "Starcoder2ForCausalLM",
    "phi": "PhiForCausalLM",
    "stablelm": "StableLmForCausalLM",
    "nemotron": "NemotronForCausalLM",
    "gpt_neox": "GPTNeoXForCausalLM",
    "gptj": "GPTJForCausalLM",
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
        raise ValueError(f"unsupported architecture {arch}; supported: {', '.join(ARCHITECTURES)}")
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


def _is_moe(raw: dict, arch: str) -> bool:
    keys = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
    return "moe" in arch.lower() or "mixtral" in arch.lower() or any(raw.get(k) for k in keys)
