import numpy as np
import pytest
from hypothesis import given, settings
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
    # 5 + 3 = 8 tokens = 2 blocks for r0; 12 + 2 = 14 tokens = 4 blocks for r1
    assert b.block_tables.tolist() == [[0, 1, 0, 0], [2, 3, 4, 5]]
    out = s.update(b, np.array([50]))
    assert out.new_token_ids == {0: [50]} and out.first_token.tolist() == [0]
    assert out.num_new_tokens == 1

    b = s.schedule()  # r0 decodes its token 50; r1 gets the other 7
    assert rows(b) == {"req_ids": [0, 1], "q": [1, 7], "c": [5, 3], "prefill": [False, True],
                       "logits": [0]}
    assert b.input_ids.tolist() == [50] + p1[3:10].tolist()
    assert b.positions.tolist() == [5, 3, 4, 5, 6, 7, 8, 9]
    s.update(b, np.array([51]))

    b = s.schedule()  # r1's last 2 prompt tokens reach its end: its last token is sampled
    assert rows(b) == {"req_ids": [0, 1], "q": [1, 2], "c": [6, 10], "prefill": [False, True],
                       "logits": [0, 2]}
    assert b.input_ids.tolist() == [51] + p1[10:].tolist()
    out = s.update(b, np.array([52, 60]))
    assert out.finished_req_ids.tolist() == [0] and out.freed_blocks.tolist() == [0, 1]
    assert out.first_token.tolist() == [1]
    assert out.new_token_ids == {0: [52], 1: [60]}

    b = s.schedule()
    assert rows(b) == {"req_ids": [1], "q": [1], "c": [12], "prefill": [False], "logits": [0]}
    assert b.input_ids.tolist() == [60]
    out = s.update(b, np.array([61]))
    assert out.finished_req_ids.tolist() == [1] and sorted(out.freed_blocks.tolist()) == [2, 3, 4, 5]
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


def test_admission_needs_budget_and_waits_fifo_for_kv_blocks():
    # block_size 4, 3 blocks: each request reserves 4 + 4 = 8 tokens = 2 blocks, so only
    # one runs at a time; r2 (1 block) must not overtake r1 (FIFO).
    s = scheduler([4, 4, 1], [4, 4, 3], budget=16, num_blocks=3, block_size=4)
    trace = []
    while not s.done:
        b = s.schedule()
        trace.append((b.step, b.req_ids.tolist(), b.block_tables.tolist()))
        out = s.update(b, np.ones(len(b.logits_indices), dtype=np.int64))
        if out.finished_req_ids.size:
            trace.append(("freed", out.freed_blocks.tolist()))
    assert trace[:4] == [(0, [0], [[0, 1]]), (1, [0], [[0, 1]]), (2, [0], [[0, 1]]),
                         (3, [0], [[0, 1]])]
    assert trace[4] == ("freed", [0, 1])
    # r1 then takes the lowest free blocks; r2 (4 tokens = 1 block) fits beside it
    assert trace[5] == (4, [1, 2], [[0, 1], [2, 0]])


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


@settings(max_examples=60, deadline=None)
@given(
    spec=st.lists(
        st.tuples(st.integers(1, 20), st.integers(1, 8), st.integers(0, 6)), min_size=1, max_size=6
    ),
    budget=st.integers(1, 16),
    seqs=st.integers(1, 4),
    block_size=st.integers(1, 4),
    extra_blocks=st.integers(0, 10),
    k=st.integers(0, 3),
    draft_seed=st.integers(0, 2**16),
)
def test_batched_run_matches_unbatched_reference(spec, budget, seqs, block_size, extra_blocks, k,
                                                 draft_seed):
    reqs = [Request(i, np.arange(p, dtype=np.int64) % V, o, a) for i, (p, o, a) in enumerate(spec)]
    need = max(-(-(p + o + k) // block_size) for p, o, _ in spec)
    kv = KVCacheManager(num_blocks=need + extra_blocks, block_size=block_size)
    s = Scheduler(reqs, max_num_batched_tokens=budget, max_num_seqs=seqs, kv=kv,
                  num_speculative_tokens=k)
    ref = {r.req_id: reference(r) for r in reqs}
    rng = np.random.default_rng(draft_seed)
    written = {r.req_id: [] for r in reqs}  # the fake model's KV cache: token per position
    prefill_end = {r.req_id: 0 for r in reqs}
    for _ in range(2000):
        if s.done:
            break
        b = s.schedule()
        if b is None:
            continue
        assert b.num_tokens <= budget and b.num_reqs <= seqs
        outs = s.outputs()
        held = set()
        for i, rid in enumerate(b.req_ids.tolist()):
            req = reqs[rid]
            c, q = int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
            history = req.prompt_token_ids.tolist() + outs[rid]
            # positions continue where the request's committed tokens end
            if b.is_prefilling[i]:
                assert c == prefill_end[rid] and c + q <= req.prompt_len
                prefill_end[rid] = c + q
            else:
                assert c == len(history) - 1
            assert c <= len(written[rid]) and written[rid][:c] == history[:c]
            toks = b.input_ids[b.query_start_loc[i]:b.query_start_loc[i + 1]].tolist()
            if b.is_prefilling[i]:
                assert toks == history[c:c + q]
            elif q:
                assert toks[0] == history[c]  # the newest token, then drafts
            written[rid] = written[rid][:c] + toks
            # the reserved blocks cover every written position, and no block is shared
            nblk = kv.num_blocks_of(rid)
            assert c + q <= nblk * kv.tokens_per_block
            blocks = set(b.block_tables[i, :nblk].tolist())
            assert not blocks & held
            held |= blocks
        sampled = [
            fake_model(written[int(b.req_ids[b.req_indices[t]])][: b.positions[t] + 1])
            for t in b.logits_indices.tolist()
        ]
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
    assert s.outputs() == ref
    assert kv.num_free_blocks == kv.num_blocks
    for rid, t in s.request_timing().items():
        assert t["num_output_tokens"] == reqs[rid].max_output_tokens
        assert t["arrival_step"] <= t["admitted_step"] <= t["first_token_step"] <= t["finish_step"]
