"""pcpflow.signals: which signals end a job as interrupted, and how the exception travels."""

from __future__ import annotations

import gc
import pickle
import signal
import time
import weakref

import pytest

from pcpflow.signals import HANDLED, Interrupted, interruptible


@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129),
                                           (signal.SIGQUIT, 131)])  # torchrun forwards SIGQUIT as a stop request
def test_each_handled_signal_raises_interrupted_with_the_shells_exit_code(sig, code):
    assert sig in HANDLED
    with pytest.raises(Interrupted) as caught:
        with interruptible():
            signal.raise_signal(sig)
    assert caught.value.exit_code == code and str(caught.value) == f"interrupted by {signal.Signals(sig).name}"


def test_nohup_keeps_sighup_ignored():
    # `nohup python -m pcpflow ...`: the run is meant to outlive its terminal
    saved = signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with interruptible():
            assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
            signal.raise_signal(signal.SIGHUP)  # ignored: nothing raised
        assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGHUP, saved)


def test_interrupted_survives_pickling():
    # a joblib worker's job (hydra's joblib launcher) sends its exception back pickled
    back = pickle.loads(pickle.dumps(Interrupted(signal.SIGTERM)))
    assert isinstance(back, Interrupted) and back.signum == signal.SIGTERM and back.exit_code == 143


def _metrics_wrapper(f):
    # the shape of torch elastic's metrics wrapper (metrics/api.py): a signal that lands before
    # its first line leaves `start` unbound, and its `finally` replaces our Interrupted
    def wrapper():
        try:
            signal.raise_signal(signal.SIGTERM)
            start = 0.0
            f()
        finally:
            print(start)  # noqa: F821 - UnboundLocalError, as in torch
    return wrapper


def test_a_library_error_that_replaces_our_interrupted_is_still_the_signal():
    with pytest.raises(Interrupted) as caught:
        with interruptible():
            _metrics_wrapper(lambda: None)()
    assert caught.value.exit_code == 143 and isinstance(caught.value.__cause__, UnboundLocalError)


def test_an_error_without_a_signal_stays_what_it_is():
    with pytest.raises(ValueError):
        with interruptible():
            raise ValueError("a stage's own error")
    assert Interrupted.of(ValueError("outside any handler")) is None


class _Node:
    pass


def test_a_signal_that_lands_in_a_finalizer_still_interrupts(capsys):
    """Python swallows an exception raised in a weakref callback or ``__del__`` ("Exception
    ignored in ..."): a Ctrl-C landing there while the garbage collector runs must still end
    the job, once, and print no traceback."""
    ran_on = []

    def finalizer(_ref):
        signal.raise_signal(signal.SIGINT)  # the handler runs here, inside the callback
        ran_on.append("finalizer")

    with pytest.raises(Interrupted) as caught:
        with interruptible():
            node = _Node()
            ref = weakref.ref(node, finalizer)
            del node
            gc.collect()
            time.sleep(0.05)
            ran_on.append("after")  # never: the signal comes back as the finalizer returns
    assert ref() is None and ran_on == [] and caught.value.exit_code == 130
    assert "Exception ignored" not in capsys.readouterr().err


def test_a_signal_held_while_a_child_starts_reaches_the_handler_after():
    """``held``: the fork server starts with SIGINT / SIGHUP / SIGQUIT ignored (it inherits
    that); one sent to the driver meanwhile is not lost but raised once the handler is back."""
    from pcpflow.signals import held

    with pytest.raises(Interrupted) as caught:
        with interruptible():
            with held(signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
                assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
                signal.raise_signal(signal.SIGHUP)  # pending, not delivered inside
                reached = "inside"
            reached = "after"  # never: the held signal is raised on the way out
    assert reached == "inside" and caught.value.exit_code == 129
    assert not signal.pthread_sigmask(signal.SIG_BLOCK, []) & set(HANDLED)  # nothing left blocked


def test_a_process_started_with_the_signals_blocked_gets_them_once_it_handles_them():
    """A rank forked by the fork server inherits them blocked: its handler unblocks them, and
    what arrived before is raised there."""
    outer = signal.signal(signal.SIGTERM, lambda *_: None)  # NOTE: should it stay pending, not this test runner's death
    saved = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    try:
        signal.raise_signal(signal.SIGTERM)  # pending: blocked before any handler of ours
        with pytest.raises(Interrupted) as caught:
            with interruptible():
                time.sleep(0.05)
        assert caught.value.exit_code == 143
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, saved)
        signal.signal(signal.SIGTERM, outer)


def test_a_signal_that_a_library_turns_into_its_error_before_the_job_is_still_the_signal(tmp_path, monkeypatch, capsys):
    """A signal while the driver imports or validates can land in a library that replaces our
    Interrupted with its own error (numpy's half-done import: "cannot load module more than
    once", OmegaConf's or Hydra's cleanup): one line, exit 143, result.json, no traceback."""
    import json

    from pcpflow.driver import cli

    def validating(argv, run_dir):
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.05)
        finally:
            raise ImportError("cannot load module more than once per process")

    monkeypatch.setattr(cli, "_main", validating)
    monkeypatch.setitem(__import__("sys").modules, "numpy", None)  # numpy unloadable, as such a signal leaves it
    run_dir = tmp_path / "run"
    assert cli.main([f"hydra.run.dir={run_dir}"]) == 143
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["error"] == "interrupted by SIGTERM before the run started"
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted by SIGTERM before the run started" in err


def test_a_signal_a_frame_swallowed_still_ends_the_command_before_its_job_starts(tmp_path, monkeypatch, capsys):
    """Some frames drop the handler's Interrupted (seen while importlib compiled a module): the
    driver raises it again before it starts the job, rather than run on to "ok" with the
    handler spent (it raises once, so no later signal could stop the run)."""
    import json

    from pcpflow.driver import cli

    def precheck(overrides, multirun):
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.05)
        except BaseException:  # noqa: S110 - the frame that drops it
            pass

    monkeypatch.setattr(cli, "precheck", precheck)
    monkeypatch.setattr(cli, "run_hydra", lambda argv: pytest.fail("the job started"))
    run_dir = tmp_path / "run"
    assert cli.main([f"hydra.run.dir={run_dir}"]) == 143
    assert json.loads((run_dir / "result.json").read_text())["error"] == "interrupted by SIGTERM before the run started"
    assert "Traceback" not in capsys.readouterr().err
