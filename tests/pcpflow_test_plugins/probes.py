"""A harmless user stage: records, per rank, every step it saw and what earlier stages
had filled in (registry, plugin and pipeline-order tests)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import Field

from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


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


@register
class QueriesOnlyForward(Stage):
    """A user's forward stage with no options: always the DCP query path."""

    kind = "test_queries_forward"
    slots = ("forward",)

    class Config(StageConfig):
        kind: Literal["test_queries_forward"] = "test_queries_forward"

    def __call__(self, state: StepState) -> StepState:
        import torch

        from pcpflow.attention.context_parallel import CPAttention

        ctx = self.ctx
        backend = CPAttention(
            layout=state.layout,
            meta=state.attn,
            caches=ctx.kv_caches,
            spec=ctx.model.attn_spec,
            block_size=ctx.block_size,
            pcp=ctx.pcp,
            dcp=ctx.dcp,
            dcp_rest="queries",
        )
        state.attn.dcp_rest = backend.dcp_rest.mode
        with torch.no_grad():
            state.hidden, state.aux_hidden = ctx.model(state.local.input_ids, state.local.positions, backend)
        return state


@register
class CacheWatch(Stage):
    """Between two steps only the engine and the verifier run: ``mark=end`` keeps a copy
    of this rank's KV caches after the step's last stage, ``mark=start`` (the next step's
    first stage) counts the entries that changed since (NaN to NaN is unchanged), in
    ``ctx.extras['cache_changes_between_steps']``."""

    kind = "test_cache_watch"

    class Config(StageConfig):
        kind: Literal["test_cache_watch"] = "test_cache_watch"
        mark: Literal["start", "end"]

    def __call__(self, state: StepState) -> StepState:
        import torch

        extras = self.ctx.extras
        if self.config.mark == "end":
            extras["cache_copy"] = [c.clone() for c in self.ctx.kv_caches]
        elif "cache_copy" in extras:
            changed = 0
            for before, now in zip(extras["cache_copy"], self.ctx.kv_caches):
                same = (before == now) | (torch.isnan(before) & torch.isnan(now))
                changed += int((~same).sum())
            extras["cache_changes_between_steps"] = extras.get("cache_changes_between_steps", 0) + changed
        return state
