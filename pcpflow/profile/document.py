"""``<run dir>/hardware.yaml``: what the sections measured, as a hardware profile
(``pcpflow.config.hardware.HardwareConfig``) with its ``tables:``, where and when it was
measured, and what it lacks while it is partial. Written after every section (atomically),
so that an interrupted profile leaves what it has, saying "partial"."""

from __future__ import annotations

import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import yaml

from pcpflow.config.hardware import PEAK_OF_DTYPE, HardwareConfig
from pcpflow.profile.grid import basis_shapes

PROFILE_FILE = "hardware.yaml"
GIB = 2**30


class Document:
    """The profile as it grows; ``write`` puts it on disk (partial until ``complete``)."""

    def __init__(self, path: Path, *, device: str, backend: str, tp: int, pcp: int, threads: int, dtypes: list[str],
                 quick: bool, attention: str, block_size: int, sections: list[str], collectives_from: dict[str, Any] | None,
                 cpu_bind: str = "none") -> None:
        import torch

        self.path, self.sections = path, list(sections)
        self.done: list[str] = []
        self.section_s: dict[str, float] = {}
        self.started = datetime.now(timezone.utc)
        self.values: dict[str, Any] = {}
        self.tables: dict[str, Any] = {}
        self.borrowed = collectives_from  # a shipped profile's NCCL sections (one GPU)
        self.attention, self.block_size = attention, block_size
        self.measured = {
            "date": self.started.isoformat(timespec="seconds"),
            "device": device,
            "torch": str(torch.__version__),
            "backend": backend,
            "tp": tp, "pcp": pcp, "threads_per_rank": threads, "cpu_bind": cpu_bind,
            "dtypes": dtypes, "quick": quick,
            "load_average": [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else [],
        }
        self.is_cpu = device.startswith("cpu")

    # ------------------------------------------------------------------ sections
    def add(self, section: str, figures: Any, seconds: float = 0.0) -> None:
        """The figures of one finished section (and how long it took)."""
        getattr(self, f"_{section.split(':')[0]}")(section, figures)
        self.done.append(section)
        self.section_s[section] = round(seconds, 1)

    def _launch(self, _section: str, f: dict[str, Any]) -> None:
        self.tables["launch"] = {k: _round(v) for k, v in f.items()}

    def _memory(self, _section: str, f: dict[str, Any]) -> None:
        self.tables["memory"] = {"bytes": f["bytes"], "seconds": _round(f["seconds"])}

    def _gemm(self, section: str, f: dict[str, Any]) -> None:
        self.tables.setdefault("gemm", {})[section.split(":")[1]] = {**f, "seconds": _round(f["seconds"])}

    def _attention(self, section: str, f: dict[str, Any]) -> None:
        _, dtype, phase = section.split(":")
        att = self.tables.setdefault("attention", {
            "backend": self.attention,
            "block_size": self.block_size,
            "basis": basis_shapes(),
            "prefill": {}, "decode": {},
        })
        att[phase][dtype] = {**f, "seconds": _round(f["seconds"])}

    def _host(self, _section: str, f: dict[str, Any]) -> None:
        self.tables["host"] = {k: _round(v) for k, v in f.items()}

    def _collectives(self, _section: str, f: list[dict[str, Any]]) -> None:
        self.tables["collectives"] = [{**c, "seconds": _round(c["seconds"]), "latency_us": _round(c["latency_us"]),
                                       "gbps": _round(c["gbps"])} for c in f]

    def _sync(self, _section: str, f: dict[str, Any]) -> None:
        self.tables["sync"] = {k: _round(v) for k, v in f.items()}

    # ------------------------------------------------------------------ the file
    def profile(self, *, elapsed_s: float, complete: bool) -> dict[str, Any]:
        """The file's contents now."""
        missing = [s for s in self.sections if s not in self.done]
        doc: dict[str, Any] = {
            "name": "measured",
            "device": "cpu" if self.is_cpu else "gpu",
            "cpu": _cpu_vendor(),
            "gpus_per_node": self.measured["tp"] * self.measured["pcp"],
        }
        doc.update(self.values)
        doc.update(self._derived())
        doc["measured"] = {**self.measured, "status": "complete" if complete and not missing else "partial",
                           "missing": missing, "elapsed_s": round(elapsed_s, 1), "section_s": self.section_s}
        doc["tables"] = self.tables
        return doc

    def _derived(self) -> dict[str, Any]:
        """The schema's scalar fields from the tables: peaks (the best GEMM rate of each dtype),
        streaming bandwidth (the largest copy), memory size, launch costs, overlap."""
        t, out = self.tables, {}
        out["hbm_gib"] = round(_memory_gib(self.is_cpu), 1)
        if "memory" in t:
            m = t["memory"]
            out["hbm_tbps"] = _round(2 * m["bytes"][-1] / m["seconds"][-1] / 1e12)
        peaks: dict[str, float | None] = {"fp32": None, "bf16": None, "fp8": None, "fp4": None, "fp64": None}
        for dtype, g in (t.get("gemm") or {}).items():
            best = max(2.0 * m * n * k / s for m, plane in zip(g["m"], g["seconds"]) for n, row in zip(g["n"], plane)
                       for k, s in zip(g["k"], row))
            peaks[PEAK_OF_DTYPE.get(dtype, dtype)] = _round(best / 1e12)
        if any(v is not None for v in peaks.values()):
            out["peak_tflops"] = peaks
        launch = t.get("launch") or {}
        out["kernel_floor_us"] = _round(launch.get("op_us", 0.0)) if self.is_cpu else 2.0
        if launch:
            per_op = (launch.get("layer_op_us") or {}).get("gqa", launch["op_us"])
            out["host"] = {"launch_us": _round(per_op), "graph_launch_us": launch.get("graph_replay_us"),
                           "kernels_per_layer": None}
        # NOTE: a CPU rank runs its ops, its collectives and its host work on one thread.
        out["overlap"] = {"host": not self.is_cpu, "p2p": not self.is_cpu}
        if self.borrowed:
            out.update(self.borrowed)
        return out

    def write(self, *, elapsed_s: float, complete: bool = False) -> dict[str, Any]:
        doc = self.profile(elapsed_s=elapsed_s, complete=complete)
        if doc["measured"]["status"] == "complete":
            HardwareConfig.model_validate(doc)  # what mode=simulate will load must be a valid profile
        text = _HEADER.format(device=self.measured["device"], date=self.measured["date"]) + yaml.dump(
            doc, Dumper=_Dumper, sort_keys=False, width=120)
        tmp = self.path.with_suffix(".yaml.tmp")
        tmp.write_text(text)
        tmp.replace(self.path)
        return doc


_HEADER = """\
# Measured by `python -m pcpflow mode=profile` on {device}, {date} (docs/profile.md).
# Simulate on it: python -m pcpflow mode=simulate hardware=measured hardware.path=<this file> ...
"""


def borrowed_sections(name: str) -> dict[str, Any]:
    """A shipped profile's NCCL sections (arch, nvlink, network), each saying ``from: name``."""
    from pcpflow.paths import conf_dir

    shipped = yaml.safe_load((Path(conf_dir()) / "hardware" / f"{name}.yaml").read_text())
    out: dict[str, Any] = {"arch": shipped["arch"]}
    for key in ("nvlink", "network"):
        out[key] = {"from": name, **shipped[key]}
    return out


def _round(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_round(v) for v in x]
    if isinstance(x, float):
        return float(f"{x:.4g}")
    return x


def _cpu_vendor() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = platform.processor()
    return "intel" if "GenuineIntel" in text else "amd" if "AuthenticAMD" in text else "other"


def _memory_gib(cpu: bool) -> float:
    if not cpu:
        import torch

        return torch.cuda.get_device_properties(0).total_memory / GIB
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError, AttributeError):
        return 1.0


class _Dumper(yaml.SafeDumper):
    """Lists of numbers on one line (``[1, 2, 3]``), everything else in block style."""


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    flat = all(not isinstance(v, (dict, list)) for v in data) or all(
        isinstance(v, list) and all(not isinstance(w, (dict, list)) for w in v) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(list, _represent_list)
