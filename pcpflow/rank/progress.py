"""Where each rank is (step, stage), kept in the job's c10d store, and who to blame when a
job breaks.

gloo times out on the ranks that *wait* and says nothing about the peer they waited for;
a peer that exits makes the others fail with "Connection closed by peer". Neither names
the root cause. So every rank keeps its progress on a board in the rendezvous store (a
heartbeat thread pushes it twice a second; the step loop only writes two module
variables), and posts how it ended. A rank whose own error is only a consequence reads
the board: a peer that posted an error of its own is the root cause; a peer that posted
nothing is stalled (its heartbeat still beats, or its process is there but frozen: stopped
by SIGSTOP, a debugger, a hung driver) or dead (its process is gone).

``mark_step`` / ``mark_stage`` are the engine's and the pipeline's hooks; they cost two
assignments and do nothing in a process without a board (the in-process single rank).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

_STEP: int = -1
_STAGE: str = "startup"
_BOARD: RankBoard | None = None

HEARTBEAT_S = 0.5
GRACE_S = 3.0  # how long a rank whose error is a consequence waits for the cause to post

CONSEQUENCE = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|[Gg]loo.*(timed out|[Tt]imeout|closed|reset)|"
    r"NCCL (error|communicator was aborted)|Socket Timeout|terminated with signal|Signal \d+|"
    r"got signal: |Timed out waiting|timed out after|connection refused|interrupted by SIG|"
    r"caused pair closure"  # gloo, a point-to-point wait after its pair timed out (rings)
)
"""Errors that a rank sees *because* another rank failed, stalled or left."""


def mark_step(step: int) -> None:
    global _STEP, _STAGE
    _STEP, _STAGE = step, "schedule"
    if _BOARD is not None:  # one store write per step: a rank that dies mid-step is placed
        _BOARD.push()


def mark_stage(stage: str) -> None:
    global _STAGE
    _STAGE = stage


def where() -> tuple[int, str]:
    return _STEP, _STAGE


TRANSFER_STAGE = "transfer of request {}"
"""The stage a rank marks while it moves a handed-over request's KV (``disagg=pd``)."""


def mark_transfer(req_id: int) -> None:
    """The stage of a handover's transfer, pushed at once (one store write per request moved):
    a rank that dies inside it, before its next heartbeat, is still placed there."""
    mark_stage(TRANSFER_STAGE.format(req_id))
    if _BOARD is not None:
        _BOARD.push()


def in_flight(message: str) -> dict[str, Any]:
    """``{"transfer_in_flight": req_id}`` when a failure's diagnosis places it inside a
    handover's transfer (``[rank R] ... at step S (transfer of request N)``), else {}."""
    m = re.search(r"\(" + TRANSFER_STAGE.format(r"(\d+)") + r"\)", message)
    return {"transfer_in_flight": int(m.group(1))} if m else {}


def startup_done(timeout_s: float, stall_s: float | None = None) -> None:
    """The engine's hook between start-up (model load, reference build) and the first step:
    every rank waits here up to ``startup_timeout_s``, so a slow load is not a stalled
    collective and a rank that never finishes loading is named. A rank whose process is
    stopped (SIGSTOP, a debugger) with no heartbeat for ``stall_s`` (``collective_timeout_s``)
    is named then: a slow load beats, a stopped process never will."""
    if _BOARD is not None:
        _BOARD.barrier("startup", timeout_s, what=f"start-up within startup_timeout_s={timeout_s:g}", stall_s=stall_s)


@dataclass(frozen=True)
class Blame:
    """The root cause of a failed job: which rank, what happened, where it was."""

    rank: int
    message: str
    step: int = -1
    stage: str = ""

    def __str__(self) -> str:
        at = "during start-up" if self.step < 0 else f"at step {self.step} ({self.stage})"
        if self.step >= 0 and re.search(rf"\bat step {self.step}\b", self.message):
            # NOTE: a message that names its step already (a stage's own error): only the stage is
            # added, if it is not there too, rather than "at step 3 at step 3"
            at = "" if f"({self.stage})" in self.message else f"({self.stage})"
        return f"[rank {self.rank}] {self.message} {at}".rstrip()


