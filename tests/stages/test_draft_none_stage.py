"""stages/draft_none.py (``none``): proposes nothing, so the scheduler schedules no
verification rows."""

from __future__ import annotations

from stage_ctx import TARGET, context, first_state, run_slots


def test_no_proposals():
    ctx = context(["pcp=1", "workload=explicit", "workload.prompt_lens=[4]", "workload.output_lens=[3]"])
    state = run_slots(first_state(ctx), ctx, *TARGET, ("forward", "model"), ("restore", "all_rows"), ("draft", "none"))
    assert state.draft_token_ids is None and ctx.config.num_speculative_tokens == 0
