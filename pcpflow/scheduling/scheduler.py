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
3. KV blocks, as vLLM allocates them: each running request gets the blocks that the tokens
   it writes this step need (``pcpflow.scheduling.kv_cache``), and, drafting, the
   ``num_speculative_tokens`` positions its drafter may write next (vLLM's lookahead);
   nothing more is reserved ahead. When
   the free blocks do not suffice, the last admitted running request is preempted (FCFS):
   its blocks are freed (with prefix caching, full ones stay cached), it goes back to the
   front of the waiting queue keeping its outputs, and readmitted it prefills its prompt
   and those outputs; the budget is shared again among the rest. A step that preempted
   admits no one;
4. admission, first come first served (preempted requests first): while there are seats,
   budget and free blocks for the tokens it prefills this step. With prefix caching, the
   longest run of its full blocks found in the cache (at most all its tokens but the
   last) is taken instead of computed: it becomes a continued prefill of the rest (as a
   ``workload.cached_lens`` prefix does). When the drafter's own KV entry at position p
   reads the token at p + 1 (``draft_kv_reads_next_token``: MTP, EAGLE), a found block's
   last entry read the token after it of the request that wrote it: the hit keeps the
   blocks written followed by the block this request has next, less the last of them (as
   vLLM drops the last block for EAGLE/MTP), and the rest is computed again. A request's
   ``cached_lens`` prefix is prefilled
   alone first (its warm-up; what hits already cover is skipped), and its clock starts
   after it.
After each step, the blocks a request filled are cached under their chained hashes
(``pcpflow.scheduling.prefix``): later requests can find them from the next step on.
Every request fits alone (``kv_cache.fit_problems``, checked before the run), so the
first-admitted running request always progresses.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from pcpflow.errors import ConfigError
from pcpflow.scheduling import prefix
from pcpflow.scheduling.arrivals import Arrivals
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.workload import Request, RequestTable
from pcpflow.tokens.stopping import cut_at_stop

KEYED_AHEAD = 64
"""Requests whose prompt blocks a run without token ids keys at once (``Scheduler._key_prompts``)."""


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
    freed_blocks: np.ndarray  # int64: KV blocks that became free this step (preemptions, then finishes)
    first_token: np.ndarray  # int64: req_ids that produced their first token this step
    preempted_req_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # preempted when scheduled
    handed_over: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # prefill_only: left for another pool

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


class StepStats(NamedTuple):
    """What the KV cache and the queues did when a step was scheduled (metrics.jsonl)."""

    num_preempted: int  # running requests preempted to make room
    prefix_hit_tokens: int  # tokens the requests admitted took from the prefix cache (not computed)
    prefix_query_tokens: int  # tokens those admissions looked up (first admissions only)
    kv_blocks_used: int  # blocks held by requests once the step is scheduled
    num_running: int
    num_waiting: int  # arrived, not running (preempted ones included)


class Scheduler:
    """See the module docstring for the policy and the call order.

    State is kept as arrays over every request of the workload (index = ``req_id``), so a
    step costs a fixed number of array operations; Python loops run only per admitted,
    preempted and finished request, and per request that fills a block (prefix caching).

    ``requests``: a ``RequestTable`` (or ``Request`` objects). A table without token ids
    (a simulated run) schedules by lengths: input ids are 0, outputs are not kept.
    Requests enter by themselves at their arrival (``feed=True``: ``pcpflow.scheduling.arrivals``,
    by step, or by the time ``schedule(now)`` is given for a timed table), or through
    ``add`` (``feed=False``: a router's replicas, which share the per-request columns of the
    scheduler given as ``share``). ``prefill_only`` (a prefill pool, ``disagg=pd``): a request
    leaves the running requests with its first token (``StepOutcome.handed_over``), keeping
    its blocks until ``release``; another pool's scheduler takes it over with ``adopt``.
    ``draft_kv_reads_next_token`` (the drafter's ``DraftConfig.kv_reads_next_token``): a
    prefix-cache hit gives up the blocks whose last entry may have read another request's
    next token (``_drafter_hit``), and what a request reports as its hit
    (``StepStats.prefix_hit_tokens``, ``prefix_hit_tokens`` of its row) is what it took from
    the cache, without them.
    ``sampled_outputs`` (a simulated run, which samples no ids, of a config that samples,
    temperature > 0): a block holding outputs is the request's own, not its prompt's (two
    requests with one prompt sample different outputs, and share no block of them, as
    executed runs do when their draws differ; greedy outputs of one prompt are one, and
    shared).
    """

    def __init__(
        self,
        requests: RequestTable | list[Request],
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        kv: KVCacheManager,
        num_speculative_tokens: int = 0,
        draft_kv_reads_next_token: bool = False,
        sampled_outputs: bool = False,
        stop_token_ids: Sequence[int] = (),
        feed: bool = True,
        share: Scheduler | None = None,
        prefill_only: bool = False,
        history: bool = False,
    ) -> None:
        if max_num_batched_tokens < 1 or max_num_seqs < 1 or num_speculative_tokens < 0:
            raise ValueError(
                f"need max_num_batched_tokens >= 1 ({max_num_batched_tokens}), max_num_seqs >= 1 "
                f"({max_num_seqs}), num_speculative_tokens >= 0 ({num_speculative_tokens})"
            )
        if (num_speculative_tokens or draft_kv_reads_next_token) and kv.groups is not None and not kv.groups.num_full:
            raise ValueError("a drafter's caches go by the first KV group's table, which must hold every entry: "
                             "a model whose every layer is windowed drafts with one group (kv.hybrid=auto)")
        table = requests if isinstance(requests, RequestTable) else _table_of(requests)
        self.table = table
        self.max_num_batched_tokens = int(max_num_batched_tokens)
        self.max_num_seqs = int(max_num_seqs)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.draft_kv_reads_next_token = bool(draft_kv_reads_next_token)
        self.sampled_outputs = bool(sampled_outputs)
        self.kv = kv
        # NOTE: per block, the key of the block that followed it where its last entry was
        # written (0: not known yet); kept only where a drafter's entries read the next token
        self._next_key = (np.zeros(kv.num_blocks, dtype=np.uint64)
                          if self.draft_kv_reads_next_token and kv.prefix_caching else None)
        self.prefill_only = bool(prefill_only)
        self.history = bool(history)  # each batch lists what its sampled rows have seen (a repetition penalty)
        self.step = 0
        # a request that appends one of these (its checkpoint's EOS ids) finishes there
        self.stop_token_ids = np.unique(np.asarray(list(stop_token_ids), dtype=np.int64))
        self.arrivals = (Arrivals(table.arrival_s if table.timed else table.arrival_steps, table.max_concurrency)
                         if feed else None)
        self._waiting: deque[int] = deque()  # arrived, not running: FCFS, preempted ones in front
        self._running = np.zeros(0, dtype=np.int64)  # request indices, admission order
        self._num_finished = 0
        self._num_added = 0
        self._joining = 0  # adopted from another pool, entries still in transfer (seats they hold)
        self._last_batch: GlobalBatch | None = None  # scheduled, not yet updated
        self._updated_batch: GlobalBatch | None = None  # updated, drafts not yet set
        self._batch_rows = self._running  # the request index of each row of the last batch
        self._sampling = np.zeros(0, dtype=bool)  # whether each row of the last batch samples
        self._zeros = np.zeros(0, dtype=np.int64)  # _zero_ids' buffer
        self._preempted: list[int] = []  # by the latest schedule()
        self._freed: list[np.ndarray] = []  # blocks freed by the latest schedule()'s preemptions
        self._last_find: tuple[np.ndarray, int, np.ndarray] | None = None  # the latest admission lookup: keys, longest, hits
        self.stats = StepStats(0, 0, 0, 0, 0, 0)
        if share is None:
            n = len(table)
            if n and (table.prompt_lens.min() < 1 or table.output_lens.min() < 1):
                bad = np.flatnonzero((table.prompt_lens < 1) | (table.output_lens < 1)).tolist()
                raise ValueError(f"requests {bad} need a prompt of >= 1 token and max_output_tokens >= 1")
            # NOTE: a prefill pool holds prompts only (the first token's entry is written where it decodes)
            outputs = np.zeros_like(table.output_lens) if prefill_only else table.output_lens
            problems = kv.fit_problems(table.prompt_lens, outputs, num_speculative_tokens, self.max_num_batched_tokens)
            if problems:
                raise ConfigError(problems, header="requests that can never fit the KV cache")
        self.columns = _Columns(table, self.num_speculative_tokens) if share is None else share.columns
        # NOTE: the block from which each request's blocks are its own (no dict entry needed while it runs)
        self._private_from = None
        if kv.prefix_caching and table.tokens is None:
            same = share is not None and share.kv.tokens_per_block == kv.tokens_per_block
            self._private_from = share._private_from if same else table.private_from(kv.tokens_per_block)
        # NOTE: self._<name> is the shared column <name> (arrays and dicts are never rebound).
        for name, value in vars(self.columns).items():
            setattr(self, f"_{name}", value)

    @property
    def done(self) -> bool:
        """Nothing running or waiting, and (feeding itself) every request arrived."""
        return not self.has_work and (self.arrivals is None or self.arrivals.exhausted)

    @property
    def has_work(self) -> bool:
        return bool(len(self._running) or self._waiting)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    def add(self, req_indices) -> None:
        """Requests that arrived (in arrival order) join the back of the waiting queue."""
        idx = np.asarray(req_indices, dtype=np.int64)
        if len(idx):
            self._entry_step[idx] = self.step
            self._waiting.extend(idx.tolist())
            self._num_added += len(idx)

    def outputs(self) -> dict[int, list[int]] | None:
        """Generated tokens per req_id (copies), in request order; None for a run without
        token ids (a simulated run samples no real token)."""
        if self._outputs is None:
            return None
        start, end = self._output_start, self._output_start + self._num_out
        return {i: self._outputs[start[i]:end[i]].tolist() for i in range(len(start))}

    def timing_columns(self) -> dict[str, np.ndarray]:
        """Per request (index = req_id), -1 where not yet: the step it arrived at (entered,
        or later: the step after its ``cached_lens`` prefix was in the cache), was first
        admitted, sampled its first and its last token; its outputs, preemptions and
        prefix-cache hit. The first-token and finish steps are those of the batches that
        sampled the first and the last output."""
        ready = self._ready_step
        return {
            "arrival_step": np.where(ready >= 0, np.maximum(self._entry_step, ready), self._entry_step),
            "entry_step": self._entry_step.copy(),
            "ready_step": ready.copy(),
            "admitted_step": self._admitted_step.copy(),
            "first_token_step": self._first_token_step.copy(),
            "finish_step": self._finish_step.copy(),
            "num_output_tokens": self._num_out.copy(),
            "num_preemptions": self._num_preempted.copy(),
            "prefix_hit_tokens": self._hit_tokens.copy(),
        }

    def request_timing(self) -> dict[int, dict[str, int | None]]:
        """``timing_columns`` as plain dicts per req_id (None: not yet), for metrics. A
        request with a cached prefix arrives (its clock starts) the step after that prefix
        is in the KV cache: what it is timed on is the continued prefill."""
        cols = {k: self.timing_columns()[k].tolist() for k in
                ("arrival_step", "admitted_step", "first_token_step", "finish_step")}
        num_out = self._num_out.tolist()
        return {
            i: {**{name: (None if v[i] < 0 else v[i]) for name, v in cols.items()}, "num_output_tokens": num_out[i]}
            for i in range(len(num_out))
        }

    def token_ids(self, req_id: int, start: int, end: int) -> np.ndarray:
        """Request ``req_id``'s tokens at positions [start, end): its prompt, then its outputs."""
        return self._sequence(np.full(end - start, req_id, dtype=np.int64), np.arange(start, end, dtype=np.int64))

    # -- schedule --------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> GlobalBatch | None:
        """The next step's batch (None: nothing to run). ``now``: the run's clock, for a
        timed table's arrivals."""
        if self._last_batch is not None:
            raise RuntimeError(f"step {self._last_batch.step} was scheduled but not updated")
        step = self.step
        if self.arrivals is not None:
            if self.arrivals.timed and now is None:
                raise ValueError("requests arriving in time need schedule(now=the run's clock)")
            self.add(self.arrivals.due(now if self.arrivals.timed else step))
        self.step += 1
        self._updated_batch = None
        self._preempted, self._freed = [], []
        run = self._running
        la, U, G = self.num_speculative_tokens, self.kv.tokens_per_block, self.kv.num_groups
        if self.kv.groups is not None:  # NOTE: the blocks a window left go back before anyone grows
            self._freed.append(self.kv.release(run, self._num_computed[run]))
        while True:
            q, written = self._running_tokens(run)
            written += q
            if la:
                written += la * (q > 0)
            grow = -(-written // U) - self.kv.num_blocks_held(run)  # NOTE: blocks_needed, less its checks
            if int(np.maximum(grow, 0).sum()) * G <= self.kv.num_free_blocks or not len(run):
                break
            # FCFS: the last admitted gives its blocks back, and recomputes later.
            self._preempt(int(run[-1]))
            run = run[:-1]
        self._running = run
        more = (grow > 0).nonzero()[0]
        if len(more):
            self.kv.grow(run[more], grow[more])
        hits = queries = 0
        if not self._preempted:  # NOTE: as vLLM: a step that preempted admits no one
            run, q, hits, queries = self._admit(step, run, q)
            self._running = run
        self.stats = StepStats(len(self._preempted), hits, queries, self.kv.num_used_blocks, len(run),
                               len(self._waiting))
        if not len(run):
            return None
        batch = self._build_batch(step, run, q)
        self._last_batch, self._batch_rows = batch, run
        return batch

    def _running_tokens(self, run: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Tokens each running request gets this step: decodes first (their newest token and
        drafts), then prefill chunks, in admission order, within the budget; and (a copy of)
        the tokens each has computed."""
        computed, end = self._num_computed[run], self._prefill_end[run]
        in_prompt = computed < end
        # A decode wants its newest token plus its drafts, cut to the outputs left after
        # the newest token's own; a prefill wants the rest of its prompt (first its
        # cached_lens prefix, alone).
        room = self._max_out[run] - self._num_out[run] - 1
        # NOTE: without a cached_lens prefix a prompt is all it wants, and without drafting a
        # decode has no drafts (0 pending, so their minimum with room is room's with 0)
        prompt_end = np.where(computed < (cached := self._cached[run]), cached, end) if self._any_cached else end
        drafts = np.minimum(self._num_drafts[run], room) if self.num_speculative_tokens else np.minimum(room, 0, out=room)
        want = np.where(in_prompt, prompt_end - computed, 1 + drafts)
        budget = self.max_num_batched_tokens
        if int(want.sum()) <= budget:  # NOTE: the usual step: everyone gets what they want
            return want, computed
        q = np.zeros(len(run), dtype=np.int64)
        for rows in (~in_prompt, in_prompt):  # decodes first, then prefill chunks
            q[rows] = _take_in_order(want[rows], budget)
            budget -= int(q[rows].sum())
        return q, computed

    def _admit(self, step: int, run: np.ndarray, q: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
        """Waiting requests join, first come first served, while there are seats, budget
        and blocks; a prefix-cache hit makes the request a continued prefill."""
        budget = self.max_num_batched_tokens - int(q.sum())
        admitted, admitted_q = [], []
        hits_total = queries = 0
        kv, U = self.kv, self.kv.tokens_per_block
        while self._waiting and len(run) + len(admitted) < self.max_num_seqs and budget > 0:
            i = self._waiting[0]
            total = int(self._prefill_end[i])  # its prompt, or prompt + outputs when preempted
            hit_blocks = np.zeros((kv.num_groups, 0), dtype=np.int64)
            if kv.prefix_caching:
                # NOTE: at most total - 1 tokens: the last one is computed for its logits.
                longest = (total - 1) // U
                chain, keys = self._lookup_keys(i, longest)
                last = self._last_find
                # NOTE: a head waiting for blocks looks up the same prefix every step: its last
                # answer, checked in a few array operations, spares a dict lookup per hit block.
                if last is not None and last[0] is keys and last[1] == longest and kv.finds_again(keys, longest, last[2]):
                    hit_blocks = last[2]
                else:
                    hit_blocks = kv.find_hit(keys, longest)
                self._last_find = (keys, longest, hit_blocks)
                if self._next_key is not None:
                    hit_blocks = self._drafter_hit_of(keys, hit_blocks)
            n_hit = hit_blocks.shape[-1]
            hit = n_hit * U
            cached = int(self._cached[i])
            take = min((cached if hit < cached else total) - hit, budget)
            written = hit + take + self.num_speculative_tokens
            # NOTE: blocks_needed, on ints: a block per new entry in every group
            new = (-(-written // U) - n_hit) * kv.num_groups + kv.evictable(hit_blocks)
            if new > kv.num_free_blocks:
                break  # FCFS: the head waits for blocks, and so does everyone behind it
            kv.allocate(i, written, cached=hit_blocks)
            self._waiting.popleft()
            if kv.prefix_caching:
                self._chain_last[i] = chain[n_hit - 1] if n_hit else prefix.ROOT
            self._num_computed[i] = hit
            self._hashed[i] = n_hit
            if 0 < cached <= hit and self._ready_step[i] < 0:
                # NOTE: a hit holds its cached_lens prefix: nothing to wait for, its clock ran
                # from its entry (a readmission must not start it again)
                self._ready_step[i] = self._entry_step[i]
            if self._admitted_step[i] < 0:
                self._admitted_step[i] = step
                self._hit_tokens[i] = hit
                hits_total += hit
                queries += total
            admitted.append(i)
            admitted_q.append(take)
            budget -= take
        if admitted:
            run = np.concatenate([run, np.asarray(admitted, dtype=np.int64)])
            q = np.concatenate([q, np.asarray(admitted_q, dtype=np.int64)])
        return run, q, hits_total, queries

    def _preempt(self, i: int) -> None:
        """Request i gives back its blocks (full cached ones stay findable) and goes to the
        front of the waiting queue, keeping its outputs: readmitted, it prefills its prompt
        and those outputs."""
        self.kv.index(i)  # NOTE: readmitted, it looks up its own blocks too
        self._freed.append(self.kv.free(i))
        self._preempted.append(i)
        self._num_computed[i] = 0
        self._prefill_end[i] = self._prompt_len[i] + self._num_out[i]
        self._num_drafts[i] = 0
        self._hashed[i] = 0
        self._chain_last[i] = prefix.ROOT
        self._num_preempted[i] += 1
        self._waiting.appendleft(i)

    def _sequence(self, req: np.ndarray, pos: np.ndarray, keyed: bool = False) -> np.ndarray:
        """Token ids at positions ``pos`` of requests ``req`` (prompt, then outputs); 0 in a
        run without token ids. ``keyed``: what a block's key is made of, where, with
        ``sampled_outputs``, an output is the request's own (-1 - request: no token's)."""
        if self._outputs is None:
            return np.zeros(len(pos), dtype=np.int64)
        plen = self._prompt_len[req]
        in_prompt = pos < plen
        out = np.empty(len(pos), dtype=np.int64)
        at = np.flatnonzero(in_prompt)
        out[at] = self._prompts[self._prompt_start[req[at]] + pos[at]]
        at = np.flatnonzero(~in_prompt)
        if keyed and self.sampled_outputs:
            out[at] = -1 - req[at]
        else:
            out[at] = self._outputs[self._output_start[req[at]] + pos[at] - plen[at]]
        return out

    def _zero_ids(self, n: int) -> np.ndarray:
        """``n`` input ids of a run without token ids: a read-only view of one zero buffer
        (a step's tokens are up to max_num_batched_tokens; zeroing them each step cost more
        than the rest of the batch)."""
        if len(self._zeros) < n:
            self._zeros = np.zeros(max(n, self.max_num_batched_tokens), dtype=np.int64)
            self._zeros.flags.writeable = False
        return self._zeros[:n]

    def _build_batch(self, step: int, run: np.ndarray, num_sched: np.ndarray) -> GlobalBatch:
        R = len(run)
        num_computed = self._num_computed[run]
        prefill_end = self._prefill_end[run]
        is_prefilling = num_computed < prefill_end
        if self.num_speculative_tokens:
            drafts = np.where(is_prefilling, 0, np.maximum(num_sched - 1, 0))
        else:  # NOTE: a decode row is its newest token alone
            drafts = np.zeros(R, dtype=np.int64)

        qsl = np.zeros(R + 1, dtype=np.int64)
        np.add.accumulate(num_sched, out=qsl[1:])
        # A prefill row reads its prompt (and, readmitted, its outputs) from its first
        # uncomputed position; a decode row is its newest output token, then its drafts.
        if self._outputs is None:
            input_ids = self._zero_ids(int(qsl[-1]))
        else:
            token_rows = np.repeat(np.arange(R), num_sched)
            offset = np.arange(qsl[-1]) - qsl[token_rows]
            token_req = run[token_rows]
            input_ids = self._sequence(token_req, num_computed[token_rows] + offset)
            at = np.flatnonzero(~is_prefilling[token_rows] & (offset > 0))
            input_ids[at] = self._drafts[token_req[at], offset[at] - 1]

        # Sampled: the last prompt token of a chunk that completes the prompt, and every
        # token of a decode row (the target's choice after each draft, plus the bonus).
        if not self.num_speculative_tokens:
            # NOTE: a chunk never passes its prompt's end and a decode row is one token past
            # it, so the rows that sample are those with tokens that reach the end, each at
            # its last token
            sampling = (num_sched > 0) & (num_computed + num_sched >= prefill_end)
            logits_indices = qsl[1:][sampling] - 1
        else:
            completes = (num_computed + num_sched == prefill_end) & (num_sched > 0)
            samples = np.where(is_prefilling, completes, num_sched)
            first = np.where(is_prefilling, qsl[1:] - 1, qsl[:-1])
            sampling = samples > 0
            if drafts.any():
                logits_indices = np.repeat(first - (samples.cumsum() - samples), samples) + np.arange(int(samples.sum()))
            else:  # NOTE: a row samples at most once: at its first (decode) or last (prefill) token
                logits_indices = first[sampling]
        self._sampling = sampling
        history = chunk_next = None
        if self._outputs is not None:
            if self.history:
                history = self._seen(run, num_computed, qsl, input_ids, logits_indices)
            ends = num_computed + num_sched
            cut = np.flatnonzero(is_prefilling & (num_sched > 0) & (ends < prefill_end))
            chunk_next = np.full(R, -1, dtype=np.int64)
            chunk_next[cut] = self._sequence(run[cut], ends[cut])
        grouped = self.kv.groups is not None
        tables = self.kv.group_block_tables(run) if grouped else self.kv.block_tables(run)
        return GlobalBatch(
            step=step,
            req_ids=run.copy(),
            num_scheduled_tokens=num_sched,
            num_computed_tokens=num_computed,
            is_prefilling=is_prefilling,
            prompt_lens=prefill_end,
            input_ids=input_ids,
            block_tables=tables[0] if grouped else tables,
            group_block_tables=tables if grouped else None,
            logits_indices=logits_indices,
            num_draft_tokens=drafts,
            sampled_history=history,
            chunk_next_ids=chunk_next,
        )

    def _seen(self, run: np.ndarray, num_computed: np.ndarray, qsl: np.ndarray, input_ids: np.ndarray,
              logits_indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``GlobalBatch.sampled_history``: for each sampled token row, its request's tokens at
        positions 0 up to its own (those before this step's from the prompt and outputs, this
        step's from ``input_ids``: drafts included), as (sample, token id), one pass over all."""
        rows = qsl.searchsorted(logits_indices, side="right") - 1
        step_start = num_computed[rows]
        lens = step_start + (logits_indices - qsl[rows]) + 1
        sample = np.repeat(np.arange(len(rows), dtype=np.int64), lens)
        pos = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(lens.cumsum() - lens, lens)
        ids = np.empty(len(pos), dtype=np.int64)
        before = pos < step_start[sample]
        at = np.flatnonzero(before)
        ids[at] = self._sequence(run[rows[sample[at]]], pos[at])
        at = np.flatnonzero(~before)
        ids[at] = input_ids[qsl[rows[sample[at]]] + pos[at] - step_start[sample[at]]]
        return sample, ids

    # -- update ----------------------------------------------------------------------------

    def update(self, batch: GlobalBatch, sampled_token_ids: np.ndarray, end: float | None = None) -> StepOutcome:
        """Apply one step's samples: verify drafts, append tokens, cache the blocks that
        filled, finish and free requests. Clears every pending draft. ``end``: the run's
        clock when the step ended (a timed table's freed slots)."""
        if batch is not self._last_batch:
            raise RuntimeError("update() takes the batch of the latest schedule(), once")
        self._last_batch = None
        rows = self._batch_rows
        n_sched = batch.num_scheduled_tokens
        before = self._num_computed[rows]
        drafted = self.num_speculative_tokens and int(batch.num_draft_tokens.sum())
        acc = accept_drafts(batch, sampled_token_ids) if drafted else _no_drafts(self._sampling, sampled_token_ids)
        sampled = np.asarray(sampled_token_ids, dtype=np.int64).reshape(-1)
        if self.num_speculative_tokens:
            self._num_drafts[rows] = 0
        # A decode row's KV now holds its newest token and its accepted drafts (without
        # drafts, a decode row's 0 or 1 scheduled token).
        after = before + (np.where(batch.is_prefilling, n_sched, (n_sched > 0) * (1 + acc.num_accepted))
                          if drafted else n_sched)
        self._num_computed[rows] = after
        if self._any_cached:
            cached = self._cached[rows]
            ready = rows[(before < cached) & (after >= cached)]
            self._ready_step[ready[self._ready_step[ready] < 0]] = batch.step + 1
        num_out = self._num_out[rows]
        take = np.minimum(acc.num_new_tokens, self._max_out[rows] - num_out)
        # Append row r's tokens sampled[start_r : start_r + take_r] to its outputs.
        if drafted:
            row_of = np.repeat(np.arange(len(rows)), take)
            j = np.arange(len(row_of)) - (take.cumsum() - take)[row_of]
            appended = sampled[acc.sample_start[row_of] + j]
        else:  # NOTE: a row appends at most one token
            row_of = take.nonzero()[0]
            j = np.zeros(len(row_of), dtype=np.int64)
            appended = sampled[acc.sample_start[row_of]]
        take, row_of, j, appended, stopped = cut_at_stop(self.stop_token_ids, take, row_of, j, appended)
        if self._outputs is not None:
            self._outputs[self._output_start[rows[row_of]] + num_out[row_of] + j] = appended
        self._num_out[rows] = num_out + take
        first = rows[(take > 0) & (num_out == 0)]
        self._first_token_step[first] = batch.step
        if self.kv.prefix_caching:
            self._cache_full_blocks(rows, after)
        done = (take > 0) & ((num_out + take >= self._max_out[rows]) | stopped)
        finished = rows[done]
        self._finish_step[finished] = batch.step
        freed = list(self._freed)
        for i in finished.tolist():
            freed.append(self.kv.free(i))
            self._prompt_contents.pop(i, None)
            self._keys.pop(i, None)
        if self.prefill_only:  # NOTE: a prefill pool keeps no decode
            leaving = done | (take > 0)
            handed = rows[leaving & ~done]
        else:
            leaving, handed = done, rows[:0]
        if len(finished) or len(handed):
            self._running = rows[~leaving]
        if len(finished):
            self._num_finished += len(finished)
            if self.arrivals is not None:
                self.arrivals.finished(len(finished), end if self.arrivals.timed else batch.step + 1)
        self._updated_batch = batch
        return StepOutcome(
            step=batch.step,
            req_ids=batch.req_ids.copy(),
            num_appended=take,
            appended_token_ids=appended,
            num_accepted=acc.num_accepted,
            num_proposed=np.asarray(batch.num_draft_tokens, dtype=np.int64).copy(),
            finished_req_ids=finished,
            freed_blocks=np.concatenate(freed) if freed else np.zeros(0, dtype=np.int64),
            first_token=first,
            preempted_req_ids=np.asarray(self._preempted, dtype=np.int64),
            handed_over=handed,
        )

    # -- between pools (disagg=pd) ---------------------------------------------------------

    def can_adopt(self, i: int) -> bool:
        """Whether request i, handed over with its prompt computed, can join this pool now:
        a seat, blocks for its prompt's positions, and no request of this pool waiting
        (preempted ones go first)."""
        n = int(self._num_computed[i])
        return (not self._waiting and len(self._running) + self._joining < self.max_num_seqs
                and self.kv.adopted_blocks(n) <= self.kv.num_free_blocks
                and self.kv.blocks_needed(n) <= self.kv.max_blocks_per_req)

    def adopt(self, i: int, *, join: bool = True) -> np.ndarray:
        """Request i comes over from another pool (its prompt computed there, its first token
        sampled): blocks for its prompt's positions, which the transfer fills
        (``KVCacheManager.adopt``), and (``join``) a place among the running requests as a
        decode; without ``join`` it takes that place when its entries have arrived (``join``).
        Returns its block tables ``[num_groups, entries]``."""
        if self._last_batch is not None:
            raise RuntimeError("adopt() goes between steps")
        tables = self.kv.adopt(int(i), int(self._num_computed[i]))
        self._joining += 1
        if join:
            self.join(i)
        return tables

    def join(self, i: int) -> None:
        """An adopted request whose entries arrived runs from the next step."""
        if self._last_batch is not None:
            raise RuntimeError("join() goes between steps")
        self._joining -= 1
        self._running = np.append(self._running, np.int64(i))

    def release(self, i: int) -> np.ndarray:
        """A handed-over request's blocks go back to this pool (cached ones stay findable):
        its entries now live in the other pool. Returns the blocks freed."""
        self._prompt_contents.pop(int(i), None)
        self._keys.pop(int(i), None)
        self.kv.index(int(i))
        return self.kv.free(int(i))

    # -- prefix caching ------------------------------------------------------------------------

    def _drafter_hit(self, keys: np.ndarray, found: np.ndarray) -> np.ndarray:
        """The blocks of a hit ``found`` (``find_cached`` of ``keys``) that a drafter whose
        entry at p reads the token at p + 1 may reuse: each must have been written followed
        by the block this request has next (``_next_key``), so that its last entry read this
        request's next token; and the last block of that run is left out, as vLLM does for
        EAGLE/MTP (v1/core/single_type_kv_cache_manager.py, FullAttentionManager.
        find_longest_cache_hit: "if use_eagle and computed_blocks: pop the last block"): its
        last entry read a token of a block that did not hit."""
        n = len(found)
        if n < 2:
            return found[:0]
        # NOTE: vLLM's pop alone reuses blocks written followed by another request's: a
        # request whose hit ended at block j computed its own copy of j (the first copy stays
        # the cached one) and cached its next blocks after it; a later request sharing its
        # longer prefix finds the first copy of j, then those blocks (as after two requests
        # that filled the same block in one step)
        follows = self._next_key[found[:-1]] == keys[1:n]
        return found[:int(np.cumprod(follows).sum())]

    def _drafter_hit_of(self, keys: np.ndarray, found: np.ndarray) -> np.ndarray:
        """``find_hit``'s ``found`` (``[groups, n]``) cut to what the drafter may reuse: the
        first group's blocks by ``_drafter_hit`` (a drafter's caches go by that table, a full
        group's), then, with windows, the longest hit within that cut (a shorter prefix of a
        drafter's hit is one too)."""
        m = len(self._drafter_hit(keys, found[0]))
        if m == found.shape[1]:
            return found
        return found[:, :m] if self.kv.groups is None else self.kv.find_hit(keys, m)

    def _note_next_keys(self, r: np.ndarray, j: np.ndarray, keys: np.ndarray) -> None:
        """Block ``j[k]`` of request ``r[k]``, full, is cached under ``keys[k]``: it has no
        successor yet, and it is the successor of block ``j[k] - 1`` (``_drafter_hit``)."""
        self._next_key[self.kv.block_ids(r, j)] = 0
        after = j > 0
        self._next_key[self.kv.block_ids(r[after], j[after] - 1)] = keys[after]

    def _cache_full_blocks(self, rows: np.ndarray, computed: np.ndarray) -> None:
        """Register the blocks each row (``computed`` tokens in the KV cache) filled this
        step under their chained hashes: rows that filled one block at once (decodes), then
        the others (prefill chunks), their keys row by row, in one call."""
        U = self.kv.tokens_per_block
        full = computed // U
        have = self._hashed[rows]
        new = full > have
        if not new.any():
            return
        rows, full, have = rows[new], full[new], have[new]
        one = full == have + 1
        if self._outputs is not None:
            fast = one
        else:  # NOTE: without token ids, a block past the prompt is keyed by the prompt's key
            fast = one & (have >= self._prompt_len[rows] // U) & (self._prompt_key[rows] != 0)
        if fast.any():
            r, j = rows[fast], have[fast]
            values = self._chain_last[r] * prefix.R + self._contents_of_one(r, j)  # NOTE: arrays wrap silently
            keys = prefix.keys(values)
            self.kv.cache_entries(r, j, keys, self._private(r, j))
            if self._next_key is not None:
                self._note_next_keys(r, j, keys)
            self._chain_last[r] = values
            self._hashed[r] = j + 1
        if fast.all():
            return
        # The others' keys one row at a time, cached in one call: as one call per row would
        # (of a hash two rows compute, the first row's block wins).
        rows, have, full = rows[~fast], have[~fast], full[~fast]
        parts = []
        for i, first, n in zip(rows.tolist(), have.tolist(), full.tolist()):
            looked_up = self._keys.get(i)
            if looked_up is not None and len(looked_up[0]) >= n:  # the admission's lookup has them
                values, keys = looked_up[0][first:n], looked_up[1][first:n]
            else:
                values = prefix.chain(self._block_contents(i, first, n), self._chain_last[i])
                keys = prefix.keys(values)
            parts.append(keys)
            self._chain_last[i] = values[-1]
        count = full - have
        r = np.repeat(rows, count)
        j = np.arange(len(r)) + np.repeat(have - (count.cumsum() - count), count)
        keys = parts[0] if len(parts) == 1 else np.concatenate(parts)
        self.kv.cache_entries(r, j, keys, self._private(r, j))
        if self._next_key is not None:
            self._note_next_keys(r, j, keys)
        self._hashed[rows] = full

    def _private(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray | None:
        """Whether block ``j[k]`` of request ``rows[k]`` is its own (``RequestTable.private_from``)
        while it has never been preempted; None when no block is."""
        if self._private_from is None:
            return None
        return (j >= self._private_from[rows]) & (self._num_preempted[rows] == 0)

    def _lookup_keys(self, i: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(chain values, cache keys) of request i's first n blocks, kept while it lives: a
        request waiting for blocks looks up its prefix each step, and its prompt's blocks are
        cached under them as it prefills."""
        have = self._keys.get(i)
        if have is None or len(have[0]) != n:
            values = self.chain_values(i, n)
            have = self._keys[i] = (values, prefix.keys(values))
        return have

    def chain_values(self, i: int, n: int) -> np.ndarray:
        """Chain values (``pcpflow.scheduling.prefix``) of request i's first n blocks."""
        return prefix.chain(self._block_contents(i, 0, n))

    def _block_contents(self, i: int, first: int, n: int) -> np.ndarray:
        """Contents ``c_j`` of request i's blocks [first, n): its token ids (its prompt, then
        its outputs), or, without them, the workload's identity of its prompt and, for the
        blocks holding outputs, that prompt's key (greedy outputs follow from the prompt), or
        with ``sampled_outputs`` the request's own (``_set_prompt_keys``)."""
        U = self.kv.tokens_per_block
        if self._outputs is not None:
            tokens = self._sequence(np.full((n - first) * U, i, dtype=np.int64), np.arange(first * U, n * U, dtype=np.int64),
                                    keyed=True)
            return prefix.token_contents(tokens, U)
        contents, _ = self._prompt_info(i)
        pf = len(contents)
        parts = [contents[first:min(n, pf)]]
        if n > pf:
            start = max(first, pf)
            parts.append(prefix.output_contents_at(self._output_base[i], np.arange(start, n)))
        return np.concatenate(parts) if len(parts) > 1 else parts[0]

    def _prompt_info(self, i: int) -> tuple[np.ndarray, int]:
        """(contents of request i's full prompt blocks, its prompt key), kept while it lives."""
        info = self._prompt_contents.get(i)
        if info is None:
            if self._outputs is None:
                self._key_prompts(i)
                return self._prompt_contents[i]
            info = self._prompt_contents[i] = self.table.prompt_contents(i, self.kv.tokens_per_block)
            self._set_prompt_keys(np.array([i]), np.array([info[1]], dtype=np.uint64))
        return info

    def _set_prompt_keys(self, reqs: np.ndarray, keys: np.ndarray) -> None:
        self._prompt_key[reqs] = np.where(keys == 0, 1, keys)  # NOTE: 0 means "not known yet"
        outputs = self._prompt_key[reqs]
        if self.sampled_outputs:
            outputs = prefix.mix(outputs, reqs.astype(np.uint64) + np.uint64(1))  # NOTE: each request its own
        self._output_base[reqs] = prefix.output_base(outputs)

    def _key_prompts(self, i: int) -> None:
        """Contents and prompt keys of request i and of the next ``KEYED_AHEAD`` requests not
        keyed yet, in a run without token ids (``RequestTable.identity_contents``, array
        operations over them all): a waiting queue reaches them in about that order. A
        request not yet admitted also gets the keys its first lookup asks for."""
        ahead = np.arange(i, min(i + KEYED_AHEAD, len(self._prompt_len)))
        ahead = ahead[(self._finish_step[ahead] < 0) & (self._prompt_key[ahead] == 0)]
        ahead = np.union1d(ahead, [i])
        U = self.kv.tokens_per_block
        contents, starts, keys = self.table.identity_contents(ahead, U)
        # NOTE: a first lookup covers (prompt_len - 1) // U blocks (see _admit)
        fresh = ahead[self._admitted_step[ahead] < 0]
        look = (self._prompt_len[fresh] - 1) // U
        at = np.repeat(starts[np.searchsorted(ahead, fresh)] - (np.cumsum(look) - look), look) + np.arange(look.sum())
        values = prefix.chain(contents[at], lengths=look)
        cache_keys = prefix.keys(values)
        self._set_prompt_keys(ahead, keys)
        for r, (req, key) in enumerate(zip(ahead.tolist(), keys.tolist())):
            self._prompt_contents[req] = (contents[starts[r]:starts[r + 1]], key)
        ends = np.cumsum(look)
        for req, a, b in zip(fresh.tolist(), (ends - look).tolist(), ends.tolist()):
            if req not in self._keys:
                self._keys[req] = (values[a:b], cache_keys[a:b])

    def _contents_of_one(self, rows: np.ndarray, j: np.ndarray) -> np.ndarray:
        """Contents of block ``j[r]`` of each request ``rows[r]`` (one block each)."""
        U = self.kv.tokens_per_block
        if self._outputs is not None:
            pos = (j[:, None] * U + np.arange(U)).ravel()
            return prefix.token_contents(self._sequence(np.repeat(rows, U), pos, keyed=True), U)
        return prefix.output_contents_at(self._output_base[rows], j)

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
            (self._num_computed[rows] >= self._prefill_end[rows])
            & (self._num_out[rows] < self._max_out[rows])
            & (self._finish_step[rows] < 0)
        )
        rows, drafts = rows[decoding], drafts[decoding]
        self._drafts[rows, : drafts.shape[1]] = drafts
        # the number of leading non-negative entries per row
        self._num_drafts[rows] = np.cumprod(drafts >= 0, axis=1).sum(axis=1)


class _Columns:
    """Every request's scheduling state, index = req_id (shared by a router's replicas)."""

    def __init__(self, table: RequestTable, num_speculative_tokens: int) -> None:
        n = len(table)

        def col(value=-1) -> np.ndarray:
            return np.full(n, value, dtype=np.int64)

        self.prompt_len = table.prompt_lens
        self.max_out = table.output_lens
        self.cached = table.cached_lens
        self.any_cached = bool(table.cached_lens.any())  # NOTE: else no request waits for a cached prefix
        self.prefill_end = table.prompt_lens.copy()  # prompt; prompt + outputs once preempted
        self.num_computed = col(0)
        self.num_out = col(0)
        self.drafts = np.zeros((n, num_speculative_tokens), dtype=np.int64)
        self.num_drafts = col(0)
        self.entry_step = col()
        self.ready_step = col()  # the step after its cached_lens prefix was in the cache
        self.admitted_step = col()
        self.first_token_step = col()
        self.finish_step = col()
        self.num_preempted = col(0)
        self.hit_tokens = col(0)
        self.hashed = col(0)  # blocks of its table cached (registered) so far
        self.chain_last = np.full(n, prefix.ROOT, dtype=np.uint64)  # chain value of its block hashed - 1
        self.prompt_key = np.zeros(n, dtype=np.uint64)  # 0: not known yet
        self.output_base = np.zeros(n, dtype=np.uint64)  # prefix.output_base of prompt_key
        self.prompt_contents: dict[int, tuple[np.ndarray, int]] = {}  # of the requests alive
        self.keys: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # its admission's lookup (chain values, keys)
        if table.tokens is not None:
            # Prompts and outputs live in flat buffers, request i's at [start[i], start[i+1]).
            self.prompts = table.tokens
            self.prompt_start = table.token_starts[:-1]
            self.outputs = np.zeros(int(table.output_lens.sum()), dtype=np.int64)
            self.output_start = table.output_lens.cumsum() - table.output_lens
        else:
            self.prompts = self.prompt_start = self.outputs = self.output_start = None


def _table_of(requests: list[Request]) -> RequestTable:
    ids = [r.req_id for r in requests]
    if len(set(ids)) != len(ids) or any(i < 0 for i in ids):
        raise ValueError(f"request ids must be unique and >= 0, got {ids}")
    by_id = sorted(requests, key=lambda r: r.req_id)
    if [r.req_id for r in by_id] != list(range(len(by_id))):
        raise ValueError(f"request ids must be 0..{len(by_id) - 1} (indices into the workload), got {ids}")
    bad = [r.req_id for r in by_id if len(r.prompt_token_ids) < 1 or r.max_output_tokens < 1]
    if bad:
        raise ValueError(f"requests {bad} need a prompt of >= 1 token and max_output_tokens >= 1")
    return RequestTable.from_requests(by_id)


def _no_drafts(sampling: np.ndarray, sampled_token_ids: np.ndarray) -> Acceptance:
    """``accept_drafts`` of a batch without drafts, whose rows ``sampling`` (bool [R]) sample
    once each: one sample per sampling row."""
    n, got = int(np.count_nonzero(sampling)), np.asarray(sampled_token_ids).size
    if got != n:
        raise ValueError(f"expected one sampled token per logits index ({n}), got {got}")
    samples = sampling.astype(np.int64)
    start = samples.cumsum()
    start -= samples
    return Acceptance(np.zeros(len(samples), dtype=np.int64), samples, start)


def _take_in_order(want: np.ndarray, budget: int) -> np.ndarray:
    """Tokens each row gets when the rows, in order, take min(want, what is left)."""
    before = want.cumsum() - want
    return np.clip(budget - before, 0, want)
