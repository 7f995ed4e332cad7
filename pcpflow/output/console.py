"""The console a command prints to, when it stops taking output: its reader has left
(``python -m pcpflow ... | head``: a broken pipe) or its file cannot grow (``> /dev/full``).
What is left to print there goes nowhere, quietly, and the command goes on: a message on
stderr that cannot be shown is lost, not a new failure; a failed write to stdout, where a
command's product goes (``--help``, a summary), is ``ConsoleGone``, and a run's result.json and
exit code still say how the run ended (``pcpflow.driver.job.run_job``). Without torch, numpy
or rich: ``--help`` uses it."""

from __future__ import annotations

import contextlib
import os
import sys


class ConsoleGone(BrokenPipeError):
    """A write to stdout failed (``errno``: EPIPE, ENOSPC, ...). A BrokenPipeError, so that
    rich's handling of one (``pcpflow.output.report``) applies too."""


class _Guarded:
    """A console stream that, once a write fails, writes to /dev/null instead (Python's own
    flush at exit included); stdout's failure raises ``ConsoleGone`` once. Everything else is
    the stream's."""

    def __init__(self, stream, *, raises: bool) -> None:
        self._stream, self._raises = stream, raises

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except OSError as exc:
            self._failed(exc)
        return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except OSError as exc:
            self._failed(exc)

    def _failed(self, exc: OSError) -> None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        if self._raises:
            raise ConsoleGone(exc.errno, exc.strerror) from exc

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def guard_console() -> None:
    """This process's ``sys.stdout`` and ``sys.stderr``, guarded (the ``python -m pcpflow``
    process: an OS error while printing is the console's, never the run dir's)."""
    # NOTE: None where the process started with the descriptor closed (``>&-``): print() skips it
    if sys.stdout is not None and not isinstance(sys.stdout, _Guarded):
        sys.stdout = _Guarded(sys.stdout, raises=True)
    if sys.stderr is not None and not isinstance(sys.stderr, _Guarded):
        sys.stderr = _Guarded(sys.stderr, raises=False)
