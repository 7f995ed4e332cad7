"""Collectives with accounting.

``Comm`` wraps one torch.distributed process group (or none: a group of one, where
every collective is the identity, so the single-rank path is the same code). Every
call names its *purpose* (``kv_gather``, ``restore``, ``dcp_query_gather`` ...) and
adds to ``CommStats``: number of calls and bytes moved.

Bytes moved are counted as the bytes each rank receives from *other* ranks, summed over
the group (the traffic of an ideal point-to-point network):

- all_gather of an ``n``-byte shard per rank: ``size * (size - 1) * n``
- all_to_all of an ``n``-byte tensor per rank: ``(size - 1) * n``
- broadcast of ``n`` bytes: ``(size - 1) * n``
- all_reduce of ``n`` bytes (ring): ``2 * (size - 1) * n``
- reduce_scatter of an ``n``-byte tensor per rank (``n / size`` back): ``(size - 1) * n``

A Comm made by ``RankGrid.build`` also knows ``copies``: how many groups of its axis run
the same collective at once (tp PCP groups, pcp TP groups, ...); bytes are counted for all
of them, so a step's figure is the traffic of the whole job (at tp=1 nothing changes).

Point-to-point traffic (the ring's ``ring_send_kv``, ``ring_send_q``, and its all-to-all of
uneven partials ``ring_all2all``) differs by rank, so each rank counts what *it* sends
(``CommStats.step_sent``: calls and bytes to other ranks); ``gather_sent`` collects every
rank's count once per step, and ``ring_totals`` folds them into the job's figures.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from pcpflow.layouts.accounting import traffic_factor


@dataclass
class CommStats:
    """Per-purpose call counts and bytes, for the current step and for the run."""

    step_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    step_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    total_bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    log: list[tuple[str, str, tuple[int, ...]]] | None = None  # (op, purpose, shape) if tracing
    # This rank's own sends (point-to-point purposes): purpose -> [calls, bytes].
    step_sent: dict[str, list[int]] = field(default_factory=lambda: defaultdict(lambda: [0, 0]))

    def add_sent(self, op: str, purpose: str, nbytes: int, shape: tuple[int, ...]) -> None:
        sent = self.step_sent[purpose]
        sent[0] += 1
        sent[1] += nbytes
        if self.log is not None:
            self.log.append((op, purpose, shape))

    def take_sent(self) -> dict[str, tuple[int, int]]:
        """This rank's (calls, bytes) by purpose sent this step; the next step starts empty."""
        out = {k: (v[0], v[1]) for k, v in self.step_sent.items()}
        self.step_sent.clear()
        return out

    def add(self, op: str, purpose: str, nbytes: int, shape: tuple[int, ...]) -> None:
        self.step_calls[purpose] += 1
        self.step_bytes[purpose] += nbytes
        if self.log is not None:
            self.log.append((op, purpose, shape))

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """What runs inside counts nothing (a warm-up): the step's counts, its sends and the
        log are as they were before."""
        calls, nbytes = dict(self.step_calls), dict(self.step_bytes)
        sent = {k: list(v) for k, v in self.step_sent.items()}
        logged = None if self.log is None else len(self.log)
        try:
            yield
        finally:
            for counts, before in ((self.step_calls, calls), (self.step_bytes, nbytes), (self.step_sent, sent)):
                counts.clear()
                counts.update(before)
            if logged is not None:
                del self.log[logged:]

    def end_step(self) -> tuple[dict[str, int], dict[str, int]]:
        """Close the step: return its (calls, bytes) and fold them into the totals."""
        calls, nbytes = dict(self.step_calls), dict(self.step_bytes)
        for k, v in calls.items():
            self.total_calls[k] += v
        for k, v in nbytes.items():
            self.total_bytes[k] += v
        self.step_calls.clear()
        self.step_bytes.clear()
        return calls, nbytes


class RingHop:
    """A hop in flight (``Comm.ring_exchange``)."""

    def __init__(self, works: list, recvs: list[torch.Tensor]) -> None:
        self.works, self.recvs = works, recvs

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        return self.recvs


def gather_sent(world: Comm, sent: dict[str, tuple[int, int]], purposes: tuple[str, ...],
                device: torch.device | str = "cpu") -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """Every rank's ``CommStats.take_sent`` of ``purposes``, gathered over ``world`` (one
    small all-gather; pass an unaccounted Comm): (calls, bytes) by purpose, a list per global
    rank. Every rank must call it at the same point of the step."""
    mine = torch.tensor([list(sent.get(p, (0, 0))) for p in purposes], dtype=torch.int64, device=device)
    mine = mine.reshape(len(purposes), 2)
    every = world.all_gather(mine[None], "sent").reshape(world.size, len(purposes), 2)
    return (
        {p: every[:, i, 0].tolist() for i, p in enumerate(purposes)},
        {p: every[:, i, 1].tolist() for i, p in enumerate(purposes)},
    )


