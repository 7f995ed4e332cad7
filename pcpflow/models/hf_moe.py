"""The mixture-of-experts part of DeepSeek-V2/V3, GLM-4.5, Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss, Llama 4,
Hunyuan-A13B, Granite, OLMoE and ERNIE 4.5 checkpoints: which config.json fields make which ``MoEConfig`` (transformers'
routing; unsupported variants named), and where the router, routed and shared experts' tensors go."""

from __future__ import annotations

from typing import Any

from pcpflow.models.hf_weights import Rename
from pcpflow.models.moe_config import MoEConfig, moe_config_problems

# transformers' defaults of the MoE fields a config.json may omit
MOE_DEFAULTS = {
    "DeepseekV3ForCausalLM": dict(
        n_routed_experts=256,
        num_experts_per_tok=8,
        moe_intermediate_size=2048,
        n_shared_experts=1,
        n_group=8,
        topk_group=4,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",
    ),
    "Glm4MoeForCausalLM": dict(
        n_routed_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=1408,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        topk_method="noaux_tc",
    ),
    "DeepseekV2ForCausalLM": dict(
        n_routed_experts=64,
        num_experts_per_tok=None,
        moe_intermediate_size=1407,
        n_shared_experts=2,
        n_group=None,
        topk_group=None,
        norm_topk_prob=False,
        routed_scaling_factor=1.0,
        topk_method="greedy",
    ),
}


def _mlp(hf: str, ours: str, part: tuple[int, int] | None = None) -> Rename:
    return Rename("model.layers.{i}.mlp." + hf, "layers.{i}.mlp." + ours, part)


MOE_RENAMES = (
    _mlp("gate.weight", "gate.weight"),
    _mlp("gate.e_score_correction_bias", "gate.e_score_correction_bias"),
    _mlp("experts.{j}.gate_proj.weight", "experts.{j}.gate_up_proj.weight", (0, 2)),
    _mlp("experts.{j}.up_proj.weight", "experts.{j}.gate_up_proj.weight", (1, 2)),
    _mlp("experts.{j}.down_proj.weight", "experts.{j}.down_proj.weight"),
    _mlp("shared_experts.gate_proj.weight", "shared_experts.gate_up_proj.weight", (0, 2)),
    _mlp("shared_experts.up_proj.weight", "shared_experts.gate_up_proj.weight", (1, 2)),
    _mlp("shared_experts.down_proj.weight", "shared_experts.down_proj.weight"),
)
"""Routed experts (one tensor per expert and projection, as DeepSeek and transformers'
``save_pretrained`` store them), router and shared experts."""

QWEN2_MOE_RENAMES = (
    _mlp("shared_expert.gate_proj.weight", "shared_experts.gate_up_proj.weight", (0, 2)),
    _mlp("shared_expert.up_proj.weight", "shared_experts.gate_up_proj.weight", (1, 2)),
    _mlp("shared_expert.down_proj.weight", "shared_experts.down_proj.weight"),
    _mlp("shared_expert_gate.weight", "shared_expert_gate.weight"),
)
"""Qwen2-MoE: one ``shared_expert`` (singular) and the ``shared_expert_gate`` that scales it."""


def _sparse(hf: str, ours: str, part: tuple[int, int] | None = None) -> Rename:
    return Rename("model.layers.{i}.block_sparse_moe." + hf, "layers.{i}.mlp." + ours, part)


MIXTRAL_RENAMES = (
    _sparse("gate.weight", "gate.weight"),
    _sparse("experts.{j}.w1.weight", "experts.{j}.gate_up_proj.weight", (0, 2)),
    _sparse("experts.{j}.w3.weight", "experts.{j}.gate_up_proj.weight", (1, 2)),
    _sparse("experts.{j}.w2.weight", "experts.{j}.down_proj.weight"),
)
"""Mixtral: ``block_sparse_moe``, each expert's ``w1`` (gate), ``w3`` (up) and ``w2`` (down),
as Mistral's checkpoints and transformers' ``save_pretrained`` store them."""

