"""stages/forward.py (``model``): at one rank, every row's hidden state is the dense,
cache-free forward of its prefix (tests/reference.py), and the KV of every token lands in
the cache."""

from __future__ import annotations

import torch
from reference import reference_forward
from stage_ctx import TARGET, context, first_state, run_slots

PROMPT = [5, 17, 3, 99, 42, 7, 250]


def test_hidden_states_equal_the_dense_reference():
    ctx = context(["pcp=1", "workload=explicit", f"workload.prompts=[{PROMPT}]".replace(" ", ""), "workload.output_lens=[2]"])
    state = run_slots(first_state(ctx), ctx, *TARGET, ("forward", "model"))
    logits = ctx.model.compute_logits(state.hidden[: len(PROMPT)])
    want, _ = reference_forward(ctx.model, torch.tensor(PROMPT))
    assert (logits.double() - want.double()).abs().max() <= 1e-9
    assert state.attn.dcp_rest == "queries"  # no DCP: nothing else to take
    # Every token's KV was written: the slots of the 7 positions hold numbers, the rest NaN.
    slots = state.attn.gathered_slot_mapping[: len(PROMPT)]
    for cache in ctx.kv_caches:
        assert not torch.isnan(cache[slots]).any()
        assert int((~torch.isnan(cache).all(dim=1)).sum()) == len(PROMPT)
