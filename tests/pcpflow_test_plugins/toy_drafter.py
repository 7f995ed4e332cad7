"""A user's drafter, written as a plugin: it proposes the newest token k times.

Loaded like any plugin:
``plugins=[pcpflow_test_plugins.toy_drafter] pipeline.draft.kind=toy_repeat``.
Everything it reads is global (the batch and the restored samples), so every rank
proposes the same tokens.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pcpflow import spec
from pcpflow.pipeline.stage import Stage, register
from pcpflow.pipeline.state import StepState


@register
class RepeatLastToken(Stage):
    kind = "toy_repeat"
    slots = ("draft",)

    class Config(spec.DraftConfig):
        kind: Literal["toy_repeat"] = "toy_repeat"

    def __call__(self, state: StepState) -> StepState:
        batch, k = state.batch, self.config.num_speculative_tokens
        start = spec.draft_start(batch, state.sampled_token_ids)
        drafts = np.repeat(start.next_token_ids[:, None], k, axis=1)
        state.draft_token_ids = spec.scatter_proposals(batch.num_reqs, start.rows, drafts)
        return state