def _fused_experts(hf: str, ours: str, **layout: bool) -> Rename:
    return Rename("model.layers.{i}.mlp.experts." + hf, "layers.{i}.mlp.experts.{j}." + ours, experts=True, **layout)


GPT_OSS_MOE_RENAMES = (
    _mlp("router.weight", "gate.weight"),
    _mlp("router.bias", "gate.bias"),
    _fused_experts("gate_up_proj", "gate_up_proj.weight", transposed=True, interleaved=True, mxfp4=True),
    _fused_experts("gate_up_proj_bias", "gate_up_proj.bias", interleaved=True),
    _fused_experts("down_proj", "down_proj.weight", transposed=True, mxfp4=True),
    _fused_experts("down_proj_bias", "down_proj.bias"),
)
"""gpt-oss: the ``router`` with its bias, and every expert of a layer in one tensor per
projection (transformers' ``GptOssExperts``): ``gate_up_proj [E, hidden, 2I]`` (``x @ W``, gate
and up interleaved along 2I), its bias ``[E, 2I]`` (interleaved), ``down_proj [E, I, hidden]``
and its bias ``[E, hidden]``; the two weights as MXFP4 ``_blocks``/``_scales`` pairs in
OpenAI's released checkpoints, dense in a ``save_pretrained`` of the dequantized model."""

def _feed_forward(hf: str, ours: str, part: tuple[int, int] | None = None, **layout: bool) -> Rename:
    return Rename("model.layers.{i}.feed_forward." + hf, "layers.{i}.mlp." + ours, part, **layout)


LLAMA4_MOE_RENAMES = (
    _feed_forward("router.weight", "gate.weight"),
    _feed_forward("experts.gate_up_proj", "experts.{j}.gate_up_proj.weight", experts=True, transposed=True),
    _feed_forward("experts.down_proj", "experts.{j}.down_proj.weight", experts=True, transposed=True),
    _feed_forward("shared_expert.gate_proj.weight", "shared_experts.gate_up_proj.weight", (0, 2)),
    _feed_forward("shared_expert.up_proj.weight", "shared_experts.gate_up_proj.weight", (1, 2)),
    _feed_forward("shared_expert.down_proj.weight", "shared_experts.down_proj.weight"),
    _feed_forward("gate_proj.weight", "gate_up_proj.weight", (0, 2)),
    _feed_forward("up_proj.weight", "gate_up_proj.weight", (1, 2)),
    _feed_forward("down_proj.weight", "down_proj.weight"),
)
"""Llama 4's ``feed_forward``: on an MoE layer the ``router``, every expert in one tensor per
projection (transformers' ``Llama4TextExperts``: ``gate_up_proj [E, hidden, 2I]``, ``x @ W``, gate
the first half of 2I and up the second, not interleaved; ``down_proj [E, I, hidden]``) and the
``shared_expert``; on a dense layer its own gate/up/down projections."""

def _block_sparse_moe(hf: str, ours: str, **layout: bool) -> Rename:
    return Rename("model.layers.{i}.block_sparse_moe." + hf, "layers.{i}.mlp." + ours, **layout)


GRANITE_MOE_RENAMES = (
    _block_sparse_moe("router.layer.weight", "gate.weight"),
    _block_sparse_moe("input_linear.weight", "experts.{j}.gate_up_proj.weight", experts=True),
    _block_sparse_moe("output_linear.weight", "experts.{j}.down_proj.weight", experts=True),
    Rename("model.layers.{i}.shared_mlp.input_linear.weight", "layers.{i}.mlp.shared_experts.gate_up_proj.weight"),
    Rename("model.layers.{i}.shared_mlp.output_linear.weight", "layers.{i}.mlp.shared_experts.down_proj.weight"),
)
"""Granite's MoE (``GraniteMoeMoE``, as its checkpoints and ``save_pretrained`` store it): the
``router.layer`` and every expert of a layer in one tensor per projection, ``input_linear
[E, 2I, hidden]`` (``nn.Linear``'s layout, gate the first half of 2I and up the second, as
pcpflow's ``gate_up_proj``) and ``output_linear [E, hidden, I]``; the ``shared_mlp`` beside them
(GraniteMoeShared, Granite 4.0), one MLP of the shared experts' summed width, gate then up."""

