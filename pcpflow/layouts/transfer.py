"""Re-laying a request's KV cache out from the prefill pool to the decode pool (numpy only).

A KV *entry* is (position, layer, head group): a head group is one KV head (GQA: its key and
value columns) or, for MLA, the whole latent (one group: it has no heads). A pool keeps an
entry on every rank whose DCP shard holds the position (``(p // I) % dcp``, its own
interleave) and whose TP slice holds the group (GQA heads split over TP, or replicated when
tp exceeds the KV heads; MLA's latent on every TP rank).

The rule (``transfer_routes``): each decode rank receives exactly the entries its layout
owns, each once, point to point from one prefill rank that holds it. Among the prefill
ranks holding (position p, group g), those with DCP rank ``(p // I_p) % dcp_p`` and g in
their slice, the decode rank with pool index ``d`` takes ``holders[d % len(holders)]``: a
fixed choice per (decode rank, prefill DCP rank, group), so that a decode rank hears from
as few prefill ranks as the layouts allow, and replicated holders (PCP ranks without DCP,
TP ranks of MLA) share the sending. Every layer goes the same way. A decode rank whose
TP slice repeats another's (MLA over TP, GQA with tp > num_kv_heads) receives the same
entries: the only duplication, counted.

A drafter's own cache of the prompt (``draft=mtp|dspark|self``) moves by the same rule, as a
cache of its own (``MovedKV``: its head groups, its layers): its own routes, messages and
bytes, counted with the target's (``handover_counts``).

Positions then land by the decode pool's slot rule (``pcpflow.layouts.slots``): a decode
block gathers the positions its DCP rank owns, which, with another interleave, come from
several prefill ranks (docs/disaggregation.md works one request through).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from pcpflow.layouts.slots import Window

TRANSFERS = ("layerwise", "after_prefill")
KV_TRANSFER = "kv_transfer"
"""The purpose of the handover's point-to-point messages (``collective_calls`` / ``bytes``)."""


