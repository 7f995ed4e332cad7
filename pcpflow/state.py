"""Public face of the step state (``pcpflow.pipeline.state``): what a stage reads and
writes. ``from pcpflow.state import StepState``."""

from pcpflow.pipeline.state import LocalBatch, StepState

__all__ = ["LocalBatch", "StepState"]
