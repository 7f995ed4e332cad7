import itertools

import numpy as np
import pytest
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from pcpflow.errors import ConfigError
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler, accept_drafts
from pcpflow.scheduling.workload import Request


def prompt(i, n):
    """Recognisable prompt tokens: request i's prompt is 100*(i+1), 100*(i+1)+1, ..."""
    return np.arange(n, dtype=np.int64) + 100 * (i + 1)


def requests(prompt_lens, outs, arrivals=None):
    arrivals = arrivals or [0] * len(prompt_lens)
    specs = enumerate(zip(prompt_lens, outs, arrivals))
    return [Request(i, prompt(i, p), o, a) for i, (p, o, a) in specs]


def scheduler(prompt_lens, outs, *, budget, seqs=8, num_blocks=64, block_size=4, k=0,
              arrivals=None):
    kv = KVCacheManager(num_blocks=num_blocks, block_size=block_size)
    return Scheduler(
        requests(prompt_lens, outs, arrivals),
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        kv=kv,
        num_speculative_tokens=k,
    )


def rows(batch):
    return {
        "req_ids": batch.req_ids.tolist(),
        "q": batch.num_scheduled_tokens.tolist(),
        "c": batch.num_computed_tokens.tolist(),
        "prefill": batch.is_prefilling.tolist(),
        "logits": batch.logits_indices.tolist(),
    }


def test_hand_worked_chunked_schedule():
    # budget 8, prompts [5, 12], outputs [3, 2], both at step 0
    s = scheduler([5, 12], [3, 2], budget=8)
    p0, p1 = prompt(0, 5), prompt(1, 12)

    b = s.schedule()  # r0 whole prompt (5), r1 a first chunk of the remaining 3
    assert b.step == 0
    assert rows(b) == {"req_ids": [0, 1], "q": [5, 3], "c": [0, 0], "prefill": [True, True],
                       "logits": [4]}
    assert b.input_ids.tolist() == p0.tolist() + p1[:3].tolist()
    assert b.positions.tolist() == [0, 1, 2, 3, 4, 0, 1, 2]
    assert b.prompt_lens.tolist() == [5, 12]
    assert b.num_draft_tokens.tolist() == [0, 0]
    # blocks as tokens are written: 5 tokens = 2 blocks of 4 for r0, 3 tokens = 1 for r1
    assert b.block_tables.tolist() == [[0, 1], [2, 0]]
    out = s.update(b, np.array([50]))
    assert out.new_token_ids == {0: [50]} and out.first_token.tolist() == [0]
    assert out.num_new_tokens == 1

    b = s.schedule()  # r0 decodes its token 50; r1 gets the other 7
    assert rows(b) == {"req_ids": [0, 1], "q": [1, 7], "c": [5, 3], "prefill": [False, True],
                       "logits": [0]}
    assert b.input_ids.tolist() == [50] + p1[3:10].tolist()
    assert b.positions.tolist() == [5, 3, 4, 5, 6, 7, 8, 9]
    assert b.block_tables.tolist() == [[0, 1, 0], [2, 3, 4]]  # r1 holds 10 tokens: 3 blocks
    s.update(b, np.array([51]))

    b = s.schedule()  # r1's last 2 prompt tokens reach its end: its last token is sampled
    assert rows(b) == {"req_ids": [0, 1], "q": [1, 2], "c": [6, 10], "prefill": [False, True],
                       "logits": [0, 2]}
    assert b.input_ids.tolist() == [51] + p1[10:].tolist()
    out = s.update(b, np.array([52, 60]))
    # freed last block first: the back of the free queue, behind the blocks never used
    assert out.finished_req_ids.tolist() == [0] and out.freed_blocks.tolist() == [1, 0]
    assert out.first_token.tolist() == [1]
    assert out.new_token_ids == {0: [52], 1: [60]}

    b = s.schedule()
    assert rows(b) == {"req_ids": [1], "q": [1], "c": [12], "prefill": [False], "logits": [0]}
    assert b.input_ids.tolist() == [60]
    assert b.block_tables.tolist() == [[2, 3, 4, 5]]  # position 12 opens a 4th block: the queue's front
    out = s.update(b, np.array([61]))
    assert out.finished_req_ids.tolist() == [1] and out.freed_blocks.tolist() == [5, 4, 3, 2]
    assert s.done and s.schedule() is None
    assert s.outputs() == {0: [50, 51, 52], 1: [60, 61]}
    t = s.request_timing()
    assert (t[0]["arrival_step"], t[0]["first_token_step"], t[0]["finish_step"]) == (0, 0, 2)
    assert (t[1]["admitted_step"], t[1]["first_token_step"], t[1]["finish_step"]) == (0, 2, 3)
    assert (t[0]["num_output_tokens"], t[1]["num_output_tokens"]) == (3, 2)
    assert s.kv.num_free_blocks == 64


