"""Ring attention over a KV cache sharded over the ring (dcp = pcp): Meta's pass-KV and
pass-Q (arXiv 2411.01783), run from ``pcpflow.layouts.ring``'s schedule.

Per layer, on rank r of P:

1. **Own writes.** The new KV entries of r's rows whose positions r owns go to its cache
   (so do those of rows every rank holds: each owner writes its positions from its copy).
2. **Own package.** r's *block* (pass-KV: per request, its cached shard read from the cache,
   then its new rows' KV), the new KV of its travelling rows that other ranks own (most
   hops to go first), and its travelling queries (pass-Q).
3. **The loop.** P iterations; at iteration h rank r holds the package of origin
   ``(r - h) % P``. Before computing on it, the package goes on to r+1 and the next one
   comes from r-1 (``Comm.ring_exchange``: batched isend/irecv, double-buffered: the next
   hop is in flight while this one's partial attention runs). On it, r writes the KV
   entries that ended their trip here, attends its staying rows over the block, and
   attends the visiting queries over its own keys (its cached shard, paged; its
   travelling rows' new KV, a block of its own).
4. **Merge.** Every row has exactly P partial results (output + log-sum-exp). Staying rows
   merge theirs here; the partials of travelling and replicated rows go to the ranks that
   hold those rows in one all-to-all (``ring_all2all``), merged there. The merge is
   ``merge_attention_partials``: max-shifted, an empty part (``lse = -inf``) weighs nothing.
"""

from __future__ import annotations

import numpy as np
import torch

from pcpflow.attention.paged import (
    merge_attention_partials,
    merge_packed_partials,
    pack_partials,
    paged_attention,
    with_sinks,
)
from pcpflow.layouts.ring import RankRing
from pcpflow.layouts.tensors import int64_tensor
from pcpflow.models.base import AttentionSpec
from pcpflow.parallel.comm import Comm


def _tensor(a: np.ndarray, device: torch.device) -> torch.Tensor:
    return int64_tensor(a, device)


class _HopTensors:
    """One ``Hop``: its sizes, and its index arrays on the device."""

    def __init__(self, hop, device: torch.device) -> None:
        self.origin, self.recv_kv, self.recv_q = hop.origin, hop.recv_kv, hop.recv_q
        self.send_kv, self.send_q = hop.send_kv, hop.send_q
        self.block_tables = _tensor(hop.block_tables, device)
        self.stay_lens = _tensor(hop.stay_lens, device)
        self.write_at = _tensor(hop.write_at, device)
        self.write_slots = _tensor(hop.write_slots, device)
        self.visit_req = _tensor(hop.visit_req, device)
        self.visit_cache_lens = _tensor(hop.visit_cache_lens, device)
        self.visit_local_lens = _tensor(hop.visit_local_lens, device)
        maybe = lambda a: None if a is None else _tensor(a, device)  # noqa: E731
        self.stay_starts = maybe(hop.stay_starts)
        self.visit_cache_starts, self.visit_local_starts = maybe(hop.visit_cache_starts), maybe(hop.visit_local_starts)


