"""Where an MoE layer's routed experts run under PCP: ``moe.dispatch``.

- ``local``: each rank routes its own rows against all its experts; no communication.
- ``gather`` (vLLM's ``moe_gathers_tokens``): each PCP rank's rows, padded to the
  gathered size, are all-gathered rank-major; every rank routes all of them (padded rows,
  vLLM's ``moe_is_padding``, reach no expert) and computes their partial sums with its
  ``1/(tp*pcp)`` share of every expert's intermediate units; a reduce-scatter over PCP
  (then an all-reduce over TP) sums the shares and returns each rank its own rows.
- ``all_to_all`` (expert parallelism over the ``tp * pcp`` ranks): rank ``w`` owns experts
  ``[w E/W, (w+1) E/W)``. Each rank routes its rows, sends each real row once to every
  rank owning one of its experts (with its ids and weights), the owners run their
  experts and send each row's partial sum back, where the partials are added. With tp > 1
  the TP ranks of a PCP rank hold the same rows: TP rank 0 dispatches them and
  broadcasts the result to its TP group; the others only serve their experts.

Every collective names its purpose and is priced by ``pcpflow.layouts.accounting`` (section
"mixture of experts"). Per step, ``moe_step_record`` adds to ``metrics.jsonl`` the tokens
per expert (each token once), the rows each rank ran through each expert and the ranks'
load balance (max / mean of their expert rows).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from pcpflow.layouts.accounting import moe_all_to_all_calls
from pcpflow.models.moe import LocalDispatch, MoEMLP, use_dispatch
from pcpflow.parallel.comm import Comm

STATS_KEY = "moe_stats"
# NOTE: verification's routing (pcpflow.rank.routing): ``for_rows(tokens)`` gives the RoutingHook
# a step's forward routes through, told the batch token of each row it routes
ROUTING_KEY = "moe_routing"


class MoEStepStats:
    """One rank's per-step MoE counts, summed over layers: tokens per expert (its
    canonical rows only, so that every token counts once over the ranks) and the rows it
    ran through each expert."""

    def __init__(self, num_experts: int, device: torch.device) -> None:
        self.tokens = torch.zeros(num_experts, dtype=torch.int64, device=device)
        self.rows = torch.zeros(num_experts, dtype=torch.int64, device=device)

    def observe(self, ids: torch.Tensor, canonical: torch.Tensor, rows: torch.Tensor) -> None:
        chosen = ids[canonical]
        self.tokens += torch.bincount(chosen[chosen >= 0], minlength=len(self.tokens))
        self.rows += rows

    def reset(self) -> None:
        self.tokens.zero_()
        self.rows.zero_()


class GatherDispatch:
    def __init__(self, *, pcp: Comm, tp: Comm, world: Comm, is_padding, own_rows, canonical, stats):
        self.pcp, self.tp, self.world = pcp, tp, world
        self.is_padding, self.own_rows = is_padding, own_rows
        self.canonical, self.stats = canonical, stats

    def __call__(self, moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
        rows = self.pcp.all_gather(x, "moe_gather")
        weights, ids = moe.route(rows)
        ids = ids.masked_fill(self.is_padding[:, None], -1)
        share = (self.world.rank, self.world.size)
        out, per_expert = moe.run_experts(rows, ids, weights, part=share)
        self.stats.observe(ids[self.own_rows], self.canonical, per_expert)
        mine = self.pcp.reduce_scatter(out, "moe_reduce_scatter")
        return self.tp.all_reduce(mine, "moe_reduce_scatter")


class AllToAllDispatch:
    def __init__(self, *, tp: Comm, world: Comm, is_padding, canonical, stats) -> None:
        self.tp, self.world = tp, world
        self.is_padding, self.canonical, self.stats = is_padding, canonical, stats

    def __call__(self, moe: MoEMLP, x: torch.Tensor) -> torch.Tensor:
        w, me, k = self.world.size, self.world.rank, moe.moe.top_k
        per_rank = moe.moe.num_experts // w
        weights, ids = moe.route(x)
        ids = ids.masked_fill(self.is_padding[:, None], -1)
        if self.tp.rank != 0:  # NOTE: the same rows as TP rank 0, which dispatches them
            ids = torch.full_like(ids, -1)
        owner = torch.where(ids >= 0, ids // per_rank, -1)
        hits = torch.zeros((len(x), w), dtype=torch.bool, device=x.device)
        valid = owner >= 0
        hits[torch.nonzero(valid, as_tuple=True)[0], owner[valid]] = True
        dest, row = hits.T.nonzero(as_tuple=True)  # by destination, then row
        send_counts = hits.sum(0)
        counts = self.world.all_gather(send_counts, "moe_counts").view(w, w)
        calls = moe_all_to_all_calls(
            counts.cpu().numpy(), hidden_size=x.shape[1], top_k=k, dtype_bytes=x.element_size()
        )
        nbytes = [b for _, b in calls[1:]] if calls else [0, 0, 0]
        send, recv = send_counts.tolist(), counts[:, me].tolist()
        on_dest = owner[row] == dest[:, None]
        meta = torch.cat(
            [torch.where(on_dest, ids[row], -1), torch.where(on_dest, weights[row], 0)], dim=1
        ).to(torch.float64)
        got_x = self.world.all_to_all_v(x[row], send, recv, "moe_dispatch", nbytes[0])
        got_meta = self.world.all_to_all_v(meta, send, recv, "moe_dispatch", nbytes[1])
        mine = range(me * per_rank, (me + 1) * per_rank)
        out, per_expert = moe.run_experts(
            got_x, got_meta[:, :k].long(), got_meta[:, k:].to(weights.dtype), experts=mine
        )
        self.stats.observe(ids, self.canonical, per_expert)
        back = self.world.all_to_all_v(out, recv, send, "moe_combine", nbytes[2])
        y = torch.zeros_like(x).index_add_(0, row, back)
        return self.tp.broadcast(y, 0, "moe_combine")


@contextmanager
def moe_forward(ctx, state) -> Iterator[None]:
    """Install this step's dispatch (``ctx.config.moe.dispatch``) for the model's MoE
    layers during the forward of ``state`` (its layout says which rows are padding)."""
    if "moe_num_experts" not in ctx.extras:
        ctx.extras["moe_num_experts"] = num_experts(ctx.model)
    experts = ctx.extras["moe_num_experts"]
    if not experts:
        yield
        return
    stats = ctx.extras.get(STATS_KEY)
    if stats is None:
        stats = ctx.extras[STATS_KEY] = MoEStepStats(experts, ctx.device)
    layout, dev = state.layout, ctx.device
    tp = getattr(ctx, "tp", None) or Comm.solo()
    own = layout.rank_rows(ctx.pcp_rank)
    first_tp = tp.rank == 0
    canonical = torch.from_numpy(layout.kv_write_mask[own] & first_tp).to(dev)
    local_padding = state.local.is_padding
    mode = ctx.config.moe.dispatch or "local"
    if mode == "local":
        dispatch = LocalDispatch(
            local_padding, lambda _layer, ids, rows: stats.observe(ids, canonical, rows)
        )
    else:
        padding = torch.from_numpy(layout.is_padding).to(dev)
        common = dict(tp=tp, world=ctx.world, is_padding=padding, canonical=canonical, stats=stats)
        if mode == "gather":
            dispatch = GatherDispatch(pcp=ctx.pcp, own_rows=own, **common)
        else:
            common["is_padding"] = local_padding
            dispatch = AllToAllDispatch(**common)
    routing = ctx.extras.get(ROUTING_KEY)
    if routing is not None:
        routing = routing.for_rows(_row_tokens(layout, ctx.pcp_rank, gathered=mode == "gather"))
    with use_dispatch(dispatch, routing):
        yield


def _row_tokens(layout, rank: int, *, gathered: bool) -> np.ndarray:
    """For each row a dispatch routes (this rank's rows, or every rank's when ``gathered``):
    the batch token it is this rank's writer row of, -1 elsewhere (padding, a replicated
    decode's copy, another rank's rows): each token has one such row over the PCP ranks."""
    own = layout.rank_rows(rank)
    mine = np.where(layout.kv_write_mask[own], layout.padded_gather_idx[own], -1)
    if not gathered:
        return mine
    rows = np.full(len(layout.kv_write_mask), -1, dtype=np.int64)
    rows[own] = mine
    return rows


def num_experts(model) -> int:
    """Routed experts of the model's MoE layers (0: a dense model)."""
    return max((m.moe.num_experts for m in model.modules() if isinstance(m, MoEMLP)), default=0)


