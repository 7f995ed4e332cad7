"""A user stage (README, docs/writing-stages.md): every ``every`` steps, each rank prints how
many tokens it holds (the console shows each rank's lines with its prefix, ``[rank1]:``).

    python -m pcpflow plugins=[docs.examples.token_counter] \
        '+pipeline.extra=[{kind: token_counter, after: plan, every: 5}]'
"""

from __future__ import annotations

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
        if state.batch.step % self.config.every == 0:
            rank = self.ctx.pcp_rank
            print(f"step {state.batch.step}: pcp rank {rank} holds {state.layout.per_rank_num_tokens[rank]} tokens")
        return state