def test_long_prompt_chunks_continue_across_steps():
    s = scheduler([10], [1], budget=4)
    chunks = []
    while not s.done:
        b = s.schedule()
        c, q = b.num_computed_tokens[0], b.num_scheduled_tokens[0]
        chunks.append((c, q, b.logits_indices.tolist()))
        s.update(b, np.full(len(b.logits_indices), 7))
    assert chunks == [(0, 4, []), (4, 4, []), (8, 2, [1])]
    assert s.outputs() == {0: [7]}


def test_max_num_seqs_limits_running_requests():
    s = scheduler([2, 2, 2, 2], [2, 2, 2, 2], budget=100, seqs=2)
    seen = []
    while not s.done:
        b = s.schedule()
        seen.append(b.req_ids.tolist())
        s.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
    # each pair prefills, decodes once and finishes before the next pair is admitted
    assert seen == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_arrival_steps_and_idle_steps():
    s = scheduler([2, 2], [1, 1], budget=8, arrivals=[0, 3])
    b = s.schedule()
    assert b.req_ids.tolist() == [0] and s.step == 1
    s.update(b, np.array([9]))
    assert s.schedule() is None and s.schedule() is None  # steps 1, 2: nothing arrived
    b = s.schedule()
    assert b.step == 3 and b.req_ids.tolist() == [1]
    s.update(b, np.array([9]))
    assert s.done and s.request_timing()[1]["arrival_step"] == 3


def test_blocks_as_written_then_fcfs_preemption_and_recompute():
    # block_size 4, 3 blocks. Step 0 admits all three (1 block each: 4, 4 and 1 prompt
    # tokens). Step 1: r0 and r1 each open a second block (position 4), r2 needs none;
    # 2 > 0 free: r2 (last admitted) is preempted, then r1, until r0's block fits.
    s = scheduler([4, 4, 1], [4, 4, 3], budget=16, num_blocks=3, block_size=4)
    b = s.schedule()
    assert rows(b)["q"] == [4, 4, 1] and b.block_tables.tolist() == [[0], [1], [2]]
    s.update(b, np.array([10, 20, 30]))

    b = s.schedule()
    assert rows(b) == {"req_ids": [0], "q": [1], "c": [4], "prefill": [False], "logits": [0]}
    # r2 freed block 2, then r1 block 1: the queue's front is 2
    assert b.block_tables.tolist() == [[0, 2]]
    assert s.stats.num_preempted == 2 and s.stats.num_waiting == 2 and s.stats.kv_blocks_used == 2
    out = s.update(b, np.array([11]))
    assert out.preempted_req_ids.tolist() == [2, 1] and out.freed_blocks.tolist() == [2, 1]

    # r1 (front of the queue: it was admitted before r2) needs 2 blocks for its prompt and
    # output (5 tokens); 1 is free: FCFS, nobody is admitted until r0 finishes.
    for token in (12, 13):
        b = s.schedule()
        assert b.req_ids.tolist() == [0] and s.stats.num_preempted == 0
        out = s.update(b, np.array([token]))
    assert out.finished_req_ids.tolist() == [0] and out.freed_blocks.tolist() == [2, 0]

    # Readmitted, r1 prefills its prompt and its output (5 tokens, from position 0), r2 its
    # prompt and output (2 tokens); the free queue is [1, 2, 0].
    b = s.schedule()
    assert rows(b) == {"req_ids": [1, 2], "q": [5, 2], "c": [0, 0], "prefill": [True, True],
                       "logits": [4, 6]}
    assert b.prompt_lens.tolist() == [5, 2]
    assert b.input_ids.tolist() == prompt(1, 4).tolist() + [20] + prompt(2, 1).tolist() + [30]
    assert b.block_tables.tolist() == [[1, 2], [0, 0]]
    s.update(b, np.array([21, 31]))
    while not s.done:
        b = s.schedule()
        s.update(b, np.array([50 + i for i in range(len(b.logits_indices))]))
    assert s.outputs()[1][:2] == [20, 21] and s.outputs()[2][:2] == [30, 31]
    assert s.request_timing()[1]["first_token_step"] == 0  # its first token stays its first
    assert s.timing_columns()["num_preemptions"].tolist() == [0, 1, 1]
    assert s.kv.num_free_blocks == 3


