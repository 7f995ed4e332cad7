"""The handover's KV transfer (``disagg=pd``): each decode rank receives exactly the entries
its layout owns, point to point from the prefill ranks that hold them (torch.distributed
send / recv: gloo on CPU, NCCL on GPUs), repacked into its own blocks.

Which prefill rank sends which entries to which decode rank is the numpy rule of
``pcpflow.layouts.transfer`` (``transfer_routes``), on each pool's ``PoolKV`` (``pool_kv``:
the grid's DCP ranks and the KV heads each TP rank holds). Here the entries move: the
sender reads them at its slots (its pool's slot rule and block table), the receiver writes
them at its own (``compute_slot_mapping`` with the decode pool's dcp and interleave), in the
columns of the head groups the route carries. ``layerwise`` sends a message per route and
layer, ``after_prefill`` one per route with every layer stacked. A drafter's own cache of the
prompt (``Stage.own_kv``) moves the same way as a cache of its own (its head groups, its
routes, its layers), in messages of its own, and so do a hybrid cache's windowed layers
(``pcpflow.scheduling.kv_groups``): each layer read and written through its KV group's table,
the windowed ones only from the first entry the decode pool keeps (``MovedKV.window``). Each
rank counts what it sends (``CommStats.add_sent``, purpose ``kv_transfer``, the drafter's
entries included); the engine gathers the counts.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch
import torch.distributed as dist

from pcpflow.layouts.slots import compute_slot_mapping
from pcpflow.layouts.transfer import KV_TRANSFER, MovedKV, PoolKV, Route, target_kv
from pcpflow.parallel.grid import Axis, RankGrid
from pcpflow.parallel.tensor_parallel import entry_columns, kv_heads_of

if TYPE_CHECKING:
    from pcpflow.scheduling.kv_groups import KVGroups


def head_groups(tp_rank: int, tp: int, num_kv_heads: int | None) -> tuple[int, ...]:
    """The KV head groups TP rank ``tp_rank`` of ``tp`` holds: its GQA KV heads, or MLA's one
    latent (``num_kv_heads`` None: group 0, on every TP rank)."""
    if num_kv_heads is None:
        return (0,)
    return tuple(kv_heads_of(tp_rank, tp, num_kv_heads))


def pool_kv(grid: RankGrid, interleave: int, num_kv_heads: int | None) -> PoolKV:
    """Where the pool of ``grid`` keeps KV entries (``pcpflow.layouts.transfer.PoolKV``)."""
    ranks = range(grid.world_size)
    return PoolKV(
        dcp_ranks=tuple(grid.coords(r)[Axis.DCP] for r in ranks),
        heads=tuple(head_groups(r % grid.tp, grid.tp, num_kv_heads) for r in ranks),
        dcp=grid.dcp,
        interleave=interleave,
    )


def moved_kv(full_spec, num_layers: int, *, prefill: RankGrid, decode: RankGrid, prefill_interleave: int,
             decode_interleave: int, elem_bytes: int) -> MovedKV:
    """The handover's view of one paged cache of ``full_spec`` (the whole, unsharded entry:
    MLA one group, GQA a group per KV head) with ``num_layers`` layers."""
    mla = full_spec.v_offset == 0
    kv_heads = None if mla else full_spec.num_kv_heads
    group_width = full_spec.entry_dim if mla else full_spec.qk_dim + full_spec.v_dim
    return MovedKV(pool_kv(prefill, prefill_interleave, kv_heads), pool_kv(decode, decode_interleave, kv_heads),
                   num_layers, group_width * elem_bytes)


def group_columns(full_spec, tp_rank: int, tp: int, groups: tuple[int, ...]) -> torch.Tensor:
    """The columns of TP rank ``tp_rank``'s cache entry that hold head groups ``groups`` (its
    keys, then its values; all of an MLA entry)."""
    if full_spec.v_offset == 0:
        return torch.arange(full_spec.entry_dim)
    local_of = {int(c): j for j, c in enumerate(entry_columns(full_spec, tp_rank, tp).tolist())}
    k = [g * full_spec.qk_dim + i for g in groups for i in range(full_spec.qk_dim)]
    v = [full_spec.v_offset + g * full_spec.v_dim + i for g in groups for i in range(full_spec.v_dim)]
    return torch.tensor([local_of[c] for c in k + v], dtype=torch.int64)


class KVTransfer:
    """This rank's part of every handover: the routes it sends or receives.

    ``rank``: this process's global rank; the prefill pool is global ranks ``0 .. Wp-1``,
    the decode pool ``Wp ..``. ``caches``: this rank's paged caches of its pool, each as
    ``(the whole cache's spec, its per-layer tensors)``: the target's first, then a
    drafter's own (``Stage.own_kv``). ``groups``: the target's KV groups (a hybrid cache: its
    windowed layers move as a cache of their own, ``target_kv``); a drafter's cache goes by
    the first group's table (a full one)."""

    def __init__(self, *, rank: int, prefill: RankGrid, decode: RankGrid, prefill_interleave: int,
                 decode_interleave: int, caches: list[tuple[object, list[torch.Tensor]]], block_size: int,
                 transfer: str, stats=None, groups: KVGroups | None = None) -> None:
        self.rank, self.offset = rank, prefill.world_size
        self.prefill, self.decode = prefill, decode
        self.block_size = block_size
        self.layerwise = transfer == "layerwise"
        self.stats = stats
        self.caches = []
        for k, (spec, layers) in enumerate(caches):
            moved = moved_kv(spec, len(layers), prefill=prefill, decode=decode, prefill_interleave=prefill_interleave,
                             decode_interleave=decode_interleave, elem_bytes=layers[0].element_size())
            if k or groups is None or not groups.hybrid:
                self.caches.append(_Cache(spec, layers, moved, [0] * len(layers)))
                continue
            # NOTE: its full layers, then its windowed ones (target_kv's order)
            group_of = groups.layer_group.tolist()
            kinds = [[i for i, g in enumerate(group_of) if groups.windowed[g] == w] for w in (False, True)]
            parts = target_kv(moved.src, moved.dst, len(layers), moved.group_bytes,
                              windowed_layers=groups.num_windowed_layers,
                              window=groups.window, entry_tokens=block_size * decode.dcp)
            for part, chosen in zip(parts, [k for k in kinds if k]):
                self.caches.append(_Cache(spec, [layers[i] for i in chosen], part, [group_of[i] for i in chosen]))
        first = 0
        for c in self.caches:  # NOTE: distinct tags per message between one pair of ranks
            c.first_tag, first = first, first + len(c.layers)

    @property
    def in_prefill(self) -> bool:
        return self.rank < self.offset

    @property
    def moved(self) -> list[MovedKV]:
        """What a handover moves, cache by cache (``pcpflow.layouts.transfer.handover_counts``)."""
        return [c.moved for c in self.caches]

    def routes(self, num_tokens: int) -> list[Route]:
        """The target cache's routes."""
        return self.caches[0].moved.routes(num_tokens)

    def move(self, num_tokens: int, src_blocks: np.ndarray, dst_blocks: np.ndarray) -> float:
        """Move one request's positions ``[0, num_tokens)`` of every cache (a windowed part's
        from its ``MovedKV.start``): from its prefill-pool blocks ``src_blocks`` to its
        decode-pool blocks ``dst_blocks`` (block tables ``[num_groups, entries]``, a row per KV
        group). Returns the seconds this rank spent (0 when no route touches it)."""
        t0 = time.perf_counter()
        ops, landing = [], []
        for cache in self.caches:
            for route in cache.moved.routes(num_tokens):
                if self.in_prefill and route.src == self.rank:
                    ops += self._sends(cache, route, src_blocks)
                elif not self.in_prefill and route.dst == self.rank - self.offset:
                    more, land = self._recvs(cache, route, dst_blocks)
                    ops += more
                    landing.append(land)
        if not ops:
            return 0.0
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        for cache, slots, cols, bufs in landing:
            for layer, g, buf in zip(cache.layers, cache.groups, bufs if self.layerwise else bufs[0]):
                layer[slots[g][:, None], cols[None, :]] = buf
        return time.perf_counter() - t0

    # -- one side of a route ------------------------------------------------------------------
    def _slots(self, positions: np.ndarray, tables: np.ndarray, groups: set[int], pool: PoolKV, pool_rank: int,
               device: torch.device) -> dict[int, torch.Tensor]:
        """The slots of ``positions`` in each KV group of ``groups`` (its row of ``tables``)."""
        out = {}
        for g in groups:
            slots = compute_slot_mapping(positions, np.zeros(len(positions), np.int64), np.asarray(tables[g])[None, :],
                                         self.block_size, dcp_size=pool.dcp, dcp_rank=pool.dcp_ranks[pool_rank],
                                         interleave=pool.interleave)
            out[g] = torch.from_numpy(slots).to(device)
        return out

    def _sends(self, cache: _Cache, route: Route, tables: np.ndarray) -> list:
        device = cache.layers[0].device
        slots = self._slots(route.positions, tables, set(cache.groups), cache.moved.src, route.src, device)
        cols = cache.columns(self.prefill, route.src, route.heads, True)
        parts = [c[slots[g]][:, cols].contiguous() for c, g in zip(cache.layers, cache.groups)]
        msgs = parts if self.layerwise else [torch.stack(parts)]
        dst = self.offset + route.dst
        for m in msgs:
            if self.stats is not None:
                self.stats.add_sent("send", KV_TRANSFER, m.numel() * m.element_size(), tuple(m.shape))
        return [dist.P2POp(dist.isend, m, dst, tag=cache.first_tag + j) for j, m in enumerate(msgs)]

    def _recvs(self, cache: _Cache, route: Route, tables: np.ndarray):
        first = cache.layers[0]
        slots = self._slots(route.positions, tables, set(cache.groups), cache.moved.dst, route.dst, first.device)
        cols = cache.columns(self.decode, route.dst, route.heads, False)
        shape = (len(route.positions), len(cols))
        if self.layerwise:
            bufs = [first.new_empty(shape) for _ in cache.layers]
        else:
            bufs = [first.new_empty((len(cache.layers), *shape))]
        ops = [dist.P2POp(dist.irecv, b, route.src, tag=cache.first_tag + j) for j, b in enumerate(bufs)]
        return ops, (cache, slots, cols, bufs)


class _Cache:
    """One paged cache of this rank that handovers move: its layers and the KV group each goes
    by, where each pool keeps its entries, the columns of each head-group set."""

    def __init__(self, spec, layers: list[torch.Tensor], moved: MovedKV, groups: list[int]) -> None:
        self.spec, self.layers, self.moved, self.groups = spec, layers, moved, groups
        self.first_tag = 0
        self._columns: dict[tuple[bool, tuple[int, ...]], torch.Tensor] = {}

    def columns(self, grid: RankGrid, pool_rank: int, heads: tuple[int, ...], sending: bool) -> torch.Tensor:
        key = (sending, heads)
        if key not in self._columns:
            cols = group_columns(self.spec, pool_rank % grid.tp, grid.tp, heads)
            self._columns[key] = cols.to(self.layers[0].device)
        return self._columns[key]
