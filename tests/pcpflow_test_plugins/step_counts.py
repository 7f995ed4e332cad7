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


COUNTED = ("per_rank_tokens", "padded_num_tokens", "per_rank_attention_work", "dcp_rest", "cp_attention",
           "collective_calls", "collective_bytes", "num_preempted", "prefix_hit_tokens", "prefix_query_tokens",
           "kv_blocks_used", "num_running", "num_waiting")
RING_SENT = ("collective_calls", "collective_bytes", "per_rank_collective_calls", "per_rank_collective_bytes")
"""A ring's point-to-point sends, every rank's: from the executed run's metrics.jsonl."""
WINDOW = "per_rank_window_attention_work"
"""One sliding layer's pairs (a model with sliding layers): from the executed run's metrics.jsonl."""


def executed_steps(path, run_dir=None) -> list[dict]:
    """The probe's lines of an executed run; with ``run_dir`` (a ring's run, a sliding
    window's), every rank's ring sends and the sliding layer's pairs as the engine recorded
    them in its metrics.jsonl."""
    steps = read(path)
    if run_dir is not None:
        for line, rec in zip(steps, read(Path(run_dir) / "metrics.jsonl")):
            line.update({k: rec[k] for k in (*RING_SENT, WINDOW) if k in rec})
    return steps


def mismatches(simulated: list[dict], executed: list[dict], *, ring: bool, dcp_over_tp: bool) -> list[str]:
    """Where a simulated run's step records differ from the executed run's probe lines: the
    steps, then every ``COUNTED`` key (and a ring's per-rank sends, a sliding layer's pairs)
    step by step. Bytes the simulation can only expect (``expected_bytes``: all_to_all MoE
    routing) are left out;
    with DCP over TP ranks the probe counts pairs per DCP shard, the run per PCP rank, so
    ``per_rank_attention_work`` is not compared."""
    out = []
    if [s["step"] for s in simulated] != [s["step"] for s in executed]:
        out.append(f"steps: simulated {[s['step'] for s in simulated]}, executed {[s['step'] for s in executed]}")
    expected = set(simulated[0].get("expected_bytes", ())) if simulated else set()
    for ex, si in zip(executed, simulated):
        for key in COUNTED + (RING_SENT[2:] if ring else ()) + ((WINDOW,) if WINDOW in ex else ()):
            if key == "per_rank_attention_work" and dcp_over_tp:
                continue
            a, b = si.get(key), ex[key]
            if key == "collective_bytes":
                a, b = ({k: v for k, v in d.items() if k not in expected} for d in (a, b))
            if a != b:
                out.append(f"step {ex['step']} {key}: simulated {a}, executed {b}")
    return out
