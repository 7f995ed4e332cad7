"""What one step's collectives move, from the layout alone (numpy only, no torch).

This is the one definition of *which* collectives a step does and *how big* they are:
``CPAttention`` asks ``attention_rows`` which rows move and ``plan_dcp_rest`` which DCP
path the rest of them take, the ``sampled_rows`` restore asks ``sampled_row_holders``
which rows it sends, ``Comm`` counts bytes with ``traffic_factor``; planner-only tools
(``scripts/compare_layouts.py``) price a layout with ``step_collectives`` without running
a model; ``ring_step_traffic`` lists what a ring (``pipeline.forward.cp_attention``) sends,
per rank (the table near the end). Per layer, on a batch of ``N`` padded rows per rank whose first ``nd`` rows are
replicated decodes:

====================  ==========  =====  =======================================
purpose               op          group  rows sent by each rank x row width
====================  ==========  =====  =======================================
kv_gather             all_gather  PCP    ``N - nd`` x ``entry_dim`` (if any rank has
                                         real rows past ``nd``)
dcp_decode_partials   all_gather  DCP    ``nd`` x ``H*(Dv + k)`` (partial out + lse)
*rest rows, queries path:*
dcp_query_gather      all_gather  DCP    ``N - nd`` x ``H`` x ``qk_dim``
dcp_partials          all_to_all  DCP    ``D * (N - nd)`` x ``H*(Dv + k)``
*rest rows, context path:*
dcp_context_gather    all_gather  DCP    ``M`` x ``entry_dim``
====================  ==========  =====  =======================================

where ``M`` (``context_rows``) is the most KV entries one DCP rank holds of the whole
contexts ``[0, seq_len)`` of the requests with a rest row on any rank (every rank pads
its part to it). The rest rows take one path per step (``plan_dcp_rest``): ``queries``
(their queries go to every shard, partials come back and are merged), ``context`` (the
shards of their requests' contexts are gathered and each rank attends its own rows over
the whole context), or ``auto``: whichever moves fewer bytes, by the table above.
Partials travel in the model's dtype, each head's log-sum-exp (float32 at least) bit for bit
in ``k`` elements of it (``k = 2`` in bf16, else 1: ``ModelShape.partials_width``).
Once per step ``restore``, an all_gather over PCP of ``N`` (``all_rows``) or of the
largest rank's count of sampled rows (``sampled_rows``) hidden states.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from pcpflow.layouts.layout import BatchLayout, TokenPositions, as_positions, plan_layout
from pcpflow.layouts.ring import (
    REPLICATED,
    STAYS,
    TRAVELS,
    RingPlan,
    plan_ring,
    request_num_computed,
)
from pcpflow.layouts.slots import (
    Window,
    as_window,
    chunk_runs,
    dcp_local_seq_lens,
    dcp_shard_len_sums,
    dcp_shard_lens,
)

DCP_REST_POLICIES = ("auto", "queries", "context")
"""How the rows past the replicated-decode prefix attend under DCP (``plan_dcp_rest``)."""


def traffic_factor(op: str, group_size: int) -> int:
    """Bytes moved per byte of one rank's tensor: what every rank receives from the
    others, summed over the group (``pcpflow.parallel.comm`` documents the model)."""
    s = int(group_size)
    if s <= 1:
        return 0
    factors = {
        "all_gather": s * (s - 1),
        "all_to_all": s - 1,
        "broadcast": s - 1,
        "all_reduce": 2 * (s - 1),
        "reduce_scatter": s - 1,  # of the full tensor each rank passes in
    }
    if op not in factors:
        raise ValueError(f"unknown collective {op!r}; known: {', '.join(factors)}")
    return factors[op]


@dataclass(frozen=True)
class ModelShape:
    """The sizes that set collective volumes (a model's ``AttentionSpec`` plus width)."""

    hidden_size: int
    num_layers: int
    entry_dim: int  # KV cache entry per token and layer
    num_heads: int  # query heads
    qk_dim: int  # per-head query dim as the attention kernel sees it
    v_dim: int  # per-head attention output dim
    dtype_bytes: int
    full_qk_norm: bool = False  # q and k normed over the whole projection (OLMo 2): a TP all-reduce each

    @property
    def partials_width(self) -> int:
        """One row of packed partial attention in the model's dtype: per-head output, then
        per-head log-sum-exp in float32 at least, bit for bit in as many elements as it takes
        (two of bf16: ``pcpflow.attention.paged.pack_partials``)."""
        return self.num_heads * (self.v_dim + max(1, 4 // self.dtype_bytes))

    @property
    def accumulation_bytes(self) -> int | None:
        """Element size of what is summed or merged in float32 at least (``ag_rs``'s
        log-sum-exps and rescaled outputs), when it differs from the model's
        (``pcpflow.attention.paged.accumulation_dtype``)."""
        return 4 if self.dtype_bytes < 4 else None


@dataclass(frozen=True)
class Collective:
    op: str  # all_gather | all_to_all
    purpose: str
    group: Literal["pcp", "dcp", "tp", "dcp_heads"]
    shape: tuple[int, ...]  # the tensor each rank passes in
    dtype_bytes: int | None = None  # element size, when not the model dtype's

    def nbytes(self, group_size: int, dtype_bytes: int) -> int:
        size = self.dtype_bytes or dtype_bytes
        return math.prod(self.shape) * size * traffic_factor(self.op, group_size)


def attention_rows(layout: BatchLayout) -> tuple[int, int]:
    """(``nd``, ``rest``): each rank's leading replicated-decode rows, which never move,
    and the rows after them that every layer all-gathers across PCP (0 when no rank has
    a real row past ``nd``: a batch of replicated decodes only)."""
    nd = layout.num_replicated_decode_tokens
    moves = max(layout.per_rank_num_tokens.tolist()) > nd  # NOTE: a few ints: no numpy call on them
    return nd, (layout.padded_num_tokens - nd) if moves else 0


@dataclass(frozen=True)
class DCPRest:
    """The DCP path of one step's rest rows (the rows past the replicated-decode prefix)."""

    mode: Literal["queries", "context"]
    context_rows: int = 0  # M: rows each DCP rank sends in the context gather (context)


QUERIES = DCPRest("queries")


def rest_requests(layout: BatchLayout) -> np.ndarray:
    """The requests with a real rest row on any rank (sorted batch indices): the same on
    every rank, since the layout is."""
    nd = layout.num_replicated_decode_tokens
    # NOTE: replicated decodes are whole segments filling the first nd rows of every rank.
    return np.unique(
        np.concatenate([seg.req_idx[seg.local_start >= nd] for seg in layout.segments])
    )


def context_rows(seq_lens, *, dcp_size: int, interleave: int) -> int:
    """``M``: the most KV entries one DCP rank stores of the contexts ``[0, L)`` of
    sequences of lengths ``seq_lens`` (each rank's part of the context gather is padded
    to it)."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    return max(
        int(dcp_local_seq_lens(lens, dcp_size, r, interleave).sum()) for r in range(dcp_size)
    )


def plan_dcp_rest(
    layout: BatchLayout,
    seq_lens,
    *,
    policy: str,
    dcp_size: int,
    interleave: int,
    shape: ModelShape,
) -> DCPRest:
    """The path of this step's rest rows under ``policy`` (one of ``DCP_REST_POLICIES``).

    ``seq_lens`` (int [R]) is each request's context once this step's tokens are written
    (``num_computed + num_scheduled``). ``auto`` takes the path whose DCP collectives
    (``layer_collectives``) move fewer bytes, ``queries`` on a tie. A function of the
    global batch only, so every rank takes the same path (it decides which collectives
    run). Without DCP, or without rest rows, nothing moves either way: ``queries``.
    """
    if policy not in DCP_REST_POLICIES:
        raise ValueError(
            f"unknown dcp_rest policy {policy!r}; known: {', '.join(DCP_REST_POLICIES)}"
        )
    _, rest = attention_rows(layout)
    if dcp_size == 1 or not rest or policy == "queries":
        return QUERIES
    lens = np.asarray(seq_lens, dtype=np.int64)[rest_requests(layout)]
    context = DCPRest("context", context_rows(lens, dcp_size=dcp_size, interleave=interleave))
    if policy == "context":
        return context

    def dcp_bytes(r: DCPRest) -> int:
        colls = layer_collectives(layout, dcp_size=dcp_size, shape=shape, dcp_rest=r)
        return sum(c.nbytes(dcp_size, shape.dtype_bytes) for c in colls if c.group == "dcp")

    return context if dcp_bytes(context) < dcp_bytes(QUERIES) else QUERIES


def layer_collectives(
    layout: BatchLayout, *, dcp_size: int, shape: ModelShape, dcp_rest: DCPRest
) -> list[Collective]:
    """One attention layer's collectives, in the order ``CPAttention`` issues them, with
    the rest rows on the path ``dcp_rest`` (``plan_dcp_rest``)."""
    nd, rest = attention_rows(layout)
    out = []
    if rest:
        out.append(Collective("all_gather", "kv_gather", "pcp", (rest, shape.entry_dim)))
    if dcp_size > 1:
        if nd:
            out.append(
                Collective(
                    "all_gather",
                    "dcp_decode_partials",
                    "dcp",
                    (nd, shape.partials_width),
                )
            )
        if rest and dcp_rest.mode == "context":
            out.append(
                Collective(
                    "all_gather",
                    "dcp_context_gather",
                    "dcp",
                    (dcp_rest.context_rows, shape.entry_dim),
                )
            )
        elif rest:
            out.append(
                Collective(
                    "all_gather", "dcp_query_gather", "dcp", (rest, shape.num_heads, shape.qk_dim)
                )
            )
            out.append(
                Collective(
                    "all_to_all",
                    "dcp_partials",
                    "dcp",
                    (dcp_size * rest, shape.partials_width),
                )
            )
    return out


def sampled_row_holders(
    layout: BatchLayout, logits_indices: np.ndarray
) -> tuple[np.ndarray, np.ndarray, int]:
    """Where each sampled token's hidden state is canonically held: (rank, local row) per
    sample, and the largest number of samples one rank holds (the rows each rank sends
    in a ``sampled_rows`` restore)."""
    holder = layout.hidden_restore_idx[np.asarray(logits_indices, dtype=np.int64)]  # gathered row
    if not len(holder):
        return holder, holder, 0
    rank, row = np.divmod(holder, layout.padded_num_tokens)
    return rank, row, int(np.bincount(rank, minlength=layout.pcp_size).max())


def restore_collective(
    layout: BatchLayout, logits_indices: np.ndarray, *, kind: str, hidden_size: int
) -> Collective:
    """The restore's all_gather of hidden states: every row, or only the sampled ones."""
    if kind == "all_rows":
        rows = layout.padded_num_tokens
    elif kind == "sampled_rows":
        rows = sampled_row_holders(layout, logits_indices)[2]
    else:
        raise ValueError(f"unknown restore kind {kind!r}; known: all_rows, sampled_rows")
    return Collective("all_gather", "restore", "pcp", (rows, hidden_size))


def step_collectives(
    layout: BatchLayout,
    logits_indices: np.ndarray,
    *,
    dcp_size: int,
    shape: ModelShape,
    dcp_rest: DCPRest,
    restore: str = "all_rows",
) -> list[Collective]:
    """Every collective of one target-model step (no drafter), in issue order, with the
    rest rows on the path ``dcp_rest`` (``plan_dcp_rest``)."""
    per_layer = layer_collectives(layout, dcp_size=dcp_size, shape=shape, dcp_rest=dcp_rest)
    return per_layer * shape.num_layers + [
        restore_collective(layout, logits_indices, kind=restore, hidden_size=shape.hidden_size)
    ]


def count_collectives(collectives: list[Collective]) -> Counter[Collective]:
    """How often each distinct collective occurs, in the order of first occurrence. A step's
    list repeats one layer's objects per layer, then adds the restore's: the layer's run is
    counted once and scaled by its repeats (hashing a dataclass costs ~0.7 us; a search and
    a serving run price thousands of steps); a list that is no such run is counted by
    identity first (an id costs next to nothing), then equal ones merged."""
    # NOTE: the run ends before the first call's next occurrence, and is checked (list
    # equality tries identity first): a prefill step's list is new, no cache holds it.
    n = period = len(collectives)
    if n > 1:
        try:
            period = collectives.index(collectives[0], 1)
        except ValueError:
            pass
    reps = n // period if n else 0
    if reps > 1 and collectives[: period * reps] == collectives[:period] * reps:
        out = Counter(collectives[:period])
        for c in out:
            out[c] *= reps
        out.update(collectives[period * reps :])
        return out
    ids = list(map(id, collectives))
    by_id = Counter(ids)
    if len(by_id) == len(ids):
        return Counter(collectives)
    out: Counter[Collective] = Counter()
    for i, n in by_id.items():  # NOTE: first occurrences come early (the first layer's): index() finds them fast
        out[collectives[ids.index(i)]] += n
    return out


def step_traffic(
    collectives: list[Collective] | Counter[Collective],
    *,
    pcp_size: int,
    dcp_size: int,
    dtype_bytes: int,
    tp_size: int = 1,
) -> tuple[dict[str, int], dict[str, int]]:
    """(calls, bytes) by purpose, as ``CommStats`` records them (groups of one move
    nothing and are not counted). Bytes count every group of an axis (``Comm.copies``:
    tp PCP groups, pcp TP groups, ...), so at tp > 1 they are the whole job's.
    ``collectives``: the step's list, or its ``count_collectives`` when the caller has it."""
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    world = pcp_size * tp_size
    sizes = {"pcp": pcp_size, "dcp": dcp_size, "tp": tp_size, "dcp_heads": dcp_tp_size(pcp_size, dcp_size)}
    counted = collectives if isinstance(collectives, Counter) else count_collectives(collectives)
    for c, n in counted.items():  # every layer repeats the same calls
        size = sizes[c.group]
        if size > 1:
            calls[c.purpose] += n
            nbytes[c.purpose] += n * c.nbytes(size, dtype_bytes) * (world // size)
    return dict(calls), dict(nbytes)


# --- tensor parallel
# Under TP every per-layer size above is one TP rank's (its heads: ``ModelShape`` of the
# local ``AttentionSpec``). Per decoder layer, on N padded rows:
#
# ==========================  ==============  =====  =================================
# purpose                     op              group  tensor each rank passes in
# ==========================  ==============  =====  =================================
# tp_all_reduce (x2)          all_reduce      TP     ``N`` x ``hidden`` (o_proj, down_proj)
# *DCP over T = dcp_tp TP ranks, instead of the DCP rows above; R = N - nd rest rows:*
# dcp_decode_query_gather     all_gather      heads  ``nd`` x ``H`` x ``qk_dim`` (T ranks)
# dcp_decode_lse_gather       all_gather      DCP    ``T * nd`` x ``H`` (ag_rs; fp32 at least)
# dcp_decode_output_r..._s... reduce_scatter  DCP    ``D * nd`` x ``H`` x ``Dv`` (ag_rs)
# dcp_decode_partials         all_to_all      DCP    ``D * nd`` x ``H*(Dv + k)`` (a2a)
# dcp_query_gather            all_gather      DCP    ``R`` x ``H`` x ``qk_dim``
# dcp_lse_gather              all_gather      DCP    ``D * R`` x ``H`` (ag_rs)
# dcp_output_reduce_scatter   reduce_scatter  DCP    ``D * R`` x ``H`` x ``Dv`` (ag_rs)
# dcp_partials                all_to_all      DCP    ``D * R`` x ``H*(Dv + k)`` (a2a)
# ==========================  ==============  =====  =================================

DCP_COMM_BACKENDS = ("ag_rs", "a2a")


def dcp_tp_size(pcp_size: int, dcp_size: int) -> int:
    """TP ranks one DCP group spans (``RankGrid.dcp_tp``), from the group sizes."""
    if dcp_size == 1:
        return 1
    return dcp_size // pcp_size if pcp_size > 1 else dcp_size


def tp_layer_collectives(layout: BatchLayout, *, tp_size: int, shape: ModelShape) -> list[Collective]:
    """A decoder layer's TP all-reduces (none at tp=1): the row-parallel ``o_proj`` and the
    MLP's ``down_proj``, then, with ``shape.full_qk_norm``, q's and k's sums of squares (one
    number a row, in float32 at least: ``pcpflow.parallel.tensor_parallel.ShardedRMSNorm``)."""
    if tp_size == 1:
        return []
    rows = layout.padded_num_tokens
    out = [Collective("all_reduce", "tp_all_reduce", "tp", (rows, shape.hidden_size))] * 2
    if shape.full_qk_norm:
        out += [Collective("all_reduce", "tp_qk_norm", "tp", (rows, 1), shape.accumulation_bytes)] * 2
    return out


def dcp_over_tp_collectives(
    layout: BatchLayout, *, dcp_size: int, shape: ModelShape, backend: str = "ag_rs"
) -> list[Collective]:
    """One attention layer's DCP collectives when the DCP group spans ``T = dcp_tp`` TP
    ranks: replicated decode rows (the same on every PCP rank) gather their queries over
    heads only (``dcp_heads``, the T ranks at one PCP rank); the rest rows of every member
    over the whole group. Results go back to their heads' owners by ``backend``."""
    if backend not in DCP_COMM_BACKENDS:
        raise ValueError(f"unknown dcp_comm_backend {backend!r}; known: {', '.join(DCP_COMM_BACKENDS)}")
    nd, rest = attention_rows(layout)
    h, d, t = shape.num_heads, dcp_size, dcp_tp_size(layout.pcp_size, dcp_size)
    wide = shape.accumulation_bytes  # log-sum-exps and rescaled outputs: fp32 at least

    def to_owners(prefix: str, blocks: int, rows: int) -> list[Collective]:
        if backend == "a2a":
            return [Collective("all_to_all", f"{prefix}_partials", "dcp", (d * rows, shape.partials_width))]
        return [
            Collective("all_gather", f"{prefix}_lse_gather", "dcp", (blocks * rows, h), wide),
            Collective(
                "reduce_scatter", f"{prefix}_output_reduce_scatter", "dcp", (d * rows, h, shape.v_dim), wide
            ),
        ]

    out = []
    if nd:
        out.append(Collective("all_gather", "dcp_decode_query_gather", "dcp_heads", (nd, h, shape.qk_dim)))
        out += to_owners("dcp_decode", t, nd)
    if rest:
        out.append(Collective("all_gather", "dcp_query_gather", "dcp", (rest, h, shape.qk_dim)))
        out += to_owners("dcp", d, rest)
    return out


def tp_step_collectives(
    layout: BatchLayout,
    logits_indices: np.ndarray,
    *,
    tp_size: int,
    dcp_size: int,
    shape: ModelShape,
    dcp_rest: DCPRest = QUERIES,
    restore: str = "all_rows",
    backend: str = "ag_rs",
) -> list[Collective]:
    """Every collective of one target-model step on the grid ``tp x pcp`` (the layout's
    ``pcp_size``) with ``dcp_size`` KV shards: ``step_collectives`` with the TP all-reduces
    and, when DCP spans TP ranks, its heads exchange. ``shape`` is one TP rank's."""
    per_layer = attention_collectives(layout, dcp_size=dcp_size, shape=shape, dcp_rest=dcp_rest, backend=backend)
    per_layer = per_layer + tp_layer_collectives(layout, tp_size=tp_size, shape=shape)
    return per_layer * shape.num_layers + [
        restore_collective(layout, logits_indices, kind=restore, hidden_size=shape.hidden_size)
    ]


def attention_collectives(
    layout: BatchLayout, *, dcp_size: int, shape: ModelShape, dcp_rest: DCPRest = QUERIES, backend: str = "ag_rs"
) -> list[Collective]:
    """One attention layer's collectives (``CPAttention``) on the grid: ``layer_collectives``,
    or, when DCP spans TP ranks, the KV gather and ``dcp_over_tp_collectives``."""
    if dcp_tp_size(layout.pcp_size, dcp_size) > 1:
        nd, rest = attention_rows(layout)
        per_layer = [Collective("all_gather", "kv_gather", "pcp", (rest, shape.entry_dim))] if rest else []
        return per_layer + dcp_over_tp_collectives(layout, dcp_size=dcp_size, shape=shape, backend=backend)
    return layer_collectives(layout, dcp_size=dcp_size, shape=shape, dcp_rest=dcp_rest)


# --- drafting: a draft stage's collectives (``pcpflow.speculative``), accounted apart


def replicated_layout(num_rows: int, *, pcp_size: int, dcp_size: int) -> BatchLayout:
    """``num_rows`` decode rows on every PCP rank: a drafter's replicated forward
    (``pcpflow.speculative.attention.replicated_attention``)."""
    return plan_layout(np.ones(num_rows, dtype=np.int64), np.zeros(num_rows, dtype=bool),
                       pcp_size=pcp_size, dcp_size=dcp_size, shard_decodes=False)


def draft_step_collectives(
    layout: BatchLayout,
    replicated: list[BatchLayout],
    *,
    tp_size: int,
    dcp_size: int,
    shape: ModelShape,
    dcp_rest: DCPRest,
    backend: str,
    prefill: str,
    restore: bool,
    own_tp: bool,
    num_moe_layers: int = 0,
) -> list[Collective]:
    """Every collective one drafting step issues after the target's forward, in issue order,
    under the purposes it is accounted by (``DraftComm``: ``draft_<purpose>``). ``shape``: the
    drafter's layers (one TP rank's; ``num_layers`` of them). Its prefill over the step's
    ``layout`` either attends (``attend``: the target's DCP path ``dcp_rest``) or only writes
    its KV (``write``: the gather of the rest rows' entries, and under TP the ``o_proj``
    all-reduce of the attention it skips); ``restore``: the prefill's hidden rows are
    all-gathered over PCP. Then one forward per ``replicated`` layout (decode rows on every
    rank). TP all-reduces are the drafter's own (``own_tp``: ``draft_tp_all_reduce``) or the
    target's layers' (``tp_all_reduce``; of which ``num_moe_layers`` have one, not two: an
    MoE MLP is not split over TP)."""
    tp = "draft_tp_all_reduce" if own_tp else "tp_all_reduce"

    def forward(lay: BatchLayout, attend: bool, rest: DCPRest) -> list[Collective]:
        nd, rows = attention_rows(lay)
        if attend:
            attn = attention_collectives(lay, dcp_size=dcp_size, shape=shape, dcp_rest=rest, backend=backend)
        else:
            attn = [Collective("all_gather", "kv_gather", "pcp", (rows, shape.entry_dim))] if rows else []
        attn = [replace(c, purpose=f"draft_{c.purpose}") for c in attn]
        layer = tp_layer_collectives(lay, tp_size=tp_size, shape=shape)
        reduces = [replace(c, purpose=tp) if c.purpose == "tp_all_reduce" else c for c in layer]
        if not attend:
            # NOTE: o_proj of the zeros the writer returns and the q/k norms before it; no MLP runs
            reduces = reduces[:1] + reduces[2:]
        out = (attn + reduces) * shape.num_layers
        for _ in range(num_moe_layers if reduces and attend else 0):
            out.remove(reduces[1])
        return out

    out = forward(layout, prefill == "attend", dcp_rest)
    if restore:
        out.append(Collective("all_gather", "draft_restore", "pcp", (layout.padded_num_tokens, shape.hidden_size)))
    for lay in replicated:
        out += forward(lay, True, QUERIES)
    return out


def tp_local_shape(shape: ModelShape, tp_size: int) -> ModelShape:
    """One TP rank's ``ModelShape``: ``num_heads / tp`` heads; a GQA entry (``2 * kv *
    qk_dim`` wide) keeps ``kv / tp`` KV heads (at least one, shared); MLA's latent entry
    (``entry_dim == qk_dim``, absorbed queries) is whole on every rank."""
    if tp_size == 1:
        return shape
    entry = shape.entry_dim
    if entry != shape.qk_dim:
        kv = entry // (2 * shape.qk_dim)
        entry = 2 * max(1, kv // tp_size) * shape.qk_dim
    return ModelShape(
        hidden_size=shape.hidden_size,
        num_layers=shape.num_layers,
        entry_dim=entry,
        num_heads=shape.num_heads // tp_size,
        qk_dim=shape.qk_dim,
        v_dim=shape.v_dim,
        dtype_bytes=shape.dtype_bytes,
    )


def tp_share(nbytes: dict[str, int]) -> dict[str, int]:
    """Bytes by axis: ``{"tp": ..., "pcp_dcp": ...}`` (TP all-reduces, and the rest but
    verification), for tables that show TP beside PCP/DCP traffic."""
    tp = sum(v for k, v in nbytes.items() if k.endswith("tp_all_reduce"))
    return {"tp": tp, "pcp_dcp": sum(nbytes.values()) - tp}
# --- mixture of experts
# Per MoE layer (``pcpflow.parallel.moe_dispatch``), on ``N`` padded rows per PCP rank, hidden width
# ``h``, ``k`` experts per token, over the ``W = tp * pcp`` expert ranks:
#
# ==================  ==============  =====  ==============================================
# purpose             op              group  what each rank passes in
# ==================  ==============  =====  ==============================================
# *gather* (vLLM's moe_gathers_tokens)
# moe_gather          all_gather      PCP    ``N`` x ``h`` (its rows, padded)
# moe_reduce_scatter  reduce_scatter  PCP    ``P * N`` x ``h`` (partial sums of every row)
# moe_reduce_scatter  all_reduce      TP     ``N`` x ``h`` (when tp > 1)
# *all_to_all* (expert parallelism; ``R[s, d]`` rows rank s sends rank d)
# moe_counts          all_gather      world  ``W`` int64 (the rows it sends each rank)
# moe_dispatch        all_to_all (v)  world  ``R[s, d]`` x ``h``, then ``R[s, d]`` x ``2k``
#                                            float64 (its expert ids and weights)
# moe_combine         all_to_all (v)  world  ``R[d, s]`` x ``h`` (each row's partial sum back)
# moe_combine         broadcast       TP     ``N`` x ``h`` (when tp > 1: TP rank 0 dispatches)
# ==================  ==============  =====  ==============================================
#
# A row is sent once to each rank that owns at least one of its experts (the owner of
# expert ``e`` is ``e // (E / W)``); rows to oneself move nothing. ``local`` moves nothing.

MOE_DISPATCH_MODES = ("local", "gather", "all_to_all")
MOE_ID_BYTES = 8  # expert ids and weights travel as float64 beside each row


def moe_gather_collectives(
    padded_num_tokens: int, pcp_size: int, hidden_size: int, *, tp_size: int = 1
) -> list[Collective]:
    """One MoE layer's collectives under ``moe.dispatch=gather``, in issue order."""
    n, h = padded_num_tokens, hidden_size
    out = [
        Collective("all_gather", "moe_gather", "pcp", (n, h)),
        Collective("reduce_scatter", "moe_reduce_scatter", "pcp", (pcp_size * n, h)),
    ]
    if tp_size > 1:
        tp_sum = Collective("all_reduce", "moe_reduce_scatter", "tp", (n, h))  # type: ignore[arg-type]
        out.append(tp_sum)
    return out


def moe_owner(expert_ids: np.ndarray, num_experts: int, num_ranks: int) -> np.ndarray:
    """The rank that owns each expert id (experts split into ``num_ranks`` equal runs)."""
    return np.asarray(expert_ids) // (num_experts // num_ranks)


def moe_all_to_all_calls(
    send_rows: np.ndarray, *, hidden_size: int, top_k: int, dtype_bytes: int
) -> list[tuple[str, int]]:
    """(purpose, bytes) of each collective of one MoE layer's all_to_all dispatch and
    combine, in issue order, from the ``[W, W]`` matrix of rows each rank sends each rank
    (``Comm``'s model: what every rank receives from the others, summed over the group).
    Each row travels with its ``top_k`` expert ids and weights as ``2 * top_k`` float64."""
    r = np.asarray(send_rows, dtype=np.int64)
    w = r.shape[0]
    if w <= 1:
        return []
    moved = int(r.sum() - np.trace(r))
    return [
        ("moe_counts", w * (w - 1) * w * MOE_ID_BYTES),
        ("moe_dispatch", moved * hidden_size * dtype_bytes),
        ("moe_dispatch", moved * 2 * top_k * MOE_ID_BYTES),
        ("moe_combine", moved * hidden_size * dtype_bytes),
    ]


def moe_uniform_send_rows(
    rows_per_rank: np.ndarray, *, top_k: int, num_experts: int, num_ranks: int
) -> np.ndarray:
    """The expected ``[W, W]`` send matrix when every real row picks ``top_k`` distinct
    experts uniformly at random (what a simulator prices without a router): a row reaches
    a rank holding ``E / W`` experts with probability ``1 - C(E - E/W, k) / C(E, k)``."""
    per_rank = num_experts // num_ranks
    miss = math.comb(num_experts - per_rank, top_k) / math.comb(num_experts, top_k)
    rows = np.asarray(rows_per_rank, dtype=np.float64)
    return np.repeat(rows[:, None] * (1.0 - miss), num_ranks, axis=1)


# --- simulate: a whole step's collectives on the tp x pcp grid, MoE layers included
# (``pcpflow.simulate.price`` counts and prices a step with these; the executed run issues
# the same calls from ``CPAttention``, ``RowParallelLinear`` and ``pcpflow.parallel.moe_dispatch``).
# An MoE layer's MLP is not split over TP (``shard_mlp``): it has one ``tp_all_reduce``
# (``o_proj``), a dense layer two.


def grid_step_collectives(
    layout: BatchLayout,
    logits_indices: np.ndarray,
    *,
    tp_size: int,
    dcp_size: int,
    shape: ModelShape,
    dcp_rest: DCPRest = QUERIES,
    restore: str = "all_rows",
    backend: str = "ag_rs",
    num_moe_layers: int = 0,
    moe_dispatch: str = "local",
) -> list[Collective]:
    """``tp_step_collectives`` of a model of which ``num_moe_layers`` layers are MoE
    under ``moe_dispatch``: their down_proj all-reduce dropped, ``moe_gather_collectives``
    added for ``gather``. ``all_to_all``'s world-group calls are not ``Collective``s of a
    fixed shape (they depend on routing): ``moe_all_to_all_step_traffic`` counts them."""
    if moe_dispatch not in MOE_DISPATCH_MODES:
        raise ValueError(f"unknown moe.dispatch {moe_dispatch!r}; known: {', '.join(MOE_DISPATCH_MODES)}")
    out = tp_step_collectives(
        layout, logits_indices, tp_size=tp_size, dcp_size=dcp_size, shape=shape, dcp_rest=dcp_rest,
        restore=restore, backend=backend,
    )
    if not num_moe_layers:
        return out
    if tp_size > 1:
        down = tp_layer_collectives(layout, tp_size=tp_size, shape=shape)[1]
        for _ in range(num_moe_layers):
            out.remove(down)
    if moe_dispatch == "gather":
        out += moe_gather_collectives(
            layout.padded_num_tokens, layout.pcp_size, shape.hidden_size, tp_size=tp_size
        ) * num_moe_layers
    return out


def moe_all_to_all_step_traffic(
    send_rows: np.ndarray,
    *,
    num_moe_layers: int,
    padded_num_tokens: int,
    tp_size: int,
    hidden_size: int,
    top_k: int,
    dtype_bytes: int,
) -> tuple[dict[str, int], dict[str, int]]:
    """(calls, bytes) by purpose of ``num_moe_layers`` all_to_all MoE layers that each
    send ``send_rows`` ([W, W], ``moe_all_to_all_calls``), with the TP broadcast of the
    combined rows when tp > 1 (bytes over all ``W / tp`` TP groups, as ``Comm`` counts)."""
    calls: dict[str, int] = defaultdict(int)
    nbytes: dict[str, int] = defaultdict(int)
    for purpose, b in moe_all_to_all_calls(send_rows, hidden_size=hidden_size, top_k=top_k, dtype_bytes=dtype_bytes):
        calls[purpose] += num_moe_layers
        nbytes[purpose] += num_moe_layers * b
    if tp_size > 1:
        w = np.asarray(send_rows).shape[0]
        bcast = Collective("broadcast", "moe_combine", "tp", (padded_num_tokens, hidden_size))
        calls["moe_combine"] += num_moe_layers
        nbytes["moe_combine"] += num_moe_layers * bcast.nbytes(tp_size, dtype_bytes) * (w // tp_size)
    return dict(calls), dict(nbytes)


def moe_all_to_all_rows(per_rank_num_tokens: np.ndarray, tp_size: int) -> np.ndarray:
    """Real rows each of the ``tp * pcp`` world ranks dispatches: TP rank 0 of each PCP
    rank dispatches that rank's rows, the other TP ranks none (``AllToAllDispatch``)."""
    rows = np.zeros((len(per_rank_num_tokens), tp_size), dtype=np.int64)
    rows[:, 0] = per_rank_num_tokens
    return rows.ravel()


def attention_work(
    layout: BatchLayout,
    positions: np.ndarray,
    *,
    dcp_size: int,
    interleave: int,
    request_mask: np.ndarray | None = None,
    dcp_rest: str = "queries",
    window: Window | int | None = None,
) -> np.ndarray:
    """(query, key) pairs each rank scores this step, from the layout alone.

    Without DCP a rank scores its own rows over their whole context (position + 1 keys).
    With DCP it scores the replicated decode rows over its shard, and the rest rows by
    their path (``dcp_rest``, the mode ``plan_dcp_rest`` chose): every gathered row over
    its shard (``queries``), or its own rows over their whole context (``context``).
    ``request_mask`` (bool [R]) counts only the rows of those requests (e.g. decodes).
    ``window``: the pairs of one windowed layer (``Window``; an int: a sliding one), each row
    over the keys of its window only (``Window.starts``: ``max(0, p + 1 - W) .. p`` sliding,
    ``p - p % W .. p`` chunked, or that range's entries in a shard); None: a full-attention
    layer's.
    """
    p, nd = layout.pcp_size, layout.num_replicated_decode_tokens
    runs = segment_runs(layout, positions, request_mask)
    if dcp_size == 1:
        # NOTE: ranks that share one run (a decode-only layout's) share its count: counted once
        work = [context_pairs(runs[0][0], runs[0][1], window)]
        for prev, run in zip(runs, runs[1:]):
            work.append(work[-1] if run is prev else context_pairs(run[0], run[1], window))
        return np.array(work, dtype=np.int64)
    # NOTE: replicated decodes are whole segments filling the first nd rows of every rank
    a, n, local = runs[0]
    decode = local < nd
    work = shard_pairs(a[decode], n[decode], dcp_size=dcp_size, interleave=interleave, window=window)
    rest = [(a[local >= nd], n[local >= nd]) for a, n, local in runs]
    if dcp_rest == "context":
        # NOTE: dcp > 1 means dcp == pcp (tp = 1): DCP rank r holds PCP rank r's rows.
        assert dcp_size == p, f"dcp ({dcp_size}) != pcp ({p})"
        return work + np.array([context_pairs(a, n, window) for a, n in rest], dtype=np.int64)
    if dcp_rest != "queries":
        raise ValueError(f"dcp_rest must be 'queries' or 'context', got {dcp_rest!r}")
    a, n = (np.concatenate(x) for x in zip(*rest))
    return work + shard_pairs(a, n, dcp_size=dcp_size, interleave=interleave, window=window)


def segment_runs(
    layout: BatchLayout, positions: np.ndarray, request_mask: np.ndarray | None = None
) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each rank's segments as runs of consecutive positions: (first position, rows, first
    local row), int64 [S] each; no rows for the requests ``request_mask`` (bool [R]) leaves out.
    Pairs are counted by run, not by row (``context_pairs``, ``shard_pairs``): a segment holds
    one request's tokens in order, at consecutive positions."""
    pos = as_positions(positions)
    runs, prev = [], None
    for seg in layout.segments:
        if seg is prev:  # NOTE: ranks that share one segments object (a decode-only layout's) share its run
            runs.append(runs[-1])
            continue
        rows = seg.length if request_mask is None else np.where(request_mask[seg.req_idx], seg.length, 0)
        if isinstance(pos, TokenPositions):  # NOTE: a segment is one request's: no search for it
            first = pos.of_requests(seg.global_start, seg.req_idx)
        else:
            first = pos[seg.global_start]
        runs.append((first, rows, seg.local_start))
        prev = seg
    return runs


def context_pairs(first: np.ndarray, rows: np.ndarray, window: Window | int | None = None) -> int:
    """Pairs that runs of ``rows`` rows at positions ``first ..`` score over their whole
    context: row ``first + i`` sees ``first + i + 1`` keys; through a ``window`` (an int: a
    sliding one), those from its start on (``_keys_before``)."""
    # NOTE: integer dot products (exact); rows (rows + 1) is even, so its sum halves exactly
    pairs = int(rows @ first) + int(rows @ (rows + 1)) // 2
    w = as_window(window)
    if w is None:
        return pairs
    return pairs - int(_keys_before(first, rows, w, lambda x: x, lambda x: x * (x + 1) // 2))


def shard_pairs(first: np.ndarray, rows: np.ndarray, *, dcp_size: int, interleave: int,
                window: Window | int | None = None) -> np.ndarray:
    """int64 [dcp_size]: pairs that runs of ``rows`` rows at positions ``first ..`` score over
    each DCP shard of their context (through a ``window``: the shard's entries from each
    row's start on, ``_keys_before``)."""
    last = dcp_shard_len_sums(first + rows, dcp_size, interleave)
    pairs = (last - dcp_shard_len_sums(first, dcp_size, interleave)).sum(axis=1)
    w = as_window(window)
    if w is None:
        return pairs
    return pairs - _keys_before(first, rows, w, lambda x: dcp_shard_lens(x, dcp_size, interleave),
                                lambda x: dcp_shard_len_sums(x, dcp_size, interleave))


def _keys_before(first, rows, window: Window, lens, len_sums):
    """The keys runs of ``rows`` rows at positions ``first ..`` do not see through ``window``,
    summed over the last axis: row ``q`` sees ``[s, q]`` (``Window.starts``), its keys over a
    shard (``lens = dcp_local_seq_lens``, or ``x`` over the whole context) ``L(q + 1) -
    L(s)``; this is ``sum L(s)``. Sliding, ``s = max(0, q + 1 - W)`` runs over ``(lo, hi]``
    (``_before_window``): ``len_sums(hi) - len_sums(lo)`` (``len_sums(x) = sum_{y=1}^{x}
    L(y)``). Chunked, ``s`` is constant over each piece of a run within one chunk
    (``chunk_runs``): each piece's rows x ``L(its chunk's start)``."""
    first, rows = np.asarray(first, dtype=np.int64), np.asarray(rows, dtype=np.int64)
    if window.chunked:
        _, _, n, start = chunk_runs(first, rows, window.size)
        return (lens(start) * n).sum(axis=-1)
    hi, lo = _before_window(first, rows, window.size)
    return (len_sums(hi) - len_sums(lo)).sum(axis=-1)


def _before_window(first: np.ndarray, rows: np.ndarray, window: int) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo), int64: the window starts runs of ``rows`` rows at positions ``first ..`` pass
    through a sliding ``window`` of that size. Row ``q`` sees ``[s, q]``, ``s = max(0, q + 1 -
    window)``; over the run's rows ``sum L(s) = sum_{y=1}^{hi} L(y) - sum_{y=1}^{lo} L(y)`` with
    ``hi = max(0, first + rows - window)``, ``lo = max(0, first - window)`` (rows whose window
    starts at 0 add nothing)."""
    first = np.asarray(first, dtype=np.int64)
    return np.maximum(first + rows - window, 0), np.maximum(first - window, 0)


# --- ring attention (``pipeline.forward.cp_attention``: ``pcpflow.layouts.ring`` plans it,
# ``pcpflow.attention.ring`` runs it). Point to point: each rank sends a different amount,
# so these count per rank (``Comm`` counts what each rank sends to the others). Per layer, on
# rank j of the ring of P (``RingPlan``: b_o entries in rank o's block, t_o its travelling
# rows, d_o(h) its travelling rows' new KV entries with at least h hops to go, r the rows
# every rank holds), at iteration h = 0..P-2, sending the package of origin o = (j - h) % P:
#
# ============  ==========  ================================================================
# purpose       op          rows rank j sends x row width
# ============  ==========  ================================================================
# ring_send_kv  isend       ``b_o + d_o(h + 1)`` x ``entry_dim`` (a call when > 0)
# ring_send_q   isend       ``t_o`` x ``H`` x ``qk_dim`` (a call when > 0)
# ring_all2all  all_to_all  ``sum_{i != j} (t_i + r)`` x ``H*(Dv + k)``, once
#                           after the loop when any rank has t or r rows
# ============  ==========  ================================================================

RING_PURPOSES = ("ring_send_kv", "ring_send_q", "ring_all2all")


def choose_ring_variant(
    policy: str,
    layout: BatchLayout,
    positions,
    *,
    shape: ModelShape,
    peak_flops: float | None = None,
    bandwidth: float | None = None,
) -> str:
    """The ring variant of one step, ``"pass_kv"`` or ``"pass_q"``, under ``policy``
    (``ring_pass_kv`` | ``ring_pass_q`` | ``ring_auto``).

    ``ring_auto`` is Meta's rule (arXiv 2411.01783, Algorithm 1) over the step's split
    prefills: T new tokens, P cached ones. Pass-KV sends every key of the context once per
    hop, ``2 * N_KV`` head-vectors a token, pass-Q the new queries, ``N_H``: pass-KV when
    ``T / (T + P) >= 2 * N_KV / N_H`` (here ``entry_dim / (H * qk_dim)``: MLA's latent is one
    entry for all heads). With a machine's ``peak_flops`` and ``bandwidth`` (bytes/s), also
    when pass-KV's hop hides behind its attention: ``T >= P_ring * C * entry_bytes /
    (2 * H * (qk_dim + v_dim) * BW)`` (Meta's ``N * C * N_KV * e / (2 * N_H * BW)``). A step
    without split prefills (decodes only) runs pass-Q, as Meta's decode does."""
    if policy in ("ring_pass_kv", "ring_pass_q"):
        return policy[len("ring_"):]
    if policy != "ring_auto":
        raise ValueError(f"unknown ring policy {policy!r}; known: ring_pass_kv, ring_pass_q, ring_auto")
    q = np.diff(layout.query_start_loc)
    split = ~layout.replicated & (q > 0)
    new = int(q[split].sum())
    if not new:
        return "pass_q"
    cached = int(request_num_computed(layout, positions)[split].sum())
    if new / (new + cached) >= shape.entry_dim / (shape.num_heads * shape.qk_dim):
        return "pass_kv"
    if peak_flops and bandwidth:
        flops_per_pair = 2 * shape.num_heads * (shape.qk_dim + shape.v_dim)
        if new * flops_per_pair * bandwidth >= layout.pcp_size * peak_flops * shape.entry_dim * shape.dtype_bytes:
            return "pass_kv"
    return "pass_q"


@dataclass(frozen=True)
class RingTraffic:
    """(calls, bytes) of each ring purpose this step, per global rank (``rank = pcp_rank *
    tp + tp_rank``): int64 arrays of ``tp * pcp``."""

    calls: dict[str, np.ndarray]
    bytes: dict[str, np.ndarray]

    def totals(self) -> tuple[dict[str, int], dict[str, int]]:
        return ring_totals(self.calls, self.bytes)


def ring_step_traffic(
    layout: BatchLayout,
    positions,
    *,
    variant: str,
    shape: ModelShape,
    interleave: int,
    tp_size: int = 1,
    plan: RingPlan | None = None,
) -> RingTraffic:
    """What every rank sends in one step's rings (the table above, times
    ``shape.num_layers``), from the layout and the positions alone. ``shape`` is one TP
    rank's (``tp_local_shape``); each of a PCP rank's TP ranks runs its own ring over its
    heads, the same rows. ``plan``: the step's ``plan_ring``, when the caller has it."""
    plan = plan or plan_ring(layout, positions, variant=variant, interleave=interleave)
    p, layers = plan.pcp_size, shape.num_layers
    kv_rows, q_rows = ring_hop_rows(plan)
    rows_back = plan.num_travel + plan.num_replicated  # partial rows each rank receives from each other
    a2a = int(plan.has_all2all)
    calls = {
        "ring_send_kv": (kv_rows > 0).sum(axis=1) * layers,
        "ring_send_q": (q_rows > 0).sum(axis=1) * layers,
        "ring_all2all": np.full(p, a2a * layers, dtype=np.int64),
    }
    nbytes = {
        "ring_send_kv": kv_rows.sum(axis=1) * shape.entry_dim * shape.dtype_bytes * layers,
        "ring_send_q": q_rows.sum(axis=1) * shape.num_heads * shape.qk_dim * shape.dtype_bytes * layers,
        "ring_all2all": a2a * (rows_back.sum() - rows_back) * shape.partials_width * shape.dtype_bytes * layers,
    }
    per_rank = lambda d: {k: np.repeat(v.astype(np.int64), tp_size) for k, v in d.items()}  # noqa: E731
    return RingTraffic(per_rank(calls), per_rank(nbytes))


def ring_hop_rows(plan: RingPlan) -> tuple[np.ndarray, np.ndarray]:
    """(KV entries, queries) rank j sends at iteration h, int64 ``[P, P-1]``: the package of
    origin ``(j - h) % P`` (the table above, one layer)."""
    p = plan.pcp_size
    hop = np.arange(p - 1, dtype=np.int64)
    origin = (np.arange(p, dtype=np.int64)[:, None] - hop[None, :]) % p  # [P, P-1]
    return plan.kv_rows_sent(origin, hop[None, :]), plan.num_travel[origin]


def ring_totals(per_rank_calls, per_rank_bytes) -> tuple[dict[str, int], dict[str, int]]:
    """The job's figures of the ring purposes from every rank's: bytes summed (what every
    rank receives from the others, as for a collective); calls of the busiest rank (hops
    follow one another; the ranks' sends of one hop run at once). Purposes nobody used are
    left out, as ``CommStats`` leaves them."""
    calls, nbytes = {}, {}
    for purpose in per_rank_calls:
        c = int(np.max(per_rank_calls[purpose])) if len(per_rank_calls[purpose]) else 0
        if c:
            calls[purpose] = c
            nbytes[purpose] = int(np.sum(per_rank_bytes[purpose]))
    return calls, nbytes


def ring_attention_work(layout: BatchLayout, positions, *, variant: str, interleave: int,
                        plan: RingPlan | None = None, window: Window | int | None = None) -> np.ndarray:
    """(query, key) pairs each PCP rank scores in one step's ring: a staying row all of its
    ``position + 1`` keys, on its rank; a travelling row, on every rank, that rank's cached
    shard of its request and that rank's new keys of it at or before its position; a row
    every rank holds, on every rank, that rank's shard of its ``position + 1`` keys.
    ``window``: one windowed layer's (``Window``; an int: a sliding one), each of these keys
    only where it is in the row's window (at or after ``Window.starts``); None: a
    full-attention layer's.
    ``plan``: the step's ``plan_ring``, when the caller has it."""
    plan = plan or plan_ring(layout, positions, variant=variant, interleave=interleave)
    window = as_window(window)
    p, n = plan.pcp_size, plan.padded_num_tokens
    rank = np.arange(p * n, dtype=np.int64) // max(n, 1)
    work = np.zeros(p, dtype=np.int64)
    stays = plan.kind == STAYS
    s_pos = plan.pos[stays]
    np.add.at(work, rank[stays], s_pos + 1 if window is None else s_pos + 1 - window.starts(s_pos))
    rep = (plan.kind == REPLICATED) & (rank == 0)
    travels = plan.kind == TRAVELS
    t_req, t_pos = plan.req[travels], plan.pos[travels]
    scale = int(plan.pos.max(initial=0)) + 2
    work += dcp_shard_lens(plan.pos[rep] + 1, p, interleave).sum(axis=1)
    limit = plan.cache_limit[t_req]
    work += dcp_shard_lens(limit, p, interleave).sum(axis=1)
    t_first = t_req * scale
    if window is not None:
        # NOTE: a key before the row's window start s is left out: a shard's entries below
        # min(s, limit) of the cache, below s of the rows every rank holds, new keys below s
        r_pos = plan.pos[rep]
        work -= dcp_shard_lens(window.starts(r_pos), p, interleave).sum(axis=1)
        t_start = window.starts(t_pos)
        work -= dcp_shard_lens(np.minimum(t_start, limit), p, interleave).sum(axis=1)
        t_first = t_first + t_start
    for r in range(p):
        mine = np.sort(t_req[rank[travels] == r] * scale + t_pos[rank[travels] == r])
        seen = np.searchsorted(mine, t_req * scale + t_pos, side="right") - np.searchsorted(mine, t_first)
        work[r] += seen.sum()
    return work