class RingAttention:
    """The ``AttentionBackend`` of one step on one rank (module docstring)."""

    def __init__(
        self,
        *,
        ring: RankRing,
        caches: list[torch.Tensor],
        spec: AttentionSpec,
        block_size: int,
        block_tables: torch.Tensor,
        dcp: Comm,
        kernel=paged_attention,
    ) -> None:
        """``block_tables``: the global batch's (``AttentionMetadata.block_tables``);
        ``dcp``: the ring's group (the DCP group, equal to the PCP group); ``kernel``:
        ``paged_attention`` or a function with its contract."""
        if spec.windowed() is not None and ring.window != spec.windowed():
            raise ValueError(f"the model's layers {list(spec.window_layers)} attend through {spec.windowed()}, but "
                             f"the ring was planned for window={ring.window} (rank_ring's window)")
        self.ring, self.caches, self.spec, self.block_size = ring, caches, spec, block_size
        self.block_tables, self.dcp, self.kernel = block_tables, dcp, kernel
        device = block_tables.device
        self.size = dcp.size
        t = lambda a: _tensor(a, device)  # noqa: E731
        self.rep_rows, self.rep_req = t(ring.replicated_rows), t(ring.replicated_req)
        self.rep_lens = t(ring.replicated_cache_lens)
        self.rep_starts = None if ring.replicated_cache_starts is None else t(ring.replicated_cache_starts)
        self.stay_rows, self.stay_req = t(ring.stay_rows), t(ring.stay_req)
        self.travel_rows = t(ring.travel_rows)
        self.local_tables = t(ring.local_tables)
        self.write_rows, self.write_slots = t(ring.write_rows), t(ring.write_slots)
        self.block_cached_at, self.block_cached_slots = t(ring.block_cached_at), t(ring.block_cached_slots)
        self.block_new_at, self.block_new_rows = t(ring.block_new_at), t(ring.block_new_rows)
        self.delivery_rows = t(ring.delivery_rows)
        self.hops = [_HopTensors(h, device) for h in ring.hops]

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The step's attention of ``q`` (through the heads' attention ``sinks``, if given, once
        per row after its merge)."""
        cache, spec, ring, p = self.caches[layer], self.spec, self.ring, self.size
        slides = spec.slides(layer)
        _write(cache, self.write_slots, kv.index_select(0, self.write_rows))
        block = kv.new_empty((ring.block_len, spec.entry_dim), dtype=cache.dtype)
        block[self.block_cached_at] = cache.index_select(0, self.block_cached_slots)
        block[self.block_new_at] = kv.index_select(0, self.block_new_rows).to(cache.dtype)
        package = torch.cat([block, kv.index_select(0, self.delivery_rows).to(cache.dtype)])
        queries = q.index_select(0, self.travel_rows)
        own_keys = kv.index_select(0, self.travel_rows).to(cache.dtype)  # visitors read them here
        q_stay = q.index_select(0, self.stay_rows)

        stays: list[tuple[torch.Tensor, torch.Tensor]] = []
        visits: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * p
        for h, hop in enumerate(self.hops):
            pending = None
            if h < p - 1:
                nxt = self.hops[h + 1]
                pending = self.dcp.ring_exchange(
                    [(package[: hop.send_kv], "ring_send_kv"), (queries[: hop.send_q], "ring_send_q")],
                    [package.new_empty((nxt.recv_kv, spec.entry_dim)),
                     queries.new_empty((nxt.recv_q, spec.num_heads, spec.qk_dim))],
                )
            if h:
                _write(cache, hop.write_slots, package.index_select(0, hop.write_at))
            if self.stay_rows.numel():
                stays.append(self.kernel(q_stay, package, spec, hop.block_tables, self.stay_req, hop.stay_lens, 1,
                                         hop.stay_starts if slides else None))
            if hop.visit_req.numel():
                visits[hop.origin] = self._visit(queries, cache, own_keys, hop, slides)
            if pending is not None:
                package, queries = pending.wait()

        out = q.new_zeros((q.shape[0], spec.num_heads, spec.v_dim))
        if stays:
            o, lse = merge_attention_partials(torch.stack([s[0] for s in stays]), torch.stack([s[1] for s in stays]))
            out[self.stay_rows] = with_sinks(o, lse, sinks).to(out.dtype)
        if ring.has_all2all:
            rep_q = q.index_select(0, self.rep_rows)
            rep = pack_partials(*self._paged(rep_q, cache, self.rep_req, self.rep_lens, self.rep_starts if slides else None),
                                q.dtype)
            empty = rep.new_zeros((0, rep.shape[1]))
            send = torch.cat([t for v in visits for t in (pack_partials(*v, q.dtype) if v is not None else empty, rep)])
            got = self.dcp.all_to_all_v(send, ring.all2all_send.tolist(), ring.all2all_recv.tolist(), "ring_all2all")
            merged = self._merge(got.view(p, -1, got.shape[1]), sinks)
            n_travel = self.travel_rows.numel()
            out[self.travel_rows] = merged[:n_travel].to(out.dtype)
            out[self.rep_rows] = merged[n_travel:].to(out.dtype)
        return out

    def _visit(self, queries, cache, own_keys, hop: _HopTensors, slides: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A visiting package's queries over this rank's keys: its cached shard (paged) and
        its travelling rows' new KV, merged into one partial result (through the window on a
        sliding layer)."""
        a = self._paged(queries, cache, hop.visit_req, hop.visit_cache_lens, hop.visit_cache_starts if slides else None)
        b = self.kernel(queries, own_keys, self.spec, self.local_tables, hop.visit_req, hop.visit_local_lens, 1,
                        hop.visit_local_starts if slides else None)
        return merge_attention_partials(torch.stack([a[0], b[0]]), torch.stack([a[1], b[1]]))

    def _paged(self, q, cache, req, lens, starts=None):
        return self.kernel(q, cache, self.spec, self.block_tables, req, lens, self.block_size, starts)

    def _merge(self, packed: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
        return merge_packed_partials(packed, self.spec.num_heads, self.spec.v_dim, sinks)


def _write(cache: torch.Tensor, slots: torch.Tensor, entries: torch.Tensor) -> None:
    if slots.numel():
        cache.index_copy_(0, slots, entries.to(cache.dtype))
