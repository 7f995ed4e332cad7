"""Public face of the stage protocol (``pcpflow.pipeline.stage``): what a stage author
imports. ``from pcpflow.stage import Stage, StageConfig, register``."""

from pcpflow.pipeline.stage import SLOTS, Stage, StageConfig, register

__all__ = ["SLOTS", "Stage", "StageConfig", "register"]
