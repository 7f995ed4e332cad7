"""draft: ``none`` — no speculative decoding (the default)."""

from __future__ import annotations

from typing import Literal

from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class NoDraft(Stage):
    kind = "none"
    slots = ("draft",)

    class Config(StageConfig):
        kind: Literal["none"] = "none"

    def __call__(self, state: StepState) -> StepState:
        return state
