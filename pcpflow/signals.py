"""Ctrl-C, SIGTERM, SIGHUP and SIGQUIT end a job as "interrupted": result.json says so, exit 130 / 143 / 129 / 131.

``Interrupted`` is a BaseException (as KeyboardInterrupt is) so that a stage's or a
launcher's ``except Exception`` cannot swallow it, and a Hydra multirun stops at it
instead of running the remaining jobs.

The driver installs the handler first thing (``pcpflow.driver.cli.main``), so that validation,
start-up, the steps, the plots and the gaps between a sweep's jobs all end the same way;
a rank installs it as it starts (``pcpflow.rank.bootstrap``).
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
"""NOTE: SIGHUP too: a closed terminal or ssh session sends it, and torchrun forwards it to its
workers; its default action kills a process before it can write result.json. SIGQUIT (Ctrl-\\)
as well: torchrun treats it as a stop request like SIGTERM and forwards it to every worker, whose
default action would dump core once per rank and leave no result.json (the survivors would then
report the quit rank as dead); a job runner asked to quit ends the job as interrupted (131)."""


class Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")

    def __reduce__(self) -> tuple[type, tuple[int]]:  # NOTE: a joblib worker's job sends it back pickled
        return (Interrupted, (self.signum,))

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 SIGINT, 143 SIGTERM, 129 SIGHUP, 131 SIGQUIT

    @classmethod
    def of(cls, exc: BaseException) -> Interrupted | None:
        """The Interrupted an exception stands for (KeyboardInterrupt, torch elastic's
        SignalException, or any error raised after this process's handler raised one), or None.

        NOTE: our Interrupted, raised into a library's frame, can be replaced on its way out by
        an error of that library's own cleanup: torch elastic's metrics wrapper, when the signal
        lands before its first line, fails in its ``finally`` on an unbound local. The signal is
        what happened; the error is its consequence."""
        if isinstance(exc, Interrupted):
            return exc
        if isinstance(exc, KeyboardInterrupt):
            return cls(signal.SIGINT)
        sigval = getattr(exc, "sigval", None)
        if sigval is not None and int(sigval) in (int(s) for s in HANDLED):
            return cls(int(sigval))
        fired = _fired()
        return cls(fired) if fired else None


def _fired() -> int | None:
    """The signal the handler in place raised Interrupted for (None: none, or it is leaving)."""
    return next((h.fired for h in handlers().values() if isinstance(h, _RaiseOnce) and h.fired), None)


def raise_if_swallowed() -> None:
    """Raise Interrupted again for a signal whose Interrupted did not come out (called where
    the driver goes on to start the job: had it come out, the driver would not be there).

    NOTE: the handler raises into whatever runs when the signal lands; some frames drop it
    (one landing while importlib compiles a module, seen on a loaded 2-core machine: the run
    went on and ended "ok", and, the handler raising once, no later signal could stop it)."""
    fired = _fired()
    if fired:
        raise Interrupted(fired)


class _RaiseOnce:
    """Raises Interrupted for the first signal; later ones are ignored.

    NOTE: a Ctrl-C reaches every process of the terminal's group, and the launcher forwards
    it to its ranks as well, so a second signal often arrives while the first unwinds:
    raising again would break the cleanup that writes result.json (and print a chained
    traceback)."""

    def __init__(self) -> None:
        self.fired: int | None = None  # the signal it raised for (0: none, the process is leaving)

    def __call__(self, signum: int, frame: object) -> None:
        if self.fired is None:
            self.fired = signum
            raise Interrupted(signum)


def _redeliver_swallowed(previous_hook):
    """A ``sys.unraisablehook`` that gives a signal back when Python swallowed its Interrupted.

    NOTE: the handler raises into whatever frame runs when the signal lands; in a finalizer (a
    weakref callback, a ``__del__``, run by the garbage collector) Python cannot propagate an
    exception and prints "Exception ignored in ..." instead: the job would run on and end "ok"
    after a Ctrl-C. Here a helper thread re-arms the handler and sends the signal again once this
    hook has returned (sent from this thread, Python would run the handler at once, inside the
    hook, where nothing catches it): the handler then runs in the code the collector interrupted,
    or in the next finalizer, which comes back here."""

    def hook(unraisable) -> None:
        exc = unraisable.exc_value
        handler = signal.getsignal(exc.signum) if isinstance(exc, Interrupted) else None
        if not (isinstance(handler, _RaiseOnce) and handler.fired == exc.signum):
            previous_hook(unraisable)
            return
        main = threading.main_thread().ident

        def resend() -> None:
            time.sleep(_RESEND_AFTER_S)
            if signal.getsignal(exc.signum) is handler:  # NOTE: not once the job has restored the old one
                handler.fired = None
                signal.pthread_kill(main, exc.signum)

        threading.Thread(target=resend, name="pcpflow-signal", daemon=True).start()

    return hook


_RESEND_AFTER_S = 0.01
"""Long beside the few bytecodes the hook runs after starting its helper thread."""


def leaving() -> None:
    """The handler in place ignores every signal from now on, as it ignores a second one: this
    process is reporting its failure on its way out, and a signal raised into that (a launcher
    stopping the survivors of a failure) would replace its report with "interrupted"."""
    for h in handlers().values():
        if isinstance(h, _RaiseOnce) and h.fired is None:
            h.fired = 0


def handlers() -> dict[int, object]:
    return {s: signal.getsignal(s) for s in HANDLED}


def restore(saved: dict[int, object]) -> None:
    for s, h in saved.items():
        signal.signal(s, h)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT / SIGTERM / SIGHUP / SIGQUIT raise Interrupted (once) in the main thread while inside; the
    previous handlers come back after, also where a library replaced ours meanwhile
    (torch's elastic agent installs its own and never restores them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    if any(isinstance(h, _RaiseOnce) for h in handlers().values()):
        # NOTE: nested (a rank's job inside its bootstrap, a run inside the driver): one handler,
        # so that a signal after the first (the launcher forwarding the terminal's Ctrl-C) is
        # ignored on the way out of every level, not raised again by the outer one.
        yield
        return
    saved, saved_hook = handlers(), sys.unraisablehook
    handler = _RaiseOnce()
    for s in HANDLED:
        # NOTE: `nohup` ignores SIGHUP so that the run outlives its terminal: that stays so
        if not (s == signal.SIGHUP and saved[s] == signal.SIG_IGN):
            signal.signal(s, handler)
    sys.unraisablehook = _redeliver_swallowed(saved_hook)
    try:
        # NOTE: a rank forked by the fork server starts with them blocked (``held``): what
        # arrived meanwhile is raised here, inside
        signal.pthread_sigmask(signal.SIG_UNBLOCK, HANDLED)
        yield
    except Exception as exc:
        interrupted = Interrupted.of(exc)  # NOTE: our Interrupted, replaced by a library's cleanup error
        if interrupted is None:
            raise
        raise interrupted from exc
    finally:
        sys.unraisablehook = saved_hook
        restore(saved)


@contextmanager
def ignored(*signals: int) -> Iterator[None]:
    """``signals`` ignored while inside (what a child process started meanwhile inherits)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.signal(s, signal.SIG_IGN) for s in signals}
    try:
        yield
    finally:
        restore(saved)


@contextmanager
def held(*signals: int) -> Iterator[None]:
    """``signals`` ignored while inside, as ``ignored``, and what arrives meanwhile held back:
    delivered on the way out, to the handler then in place (a Ctrl-C while the fork server
    starts is not lost). A child process started inside inherits them ignored and blocked:
    ``interruptible`` unblocks them where a rank installs its handler."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    # NOTE: Linux keeps a blocked signal pending even while it is ignored (kernel/signal.c,
    # sig_ignored: "blocked signals are never ignored"); restoring the handler before the mask
    # delivers it there.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        with ignored(*signals):
            yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
