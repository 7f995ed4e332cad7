"""One rank's run: schedule -> pipeline -> update, step after step, until the workload
is done. Every rank runs this same loop on the same global batches; rank 0 also keeps
the single-rank reference in lockstep (``verify``) and writes the metrics.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pcpflow.config.run import RunConfig
from pcpflow.layouts.accounting import (
    RING_PURPOSES,
    attention_work,
    ring_attention_work,
    ring_totals,
)
from pcpflow.layouts.ring import plan_ring
from pcpflow.models import build_model
from pcpflow.output.metrics import MetricsRecorder, draft_record, step_record
from pcpflow.parallel.comm import Comm, CommStats, gather_sent
from pcpflow.parallel.moe_dispatch import moe_run_summary, moe_step_record
from pcpflow.parallel.tensor_parallel import shard_model
from pcpflow.pipeline.assemble import Pipeline, resolve_pipeline
from pcpflow.pipeline.context import DTYPES, RankContext, allocate_kv_caches, build_comms
from pcpflow.pipeline.state import StepState
from pcpflow.rank.devices import pick_device, rank_threads
from pcpflow.rank.progress import mark_stage, mark_step, startup_done
from pcpflow.rank.verify import Verifier
from pcpflow.rank.warmup import warm_up
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.kv_groups import run_kv_groups
from pcpflow.scheduling.loop import StepLoop, request_rows
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import RequestTable, build_requests
from pcpflow.speculative.drafting import draft_kv_reads_next_token
from pcpflow.tokens.text import decode_outputs, stop_token_ids


def run_rank(cfg: RunConfig, run_dir: Path | None = None) -> dict[str, Any] | None:
    """Run the workload on this rank; rank 0 returns the result sections
    (``verify``, ``outputs``, ``texts`` with a tokenizer, ``requests``, ``metrics``),
    other ranks None.

    torch.distributed must be initialized with ``tp * pcp`` ranks, unless that is 1
    (``disagg=pd`` runs ``pcpflow.rank.pools.run_pools`` instead).
    """
    return run_on_cores(cfg, lambda: _run_rank(cfg, run_dir))


def run_on_cores(cfg: RunConfig, work: Callable[[], dict[str, Any] | None]) -> dict[str, Any] | None:
    """``work()`` with this rank's threads and cores (``rank_threads``); rank 0's result says
    where it ran (``metrics.cpu_cores``, under ``cpu_bind=cores``; None: the ranks did not fit,
    the OS placed them)."""
    with rank_threads(cfg.threads_per_rank, cfg.cpu_bind) as cores:
        result = work()
    if result is not None and cfg.cpu_bind == "cores":
        result["metrics"]["cpu_cores"] = None if cores is None else sorted(cores)
    return result


def _run_rank(cfg: RunConfig, run_dir: Path | None) -> dict[str, Any] | None:
    stats = CommStats()
    if dist.is_initialized() and cfg.world_size > 1:  # a one-rank run needs no group (mode=profile runs some)
        if dist.get_world_size() != cfg.world_size:
            raise RuntimeError(
                f"world size {dist.get_world_size()} != tp*pcp = {cfg.tp}*{cfg.pcp}"
            )
    elif cfg.world_size != 1:
        raise RuntimeError(f"pcp={cfg.pcp} needs torch.distributed with {cfg.world_size} ranks")
    specs = resolve_pipeline(cfg)  # first: it imports the plugins
    comms = build_comms(cfg.grid, stats, timeout_s=cfg.collective_timeout_s)
    world, pcp, dcp, tp = comms["world"], comms["pcp"], comms["dcp"], comms["tp"]
    device, dtype = pick_device(cfg.device), DTYPES[cfg.dtype]
    model = build_model(cfg.model, dtype=dtype, seed=cfg.seed, device=device)
    # NOTE: the whole model's layers and window (a TP rank's spec splits heads only)
    groups = run_kv_groups(cfg, model.num_layers, model.attn_spec.window_layers, model.attn_spec.windowed())
    shard_model(model, tp, tp.rank, tp.size)  # tensor parallel: keep this rank's slice
    requests = build_requests(cfg.workload, vocab_size=model.vocab_size, seed=cfg.seed)
    table = RequestTable.from_requests(requests)
    table.max_concurrency = cfg.workload.max_concurrency
    scheduler = Scheduler(
        table,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        kv=KVCacheManager(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp, prefix_caching=cfg.kv.prefix_caching,
                          groups=groups),
        num_speculative_tokens=cfg.num_speculative_tokens,
        draft_kv_reads_next_token=draft_kv_reads_next_token(specs),
        stop_token_ids=stop_token_ids(cfg.model, ignore_eos=getattr(cfg.workload, "ignore_eos", True)),
        history=cfg.repetition_penalty != 1,
    )
    ctx = RankContext(
        config=cfg,
        pcp=pcp,
        dcp=dcp,
        world=world,
        device=device,
        dtype=dtype,
        model=model,
        kv_caches=allocate_kv_caches(model, cfg.kv.num_blocks, cfg.kv.block_size, dtype, device, groups=groups),
        stats=stats,
        requests=requests,
        tp=tp,
        dcp_heads=comms["dcp_heads"],
        kv_groups=groups,
    )
    pipeline = Pipeline(specs, ctx, on_stage=mark_stage)
    unaccounted_world = Comm(world.group, world.rank, world.size, None)
    verifier = Verifier(cfg, ctx, specs, unaccounted_world, scheduler) if cfg.verify else None
    is_root = world.rank == 0
    recorder = MetricsRecorder(
        run_dir / "metrics.jsonl" if (is_root and run_dir is not None) else None,
        pcp_size=pcp.size,
        num_to_generate=sum(r.max_output_tokens for r in requests),
    )
    steps = _Steps(cfg, ctx, scheduler, pipeline, verifier, recorder, unaccounted_world if runs_ring(cfg, specs) else None)
    startup_done(cfg.startup_timeout_s, cfg.collective_timeout_s)  # start-up has its own timeout (startup_timeout_s); steps the collective one
    warmup_s = warm_up(cfg, ctx, specs)
    # NOTE: the board's barrier lets each rank go within its poll (50 ms) of the others: one
    # collective more, so that every rank's run clock starts at the same moment (else a
    # rank's first step waits for a late peer, and the first TTFT counts that wait).
    world.barrier()
    t0 = time.perf_counter()
    try:
        steps.run()
    finally:
        recorder.close()
    wall_s = time.perf_counter() - t0
    if not is_root:
        return None
    cols = steps.loop.request_columns()
    serving = {"prompt_lens": table.prompt_lens, "gpus": cfg.world_size, "ttft_slo_s": cfg.slo.ttft_s,
               "tpot_slo_s": cfg.slo.tpot_s}
    outputs = scheduler.outputs()
    result: dict[str, Any] = {
        "outputs": [outputs.get(r.req_id, []) for r in requests],
        "requests": request_rows(cols, requests),
        "metrics": {**recorder.summary(cols, wall_s, serving=serving), **moe_run_summary(ctx), "warmup_s": warmup_s,
                    "kv_groups": None if groups is None else groups.describe()},
    }
    texts = decode_outputs(cfg.model, result["outputs"])
    if texts is not None:
        result["texts"] = texts
    if "cudagraph" in ctx.extras:  # steps by CUDA-graph runtime mode (stages/forward.py)
        result["metrics"]["cudagraph"] = ctx.extras["cudagraph"]
    if verifier is not None:
        result["verify"] = verifier.summary()
    if cfg.output.save_logits:
        result["logits"] = [steps.logits.get(r.req_id, []) for r in requests]
    return result


def runs_ring(cfg: RunConfig, specs=None) -> bool:
    """Whether a run of ``cfg`` (one pool's, with pools) runs a ring: its forward stage's
    ``cp_attention`` (``specs``: its resolved pipeline, else resolved here) on pcp > 1."""
    forward = next((s for s in (specs or resolve_pipeline(cfg)) if s.name == "forward"), None)
    return getattr(forward.config, "cp_attention", "allgather") != "allgather" and cfg.pcp > 1


class _Steps:
    """This rank's steps over the shared loop (``pcpflow.scheduling.loop``): each batch runs
    through the pipeline on the run clock; verification and metrics follow, off it."""

    def __init__(self, cfg, ctx, scheduler, pipeline, verifier, recorder, ring_world: Comm | None = None) -> None:
        self.cfg, self.ctx, self.scheduler = cfg, ctx, scheduler
        self.pipeline, self.verifier, self.recorder = pipeline, verifier, recorder
        self.ring_world = ring_world  # rings: every rank's point-to-point counts are gathered over it
        self.loop = StepLoop(scheduler, max_steps=cfg.max_steps, on_step=mark_step)
        self.logits: dict[int, list[list[float]]] = {}  # req_id -> sampled rows (save_logits)

    def run(self) -> None:
        sched, loop = self.scheduler, self.loop
        for batch in loop.batches():
            # NOTE: what the scheduler did this step (preemptions, prefix hits, blocks in
            # use), for stages that record it
            self.ctx.extras["step_stats"] = sched.stats
            state = self.pipeline(StepState(batch))
            outcome = sched.update(batch, state.sampled_token_ids)
            if state.draft_token_ids is not None:
                sched.set_draft_tokens(batch, state.draft_token_ids)
            step_s = loop.elapsed()
            loop.advance(batch, step_s, outcome.num_new_tokens)
            calls, nbytes = self.ctx.stats.end_step()
            per_rank = self._per_rank_sent(calls, nbytes)
            logit_diff = None
            if self.verifier is not None:
                mark_stage("verify")
                logit_diff = self.verifier.step(state, outcome)
            if self.cfg.output.save_logits:
                self._save_logits(state)
            record = self._record(state, outcome, calls, nbytes, step_s, logit_diff)
            if per_rank is not None:
                record["per_rank_collective_calls"], record["per_rank_collective_bytes"] = per_rank
            self.recorder.step(record)

    def _per_rank_sent(self, calls, nbytes):
        """The ring's point-to-point counts: every rank's, gathered (off the run clock), and
        the job's figures folded into ``calls`` / ``nbytes``; None without rings."""
        sent = self.ctx.stats.take_sent()
        if self.ring_world is None:
            return None
        per_calls, per_bytes = gather_sent(self.ring_world, sent, RING_PURPOSES, self.ctx.device)
        add_ring_totals(calls, nbytes, per_calls, per_bytes)
        return per_calls, per_bytes

    def _save_logits(self, state: StepState) -> None:
        rows = state.logits.to(torch.float64).cpu().tolist()
        req_ids = state.batch.req_ids[state.batch.logits_req_indices].tolist()
        for req_id, row in zip(req_ids, rows):
            self.logits.setdefault(req_id, []).append(row)

    def _record(self, state: StepState, outcome, calls, nbytes, step_s, logit_diff) -> dict[str, Any]:
        record = batch_record(self.ctx, state, calls=calls, nbytes=nbytes, step_s=step_s, generated=self.loop.generated,
                              to_generate=self.recorder.num_to_generate, serving=self.scheduler.stats,
                              time_s=float(self.loop.step_start[state.batch.step]))
        record.update(draft_record(outcome))
        record.update(moe_step_record(self.ctx))  # NOTE: a collective: every rank records
        if logit_diff is not None:
            record["max_abs_logit_diff"] = logit_diff
        return record


def add_ring_totals(calls: dict[str, int], nbytes: dict[str, int], per_calls, per_bytes) -> None:
    """A ring's point-to-point sends, every rank's (by purpose, a list per rank), folded into a
    step's ``calls`` and ``nbytes`` as the job's figures (``ring_totals``)."""
    more_calls, more_bytes = ring_totals(per_calls, per_bytes)
    calls.update(more_calls)
    nbytes.update(more_bytes)


def batch_record(ctx: RankContext, state: StepState, *, calls, nbytes, step_s: float, generated: int, to_generate: int,
                 serving, time_s: float) -> dict[str, Any]:
    """The metrics.jsonl fields of one batch this rank's pipeline ran (``step_record``, with
    the attention work the path it took counts and the CP attention it ran). No collective:
    a pool's root calls it alone; the MoE counts are ``moe_step_record``'s."""
    b, layout, cfg = state.batch, state.layout, ctx.config
    ran = state.attn.cp_attention or "allgather"
    if ran.startswith("ring_"):
        variant = ran[len("ring_"):]
        plan = plan_ring(layout, b.positions, variant=variant, interleave=cfg.kv.interleave)
        count = partial(ring_attention_work, layout, b.positions, variant=variant, interleave=cfg.kv.interleave,
                        plan=plan)
    else:
        count = partial(
            attention_work,
            layout,
            b.positions,
            dcp_size=ctx.layout_dcp_size,  # per PCP rank (its TP ranks share it)
            interleave=cfg.kv.interleave,
            dcp_rest=state.attn.dcp_rest or "queries",
        )
    window = ctx.model.attn_spec.windowed()  # NOTE: a TP rank's local spec keeps the window (and its kind)
    record = step_record(b, layout, attention_work=count(), calls=calls, nbytes=nbytes, stage_s=state.timings,
                         step_s=step_s, generated=generated, to_generate=to_generate, serving=serving,
                         num_blocks=cfg.kv.num_blocks, time_s=time_s,
                         window_attention_work=None if window is None else count(window=window))
    record["cp_attention"] = ran
    return record
