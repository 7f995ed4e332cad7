"""Deterministic continuous batching with chunked prefill and speculative decoding.

Every rank runs the same scheduler on the same inputs and so emits the same
``GlobalBatch`` each step. One step of the driver loop::

    batch = scheduler.schedule()              # None: nothing to run yet (waiting for arrivals)
    state = pipeline(batch)                   # forward, sample, and (optionally) draft
    scheduler.update(batch, state.sampled_token_ids)
    scheduler.set_draft_tokens(batch, state.draft_token_ids)   # proposals for the next step

Drafts live for exactly one step: ``update`` clears them, ``set_draft_tokens`` (after
``update``) sets the next ones. A request's drafts are the tokens its drafter proposes to
follow its newest token, i.e. after this step's accepted tokens (a drafter learns how many
were accepted with ``accept_drafts``, the same function ``update`` uses).

Policy, with budget = max_num_batched_tokens, running requests in admission order:
1. decodes: 1 + d tokens each (d = pending drafts, cut to the remaining outputs and the
   budget); a decode left without budget stays in the batch with 0 tokens;
2. prefills: a chunk of min(remaining prompt, budget) tokens;
3. admission, FIFO by arrival: while there are free seats, budget and free blocks for
   prompt + max outputs + num_speculative_tokens, which are reserved at once, so that
   a running request never runs out of blocks (no preemption).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np

from pcpflow.errors import ConfigError
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.workload import Request
from pcpflow.tokens.stopping import cut_at_stop


class Acceptance(NamedTuple):
    """Greedy verification of one step, per batch row."""

    num_accepted: np.ndarray  # int64 [R]: drafts accepted (0 for rows without drafts)
    num_new_tokens: np.ndarray  # int64 [R]: tokens the row appends (accepted + 1, or 0)
    sample_start: np.ndarray  # int64 [R]: the row's first entry in sampled_token_ids


def accept_drafts(batch: GlobalBatch, sampled_token_ids: np.ndarray) -> Acceptance:
    """Longest-prefix greedy acceptance: a decode row with drafts d_1..d_k and samples
    s_0..s_k accepts the a drafts with d_{j+1} == s_j for j < a and appends s_0..s_a.

    A row's new tokens are ``sampled_token_ids[sample_start : sample_start + num_new_tokens]``.
    """
    sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
    if len(sampled) != len(batch.logits_indices):
        raise ValueError(
            f"expected one sampled token per logits index ({len(batch.logits_indices)}), "
            f"got {len(sampled)}"
        )
    R = batch.num_reqs
    num_samples = np.bincount(batch.logits_req_indices, minlength=R).astype(np.int64)
    sample_start = np.zeros(R, dtype=np.int64)
    np.cumsum(num_samples[:-1], out=sample_start[1:])

    num_drafts = np.asarray(batch.num_draft_tokens, dtype=np.int64)
    offsets = np.arange(batch.num_tokens, dtype=np.int64) - batch.query_start_loc[batch.req_indices]
    is_draft = (offsets >= 1) & (offsets <= num_drafts[batch.req_indices])
    draft_tokens = np.flatnonzero(is_draft)
    # NOTE: every token of a decode row is sampled, so draft t is checked against the
    # sample taken at token t - 1 (the target's choice for position t).
    sample_of_token = np.full(batch.num_tokens, -1, dtype=np.int64)
    sample_of_token[batch.logits_indices] = np.arange(len(sampled))
    prev_sample = sample_of_token[draft_tokens - 1]
    if (prev_sample < 0).any():
        raise ValueError("a draft token follows a token without logits: not a decode row")
    rejected = batch.input_ids[draft_tokens] != sampled[prev_sample]
    first_rejected = num_drafts + 1  # offset of the first rejected draft; k+1 = none
    bad = draft_tokens[rejected]
    np.minimum.at(first_rejected, batch.req_indices[bad], offsets[bad])
    num_accepted = first_rejected - 1
    num_new_tokens = np.where(num_samples > 0, num_accepted + 1, 0)
    return Acceptance(num_accepted, num_new_tokens, sample_start)


@dataclass
class StepOutcome:
    """What one ``update`` changed, per batch row (R) and per request."""

    step: int
    req_ids: np.ndarray  # int64 [R]: the batch rows' requests
    num_appended: np.ndarray  # int64 [R]: tokens each row appended to its outputs
    appended_token_ids: np.ndarray  # int64 [sum(num_appended)]: those tokens, row by row
    num_accepted: np.ndarray  # int64 [R]: drafts accepted
    num_proposed: np.ndarray  # int64 [R]: drafts scheduled (batch.num_draft_tokens)
    finished_req_ids: np.ndarray  # int64: requests that reached max_output_tokens or a stop token
    freed_blocks: np.ndarray  # int64: KV blocks released by the finished requests
    first_token: np.ndarray  # int64: req_ids that produced their first token this step

    @property
    def num_new_tokens(self) -> int:
        """Tokens generated this step, over all requests."""
        return int(self.appended_token_ids.shape[0])

    @property
    def new_token_ids(self) -> dict[int, list[int]]:
        """req_id -> tokens appended this step, for the rows that appended any."""
        tokens = np.split(self.appended_token_ids, self.num_appended.cumsum()[:-1])
        return {
            rid: toks.tolist()
            for rid, n, toks in zip(self.req_ids.tolist(), self.num_appended.tolist(), tokens)
            if n
        }


class Scheduler:
    """See the module docstring for the policy and the call order.

    State is kept as arrays over the requests in arrival order (``arrival_step``, then
    ``req_id``), so a step costs a fixed number of array operations; Python loops run
    only per admitted and per finished request.
    """

    def __init__(
        self,
        requests: list[Request],
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv: KVCacheManager,
        num_speculative_tokens: int = 0,
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or num_speculative_tokens < 0:
            raise ValueError(
                f"need max_num_batched_tokens >= 1 ({max_num_batched_tokens}), max_num_seqs >= 1 "
                f"({max_num_seqs}), num_speculative_tokens >= 0 ({num_speculative_tokens})"
            )
        ids = [r.req_id for r in requests]
        if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
            raise ValueError(f"request ids must be unique and >= 0, got {ids}")
        bad = [r.req_id for r in requests if len(r.prompt_token_ids) < 1 or r.max_output_tokens < 1]
        if bad:
            raise ValueError(
                f"requests {bad} need a prompt of >= 1 token and max_output_tokens >= 1"
            )
        problems = kv.fit_problems([len(r.prompt_token_ids) for r in requests],
                                   [r.max_output_tokens for r in requests], num_speculative_tokens)
        if problems:
            raise ConfigError(problems, header="requests that can never fit the KV cache")
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.kv = kv
        self.step = 0
        # a request that appends one of these (its checkpoint's EOS ids) finishes there
        self.stop_token_ids = np.unique(np.asarray(list(stop_token_ids), dtype=np.int64))

        # Per request, in arrival order (index i below); admission takes them in order.
        order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_step, ids[i]))
        reqs = [requests[i] for i in order]
        self._input_order = np.argsort(np.asarray(order, dtype=np.int64)).astype(np.int64)
        n = len(reqs)

        def column(values) -> np.ndarray:
            return np.fromiter(values, dtype=np.int64, count=n)

        self._req_id = column(r.req_id for r in reqs)
        self._arrival = column(r.arrival_step for r in reqs)
        self._prompt_len = column(len(r.prompt_token_ids) for r in reqs)
        self._max_out = column(r.max_output_tokens for r in reqs)
        self._kv_tokens = self._prompt_len + self._max_out + self.num_speculative_tokens
        # --- cached prefixes: a prompt's first cached_len tokens are prefilled in steps
        # of their own, and its clock starts the step after (``request_timing``).
        self._cached = column(getattr(r, "cached_len", 0) for r in reqs)
        self._ready_step = np.full(n, -1, dtype=np.int64)
        # Prompts and outputs live in flat buffers, request i's at [start[i], start[i+1]).
        self._prompts = np.concatenate(
            [np.asarray(r.prompt_token_ids, dtype=np.int64) for r in reqs] or [np.zeros(0, np.int64)]
        )
        self._prompt_start = self._prompt_len.cumsum() - self._prompt_len
        self._outputs = np.zeros(int(self._max_out.sum()), dtype=np.int64)
        self._output_start = self._max_out.cumsum() - self._max_out
        self._num_computed = np.zeros(n, dtype=np.int64)
        self._num_out = np.zeros(n, dtype=np.int64)
        self._drafts = np.zeros((n, self.num_speculative_tokens), dtype=np.int64)
        self._num_drafts = np.zeros(n, dtype=np.int64)
        self._admitted_step = np.full(n, -1, dtype=np.int64)
        self._first_token_step = np.full(n, -1, dtype=np.int64)
        self._finish_step = np.full(n, -1, dtype=np.int64)
        self._next_waiting = 0  # requests [0, _next_waiting) have been admitted
        self._running = np.zeros(0, dtype=np.int64)  # request indices, admission order
        self._num_finished = 0
        self._last_batch: GlobalBatch | None = None  # scheduled, not yet updated
        self._updated_batch: GlobalBatch | None = None  # updated, drafts not yet set
        self._batch_rows = self._running  # the request index of each row of the last batch

    @property
    def done(self) -> bool:
        return self._num_finished == len(self._req_id)

    @property
    def num_waiting(self) -> int:
        return len(self._req_id) - self._next_waiting

    @property
    def num_running(self) -> int:
        return len(self._running)

    def outputs(self) -> dict[int, list[int]]:
        """Generated tokens per req_id (copies), in the order the requests were given."""
        start, end = self._output_start, self._output_start + self._num_out
        return {
            int(self._req_id[i]): self._outputs[start[i] : end[i]].tolist()
            for i in self._input_order.tolist()
        }

    def request_timing(self) -> dict[int, dict[str, int | None]]:
        """Per req_id: arrival / admitted / first-token / finish steps (None: not yet) and
        num_output_tokens, as plain dicts, for metrics. The first-token and finish steps
        are those of the batches that sampled the first and the last output. A request
        with a cached prefix arrives (its clock starts) the step after that prefix is in
        the KV cache: what it is timed on is the continued prefill."""
        columns = {
            "arrival_step": np.where(self._ready_step >= 0, np.maximum(self._arrival, self._ready_step), self._arrival),
            "admitted_step": self._admitted_step,
            "first_token_step": self._first_token_step,
            "finish_step": self._finish_step,
        }
        lists = {name: col.tolist() for name, col in columns.items()}
        num_out = self._num_out.tolist()
        return {
            int(self._req_id[i]): {
                **{name: (None if v[i] < 0 else v[i]) for name, v in lists.items()},
                "num_output_tokens": num_out[i],
            }
            for i in self._input_order.tolist()
        }

    # -- schedule --------------------------------------------------------------------------

    def schedule(self) -> GlobalBatch | None:
        if self._last_batch is not None:
            raise RuntimeError(f"step {self._last_batch.step} was scheduled but not updated")
        step = self.step
        self.step += 1
        self._updated_batch = None
        run = self._running
        computed, prompt_len = self._num_computed[run], self._prompt_len[run]
        in_prompt = computed < prompt_len
        # A decode wants its newest token plus its drafts, cut to the outputs left after
        # the newest token's own; a prefill wants the rest of its prompt.
        room = self._max_out[run] - self._num_out[run] - 1
        prompt_end = np.where(computed < self._cached[run], self._cached[run], prompt_len)
        want = np.where(in_prompt, prompt_end - computed, 1 + np.minimum(self._num_drafts[run], room))
        q = np.zeros(len(run), dtype=np.int64)
        budget = self.max_num_batched_tokens
        for rows in (~in_prompt, in_prompt):  # decodes first, then prefill chunks
            q[rows] = _take_in_order(want[rows], budget)
            budget -= int(q[rows].sum())
        admitted, admitted_q = [], []
        i = self._next_waiting
        while (
            i < len(self._req_id)
            and self._arrival[i] <= step
            and len(run) + len(admitted) < self.max_num_seqs
            and budget > 0
        ):
            tokens = int(self._kv_tokens[i])
            if not self.kv.can_allocate(tokens):
                break  # FIFO: the head waits for blocks, and so does everyone behind it
            self.kv.allocate(int(self._req_id[i]), tokens)
            self._admitted_step[i] = step
            admitted.append(i)
            admitted_q.append(min(int(self._cached[i] or self._prompt_len[i]), budget))
            budget -= admitted_q[-1]
            i += 1
        self._next_waiting = i
        if admitted:
            run = self._running = np.concatenate([run, np.asarray(admitted, dtype=np.int64)])
            q = np.concatenate([q, np.asarray(admitted_q, dtype=np.int64)])
        if not len(run):
            return None
        batch = self._build_batch(step, run, q)
        self._last_batch, self._batch_rows = batch, run
        return batch

    def _build_batch(self, step: int, run: np.ndarray, num_sched: np.ndarray) -> GlobalBatch:
        R = len(run)
        num_computed = self._num_computed[run]
        prompt_lens = self._prompt_len[run]
        is_prefilling = num_computed < prompt_lens
        drafts = np.where(is_prefilling, 0, np.maximum(num_sched - 1, 0))

        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        token_rows = np.repeat(np.arange(R), num_sched)
        offset = np.arange(qsl[-1]) - qsl[token_rows]
        token_req = run[token_rows]
        # A prefill row reads its prompt from its first uncomputed position; a decode row
        # is its newest output token, then its drafts.
        input_ids = np.empty(len(token_rows), dtype=np.int64)
        pre = is_prefilling[token_rows]
        at = np.flatnonzero(pre)
        input_ids[at] = self._prompts[
            self._prompt_start[token_req[at]] + num_computed[token_rows[at]] + offset[at]
        ]
        at = np.flatnonzero(~pre & (offset == 0))
        input_ids[at] = self._outputs[
            self._output_start[token_req[at]] + self._num_out[token_req[at]] - 1
        ]
        at = np.flatnonzero(~pre & (offset > 0))
        input_ids[at] = self._drafts[token_req[at], offset[at] - 1]

        # Sampled: the last prompt token of a chunk that completes the prompt, and every
        # token of a decode row (the target's choice after each draft, plus the bonus).
        samples_row = np.where(
            is_prefilling, (num_computed + num_sched == prompt_lens) & (num_sched > 0), True
        )
        is_last = offset == num_sched[token_rows] - 1
        sampled = np.where(pre, is_last, True) & samples_row[token_rows]
        req_ids = self._req_id[run]
        return GlobalBatch(
            step=step,
            req_ids=req_ids,
            num_scheduled_tokens=num_sched,
            num_computed_tokens=num_computed,
            is_prefilling=is_prefilling,
            prompt_lens=prompt_lens,
            input_ids=input_ids,
            block_tables=self.kv.block_tables(req_ids),
            logits_indices=np.flatnonzero(sampled).astype(np.int64),
            num_draft_tokens=drafts,
        )

    # -- update ----------------------------------------------------------------------------

    def update(self, batch: GlobalBatch, sampled_token_ids: np.ndarray) -> StepOutcome:
        """Apply one step's samples: verify drafts, append tokens, finish and free requests.
        Clears every pending draft."""
        if batch is not self._last_batch:
            raise RuntimeError("update() takes the batch of the latest schedule(), once")
        self._last_batch = None
        acc = accept_drafts(batch, sampled_token_ids)
        sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
        rows = self._batch_rows
        n_sched = batch.num_scheduled_tokens
        self._num_drafts[rows] = 0
        before = self._num_computed[rows]
        # A decode row's KV now holds its newest token and its accepted drafts.
        self._num_computed[rows] += np.where(
            batch.is_prefilling, n_sched, (n_sched > 0) * (1 + acc.num_accepted)
        )
        cached = self._cached[rows]
        self._ready_step[rows[(before < cached) & (self._num_computed[rows] >= cached)]] = batch.step + 1
        num_out = self._num_out[rows]
        take = np.minimum(acc.num_new_tokens, self._max_out[rows] - num_out)
        # Append row r's tokens sampled[start_r : start_r + take_r] to its outputs.
        row_of = np.repeat(np.arange(len(rows)), take)
        j = np.arange(len(row_of)) - (take.cumsum() - take)[row_of]
        appended = sampled[acc.sample_start[row_of] + j]
        take, row_of, j, appended, stopped = cut_at_stop(self.stop_token_ids, take, row_of, j, appended)
        self._outputs[self._output_start[rows[row_of]] + num_out[row_of] + j] = appended
        self._num_out[rows] = num_out + take
        first = rows[(take > 0) & (num_out == 0)]
        self._first_token_step[first] = batch.step
        done = (take > 0) & ((num_out + take >= self._max_out[rows]) | stopped)
        finished = rows[done]
        self._finish_step[finished] = batch.step
        finished_ids = self._req_id[finished]
        freed = [self.kv.free(rid) for rid in finished_ids.tolist()]
        if len(finished):
            self._running = rows[~done]
            self._num_finished += len(finished)
        self._updated_batch = batch
        return StepOutcome(
            step=batch.step,
            req_ids=batch.req_ids.copy(),
            num_appended=take,
            appended_token_ids=appended,
            num_accepted=acc.num_accepted,
            num_proposed=np.asarray(batch.num_draft_tokens, dtype=np.int64).copy(),
            finished_req_ids=finished_ids,
            freed_blocks=np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64),
            first_token=self._req_id[first],
        )

    def set_draft_tokens(self, batch: GlobalBatch, draft_token_ids: np.ndarray | None) -> None:
        """Proposals ``[R, k]`` (-1 = none) for the next step, one row per batch row, each
        continuing its request's newest token; call after ``update(batch, ...)``. A row's
        drafts are its leading non-negative entries; finished or mid-prompt rows are ignored."""
        if batch is not self._updated_batch:
            raise RuntimeError("set_draft_tokens() follows update() of the same batch")
        if draft_token_ids is None:
            return
        drafts = np.asarray(draft_token_ids, dtype=np.int64)
        if drafts.ndim != 2 or drafts.shape[0] != batch.num_reqs:
            raise ValueError(
                f"draft_token_ids must be [num_reqs={batch.num_reqs}, k], got {drafts.shape}"
            )
        if drafts.shape[1] > self.num_speculative_tokens:
            raise ValueError(
                f"{drafts.shape[1]} drafts per request, more than num_speculative_tokens "
                f"({self.num_speculative_tokens})"
            )
        rows = self._batch_rows
        decoding = (
            (self._num_computed[rows] >= self._prompt_len[rows])
            & (self._num_out[rows] < self._max_out[rows])
            & (self._finish_step[rows] < 0)
        )
        rows, drafts = rows[decoding], drafts[decoding]
        self._drafts[rows, : drafts.shape[1]] = drafts
        # the number of leading non-negative entries per row
        self._num_drafts[rows] = np.cumprod(drafts >= 0, axis=1).sum(axis=1)


def _take_in_order(want: np.ndarray, budget: int) -> np.ndarray:
    """Tokens each row gets when the rows, in order, take min(want, what is left)."""
    before = want.cumsum() - want
    return np.clip(budget - before, 0, want)
