"""stages/self_draft.py (``self``): the target drafts its own greedy continuation, which
the dense reference forward generates too; ``error_rate`` corrupts a seeded share."""

from __future__ import annotations

import torch
from reference import reference_forward
from stage_ctx import TARGET, context, first_state, run_slots

PROMPT = [5, 17, 3, 99, 42]


def greedy(model, ids, n):
    ids = list(ids)
    for _ in range(n):
        logits, _ = reference_forward(model, torch.tensor(ids))
        ids.append(int(logits[-1].argmax()))
    return ids[-n:]


def test_proposals_are_the_dense_greedy_continuation():
    overrides = ["pcp=1", "draft=self", "workload=explicit", f"workload.prompts=[{PROMPT}]".replace(" ", ""),
                 "workload.output_lens=[6]"]
    ctx = context(overrides)
    k = ctx.config.num_speculative_tokens
    state = run_slots(first_state(ctx), ctx, *TARGET, ("forward", "model"), ("restore", "all_rows"))
    state = run_slots(state, ctx, ("draft", "self"))
    sampled, drafts = int(state.sampled_token_ids[0]), state.draft_token_ids[0].tolist()
    assert k == 3 and [sampled, *drafts] == greedy(ctx.model, PROMPT, 1 + k)