@dataclass(frozen=True)
class PoolKV:
    """Where a pool keeps KV entries: per rank of the pool (its index in the pool), its DCP
    rank and the head groups its TP slice holds; the pool's dcp and interleave."""

    dcp_ranks: tuple[int, ...]
    heads: tuple[tuple[int, ...], ...]
    dcp: int
    interleave: int

    def __post_init__(self) -> None:
        if len(self.dcp_ranks) != len(self.heads):
            raise ValueError(f"{len(self.dcp_ranks)} DCP ranks but {len(self.heads)} head slices")
        if self.dcp < 1 or self.interleave < 1:
            raise ValueError(f"dcp ({self.dcp}) and interleave ({self.interleave}) must be >= 1")

    @property
    def size(self) -> int:
        return len(self.dcp_ranks)

    def owned(self, positions: np.ndarray, rank: int) -> np.ndarray:
        """The positions of ``positions`` whose entries pool rank ``rank`` keeps."""
        return positions[(positions // self.interleave) % self.dcp == self.dcp_ranks[rank]]


@dataclass(frozen=True)
class Route:
    """Entries one prefill rank sends one decode rank: ``positions`` (ascending) x every
    layer x ``heads``."""

    src: int  # the prefill rank's index in its pool
    dst: int  # the decode rank's index in its pool
    heads: tuple[int, ...]
    positions: np.ndarray

    @property
    def num_entries(self) -> int:
        """Entries per layer."""
        return len(self.positions) * len(self.heads)


def transfer_routes(num_tokens: int, src: PoolKV, dst: PoolKV, start: int = 0) -> list[Route]:
    """The routes that move positions ``[start, num_tokens)`` of one request from pool ``src``
    to pool ``dst`` (see the module's rule), ordered by decode rank, then prefill rank;
    routes without entries are left out."""
    positions = np.arange(int(start), int(num_tokens), dtype=np.int64)
    routes = []
    for s, d, heads, k in _route_plan(src, dst):
        mine = dst.owned(positions, d)
        sent = mine[(mine // src.interleave) % src.dcp == k]
        if len(sent):
            _check_holders(heads, k)
            routes.append(Route(s, d, heads, sent))
    return routes


@dataclass(frozen=True)
class RouteSizes:
    """One request's routes as arrays (what the simulator prices): per route its prefill
    rank, decode rank and entries per layer, in ``transfer_routes``' order."""

    src: np.ndarray
    dst: np.ndarray
    entries: np.ndarray

    def __len__(self) -> int:
        return len(self.src)

    @classmethod
    def of(cls, routes: list[Route]) -> RouteSizes:
        ints = lambda v: np.array(v, dtype=np.int64)  # noqa: E731
        return cls(ints([r.src for r in routes]), ints([r.dst for r in routes]), ints([r.num_entries for r in routes]))


def route_sizes(num_tokens: int, src: PoolKV, dst: PoolKV, start: int = 0) -> RouteSizes:
    """``transfer_routes`` without the positions: each route's entries counted from one
    period of the two pools' position rules (``(n // P) x per period + the first n % P``, less
    the same of ``start``), so the cost does not grow with the request's length."""
    plan = _route_plan(src, dst)
    table = _period_counts(src.interleave, src.dcp, dst.interleave, dst.dcp)
    period = table.shape[2] - 1

    def below(n: int) -> np.ndarray:  # [dst DCP rank, src DCP rank]: pairs' positions of [0, n)
        return table[:, :, period] * (n // period) + table[:, :, n % period]

    counts = below(int(num_tokens)) - below(int(start)) if start else below(int(num_tokens))
    s = np.array([r[0] for r in plan], dtype=np.int64)
    d = np.array([r[1] for r in plan], dtype=np.int64)
    groups = np.array([len(r[2]) for r in plan], dtype=np.int64)
    positions = counts[np.array(dst.dcp_ranks, dtype=np.int64)[d], np.array([r[3] for r in plan], dtype=np.int64)]
    keep = positions > 0
    for (_, _, heads, k), used in zip(plan, keep.tolist()):
        if used:
            _check_holders(heads, k)
    return RouteSizes(s[keep], d[keep], (positions * groups)[keep])


_MISSING = -1
"""A head group no prefill rank of a DCP rank holds, in a route plan (an error once used)."""


def _check_holders(heads: tuple[int, ...], k: int) -> None:
    if _MISSING in heads:
        raise ValueError(f"no prefill rank holds every head group at DCP rank {k}")


@functools.lru_cache(maxsize=256)
def _route_plan(src: PoolKV, dst: PoolKV) -> tuple[tuple[int, int, tuple[int, ...], int], ...]:
    """``(prefill rank, decode rank, head groups, prefill DCP rank)`` of every route a long
    enough request takes, in ``transfer_routes``' order: which positions a route carries
    depends only on the two DCP ranks, so the plan depends on the pools alone."""
    plan = []
    for d in range(dst.size):
        picked: dict[int, list[int]] = {}  # prefill rank -> the groups it sends to d
        missing: dict[int, list[int]] = {}  # prefill DCP rank -> groups nobody there holds
        for k in range(src.dcp):
            for g in dst.heads[d]:
                holders = [r for r in range(src.size) if src.dcp_ranks[r] == k and g in src.heads[r]]
                if holders:
                    picked.setdefault(holders[d % len(holders)], []).append(g)
                else:
                    missing.setdefault(k, []).append(g)
        routes = [(s, d, tuple(sorted(picked[s])), src.dcp_ranks[s]) for s in sorted(picked)]
        routes += [(-1, d, (_MISSING,), k) for k in sorted(missing)]
        plan += routes
    return tuple(plan)


@functools.lru_cache(maxsize=256)
def _period_counts(src_interleave: int, src_dcp: int, dst_interleave: int, dst_dcp: int) -> np.ndarray:
    """``[dst_dcp, src_dcp, P + 1]``: how many of the positions ``[0, j)`` each pair of DCP
    ranks (decode, prefill) owns, for ``j <= P``, the period of both pools' rules."""
    a, b = src_interleave * src_dcp, dst_interleave * dst_dcp
    period = a * b // math.gcd(a, b)
    p = np.arange(period, dtype=np.int64)
    pair = ((p // dst_interleave) % dst_dcp) * src_dcp + (p // src_interleave) % src_dcp
    onehot = np.zeros((dst_dcp * src_dcp, period + 1), dtype=np.int32)
    onehot[pair, p + 1] = 1
    table = np.cumsum(onehot, axis=1, dtype=np.int64).reshape(dst_dcp, src_dcp, period + 1)
    table.flags.writeable = False
    return table


def transfer_counts(routes: list[Route] | RouteSizes, *, group_bytes: int, num_layers: int,
                    transfer: str) -> tuple[int, int]:
    """(messages, bytes) of one request's routes: ``group_bytes`` is one head group of one
    position and layer; ``layerwise`` sends a message per route and layer, ``after_prefill``
    one per route with every layer."""
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer {transfer!r}: one of {', '.join(TRANSFERS)}")
    sizes = routes if isinstance(routes, RouteSizes) else RouteSizes.of(routes)
    calls = len(sizes) * (num_layers if transfer == "layerwise" else 1)
    return calls, int(sizes.entries.sum()) * group_bytes * num_layers


@dataclass(frozen=True)
class MovedKV:
    """One paged KV cache a handover moves (the target's, a drafter's own): where each pool
    keeps its entries, its layers, and the bytes of one head group of one position and layer.

    A hybrid cache's windowed layers (``pcpflow.scheduling.kv_groups``) move as a cache of
    their own with a ``window``: only the positions of the entries the decode pool keeps, from
    the one holding the first key the request's next query reads (``start``; its entries
    hold ``entry_tokens`` positions); the earlier ones no query reads again."""

    src: PoolKV
    dst: PoolKV
    num_layers: int
    group_bytes: int
    window: Window | None = None
    entry_tokens: int = 1  # the decode pool's positions an entry (block_size x dcp)

    def start(self, num_tokens: int) -> int:
        """The first position moved of a request with ``num_tokens`` computed."""
        if self.window is None:
            return 0
        first = int(self.window.starts(np.int64(num_tokens)))
        return first // self.entry_tokens * self.entry_tokens

    def routes(self, num_tokens: int) -> list[Route]:
        return transfer_routes(num_tokens, self.src, self.dst, self.start(num_tokens))

    def sizes(self, num_tokens: int) -> RouteSizes:
        return route_sizes(num_tokens, self.src, self.dst, self.start(num_tokens))


def target_kv(src: PoolKV, dst: PoolKV, num_layers: int, group_bytes: int, *, windowed_layers: int = 0,
              window: Window | None = None, entry_tokens: int = 1) -> list[MovedKV]:
    """The target cache's part of a handover: one ``MovedKV`` of its ``num_layers`` layers, or,
    where ``windowed_layers`` of them give back what their ``window`` left (a hybrid cache),
    two: its full layers, then its windowed ones (``MovedKV.window``)."""
    if window is None or not windowed_layers:
        return [MovedKV(src, dst, num_layers, group_bytes)]
    windowed = MovedKV(src, dst, windowed_layers, group_bytes, window, entry_tokens)
    full = num_layers - windowed_layers
    return [MovedKV(src, dst, full, group_bytes), windowed] if full else [windowed]


def handover_counts(num_tokens: int, moved: list[MovedKV], *, transfer: str) -> tuple[int, int]:
    """(messages, bytes) of one request's handover: every cache of ``moved`` by its own
    routes (``transfer_counts``), the target's and a drafter's alike."""
    calls = nbytes = 0
    for m in moved:
        c, b = transfer_counts(m.sizes(num_tokens), group_bytes=m.group_bytes, num_layers=m.num_layers,
                               transfer=transfer)
        calls, nbytes = calls + c, nbytes + b
    return calls, nbytes


def rank_bytes(routes: list[Route], *, group_bytes: int, num_layers: int, num_src: int,
               num_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each prefill rank sends and each decode rank receives over ``routes``."""
    sent, got = np.zeros(num_src, dtype=np.int64), np.zeros(num_dst, dtype=np.int64)
    for r in routes:
        n = r.num_entries * group_bytes * num_layers
        sent[r.src] += n
        got[r.dst] += n
    return sent, got
