"""What every stage of one rank can see: config, rank grid, groups, model, KV caches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pcpflow.config.run import RunConfig
from pcpflow.models.base import CausalLM
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.parallel.grid import RankGrid
from pcpflow.scheduling.kv_groups import KVGroups

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
    kv_caches: list[torch.Tensor]  # per layer [num_blocks * block_size, entry_dim] (``allocate_kv_caches``)
    stats: CommStats
    requests: list[Any] = field(default_factory=list)  # the workload (pcpflow.scheduling.workload.Request)
    is_reference: bool = False
    aux_layers: set[int] = field(default_factory=set)  # layers whose hidden drafters need
    extras: dict[str, Any] = field(default_factory=dict)  # per-run space for user stages
    tp: Comm = field(default_factory=Comm.solo)  # the TP group (heads and MLP width split)
    dcp_heads: Comm = field(default_factory=Comm.solo)  # DCP members at this PCP rank
    # the paged caches stages keep besides the target's (``Stage.own_kv``), by slot: a drafter's
    own_kv: dict[str, list[tuple[Any, list[torch.Tensor]]]] = field(default_factory=dict)
    # the KV groups of a hybrid cache (``pcpflow.scheduling.kv_groups``): each group's layers
    # read its own block tables (``GlobalBatch.group_block_tables``); None: one group, one table
    kv_groups: KVGroups | None = None

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
    def layout_dcp_size(self) -> int:
        """The dcp a PCP layout is planned with (``plan_layout`` knows dcp in {1, pcp}):
        the layout depends on the PCP rank only, DCP over TP ranks shards KV, not rows."""
        return self.config.grid.layout_dcp

    @property
    def block_size(self) -> int:
        return self.config.kv.block_size


def allocate_kv_caches(
    model: CausalLM,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    groups: KVGroups | None = None,
) -> list[torch.Tensor]:
    """The KV cache, one ``[num_slots, entry_dim]`` tensor per layer, filled with NaN so that
    a read of a slot nobody wrote poisons the output and a stray write stands out.

    Classic (``groups`` None or not hybrid): a tensor of its own per layer, ``num_blocks *
    block_size`` slots. Hybrid: ``groups.size`` tensors of ``(num_blocks + 1) * block_size``
    slots, the last block the null block (``KVCacheManager.null_block``: the table entries a
    window left point at it; nobody writes it, the kernels mask what they read of it); layer
    ``l`` gets tensor ``groups.layer_slot[l]``, the same object as the same place of every
    other group (a block holds one group's layers)."""
    hybrid = groups is not None and groups.hybrid
    num_slots, entry_dim = (num_blocks + hybrid) * block_size, model.attn_spec.entry_dim

    # NOTE: one spare row past the last slot, outside the cache's view: where a captured
    # graph sends its padded rows' writes (``with_pad_slot``), since PAD_SLOT_ID cannot be
    # skipped without a data-dependent shape.
    def tensor() -> torch.Tensor:
        return torch.full((num_slots + 1, entry_dim), float("nan"), dtype=dtype, device=device)[:num_slots]

    if not hybrid:
        return [tensor() for _ in range(model.num_layers)]
    if len(groups.layer_slot) != model.num_layers:
        raise ValueError(f"KV groups of {len(groups.layer_slot)} layers for a {model.num_layers}-layer model")
    storage = [tensor() for _ in range(groups.size)]
    return [storage[s] for s in groups.layer_slot.tolist()]


def with_pad_slot(cache: torch.Tensor) -> torch.Tensor:
    """The cache with its spare row: ``[num_slots + 1, entry_dim]`` on the same storage."""
    rows, width = cache.shape
    if cache.untyped_storage().nbytes() < (cache.storage_offset() + (rows + 1) * width) * cache.element_size():
        raise ValueError("cache has no spare pad row (allocate it with allocate_kv_caches)")
    return cache.as_strided((rows + 1, width), cache.stride())


def build_comms(grid: RankGrid, stats: CommStats, *, timeout_s: float) -> dict[str, Comm]:
    """``{"world", "tp", "pcp", "dcp", "dcp_heads"}`` groups of this rank (solo ones in one
    process; see ``RankGrid.build``)."""
    # NOTE: a one-rank grid needs no group on any rank (mode=profile runs one on each of its ranks)
    if not dist.is_initialized() or grid.world_size == 1:
        return {name: Comm.solo(stats) for name in ("world", "tp", "pcp", "dcp", "dcp_heads")}
    return grid.build(dist.get_rank(), stats, timeout_s=timeout_s)
