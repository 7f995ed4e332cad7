"""A simulated run with a prefill pool and a decode pool (``disagg=pd``).

Each pool is priced as a simulated run of its own config prices it (``_PoolPricing``: the
pool's plan, collectives and operators on its grid); the schedulers, the queue between the
pools and the routes of each handover are the executed run's (``pcpflow.scheduling.pools``,
``pcpflow.layouts.transfer``); a handover is priced on the links between the pools
(``pcpflow.simulate.transfer``). Placement: both pools share a node when they fit in one;
otherwise each starts on a node of its own (the decode pool's first rank on the node after
the prefill pool's last), and the handover crosses the NICs.

- **Arrivals in steps** (what the equality with executed runs compares): both pools step in
  the executed run's global loop (``PoolLoop``): the handovers between steps, then both
  batches; a step lasts as long as the slower pool plus the exposed transfers before it.
- **Arrivals in time**: each pool advances on its own clock, the one whose clock is
  earliest running its next step. A prefill step's handed-over requests join the queue as it
  ends; the decode pool adopts the head of the queue at its step boundaries (blocks for the
  prompt, a seat), the transfer runs while it steps on, and the request decodes from the
  first boundary after its entries arrived; the prefill pool frees the blocks at its first
  boundary after that. A pool with nothing to do waits for its next event (an arrival, a
  request ready to hand over, a transfer done); a prefill pool whose blocks are all held
  waits for a transfer to finish.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from pcpflow.config.disagg import POOLS, pool_config
from pcpflow.config.run import RunConfig
from pcpflow.layouts.transfer import KV_TRANSFER, MovedKV, handover_counts, target_kv
from pcpflow.output.metrics import STEP_COUNTS, MetricsRecorder, pool_step_record, step_record
from pcpflow.parallel.transfer import pool_kv
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.scheduling.loop import StepLoop, request_columns, request_rows, steps_between
from pcpflow.scheduling.pools import PoolLoop, pool_schedulers
from pcpflow.simulate.engine import (
    VERIFICATION_OFF,
    SimulatedRun,
    _step_fields,
    _TablelessKV,
    kv_key,
    simulate_summary,
)
from pcpflow.simulate.sizes import DTYPE_BYTES, model_sizes
from pcpflow.simulate.slo_watch import SloWatch
from pcpflow.simulate.transfer import exposed_seconds, transfer_seconds
from pcpflow.speculative.drafting import MLALayerConfig


def handover_kv(cfg: RunConfig, groups: KVGroups | None = None) -> list[MovedKV]:
    """What one handover moves, cache by cache, at ``simulate.kv_dtype``: the target's cache
    (the model card's geometry; with KV ``groups``, its full layers, then its windowed ones:
    ``target_kv``), then a shipped drafter's own cache of the prompt: ``self`` a copy of the
    target's, ``mtp`` one MLA layer of ``draft.layer``, ``dspark`` ``draft.num_layers`` of them
    (``Stage.own_kv`` of the executed stages). Priced runs do not draft yet (``draft`` is
    refused with mode=simulate), so only the counts use the drafter's part: executed drafting
    runs are checked against them."""
    sizes = model_sizes(cfg.model)
    mla = sizes.attention == "mla"
    elem = DTYPE_BYTES[kv_key(cfg)]  # NOTE: a tiny model priced on a measured profile keeps the run's dtype
    kv_heads = None if mla else sizes.num_kv_heads
    src = pool_kv(cfg.grid, cfg.kv.interleave, kv_heads)
    dst = pool_kv(cfg.disagg.decode_grid, cfg.disagg.decode_pool.interleave, kv_heads)
    group_bytes = sizes.entry_dim // (1 if mla else sizes.num_kv_heads) * elem
    hybrid = groups is not None and groups.hybrid
    target = target_kv(src, dst, sizes.num_layers, group_bytes,
                       windowed_layers=groups.num_windowed_layers if hybrid else 0,
                       window=groups.window if hybrid else None,
                       entry_tokens=cfg.kv.block_size * cfg.disagg.decode_grid.dcp)
    if not cfg.draft_enabled:
        return target
    draft = cfg.draft_stage_config()
    kind = draft.get("kind")
    if kind == "self":  # NOTE: the drafter's own copy goes by the first group's table: every layer, every entry
        return [*target, MovedKV(src, dst, sizes.num_layers, group_bytes)]
    if kind not in ("mtp", "dspark"):
        raise ValueError(f"draft={kind}: its own cache is not known to the simulator (shipped drafters: self, mtp, "
                         "dspark)")
    layer = MLALayerConfig(**(draft.get("layer") or {}))
    layers = 1 if kind == "mtp" else int(draft.get("num_layers") or 1)
    latent = MovedKV(pool_kv(cfg.grid, cfg.kv.interleave, None),
                     pool_kv(cfg.disagg.decode_grid, cfg.disagg.decode_pool.interleave, None), layers,
                     layer.cache_entry_dim() * elem)
    return [*target, latent]


class _PoolPricing(SimulatedRun):
    """One pool's plan and prices, on its own config; the pooled run owns the schedulers."""

    def _build_replicas(self) -> None:
        self.router = None

    def price(self, batch, stats, time_s: float) -> dict[str, Any]:
        """Plan and price one of this pool's batches: its step record (``step_s`` its price)."""
        state = self.plan(StepState(batch))
        layout = state.layout
        mode = state.dispatch.runtime_mode if state.dispatch is not None else "none"
        rest, counts, p, meta = self._priced(batch, layout, mode)
        record = step_record(batch, layout, attention_work=counts.pairs, calls=counts.calls, nbytes=counts.nbytes,
                             step_s=p.step_s, generated=0, to_generate=0, serving=stats,
                             num_blocks=self.cfg.kv.num_blocks, time_s=time_s,
                             window_attention_work=counts.window_pairs)
        record.update(_step_fields(rest, counts, p, meta))
        self.recorder.step(record)  # NOTE: this pool's own totals (run_s: its busy seconds)
        self._accumulate(rest, p, meta)
        return record


