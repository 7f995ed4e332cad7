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

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import numpy as np

from pcpflow.batch import GlobalBatch
from pcpflow.errors import ConfigError, Problem
from pcpflow.kv_cache import KVCacheManager
from pcpflow.workload import Request


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
    new_token_ids: dict[int, list[int]]  # req_id -> tokens appended this step (rows with any)
    num_accepted: np.ndarray  # int64 [R]: drafts accepted
    num_proposed: np.ndarray  # int64 [R]: drafts scheduled (batch.num_draft_tokens)
    finished_req_ids: np.ndarray  # int64: requests that reached max_output_tokens this step
    freed_blocks: np.ndarray  # int64: KV blocks released by the finished requests
    first_token: np.ndarray  # int64: req_ids that produced their first token this step

    @property
    def num_new_tokens(self) -> int:
        """Tokens generated this step, over all requests."""
        return sum(len(t) for t in self.new_token_ids.values())


@dataclass
class RequestTiming:
    """Steps at which a request's life events happened (None: not yet)."""

    arrival_step: int
    admitted_step: int | None = None  # first scheduled
    first_token_step: int | None = None  # the step whose batch sampled its first output
    finish_step: int | None = None  # the step whose batch sampled its last output
    num_output_tokens: int = 0


@dataclass
class _Running:
    req: Request
    num_computed: int = 0
    outputs: list[int] = field(default_factory=list)
    drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def prompt_len(self) -> int:
        return len(self.req.prompt_token_ids)

    @property
    def in_prompt(self) -> bool:
        return self.num_computed < self.prompt_len


def _kv_tokens(req: Request, num_speculative_tokens: int) -> int:
    return len(req.prompt_token_ids) + req.max_output_tokens + num_speculative_tokens


def check_fits(
    requests: list[Request], kv: KVCacheManager, num_speculative_tokens: int = 0
) -> list[Problem]:
    """One problem per request whose reservation exceeds the whole cache: it would wait forever."""
    limit = min(kv.num_blocks, kv.max_blocks_per_req)
    problems = []
    for i, req in enumerate(requests):
        tokens = _kv_tokens(req, num_speculative_tokens)
        need = kv.blocks_needed(tokens)
        if need > limit:
            problems.append(
                Problem(
                    field="kv.num_blocks",
                    given=kv.num_blocks,
                    allowed=(
                        f"workload request {i} needs {need} blocks ({len(req.prompt_token_ids)} "
                        f"prompt + {req.max_output_tokens} output + {num_speculative_tokens} "
                        f"speculative tokens at {kv.tokens_per_block} tokens per block); "
                        f"kv.num_blocks must be >= {need}"
                        + (
                            f" (and max_blocks_per_req, {kv.max_blocks_per_req}, too)"
                            if need > kv.max_blocks_per_req
                            else ""
                        )
                    ),
                )
            )
    return problems


