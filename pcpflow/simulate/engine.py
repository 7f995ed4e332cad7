"""A simulated run: the executed run's loop in one process, with every step priced.

The loop is the executed run's (``pcpflow.scheduling.loop``): the same ``Scheduler`` on the
same requests, the same plan stage (``plan_layout``), the same counts (``attention_work``,
and the collectives ``pcpflow.layouts.accounting`` lists for the layout, which
``CPAttention`` issues and ``Comm`` counts), the same step records and request timing. What it leaves out is only
what needs tensors: the forward's arithmetic and the collectives' data, replaced by
their price (``pcpflow.simulate.price``: operators), and the sampled token ids (every request
samples token 0: without drafting and EOS stops no count depends on them).

Slot mappings and block tables are not materialised: no count reads them (the KV-write
masks and DCP owners they encode are what ``attention_work`` and ``context_rows`` compute
through ``pcpflow.layouts.slots.dcp_local_seq_lens``); the KV manager still allocates,
caches, evicts and frees every block, so admission, preemption and prefix hits happen as
executed. ``tests/simulate/test_simulate_equality.py`` checks the counts against executed
runs step by step.

Requests are held by their lengths (``pcpflow.scheduling.workload.RequestTable`` without
token ids): a few numbers per request, plus the chained block hashes of the requests
running or waiting when prefix caching needs them. Arrivals come in time where the
workload says so (``request_rate``, trace timestamps): the clock is the sum of the priced
steps, jumping over idle gaps (``pcpflow.scheduling.loop``). ``serving.replicas`` copies
of the instance run behind a router (``pcpflow.simulate.serving``).
"""

from __future__ import annotations

import time
from dataclasses import replace
from operator import add
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from pcpflow.config.hardware import PEAK_OF_DTYPE
from pcpflow.config.run import RunConfig
from pcpflow.layouts.accounting import (
    QUERIES,
    DCPRest,
    attention_rows,
    choose_ring_variant,
    plan_dcp_rest,
)
from pcpflow.models import vocab_size_of
from pcpflow.output.metrics import MetricsRecorder, draft_record, step_record
from pcpflow.pipeline.assemble import resolve_pipeline
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.arrivals import Arrivals
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop, request_columns, request_rows
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.simulate import flash
from pcpflow.simulate.collectives import NCCL_VERSION
from pcpflow.simulate.drafting import SimulatedDrafting, with_phases
from pcpflow.simulate.host import Host, kernels_per_layer, moe_ops
from pcpflow.simulate.prepare import requests_of, sizes_kv_groups
from pcpflow.simulate.price import ROUTED_PURPOSES, Pricer, StepPrice, step_counts
from pcpflow.simulate.serving import Router, run_replicas
from pcpflow.simulate.sizes import DTYPE_BYTES, model_sizes
from pcpflow.simulate.slo_watch import GaveUp, SloWatch
from pcpflow.speculative.drafting import draft_kv_reads_next_token

TOTALS = ("compute_s", "memory_s", "communication_s", "flops", "hbm_bytes")
"""The per-rank figures of every step's price that a run sums (``SimulatedRun.totals``)."""

REQUEST_ROWS_IN_RESULT = 20_000
"""result.json lists each request up to this many; beyond, requests.csv in the run dir does."""

VERIFICATION_OFF = "off: mode=simulate computes nothing, so there is nothing to verify (counts and prices only)"


class _TablelessKV(KVCacheManager):
    """Allocates as executed, but hands the batch a one-column table: a simulated step
    reads no slot (at real lengths a table is requests x 10^4 blocks per step)."""

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(req_ids), 1), dtype=np.int64)

    def group_block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        return np.zeros((self.num_groups, len(req_ids), 1), dtype=np.int64)


