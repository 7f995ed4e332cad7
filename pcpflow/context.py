"""What every stage of one rank can see: config, rank grid, groups, model, KV caches."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pcpflow.comm import Comm, CommStats
from pcpflow.config import RunConfig
from pcpflow.models.base import CausalLM

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


@dataclass
class RankContext:
    config: RunConfig
    pcp: Comm  # the PCP group (layouts are planned over it)
    dcp: Comm  # the DCP group (KV shards); a group of one when dcp == 1
    world: Comm
    device: torch.device
    dtype: torch.dtype
    model: CausalLM
    kv_caches: list[torch.Tensor]  # per layer [num_blocks * block_size, entry_dim]
    stats: CommStats
    requests: list[Any] = field(default_factory=list)  # the workload (pcpflow.workload.Request)
    is_reference: bool = False
    aux_layers: set[int] = field(default_factory=set)  # layers whose hidden drafters need
    extras: dict[str, Any] = field(default_factory=dict)  # per-run space for user stages

    @property
    def pcp_rank(self) -> int:
        return self.pcp.rank

    @property
    def pcp_size(self) -> int:
        return self.pcp.size

    @property
    def dcp_rank(self) -> int:
        return self.dcp.rank

    @property
    def dcp_size(self) -> int:
        return self.dcp.size

    @property
    def block_size(self) -> int:
        return self.config.kv.block_size


def allocate_kv_caches(
    model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    """One ``[num_blocks * block_size, entry_dim]`` tensor per layer, filled with NaN so that
    a read of a slot nobody wrote poisons the output and a stray write stands out."""
    shape = (num_blocks * block_size, model.attn_spec.entry_dim)
    return [torch.full(shape, float("nan"), dtype=dtype, device=device) for _ in range(model.num_layers)]


def pick_device(cfg: RunConfig) -> torch.device:
    if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()):
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
    return torch.device("cpu")


def pick_backend(cfg: RunConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def build_groups(cfg: RunConfig, stats: CommStats) -> tuple[Comm, Comm, Comm]:
    """World, PCP and DCP groups on an initialized default group.

    Ranks are laid out ``rank = pcp_rank * tp + tp_rank``; the DCP group runs along the
    PCP axis first, then TP (vLLM semantics). With tp == 1 a dcp > 1 group is the PCP
    group itself. Every rank creates every group in the same order (new_group is a
    collective).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    world = Comm(dist.group.WORLD, rank, world_size, stats)
    tp, pcp = cfg.tp, cfg.pcp
    pcp_rank, tp_rank = divmod(rank, tp)
    pcp_comm = Comm.solo(stats)
    for t in range(tp):
        members = [p * tp + t for p in range(pcp)]
        group = dist.new_group(members) if pcp > 1 else None
        if t == tp_rank and group is not None:
            pcp_comm = Comm(group, pcp_rank, pcp, stats)
    dcp_comm = Comm.solo(stats)
    if cfg.dcp > 1:
        # DCP ranks are consecutive along (pcp, then tp); groups of dcp size.
        order = [p * tp + t for t in range(tp) for p in range(pcp)]
        for start in range(0, world_size, cfg.dcp):
            members = sorted(order[start : start + cfg.dcp])
            group = dist.new_group(members)
            if rank in members:
                dcp_comm = Comm(group, members.index(rank), cfg.dcp, stats)
    return world, pcp_comm, dcp_comm
