"""Run pcpflow jobs from Python, for tests (pcpflow's own, and a plugin author's).

``run(configs)`` runs each config's engine exactly as a job would — same stages, same
collectives, same verification — but starts each world size's ranks only once and runs
every config of that size inside them, so a matrix of dozens of configs costs a few
process starts instead of dozens::

    from pcpflow.testing import compose, run

    cfgs = [compose(["pcp=2", f"decode={d}"]) for d in ("replicated", "sharded")]
    for result in run(cfgs):
        assert result["verify"]["passed"]

Each result is rank 0's result sections (``verify``, ``outputs``, ``requests``,
``metrics``). A rank that raises makes ``run`` raise with that rank's traceback.
``cli(*args)`` answers ``python -m pcpflow ARGS`` in this process, for the commands the
driver refuses before any rank starts.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import socket
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any

from pcpflow.config.run import RunConfig, parse_run_config
from pcpflow.rank.bootstrap import rank_start_method


def compose(overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """The validated config of ``python -m pcpflow <overrides>`` (ConfigError if invalid)."""
    from pcpflow.driver.compose import compose_raw
    from pcpflow.driver.job import prepare_job

    return prepare_job(compose_raw(list(overrides)))


def cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m pcpflow ARGS`` in this process, with its exit code and what it printed,
    as ``subprocess.run`` would return them. For commands the driver refuses (exit 2): it
    checks everything before any rank starts, so the answer is the same without a new
    Python (seconds of imports) per case."""
    from pcpflow.driver.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["pcpflow", *args], code, out.getvalue(), err.getvalue())


def run(configs: list[RunConfig], *, timeout_s: float = 600, run_dirs: list[Path | None] | None = None) -> list[dict[str, Any]]:
    """Rank 0's result of each config, in order (ranks started once per world size).
    ``run_dirs``: where each run's rank 0 writes ``metrics.jsonl`` (None: nowhere)."""
    by_world: dict[int, list[int]] = defaultdict(list)
    for i, cfg in enumerate(configs):
        by_world[cfg.world_size].append(i)
    dirs = [None] * len(configs) if run_dirs is None else [None if d is None else str(d) for d in run_dirs]
    results: list[dict[str, Any] | None] = [None] * len(configs)
    for world_size, idx in by_world.items():
        batch = [(configs[i], dirs[i]) for i in idx]
        outs = _run_in_process(batch) if world_size == 1 else _run_spawned(batch, world_size, timeout_s)
        for i, out in zip(idx, outs):
            results[i] = out
    return results  # type: ignore[return-value]


def _run_in_process(configs: list[tuple[RunConfig, str | None]]) -> list[dict[str, Any]]:
    from pcpflow.rank.bootstrap import RankSession

    session = RankSession.solo()
    return [session.run(cfg, None if d is None else Path(d)) for cfg, d in configs]  # type: ignore[misc]


def _run_spawned(configs: list[tuple[RunConfig, str | None]], world_size: int, timeout_s: float) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="pcpflow-test-") as tmp:
        payload = [(cfg.model_dump(mode="json"), d) for cfg, d in configs]
        out_path = Path(tmp) / "results.pkl"
        saved = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(max(cfg.threads_per_rank for cfg, _ in configs))
        try:
            mp.start_processes(
                _worker,
                args=(world_size, _free_port(), payload, str(out_path), timeout_s),
                nprocs=world_size,
                join=True,
                start_method=rank_start_method(),
            )
        finally:
            if saved is None:
                os.environ.pop("OMP_NUM_THREADS", None)
            else:
                os.environ["OMP_NUM_THREADS"] = saved
        return pickle.loads(out_path.read_bytes())


def _worker(rank: int, world_size: int, port: int, payload: list, out_path: str, timeout_s: float) -> None:
    from pcpflow.rank.bootstrap import RankSession

    session = RankSession.connect(f"tcp://127.0.0.1:{port}", rank, world_size)
    cfgs = [(parse_run_config(raw), None if d is None else Path(d)) for raw, d in payload]
    session.init_group(cfgs[0][0], timeout_s=timeout_s)
    try:
        outs = [session.run(cfg, d) for cfg, d in cfgs]
        if rank == 0:
            Path(out_path).write_bytes(pickle.dumps(outs))
    finally:
        session.close()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
