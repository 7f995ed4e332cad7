"""The step loop every run drives: schedule a batch, run it, account for it.

An executed rank (``pcpflow.rank.engine``) runs each batch through its pipeline and times
it; a simulated run (``pcpflow.simulate.engine``) prices it. Both go through this one
loop, so that they schedule, stop, clock and time requests the same way::

    loop = StepLoop(scheduler, max_steps=cfg.max_steps)
    for batch in loop.batches():
        ...                                  # run or price the batch, scheduler.update(...)
        loop.advance(batch, seconds, num_new_tokens)

``seconds`` is what the step took on the run clock: the measured pipeline and scheduler
time of an executed step (``loop.elapsed()`` since the batch was scheduled), the price of a
simulated one. Verification and metrics happen after ``advance``, off the clock.

Arrivals in steps (executed runs, and simulated ones that ask for it): a step with nothing
to run takes no time. Arrivals in time (a simulated run's ``request_rate`` or trace
timestamps): the clock is the run's time; when nothing is running or waiting it jumps to
the next arrival (idle time is skipped, not stepped through), and requests that arrive
during a step enter at their arrival time and are scheduled from the next step on.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.scheduler import Scheduler


class StepLoop:
    def __init__(self, scheduler: Scheduler, *, max_steps: int | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.scheduler, self.max_steps, self.on_step = scheduler, max_steps, on_step
        self.timed = scheduler.arrivals is not None and scheduler.arrivals.timed
        self.clock = 0.0  # the run clock: what each step took (see the module's docstring)
        self._start = np.zeros(1024)  # per step: the clock when it began and ended
        self._end = np.zeros(1024)
        self.generated = 0
        self.executed = 0
        self._scheduled_at = 0.0

    @property
    def step_start(self) -> np.ndarray:
        return self._start[:self.scheduler.step]

    @property
    def step_end(self) -> np.ndarray:
        return self._end[:self.scheduler.step]

    def batches(self) -> Iterator[GlobalBatch]:
        """Each step's batch until the workload is done (or ``max_steps`` ran)."""
        while True:
            batch = self.next_batch()
            if batch is None:
                return
            yield batch

    def next_batch(self) -> GlobalBatch | None:
        """The next step's batch, or None when the workload is done (or ``max_steps`` ran);
        steps with nothing to run are passed over (in time, the clock jumps to the next
        arrival)."""
        sched = self.scheduler
        while not sched.done and (self.max_steps is None or self.executed < self.max_steps):
            if self.timed and not sched.has_work:
                t = sched.arrivals.next_time()
                if t is not None and t > self.clock:
                    self.clock = float(t)  # NOTE: the idle gap is skipped, not stepped through
            batch = self.schedule_step()
            if batch is not None:
                return batch
        return None

    def schedule_step(self) -> GlobalBatch | None:
        """One ``schedule`` on the loop's clock (None: nothing ran; the step took no time)."""
        sched = self.scheduler
        step = sched.step
        if self.on_step is not None:
            self.on_step(step)
        if step >= len(self._start):
            self._start, self._end = (np.concatenate([a, np.zeros(len(a))]) for a in (self._start, self._end))
        self._start[step] = self.clock
        self._scheduled_at = time.perf_counter()
        batch = sched.schedule(now=self.clock)
        if batch is None:
            self._end[step] = self.clock
        return batch

    def elapsed(self) -> float:
        """Wall seconds since the current batch was scheduled (scheduling included)."""
        return time.perf_counter() - self._scheduled_at

    def advance(self, batch: GlobalBatch, seconds: float, num_new_tokens: int) -> None:
        self.clock += seconds
        self._end[batch.step] = self.clock
        self.generated += num_new_tokens
        self.executed += 1

    def request_columns(self, req: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Per request (those of ``req``, default all; float64, NaN where not yet): arrival
        (its clock starts), first token, finish and first-scheduled times on the run clock,
        TTFT / TPOT / queueing in seconds and steps, outputs, preemptions and prefix hits."""
        return request_columns(self.scheduler, self.step_start, self.step_end, req)

    def request_rows(self, requests: Any, *, with_token_ids: bool = True) -> list[dict[str, Any]]:
        """One row per request: its lengths, the steps it arrived, got its first token and
        finished at, and TTFT / TPOT in steps and on the run clock."""
        return request_rows(self.request_columns(), requests, with_token_ids=with_token_ids)


def request_columns(scheduler: Scheduler, step_start: np.ndarray, step_end: np.ndarray,
                    req: np.ndarray | None = None, *, entered_at: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """``StepLoop.request_columns`` for the requests ``req`` a scheduler ran, given its
    steps' start and end on the run clock (and, for requests a router fed it, their entry
    times: ``Arrivals.entered_at``)."""
    t = scheduler.timing_columns()
    if req is None:
        req = np.arange(len(t["arrival_step"]))
    t = {k: v[req] for k, v in t.items()}

    def at(times: np.ndarray, steps: np.ndarray) -> np.ndarray:
        out = np.full(len(steps), np.nan)
        ok = steps >= 0
        out[ok] = times[steps[ok]]
        return out

    arrivals = scheduler.arrivals
    if entered_at is None and arrivals is not None:
        entered_at = arrivals.entered_at
    if entered_at is not None and entered_at.dtype.kind == "f":
        entered = entered_at[req].astype(np.float64)
    else:
        entered = at(step_start, t["entry_step"])
    # NOTE: the clock starts at entry, or at the end of a cached_lens warm-up where one ran (a
    # prefix hit holding the prefix is ready at its entry step: no warm-up)
    warmed = t["ready_step"] > t["entry_step"]
    ready = at(step_end, np.where(warmed, t["ready_step"] - 1, -1))
    arrival = np.where(np.isnan(ready), entered, np.fmax(entered, ready))
    first = at(step_end, t["first_token_step"])
    finish = at(step_end, t["finish_step"])
    n_out = t["num_output_tokens"].astype(np.float64)
    many = (n_out > 1) & (t["finish_step"] >= 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(many, (finish - first) / (n_out - 1), np.nan)
    ttft_steps, tpot_steps = steps_between(t["arrival_step"], t["first_token_step"], t["finish_step"],
                                           t["num_output_tokens"])
    return {
        "req_id": req,
        "arrival_step": t["arrival_step"],
        "first_token_step": t["first_token_step"],
        "finish_step": t["finish_step"],
        "arrival_s": arrival,
        "first_token_s": first,
        "finish_s": finish,
        "ttft_s": first - arrival,
        "ttft_steps": ttft_steps,
        "tpot_s": tpot,
        "tpot_steps": tpot_steps,
        # NOTE: from the clock's start, as TTFT: a request admitted before (for its warm-up) waits for nothing
        "queue_s": np.maximum(at(step_start, t["admitted_step"]) - arrival, 0.0),
        "output_len": t["num_output_tokens"],
        "num_preemptions": t["num_preemptions"],
        "prefix_hit_tokens": t["prefix_hit_tokens"],
    }


def steps_between(arrival_step: np.ndarray, first_token_step: np.ndarray, finish_step: np.ndarray,
                  num_output_tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """TTFT in steps (the arrival step and the first token's both counted) and TPOT in steps
    (the mean steps between later tokens) from a request's step columns; NaN where not yet."""
    n_out = num_output_tokens.astype(np.float64)
    got_first = (first_token_step >= 0) & (arrival_step >= 0)
    many = (n_out > 1) & (finish_step >= 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return (np.where(got_first, first_token_step - arrival_step + 1, np.nan),
                np.where(many, (finish_step - first_token_step) / (n_out - 1), np.nan))


def _value(v: float) -> float | None:
    return None if v != v else v


def request_rows(cols: dict[str, np.ndarray], requests: Any, *, with_token_ids: bool = True) -> list[dict[str, Any]]:
    """The rows of ``request_columns`` (plain values, None where not yet), with each
    request's prompt length (and its token ids, from ``Request`` objects)."""
    if hasattr(requests, "prompt_lens"):  # a RequestTable: lengths only
        prompt_lens, token_ids = requests.prompt_lens.tolist(), None
    else:
        prompt_lens = [len(r.prompt_token_ids) for r in requests]
        token_ids = [r.prompt_token_ids for r in requests] if with_token_ids else None
    lists = {k: v.tolist() for k, v in cols.items()}
    rows = []
    for n, i in enumerate(lists["req_id"]):
        steps = {k: (None if lists[k][n] < 0 else lists[k][n]) for k in ("arrival_step", "first_token_step", "finish_step")}
        rows.append({
            "req_id": i,
            "prompt_len": prompt_lens[i],
            "prompt_token_ids": token_ids[i].tolist() if token_ids is not None else None,
            "output_len": lists["output_len"][n],
            **steps,
            "ttft_steps": _int_or_none(lists["ttft_steps"][n]),
            "ttft_s": _value(lists["ttft_s"][n]),
            "tpot_steps": _value(lists["tpot_steps"][n]),
            "tpot_s": _value(lists["tpot_s"][n]),
            "queue_s": _value(lists["queue_s"][n]),
            "num_preemptions": lists["num_preemptions"][n],
            "prefix_hit_tokens": lists["prefix_hit_tokens"][n],
        })
    return rows


def _int_or_none(v: float) -> int | None:
    return None if v != v else int(v)
