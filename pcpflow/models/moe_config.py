"""The mixture-of-experts settings of a model (``model.moe``), with DeepSeek-V3's names as
transformers' ``DeepseekV3Config`` spells them (in brackets where they differ); Qwen2-MoE,
Qwen3-MoE, Mixtral, GLM-4.5, gpt-oss, Llama 4, Granite and ERNIE 4.5 checkpoints map onto the same fields (``pcpflow.models.hf_moe``).

Shared by the executed MoE layers (``pcpflow.models.moe``), the Hugging Face loader and
the simulator's model cards; ``model.moe: null`` is a dense model.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pcpflow.errors import Problem, Settings


class MoEConfig(Settings):
    num_experts: int = Field(8, ge=1, description="routed experts per MoE layer (n_routed_experts)")
    top_k: int = Field(2, ge=1, description="routed experts per token (num_experts_per_tok)")
    intermediate_size: int | None = Field(
        None, ge=1, description="width of each expert's MLP (moe_intermediate_size); None: the model's intermediate_size"
    )
    num_shared_experts: int = Field(1, ge=0, description="always-on experts (n_shared_experts)")
    shared_expert_gate: bool = Field(False, description="scale the shared experts' output by sigmoid(x w), one "
                                     "learned logit per row (Qwen2-MoE's shared_expert_gate)")
    n_group: int = Field(1, ge=1, description="expert groups for group-limited routing")
    topk_group: int = Field(1, ge=1, description="groups each token may route into")
    norm_topk_prob: bool = Field(True, description="renormalise the top-k weights to sum to 1")
    norm_min: float | None = Field(None, gt=0, description="renormalise by max(sum, norm_min) (ERNIE 4.5's "
                                   "moe_norm_min); None: by sum + 1e-20 (DeepSeek, Qwen)")
    selection_bias: bool = Field(False, description="softmax scoring selects on scores + e_score_correction_bias "
                                 "and weights the unbiased scores (ERNIE 4.5's moe_statics); sigmoid always has it")
    routed_scaling_factor: float = Field(1.0, gt=0, description="scale of the routed experts' sum")
    scoring_func: Literal["sigmoid", "softmax", "topk_softmax", "topk_sigmoid"] = Field(
        "sigmoid", description="sigmoid + e_score_correction_bias (V3), softmax (V2), topk_softmax (gpt-oss: "
        "the top-k of the raw logits, weighted by a softmax over those k alone, which sums to 1 whatever "
        "norm_topk_prob says), or topk_sigmoid (Llama 4: the top-k of the raw logits, each weighted by its own "
        "sigmoid in float32)"
    )
    weights_on: Literal["output", "input"] = Field(
        "output", description="where a routed expert's weight applies: to its output, summed weighted (every "
        "family but Llama 4), or to its input, the outputs summed unweighted (Llama 4's expert(x * w), not "
        "w * expert(x): the SwiGLU is not linear)"
    )
    first_k_dense_replace: int = Field(0, ge=0, description="the first k layers stay dense")
    moe_layer_freq: int = Field(1, ge=1, description="every n-th layer past the dense ones is MoE")
    router_dtype: Literal["float32", "model"] = Field(
        "float32", description="the router logits' dtype: float32 (DeepSeek), or the model's (Qwen3-MoE, Mixtral, "
        "gpt-oss); scores are float32 either way, as transformers computes them, except topk_softmax's, whose "
        "selection and softmax stay in the logits' dtype (transformers' GptOssTopKRouter)")
    weights_dtype: Literal["scores", "model"] = Field(
        "scores", description="the routed weights' dtype as they scale the experts: scores, the dtype they are "
        "scored in (float32 for a bf16/fp16 model, topk_softmax's the logits'); or model, scored in float32 "
        "(topk_softmax's too) and rounded to the model's dtype first (Granite's GraniteMoeTopKRouter)")
    router_bias: bool = Field(False, description="the router has a bias per expert, added to the logits before "
                              "the selection and so in the weights too (gpt-oss)")
    expert_bias: bool = Field(False, description="each routed expert's gate_up and down projections carry biases "
                              "(gpt-oss)")
    activation: Literal["silu", "swiglu_clamped"] = Field(
        "silu", description="the routed experts' GLU: silu(gate) * up, or swiglu_clamped (gpt-oss: gate clamped "
        "above at swiglu_limit, up to +-swiglu_limit, (up + 1) * gate * sigmoid(swiglu_alpha * gate))"
    )
    swiglu_alpha: float = Field(1.702, gt=0, description="swiglu_clamped's sigmoid gain")
    swiglu_limit: float = Field(7.0, gt=0, description="swiglu_clamped's clamp of gate (above) and up (both sides)")


def dense_sentinel(value):
    """``model.moe`` with ``num_experts: 0`` is a dense model (None): a YAML needs the
    whole ``moe:`` block for ``model.moe.num_experts=8`` to be a valid override. Any other
    MoE setting changed there without experts is an error rather than silently dense."""
    if not isinstance(value, dict) or value.get("num_experts", 1) != 0:
        return value
    defaults = {k: f.default for k, f in MoEConfig.model_fields.items()}
    changed = sorted(k for k, v in value.items() if k != "num_experts" and v != defaults.get(k, v))
    if changed:
        raise ValueError(
            f"num_experts is 0 (a dense model), so {', '.join(changed)} would have no effect; "
            "set model.moe.num_experts >= 1 to add experts"
        )
    return None


def moe_config_problems(moe: MoEConfig, field: str = "model.moe") -> list[Problem]:
    """What makes ``moe`` unroutable, each naming the field and the numbers."""
    e, g = moe.num_experts, moe.n_group
    out = []
    if moe.top_k > e:
        out.append(Problem(f"{field}.top_k", moe.top_k, f"must be <= num_experts ({e})"))
    elif e % g:
        out.append(Problem(f"{field}.n_group", g, f"must divide num_experts ({e})"))
    elif moe.topk_group > g:
        out.append(Problem(f"{field}.topk_group", moe.topk_group, f"must be <= n_group ({g})"))
    elif moe.top_k > moe.topk_group * (e // g):
        allowed = f"must be <= topk_group * num_experts / n_group ({moe.topk_group * (e // g)})"
        out.append(Problem(f"{field}.top_k", moe.top_k, allowed))
    elif g > 1 and moe.scoring_func == "sigmoid" and e // g < 2:
        # NOTE: V3 ranks a group by the sum of its two best scores
        allowed = f"sigmoid groups need >= 2 experts each (num_experts {e})"
        out.append(Problem(f"{field}.n_group", g, allowed))
    elif moe.selection_bias and (moe.scoring_func != "softmax" or g > 1):
        # NOTE: ERNIE 4.5's router is the one that biases a softmax: over all experts, no groups
        allowed = f"selection_bias biases softmax scores over all experts: scoring_func softmax, n_group 1 (got {g})"
        out.append(Problem(f"{field}.scoring_func", moe.scoring_func, allowed))
    elif g > 1 and moe.scoring_func in ("topk_softmax", "topk_sigmoid"):
        # NOTE: gpt-oss's and Llama 4's routers have no groups; a group rule for raw logits would be pcpflow's invention
        allowed = f"{moe.scoring_func} routes over all experts: n_group must be 1"
        out.append(Problem(f"{field}.n_group", g, allowed))
    return out
