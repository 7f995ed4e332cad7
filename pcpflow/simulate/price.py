"""The price of one step: a sum of operators, each from a cited source, the step as long as
its slowest rank (docs/simulate.md, "Operators").

Per PCP rank (its TP ranks hold the same rows and cost the same; ``N`` its padded rows):

- ``gemm``: every projection of every layer by its ``M x N x K`` (``ModelSizes``' lists; MoE
  experts where ``moe.dispatch`` runs them, the routed ones' weights at
  ``simulate.expert_weights_dtype``: ``gemm_peak_key``; the LM head, replicated, on the sampled
  rows), priced by ``pcpflow.simulate.kernels`` (tiles, waves, roofline, floor);
- ``attention``: the pairs of the rank's busiest DCP shard (``attention_work``, the executed
  count; a ring's ``ring_attention_work``), prefill rows through FlashAttention-3's kernel at
  its published throughput for the shapes each call holds (``pcpflow.simulate.flash``), decode
  rows through split-KV; a model's sliding-window layers apart from its full ones, each kind by
  its own pairs times its layer count (``Pricer._layer_kinds``);
- ``memory_ops``: norms, RoPE, residual adds, the activation, KV writes, DCP and ring merges
  (HBM-bound; every kernel of pcpflow's forward that is neither a GEMM nor attention costs at
  least the kernel floor);
- each collective purpose: the executed run's own list (``grid_step_collectives``), each call
  priced and picked as NCCL v2.29.7 does (``pcpflow.simulate.collectives``); all-to-all as
  point-to-point; a ring (``pipeline.forward.cp_attention``, ``simulate.cp_decode=ring_pass_q``)
  as the executed ring counts it (``ring_step_traffic``): each hop a point-to-point transfer;
- ``host_launch``: the host launching the step's kernels (``pcpflow.simulate.host``).

Overlap, per mechanism. The engine (pcpflow's executed path, vLLM's) runs everything on one
stream: its collectives wait for their inputs and the next kernel waits for them, so all are
exposed. A ring double-buffers, as the executed one does (``pcpflow.attention.ring``): at
iteration ``h`` a rank posts its hop (its send to the next rank, its receive from the one
before) and computes the partial attention of the package it holds, then waits for the hop:
the iteration lasts ``max(attention, hop)``, exposing ``max(0, hop - attention)``; the rows
every rank holds, the all-to-all of pass-Q's partials and the merges follow the loop, exposed. The host runs ahead of
the GPU and waits for it once per step (sampling reads the logits): the host's time hides
behind the GPU's, and what it takes beyond is exposed (``host_launch``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from functools import partial

import numpy as np

from pcpflow.config.hardware import HardwareConfig, SimulateConfig
from pcpflow.layouts.accounting import (
    RING_PURPOSES,
    DCPRest,
    attention_rows,
    attention_work,
    count_collectives,
    grid_step_collectives,
    moe_all_to_all_calls,
    moe_all_to_all_rows,
    moe_all_to_all_step_traffic,
    moe_uniform_send_rows,
    ring_attention_work,
    ring_hop_rows,
    ring_step_traffic,
    ring_totals,
    sampled_row_holders,
    segment_runs,
    shard_pairs,
    step_traffic,
)
from pcpflow.layouts.ring import RingPlan, plan_ring
from pcpflow.layouts.slots import Window, dcp_shard_lens
from pcpflow.parallel.grid import RankGrid
from pcpflow.simulate import flash
from pcpflow.simulate.collectives import (
    Comm,
    all_to_all_seconds,
    p2p_rate_gbps,
    sendrecv_seconds,
    tuner,
)
from pcpflow.simulate.host import Host, elementwise_bytes
from pcpflow.simulate.kernels import Kernels
from pcpflow.simulate.measured import (
    MeasuredCollectives,
    MeasuredKernels,
    call_work,
    dtype_of,
    head_features,
    host_seconds,
    launch_us,
    sync_wait_seconds,
)
from pcpflow.simulate.sizes import DTYPE_BYTES, ModelSizes

KV_PURPOSES = ("kv_gather", "dcp_context_gather", "ring_send_kv")
"""Collectives that move KV-cache entries: sized by ``simulate.kv_dtype``."""
FLASH_QUERY_TILE = 128  # query rows that share one read of a key tile (FlashAttention-2/3)
NCCL_FUNC = {"all_gather": "all_gather", "all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter",
             "broadcast": "broadcast"}
ROUTED_PURPOSES = ("moe_dispatch", "moe_combine")
"""all_to_all purposes whose executed bytes follow the router's choices (data-dependent)."""


