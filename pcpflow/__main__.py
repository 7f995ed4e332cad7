"""``python -m pcpflow`` and the ``pcpflow`` console script.

NOTE: the signal handler goes in before the driver's own imports (pydantic, Hydra: a tenth of
a second, more on a loaded machine; a torchrun job's ranks start all at once), so that a Ctrl-C
there too is one line and the shell's exit code, not a KeyboardInterrupt traceback
(``pcpflow.driver.cli.main`` takes over from here).
"""

import sys

from pcpflow.signals import Interrupted, interruptible


def main() -> None:
    """``python -m pcpflow`` and the ``pcpflow`` console script."""
    with interruptible():
        try:
            from pcpflow.driver.cli import entry
        except BaseException as exc:  # NOTE: or a library's error that replaced it (Interrupted.of)
            if (interrupted := Interrupted.of(exc)) is None:
                raise
            from pcpflow.driver.interrupted import interrupted_early

            sys.exit(interrupted_early(interrupted, sys.argv[1:]))
    entry()


if __name__ == "__main__":
    main()
