"""Mixture-of-experts MLP layers (DeepSeek-V2/V3, GLM-4.5, Qwen2-MoE, Qwen3-MoE, Mixtral, gpt-oss, Llama 4,
Granite, OLMoE), routed exactly as transformers' ``DeepseekV3TopkRouter`` / ``DeepseekV2TopkRouter`` /
``Qwen2MoeTopKRouter`` / ``Qwen3MoeTopKRouter`` / ``MixtralTopKRouter`` / ``GptOssTopKRouter`` /
``Llama4Router`` / ``GraniteMoeTopKRouter`` / ``OlmoeTopKRouter`` do.

V3 (``scoring_func=sigmoid``): scores ``sigmoid(x W^T)``; experts are *selected* on
``scores + e_score_correction_bias``, within the ``topk_group`` groups (of ``n_group``)
whose two best biased scores sum highest; the weights are the unbiased scores of the
chosen experts, normalised to sum 1 when ``norm_topk_prob``, times
``routed_scaling_factor``. V2 (``softmax``): softmax scores, groups ranked by their best
score, the top-k scores are the weights (normalised when ``norm_topk_prob``; transformers'
V2 never normalises, so its checkpoints load with it off), times the scaling factor.
Qwen2-MoE, Qwen3-MoE, Mixtral, Hunyuan-A13B and OLMoE are the softmax path with one group and no scaling
(Mixtral and Hunyuan always normalise; Hunyuan's router logits in float32; OLMoE's weights rounded to the
model's dtype, ``weights_dtype=model``). ERNIE 4.5 is the softmax path with the selection bias
(``selection_bias``: chosen on softmax + ``e_score_correction_bias``, weighted by the unbiased softmax),
logits in float32, renormalised by ``max(sum, norm_min)``, weights rounded to the model's dtype. gpt-oss (``topk_softmax``): the router's logits carry a bias
(``router_bias``); the top-k raw logits are chosen and weighted by their softmax, taken over
those k alone; its experts have biases (``expert_bias``) and a clamped SwiGLU
(``activation=swiglu_clamped``). Granite routes as gpt-oss without the bias, in float32, its
weights rounded to the model's dtype (``weights_dtype=model``). Llama 4 (``topk_sigmoid``): the
top-k raw logits are chosen, each
weighted by its sigmoid (float32, then the model's dtype), and the weight scales the expert's
*input* (``weights_on=input``: ``expert(x * w)``, the outputs summed unweighted). The layer's output is the routed experts' weighted sum plus the shared
experts (Qwen2-MoE's scaled by a sigmoid gate of each row, ``shared_expert_gate``).

A model never sees ranks: *where* the routed experts run is an ``ExpertDispatch`` the
engine installs for the forward (``use_dispatch``; vLLM's forward context does the same
for its MoE runner). Without one a layer routes its own rows against all its experts
(``LOCAL``), which is also what drafters that reuse the target model get.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

import torch
from torch import nn

from pcpflow.models.common import GLU, GatedMLP, narrow_to_float32, swiglu_clamped
from pcpflow.models.moe_config import MoEConfig


def is_moe_layer(moe: MoEConfig | None, layer: int) -> bool:
    """Layers ``>= first_k_dense_replace`` are MoE, every ``moe_layer_freq``-th of them."""
    if moe is None or layer < moe.first_k_dense_replace:
        return False
    return (layer - moe.first_k_dense_replace) % moe.moe_layer_freq == 0


def moe_layers(moe: MoEConfig | None, num_layers: int) -> list[int]:
    return [i for i in range(num_layers) if is_moe_layer(moe, i)]


class TopKRouter(nn.Module):
    """The gate: ``weight [E, hidden]``, the logits' ``bias [E]`` with ``router_bias`` and, for
    sigmoid scoring or ``selection_bias``, the selection bias."""

    def __init__(self, hidden_size: int, moe: MoEConfig):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts)) if moe.router_bias else None
        if moe.scoring_func == "sigmoid" or moe.selection_bias:
            self.e_score_correction_bias = nn.Parameter(torch.empty(moe.num_experts))
        else:
            self.e_score_correction_bias = None

    def seeded_init(self, gen: torch.Generator, gain: float) -> None:
        """``build_seeded``'s rule: weight ``N(0, gain^2 / hidden)``; the selection bias and then
        the logits' bias ``N(0, 0.1^2)`` each (large enough to change which experts win)."""
        e, h = self.weight.shape
        self.weight.copy_(torch.randn((e, h), generator=gen, dtype=torch.float64) * gain / h**0.5)
        if self.e_score_correction_bias is not None:
            bias = 0.1 * torch.randn(e, generator=gen, dtype=torch.float64)
            self.e_score_correction_bias.copy_(bias)
        if self.bias is not None:  # NOTE: drawn last, so a router without one draws as before
            self.bias.copy_(0.1 * torch.randn(e, generator=gen, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, hidden] -> (weights [N, top_k], expert ids [N, top_k])``."""
        return self.select(self.logits(x))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """Router logits ``[N, E]`` (with the bias, if any), as transformers computes them:
        DeepSeek's in float32 from half precision (``router_dtype=float32``), Qwen3-MoE's and
        Mixtral's in the model's dtype and then widened (``model``), so that scores are taken
        from float32 at least; gpt-oss's (``topk_softmax``) in the model's dtype, kept there
        (Granite's, ``weights_dtype=model``, widened)."""
        half = x.dtype in (torch.bfloat16, torch.float16)
        if self.moe.router_dtype == "model":
            logits = self._linear(x, x.dtype)
            # NOTE: GptOssTopKRouter selects and softmaxes in the model's dtype, unwidened
            kept = self.moe.scoring_func == "topk_softmax" and self.moe.weights_dtype == "scores"
            return logits.float() if half and not kept else logits
        dtype = torch.float32 if half else x.dtype
        return self._linear(x.to(dtype), dtype)

    def _linear(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if self.bias is None:
            return x @ self.weight.to(dtype).T
        # NOTE: F.linear with the bias, as GptOssTopKRouter: in half precision the sum is rounded once
        return nn.functional.linear(x, self.weight.to(dtype), self.bias.to(dtype))

    def select(self, logits: torch.Tensor, ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) of router ``logits``: the experts they choose, or ``ids``
        given (weighted by these logits); ``weights_dtype=model``: the weights rounded to the
        model's (the router's own) dtype, as ``GraniteMoeTopKRouter``'s ``type_as``."""
        bias = self.e_score_correction_bias
        bias = None if bias is None else bias.to(logits.dtype)
        if ids is None:
            weights, ids = route(logits, bias, self.moe)
        else:
            weights = _weights(_scores(logits, self.moe).gather(1, ids), self.moe)
        return (weights.to(self.weight.dtype) if self.moe.weights_dtype == "model" else weights), ids


def route(
    logits: torch.Tensor, bias: torch.Tensor | None, moe: MoEConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits ``[N, E]`` -> (weights, expert ids), both ``[N, top_k]``; ``bias``: the
    selection bias (sigmoid routers', ERNIE 4.5's softmax one)."""
    n, e, g = logits.shape[0], moe.num_experts, moe.n_group
    scores = _scores(logits, moe)
    if moe.scoring_func == "sigmoid":
        choice = scores if bias is None else scores + bias
        if g > 1:
            group_scores = choice.view(n, g, e // g).topk(2, dim=-1).values.sum(-1)
            keep = _group_mask(group_scores, moe.topk_group, e // g)
            choice = choice.masked_fill(~keep, float("-inf"))
        ids = choice.topk(moe.top_k, dim=-1).indices
        chosen = scores.gather(1, ids)
    elif bias is not None:  # NOTE: ERNIE 4.5 (moe_statics): chosen on biased scores, weighted by unbiased ones
        ids = (scores + bias).topk(moe.top_k, dim=-1).indices
        chosen = scores.gather(1, ids)
    else:
        if g > 1:
            group_scores = scores.view(n, g, e // g).max(dim=-1).values
            scores = scores.masked_fill(~_group_mask(group_scores, moe.topk_group, e // g), 0.0)
        chosen, ids = scores.topk(moe.top_k, dim=-1)
    return _weights(chosen, moe), ids


def _scores(logits: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """What the experts are chosen by: sigmoid or softmax of the logits; topk_softmax's and
    topk_sigmoid's are the logits."""
    if moe.scoring_func in ("topk_softmax", "topk_sigmoid"):
        return logits
    return logits.sigmoid() if moe.scoring_func == "sigmoid" else logits.softmax(dim=-1)


def _weights(chosen: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """The chosen experts' scores ``[N, top_k]`` -> their weights: normalised when
    ``norm_topk_prob`` (by ``max(sum, norm_min)`` where set), times ``routed_scaling_factor``; topk_softmax's chosen logits: their
    softmax (which sums to 1: ``norm_topk_prob`` does not apply), times the factor; topk_sigmoid's:
    each one's sigmoid (``Llama4Router``: of the logit widened to float32 at least)."""
    if moe.scoring_func == "topk_softmax":
        return chosen.softmax(dim=-1) * moe.routed_scaling_factor
    if moe.scoring_func == "topk_sigmoid":
        return narrow_to_float32(chosen).sigmoid() * moe.routed_scaling_factor
    if moe.norm_topk_prob and moe.norm_min is not None:  # NOTE: Ernie4_5_MoeTopKRouter's clamp
        chosen = chosen / chosen.sum(dim=-1, keepdim=True).clamp(min=moe.norm_min)
    elif moe.norm_topk_prob:
        chosen = chosen / (chosen.sum(dim=-1, keepdim=True) + 1e-20)
    return chosen * moe.routed_scaling_factor


def _group_mask(group_scores: torch.Tensor, topk_group: int, group_size: int) -> torch.Tensor:
    """``[N, E]`` bool: the experts inside each row's ``topk_group`` best groups."""
    keep = torch.zeros_like(group_scores, dtype=torch.bool)
    keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
    return keep.repeat_interleave(group_size, dim=1)


def expert_slice(i: int, part: int, parts: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of an ``i``-wide intermediate dimension that part ``part`` of
    ``parts`` computes (as even as can be; a part may be empty when ``i < parts``)."""
    return i * part // parts, i * (part + 1) // parts


def sliced_mlp(mlp: GatedMLP, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """``mlp(x)``'s share from intermediate units ``[lo, hi)``: summed over a partition of
    the units, the shares give ``mlp(x)``. Gate and up biases are sliced with their units;
    down's bias is added by the one share that holds unit 0 (``lo == 0 < hi``), so exactly
    once per partition, and never by an empty share (``expert_slice`` may start one at 0)."""
    i = mlp.down_proj.in_features
    if (lo, hi) == (0, i):
        return mlp(x)
    w, b = mlp.gate_up_proj.weight, mlp.gate_up_proj.bias
    gate, up = x @ w[lo:hi].T, x @ w[i + lo : i + hi].T
    if b is not None:
        gate, up = gate + b[lo:hi], up + b[i + lo : i + hi]
    out = mlp.glu(gate, up) @ mlp.down_proj.weight[:, lo:hi].T
    if mlp.down_proj.bias is not None and lo == 0 < hi:
        out = out + mlp.down_proj.bias
    return out


class BiasedExpert(GatedMLP):
    """A routed expert with biases (``expert_bias``): ``x @ W^T + b``, the bias added to the
    rounded product, as transformers' ``GptOssExperts`` (and ``sliced_mlp``) compute it.
    NOTE: nn.Linear fuses the add (one rounding): in bf16 most outputs would differ by an ulp."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up_proj, down_proj = self.gate_up_proj, self.down_proj
        gate, up = (x @ up_proj.weight.T + up_proj.bias).chunk(2, dim=-1)
        return self.glu(gate, up) @ down_proj.weight.T + down_proj.bias


def expert_glu(moe: MoEConfig) -> GLU | None:
    """The routed experts' GLU (None: ``GatedMLP``'s default, SiLU)."""
    if moe.activation == "swiglu_clamped":
        return functools.partial(swiglu_clamped, alpha=moe.swiglu_alpha, limit=moe.swiglu_limit)
    return None


class MoEMLP(nn.Module):
    """Router, routed experts and shared experts of one layer (transformers'
    ``DeepseekV3MoE``); the routed part runs where the installed dispatch says."""

    def __init__(self, hidden_size: int, intermediate_size: int, moe: MoEConfig, layer: int):
        super().__init__()
        self.moe, self.layer = moe, layer
        width = moe.intermediate_size or intermediate_size
        self.intermediate_size = width
        self.gate = TopKRouter(hidden_size, moe)
        expert, glu = BiasedExpert if moe.expert_bias else GatedMLP, expert_glu(moe)
        self.experts = nn.ModuleList(
            expert(hidden_size, width, bias=moe.expert_bias, glu=glu) for _ in range(moe.num_experts)
        )
        shared = width * moe.num_shared_experts
        self.shared_experts = GatedMLP(hidden_size, shared) if shared else None
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False) if shared and moe.shared_expert_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routed = (_DISPATCH.get() or LOCAL)(self, x)
        if self.shared_experts is None:
            return routed
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:  # Qwen2-MoE: one learned logit per row
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return routed + shared

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) of rows ``x`` (``[N, top_k]`` each), through the installed
        ``RoutingHook`` if any."""
        hook = _ROUTING.get()
        if hook is None:
            return self.gate(x)
        return hook(self, self.gate.logits(x))

    def run_experts(
        self,
        x: torch.Tensor,
        ids: torch.Tensor,
        weights: torch.Tensor,
        experts: range | None = None,
        part: tuple[int, int] = (0, 1),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The weighted sum over ``experts`` (default all) of each row's chosen experts, each
        computed on its intermediate share ``part`` = (k, n), and the rows each expert
        received (``[E]`` int64). ``ids`` -1 chooses no expert (padding). ``weights_on=input``
        (Llama 4): each expert runs on its rows scaled by their weights (rounded to the rows'
        dtype first, as ``Llama4Router`` rounds its scores) and its outputs are summed as they are."""
        out = torch.zeros_like(x)
        rows_per_expert = torch.zeros(self.moe.num_experts, dtype=torch.int64, device=x.device)
        if not len(x):
            return out, rows_per_expert
        chosen = ids[ids >= 0]
        rows_per_expert += torch.bincount(chosen, minlength=self.moe.num_experts)
        lo, hi = expert_slice(self.intermediate_size, *part)
        hit = torch.zeros(self.moe.num_experts, dtype=torch.bool)
        hit[chosen.cpu()] = True
        for e in experts if experts is not None else range(self.moe.num_experts):
            if not hit[e] or hi == lo:
                continue
            row, slot = (ids == e).nonzero(as_tuple=True)
            w = weights[row, slot, None]
            if self.moe.weights_on == "input":
                y = sliced_mlp(self.experts[e], x[row] * w.to(x.dtype), lo, hi)
            else:
                y = sliced_mlp(self.experts[e], x[row], lo, hi) * w
            out.index_add_(0, row, y.to(out.dtype))
        if experts is not None:
            outside = torch.ones(self.moe.num_experts, dtype=torch.bool, device=x.device)
            outside[experts.start : experts.stop] = False
            rows_per_expert[outside] = 0
        return out, rows_per_expert


class RoutingHook(Protocol):
    def __call__(self, moe: MoEMLP, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, expert ids) of the rows whose router logits are ``logits`` (``[N, E]``)."""
        ...


class ExpertDispatch(Protocol):
    def __call__(self, moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
        """The routed experts' output for this rank's rows ``x`` (``[N, hidden]``)."""
        ...


class LocalDispatch:
    """Route this rank's rows against all experts, here (``moe.dispatch=local``); rows
    flagged in ``is_padding`` reach no expert. ``on_experts(layer, ids, rows_per_expert)``
    observes each layer's routing (metrics)."""

    def __init__(self, is_padding: torch.Tensor | None = None, on_experts=None) -> None:
        self.is_padding, self.on_experts = is_padding, on_experts

    def __call__(self, moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
        weights, ids = moe.route(x)
        if self.is_padding is not None:
            ids = ids.masked_fill(self.is_padding[:, None], -1)
        out, rows = moe.run_experts(x, ids, weights)
        if self.on_experts is not None:
            self.on_experts(moe.layer, ids, rows)
        return out


LOCAL = LocalDispatch()
_DISPATCH: ContextVar[ExpertDispatch | None] = ContextVar("pcpflow_moe_dispatch", default=None)
_ROUTING: ContextVar[RoutingHook | None] = ContextVar("pcpflow_moe_routing", default=None)


@contextmanager
def use_dispatch(dispatch: ExpertDispatch | None, routing: RoutingHook | None = None) -> Iterator[None]:
    """Run the MoE layers of forwards inside the block through ``dispatch``, and route
    their rows through ``routing`` if given (verification: ``pcpflow.rank.routing``)."""
    token, routing_token = _DISPATCH.set(dispatch), _ROUTING.set(routing)
    try:
        yield
    finally:
        _ROUTING.reset(routing_token)
        _DISPATCH.reset(token)


def build_mlp(
    moe: MoEConfig | None, layer: int, hidden_size: int, intermediate_size: int
) -> MoEMLP | None:
    """Layer ``layer``'s MoE block, or None where the layer is dense."""
    if not is_moe_layer(moe, layer):
        return None
    return MoEMLP(hidden_size, intermediate_size, moe, layer)
