"""The one rank bootstrap: every way pcpflow's ranks start ends up here.

- pcpflow's own launch (the elastic agent spawns ``elastic_rank``),
- torchrun / srun (``torchrun_rank``: rank 0 composes the config, the others read it),
- ``pcpflow.testing`` (many configs in one set of ranks),
- one rank in the driver's own process (``RankSession.solo()``: no process group at
  all, gpt-fast's ``maybe_init_dist`` returning None: the same code path).

A session is: rendezvous (a c10d store) -> process group (gloo on CPU, NCCL on CUDA, timeout
``collective_timeout_s``) -> per job: plugins, a progress board in the store, the engine
(whose groups ``cfg.grid.build`` makes, each with the same timeout), a closing barrier ->
destroy the group. Any way a rank ends early (an error, ``sys.exit``, a signal, a stalled
or vanished peer) becomes one ``RankError`` that names the root cause (``pcpflow.rank.progress``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing.errors import record

from pcpflow import signals
from pcpflow.errors import EXIT_FAILED, EXIT_INVALID_CONFIG
from pcpflow.output.rundir import (
    failed_result,
    load_frozen_config,
    progress_of,
    result_of,
    write_result,
)
from pcpflow.rank.progress import Blame, RankBoard, in_flight, store_timeout
from pcpflow.signals import Interrupted, interruptible

STARTUP_STORE_TIMEOUT_S = 900  # rank 0 composing and checking the config, before any cfg exists


RANK_PRELOAD = ("torch", "torch.distributed", "pcpflow.rank.engine", "pcpflow.attention.fused", "pcpflow.rank.cudagraph")
"""What the fork server imports once (with the built-in stages), for every rank it forks."""


def rank_start_method(*, log: Path | None = None) -> str:
    """How ranks on this host start: ``forkserver`` where the platform has it. One server
    process imports torch and pcpflow once (``RANK_PRELOAD``) and forks every rank of this
    process's jobs from it: a fraction of a second per rank instead of a fresh
    interpreter's import of torch (seconds each, and the ranks share the cores). The server
    runs no torch op, so its forks inherit no thread pool; each rank sets its own thread
    count (``threads_per_rank``). ``spawn`` elsewhere.

    ``log`` (pcpflow's own launch, whose ranks write to their logs): a server started here
    writes to that file instead of the console. What it could print is a rank that fails
    before the launcher has redirected its output: when the job is torn down as it starts
    (a Ctrl-C then), or a rank that cannot even unpickle its entry point."""
    import multiprocessing

    from pcpflow.pipeline.assemble import BUILTIN_STAGES

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    from multiprocessing import forkserver

    # NOTE: read when the server starts (here, once); a later call changes nothing. The server
    # starts with SIGINT ignored: a Ctrl-C while it imports torch would print a traceback
    # (it ignores SIGINT itself only once its imports are done). Its ranks install their own
    # handlers first thing (elastic_rank, RankSession.run). SIGHUP too, for the server and the
    # resource tracker started with it (which ignores SIGINT and SIGTERM itself, not SIGHUP): a
    # closed terminal would kill the tracker, and the driver's relaunch of it floods the console
    # with tracebacks. The driver handles SIGHUP and stops the ranks. SIGQUIT (Ctrl-\ reaches the
    # whole group) would dump the server's and the tracker's core: the driver handles it as well.
    # Held, not only ignored: one sent to the driver meanwhile reaches its handler after.
    multiprocessing.set_forkserver_preload([*RANK_PRELOAD, *BUILTIN_STAGES])
    with signals.held(signal.SIGINT, signal.SIGHUP, signal.SIGQUIT), _stdio_to(log):
        forkserver.ensure_running()
    return "forkserver"


@contextlib.contextmanager
def _stdio_to(path: Path | None):
    """File descriptors 1 and 2 (what a child process inherits) append to ``path`` inside."""
    if path is None:
        yield
        return
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.dup2(target, 1)
        os.dup2(target, 2)
        yield
    finally:
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, target):
            os.close(fd)


class RankError(RuntimeError):
    """A rank's job ended early; ``blame`` is the job's root cause (maybe another rank)."""

    def __init__(self, blame: Blame, exit_code: int, *, rank: int | None = None, reported: Path | None = None) -> None:
        self.blame, self.exit_code = blame, exit_code
        self.rank = blame.rank if rank is None else rank  # the rank that raised it
        self.reported = reported  # the result.json this rank wrote (torchrun: one rank does)
        super().__init__(str(blame))


class RankSession:
    """This process's part of a torch.distributed job (or a solo rank without one)."""

    def __init__(self, store: Any, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.jobs = 0

    @classmethod
    def solo(cls) -> RankSession:
        return cls(None, 0, 1)

    @classmethod
    def connect(cls, init_method: str = "env://", rank: int = -1, world_size: int = -1) -> RankSession:
        import torch.distributed as dist

        store, rank, world_size = next(
            dist.rendezvous(init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=STARTUP_STORE_TIMEOUT_S))
        )
        store_timeout(store, STARTUP_STORE_TIMEOUT_S)
        return cls(store, rank, world_size)

    # ------------------------------------------------------------------ process group
    def init_group(self, cfg: Any, timeout_s: float | None = None) -> None:
        import torch
        import torch.distributed as dist

        from pcpflow.rank.devices import pick_backend, pick_device

        if self.store is None or dist.is_initialized():
            return
        device = pick_device(cfg.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=pick_backend(cfg.backend, device),
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=timedelta(seconds=timeout_s or cfg.collective_timeout_s),
        )

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ one job
    def exchange(self, prepare: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """Rank 0 runs ``prepare`` (compose + validate); every rank gets its answer."""
        self.jobs += 1
        key = f"pcpflow/job/{self.jobs}"
        if self.rank == 0:
            job = prepare()
            if "error" in job:  # NOTE: before the others learn it and exit: torchrun then stops us
                print(job["error"], file=sys.stderr, flush=True)
            self.store.set(key, json.dumps(job))
            return job
        # NOTE: polled, not one blocking store.wait: a signal's handler runs only between Python
        # bytecodes, and a Ctrl-C while rank 0 composes would wait out the whole timeout here
        # (torchrun then kills this rank after its own 30 s).
        deadline = time.monotonic() + STARTUP_STORE_TIMEOUT_S
        while not self.store.check([key]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank 0 did not compose the job's config within {STARTUP_STORE_TIMEOUT_S} s")
            time.sleep(0.05)
        return json.loads(self.store.get(key))

    def run(self, cfg: Any, run_dir: Path | None, *, writes_result: bool = False,
            work: Callable[[Any, Path | None], dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
        """Run one job's engine on this rank; rank 0's result sections (others None).
        Raises RankError naming the root cause; with ``writes_result`` exactly one rank
        writes the failed result.json (torchrun: no driver is there to do it). ``work``: what
        the ranks run instead of the engine (``run_rank``'s signature; ``mode=profile``)."""
        if cfg.disagg.enabled:  # a prefill pool and a decode pool
            from pcpflow.rank.pools import run_pools as run_rank
        else:
            from pcpflow.rank.engine import run_rank

        self.init_group(cfg)
        self.jobs += 1
        board = RankBoard(self.store, self.rank, self.world_size, self.jobs).start() if self.store else None
        try:
            with interruptible():
                try:
                    sections = (work or run_rank)(cfg, run_dir)  # run_rank loads the plugins (resolve_pipeline)
                    if board is not None:
                        board.post("done")
                        board.barrier("end", cfg.collective_timeout_s, what=f"the run within collective_timeout_s={cfg.collective_timeout_s:g} of its peers")
                        board.leave(cfg.collective_timeout_s)
                    return sections
                except BaseException as exc:
                    raise self._failure(exc, cfg, run_dir, board, writes_result) from (Interrupted.of(exc) or exc)
        finally:
            if board is not None:
                board.stop()

    def _failure(self, exc: BaseException, cfg: Any, run_dir: Path | None, board: RankBoard | None, writes_result: bool) -> RankError:
        from pcpflow.rank.progress import describe, where

        if board is not None:  # a rank of a failing job: it leaves with this report, whatever signal follows
            signals.leaving()
        exc = Interrupted.of(exc) or exc
        # NOTE: the launcher SIGTERMs the survivors of a failure at once (torchrun within ~0.1 s of
        # a death); raised in the middle of the diagnosis, it would leave no result.json and
        # name no cause. The diagnosis is bounded (progress.GRACE_S), and this rank is ending.
        with signals.ignored(*signals.HANDLED):
            if board is None:
                step, stage = where()
                blame = Blame(self.rank, describe(exc), step, stage)
            else:
                blame = board.diagnose(exc, collective_timeout_s=cfg.collective_timeout_s)
            # a SIGTERM that stopped this rank because a peer failed is that peer's failure
            interrupted = isinstance(exc, Interrupted) and blame.rank == self.rank
            code = exc.exit_code if interrupted else EXIT_FAILED
            reported = None
            if writes_result and run_dir is not None and (board is None or _claims_report(board)):
                error = f"{exc} (rank {self.rank})" if interrupted else f"rank {blame.rank} failed: {str(blame).split('] ', 1)[1]}"
                write_result(run_dir, failed_result(error, cfg.model_dump(mode="json"), code, failed_rank=blame.rank,
                                                    run_dir=str(run_dir), launcher="external (torchrun)", **in_flight(error),
                                                    **progress_of(run_dir)))
                reported = run_dir / "result.json"
                if not interrupted:
                    # NOTE: said by the rank that wrote result.json, so once, whichever rank failed:
                    # a rank that died (SIGKILL, the OOM killer) cannot say it itself. (An
                    # interrupted rank says so in torchrun_rank, each rank for itself.)
                    print(f"pcpflow: {error}", file=sys.stderr, flush=True)
        return RankError(blame, code, rank=self.rank, reported=reported)


def _claims_report(board: RankBoard) -> bool:
    """This rank writes the failure's result.json. NOTE: where rank 0 hosts the store (srun
    with env://) and died, no rank can claim it: each survivor then reports what it knows."""
    try:
        return board.claim_report()
    except Exception:
        return True


# ------------------------------------------------------------------------------ entries
@record
def elastic_rank(run_dir: str, work: Callable[[Any, Path | None], dict[str, Any] | None] | None = None) -> dict[str, Any] | None:
    """Entry point of a rank that pcpflow's launch started (module level: the start method
    pickles it by name, and ``work``, a module-level function too). The driver writes
    result.json from the ranks' error files."""
    # NOTE: the launch tees every rank's stdout to the console; a line reaches it when
    # printed, not when a block buffer of the log file fills.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(AttributeError, ValueError):
            stream.reconfigure(line_buffering=True)
    # NOTE: what the handlers go back to as the rank leaves: ignored. Its error file (the
    # diagnosis of a dead peer, with its step) is written by @record after this function has
    # raised, and the agent SIGTERMs the survivors of a death just then: by default that signal
    # would kill the rank first, and the driver would know only "died with signal SIGKILL".
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(s, signal.SIG_IGN)
    with interruptible():
        try:
            path = Path(run_dir)
            cfg = load_frozen_config(path)
            session = RankSession.connect()
            try:
                return session.run(cfg, path, work=work)
            finally:
                session.close()
        except BaseException as exc:
            stopped = _own_interruption(exc)
            if stopped is None:
                raise
            # NOTE: the driver got the same signal and reports it in one line; a traceback from
            # each rank would bury that line on the console.
            raise SystemExit(stopped.exit_code) from None


def _own_interruption(exc: BaseException) -> Interrupted | None:
    """The signal that stopped this rank, where the rank's diagnosis blames no peer for it.

    NOTE: the elastic agent SIGTERMs the survivors of a death at once, often before their
    collective has failed; a survivor's diagnosis then names the dead rank and its step
    (``RankBoard.diagnose``). That RankError must reach the driver through its error file
    (``@record``): left as a quiet exit, the driver knows only "died with signal SIGKILL"."""
    if isinstance(exc, RankError) and exc.blame.rank != exc.rank:
        return None
    return Interrupted.of(exc) or (exc.__cause__ if isinstance(exc.__cause__, Interrupted) else None)


def torchrun_rank(prepare: Callable[[], dict[str, Any]]) -> int:
    """This process is one rank of a torchrun / srun job. ``prepare`` (rank 0 only) returns
    ``{"config", "run_dir"}`` or ``{"error", "exit_code"}``. Returns this rank's exit code:
    pcpflow's codes (torchrun's own exit code is 1 for any failed worker)."""
    rank, job = int(os.environ.get("RANK", "0")), {}
    # NOTE: from the first moment: a Ctrl-C (or torchrun's forwarded SIGTERM / SIGHUP) while rank
    # 0 composes the config or a rank imports the engine ends as one during the steps does.
    with interruptible():
        try:
            return _torchrun_rank(prepare, job)
        except Interrupted as exc:
            if rank == 0 and "run_dir" in job:  # config.json is there: its result must be too
                with contextlib.suppress(OSError):
                    write_result(Path(job["run_dir"]), failed_result(
                        f"{exc} (rank 0)", job["config"], exc.exit_code, failed_rank=0, run_dir=job["run_dir"],
                        launcher="external (torchrun)"))
            print(f"pcpflow: {exc} (rank {rank})", file=sys.stderr, flush=True)
            return exc.exit_code


def _torchrun_rank(prepare: Callable[[], dict[str, Any]], job: dict[str, Any]) -> int:
    """``job`` receives the job rank 0 prepared, as soon as this rank knows it."""
    from pcpflow.config.run import parse_run_config

    session = RankSession.connect()
    try:
        job.update(session.exchange(prepare))
        if "error" in job:
            return int(job.get("exit_code", EXIT_INVALID_CONFIG))
        cfg, run_dir = parse_run_config(job["config"]), Path(job["run_dir"])
        try:
            sections = session.run(cfg, run_dir, writes_result=True)
        except RankError as exc:  # the failure's line came from the rank that wrote result.json
            if isinstance(exc.__cause__, Interrupted) and exc.blame.rank == session.rank:
                print(f"pcpflow: {exc.__cause__} (rank {session.rank})", file=sys.stderr, flush=True)
            return exc.exit_code
    finally:
        session.close()
    if session.rank != 0:
        return 0
    from pcpflow.output.report import print_summary

    result = result_of(sections or {}, job["config"], run_dir=str(run_dir), launcher="external (torchrun)")
    write_result(run_dir, result)
    print_summary(result)
    return result["exit_code"]


def is_external_rank() -> bool:
    """Started by torchrun / srun-with-torch-env: this process is a rank, not a driver."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
