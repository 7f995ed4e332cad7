"""Stop a simulated run as soon as its SLO attainment can no longer reach a target.

A goodput search asks each run one question: do at least ``target`` of the requests meet
their SLOs? A run that cannot answer yes any more need not go on. A request has missed for
certain, before the run ends, when

- its first token came later than ``slo.ttft_s`` after its arrival, or it has arrived, has no
  first token yet, and the clock is already past ``arrival + slo.ttft_s`` (its first token
  comes at the end of a step that has not run yet; a request with a ``cached_lens`` prefix
  is left to its first token: its clock starts when the prefix is in the cache);
- it finished with a TPOT above ``slo.tpot_s``, or (without stop tokens, when its output
  length is fixed) its decode since the first token already took longer than
  ``slo.tpot_s x (output_len - 1)``.

Once more than ``(1 - target)`` of the run's requests missed for certain, the attainment of
the whole run is below ``target`` whatever the rest does; the run stops and reports that
bound (``goodput.share`` = the share not yet missed, ``goodput.gave_up`` what it saw). Only a
run that would finish every request may stop so (no ``max_steps``): its attainment is over
all of them. The answer to the question is the full run's, exactly; what is lost is the
partial run's other metrics, which a rate probe does not read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

CHECK_EVERY = 64
"""Steps between checks: each check is a few array operations over every request."""


class GaveUp(Exception):
    """Raised from a step once the run cannot reach the target (caught by the run)."""


@dataclass
class SloWatch:
    target: float  # the attainment the run must reach (slo.attainment)
    ttft_s: float | None
    tpot_s: float | None
    output_lens: np.ndarray | None  # per request, when a request's output length is fixed (no stop tokens)
    from_entry: np.ndarray  # per request: its clock starts when it enters (no cached_lens prefix)
    steps: int = 0
    missed: int = 0
    requests: int = 0
    clock_s: float = 0.0
    stopped: bool = False  # hopeless() said so: the run stopped there

    @classmethod
    def of(cls, cfg, requests, *, fixed_outputs: bool, target: float | None) -> SloWatch | None:
        """A watch for ``cfg``'s SLOs, or None when there is nothing to watch: no target, no
        SLO, or a run cut at ``max_steps`` (its attainment counts only what finished)."""
        if target is None or cfg.max_steps is not None or (cfg.slo.ttft_s is None and cfg.slo.tpot_s is None):
            return None
        return cls(target, cfg.slo.ttft_s, cfg.slo.tpot_s, requests.output_lens if fixed_outputs else None,
                   requests.cached_lens == 0)

    def hopeless(self, columns: Callable[[], dict[str, np.ndarray]], now: float) -> bool:
        """Every ``CHECK_EVERY`` calls (one per step), whether the run can no longer reach
        the target; ``columns()`` gives the request columns (``request_columns``), ``now``
        the earliest any step still to run can end."""
        self.steps += 1
        if self.steps % CHECK_EVERY:
            return False
        cols = columns()
        n = len(cols["req_id"])
        if n == 0:
            return False
        missed = np.zeros(n, dtype=bool)
        arrived = ~np.isnan(cols["arrival_s"])
        first = cols["first_token_s"]
        if self.ttft_s is not None:
            missed |= cols["ttft_s"] > self.ttft_s  # NaN (no first token yet) compares False
            waiting = arrived & np.isnan(first) & self.from_entry[cols["req_id"]]
            missed |= waiting & (now - cols["arrival_s"] > self.ttft_s)
        if self.tpot_s is not None:
            missed |= cols["tpot_s"] > self.tpot_s
            if self.output_lens is not None:
                out = self.output_lens[cols["req_id"]]
                decoding = ~np.isnan(first) & np.isnan(cols["finish_s"]) & (out > 1)
                with np.errstate(invalid="ignore", divide="ignore"):
                    missed |= decoding & ((now - first) / (out - 1) > self.tpot_s)
        self.missed, self.requests, self.clock_s = int(missed.sum()), n, float(now)
        self.stopped = n - self.missed < self.target * n
        return self.stopped

    def report(self, metrics: dict) -> None:
        """A stopped run's ``goodput``: ``share``, the most the attainment could have been,
        and ``gave_up``, what the watch saw when it stopped."""
        if not self.stopped:
            return
        share = (self.requests - self.missed) / self.requests
        metrics["goodput"].update(share=share, gave_up={"clock_s": self.clock_s, "missed": self.missed,
                                                        "requests": self.requests, "share_at_most": share,
                                                        "target": self.target})
