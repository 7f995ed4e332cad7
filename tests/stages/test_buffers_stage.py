"""stages/buffers.py (``persistent``): the rank-local batch in preallocated buffers,
worked by hand for PCP rank 1 of 2."""

from __future__ import annotations

import torch
from stage_ctx import context, first_state, stage

BASE = ["pcp=2", "workload=explicit", "workload.prompts=[[10,11,12,13,14,15,16,17],[20,21,22]]",
        "workload.output_lens=[2]"]


def test_rank_local_rows_segments_and_seq_lens_by_hand():
    ctx = context(BASE, rank=1)
    state = stage("dual_chunk_swap", "plan", ctx)(first_state(ctx))
    buffers = stage("persistent", "buffers", ctx)
    local = buffers(state).local
    # rank 1 holds positions 2-5 of the first prompt and 1-2 of the second (test_plan_stage)
    assert local.input_ids.tolist() == [12, 13, 14, 15, 21, 22]
    assert local.positions.tolist() == [2, 3, 4, 5, 1, 2]
    assert local.token_req_indices.tolist() == [0, 0, 0, 0, 1, 1]
    # One segment per chunk: [2 3] [4 5] of the first prompt, [1] [2] of the second; a chunk
    # attends to everything before it (seq_len = its last position + 1).
    assert local.query_start_loc.tolist() == [0, 2, 4, 5, 6]
    assert local.seq_lens.tolist() == [4, 6, 2, 3]
    assert local.segment_req_indices.tolist() == [0, 0, 1, 1]
    assert not local.is_padding.any() and local.num_tokens == 6
    # Persistent: the views point into the buffers made once.
    assert local.input_ids.data_ptr() == buffers.input_ids.data_ptr()


def test_padding_rows_are_zero():
    ctx = context(BASE, rank=0)  # rank 0 holds 5 rows, padded to 6
    local = stage("persistent", "buffers", ctx)(stage("dual_chunk_swap", "plan", ctx)(first_state(ctx))).local
    assert local.input_ids.tolist() == [10, 11, 16, 17, 20, 0]
    assert local.is_padding.tolist() == [False] * 5 + [True]
    assert torch.equal(local.positions, torch.tensor([0, 1, 6, 7, 0, 0]))
