"""The price of one step on one hardware profile: a roofline per rank for the GEMMs and
the attention, an alpha-beta model per collective, the step as long as its slowest rank.

Per PCP rank (its TP ranks hold the same rows and split heads and MLP, so they cost the
same) and step, with N the rank's padded rows and S the sampled rows:

- GEMMs: ``2 * active_params * N / tp`` FLOPs (+ the LM head on S rows, + MLA's expansion
  of the cached context a prefill reads) at ``peak[weights_dtype] * gemm_efficiency``;
  HBM: every weight the step touches once (MoE: the experts N routed rows reach, in
  expectation), at ``hbm_tbps * hbm_efficiency``; the slower of the two.
- attention: the rank's (query, key) pairs, from ``pcpflow.cp_attention.attention_work``
  (the executed count), ``2 * heads/tp * (qk + v)`` FLOPs each at ``peak.bf16 *
  attention_efficiency``; HBM: a decode row reads its keys once, a prefill row once per
  128-row query tile (FlashAttention); the slower of the two.
- collectives: the executed run's own list (``pcpflow.accounting.step_collectives``, per
  TP rank), plus tensor parallelism's two all-reduces of ``N x hidden`` per layer, each
  ``hops * latency + group_bytes / (n * busbw)`` (nccl-tests' bus bandwidth: (n-1)/n of
  the data for all-gather and all-to-all, 2(n-1)/n for all-reduce; hops n-1, 2(n-1)) on
  NVLink when the group sits in one node, else on the network (TP innermost).
- overlap ``ring``: the exchange before attention (kv_gather, dcp_query_gather,
  dcp_context_gather) runs as n-1 ring hops, hop i hidden behind the attention of chunk
  i-1, and each received chunk's partial output is merged into the fp32 accumulator
  (HBM-bound): ``attention/n + max(exchange, attention*(n-1)/n) + merges``; ``none``:
  attention and exchange one after the other (one attention over the gathered KV).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pcpflow.accounting import step_collectives, step_traffic
from pcpflow.cp_attention import attention_work
from pcpflow.grid import RankGrid
from pcpflow.simulate.settings import HardwareConfig, SimulateConfig
from pcpflow.simulate.sizes import DTYPE_BYTES, ModelSizes

EXCHANGE_PURPOSES = ("kv_gather", "dcp_query_gather", "dcp_context_gather")
"""Collectives that bring a layer's attention its inputs: what a ring overlaps."""
TP_PURPOSE = "tp_all_reduce"
FLASH_QUERY_TILE = 128  # query rows that share one read of a key tile (FlashAttention-2/3)
ACTIVATION_BYTES = 2  # activations and the TP all-reduces in bf16 (as a GPU serves)


