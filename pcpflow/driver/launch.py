"""Starting the ranks of one job (the driver side; what a rank runs is ``pcpflow.rank.bootstrap``).

The driver has written the frozen, resolved config to ``<run dir>/config.json``; this starts
``tp * pcp`` rank processes with torch's elastic launch API (c10d rendezvous on
``localhost:0`` so that concurrent or successive jobs never share a port, ``spawn``,
``OMP_NUM_THREADS=threads_per_rank``, per-rank logs under ``<run dir>/logs``). A rank that
raises ends the job: the elastic agent stops the others, and the driver reports the root
cause that the ranks agreed on (``pcpflow.rank.progress``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from pcpflow.config.run import RunConfig
from pcpflow.errors import Problem
from pcpflow.rank.progress import CONSEQUENCE as _CONSEQUENCE
from pcpflow.signals import Interrupted

if TYPE_CHECKING:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

SHUTDOWN_GRACE_S = 3
# NOTE: torch's elastic launcher hands every rank the result queue of every rank (a pipe: two
# descriptors each), and a fork server receives a new process's descriptors in one message,
# with 4 of multiprocessing's own: Linux passes at most 253 at once (SCM_MAX_FD)
MAX_FORKED_RANKS = (253 - 4) // 2


def launch_problems(cfg: RunConfig) -> list[Problem]:
    """More ranks than pcpflow's own launch can start on one host (its fork server's limit: 124).
    None under torchrun, which has started them."""
    if cfg.world_size <= MAX_FORKED_RANKS or "RANK" in os.environ:
        return []
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return []
    field, given = ("pcp", cfg.pcp) if cfg.pcp > 1 or cfg.tp == 1 else ("tp", cfg.tp)
    ranks = f"tp*pcp = {cfg.world_size} ranks"
    if cfg.disagg.enabled:
        ranks = f"{cfg.world_size} ranks ({cfg.grid.world_size} prefill + {cfg.world_size - cfg.grid.world_size} decode)"
    return [Problem(field, given, f"{ranks}: pcpflow's own launch starts at most {MAX_FORKED_RANKS} on one host (its "
                    "fork server passes each rank two descriptors of every rank, and Linux at most 253 at once); "
                    f"a world of <= {MAX_FORKED_RANKS} ranks, or start them with torchrun")]


def launch_ranks(cfg: RunConfig, run_dir: Path, *, work: Callable[[Any, Path | None], Any] | None = None) -> dict[str, Any]:
    """Run the job's ranks; returns rank 0's result sections. Raises RankFailure. ``work``:
    a module-level function the ranks run instead of the engine (``mode=profile``)."""
    # NOTE: torch is imported here, where ranks start: the driver validates a command, answers
    # --help and prices a simulated run without it (tests/test_structure.py)
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, SignalException, Std
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    from pcpflow.rank.bootstrap import RankError, RankSession, elastic_rank, rank_start_method

    if cfg.world_size == 1:
        # One rank needs no process group: run it in this process (same bootstrap code).
        try:
            result = RankSession.solo().run(cfg, run_dir, work=work)
        except RankError as exc:
            if isinstance(exc.__cause__, Interrupted):
                raise exc.__cause__ from None
            raise RankFailure(0, str(exc.blame).split("] ", 1)[1], _traceback_of(exc.__cause__)) from None
        assert result is not None
        return result
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=cfg.world_size,
        run_id=f"pcpflow-{uuid.uuid4().hex[:12]}",
        role="rank",  # the console prefix of a rank's lines: "[rank1]:"
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        rdzv_configs={"timeout": 60},
        max_restarts=0,
        monitor_interval=0.1,
        # NOTE: none: the agent would replace our SIGINT / SIGTERM handlers with its own, whose
        # exception (an Exception) parts of its teardown swallow. Ours stay: they raise
        # Interrupted, and the agent's own cleanup stops the ranks on the way out.
        signals_to_handle="",
        # NOTE: once the job has failed, a rank gets this long to leave after SIGTERM; one
        # blocked in a collective or stopped (SIGSTOP) would otherwise hold the job 30 s.
        shutdown_timeout=SHUTDOWN_GRACE_S,
        start_method=rank_start_method(log=log_dir / "forkserver.log"),
        # Every rank's stdout (a stage's print) and rank 0's stderr reach the console too,
        # prefixed by the rank ("[rank1]:"); everything is in the rank's log.
        logs_specs=DefaultLogsSpecs(log_dir=str(log_dir), redirects=Std.ALL,
                                    tee={r: Std.ALL if r == 0 else Std.OUT for r in range(cfg.world_size)}),
    )
    # NOTE: the elastic agent does not set OMP_NUM_THREADS; oversubscribed ranks on a few
    # cores slow each other down by orders of magnitude. (The launcher sets its signal list
    # in the environment and leaves it there.)
    env = {"OMP_NUM_THREADS": str(cfg.threads_per_rank), "TORCHELASTIC_SIGNALS_TO_HANDLE": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with _spawnable_main(), _agent_log(log_dir / "launcher.log"):
            results = elastic_launch(config, elastic_rank)(str(run_dir), work)
    except ChildFailedError as exc:
        raise RankFailure.root_cause(exc, log_dir.glob(f"{config.run_id}*/attempt_*/*/error.json"), log_dir) from None
    except SignalException as exc:
        raise Interrupted(int(exc.sigval)) from None
    except Exception as exc:  # NOTE: our Interrupted, replaced by an error of the agent's own cleanup
        interrupted = Interrupted.of(exc)
        if interrupted is None:
            raise
        raise interrupted from exc
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return results[0]


class RankFailure(RuntimeError):
    """A rank raised (or died); carries that rank's error message."""

    def __init__(self, rank: int, message: str, details: str = "") -> None:
        self.rank, self.message, self.details = rank, message, details
        super().__init__(f"rank {rank} failed: {message}")

    @classmethod
    def root_cause(cls, exc: ChildFailedError, error_files, log_dir: Path | None = None) -> RankFailure:
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
                how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
                log = next(iter(sorted(log_dir.glob(f"*/attempt_*/{rank}/stderr.log"))), None) if log_dir else None
                message = f"died with {how} before it could report an error (see {log or 'its log'})"
                found.append((failure.timestamp * 10**9, rank, message, ""))
        found.sort()
        causes = [f for f in found if not _CONSEQUENCE.search(f[2])] or found
        _, rank, message, details = causes[0]
        if rank not in with_files:
            # NOTE: a peer that diagnosed this rank (a frozen process it then killed, a death it
            # saw on the board) says more than the bare signal; which of the two the agent
            # noticed first is a race (its failure times have one-second resolution).
            named = [m for _, _, m, _ in found if (b := _BLAMED.match(m)) and int(b.group(1)) == rank]
            if named:
                message, details = named[0], ""
        blamed = _BLAMED.match(message)
        if blamed:  # the ranks' own diagnosis (pcpflow.rank.progress): it may name another rank
            if int(blamed.group(1)) != rank:
                details = ""  # the reporting rank's traceback shows only where it waited
            rank, message = int(blamed.group(1)), blamed.group(2)
        return cls(rank, message, details)


