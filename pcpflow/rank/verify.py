"""Verification against the single-rank reference.

The reference is the same pipeline (its target slots) at tp=1, pcp=1, dcp=1, run in-process
on rank 0 in lockstep with the real run and fed the same batches — so the generated
tokens it is fed are the real run's, and one near-tie cannot make the runs drift apart.
Each step:

- **logits and tokens** (rank 0): largest |logit - reference logit|; every sampled token
  must equal the reference's argmax (or, sampling, its keyed draw). In float32 and bfloat16
  a differing token is accepted as a *near-tie* only where the reference's top two logits
  (sampling: the two tokens' perturbed scores, ``pcpflow.tokens.sampling.decision_gap``) are within
  2 * tolerance (either could win under rounding); float64 has no such allowance.
- **KV caches** (every rank): the target's, and every cache a stage keeps of its own
  (``Stage.own_kv``: a drafter's). Rank 0 broadcasts the reference's cache entries for this
  step's tokens; each rank writes them into an *expected* cache at the slots of the
  positions it owns (all positions without DCP, its shard with DCP), in the columns of the
  KV heads it holds under TP, and compares its whole cache with it: same values where
  expected, untouched (NaN) everywhere else. The slots come from the rule the ``slots``
  stage uses (``pcpflow.attention.metadata.rank_slot_mapping``); a drafter's cache is on
  the target's block tables and slot rule, so one rule serves both.
- **KV groups** (a hybrid cache, ``RankContext.kv_groups``): the run's layers share cache
  tensors (``KVGroups.layer_slot``), and so do the expected ones; each layer's entries go to
  the slots of its group's block table (``GlobalBatch.group_block_tables``), none where that
  table points at the null block (the keys a window left); each tensor is compared once. The
  reference keeps one group: it computes the same attention.
- **MoE routing** (rank 0): the reference takes the run's experts where a router nearly
  ties, and lists it (``pcpflow.rank.routing``).

Drafters: the reference runs the stages that keep a cache of their own (the ``draft``
slot) after its target slots, on the run's sampled tokens (what the run's drafter reads).
A drafter's entries are checked at the positions a step *committed*: its tokens less the
drafts it rejected (and every recomputed prefix position). Past them, from the newest token
on, its ``num_speculative_tokens`` positions are the drafter's scratch (rejected drafts'
entries, the entries of its own later draft steps, which follow its own proposals): the
next step's draft prefill writes them again before anything reads them, and the expected
cache takes over what the run holds there. Everywhere else a drafter's cache must be
untouched, as the target's.

The verifier never writes the caches of the run it checks: when a request's blocks are
freed (it finished, or was preempted), the expected cache takes over what the run's cache
holds there (checked already), so that a reused block is checked against its new writes
and a stray write into a free block still differs.

Prefix hits and preemptions: a request that starts past what the reference holds for it
(a prefix found in the cache, or a readmission after preemption, whose outputs are
prefilled again) is first *recomputed* by the reference from what it holds (nothing, for a
readmitted request: the reference freed it when it was preempted) up to where the run
starts it, in a step of the reference's own, drafters included. Those entries go into the
expected caches at the run's slots of those positions: a block the run reuses must hold
exactly what recomputation writes, on every rank and every DCP shard, in the drafter's
cache as in the target's (an MTP entry at p reads the token at p + 1: a reused block whose
last entry read another request's next token differs).

A mismatch is named: ``kv_mismatches`` lists the first ones (the cache, global rank, step,
layer, request, position, slot), ``failures`` says in words what failed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from pcpflow.attention.metadata import rank_slot_mapping
from pcpflow.config.run import RunConfig
from pcpflow.models import build_model
from pcpflow.models.base import AttentionSpec
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.parallel.moe_dispatch import ROUTING_KEY, num_experts
from pcpflow.parallel.tensor_parallel import entry_columns
from pcpflow.pipeline.assemble import TARGET_SLOTS, Pipeline, StageSpec
from pcpflow.pipeline.context import RankContext, allocate_kv_caches
from pcpflow.pipeline.state import StepState
from pcpflow.rank.routing import (
    ForcedRouting,
    RecalledRouting,
    RecordRouting,
    RoutingReport,
    prefix_keys,
)
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.scheduling.scheduler import Scheduler, StepOutcome
from pcpflow.tokens.sampling import decision_gap

_MAX_LISTED = 20  # mismatches listed in result.json (all are counted)
TARGET_CACHE = "target KV cache"


def own_cache_name(slot: str, kind: str) -> str:
    """How a mismatch names a stage's own cache: ``drafter KV cache (draft=mtp)``."""
    if slot == "draft":
        return f"drafter KV cache (draft={kind})"
    return f"KV cache of stage {slot}"


