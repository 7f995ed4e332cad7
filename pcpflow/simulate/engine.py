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
through ``pcpflow.layouts.slots.dcp_local_seq_lens``); the KV manager still allocates and frees
every block, so admission waits for blocks as executed. ``tests/simulate/test_simulate_equality.py``
checks the counts against executed runs step by step.
"""

from __future__ import annotations

import time
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
    plan_dcp_rest,
    rest_requests,
)
from pcpflow.models import vocab_size_of
from pcpflow.output.metrics import MetricsRecorder, step_record
from pcpflow.pipeline.assemble import resolve_pipeline
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.simulate.collectives import NCCL_VERSION
from pcpflow.simulate.host import Host, kernels_per_layer, moe_ops
from pcpflow.simulate.prepare import requests_of
from pcpflow.simulate.price import ROUTED_PURPOSES, Pricer, StepPrice, step_counts
from pcpflow.simulate.ring import RING_PREFILL, RING_PURPOSES, meta_algorithm1
from pcpflow.simulate.sizes import DTYPE_BYTES, model_sizes

VERIFICATION_OFF = "off: mode=simulate computes nothing, so there is nothing to verify (counts and prices only)"


class _TablelessKV(KVCacheManager):
    """Allocates as executed, but hands the batch a one-column table: a simulated step
    reads no slot (at real lengths a table is requests x 10^4 blocks per step)."""

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(req_ids), 1), dtype=np.int64)


class SimulatedRun:
    """One simulated run; ``run()`` returns the result sections, ``records`` every step's."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, *, cp_attention: str | None = None) -> None:
        """``cp_attention``: the prefill's CP attention algorithm (``pipeline.forward.cp_attention``
        once the executed ring lands; until then this argument, for Meta's ring variants)."""
        assert cfg.hardware is not None, "prepare_job checks mode=simulate has a hardware profile"
        self.cfg, self.hw, self.sim = cfg, cfg.hardware, cfg.simulate
        self.grid = cfg.grid
        self.sizes = model_sizes(cfg.model)
        self.dtype_bytes = DTYPE_BYTES[cfg.dtype]
        specs = {s.name: s for s in resolve_pipeline(cfg)}
        plan_ctx = SimpleNamespace(config=cfg, pcp_size=cfg.pcp, dcp_size=cfg.dcp, layout_dcp_size=cfg.grid.layout_dcp)
        self.plan = specs["plan"].cls(specs["plan"].config, plan_ctx)
        self.dcp_rest_policy = getattr(specs["forward"].config, "dcp_rest", "queries")
        self.cp_attention = cp_attention or getattr(specs["forward"].config, "cp_attention", "allgather")
        if self.cp_attention in RING_PREFILL and not (cfg.pcp > 1 and cfg.dcp == cfg.pcp):
            raise ValueError(f"cp_attention={self.cp_attention} runs a ring over a KV cache sharded over the ring: "
                             f"it needs dcp = pcp > 1 (pcp={cfg.pcp}, dcp={cfg.dcp})")
        self.restore = specs["restore"].cls.kind
        self.moe_dispatch = cfg.moe.dispatch or "local"
        self.pricer = _pricer(cfg, self.sizes, self.moe_dispatch)
        self.requests = requests_of(cfg.workload, vocab_size_of(cfg.model), cfg.seed)
        self.scheduler = Scheduler(
            self.requests,
            max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
            max_num_seqs=cfg.scheduler.max_num_seqs,
            kv=_TablelessKV(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp),
            num_speculative_tokens=cfg.num_speculative_tokens,
        )
        self.recorder = MetricsRecorder(
            run_dir / "metrics.jsonl" if run_dir is not None else None,
            pcp_size=cfg.pcp,
            num_to_generate=sum(r.max_output_tokens for r in self.requests),
        )
        self.records: list[dict[str, Any]] = []
        self.loop = StepLoop(self.scheduler, max_steps=cfg.max_steps)
        self.totals = {k: np.zeros(cfg.pcp) for k in ("compute_s", "memory_s", "communication_s", "flops", "hbm_bytes")}
        self.breakdown: dict[str, list[float]] = {}
        self.fitted_s: dict[str, float] = {}
        self.picks: dict[str, dict[str, int]] = {}
        self.dcp_rest_steps: dict[str, int] = {}
        self.meta_rule_steps: dict[str, int] = {}

    @property
    def clock(self) -> float:
        return self.loop.clock

    def run(self) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            for batch in self.loop.batches():
                self._step(batch)
        finally:
            self.recorder.close()
        wall_s = time.perf_counter() - t0
        rows = self.loop.request_rows(self.requests, with_token_ids=False)
        metrics = self.recorder.summary(rows, wall_s, simulated=True)
        metrics["simulate"] = self._summary()
        return {"outputs": None, "requests": rows, "metrics": metrics, "verification": VERIFICATION_OFF}

    def _counts(self, batch, layout, rest, ring=None):
        return step_counts(
            batch, layout, grid=self.grid, sizes=self.sizes, dtype_bytes=self.dtype_bytes,
            dcp_rest=rest, interleave=self.cfg.kv.interleave, restore=self.restore,
            dcp_comm_backend=self.cfg.dcp_comm_backend, moe_dispatch=self.moe_dispatch,
            kv_bytes=DTYPE_BYTES[kv_key(self.cfg)], prefill_ring=ring,
            decode_ring=self.sim.cp_decode == "ring_pass_q",
        )

    def _step(self, batch) -> None:
        state = self.plan(StepState(batch))
        layout = state.layout
        mode = state.dispatch.runtime_mode if state.dispatch is not None else "none"
        rest, counts, p, meta = self._priced(batch, layout, mode)
        outcome = self.scheduler.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64))
        self.loop.advance(batch, p.step_s, outcome.num_new_tokens)
        record = step_record(batch, layout, attention_work=counts.pairs, calls=counts.calls, nbytes=counts.nbytes,
                             step_s=p.step_s, generated=self.loop.generated, to_generate=self.recorder.num_to_generate)
        record.update(_step_fields(rest, counts, p, meta))
        self.recorder.step(record)
        self.records.append(record)
        self._accumulate(rest, p, meta)

    def _priced(self, batch, layout, mode: str):
        """The step's DCP path, counts and price: ``dcp_rest=auto`` takes the path with the
        smaller simulated step time (executed, auto takes fewer bytes), Meta's closed-form
        rule (its Algorithm 1) computed beside as a reference; ``ring_auto`` follows that rule."""
        ring = self.cp_attention if self.cp_attention in RING_PREFILL else None
        meta = self._meta_rule(batch, layout)
        candidates = [QUERIES]
        # NOTE: DCP over TP ranks always takes the queries path (CPAttention).
        if self.grid.dcp > 1 and self.grid.dcp_tp == 1:
            context = plan_dcp_rest(
                layout, batch.seq_lens, policy="context", dcp_size=self.grid.dcp,
                interleave=self.cfg.kv.interleave, shape=self.sizes.shape_per_rank(self.grid.tp, self.dtype_bytes),
            )
            # NOTE: ring_auto follows Meta's rule; the engine's auto, the simulated time.
            policy = {"ring_pass_kv": "context", "ring_pass_q": "queries", "ring_auto": meta}.get(
                ring or "", self.dcp_rest_policy)
            candidates = {"queries": [QUERIES], "context": [context]}.get(policy or "queries", [QUERIES, context])
            if context.mode != "context":
                candidates = [QUERIES]
        priced = []
        for rest in candidates:
            kind = None if ring is None else ("ring_pass_kv" if rest.mode == "context" else "ring_pass_q")
            counts = self._counts(batch, layout, rest, kind)
            priced.append((rest, counts, self.pricer.price(batch, layout, counts, runtime_mode=mode)))
        rest, counts, p = min(priced, key=lambda x: x[2].step_s)
        return rest, counts, p, meta

    def _meta_rule(self, batch, layout) -> str | None:
        """Meta's Algorithm 1 for this step's rest rows (None without DCP rest rows)."""
        if self.grid.dcp <= 1 or self.grid.dcp_tp > 1 or not attention_rows(layout)[1]:
            return None
        req = rest_requests(layout)
        new = int(batch.num_scheduled_tokens[req].sum())
        cached = int(batch.num_computed_tokens[req].sum())
        s, hw = self.sizes, self.hw
        return meta_algorithm1(
            new_tokens=new, cached_tokens=cached, n=self.grid.dcp, num_heads=s.num_heads, num_kv_heads=s.num_kv_heads,
            compute_flops=hw.peak(self.pricer.act_key) * 1e12 * self.sim.attention_efficiency,
            bandwidth=self.pricer.place.p2p_gbps("dcp", self.sim.p2p_efficiency) * 1e9,
            elem_bytes=self.pricer.act_bytes,
        )

    def _accumulate(self, rest: DCPRest, p: StepPrice, meta: str | None) -> None:
        for k, v in (("compute_s", p.compute_s), ("memory_s", p.memory_s), ("communication_s", p.communication_s),
                     ("flops", p.flops), ("hbm_bytes", p.hbm_bytes)):
            self.totals[k] += v
        for k, (e, h) in p.terms.items():
            acc = self.breakdown.setdefault(k, [0.0, 0.0])
            acc[0] += e
            acc[1] += h
        for k, v in p.fitted_s.items():
            self.fitted_s[k] = self.fitted_s.get(k, 0.0) + v
        for purpose, pick in p.picks.items():
            seen = self.picks.setdefault(purpose, {})
            seen[pick] = seen.get(pick, 0) + 1
        self.dcp_rest_steps[rest.mode] = self.dcp_rest_steps.get(rest.mode, 0) + 1
        if meta is not None:
            self.meta_rule_steps[meta] = self.meta_rule_steps.get(meta, 0) + 1

    def _summary(self) -> dict[str, Any]:
        return simulate_summary(self)