def test_admission_waits_fifo_for_blocks():
    # 3 blocks of 4: r0's 8-token prompt takes 2; r1 (5 tokens: 2 blocks) does not fit the
    # one left, and r2 (1 token: 1 block) would, but may not pass r1 (FCFS).
    s = scheduler([8, 5, 1], [1, 1, 1], budget=16, num_blocks=3, block_size=4)
    b = s.schedule()
    assert b.req_ids.tolist() == [0] and b.block_tables.tolist() == [[0, 1]]
    assert s.stats.num_waiting == 2
    s.update(b, np.array([1]))  # r0 done: its one output
    b = s.schedule()
    assert b.req_ids.tolist() == [1, 2] and b.num_scheduled_tokens.tolist() == [5, 1]


def test_prefix_hits_become_continued_prefills():
    # block_size 2: r0 = [1,2,3,4,5] caches blocks [1,2] and [1,2][3,4] after step 0, and
    # [..][5,a] once it decodes a; r1 = [1,2,3,4,9,9] arrives at step 3 and finds 2 blocks.
    p0, p1, p2 = [1, 2, 3, 4, 5], [1, 2, 3, 4, 9, 9], [1, 2, 3, 4]
    reqs = [Request(0, np.array(p0), 2, 0), Request(1, np.array(p1), 1, 3), Request(2, np.array(p2), 1, 3)]
    kv = KVCacheManager(num_blocks=16, block_size=2, prefix_caching=True)
    s = Scheduler(reqs, max_num_batched_tokens=64, max_num_seqs=4, kv=kv)
    b = s.schedule()
    assert b.block_tables.tolist() == [[0, 1, 2]]
    s.update(b, np.array([7]))
    assert kv.num_cached_blocks == 2  # the two full prompt blocks
    b = s.schedule()
    s.update(b, np.array([8]))  # r0 done: [5, 7] filled block 2 too; all three are free, cached
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 16
    assert s.schedule() is None  # step 2: nothing arrived
    b = s.schedule()
    # r1: 2 blocks (4 tokens) found; r2 = [1,2,3,4]: at most 3 tokens may hit, so 1 block
    assert rows(b) == {"req_ids": [1, 2], "q": [2, 2], "c": [4, 2], "prefill": [True, True],
                       "logits": [1, 3]}
    assert b.input_ids.tolist() == [9, 9, 3, 4]
    assert b.block_tables.tolist() == [[0, 1, 3], [0, 4, 0]]
    assert s.stats.prefix_hit_tokens == 6 and s.stats.prefix_query_tokens == 10
    assert kv.ref_counts()[[0, 1, 3, 4]].tolist() == [2, 1, 1, 1]
    s.update(b, np.array([1, 2]))
    assert s.done and kv.num_free_blocks == 16 and kv.ref_counts().sum() == 0
    assert s.timing_columns()["prefix_hit_tokens"].tolist() == [0, 4, 2]