class PooledRun:
    """One simulated run of both pools; ``run()`` returns the result sections, ``records``
    every step's (kept when ``keep_records``: tests compare them)."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, *, keep_records: bool = True,
                 give_up_below: float | None = None) -> None:
        """``give_up_below``: as ``SimulatedRun``'s, for runs in time (TTFT as the prefill pool
        gives it, TPOT of finished requests)."""
        assert cfg.hardware is not None
        self.cfg, self.run_dir, self.keep_records = cfg, run_dir, keep_records
        self.configs = {n: pool_config(cfg, n) for n in POOLS}
        self.pools = {n: _PoolPricing(self.configs[n], None, keep_records=False) for n in POOLS}
        self.requests = self.pools["prefill"].requests
        self.kv_groups = groups = self.pools["prefill"].kv_groups  # NOTE: one model: both pools' groups
        self.prefill, self.decode = pool_schedulers(self.requests, self.configs["prefill"], self.configs["decode"],
                                                    kv_cls=_TablelessKV, sampled_outputs=not cfg.sampling.greedy,
                                                    groups=groups)
        self.moved = handover_kv(cfg, groups)
        self.num_layers = self.pools["prefill"].sizes.num_layers  # the target's: what a layerwise transfer hides behind
        self.layerwise = cfg.disagg.transfer == "layerwise"
        gpn, wp, wd = cfg.hardware.gpus_per_node, cfg.grid.world_size, cfg.disagg.decode_grid.world_size
        self.offset = wp if wp + wd <= gpn else -(-wp // gpn) * gpn  # the decode pool's first GPU
        self.recorder = MetricsRecorder(run_dir / "metrics.jsonl" if run_dir is not None else None,
                                        pcp_size=cfg.pcp + cfg.disagg.decode_pool.pcp,
                                        num_to_generate=int(self.requests.output_lens.sum()))
        self.records: list[dict[str, Any]] = []
        self.transfer_hidden_s = 0.0
        self.timed = bool(self.requests.timed)
        # NOTE: decodes run on their own clock: an unfinished request's TPOT is not bounded from the prefill's
        self.watch = SloWatch.of(cfg, self.requests, fixed_outputs=False, target=give_up_below) if self.timed else None

    # -- a handover -----------------------------------------------------------------------------
    def _hand_over(self, handed) -> dict[str, Any]:
        """Price each handed-over request's routes; record them on the handover's columns."""
        if not handed:
            return {}
        ho = self._handover
        calls = nbytes = 0
        exposed_total = 0.0
        for i, n, _, _ in handed:
            c, b = handover_counts(n, self.moved, transfer=self.cfg.disagg.transfer)
            t = transfer_seconds(self.moved, n, offset=self.offset, hw=self.cfg.hardware, sim=self.cfg.simulate,
                                 layerwise=self.layerwise)
            exposed = exposed_seconds(t, layerwise=self.layerwise, num_layers=self.num_layers,
                                      prefill_step_s=float(ho.prefill_s[i]), waited=bool(ho.waited[i]))
            ho.record(i, c, b, exposed)
            self.transfer_hidden_s += t - exposed
            calls, nbytes, exposed_total = calls + c, nbytes + b, exposed_total + exposed
        return {"req_ids": [h[0] for h in handed], "tokens": [h[1] for h in handed], "calls": calls, "bytes": nbytes,
                "s": exposed_total}

    def _record(self, step: int, recs: dict, transfer: dict, step_s: float, time_s: float, generated: int,
                scheduled: tuple[str, ...] | None = None) -> None:
        """``scheduled``: the pools whose ``schedule()`` made this step (None: both, a global step)."""
        record = pool_step_record(
            step, recs, pcp={n: self.configs[n].pcp for n in POOLS},
            num_blocks={n: self.configs[n].kv.num_blocks for n in POOLS},
            stats={"prefill": self.prefill.stats, "decode": self.decode.stats}, transfer=transfer,
            queue=len(self._handover), step_s=step_s, time_s=time_s, generated=generated,
            to_generate=self.recorder.num_to_generate, scheduled=scheduled)
        for k in ("per_rank_compute_s", "per_rank_memory_s", "per_rank_communication_s"):  # load.png: both pools' ranks
            record[k] = [v for n in POOLS for v in (recs[n][k] if recs.get(n) else [0.0] * self.configs[n].pcp)]
        self.recorder.step(record)
        if self.keep_records:
            self.records.append(record)

    # -- arrivals in steps: the executed run's global loop --------------------------------------
    def _run_in_steps(self) -> None:
        loop = PoolLoop(self.prefill, self.decode, max_steps=self.cfg.max_steps)
        self._handover = loop.handover
        for ps in loop.steps():
            transfer = self._hand_over(ps.handed)
            loop.handover.release([h[0] for h in ps.handed])
            time_s = loop.clock
            recs: dict[str, Any] = {}
            for name, batch, sched in (("prefill", ps.prefill, self.prefill), ("decode", ps.decode, self.decode)):
                if batch is not None:
                    recs[name] = self.pools[name].price(batch, sched.stats, time_s + transfer.get("s", 0.0))
            ps.prefill_s = recs["prefill"]["step_s"] if "prefill" in recs else 0.0
            zeros = {n: np.zeros(len(b.logits_indices), dtype=np.int64) for n, b in
                     (("prefill", ps.prefill), ("decode", ps.decode)) if b is not None}
            loop.update(ps, zeros.get("prefill"), zeros.get("decode"))
            step_s = transfer.get("s", 0.0) + max((r["step_s"] for r in recs.values()), default=0.0)
            loop.advance(ps, step_s)
            self._record(ps.step, recs, transfer, step_s, time_s, loop.generated)
        self._clock = loop.clock
        self.columns = request_columns(self.prefill, loop.step_start, loop.step_end)

    # -- arrivals in time: a clock per pool -----------------------------------------------------
    def _run_in_time(self) -> None:
        from pcpflow.scheduling.pools import Handover

        # NOTE: each pool step's index in metrics.jsonl (for a step that made no record, the next record's)
        marks: dict[str, list[int]] = {n: [] for n in POOLS}
        self._run_steps = marks
        p_loop = StepLoop(self.prefill, on_step=lambda _: marks["prefill"].append(self.recorder.num_steps))
        d_loop = StepLoop(self.decode, on_step=lambda _: marks["decode"].append(self.recorder.num_steps))
        ho = self._handover = Handover(self.prefill, self.decode)
        arrivals = self.prefill.arrivals
        inflight: list[tuple[float, int]] = []  # (arrives, req): adopted, entries on the way
        released: list[tuple[float, int]] = []  # (arrives, req): prefill blocks to free then
        blocked = False  # the prefill pool has requests but no blocks to run them
        executed, max_steps = 0, self.cfg.max_steps
        generated = 0
        while max_steps is None or executed < max_steps:
            p_next = np.inf
            if self.prefill.has_work:
                p_next = min((t for t, _ in released), default=np.inf) if blocked else p_loop.clock
                p_next = max(p_next, p_loop.clock)
            elif arrivals.next_time() is not None:
                p_next = max(p_loop.clock, float(arrivals.next_time()))
            if self.decode.has_work:
                d_next = d_loop.clock
            else:
                # NOTE: the queue's head is an event only if the pool can take it (its seats may all be in transfer)
                head = [ho.ready_s[ho.queue[0]]] if ho.queue and self.decode.can_adopt(ho.queue[0]) else []
                events = [t for t, _ in inflight] + head
                d_next = max(d_loop.clock, min(events)) if events else np.inf
            if p_next == np.inf and d_next == np.inf:
                if ho.queue or self.prefill.has_work or self.decode.has_work or inflight:
                    raise RuntimeError("the pools are stuck: nothing can run")
                break
            if p_next <= d_next:
                p_loop.clock = p_next
                done = [i for t, i in released if t <= p_next]
                released = [(t, i) for t, i in released if t > p_next]
                ho.release(done)
                batch = p_loop.schedule_step()
                # NOTE: a step that preempted admits no one: the next may (no wait for a transfer then)
                blocked = batch is None and self.prefill.has_work and not self.prefill.stats.num_preempted
                if batch is None:
                    if _counts(self.prefill.stats):  # NOTE: it preempted all it ran (the queue holds blocks)
                        self._record(self.recorder.num_steps, {}, {}, 0.0, p_next, generated, ("prefill",))
                    continue
                rec = self.pools["prefill"].price(batch, self.prefill.stats, p_next)
                out = self.prefill.update(batch, np.zeros(len(batch.logits_indices), np.int64),
                                          end=p_next + rec["step_s"])
                ho.push(out, at=p_next + rec["step_s"], step_s=rec["step_s"])
                p_loop.advance(batch, rec["step_s"], out.num_new_tokens)
                generated += out.num_new_tokens
                executed += 1
                self._record(self.recorder.num_steps, {"prefill": rec}, {}, rec["step_s"], p_next, generated,
                             ("prefill",))
                if self._hopeless(p_loop, d_loop, ho):
                    break
                continue
            d_loop.clock = d_next
            for t, i in [x for x in inflight if x[0] <= d_next]:
                self.decode.join(i)
            inflight = [x for x in inflight if x[0] > d_next]
            handed = ho.admit(self.recorder.num_steps, now=d_next, join=False)  # NOTE: the step recording the transfer
            transfer = self._hand_over(handed)
            for i, *_ in handed:
                arrive = d_next + float(ho.transfer_s[i])
                inflight.append((arrive, i))
                released.append((arrive, i))
            batch = d_loop.schedule_step()
            if batch is None:
                # NOTE: it may have preempted all it ran (blocks held by requests still in transfer)
                if transfer or _counts(self.decode.stats):
                    self._record(self.recorder.num_steps, {}, transfer, 0.0, d_next, generated, ("decode",))
                if self.decode.has_work:  # NOTE: blocks held by requests still in transfer
                    d_loop.clock = min((t for t, _ in inflight), default=np.inf)
                continue
            rec = self.pools["decode"].price(batch, self.decode.stats, d_next)
            out = self.decode.update(batch, np.zeros(len(batch.logits_indices), np.int64), end=d_next + rec["step_s"])
            if len(out.finished_req_ids):
                arrivals.finished(len(out.finished_req_ids), d_next + rec["step_s"])
            d_loop.advance(batch, rec["step_s"], out.num_new_tokens)
            generated += out.num_new_tokens
            executed += 1
            self._record(self.recorder.num_steps, {"decode": rec}, transfer, rec["step_s"], d_next, generated,
                         ("decode",))
            if self._hopeless(p_loop, d_loop, ho):
                break
        self._clock = max(p_loop.clock, d_loop.clock)
        self.columns = self._timed_columns(p_loop, d_loop, ho)

    def _hopeless(self, p_loop: StepLoop, d_loop: StepLoop, ho) -> bool:
        """After a step: whether the run can no longer reach ``give_up_below`` (then it stops)."""
        # NOTE: first tokens come from prefill steps: none still to come ends before the prefill clock
        return self.watch is not None and self.watch.hopeless(lambda: self._timed_columns(p_loop, d_loop, ho),
                                                              p_loop.clock)

    def _timed_columns(self, p_loop: StepLoop, d_loop: StepLoop, ho) -> dict[str, np.ndarray]:
        """The request columns of a run in time: first tokens on the prefill pool's clock,
        finishes on the decode pool's; every step is metrics.jsonl's (either pool's)."""
        # NOTE: a request handed over finished on the decode pool's clock (its steps are that pool's):
        # its finish is read from the prefill pool's steps padded to as many, then replaced
        n = max(len(p_loop.step_end), len(d_loop.step_end))
        start, end = (np.pad(a, (0, n - len(a))) for a in (p_loop.step_start, p_loop.step_end))
        cols = request_columns(self.prefill, start, end)
        fin = (ho.step >= 0) & (cols["finish_step"] >= 0)
        cols["finish_s"][fin] = d_loop.step_end[cols["finish_step"][fin]]
        many = fin & (cols["output_len"] > 1)
        cols["tpot_s"][many] = (cols["finish_s"][many] - cols["first_token_s"][many]) / (cols["output_len"][many] - 1)
        # NOTE: each pool's steps to the run's; a step not yet scheduled (a warm-up just done) is the next record's
        p_steps, d_steps = (np.array([*self._run_steps[n], self.recorder.num_steps]) for n in POOLS)
        for k in ("arrival_step", "first_token_step"):
            ok = cols[k] >= 0
            cols[k][ok] = p_steps[cols[k][ok]]
        finish = cols["finish_step"]
        in_prefill = (finish >= 0) & ~fin  # NOTE: one output: done as its prefill ended
        finish[in_prefill] = p_steps[finish[in_prefill]]
        finish[fin] = d_steps[finish[fin]]
        cols["ttft_steps"], cols["tpot_steps"] = steps_between(cols["arrival_step"], cols["first_token_step"],
                                                               finish, cols["output_len"])
        return cols

    # -- the run ----------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            self._run_in_time() if self.timed else self._run_in_steps()
        finally:
            self.recorder.close()
        wall_s = time.perf_counter() - t0
        cfg, cols = self.cfg, self.columns
        gpus = cfg.world_size
        serving = {"prompt_lens": self.requests.prompt_lens, "gpus": gpus, "ttft_slo_s": cfg.slo.ttft_s,
                   "tpot_slo_s": cfg.slo.tpot_s}
        metrics = self.recorder.summary(cols, wall_s, simulated=True, serving=serving)
        metrics.update(self.recorder.pool_metrics(self._clock, {n: self.configs[n].world_size for n in POOLS},
                                                  cfg.disagg.transfer))
        metrics["transfer"]["hidden_s"] = self.transfer_hidden_s
        metrics["kv_groups"] = None if self.kv_groups is None else self.kv_groups.describe()
        metrics["simulate"] = self._summary()
        if self.watch is not None:
            self.watch.report(metrics)
        rows = self._handover.with_columns(request_rows(cols, self.requests))
        return {"outputs": None, "metrics": metrics, "verification": VERIFICATION_OFF, "requests": rows}

    def _summary(self) -> dict[str, Any]:
        """``metrics.simulate`` over both pools: the prefill pool's summary's keys, with the
        GPUs of both, the breakdown summed over the pools plus the exposed and hidden transfer
        (``kv_transfer``), and each pool's own summary under ``pools``."""
        per_pool = {n: simulate_summary(self.pools[n]) for n in POOLS}
        out = dict(per_pool["prefill"])
        hw, gpus = self.cfg.hardware, self.cfg.world_size
        breakdown: dict[str, dict[str, float]] = {}
        for s in per_pool.values():
            for k, v in s["breakdown_s"].items():
                acc = breakdown.setdefault(k, {"exposed_s": 0.0, "hidden_s": 0.0})
                acc["exposed_s"] += v["exposed_s"]
                acc["hidden_s"] += v["hidden_s"]
        breakdown[KV_TRANSFER] = {"exposed_s": self.recorder.transfer["s"], "hidden_s": self.transfer_hidden_s}
        out.update(gpus=gpus, nodes=-(-(self.offset + self.cfg.disagg.decode_grid.world_size) // hw.gpus_per_node),
                   breakdown_s=dict(sorted(breakdown.items())),
                   purpose_s={k: v["exposed_s"] for k, v in sorted(breakdown.items())},
                   pools=per_pool, decode_pool_first_gpu=self.offset)
        return out


def _counts(stats) -> bool:
    """Whether a ``schedule()`` that ran nothing still did something the metrics count."""
    return any(getattr(stats, k) for k in STEP_COUNTS)


def pooled_run(cfg: RunConfig, run_dir: Path | None = None) -> dict[str, Any]:
    return PooledRun(cfg, run_dir, keep_records=False).run()
