"""One set of rank processes per world size for the whole test session.

Starting a world of ranks costs time (each run forks them from a preloaded server); the configs
then run in them back to back (``pcpflow.testing.run``). Test files register their
matrices here, by name, and mark the tests that read them; the session runs every
matrix that a selected test needs, all world sizes together, once::

    @shared_ranks.matrix("engine/pcp=2")
    def _engine_2():
        return [compose([...]), ...]

    @pytest.mark.matrix("engine/pcp=2")
    def test_it(shared_runs):
        for cfg, result in shared_runs["engine/pcp=2"]:
            ...

A matrix's configs are composed only if a selected test needs it (``-m "not slow"`` skips
the slow ones' matrices), and a matrix that raises fails only the tests that read it. A
matrix may give a run dir with a config (``(cfg, path)``): rank 0 writes its
``metrics.jsonl`` there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pcpflow.config.run import RunConfig

MATRICES: dict[str, Callable[[], list[RunConfig]]] = {}


def matrix(name: str) -> Callable[[Callable[[], list[RunConfig]]], Callable[[], list[RunConfig]]]:
    """Register the function that composes the configs of matrix ``name``."""

    def register(fn: Callable[[], list[RunConfig]]) -> Callable[[], list[RunConfig]]:
        if name in MATRICES and MATRICES[name] is not fn:
            raise ValueError(f"matrix {name!r} is registered twice")
        MATRICES[name] = fn
        return fn

    return register


class SharedRuns:
    """Results of the selected matrices, run together on first access."""

    def __init__(self, names: set[str]) -> None:
        unknown = names - set(MATRICES)
        if unknown:
            raise KeyError(f"tests mark matrices nobody registered: {sorted(unknown)}")
        self.names = sorted(names)
        self._results: dict[str, list[tuple[RunConfig, dict[str, Any]]]] | None = None
        self._error: BaseException | None = None

    def __getitem__(self, name: str) -> list[tuple[RunConfig, dict[str, Any]]]:
        if name not in self.names:
            raise KeyError(f"matrix {name!r}: mark the test with @pytest.mark.matrix({name!r})")
        if self._results is None and self._error is None:
            self._run()
        if self._error is not None:
            raise RuntimeError(f"the shared rank run failed: {self._error}") from self._error
        assert self._results is not None
        return self._results[name]

    def _run(self) -> None:
        from pcpflow.testing import run

        cfgs = {name: [c if isinstance(c, tuple) else (c, None) for c in MATRICES[name]()] for name in self.names}
        flat = [c for name in self.names for c in cfgs[name]]
        try:
            results = iter(run([cfg for cfg, _ in flat], run_dirs=[d for _, d in flat]))
        except BaseException as exc:  # NOTE: kept, so that every dependent test reports it
            self._error = exc
            return
        self._results = {name: [(cfg, next(results)) for cfg, _ in cfgs[name]] for name in self.names}
