"""Starting the ranks of one job, and the code each rank runs.

The driver writes the frozen, resolved config to ``<run dir>/config.json`` and starts
``tp * pcp`` rank processes with torch's elastic launch API (c10d rendezvous on
``localhost:0`` so that concurrent or successive jobs never share a port, ``spawn``,
``OMP_NUM_THREADS=threads_per_rank``, per-rank logs under ``<run dir>/logs``). Ranks never run Hydra:
``rank_main`` loads the frozen config, initializes the process groups and runs the
engine. A rank that raises ends the job: the elastic agent stops the others, and the
driver reports the first failing rank's error.
"""

from __future__ import annotations

import json
import os
import re
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.launcher.api import LaunchConfig, elastic_launch

from pcpflow.config import RunConfig, parse_run_config
from pcpflow.context import pick_backend, pick_device

CONFIG_FILE = "config.json"
RESULT_FILE = "result.json"


def write_frozen_config(cfg: RunConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(json.dumps(cfg.model_dump(mode="json"), indent=2) + "\n")


def load_frozen_config(run_dir: Path) -> RunConfig:
    return parse_run_config(json.loads((run_dir / CONFIG_FILE).read_text()))


def init_distributed(cfg: RunConfig) -> None:
    device = pick_device(cfg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=pick_backend(cfg, device),
        timeout=timedelta(seconds=cfg.collective_timeout_s),
    )


@record
def rank_main(run_dir: str) -> dict[str, Any] | None:
    """Entry point of a spawned rank (module level: spawn pickles it by name)."""
    from pcpflow.engine import run_rank
    from pcpflow.stage import load_stage_sources

    path = Path(run_dir)
    cfg = load_frozen_config(path)
    load_stage_sources(cfg.plugins)
    init_distributed(cfg)
    try:
        return run_rank(cfg, path)
    finally:
        dist.destroy_process_group()


def launch_ranks(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """Run the job's ranks; returns rank 0's result sections. Raises RankFailure."""
    if cfg.world_size == 1:
        # One rank needs no process group: run it in this process (same engine code).
        from pcpflow.engine import run_rank

        result = run_rank(cfg, run_dir)
        assert result is not None
        return result
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"pcpflow-{uuid.uuid4().hex[:12]}",
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 60},
        max_restarts=0,
        monitor_interval=0.1,
        start_method="spawn",
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL, tee={0: Std.ERR}),
    )
    env_threads = os.environ.get("OMP_NUM_THREADS")
    # NOTE: the elastic agent does not set OMP_NUM_THREADS; oversubscribed ranks on a
    # few cores slow each other down by orders of magnitude.
    os.environ["OMP_NUM_THREADS"] = str(cfg.threads_per_rank)
    try:
        results = elastic_launch(config, rank_main)(str(run_dir))
    except ChildFailedError as exc:
        raise RankFailure.root_cause(exc, log_dir.glob(f"{config.run_id}*/attempt_*/*/error.json")) from None
    finally:
        if env_threads is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    return results[0]


class RankFailure(RuntimeError):
    """A rank raised (or died); carries that rank's error message."""

    def __init__(self, rank: int, message: str, details: str = "") -> None:
        self.rank, self.message, self.details = rank, message, details
        super().__init__(f"rank {rank} failed: {message}")

    @classmethod
    def root_cause(cls, exc: ChildFailedError, error_files) -> RankFailure:
        """The earliest rank that raised an error of its own. Ranks that died *because* of
        it (a collective's peer vanished, the agent's SIGTERM) are consequences, and the
        agent reports only the first failed process it happens to notice, so every rank's
        error file (written by ``@record``) is read. File times order the errors (their
        own timestamps have one-second resolution)."""
        found = []
        for path in error_files:
            try:
                data = json.loads(path.read_text())
                rank, mtime = int(path.parent.name), path.stat().st_mtime_ns
            except (OSError, ValueError):
                continue
            message, details = _error_message(data)
            found.append((mtime, rank, message, details))
        with_files = {rank for _, rank, _, _ in found}
        for rank, failure in exc.failures.items():
            if rank not in with_files:  # died without Python unwinding (signal, crash)
                message = f"exited with code {failure.exitcode} (no Python error; see the rank's log)"
                found.append((failure.timestamp * 10**9, rank, message, ""))
        found.sort()
        causes = [f for f in found if not _CONSEQUENCE.search(f[2])] or found
        _, rank, message, details = causes[0]
        return cls(rank, message, details)


_CONSEQUENCE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|[Gg]loo.*(timed out|closed|reset)|"
    r"NCCL (error|communicator was aborted)|Socket Timeout|terminated with signal|Signal \d+"
)


def _error_message(data: Any) -> tuple[str, str]:
    """(message, python traceback) of an elastic error file's contents."""
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        return str(msg.get("message", "")), str(msg.get("extraInfo", {}).get("py_callstack", ""))
    return (str(msg) if msg and msg != "<NONE>" else ""), ""


def print_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