class SimulatedRun:
    """One simulated run; ``run()`` returns the result sections, ``records`` every step's
    (kept when ``keep_records``: tests compare them)."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, *, keep_records: bool = True,
                 give_up_below: float | None = None) -> None:
        """``give_up_below``: an SLO attainment; the run stops as soon as it can no longer
        reach it (``pcpflow.simulate.slo_watch``: a goodput search's rate probes)."""
        assert cfg.hardware is not None, "prepare_job checks mode=simulate has a hardware profile"
        self.cfg, self.hw, self.sim = cfg, cfg.hardware, cfg.simulate
        self.run_dir = run_dir
        self.grid = cfg.grid
        self.sizes = model_sizes(cfg.model)
        self.dtype_bytes = DTYPE_BYTES[cfg.dtype]
        specs = {s.name: s for s in resolve_pipeline(cfg)}
        plan_ctx = SimpleNamespace(config=cfg, pcp_size=cfg.pcp, dcp_size=cfg.dcp, layout_dcp_size=cfg.grid.layout_dcp)
        self.plan = specs["plan"].cls(specs["plan"].config, plan_ctx)
        self.dcp_rest_policy = getattr(specs["forward"].config, "dcp_rest", "queries")
        self.cp_attention = getattr(specs["forward"].config, "cp_attention", "allgather")
        rings = self.cp_attention != "allgather" or cfg.simulate.cp_decode == "ring_pass_q"
        if rings and not (cfg.pcp > 1 and cfg.dcp == cfg.pcp):
            raise ValueError(f"a ring runs over a KV cache sharded over the ring: it needs dcp = pcp > 1 "
                             f"(pcp={cfg.pcp}, dcp={cfg.dcp}); prepare_job refuses it before a run starts")
        self.restore = specs["restore"].cls.kind
        self.moe_dispatch = cfg.moe.dispatch or "local"
        self.pricer = _pricer(cfg, self.sizes, self.moe_dispatch)
        self.requests = requests_of(cfg.workload, vocab_size_of(cfg.model), cfg.seed)
        self.drafting = None
        if cfg.draft_enabled:
            work = specs["draft"].config.work(self.sizes.num_layers)
            self.drafting = SimulatedDrafting(cfg, work, self.sizes, self.pricer, len(self.requests))
        self.draft_kv_reads_next_token = draft_kv_reads_next_token(specs.values())
        self.kv_groups = sizes_kv_groups(cfg.kv.hybrid, self.sizes, drafting=cfg.draft_enabled)
        self._build_replicas()
        self.recorder = MetricsRecorder(
            run_dir / "metrics.jsonl" if run_dir is not None else None,
            pcp_size=cfg.pcp,
            num_to_generate=int(self.requests.output_lens.sum()),
        )
        self.keep_records = keep_records
        self.watch = SloWatch.of(cfg, self.requests, fixed_outputs=True, target=give_up_below)
        self.records: list[dict[str, Any]] = []
        # NOTE: per-rank sums as lists of floats (each step adds P floats, as numpy's += did); ``totals`` arrays them
        self._totals = {k: [0.0] * cfg.pcp for k in TOTALS}
        self.breakdown: dict[str, list[float]] = {}
        self.fitted_s: dict[str, float] = {}
        self.picks: dict[str, dict[str, int]] = {}
        self.dcp_rest_steps: dict[str, int] = {}
        self.meta_rule_steps: dict[str, int] = {}

    # -- replicas, arrivals, the clock ----------------------------------------------------------

    def _build_replicas(self) -> None:
        """One scheduler and loop per replica; one replica feeds itself its arrivals (the
        executed run's loop), several share a router's."""
        cfg = self.cfg
        n = cfg.serving.replicas
        self.schedulers: list[Scheduler] = []
        for _ in range(n):
            self.schedulers.append(Scheduler(
                self.requests,
                max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                max_num_seqs=cfg.scheduler.max_num_seqs,
                kv=_TablelessKV(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp, prefix_caching=cfg.kv.prefix_caching,
                                groups=self.kv_groups),
                num_speculative_tokens=cfg.num_speculative_tokens,
                draft_kv_reads_next_token=self.draft_kv_reads_next_token,
                sampled_outputs=not cfg.sampling.greedy,
                feed=n == 1,
                share=self.schedulers[0] if self.schedulers else None,
            ))
        self.loops = [StepLoop(s, max_steps=cfg.max_steps) for s in self.schedulers]
        self.scheduler, self.loop = self.schedulers[0], self.loops[0]
        self.router = None
        if n > 1:
            table = self.requests
            self.arrivals = Arrivals(table.arrival_s if table.timed else table.arrival_steps, table.max_concurrency)
            self.router = Router(cfg.serving.router, self.schedulers)

    @property
    def totals(self) -> dict[str, np.ndarray]:
        """Per-rank sums over the steps: compute, memory and exposed communication seconds, FLOPs, HBM bytes."""
        return {k: np.array(v, dtype=np.float64) for k, v in self._totals.items()}

    @property
    def clock(self) -> float:
        return max(lp.clock for lp in self.loops)

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            if self.router is None:
                for batch in self.loop.batches():
                    self._step(0, batch)
            else:
                run_replicas(self.loops, self.arrivals, self.router, self._step, max_steps=self.cfg.max_steps)
        except GaveUp:
            pass  # the watch says so in the metrics
        finally:
            self.recorder.close()
        wall_s = time.perf_counter() - t0
        cols = self._request_columns()
        cfg = self.cfg
        serving = {"prompt_lens": self.requests.prompt_lens, "gpus": cfg.world_size * cfg.serving.replicas,
                   "ttft_slo_s": cfg.slo.ttft_s, "tpot_slo_s": cfg.slo.tpot_s}
        metrics = self.recorder.summary(cols, wall_s, simulated=True, serving=serving)
        metrics["simulate"] = self._summary()
        metrics["kv_groups"] = None if self.kv_groups is None else self.kv_groups.describe()
        metrics["serving"] = self._serving_summary(cols)
        if self.watch is not None:
            self.watch.report(metrics)
        out = {"outputs": None, "metrics": metrics, "verification": VERIFICATION_OFF}
        if len(self.requests) <= REQUEST_ROWS_IN_RESULT:
            out["requests"] = request_rows(cols, self.requests)
        else:  # NOTE: a row per request as Python objects would cost ~1 KB each
            out["requests"] = None
            if self.run_dir is not None:
                out["requests_file"] = _write_request_rows(self.run_dir / "requests.csv", cols, self.requests)
        return out

    def _request_columns(self) -> dict[str, np.ndarray]:
        if self.router is None:
            return self.loop.request_columns()
        n = len(self.requests)
        parts = []
        for r, lp in enumerate(self.loops):
            req = np.flatnonzero(self.router.replica_of == r)
            parts.append(request_columns(lp.scheduler, lp.step_start, lp.step_end, req, entered_at=self.arrivals.entered_at))
        unrouted = np.flatnonzero(self.router.replica_of < 0)  # a run cut short (max_steps)
        if len(unrouted):
            parts.append(request_columns(self.scheduler, self.loop.step_start, self.loop.step_end, unrouted,
                                         entered_at=self.arrivals.entered_at))
        cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
        order = np.argsort(cols["req_id"], kind="stable")
        assert len(order) == n
        return {k: v[order] for k, v in cols.items()}

    def _serving_summary(self, cols: dict[str, np.ndarray]) -> dict[str, Any]:
        """How the service kept up: the arrivals' span against the run's, and each replica's share."""
        arrived = cols["arrival_s"][~np.isnan(cols["arrival_s"])]
        span = float(arrived.max() - arrived.min()) if len(arrived) else 0.0
        finish = cols["finish_s"][~np.isnan(cols["finish_s"])]
        out: dict[str, Any] = {
            "replicas": self.cfg.serving.replicas,
            "router": self.cfg.serving.router if self.router is not None else None,
            "arrivals_in_time": self.requests.timed,
            "arrival_span_s": span,
            "last_finish_s": float(finish.max()) if len(finish) else None,
            "finished": int(len(finish)),
            "requests": len(self.requests),
        }
        if self.router is not None:
            out["requests_per_replica"] = np.bincount(self.router.replica_of[self.router.replica_of >= 0],
                                                      minlength=self.cfg.serving.replicas).tolist()
        return out

    def _counts(self, batch, layout, rest, ring=None):
        return step_counts(
            batch, layout, grid=self.grid, sizes=self.sizes, dtype_bytes=self.dtype_bytes,
            dcp_rest=rest, interleave=self.cfg.kv.interleave, restore=self.restore,
            dcp_comm_backend=self.cfg.dcp_comm_backend, moe_dispatch=self.moe_dispatch,
            kv_bytes=DTYPE_BYTES[kv_key(self.cfg)], ring=ring,
        )

    def _step(self, replica: int, batch) -> list[int]:
        """Price one batch of ``replica``, apply it, record it; the requests it finished."""
        scheduler, loop = self.schedulers[replica], self.loops[replica]
        state = self.plan(StepState(batch))
        layout = state.layout
        mode = state.dispatch.runtime_mode if state.dispatch is not None else "none"
        rest, counts, p, meta = self._priced(batch, layout, mode)
        drafting, stage_s = self.drafting, None
        if drafting is None:
            sampled = np.zeros(len(batch.logits_indices), dtype=np.int64)
        else:
            calls, nbytes, phases = drafting.step(batch, layout, rest, counts, runtime_mode=mode)
            counts = replace(counts, calls=_summed(counts.calls, calls), nbytes=_summed(counts.nbytes, nbytes))
            p = with_phases(p, phases)
            stage_s = {"draft": sum(q.step_s for _, q in phases)}  # NOTE: the draft stage's priced seconds
            sampled = drafting.sampled(batch)
        outcome = scheduler.update(batch, sampled, end=loop.clock + p.step_s)
        if drafting is not None:
            scheduler.set_draft_tokens(batch, drafting.propose(batch))
        loop.advance(batch, p.step_s, outcome.num_new_tokens)
        record = step_record(batch, layout, attention_work=counts.pairs, calls=counts.calls, nbytes=counts.nbytes,
                             step_s=p.step_s, generated=sum(lp.generated for lp in self.loops),
                             to_generate=self.recorder.num_to_generate, serving=scheduler.stats,
                             num_blocks=self.cfg.kv.num_blocks, time_s=float(loop.step_start[batch.step]),
                             stage_s=stage_s, window_attention_work=counts.window_pairs)
        if self.router is not None:
            record["replica"] = replica
        record.update(draft_record(outcome))
        record.update(_step_fields(rest, counts, p, meta))
        self.recorder.step(record)
        if self.keep_records:
            self.records.append(record)
        self._accumulate(rest, p, meta)
        if self.watch is not None and self.watch.hopeless(self._request_columns, min(lp.clock for lp in self.loops)):
            raise GaveUp
        return outcome.finished_req_ids.tolist()

    def _priced(self, batch, layout, mode: str):
        """The step's algorithm, counts and price. A ring (``cp_attention`` a ring, or a step of
        decodes only under ``simulate.cp_decode=ring_pass_q``) runs the executed ring, its
        variant from ``choose_ring_variant`` (``rest`` None). Otherwise the DCP path:
        ``dcp_rest=auto`` takes the path with the smaller simulated step time (executed, auto
        takes fewer bytes), ``ring_auto``'s rule computed beside it as a reference."""
        variant = self._ring_variant(batch, layout)
        if variant is not None:
            counts = self._counts(batch, layout, QUERIES, variant)
            return None, counts, self.pricer.price(batch, layout, counts, runtime_mode=mode), None
        meta = self._meta_rule(batch, layout)
        candidates = [QUERIES]
        # NOTE: DCP over TP ranks always takes the queries path (CPAttention).
        if self.grid.dcp > 1 and self.grid.dcp_tp == 1 and self.dcp_rest_policy != "queries":
            context = plan_dcp_rest(
                layout, batch.seq_lens, policy="context", dcp_size=self.grid.dcp,
                interleave=self.cfg.kv.interleave, shape=self.sizes.shape_per_rank(self.grid.tp, self.dtype_bytes),
            )
            if context.mode == "context":
                candidates = [context] if self.dcp_rest_policy == "context" else [QUERIES, context]
        priced = []
        for rest in candidates:
            counts = self._counts(batch, layout, rest)
            priced.append((rest, counts, self.pricer.price(batch, layout, counts, runtime_mode=mode)))
        rest, counts, p = priced[0] if len(priced) == 1 else min(priced, key=lambda x: x[2].step_s)
        return rest, counts, p, meta

    def _ring_variant(self, batch, layout) -> str | None:
        """``pass_kv`` | ``pass_q`` when this step runs the ring, else None."""
        policy = self.cp_attention
        if policy == "allgather":
            if self.sim.cp_decode != "ring_pass_q" or batch.is_prefilling[batch.num_scheduled_tokens > 0].any():
                return None
            policy = "ring_pass_q"
        return self._choose(policy, batch, layout)

    def _choose(self, policy: str, batch, layout) -> str:
        """``choose_ring_variant``, the executed ring's choice, with this hardware's numbers:
        the attention's rate (the dense peak at FlashAttention-3's plateau share) and the
        ring's point-to-point rate (``p2p_rate_gbps``)."""
        hw = self.hw
        shape = self.sizes.shape_per_rank(self.grid.tp, DTYPE_BYTES[kv_key(self.cfg)])
        peak = hw.peak(self.pricer.act_key) * 1e12 * float(flash.share(flash.SEQLENS[-1], causal=False))
        bandwidth = self.pricer.place.p2p_gbps("dcp", self.sim.p2p_efficiency) * 1e9
        return choose_ring_variant(policy, layout, batch.positions, shape=shape, peak_flops=peak, bandwidth=bandwidth)

    def _meta_rule(self, batch, layout) -> str | None:
        """What ``ring_auto`` would run for this step, as the DCP path of the same name
        (pass-KV: ``context``, pass-Q: ``queries``); None without DCP rest rows."""
        if self.grid.dcp <= 1 or self.grid.dcp_tp > 1 or not attention_rows(layout)[1]:
            return None
        return "context" if self._choose("ring_auto", batch, layout) == "pass_kv" else "queries"

    def _accumulate(self, rest: DCPRest | None, p: StepPrice, meta: str | None) -> None:
        t = self._totals
        for k in TOTALS:
            t[k] = list(map(add, t[k], getattr(p, k)))
        for k, (e, h) in p.terms.items():
            acc = self.breakdown.setdefault(k, [0.0, 0.0])
            acc[0] += e
            acc[1] += h
        for k, v in p.fitted_s.items():
            self.fitted_s[k] = self.fitted_s.get(k, 0.0) + v
        for purpose, pick in p.picks.items():
            seen = self.picks.setdefault(purpose, {})
            seen[pick] = seen.get(pick, 0) + 1
        if rest is not None:
            self.dcp_rest_steps[rest.mode] = self.dcp_rest_steps.get(rest.mode, 0) + 1
        if meta is not None:
            self.meta_rule_steps[meta] = self.meta_rule_steps.get(meta, 0) + 1

    def _summary(self) -> dict[str, Any]:
        return simulate_summary(self)


def _summed(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}


def _pricer(cfg: RunConfig, sizes, moe_dispatch: str) -> Pricer:
    hw, sim = cfg.hardware, cfg.simulate
    assert hw is not None
    measured = hw.tables is not None and bool(hw.tables.gemm)
    host = Host(launch_s=hw.host.launch_us * 1e-6, graph_launch_s=(hw.host.graph_launch_us or hw.host.launch_us) * 1e-6,
                layer=kernels_per_layer(sizes, cfg.tp), num_layers=sizes.num_layers,
                override=hw.host.kernels_per_layer,
                moe_ops=moe_ops(sizes.num_experts, sizes.top_k, sizes.num_shared_experts, sizes.shared_expert_gate)
                if measured and sizes.num_experts else (0.0, 0.0))
    return Pricer(cfg.grid, hw, sizes, sim, act_key=PEAK_OF_DTYPE[cfg.dtype], kv_key=kv_key(cfg), host=host,
                  moe_dispatch=moe_dispatch, interleave=cfg.kv.interleave, block_size=cfg.kv.block_size)


def kv_key(cfg: RunConfig) -> str:
    """The KV cache's element: ``simulate.kv_dtype``; an executed model priced on a measured
    profile keeps its cache in the run's dtype, as it executes."""
    if cfg.hardware is not None and cfg.hardware.tables is not None and cfg.model.name in ("tiny_mla", "tiny_gqa"):
        return PEAK_OF_DTYPE[cfg.dtype]
    return cfg.simulate.kv_dtype


def _step_fields(rest: DCPRest | None, counts, p: StepPrice, meta: str | None) -> dict[str, Any]:
    """What a simulated step record adds to the executed one's fields (``cp_attention`` and a
    ring's per-rank sends as the executed record has them; the DCP path of an all-gather step)."""
    return {
        **({"dcp_rest": rest.mode} if rest is not None else {}),
        **({"dcp_rest_meta_rule": meta} if meta is not None else {}),
        **({"expected_bytes": list(counts.expected)} if counts.expected else {}),
        "cp_attention": counts.ring or "allgather",
        **({"per_rank_collective_calls": counts.per_rank_calls,
            "per_rank_collective_bytes": counts.per_rank_bytes} if counts.ring else {}),
        "per_rank_compute_s": p.compute_s,
        "per_rank_memory_s": p.memory_s,
        "per_rank_communication_s": p.communication_s,
        "purpose_s": p.purpose_s,
        "hidden_s": {k: v[1] for k, v in p.terms.items() if v[1]},
    }


def simulate_summary(run: SimulatedRun) -> dict[str, Any]:
    """``metrics.simulate``: what the run was priced on, the breakdown by term (exposed and
    hidden seconds, summed over steps on each step's slowest rank), the fitted factors and
    the share of the prediction each makes up."""
    cfg, sim, hw, grid = run.cfg, run.sim, run.hw, run.grid
    run_s = run.recorder.run_s  # busy time, summed over replicas
    gpus = grid.world_size * cfg.serving.replicas
    totals = run.totals
    flops = totals["flops"] * grid.tp  # a PCP rank's TP ranks each do 1/tp
    breakdown = {k: {"exposed_s": v[0], "hidden_s": v[1]} for k, v in sorted(run.breakdown.items())}
    return {
        "hardware": hw.name,
        "device": hw.device,
        "gpus": gpus,
        "nodes": -(-gpus // hw.gpus_per_node),
        "weights_dtype": sim.weights_dtype,
        # NOTE: null for a dense model (no routed expert to store)
        "expert_weights_dtype": (sim.expert_weights_dtype or sim.weights_dtype) if run.sizes.num_experts else None,
        "kv_dtype": sim.kv_dtype,
        "cp_decode": sim.cp_decode,
        "cp_attention": run.cp_attention,
        "nccl": NCCL_VERSION,
        "breakdown_s": breakdown,
        "purpose_s": {k: v["exposed_s"] for k, v in breakdown.items()},
        "fitted": {
            name: {"value": getattr(sim, name), "fitted_on": on,
                   "share": run.fitted_s.get(name, 0.0) / run_s if run_s else 0.0}
            for name, on in sim.FITTED.items()
        },
        "efficiencies": {"gemm": sim.gemm_efficiency, "hbm": sim.hbm_efficiency, "p2p": sim.p2p_efficiency},
        "attention": flash.SOURCE,
        "kernels_per_layer": run.pricer.host.per_layer,
        "collectives": run.picks,
        "per_rank": {k: v.tolist() for k, v in totals.items()},
        "dcp_rest_steps": run.dcp_rest_steps,
        **({"dcp_rest_meta_rule_steps": run.meta_rule_steps} if run.meta_rule_steps else {}),
        # NOTE: all_to_all MoE bytes follow the router; simulated, they are uniform routing's expectation.
        "expected_bytes": (list(ROUTED_PURPOSES)
                           if run.moe_dispatch == "all_to_all" and run.sizes.num_experts else []),
        "tflops_per_gpu": float(flops.sum() / gpus / run_s / 1e12) if run_s else 0.0,
        "scheduler": {
            "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
            "max_num_seqs": cfg.scheduler.max_num_seqs,
            "kv_num_blocks": cfg.kv.num_blocks,
        },
    }


def simulate_run(cfg: RunConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The result sections of a simulated run (``verification`` says it is not verified)."""
    return SimulatedRun(cfg, run_dir, keep_records=False).run()


REQUEST_COLUMNS = ("req_id", "prompt_len", "output_len", "arrival_step", "first_token_step", "finish_step",
                   "arrival_s", "first_token_s", "finish_s", "ttft_s", "ttft_steps", "tpot_s", "tpot_steps", "queue_s",
                   "num_preemptions", "prefix_hit_tokens")


def _write_request_rows(path: Path, cols: dict[str, np.ndarray], requests) -> str:
    """Every request's row, a CSV line each (-1 / nan: not yet), written column-wise by
    numpy: bounded memory, no Python object per request."""
    path = path.with_suffix(".csv")
    table = {**cols, "prompt_len": requests.prompt_lens[cols["req_id"]]}
    ints = {"req_id", "prompt_len", "output_len", "arrival_step", "first_token_step", "finish_step",
            "num_preemptions", "prefix_hit_tokens"}
    data = np.column_stack([table[c].astype(np.float64) for c in REQUEST_COLUMNS])
    np.savetxt(path, data, delimiter=",", header=",".join(REQUEST_COLUMNS), comments="",
               fmt=["%d" if c in ints else "%.9g" for c in REQUEST_COLUMNS])
    return path.name
