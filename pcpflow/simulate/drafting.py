"""Drafting in a simulated run: how many drafts each step verifies and accepts, what the
draft stage counts, and what it costs.

**Acceptance.** A simulated run has no tokens: every request samples token 0, and a draft
is token 0 too (a tokenless batch's input ids). What verification accepts is therefore set
by the samples alone: ``sampled`` puts a 1 at the sample that checks the first rejected
draft (``scheduler.accept_drafts``), so the scheduler accepts, rolls back and schedules
exactly as it does executed. Which draft is rejected is drawn when the drafts are proposed,
per step from ``(seed + seed_offset, step)`` over the batch rows, as the executed ``self``
drafter draws the proposals it corrupts: a draft at position j is rejected with probability
``1 - simulate.draft_acceptance[j]``; ``self`` without it takes ``1 - error_rate``, which is
its executed draws exactly (greedy sampling: its own proposals are the target's), so its
simulated counts are the executed ones.

**Counts.** The drafter declares its step (``DraftConfig.work``: ``DraftWork``); its
collectives are ``pcpflow.layouts.accounting.draft_step_collectives``: its prefill over the
step's layout, the restore of its hidden rows, one forward per replicated step over the
drafting requests (the rows that sampled).

**Price.** Each phase is priced as a forward of the drafter's layers (``Pricer`` on the
drafter's sizes: the target's for ``self``; its MLA layers otherwise, or with
``simulate.draft_layer`` target (auto's on a model card) as many of the target's own layers) after the target's, its
projections into the hidden size beside it; the terms it adds are ``draft_gemm``,
``draft_attention``, ``draft_memory_ops``, ``draft_host_launch`` and its collectives' purposes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np

from pcpflow.layouts.accounting import (
    QUERIES,
    DCPRest,
    attention_work,
    count_collectives,
    draft_step_collectives,
    replicated_layout,
    step_traffic,
)
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.simulate.host import Host, kernels_per_layer
from pcpflow.simulate.price import (
    KV_PURPOSES,
    Pricer,
    StepCounts,
    StepPrice,
    _busiest_shard,
    _tensor_bytes,
)
from pcpflow.simulate.sizes import ModelSizes, drafter_sizes, target_layers
from pcpflow.speculative.drafting import DraftWork, draft_draws

DRAFT_KV_PURPOSES = tuple(f"draft_{p}" for p in KV_PURPOSES[:2])
"""The draft stage's collectives that move KV entries (at ``simulate.kv_dtype``, as the target's)."""

PHASE_TERMS = {"gemm": "draft_gemm", "attention": "draft_attention", "memory_ops": "draft_memory_ops",
               "host_launch": "draft_host_launch"}
"""A drafting phase's own terms, as the step's breakdown names them (collectives keep their purposes)."""


def acceptance_rates(work: DraftWork, given: list[float] | None, k: int) -> np.ndarray:
    """float64 ``[k]``: per draft position, the probability it is accepted when the drafts
    before it were (``given``, its last entry repeated; None: ``1 - error_rate``)."""
    if given is None:
        assert work.error_rate is not None, "prepare_job refuses a drafter without simulate.draft_acceptance"
        return np.full(k, 1.0 - work.error_rate)
    return np.array([given[min(j, len(given) - 1)] for j in range(k)], dtype=np.float64)


class SimulatedDrafting:
    """One run's drafter, simulated: its draws, its counts and its price."""

    def __init__(self, cfg, work: DraftWork, sizes: ModelSizes, pricer: Pricer, num_requests: int) -> None:
        self.cfg, self.work, self.grid = cfg, work, cfg.grid
        self.k = cfg.num_speculative_tokens
        self.rates = acceptance_rates(work, cfg.simulate.draft_acceptance, self.k)
        self.seed = cfg.seed + work.seed_offset
        self.accepts = np.zeros(num_requests, dtype=np.int64)  # per request: drafts its proposals will keep
        if work.layer is None:
            self.sizes = sizes
        elif cfg.simulate.drafter_layers(cfg.model) == "target":
            self.sizes = target_layers(sizes, work.num_layers)
        else:
            self.sizes = drafter_sizes(work.layer, work.num_layers, sizes)
        # NOTE: a drafter's MoE layers route their own rows (no dispatch is installed for it: LOCAL)
        self.pricer = (pricer if self.sizes is sizes and pricer.moe_dispatch == "local"
                       else _drafter_pricer(pricer, self.sizes))
        self.moe_layers = self.sizes.num_moe_layers if self.sizes.num_experts else 0

    # -- what the scheduler sees ------------------------------------------------------------
    def sampled(self, batch: GlobalBatch) -> np.ndarray:
        """int64 ``[S]``: this step's samples, 0 but at the sample that checks each row's
        first rejected draft (the row accepts the drafts before it)."""
        out = np.zeros(len(batch.logits_indices), dtype=np.int64)
        drafts = np.asarray(batch.num_draft_tokens, dtype=np.int64)
        rows = np.flatnonzero(drafts > 0)
        if len(rows):
            kept = np.minimum(self.accepts[batch.req_ids[rows]], drafts[rows])
            first = np.searchsorted(batch.logits_indices, batch.query_start_loc[rows])  # a decode row's first sample
            rejected = kept < drafts[rows]
            out[first[rejected] + kept[rejected]] = 1
        return out

    def propose(self, batch: GlobalBatch) -> np.ndarray:
        """The step's proposals ``[R, k]`` (token 0), drawing how many of each drafting row's
        the next verification keeps."""
        _, u = draft_draws(self.seed, batch.step, batch.num_reqs, self.k)
        rejected = u < 1.0 - self.rates
        rows = drafting_rows(batch)
        self.accepts[batch.req_ids[rows]] = np.cumprod(~rejected[rows], axis=1).sum(axis=1)
        return np.zeros((batch.num_reqs, self.k), dtype=np.int64)

    # -- what the draft stage counts and costs ----------------------------------------------
    def step(self, batch: GlobalBatch, layout, rest: DCPRest | None, target: StepCounts, *,
             runtime_mode: str) -> tuple[dict[str, int], dict[str, int], list[tuple[str, StepPrice]]]:
        """(calls, bytes) by purpose of the draft stage's collectives this step, and the
        price of each of its phases."""
        work, grid = self.work, self.grid
        rest = rest or QUERIES
        rows = drafting_rows(batch)
        m = len(rows)
        n = m * work.rows_per_request
        replicated = [replicated_layout(n, pcp_size=grid.pcp, dcp_size=grid.layout_dcp)] * (work.steps if m else 0)
        shape = self.sizes.shape_per_rank(grid.tp, self.pricer.act_bytes)
        common = dict(tp_size=grid.tp, dcp_size=grid.dcp, shape=shape, backend=self.cfg.dcp_comm_backend,
                      own_tp=work.layer is not None, num_moe_layers=self.moe_layers)
        prefill = draft_step_collectives(layout, [], dcp_rest=rest, prefill=work.prefill, restore=work.restore and m > 0,
                                         **common)
        per_step = draft_step_collectives(replicated[0], [], dcp_rest=QUERIES, prefill="attend", restore=False,
                                          **common) if replicated else []
        calls, nbytes = step_traffic(count_collectives(prefill + per_step * len(replicated)), pcp_size=grid.pcp,
                                     dcp_size=grid.dcp, dtype_bytes=shape.dtype_bytes, tp_size=grid.tp)
        scale = self.pricer.kv_bytes / self.pricer.act_bytes  # NOTE: KV entries move at the cache's dtype
        nbytes = {k: int(v * scale) if k in DRAFT_KV_PURPOSES else v for k, v in nbytes.items()}

        attends = work.prefill == "attend"
        none = np.zeros_like(target.work)
        pre = replace(target, work=target.work if attends else none, decode_work=target.decode_work if attends else none,
                      priced=self._priced(prefill), ring=None, ring_plan=None)
        if not attends and target.window_work is not None:  # NOTE: no layer attends, sliding or not
            pre = replace(pre, window_work=none, window_decode_work=none)
        phases = [("prefill", self._price(batch, layout, pre, runtime_mode, samples=m if work.head_after_prefill else 0,
                                          proj=work.prefill_proj))]
        if replicated:
            rb = _replicated_batch(batch, rows, work.rows_per_request)
            counts = self._replicated_counts(rb, replicated[0], self._priced(per_step))
            price = self._price(rb, replicated[0], counts, runtime_mode, samples=n, proj=work.step_proj)
            phases += [("step", price)] * len(replicated)
        return calls, nbytes, phases

    def _priced(self, colls) -> list[tuple[str, str, str, int, float]]:
        grid = self.grid
        size = {"pcp": grid.pcp, "dcp": grid.dcp, "tp": grid.tp, "dcp_heads": len(grid.dcp_heads_members(0))}
        scale = self.pricer.kv_bytes / self.pricer.act_bytes
        return [(c.purpose, c.op, c.group, k,
                 _tensor_bytes(c, self.pricer.act_bytes) * (scale if c.purpose in DRAFT_KV_PURPOSES else 1.0))
                for c, k in count_collectives(colls).items() if size[c.group] > 1]

    def _replicated_counts(self, rb: GlobalBatch, layout, priced) -> StepCounts:
        """A replicated forward's decode rows, counted on the drafter's layers (through the
        window on the sliding ones, when its layers are a target's that slide: ``self``)."""
        grid = self.grid

        def count(window):
            pairs = attention_work(layout, rb.token_positions, dcp_size=grid.layout_dcp,
                                   interleave=self.cfg.kv.interleave, dcp_rest="queries", window=window)
            work = pairs if grid.dcp_tp == 1 else _busiest_shard(layout, rb.token_positions, grid,
                                                                 self.cfg.kv.interleave, "queries", None, window)
            return pairs, work

        pairs, work = count(None)
        if self.sizes.window is None:
            return StepCounts(pairs, work, work, {}, {}, priced)
        w_pairs, w_work = count(self.sizes.window)
        return StepCounts(pairs, work, work, {}, {}, priced, window_pairs=w_pairs, window_work=w_work,
                          window_decode_work=w_work)

    def _price(self, batch, layout, counts: StepCounts, runtime_mode: str, *, samples: int, proj: int) -> StepPrice:
        p = self.pricer.price(batch, layout, counts, runtime_mode=runtime_mode, samples=samples)
        if proj:
            h, pr = self.sizes.hidden_size, self.pricer
            sec, bound = pr.kern.gemm_scalar(int(layout.padded_num_tokens), h, proj * h, peak_key=pr.w_key,
                                             w_bytes=pr.w_bytes, a_bytes=pr.act_bytes)
            p = _plus_gemm(p, sec, bound, 2.0 * layout.padded_num_tokens * h * proj * h, proj * h * h * pr.w_bytes)
        return p


