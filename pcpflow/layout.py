"""Public face of the layout algorithm (``pcpflow.layouts.layout``; numpy only, no torch).
``from pcpflow.layout import plan_layout``."""

from pcpflow.layouts.layout import BatchLayout, plan_layout

__all__ = ["BatchLayout", "plan_layout"]
