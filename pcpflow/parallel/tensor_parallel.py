"""Tensor parallelism: each TP rank keeps its slice of a full model, and the checks that
say which slices exist.

A model is built whole (seeded, or loaded from a checkpoint) on every rank, then
``shard_model`` cuts it in place to this TP rank's part, so the TP model *is* the tp=1
model with its matrices partitioned (Megatron's scheme):

- attention: query heads split over TP (column-parallel QKV; MLA's ``q_proj`` / ``q_b_proj``
  and ``kv_b_proj`` by heads); GQA's KV heads split when ``tp`` divides them, replicated
  (``tp / num_kv_heads`` ranks share one) when ``num_kv_heads`` divides ``tp``; MLA's
  latent (``q_a``, ``kv_a``, their norms) is shared by all heads and stays whole;
- MLP: ``gate_up_proj`` (a plain MLP's ``up_proj``) column-parallel, ``down_proj`` row-parallel;
- ``o_proj`` and ``down_proj`` become ``RowParallelLinear``: a partial product, one
  all-reduce over TP (``tp_all_reduce``), then the bias once;
- embedding, norms and LM head replicated (every TP rank computes the logits itself).

``AttentionSpec`` becomes the local one (this rank's heads; a GQA cache entry holds only
its KV heads), kept beside the full one as ``full_attn_spec`` (the verifier compares the
cache columns a rank owns with the single-rank reference's).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from pcpflow.errors import Problem
from pcpflow.models.base import AttentionSpec
from pcpflow.models.common import DecoderLayer, GatedMLP, PlainMLP, RMSNorm, narrow_to_float32
from pcpflow.models.layers import GQAAttention, MLAAttention

TP_ALL_REDUCE = "tp_all_reduce"
"""Purpose of the row-parallel all-reduces (two per decoder layer: attention and MLP)."""

TP_QK_NORM = "tp_qk_norm"
"""Purpose of the all-reduces of a full-width q/k norm's sums of squares (OLMo 2: two per layer)."""


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x @ W_t^T) + b``: this rank's input columns ``W_t`` of a linear
    layer whose input is split over TP; the bias is added once, after the sum."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, comm) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(nn.functional.linear(x, self.weight), TP_ALL_REDUCE)
        return y if self.bias is None else y + self.bias


