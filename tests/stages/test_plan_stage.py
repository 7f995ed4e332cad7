"""stages/plan.py (``dual_chunk_swap``): the layout of the step, worked by hand."""

from __future__ import annotations

from stage_ctx import context, first_state, stage

# One prompt of 8 tokens and one of 3 at pcp=2: the 8 are cut into 2P = 4 chunks of 2,
# rank 0 takes chunks 0 and 3 (positions 0 1 6 7), rank 1 chunks 1 and 2 (2 3 4 5); the 3
# are cut into chunks of 1 (the last one empty): rank 0 takes position 0, rank 1 1 and 2.
BASE = ["pcp=2", "workload=explicit", "workload.prompt_lens=[8,3]", "workload.output_lens=[2]"]


def test_dual_chunk_swap_by_hand():
    ctx = context(BASE, rank=1)
    layout = stage("dual_chunk_swap", "plan", ctx)(first_state(ctx)).layout
    assert layout.per_rank_num_tokens.tolist() == [5, 6]
    assert layout.padded_num_tokens == 6
    # gathered rows (rank-major, each rank padded to 6): global token of each row
    gather = layout.padded_gather_idx.reshape(2, 6)
    assert gather[0, :5].tolist() == [0, 1, 6, 7, 8] and layout.is_padding.reshape(2, 6)[0].tolist() == [0] * 5 + [1]
    assert gather[1].tolist() == [2, 3, 4, 5, 9, 10]


def test_capture_sizes_pad_every_rank_to_the_next_size():
    # The largest rank holds 6 rows: the next capture size is 8 (vLLM's dispatch).
    ctx = context(BASE + ["cudagraph_mode=piecewise", "cudagraph_capture_sizes=[4,8,16]"])
    layout = stage("dual_chunk_swap", "plan", ctx)(first_state(ctx)).layout
    assert layout.padded_num_tokens == 8 and layout.per_rank_num_tokens.tolist() == [5, 6]
    assert int(layout.is_padding.sum()) == 16 - 11
