"""A user drafter (README, docs/writing-stages.md): proposes the newest token k times.

    python -m pcpflow plugins=[docs.examples.my_drafts] pipeline.draft.kind=my_draft \
        +pipeline.draft.num_speculative_tokens=3
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pcpflow import spec
from pcpflow.stage import Stage, register
from pcpflow.state import StepState


@register
class RepeatLastToken(Stage):
    """Proposes the newest token k times."""

    kind = "my_draft"
    slots = ("draft",)

    class Config(spec.DraftConfig):  # brings num_speculative_tokens (default 2)
        kind: Literal["my_draft"] = "my_draft"

    def __call__(self, state: StepState) -> StepState:
        batch, k = state.batch, self.config.num_speculative_tokens
        start = spec.draft_start(batch, state.sampled_token_ids)  # rows that sampled this step
        drafts = np.repeat(start.next_token_ids[:, None], k, axis=1)
        state.draft_token_ids = spec.scatter_proposals(batch.num_reqs, start.rows, drafts)
        return state