class Scheduler:
    """See the module docstring for the policy and the call order."""

    def __init__(
        self,
        requests: list[Request],
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv: KVCacheManager,
        num_speculative_tokens: int = 0,
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
        problems = check_fits(requests, kv, num_speculative_tokens)
        if problems:
            raise ConfigError(problems, header="requests that can never fit the KV cache")
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.kv = kv
        self.step = 0
        order = sorted(requests, key=lambda r: (r.arrival_step, r.req_id))
        self._waiting: deque[Request] = deque(order)
        self._running: list[_Running] = []
        self._outputs: dict[int, list[int]] = {r.req_id: [] for r in requests}
        self._timing = {r.req_id: RequestTiming(r.arrival_step) for r in requests}
        self._num_finished = 0
        self._last_batch: GlobalBatch | None = None  # scheduled, not yet updated
        self._updated_batch: GlobalBatch | None = None  # updated, drafts not yet set

    @property
    def done(self) -> bool:
        return self._num_finished == len(self._outputs)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def outputs(self) -> dict[int, list[int]]:
        """Generated tokens per req_id (copies)."""
        return {rid: list(toks) for rid, toks in self._outputs.items()}

    def request_timing(self) -> dict[int, dict[str, int | None]]:
        """Per req_id: the ``RequestTiming`` fields (arrival / admitted / first-token /
        finish steps, num_output_tokens) as a plain dict, for metrics."""
        return {rid: asdict(t) for rid, t in self._timing.items()}

    # -- schedule --------------------------------------------------------------------------

    def schedule(self) -> GlobalBatch | None:
        if self._last_batch is not None:
            raise RuntimeError(f"step {self._last_batch.step} was scheduled but not updated")
        step = self.step
        self.step += 1
        self._updated_batch = None
        budget = self.max_num_batched_tokens
        q: dict[int, int] = {}
        num_drafts: dict[int, int] = {}
        for r in self._running:
            if not r.in_prompt:
                room = r.req.max_output_tokens - len(r.outputs) - 1
                d = max(0, min(len(r.drafts), room, budget - 1))
                q[r.req.req_id] = min(1 + d, budget)
                num_drafts[r.req.req_id] = d
                budget -= q[r.req.req_id]
        for r in self._running:
            if r.in_prompt:
                q[r.req.req_id] = min(r.prompt_len - r.num_computed, budget)
                budget -= q[r.req.req_id]
        while (
            self._waiting
            and self._waiting[0].arrival_step <= step
            and len(self._running) < self.max_num_seqs
            and budget > 0
        ):
            req = self._waiting[0]
            tokens = _kv_tokens(req, self.num_speculative_tokens)
            if not self.kv.can_allocate(tokens):
                break  # FIFO: the head waits for blocks, and so does everyone behind it
            self._waiting.popleft()
            self.kv.allocate(req.req_id, tokens)
            self._running.append(_Running(req, outputs=self._outputs[req.req_id]))
            self._timing[req.req_id].admitted_step = step
            q[req.req_id] = min(len(req.prompt_token_ids), budget)
            budget -= q[req.req_id]
        if not self._running:
            return None
        batch = self._build_batch(step, q, num_drafts)
        self._last_batch = batch
        return batch

    def _build_batch(self, step: int, q: dict[int, int], num_drafts: dict[int, int]) -> GlobalBatch:
        running = self._running
        R = len(running)
        req_ids = np.fromiter((r.req.req_id for r in running), np.int64, R)
        num_sched = np.fromiter((q[r.req.req_id] for r in running), np.int64, R)
        num_computed = np.fromiter((r.num_computed for r in running), np.int64, R)
        prompt_lens = np.fromiter((r.prompt_len for r in running), np.int64, R)
        drafts = np.fromiter((num_drafts.get(r.req.req_id, 0) for r in running), np.int64, R)
        is_prefilling = num_computed < prompt_lens
        chunks = []
        for r, n, d in zip(running, num_sched.tolist(), drafts.tolist()):
            if r.in_prompt:
                chunks.append(r.req.prompt_token_ids[r.num_computed : r.num_computed + n])
            elif n > 0:
                chunks.append(np.concatenate([[r.outputs[-1]], r.drafts[:d]]).astype(np.int64))
        input_ids = np.concatenate(chunks).astype(np.int64) if chunks else np.zeros(0, np.int64)

        qsl = np.zeros(R + 1, dtype=np.int64)
        np.cumsum(num_sched, out=qsl[1:])
        token_rows = np.repeat(np.arange(R), num_sched)
        # Sampled: the last prompt token of a chunk that completes the prompt, and every
        # token of a decode row (the target's choice after each draft, plus the bonus).
        samples_row = np.where(
            is_prefilling, (num_computed + num_sched == prompt_lens) & (num_sched > 0), True
        )
        is_last = np.arange(qsl[-1]) == qsl[token_rows + 1] - 1
        sampled = np.where(is_prefilling[token_rows], is_last, True) & samples_row[token_rows]
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
        new_tokens: dict[int, list[int]] = {}
        finished: list[int] = []
        first: list[int] = []
        freed: list[np.ndarray] = []
        by_id = {r.req.req_id: r for r in self._running}
        rows = zip(
            batch.req_ids.tolist(),
            batch.num_scheduled_tokens.tolist(),
            batch.is_prefilling.tolist(),
            acc.num_accepted.tolist(),
            acc.num_new_tokens.tolist(),
            acc.sample_start.tolist(),
        )
        for rid, n_sched, prefilling, n_acc, n_new, start in rows:
            r = by_id[rid]
            r.drafts = r.drafts[:0]
            if n_sched == 0:
                continue
            r.num_computed += n_sched if prefilling else 1 + n_acc
            if n_new == 0:
                continue
            room = r.req.max_output_tokens - len(r.outputs)
            toks = sampled[start : start + min(n_new, room)].tolist()
            if not r.outputs:
                first.append(rid)
                self._timing[rid].first_token_step = batch.step
            r.outputs.extend(toks)
            new_tokens[rid] = toks
            self._timing[rid].num_output_tokens = len(r.outputs)
            if len(r.outputs) >= r.req.max_output_tokens:
                finished.append(rid)
                self._timing[rid].finish_step = batch.step
                freed.append(self.kv.free(rid))
        if finished:
            done = set(finished)
            self._running = [r for r in self._running if r.req.req_id not in done]
            self._num_finished += len(finished)
        self._updated_batch = batch
        return StepOutcome(
            step=batch.step,
            req_ids=batch.req_ids.copy(),
            new_token_ids=new_tokens,
            num_accepted=acc.num_accepted,
            num_proposed=np.asarray(batch.num_draft_tokens, dtype=np.int64).copy(),
            finished_req_ids=np.asarray(finished, dtype=np.int64),
            freed_blocks=np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64),
            first_token=np.asarray(first, dtype=np.int64),
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
        # number of leading non-negative entries per row
        lead = np.cumprod(drafts >= 0, axis=1).sum(axis=1)
        by_id = {r.req.req_id: r for r in self._running}
        for rid, row, n in zip(batch.req_ids.tolist(), drafts, lead.tolist()):
            r = by_id.get(rid)
            if r is not None and not r.in_prompt:
                r.drafts = row[:n].copy()
