"""validate: the batch every rank received is well formed (cheap, vectorized checks).

The run config itself is validated once in the driver, before any rank starts
(``pcpflow.config.run``); this stage guards the per-step contract between the scheduler and
the rest of the pipeline, so that a scheduler bug fails loudly instead of corrupting KV.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


@register
class BatchChecks(Stage):
    kind = "batch_checks"
    slots = ("validate",)

    class Config(StageConfig):
        kind: Literal["batch_checks"] = "batch_checks"

    def __call__(self, state: StepState) -> StepState:
        b, cfg = state.batch, self.ctx.config
        q = b.num_scheduled_tokens
        problems = []
        if (q < 0).any():
            problems.append(f"negative num_scheduled_tokens {q[q < 0].tolist()}")
        if b.num_tokens > cfg.scheduler.max_num_batched_tokens:
            problems.append(
                f"{b.num_tokens} tokens > scheduler.max_num_batched_tokens="
                f"{cfg.scheduler.max_num_batched_tokens}"
            )
        if b.num_reqs > cfg.scheduler.max_num_seqs:
            problems.append(f"{b.num_reqs} requests > scheduler.max_num_seqs={cfg.scheduler.max_num_seqs}")
        if len(b.input_ids) != b.num_tokens:
            problems.append(f"{len(b.input_ids)} input ids for {b.num_tokens} tokens")
        li = b.logits_indices
        if len(li) and (li.min() < 0 or li.max() >= b.num_tokens or (np.diff(li) <= 0).any()):
            problems.append("logits_indices must be increasing token rows of this batch")
        # A request's tokens must fit the blocks its table lists.
        capacity = b.block_tables.shape[1] * cfg.kv.block_size * cfg.dcp
        if b.num_reqs and int(b.seq_lens.max()) > capacity:
            problems.append(f"a request reaches {int(b.seq_lens.max())} tokens, its blocks hold {capacity}")
        if problems:
            raise RuntimeError(f"step {b.step}: malformed batch: " + "; ".join(problems))
        return state