@pytest.mark.parametrize("reads_next", [False, True])
def test_a_drafter_reading_the_next_token_reuses_only_blocks_written_before_its_own(reads_next):
    # block_size 2. Step 0: r0 = [1 2 3 4 5 6 7] and r1 = [1 2 3 4 8 9 7] prefill together;
    # r0's copies of [1 2] and [3 4] are cached (r0 is admitted first), then r0's [5 6] and
    # r1's [8 9]. Step 2: r2 = r1's prompt + [7] finds r0's [1 2], r0's [3 4], r1's [8 9];
    # r3 = [1 2 3 4 5 9 9] finds r0's [1 2], [3 4].
    # A drafter whose entry at p reads the token at p + 1 (MTP) may reuse a block only if it
    # was written followed by this request's next block, and not the last one found (its
    # last entry read a token outside the hit):
    # - r2: [1 2] was followed by [3 4] (r2's too), [3 4] by r0's 5, not 8: 2 tokens;
    # - r3: [1 2] by [3 4], and [3 4] is the last one found: 2 tokens.
    # Without such a drafter: 6 and 4.
    prompts = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 8, 9, 7], [1, 2, 3, 4, 8, 9, 7, 7], [1, 2, 3, 4, 5, 9, 9]]
    reqs = [Request(i, np.array(p), 3 if i < 2 else 1, 0 if i < 2 else 2) for i, p in enumerate(prompts)]
    kv = KVCacheManager(num_blocks=32, block_size=2, prefix_caching=True)
    s = Scheduler(reqs, max_num_batched_tokens=64, max_num_seqs=4, kv=kv, draft_kv_reads_next_token=reads_next)
    for _ in range(2):
        b = s.schedule()
        s.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
    first_blocks = kv.blocks_of(0)[:2]
    b = s.schedule()
    assert b.req_ids.tolist() == [0, 1, 2, 3]
    hits = [2, 2] if reads_next else [6, 4]
    assert b.num_computed_tokens[2:].tolist() == hits
    assert s.stats.prefix_hit_tokens == sum(hits) and s.stats.prefix_query_tokens == 8 + 7
    # the blocks taken are r0's first ones; the rest is r2's and r3's own, written this step
    assert (b.block_tables[2:, :1] == first_blocks[0]).all()
    if reads_next:
        assert not np.isin(b.block_tables[2:, 1:4], kv.blocks_of(0)).any()
    s.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
    assert s.timing_columns()["prefix_hit_tokens"].tolist() == [0, 0, *hits]


def test_zero_token_rows_and_drafts_cut_by_budget():
    s = scheduler([1, 1, 1], [5, 5, 5], budget=3, k=2)
    b = s.schedule()
    assert rows(b)["q"] == [1, 1, 1] and rows(b)["logits"] == [0, 1, 2]
    s.update(b, np.array([10, 20, 30]))
    s.set_draft_tokens(b, np.array([[11, 12], [21, 22], [31, 32]]))

    b = s.schedule()  # r0 takes 1 + 2 drafts = the whole budget; r1, r2 get 0 tokens
    assert rows(b) == {"req_ids": [0, 1, 2], "q": [3, 0, 0], "c": [1, 1, 1],
                       "prefill": [False, False, False], "logits": [0, 1, 2]}
    assert b.num_draft_tokens.tolist() == [2, 0, 0]
    assert b.input_ids.tolist() == [10, 11, 12] and b.positions.tolist() == [1, 2, 3]
    out = s.update(b, np.array([11, 12, 13]))
    assert out.num_accepted.tolist() == [2, 0, 0] and out.new_token_ids == {0: [11, 12, 13]}

    b = s.schedule()  # drafts were cleared by update: plain decodes, everyone fits
    assert rows(b)["q"] == [1, 1, 1] and rows(b)["c"] == [4, 1, 1]
    assert b.input_ids.tolist() == [13, 20, 30]
    with pytest.raises(RuntimeError, match="not updated"):
        s.schedule()


def _spec_setup(max_out=6):
    s = scheduler([3], [max_out], budget=16, k=3)
    b = s.schedule()
    s.update(b, np.array([100]))
    s.set_draft_tokens(b, np.array([[101, 102, 103]]))
    b = s.schedule()
    assert b.input_ids.tolist() == [100, 101, 102, 103]
    assert b.positions.tolist() == [3, 4, 5, 6]
    assert b.logits_indices.tolist() == [0, 1, 2, 3] and b.num_draft_tokens.tolist() == [3]
    return s, b


def test_spec_full_acceptance_then_drafts_cut_at_output_limit():
    s, b = _spec_setup(max_out=6)
    out = s.update(b, np.array([101, 102, 103, 104]))
    assert out.num_accepted.tolist() == [3] and out.num_proposed.tolist() == [3]
    assert out.new_token_ids == {0: [101, 102, 103, 104]}
    s.set_draft_tokens(b, np.array([[105, 106, 107]]))
    b = s.schedule()  # 5 of 6 outputs: one token left, so no room for drafts
    assert b.num_draft_tokens.tolist() == [0] and b.input_ids.tolist() == [104]
    assert b.positions.tolist() == [7]  # prompt 3 + outputs 5 - 1
    out = s.update(b, np.array([105]))
    assert out.finished_req_ids.tolist() == [0] and out.freed_blocks.size > 0
    assert s.outputs()[0] == [100, 101, 102, 103, 104, 105] and s.done


