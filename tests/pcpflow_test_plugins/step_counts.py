"""Records what an executed step counted, as the engine records it, on rank 0: per-rank
tokens and attention pairs (a ring's, on a ring step), the attention that ran, this step's
collective calls and bytes by purpose (read from the rank's CommStats before the engine
closes the step; a ring's point-to-point sends are in the run's metrics.jsonl), and what the
scheduler did (preemptions, prefix hits, KV blocks in use, running and waiting requests). For
the simulate tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from pcpflow.layouts.accounting import attention_work, ring_attention_work
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class StepCounts(Stage):
    kind = "test_step_counts"

    class Config(StageConfig):
        kind: Literal["test_step_counts"] = "test_step_counts"
        path: str = Field(description="JSONL file rank 0 appends one line per step to")

    def __call__(self, state: StepState) -> StepState:
        ctx, layout, b = self.ctx, state.layout, state.batch
        if ctx.world.rank != 0:
            return state
        rest = state.attn.dcp_rest or "queries"
        ran = state.attn.cp_attention or "allgather"
        if ran.startswith("ring_"):  # a ring step: no DCP path, the ring's pairs
            rest = None
            work = ring_attention_work(layout, b.positions, variant=ran[len("ring_"):], interleave=ctx.config.kv.interleave)
        else:
            work = attention_work(layout, b.positions, dcp_size=ctx.dcp_size, interleave=ctx.config.kv.interleave,
                                  dcp_rest=rest)
        line = {
            "step": b.step,
            "per_rank_tokens": layout.per_rank_num_tokens.tolist(),
            "padded_num_tokens": layout.padded_num_tokens,
            "per_rank_attention_work": work.tolist(),
            "dcp_rest": rest,
            "cp_attention": ran,
            "collective_calls": dict(ctx.stats.step_calls),
            "collective_bytes": dict(ctx.stats.step_bytes),
            **ctx.extras["step_stats"]._asdict(),
        }
        with open(Path(self.config.path), "a") as f:
            f.write(json.dumps(line) + "\n")
        return state


def read(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]
