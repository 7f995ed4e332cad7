"""stages/slots.py (``paged``): the gathered slot mapping and row metadata of the step,
worked by hand (the arithmetic is pcpflow.attention.metadata's: tests/attention/test_attn_metadata.py)."""

from __future__ import annotations

from stage_ctx import TARGET, context, first_state, run_slots

BASE = ["pcp=2", "workload=explicit", "workload.prompt_lens=[8,3]", "workload.output_lens=[2]", "kv.block_size=4"]


def test_slots_of_the_gathered_rows_by_hand():
    ctx = context(BASE, rank=1)
    state = run_slots(first_state(ctx), ctx, *TARGET)
    b = state.batch
    tables = b.block_tables
    slot = lambda req, pos: int(tables[req, pos // 4]) * 4 + pos % 4  # noqa: E731
    # gathered rows: rank 0 [0 1 6 7 | 0'] + pad, rank 1 [2 3 4 5 | 1' 2']; one writer each
    want = [slot(0, 0), slot(0, 1), slot(0, 6), slot(0, 7), slot(1, 0), -1,
            slot(0, 2), slot(0, 3), slot(0, 4), slot(0, 5), slot(1, 1), slot(1, 2)]
    assert state.attn.gathered_slot_mapping.tolist() == want
    assert state.attn.local_row_context_lens.tolist() == [3, 4, 5, 6, 2, 3]  # causal: position + 1
    assert state.attn.local_row_req_indices.tolist() == [0, 0, 0, 0, 1, 1]
    assert state.attn.dcp_context is None  # no DCP