class StalledRanks(RuntimeError):
    """Ranks that did not reach a point every rank must reach in time (``stopped``: before the
    time was up, their processes being stopped)."""

    def __init__(self, ranks: list[int], what: str, names: str, *, stopped: bool = False) -> None:
        self.ranks, self.what, self.stopped = ranks, what, stopped
        super().__init__(f"{names} did not finish {what}" + (" (its process is stopped)" if stopped else ""))


class RankBoard:
    """One job's board in the store: ``progress/<rank>`` (step, stage, beat) and
    ``status/<rank>`` (how the rank ended: error, exited, consequence, interrupted, done)."""

    def __init__(self, store: Any, rank: int, world_size: int, job: int = 0) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix = f"pcpflow/{job}/"
        self._beat = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the heartbeat thread and the step loop share the client

    # ------------------------------------------------------------------ this rank
    def start(self) -> RankBoard:
        global _BOARD, _STEP, _STAGE
        _BOARD, _STEP, _STAGE = self, -1, "startup"
        self.push()
        self._thread = threading.Thread(target=self._heartbeat, name="pcpflow-heartbeat", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        global _BOARD
        self._stop.set()
        if _BOARD is self:
            _BOARD = None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.push()
            except Exception:  # the store's host is gone: the job is ending anyway
                return

    def push(self) -> None:
        with self._lock:
            self._beat += 1
            self.store.set(self._key("progress", self.rank), json.dumps(
                {"step": _STEP, "stage": _STAGE, "beat": self._beat, "pid": os.getpid(), "host": _HOST,
                 "started": _process_start(os.getpid())}))

    def post(self, kind: str, message: str = "") -> None:
        with self._lock:
            seq = self.store.add(self.prefix + "seq", 1)
            step, stage = where()
            value = {"kind": kind, "message": message, "step": step, "stage": stage, "seq": seq}
            self.store.set(self._key("status", self.rank), json.dumps(value))

    def claim_report(self) -> bool:
        """True for exactly one rank of the job: the one that writes result.json."""
        key = self.prefix + "reporter"
        got = self.store.compare_set(key, "", str(self.rank))
        return (got.decode() if isinstance(got, bytes) else str(got)) == str(self.rank)

    def barrier(self, name: str, timeout_s: float, *, what: str, stall_s: float | None = None) -> None:
        """Wait until every rank reached ``name``; StalledRanks naming the others if not.
        ``stall_s``: a missing rank whose process is stopped and has not beaten for that long
        is named at once (``stopped``)."""
        self.store.set(self._key(name, self.rank), "1")
        keys = [self._key(name, r) for r in range(self.world_size)]
        deadline = time.monotonic() + timeout_s
        beats: dict[int, tuple[Any, float]] = {}  # rank -> (its last beat, when it changed)
        looked = 0.0
        while True:
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            if not missing:
                return
            now = time.monotonic()
            if now > deadline:
                names = ", ".join(self._describe(r) for r in missing)
                raise StalledRanks(missing, what, names)
            if stall_s is not None and now - looked >= HEARTBEAT_S:
                looked = now
                stopped = [r for r in missing if self._stopped_for(r, beats, now) > stall_s]
                if stopped:
                    raise StalledRanks(stopped, what, ", ".join(self._describe(r) for r in stopped), stopped=True)
            time.sleep(0.05)

    def _stopped_for(self, rank: int, beats: dict[int, tuple[Any, float]], now: float) -> float:
        """How long ``rank`` has not beaten while its process (on this host) is stopped; 0 otherwise."""
        p = self.read("progress", rank) or {}
        beat = p.get("beat")
        if rank not in beats or beats[rank][0] != beat:
            beats[rank] = (beat, now)
        stat = _process_stat(p["pid"]) if p.get("host") == _HOST and p.get("pid") else None
        return now - beats[rank][1] if stat and stat[0] in ("T", "t") else 0.0

    def leave(self, timeout_s: float) -> None:
        """After the last barrier: rank 0 returns only once every other rank is done with
        the store. NOTE: where rank 0 hosts the store (``pcpflow.testing``), a rank still
        polling a barrier that rank 0 has already passed would lose it when rank 0 exits;
        the others only set their key, so nobody waits on a store that may vanish."""
        self.store.set(self._key("left", self.rank), "1")
        if self.rank != 0:
            return
        keys = [self._key("left", r) for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while keys and time.monotonic() < deadline:
            keys = [k for k in keys if not self.store.check([k])]
            if keys:
                time.sleep(0.01)

    # ------------------------------------------------------------------ the others
    def read(self, kind: str, rank: int) -> dict[str, Any] | None:
        key = self._key(kind, rank)
        try:
            with self._lock:
                if not self.store.check([key]):
                    return None
                return json.loads(self.store.get(key))
        except Exception:
            return None

    def _describe(self, rank: int) -> str:
        p = self.read("progress", rank)
        if p is None:
            return f"rank {rank} (never reported)"
        at = "in start-up" if p["step"] < 0 else f"at step {p['step']} ({p['stage']})"
        return f"rank {rank} ({at})"

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}{kind}/{rank}"

    # ------------------------------------------------------------------ diagnosis
    def diagnose(self, exc: BaseException, *, collective_timeout_s: float) -> Blame:
        """Post how this rank ended and return the job's root cause.

        ``kind``: "error" (this rank's own failure), "exited" (it left early),
        "interrupted" (a signal), or "consequence" (a peer failed, stalled or left)."""
        kind, message = classify(exc), describe(exc)
        step, stage = where()
        mine = Blame(self.rank, message, step, stage)
        try:
            self.post("consequence" if kind == "stalled" else kind, message)
        except Exception:
            return mine
        others = [r for r in range(self.world_size) if r != self.rank]
        if kind == "interrupted" and getattr(exc, "signum", None) == signal.SIGTERM:
            # NOTE: a launcher stops the survivors of a failure with SIGTERM (torchrun ~0.1 s after a
            # death), often before their collective has failed: a peer that failed or is gone is
            # the cause then, not this rank.
            return self._failed_peer(others) or mine
        if kind in ("error", "exited", "interrupted"):
            return mine
        beats = {r: (self.read("progress", r) or {}).get("beat") for r in others}
        deadline = time.monotonic() + GRACE_S
        while True:
            statuses = {r: self.read("status", r) for r in others}
            causes = [(s["seq"], r, s) for r, s in statuses.items() if s and s["kind"] in ("error", "exited")]
            if causes:
                _, r, s = min(causes)
                return Blame(r, s["message"], s["step"], s["stage"])
            # NOTE: a silent peer whose process is gone will never post: no need to wait out the
            # grace (under torchrun the agent's SIGTERM follows a death within ~0.1 s)
            if time.monotonic() > deadline or any(_process_gone(self.read("progress", r) or {})
                                                  for r, s in statuses.items() if s is None):
                break
            time.sleep(0.1)
        if isinstance(exc, StalledRanks):
            p = self.read("progress", exc.ranks[0]) or {}
            if exc.stopped:  # named (and killed, as a frozen peer is) before the time was up
                what = _silent_peer(p, f"its peers waited collective_timeout_s={collective_timeout_s:g} for its heartbeat")
                return Blame(exc.ranks[0], what, p.get("step", -1), p.get("stage", ""))
            return Blame(exc.ranks[0], f"did not finish {exc.what}", p.get("step", -1), p.get("stage", ""))
        silent = {r: self.read("progress", r) or {} for r, s in statuses.items() if s is None}
        # NOTE: a peer whose process is gone first: it ended the grace at once, before a live
        # peer still blocked in the same collective could post (or beat): judged first, that one
        # would look frozen, and be killed for it.
        for r in sorted(silent, key=lambda r: not _process_gone(silent[r])):
            p = silent[r]
            waited = f"its peers waited collective_timeout_s={collective_timeout_s:g}"
            if p.get("beat") != beats.get(r) and not _process_gone(p):
                what = f"stalled: it stopped taking part in collectives; {waited}"
            else:
                what = _silent_peer(p, waited)
            return Blame(r, what, p.get("step", -1), p.get("stage", ""))
        done = [r for r, s in statuses.items() if s and s["kind"] == "done"]
        if done:
            s = statuses[done[0]]
            return Blame(done[0], "left the job early (its engine returned while peers still ran)", s["step"], s["stage"])
        return mine


    def _failed_peer(self, others: list[int]) -> Blame | None:
        """The earliest peer that posted an error or an early exit, or else one whose process
        is gone without posting; None if every peer is alive or was interrupted too."""
        statuses = {r: self.read("status", r) for r in others}
        causes = [(s["seq"], r, s) for r, s in statuses.items() if s and s["kind"] in ("error", "exited")]
        if causes:
            _, r, s = min(causes)
            return Blame(r, s["message"], s["step"], s["stage"])
        for r in (r for r, s in statuses.items() if s is None):
            p = self.read("progress", r) or {}
            if _process_gone(p):
                return Blame(r, _silent_peer(p, ""), p.get("step", -1), p.get("stage", ""))
        return None


_HOST = socket.gethostname()


def _process_stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name (state first), or None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _process_start(pid: int) -> str | None:
    """When ``pid`` started (clock ticks since boot): tells a process from a later one that
    reuses its pid."""
    stat = _process_stat(pid)
    return stat[19] if stat and len(stat) > 19 else None


def _process_gone(progress: dict[str, Any]) -> bool:
    """The process of a board entry (``progress/<rank>``) is known to be gone: on this host, and
    exited, a zombie, or its pid now another process's."""
    pid = progress.get("pid")
    if progress.get("host") != _HOST or pid is None:
        return False
    stat = _process_stat(pid)
    return stat is None or _process_start(pid) != progress.get("started") or stat[0] in ("Z", "X")


def _silent_peer(progress: dict[str, Any], waited: str) -> str:
    """What became of a peer whose heartbeat stopped, from its process where it can be seen
    (the same host): frozen (stopped, or alive with a dead heartbeat) is a stall, gone is a death."""
    pid = progress.get("pid")
    if progress.get("host") != _HOST or pid is None:
        return (f"stopped responding: no heartbeat and no error (on another host: killed, crashed or frozen); "
                f"{waited}; last seen")
    if _process_gone(progress):
        return "died without a Python error (killed by a signal, os._exit or a crash; see its log); last seen"
    state = (_process_stat(pid) or ["?"])[0]
    # NOTE: a frozen process cannot act on the launcher's SIGTERM, which would hold the job
    # ~30 s more (torch's own grace) before its SIGKILL: the job is failing, end it now.
    with contextlib.suppress(OSError):
        os.kill(pid, signal.SIGKILL)
    if state in ("T", "t"):
        return f"stalled: its process is stopped (SIGSTOP or a debugger); {waited}; last seen"
    return f"stalled: its process is alive but frozen (no heartbeat); {waited}; last seen"


def classify(exc: BaseException) -> str:
    """The board kind of an exception that ended a rank."""
    from pcpflow.signals import Interrupted

    if isinstance(exc, Interrupted):
        return "interrupted"
    if isinstance(exc, SystemExit):
        return "exited"
    if isinstance(exc, StalledRanks):
        return "stalled"
    return "consequence" if CONSEQUENCE.search(f"{type(exc).__name__}: {exc}") else "error"


def describe(exc: BaseException) -> str:
    from pcpflow.signals import Interrupted

    if isinstance(exc, SystemExit):
        return f"exited early (sys.exit({exc.code!r}))"
    if isinstance(exc, Interrupted):
        return str(exc)
    if isinstance(exc, StalledRanks):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


def store_timeout(store: Any, seconds: float) -> None:
    try:
        store.set_timeout(timedelta(seconds=seconds))
    except Exception:
        pass
