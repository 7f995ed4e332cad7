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
from pcpflow.scheduling.arrivals import Arrivals
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop, request_columns, request_rows
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.simulate.prepare import requests_of
from pcpflow.simulate.price import ROUTED_PURPOSES, Placement, price_step, step_counts
from pcpflow.simulate.serving import Router, run_replicas
from pcpflow.simulate.sizes import DTYPE_BYTES, model_sizes

REQUEST_ROWS_IN_RESULT = 20_000
"""result.json lists each request up to this many; beyond, requests.csv in the run dir does."""

VERIFICATION_OFF = "off: mode=simulate computes nothing, so there is nothing to verify (counts and prices only)"


class _TablelessKV(KVCacheManager):
    """Allocates as executed, but hands the batch a one-column table: a simulated step
    reads no slot (at real lengths a table is requests x 10^4 blocks per step)."""

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        return np.zeros((len(req_ids), 1), dtype=np.int64)


class SimulatedRun:
    """One simulated run; ``run()`` returns the result sections, ``records`` every step's
    (kept when ``keep_records``: tests compare them)."""

    def __init__(self, cfg: RunConfig, run_dir: Path | None = None, *, keep_records: bool = True) -> None:
        assert cfg.hardware is not None, "prepare_job checks mode=simulate has a hardware profile"
        self.cfg, self.hw, self.sim = cfg, cfg.hardware, cfg.simulate
        self.run_dir = run_dir
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
        self._build_replicas()
        self.recorder = MetricsRecorder(
            run_dir / "metrics.jsonl" if run_dir is not None else None,
            pcp_size=cfg.pcp,
            num_to_generate=int(self.requests.output_lens.sum()),
        )
        self.keep_records = keep_records
        self.records: list[dict[str, Any]] = []
        self.totals = {k: np.zeros(cfg.pcp) for k in ("compute_s", "memory_s", "communication_s", "flops", "hbm_bytes")}
        self.purpose_s: dict[str, float] = {}
        self.dcp_rest_steps: dict[str, int] = {}

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
                kv=_TablelessKV(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp, prefix_caching=cfg.kv.prefix_caching),
                num_speculative_tokens=cfg.num_speculative_tokens,
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
        finally:
            self.recorder.close()
        wall_s = time.perf_counter() - t0
        cols = self._request_columns()
        cfg = self.cfg
        serving = {"prompt_lens": self.requests.prompt_lens, "gpus": cfg.world_size * cfg.serving.replicas,
                   "ttft_slo_s": cfg.slo.ttft_s, "tpot_slo_s": cfg.slo.tpot_s}
        metrics = self.recorder.summary(cols, wall_s, simulated=True, serving=serving)
        metrics["simulate"] = self._summary()
        metrics["serving"] = self._serving_summary(cols)
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

    def _counts(self, batch, layout, rest):
        return step_counts(
            batch, layout, grid=self.grid, sizes=self.sizes, dtype_bytes=self.dtype_bytes,
            dcp_rest=rest, interleave=self.cfg.kv.interleave, restore=self.restore,
            dcp_comm_backend=self.cfg.dcp_comm_backend, moe_dispatch=self.moe_dispatch,
        )

    def _price(self, batch, layout, counts, graphed: bool):
        return price_step(batch, layout, counts, place=self.placement, sizes=self.sizes, sim=self.sim,
                          moe_dispatch=self.moe_dispatch, graphed=graphed)

    def _step(self, replica: int, batch) -> list[int]:
        """Price one batch of ``replica``, apply it, record it; the requests it finished."""
        scheduler, loop = self.schedulers[replica], self.loops[replica]
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
        outcome = scheduler.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64), end=loop.clock + p.step_s)
        loop.advance(batch, p.step_s, outcome.num_new_tokens)
        record = step_record(batch, layout, attention_work=counts.pairs, calls=counts.calls, nbytes=counts.nbytes,
                             step_s=p.step_s, generated=sum(lp.generated for lp in self.loops),
                             to_generate=self.recorder.num_to_generate, serving=scheduler.stats,
                             num_blocks=self.cfg.kv.num_blocks, time_s=float(loop.step_start[batch.step]))
        if self.router is not None:
            record["replica"] = replica
        record.update({
            "dcp_rest": rest.mode,
            **({"expected_bytes": list(counts.expected)} if counts.expected else {}),
            "per_rank_compute_s": p.compute_s.tolist(),
            "per_rank_memory_s": p.memory_s.tolist(),
            "per_rank_communication_s": p.communication_s.tolist(),
            "purpose_s": p.purpose_s,
        })
        self.recorder.step(record)
        if self.keep_records:
            self.records.append(record)
        for k, v in (("compute_s", p.compute_s), ("memory_s", p.memory_s), ("communication_s", p.communication_s),
                     ("flops", p.flops), ("hbm_bytes", p.hbm_bytes)):
            self.totals[k] += v
        for k, v in p.purpose_s.items():
            self.purpose_s[k] = self.purpose_s.get(k, 0.0) + v
        self.dcp_rest_steps[rest.mode] = self.dcp_rest_steps.get(rest.mode, 0) + 1
        return outcome.finished_req_ids.tolist()

    def _summary(self) -> dict[str, Any]:
        run_s = self.recorder.run_s  # busy time, summed over replicas
        gpus = self.grid.world_size * self.cfg.serving.replicas
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
