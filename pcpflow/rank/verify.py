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
- **KV cache** (every rank): rank 0 broadcasts the reference's cache entries for this
  step's tokens; each rank writes them into an *expected* cache at the slots of the
  positions it owns (all positions without DCP, its shard with DCP), in the columns of the
  KV heads it holds under TP, and compares its whole cache with it: same values where
  expected, untouched (NaN) everywhere else. The slots come from the rule the ``slots``
  stage uses (``pcpflow.attention.metadata.rank_slot_mapping``).
- **MoE routing** (rank 0): the reference takes the run's experts where a router nearly
  ties, and lists it (``pcpflow.rank.routing``).

The verifier never writes the caches of the run it checks: when a request's blocks are
freed (it finished, or was preempted), the expected cache takes over what the run's cache
holds there (checked already), so that a reused block is checked against its new writes
and a stray write into a free block still differs.

Prefix hits and preemptions: a request that starts past what the reference holds for it
(a prefix found in the cache, or a readmission after preemption, whose outputs are
prefilled again) is first *recomputed* by the reference from what it holds (nothing, for a
readmitted request: the reference freed it when it was preempted) up to where the run
starts it, in a step of the reference's own. Those entries go into the expected cache at
the run's slots of those positions: a block the run reuses must hold exactly what
recomputation writes, on every rank and every DCP shard.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from pcpflow.attention.metadata import rank_slot_mapping
from pcpflow.config.run import RunConfig
from pcpflow.models import build_model
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
from pcpflow.scheduling.scheduler import Scheduler, StepOutcome
from pcpflow.tokens.sampling import decision_gap

_MAX_LISTED = 20  # mismatches listed in result.json (all are counted)


