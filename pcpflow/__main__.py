"""``python -m pcpflow``.

NOTE: the signal handler goes in before the driver's own imports (pydantic, Hydra: a tenth of
a second, more on a loaded machine), so that a Ctrl-C there too is one line and the shell's
exit code, not a KeyboardInterrupt traceback (``pcpflow.driver.cli.main`` takes over from here).
"""

import os
import sys

from pcpflow.signals import Interrupted, interruptible

if __name__ == "__main__":
    with interruptible():
        try:
            from pcpflow.driver.cli import entry
        except Interrupted as exc:
            ranked = f" (rank {os.environ['RANK']})" if "RANK" in os.environ and "WORLD_SIZE" in os.environ else ""
            print(f"pcpflow: {exc} before the run started{ranked}", file=sys.stderr, flush=True)
            sys.exit(exc.exit_code)
    entry()
