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
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.scheduler import Scheduler


class StepLoop:
    def __init__(self, scheduler: Scheduler, *, max_steps: int | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.scheduler, self.max_steps, self.on_step = scheduler, max_steps, on_step
        self.clock = 0.0  # the run clock: what each step took (see the module's docstring)
        self.step_start: dict[int, float] = {}
        self.step_end: dict[int, float] = {}
        self.generated = 0
        self.executed = 0
        self._scheduled_at = 0.0

    def batches(self) -> Iterator[GlobalBatch]:
        """Each step's batch until the workload is done (or ``max_steps`` ran); a step with
        nothing to run (waiting for arrivals) takes no time and yields nothing."""
        sched = self.scheduler
        while not sched.done and (self.max_steps is None or self.executed < self.max_steps):
            step = sched.step
            if self.on_step is not None:
                self.on_step(step)
            self.step_start[step] = self.clock
            self._scheduled_at = time.perf_counter()
            batch = sched.schedule()
            if batch is None:
                self.step_end[step] = self.clock
                continue
            yield batch

    def elapsed(self) -> float:
        """Wall seconds since the current batch was scheduled (scheduling included)."""
        return time.perf_counter() - self._scheduled_at

    def advance(self, batch: GlobalBatch, seconds: float, num_new_tokens: int) -> None:
        self.clock += seconds
        self.step_end[batch.step] = self.clock
        self.generated += num_new_tokens
        self.executed += 1

    def request_rows(self, requests: list[Any], *, with_token_ids: bool = True) -> list[dict[str, Any]]:
        """One row per request: its lengths, the steps it arrived, got its first token and
        finished at, and TTFT / TPOT in steps and on the run clock."""
        rows = []
        timing = self.scheduler.request_timing()
        outputs = self.scheduler.outputs()
        for r in requests:
            t = timing.get(r.req_id, {})
            arrival, first, finish = t.get("arrival_step"), t.get("first_token_step"), t.get("finish_step")
            n_out = len(outputs.get(r.req_id, []))
            ttft_s = ttft_steps = tpot_s = tpot_steps = None
            if first is not None and arrival is not None:
                ttft_steps = first - arrival + 1
                ttft_s = self.step_end[first] - self.step_start[arrival]
            if finish is not None and first is not None and n_out > 1:
                tpot_steps = (finish - first) / (n_out - 1)
                tpot_s = (self.step_end[finish] - self.step_end[first]) / (n_out - 1)
            rows.append(
                {
                    "req_id": r.req_id,
                    "prompt_len": len(r.prompt_token_ids),
                    "prompt_token_ids": r.prompt_token_ids.tolist() if with_token_ids else None,
                    "output_len": n_out,
                    "arrival_step": arrival,
                    "first_token_step": first,
                    "finish_step": finish,
                    "ttft_steps": ttft_steps,
                    "ttft_s": ttft_s,
                    "tpot_steps": tpot_steps,
                    "tpot_s": tpot_s,
                }
            )
        return rows