class ShardedRMSNorm(nn.Module):
    """An RMS norm over a width split by heads over TP (OLMo 2's q/k norms): this rank's
    columns of ``weight``; the mean square is the whole width's, from every rank's sum of
    squares (one all-reduce of one number a row). ``shared``: how many TP ranks hold each of
    these columns (GQA KV heads replicated when tp exceeds them), whose sums count once."""

    def __init__(self, norm: RMSNorm, columns: torch.Tensor, comm, shared: int) -> None:
        super().__init__()
        self.norm, self.comm, self.shared = norm, comm, shared
        self.width = norm.weight.numel()
        norm.weight = nn.Parameter(norm.weight.data.index_select(0, columns.to(norm.weight.device)), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = narrow_to_float32(x)
        squares = self.comm.all_reduce(h.pow(2).sum(-1, keepdim=True), TP_QK_NORM)
        mean = squares / (self.shared * self.width)
        return self.norm.scaled(h * torch.rsqrt(mean + self.norm.eps), x.dtype)


# -------------------------------------------------------------------- which slices


def kv_heads_of(tp_rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The GQA KV heads TP rank ``tp_rank`` holds: its ``num_kv_heads / tp`` heads, or the
    one head it shares with ``tp / num_kv_heads - 1`` neighbours."""
    if num_kv_heads % tp_size == 0:
        n = num_kv_heads // tp_size
        return range(tp_rank * n, (tp_rank + 1) * n)
    share = tp_size // num_kv_heads
    return range(tp_rank // share, tp_rank // share + 1)


def local_spec(spec: AttentionSpec, tp_rank: int, tp_size: int) -> AttentionSpec:
    """The ``AttentionSpec`` of one TP rank's heads. MLA (values are the shared latent,
    ``v_offset == 0``) keeps its entry; GQA keeps only its KV heads' keys and values."""
    heads = spec.num_heads // tp_size
    if spec.v_offset == 0:
        return dataclasses.replace(spec, num_heads=heads)
    kv = len(kv_heads_of(tp_rank, tp_size, spec.num_kv_heads))
    width = kv * spec.qk_dim
    return dataclasses.replace(
        spec, num_heads=heads, num_kv_heads=kv, v_offset=width, entry_dim=width + kv * spec.v_dim
    )


def entry_columns(spec: AttentionSpec, tp_rank: int, tp_size: int) -> torch.Tensor:
    """Columns of a full cache entry that TP rank ``tp_rank``'s entry holds, in its order."""
    if spec.v_offset == 0 or tp_size == 1:
        return torch.arange(spec.entry_dim)
    heads = torch.tensor(list(kv_heads_of(tp_rank, tp_size, spec.num_kv_heads)))
    k = (heads[:, None] * spec.qk_dim + torch.arange(spec.qk_dim)).flatten()
    v = (spec.v_offset + heads[:, None] * spec.v_dim + torch.arange(spec.v_dim)).flatten()
    return torch.cat([k, v])


# -------------------------------------------------------------------- cutting a model


def shard_model(module: nn.Module, comm, tp_rank: int, tp_size: int) -> nn.Module:
    """Cut every decoder layer of ``module`` (a target model or a drafter) to TP rank
    ``tp_rank`` of ``tp_size`` in place; its ``attn_spec`` becomes the local one. ``comm``
    is the TP group the row-parallel layers all-reduce over."""
    if tp_size == 1:
        return module
    for layer in [m for m in module.modules() if isinstance(m, DecoderLayer)]:
        shard_attention(layer.self_attn, comm, tp_rank, tp_size)
        layer.mlp = shard_mlp(layer.mlp, comm, tp_rank, tp_size)
    spec = getattr(module, "attn_spec", None)
    if spec is not None:
        module.full_attn_spec = spec
        module.attn_spec = local_spec(spec, tp_rank, tp_size)
    return module


def shard_mlp(mlp: nn.Module, comm, tp_rank: int, tp_size: int) -> nn.Module:
    """The one place an MLP is split over TP. A MoE block stays whole on every TP rank:
    ``moe.dispatch`` places its experts (gather: an intermediate share per tp*pcp rank;
    all_to_all: experts owned by ranks; local: all of them, on rows every TP rank holds)."""
    from pcpflow.models.moe import MoEMLP

    if isinstance(mlp, MoEMLP):
        return mlp
    if not isinstance(mlp, (GatedMLP, PlainMLP)):
        raise TypeError(f"no tensor-parallel split for {type(mlp).__name__}")
    inner = mlp.down_proj.in_features
    width = inner // tp_size
    cols = torch.arange(tp_rank * width, (tp_rank + 1) * width)
    if isinstance(mlp, PlainMLP):
        _keep_rows(mlp.up_proj, cols)
    else:
        _keep_rows(mlp.gate_up_proj, torch.cat([cols, inner + cols]))
    mlp.down_proj = _row_parallel(mlp.down_proj, cols, comm)
    return mlp


def shard_attention(attn: nn.Module, comm, tp_rank: int, tp_size: int) -> None:
    if isinstance(attn, GQAAttention):
        heads, hd = attn.num_heads // tp_size, attn.head_dim
        kv = kv_heads_of(tp_rank, tp_size, attn.num_kv_heads)
        q_rows = _head_rows(range(tp_rank * heads, (tp_rank + 1) * heads), hd)
        _keep_rows(attn.q_proj, q_rows)
        _keep_rows(attn.k_proj, _head_rows(kv, hd))
        _keep_rows(attn.v_proj, _head_rows(kv, hd))
        if attn.full_qk_norm:
            attn.q_norm = ShardedRMSNorm(attn.q_norm, q_rows, comm, 1)
            attn.k_norm = ShardedRMSNorm(attn.k_norm, _head_rows(kv, hd), comm, _kv_share(tp_size, attn.num_kv_heads))
        attn.o_proj = _row_parallel(attn.o_proj, q_rows, comm)
        if attn.sinks is not None:  # NOTE: one logit per query head: cut as the heads are
            mine = torch.arange(tp_rank * heads, (tp_rank + 1) * heads, device=attn.sinks.device)
            attn.sinks = nn.Parameter(attn.sinks.data.index_select(0, mine), requires_grad=False)
        attn.num_heads, attn.num_kv_heads = heads, len(kv)
    elif isinstance(attn, MLAAttention):
        heads = attn.num_heads // tp_size
        mine = range(tp_rank * heads, (tp_rank + 1) * heads)
        q = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
        _keep_rows(q, _head_rows(mine, attn.nope_dim + attn.rope_dim))
        _keep_rows(attn.kv_b_proj, _head_rows(mine, attn.nope_dim + attn.v_dim))
        attn.o_proj = _row_parallel(attn.o_proj, _head_rows(mine, attn.v_dim), comm)
        attn.num_heads = heads
    else:
        raise TypeError(f"no tensor-parallel split for {type(attn).__name__}")


def _head_rows(heads: range, width: int) -> torch.Tensor:
    return (torch.tensor(list(heads))[:, None] * width + torch.arange(width)).flatten()


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    """Column parallel: keep output features ``rows`` of ``linear``."""
    rows = rows.to(linear.weight.device)
    linear.weight = nn.Parameter(linear.weight.data.index_select(0, rows), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.data.index_select(0, rows), requires_grad=False)
    linear.out_features = int(rows.numel())


def _row_parallel(linear: nn.Linear, cols: torch.Tensor, comm) -> RowParallelLinear:
    weight = linear.weight.data.index_select(1, cols.to(linear.weight.device))
    bias = None if linear.bias is None else linear.bias.data.clone()
    return RowParallelLinear(weight, bias, comm)


# -------------------------------------------------------------------- what is allowed


def run_tp_problems(cfg) -> list[Problem]:
    """``tp_problems`` of a run's target model (a drafter checks its own layers, and the
    forward stage its DCP path: their stages' ``check_run``)."""
    if cfg.tp == 1:
        return []
    try:
        heads, kv, inner = model_shape(cfg.model)
    except ValueError:
        return []  # the model's own validation reports an unreadable checkpoint
    return tp_problems(cfg.grid, num_heads=heads, num_kv_heads=kv, intermediate_size=inner)


def tp_problems(
    grid,
    *,
    num_heads: int,
    num_kv_heads: int | None,
    intermediate_size: int,
    what: str = "the model",
) -> list[Problem]:
    """Everything that stops ``what`` from splitting over ``grid.tp`` ranks (and its DCP
    over TP ranks), naming the numbers. ``num_kv_heads`` None: MLA (one latent shared by
    all heads, so any DCP). GQA takes DCP over TP ranks only where they hold the same KV
    heads (vLLM's rule: dcp within TP <= tp / num_kv_heads)."""
    tp = grid.tp
    if tp == 1:
        return []

    def splits(t: int) -> tuple[list[str], bool]:
        divides = [f"num_heads ({num_heads})"] * bool(num_heads % t)
        divides += [f"MLP width intermediate_size ({intermediate_size})"] * bool(intermediate_size % t)
        return divides, num_kv_heads is not None and bool(num_kv_heads % t) and bool(t % num_kv_heads)

    divides, kv_bad = splits(tp)
    if divides or kv_bad:
        why = [f"must divide {what}'s {' and '.join(divides)}"] * bool(divides)
        why += [f"{what}'s num_kv_heads ({num_kv_heads}) must be a multiple of tp or divide it"] * kv_bad
        allowed = [t for t in range(1, num_heads + 1) if splits(t) == ([], False)]
        return [Problem("tp", tp, f"{'; '.join(why)}; allowed: {allowed}")]
    p: list[Problem] = []
    if num_kv_heads is None:
        return p
    if _kv_share(tp, num_kv_heads) % grid.dcp_tp:
        p.append(
            Problem(
                "dcp",
                grid.dcp,
                f"this dcp spans {grid.dcp_tp} TP ranks, which must hold the same KV heads; "
                f"{what} has num_kv_heads={num_kv_heads} over tp={tp}, so "
                f"{_kv_share(tp, num_kv_heads)} rank(s) share each (dcp within TP <= "
                f"tp/num_kv_heads); the largest dcp that works is {largest_gqa_dcp(grid, num_kv_heads)}",
            )
        )
    return p


def _kv_share(tp: int, num_kv_heads: int) -> int:
    """TP ranks that hold the same GQA KV heads."""
    return max(1, tp // num_kv_heads)


def largest_gqa_dcp(grid, num_kv_heads: int) -> int:
    """The largest dcp ``grid`` allows whose TP ranks share their KV heads."""
    share = _kv_share(grid.tp, num_kv_heads)
    return max(
        d for d in grid.allowed_dcp() if share % dataclasses.replace(grid, dcp=d).dcp_tp == 0
    )


def model_shape(model_cfg) -> tuple[int, int | None, int]:
    """(query heads, GQA KV heads or None for MLA, MLP width) of a model config."""
    if model_cfg.name == "hf":
        from pcpflow.models.hf_registry import read_checkpoint

        c = read_checkpoint(model_cfg.path or "")
        kv = getattr(c, "kv_heads", None)
        return c.num_attention_heads, kv, c.intermediate_size
    kv = getattr(model_cfg, "num_kv_heads", None)
    return model_cfg.num_heads, kv, model_cfg.intermediate_size
