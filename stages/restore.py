"""restore: back to the global batch, then sampling on it (greedy unless ``sampling.*``).

``all_rows`` all-gathers every rank's hidden states and indexes them with
``hidden_restore_idx`` (vLLM's behaviour): the whole global batch is restored, which is
what drafters that read every token's hidden state need. ``sampled_rows`` gathers only
the rows that are sampled (the last token of each finishing prefill, every row of a
decode): each rank sends the sampled rows it canonically holds, padded to the largest
rank's count, so the restore moves ``P * max_rank_samples`` rows instead of ``P * N``.
"""

from __future__ import annotations

import time
from typing import Literal

import numpy as np
import torch

from pcpflow.layouts.accounting import sampled_row_holders
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState
from pcpflow.tokens.sampling import apply_repetition_penalty, sample_batch


def sample_greedy(state: StepState, model, sample_hidden: torch.Tensor, config=None) -> StepState:
    """Logits of the sampled rows and their tokens: the argmax (ties go to the lowest
    token id), or with ``config.sampling`` a keyed draw (``pcpflow.tokens.sampling``). A
    run's repetition penalty applies first: the choice is made on ``state.scores``, the
    penalized logits (transformers' scores); ``state.logits`` stay the model's."""
    state.sample_hidden = sample_hidden
    t0 = time.perf_counter()
    with torch.no_grad():
        state.logits = scores = model.compute_logits(sample_hidden)
        if state.batch.sampled_history is not None and config is not None and config.repetition_penalty != 1:
            state.scores = scores = apply_repetition_penalty(scores, config.repetition_penalty, state.batch.sampled_history)
    if config is None or config.sampling.greedy:
        state.sampled_token_ids = scores.argmax(dim=-1).cpu().numpy().astype(np.int64)
    else:
        state.sampled_token_ids = sample_batch(scores, config.sampling, config.sampling_seed, state.batch)
    state.timings["restore.sample"] = time.perf_counter() - t0
    return state


@register
class AllRowsRestore(Stage):
    kind = "all_rows"
    slots = ("restore",)

    class Config(StageConfig):
        kind: Literal["all_rows"] = "all_rows"

    def __call__(self, state: StepState) -> StepState:
        layout, ctx = state.layout, self.ctx
        assert layout is not None and state.hidden is not None
        gathered = ctx.pcp.all_gather(state.hidden, "restore")
        t0 = time.perf_counter()
        restore_idx = torch.from_numpy(layout.hidden_restore_idx).to(gathered.device)
        state.restored_hidden = gathered.index_select(0, restore_idx)
        logits_idx = torch.from_numpy(state.batch.logits_indices).to(gathered.device)
        sample_hidden = state.restored_hidden.index_select(0, logits_idx)
        state.timings["restore.indexing"] = time.perf_counter() - t0
        return sample_greedy(state, ctx.model, sample_hidden, ctx.config)


@register
class SampledRowsRestore(Stage):
    kind = "sampled_rows"
    slots = ("restore",)

    class Config(StageConfig):
        kind: Literal["sampled_rows"] = "sampled_rows"

    def __call__(self, state: StepState) -> StepState:
        layout, ctx, hidden = state.layout, self.ctx, state.hidden
        assert layout is not None and hidden is not None
        t0 = time.perf_counter()
        # Each sample's canonical holder, and the most samples one rank holds (m).
        holder_rank, holder_row, m = sampled_row_holders(layout, state.batch.logits_indices)
        send = hidden.new_zeros((m, hidden.shape[1]))
        mine = holder_row[holder_rank == ctx.pcp_rank]
        send[: len(mine)] = hidden[torch.from_numpy(mine).to(hidden.device)]
        # Sample i sits at its rank's block, after the earlier samples of that rank.
        order = np.argsort(holder_rank, kind="stable")
        within = np.empty_like(order)
        within[order] = np.arange(len(order)) - np.searchsorted(holder_rank[order], holder_rank[order])
        pick = torch.from_numpy(holder_rank * m + within).to(hidden.device)
        indexing = time.perf_counter() - t0
        gathered = ctx.pcp.all_gather(send, "restore")
        t0 = time.perf_counter()
        sample_hidden = gathered.index_select(0, pick)
        state.timings["restore.indexing"] = indexing + time.perf_counter() - t0
        state.restored_hidden = None
        return sample_greedy(state, ctx.model, sample_hidden, ctx.config)