def drafting_rows(batch: GlobalBatch) -> np.ndarray:
    """Batch rows that sampled this step (``draft_start``'s rows: each drafts from its newest token)."""
    req = batch.logits_req_indices
    if not len(req):
        return req
    return req[np.concatenate(([True], req[1:] != req[:-1]))]


def _replicated_batch(batch: GlobalBatch, rows: np.ndarray, per_request: int) -> GlobalBatch:
    """A replicated forward's rows as one-token decodes: each drafting request's
    ``per_request`` rows after its context (this step's tokens written)."""
    ctx = np.repeat(batch.seq_lens[rows], per_request) + np.tile(np.arange(per_request), len(rows))
    n = len(ctx)
    zeros = np.zeros(n, dtype=np.int64)
    return GlobalBatch(step=batch.step, req_ids=np.arange(n, dtype=np.int64), num_scheduled_tokens=np.ones(n, np.int64),
                       num_computed_tokens=ctx, is_prefilling=np.zeros(n, dtype=bool), prompt_lens=ctx + 1,
                       input_ids=zeros, block_tables=zeros[:, None], logits_indices=np.arange(n, dtype=np.int64),
                       num_draft_tokens=zeros)


def _drafter_pricer(target: Pricer, sizes: ModelSizes) -> Pricer:
    """The target's pricer (grid, hardware, settings, host rates) on the drafter's layers, its
    MoE layers routing their own rows (``moe.dispatch`` is the target forward's)."""
    h = target.host
    host = h if sizes is target.sizes else Host(
        launch_s=h.launch_s, graph_launch_s=h.graph_launch_s, layer=kernels_per_layer(sizes, target.grid.tp),
        num_layers=sizes.num_layers)
    return Pricer(target.grid, target.hw, sizes, target.sim, act_key=target.act_key,
                  kv_key=target.kv_key, host=host,
                  interleave=target.interleave, block_size=target.block_size)