# torch >= 2.12 names it all_gather_single (all_gather_into_tensor is deprecated there).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Comm:
    """One process group. ``group=None`` with ``size == 1`` is the single-rank group."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        rank: int,
        size: int,
        stats: CommStats | None = None,
        copies: int = 1,
    ) -> None:
        if group is None and size != 1:
            raise ValueError(f"a Comm of size {size} needs a process group")
        self.group = group
        self.rank = rank
        self.size = size
        self.stats = stats
        self.copies = copies  # groups of this axis doing the same collective (accounting)

    @classmethod
    def solo(cls, stats: CommStats | None = None) -> Comm:
        return cls(None, 0, 1, stats)

    def _account(self, op: str, purpose: str, t: torch.Tensor) -> None:
        if self.stats is not None and self.size > 1:
            nbytes = t.numel() * t.element_size() * traffic_factor(op, self.size) * self.copies
            self.stats.add(op, purpose, nbytes, tuple(t.shape))

    def all_gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        """Concatenate every rank's ``t`` along dim 0, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]))
        _all_gather_single(out, t, group=self.group)
        self._account("all_gather", purpose, t)
        return out

    def all_to_all(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        """Split ``t`` into ``size`` equal chunks along dim 0; chunk ``j`` goes to rank
        ``j``; the result holds the chunks received, in source-rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        self._account("all_to_all", purpose, t)
        return out

    def broadcast(self, t: torch.Tensor, src: int, purpose: str) -> torch.Tensor:
        """``src`` is a rank within this group."""
        if self.size == 1:
            return t
        global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
        dist.broadcast(t, src=global_src, group=self.group)
        self._account("broadcast", purpose, t)
        return t

    def all_reduce(self, t: torch.Tensor, purpose: str, op: str = "sum") -> torch.Tensor:
        if self.size == 1:
            return t
        red = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op]
        dist.all_reduce(t, op=red, group=self.group)
        self._account("all_reduce", purpose, t)
        return t

    def reduce_scatter(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        """Sum ``t`` over the group; rank ``j`` gets the ``j``-th of ``size`` equal chunks
        along dim 0."""
        if self.size == 1:
            return t
        t = t.contiguous()
        out = t.new_empty((t.shape[0] // self.size, *t.shape[1:]))
        _reduce_scatter_single(out, t, group=self.group)
        self._account("reduce_scatter", purpose, t)
        return out

    def all_to_all_v(
        self, t: torch.Tensor, send: list[int], recv: list[int], purpose: str, nbytes: int | None = None
    ) -> torch.Tensor:
        """Rows ``t[sum(send[:j]) : sum(send[:j+1])]`` go to rank ``j``; the result holds
        ``recv[i]`` rows from each rank ``i``, in rank order. Uneven sizes: the caller, who
        knows every rank's counts, says what the group moved (``nbytes``); without it this
        rank counts what it sends to the others (``CommStats.step_sent``)."""
        if self.size == 1:
            return t
        out = t.new_empty((sum(recv), *t.shape[1:]))
        dist.all_to_all_single(out, t.contiguous(), recv, send, group=self.group)
        if self.stats is not None and nbytes is not None:
            self.stats.add("all_to_all", purpose, nbytes, tuple(t.shape))
        elif self.stats is not None:
            row = t[0].numel() * t.element_size() if t.dim() > 1 else t.element_size()
            self.stats.add_sent("all_to_all", purpose, (sum(send) - send[self.rank]) * row, tuple(t.shape))
        return out

    def ring_exchange(self, sends: list[tuple[torch.Tensor, str]], recvs: list[torch.Tensor]) -> RingHop:
        """One hop of a ring: ``sends[i]`` goes to the next rank of the group while
        ``recvs[i]`` (preallocated) is filled from the previous one, as one batch of
        isend/irecv that runs while the caller computes; ``RingHop.wait`` finishes it.
        Empty tensors are skipped on both sides (each side knows the other's sizes). A wait
        fails like a collective: after the group's timeout, or when a peer leaves."""
        if self.size == 1:
            raise ValueError("a ring needs a group of at least two ranks")
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        ops = []
        for tag, (t, purpose) in enumerate(sends):
            if t.numel():
                ops.append(dist.P2POp(dist.isend, t, nxt, self.group, tag=tag))
                if self.stats is not None:
                    self.stats.add_sent("send", purpose, t.numel() * t.element_size(), tuple(t.shape))
        ops += [dist.P2POp(dist.irecv, buf, prv, self.group, tag=tag) for tag, buf in enumerate(recvs) if buf.numel()]
        return RingHop(dist.batch_isend_irecv(ops) if ops else [], recvs)

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.group)