def _pricer(cfg: RunConfig, sizes, moe_dispatch: str) -> Pricer:
    hw, sim = cfg.hardware, cfg.simulate
    assert hw is not None
    measured = hw.tables is not None and bool(hw.tables.gemm)
    host = Host(launch_s=hw.host.launch_us * 1e-6, graph_launch_s=(hw.host.graph_launch_us or hw.host.launch_us) * 1e-6,
                layer=kernels_per_layer(sizes, cfg.tp), num_layers=sizes.num_layers,
                override=hw.host.kernels_per_layer,
                moe_ops=moe_ops(sizes.num_experts, sizes.top_k, sizes.num_shared_experts)
                if measured and sizes.num_experts else (0.0, 0.0))
    return Pricer(cfg.grid, hw, sizes, sim, act_key=PEAK_OF_DTYPE[cfg.dtype], kv_key=kv_key(cfg), host=host,
                  moe_dispatch=moe_dispatch)


def kv_key(cfg: RunConfig) -> str:
    """The KV cache's element: ``simulate.kv_dtype``; an executed model priced on a measured
    profile keeps its cache in the run's dtype, as it executes."""
    if cfg.hardware is not None and cfg.hardware.tables is not None and cfg.model.name in ("tiny_mla", "tiny_gqa"):
        return PEAK_OF_DTYPE[cfg.dtype]
    return cfg.simulate.kv_dtype


