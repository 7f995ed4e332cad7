"""Goodput as DistServe defines it: the highest request rate at which at least
``slo.attainment`` of the requests meet every SLO.

``max_rate`` searches it from a run with every request arriving at once (the burst: its
served rate bounds what the layout can sustain), bracketing by a constant factor, then
bisecting geometrically until the rate that keeps the attainment and the one that does not
are within ``tolerance``. Attainment is assumed to fall as the rate rises (queues only
grow); the search reports every rate it tried, so a non-monotone case is visible.

It never tries a rate above the burst's served rate (``highest``): past it the layout
cannot serve the requests as fast as they arrive, whatever share of them a compressed
trace lets meet its SLOs (attainment is not monotone there: a burst of a trace can miss
where 16x its rate keeps it). A layout that keeps the attainment at that rate has it as
its goodput (bound ``served``).

By the same assumption, once a first guess misses, the floor (the lowest rate the search
tries) settles in one run whether the layout keeps the attainment at any rate it would try
(``floor_first``): a descent finds a layout that meets its SLOs at no rate only after several
runs at ever lower rates, the costliest ones (fewer requests share each step). Without a
guess to start from (a screen), such layouts are common under tight SLOs; with a close guess
(pricing in full after a screen) the descent's close bracket is cheaper and is kept.

NOTE: the limit of a falling rate is not every request alone: a trace replayed slower keeps
the requests that arrive together, together.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RateSearch:
    rate: float  # requests/s: the highest rate found that keeps the attainment (0: none)
    bound: str  # "burst": even all at once keeps it | "bisected" | "served": kept at the burst's served rate,
    # the most it tries | "below": not at the lowest tried
    tried: list[tuple[float, float]] = field(default_factory=list)  # (rate, attainment) in the order run

    @property
    def runs(self) -> int:
        return len(self.tried)


def max_rate(attain: Callable[[float], float], *, burst_attainment: float, burst_rate: float, target: float,
             tolerance: float, start: float | None = None, step: float = 2.0, lowest: float = 1 / 64,
             highest: float = 1.0, floor_first: bool = False) -> RateSearch:
    """``attain(rate)``: the share of requests meeting the SLOs at ``rate``. The burst's
    attainment and served rate (requests per second of its span) are given (one run the
    caller made). ``start``: a first guess (a screen's answer); ``step``: the first
    bracketing factor (squared after each step that does not bracket); the search gives up
    below ``lowest x burst_rate`` (rate 0, bound "below": it tried that rate) and tries
    nothing above ``highest x burst_rate`` (kept there: that rate, bound "served"). ``floor_first``: once the first guess
    misses, the floor is tried next, then the rate bisected between the two."""
    found = RateSearch(0.0, "below", [(math.inf, burst_attainment)])
    if burst_attainment >= target:
        found.rate, found.bound = burst_rate, "burst"
        return found

    def ok(rate: float) -> bool:
        a = attain(rate)
        found.tried.append((rate, a))
        return a >= target

    cap = burst_rate * highest
    r = min(start, cap) if start is not None and 0 < start < math.inf else cap
    lo, hi = (r, None) if ok(r) else (None, r)
    if lo is None and floor_first:
        assert hi is not None
        floor = burst_rate * lowest
        if hi <= floor or not ok(floor):
            return found
        lo = floor
    while lo is None:  # NOTE: the step squares each time it fails to bracket: a far guess costs few runs
        assert hi is not None
        r = max(hi / step, burst_rate * lowest) if hi > burst_rate * lowest else 0.0
        if r <= 0.0:
            return found
        lo, hi = (r, hi) if ok(r) else (None, r)
        step *= step
    while hi is None:
        if lo >= cap:
            found.rate, found.bound = lo, "served"
            return found
        r = min(lo * step, cap)
        lo, hi = (r, None) if ok(r) else (lo, r)
        step *= step
    while hi / lo > 1 + tolerance:
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    found.rate, found.bound = lo, "bisected"
    return found
