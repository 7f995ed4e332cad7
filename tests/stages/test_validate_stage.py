"""stages/validate.py (``batch_checks``): a malformed batch fails loudly, naming what is
wrong; a well-formed one passes untouched."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from stage_ctx import context, first_state, stage

BASE = ["pcp=1", "workload=explicit", "workload.prompt_lens=[6,3]", "workload.output_lens=[2]",
        "scheduler.max_num_batched_tokens=16"]


def test_a_well_formed_batch_passes_untouched():
    ctx = context(BASE)
    state = first_state(ctx)
    assert stage("batch_checks", "validate", ctx)(state) is state and state.layout is None


def test_each_broken_contract_is_named():
    ctx = context(BASE)
    b = first_state(ctx).batch
    check = stage("batch_checks", "validate", ctx)
    bad = {
        "8 input ids for 9 tokens": dataclasses.replace(b, input_ids=b.input_ids[:-1]),
        "logits_indices must be increasing": dataclasses.replace(b, logits_indices=b.logits_indices[::-1].copy()),
    }
    assert b.num_tokens == 9
    for message, batch in bad.items():
        state = first_state(ctx)
        state.batch = batch
        with pytest.raises(RuntimeError, match=f"step 0: malformed batch: .*{message}"):
            check(state)
    assert np.array_equal(b.num_scheduled_tokens, [6, 3])