LLAMA4_MOE_DEFAULTS = dict(num_local_experts=16, num_experts_per_tok=1, intermediate_size=8192,
                           interleave_moe_layer_step=1, num_hidden_layers=48)
"""``Llama4TextConfig``'s defaults of the MoE fields a config.json may omit."""


def llama4_moe_settings(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``MoEConfig`` fields of a Llama 4 text config.json dict (``Llama4TextMoe``): the top-k of the
    router's raw logits (in the model's dtype), each expert's input scaled by the sigmoid of its logit
    (``topk_sigmoid``, ``weights_on=input``), one shared expert as wide as the routed ones; MoE on
    ``moe_layers``, else every ``interleave_moe_layer_step``-th layer from ``step - 1`` (transformers'
    rule). None when no layer is MoE; ValueError naming a ``moe_layers`` list that no step gives."""
    get = {**LLAMA4_MOE_DEFAULTS, **{k: v for k, v in raw.items() if v is not None}}.get
    step, layers = get("interleave_moe_layer_step"), get("num_hidden_layers")
    if not (type(step) is int and step >= 1):
        raise ValueError(f"interleave_moe_layer_step must be a positive integer; got {step!r}")
    if not (type(layers) is int and layers >= 1):
        return None  # NOTE: the config's own validation names num_hidden_layers
    listed = raw.get("moe_layers")
    if listed is not None:
        if not (isinstance(listed, list) and all(type(i) is int for i in listed)):
            raise ValueError(f"moe_layers must be a list of layer indices; got {listed!r}")
        if not listed:
            return None
        # NOTE: pcpflow's MoE layers are every n-th from the first: a list any step gives is read as that step
        step = listed[1] - listed[0] if len(listed) > 1 else layers
        if step < 1 or listed != list(range(listed[0], layers, step)):
            raise ValueError(f"moe_layers={listed} is not supported; supported: every n-th layer from one on "
                             f"(transformers' default, range(interleave_moe_layer_step - 1, {layers}, "
                             "interleave_moe_layer_step))")
        first = listed[0]
    else:
        first = step - 1
        if first >= layers:
            return None
    return _checked(dict(
        num_experts=get("num_local_experts"), top_k=get("num_experts_per_tok"), intermediate_size=get("intermediate_size"),
        num_shared_experts=1, scoring_func="topk_sigmoid", weights_on="input", norm_topk_prob=False,
        routed_scaling_factor=1.0, n_group=1, topk_group=1, router_dtype="model",
        first_k_dense_replace=first, moe_layer_freq=step,
    ))


HUNYUAN_MOE_RENAMES = (
    _mlp("gate.wg.weight", "gate.weight"),
    *(r for r in MOE_RENAMES if ".experts.{j}." in r.hf),
    _mlp("shared_mlp.gate_proj.weight", "shared_experts.gate_up_proj.weight", (0, 2)),
    _mlp("shared_mlp.up_proj.weight", "shared_experts.gate_up_proj.weight", (1, 2)),
    _mlp("shared_mlp.down_proj.weight", "shared_experts.down_proj.weight"),
)
"""Hunyuan-A13B: the router ``gate.wg``, routed experts one tensor per expert and projection (as
transformers' ``save_pretrained`` stores them), the ``shared_mlp``."""


def hunyuan_moe_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """``MoEConfig`` fields of a Hunyuan MoE config.json dict (``HunYuanMoEV1Moe``): every layer MoE, a
    softmax over ``num_experts`` router logits computed in float32 (``gate.wg`` is a float32 Linear
    whatever the model's dtype), the top ``moe_topk`` renormalised to sum 1, plus one shared expert
    added unweighted; routed and shared experts ``intermediate_size`` wide (transformers reads neither
    ``moe_intermediate_size`` nor ``num_shared_expert``). ValueError naming what transformers cannot
    build (several expert counts) or pcpflow does not route (a top-k that differs by layer)."""
    def given(name: str, alias: str, default: Any) -> Any:
        # NOTE: the alias is HunYuanMoEV1Config's attribute_map
        value = raw.get(name, raw.get(alias))
        return default if value is None else value

    experts, top_k = given("num_experts", "num_local_experts", 1), given("moe_topk", "num_experts_per_tok", 1)
    layers = raw.get("num_hidden_layers")
    if type(experts) is not int:
        raise ValueError(f"num_experts must be one number of experts for every layer (transformers' HunYuanMoEV1Experts "
                         f"builds that many on each); got {experts!r}")
    if isinstance(top_k, list) and type(layers) is int:
        if len(top_k) < layers or not all(type(k) is int for k in top_k):
            raise ValueError(f"moe_topk must give each of the {layers} layers its experts per token; got {top_k!r}")
        if len(set(top_k[:layers])) > 1:
            raise ValueError(f"moe_topk={top_k[:layers]} is not supported; supported: the same top-k on every layer "
                             "(as Hunyuan-A13B's list gives)")
        top_k = top_k[0]
    if type(top_k) is not int:
        raise ValueError(f"moe_topk must be a number of experts per token, or one per layer; got {top_k!r}")
    return _checked(dict(num_experts=experts, top_k=top_k, num_shared_experts=1, scoring_func="softmax",
                         norm_topk_prob=True, routed_scaling_factor=1.0, n_group=1, topk_group=1,
                         router_dtype="float32"))


OLMOE_MOE_RENAMES = (
    _mlp("gate.weight", "gate.weight"),
    *(r for r in MOE_RENAMES if ".experts.{j}." in r.hf),
    _fused_experts("gate_up_proj", "gate_up_proj.weight"),
    _fused_experts("down_proj", "down_proj.weight"),
)
"""OLMoE: the router ``gate`` and the routed experts one tensor per expert and projection (as the
released checkpoints and transformers' ``save_pretrained`` store them), or every expert of a layer
in one tensor per projection (transformers 5's ``OlmoeExperts``, which its loader also reads):
``gate_up_proj [E, 2I, hidden]`` (``nn.Linear``'s layout, gate the first half of 2I, as pcpflow's)
and ``down_proj [E, hidden, I]``."""

OLMOE_MOE_DEFAULTS = dict(num_experts=64, num_experts_per_tok=8, norm_topk_prob=False)
"""``OlmoeConfig``'s defaults of the MoE fields a config.json may omit."""


def olmoe_moe_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """``MoEConfig`` fields of an OLMoE config.json dict (``OlmoeTopKRouter``): every layer MoE, the
    softmax (float32) of ``num_experts`` router logits computed in the model's dtype, the top
    ``num_experts_per_tok`` of it, renormalised only when ``norm_topk_prob``, rounded to the model's
    dtype before they scale the experts (``weights_dtype=model``); experts ``intermediate_size`` wide,
    no shared expert."""
    # NOTE: num_local_experts is OlmoeConfig's alias of num_experts (its attribute_map)
    given = {k: v for k, v in raw.items() if v is not None}
    given.setdefault("num_experts", given.get("num_local_experts", OLMOE_MOE_DEFAULTS["num_experts"]))
    get = {**OLMOE_MOE_DEFAULTS, **given}.get
    for field, kind in (("num_experts", int), ("num_experts_per_tok", int), ("norm_topk_prob", bool)):
        if type(get(field)) is not kind:  # NOTE: strictly, as every config.json field (a "8" is refused)
            raise ValueError(f"{field} must be {'an integer' if kind is int else 'true or false'}; got {get(field)!r}")
    return _checked(dict(num_experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                         intermediate_size=get("intermediate_size"), norm_topk_prob=get("norm_topk_prob"),
                         scoring_func="softmax", router_dtype="model", weights_dtype="model", num_shared_experts=0,
                         n_group=1, topk_group=1, routed_scaling_factor=1.0))


ERNIE_MOE_RENAMES = (
    Rename("model.layers.{i}.mlp.moe_statics.e_score_correction_bias", "layers.{i}.mlp.gate.e_score_correction_bias",
           squeezed=True),
)
"""ERNIE 4.5 MoE beyond ``MOE_RENAMES`` (router ``gate``, experts one tensor per expert and projection,
``shared_experts``, as the released checkpoints and ``save_pretrained`` store them): the selection bias
``moe_statics.e_score_correction_bias [1, E]`` (float32)."""

ERNIE_MOE_DEFAULTS = dict(moe_num_experts=64, moe_k=6, moe_intermediate_size=1536, moe_num_shared_experts=2,
                          moe_layer_start_index=1, moe_layer_end_index=-1, moe_layer_interval=1, moe_norm_min=1e-12,
                          use_bias=False)
"""``Ernie4_5_MoeConfig``'s defaults of the MoE fields a config.json may omit."""


def ernie_moe_settings(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``MoEConfig`` fields of an ERNIE 4.5 MoE config.json dict (``Ernie4_5_MoeSparseMoeBlock``): the
    softmax of float32 router logits, the top ``moe_k`` chosen on it plus ``e_score_correction_bias``
    (``selection_bias``) and weighted by the unbiased softmax, renormalised by ``max(sum, moe_norm_min)``
    and rounded to the model's dtype; ``moe_num_shared_experts`` shared experts as one MLP, experts
    ``moe_intermediate_size`` wide; layer i MoE when ``(i + 1) % moe_layer_interval == 0`` and
    ``moe_layer_start_index <= i <= moe_layer_end_index`` (-1: the last). None when no layer is MoE;
    ValueError naming what pcpflow cannot reproduce (``use_bias``: biased shared experts and lm_head; an
    end index that stops the MoE layers early)."""
    # NOTE: moe_num_experts / moe_k have transformers' aliases num_experts / num_experts_per_tok (attribute_map)
    given = {k: v for k, v in raw.items() if v is not None}
    for name, alias in (("moe_num_experts", "num_experts"), ("moe_k", "num_experts_per_tok")):
        if alias in given:
            given.setdefault(name, given[alias])
    get = {**ERNIE_MOE_DEFAULTS, **given}.get
    layers = raw.get("num_hidden_layers")
    names = ("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_num_shared_experts", "moe_layer_start_index",
             "moe_layer_end_index", "moe_layer_interval")
    for name in names:
        if type(get(name)) is not int:
            raise ValueError(f"{name} must be an integer; got {get(name)!r}")
    if get("use_bias") is True:
        raise ValueError("use_bias=True is not supported for Ernie4_5_MoeForCausalLM; supported: false (as every "
                         "released ERNIE 4.5 MoE checkpoint; pcpflow's shared experts and lm_head carry no bias)")
    if type(layers) is not int or get("moe_num_experts") < 1:
        return None  # NOTE: the config's own validation names num_hidden_layers
    start, end, step = get("moe_layer_start_index"), get("moe_layer_end_index"), get("moe_layer_interval")
    end = layers - 1 if end == -1 else end  # NOTE: Ernie4_5_MoeConfig.__post_init__
    if step < 1:
        raise ValueError(f"moe_layer_interval must be a positive integer; got {step}")
    wanted = [i for i in range(layers) if (i + 1) % step == 0 and start <= i <= end]
    if not wanted:
        return None
    first = wanted[0]
    if wanted != list(range(first, layers, step)):
        raise ValueError(f"moe_layer_end_index={get('moe_layer_end_index')} is not supported; supported: -1 or one "
                         f"at or past the last MoE layer ({list(range(first, layers, step))[-1]}): pcpflow's MoE "
                         "layers run to the last layer")
    norm_min = get("moe_norm_min")
    if not (isinstance(norm_min, (int, float)) and not isinstance(norm_min, bool) and norm_min > 0):
        raise ValueError(f"moe_norm_min must be a positive number; got {norm_min!r}")
    return _checked(dict(
        num_experts=get("moe_num_experts"), top_k=get("moe_k"), intermediate_size=get("moe_intermediate_size"),
        num_shared_experts=get("moe_num_shared_experts"), scoring_func="softmax", selection_bias=True,
        norm_topk_prob=True, norm_min=float(norm_min), router_dtype="float32", weights_dtype="model",
        n_group=1, topk_group=1, routed_scaling_factor=1.0, first_k_dense_replace=first, moe_layer_freq=step,
    ))


GQA_MOE_DEFAULTS = {
    "Qwen2MoeForCausalLM": dict(num_experts=60, num_experts_per_tok=4, moe_intermediate_size=1408,
                                shared_expert_intermediate_size=5632, norm_topk_prob=False, decoder_sparse_step=1),
    "Qwen3MoeForCausalLM": dict(num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                                norm_topk_prob=False, decoder_sparse_step=1),
    "MixtralForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2),
    "GptOssForCausalLM": dict(num_local_experts=128, num_experts_per_tok=4, intermediate_size=2880,
                              swiglu_alpha=1.702, swiglu_limit=7.0),
    "GraniteMoeForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=0),
    "GraniteMoeSharedForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=0),
    "GraniteMoeHybridForCausalLM": dict(num_local_experts=8, num_experts_per_tok=2, shared_intermediate_size=1024),
}
"""transformers' defaults (``Qwen2MoeConfig``, ``Qwen3MoeConfig``, ``MixtralConfig``, ``GptOssConfig``,
``GraniteMoeConfig``, ``GraniteMoeSharedConfig``, ``GraniteMoeHybridConfig``) of the MoE fields a
config.json may omit (GraniteMoe has no shared MLP)."""


V3_ROUTING = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM")
"""Architectures routed as DeepSeek-V3: sigmoid scores, the selection bias, groups, scaling."""


def gqa_moe_settings(raw: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """``MoEConfig`` fields of a Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss or GLM-4.5 config.json dict:
    the Qwens and Mixtral route by softmax (one group, router logits in the model's dtype, as
    transformers' ``Qwen2MoeTopKRouter`` / ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter``; the Qwens'
    weights rounded to the model's dtype, Mixtral's kept in float32; Qwen2-MoE
    with a gated shared expert ``shared_expert_intermediate_size`` wide), gpt-oss by
    ``topk_softmax`` (``GptOssTopKRouter``: a biased router in the model's dtype; every layer MoE,
    biased experts with the clamped SwiGLU), GLM-4.5 as DeepSeek-V3 (``Glm4MoeTopkRouter``, its
    DeepSeek field names), Granite by ``granite_moe_settings``; None for a dense architecture or no
    experts; ERNIE 4.5 by ``ernie_moe_settings``; ValueError naming an unsupported variant."""
    if arch == "Glm4MoeForCausalLM":
        glm = {k: v for k, v in raw.items() if v is not None}
        # NOTE: transformers 5 writes num_local_experts (its attribute_map), 4 n_routed_experts
        glm.setdefault("n_routed_experts", glm.get("num_local_experts", MOE_DEFAULTS[arch]["n_routed_experts"]))
        glm.setdefault("first_k_dense_replace", 1)
        return moe_settings({**glm, "architecture": arch})
    if arch == "Ernie4_5_MoeForCausalLM":
        return ernie_moe_settings(raw)
    if arch not in GQA_MOE_DEFAULTS:
        return None
    if arch.startswith("GraniteMoe"):
        return granite_moe_settings(raw, arch)
    get = {**GQA_MOE_DEFAULTS[arch], **{k: v for k, v in raw.items() if v is not None}}.get
    common = dict(scoring_func="softmax", n_group=1, topk_group=1, routed_scaling_factor=1.0,
                  num_shared_experts=0, router_dtype="model")
    if arch == "MixtralForCausalLM":
        moe = dict(num_experts=get("num_local_experts"), top_k=get("num_experts_per_tok"),
                   intermediate_size=get("intermediate_size"), norm_topk_prob=True, **common)
    elif arch == "GptOssForCausalLM":
        # NOTE: num_experts is GptOssConfig's alias of num_local_experts (its attribute_map)
        experts = raw.get("num_local_experts") or raw.get("num_experts") or get("num_local_experts")
        moe = dict(num_experts=experts, top_k=get("num_experts_per_tok"), intermediate_size=get("intermediate_size"),
                   router_bias=True, expert_bias=True, activation="swiglu_clamped",
                   swiglu_alpha=get("swiglu_alpha"), swiglu_limit=get("swiglu_limit"),
                   **{**common, "scoring_func": "topk_softmax", "norm_topk_prob": False})
    else:
        if get("mlp_only_layers"):
            raise ValueError(f"mlp_only_layers={get('mlp_only_layers')} is not supported; supported: [] (the MoE "
                             "layers set by decoder_sparse_step alone, as every released Qwen2/3-MoE checkpoint)")
        # NOTE: transformers 4 writes num_experts, transformers 5 num_local_experts (its attribute_map)
        experts = get("num_local_experts") if raw.get("num_local_experts") is not None else get("num_experts")
        if not experts:
            return None
        step = get("decoder_sparse_step")
        if not isinstance(step, int) or step < 1:
            raise ValueError(f"decoder_sparse_step must be a positive integer; got {step!r}")
        # NOTE: transformers makes layer i MoE when (i + 1) % step == 0: layers step-1, 2*step-1, ...
        # NOTE: Qwen2MoeTopKRouter / Qwen3MoeTopKRouter round the top-k weights to the logits' (model's) dtype
        moe = dict(num_experts=experts, top_k=get("num_experts_per_tok"),
                   intermediate_size=get("moe_intermediate_size"), norm_topk_prob=bool(get("norm_topk_prob")),
                   first_k_dense_replace=step - 1, moe_layer_freq=step, weights_dtype="model", **common)
        if arch == "Qwen2MoeForCausalLM":
            moe.update(_gated_shared_expert(get("shared_expert_intermediate_size"), get("moe_intermediate_size")))
    return _checked(moe)


def granite_moe_settings(raw: dict[str, Any], arch: str) -> dict[str, Any] | None:
    """``MoEConfig`` fields of a Granite MoE config.json dict (``GraniteMoeTopKRouter``): every layer
    MoE, ``num_local_experts`` experts ``intermediate_size`` wide, the top ``num_experts_per_tok`` of
    the router's logits (the model's dtype, widened to float32) weighted by a softmax over those k
    alone, rounded to the model's dtype (``topk_softmax``, ``weights_dtype=model``); the shared MLP,
    ``shared_intermediate_size`` wide (0: none), as shared experts. None for a Granite 4.0 hybrid
    without experts (``num_local_experts: 0``: its shared MLP is the layer's MLP)."""
    get = {**GQA_MOE_DEFAULTS[arch], **{k: v for k, v in raw.items() if v is not None}}.get
    experts, shared = get("num_local_experts"), get("shared_intermediate_size")
    hybrid = arch == "GraniteMoeHybridForCausalLM"
    if hybrid and not (type(shared) is int and shared > 0):
        raise ValueError(f"shared_intermediate_size must be a positive integer (every {arch} layer has its shared "
                         f"MLP); got {shared!r}")
    if not (type(experts) is int and experts >= (0 if hybrid else 1)):
        every = "0 (the shared MLP alone) or more" if hybrid else f"a positive integer (every {arch} layer is MoE)"
        raise ValueError(f"num_local_experts must be {every}; got {experts!r}")
    if experts == 0:
        return None
    moe = dict(num_experts=experts, top_k=get("num_experts_per_tok"), intermediate_size=get("intermediate_size"),
               scoring_func="topk_softmax", weights_dtype="model", norm_topk_prob=False, n_group=1, topk_group=1,
               routed_scaling_factor=1.0, router_dtype="model", num_shared_experts=0)
    if shared:
        why = "or 0 (none): pcpflow's shared experts are each as wide as a routed one"
        moe["num_shared_experts"] = _shared_experts(("shared_intermediate_size", shared),
                                                    ("intermediate_size", get("intermediate_size")), why)
    return _checked(moe)


def _shared_experts(width: tuple[str, Any], expert_width: tuple[str, Any], why: str) -> int:
    """How many of pcpflow's shared experts, each as wide as a routed one, make a family's one
    shared MLP (they compute the same as one MLP of their summed width); ``width`` and
    ``expert_width``: (config.json field, value); ``why``: the refusal's reason."""
    (field, w), (expert_field, e) = width, expert_width
    if not (type(w) is int and type(e) is int and e > 0 and w > 0):
        raise ValueError(f"{field} ({w!r}) and {expert_field} ({e!r}) must be positive integers")
    if w % e:
        raise ValueError(f"{field}={w} is not supported; supported: a multiple of {expert_field} ({e}), {why}")
    return w // e


def _gated_shared_expert(width: Any, expert_width: Any) -> dict[str, Any]:
    """Qwen2-MoE's shared expert, ``width`` wide, as pcpflow's shared experts, behind the gate."""
    shared = _shared_experts(("shared_expert_intermediate_size", width), ("moe_intermediate_size", expert_width),
                             "as every released Qwen2-MoE checkpoint")
    return dict(num_shared_experts=shared, shared_expert_gate=True)


def _checked(moe: dict[str, Any]) -> dict[str, Any]:
    problems = moe_config_problems(MoEConfig(**moe), field="moe")
    if problems:
        raise ValueError("; ".join(f"{p.field}={p.given}: {p.allowed}" for p in problems))
    return moe


def moe_settings(raw: dict[str, Any]) -> dict[str, Any] | None:
    """``MoEConfig`` fields of a DeepSeek config.json dict, None when every layer is
    dense; ValueError naming an unsupported MoE variant."""
    arch = raw.get("architecture")
    dense_layers = raw["first_k_dense_replace"]
    if raw.get("n_routed_experts") is None or dense_layers >= raw.get("num_hidden_layers", 0):
        return None
    get = {**MOE_DEFAULTS.get(arch, {}), **{k: v for k, v in raw.items() if v is not None}}.get
    if get("moe_layer_freq", 1) != 1:
        raise ValueError(
            f"moe_layer_freq={get('moe_layer_freq')} is not supported (transformers makes "
            "every layer past first_k_dense_replace MoE); supported: 1"
        )
    v3 = arch in V3_ROUTING
    method, scoring = get("topk_method"), get("scoring_func", "sigmoid" if v3 else "softmax")
    if v3:
        if method not in ("noaux_tc", None) or scoring != "sigmoid":
            raise ValueError(
                f"{'DeepSeek-V3' if arch == 'DeepseekV3ForCausalLM' else arch} MoE routing topk_method={method!r} "
                f"scoring_func={scoring!r} is not supported; supported: topk_method 'noaux_tc' with scoring_func 'sigmoid'"
            )
        groups, norm = (get("n_group") or 1, get("topk_group") or 1), bool(get("norm_topk_prob"))
    else:
        if method not in ("greedy", "group_limited_greedy") or scoring != "softmax":
            raise ValueError(
                f"DeepSeek-V2 MoE routing topk_method={method!r} scoring_func={scoring!r} is not "
                "supported; supported: topk_method 'greedy' or 'group_limited_greedy' with softmax"
            )
        limited = method == "group_limited_greedy"
        groups = (get("n_group") or 1, get("topk_group") or 1) if limited else (1, 1)
        norm = False  # NOTE: transformers' DeepseekV2TopkRouter ignores norm_topk_prob
    if get("num_experts_per_tok") is None:
        raise ValueError("num_experts_per_tok is required for MoE layers")
    moe = dict(
        num_experts=get("n_routed_experts"),
        top_k=get("num_experts_per_tok"),
        intermediate_size=get("moe_intermediate_size"),
        num_shared_experts=get("n_shared_experts") or 0,
        n_group=groups[0],
        topk_group=groups[1],
        norm_topk_prob=norm,
        routed_scaling_factor=get("routed_scaling_factor"),
        scoring_func=scoring,
        first_k_dense_replace=raw["first_k_dense_replace"],
    )
    return _checked(moe)
