"""The rank grid: tp x pcp ranks, the DCP shards over them, and their process groups.

One object owns the grid (as torchtitan's ``ParallelDims`` does): it validates the sizes
with the numbers in its messages, maps a global rank to its coordinates, lists the members
of every group, and builds the groups. Nothing else recomputes world sizes or ranks.

vLLM's semantics::

    world = tp * pcp,   rank = pcp_rank * tp + tp_rank       # TP innermost (inside a node)
    dcp in {1, pcp, tp * pcp} when pcp > 1;  dcp | tp when pcp == 1

The DCP axis runs along PCP first, then TP: a group holds every PCP rank (pcp > 1) and a
block of ``dcp_tp`` consecutive TP ranks; DCP rank ``d`` is its index in ascending global
rank, ``d = pcp_rank * dcp_tp + tp_local`` (``tp_local`` counts TP ranks inside the block).
With tp == 1, ``pcp=4 dcp=4`` is one group whose PCP and DCP groups are the same ranks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from pcpflow.errors import Problem

if TYPE_CHECKING:
    from pcpflow.parallel.comm import Comm, CommStats


class Axis(str, enum.Enum):
    """The grid's axes; one meaning each."""

    TP = "tp"  # tensor parallel: heads and MLP width split, same rows
    PCP = "pcp"  # prefill context parallel: rows split (DualChunkSwap), full heads
    DCP = "dcp"  # decode context parallel: KV positions sharded, (p // I) % dcp


