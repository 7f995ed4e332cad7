"""Arrivals: in steps or in time, at most max_concurrency in flight; and the loop's clock
over them (idle gaps skipped, requests clocked from when they enter)."""

import numpy as np
import pytest

from pcpflow.scheduling.arrivals import Arrivals
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import (
    BlockIdentity,
    RequestTable,
    SyntheticWorkload,
    poisson_arrivals,
    request_table,
)


def test_no_cap_releases_by_key_in_arrival_order():
    a = Arrivals(np.array([3, 0, 3, 1]))
    assert a.due(0).tolist() == [1]
    assert a.due(2).tolist() == [3]
    assert a.next_time() == 3
    assert a.due(5).tolist() == [0, 2]  # ties by index
    assert a.exhausted and a.next_time() is None
    assert a.entered_at.tolist() == [3, 0, 3, 1]


def test_closed_loop_a_finish_frees_a_slot_for_the_next():
    # all at t=0, 2 in flight: 0 and 1 enter at 0; 2 enters when the first finish frees a
    # slot (t=5), 3 when the second does (t=7), in arrival order.
    a = Arrivals(np.zeros(4), max_concurrency=2)
    assert a.due(0.0).tolist() == [0, 1] and a.next_time() is None
    a.finished(1, 5.0)
    assert a.next_time() == 5.0
    assert a.due(4.0).tolist() == []  # not yet freed
    assert a.due(6.0).tolist() == [2]
    a.finished(1, 7.0)
    assert a.due(9.0).tolist() == [3]
    assert a.entered_at.tolist() == [0.0, 0.0, 5.0, 7.0]


def test_a_late_arrival_takes_a_slot_freed_before_it():
    a = Arrivals(np.array([0.0, 0.0, 10.0]), max_concurrency=1)
    assert a.due(0.0).tolist() == [0]
    a.finished(1, 2.0)
    assert a.due(3.0).tolist() == [1]  # waited for the slot: enters at 2
    a.finished(1, 4.0)
    assert a.next_time() == 10.0
    assert a.due(10.0).tolist() == [2]  # slot free since 4, arrives at 10
    assert a.entered_at.tolist() == [0.0, 2.0, 10.0]


def test_poisson_arrivals_mean_rate_and_inf():
    rate, n = 4.0, 20000
    t = poisson_arrivals(n, rate, seed=3)
    assert t[0] == 0 and (np.diff(t) >= 0).all()
    gaps = np.diff(t)
    # the mean of n-1 exponential gaps: 1/rate, with std 1/(rate sqrt(n-1)); 5 sigma
    assert abs(gaps.mean() - 1 / rate) < 5 / (rate * np.sqrt(n - 1))
    # exponential: P(gap > 1/rate) = e^-1 within 5 binomial sigmas
    p = np.exp(-1)
    assert abs((gaps > 1 / rate).mean() - p) < 5 * np.sqrt(p * (1 - p) / (n - 1))
    assert (poisson_arrivals(5, float("inf"), seed=0) == 0).all()
    np.testing.assert_array_equal(poisson_arrivals(10, 2.0, seed=1), poisson_arrivals(10, 2.0, seed=1))


def test_workload_request_rate_only_in_time_for_simulated_runs():
    cfg = SyntheticWorkload(num_requests=6, request_rate=2.0, max_concurrency=3)
    timed = request_table(cfg, vocab_size=50, seed=0, with_tokens=False, simulated=True)
    assert timed.timed and timed.max_concurrency == 3 and timed.tokens is None
    np.testing.assert_array_equal(timed.arrival_s, poisson_arrivals(6, 2.0, 0))
    stepped = request_table(SyntheticWorkload(num_requests=6), vocab_size=50, seed=0, with_tokens=True)
    assert not stepped.timed and stepped.arrival_steps.tolist() == [0, 1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="exclude each other"):
        SyntheticWorkload(request_rate=1.0, arrival_every=0.5)


def _table(prompts, outputs, arrival_s=None):
    n = len(prompts)
    return RequestTable(prompt_lens=np.array(prompts), output_lens=np.array(outputs),
                        arrival_steps=np.zeros(n, dtype=np.int64), cached_lens=np.zeros(n, dtype=np.int64),
                        arrival_s=None if arrival_s is None else np.array(arrival_s, dtype=np.float64),
                        identity=BlockIdentity(salts=np.arange(1, n + 1, dtype=np.uint64)))


def test_timed_loop_skips_idle_gaps_and_clocks_from_arrival():
    # r0 arrives at 1.0 s, r1 at 10.25 s; every step costs 0.5 s. r0: prefill (sample 1)
    # then one decode; idle until 10.25; r1 the same.
    table = _table([4, 4], [2, 2], arrival_s=[1.0, 10.25])
    s = Scheduler(table, max_num_batched_tokens=16, max_num_seqs=4, kv=KVCacheManager(8, 4))
    loop = StepLoop(s)
    starts = []
    for batch in loop.batches():
        starts.append(loop.clock)
        out = s.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64), end=loop.clock + 0.5)
        loop.advance(batch, 0.5, out.num_new_tokens)
    assert starts == [1.0, 1.5, 10.25, 10.75]  # no step runs in the gap
    cols = loop.request_columns()
    np.testing.assert_allclose(cols["arrival_s"], [1.0, 10.25])
    np.testing.assert_allclose(cols["ttft_s"], [0.5, 0.5])
    np.testing.assert_allclose(cols["tpot_s"], [0.5, 0.5])
    np.testing.assert_allclose(cols["queue_s"], [0.0, 0.0])
    assert cols["ttft_steps"].tolist() == [1, 1]


def test_executed_style_steps_honour_max_concurrency():
    # 3 requests at step 0, 1 in flight: each enters the step after the previous finished
    # and is clocked (TTFT in steps) from there.
    table = _table([2, 2, 2], [2, 2, 2])
    table.max_concurrency = 1
    s = Scheduler(table, max_num_batched_tokens=16, max_num_seqs=4, kv=KVCacheManager(8, 4))
    loop = StepLoop(s)
    seen = []
    for batch in loop.batches():
        seen.append((batch.step, batch.req_ids.tolist()))
        out = s.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64))
        loop.advance(batch, 1.0, out.num_new_tokens)
    assert seen == [(0, [0]), (1, [0]), (2, [1]), (3, [1]), (4, [2]), (5, [2])]
    cols = loop.request_columns()
    assert cols["arrival_step"].tolist() == [0, 2, 4] and cols["ttft_steps"].tolist() == [1, 1, 1]
