"""Ctrl-C and SIGTERM end a job as "interrupted": result.json says so, exit 130 / 143.

``Interrupted`` is a BaseException (as KeyboardInterrupt is) so that a stage's or a
launcher's ``except Exception`` cannot swallow it, and a Hydra multirun stops at it
instead of running the remaining jobs.
"""

from __future__ import annotations

import signal
import threading
from contextlib import contextmanager
from typing import Iterator

HANDLED = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    def __init__(self, signum: int) -> None:
        self.signum = int(signum)
        super().__init__(f"interrupted by {signal.Signals(self.signum).name}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum  # the shell's convention: 130 SIGINT, 143 SIGTERM

    @classmethod
    def of(cls, exc: BaseException) -> Interrupted | None:
        """The Interrupted an exception stands for (KeyboardInterrupt, torch elastic's
        SignalException), or None."""
        if isinstance(exc, Interrupted):
            return exc
        if isinstance(exc, KeyboardInterrupt):
            return cls(signal.SIGINT)
        sigval = getattr(exc, "sigval", None)
        if sigval is not None and int(sigval) in (int(s) for s in HANDLED):
            return cls(int(sigval))
        return None


def _raise(signum: int, frame) -> None:
    raise Interrupted(signum)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGINT / SIGTERM raise Interrupted in the main thread while inside; the previous
    handlers come back after (torch's elastic agent installs its own and never restores)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {s: signal.getsignal(s) for s in HANDLED}
    for s in HANDLED:
        signal.signal(s, _raise)
    try:
        yield
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
