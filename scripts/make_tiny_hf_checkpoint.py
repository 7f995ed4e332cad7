"""Build a tiny random-weight Hugging Face checkpoint with transformers' own classes, offline.

The checkpoint is a normal ``save_pretrained`` directory (config.json + safetensors, sharded
with an index when ``--max-shard-size`` is small), so it exercises exactly the loading
path a real Llama / Qwen / Mistral / DeepSeek checkpoint takes::

    python scripts/make_tiny_hf_checkpoint.py --arch llama --out /tmp/tiny-llama
    python scripts/make_tiny_hf_checkpoint.py --arch qwen2 --tie-word-embeddings --out /tmp/tiny-qwen2
    python scripts/make_tiny_hf_checkpoint.py --arch qwen3 --out /tmp/tiny-qwen3
    python scripts/make_tiny_hf_checkpoint.py --arch mistral --sliding-window 4096 --out /tmp/tiny-mistral
    python scripts/make_tiny_hf_checkpoint.py --arch deepseek_v3 --out /tmp/tiny-dsv3
    python scripts/make_tiny_hf_checkpoint.py --arch deepseek_v2 --q-lora-rank none \
        --out /tmp/tiny-dsv2
    python scripts/make_tiny_hf_checkpoint.py --arch deepseek_v3 --moe --out /tmp/tiny-dsv3-moe
    python -m pcpflow model=hf model.path=/tmp/tiny-dsv3 pcp=2 dcp=2

The GQA families differ as transformers builds them: Qwen2 always has q/k/v biases (never
o or MLP ones), Qwen3 has per-head q/k RMSNorms and ``head_dim=24`` != hidden/heads (16),
``--bias`` gives Llama attention and MLP biases and Qwen3 q/k/v/o ones (Mistral has none).
``--sliding-window N`` (Mistral, Phi-3; Qwen with ``use_sliding_window``) writes a sliding window;
without it there is none (``sliding_window`` null). Phi-3 stores q/k/v as one ``qkv_proj`` and
gate/up as one ``gate_up_proj``, ropes 3/4 of each head and has LongRoPE (original length 128).

``gemma3`` (``Gemma3ForCausalLM``) is hidden 80 (its square root, the embedding scale, is not a
float32 number), ``head_dim=24``, ``query_pre_attn_scalar=20`` (tied embeddings, as the released ones, with ``--tie-word-embeddings``),
even layers sliding (over ``--sliding-window``, else transformers' 4096; RoPE base 1e4) and
odd ones full (base 1e6, linear x8 unless ``--rope-scaling`` says otherwise)::

    python scripts/make_tiny_hf_checkpoint.py --arch gemma3 --tie-word-embeddings --out /tmp/tiny-gemma3

``smollm3`` has no RoPE on its second layer (``no_rope_layer_interval=2``); ``granite`` has
each of Granite's multipliers away from one (embedding 2, residual 0.5, softmax scale 0.2,
logits divided by 2.5).

``granitemoe`` (``GraniteMoeForCausalLM``) has ``granite``'s multipliers and every layer
mixture-of-experts: 8 experts 32 wide, 2 per token (the top-2 router logits, weighted by a softmax
over those two), stored fused (``input_linear``, ``output_linear``); ``granitemoeshared`` adds a
shared MLP 64 wide beside the experts. ``granite4`` is Granite 4.0's ``GraniteMoeHybridForCausalLM``
with attention layers only (``layer_types`` all ``attention``, RoPE), the same experts and shared
MLP; ``granite4_dense`` has no experts (its shared MLP, 128 wide, is each layer's MLP, as
granite-4.0-micro) and no position embedding (``position_embedding_type: nope``)::

    python scripts/make_tiny_hf_checkpoint.py --arch granite4 --out /tmp/tiny-granite4

``gemma3_mm`` is ``gemma3``'s language model inside a multimodal ``Gemma3ForConditionalGeneration``
(a one-layer SigLIP vision tower and its projector beside it, the text tensors under
``language_model.``), as gemma-3-4b/12b/27b are stored.

``qwen2_5_vl`` is ``qwen2``'s language model inside ``Qwen2_5_VLForConditionalGeneration`` (M-RoPE
sections 2/3/3, a one-block vision tower beside it).

``qwen3_vl`` is a Qwen3 language model inside ``Qwen3VLForConditionalGeneration`` (q/k norms,
``head_dim=24`` != hidden/heads, interleaved M-RoPE sections 4/4/4 of its 12 frequencies, a
one-block vision tower with a DeepStack merger beside it, the text tensors under
``model.language_model.``; tied with ``--tie-word-embeddings``, as the 2B and 4B are).
``qwen3_vl_moe`` is ``Qwen3VLMoeForConditionalGeneration``: every layer mixture-of-experts, 8
experts 24 wide (so that no fused tensor is square), top-2 of a softmax router, always
renormalised; the fused experts written transposed, ``[E, hidden, 2I]`` and ``[E, I, hidden]``,
as the released checkpoints store them (transformers 5's ``save_pretrained`` writes
``[E, 2I, hidden]``; it reads both)::

    python scripts/make_tiny_hf_checkpoint.py --arch qwen3_vl_moe --out /tmp/tiny-qwen3-vl-moe

``mistral3`` is ``mistral``'s language model inside ``Mistral3ForConditionalGeneration`` (a
one-layer Pixtral beside it), as Mistral Small 3.1 / 3.2 are stored.

``ministral3`` (``Ministral3ForCausalLM``) is Ministral 3's: Mistral's layers, YaRN x4 over an original
length of 32 with ``mscale != mscale_all_dim`` (a fractional ramp, cos/sin x1.025) and, after RoPE, each
query scaled by ``1 + 0.5 * ln(1 + floor(p / 32))`` (``llama_4_scaling_beta=0.5``, so that the scale
changes at positions 32 and 64 of the test prompts). ``ministral3_mm`` is that language model inside
``Mistral3ForConditionalGeneration`` (a one-layer Pixtral beside it), as Ministral 3 3B/8B/14B are stored::

    python scripts/make_tiny_hf_checkpoint.py --arch ministral3_mm --tie-word-embeddings --out /tmp/tiny-ministral3

``cohere2`` has parallel blocks (attention and MLP on one centered norm), its even layers sliding
with interleaved RoPE and its odd ones full without position embedding, logits times 0.75;
``cohere`` (Cohere 1) the same blocks, every layer full with interleaved RoPE.

``starcoder2``, ``phi`` and ``stablelm`` have LayerNorms with biases: StarCoder2 an MLP without a gate
and every bias (every layer sliding when given ``--sliding-window``), Phi parallel layers, RoPE on 12 of
16 dims, ``gelu_new`` and an LM head with a bias, StableLM SwiGLU, q/k/v biases and RoPE on 4 of 16 dims;
``nemotron`` LayerNorm1P (scaled by ``1 + weight``), squared ReLU without a gate, head 24, RoPE on 12 dims;
``gpt_neox`` parallel layers on two LayerNorms, q/k/v fused a head at a time, RoPE on half a head;
``gptj`` parallel layers on one LayerNorm, RoPE on adjacent pairs of half a head, an LM head with a bias.

``ernie4_5`` has every bias (``use_bias``) and RoPE on adjacent pairs, head 24.

``ernie4_5_moe`` (``Ernie4_5_MoeForCausalLM``) is ERNIE 4.5's layers without biases, layer 0 dense and the
others MoE: top-2 of 8 experts chosen on the softmax plus a nonzero selection bias (``moe_statics``),
renormalised by ``max(sum, moe_norm_min=0.3)`` (the clamp bites), two shared experts.

``seed_oss`` has q/k/v biases (its default) and an o bias (``attention_out_bias``), head 24.

``exaone4`` is post-norm with per-head q/k norms, its even layers sliding (RoPE, llama3 scaling)
and its odd ones full without position embedding.

``olmo2`` and ``olmo3`` are post-norm layers with q and k normed over the whole projection
(OLMo 3: its even layers sliding, YaRN on the odd, full ones).

``olmoe`` (``OlmoeForCausalLM``) is pre-norm with q and k normed over the whole projection,
``clip_qkv=1.5`` (q, k and v clamped: about one entry in seven), every layer
mixture-of-experts: 8 experts 32 wide, top-2 of the softmax over all 8, not renormalised (as the
released ``norm_topk_prob: false``), stored one tensor per expert (``save_pretrained``)::

    python scripts/make_tiny_hf_checkpoint.py --arch olmoe --out /tmp/tiny-olmoe

``gemma2`` is ``gemma3``'s sizes without q/k norms, one RoPE (base 1e4), the even layers
sliding, attention scores soft-capped at 4 and logits at 5 (so that both caps bite).
``gemma`` (Gemma 1) is the same sizes in pre-norm layers, every layer full, nothing capped,
``hidden_act: gelu`` as released (transformers reads it as the tanh approximation).

``qwen2_moe``, ``qwen3_moe``, ``mixtral`` and ``glm4_moe`` are mixture-of-experts always, 8 experts,
2 per token: Qwen2-MoE as Qwen3-MoE's routing below (with Qwen2's attention) plus a shared expert
64 wide behind its sigmoid gate, Qwen3-MoE with softmax routing and ``decoder_sparse_step=2`` (layer 0 dense, layer 1
MoE, experts 32 wide, top-2 weights not renormalised), Mixtral every layer MoE (softmax,
experts as wide as ``intermediate_size``, renormalised), GLM-4.5 layer 0 dense and layer 1
routed as DeepSeek-V3 (sigmoid scores, a random selection bias, 4 groups of which 2, a shared
expert, scaling 2.5), with q/k norms, q/k/v biases under ``--bias`` and RoPE on half a head::

    python scripts/make_tiny_hf_checkpoint.py --arch qwen3_moe --out /tmp/tiny-qwen3-moe

``gpt_oss`` is every layer mixture-of-experts (8 experts 32 wide, 2 per token, chosen on the
router's biased logits), experts with biases and gpt-oss's clamped SwiGLU (``swiglu_limit=1``, so
that the clamps bite), attention biases and a sink per head, the even layers sliding, YaRN with
its correction range not rounded (``truncate: false``).

``llama4`` (``Llama4ForCausalLM``) has 4 layers: layers 0-2 rotate (RoPE on adjacent pairs, llama3
scaling), attend within chunks of ``--chunk`` keys (``attention_chunk_size``; transformers' 8192
without it) and L2-norm q and k after RoPE (``use_qk_norm``); layer 3 has no position embedding and
its q scaled by the attention temperature (``floor_scale=4``, ``attn_scale=0.1``, so that it bites
at test lengths). Layers 1 and 3 are mixture-of-experts (``interleave_moe_layer_step=2``: 8 experts
32 wide, top-1, each expert's input scaled by the sigmoid of its router logit, plus a shared expert
32 wide), layers 0 and 2 dense MLPs 128 wide (``intermediate_size_mlp``). ``llama4_mm`` is that
language model inside ``Llama4ForConditionalGeneration`` (a one-layer vision model and its projector
beside it, the text tensors under ``language_model.``), as the released Scout and Maverick are stored::

    python scripts/make_tiny_hf_checkpoint.py --arch llama4 --chunk 7 --out /tmp/tiny-llama4

``hunyuan`` (``HunYuanDenseV1ForCausalLM``) has ``head_dim=24`` != hidden/heads, a per-head RMSNorm of
q and k after RoPE, and RoPE's base stretched by a fixed NTK alpha of 50 (``rope_scaling`` of type
``dynamic`` with an ``alpha``, as the released configs write it; ``--bias``: q/k/v/o biases).
``hunyuan_moe`` (``HunYuanMoEV1ForCausalLM``) has the same attention and every layer
mixture-of-experts: 8 experts 32 wide, top-2 (``moe_topk`` one per layer, as released) of a float32
softmax router, renormalised, plus a shared expert 32 wide::

    python scripts/make_tiny_hf_checkpoint.py --arch hunyuan --out /tmp/tiny-hunyuan

``glm`` (``GlmForCausalLM``) has q/k/v biases (its default), gate and up in one ``gate_up_proj`` and RoPE on
adjacent pairs of the first 12 of 16 dims (``partial_rotary_factor=0.75``); ``glm4`` (``Glm4ForCausalLM``) has
GLM's with ``head_dim=24`` != hidden/heads, RoPE on its first 12 (the default factor 0.5) and each block's
output normed before it is added (``post_self_attn_layernorm``, ``post_mlp_layernorm``)::

    python scripts/make_tiny_hf_checkpoint.py --arch glm4 --out /tmp/tiny-glm4

``--moe`` (DeepSeek only): layer 0 dense, the others mixture-of-experts — 8 routed experts
in 4 groups, 2 groups and 2 experts per token, one shared expert; V3 with sigmoid scores,
a random ``e_score_correction_bias`` (``N(0, 0.1^2)``, so that it changes which experts
win) and ``routed_scaling_factor=2.5``; V2 with softmax ``group_limited_greedy``. Expert
weights are ``N(0, 1/fan_in)`` as every linear weight.

Weights are drawn from ``torch.Generator(seed)``: linear weights ``N(0, 1/fan_in)``, the LM
head ``N(0, 4/hidden)`` (logits of standard deviation ~2), embeddings ``N(0, 1)`` (tied:
``N(0, 4/hidden)``, as the head), biases ``N(0, 0.1^2)``, gpt-oss's attention sinks ``N(0, 1)``, and every norm weight
``1 + N(0, 0.2^2)`` (Gemma's stored offsets ``N(0, 0.2^2)``: the same norms) — not transformers' ``std=0.02`` init, whose logits are nearly flat
(greedy decoding would then hinge on rounding). Logits of a few units keep float32
rounding near 1e-6 while top-2 gaps stay far above it. Norm weights that are not all one
make a swapped or missing norm in a loader show up in the logits.

The sizes and rope settings are chosen so that the rope scalings bite at test lengths:
llama3 with ``original_max_position_embeddings=64`` puts rope frequencies on both sides of
and inside its smoothing band; YaRN with ``original_max_position_embeddings=64``,
``factor=4`` and ``mscale != mscale_all_dim`` has a fractional ramp, a cos/sin attention
factor != 1 and a softmax mscale != 1. Without ``--tokenizer`` the checkpoints have no
EOS token: pcpflow generates a request's full output length, and so must the reference.

``--tokenizer`` adds a real tokenizer: a byte-level BPE trained offline with the
``tokenizers`` library on ``PARAGRAPH`` (special tokens ``<s>``, ``</s>``, ``<|im_start|>``,
``<|im_end|>``; the tokenizer adds ``<s>`` to plain text), saved beside the weights with a
ChatML chat template, the model's vocabulary sized to it, and ``generation_config.json``
naming the EOS ids (``--eos-token-id``, default ``<|im_end|>`` and ``</s>``)::

    python scripts/make_tiny_hf_checkpoint.py --arch llama --tokenizer --out /tmp/tiny-llama-tok
    python -m pcpflow model=hf model.path=/tmp/tiny-llama-tok workload=explicit \
        'workload.texts=["The capital of France is"]'
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

ARCHS = ("llama", "qwen2", "qwen3", "mistral", "phi3", "smollm3", "granite", "granitemoe", "granitemoeshared",
         "granite4", "granite4_dense", "qwen2_moe", "qwen3_moe", "mixtral",
         "glm4_moe", "gemma3", "gemma3_mm", "mistral3", "ministral3", "ministral3_mm", "gemma2", "gemma", "olmo2", "olmo3", "olmoe", "cohere2", "cohere", "seed_oss", "ernie4_5", "ernie4_5_moe", "exaone4", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "gpt_oss", "llama4", "llama4_mm", "hunyuan", "hunyuan_moe", "deepseek_v3", "deepseek_v2", "glm", "glm4", "starcoder2", "phi", "stablelm", "nemotron", "gpt_neox", "gptj")
GQA_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "ministral3": ("Ministral3Config", "Ministral3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM"),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM"),
    "granite4": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "granite4_dense": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM"),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM"),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM"),
    "cohere": ("CohereConfig", "CohereForCausalLM"),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM"),
    "ernie4_5": ("Ernie4_5Config", "Ernie4_5ForCausalLM"),
    "glm": ("GlmConfig", "GlmForCausalLM"),
    "glm4": ("Glm4Config", "Glm4ForCausalLM"),
    "ernie4_5_moe": ("Ernie4_5_MoeConfig", "Ernie4_5_MoeForCausalLM"),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM"),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM"),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM"),
    "hunyuan": ("HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM"),
    "hunyuan_moe": ("HunYuanMoEV1Config", "HunYuanMoEV1ForCausalLM"),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    "nemotron": ("NemotronConfig", "NemotronForCausalLM"),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "gptj": ("GPTJConfig", "GPTJForCausalLM"),
}

ROPE_SCALINGS = {
    "none": None,
    "linear": {"rope_type": "linear", "factor": 8.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
    },
    # NOTE: gpt-oss's: the correction range not rounded outwards, the attention factor YaRN's default
    "yarn_untruncated": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "truncate": False,
    },
    # NOTE: Ministral 3's (YaRN with DeepSeek's mscale pair; its query scaling's beta beside them, over the
    # original length): a ramp 0, 0.5, 1 over the 8 frequencies of a 16-dim head
    "ministral3": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 0.8,
        "llama_4_scaling_beta": 0.5,
    },
    # NOTE: Hunyuan's, as its released configs write it: a fixed NTK alpha (theta x 50^(d / (d - 2)))
    "ntk_alpha": {"type": "dynamic", "alpha": 50.0, "factor": 1.0},
    # NOTE: Phi-3's: 6 frequencies (head 16, RoPE on 3/4 of it); short factors used up to the
    # original length, 128, with factor 256/128 = 2 (cos/sin x sqrt(1 + ln 2 / ln 128))
    "longrope": {
        "rope_type": "longrope",
        "short_factor": [1.0, 1.25, 1.5, 2.0, 3.0, 5.0],
        "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0],
    },
}

DEFAULT_ROPE_SCALING = {
    "llama": "llama3",
    "qwen2": "yarn",
    "qwen3": "none",
    "mistral": "none",
    "phi3": "longrope",
    "smollm3": "none",
    "granite": "none",
    "granitemoe": "none",
    "granitemoeshared": "none",
    "granite4": "none",
    "granite4_dense": "none",
    "qwen2_moe": "none",
    "qwen3_moe": "none",
    "mixtral": "none",
    "glm4_moe": "none",
    "gemma3": "linear",
    "gemma3_mm": "linear",
    "mistral3": "none",
    "ministral3": "ministral3",
    "ministral3_mm": "ministral3",
    "qwen2_5_vl": "none",
    "qwen3_vl": "none",
    "qwen3_vl_moe": "none",
    "gemma2": "none",
    "gemma": "none",
    "olmo2": "none",
    "olmo3": "yarn",
    "olmoe": "none",
    "cohere2": "none",
    "cohere": "none",
    "seed_oss": "none",
    "ernie4_5": "none",
    "ernie4_5_moe": "none",
    "exaone4": "llama3",
    "gpt_oss": "yarn_untruncated",
    "llama4": "llama3",
    "llama4_mm": "llama3",
    "hunyuan": "ntk_alpha",
    "hunyuan_moe": "ntk_alpha",
    "deepseek_v3": "yarn",
    "deepseek_v2": "yarn",
    "glm": "none",
    "glm4": "none",
    "starcoder2": "none",
    "phi": "none",
    "stablelm": "none",
    "nemotron": "none",
    "gpt_neox": "none",
    "gptj": "none",
}


def tiny_config(
    arch: str,
    *,
    q_lora_rank: int | None = 48,
    rope_scaling: str | None = None,
    tie_word_embeddings: bool = False,
    bias: bool = False,
    rope_interleave: bool = True,
    vocab_size: int = 384,
    num_layers: int = 2,
    moe: bool = False,
    sliding_window: int | None = None,
    chunk: int | None = None,
):
    """The transformers config of a tiny ``arch`` model (``rope_scaling`` None: the arch's
    default, see ``DEFAULT_ROPE_SCALING``; ``chunk``: Llama 4's ``attention_chunk_size``)."""
    import transformers

    scaling = ROPE_SCALINGS[rope_scaling or DEFAULT_ROPE_SCALING[arch]]
    common = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=dict(scaling) if scaling else None,
        tie_word_embeddings=tie_word_embeddings,
        attention_bias=bias,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    if arch in GQA_ARCHS:
        # NOTE: each multiplier away from 1 and the softmax scale away from 1/sqrt(head_dim) = 0.25
        granite_multipliers = dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                                   logits_scaling=2.5)
        granite_moe = dict(num_local_experts=8, num_experts_per_tok=2)
        family = dict(
            llama=dict(head_dim=16, mlp_bias=bias),
            qwen2=dict(use_sliding_window=sliding_window is not None, sliding_window=sliding_window, max_window_layers=0),
            qwen3=dict(head_dim=24, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                       max_window_layers=0),
            mistral=dict(head_dim=16, sliding_window=sliding_window),
            ministral3=dict(head_dim=16, sliding_window=sliding_window),
            # NOTE: q/k/v in one qkv_proj, gate/up in one gate_up_proj; RoPE on 12 of 16 dims
            phi3=dict(sliding_window=sliding_window, partial_rotary_factor=0.75, original_max_position_embeddings=128),
            # NOTE: layer 1 of 2 without RoPE (no_rope_layer_interval=2)
            smollm3=dict(no_rope_layer_interval=2, mlp_bias=bias, use_sliding_window=False),
            granite=dict(granite_multipliers, mlp_bias=bias),
            # NOTE: every layer MoE, 8 experts 32 wide (intermediate_size), top-2; a shared MLP two experts wide
            granitemoe=dict(granite_multipliers, **granite_moe),
            granitemoeshared=dict(granite_multipliers, **granite_moe, shared_intermediate_size=64),
            # NOTE: attention layers only (the transformers 4 spelling, as the released config.json files)
            granite4=dict(granite_multipliers, **granite_moe, shared_intermediate_size=64,
                          layer_types=["attention"] * num_layers, position_embedding_type="rope"),
            granite4_dense=dict(granite_multipliers, num_local_experts=0, shared_intermediate_size=128,
                                layer_types=["attention"] * num_layers, position_embedding_type="nope"),
            # NOTE: Qwen2-MoE: a gated shared expert two experts wide; layer 0 dense (decoder_sparse_step=2)
            qwen2_moe=dict(use_sliding_window=False, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                           shared_expert_intermediate_size=64, norm_topk_prob=False, decoder_sparse_step=2),
            # NOTE: decoder_sparse_step=2: layer 0 dense, layer 1 MoE; the top-k weights not renormalised
            qwen3_moe=dict(head_dim=24, use_sliding_window=sliding_window is not None, sliding_window=sliding_window,
                           num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                           decoder_sparse_step=2),
            mixtral=dict(head_dim=16, sliding_window=sliding_window, num_local_experts=8, num_experts_per_tok=2),
            # NOTE: layer 0 dense, layer 1 MoE routed as DeepSeek-V3 (groups, bias, scaling); RoPE on half a head
            glm4_moe=dict(head_dim=16, partial_rotary_factor=0.5, use_qk_norm=True, n_routed_experts=8,
                          num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, n_group=4, topk_group=2,
                          first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True),
            # NOTE: head_dim 24 != hidden/heads, a softmax scale of its own (query_pre_attn_scalar);
            # even layers slide (RoPE base 1e4), odd ones are full (base 1e6, the rope scaling)
            gemma3=dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=sliding_window or 4096,
                        layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)],
                        rope_local_base_freq=10000.0),
            # NOTE: Gemma 2: even layers slide; caps that bite on scores and logits of a few units
            gemma2=dict(head_dim=24, query_pre_attn_scalar=20, sliding_window=sliding_window or 4096,
                        attn_logit_softcapping=4.0, final_logit_softcapping=5.0),
            # NOTE: Gemma 1: head_dim 24 != hidden/heads (the softmax scale is its own), the released "gelu"
            gemma=dict(head_dim=24, hidden_act="gelu"),
            olmo2=dict(),
            # NOTE: layers 0 and 1 slide, the others are full (YaRN on them alone); 4 layers
            olmo3=dict(sliding_window=sliding_window or 4096,
                       layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]),
            # NOTE: every layer MoE (8 experts 32 wide, top-2 of a softmax over all 8, not renormalised); a clip
            # of q, k and v that bites on entries of about unit scale
            olmoe=dict(num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, clip_qkv=1.5),
            # NOTE: even layers slide (interleaved RoPE), odd ones are full (NoPE); a logit scale that
            # keeps the logits decisive (the released 0.0625-0.25 would flatten random ones)
            # NOTE: q/k/v biases (attention_bias, its default) and o's own (attention_out_bias, set here)
            seed_oss=dict(head_dim=24, attention_out_bias=True, mlp_bias=bias),
            # NOTE: every bias (use_bias), RoPE on adjacent pairs; tied as its released 0.3B
            ernie4_5=dict(head_dim=24, use_bias=True),
            # NOTE: RoPE on adjacent pairs of the first 12 of 16 dims; q/k/v biases (attention_bias, its default)
            glm=dict(head_dim=16, partial_rotary_factor=0.75),
            # NOTE: GLM's, head_dim 24 != hidden/heads, RoPE on 12 of them (the default 0.5), sandwich norms
            glm4=dict(head_dim=24),
            # NOTE: layer 0 dense, the others MoE (8 experts 32 wide, top-2 chosen on the softmax plus a selection
            # bias N(0, 0.1^2) that changes the choice, two shared experts); moe_norm_min 0.3 so that the clamp of
            # the renormalisation bites on rows whose two weights sum below it (released: 1e-12)
            ernie4_5_moe=dict(head_dim=24, use_bias=False, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
                              moe_num_shared_experts=2, moe_layer_start_index=1, moe_norm_min=0.3),
            # NOTE: the even layers slide and rotate, the odd ones are full and NoPE (its "LLLG", in two)
            exaone4=dict(sliding_window=sliding_window or 4096, sliding_window_pattern="LG",
                         layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]),
            # NOTE: Cohere 1: every layer full and rotated (interleaved pairs); the logit scale as Cohere 2's
            cohere=dict(logit_scale=0.75, layer_norm_eps=1e-5),
            cohere2=dict(sliding_window=sliding_window or 4096, logit_scale=0.75, layer_norm_eps=1e-5,
                         layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]),
            # NOTE: every layer MoE (8 experts 32 wide, top-2 on the router's biased logits), sinks on
            # every head, even layers sliding; swiglu_limit 1.0 so that the clamps bite on activations of a few units
            gpt_oss=dict(head_dim=16, sliding_window=sliding_window or 4096, num_local_experts=8, num_experts_per_tok=2,
                         swiglu_limit=1.0,
                         layer_types=[("sliding_attention", "full_attention")[i % 2] for i in range(num_layers)]),
            # NOTE: layer 3 NoPE (no_rope_layer_interval=4) with a temperature that bites past position 3;
            # layers 1 and 3 MoE (8 experts 32 wide, top-1, a shared expert), 0 and 2 dense (128 wide)
            llama4=dict(head_dim=16, intermediate_size_mlp=128, num_local_experts=8, num_experts_per_tok=1,
                        interleave_moe_layer_step=2, no_rope_layer_interval=4, use_qk_norm=True,
                        attn_temperature_tuning=True, floor_scale=4, attn_scale=0.1,
                        **({"attention_chunk_size": chunk} if chunk is not None else {})),
            # NOTE: head_dim 24 != hidden/heads; q/k norms after RoPE (always); every layer MoE (8 experts
            # 32 wide, 2 per token, given per layer as the released list, and a shared expert as wide)
            hunyuan=dict(head_dim=24),
            hunyuan_moe=dict(head_dim=24, num_experts=8, moe_topk=[2] * num_layers),
            # NOTE: LayerNorms with biases, an MLP without a gate (GELU, tanh-approximated), every bias; every
            # layer sliding when given a window
            starcoder2=dict(norm_epsilon=1e-5, use_bias=True, sliding_window=sliding_window),
            # NOTE: parallel layers on one LayerNorm, RoPE on 12 of 16 dims, gelu_new, an LM head with a bias
            phi=dict(layer_norm_eps=1e-5, partial_rotary_factor=0.75),
            # NOTE: LayerNorms with biases, SwiGLU, q/k/v biases, RoPE on 4 of 16 dims (its released 0.25)
            stablelm=dict(layer_norm_eps=1e-5, use_qkv_bias=True),
            # NOTE: LayerNorm1P (1 + weight, a bias), relu2 without a gate, head_dim 24 != hidden/heads, RoPE on 12
            nemotron=dict(norm_eps=1e-5, head_dim=24, mlp_bias=bias),
            # NOTE: parallel layers, each block on its own LayerNorm; q/k/v fused a head at a time; RoPE on half a head
            # (its older rotary_pct / rotary_emb_base, as Pythia's config.json); every bias
            gpt_neox=dict(layer_norm_eps=1e-5, rotary_pct=0.5, rotary_emb_base=10000, use_parallel_residual=True),
            # NOTE: parallel layers on one LayerNorm, RoPE on adjacent pairs of 8 of 16 dims, n_inner given, an LM
            # head with a bias
            gptj=dict(layer_norm_epsilon=1e-5, rotary_dim=8, n_inner=128),
        )[arch]
        if arch in ("qwen2", "mistral", "ministral3", "mixtral", "phi3", "qwen2_moe"):  # NOTE: their attention ignores attention_bias
            common.pop("attention_bias")
        if arch == "ministral3":  # NOTE: transformers needs the query scaling's numbers whatever the rope type;
            # YaRN's factor 4 times its original length 32 is the model's (transformers warns of any other)
            common["rope_scaling"] = {"rope_type": "default", "original_max_position_embeddings": 32,
                                      "llama_4_scaling_beta": 0.5, **(common["rope_scaling"] or {})}
            common.update(max_position_embeddings=128)
        if arch in ("seed_oss", "glm", "glm4") and not bias:  # NOTE: absent: their default, q/k/v biases
            common.pop("attention_bias")
        if arch == "gemma3":  # NOTE: hidden 80: its sqrt (the embedding scale) is not a float32 number
            common.update(hidden_size=80, rope_theta=1_000_000.0)
        if arch in ("gemma2", "gemma"):
            common.update(hidden_size=80)
        if arch == "gpt_neox":  # NOTE: every bias, as released
            common.update(attention_bias=True)
        if arch == "gptj":  # NOTE: its RoPE has no settings but rotary_dim (transformers warns of rope_scaling)
            common.pop("rope_scaling")
            common.pop("rope_theta")
        if arch in ("gpt_oss", "granitemoe", "granitemoeshared", "granite4", "olmoe"):  # NOTE: the experts' width
            common.update(intermediate_size=32)
        if arch == "hunyuan_moe":  # NOTE: the routed and shared experts' width
            common.update(intermediate_size=32)
        if arch == "llama4":  # NOTE: the experts' and shared expert's width; 4 layers so that the NoPE one exists
            common.update(intermediate_size=32, num_hidden_layers=max(num_layers, 4))
        return getattr(transformers, GQA_ARCHS[arch][0])(**common, num_key_value_heads=2, **family)
    mla = dict(
        q_lora_rank=q_lora_rank,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=16,
        v_head_dim=24,  # != qk_nope_head_dim, so a loader that mixes them up fails
        num_key_value_heads=4,
        # dense unless --moe: layer 0 dense, the others MoE
        first_k_dense_replace=1 if moe else num_layers,
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        n_group=4 if moe else 1,
        topk_group=2 if moe else 1,
    )
    if arch == "gemma3_mm":
        text = tiny_config("gemma3", rope_scaling=rope_scaling, tie_word_embeddings=tie_word_embeddings, bias=bias,
                           vocab_size=vocab_size, num_layers=num_layers, sliding_window=sliding_window)
        # NOTE: the smallest SigLIP; the special image tokens are ordinary ids of the vocabulary, as released
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14)
        return transformers.Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4,
                                         boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                                         image_token_index=vocab_size - 1, tie_word_embeddings=tie_word_embeddings)
    if arch == "llama4_mm":
        text = tiny_config("llama4", rope_scaling=rope_scaling, tie_word_embeddings=tie_word_embeddings, bias=bias,
                           vocab_size=vocab_size, num_layers=num_layers, chunk=chunk)
        # NOTE: the smallest vision model; the image tokens ordinary ids of the vocabulary
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                      patch_size=14, vision_output_dim=32, projector_input_dim=32, projector_output_dim=32)
        return transformers.Llama4Config(text_config=text.to_dict(), vision_config=vision,
                                         boi_token_index=vocab_size - 3, eoi_token_index=vocab_size - 2,
                                         image_token_index=vocab_size - 1, tie_word_embeddings=tie_word_embeddings)
    if arch == "qwen2_5_vl":
        text = tiny_config("qwen2", rope_scaling="none", tie_word_embeddings=tie_word_embeddings, vocab_size=vocab_size,
                           num_layers=num_layers, sliding_window=sliding_window).to_dict()
        text["rope_parameters"] = {"rope_type": "default", "type": "mrope", "mrope_section": [2, 3, 3],
                                   "rope_theta": 10000.0}  # NOTE: head 16: 8 frequencies in 3 sections
        # NOTE: the smallest vision tower; the special ids are ordinary ids of the vocabulary
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      spatial_merge_size=2, patch_size=14, window_size=56, fullatt_block_indexes=[0])
        return transformers.Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=vocab_size - 1,
                                             video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 3,
                                             tie_word_embeddings=tie_word_embeddings)
    if arch in ("qwen3_vl", "qwen3_vl_moe"):
        text = tiny_config("qwen3", rope_scaling="none", vocab_size=vocab_size, num_layers=num_layers,
                           bias=bias).to_dict()
        for key in ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types"):
            text.pop(key, None)
        # NOTE: head 24: 12 frequencies, interleaved T/H/W over all of them
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 4, 4],
                                   "mrope_interleaved": True}
        if arch == "qwen3_vl_moe":  # NOTE: every layer MoE; experts 24 wide: no fused tensor square (hidden 64)
            text.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, decoder_sparse_step=1)
        # NOTE: the smallest vision tower; the special ids ordinary ids of the vocabulary
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                      num_position_embeddings=16, deepstack_visual_indexes=[0])
        cls = transformers.Qwen3VLMoeConfig if arch == "qwen3_vl_moe" else transformers.Qwen3VLConfig
        return cls(text_config=text, vision_config=vision, image_token_id=vocab_size - 1,
                   video_token_id=vocab_size - 2, vision_start_token_id=vocab_size - 3,
                   vision_end_token_id=vocab_size - 4, tie_word_embeddings=tie_word_embeddings)
    if arch in ("mistral3", "ministral3_mm"):
        text = tiny_config("mistral" if arch == "mistral3" else "ministral3", rope_scaling=rope_scaling,
                           vocab_size=vocab_size, num_layers=num_layers, sliding_window=sliding_window)
        # NOTE: the smallest Pixtral; the image token an ordinary id of the vocabulary, as released
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, head_dim=16,
                      image_size=28, patch_size=14)
        return transformers.Mistral3Config(text_config=text.to_dict(), vision_config=vision, spatial_merge_size=2,
                                           image_token_index=vocab_size - 1, tie_word_embeddings=tie_word_embeddings)
    if arch == "deepseek_v3":
        return transformers.DeepseekV3Config(
            **common, **mla, rope_interleave=rope_interleave, routed_scaling_factor=2.5, norm_topk_prob=True
        )
    if arch == "deepseek_v2":
        method = "group_limited_greedy" if moe else "greedy"
        return transformers.DeepseekV2Config(**common, **mla, topk_method=method)
    raise ValueError(f"unknown arch {arch!r}; allowed: {', '.join(ARCHS)}")


