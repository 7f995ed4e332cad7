"""Two pools of one instance (``disagg=pd``): a prefill pool that prefills and samples the
first token, a decode pool that takes each request over, and the queue between them.

Both pools' schedulers share the per-request columns (``Scheduler(feed=False, share=...)``,
as a router's replicas do): the prefill pool's (``prefill_only``) feeds itself the arrivals;
a request whose prefill is done leaves its running requests with its first token and
*waits* in the ``Handover`` queue, holding its prefill-pool blocks. The decode pool adopts
the head of the queue when it has a seat and blocks for the prompt's positions and none of
its own requests waits (preempted ones recompute first), first come first served; the KV
entries then move (``pcpflow.parallel.transfer``) and the prefill pool frees the blocks.

Flow control follows from the blocks: while the decode pool is full the queue holds
prefill-pool blocks, and the prefill pool stops admitting when its own run out (its
scheduler admits only what its free blocks hold). Nothing deadlocks: the decode pool's
requests always progress (it preempts its own, which recompute there, never the queue's),
and an empty decode pool takes any request (``fit_problems`` of each pool, before the run).

``PoolLoop`` steps both pools in one deterministic global loop, as every executed rank does
(and a simulated run whose requests arrive in steps): each step first hands over what the
decode pool can take (the transfers run between steps), then schedules both pools, runs
them, and updates both. A simulated run in time advances each pool on its own clock
instead (``pcpflow.simulate.pools``), with the same queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.scheduling.scheduler import Scheduler, StepOutcome


def pool_schedulers(table, prefill, decode, *, stop_token_ids=(), kv_cls=KVCacheManager,
                    history: bool = False, draft_kv_reads_next_token: bool = False,
                    sampled_outputs: bool = False, groups: KVGroups | None = None) -> tuple[Scheduler, Scheduler]:
    """The prefill pool's scheduler (``prefill_only``, fed the arrivals) and the decode pool's
    (sharing its per-request columns: a request's drafts, proposed as its prefill ended, go
    over with it as its first token does), each with its own KV blocks and budget. ``prefill``
    and ``decode`` are each pool's view of the run config (``pcpflow.config.disagg.pool_config``:
    ``scheduler``, ``kv`` and ``dcp`` read). ``history``: batches list what their sampled rows
    have seen (a repetition penalty). ``draft_kv_reads_next_token``: the drafter's entries read
    the next token (``Scheduler``: a prefix hit gives up blocks to compute again).
    ``sampled_outputs``: a simulated run of a config that samples (``Scheduler``). ``groups``:
    both pools' KV groups (a hybrid cache: ``pcpflow.scheduling.kv_groups``); the prefill pool's
    window groups keep the decode pool's whole entries (``keep_align``), which the handover
    moves from the first one the decode pool keeps (``KVGroups.first_moved``)."""

    def scheduler(c, keep_align=None, **kw) -> Scheduler:
        return Scheduler(table, max_num_batched_tokens=c.scheduler.max_num_batched_tokens,
                         max_num_seqs=c.scheduler.max_num_seqs,
                         kv=kv_cls(c.kv.num_blocks, c.kv.block_size, c.dcp, prefix_caching=c.kv.prefix_caching,
                                   groups=groups, keep_align=keep_align),
                         num_speculative_tokens=c.num_speculative_tokens,
                         draft_kv_reads_next_token=draft_kv_reads_next_token, stop_token_ids=stop_token_ids,
                         sampled_outputs=sampled_outputs, history=history, **kw)

    first = scheduler(prefill, prefill_only=True, keep_align=decode.kv.block_size * decode.dcp)
    return first, scheduler(decode, feed=False, share=first)


class Handover:
    """The queue from the prefill pool to the decode pool, and what each handover moved."""

    def __init__(self, prefill: Scheduler, decode: Scheduler) -> None:
        if not prefill.prefill_only:
            raise ValueError("the prefill pool's scheduler must be prefill_only")
        self.prefill, self.decode = prefill, decode
        self.queue: deque[int] = deque()
        n = len(prefill.table)
        self.ready_s = np.full(n, np.nan)  # when its prefill ended (timed runs)
        self.prefill_s = np.zeros(n)  # the length of the step that ended its prefill (priced runs)
        self.waited = np.zeros(n, dtype=bool)  # the decode pool could not take it at the first try
        self._tries = 0  # admit() calls so far
        self._pushed_at = np.zeros(n, dtype=np.int64)  # admit() calls before it joined the queue
        self.step = np.full(n, -1, dtype=np.int64)  # the (global or decode-pool) step it was handed over at
        self.transfer_bytes = np.zeros(n, dtype=np.int64)
        self.transfer_calls = np.zeros(n, dtype=np.int64)
        self.transfer_s = np.zeros(n, dtype=np.float64)

    def __len__(self) -> int:
        return len(self.queue)

    def push(self, outcome: StepOutcome, at: float | None = None, step_s: float = 0.0) -> None:
        """The requests a prefill-pool step finished prefilling join the queue, in batch order
        (``at``: when that step ended; ``step_s``: how long it took)."""
        ids = outcome.handed_over
        if len(ids):
            self.queue.extend(ids.tolist())
            self.prefill_s[ids] = step_s
            self._pushed_at[ids] = self._tries
            if at is not None:
                self.ready_s[ids] = at

    def admit(self, step: int, now: float | None = None, *, join: bool = True) -> list[tuple[int, int, np.ndarray, np.ndarray]]:
        """Hand over the head of the queue while the decode pool can adopt it (and, timed,
        its prefill has ended by ``now``): ``(req, num_tokens, prefill tables, decode tables)``
        per request, in order (tables ``[num_groups, entries]``: one row per KV group). Its prefill-pool blocks stay held until ``release``; without
        ``join`` it runs on the decode pool once its entries arrived (``Scheduler.join``)."""
        self._tries += 1
        out = []
        while self.queue:
            i = self.queue[0]
            if now is not None and not self.ready_s[i] <= now:
                break
            if not self.decode.can_adopt(i):
                break  # FCFS: the head waits for room, and so does everyone behind it
            self.queue.popleft()
            src = self.prefill.kv.tables_of(i)
            dst = self.decode.adopt(i, join=join)
            self.step[i] = step
            self.waited[i] = self._tries > self._pushed_at[i] + 1
            out.append((i, int(self.prefill.columns.num_computed[i]), src, dst))
        return out

    def release(self, req_ids) -> np.ndarray:
        """The prefill pool frees the blocks of requests whose entries arrived."""
        freed = [self.prefill.release(int(i)) for i in req_ids]
        return np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64)

    def record(self, i: int, calls: int, nbytes: int, seconds: float) -> None:
        self.transfer_calls[i] += calls
        self.transfer_bytes[i] += nbytes
        self.transfer_s[i] += seconds

    @property
    def done(self) -> bool:
        return not self.queue

    def with_columns(self, rows: list[dict]) -> list[dict]:
        """Request rows (``pcpflow.scheduling.loop.request_rows``) with each request's handover:
        the step it was handed over at (None: it finished on the prefill pool), the bytes and
        seconds of its transfer."""
        steps, nbytes, secs = self.step.tolist(), self.transfer_bytes.tolist(), self.transfer_s.tolist()
        for row in rows:
            i = row["req_id"]
            row.update(handover_step=None if steps[i] < 0 else steps[i], transfer_bytes=nbytes[i], transfer_s=secs[i])
        return rows


@dataclass
class PoolStep:
    """One global step: what was handed over before it, and each pool's batch (None: the
    pool had nothing to run)."""

    step: int
    handed: list[tuple[int, int, np.ndarray, np.ndarray]]
    prefill: GlobalBatch | None
    decode: GlobalBatch | None
    prefill_s: float = 0.0  # how long the prefill pool's batch took (a priced run's layerwise overlap)


class PoolLoop:
    """Both pools in one global loop (every rank runs it alike)::

        loop = PoolLoop(prefill, decode)
        for ps in loop.steps():
            ...   # move ps.handed's entries, release them; run ps.prefill / ps.decode
            loop.update(ps, prefill_tokens, decode_tokens)
            loop.advance(ps, seconds)

    A step with nothing handed over and nothing to run takes no time (arrivals in steps)."""

    def __init__(self, prefill: Scheduler, decode: Scheduler, *, max_steps: int | None = None,
                 on_step: Callable[[int], None] | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.handover = Handover(prefill, decode)
        self.max_steps, self.on_step = max_steps, on_step
        self.clock = 0.0
        self._start, self._end = np.zeros(1024), np.zeros(1024)
        self.generated = self.executed = 0
        self.outcomes: tuple[StepOutcome | None, StepOutcome | None] = (None, None)

    @property
    def done(self) -> bool:
        return self.prefill.done and not self.decode.has_work and self.handover.done

    @property
    def step_start(self) -> np.ndarray:
        return self._start[:self.prefill.step]

    @property
    def step_end(self) -> np.ndarray:
        return self._end[:self.prefill.step]

    def steps(self) -> Iterator[PoolStep]:
        while not self.done and (self.max_steps is None or self.executed < self.max_steps):
            step = self.prefill.step
            if self.on_step is not None:
                self.on_step(step)
            if step >= len(self._start):
                self._start, self._end = (np.concatenate([a, np.zeros(len(a))]) for a in (self._start, self._end))
            self._start[step] = self._end[step] = self.clock
            handed = self.handover.admit(step)
            p, d = self.prefill.schedule(), self.decode.schedule()
            if p is None and d is None and not handed:
                if self.prefill.arrivals.exhausted and not self.prefill.has_work and self.handover.queue:
                    raise RuntimeError(f"the pools are stuck: {len(self.handover)} request(s) wait for the decode pool, "
                                       "which runs nothing and adopts none")
                continue
            yield PoolStep(step, handed, p, d)

    def update(self, ps: PoolStep, prefill_tokens: np.ndarray | None, decode_tokens: np.ndarray | None,
               ) -> tuple[StepOutcome | None, StepOutcome | None]:
        """Apply both pools' samples; the prefills that ended join the queue; a request that
        finished on the decode pool frees its seat of ``max_concurrency``."""
        po = self.prefill.update(ps.prefill, prefill_tokens) if ps.prefill is not None else None
        do = self.decode.update(ps.decode, decode_tokens) if ps.decode is not None else None
        if po is not None:
            self.handover.push(po, step_s=ps.prefill_s)
        if do is not None and len(do.finished_req_ids):
            self.prefill.arrivals.finished(len(do.finished_req_ids), ps.step + 1)
        self.outcomes = (po, do)
        return po, do

    def advance(self, ps: PoolStep, seconds: float) -> None:
        self.clock += seconds
        self._end[ps.step] = self.clock
        self.generated += sum(o.num_new_tokens for o in self.outcomes if o is not None)
        self.executed += 1
