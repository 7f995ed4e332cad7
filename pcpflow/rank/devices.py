"""Which device and collective backend each rank uses.

Rank -> device: ``cuda:LOCAL_RANK`` (set by pcpflow's elastic launch and by torchrun /
srun wrappers), else ``cuda:0`` for a rank started without one (the in-process pcp=1
run). NCCL on CUDA, gloo on CPU. NCCL cannot put two ranks on one GPU, and gloo on CUDA
tensors would stage every collective through the host (and was never run here), so a
run with more ranks on a node than visible GPUs is refused before any rank starts
(exit 2) rather than sharing a GPU; multi-rank layouts run on CPU (``device=cpu``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pcpflow.errors import Problem

if TYPE_CHECKING:
    from pcpflow.config.run import RunConfig


def local_rank() -> int:
    """This process's rank on its node (``LOCAL_RANK``; 0 when no launcher set it)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def uses_cuda(cfg: RunConfig) -> bool:
    return cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available())


def pick_device(cfg: RunConfig) -> torch.device:
    if not uses_cuda(cfg):
        return torch.device("cpu")
    rank, count = local_rank(), torch.cuda.device_count()
    if rank >= count:
        raise RuntimeError(
            f"local rank {rank} has no GPU of its own ({count} visible): start at most "
            f"{count} ranks per node, or use device=cpu"
        )
    return torch.device("cuda", rank)


def pick_backend(cfg: RunConfig, device: torch.device) -> str:
    if cfg.backend != "auto":
        return cfg.backend
    return "nccl" if device.type == "cuda" else "gloo"


def device_problems(cfg: RunConfig) -> list[Problem]:
    """Device/backend settings that cannot run here (checked in the driver)."""
    p: list[Problem] = []
    if cfg.backend == "nccl" and cfg.device == "cpu":
        p.append(
            Problem("backend", "nccl", "nccl needs device=cuda (or auto on a GPU machine); use gloo")
        )
    if cfg.device == "cuda" or cfg.backend == "nccl":
        if not torch.cuda.is_available():
            field, given = ("device", "cuda") if cfg.device == "cuda" else ("backend", "nccl")
            p.append(
                Problem(field, given, "no CUDA device is visible here; use device=cpu / backend=gloo")
            )
            return p
    if cfg.device != "cpu" and torch.cuda.is_available():
        count, needed = torch.cuda.device_count(), ranks_on_this_node(cfg)
        if count < needed:
            p.append(
                Problem(
                    "pcp",
                    cfg.pcp,
                    f"needs {needed} GPUs on this node, {count} visible (one rank per GPU: "
                    "NCCL cannot put two ranks on one GPU, and gloo on CUDA tensors stages "
                    f"every collective through the host); run tp*pcp <= {count} on the GPU, "
                    "or device=cpu",
                )
            )
    return p


def ranks_on_this_node(cfg: RunConfig) -> int:
    """``LOCAL_WORLD_SIZE`` under torchrun / srun wrappers; every rank under pcpflow's
    own launch (one node)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world_size))
