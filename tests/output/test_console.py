"""pcpflow.output.console: a console stream that stops taking output (a closed pipe, a full
device) is quiet from then on; stdout's failure is ConsoleGone once, stderr's is lost."""

from __future__ import annotations

import errno
import os

import pytest

from pcpflow.output.console import ConsoleGone, _Guarded


class _Full:
    """A stream over a real file whose writes fail as /dev/full's do."""

    def __init__(self, fd: int) -> None:
        self.fd, self.tries = fd, 0

    def write(self, text: str) -> int:
        if os.fstat(self.fd).st_rdev == os.stat(os.devnull).st_rdev:
            return len(text)  # NOTE: /dev/null now: it takes everything
        self.tries += 1
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass

    def fileno(self) -> int:
        return self.fd

    encoding = "utf-8"


@pytest.mark.parametrize("raises", [True, False])
def test_a_failed_console_write_goes_quiet(raises, tmp_path):
    fd = os.open(tmp_path / "console", os.O_WRONLY | os.O_CREAT)
    try:
        stream = _Full(fd)
        guarded = _Guarded(stream, raises=raises)
        if raises:  # stdout: what a command prints is its product
            with pytest.raises(ConsoleGone) as gone:
                guarded.write("table")
            assert gone.value.errno == errno.ENOSPC and isinstance(gone.value, BrokenPipeError)
        else:  # stderr: a message it cannot take is lost
            assert guarded.write("warning") == len("warning")
        assert guarded.write("more") == 4 and stream.tries == 1  # the fd is /dev/null now
        assert os.fstat(fd).st_rdev == os.stat(os.devnull).st_rdev
        assert guarded.encoding == "utf-8"  # the rest is the stream's
    finally:
        os.close(fd)


def test_a_command_started_without_a_stdout_runs_as_with_one():
    # ``python -m pcpflow --help >&-``: Python's sys.stdout is None, which print() skips
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-m", "pcpflow", "--help"], preexec_fn=lambda: os.close(1),
                          stderr=subprocess.PIPE, text=True, timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
