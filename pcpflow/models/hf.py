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
with a shared expert); LayerNorm families (``hf_layernorm``: StarCoder2's ``Starcoder2ForCausalLM``, an MLP
without a gate and every bias, every layer sliding; Phi's ``PhiForCausalLM``, parallel layers, partial RoPE, an
LM head with a bias; ``StableLmForCausalLM``; Nemotron's ``NemotronForCausalLM``, LayerNorm1P and squared
ReLU; ``GPTNeoXForCausalLM``, parallel layers on two LayerNorms, q/k/v fused a head at a time; ``GPTJForCausalLM``);
``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM``, dense or with MoE layers
(``hf_deepseek``); IBM's ``GraniteMoeForCausalLM``, ``GraniteMoeSharedForCausalLM`` and Granite 4.0's
``GraniteMoeHybridForCausalLM`` with attention layers only (``hf_granite``: Granite's multipliers, top-k
experts weighted by a softmax over the k, a shared MLP; a hybrid's Mamba2 layers are refused, naming
them). The config is checked when the run config is validated — an unsupported
architecture (other MoE families such as Phi-3.5-MoE are named as such; a feature a family does not
compute, such as Phi's ``qk_layernorm``, by its field), a quantized checkpoint, a missing directory or weights are
configuration errors (exit 2, no rank started; gpt-oss's MXFP4 experts are read, widened to the run's dtype); so is, in an executed run, a request past
LongRoPE's original length (``length_problems``). A sliding window (Mistral's
``sliding_window``, Qwen's ``use_sliding_window``, Gemma's sliding layers) is executed:
``AttentionSpec.window``, and so are Llama 4's attention chunks (``window_kind: chunked``).
The weights are cast to the run's ``dtype``; only ``safetensors`` is needed to load them.
A simulated run reads the same architectures' sizes (quantized ones too) and prices full
attention.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch

from pcpflow.errors import Problem, missing_extra
from pcpflow.models.common import DecoderLM, build_uninitialized
from pcpflow.models.config import HFConfig
from pcpflow.models.hf_checkpoint import CheckpointConfig
from pcpflow.models.hf_registry import read_checkpoint, read_checkpoint_config
from pcpflow.models.hf_weights import (
    Rename,
    checkpoint_files,
    load_checkpoint,
    plan_names,
    read_safetensors_header,
)
from pcpflow.models.mxfp4 import dense_shape as mxfp4_dense_shape

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


class HFModel(DecoderLM):
    """A Llama-style (Llama, Mistral, Ministral 3, Qwen2/3, Phi-3, SmolLM3, Granite, Qwen2/3-MoE, Mixtral, GLM-4.5), Gemma
    1/2/3, OLMo 2/3, OLMoE, Cohere 1/2, EXAONE 4, gpt-oss, Llama 4, Hunyuan, StarCoder2, Phi, StableLM, Nemotron, GPT-NeoX,
    GPT-J, DeepSeek or Granite MoE / 4.0 model with the weights of a Hugging Face checkpoint."""

    Config = HFConfig

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
