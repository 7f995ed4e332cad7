"""A search as the driver runs it: the search, its report, and an interruption that keeps
what was priced."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pcpflow.search.report import write_report
from pcpflow.search.run import Search
from pcpflow.signals import Interrupted


def run_search(raw: dict[str, Any], run_dir: Path, prepare, *, overrides: list[str] | None = None,
               console: bool = True) -> dict[str, Any]:
    """The search's result sections; search.csv, pruned.csv, search.md and search.png in
    ``run_dir``. Interrupted: search.csv and pruned.csv are written with what was priced,
    then the interruption goes on (the driver's one line names them)."""
    search = Search(raw, prepare, run_dir, overrides=overrides, console=console)
    try:
        search.run()
    except Interrupted as exc:
        search.wall_s["total"] = time.perf_counter() - search.started
        write_report(search, run_dir, partial=True)
        exc.note = f"{len(search.rows)} priced layout(s) kept in {run_dir / 'search.csv'}"  # type: ignore[attr-defined]
        raise
    return write_report(search, run_dir)