class Verifier:
    def __init__(self, cfg: RunConfig, ctx: RankContext, specs: list[StageSpec], world: Comm,
                 scheduler: Scheduler, *, ref_blocks: int | None = None) -> None:
        self.cfg, self.ctx, self.world, self.scheduler = cfg, ctx, world, scheduler
        # per request: positions [0, n) the reference holds (every rank keeps the count)
        self.ref_len = np.zeros(len(scheduler.table), dtype=np.int64)
        self.positions_recomputed = 0
        self.atol = cfg.logits_atol
        self.is_root = world.rank == 0
        self.expected = [torch.full_like(c, float("nan")) for c in ctx.kv_caches]
        self.max_logit_diff = 0.0
        self.max_kv_diff = 0.0
        self.kv_bad_slots = 0
        self.tokens_checked = 0
        self.steps = 0
        self.token_mismatches: list[dict] = []
        self.near_ties: list[dict] = []
        self.num_token_mismatches = 0
        # MoE: every rank records its rows' router logits; the reference routes as the run
        # did where they nearly tie (pcpflow.rank.routing)
        self.routing = RecordRouting() if num_experts(ctx.model) else None
        if self.routing is not None:
            ctx.extras[ROUTING_KEY] = self.routing
        self.routing_report = RoutingReport()
        # Under TP a rank's model and cache hold its heads only; the reference is whole.
        full_spec = getattr(ctx.model, "full_attn_spec", ctx.model.attn_spec)
        self.ref_entry_dim = full_spec.entry_dim
        self.columns = entry_columns(full_spec, ctx.tp.rank, ctx.tp.size).to(ctx.device)
        if self.is_root:
            self.ref_model = ctx.model
            if ctx.tp.size > 1:
                self.ref_model = build_model(cfg.model, dtype=ctx.dtype, seed=cfg.seed, device=ctx.device)
            ref_cfg = cfg.model_copy(update={"tp": 1, "pcp": 1, "dcp": 1})
            # The reference holds the whole context on one rank (dcp times the blocks), and
            # a prefix the run shares once, once per request: room for every seat's longest.
            table = scheduler.table
            longest = int((table.prompt_lens + table.output_lens).max(initial=1)) + cfg.num_speculative_tokens
            per_seat = -(-longest // cfg.kv.block_size)
            ref_blocks = ref_blocks or max(cfg.kv.num_blocks * cfg.dcp, cfg.scheduler.max_num_seqs * per_seat)
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
        num_layers = len(self.ctx.kv_caches)
        rows, catch_pos = self._catch_up_rows(batch)
        n_catch = len(catch_pos)
        ref_entries = torch.empty((num_layers, n_catch + batch.num_tokens, self.ref_entry_dim),
                                  dtype=self.ctx.dtype, device=self.ctx.device)
        step_logit_diff = 0.0
        if self.is_root:
            if n_catch:
                self._catch_up(batch, rows, catch_pos, ref_entries[:, :n_catch])
            step_logit_diff = self._reference_step(state, ref_entries[:, n_catch:], router_logits)
        self.world.broadcast(ref_entries, src=0, purpose="verify")
        catch_req = np.repeat(rows, batch.num_computed_tokens[rows] - self.ref_len[batch.req_ids[rows]])
        if mine:
            self._expect(batch, ref_entries, catch_pos, catch_req)
        self._compare(mine)
        self.ref_len[batch.req_ids] = batch.seq_lens
        self.positions_recomputed += n_catch
        self._release(outcome, mine)
        self.steps += 1
        return step_logit_diff

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

    def _catch_up(self, batch, rows: np.ndarray, positions: np.ndarray, out: torch.Tensor) -> None:
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
            done += self._reference_prefill(batch.step, step, out[:, done:done + used])

    def _reference_prefill(self, step: int, chunks: list[tuple[int, int, int]], out: torch.Tensor) -> int:
        """One reference step prefilling ``(request, start, end)`` chunks; their entries into ``out``."""
        req_ids = np.array([c[0] for c in chunks], dtype=np.int64)
        start = np.array([c[1] for c in chunks], dtype=np.int64)
        end = np.array([c[2] for c in chunks], dtype=np.int64)
        ids = np.concatenate([self.scheduler.token_ids(int(r), int(a), int(e)) for r, a, e in chunks])
        tables = self.ref_kv.block_tables(req_ids)
        catch = GlobalBatch(
            step=step, req_ids=req_ids, num_scheduled_tokens=end - start, num_computed_tokens=start,
            is_prefilling=np.ones(len(chunks), dtype=bool), prompt_lens=end + 1, input_ids=ids,
            block_tables=tables, logits_indices=np.zeros(0, dtype=np.int64),
            num_draft_tokens=np.zeros(len(chunks), dtype=np.int64),
        )
        if self.routing_report.taken:  # NOTE: routed as the run did where it took the run's experts
            keys = self._prefix_keys(catch, np.arange(catch.num_tokens))
            self.ref_ctx.extras[ROUTING_KEY] = RecalledRouting(self.routing_report.taken, keys)
        try:
            self.ref_pipeline(StepState(catch))
        finally:
            self.ref_ctx.extras.pop(ROUTING_KEY, None)
        ref_slots = rank_slot_mapping(catch.positions, catch.req_indices, tables, self.cfg.kv)
        idx = torch.from_numpy(ref_slots).to(self.ctx.device)
        for layer, cache in enumerate(self.ref_ctx.kv_caches):
            out[layer] = cache.index_select(0, idx)
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

    def _reference_step(self, state: StepState, ref_entries: torch.Tensor, router_logits=None) -> float:
        batch = state.batch
        self.ref_kv.allocate_many(batch.req_ids, batch.seq_lens)
        ref_tables = self.ref_kv.block_tables(batch.req_ids)
        if router_logits is not None:  # NOTE: float64 has no near-tie allowance, as for tokens
            allowance = None if self.cfg.dtype == "float64" else self.atol
            self.ref_ctx.extras[ROUTING_KEY] = ForcedRouting(router_logits, allowance, batch, self.routing_report,
                                                             lambda tokens: self._prefix_keys(batch, tokens))
        try:
            ref = self.ref_pipeline(StepState(batch.with_block_tables(ref_tables)))
        finally:
            self.ref_ctx.extras.pop(ROUTING_KEY, None)
        ref_slots = rank_slot_mapping(batch.positions, batch.req_indices, ref_tables, self.cfg.kv)
        idx = torch.from_numpy(ref_slots).to(self.ctx.device)
        for layer, cache in enumerate(self.ref_ctx.kv_caches):
            ref_entries[layer] = cache.index_select(0, idx)

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
        return diff

    def _expect(self, batch: GlobalBatch, ref_entries: torch.Tensor, catch_pos: np.ndarray, catch_rows: np.ndarray) -> None:
        """The reference's entries of this step (recomputed prefixes first, then the step's
        tokens) into the expected cache, at this rank's slots of the positions it owns."""
        self.expect_at(np.concatenate([catch_pos, batch.positions]), np.concatenate([catch_rows, batch.req_indices]),
                       batch.block_tables, ref_entries)

    def expect_at(self, positions: np.ndarray, req_indices: np.ndarray, block_tables: np.ndarray,
                  ref_entries: torch.Tensor) -> None:
        """Full reference entries ``[layers, len(positions), entry]`` of these positions
        (rows ``req_indices`` of ``block_tables``) into the expected cache where this rank
        holds them: its DCP shard's positions, its TP slice's columns."""
        ctx = self.ctx
        slots = rank_slot_mapping(positions, req_indices, block_tables, self.cfg.kv, dcp_size=ctx.dcp_size,
                                  dcp_rank=ctx.dcp_rank)
        owned = torch.from_numpy(np.flatnonzero(slots >= 0)).to(ctx.device)
        owned_slots = torch.from_numpy(slots[slots >= 0]).to(ctx.device)
        for layer, expected in enumerate(self.expected):
            expected.index_copy_(0, owned_slots, ref_entries[layer].index_select(0, owned).index_select(1, self.columns))

    def _compare(self, mine: bool = True) -> None:
        """This rank's whole cache against the expected one; every rank's worst difference
        and mismatched slots summed on rank 0."""
        ctx = self.ctx
        worst, bad = 0.0, 0
        for cache, expected in zip(ctx.kv_caches, self.expected) if mine else ():
            nan_c, nan_e = torch.isnan(cache), torch.isnan(expected)
            both = ~(nan_c | nan_e)
            d = (cache - expected).abs().where(both, torch.zeros((), dtype=cache.dtype, device=cache.device))
            bad_entry = (nan_c != nan_e) | (d > self.atol)
            bad += int(bad_entry.any(dim=1).sum())
            worst = max(worst, float(d.max()) if d.numel() else 0.0)
        # Every rank's worst difference and bad-slot count, on rank 0 (this traffic
        # is verification's own and is not accounted).
        worst_t = self.world.all_reduce(torch.tensor([worst], dtype=torch.float64, device=ctx.device), "verify", op="max")
        bad_t = self.world.all_reduce(torch.tensor([float(bad)], dtype=torch.float64, device=ctx.device), "verify", op="sum")
        self.max_kv_diff = max(self.max_kv_diff, float(worst_t))
        self.kv_bad_slots += int(bad_t)

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
                    for cache in self.ref_ctx.kv_caches:
                        cache.index_fill_(0, slots.to(cache.device), float("nan"))

    def take_over(self, freed_blocks: np.ndarray) -> None:
        """Blocks this rank's pool freed: the expected cache takes over what the run left there,
        so that a reused block is checked against its new writes."""
        if len(freed_blocks):
            b = self.cfg.kv.block_size
            slots = (np.asarray(freed_blocks, dtype=np.int64)[:, None] * b + np.arange(b)).ravel()
            idx = torch.from_numpy(slots).to(self.ctx.device)
            for cache, expected in zip(self.ctx.kv_caches, self.expected):
                expected.index_copy_(0, idx, cache.index_select(0, idx))

    # ------------------------------------------------------------------ summary
    def summary(self) -> dict:
        tokens_match = self.num_token_mismatches == 0
        kv_match = self.kv_bad_slots == 0
        logits_ok = self.max_logit_diff <= self.atol
        routing = self.routing_report.summary(self.atol) if self.routing is not None else {}
        routing_ok = routing.get("routing_match", True)
        return {
            "passed": bool(tokens_match and kv_match and logits_ok and routing_ok),
            "tokens_match": bool(tokens_match),
            "kv_match": bool(kv_match),
            "logits_match": bool(logits_ok),
            "max_abs_logit_diff": self.max_logit_diff,
            "max_abs_kv_diff": self.max_kv_diff,
            "tolerance": self.atol,
            "num_steps_checked": self.steps,
            "num_tokens_checked": self.tokens_checked,
            "num_token_mismatches": self.num_token_mismatches,
            "token_mismatches": self.token_mismatches,
            "near_ties": self.near_ties,
            "kv_mismatched_slots": self.kv_bad_slots,
            "positions_recomputed": self.positions_recomputed,
            **routing,
            "reference": "the same pipeline at tp=1, pcp=1, dcp=1, in-process on rank 0, fed the same batches",
        }