def written_apart(nan_run: torch.Tensor, nan_expected: torch.Tensor) -> str | None:
    """How one slot's written columns (not NaN) differ between the run and the expected entry;
    None where they are the same columns (then the values differ)."""
    missing = bool((nan_run & ~nan_expected).any())  # NaN in the run where a value was expected
    stray = bool((nan_expected & ~nan_run).any())  # a value where nothing (NaN) was expected
    if missing and stray:
        return "written in other columns than expected"
    return "never written" if missing else "a write where none was expected" if stray else None


def _mismatch(run: torch.Tensor, expected: torch.Tensor, atol: float):
    """``(bad_slot, d, nan_run, nan_expected)`` of one layer: the slots whose entries differ
    (beyond ``atol``, or written on one side only), and the differences where both are written."""
    nan_c, nan_e = torch.isnan(run), torch.isnan(expected)
    d = (run - expected).abs().where(~(nan_c | nan_e), torch.zeros((), dtype=run.dtype, device=run.device))
    return ((nan_c != nan_e) | (d > atol)).any(dim=1), d, nan_c, nan_e


def aliased_like(run: list[torch.Tensor]) -> list[torch.Tensor]:
    """NaN tensors shaped as ``run``'s, one per distinct tensor, aliased as ``run``'s layers are
    (a hybrid cache's: ``allocate_kv_caches``)."""
    made: dict[int, torch.Tensor] = {}
    for c in run:
        if id(c) not in made:
            made[id(c)] = torch.full_like(c, float("nan"))
    return [made[id(c)] for c in run]


@dataclass
class CheckedCache:
    """One paged KV cache of this rank under check: the run's (per layer), its expected copy,
    and the reference's (rank 0). ``committed_only``: a drafter's, checked at the positions a
    step committed (module docstring)."""

    name: str
    run: list[torch.Tensor]
    expected: list[torch.Tensor]
    entry_dim: int  # a full (unsharded) entry: the reference's
    columns: torch.Tensor  # this rank's TP columns of a full entry
    committed_only: bool
    ref: list[torch.Tensor] | None = None
    # over every rank and step (summed alike on every rank)
    entries_checked: int = 0  # reference entries expected: a position on a rank, all layers
    bad_slots: int = 0  # mismatched slots, per cache tensor, counted at each step they differ
    max_diff: float = 0.0
    step_entries: int = 0  # this rank's, since the last comparison
    groups: KVGroups | None = None  # a hybrid cache's KV groups (layers share tensors); None: one

    @classmethod
    def of(cls, name: str, spec: AttentionSpec, run: list[torch.Tensor], ctx: RankContext, *,
           committed_only: bool, groups: KVGroups | None = None) -> CheckedCache:
        return cls(name, run, aliased_like(run), spec.entry_dim,
                   entry_columns(spec, ctx.tp.rank, ctx.tp.size).to(ctx.device), committed_only, groups=groups)

    @property
    def tensors(self) -> list[int]:
        """The first layer of each distinct cache tensor (every layer without KV groups)."""
        first: dict[int, int] = {}
        for layer, c in enumerate(self.run):
            first.setdefault(id(c), layer)
        return sorted(first.values())

    def layer_group(self) -> np.ndarray:
        """int64 [layers]: the table (KV group) each layer's entries go by; 0 without groups."""
        return np.zeros(len(self.run), dtype=np.int64) if self.groups is None else self.groups.layer_group


