"""The price of one step on one hardware profile: a roofline per rank for the GEMMs and
the attention, an alpha-beta model per collective, the step as long as its slowest rank.

Per PCP rank (its TP ranks hold the same rows and split heads and MLP, so they cost the
same) and step, with N the rank's padded rows and S the sampled rows:

- GEMMs: ``2 * dense_params * N / tp`` FLOPs (+ the LM head on S rows, + MLA's expansion
  of the cached context a prefill reads, + the MoE blocks where ``moe.dispatch`` runs
  them: ``_moe_gemm``) at ``peak[weights_dtype] * gemm_efficiency``; HBM: every weight the
  step touches once (MoE: the experts the routed rows reach, in expectation), at
  ``hbm_tbps * hbm_efficiency``; the slower of the two.
- attention: the (query, key) pairs of the rank's busiest DCP shard (``_busiest_shard``;
  ``attention_work`` with DCP inside PCP), ``2 * heads/tp * dcp_tp * (qk + v)`` FLOPs
  each at ``peak.bf16 * attention_efficiency``; HBM: a decode row reads its keys once, a prefill row once per
  128-row query tile (FlashAttention); the slower of the two.
- collectives: the executed run's own list (``pcpflow.layouts.accounting.grid_step_collectives``:
  PCP/DCP, TP and MoE; ``all_to_all`` MoE rows from uniform routing), each
  ``hops * latency + group_bytes / (n * busbw)`` (nccl-tests' bus bandwidth: (n-1)/n of
  the data for all-gather and all-to-all, 2(n-1)/n for all-reduce; hops n-1, 2(n-1)) on
  NVLink when the group sits in one node, else through the NICs of its GPUs in each node
  (``Placement``: TP innermost, one NIC per GPU).
- overlap ``ring``: the exchange before attention (kv_gather, dcp_query_gather,
  dcp_context_gather) runs as n-1 ring hops, hop i hidden behind the attention of chunk
  i-1; the n partial outputs are written and merged once at the end (HBM-bound, Meta's
  sec. 3.5.2), and each iteration of every layer costs ``ring_step_us`` that nothing
  hides (fitted; not in a replayed full CUDA graph):
  ``attention/n + max(exchange, attention*(n-1)/n) + merges + ring steps``; ``none``:
  attention and exchange one after the other (one attention over the gathered KV).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from pcpflow.config.hardware import HardwareConfig, Link, SimulateConfig
from pcpflow.layouts.accounting import (
    attention_work,
    grid_step_collectives,
    moe_all_to_all_calls,
    moe_all_to_all_rows,
    moe_all_to_all_step_traffic,
    moe_uniform_send_rows,
    step_traffic,
)
from pcpflow.layouts.slots import dcp_local_seq_lens
from pcpflow.parallel.grid import RankGrid
from pcpflow.simulate.sizes import DTYPE_BYTES, ModelSizes

EXCHANGE_PURPOSES = ("kv_gather", "dcp_query_gather", "dcp_context_gather")
"""Collectives that bring a layer's attention its inputs: what a ring overlaps."""
FLASH_QUERY_TILE = 128  # query rows that share one read of a key tile (FlashAttention-2/3)
ACTIVATION_BYTES = 2  # KV reads and ring merges in bf16 (as a GPU serves); collectives at the run dtype


