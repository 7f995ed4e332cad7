"""Requests entering the server: at their arrival step (executed runs) or time (simulated
runs), at most ``max_concurrency`` in flight, as a benchmark client sends them.

A request is *in flight* from the moment it enters until it finishes. With a cap, a request
that arrives while ``max_concurrency`` are in flight enters when one of them finishes
(``vllm bench serve --max-concurrency``: a closed loop when every request arrives at once).
Its clock (TTFT, queueing) starts when it enters. Slots free in the order requests finish,
and requests take them in arrival order, so request i enters at
``max(arrival_i, the time the slot it takes was freed)``.

In steps, a request finishing at step f frees its slot for step f + 1; in time, at the end
of the step that finished it.
"""

from __future__ import annotations

from collections import deque

import numpy as np


class Arrivals:
    """Arrival keys (int steps or float seconds, one per request) released in order."""

    def __init__(self, keys: np.ndarray, max_concurrency: int | None = None) -> None:
        keys = np.asarray(keys)
        self.timed = keys.dtype.kind == "f"
        self.order = np.argsort(keys, kind="stable")  # arrival order; ties by request index
        self.sorted_keys = keys[self.order]
        self.cap = max_concurrency
        self.entered_at = np.full(len(keys), np.nan if self.timed else -1, dtype=np.float64 if self.timed else np.int64)
        self._next = 0
        self._in_flight = 0
        self._released: deque = deque()  # times (steps) at which slots were freed, oldest first

    def __len__(self) -> int:
        return len(self.order)

    @property
    def exhausted(self) -> bool:
        return self._next == len(self.order)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def due(self, now) -> np.ndarray:
        """Requests (indices) that enter at ``now``, in arrival order; their entry is recorded
        in ``entered_at``."""
        end = int(np.searchsorted(self.sorted_keys, now, side="right"))
        if end <= self._next:
            return self.order[:0]
        idx = self.order[self._next:end]
        if self.cap is None:
            self.entered_at[idx] = self.sorted_keys[self._next:end]
        else:
            idx = self._take_slots(idx, now)
        self._next += len(idx)
        self._in_flight += len(idx)
        return idx

    def _take_slots(self, idx: np.ndarray, now) -> np.ndarray:
        keys = self.sorted_keys[self._next:self._next + len(idx)]
        fresh = max(0, self.cap - self._in_flight - len(self._released))  # never used: free since the start
        n = min(len(idx), fresh)
        self.entered_at[idx[:n]] = keys[:n]
        while n < len(idx) and self._released and self._released[0] <= now:
            self.entered_at[idx[n]] = max(keys[n], self._released.popleft())
            n += 1
        return idx[:n]

    def finished(self, count: int, at) -> None:
        """``count`` requests finished; their slots are free from ``at`` (a step or a time)."""
        self._in_flight -= count
        if self.cap is not None and count:
            self._released.extend([at] * count)

    def next_time(self):
        """When the next request can enter: its arrival, or (every slot taken) None: only a
        finish frees one."""
        if self.exhausted:
            return None
        key = self.sorted_keys[self._next]
        if self.cap is None or self._in_flight + len(self._released) < self.cap:
            return key
        if self._released:
            return max(key, self._released[0])
        return None