def reference_blocks(pools: list[RunConfig], lengths: np.ndarray, num_speculative_tokens: int = 0) -> int:
    """Blocks of the single-rank reference's cache, for a run of ``pools`` (one config, or
    both pools' under disagg=pd) and requests of ``lengths`` (prompt + output) tokens. It
    holds the whole context on one rank (dcp times a pool's blocks), and a prefix the run
    shares once, once per request: room for each seat's longest request too (seats: at
    most ``max_num_seqs`` and the number of requests). One pool: the larger of the two;
    two (the reference runs both pools' batches): all of them."""
    longest = int(lengths.max(initial=1)) + num_speculative_tokens
    per_seat = -(-longest // pools[0].kv.block_size)
    need = [(c.kv.num_blocks * c.dcp, min(c.scheduler.max_num_seqs, max(len(lengths), 1)) * per_seat) for c in pools]
    return max(need[0]) if len(pools) == 1 else sum(a + b for a, b in need)


class Verifier:
    """The reference of a run and its checks (module docstring), built after the run's
    pipeline: the caches its stages keep (``RankContext.own_kv``) are checked with the target's."""

    def __init__(self, cfg: RunConfig, ctx: RankContext, specs: list[StageSpec], world: Comm,
                 scheduler: Scheduler, *, ref_blocks: int | None = None) -> None:
        self.cfg, self.ctx, self.world, self.scheduler = cfg, ctx, world, scheduler
        # per request: positions [0, n) the reference holds (every rank keeps the count)
        self.ref_len = np.zeros(len(scheduler.table), dtype=np.int64)
        self.positions_recomputed = 0
        self.atol = cfg.logits_atol
        self.is_root = world.rank == 0
        self.max_logit_diff = 0.0
        self.tokens_checked = 0
        self.steps = 0
        self.token_mismatches: list[dict] = []
        self.near_ties: list[dict] = []
        self.num_token_mismatches = 0
        self.kv_mismatches: list[dict] = []  # rank 0: the first ones named, every rank's
        self.num_named = 0  # every rank: mismatches named so far, over all ranks
        self._named: set[tuple[int, int, int]] = set()  # this rank's named (cache, layer, slot)
        # MoE: every rank records its rows' router logits; the reference routes as the run
        # did where they nearly tie (pcpflow.rank.routing)
        self.routing = RecordRouting() if num_experts(ctx.model) else None
        if self.routing is not None:
            ctx.extras[ROUTING_KEY] = self.routing
        self.routing_report = RoutingReport()
        # Under TP a rank's model and cache hold its heads only; the reference is whole.
        full_spec = getattr(ctx.model, "full_attn_spec", ctx.model.attn_spec)
        self.caches = [CheckedCache.of(TARGET_CACHE, full_spec, ctx.kv_caches, ctx, committed_only=False,
                                       groups=ctx.kv_groups)]
        # the stages that keep a cache of their own (a drafter's), by slot (RankContext.own_kv)
        kinds = {s.name: s.cls.kind for s in specs}
        for name, own in ctx.own_kv.items():
            self.caches += [CheckedCache.of(own_cache_name(name, kinds[name]), spec, caches, ctx, committed_only=True)
                            for spec, caches in own]
        # slot -> (request, position) last expected there: names a mismatch
        num_slots = ctx.kv_caches[0].shape[0] if ctx.kv_caches else 0
        self.slot_req = np.full(num_slots, -1, dtype=np.int64)
        self.slot_pos = np.full(num_slots, -1, dtype=np.int64)
        self.slot_group = np.full(num_slots, -1, dtype=np.int64)  # the KV group whose entry that was
        # NOTE: a hybrid cache's slots from here on are the null block's: nothing is ever expected there
        self.pool_slots = num_slots if ctx.kv_groups is None else cfg.kv.num_blocks * cfg.kv.block_size
        if self.is_root:
            self.ref_model = ctx.model
            if ctx.tp.size > 1:
                self.ref_model = build_model(cfg.model, dtype=ctx.dtype, seed=cfg.seed, device=ctx.device)
            table = scheduler.table
            ref_blocks = ref_blocks or reference_blocks([cfg], table.prompt_lens + table.output_lens, cfg.num_speculative_tokens)
            # NOTE: kv.num_blocks is the reference's own: a drafter sizes its cache by it
            ref_cfg = cfg.model_copy(update={"tp": 1, "pcp": 1, "dcp": 1,
                                             "kv": cfg.kv.model_copy(update={"num_blocks": ref_blocks})})
            self.ref_kv = KVCacheManager(ref_blocks, cfg.kv.block_size, 1)
            self.ref_ctx = RankContext(
                config=ref_cfg,
                pcp=Comm.solo(),
                dcp=Comm.solo(),
                world=Comm.solo(),
                device=ctx.device,
                dtype=ctx.dtype,
                model=self.ref_model,
                kv_caches=allocate_kv_caches(self.ref_model, ref_blocks, cfg.kv.block_size, ctx.dtype, ctx.device),
                stats=CommStats(),
                is_reference=True,
                aux_layers=ctx.aux_layers,
                requests=ctx.requests,
            )
            self.ref_pipeline = Pipeline([s for s in specs if s.name in TARGET_SLOTS], self.ref_ctx)
            # NOTE: after the target slots, on the run's sampled tokens (_reference_step)
            drafting = {name for name in ctx.own_kv if name not in TARGET_SLOTS}
            self.ref_drafting = Pipeline([s for s in specs if s.name in drafting], self.ref_ctx)
            ref_caches = [self.ref_ctx.kv_caches, *(caches for name in ctx.own_kv for _, caches in self.ref_ctx.own_kv[name])]
            for cache, ref in zip(self.caches, ref_caches, strict=True):
                cache.ref = ref

    # ------------------------------------------------------------------ per step
    def step(self, state: StepState, outcome: StepOutcome) -> float:
        """Check one step; returns this step's largest logit difference (rank 0)."""
        return self.check(state.batch, state, outcome, router_logits=self.gather_router_logits(state))

    def gather_router_logits(self, state: StepState):
        """The step's router logits in the batch's order (``RecordRouting.gather``): a
        collective over PCP of the ranks that ran the batch; None without experts."""
        return None if self.routing is None else self.routing.gather(self.ctx.pcp, state.batch.num_tokens)

    def check(self, batch: GlobalBatch, state, outcome: StepOutcome, *, mine: bool = True, router_logits=None) -> float:
        """Check one batch: ``state`` (its ``logits`` and ``sampled_token_ids``) is read on
        rank 0, and ``router_logits`` there (``gather_router_logits``) with experts. ``mine``:
        this rank's caches hold the batch's KV (``disagg=pd``: the ranks of the other pool
        take part in the collectives only)."""
        rows, catch_pos = self._catch_up_rows(batch)
        n_catch = len(catch_pos)
        flat, entries = self._entries(n_catch + batch.num_tokens)
        step_logit_diff = 0.0
        if self.is_root:
            if n_catch:
                self._catch_up(batch, rows, catch_pos, [e[:, :n_catch] for e in entries])
            step_logit_diff = self._reference_step(state, [e[:, n_catch:] for e in entries], router_logits)
        self.world.broadcast(flat, src=0, purpose="verify")
        catch_req = np.repeat(rows, batch.num_computed_tokens[rows] - self.ref_len[batch.req_ids[rows]])
        if mine:
            self._expect(batch, outcome, entries, catch_pos, catch_req)
        self._compare(batch.step, mine)
        self.ref_len[batch.req_ids] = batch.seq_lens
        self.positions_recomputed += n_catch
        self._release(outcome, mine)
        self.steps += 1
        return step_logit_diff

    def _entries(self, n: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Room for the reference's full entries of ``n`` positions: one flat buffer (one
        broadcast), and its view per checked cache, ``[layers, n, entry]`` each."""
        sizes = [len(c.run) * n * c.entry_dim for c in self.caches]
        flat = torch.empty(sum(sizes), dtype=self.ctx.dtype, device=self.ctx.device)
        return flat, [part.view(len(c.run), n, c.entry_dim) for c, part in zip(self.caches, flat.split(sizes))]

    def _read_reference(self, ref_slots: np.ndarray, out: list[torch.Tensor]) -> None:
        """The reference's entries at ``ref_slots``, of every checked cache, into ``out``."""
        idx = torch.from_numpy(ref_slots).to(self.ctx.device)
        for cache, o in zip(self.caches, out):
            for layer, ref in enumerate(cache.ref):
                o[layer] = ref.index_select(0, idx)

    def _catch_up_rows(self, batch) -> tuple[np.ndarray, np.ndarray]:
        """Batch rows that start past what the reference holds for them, and the positions
        the reference recomputes for them (row by row)."""
        have = self.ref_len[batch.req_ids]
        rows = np.flatnonzero(batch.num_computed_tokens > have)
        if not len(rows):
            return rows, np.zeros(0, dtype=np.int64)
        start, end = have[rows], batch.num_computed_tokens[rows]
        n = end - start
        offsets = np.arange(int(n.sum())) - np.repeat(n.cumsum() - n, n)
        return rows, np.repeat(start, n) + offsets

    def _catch_up(self, batch, rows: np.ndarray, positions: np.ndarray, out: list[torch.Tensor]) -> None:
        """The reference computes ``rows``' missing prefixes in steps of its own (no logits),
        each within the run's token budget and seats."""
        req_ids = batch.req_ids[rows]
        start, end = self.ref_len[req_ids], batch.num_computed_tokens[rows]
        self.ref_kv.allocate_many(req_ids, end)
        budget, seats = self.cfg.scheduler.max_num_batched_tokens, self.cfg.scheduler.max_num_seqs
        chunks: list[tuple[int, int, int]] = []  # (request, first position, end), in order
        for r, a, e in zip(req_ids.tolist(), start.tolist(), end.tolist()):
            chunks += [(r, p, min(p + budget, e)) for p in range(a, e, budget)]
        done = 0
        while chunks:
            step, used = [], 0
            while chunks and len(step) < seats and used < budget:
                r, a, e = chunks.pop(0)
                take = min(e - a, budget - used)
                step.append((r, a, a + take))
                if a + take < e:
                    chunks.insert(0, (r, a + take, e))
                used += take
            done += self._reference_prefill(batch.step, step, [o[:, done:done + used] for o in out])

    def _reference_prefill(self, step: int, chunks: list[tuple[int, int, int]], out: list[torch.Tensor]) -> int:
        """One reference step prefilling ``(request, start, end)`` chunks; their entries into ``out``."""
        req_ids = np.array([c[0] for c in chunks], dtype=np.int64)
        start = np.array([c[1] for c in chunks], dtype=np.int64)
        end = np.array([c[2] for c in chunks], dtype=np.int64)
        # NOTE: each chunk's tokens and the one after it (the run's next input there): what an
        # MTP head's entry at a chunk's last position reads (its batch's chunk_next_ids)
        seqs = [self.scheduler.token_ids(int(r), int(a), int(e) + 1) for r, a, e in chunks]
        ids = np.concatenate([s[:-1] for s in seqs])
        tables = self.ref_kv.block_tables(req_ids)
        catch = GlobalBatch(
            step=step, req_ids=req_ids, num_scheduled_tokens=end - start, num_computed_tokens=start,
            is_prefilling=np.ones(len(chunks), dtype=bool), prompt_lens=end + 1, input_ids=ids,
            block_tables=tables, logits_indices=np.zeros(0, dtype=np.int64),
            num_draft_tokens=np.zeros(len(chunks), dtype=np.int64),
            chunk_next_ids=np.array([s[-1] for s in seqs], dtype=np.int64),
        )
        if self.routing_report.taken:  # NOTE: routed as the run did where it took the run's experts
            keys = self._prefix_keys(catch, np.arange(catch.num_tokens))
            self.ref_ctx.extras[ROUTING_KEY] = RecalledRouting(self.routing_report.taken, keys)
        try:
            ref = self.ref_pipeline(StepState(catch))
        finally:
            self.ref_ctx.extras.pop(ROUTING_KEY, None)
        self.ref_drafting(ref)
        self._read_reference(rank_slot_mapping(catch.positions, catch.req_indices, tables, self.cfg.kv), out)
        return catch.num_tokens

    def _prefix_keys(self, batch: GlobalBatch, tokens: np.ndarray) -> np.ndarray:
        """The prefix keys (``pcpflow.rank.routing.prefix_keys``) of the batch's ``tokens``:
        each one's request's tokens up to its position."""
        rows, positions = batch.req_indices[tokens], batch.positions[tokens]
        keys = np.empty(len(tokens), dtype=np.uint64)
        for r in np.unique(rows).tolist():  # NOTE: rare: where a near-tie was taken, or recomputing after one
            at = rows == r
            history = self.scheduler.token_ids(int(batch.req_ids[r]), 0, int(positions[at].max()) + 1)
            keys[at] = prefix_keys(history)[positions[at]]
        return keys

    def _reference_step(self, state: StepState, out: list[torch.Tensor], router_logits=None) -> float:
        batch = state.batch
        # NOTE: drafting, the drafter writes its scratch past the step's tokens (the run's lookahead)
        lookahead = self.cfg.num_speculative_tokens if len(self.caches) > 1 else 0
        self.ref_kv.allocate_many(batch.req_ids, batch.seq_lens + lookahead)
        ref_tables = self.ref_kv.block_tables(batch.req_ids)
        if router_logits is not None:  # NOTE: float64 has no near-tie allowance, as for tokens
            allowance = None if self.cfg.dtype == "float64" else self.atol
            self.ref_ctx.extras[ROUTING_KEY] = ForcedRouting(router_logits, allowance, batch, self.routing_report,
                                                             lambda tokens: self._prefix_keys(batch, tokens))
        try:
            ref = self.ref_pipeline(StepState(batch.with_block_tables(ref_tables)))
        finally:
            self.ref_ctx.extras.pop(ROUTING_KEY, None)

        diff = 0.0
        if state.logits is not None and state.logits.numel():
            diff = float((state.logits.to(torch.float64) - ref.logits.to(torch.float64)).abs().max())
            if not math.isfinite(diff):  # NOTE: max(0.0, nan) == 0.0 would hide a NaN logit
                diff = math.inf
        self.max_logit_diff = max(self.max_logit_diff, diff)
        got, want = state.sampled_token_ids, ref.sampled_token_ids
        self.tokens_checked += len(want)
        # NOTE: a choice is made on the penalized logits, where a penalty p scales a seen
        # token's rounding by up to max(p, 1/p): its gap is taken back to logit units
        scores, stretch = ref.logits, 1.0
        if ref.scores is not None:
            scores, stretch = ref.scores, max(self.cfg.repetition_penalty, 1 / self.cfg.repetition_penalty)
        for i in np.flatnonzero(got != want):
            req = int(batch.req_ids[batch.logits_req_indices[i]])
            # greedy: the top-2 gap; sampling: the gap of the two perturbed scores
            gap = decision_gap(scores[i], int(got[i]), int(want[i]), self.cfg.sampling,
                               self.cfg.sampling_seed, req, int(batch.positions[batch.logits_indices[i]]) + 1) / stretch
            entry = {"step": batch.step, "req_id": req, "got": int(got[i]), "reference": int(want[i]), "top2_gap": gap}
            if self.cfg.dtype != "float64" and gap <= 2 * self.atol:
                self.near_ties.append(entry)
            else:
                self.num_token_mismatches += 1
                if len(self.token_mismatches) < _MAX_LISTED:
                    self.token_mismatches.append(entry)
        # NOTE: the drafter reads the run's samples, as the run's drafter did (a near-tie's too)
        ref.sampled_token_ids = np.asarray(got, dtype=np.int64)
        self.ref_drafting(ref)
        self._read_reference(rank_slot_mapping(batch.positions, batch.req_indices, ref_tables, self.cfg.kv), out)
        return diff

    def _expect(self, batch: GlobalBatch, outcome: StepOutcome, entries: list[torch.Tensor], catch_pos: np.ndarray,
                catch_rows: np.ndarray) -> None:
        """The reference's entries of this step (recomputed prefixes first, then the step's
        tokens) into the expected caches, at this rank's slots of the positions it owns; a
        drafter's at the positions the step committed, its scratch past them taken over."""
        rows = np.concatenate([catch_rows, batch.req_indices])
        committed_end = None
        if len(self.caches) > 1:
            # NOTE: a row committed its tokens less the drafts it rejected
            rejected = np.asarray(outcome.num_proposed, dtype=np.int64) - np.asarray(outcome.num_accepted, dtype=np.int64)
            committed_end = batch.num_computed_tokens + batch.num_scheduled_tokens - rejected
            self._take_over_scratch(batch, committed_end)
        committed = None if committed_end is None else np.concatenate(
            [np.ones(len(catch_pos), dtype=bool), batch.positions < committed_end[batch.req_indices]])
        self.expect_at(np.concatenate([catch_pos, batch.positions]), rows, batch.block_tables, entries,
                       req_ids=batch.req_ids[rows], committed=committed, group_tables=batch.group_block_tables)

    def expect_at(self, positions: np.ndarray, req_indices: np.ndarray, block_tables: np.ndarray,
                  entries: list[torch.Tensor], *, req_ids: np.ndarray, committed: np.ndarray | None = None,
                  group_tables: np.ndarray | None = None) -> None:
        """Full reference entries ``[layers, len(positions), entry]`` of these positions
        (rows ``req_indices`` of ``block_tables``; requests ``req_ids``), one tensor per
        checked cache, into the expected caches where this rank holds them: its DCP shard's
        positions, its TP slice's columns. ``committed``: the positions a drafter's cache is
        checked at (None: all). ``group_tables`` ``[G, R, W]``: a hybrid cache's tables, by KV
        group (``GlobalBatch.group_block_tables``; group 0's are ``block_tables``): a layer's
        entries go by its group's table, and nowhere its table points at the null block."""
        ctx = self.ctx
        tables = [block_tables] if group_tables is None or ctx.kv_groups is None else list(group_tables)
        slots = np.stack([rank_slot_mapping(positions, req_indices, t, self.cfg.kv, dcp_size=ctx.dcp_size,
                                            dcp_rank=ctx.dcp_rank) for t in tables])  # [G, T]
        owned = (slots >= 0) & (slots < self.pool_slots)
        for g, (at, mine) in enumerate(zip(slots, owned)):
            self.slot_req[at[mine]] = req_ids[mine]
            self.slot_pos[at[mine]] = positions[mine]
            self.slot_group[at[mine]] = g
        for cache, ref_entries in zip(self.caches, entries):
            # NOTE: a cache without groups (a drafter's) goes by the target's first table, block_tables
            keep = owned if cache.groups is not None else owned[:1]
            if cache.committed_only and committed is not None:
                keep = keep & committed
            idx = [torch.from_numpy(np.flatnonzero(k)).to(ctx.device) for k in keep]
            at = [torch.from_numpy(s[k]).to(ctx.device) for s, k in zip(slots, keep)]
            cache.step_entries += int(keep.any(axis=0).sum())
            for layer, (expected, g) in enumerate(zip(cache.expected, cache.layer_group().tolist())):
                expected.index_copy_(0, at[g], ref_entries[layer].index_select(0, idx[g]).index_select(1, cache.columns))

    def _take_over_scratch(self, batch: GlobalBatch, committed_end: np.ndarray) -> None:
        """A drafter's scratch of this step: the ``num_speculative_tokens`` positions from the
        newest token of each row that sampled (module docstring); the expected caches take
        over what the run holds there. The scheduler allocated them (its lookahead)."""
        k = self.cfg.num_speculative_tokens
        rows = np.unique(batch.logits_req_indices)
        if not k or not len(rows):
            return
        positions = np.repeat(committed_end[rows], k) + np.tile(np.arange(k, dtype=np.int64), len(rows))
        slots = rank_slot_mapping(positions, np.repeat(rows, k), batch.block_tables, self.cfg.kv,
                                  dcp_size=self.ctx.dcp_size, dcp_rank=self.ctx.dcp_rank)
        self._take_over_slots(slots[slots >= 0], [c for c in self.caches if c.committed_only])

    def _compare(self, step: int, mine: bool = True) -> None:
        """This rank's whole caches against the expected ones; every rank's worst difference,
        mismatched slots and entries checked summed on rank 0, the first mismatches named."""
        ctx, n = self.ctx, len(self.caches)
        # NOTE: each cache tensor once (layers of KV groups share them), by its first layer
        layers = [(i, layer) for i, cache in enumerate(self.caches if mine else ()) for layer in cache.tensors]
        # NOTE: one tensor's differences at a time; its count and worst stay on the device until
        # one read for every tensor (a mismatch named computes its tensor's again)
        stats, bad_slots = [], []
        none = torch.zeros((), dtype=torch.float64, device=ctx.device)
        for i, layer in layers:
            bad_slot, d, _, _ = _mismatch(self.caches[i].run[layer], self.caches[i].expected[layer], self.atol)
            stats.append(torch.stack((bad_slot.sum().double(), d.amax().double() if d.numel() else none)))
            bad_slots.append(bad_slot)
        worst, bad = [0.0] * n, [0] * n
        listed: list[dict] = []
        for (i, layer), (count, diff), bad_slot in zip(layers, torch.stack(stats).tolist() if stats else [], bad_slots):
            bad[i] += int(count)
            worst[i] = max(worst[i], diff)
            room = _MAX_LISTED - self.num_named - len(listed)
            if count and room > 0:
                # NOTE: a slot that stays wrong is counted each step, named once
                slots = [s for s in torch.nonzero(bad_slot).flatten().tolist() if (i, layer, s) not in self._named][:room]
                self._named.update((i, layer, s) for s in slots)
                listed += self._describe(self.caches[i], step, layer, slots)
        # Every rank's worst differences, mismatched slots and entries, on rank 0 (this traffic
        # is verification's own and is not accounted).
        entries = [c.step_entries if mine else 0 for c in self.caches]
        worst_t = self.world.all_reduce(torch.tensor(worst, dtype=torch.float64, device=ctx.device), "verify", op="max")
        sums_t = self.world.all_reduce(torch.tensor([*bad, *entries, len(listed)], dtype=torch.float64,
                                                    device=ctx.device), "verify")
        for i, cache in enumerate(self.caches):
            cache.max_diff = max(cache.max_diff, float(worst_t[i]))
            cache.bad_slots += int(sums_t[i])
            cache.entries_checked += int(sums_t[n + i])
            cache.step_entries = 0
        # NOTE: every rank knows how many were named (the sum): all gather, or none does
        named = int(sums_t[2 * n])
        if named and self.num_named < _MAX_LISTED:
            self._gather_mismatches(listed)
        self.num_named += named

    def _describe(self, cache: CheckedCache, step: int, layer: int, slots: list[int]) -> list[dict]:
        """The mismatched ``slots`` of one layer's tensor of ``cache`` on this rank, named."""
        _, d, nan_c, nan_e = _mismatch(cache.run[layer], cache.expected[layer], self.atol)
        out = []
        for s in slots:
            what = written_apart(nan_c[s], nan_e[s])
            out.append({
                "cache": cache.name, "rank": self.world.rank, "step": step, "layer": self._layer_at(cache, layer, s),
                "req_id": int(self.slot_req[s]), "position": int(self.slot_pos[s]), "slot": s,
                "abs_diff": None if what else float(d[s].max()), "what": what or "differs",
            })
        return out

    def _layer_at(self, cache: CheckedCache, layer: int, slot: int) -> int:
        """The layer a mismatch at ``slot`` of ``layer``'s tensor is named by: with KV groups, the
        tensor's layer in the group whose entry was last expected there (else ``layer``)."""
        group = int(self.slot_group[slot]) if cache.groups is not None else -1
        if group < 0:
            return layer
        members, place = cache.groups.layers[group], int(cache.groups.layer_slot[layer])
        return members[place] if place < len(members) else layer

    def _gather_mismatches(self, mine: list[dict]) -> None:
        """Every rank's named mismatches of this step onto rank 0's list (a collective: every
        rank calls it when any rank found one)."""
        every = [mine]
        if self.world.size > 1:
            every = [None] * self.world.size
            dist.all_gather_object(every, mine, group=self.world.group)
        if self.is_root:
            for listed in every:
                self.kv_mismatches += listed[:_MAX_LISTED - len(self.kv_mismatches)]

    def _release(self, outcome: StepOutcome, mine: bool = True) -> None:
        """Blocks the run freed this step: the expected cache takes over what the run left
        there (on the ranks that hold them). The reference frees what it held for finished
        and preempted requests."""
        if mine:
            self.take_over(outcome.freed_blocks)
        gone = np.concatenate([outcome.preempted_req_ids, outcome.finished_req_ids]).astype(np.int64)
        self.ref_len[gone] = 0
        if self.is_root:
            for req_id in gone.tolist():
                if not self.ref_kv.num_blocks_of(req_id):
                    continue
                freed = self.ref_kv.free(req_id)
                if len(freed):
                    b = self.cfg.kv.block_size
                    slots = torch.from_numpy((np.asarray(freed)[:, None] * b + np.arange(b)).ravel())
                    for cache in self.caches:
                        for ref in cache.ref:
                            ref.index_fill_(0, slots.to(ref.device), float("nan"))

    def take_over(self, freed_blocks: np.ndarray) -> None:
        """Blocks this rank's pool freed: the expected caches take over what the run left there,
        so that a reused block is checked against its new writes."""
        if len(freed_blocks):
            b = self.cfg.kv.block_size
            slots = (np.asarray(freed_blocks, dtype=np.int64)[:, None] * b + np.arange(b)).ravel()
            self.slot_req[slots] = -1
            self.slot_pos[slots] = -1
            self.slot_group[slots] = -1
            self._take_over_slots(slots, self.caches)

    def _take_over_slots(self, slots: np.ndarray, caches: list[CheckedCache]) -> None:
        idx = torch.from_numpy(slots).to(self.ctx.device)
        for cache in caches:
            for layer in cache.tensors:
                cache.expected[layer].index_copy_(0, idx, cache.run[layer].index_select(0, idx))

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        target, own = self.caches[0], self.caches[1:]
        tokens_match = self.num_token_mismatches == 0
        kv_match = target.bad_slots == 0
        draft_kv_match = all(c.bad_slots == 0 for c in own)
        logits_ok = self.max_logit_diff <= self.atol
        routing = self.routing_report.summary(self.atol) if self.routing is not None else {}
        routing_ok = routing.get("routing_match", True)
        drafter = {}
        if own:
            drafter = {
                "draft_kv_match": bool(draft_kv_match),
                "max_abs_draft_kv_diff": max(c.max_diff for c in own),
                "draft_kv_mismatched_slots": sum(c.bad_slots for c in own),
                "draft_kv_entries_checked": sum(c.entries_checked for c in own),
            }
        out = {
            "passed": bool(tokens_match and kv_match and draft_kv_match and logits_ok and routing_ok),
            "tokens_match": bool(tokens_match),
            "kv_match": bool(kv_match),
            "logits_match": bool(logits_ok),
            "max_abs_logit_diff": self.max_logit_diff,
            "max_abs_kv_diff": target.max_diff,
            "tolerance": self.atol,
            "num_steps_checked": self.steps,
            "num_tokens_checked": self.tokens_checked,
            "num_token_mismatches": self.num_token_mismatches,
            "token_mismatches": self.token_mismatches,
            "near_ties": self.near_ties,
            "kv_mismatched_slots": target.bad_slots,
            "kv_entries_checked": target.entries_checked,
            **drafter,
            "kv_mismatches": self.kv_mismatches,
            "positions_recomputed": self.positions_recomputed,
            **routing,
            "reference": "the same pipeline at tp=1, pcp=1, dcp=1, in-process on rank 0, fed the same batches",
        }
        out["failures"] = self._failures(out)
        return out

    def _failures(self, v: dict) -> list[str]:
        """What failed, in words, one line per check (empty: passed)."""
        out = []
        if not v["tokens_match"]:
            first = self.token_mismatches[0]
            out.append(f"{self.num_token_mismatches} sampled token(s) differ from the reference's, first at step "
                       f"{first['step']}, request {first['req_id']}: {first['got']} != {first['reference']}")
        if not v["logits_match"]:
            out.append(f"logits differ by up to {self.max_logit_diff:.3g} (tolerance {self.atol:g})")
        for cache in self.caches:
            if cache.bad_slots:
                named = next((m for m in self.kv_mismatches if m["cache"] == cache.name), None)
                where = ""
                if named is not None:
                    at = (f"request {named['req_id']}, position {named['position']}" if named["req_id"] >= 0
                          else "a slot no position was expected at")
                    how = f"off by {named['abs_diff']:.3g}" if named["abs_diff"] is not None else named["what"]
                    where = (f", first on rank {named['rank']} at step {named['step']}: {at} (layer {named['layer']}, "
                             f"slot {named['slot']}) {how}")
                out.append(f"{cache.name} differs from the reference's{where}; {cache.bad_slots} slot mismatch(es) "
                           "over all steps and layers")
        if not v.get("routing_match", True):
            out.append("MoE routing differs from the reference's (routing_mismatches)")
        return out
