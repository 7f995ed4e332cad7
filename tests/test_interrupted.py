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
