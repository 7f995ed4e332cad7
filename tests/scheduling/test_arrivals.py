"""Arrivals: in steps or in time, at most max_concurrency in flight; and the loop's clock
over them (idle gaps skipped, requests clocked from when they enter)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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


def _table(prompts, outputs, arrival_s=None, cached=None, salts=None):
    n = len(prompts)
    return RequestTable(prompt_lens=np.array(prompts), output_lens=np.array(outputs),
                        arrival_steps=np.zeros(n, dtype=np.int64),
                        cached_lens=np.zeros(n, dtype=np.int64) if cached is None else np.array(cached),
                        arrival_s=None if arrival_s is None else np.array(arrival_s, dtype=np.float64),
                        identity=BlockIdentity(salts=np.arange(1, n + 1, dtype=np.uint64) if salts is None
                                               else np.array(salts, dtype=np.uint64)))


def _run(s, step_s):
    """Drive ``s`` to the end, step ``j`` costing ``step_s(j)`` s; the loop's request columns."""
    loop = StepLoop(s)
    for batch in loop.batches():
        seconds = step_s(batch.step)
        out = s.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64), end=loop.clock + seconds)
        loop.advance(batch, seconds, out.num_new_tokens)
    return loop.request_columns()


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


def test_queue_and_ttft_start_after_a_cached_lens_warm_up():
    # One seat, all at t=0, every step 0.5 s. r0 (4 tokens, 2 outputs) runs steps 0-1. r1
    # (8 tokens, 4 of them cached_lens) waits, is admitted at step 2 (t=1.0) for its warm-up,
    # and its clock starts as that step ends (1.5): step 3 prefills the rest and samples its
    # first token (2.0). It was admitted before its clock started, so it waited for nothing
    # from then (counted from its entry, its wait of 1.0 s exceeded its TTFT of 0.5 s).
    # r2 (4 tokens, 1 output) waits for the seat until step 5 (2.5) and samples at 3.0.
    table = _table([4, 8, 4], [2, 2, 1], arrival_s=[0.0, 0.0, 0.0], cached=[0, 4, 0])
    s = Scheduler(table, max_num_batched_tokens=16, max_num_seqs=1, kv=KVCacheManager(8, 4))
    cols = _run(s, lambda step: 0.5)
    assert cols["arrival_step"].tolist() == [0, 3, 0]
    np.testing.assert_allclose(cols["arrival_s"], [0.0, 1.5, 0.0])
    np.testing.assert_allclose(cols["ttft_s"], [0.5, 0.5, 3.0])
    np.testing.assert_allclose(cols["queue_s"], [0.0, 0.0, 2.5])


def test_a_prefix_hit_holding_cached_lens_clocks_from_arrival():
    # r0 and r1 share their prompt (one salt); steps of 0.5 s, blocks of 4. r0 (arrives at 0)
    # prefills at step 0; its two blocks are cached after it. r1 (cached_lens 4) arrives at
    # 0.75, during step 1, and enters at step 2 (1.0), where a hit of one block (all but its
    # last token's block) holds its cached_lens prefix: no warm-up, its clock runs from 0.75:
    # queue 0.25, first token at the end of step 2 (1.5), TTFT 0.75.
    table = _table([8, 8], [3, 2], arrival_s=[0.0, 0.75], cached=[0, 4], salts=[1, 1])
    s = Scheduler(table, max_num_batched_tokens=16, max_num_seqs=4, kv=KVCacheManager(16, 4, prefix_caching=True))
    cols = _run(s, lambda step: 0.5)
    assert cols["prefix_hit_tokens"].tolist() == [0, 4]
    np.testing.assert_allclose(cols["arrival_s"], [0.0, 0.75])
    np.testing.assert_allclose(cols["queue_s"], [0.0, 0.25])
    np.testing.assert_allclose(cols["ttft_s"], [0.5, 0.75])


@settings(max_examples=60, deadline=None)
@given(
    spec=st.lists(st.tuples(st.integers(2, 40), st.integers(1, 6), st.floats(0, 1), st.integers(0, 3)),
                  min_size=1, max_size=8),
    budget=st.integers(1, 48),
    seqs=st.integers(1, 4),
    spare_blocks=st.integers(0, 6),
    prefix_caching=st.booleans(),
    concurrency=st.sampled_from([None, 1, 2]),
    seed=st.integers(0, 2**16),
)
def test_queue_never_exceeds_ttft(spec, budget, seqs, spare_blocks, prefix_caching, concurrency, seed):
    """Every request's wait and TTFT run from one start (arrival, entry, or the end of its
    cached_lens warm-up): queue_s in [0, ttft_s], whatever the warm-ups, hits (requests with
    equal salts share their prompt), preemptions (few blocks), seats and step costs."""
    prompts = [p for p, *_ in spec]
    cached = [(p - 1) * c // 3 for p, _, _, c in spec]  # 0 to two thirds of the prompt, < p
    table = _table(prompts, [o for _, o, _, _ in spec], arrival_s=np.cumsum([a for _, _, a, _ in spec]),
                   cached=cached, salts=[1 + i % 2 for i in range(len(spec))])
    table.max_concurrency = concurrency
    need = max(-(-(p + o) // 4) for p, o, _, _ in spec)
    s = Scheduler(table, max_num_batched_tokens=budget, max_num_seqs=seqs,
                  kv=KVCacheManager(need + spare_blocks, 4, prefix_caching=prefix_caching))
    costs = np.random.default_rng(seed).uniform(0.01, 1.0, size=10_000)
    cols = _run(s, lambda step: float(costs[step]))
    assert (cols["finish_step"] >= 0).all()
    assert (cols["queue_s"] >= 0).all() and (cols["queue_s"] <= cols["ttft_s"] + 1e-12).all(), (cols["queue_s"],
                                                                                                 cols["ttft_s"])
