"""Draft collectives, accounted apart: a drafter's traffic is ``draft_<purpose>`` so that it
never mixes with the target's in ``metrics.collective_bytes``."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pcpflow.parallel.comm import Comm

if TYPE_CHECKING:
    from pcpflow.pipeline.context import RankContext


class DraftComm(Comm):
    """``comm``'s group, its traffic accounted as ``draft_<purpose>`` so that draft
    collectives never mix with the target's."""

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm.group, comm.rank, comm.size, comm.stats, comm.copies)

    def all_gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_gather(t, f"draft_{purpose}")

    def all_to_all(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_to_all(t, f"draft_{purpose}")

    def broadcast(self, t: torch.Tensor, src: int, purpose: str) -> torch.Tensor:
        return super().broadcast(t, src, f"draft_{purpose}")

    def all_reduce(self, t: torch.Tensor, purpose: str, op: str = "sum") -> torch.Tensor:
        return super().all_reduce(t, f"draft_{purpose}", op)

    def reduce_scatter(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().reduce_scatter(t, f"draft_{purpose}")


def draft_comm(comm: Comm) -> DraftComm:
    """``comm`` with its traffic accounted under ``draft_<purpose>``."""
    return DraftComm(comm)


def shard_drafter(ctx: RankContext, module: nn.Module) -> nn.Module:
    """A draft model cut to this TP rank's heads and MLP slice (``pcpflow.parallel.tensor_parallel``),
    its all-reduces accounted as ``draft_tp_all_reduce``."""
    from pcpflow.parallel.tensor_parallel import shard_model

    return shard_model(module, draft_comm(ctx.tp), ctx.tp.rank, ctx.tp.size)
