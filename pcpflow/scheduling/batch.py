"""The global scheduled batch: what the (global, deterministic) scheduler emits each step.

Every rank builds the identical ``GlobalBatch``; stages derive their rank-local views
from it. Arrays are numpy (int64 / bool) so that planning stays free of torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from pcpflow.layouts.layout import TokenPositions


@dataclass(frozen=True)
class GlobalBatch:
    """One scheduler step, in batch order (R requests, T tokens).

    Request ``i`` contributes tokens ``query_start_loc[i]:query_start_loc[i+1]`` at
    positions ``num_computed_tokens[i] + arange(num_scheduled_tokens[i])``. A request may
    be listed with 0 scheduled tokens (it is running but got no budget this step).
    """

    step: int
    req_ids: np.ndarray  # int64 [R]: workload request id of each batch row
    num_scheduled_tokens: np.ndarray  # int64 [R]: q
    num_computed_tokens: np.ndarray  # int64 [R]: c (tokens already in the KV cache)
    is_prefilling: np.ndarray  # bool [R]: the scheduled tokens are (still) prompt tokens
    prompt_lens: np.ndarray  # int64 [R]: prompt length (incl. recomputed outputs)
    input_ids: np.ndarray  # int64 [T]
    block_tables: np.ndarray  # int64 [R, max_blocks]; unused entries are 0
    logits_indices: np.ndarray  # int64 [S]: global token rows whose logits are sampled
    num_draft_tokens: np.ndarray  # int64 [R]: speculative tokens in this row (0 if none)
    query_start_loc: np.ndarray = field(init=False)  # int64 [R+1]
    # (sample, token id) of every token each sampled row's request has seen up to and
    # including that row (prompt, outputs, this step's drafts before it): what a repetition
    # penalty reads; None when the run has none (``Scheduler(history=True)`` builds it)
    sampled_history: tuple[np.ndarray, np.ndarray] | None = None
    # int64 [R]: the token after each row's prefill chunk that ends before its prefill does
    # (a prompt's, or a readmitted request's output), -1 elsewhere; None: not known (a batch
    # built without token ids)
    chunk_next_ids: np.ndarray | None = None
    # int64 [G, R, max_blocks]: every KV group's block tables (``pcpflow.scheduling.kv_groups``;
    # group 0's are ``block_tables``); None when no group gives back blocks (one table of all)
    group_block_tables: np.ndarray | None = None

    def __post_init__(self) -> None:
        q = np.asarray(self.num_scheduled_tokens, dtype=np.int64)
        qsl = np.zeros(len(q) + 1, dtype=np.int64)
        np.add.accumulate(q, out=qsl[1:])  # NOTE: cumsum's out= path costs twice as much
        object.__setattr__(self, "query_start_loc", qsl)

    # NOTE: the per-token arrays are built on first read: a priced step reads neither (it
    # goes by request), an executed one both.
    @cached_property
    def positions(self) -> np.ndarray:
        """int64 [T]: position of each token."""
        return np.asarray(self.token_positions)

    @cached_property
    def token_positions(self) -> TokenPositions:
        """The tokens' positions held per request (read per segment without building [T])."""
        return TokenPositions(self.query_start_loc, self.num_computed_tokens)

    @cached_property
    def req_indices(self) -> np.ndarray:
        """int64 [T]: batch row of each token."""
        q = np.asarray(self.num_scheduled_tokens, dtype=np.int64)
        return np.repeat(np.arange(len(q), dtype=np.int64), q)

    @property
    def num_reqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def seq_lens(self) -> np.ndarray:
        """Context length of each request once this step's tokens are written."""
        return self.num_computed_tokens + self.num_scheduled_tokens

    @property
    def logits_req_indices(self) -> np.ndarray:
        """Batch row of each sampled logit: the last row starting at or before its token
        (rows without tokens start where the next row does)."""
        return self.query_start_loc.searchsorted(self.logits_indices, side="right") - 1

    def with_block_tables(self, block_tables: np.ndarray) -> GlobalBatch:
        """The same batch over another KV layout (the single-rank reference's blocks, one group)."""
        return GlobalBatch(
            step=self.step,
            req_ids=self.req_ids,
            num_scheduled_tokens=self.num_scheduled_tokens,
            num_computed_tokens=self.num_computed_tokens,
            is_prefilling=self.is_prefilling,
            prompt_lens=self.prompt_lens,
            input_ids=self.input_ids,
            block_tables=block_tables,
            logits_indices=self.logits_indices,
            num_draft_tokens=self.num_draft_tokens,
            sampled_history=self.sampled_history,
            chunk_next_ids=self.chunk_next_ids,
        )
