"""pcpflow.rank.progress and the failure report of pcpflow.rank.bootstrap, on an in-process store
(no process group): how fast a dead peer is named, and that the launcher's SIGTERM cannot cut
the report short."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from pcpflow.rank.bootstrap import RankError, RankSession
from pcpflow.rank.progress import GRACE_S, RankBoard
from pcpflow.signals import interruptible


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _board_with_a_dead_peer() -> RankBoard:
    store = dist.HashStore()
    board = RankBoard(store, 0, 2, job=1)
    # rank 1 beat once at step 2, then its process vanished (SIGKILL, the OOM killer) posting nothing
    store.set(board._key("progress", 1), json.dumps({"step": 2, "stage": "forward", "beat": 1, "pid": _dead_pid(),
                                                      "host": socket.gethostname(), "started": "1"}))
    return board


def test_a_peer_whose_process_is_gone_is_named_without_waiting_out_the_grace():
    board = _board_with_a_dead_peer()
    t0 = time.monotonic()
    blame = board.diagnose(RuntimeError("Connection closed by peer"), collective_timeout_s=60)
    assert time.monotonic() - t0 < GRACE_S / 3
    assert blame.rank == 1 and blame.message.startswith("died without a Python error") and blame.step == 2


def test_a_dead_peer_is_the_cause_not_a_live_one_that_has_not_posted_yet():
    """A ring of three: rank 1 dies, rank 2 sees its connection close at once, rank 0 is still
    blocked waiting (alive, silent, no beat yet in so short a time). Rank 1 is the cause; rank 0
    is not "frozen" (and is not killed for it)."""
    from pcpflow.rank.progress import _process_start

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store = dist.HashStore()
        board = RankBoard(store, 2, 3, job=1)
        store.set(board._key("progress", 0), json.dumps({"step": 1, "stage": "forward", "beat": 4, "pid": peer.pid,
                                                          "host": socket.gethostname(), "started": _process_start(peer.pid)}))
        store.set(board._key("progress", 1), json.dumps({"step": 1, "stage": "forward", "beat": 4, "pid": _dead_pid(),
                                                          "host": socket.gethostname(), "started": "1"}))
        blame = board.diagnose(RuntimeError("Connection closed by peer"), collective_timeout_s=5)
        assert blame.rank == 1 and blame.message.startswith("died without a Python error"), blame
        assert peer.poll() is None
    finally:
        peer.kill()
        peer.wait()


def test_the_launchers_sigterm_during_the_failure_report_does_not_cut_it(tmp_path, monkeypatch, capsys):
    """torchrun SIGTERMs the survivors of a death within ~0.1 s: the rank that writes
    result.json must still write it, naming the dead rank, and say it on the console (the
    dead rank cannot)."""
    from pcpflow.testing import compose

    board = _board_with_a_dead_peer()
    diagnose = board.diagnose

    def diagnose_while_signalled(exc, **kw):
        signal.raise_signal(signal.SIGTERM)
        return diagnose(exc, **kw)

    monkeypatch.setattr(board, "diagnose", diagnose_while_signalled)
    session = RankSession(board.store, 0, 2)
    with interruptible():
        failure = session._failure(RuntimeError("Connection closed by peer"), compose(["pcp=2"]), tmp_path, board, True)
    assert isinstance(failure, RankError) and failure.blame.rank == 1 and failure.exit_code == 1
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["failed_rank"] == 1 and result["error"].startswith("rank 1 failed: died without a Python error")
    assert failure.reported == tmp_path / "result.json"
    assert capsys.readouterr().err.splitlines() == [f"pcpflow: {result['error']}"]


def test_only_the_rank_that_writes_result_json_prints_the_failure(tmp_path, capsys):
    """Every torchrun rank reports to the same terminal: the failure is said once, by the rank
    that claimed the report, whichever rank failed."""
    from pcpflow.testing import compose

    board = _board_with_a_dead_peer()
    assert RankBoard(board.store, 2, 3, job=1).claim_report()  # another survivor got there first
    failure = RankSession(board.store, 0, 3)._failure(RuntimeError("Connection closed by peer"), compose(["pcp=2"]),
                                                       tmp_path, board, True)
    assert failure.blame.rank == 1 and failure.reported is None
    assert capsys.readouterr().err == "" and not (tmp_path / "result.json").exists()


def test_a_survivor_stopped_by_the_agent_hands_its_diagnosis_of_a_dead_peer_to_the_driver():
    """pcpflow's launch SIGTERMs the survivors of a death, often before their collective fails:
    the survivor's diagnosis (the dead rank, its step) must reach the driver as an error, not
    vanish in a quiet exit (the driver would know only "died with signal SIGKILL")."""
    from pcpflow.rank.bootstrap import _own_interruption
    from pcpflow.rank.progress import Blame
    from pcpflow.signals import Interrupted

    def stopped(blamed: int) -> RankError:
        err = RankError(Blame(blamed, "died without a Python error; last seen", 2, "forward"), 1 if blamed else 143, rank=0)
        err.__cause__ = Interrupted(signal.SIGTERM)
        return err

    assert _own_interruption(stopped(1)) is None  # raised: @record writes it to the error file
    assert _own_interruption(stopped(0)).signum == signal.SIGTERM  # its own: the driver's line says it
    assert _own_interruption(Interrupted(signal.SIGINT)).signum == signal.SIGINT


def test_a_rank_reporting_its_failure_leaves_with_that_report_whatever_signal_follows(tmp_path):
    """The agent SIGTERMs the survivors of a death just as they report it: raised after the
    diagnosis (on the way out, before @record writes the error file), the signal would replace
    the report naming the dead rank with a quiet "interrupted"."""
    from pcpflow.testing import compose

    board = _board_with_a_dead_peer()
    with interruptible():
        failure = RankSession(board.store, 0, 2)._failure(RuntimeError("Connection closed by peer"), compose(["pcp=2"]),
                                                          None, board, False)
        signal.raise_signal(signal.SIGTERM)  # ignored: nothing raised
    assert failure.blame.rank == 1


@pytest.mark.parametrize(("message", "said"), [
    ("RuntimeError: NaN at step 3", "[rank 1] RuntimeError: NaN at step 3 (forward)"),
    ("RuntimeError: NaN at step 3 (forward)", "[rank 1] RuntimeError: NaN at step 3 (forward)"),
    ("RuntimeError: NaN at step 33", "[rank 1] RuntimeError: NaN at step 33 at step 3 (forward)"),
    ("RuntimeError: NaN", "[rank 1] RuntimeError: NaN at step 3 (forward)"),
])
def test_a_message_that_names_its_step_is_not_given_it_twice(message, said):
    from pcpflow.rank.progress import Blame

    assert str(Blame(1, message, 3, "forward")) == said


@pytest.mark.parametrize("nested", [False, True])
def test_one_handler_raises_once_however_deeply_nested(nested):
    """A rank's job runs inside its bootstrap's handler: the second signal (the launcher
    forwarding the terminal's Ctrl-C) must not raise again in the outer level."""
    from pcpflow.signals import Interrupted

    raised = 0
    with interruptible():
        try:
            if nested:
                with interruptible():
                    signal.raise_signal(signal.SIGINT)
            else:
                signal.raise_signal(signal.SIGINT)
        except Interrupted:
            raised += 1
        signal.raise_signal(signal.SIGINT)  # ignored
    assert raised == 1


@pytest.mark.parametrize(("sig", "peer_gone", "blamed"), [(signal.SIGTERM, True, 1), (signal.SIGTERM, False, 0),
                                                          (signal.SIGINT, True, 0)])
def test_a_sigterm_that_follows_a_peers_death_blames_the_peer(sig, peer_gone, blamed):
    """torchrun SIGTERMs the survivors of a death, often before their collective noticed it:
    that SIGTERM is the peer's failure. A SIGTERM with every peer alive, or a Ctrl-C, is this rank's."""
    from pcpflow.signals import Interrupted

    board = _board_with_a_dead_peer()
    if not peer_gone:
        board.store.set(board._key("progress", 1), json.dumps({"step": 2, "stage": "forward", "beat": 1, "pid": os.getpid(),
                                                                "host": socket.gethostname(), "started": _start_of_self()}))
    blame = board.diagnose(Interrupted(sig), collective_timeout_s=60)
    assert blame.rank == blamed
    if blamed == 1:
        assert blame.message.startswith("died without a Python error") and blame.step == 2


def _start_of_self() -> str | None:
    from pcpflow.rank.progress import _process_start

    return _process_start(os.getpid())


def test_a_rank_stopped_before_a_barrier_is_named_long_before_its_timeout():
    """The start-up barrier waits startup_timeout_s for a slow load; a process that is stopped
    (and so beats no heartbeat) is named after stall_s, and the diagnosis kills it."""
    from pcpflow.rank.progress import StalledRanks, _process_start

    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        store = dist.HashStore()
        board = RankBoard(store, 0, 2, job=1)
        store.set(board._key("progress", 1), json.dumps({"step": -1, "stage": "startup", "beat": 3, "pid": peer.pid,
                                                          "host": socket.gethostname(), "started": _process_start(peer.pid)}))
        with pytest.raises(StalledRanks) as slow:  # alive and running: only the timeout ends the wait
            board.barrier("startup", 1.0, what="start-up within startup_timeout_s=1", stall_s=0.2)
        assert not slow.value.stopped
        peer.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(StalledRanks) as stopped:
            board.barrier("startup", 600, what="start-up within startup_timeout_s=600", stall_s=0.5)
        assert stopped.value.stopped and stopped.value.ranks == [1] and time.monotonic() - t0 < 5
        blame = board.diagnose(stopped.value, collective_timeout_s=0.5)
        assert blame.rank == 1 and blame.message.startswith("stalled: its process is stopped") and blame.step == -1
        assert peer.wait(timeout=10) == -signal.SIGKILL
    finally:
        if peer.poll() is None:
            peer.kill()