PARAGRAPH = (
    "The capital of France is Paris, a city on the river Seine. Context parallelism splits a "
    "long prompt into chunks that several ranks prefill at once; each rank keeps part of the "
    "key-value cache, and decode steps read every shard, merging the partial attention with "
    "the log-sum-exp of each shard. What is the capital of France? It is Paris. The quick "
    "brown fox jumps over the lazy dog while the tokenizer learns which letters come "
    "together: the, and, of, in, is, to, on, at, a, an. Numbers such as 1, 2, 3, 42 and 2026 "
    "appear too, with punctuation: commas, periods, questions? and exclamations!"
)
SPECIAL_TOKENS = ("<s>", "</s>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE trained on ``PARAGRAPH`` (any text encodes: bytes are its alphabet),
    as a transformers ``PreTrainedTokenizerFast`` with BOS, EOS and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([PARAGRAPH], trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        chat_template=CHAT_TEMPLATE,
    )


def write_generation_config(out: str | Path, eos_token_id: int | list[int], bos_token_id: int | None = None) -> None:
    """``generation_config.json`` naming the checkpoint's EOS id(s)."""
    import transformers

    config = transformers.GenerationConfig(eos_token_id=eos_token_id, bos_token_id=bos_token_id)
    config.save_pretrained(out)


LOGIT_GAIN = 2.0
"""The LM head is ``N(0, LOGIT_GAIN^2 / hidden)``: logits of standard deviation ~2."""


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter from ``torch.Generator(seed)`` (see the module docstring)."""
    gen = torch.Generator().manual_seed(seed)
    tied = model.config.tie_word_embeddings
    # NOTE: Gemma's and Nemotron's norms scale by 1 + weight
    offsets = model.config.model_type in ("gemma3_text", "gemma3", "gemma2", "gemma", "nemotron")

    def randn(shape):
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    with torch.no_grad():
        for name, param in model.named_parameters():
            if any(f".{part}." in f".{name}" for part in ("vision_tower", "vision_model", "multi_modal_projector",
                                                          "visual")):
                continue  # NOTE: a multimodal model's image side: never run on text (transformers' own init)
            if name.endswith(("embed_tokens.weight", "embed_in.weight", "wte.weight")):
                std = LOGIT_GAIN / math.sqrt(param.shape[1]) if tied else 1.0
                value = randn(param.shape) * std
            elif name.endswith("bias"):  # NOTE: gpt-oss's experts' gate_up_proj_bias / down_proj_bias, LayerNorms' too
                value = 0.1 * randn(param.shape)
            elif name.endswith("norm.weight") or "layernorm" in name or ".ln_" in name:
                value = (0 if offsets else 1) + 0.2 * randn(param.shape)
            elif name.endswith(".sinks"):  # gpt-oss: a logit per head, on the scores' scale
                value = randn(param.shape)
            elif ".feed_forward.experts." in name:  # NOTE: Llama 4's stacked experts, [E, in, out]: fan_in is dim 1
                value = randn(param.shape) / math.sqrt(param.shape[1])
            elif param.dim() in (2, 3):  # 3: stacked experts [E, out, in] (gpt-oss: [E, in, out])
                gain = LOGIT_GAIN if name in ("lm_head.weight", "embed_out.weight") else 1.0
                value = randn(param.shape) * (gain / math.sqrt(param.shape[-1]))
            else:
                raise TypeError(f"no init rule for {name} {tuple(param.shape)}")
            param.copy_(value.to(param.dtype))
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_((0.1 * randn(buf.shape)).to(buf.dtype))


def build_checkpoint(
    out: str | Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    max_shard_size: str | None = None,
    tokenizer: bool = False,
    eos_token_id: int | list[int] | None = None,
    **config_kwargs,
) -> Path:
    """Write a tiny random ``arch`` checkpoint to ``out`` (see ``tiny_config`` for the
    options) and return its path. ``tokenizer``: with a trained BPE tokenizer, the vocabulary
    sized to it, and EOS ids ``eos_token_id`` (default ``<|im_end|>`` and ``</s>``)."""
    import transformers

    tok = None
    if tokenizer:
        tok = train_tokenizer(config_kwargs.get("vocab_size", 384))
        config_kwargs["vocab_size"] = len(tok)
    config = tiny_config(arch, **config_kwargs)
    cls = {
        **{name: getattr(transformers, model) for name, (_, model) in GQA_ARCHS.items()},
        "deepseek_v3": transformers.DeepseekV3ForCausalLM,
        "deepseek_v2": transformers.DeepseekV2ForCausalLM,
        "gemma3_mm": transformers.Gemma3ForConditionalGeneration,
        "mistral3": transformers.Mistral3ForConditionalGeneration,
        "ministral3_mm": transformers.Mistral3ForConditionalGeneration,
        "qwen2_5_vl": transformers.Qwen2_5_VLForConditionalGeneration,
        "qwen3_vl": transformers.Qwen3VLForConditionalGeneration,
        "qwen3_vl_moe": transformers.Qwen3VLMoeForConditionalGeneration,
        "llama4_mm": transformers.Llama4ForConditionalGeneration,
    }[arch]
    model = cls(config)
    for t in (*model.parameters(), *model.buffers()):  # NOTE: float32; Llama 4's vision keeps its complex rotary table
        if t.is_floating_point():
            t.data = t.data.float()
    init_weights(model, seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    if arch == "qwen3_vl_moe":
        transpose_fused_experts(out)
    if tok is not None:
        tok.save_pretrained(out)
        if eos_token_id is None:
            eos_token_id = [tok.convert_tokens_to_ids("<|im_end|>"), tok.eos_token_id]
        write_generation_config(out, eos_token_id, tok.bos_token_id)
    return out


def transpose_fused_experts(out: Path) -> None:
    """Rewrite the fused expert tensors (``*.mlp.experts.gate_up_proj`` / ``down_proj``) of the
    checkpoint at ``out`` transposed, ``[E, in, out]``: Qwen3-VL-MoE's released layout."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for file in sorted(out.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            metadata = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        fused = [k for k in tensors if k.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))]
        for k in fused:
            tensors[k] = tensors[k].transpose(1, 2).contiguous()
        if fused:
            save_file(tensors, str(file), metadata=metadata)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", choices=ARCHS, required=True)
    p.add_argument("--out", required=True, help="checkpoint directory to write")
    p.add_argument(
        "--q-lora-rank",
        default="48",
        help="DeepSeek query compression rank, or 'none' for a full q_proj (V2-Lite style)",
    )
    p.add_argument(
        "--rope-scaling",
        choices=sorted(ROPE_SCALINGS),
        default=None,
        help="default: llama3 for llama, yarn for qwen2 and deepseek, none for qwen3 and mistral",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tie-word-embeddings", action="store_true")
    p.add_argument("--bias", action="store_true", help="attention (and Llama MLP) biases; Qwen2 has q/k/v biases always")
    p.add_argument("--sliding-window", type=int, default=None, help="Mistral / Qwen: a sliding window of N tokens")
    p.add_argument("--chunk", type=int, default=None, help="Llama 4: attention_chunk_size (default transformers' 8192)")
    p.add_argument(
        "--no-rope-interleave",
        action="store_true",
        help="DeepSeek-V3: rope_interleave=false (rotate-half rope)",
    )
    p.add_argument("--max-shard-size", default=None, help="e.g. 200KB: a sharded checkpoint")
    p.add_argument("--moe", action="store_true", help="DeepSeek: mixture-of-experts layers past layer 0")
    p.add_argument("--tokenizer", action="store_true", help="with a BPE tokenizer trained offline, a chat template and EOS ids")
    p.add_argument("--eos-token-id", type=int, action="append", default=None, help="EOS id (repeatable; with --tokenizer)")
    args = p.parse_args(argv)
    from pcpflow.errors import missing_extra

    missing = missing_extra(("transformers", "safetensors", *(("tokenizers",) if args.tokenizer else ())), "hf")
    if missing:
        raise SystemExit(f"make_tiny_hf_checkpoint.py: {missing}")
    q_lora = None if args.q_lora_rank.lower() == "none" else int(args.q_lora_rank)
    out = build_checkpoint(
        args.out,
        args.arch,
        seed=args.seed,
        max_shard_size=args.max_shard_size,
        q_lora_rank=q_lora,
        rope_scaling=args.rope_scaling,
        tie_word_embeddings=args.tie_word_embeddings,
        bias=args.bias,
        rope_interleave=not args.no_rope_interleave,
        moe=args.moe,
        sliding_window=args.sliding_window,
        chunk=args.chunk,
        tokenizer=args.tokenizer,
        eos_token_id=args.eos_token_id,
    )
    cfg = json.loads((out / "config.json").read_text())
    files = sorted(f.name for f in out.iterdir())
    print(f"wrote {cfg['architectures'][0]} to {out}: {', '.join(files)}")


if __name__ == "__main__":
    main()
