"""What ``mode=profile`` refuses before any rank starts (``pcpflow.driver.checks``): a world
this machine cannot run with every rank busy on its own core, and a ``collectives_from``
that is no shipped profile with NCCL's graphs."""

from __future__ import annotations

import os
from pathlib import Path

from pcpflow.errors import Problem


def profile_problems(cfg) -> list[Problem]:
    p: list[Problem] = []
    if cfg.mode != "profile":
        return p
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    want = cfg.world_size * cfg.threads_per_rank
    if cfg.device == "cpu" or not _cuda():
        if want > cores:
            field = "pcp" if cfg.pcp > 1 else "tp"
            p.append(Problem(field, getattr(cfg, field),
                             f"a profile measures with every rank on a core of its own: tp*pcp = {cfg.world_size} "
                             f"ranks x threads_per_rank={cfg.threads_per_rank} need {want} cores, this machine has "
                             f"{cores}; profile tp*pcp <= {max(cores // cfg.threads_per_rank, 1)}"))
    shipped = _shipped()
    if cfg.profile.collectives_from not in shipped:
        p.append(Problem("profile.collectives_from", cfg.profile.collectives_from,
                         f"a shipped profile with NCCL's graphs: one of {', '.join(shipped)}"))
    return p


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - no torch, no CUDA
        return False


def _shipped() -> list[str]:
    import yaml

    from pcpflow.paths import conf_dir

    out = []
    for path in sorted((Path(conf_dir()) / "hardware").glob("*.yaml")):
        values = yaml.safe_load(path.read_text()) or {}
        if isinstance(values, dict) and values.get("nvlink"):
            out.append(path.stem)
    return out
