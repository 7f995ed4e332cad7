"""The warm-up before a run's clock starts, as vLLM warms its engine before it serves (its
start-up dummy runs of the model and the sampler).

A rank's first step pays what no later step pays: the first call of each op (kernel and
primitive set-up, allocations, lazily imported code), a CUDA context's handles, and each
NCCL group's communicator, which torch creates at the group's first collective. Measured on
this project's 2-core CPU machine (tiny GQA model, 8 prompts of 24 tokens): the first prefill
step took 12.0 ms at pcp=1 and 14.0 ms at pcp=2, the same step run again later 7.7 and 9.8 ms.
Counted in the first requests' TTFT, that is a cost of starting a process, not of the layout.

``warm_up`` runs one throwaway request through a pipeline of the run's own stages, on a
scratch KV cache and a context of its own (the model and the groups are the run's): a
prefill of ``2 x 32`` rows per PCP rank (the reference kernel's segment path; chunked by the
step budget) and one decode step, on every rank of the pool together. Nothing it does is
counted: its collectives are dropped from the rank's counts, its steps are not recorded,
and the run's KV cache, scheduler and verification never see it. Two cases run no warm-up:
``warmup=false``, and a pipeline with any stage that is not pcpflow's own (a user's stage
may count or record the steps it sees). The draft slot is left out (a drafter builds its
own model and caches); the target's forward is what it warms.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from pcpflow.config.run import RunConfig
from pcpflow.pipeline.assemble import Pipeline, StageSpec
from pcpflow.pipeline.context import RankContext, allocate_kv_caches
from pcpflow.pipeline.state import StepState
from pcpflow.rank.progress import mark_stage
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.loop import StepLoop
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import Request

SHIPPED = "pcpflow.stages."
ROWS_PER_RANK = 64  # two segments of the reference kernel's 32 rows on each PCP rank
OUTPUTS = 2  # the prefill's token, then one decode step


def warms(cfg: RunConfig, specs: list[StageSpec]) -> bool:
    """Whether a run of ``cfg`` warms up: ``warmup`` set and every stage pcpflow's own."""
    return cfg.warmup and all(spec.cls.__module__.startswith(SHIPPED) for spec in specs)


def warm_up(cfg: RunConfig, ctx: RankContext, specs: list[StageSpec]) -> float | None:
    """Run the warm-up on this rank (every rank of the pool calls it at the same point);
    the seconds it took, or None when the run does not warm up (``warms``)."""
    if not warms(cfg, specs):
        return None
    t0 = time.perf_counter()
    prompt_len = min(ROWS_PER_RANK * cfg.pcp, cfg.scheduler.max_num_batched_tokens)
    request = Request(req_id=0, prompt_token_ids=np.arange(prompt_len, dtype=np.int64) % ctx.model.vocab_size,
                      max_output_tokens=OUTPUTS, arrival_step=0)
    tokens_per_block = cfg.kv.block_size * cfg.dcp
    num_blocks = -(-(prompt_len + OUTPUTS) // tokens_per_block) + 1
    warm_cfg = cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"num_blocks": num_blocks, "prefix_caching": False}),
                                      "num_speculative_tokens": 0})
    warm_ctx = dataclasses.replace(
        ctx, config=warm_cfg, requests=[request], extras={}, aux_layers=set(), own_kv={},
        kv_caches=allocate_kv_caches(ctx.model, num_blocks, cfg.kv.block_size, ctx.dtype, ctx.device),
        kv_groups=None,  # NOTE: one group: its manager keeps every block, the forward is the same
    )
    pipeline = Pipeline([spec for spec in specs if spec.name != "draft"], warm_ctx, on_stage=mark_stage)
    scheduler = Scheduler([request], max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
                          max_num_seqs=1, kv=KVCacheManager(num_blocks, cfg.kv.block_size, cfg.dcp))
    with ctx.stats.uncounted():
        for batch in StepLoop(scheduler).batches():
            state = pipeline(StepState(batch))
            scheduler.update(batch, state.sampled_token_ids)
    return time.perf_counter() - t0