def test_spec_partial_acceptance_rolls_back():
    s, b = _spec_setup()
    out = s.update(b, np.array([101, 999, 5, 6]))  # 101 matches, 102 != 999
    assert out.num_accepted.tolist() == [1] and out.new_token_ids == {0: [101, 999]}
    b = s.schedule()  # the rejected drafts' positions (5, 6) are recomputed from 5
    assert b.input_ids.tolist() == [999] and b.num_computed_tokens.tolist() == [5]


def test_spec_zero_acceptance():
    s, b = _spec_setup()
    out = s.update(b, np.array([777, 102, 103, 104]))  # agrees later, but the first differs
    assert out.num_accepted.tolist() == [0] and out.new_token_ids == {0: [777]}
    b = s.schedule()
    assert b.input_ids.tolist() == [777] and b.num_computed_tokens.tolist() == [4]


def test_drafts_with_padding_and_order_errors():
    s = scheduler([3], [8], budget=16, k=3)
    b = s.schedule()
    with pytest.raises(RuntimeError, match="follows update"):
        s.set_draft_tokens(b, np.array([[1, 2, 3]]))
    s.update(b, np.array([100]))
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        s.set_draft_tokens(b, np.array([[1, 2, 3, 4]]))
    s.set_draft_tokens(b, np.array([[101, -1, 102]]))  # only the leading proposal counts
    b = s.schedule()
    assert b.input_ids.tolist() == [100, 101] and b.num_draft_tokens.tolist() == [1]
    with pytest.raises(ValueError, match="one sampled token per logits index"):
        s.update(b, np.array([1]))


def test_mid_prompt_rows_ignore_drafts():
    s = scheduler([6], [2], budget=4, k=2)
    b = s.schedule()
    s.update(b, np.zeros(0, dtype=np.int64))
    s.set_draft_tokens(b, np.array([[1, 2]]))
    b = s.schedule()
    assert b.is_prefilling.tolist() == [True] and b.num_draft_tokens.tolist() == [0]
    assert b.num_scheduled_tokens.tolist() == [2]


def test_accept_drafts_on_a_mixed_batch():
    # rows: a finishing prefill chunk (3 tokens), decode with 2 drafts, decode with 1 draft,
    # a decode with no budget (0 tokens), a chunk stopping mid-prompt (2 tokens)
    batch = GlobalBatch(
        step=0,
        req_ids=np.array([0, 1, 2, 3, 4]),
        num_scheduled_tokens=np.array([3, 3, 2, 0, 2]),
        num_computed_tokens=np.array([0, 9, 4, 6, 0]),
        is_prefilling=np.array([True, False, False, False, True]),
        prompt_lens=np.array([3, 5, 4, 6, 9]),
        input_ids=np.array([1, 2, 3, 40, 41, 42, 50, 51, 7, 8]),
        block_tables=np.zeros((5, 1), dtype=np.int64),
        logits_indices=np.array([2, 3, 4, 5, 6, 7]),
        num_draft_tokens=np.array([0, 2, 1, 0, 0]),
    )
    # samples: prefill -> 9; row 1 -> [41, 99, x] (accepts draft 41, rejects 42); row 2 -> [51, 52]
    acc = accept_drafts(batch, np.array([9, 41, 99, 5, 51, 52]))
    assert acc.num_accepted.tolist() == [0, 1, 1, 0, 0]
    assert acc.num_new_tokens.tolist() == [1, 2, 2, 0, 0]
    assert acc.sample_start.tolist() == [0, 1, 4, 6, 6]


