"""Draft collectives, accounted apart: a drafter's traffic is ``draft_<purpose>`` so that it
never mixes with the target's in ``metrics.collective_bytes``."""

from __future__ import annotations

import torch

from pcpflow.comm import Comm


class DraftComm(Comm):
    """``comm``'s group, its traffic accounted as ``draft_<purpose>`` so that draft
    collectives never mix with the target's."""

    def __init__(self, comm: Comm) -> None:
        super().__init__(comm.group, comm.rank, comm.size, comm.stats)

    def all_gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_gather(t, f"draft_{purpose}")

    def all_to_all(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return super().all_to_all(t, f"draft_{purpose}")

    def broadcast(self, t: torch.Tensor, src: int, purpose: str) -> torch.Tensor:
        return super().broadcast(t, src, f"draft_{purpose}")

    def all_reduce(self, t: torch.Tensor, purpose: str, op: str = "sum") -> torch.Tensor:
        return super().all_reduce(t, f"draft_{purpose}", op)


def draft_comm(comm: Comm) -> DraftComm:
    """``comm`` with its traffic accounted under ``draft_<purpose>``."""
    return DraftComm(comm)