@dataclass(frozen=True)
class RankGrid:
    tp: int = 1
    pcp: int = 1
    dcp: int = 1

    # ------------------------------------------------------------------ validation
    def problems(self) -> list[Problem]:
        """Everything wrong with these sizes, each naming the numbers (empty: valid)."""
        out: list[Problem] = []
        for name in ("tp", "pcp", "dcp"):
            if getattr(self, name) < 1:
                out.append(Problem(name, getattr(self, name), "must be >= 1"))
        if out:
            return out
        if self.pcp > 1:
            allowed = self.allowed_dcp()
            if self.dcp not in allowed:
                out.append(
                    Problem(
                        "dcp",
                        self.dcp,
                        f"with pcp({self.pcp}) x tp({self.tp}) dcp must be one of {allowed} "
                        "(1, pcp, or tp*pcp)",
                    )
                )
        elif self.tp % self.dcp:
            out.append(
                Problem("dcp", self.dcp, f"with pcp=1 dcp must divide tp({self.tp}); allowed: {self.allowed_dcp()}")
            )
        return out

    def allowed_dcp(self) -> list[int]:
        if self.pcp > 1:
            return sorted({1, self.pcp, self.tp * self.pcp})
        return [d for d in range(1, self.tp + 1) if self.tp % d == 0]

    # ------------------------------------------------------------------ coordinates
    @property
    def world_size(self) -> int:
        return self.tp * self.pcp

    @property
    def dcp_tp(self) -> int:
        """How many TP ranks one DCP group spans: dcp // pcp when the group takes the whole
        PCP axis (pcp > 1), else dcp itself (pcp == 1: DCP inside the TP group)."""
        if self.dcp == 1:
            return 1
        return self.dcp // self.pcp if self.pcp > 1 else self.dcp

    @property
    def layout_dcp(self) -> int:
        """The dcp a PCP layout is planned with (``plan_layout`` knows dcp in {1, pcp}):
        the layout depends on the PCP rank only; DCP over TP ranks shards KV, not rows."""
        return self.pcp if self.dcp > 1 else 1

    def coords(self, rank: int) -> dict[Axis, int]:
        """``{TP: tp_rank, PCP: pcp_rank, DCP: dcp_rank}`` of a global rank."""
        pcp_rank, tp_rank = divmod(rank, self.tp)
        return {Axis.TP: tp_rank, Axis.PCP: pcp_rank, Axis.DCP: self.dcp_members(rank).index(rank)}

    def tp_members(self, rank: int) -> list[int]:
        pcp_rank = rank // self.tp
        return [pcp_rank * self.tp + t for t in range(self.tp)]

    def pcp_members(self, rank: int) -> list[int]:
        tp_rank = rank % self.tp
        return [p * self.tp + tp_rank for p in range(self.pcp)]

    def dcp_members(self, rank: int) -> list[int]:
        """The ranks of ``rank``'s DCP group in DCP-rank order (ascending global rank, the
        order torch numbers a group in). The group takes the PCP axis first (every PCP rank
        when dcp > 1 and pcp > 1), then a block of ``dcp_tp`` consecutive TP ranks (those
        that hold the same KV heads)."""
        if self.dcp == 1:
            return [rank]
        pcp_rank, tp_rank = divmod(rank, self.tp)
        t0 = tp_rank // self.dcp_tp * self.dcp_tp
        pcps = range(self.pcp) if self.pcp > 1 else [pcp_rank]
        return sorted(p * self.tp + t for p in pcps for t in range(t0, t0 + self.dcp_tp))

    def dcp_heads_members(self, rank: int) -> list[int]:
        """The members of ``rank``'s DCP group at its own PCP rank: the TP block that holds
        the same rows and shares its KV heads (where DCP over TP gathers decode queries)."""
        pcp_rank = rank // self.tp
        return [r for r in self.dcp_members(rank) if r // self.tp == pcp_rank]

    def all_groups(self, axis: Axis) -> list[list[int]]:
        """Every group along ``axis``, each in its group-rank order, in a fixed order (every
        rank must create every group, in the same order: new_group is collective)."""
        members = {Axis.TP: self.tp_members, Axis.PCP: self.pcp_members, Axis.DCP: self.dcp_members}[axis]
        seen: list[list[int]] = []
        for r in range(self.world_size):
            g = members(r)
            if g not in seen:
                seen.append(g)
        return seen

    # ------------------------------------------------------------------ groups
    def build(self, rank: int, stats: CommStats, *, timeout_s: float | None = None,
              offset: int = 0) -> dict[str, Comm] | None:
        """``{"world", "tp", "pcp", "dcp", "dcp_heads"}`` Comms of global rank ``rank`` on an
        initialized default group (or groups of one when the grid is one rank). ``dcp_heads``
        is the part of the DCP group at this PCP rank (``dcp_heads_members``; the DCP group
        itself when that is all of it). Every group honours ``timeout_s``.

        ``offset``: the grid's first global rank, when it is one pool of a larger job
        (``disagg=pd``: the decode pool after the prefill pool). Creating a group is
        collective, so every rank of the job calls this for every pool; a rank outside the
        grid gets None."""
        import torch.distributed as dist

        from pcpflow.parallel.comm import Comm

        local = rank - offset
        inside = 0 <= local < self.world_size
        if self.world_size == 1 or not dist.is_initialized():
            return {name: Comm.solo(stats) for name in ("world", "tp", "pcp", "dcp", "dcp_heads")} if inside else None
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)

        def group(members: list[int]):
            return dist.new_group([m + offset for m in members], timeout=timeout)

        if offset == 0 and dist.get_world_size() == self.world_size:
            world = dist.group.WORLD
        else:
            world = group(list(range(self.world_size)))
        comms: dict[str, Comm] = {"world": Comm(world, local, self.world_size, stats)} if inside else {}
        for axis in (Axis.TP, Axis.PCP, Axis.DCP):
            mine = Comm.solo(stats)
            for members in self.all_groups(axis):
                if len(members) == 1:
                    continue
                made = group(members)
                if local in members:
                    copies = self.world_size // len(members)
                    mine = Comm(made, members.index(local), len(members), stats, copies)
            comms[axis.value] = mine
        comms["dcp_heads"] = comms["dcp"]  # the whole DCP group holds the same rows
        if self.pcp > 1 and self.dcp_tp > 1:
            seen: list[list[int]] = []
            for r in range(self.world_size):
                members = self.dcp_heads_members(r)
                if members in seen:
                    continue
                seen.append(members)
                made = group(members)
                if local in members:
                    copies = self.world_size // len(members)
                    comms["dcp_heads"] = Comm(made, members.index(local), len(members), stats, copies)
        return comms if inside else None
