"""pcpflow.speculative's bookkeeping helpers: hand-worked batches, and agreement with the
scheduler's own state over random spec-decode runs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow import spec
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import Request

PROMPTS = {
    7: np.array([10, 11, 12, 13, 14, 15]),
    8: np.array([20, 21, 22]),
    9: np.arange(5) + 90,
    10: np.arange(6) + 80,
    11: np.arange(7) + 70,
}


def hand_worked_batch() -> tuple[GlobalBatch, np.ndarray]:
    """Five rows, one of each kind:

    row 0, req 7: prompt chunk [10 11 12] of 6 tokens (positions 0-2): no sample
    row 1, req 8: last prompt chunk [21 22] (positions 1-2): samples 30 after 22
    row 2, req 9: verify row [40 | 41 42] (positions 5-7): samples [41 50 51] -> accepts 41,
                  rejects 42 (the target says 50)
    row 3, req 10: a decode left without budget (0 tokens)
    row 4, req 11: a decode without drafts [60] (position 7): samples 61
    """
    batch = GlobalBatch(
        step=3,
        req_ids=np.array([7, 8, 9, 10, 11]),
        num_scheduled_tokens=np.array([3, 2, 3, 0, 1]),
        num_computed_tokens=np.array([0, 1, 5, 6, 7]),
        is_prefilling=np.array([True, True, False, False, False]),
        prompt_lens=np.array([6, 3, 5, 6, 7]),
        input_ids=np.array([10, 11, 12, 21, 22, 40, 41, 42, 60]),
        block_tables=np.zeros((5, 4), dtype=np.int64),
        logits_indices=np.array([4, 5, 6, 7, 8]),
        num_draft_tokens=np.array([0, 0, 2, 0, 0]),
    )
    return batch, np.array([30, 41, 50, 51, 61])


def test_next_token_ids_hand_worked():
    batch, sampled = hand_worked_batch()
    # prompt tokens -> the next prompt token (across the chunk end: PROMPTS[7][3] = 13);
    # sampled tokens -> the sample: 30 after the prompt, 41 (== the accepted draft), then
    # 50 (the target's correction) and 51 after the rejected draft (never used), 61.
    assert spec.next_token_ids(batch, sampled, PROMPTS).tolist() == [
        11,
        12,
        13,
        22,
        30,
        41,
        50,
        51,
        61,
    ]
    # Without the prompts, the successor of an unfinished chunk is unknown.
    assert spec.next_token_ids(batch, sampled).tolist() == [11, 12, -1, 22, 30, 41, 50, 51, 61]


def test_draft_start_hand_worked():
    batch, sampled = hand_worked_batch()
    start = spec.draft_start(batch, sampled)
    assert start.rows.tolist() == [1, 2, 4]  # rows that sampled; not the chunk, not the idle decode
    assert start.num_accepted.tolist() == [0, 1, 0]
    # last accepted token: req 8's last prompt token (4); req 9's accepted draft 41 (6); 60 (8)
    assert start.last_token_indices.tolist() == [4, 6, 8]
    assert start.next_token_ids.tolist() == [30, 50, 61]
    # the newest token's position = the KV the request holds after this step:
    # 3 prompt tokens; 5 + 1 + 1 accepted; 7 + 1
    assert start.next_positions.tolist() == [3, 7, 8]


def test_scatter_proposals_fills_the_other_rows_with_minus_one():
    out = spec.scatter_proposals(4, np.array([0, 2]), np.array([[5, 6], [7, 8]]))
    assert out.tolist() == [[5, 6], [-1, -1], [7, 8], [-1, -1]]
    assert (
        spec.scatter_proposals(3, np.zeros(0, np.int64), np.zeros((0, 2))).tolist()
        == [[-1, -1]] * 3
    )


def _seq_model(req_id: int, token: int, position: int, vocab: int) -> int:
    """A stand-in target: a deterministic next token."""
    return (7 * token + 3 * position + req_id) % vocab


@settings(max_examples=40, deadline=None)
@given(
    prompt_lens=st.lists(st.integers(1, 20), min_size=1, max_size=5),
    out_len=st.integers(1, 9),
    budget=st.integers(4, 24),
    k=st.integers(1, 4),
    p_right=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**16),
)
def test_draft_start_and_next_tokens_agree_with_the_scheduler(
    prompt_lens, out_len, budget, k, p_right, seed
):
    """Over random spec-decode runs (a stand-in target, drafts right with probability
    p_right): each drafting row's newest token and position are what the scheduler puts
    first in that request's next verify row, and every token's successor (up to the last
    accepted one) is the request's actual next token."""
    vocab, rng = 50, np.random.default_rng(seed)
    reqs = [Request(i, rng.integers(0, vocab, n), out_len, 0) for i, n in enumerate(prompt_lens)]
    prompts = {r.req_id: r.prompt_token_ids for r in reqs}
    sched = Scheduler(
        reqs,
        max_num_batched_tokens=budget,
        max_num_seqs=3,
        kv=KVCacheManager(256, 4),
        num_speculative_tokens=k,
    )
    expect: dict[int, tuple[int, int]] = {}  # req_id -> (position, token) of its next row
    pending: list[tuple[int, int, int]] = []  # (req_id, position, successor) to check at the end
    while not sched.done:
        b = sched.schedule()
        if b is None:
            continue
        for r, (rid, q) in enumerate(zip(b.req_ids.tolist(), b.num_scheduled_tokens.tolist())):
            if rid in expect and q > 0:
                assert (b.num_computed_tokens[r], b.input_ids[b.query_start_loc[r]]) == expect.pop(
                    rid
                )
        li = b.logits_indices
        sampled = np.array(
            [
                _seq_model(
                    int(b.req_ids[b.req_indices[i]]),
                    int(b.input_ids[i]),
                    int(b.positions[i]),
                    vocab,
                )
                for i in li
            ],
            dtype=np.int64,
        )
        start = spec.draft_start(b, sampled)
        succ = spec.next_token_ids(b, sampled, prompts)
        accepted_end = b.query_start_loc[:-1] + np.where(
            b.is_prefilling, b.num_scheduled_tokens - 1, 0
        )
        accepted_end[start.rows] = start.last_token_indices
        for i in range(b.num_tokens):
            r = b.req_indices[i]
            if i <= accepted_end[r]:
                pending.append((int(b.req_ids[r]), int(b.positions[i]) + 1, int(succ[i])))
        sched.update(b, sampled)
        drafts = np.full((b.num_reqs, k), -1, dtype=np.int64)
        for row, tok, pos in zip(
            start.rows.tolist(), start.next_token_ids.tolist(), start.next_positions.tolist()
        ):
            rid = int(b.req_ids[row])
            expect[rid] = (pos, tok)
            for j in range(k):  # the true continuation, each draft wrong with 1 - p_right
                tok = _seq_model(rid, tok, pos + j, vocab)
                drafts[row, j] = tok if rng.random() < p_right else (tok + 1) % vocab
        sched.set_draft_tokens(b, drafts)
    outputs = sched.outputs()
    for rid, pos, successor in pending:
        seq = np.concatenate([prompts[rid], outputs[rid]])
        if pos < len(seq):
            assert successor == seq[pos], (rid, pos)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["draft=self", "draft.error_rate=1.5"], "draft.error_rate"),
        (["draft=dspark", "draft.target_layers=[0,7]"], "draft.target_layers"),
        (["draft=mtp", "draft.num_speculative_tokens=0"], "draft.num_speculative_tokens"),
        (["draft=mtp", "+draft.bogus=1"], "draft.bogus"),
    ],
)
def test_bad_draft_settings_name_the_field(overrides, field):
    from pcpflow.errors import ConfigError
    from pcpflow.testing import compose

    with pytest.raises(ConfigError) as err:
        compose(overrides)
    assert field in err.value.report()