class Placement:
    """Each group of the ``tp x pcp`` grid as NCCL sees it (TP innermost, ``gpus_per_node`` per
    node, one NIC per GPU): ranks, nodes, ranks in one node."""

    def __init__(self, grid: RankGrid, hw: HardwareConfig, p2p_efficiency: float = 1.0) -> None:
        self.grid, self.hw, self.p2p_efficiency = grid, hw, p2p_efficiency
        # NOTE: a measured profile's collectives come from its tables; NCCL's model prices the rest.
        self.measured = MeasuredCollectives(hw.tables) if hw.tables is not None else None
        members = {"tp": grid.tp_members(0), "pcp": grid.pcp_members(0), "dcp": grid.dcp_members(0),
                   "dcp_heads": grid.dcp_heads_members(0), "world": list(range(grid.world_size))}
        self.comms: dict[str, Comm] = {}
        for g, m in members.items():
            nodes = Counter(r // hw.gpus_per_node for r in m)
            most, fewest = max(nodes.values()), min(nodes.values())
            self.comms[g] = Comm(len(m), len(nodes), most, fewest if fewest != most else None)
        self._tuners = {g: tuner(hw, c) for g, c in self.comms.items()} if hw.nccl else {}
        self._seconds: dict[tuple[str, str, float], tuple[float, str]] = {}

    def comm(self, group: str) -> Comm:
        return self.comms[group]

    def size(self, group: str) -> int:
        return self.comms[group].nranks

    def network(self, group: str) -> bool:
        return self.comms[group].nnodes > 1

    def seconds(self, op: str, group: str, tensor_bytes: float) -> tuple[float, str]:
        """One call: (seconds, what ran: NCCL's algorithm/protocol, or p2p)."""
        key = (op, group, tensor_bytes)
        hit = self._seconds.get(key)
        if hit is None:
            if len(self._seconds) > 65536:
                self._seconds.clear()
            hit = self._seconds[key] = self._price(op, group, tensor_bytes)
        return hit

    def _price(self, op: str, group: str, tensor_bytes: float) -> tuple[float, str]:
        comm = self.comms[group]
        if comm.nranks <= 1 or tensor_bytes <= 0:
            return 0.0, "-"
        if self.measured is not None and self.measured.has(op, comm.nranks):
            return self.measured.seconds(op, comm.nranks, tensor_bytes), "measured"
        if op == "all_to_all":
            return all_to_all_seconds(self.hw, comm, tensor_bytes, efficiency=self.p2p_efficiency), "p2p"
        if op == "sendrecv":
            return sendrecv_seconds(self.hw, comm, tensor_bytes, network=comm.nnodes > 1,
                                    efficiency=self.p2p_efficiency), "p2p"
        nbytes = tensor_bytes * comm.nranks if op == "all_gather" else tensor_bytes
        algo, proto, s = self._tuners[group].pick(NCCL_FUNC[op], nbytes)
        return s, f"{algo}/{proto}"

    def p2p_gbps(self, group: str, efficiency: float) -> float:
        """What one rank sends a peer of ``group`` per second (GB/s): the measured send/recv's
        fitted bandwidth, else NCCL's point-to-point rate."""
        comm = self.comms[group]
        if self.measured is not None and self.measured.has("sendrecv", comm.nranks):
            return self.measured.rate_gbps("sendrecv", comm.nranks)
        return p2p_rate_gbps(self.hw, comm, network=comm.nnodes > 1, efficiency=efficiency)


@dataclass
class StepCounts:
    """One step as the executed run counts it, and what pricing needs beside."""

    pairs: np.ndarray  # per-rank attention pairs as the executed run records them
    work: np.ndarray  # [P] pairs the busiest DCP shard of each PCP rank scores
    decode_work: np.ndarray  # [P] their decode part
    calls: dict[str, int]  # collective calls by purpose
    nbytes: dict[str, int]  # bytes by purpose, the whole job's (as ``CommStats`` counts them)
    priced: list[tuple[str, str, str, int, float]]  # (purpose, op, group, calls, one rank's tensor bytes)
    expected: tuple[str, ...] = ()  # purposes whose bytes are uniform routing's expectation
    dcp_rest: str = "queries"  # the DCP path of the rest rows (an all-gather step)
    ring: str | None = None  # ring_pass_kv | ring_pass_q: the step ran a ring (the executed ``cp_attention``)
    ring_plan: RingPlan | None = None
    per_rank_calls: dict[str, list[int]] = field(default_factory=dict)  # ring purposes, per global rank
    per_rank_bytes: dict[str, list[int]] = field(default_factory=dict)
    # One sliding-window layer's (``ModelSizes.window``; None: no layer slides): pairs, work, decode work
    window_pairs: np.ndarray | None = None
    window_work: np.ndarray | None = None
    window_decode_work: np.ndarray | None = None


def step_counts(batch, layout, *, grid: RankGrid, sizes: ModelSizes, dtype_bytes: int, dcp_rest: DCPRest,
                interleave: int, restore: str, dcp_comm_backend: str = "ag_rs", moe_dispatch: str = "local",
                kv_bytes: float | None = None, ring: str | None = None) -> StepCounts:
    """What the executed run counts for this step, through ``pcpflow.layouts.accounting``
    (``grid_step_collectives``: PCP/DCP, TP and MoE layers). ``all_to_all`` MoE bytes are
    uniform routing's expectation (flagged in ``expected``). ``ring`` (``pass_kv`` |
    ``pass_q``): the step runs the executed ring (``pcpflow.attention.ring``) in place of the
    attention's all-gather paths: its sends as ``ring_step_traffic`` lists them, its pairs as
    ``ring_attention_work`` counts them. ``kv_bytes``: KV entries' element size when it differs.
    A model with sliding-window layers (``sizes.window``) also counts one such layer's pairs."""
    shape = sizes.shape_per_rank(grid.tp, dtype_bytes)
    window = sizes.window
    w_pairs = w_work = w_decode = None
    moe_layers = sizes.num_moe_layers if sizes.num_experts else 0
    calls, nbytes, priced = _collective_counts(
        layout, batch.logits_indices, grid=grid, shape=shape, dtype_bytes=dtype_bytes, dcp_rest=dcp_rest,
        restore=restore, backend=dcp_comm_backend, num_moe_layers=moe_layers, moe_dispatch=moe_dispatch, ring=ring,
    )
    plan = traffic = None
    if ring is not None:
        plan = plan_ring(layout, batch.positions, variant=ring, interleave=interleave)
        traffic = ring_step_traffic(layout, batch.positions, variant=ring, shape=shape, interleave=interleave,
                                    tp_size=grid.tp, plan=plan)
        pairs = ring_attention_work(layout, batch.positions, variant=ring, interleave=interleave, plan=plan)
        work, decode_work = pairs, np.zeros_like(pairs)  # a ring's price reads its plan (flash.ring_blocks)
        if window is not None:
            w_pairs = ring_attention_work(layout, batch.positions, variant=ring, interleave=interleave, plan=plan,
                                          window=window)
            w_work, w_decode = w_pairs, decode_work
    else:
        positions = batch.token_positions  # NOTE: read per segment
        pairs = attention_work(layout, positions, dcp_size=grid.layout_dcp, interleave=interleave,
                               dcp_rest=dcp_rest.mode)
        # NOTE: with DCP inside PCP (dcp_tp = 1, so layout_dcp = dcp) the busiest shard's work is
        # ``pairs`` itself: _busiest_shard would count the same attention_work again.
        work = pairs if grid.dcp_tp == 1 else _busiest_shard(layout, positions, grid, interleave,
                                                             dcp_rest.mode, None)
        if window is not None:
            w_pairs = attention_work(layout, positions, dcp_size=grid.layout_dcp, interleave=interleave,
                                     dcp_rest=dcp_rest.mode, window=window)
            w_work = w_pairs if grid.dcp_tp == 1 else _busiest_shard(layout, positions, grid, interleave,
                                                                     dcp_rest.mode, None, window)
        # NOTE: whether any, or every, token is a decode reads the requests that have tokens;
        # without shard_decodes the layout counts their tokens (num_replicated_decode_tokens:
        # every decode token of the step), so that is all of the step's, or none, without a numpy call
        nd = layout.num_replicated_decode_tokens
        if layout.shard_decodes:
            scheduled = batch.num_scheduled_tokens > 0
            decodes_only = not batch.is_prefilling[scheduled].any()
            prefills_only = not decodes_only and batch.is_prefilling[scheduled].all()
        else:
            decodes_only, prefills_only = nd == layout.num_tokens, nd == 0
        if decodes_only:
            decode_work, w_decode = work, w_work
        elif prefills_only:
            decode_work = np.zeros_like(work)
            w_decode = None if window is None else decode_work
        else:
            decode_work = _busiest_shard(layout, positions, grid, interleave, dcp_rest.mode, ~batch.is_prefilling)
            if window is not None:
                w_decode = _busiest_shard(layout, positions, grid, interleave, dcp_rest.mode, ~batch.is_prefilling,
                                          window)
    per_calls: dict[str, list[int]] = {}
    per_bytes: dict[str, list[int]] = {}
    if traffic is not None:
        sent = dict(traffic.bytes)
        if kv_bytes is not None and kv_bytes != dtype_bytes:  # KV entries at the KV cache's dtype
            sent["ring_send_kv"] = (sent["ring_send_kv"] * kv_bytes // dtype_bytes).astype(np.int64)
        per_calls = {k: traffic.calls[k].tolist() for k in RING_PURPOSES}
        per_bytes = {k: sent[k].tolist() for k in RING_PURPOSES}
        ring_calls, ring_bytes = ring_totals(traffic.calls, sent)
        calls.update(ring_calls)
        nbytes.update(ring_bytes)
    if kv_bytes is not None and kv_bytes != dtype_bytes:
        scale = kv_bytes / dtype_bytes
        priced = [(p, op, g, k, b * scale if p in KV_PURPOSES else b) for p, op, g, k, b in priced]
        nbytes = {p: int(b * scale) if p in KV_PURPOSES[:2] else b for p, b in nbytes.items()}
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
        w = grid.world_size
        for k, b in moe_all_to_all_calls(np.rint(send), hidden_size=sizes.hidden_size, top_k=sizes.top_k,
                                         dtype_bytes=dtype_bytes):
            # NOTE: Comm's bytes are what every rank receives, summed: one rank's tensor is
            # b / (w (w - 1)) gathered, b / (w - 1) sent all-to-all (uniform rows).
            if k == "moe_counts":
                priced.append((k, "all_gather", "world", moe_layers, b / (w * (w - 1))))
            else:
                priced.append((k, "all_to_all", "world", moe_layers, b / (w - 1)))
        if grid.tp > 1:  # TP rank 0 broadcasts the combined rows (counted exactly: N x hidden)
            priced.append(("moe_combine", "broadcast", "tp", moe_layers,
                           layout.padded_num_tokens * sizes.hidden_size * dtype_bytes))
        expected = ROUTED_PURPOSES
    return StepCounts(pairs, work, decode_work, calls, nbytes, priced, expected, dcp_rest=dcp_rest.mode,
                      ring=f"ring_{ring}" if ring is not None else None, ring_plan=plan,
                      per_rank_calls=per_calls, per_rank_bytes=per_bytes, window_pairs=w_pairs, window_work=w_work,
                      window_decode_work=w_decode)


_COLLECTIVE_COUNTS: dict[tuple, tuple[dict[str, int], dict[str, int], list]] = {}


def _collective_counts(layout, logits_indices, *, grid: RankGrid, shape, dtype_bytes: int, dcp_rest: DCPRest,
                       restore: str, backend: str, num_moe_layers: int, moe_dispatch: str, ring: str | None):
    """(calls, bytes, priced) of the step's ``grid_step_collectives`` (a ring's without the
    attention's), as ``step_traffic`` and ``count_collectives`` count them: fresh copies."""
    # NOTE: the list is a function of the layout's row counts alone (replicated decode rows,
    # rest rows, padded rows, the restore's rows) and of the run's constants: steps that share
    # them share the counts (decode steps mostly do), so they are kept by exactly those inputs.
    nd, rest = attention_rows(layout)
    restore_rows = (layout.padded_num_tokens if restore == "all_rows"
                    else sampled_row_holders(layout, logits_indices)[2] if restore == "sampled_rows" else restore)
    key = (grid.tp, grid.pcp, grid.dcp, shape, dtype_bytes, dcp_rest, restore, backend, num_moe_layers, moe_dispatch,
           ring, nd, rest, layout.padded_num_tokens, restore_rows)
    hit = _COLLECTIVE_COUNTS.get(key)
    if hit is None:
        colls = grid_step_collectives(
            layout, logits_indices, tp_size=grid.tp, dcp_size=grid.dcp, shape=shape, dcp_rest=dcp_rest,
            restore=restore, backend=backend, num_moe_layers=num_moe_layers, moe_dispatch=moe_dispatch,
        )
        if ring is not None:
            # NOTE: the ring replaces every attention collective (RingAttention stands in for CPAttention).
            colls = [c for c in colls if c.purpose != "kv_gather" and not c.purpose.startswith("dcp_")]
        counted = count_collectives(colls)
        calls, nbytes = step_traffic(counted, pcp_size=grid.pcp, dcp_size=grid.dcp, dtype_bytes=dtype_bytes,
                                     tp_size=grid.tp)
        group_size = {"pcp": grid.pcp, "dcp": grid.dcp, "tp": grid.tp, "dcp_heads": len(grid.dcp_heads_members(0))}
        priced = [(c.purpose, c.op, c.group, k, _tensor_bytes(c, dtype_bytes))
                  for c, k in counted.items() if group_size[c.group] > 1]
        if len(_COLLECTIVE_COUNTS) > 65536:
            _COLLECTIVE_COUNTS.clear()
        hit = _COLLECTIVE_COUNTS[key] = (calls, nbytes, priced)
    calls, nbytes, priced = hit
    return dict(calls), dict(nbytes), list(priced)


def _tensor_bytes(c, dtype_bytes: int) -> float:
    """One rank's tensor of collective ``c`` (NCCL's send count; a reduce-scatter's is whole)."""
    return float(math.prod(c.shape)) * (c.dtype_bytes or dtype_bytes)


@dataclass
class StepPrice:
    """One step's price; per-rank figures are lists of P floats (the step record's form)."""

    step_s: float
    terms: dict[str, list[float]]  # slowest rank: term -> [exposed_s, hidden_s]
    compute_s: list[float]  # [P]: FLOP-bound kernel time
    memory_s: list[float]  # [P]: HBM-bound kernel time
    communication_s: list[float]  # [P]: exposed collective and host time
    fitted_s: dict[str, float]  # slowest rank: exposed seconds each fitted factor scales
    picks: dict[str, str]  # purpose -> what NCCL picked (algorithm/protocol) or p2p
    flops: list[float]  # [P]
    hbm_bytes: list[float]  # [P]

    @property
    def purpose_s(self) -> dict[str, float]:
        """Exposed seconds by term (the step record's short form)."""
        return {k: v[0] for k, v in self.terms.items()}


@dataclass
class Attention:
    """A step's attention per PCP rank: seconds (prefill and decode kernels), their
    compute-bound part, FLOPs, decode KV bytes read, and a ring's exposed transfers
    (arrays, or lists of floats)."""

    prefill_s: np.ndarray | list[float]
    decode_s: np.ndarray | list[float]
    compute_s: np.ndarray | list[float]
    flops: np.ndarray | list[float]
    decode_bytes: np.ndarray | list[float]
    comm_s: np.ndarray | list[float]

    def plus(self, other: Attention) -> Attention:
        """Both kinds of layers' attention (``Pricer._layer_kinds``), figure by figure."""
        return Attention(*(np.add(getattr(self, f), getattr(other, f)) for f in
                           ("prefill_s", "decode_s", "compute_s", "flops", "decode_bytes", "comm_s")))


class Pricer:
    """Prices steps of one run: its grid on its hardware, its model, its ``simulate`` settings."""

    def __init__(self, grid: RankGrid, hw: HardwareConfig, sizes: ModelSizes, sim: SimulateConfig, *,
                 act_key: str, kv_key: str, host: Host, moe_dispatch: str = "local", interleave: int = 1,
                 block_size: int = 16) -> None:
        self.grid, self.hw, self.sizes, self.sim, self.interleave = grid, hw, sizes, sim, interleave
        self.block_size = block_size  # the KV cache's (kv.block_size): the reference kernel's tiles pad to it
        self.place = Placement(grid, hw, sim.p2p_efficiency)
        # NOTE: a measured profile prices pcpflow's own forward from its tables (pcpflow.simulate.measured).
        self.measured = hw.tables is not None and bool(hw.tables.gemm)
        self.kern = (MeasuredKernels(hw, dtype=dtype_of(act_key)) if self.measured
                     else Kernels(hw, gemm_efficiency=sim.gemm_efficiency, hbm_efficiency=sim.hbm_efficiency))
        self.act_key, self.act_bytes = act_key, DTYPE_BYTES[act_key]
        self.kv_key, self.kv_bytes = kv_key, DTYPE_BYTES[kv_key]
        self.w_key = sim.weights_dtype or "bf16"
        self.w_bytes = DTYPE_BYTES[self.w_key]
        experts = sim.expert_weights_dtype or self.w_key
        self.e_key, self.e_bytes = gemm_peak_key(experts, act_key), DTYPE_BYTES[experts]  # the routed experts'
        self.host, self.moe_dispatch = host, moe_dispatch
        # NOTE: pcpflow's own forward on a measured profile: its unfused ops' bytes, counted.
        self.counted_bytes = (elementwise_bytes(sizes, grid.tp, dtype_of(act_key)) if self.measured else None)
        self._dense = self._gemm_set()
        self._dense_cache: dict[tuple[int, int], tuple[float, float, float, float]] = {}
        self._gemms_cache: dict[tuple, tuple[list[float], ...]] = {}
        # NOTE: what depends only on the run (model, grid, hardware, host) is computed once, by
        # the same expressions a step used to evaluate: every step reads the same floats.
        self._pair_costs = self._pair_costs_of_run()
        self._row_bytes_of_run = self._row_bytes()
        self._small_kernels = (sizes.num_layers * max(self.host.per_layer - self._gemm_kernels() - 1, 0)
                               + self.host.layer.norm + 3)

    def _gemm_set(self):
        s, tp = self.sizes, self.grid.tp
        attn = s.attention_gemms(tp)
        mlp = s.mlp_gemms(tp) if s.num_dense_layers else []
        return attn, mlp

    # ------------------------------------------------------------------ compute
    def _gemms(self, layout, batch, samples: float):
        """[P] GEMM seconds, [P] of them compute-bound seconds, [P] FLOPs, [P] weight bytes
        (lists of floats, shared by the steps that repeat the inputs: read-only)."""
        s = self.sizes
        ctx = None
        if s.attention == "mla" and s.kv_b_params and not self.measured:  # pcpflow's own MLA stays absorbed
            ctx = _prefill_context(batch, layout, self.grid)
            if not ctx.any():
                ctx = None
        moe_rows = layout.per_rank_num_tokens if s.num_experts and s.num_moe_layers else None
        # NOTE: the GEMMs are a function of these inputs alone (padded rows, sampled rows, MLA's
        # expanded context, the MoE layers' real rows per rank): steps that repeat them (decode
        # steps at one batch size) reuse the values, read-only, that the same sums produced.
        key = (int(layout.padded_num_tokens), int(samples), None if ctx is None else ctx.tobytes(),
               None if moe_rows is None else moe_rows.tobytes())
        hit = self._gemms_cache.get(key)
        if hit is None:
            # NOTE: kept as lists of floats (tolist: value for value), for price's per-rank sums
            hit = tuple(a.tolist() for a in self._gemms_of(layout, int(samples), ctx, moe_rows is not None))
            if len(self._gemms_cache) > 4096:
                self._gemms_cache.clear()
            self._gemms_cache[key] = hit
        return hit

    def _gemms_of(self, layout, samples: int, ctx, moe: bool):
        s, P = self.sizes, self.grid.pcp
        # NOTE: the dense GEMMs are every rank's: 0.0 + v is what adding them to zeros gave, one array each
        out = [np.full(P, 0.0 + v) for v in self._dense_cost(int(layout.padded_num_tokens), samples)]

        def add(m, N, K, count, key=None, wb=None):
            kk = dict(peak_key=key or self.w_key, w_bytes=self.w_bytes if wb is None else wb, a_bytes=self.act_bytes)
            sec, bound = self.kern.gemm(m, N, K, count=count, **kk)
            m = np.asarray(m, dtype=np.float64)
            for i, v in enumerate((sec, np.where(bound, sec, 0.0), 2.0 * count * m * N * K,
                                   count * N * K * kk["w_bytes"] * (m > 0))):
                out[i] = out[i] + v

        if ctx is not None:
            _, N, K = next(g for g in self._dense[0] if g[0] == "kv_b_proj")
            add(ctx, N, K, s.num_layers)
        if moe:
            self._moe(layout, add)
        return tuple(out)

    def _dense_cost(self, rows: int, samples: int) -> tuple[float, float, float, float]:
        """Every rank's projections and dense MLPs on ``rows`` padded rows, the LM head (whole on
        every TP rank) on ``samples`` rows: (seconds, compute-bound seconds, FLOPs, weight
        bytes), cached."""
        key = (rows, samples)
        hit = self._dense_cache.get(key)
        if hit is not None:
            return hit
        s = self.sizes
        attn, mlp = self._dense
        parts = [(rows, N, K, s.num_layers, self.w_key, self.w_bytes) for _, N, K in attn]
        parts += [(rows, N, K, s.num_dense_layers, self.w_key, self.w_bytes) for _, N, K in mlp]
        # NOTE: every TP rank computes every logit: pcpflow replicates the LM head
        # (pcpflow.parallel.tensor_parallel) and gathers no logits over TP.
        parts.append((samples, s.vocab_size, s.hidden_size, 1, "bf16", 2))
        t = tc = flops = wbytes = 0.0
        for m, N, K, count, peak_key, wb in parts:
            sec, bound = self.kern.gemm_scalar(m, N, K, peak_key=peak_key, w_bytes=wb, a_bytes=self.act_bytes)
            sec *= count
            t += sec
            tc += sec if bound else 0.0
            flops += 2.0 * count * m * N * K
            wbytes += count * N * K * wb if m > 0 else 0.0
        if len(self._dense_cache) > 4096:
            self._dense_cache.clear()
        self._dense_cache[key] = (t, tc, flops, wbytes)
        return t, tc, flops, wbytes

    def _moe(self, layout, add) -> None:
        """MoE layers (not split over TP): router and shared experts on every row; routed rows
        where ``moe.dispatch`` puts them (uniform top-k routing): ``local`` each rank's real
        rows x top-k over the experts they reach, ``gather`` / ``all_to_all`` a ``1/W`` share
        of all routed rows and of the experts (``W = tp * pcp``)."""
        s, grid = self.sizes, self.grid
        L, n = s.num_moe_layers, float(layout.padded_num_tokens)
        rows = n * (grid.pcp if self.moe_dispatch == "gather" else 1)
        add(rows, s.router_outputs, s.hidden_size, L, key=self.act_key, wb=self.act_bytes)  # router (and a shared gate)
        for _, N, K in s.expert_gemms():
            add(n, N, K, L * s.num_shared_experts)
        real = layout.per_rank_num_tokens.astype(np.float64)
        if self.moe_dispatch == "local":
            routed, experts = real * s.top_k, _experts_touched(s, real)
        else:
            total = real.sum()
            w = grid.world_size
            routed = np.full(grid.pcp, total * s.top_k / w)
            experts = np.full(grid.pcp, float(_experts_touched(s, total)) / w)
        per_expert = np.where(experts > 0, routed / np.maximum(experts, 1e-9), 0.0)
        for _, N, K in s.expert_gemms():
            # NOTE: a grouped GEMM: each reached expert's rows tiled apart
            add(per_expert, N, K, L * experts, key=self.e_key, wb=self.e_bytes)

    # ------------------------------------------------------------------ the step
    def price(self, batch, layout, counts: StepCounts, *, runtime_mode: str = "none",
              samples: int | None = None) -> StepPrice:
        """The step's price; ``samples``: rows the LM head runs on (default: the batch's sampled ones)."""
        s, grid, k, place = self.sizes, self.grid, self.kern, self.place
        L = s.num_layers
        nd, rest = attention_rows(layout)
        samples = float(len(batch.logits_indices) if samples is None else samples)
        g_t, g_c, g_flops, w_bytes = self._gemms(layout, batch, samples)

        # Attention: FlashAttention-3 by shape for prefill rows, split-KV for decode rows.
        terms: dict[str, list] = {}
        picks: dict[str, str] = {}
        if counts.ring_plan is not None:
            att = self._ring(batch, layout, counts, terms, picks)
        else:
            attend = self._measured_attention if self.measured else self._engine_attention
            kinds = self._layer_kinds(counts)
            att = attend(batch, layout, counts, *kinds[0])
            for more in kinds[1:]:
                att = att.plus(attend(batch, layout, counts, *more))
        # NOTE: from here every [P] figure is a list of floats: P is a few ranks, and numpy's
        # elementwise float64 operations are Python's, value for value (the same operations in
        # the same order), without a numpy call each.
        pre_s, dec_s, att_compute, att_flops, att_dec_bytes, att_comm = (
            x.tolist() if isinstance(x, np.ndarray) else x
            for x in (att.prefill_s, att.decode_s, att.compute_s, att.flops, att.decode_bytes, att.comm_s))
        t_attn = [a + b for a, b in zip(pre_s, dec_s)]

        # Memory-bound ops: bytes per row and layer, and at least a floor per small kernel.
        if self.counted_bytes is not None:
            per_row, fixed = self.counted_bytes
            mem_bytes = L * (float(layout.padded_num_tokens) * per_row + fixed)
        else:
            mem_bytes = float(layout.padded_num_tokens) * L * self._row_bytes_of_run
        merge_bytes = self._merge_bytes(layout, counts, nd, rest)
        small = self._small_kernels
        inline = not self.hw.overlap.host  # NOTE: the host runs each op: its launch is in the op's time
        # NOTE: what is the same on every rank stays one float (numpy broadcasts it, value for value)
        if inline:
            op_bytes = float(layout.padded_num_tokens) * s.hidden_size * self.act_bytes
            t_mem = float(k.memory(mem_bytes + merge_bytes, op_bytes=op_bytes))
        else:
            t_mem = max(float(k.memory(mem_bytes + merge_bytes)), small * k.floor)

        # Collectives: the engine's all exposed (a ring's hops hide behind its iterations: _ring).
        comm, calls = att_comm, 0
        for purpose, op, group, n_calls, tensor in counts.priced:
            sec, pick = place.seconds(op, group, tensor)
            sec = n_calls * sec
            _add(terms, purpose, sec, 0.0)
            comm = [c + sec for c in comm]
            picks[purpose] = pick
            calls += n_calls
        gpu = [g + a + t_mem + c for g, a, c in zip(g_t, t_attn, comm)]
        if counts.ring is not None:
            calls += sum(counts.calls.get(p, 0) for p in RING_PURPOSES)
        host = self.host.step(runtime_mode, calls)
        if counts.ring_plan is not None and runtime_mode != "full":
            # NOTE: each ring iteration past the first launches the attention backend's kernels again.
            host += L * (grid.dcp - 1) * self.host.layer.attention * self.host.launch_s
        # pcpflow's own per-step work (scheduler, plan, buffers, slots, sampling): measured
        # profiles only; it runs before the step's first op and after its last, exposed.
        work = host_seconds(self.hw.tables, len(batch.num_scheduled_tokens), int(batch.num_tokens)) if self.measured else 0.0
        if inline:
            host = self._inline_ops(layout) * self.launch_s
            total = [x + host + work for x in gpu]
        else:
            # NOTE: max(x, host) is np.maximum's value (no NaN here)
            total = [max(x, host) + work for x in gpu]
        wait = 0.0
        if self.measured:
            wait = sync_wait_seconds(self.hw.tables, calls, [t - c for t, c in zip(total, comm)])
            total = [t + wait for t in total]
        slow = total.index(max(total))  # NOTE: the first of the largest, as argmax
        out = {"gemm": [g_t[slow], 0.0], "attention": [t_attn[slow], 0.0], "memory_ops": [t_mem, 0.0]}
        for p, (e, h) in terms.items():
            out[p] = [_at(e, slow), _at(h, slow)]
        out["host_launch"] = [host, 0.0] if inline else [max(host - gpu[slow], 0.0), min(host, gpu[slow])]
        if self.measured:
            out["host_work"] = [work, 0.0]
            if wait:
                out["sync_wait"] = [wait, 0.0]
        p2p = sum(out[p][0] for p in terms if picks.get(p) == "p2p")
        fitted = {"gemm_efficiency": g_c[slow], "p2p_efficiency": p2p}
        return StepPrice(
            step_s=total[slow],
            terms=out,
            compute_s=[a + b for a, b in zip(g_c, att_compute)],
            memory_s=[gt - gc + (ta - ac) + t_mem for gt, gc, ta, ac in zip(g_t, g_c, t_attn, att_compute)],
            # exposed collectives and host
            communication_s=[t - gt - ta - t_mem for t, gt, ta in zip(total, g_t, t_attn)],
            fitted_s=fitted,
            picks=picks,
            flops=[a + b for a, b in zip(g_flops, att_flops)],
            hbm_bytes=[w + d + mem_bytes + merge_bytes for w, d in zip(w_bytes, att_dec_bytes)],
        )

    def _per_pair(self, layers: int | None = None) -> tuple[float, float, float]:
        """``_pair_costs_of_run``: over every layer (None), or over ``layers`` of them."""
        return self._pair_costs if layers is None else self._pair_costs_of_run(layers)

    def _pair_costs_of_run(self, layers: int | None = None) -> tuple[float, float, float]:
        """FLOPs of one (query, key) pair over every layer (or ``layers`` of them), prefill and
        decode kernels, and KV bytes of one key over them (heads split by tp, gathered back over
        a DCP group's TP part)."""
        s, grid = self.sizes, self.grid
        heads = s.num_heads / grid.tp * grid.dcp_tp
        L = s.num_layers if layers is None else layers
        return (2.0 * heads * L * (s.prefill_qk_dim + s.prefill_v_dim),
                2.0 * heads * L * (s.decode_qk_dim + s.decode_v_dim),
                s.entry_dim_per_rank(grid.tp) * self.kv_bytes * L)

    def _group(self) -> int:
        """Query heads per KV head of one rank's prefill kernel (PackGQA packs them into its
        query tiles); 1 for multi-head attention and MLA's expanded prefill."""
        s = self.sizes
        if s.attention != "gqa":
            return 1
        return max(1, (s.num_heads // self.grid.tp) // s.kv_heads_per_rank(self.grid.tp))

    def _layer_kinds(self, counts: StepCounts) -> tuple[tuple[int | None, int | None], ...]:
        """(layers, window) of each kind of attention layer the step's attention is priced for,
        each kind by its own pairs times its layers: every layer at once ``(None, None)`` when
        none slides, or when the window cuts no pair this step (every row's context fits it:
        the sliding layers score what the full ones do); else the full layers (if any) and the
        ``sliding_layers`` through ``sliding_window``."""
        s = self.sizes
        if s.window is None or np.array_equal(counts.window_pairs, counts.pairs):
            return ((None, None),)
        full, sliding = s.num_layers - s.sliding_layers, (s.sliding_layers, s.window)
        return ((full, None), sliding) if full else (sliding,)

    def _prefill(self, pairs, peak_pairs, layers: int | None = None):
        """Seconds of prefill attention of ``pairs`` priced as ``peak_pairs`` at the peak, on
        every layer (or ``layers`` of them)."""
        k, L = self.kern, self.sizes.num_layers if layers is None else layers
        fpp, _, entry = self._per_pair(layers)
        t = k.prefill_attention(np.asarray(peak_pairs) * fpp, entry * np.asarray(pairs) / flash.QUERY_TILE,
                                peak_key=self.act_key)
        return np.where(np.asarray(pairs) > 0, np.maximum(t, L * k.floor), 0.0)

    def _decode(self, pairs, layers: int | None = None):
        """Seconds of split-KV decode attention of ``pairs`` (every layer, or ``layers``) and
        whether FLOPs bound it."""
        pairs = np.asarray(pairs, dtype=np.float64)
        t, bound = self._decode_lists(pairs.ravel().tolist(), layers)
        return np.array(t, dtype=np.float64).reshape(pairs.shape), np.array(bound, dtype=bool).reshape(pairs.shape)

    def _decode_lists(self, pairs: list[float], layers: int | None = None) -> tuple[list[float], list[bool]]:
        """``_decode`` of a few ranks' pairs (floats), as lists."""
        k, L = self.kern, self.sizes.num_layers if layers is None else layers
        _, fpp, entry = self._per_pair(layers)
        floor = L * k.floor
        # NOTE: a few ranks' floats: plain Python (each operation numpy's, value for value), not a numpy call each
        t, bound = [], []
        for x in pairs:
            sec, flops_bound = k.decode_attention_scalar(fpp * x, entry * x, peak_key=self.act_key)
            t.append(max(sec, floor) if x > 0 else 0.0)
            bound.append(flops_bound)
        return t, bound

    def _engine_attention(self, batch, layout, counts: StepCounts, layers: int | None = None,
                          window: int | None = None) -> Attention:
        """The all-gather paths: one call per rank, its rows over the context or its DCP shard
        (``flash.engine_blocks``) at the executed pairs of its busiest shard; on every layer, or
        on ``layers`` of them (``_layer_kinds``: sliding ones through ``window``)."""
        grid, P = self.grid, self.grid.pcp
        fpp, dpp, entry = self._per_pair(layers)
        work, decode_work = ((counts.work, counts.decode_work) if window is None
                             else (counts.window_work, counts.window_decode_work))
        decode_pairs = decode_work.astype(np.float64)
        # NOTE: a step of decodes (its work is its decode work): _prefill of no pairs is 0.0 on every rank
        prefill_pairs = None if work is decode_work else work.astype(np.float64) - decode_pairs
        if prefill_pairs is None or not prefill_pairs.any():
            # NOTE: per-rank lists of floats (astype's values): price sums them in plain Python
            dec = decode_pairs.tolist()
            t_dec, dec_bound = self._decode_lists(dec, layers)
            zeros = [0.0] * P  # NOTE: so is fpp * prefill_pairs: the FLOPs are the decodes' alone
            return Attention(zeros, t_dec, [t if b else 0.0 for t, b in zip(t_dec, dec_bound)],
                             [dpp * x for x in dec], [entry * x for x in dec], zeros)
        ratio = np.ones(P)
        blocks = flash.engine_blocks(layout, batch.token_positions, batch.is_prefilling, dcp_size=grid.dcp,
                                     interleave=self.interleave, dcp_rest=counts.dcp_rest, window=window)
        if blocks is not None:
            shard = blocks.bin // grid.dcp_tp  # DCP member d = pcp_rank * dcp_tp + tp_local
            pairs = np.bincount(shard, weights=blocks.pairs.astype(np.float64), minlength=P)
            peak = np.bincount(shard, weights=blocks.peak_pairs(self._group()), minlength=P)
            ratio = np.where(pairs > 0, peak / np.maximum(pairs, 1e-300), 1.0)
        t_pre = self._prefill(prefill_pairs, prefill_pairs * ratio, layers)
        t_dec, dec_bound = self._decode(decode_pairs, layers)
        return Attention(t_pre, t_dec, t_pre + np.where(dec_bound, t_dec, 0.0), fpp * prefill_pairs + dpp * decode_pairs,
                         entry * decode_pairs, np.zeros(P))

    def _ring(self, batch, layout, counts: StepCounts, terms: dict, picks: dict) -> Attention:
        """A ring step (``pcpflow.attention.ring``): per rank and iteration, the partial
        attention of the package it holds (``flash.ring_blocks``) beside its hop (its send to
        the next rank, its receive from the one before: point to point, both purposes in one
        batch), the longer of the two; after the loop the rows every rank holds, then pass-Q's
        all-to-all, exposed, as long on a rank as the larger of what it sends and receives. Each kind of layer (``_layer_kinds``) runs its loops beside the
        same hops."""
        grid, s, place, plan = self.grid, self.sizes, self.place, counts.ring_plan
        P, L = grid.pcp, s.num_layers

        # The hops: iteration h < P - 1 sends the package of origin (r - h) % P (one layer).
        kv_rows, q_rows = ring_hop_rows(plan)
        shape = s.shape_per_rank(grid.tp, self.act_bytes)
        kv_b = kv_rows * shape.entry_dim * self.kv_bytes
        q_b = q_rows * shape.num_heads * shape.qk_dim * self.act_bytes
        sizes, at = np.unique(kv_b + q_b, return_inverse=True)  # NOTE: most hops carry the same bytes
        send = np.array([place.seconds("sendrecv", "dcp", float(b))[0] for b in sizes])[at].reshape(kv_b.shape)
        send = np.where(kv_b + q_b > 0, send, 0.0)  # NOTE: an empty package is no call
        kinds = self._layer_kinds(counts)
        att = self._ring_layers(batch, layout, plan, kv_b, q_b, send, terms, picks, *kinds[0])
        for more in kinds[1:]:
            att = att.plus(self._ring_layers(batch, layout, plan, kv_b, q_b, send, terms, picks, *more))
        comm = att.comm_s
        a2a = np.asarray(counts.per_rank_bytes.get("ring_all2all", [0] * grid.world_size), dtype=np.float64)[:: grid.tp]
        if a2a.any():
            n = grid.dcp
            # NOTE: a rank's call lasts until its receives are in as well: each of the n - 1 others sends
            # it the partials of its own rows (travelling and held by all), a share of all that is sent
            # by its rows' share; uneven where few rows travel (a decode's: its owner receives them all)
            rows = (plan.num_travel + plan.num_replicated).astype(np.float64)
            recv = a2a.sum() * rows / rows.sum()
            per_layer = np.maximum(a2a, recv) / L * n / (n - 1)  # the buffer NCCL splits over the ring (its own share stays)
            sec = np.array([place.seconds("all_to_all", "dcp", float(b))[0] for b in per_layer])
            _add(terms, "ring_all2all", L * sec, np.zeros(P))
            comm = comm + L * sec
            picks["ring_all2all"] = "p2p"
        return replace(att, comm_s=comm)

    def _ring_layers(self, batch, layout, plan: RingPlan, kv_b, q_b, send, terms: dict, picks: dict,
                     layers: int | None = None, window: int | None = None) -> Attention:
        """``_ring``'s loops on every layer (or on ``layers`` of them, through ``window``):
        each iteration's attention beside its hop (``send``: one layer's seconds, ``kv_b`` /
        ``q_b`` its bytes), the hops' exposed and hidden seconds added to ``terms``; the rows
        every rank holds after the loop. ``comm_s``: the exposed hops."""
        P = self.grid.pcp
        L = self.sizes.num_layers if layers is None else layers
        fpp, dpp, entry = self._per_pair(layers)
        rb = flash.ring_blocks(plan, layout, batch.positions, batch.is_prefilling, window)
        pairs, peak = rb.loop.per_bin(P * P, self._group())
        a_pairs, a_peak = rb.after.per_bin(P, self._group())
        if self.measured:
            loop, after = self._measured_ring_attention(plan, layers, window)
            loop_dec, after_dec = np.zeros((P, P)), np.zeros(P)
            loop_bound, after_bound = np.zeros((P, P), dtype=bool), np.zeros(P, dtype=bool)
        else:
            loop = self._prefill(pairs, peak, layers).reshape(P, P)
            loop_dec, loop_bound = self._decode(rb.loop_decode_pairs, layers)
            after = self._prefill(a_pairs, a_peak, layers)
            after_dec, after_bound = self._decode(rb.after_decode_pairs, layers)
        attention = loop + loop_dec  # [P, P]: rank, iteration; these layers
        hop = ring_loop(attention, L * send, overlap=self.hw.overlap.p2p)
        exposed, hidden = np.maximum(hop - attention, 0.0), np.minimum(hop, attention)
        if not self.hw.overlap.p2p:  # NOTE: the profile's transfers run on the thread that computes
            exposed, hidden = hop, np.zeros_like(hop)
        # NOTE: a hop is its send and its receive: each purpose's share of the bytes of both (a
        # rank that sends nothing still waits for what it receives)
        total_b = np.zeros((P, P))
        total_b[:, : P - 1] = kv_b + q_b + np.roll(kv_b + q_b, 1, axis=0)
        for purpose, b in (("ring_send_kv", kv_b), ("ring_send_q", q_b)):
            if not b.any():
                continue
            part = np.zeros((P, P))
            part[:, : P - 1] = b + np.roll(b, 1, axis=0)
            w = np.where(total_b > 0, part / np.maximum(total_b, 1e-300), 0.0)
            _add(terms, purpose, (exposed * w).sum(axis=1), (hidden * w).sum(axis=1))
            picks[purpose] = "p2p"
        t_pre = loop.sum(axis=1) + after
        t_dec = loop_dec.sum(axis=1) + after_dec
        compute = t_pre + np.where(loop_bound, loop_dec, 0.0).sum(axis=1) + np.where(after_bound, after_dec, 0.0)
        pre_pairs = pairs.reshape(P, P).sum(axis=1) + a_pairs
        dec_pairs = rb.loop_decode_pairs.sum(axis=1) + rb.after_decode_pairs
        return Attention(t_pre, t_dec, compute, fpp * pre_pairs + dpp * dec_pairs, entry * dec_pairs,
                         exposed.sum(axis=1))

    # ------------------------------------------------------------------ measured profiles
    def _measured_features(self) -> np.ndarray:
        """``head_features`` of the executed head shape at one rank (MLA absorbed)."""
        s, grid = self.sizes, self.grid
        heads = s.num_heads / grid.tp
        return head_features(s.entry_dim_per_rank(grid.tp), heads, heads * (s.decode_qk_dim + s.decode_v_dim))

    def _measured_ring_attention(self, plan: RingPlan, layers: int | None = None,
                                 window: Window | None = None) -> tuple[np.ndarray, np.ndarray]:
        """A ring's calls (``measured_ring_calls``) from a profile's tables, on every layer (or
        on ``layers`` of them, through ``window``): seconds ``[P, P]`` per rank and iteration,
        ``[P]`` after the loop. A call whose rows read no key costs the smallest call the
        profile timed (``attention_fixed``)."""
        s, k, P = self.sizes, self.kern, self.grid.pcp
        w, kind = self._measured_features(), s.attention
        fixed = k.attention_fixed(w, kind)
        seconds = np.zeros((P, P + 1))
        for (r, h), calls in self.measured_ring_calls(plan, window).items():
            for req, lens, block_size, starts in calls:
                work = call_work(k.backend, req, lens, None, heads=w[2], entry=w[1], block_size=block_size,
                                 starts=starts)
                t = k.call(work, w, kind)
                seconds[r, h] += t if t > 0 else fixed
        L = s.num_layers if layers is None else layers
        return L * seconds[:, :P], L * seconds[:, P]

    def measured_ring_calls(self, plan: RingPlan, window: Window | None = None
                            ) -> dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray, int, np.ndarray | None]]]:
        """Each call of pcpflow's backend one layer of a ring makes (``pcpflow.attention.ring``),
        its rows' requests and keys from the executed ring's own plan (``rank_ring``) and its
        block size, and on a windowed layer (``window``) the rows' first keys (None: 0), by
        (rank, iteration; ``P``: after the loop): every iteration one call of the rank's staying
        rows over the block it holds (blocks of one entry), two of the visiting queries (over its
        cached shard, over its travelling rows' new KV); after the loop one call of the rows
        every rank holds over its shard."""
        from pcpflow.layouts.ring import rank_ring

        P, bs = self.grid.pcp, self.block_size
        # NOTE: the block tables only place slots, which no price reads: zeros wide enough
        tables = np.zeros((plan.block_cached.shape[1], int(plan.pos.max(initial=0)) // bs + 2), dtype=np.int64)
        out: dict[tuple[int, int], list[tuple[np.ndarray, np.ndarray, int, np.ndarray | None]]] = {}
        for r in range(P):
            ring = rank_ring(plan, r, tables, bs, window)
            for h, hop in enumerate(ring.hops):
                calls = out.setdefault((r, h), [])
                if ring.stay_rows.size:
                    calls.append((ring.stay_req, hop.stay_lens, 1, hop.stay_starts))
                if hop.visit_req.size:
                    calls += [(hop.visit_req, hop.visit_cache_lens, bs, hop.visit_cache_starts),
                              (hop.visit_req, hop.visit_local_lens, 1, hop.visit_local_starts)]
            if ring.replicated_rows.size:
                out[r, P] = [(ring.replicated_req, ring.replicated_cache_lens, bs, ring.replicated_cache_starts)]
        return out

    def _measured_attention(self, batch, layout, counts: StepCounts, layers: int | None = None,
                            window: Window | None = None) -> Attention:
        """The all-gather paths from a profile's tables: each call a layer makes
        (``measured_calls``), at the executed head shape (MLA absorbed for every row), by the
        work of its rows as the backend cuts them (``call_work``: the reference kernel's
        segments and tiles, from each row's start on a windowed layer); its decode rows' share
        priced as a call of them alone; on every layer, or on ``layers`` of them
        (``_layer_kinds``: windowed ones through ``window``). A PCP rank waits for its slowest
        TP rank (DCP over TP ranks: each over its own shard)."""
        s, k = self.sizes, self.kern
        w = self._measured_features()
        work = partial(call_work, k.backend, heads=w[2], entry=w[1], block_size=self.block_size)

        def priced(rq, cx, dec, st) -> np.ndarray:
            whole = k.call(work(rq, cx, dec, starts=st), w, s.attention)
            has = cx > (0 if st is None else st)
            if not dec.any() or dec[has].all():  # NOTE: no decode row, or every row with keys one
                return np.array([0.0, whole] if dec.any() else [whole, 0.0])
            alone = min(k.call(work(rq[dec], cx[dec], dec[dec], starts=None if st is None else st[dec]), w,
                               s.attention), whole)
            return np.array([whole - alone, alone])

        per_rank = self.measured_calls(batch, layout, counts, window)
        seconds = np.array([max((sum((priced(*c) for c in calls), np.zeros(2)) for calls in per_tp),
                                key=lambda x: x.sum()) for per_tp in per_rank])
        fpp, dpp, entry = self._per_pair(layers)
        work_pairs, decode_work = ((counts.work, counts.decode_work) if window is None
                                   else (counts.window_work, counts.window_decode_work))
        decode_pairs = decode_work.astype(np.float64)
        prefill_pairs = work_pairs.astype(np.float64) - decode_pairs
        L = s.num_layers if layers is None else layers
        t_pre, t_dec = L * seconds[:, 0], L * seconds[:, 1]
        return Attention(t_pre, t_dec, t_pre + t_dec, fpp * prefill_pairs + dpp * decode_pairs, entry * decode_pairs,
                         np.zeros(len(per_rank)))

    def measured_calls(self, batch, layout, counts: StepCounts, window: Window | None = None
                       ) -> list[list[list[tuple]]]:
        """``[P][dcp_tp]``: the calls of pcpflow's backend one layer makes on each PCP rank's TP
        ranks of its DCP group (one when DCP is inside PCP) on the all-gather paths, as
        ``pcpflow.attention.context_parallel`` makes them, each ``(req, ctx, decode, starts)``:
        its rows' requests and keys (the executed metadata's ``gathered_rows``), which decode,
        and on a windowed layer (``window``) each row's first key in the same index space (the
        metadata's row starts; None: 0). With DCP the decode rows' call and the rest rows'
        apart, each row over the rank's shard of its keys (DCP rank ``r dcp_tp + j``); over TP
        ranks (step 3) every TP rank attends the decode rows of each of its heads' blocks and
        every PCP rank's rest rows once for each TP rank."""
        from pcpflow.attention.metadata import gathered_rows

        grid = self.grid
        P, n, nd, t = grid.pcp, layout.padded_num_tokens, layout.num_replicated_decode_tokens, grid.dcp_tp
        positions = np.asarray(batch.positions, dtype=np.int64)
        req, ctx = (a.reshape(P, n) for a in gathered_rows(layout, batch.req_indices, positions + 1))
        decode = ~np.asarray(batch.is_prefilling, dtype=bool)[req] & (ctx > 0)
        first = None
        if window is not None:
            first = gathered_rows(layout, batch.req_indices, window.starts(positions))[1].reshape(P, n)

        if grid.dcp == 1:
            return [[[_cut(lambda a: a[r], req, ctx, decode, first)]] for r in range(P)]
        shards = dcp_shard_lens(ctx, grid.dcp, self.interleave).reshape(grid.dcp, P, n)  # every DCP rank's
        # NOTE: the shard's keys before a row's start: positions only grow along a shard
        starts = (None if first is None
                  else dcp_shard_lens(first, grid.dcp, self.interleave).reshape(grid.dcp, P, n))

        def calls(r: int, j: int) -> list[tuple]:
            rows = (req, shards[r * t + j], decode, None if starts is None else starts[r * t + j])
            if t > 1:  # NOTE: each block of rows once per TP rank of the group, consecutive
                return [_cut(lambda a: np.tile(a[r, :nd], t), *rows),
                        _cut(lambda a: np.repeat(a[:, nd:], t, axis=0).ravel(), *rows)]
            out = [_cut(lambda a: a[r, :nd], *rows)]
            if counts.dcp_rest == "context":  # its own rows over their gathered whole context
                return out + [_cut(lambda a: a[r, nd:], req, ctx, decode, first)]
            return out + [_cut(lambda a: a[:, nd:].ravel(), *rows)]

        return [[calls(r, j) for j in range(t)] for r in range(P)]

    @property
    def launch_s(self) -> float:
        """One op of pcpflow's forward on a host that runs its ops itself (measured)."""
        return launch_us(self.hw, self.sizes.attention) * 1e-6

    def _inline_ops(self, layout) -> float:
        """The ops of one step that are neither a GEMM nor the attention backend's call (those
        are measured with their launch), on a host that runs them: every layer's (pcpflow's
        forward counted, ``pcpflow.simulate.host``), an MoE layer's per reached expert. The
        step's own ops outside the layers are in the host table (``host_work``)."""
        s = self.sizes
        per_layer = max(self.host.per_layer - self._gemm_kernels() - self.host.layer.attention, 0)
        ops = float(s.num_layers * per_layer)
        if s.num_experts and s.num_moe_layers:
            fixed, per_expert = self.host.moe_ops
            reached = float(np.max(_experts_touched(s, layout.per_rank_num_tokens.astype(np.float64))))
            ops += s.num_moe_layers * (fixed + per_expert * reached)
        return ops

    def _gemm_kernels(self) -> int:
        """GEMM kernels pcpflow's forward launches per layer (the rest are small kernels)."""
        a, m = self._dense
        return len(a) + 2 + (1 if self.sizes.attention == "gqa" else 0)

    def _row_bytes(self) -> float:
        """Bytes one row moves through a layer's memory-bound ops: two RMSNorms (read, write
        ``h``), two residual adds (read ``2h``, write ``h``), RoPE on its query and key heads'
        rotary dims (read, write), the MLP's activation (gated: read ``2I``, write ``I``; plain:
        read and write ``I``; per TP rank; an MoE layer's on its shared and top-k experts), its KV write."""
        s, tp = self.sizes, self.grid.tp
        h = s.hidden_size
        rope = s.head_dims[0] if s.attention == "gqa" else s.head_dims[3]
        rot = 2 * (s.num_heads // tp + s.kv_heads_per_rank(tp)) * rope
        dense = (3 if s.gated_mlp else 2) * s.dense_intermediate / tp
        if s.num_experts:
            mlp = (s.num_dense_layers * dense
                   + s.num_moe_layers * (s.top_k + s.num_shared_experts) * 3 * s.moe_intermediate) / s.num_layers
        else:
            mlp = dense
        act = self.act_bytes * (4 * h + 6 * h + rot + mlp)
        return act + s.entry_dim_per_rank(tp) * self.kv_bytes

    def _merge_bytes(self, layout, counts: StepCounts, nd: int, rest: int) -> float:
        """HBM bytes of merging partial outputs: DCP merges read ``n`` packed partials of each
        merged row and write it; a ring writes its ``n`` partials and merges them once
        (arXiv 2411.01783 sec. 3.5.2)."""
        s, grid = self.sizes, self.grid
        if grid.dcp <= 1:
            return 0.0
        heads = s.num_heads / grid.tp
        width = heads * (s.decode_v_dim * self.act_bytes + 4)
        rows = float(nd) + (float(rest) if counts.ring or "dcp_partials" in counts.calls
                            or "dcp_output_reduce_scatter" in counts.calls else 0.0)
        passes = 2 * grid.dcp + 1 if counts.ring else grid.dcp + 1
        return passes * rows * width * s.num_layers


def ring_loop(attention: np.ndarray, send: np.ndarray, *, overlap: bool = True) -> np.ndarray:
    """How long each rank waits on each iteration's hop, ``[P, P]`` (rank, iteration; the
    last iteration has none), as the loop runs (``pcpflow.attention.ring``): at iteration h
    rank r sends its package to r+1 and receives the next from r-1, while its ``attention[r,
    h]`` runs (after it, without ``overlap``); ``send[r, h]`` (``[P, P-1]`` seconds, 0: no
    call) is r's transfer. A transfer starts once both ends have posted it, i.e. reached the
    iteration: a hop is ``max(start[r], start[r+1]) + send[r]`` for the send and ``max(start[r
    - 1], start[r]) + send[r-1]`` for the receive, from the rank's own start. Ranks starting
    together make a hop ``max(send[r], send[r-1])``; a package that crosses the ring alone (a
    decode's query: N - 1 hops) pays its hops one after another, as the ranks on its way wait
    for it."""
    P = attention.shape[0]
    hop = np.zeros((P, P))
    start = np.zeros(P)
    for h in range(P - 1):
        s = send[:, h]
        done = np.where(s > 0, np.maximum(start, np.roll(start, -1)) + s, 0.0)  # r's send to r + 1 ends
        hop[:, h] = np.maximum(np.maximum(done, start), np.roll(done, 1)) - start  # and what r - 1 sends it
        start = start + (np.maximum(attention[:, h], hop[:, h]) if overlap else attention[:, h] + hop[:, h])
    return hop


def _cut(rows, *arrays: np.ndarray | None) -> tuple:
    """A call's ``(req, ctx, decode, starts)``: ``rows`` of each of ``arrays`` (None stays None)."""
    return tuple(None if a is None else rows(a) for a in arrays)


def _add(terms: dict, name: str, exposed: np.ndarray | float, hidden: np.ndarray | float) -> None:
    """Add a term's [P] seconds (a float: the same on every rank)."""
    if name in terms:
        terms[name] = (terms[name][0] + exposed, terms[name][1] + hidden)
    else:
        terms[name] = (exposed, hidden)


def _at(v: np.ndarray | float, rank: int) -> float:
    """A term's seconds on ``rank`` (a float is every rank's)."""
    return float(v[rank]) if isinstance(v, np.ndarray) else float(v)


def _busiest_shard(layout, positions, grid: RankGrid, interleave: int, dcp_rest: str, request_mask,
                   window: int | None = None) -> np.ndarray:
    """[P] (query, key) pairs of the busiest DCP shard of each PCP rank (of the requests
    ``request_mask`` keeps, all when None; ``window``: on one sliding layer). With DCP inside
    PCP this is ``attention_work``. With DCP over TP ranks every member scores every gathered
    row (all PCP ranks' rows, replicated decodes once per PCP rank, with its own heads) over
    its shard; member ``d = pcp_rank * dcp_tp + tp_local``."""
    if grid.dcp_tp == 1:
        return attention_work(layout, positions, dcp_size=grid.dcp, interleave=interleave, request_mask=request_mask,
                              dcp_rest=dcp_rest, window=window)
    first, rows, _ = (np.concatenate(x) for x in zip(*segment_runs(layout, positions, request_mask)))
    member = shard_pairs(first, rows, dcp_size=grid.dcp, interleave=interleave, window=window)
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


def gemm_peak_key(weights_dtype: str, act_key: str) -> str:
    """The peak a GEMM of ``weights_dtype`` weights computes at: its own, but mxfp4's is the
    activations' (weight-only: the 4.25-bit weights stream from HBM and are dequantized in the
    kernel, the math at the activations' dtype; W4A16 as vLLM runs gpt-oss's MXFP4 experts
    (``vllm/model_executor/layers/quantization/mxfp4.py``, ``get_mxfp4_backend``): Marlin or
    Triton's matmul_ogs on Hopper, which has no FP4 tensor cores; FlashInfer's MXFP4 x BF16
    kernels by default on Blackwell, MXFP8 activations only when asked for)."""
    return act_key if weights_dtype == "mxfp4" else weights_dtype


def _experts_touched(sizes: ModelSizes, rows):
    """Routed experts that ``rows`` tokens reach in expectation (uniform top-k routing)."""
    if not sizes.num_experts:
        return 0.0 * np.asarray(rows, dtype=np.float64)
    e, k = sizes.num_experts, sizes.top_k
    return e * (1.0 - (1.0 - k / e) ** np.asarray(rows, dtype=np.float64))