def test_requests_that_never_fit_are_reported_up_front():
    kv = KVCacheManager(num_blocks=2, block_size=4)
    reqs = requests([5, 6, 1], [3, 3, 1])  # 8, 9 (> 8 = 2 blocks) and 2 tokens
    lens = ([len(r.prompt_token_ids) for r in reqs], [r.max_output_tokens for r in reqs])
    (p,) = kv.fit_problems(*lens)
    assert p.field == "kv.num_blocks" and p.given == 2
    assert "request 1 needs 3 blocks" in p.allowed
    assert kv.fit_problems([5], [3], num_speculative_tokens=1)[0].allowed.startswith(
        "workload request 0 needs 3 blocks"
    )
    # a per-request cap below the cache is the limit too, and is named
    capped = KVCacheManager(num_blocks=10, block_size=4, max_blocks_per_req=2)
    (p,) = capped.fit_problems(*lens)
    assert "request 1 needs 3 blocks" in p.allowed and "max_blocks_per_req, 2" in p.allowed
    with pytest.raises(ConfigError, match="kv.num_blocks"):
        Scheduler(reqs, max_num_batched_tokens=8, max_num_seqs=2, kv=kv)


# -- property: batching changes nothing -----------------------------------------------------

V = 7  # small: random drafts sometimes match by chance


def fake_model(seq):
    """Next token of a token sequence: depends on every token and its position."""
    return int(sum((j + 1) * t for j, t in enumerate(seq)) % V)


def reference(req):
    seq, out = req.prompt_token_ids.tolist(), []
    for _ in range(req.max_output_tokens):
        out.append(fake_model(seq))
        seq.append(out[-1])
    return out


def _prompts(spec, shared):
    """Prompts over a tiny alphabet; with ``shared``, each starts with a common stem, so that
    prefix caching finds blocks of other requests."""
    stem = [(3 * j + 1) % V for j in range(24)]
    return [np.array((stem[: min(p, s)] if shared else []) + [(i + 2 * j) % V for j in range(p - (min(p, s) if shared else 0))],
                     dtype=np.int64) for i, (p, s) in enumerate(spec)]