class Placement:
    """Which link each group crosses: TP innermost, ``gpus_per_node`` per node; a group
    whose ranks share a node talks over NVLink, any other over the network."""

    def __init__(self, grid: RankGrid, hw: HardwareConfig) -> None:
        self.grid, self.hw = grid, hw
        members = {"tp": grid.tp_members(0), "pcp": grid.pcp_members(0), "dcp": grid.dcp_members(0)}
        self.sizes = {g: len(m) for g, m in members.items()}
        self.links = {
            g: hw.nvlink if len({r // hw.gpus_per_node for r in m}) == 1 else hw.network
            for g, m in members.items()
        }

    def link(self, group: str):
        return self.links[group]

    def size(self, group: str) -> int:
        return self.sizes[group]


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


def step_counts(batch, layout, *, grid: RankGrid, sizes: ModelSizes, dtype_bytes: int, dcp_rest,
                interleave: int, restore: str):
    """What the executed run counts for this step: per-rank attention pairs (and their
    decode part), and collective (calls, bytes) by purpose, per TP rank (tp > 1 adds the
    card-priced TP all-reduces)."""
    shape = sizes.shape_per_rank(grid.tp, dtype_bytes)
    pairs = attention_work(layout, batch.positions, dcp_size=grid.dcp, interleave=interleave, dcp_rest=dcp_rest.mode)
    decode = ~batch.is_prefilling[batch.req_indices]
    if decode.all():
        decode_pairs = pairs
    elif not decode.any():
        decode_pairs = np.zeros_like(pairs)
    else:
        decode_pairs = attention_work(layout, batch.positions, dcp_size=grid.dcp, interleave=interleave,
                                      token_mask=decode, dcp_rest=dcp_rest.mode)
    colls = step_collectives(layout, batch.logits_indices, dcp_size=grid.dcp, shape=shape, dcp_rest=dcp_rest,
                             restore=restore)
    calls, nbytes = step_traffic(colls, pcp_size=grid.pcp, dcp_size=grid.dcp, dtype_bytes=dtype_bytes)
    if grid.tp > 1:
        ar = 2 * sizes.num_layers
        calls[TP_PURPOSE] = ar
        nbytes[TP_PURPOSE] = ar * 2 * (grid.tp - 1) * layout.padded_num_tokens * sizes.hidden_size * ACTIVATION_BYTES
    ops = {c.purpose: c.op for c in colls}
    ops[TP_PURPOSE] = "all_reduce"
    groups = {c.purpose: c.group for c in colls}
    groups[TP_PURPOSE] = "tp"
    return pairs, decode_pairs, calls, nbytes, ops, groups


def price_step(batch, layout, counts, *, place: Placement, sizes: ModelSizes, sim: SimulateConfig) -> StepPrice:
    pairs, decode_pairs, calls, nbytes, ops, groups = counts
    grid, hw = place.grid, place.hw
    P, tp = grid.pcp, grid.tp
    pairs = _per_pcp_rank(pairs, grid).astype(np.float64)
    decode_pairs = _per_pcp_rank(decode_pairs, grid).astype(np.float64)
    prefill_pairs = pairs - decode_pairs
    rows = float(layout.padded_num_tokens)
    samples = float(len(batch.logits_indices))

    # GEMMs (every rank computes its padded rows; the LM head runs on the sampled rows).
    w_bytes = DTYPE_BYTES[sim.weights_dtype]
    gemm_flops = 2.0 * (sizes.active_params_per_row() * rows + sizes.vocab_size * sizes.hidden_size * samples) / tp
    gemm_flops = np.full(P, gemm_flops) + 2.0 * sizes.num_layers * sizes.kv_b_params * _prefill_context(batch, layout, grid) / tp
    touched = _experts_touched(sizes, rows)
    weight_bytes = (sizes.layer_weight_params(touched) * w_bytes + sizes.vocab_size * sizes.hidden_size * 2) / tp
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
    purpose_s = {
        k: calls[k] * collective_seconds(ops[k], nbytes[k] / calls[k], place.size(groups[k]), place.link(groups[k]))
        for k in calls
    }
    exchange = sum(v for k, v in purpose_s.items() if k in EXCHANGE_PURPOSES)
    exposed = sum(v for k, v in purpose_s.items() if k not in EXCHANGE_PURPOSES)
    merge = np.zeros(P)
    if sim.overlap == "ring" and exchange > 0:
        n = max(place.size(groups[k]) for k in purpose_s if k in EXCHANGE_PURPOSES)
        # NOTE: a ring attends chunk by chunk, so each of the n-1 received chunks' partial
        # output is merged into the fp32 accumulator (read it, read the partial, write it).
        merge_bytes = (n - 1) * rows * sizes.num_heads / tp * sizes.num_layers * (
            sizes.decode_v_dim * (4 + ACTIVATION_BYTES + 4) + 3 * 4
        )
        merge = np.full(P, merge_bytes / (hw.hbm_tbps * 1e12 * sim.hbm_efficiency))
        attn_phase = t_attn / n + np.maximum(exchange, t_attn * (n - 1) / n) + merge
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
    return StepPrice(
        step_s=float(total[slow]),
        compute_s=compute,
        memory_s=memory,
        communication_s=comm,
        purpose_s=purpose_s,
        flops=gemm_flops + attn_flops,
        hbm_bytes=weight_bytes + kv_bytes,
    )


def _per_pcp_rank(work: np.ndarray, grid: RankGrid) -> np.ndarray:
    """``attention_work`` is per PCP rank without DCP and per DCP rank with it; a PCP
    rank's TP ranks wait for the busiest of their shards."""
    work = np.asarray(work)
    if len(work) == grid.pcp:
        return work
    if grid.pcp == 1:
        return np.asarray([work.max()])
    return work.reshape(grid.dcp_tp, grid.pcp).max(axis=0)  # DCP rank = tp_local * pcp + pcp_rank


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


def _experts_touched(sizes: ModelSizes, rows: float) -> float:
    """Routed experts that ``rows`` tokens reach in expectation (uniform top-k routing)."""
    if not sizes.num_experts:
        return 0.0
    e, k = sizes.num_experts, sizes.top_k
    return e * (1.0 - (1.0 - k / e) ** rows)
