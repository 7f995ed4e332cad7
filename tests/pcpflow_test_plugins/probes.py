"""A harmless user stage: records, per rank, every step it saw and what earlier stages
had filled in (registry, plugin and pipeline-order tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from pcpflow.stage import Stage, StageConfig, register
from pcpflow.state import StepState


@register
class CallCounter(Stage):
    kind = "test_call_counter"

    class Config(StageConfig):
        kind: Literal["test_call_counter"] = "test_call_counter"
        out_dir: str | None = Field(None, description="append one JSON line per call to <out_dir>/rank<R>.jsonl")

    def __call__(self, state: StepState) -> StepState:
        if self.config.out_dir is not None:
            line = {
                "step": state.batch.step,
                "rank": self.ctx.pcp_rank,
                "has_layout": state.layout is not None,
                "has_hidden": state.hidden is not None,
                "has_logits": state.logits is not None,
            }
            path = Path(self.config.out_dir) / f"rank{self.ctx.pcp_rank}.jsonl"
            with open(path, "a") as f:
                f.write(json.dumps(line) + "\n")
        return state
