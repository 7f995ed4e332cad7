"""Replicas behind a router (``serving.replicas``, ``serving.router``), in simulated time.

Each replica is a copy of the tp x pcp instance: its own scheduler, KV cache and clock,
all sharing the per-request columns (a request lives on one replica). Requests arrive at
the router (``pcpflow.scheduling.arrivals``: their times, at most ``max_concurrency`` in
flight over all replicas), which sends each to a replica the moment it arrives:

- ``round_robin``: in turn;
- ``least_loaded``: the replica with the fewest queued plus running tokens (tokens its
  waiting requests will prefill, plus the tokens its running requests hold);
- ``prefix_aware``: the replica whose prefix cache holds the longest prefix of the
  request's blocks; ties go to the least loaded.

Events run in time order: an arrival is routed at its time (a replica idle until then
starts from that time), else the replica whose clock is earliest runs its next step. A
replica's state is as of its last step boundary: a request arriving while a step runs
sees the state that step will leave.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from pcpflow.scheduling import prefix
from pcpflow.scheduling.arrivals import Arrivals
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler

ROUTERS = ("round_robin", "least_loaded", "prefix_aware")


class Router:
    def __init__(self, kind: str, schedulers: list[Scheduler]) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"router {kind!r}: one of {', '.join(ROUTERS)}")
        self.kind, self.schedulers = kind, schedulers
        self.replica_of = np.full(len(schedulers[0].table), -1, dtype=np.int64)
        self._turn = 0

    def route(self, i: int) -> int:
        """The replica request i goes to (and sends it there)."""
        n = len(self.schedulers)
        if self.kind == "round_robin" or n == 1:
            r = self._turn % n
            self._turn += 1
        else:
            load = np.array([self.load(s) for s in self.schedulers])
            if self.kind == "least_loaded":
                r = int(np.argmin(load))  # NOTE: ties to the lowest replica index
            else:
                hits = np.array([self.cached_tokens(s, i) for s in self.schedulers])
                best = np.flatnonzero(hits == hits.max())
                r = int(best[np.argmin(load[best])])
        self.replica_of[i] = r
        self.schedulers[r].add([i])
        return r

    @staticmethod
    def load(s: Scheduler) -> int:
        """Queued plus running tokens: what its waiting requests will prefill, and what its
        running requests hold in the KV cache."""
        waiting = np.fromiter(s._waiting, dtype=np.int64, count=len(s._waiting))
        return int(s._prefill_end[waiting].sum() + s._num_computed[s._running].sum())

    @staticmethod
    def cached_tokens(s: Scheduler, i: int) -> int:
        """Tokens of request i's prompt this replica's prefix cache holds."""
        if not s.kv.prefix_caching:
            return 0
        longest = (int(s._prefill_end[i]) - 1) // s.kv.tokens_per_block
        return s.kv.find_hit(prefix.keys(s.chain_values(i, longest)), longest).shape[1] * s.kv.tokens_per_block


def run_replicas(loops: list[StepLoop], arrivals: Arrivals, router: Router,
                 step: Callable[[int, object], list[int] | None], *, max_steps: int | None = None) -> None:
    """Drive the replicas' loops in time order until every request finished (or
    ``max_steps`` steps ran in all). ``step(replica, batch)`` runs one scheduled batch of
    that replica and returns the requests it finished."""
    executed = 0
    while max_steps is None or executed < max_steps:
        busy = [r for r, lp in enumerate(loops) if lp.scheduler.has_work]
        t_busy = min((loops[r].clock for r in busy), default=np.inf)
        t_next = arrivals.next_time()
        if t_next is not None and t_next <= t_busy:
            for i in arrivals.due(t_next).tolist():
                r = router.route(i)
                loops[r].clock = max(loops[r].clock, float(t_next))
            continue
        if not busy:
            return
        r = min(busy, key=lambda b: (loops[b].clock, b))
        batch = loops[r].schedule_step()
        if batch is None:  # NOTE: a replica with work always runs (every request fits alone)
            raise RuntimeError(f"replica {r} has requests but scheduled none")
        finished = step(r, batch)
        executed += 1
        if finished:
            arrivals.finished(len(finished), loops[r].clock)
