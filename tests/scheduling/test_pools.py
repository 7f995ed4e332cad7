"""pcpflow.scheduling.pools: the prefill pool, the queue, the decode pool (disagg=pd), by hand
and as a property: both pools driven full never deadlock, every request gets its outputs,
a request waits in the queue holding its prefill blocks, and one preempted on the decode
pool recomputes there."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.pools import PoolLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import Request


def pools(prompt_lens, outs, *, p_blocks=64, d_blocks=64, p_budget=8, d_budget=8, p_seqs=4, d_seqs=4, block=4,
          arrivals=None):
    reqs = [Request(i, np.arange(p, dtype=np.int64) + 1, o, (arrivals or [0] * len(outs))[i])
            for i, (p, o) in enumerate(zip(prompt_lens, outs))]
    prefill = Scheduler(reqs, max_num_batched_tokens=p_budget, max_num_seqs=p_seqs,
                        kv=KVCacheManager(p_blocks, block), prefill_only=True)
    decode = Scheduler(reqs, max_num_batched_tokens=d_budget, max_num_seqs=d_seqs, kv=KVCacheManager(d_blocks, block),
                       feed=False, share=prefill)
    return PoolLoop(prefill, decode)


def drive(loop, on_step=None, max_steps=10_000):
    """Run the loop with token 7 sampled everywhere; ``on_step(ps, loop)`` after each update."""
    for ps in loop.steps():
        loop.handover.release([h[0] for h in ps.handed])
        tokens = [None if b is None else np.full(len(b.logits_indices), 7, np.int64) for b in (ps.prefill, ps.decode)]
        loop.update(ps, *tokens)
        loop.advance(ps, 1.0)
        if on_step is not None:
            on_step(ps, loop)
        assert loop.executed < max_steps, "the pools did not finish"


def test_hand_worked_handover():
    # r0: prompt 5, 3 outputs; r1: prompt 6, 2 outputs; prefill budget 8, one decode seat.
    loop = pools([5, 6], [3, 2], d_seqs=1)
    seen = []

    def look(ps, lp):
        seen.append({
            "handed": [h[0] for h in ps.handed],
            "prefill": None if ps.prefill is None else (ps.prefill.req_ids.tolist(), ps.prefill.num_scheduled_tokens.tolist()),
            "decode": None if ps.decode is None else (ps.decode.req_ids.tolist(), ps.decode.is_prefilling.tolist()),
            "queue": list(lp.handover.queue),
            "prefill_blocks": lp.prefill.kv.num_used_blocks,
        })

    drive(loop, look)
    assert seen == [
        # step 0: r0 prefilled whole, samples its first token and leaves; r1 gets the other 3 of the budget
        {"handed": [], "prefill": ([0, 1], [5, 3]), "decode": None, "queue": [0], "prefill_blocks": 3},
        # step 1: r0 handed over (its 2 prefill blocks freed), decodes; r1 finishes its prompt, queues
        {"handed": [0], "prefill": ([1], [3]), "decode": ([0], [False]), "queue": [1], "prefill_blocks": 2},
        # step 2: the decode pool's one seat is r0's: r1 waits holding its 2 prefill blocks
        {"handed": [], "prefill": None, "decode": ([0], [False]), "queue": [1], "prefill_blocks": 2},
        # step 3: r0 finished at step 2; r1 is handed over and decodes its second (last) token
        {"handed": [1], "prefill": None, "decode": ([1], [False]), "queue": [], "prefill_blocks": 0},
    ]
    t = loop.prefill.timing_columns()
    assert t["first_token_step"].tolist() == [0, 1] and t["finish_step"].tolist() == [2, 3]
    assert loop.handover.step.tolist() == [1, 3] and loop.handover.waited.tolist() == [False, True]
    assert loop.prefill.outputs() == {0: [7, 7, 7], 1: [7, 7]}


def test_a_one_token_request_finishes_on_the_prefill_pool():
    loop = pools([5, 3], [1, 2])
    drive(loop)
    assert loop.handover.step.tolist() == [-1, 1]
    assert loop.prefill.outputs() == {0: [7], 1: [7, 7]}


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 6)), min_size=1, max_size=12),
       st.integers(0, 6), st.integers(0, 10), st.integers(1, 3), st.integers(4, 16))
def test_both_pools_full_never_deadlock(reqs, p_extra, d_extra, d_seqs, budget):
    prompts, outs, arrivals = (list(x) for x in zip(*reqs))
    block = 4
    # each pool holds its largest request alone (the pre-run fit rule), little more
    p_blocks = max(-(-p // block) for p in prompts) + p_extra
    d_blocks = max(-(-(p + o) // block) for p, o in zip(prompts, outs)) + d_extra
    loop = pools(prompts, outs, p_blocks=p_blocks, d_blocks=d_blocks, p_budget=budget, d_budget=budget,
                 d_seqs=d_seqs, arrivals=sorted(arrivals))

    def invariants(ps, lp):
        p_run, d_run = set(lp.prefill._running.tolist()), set(lp.decode._running.tolist())
        assert not p_run & d_run and not set(lp.handover.queue) & (p_run | d_run)
        for i in lp.handover.queue:  # a handed-over request waits holding its prefill-pool blocks
            assert lp.prefill.kv.num_blocks_of(i) == -(-lp.prefill.columns.num_computed[i] // block)

    drive(loop, invariants)
    assert loop.prefill.outputs() == {i: [7] * o for i, o in enumerate(outs)}


def test_flow_control_with_both_pools_full():
    """Many requests over few blocks: the queue holds prefill blocks while the decode pool is
    full, the prefill pool stops admitting for want of blocks, the decode pool preempts its
    own and they recompute there; everything finishes."""
    prompts, outs = [12, 9, 15, 7, 11, 14, 8, 13], [9, 6, 8, 10, 5, 7, 9, 6]
    loop = pools(prompts, outs, p_blocks=8, d_blocks=9, p_budget=16, d_budget=16, p_seqs=4, d_seqs=3)
    saw = {"queue_full_decode": 0, "prefill_starved": 0, "recomputed_on_decode": 0}

    def watch(ps, lp):
        d, p = lp.decode, lp.prefill
        if lp.handover.queue and not d.can_adopt(lp.handover.queue[0]):
            saw["queue_full_decode"] += 1
        if p.num_waiting and p.kv.num_free_blocks < 2 and lp.handover.queue:
            saw["prefill_starved"] += 1
        if ps.decode is not None:
            rows = ps.decode.is_prefilling & (d.columns.num_preempted[ps.decode.req_ids] > 0)
            saw["recomputed_on_decode"] += int(rows.sum())

    drive(loop, watch)
    assert loop.prefill.outputs() == {i: [7] * o for i, o in enumerate(outs)}
    assert all(saw.values()), saw
    assert int(loop.decode.columns.num_preempted.sum()) >= 1


@settings(max_examples=60, deadline=None, database=None)
@given(st.lists(st.tuples(st.integers(1, 60), st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=8),
       st.sampled_from(["sliding", "chunked"]), st.integers(2, 20), st.sampled_from([(1, 1), (1, 2), (2, 1), (2, 4),
                                                                                    (3, 2)]),
       st.integers(4, 24), st.booleans())
def test_hybrid_pools_hand_over_every_key_a_window_still_reads(reqs, kind, size, dcps, budget, share_stem):
    """KV groups in both pools (a hybrid cache, ``disagg=pd``): at each handover the decode
    pool's window groups point at the null block exactly before the entry holding the first
    key the request's next query reads (its own entries: block_size x its dcp), hold a block
    from there on, and the prefill pool still holds every position of those entries (its
    window groups keep the decode pool's whole entries, whatever either dcp), with prefix
    hits on the prefill pool; every block goes back, and everything finishes."""
    from types import SimpleNamespace

    from pcpflow.layouts.slots import Window
    from pcpflow.scheduling.kv_groups import KVGroups
    from pcpflow.scheduling.pools import pool_schedulers
    from pcpflow.scheduling.workload import RequestTable

    prompts, outs, arrivals = (list(x) for x in zip(*reqs))
    block, (p_dcp, d_dcp) = 2, dcps
    groups = KVGroups.of(3, [1, 2], Window(size, kind))  # one full group, two windowed (one layer each)
    stem = list(range(1, 25))
    reqs = [Request(i, np.array((stem if share_stem else [])[:p] + [100 + i] * max(0, p - 24 * share_stem),
                                dtype=np.int64)[:p], o, a)
            for i, (p, o, a) in enumerate(zip(prompts, outs, sorted(arrivals)))]

    def pool(dcp, prefix):
        entries = -(-(max(prompts) + max(outs)) // (block * dcp))
        return SimpleNamespace(scheduler=SimpleNamespace(max_num_batched_tokens=budget, max_num_seqs=3),
                               kv=SimpleNamespace(num_blocks=3 * entries + 4, block_size=block, prefix_caching=prefix),
                               dcp=dcp, num_speculative_tokens=0)

    prefill, decode = pool_schedulers(RequestTable.from_requests(reqs), pool(p_dcp, True), pool(d_dcp, False),
                                      groups=groups)
    loop = PoolLoop(prefill, decode)
    Up, Ud, null_p, null_d = block * p_dcp, block * d_dcp, prefill.kv.null_block, decode.kv.null_block
    handed = 0

    def check(ps, lp):
        nonlocal handed
        for i, n, src, dst in ps.handed:
            handed += 1
            first = int(Window(size, kind).starts(np.int64(n)))  # the first key of the query at n
            keep = first // Ud  # the decode pool's first kept entry
            assert dst.shape == (3, -(-n // Ud)) and src.shape == (3, -(-n // Up))
            assert (dst[0] != null_d).all() and (src[0] != null_p).all()
            for g in (1, 2):
                assert (dst[g, :keep] == null_d).all() and (dst[g, keep:] != null_d).all(), (g, keep, dst[g])
                moved = np.arange(keep * Ud, n)
                assert (src[g, moved // Up] != null_p).all(), (g, n, keep * Ud, src[g])
        lp.handover.release([h[0] for h in ps.handed])

    for ps in loop.steps():
        check(ps, loop)
        tokens = [None if b is None else np.full(len(b.logits_indices), 7, np.int64) for b in (ps.prefill, ps.decode)]
        loop.update(ps, *tokens)
        loop.advance(ps, 1.0)
        assert loop.executed < 10_000, "the pools did not finish"
    assert prefill.outputs() == {i: [7] * o for i, o in enumerate(outs)}
    assert handed == sum(o > 1 for o in outs)
    for s in (prefill, decode):
        assert (s.kv.ref_counts() == 0).all() and s.kv.num_free_blocks == s.kv.num_blocks
