"""One rank of a profile: every section, all ranks at once; rank 0 writes the file.

``measure`` is the work a profile's ranks run in place of the engine (``RankSession.run``,
started by ``pcpflow.driver.launch`` as a run's ranks are). After each section the ranks'
figures meet on rank 0 (compute: their mean; collectives: the slowest rank), which adds them
to the document and rewrites ``hardware.yaml`` (partial until the last section), and appends
a line to ``progress.jsonl`` for the driver's progress bar.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from pcpflow.profile import sections as S
from pcpflow.profile.document import PROFILE_FILE, Document, borrowed_sections
from pcpflow.profile.grid import grid_of

PROGRESS_FILE = "progress.jsonl"


def default_dtypes(device: str, quick: bool) -> list[str]:
    """The dtypes a profile covers when ``profile.dtypes`` is null."""
    full = ["bfloat16", "float32"] if device == "cuda" else ["float32", "float64", "bfloat16"]
    return full[:1] if quick else full


def section_names(dtypes: list[str], *, collectives: bool) -> list[str]:
    names = ["launch", "memory"]  # then dtype by dtype: one cold pool filled once each
    names += [s for d in dtypes for s in (f"gemm:{d}", f"attention:{d}:prefill", f"attention:{d}:decode")]
    names.append("host")
    if collectives:
        names += ["collectives", "sync"]
    return names


def measure(cfg, run_dir: Path | None) -> dict[str, Any] | None:
    """Every section on this rank; rank 0 returns the result sections (others None)."""
    from pcpflow.rank.devices import rank_threads

    with rank_threads(cfg.threads_per_rank, cfg.cpu_bind):
        return _measure(cfg, run_dir)


def _measure(cfg, run_dir: Path | None) -> dict[str, Any] | None:
    from pcpflow.parallel.comm import CommStats
    from pcpflow.pipeline.context import build_comms
    from pcpflow.rank.devices import pick_device
    from pcpflow.rank.progress import mark_stage

    device = pick_device(cfg.device)
    grid = grid_of(cfg.profile.quick)
    dtypes = list(cfg.profile.dtypes or default_dtypes(device.type, cfg.profile.quick))
    comms = _distinct_groups(build_comms(cfg.grid, CommStats(), timeout_s=cfg.collective_timeout_s), cfg)
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = section_names(dtypes, collectives=bool(comms))
    doc = progress = None
    if rank == 0 and run_dir is not None:
        doc = _document(cfg, run_dir, device, dtypes, names, bool(comms))
        progress = _Progress(run_dir / PROGRESS_FILE, _points(grid, dtypes, comms))
    bench = S.Bench(device=device, grid=grid, dtypes=dtypes, block_size=cfg.kv.block_size, comms=comms,
                    attention=_attention_setting(cfg), run_cfg=cfg,
                    tick=progress.tick if progress is not None else (lambda n: None))
    t0 = time.perf_counter()
    if doc is not None:
        doc.write(elapsed_s=0.0)
    for name in names:
        mark_stage(f"profile {name}")
        started = time.perf_counter()
        figures = _reduce(name, _run(bench, name))
        if doc is not None:
            doc.add(name, figures, seconds=time.perf_counter() - started)
            doc.write(elapsed_s=time.perf_counter() - t0)
    if doc is None:
        return None
    mark_stage("profile: the file")
    final = doc.write(elapsed_s=time.perf_counter() - t0, complete=True)
    return {"profile": {"path": str(run_dir / PROFILE_FILE), "status": final["measured"]["status"],
                        "dtypes": dtypes, "sections": names, "elapsed_s": final["measured"]["elapsed_s"],
                        "peak_tflops": final.get("peak_tflops"), "hbm_tbps": final.get("hbm_tbps"),
                        "launch_us": (final.get("host") or {}).get("launch_us")}}


def _attention_setting(cfg) -> str:
    forward = (cfg.pipeline or {}).get("forward") or {}
    return forward.get("attention", "auto")


def _document(cfg, run_dir: Path, device: torch.device, dtypes: list[str], names: list[str], measured_comms: bool):
    from pcpflow.attention.fused import resolve_attention

    if device.type == "cuda":
        what = f"cuda: {torch.cuda.get_device_name(device)}"
        backend = f"nccl {'.'.join(map(str, torch.cuda.nccl.version()))}" if cfg.world_size > 1 else "none (one GPU)"
    else:
        import os
        import platform

        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        what = f"cpu: {_cpu_model() or platform.processor() or platform.machine()} ({cores} cores)"
        backend = f"gloo (torch {torch.__version__})" if cfg.world_size > 1 else "none (one rank)"
    borrowed = None
    if device.type == "cuda" and not measured_comms:
        borrowed = borrowed_sections(cfg.profile.collectives_from)
    doc = Document(run_dir / PROFILE_FILE, device=what, backend=backend, tp=cfg.tp, pcp=cfg.pcp,
                   threads=cfg.threads_per_rank, cpu_bind=cfg.cpu_bind, dtypes=dtypes, quick=cfg.profile.quick,
                   attention=resolve_attention(_attention_setting(cfg), device), block_size=cfg.kv.block_size,
                   sections=names,
                   collectives_from=borrowed)
    if device.type == "cuda":
        doc.values["sm_count"] = torch.cuda.get_device_properties(device).multi_processor_count
    return doc


def _cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _distinct_groups(comms: dict[str, Any], cfg) -> dict[str, Any]:
    """The grid's groups of more than one rank, each set of members once (at tp=1 the PCP
    group is the world): name -> Comm."""
    grid, out, seen = cfg.grid, {}, set()
    members = {"tp": grid.tp_members, "pcp": grid.pcp_members, "dcp": grid.dcp_members,
               "dcp_heads": grid.dcp_heads_members, "world": lambda r: list(range(grid.world_size))}
    for name in ("tp", "pcp", "dcp", "dcp_heads", "world"):
        comm = comms[name]
        key = tuple(members[name](0))
        if comm.size > 1 and key not in seen:
            seen.add(key)
            out[name] = comm
    return out


def _run(b: S.Bench, name: str) -> Any:
    kind, *rest = name.split(":")
    if kind == "gemm":
        return S.gemm(b, rest[0])
    if kind == "attention":
        return S.attention(b, rest[0], rest[1])
    return getattr(S, kind)(b)


def _reduce(name: str, mine: Any) -> Any:
    """Every rank's figures on rank 0: compute times averaged over the ranks, a collective's
    the slowest rank's (a call ends when its last rank is done), host points every rank's;
    then the fits."""
    every = [mine]
    if dist.is_initialized() and dist.get_world_size() > 1:
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
    if name == "collectives":
        out = []
        for i, c in enumerate(every[0]):
            seconds = S.monotone(np.max([e[i]["seconds"] for e in every], axis=0).tolist())
            lat, gbps = S.fit_collective(c["bytes"], seconds)
            out.append({**c, "seconds": seconds, "latency_us": lat, "gbps": gbps})
        return out
    if name == "host":
        points = [p for e in every for p in e["points"]]
        return S.fit_host(points)
    if name == "sync":  # every rank waits as long as the call: their mean
        return S.fit_sync(*(np.mean([e[k] for e in every], axis=0).tolist() for k in ("work_s", "excess_s")))
    out = _mean(every)
    if name == "memory":
        out["seconds"] = S.monotone(out["seconds"])
    return out


def _mean(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        return {k: _mean([v[k] for v in values]) for k in first}
    if isinstance(first, list):
        if not _numeric(first) or _integers(first):  # axes (sizes) are the same on every rank
            return first
        return np.mean(np.asarray(values, dtype=np.float64), axis=0).tolist()
    if isinstance(first, float):
        return float(np.mean(values))
    return first


def _integers(x: Any) -> bool:
    return isinstance(x, int) or (isinstance(x, list) and all(_integers(v) for v in x))


def _numeric(x: Any) -> bool:
    return isinstance(x, (int, float)) or (isinstance(x, list) and all(_numeric(v) for v in x))


def _points(grid, dtypes: list[str], comms: dict[str, Any]) -> int:
    n = 3 + len(grid.memory_bytes)
    n += len(dtypes) * len(grid.gemm_m) * len(grid.gemm_nk) ** 2
    n += len(dtypes) * (len(grid.prefill_rows) * len(grid.prefill_keys) + len(grid.decode_rows) * len(grid.decode_keys))
    n += len(grid.host_batches) + 2
    n += len(comms) * 6 * len(grid.collective_bytes)
    n += len(grid.sync_work_s) if comms else 0
    return n


class _Progress:
    """``progress.jsonl``: points done of the total, for the driver's bar."""

    def __init__(self, path: Path, total: int) -> None:
        self.path, self.total, self.done = path, total, 0
        self.path.write_text("")

    def tick(self, n: int) -> None:
        self.done = min(self.done + n, self.total)
        with open(self.path, "a") as f:
            f.write(json.dumps({"step": self.done, "num_generated": self.done, "num_to_generate": self.total}) + "\n")