def test_a_plugin_drafter_brings_its_own_num_speculative_tokens():
    """`pipeline.draft.kind=<plugin kind>` alone: the scheduler reserves and verifies what
    the stage's Config says (its default), not 0."""
    from pcpflow.testing import compose

    base = ["plugins=[pcpflow_test_plugins.toy_drafter]", "pipeline.draft.kind=toy_repeat"]
    assert (
        compose(base).num_speculative_tokens
        == spec.DraftConfig.model_fields["num_speculative_tokens"].default
    )
    assert compose(base + ["+pipeline.draft.num_speculative_tokens=4"]).num_speculative_tokens == 4
    assert compose(["draft=self"]).num_speculative_tokens == 3  # conf/draft/self.yaml
    assert compose([]).num_speculative_tokens == 0


@pytest.mark.parametrize(
    "overrides, reads_next",
    [
        ([], False),  # no drafter
        (["draft=mtp"], True),  # its row at p embeds the token at p + 1
        (["draft=self"], False),  # the target's own cache: positions <= p
        (["draft=dspark"], False),  # context entries of the target's hidden at p
        (["plugins=[pcpflow_test_plugins.toy_drafter]", "pipeline.draft.kind=toy_repeat"], False),  # no cache
    ],
)
def test_only_a_drafter_whose_entries_read_the_next_token_gives_up_prefix_hits(overrides, reads_next):
    """What the scheduler is told (``Scheduler(draft_kv_reads_next_token=...)``, from the
    draft stage's Config): only such a drafter makes a prefix hit recompute blocks."""
    from pcpflow.pipeline.assemble import resolve_pipeline
    from pcpflow.speculative.drafting import draft_kv_reads_next_token
    from pcpflow.testing import compose

    assert draft_kv_reads_next_token(resolve_pipeline(compose(overrides))) is reads_next
