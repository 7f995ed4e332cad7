"""stages/restore.py (``all_rows``, ``sampled_rows``): the global batch back, and greedy
samples of its sampled rows; both restores sample the same logits."""

from __future__ import annotations

import torch
from stage_ctx import TARGET, context, first_state, run_slots

BASE = ["pcp=1", "workload=explicit", "workload.prompt_lens=[6,3]", "workload.output_lens=[2]"]


def test_all_rows_and_sampled_rows_sample_the_same_rows():
    ctx = context(BASE)
    forward = run_slots(first_state(ctx), ctx, *TARGET, ("forward", "model"))
    hidden = forward.hidden.clone()
    every = run_slots(forward, ctx, ("restore", "all_rows"))
    assert torch.equal(every.restored_hidden, hidden[:9])  # one rank: the order is the batch's
    logits_all = every.logits.clone()
    # the last prompt token of each request is sampled: global tokens 5 and 8
    assert every.batch.logits_indices.tolist() == [5, 8]
    assert torch.equal(every.sample_hidden, hidden[[5, 8]])
    forward.restored_hidden = None
    some = run_slots(forward, ctx, ("restore", "sampled_rows"))
    assert some.restored_hidden is None and torch.equal(some.logits, logits_all)
    assert some.sampled_token_ids.tolist() == logits_all.argmax(dim=-1).tolist()