class Placement:
    """Which links each group crosses: TP innermost, ``gpus_per_node`` per node, one NIC per
    GPU. A group whose ranks share a node talks over NVLink. A group spread over nodes with
    ``k`` of its ranks in each drives those ``k`` GPUs' NICs at once: NCCL runs one ring per
    NIC, so a ring collective's bus bandwidth is ``k`` NICs' (nccl-tests#160: on several
    nodes "the busbw is going to reflect exactly what's going through the NICs"), at most
    NVLink's; an all-to-all sends the ``(n-k)/n`` of its data bound off the node through the
    sender's NIC and the rest over NVLink, at once (``_spread_link``). A CP group (one GPU
    per node, ``k = 1``) gets one NIC."""

    def __init__(self, grid: RankGrid, hw: HardwareConfig) -> None:
        self.grid, self.hw = grid, hw
        members = {"tp": grid.tp_members(0), "pcp": grid.pcp_members(0), "dcp": grid.dcp_members(0),
                   "dcp_heads": grid.dcp_heads_members(0), "world": list(range(grid.world_size))}
        self.sizes = {g: len(m) for g, m in members.items()}
        self.per_node = {g: Counter(r // hw.gpus_per_node for r in m) for g, m in members.items()}
        self._links: dict[tuple[str, str], Link] = {}

    def link(self, group: str, op: str = "all_gather") -> Link:
        """The link (bus bandwidth and per-hop latency) one ``op`` over ``group`` runs at."""
        key = (group, "all_to_all" if op == "all_to_all" else "ring")
        if key not in self._links:
            nodes = self.per_node[group]
            self._links[key] = (self.hw.nvlink if len(nodes) == 1
                                else _spread_link(op, self.sizes[group], max(nodes.values()), self.hw))
        return self._links[key]

    def size(self, group: str) -> int:
        return self.sizes[group]


def _spread_link(op: str, n: int, k: int, hw: HardwareConfig) -> Link:
    """nccl-tests' bus bandwidth of ``op`` over ``n`` ranks on several nodes, ``k`` per node.
    Ring collectives: ``min(k * NIC, NVLink)``. All-to-all (busbw = (n-1)/n of the data over
    the time): off-node ``(n-k)/n`` through the NIC while ``(k-1)/n`` crosses NVLink."""
    net, nvl = hw.network.busbw_gbps, hw.nvlink.busbw_gbps
    if op == "all_to_all":
        bw = (n - 1) / (n - k) * net if k == 1 else min((n - 1) / (n - k) * net, (n - 1) / (k - 1) * nvl)
    else:
        bw = min(k * net, nvl) if k > 1 else net
    return Link(busbw_gbps=bw, latency_us=hw.network.latency_us)


@dataclass
class StepPrice:
    step_s: float
    compute_s: np.ndarray  # [P] per PCP rank: roofline parts bound by FLOPs
    memory_s: np.ndarray  # [P]: parts bound by HBM
    communication_s: np.ndarray  # [P]: collective time not hidden
    purpose_s: dict[str, float] = field(default_factory=dict)  # slowest rank: gemm, attention, each collective
    flops: np.ndarray | None = None  # [P]
    hbm_bytes: np.ndarray | None = None  # [P]


def collective_seconds(op: str, group_bytes: float, n: int, link) -> float:
    """nccl-tests' alpha-beta time of one collective moving ``group_bytes`` (pcpflow's
    count: what every rank receives, summed over the group) among ``n`` ranks."""
    if n <= 1:
        return 0.0
    hops = 2 * (n - 1) if op == "all_reduce" else n - 1
    return hops * link.latency_us * 1e-6 + group_bytes / (n * link.busbw_gbps * 1e9)


@dataclass
class StepCounts:
    """One step as the executed run counts it, and what pricing needs beside."""

    pairs: np.ndarray  # per-rank attention pairs as the executed run records them (per PCP rank, layout_dcp)
    work: np.ndarray  # [P] pairs the busiest DCP shard of each PCP rank scores (what its time waits for)
    decode_work: np.ndarray  # [P] their decode part
    calls: dict[str, int]  # collective calls by purpose (one TP rank's view: every rank issues the same)
    nbytes: dict[str, int]  # bytes by purpose, the whole job's (as ``CommStats`` counts them)
    priced: list[tuple[str, str, str, int, int]]  # (purpose, op, group, calls, bytes of one group)
    expected: tuple[str, ...] = ()  # purposes whose bytes are the expected-uniform routing's, not a count


ROUTED_PURPOSES = ("moe_dispatch", "moe_combine")
"""all_to_all purposes whose executed bytes follow the router's choices (data-dependent)."""


def step_counts(batch, layout, *, grid: RankGrid, sizes: ModelSizes, dtype_bytes: int, dcp_rest,
                interleave: int, restore: str, dcp_comm_backend: str = "ag_rs",
                moe_dispatch: str = "local") -> StepCounts:
    """What the executed run counts for this step, through ``pcpflow.layouts.accounting``
    (``grid_step_collectives``: PCP/DCP, TP and MoE layers). ``all_to_all`` MoE bytes
    depend on the routing a simulation does not have: they are the expected bytes of
    uniform top-k routing (``moe_uniform_send_rows``), flagged in ``expected``."""
    shape = sizes.shape_per_rank(grid.tp, dtype_bytes)
    layout_dcp = grid.layout_dcp
    pairs = attention_work(layout, batch.positions, dcp_size=layout_dcp, interleave=interleave, dcp_rest=dcp_rest.mode)
    decode = ~batch.is_prefilling[batch.req_indices]
    work = _busiest_shard(layout, batch.positions, grid, interleave, dcp_rest.mode, None)
    decode_work = (work if decode.all() else np.zeros_like(work) if not decode.any()
                   else _busiest_shard(layout, batch.positions, grid, interleave, dcp_rest.mode, decode))
    moe_layers = sizes.num_moe_layers if sizes.num_experts else 0
    colls = grid_step_collectives(
        layout, batch.logits_indices, tp_size=grid.tp, dcp_size=grid.dcp, shape=shape, dcp_rest=dcp_rest,
        restore=restore, backend=dcp_comm_backend, num_moe_layers=moe_layers, moe_dispatch=moe_dispatch,
    )
    calls, nbytes = step_traffic(colls, pcp_size=grid.pcp, dcp_size=grid.dcp, dtype_bytes=dtype_bytes, tp_size=grid.tp)
    group_size = {"pcp": grid.pcp, "dcp": grid.dcp, "tp": grid.tp, "dcp_heads": len(grid.dcp_heads_members(0))}
    priced = [(c.purpose, c.op, c.group, n, c.nbytes(group_size[c.group], dtype_bytes))
              for c, n in Counter(colls).items() if group_size[c.group] > 1]
    expected: tuple[str, ...] = ()
    if moe_layers and moe_dispatch == "all_to_all" and grid.world_size > 1:
        send = moe_uniform_send_rows(
            moe_all_to_all_rows(layout.per_rank_num_tokens, grid.tp), top_k=sizes.top_k,
            num_experts=sizes.num_experts, num_ranks=grid.world_size,
        )
        a2a_calls, a2a_bytes = moe_all_to_all_step_traffic(
            np.rint(send), num_moe_layers=moe_layers, padded_num_tokens=layout.padded_num_tokens, tp_size=grid.tp,
            hidden_size=sizes.hidden_size, top_k=sizes.top_k, dtype_bytes=dtype_bytes,
        )
        for k in a2a_calls:
            calls[k] = calls.get(k, 0) + a2a_calls[k]
            nbytes[k] = nbytes.get(k, 0) + a2a_bytes[k]
        for k, b in moe_all_to_all_calls(np.rint(send), hidden_size=sizes.hidden_size, top_k=sizes.top_k,
                                         dtype_bytes=dtype_bytes):
            priced.append((k, "all_gather" if k == "moe_counts" else "all_to_all", "world", moe_layers, b))
        if grid.tp > 1:  # TP rank 0 broadcasts the combined rows (counted exactly: N x hidden)
            bcast = layout.padded_num_tokens * sizes.hidden_size * dtype_bytes * (grid.tp - 1)
            priced.append(("moe_combine", "broadcast", "tp", moe_layers, bcast))
        expected = ROUTED_PURPOSES
    return StepCounts(pairs, work, decode_work, calls, nbytes, priced, expected)


def price_step(batch, layout, counts: StepCounts, *, place: Placement, sizes: ModelSizes, sim: SimulateConfig,
               moe_dispatch: str = "local", graphed: bool = False) -> StepPrice:
    """``graphed``: the step replays a full CUDA graph (``cudagraph.dispatch``), so its
    ring loop pays no ``ring_step_us``."""
    grid, hw = place.grid, place.hw
    P, tp = grid.pcp, grid.tp
    pairs = counts.work.astype(np.float64)
    decode_pairs = counts.decode_work.astype(np.float64)
    prefill_pairs = pairs - decode_pairs
    rows = float(layout.padded_num_tokens)
    samples = float(len(batch.logits_indices))

    # GEMMs (every rank computes its padded rows; the LM head runs on the sampled rows;
    # MoE layers where moe.dispatch puts their experts).
    w_bytes = DTYPE_BYTES[sim.weights_dtype]
    gemm_flops = 2.0 * (sizes.dense_params_per_row() * rows + sizes.vocab_size * sizes.hidden_size * samples) / tp
    gemm_flops = np.full(P, gemm_flops) + 2.0 * sizes.num_layers * sizes.kv_b_params * _prefill_context(batch, layout, grid) / tp
    moe_flops, moe_params = _moe_gemm(sizes, moe_dispatch, layout, grid)
    gemm_flops = gemm_flops + moe_flops
    weight_bytes = (sizes.dense_params_per_row() * w_bytes + sizes.vocab_size * sizes.hidden_size * 2) / tp
    weight_bytes = weight_bytes + moe_params * w_bytes
    gemm_c = gemm_flops / (hw.peak_tflops.fp8 if sim.weights_dtype == "fp8" else hw.peak_tflops.bf16) / 1e12 / sim.gemm_efficiency
    gemm_m = weight_bytes / (hw.hbm_tbps * 1e12 * sim.hbm_efficiency)

    # Attention (bf16 kernel); heads split by tp, gathered back over a DCP group's TP part.
    heads = sizes.num_heads / tp * grid.dcp_tp
    attn_flops = 2.0 * heads * sizes.num_layers * (
        prefill_pairs * (sizes.prefill_qk_dim + sizes.prefill_v_dim)
        + decode_pairs * (sizes.decode_qk_dim + sizes.decode_v_dim)
    )
    entry = sizes.entry_dim_per_rank(tp) * ACTIVATION_BYTES * sizes.num_layers
    kv_bytes = entry * (decode_pairs + prefill_pairs / FLASH_QUERY_TILE)
    attn_c = attn_flops / (hw.peak_tflops.bf16 * 1e12 * sim.attention_efficiency)
    attn_m = kv_bytes / (hw.hbm_tbps * 1e12 * sim.hbm_efficiency)
    t_attn = np.maximum(attn_c, attn_m)

    # Collectives: one synchronized sequence, the same on every rank.
    purpose_s: dict[str, float] = {}
    groups: dict[str, str] = {}
    for purpose, op, group, n, group_bytes in counts.priced:
        t = n * collective_seconds(op, group_bytes, place.size(group), place.link(group, op))
        purpose_s[purpose] = purpose_s.get(purpose, 0.0) + t
        groups[purpose] = group
    exchange = sum(v for k, v in purpose_s.items() if k in EXCHANGE_PURPOSES)
    exposed = sum(v for k, v in purpose_s.items() if k not in EXCHANGE_PURPOSES)
    merge = np.zeros(P)
    ring_fixed = 0.0
    if sim.overlap == "ring" and exchange > 0:
        n = max(place.size(groups[k]) for k in purpose_s if k in EXCHANGE_PURPOSES)
        # NOTE: a ring attends chunk by chunk: each of its n partial outputs (and its fp32
        # log-sum-exp) is written, and one merge reads all n and writes the output (arXiv
        # 2411.01783 sec. 3.5.2): 2n + 1 passes, 2n beyond the one output a single call writes.
        merge_bytes = 2 * n * rows * sizes.num_heads / tp * sizes.num_layers * (
            sizes.decode_v_dim * ACTIVATION_BYTES + 4
        )
        merge = np.full(P, merge_bytes / (hw.hbm_tbps * 1e12 * sim.hbm_efficiency))
        # NOTE: each of the n-1 ring iterations of every layer costs a fixed time nothing
        # hides (the fitted ring_step_us); a replayed full graph does not pay it.
        ring_fixed = 0.0 if graphed else (n - 1) * sizes.num_layers * sim.ring_step_us * 1e-6
        attn_phase = t_attn / n + np.maximum(exchange, t_attn * (n - 1) / n) + merge + ring_fixed
    else:
        attn_phase = t_attn + exchange
    t_gemm = np.maximum(gemm_c, gemm_m)
    total = t_gemm + attn_phase + exposed

    compute = np.where(attn_c >= attn_m, t_attn, 0.0) + np.where(gemm_c >= gemm_m, t_gemm, 0.0)
    memory = np.where(attn_c >= attn_m, 0.0, t_attn) + np.where(gemm_c >= gemm_m, 0.0, t_gemm) + merge
    comm = total - compute - memory
    slow = int(np.argmax(total))
    purpose_s = {"gemm": float(t_gemm[slow]), "attention": float(t_attn[slow]), **purpose_s}
    if merge.any():
        purpose_s["ring_merge"] = float(merge[slow])
    if ring_fixed:
        purpose_s["ring_step"] = ring_fixed
    return StepPrice(
        step_s=float(total[slow]),
        compute_s=compute,
        memory_s=memory,
        communication_s=comm,
        purpose_s=purpose_s,
        flops=gemm_flops + attn_flops,
        hbm_bytes=weight_bytes + kv_bytes,
    )


def _busiest_shard(layout, positions, grid: RankGrid, interleave: int, dcp_rest: str, token_mask) -> np.ndarray:
    """[P] (query, key) pairs of the busiest DCP shard of each PCP rank. With DCP inside
    PCP this is ``attention_work``. With DCP over TP ranks every member scores every
    gathered row (all PCP ranks' rows, replicated decodes once per PCP rank, with its
    own heads) over its shard; member ``d = pcp_rank * dcp_tp + tp_local``."""
    if grid.dcp_tp == 1:
        return attention_work(layout, positions, dcp_size=grid.dcp, interleave=interleave, token_mask=token_mask,
                              dcp_rest=dcp_rest)
    skip = layout.is_padding
    if token_mask is not None:
        skip = skip | ~np.asarray(token_mask, dtype=bool)[layout.padded_gather_idx]
    ctx = np.where(skip, 0, positions[layout.padded_gather_idx] + 1)
    member = np.array([dcp_local_seq_lens(ctx, grid.dcp, d, interleave).sum() for d in range(grid.dcp)])
    return member.reshape(-1, grid.dcp_tp).max(axis=1).repeat(grid.pcp // (grid.dcp // grid.dcp_tp))


def _prefill_context(batch, layout, grid: RankGrid) -> np.ndarray:
    """Per PCP rank: cached context tokens its prefill rows read (MLA expands them),
    its DCP share when the KV is sharded."""
    ctx = np.where(batch.is_prefilling, batch.num_computed_tokens, 0)
    if not ctx.any():
        return np.zeros(grid.pcp)
    out = np.zeros(grid.pcp)
    for r, seg in enumerate(layout.segments):
        out[r] = ctx[np.unique(seg.req_idx)].sum()
    return out / grid.dcp


def _experts_touched(sizes: ModelSizes, rows):
    """Routed experts that ``rows`` tokens reach in expectation (uniform top-k routing)."""
    if not sizes.num_experts:
        return 0.0 * np.asarray(rows, dtype=np.float64)
    e, k = sizes.num_experts, sizes.top_k
    return e * (1.0 - (1.0 - k / e) ** np.asarray(rows, dtype=np.float64))


def _moe_gemm(sizes: ModelSizes, dispatch: str, layout, grid: RankGrid) -> tuple[np.ndarray, np.ndarray]:
    """[P] FLOPs and weight parameters read of the MoE layers on one rank of each PCP rank.
    An MoE block is not split over TP (``shard_mlp``): the router and the shared experts
    run whole on every rank's rows. ``local``: each rank runs its real rows through all
    the experts they reach; ``gather``: every rank runs all real rows with a ``1/W`` share
    of each expert; ``all_to_all``: each rank runs the rows sent to its ``E/W`` experts
    (uniform routing: ``1/W`` of all routed rows). ``W = tp * pcp``."""
    P = grid.pcp
    if not sizes.num_experts or not sizes.num_moe_layers:
        return np.zeros(P), np.zeros(P)
    L, x, w = sizes.num_moe_layers, sizes.expert_params, grid.world_size
    real = layout.per_rank_num_tokens.astype(np.float64)
    rows = float(layout.padded_num_tokens) * (P if dispatch == "gather" else 1)  # rows the router scores
    always = (sizes.num_shared_experts * x * float(layout.padded_num_tokens)
              + sizes.hidden_size * sizes.num_experts * rows)
    if dispatch == "local":
        routed, reached = real * sizes.top_k * x, _experts_touched(sizes, real) * x
    else:
        total = real.sum()
        routed = np.full(P, total * sizes.top_k * x / w)
        reached = np.full(P, float(_experts_touched(sizes, total)) * x / w)
    fixed = sizes.num_shared_experts * x + sizes.hidden_size * sizes.num_experts
    return 2.0 * L * (always + routed), L * (fixed + reached)