def moe_step_counts(ctx) -> np.ndarray | None:
    """This step's MoE counts of every rank of ``ctx.world``, ``[W, 2, E]`` (tokens routed to
    each expert, rows each rank ran through each expert; summed over the MoE layers), or None
    for a model without experts. A collective over ``ctx.world``: every rank of it calls it,
    once a step it ran a batch. The all-gather is measurement, not the layout's traffic, and
    is not counted."""
    stats: MoEStepStats | None = ctx.extras.get(STATS_KEY)
    if stats is None:
        return None
    world = Comm(ctx.world.group, ctx.world.rank, ctx.world.size, None)
    both = world.all_gather(torch.stack([stats.tokens, stats.rows])[None], "moe_metrics")
    stats.reset()
    return both.cpu().numpy()


def moe_step_record(ctx) -> dict:
    """This step's MoE metrics (every rank calls it; rank 0's record holds the totals):
    ``moe_tokens_per_expert`` [E], ``moe_expert_rows`` [W][E] (rows each rank ran through
    each expert), ``moe_rank_load`` [W] and ``moe_load_balance`` (max / mean of the load),
    from ``moe_step_counts``; the run's sum is kept for ``moe_run_summary``."""
    both = moe_step_counts(ctx)
    if both is None:
        return {}
    run = ctx.extras.get("moe_run")
    ctx.extras["moe_run"] = both if run is None else run + both
    return moe_metrics(both)


def moe_run_summary(ctx) -> dict:
    """The run's MoE metrics (``result.json`` ``metrics``), as ``moe_step_record``'s, summed
    over the steps."""
    run = ctx.extras.get("moe_run")
    return {} if run is None else moe_metrics(run)


def moe_metrics(both: np.ndarray) -> dict:
    """The MoE metrics of counts ``[W, 2, E]`` (``moe_step_counts``, or their sum)."""
    rows = both[:, 1]
    load = rows.sum(axis=1)
    return {
        "moe_tokens_per_expert": both[:, 0].sum(axis=0).tolist(),
        "moe_expert_rows": rows.tolist(),
        "moe_rank_load": load.tolist(),
        "moe_load_balance": float(load.max() / load.mean()) if load.sum() else None,
    }