def _step_fields(rest: DCPRest, counts, p: StepPrice, meta: str | None) -> dict[str, Any]:
    """What a simulated step record adds to the executed one's fields."""
    return {
        "dcp_rest": rest.mode,
        **({"dcp_rest_meta_rule": meta} if meta is not None else {}),
        **({"expected_bytes": list(counts.expected)} if counts.expected else {}),
        **({"cp_attention": counts.ring} if counts.ring else {}),
        "per_rank_compute_s": p.compute_s.tolist(),
        "per_rank_memory_s": p.memory_s.tolist(),
        "per_rank_communication_s": p.communication_s.tolist(),
        "purpose_s": p.purpose_s,
        "hidden_s": {k: v[1] for k, v in p.terms.items() if v[1]},
    }


def simulate_summary(run: SimulatedRun) -> dict[str, Any]:
    """``metrics.simulate``: what the run was priced on, the breakdown by term (exposed and
    hidden seconds, summed over steps on each step's slowest rank), the fitted factors and
    the share of the prediction each makes up."""
    cfg, sim, hw, grid = run.cfg, run.sim, run.hw, run.grid
    run_s = run.clock
    gpus = grid.world_size
    flops = run.totals["flops"] * grid.tp  # a PCP rank's TP ranks each do 1/tp
    breakdown = {k: {"exposed_s": v[0], "hidden_s": v[1]} for k, v in sorted(run.breakdown.items())}
    priced_only = sorted(k for k in run.breakdown if k in RING_PURPOSES)
    return {
        "hardware": hw.name,
        "device": hw.device,
        "gpus": gpus,
        "nodes": -(-gpus // hw.gpus_per_node),
        "weights_dtype": sim.weights_dtype,
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
        "efficiencies": {"gemm": sim.gemm_efficiency, "attention": sim.attention_efficiency, "hbm": sim.hbm_efficiency,
                         "p2p": sim.p2p_efficiency},
        "kernels_per_layer": run.pricer.host.per_layer,
        "collectives": run.picks,
        **({"priced_only": priced_only} if priced_only else {}),
        "per_rank": {k: v.tolist() for k, v in run.totals.items()},
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


def simulate_run(cfg: RunConfig, run_dir: Path | None = None, *, cp_attention: str | None = None) -> dict[str, Any]:
    """The result sections of a simulated run (``verification`` says it is not verified)."""
    return SimulatedRun(cfg, run_dir, cp_attention=cp_attention).run()