_BLAMED = re.compile(r"(?:[\w.]+: )?\[rank (\d+)\] (.*)", re.S)


def _error_message(data: Any) -> tuple[str, str]:
    """(message, python traceback) of an elastic error file's contents."""
    msg = data.get("message") if isinstance(data, dict) else None
    if isinstance(msg, dict):
        return str(msg.get("message", "")), str(msg.get("extraInfo", {}).get("py_callstack", ""))
    return (str(msg) if msg and msg != "<NONE>" else ""), ""


@contextlib.contextmanager
def _spawnable_main():
    """Spawned ranks must be able to re-create this process's multiprocessing start method.

    NOTE: inside a Hydra joblib-launcher worker (loky), the process-wide start method is
    'loky'; a spawned rank's bootstrap calls set_start_method('loky') before any user code
    runs, fails ("cannot find context for 'loky'") and exits 1 with an empty log. Spawn is
    what the ranks use anyway, so that is what they are told while they start."""
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)
    if method in (None, "spawn", "fork", "forkserver"):
        yield
        return
    multiprocessing.set_start_method("spawn", force=True)
    try:
        yield
    finally:
        multiprocessing.set_start_method(method, force=True)


@contextlib.contextmanager
def _agent_log(path: Path):
    """The elastic agent's own messages (workers closed, signals forwarded) go to the run's
    ``logs/launcher.log``, not the console: pcpflow's one line says what happened."""
    import logging

    names = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
    loggers = [logging.getLogger(n) for n in names]
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    # NOTE: with no signals to handle (LaunchConfig.signals_to_handle="", on purpose) the agent
    # still tries the one empty name and logs a warning with a traceback: noise, not a fault.
    handler.addFilter(lambda record: not (record.getMessage().startswith("Failed to register signal handler")
                                          and record.args == ("",)))
    saved = [logger.propagate for logger in loggers]
    for logger in loggers:
        logger.addHandler(handler)
        logger.propagate = False
    try:
        yield
    finally:
        for logger, propagate in zip(loggers, saved):
            logger.propagate = propagate
            logger.removeHandler(handler)
        handler.close()


def _traceback_of(exc: BaseException | None) -> str:
    import traceback

    return "" if exc is None else "".join(traceback.format_exception(exc))


def print_err(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
