"""Records every call of the reference attention kernel a rank makes (its block size, its rows'
requests, keys and starts, None without a window), one line per rank and step, for
tests/simulate/test_simulate_calls.py to compare with the calls a simulated run prices on a
measured profile. Importing this module (``plugins=[...]``, before the pipeline is built) hands
the forward stage a recording kernel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

import pcpflow.attention.fused as fused
from pcpflow.attention import paged
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState

CALLS: list[tuple[int, list[int], list[int], list[int] | None]] = []


def _recording(q, cache, spec, block_tables, row_req_indices, row_context_lens, block_size, starts=None):
    CALLS.append((int(block_size), row_req_indices.tolist(), row_context_lens.tolist(),
                  None if starts is None else starts.tolist()))
    return paged.paged_attention(q, cache, spec, block_tables, row_req_indices, row_context_lens, block_size, starts)


fused.paged_attention = _recording  # NOTE: what attention_kernel("reference") hands the forward stage


@register
class AttentionCalls(Stage):
    kind = "test_attention_calls"

    class Config(StageConfig):
        kind: Literal["test_attention_calls"] = "test_attention_calls"
        dir: str = Field(description="folder each rank appends rank<R>.jsonl to")

    def __call__(self, state: StepState) -> StepState:
        ctx = self.ctx
        if not ctx.is_reference:
            line = {"step": state.batch.step, "rank": ctx.world.rank, "calls": CALLS}
            with open(Path(self.config.dir) / f"rank{ctx.world.rank}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        CALLS.clear()
        return state


def read(folder) -> dict[tuple[int, int], list]:
    """(step, rank) -> the calls."""
    out = {}
    for path in Path(folder).glob("rank*.jsonl"):
        for x in path.read_text().splitlines():
            if x.strip():
                line = json.loads(x)
                out[line["step"], line["rank"]] = line["calls"]
    return out
