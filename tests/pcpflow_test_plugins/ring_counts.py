"""Records, on every rank and every step, what the rank's rings sent (its ``CommStats``
point-to-point counts, read before the engine closes the step) beside what is needed to
recompute them (the batch, the layout settings, the model's per-rank sizes), for
tests/attention/test_ring_attention.py to compare with ``pcpflow.layouts.accounting.ring_step_traffic``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class RingCounts(Stage):
    kind = "test_ring_counts"

    class Config(StageConfig):
        kind: Literal["test_ring_counts"] = "test_ring_counts"
        dir: str = Field(description="folder each rank appends rank<R>.jsonl to")

    def __call__(self, state: StepState) -> StepState:
        ctx, b = self.ctx, state.batch
        if ctx.is_reference:
            return state
        spec, cfg = ctx.model.attn_spec, ctx.config
        line = {
            "step": b.step,
            "rank": ctx.world.rank,
            "cp_attention": state.attn.cp_attention,
            "num_scheduled": b.num_scheduled_tokens.tolist(),
            "num_computed": b.num_computed_tokens.tolist(),
            "is_prefilling": b.is_prefilling.tolist(),
            "padded_num_tokens": state.layout.padded_num_tokens,
            "shape": [spec.entry_dim, spec.num_heads, spec.qk_dim, spec.v_dim, ctx.kv_caches[0].element_size(),
                      ctx.model.num_layers],
            "sent": {k: list(v) for k, v in ctx.stats.step_sent.items()},
            "decode_assignment": cfg.decode.assignment,
        }
        with open(Path(self.config.dir) / f"rank{ctx.world.rank}.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        return state


def read(folder) -> dict[int, list[dict]]:
    """step -> every rank's line."""
    out: dict[int, list[dict]] = {}
    for path in sorted(Path(folder).glob("rank*.jsonl")):
        for x in path.read_text().splitlines():
            if x.strip():
                line = json.loads(x)
                out.setdefault(line["step"], []).append(line)
    return out