@settings(max_examples=150, deadline=None)
# NOTE: request 2's cached_lens prefix (1 token) is a prefix hit at admission (step 1, where it
# samples its first token); preempted, readmitted, it prefilled that prefix again and its clock
# started at step 4, after its first token (fixed: a hit holding the prefix starts it at entry)
@example(spec=[(1, 3, 0, 0), (1, 1, 0, 0), (3, 4, 1, 1), (1, 4, 0, 0)], budget=4, seqs=3, block_size=1,
         extra_blocks=0, k=0, prefix_caching=True, draft_seed=0, reads_next=False)
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(0, 3), st.integers(0, 20)),
        min_size=1, max_size=6,
    ),
    budget=st.integers(1, 16),
    seqs=st.integers(1, 4),
    block_size=st.integers(1, 4),
    extra_blocks=st.integers(0, 4),
    k=st.integers(0, 3),
    prefix_caching=st.booleans(),
    draft_seed=st.integers(0, 2**16),
    reads_next=st.booleans(),
)
def test_batched_run_matches_unbatched_reference(spec, budget, seqs, block_size, extra_blocks, k,
                                                 prefix_caching, draft_seed, reads_next):
    """Whatever the batching, preemptions (few blocks) and prefix hits: every request's
    outputs are the unbatched reference's; every position a step attends to holds, in the
    request's blocks, the token recomputation would write there (so a hit or a shared block
    holds exactly the request's own prefix); a block being written belongs to its writer
    alone; every block comes back. ``reads_next``: a drafter's own cache whose entry at p
    holds the token at p and the one after it (MTP's) holds, where a step attends, the
    request's own next token too (a hit never reuses an entry that read another's)."""
    prompts = _prompts([(p, s) for p, _, _, s in spec], shared=prefix_caching)
    # every third request has a cached_lens prefix (prefilled first, then its clock starts)
    reqs = [Request(i, prompts[i], o, a, cached_len=(len(prompts[i]) - 1) // 2 if i % 3 == 2 else 0)
            for i, (_, o, a, _) in enumerate(spec)]
    need = max(-(-(len(r.prompt_token_ids) + r.max_output_tokens + k) // block_size) for r in reqs)
    kv = KVCacheManager(num_blocks=need + extra_blocks, block_size=block_size, prefix_caching=prefix_caching)
    s = Scheduler(reqs, max_num_batched_tokens=budget, max_num_seqs=seqs, kv=kv,
                  num_speculative_tokens=k, draft_kv_reads_next_token=reads_next)
    ref = {r.req_id: reference(r) for r in reqs}
    rng = np.random.default_rng(draft_seed)
    slot = {}  # the fake model's KV cache: (block, offset) -> token written there
    draft_slot = {}  # the fake drafter's: (block, offset) -> (token, the token after it)
    for _ in range(3000):
        if s.done:
            break
        b = s.schedule()
        if b is None:
            continue
        assert b.num_tokens <= budget and b.num_reqs <= seqs
        outs = s.outputs()
        refs = kv.ref_counts()
        for i, rid in enumerate(b.req_ids.tolist()):
            req = reqs[rid]
            c, q = int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
            history = req.prompt_token_ids.tolist() + outs[rid]
            if b.is_prefilling[i]:  # its prompt, or (readmitted) its prompt and outputs
                assert b.prompt_lens[i] <= len(history) and c + q <= b.prompt_lens[i]
            else:
                assert c == len(history) - 1
            table = b.block_tables[i]
            assert c + q <= kv.num_blocks_of(rid) * kv.tokens_per_block
            # what it attends to: its prefix, as recomputation would write it
            cached = [slot.get((int(table[p // block_size]), p % block_size)) for p in range(c)]
            assert cached == history[:c], (rid, c)
            if reads_next or not prefix_caching:
                drafted = [draft_slot.get((int(table[p // block_size]), p % block_size)) for p in range(c)]
                assert drafted == list(itertools.pairwise(history[:c + 1])), (rid, c)
            toks = b.input_ids[b.query_start_loc[i]:b.query_start_loc[i + 1]].tolist()
            if b.is_prefilling[i]:
                assert toks == history[c:c + q]
            elif q:
                assert toks[0] == history[c]  # the newest token, then drafts
            for j, t in enumerate(toks):
                block = int(table[(c + j) // block_size])
                assert refs[block] == 1, "a written block is shared"
                slot[(block, (c + j) % block_size)] = t
        sampled = []
        for t in b.logits_indices.tolist():
            row = int(b.req_indices[t])
            table, pos = b.block_tables[row], int(b.positions[t])
            sampled.append(fake_model([slot[(int(table[p // block_size]), p % block_size)] for p in range(pos + 1)]))
        # the drafter's entry of each token: the token after it is the sample taken there, else
        # the next input token, else (a chunk's last) the sequence's next token
        sample_at = dict(zip(b.logits_indices.tolist(), sampled))
        for i, rid in enumerate(b.req_ids.tolist()):
            start, end = int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])
            c, table = int(b.num_computed_tokens[i]), b.block_tables[i]
            history = reqs[rid].prompt_token_ids.tolist() + outs[rid]
            for g in range(start, end):
                after = sample_at.get(g, int(b.input_ids[g + 1]) if g + 1 < end else None)
                p = c + g - start
                draft_slot[(int(table[p // block_size]), p % block_size)] = (
                    int(b.input_ids[g]), history[p + 1] if after is None else after)
        s.update(b, np.array(sampled, dtype=np.int64))
        if k:
            # a drafter that knows the answer but errs: each proposal is wrong w.p. 0.4,
            # and proposals sometimes stop early (-1); full proposals crowd the budget
            outs = s.outputs()
            drafts = np.full((b.num_reqs, k), -1, dtype=np.int64)
            for i, rid in enumerate(b.req_ids.tolist()):
                truth = ref[rid][len(outs[rid]):len(outs[rid]) + k]
                n = k if rng.random() < 0.7 else rng.integers(0, k + 1)
                guess = [t if rng.random() > 0.4 else int(rng.integers(0, V)) for t in truth[:n]]
                drafts[i, : len(guess)] = guess
            s.set_draft_tokens(b, drafts)
    assert s.done
    cols = s.timing_columns()
    event(f"preempted: {bool(cols['num_preemptions'].any())}, prefix hit: {bool(cols['prefix_hit_tokens'].any())}")
    assert s.outputs() == ref
    assert kv.num_free_blocks == kv.num_blocks and not kv.ref_counts().any()
    for rid, t in s.request_timing().items():
        assert t["num_output_tokens"] == reqs[rid].max_output_tokens
        assert t["admitted_step"] <= t["first_token_step"] <= t["finish_step"]
        assert t["arrival_step"] <= t["first_token_step"]
