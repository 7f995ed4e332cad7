"""A command interrupted before its run started (imports, validation, Hydra starting, a torchrun
rank importing torch): one line, the shell's exit code, and ``result.json`` in the run dir the
command names, an older result there kept aside.

Light on purpose (no pydantic, Hydra or torch): ``python -m pcpflow`` (``pcpflow/__main__.py``)
calls it before the driver itself is imported.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pcpflow.signals import Interrupted


def interrupted_before_the_job(exc: Interrupted, run_dir: Path | None, *, rank: int | None = None) -> int:
    """No job owns the run dir yet; ``rank``: this process is that rank of a torchrun job."""
    from pcpflow.output.rundir import failed_result, live_lock_owner, write_refusal

    where = ""
    launcher = {} if rank is None else {"launcher": "external (torchrun)"}
    if run_dir is not None and live_lock_owner(run_dir) is None:
        try:  # NOTE: a run that never started loses nothing: an older result there is kept aside
            write_refusal(run_dir, failed_result(f"{exc} before the run started", {}, exc.exit_code, run_dir=str(run_dir),
                                                 **launcher))
            where = f"; result.json: {run_dir / 'result.json'}"
        except OSError:
            pass
    ranked = "" if rank is None else f" (rank {rank})"
    print(f"pcpflow: {exc} before the run started{ranked}{where}", file=sys.stderr, flush=True)
    return exc.exit_code


def named_run_dir(argv: list[str]) -> Path | None:
    """The run dir a single run's command line names outright (``hydra.run.dir=DIR``, nothing
    left for Hydra to resolve), or None. NOTE: composing the default (``${now:...}``) is Hydra's
    work, and a torchrun job's rank 0's: not known this early."""
    if "-m" in argv or "--multirun" in argv:
        return None
    given = [a.split("=", 1)[1] for a in argv if a.startswith("hydra.run.dir=")]
    return Path(given[-1]) if given and given[-1] and "${" not in given[-1] else None


def torchrun_rank() -> int | None:
    """This process's rank when torchrun / srun started it (RANK and WORLD_SIZE set), else None."""
    import os

    return int(os.environ["RANK"]) if "RANK" in os.environ and "WORLD_SIZE" in os.environ else None


def interrupted_early(exc: Interrupted, argv: list[str]) -> int:
    """Interrupted while the driver (or a torchrun rank) imports itself: the run dir only where
    the command names it, and under torchrun only rank 0 writes there."""
    rank = torchrun_rank()
    return interrupted_before_the_job(exc, named_run_dir(argv) if rank in (None, 0) else None, rank=rank)
