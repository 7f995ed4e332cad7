"""A user stage (README, docs/writing-stages.md): every ``every`` steps, rank 0 prints how
many tokens each PCP rank holds.

    python -m pcpflow plugins=[docs.examples.token_counter] \
        '+pipeline.extra=[{kind: token_counter, after: plan, every: 5}]'
"""

from __future__ import annotations

import sys
from typing import Literal

from pydantic import Field

from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import StepState


@register
class TokenCounter(Stage):
    kind = "token_counter"

    class Config(StageConfig):
        kind: Literal["token_counter"] = "token_counter"
        every: int = Field(10, ge=1, description="print every N steps")

    def __call__(self, state: StepState) -> StepState:
        if state.batch.step % self.config.every == 0 and self.ctx.pcp_rank == 0:
            # NOTE: a rank's stdout goes to its log (logs/); rank 0's stderr also reaches
            # the console.
            print(f"step {state.batch.step}: tokens per rank {state.layout.per_rank_num_tokens.tolist()}",
                  file=sys.stderr, flush=True)
        return state
