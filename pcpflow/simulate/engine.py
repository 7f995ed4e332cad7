"""A simulated run: the executed run's loop in one process, with every step priced.

The loop is the executed run's (``pcpflow.scheduling.loop``): the same ``Scheduler`` on the
same requests, the same plan stage (``plan_layout``), the same counts (``attention_work``,
and the collectives ``pcpflow.layouts.accounting`` lists for the layout, which
``CPAttention`` issues and ``Comm`` counts), the same step records and request timing. What it leaves out is only
what needs tensors: the forward's arithmetic and the collectives' data, replaced by
their price (``pcpflow.simulate.price``), and the sampled token ids (every request
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

from pcpflow.config.run import RunConfig
from pcpflow.layouts.accounting import QUERIES, plan_dcp_rest
from pcpflow.models import vocab_size_of
from pcpflow.output.metrics import MetricsRecorder, step_record
from pcpflow.pipeline.assemble import resolve_pipeline
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.simulate.prepare import requests_of
from pcpflow.simulate.price import ROUTED_PURPOSES, Placement, price_step, step_counts
from pcpflow.simulate.sizes import DTYPE_BYTES, model_sizes

VERIFICATION_OFF = "off: mode=simulate computes nothing, so there is nothing to verify (counts and prices only)"


class _TablelessKV(KVCacheManager):
    """Allocates as executed, but hands the batch a one-column table: a simulated step
    reads no slot (at real lengths a table is requests x 10^4 blocks per step)."""

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(req_ids), 1), dtype=np.int64)


class SimulatedRun:
    """One simulated run; ``run()`` returns the result sections, ``records`` every step's."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None) -> None:
        assert cfg.hardware is not None, "prepare_job checks mode=simulate has a hardware profile"
        self.cfg, self.hw, self.sim = cfg, cfg.hardware, cfg.simulate
        self.grid = cfg.grid
        self.placement = Placement(self.grid, self.hw)
        self.sizes = model_sizes(cfg.model)
        self.dtype_bytes = DTYPE_BYTES[cfg.dtype]
        specs = {s.name: s for s in resolve_pipeline(cfg)}
        plan_ctx = SimpleNamespace(config=cfg, pcp_size=cfg.pcp, dcp_size=cfg.dcp, layout_dcp_size=cfg.grid.layout_dcp)
        self.plan = specs["plan"].cls(specs["plan"].config, plan_ctx)
        self.dcp_rest_policy = getattr(specs["forward"].config, "dcp_rest", "queries")
        self.restore = specs["restore"].cls.kind
        self.moe_dispatch = cfg.moe.dispatch or "local"
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
        self.purpose_s: dict[str, float] = {}
        self.dcp_rest_steps: dict[str, int] = {}

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

    def _counts(self, batch, layout, rest):
        return step_counts(
            batch, layout, grid=self.grid, sizes=self.sizes, dtype_bytes=self.dtype_bytes,
            dcp_rest=rest, interleave=self.cfg.kv.interleave, restore=self.restore,
            dcp_comm_backend=self.cfg.dcp_comm_backend, moe_dispatch=self.moe_dispatch,
        )

    def _price(self, batch, layout, counts, graphed: bool):
        return price_step(batch, layout, counts, place=self.placement, sizes=self.sizes, sim=self.sim,
                          moe_dispatch=self.moe_dispatch, graphed=graphed)

    def _step(self, batch) -> None:
        state = self.plan(StepState(batch))
        layout = state.layout
        graphed = state.dispatch is not None and state.dispatch.runtime_mode == "full"
        rest = QUERIES
        # NOTE: DCP over TP ranks always takes the queries path (CPAttention).
        if self.grid.dcp > 1 and self.grid.dcp_tp == 1 and self.dcp_rest_policy != "queries":
            rest = plan_dcp_rest(
                layout, batch.seq_lens, policy="context", dcp_size=self.grid.dcp,
                interleave=self.cfg.kv.interleave, shape=self.sizes.shape_per_rank(self.grid.tp, self.dtype_bytes),
            )
        counts = self._counts(batch, layout, rest)
        p = self._price(batch, layout, counts, graphed)
        if self.dcp_rest_policy == "auto" and rest.mode == "context":
            # NOTE: simulating, auto takes the faster path (executed, the one moving fewer bytes).
            q_counts = self._counts(batch, layout, QUERIES)
            q = self._price(batch, layout, q_counts, graphed)
            if q.step_s <= p.step_s:
                rest, counts, p = QUERIES, q_counts, q
        outcome = self.scheduler.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64))
        self.loop.advance(batch, p.step_s, outcome.num_new_tokens)
        record = step_record(batch, layout, attention_work=counts.pairs, calls=counts.calls, nbytes=counts.nbytes,
                             step_s=p.step_s, generated=self.loop.generated, to_generate=self.recorder.num_to_generate)
        record.update({
            "dcp_rest": rest.mode,
            **({"expected_bytes": list(counts.expected)} if counts.expected else {}),
            "per_rank_compute_s": p.compute_s.tolist(),
            "per_rank_memory_s": p.memory_s.tolist(),
            "per_rank_communication_s": p.communication_s.tolist(),
            "purpose_s": p.purpose_s,
        })
        self.recorder.step(record)
        self.records.append(record)
        for k, v in (("compute_s", p.compute_s), ("memory_s", p.memory_s), ("communication_s", p.communication_s),
                     ("flops", p.flops), ("hbm_bytes", p.hbm_bytes)):
            self.totals[k] += v
        for k, v in p.purpose_s.items():
            self.purpose_s[k] = self.purpose_s.get(k, 0.0) + v
        self.dcp_rest_steps[rest.mode] = self.dcp_rest_steps.get(rest.mode, 0) + 1

    def _summary(self) -> dict[str, Any]:
        run_s = self.clock
        gpus = self.grid.world_size
        flops = self.totals["flops"] * self.grid.tp  # a PCP rank's TP ranks each do 1/tp
        return {
            "hardware": self.hw.name,
            "gpus": gpus,
            "nodes": -(-gpus // self.hw.gpus_per_node),
            "weights_dtype": self.sim.weights_dtype,
            "overlap": self.sim.overlap,
            "efficiencies": {
                "gemm": self.sim.gemm_efficiency,
                "attention": self.sim.attention_efficiency,
                "hbm": self.sim.hbm_efficiency,
            },
            "ring_step_us": self.sim.ring_step_us,
            "per_rank": {k: v.tolist() for k, v in self.totals.items()},
            "purpose_s": dict(sorted(self.purpose_s.items())),
            "dcp_rest_steps": self.dcp_rest_steps,
            # NOTE: all_to_all MoE bytes follow the router; simulated, they are uniform routing's expectation.
            "expected_bytes": (list(ROUTED_PURPOSES)
                               if self.moe_dispatch == "all_to_all" and self.sizes.num_experts else []),
            "tflops_per_gpu": float(flops.sum() / gpus / run_s / 1e12) if run_s else 0.0,
            "scheduler": {
                "max_num_batched_tokens": self.cfg.scheduler.max_num_batched_tokens,
                "max_num_seqs": self.cfg.scheduler.max_num_seqs,
                "kv_num_blocks": self.cfg.kv.num_blocks,
            },
        }


def simulate_run(cfg: RunConfig, run_dir: Path | None = None) -> dict[str, Any]:
    """The result sections of a simulated run (``verification`` says it is not verified)."""
    return SimulatedRun(cfg, run_dir).run()