def _plus_gemm(p: StepPrice, sec: float, bound: bool, flops: float, wbytes: float) -> StepPrice:
    """``p`` with one more GEMM on every rank (a drafter's input projection)."""
    terms = dict(p.terms)
    terms["gemm"] = [terms["gemm"][0] + sec, terms["gemm"][1]]
    return replace(p, step_s=p.step_s + sec, terms=terms,
                   compute_s=[c + (sec if bound else 0.0) for c in p.compute_s],
                   memory_s=[m + (0.0 if bound else sec) for m in p.memory_s],
                   fitted_s={**p.fitted_s, "gemm_efficiency": p.fitted_s.get("gemm_efficiency", 0.0)
                             + (sec if bound else 0.0)},
                   flops=[f + flops for f in p.flops], hbm_bytes=[b + wbytes for b in p.hbm_bytes])


def with_phases(p: StepPrice, phases: list[tuple[str, StepPrice]]) -> StepPrice:
    """The step's price with its draft phases after the target's forward (each waits for the
    one before: its collectives synchronize the ranks): seconds, terms and per-rank sums add."""
    terms = {k: list(v) for k, v in p.terms.items()}
    out: dict[str, Any] = dict(step_s=p.step_s, compute_s=list(p.compute_s), memory_s=list(p.memory_s),
                               communication_s=list(p.communication_s), flops=list(p.flops),
                               hbm_bytes=list(p.hbm_bytes))
    fitted, picks = dict(p.fitted_s), dict(p.picks)
    for _, q in phases:
        out["step_s"] += q.step_s
        for key in ("compute_s", "memory_s", "communication_s", "flops", "hbm_bytes"):
            out[key] = [a + b for a, b in zip(out[key], getattr(q, key))]
        for name, (e, h) in q.terms.items():
            acc = terms.setdefault(PHASE_TERMS.get(name, name), [0.0, 0.0])
            acc[0] += e
            acc[1] += h
        for name, v in q.fitted_s.items():
            fitted[name] = fitted.get(name, 0.0) + v
        picks.update(q.picks)
    return StepPrice(terms=terms, fitted_s=fitted, picks=picks, **out)

