"""A stage on its own: the rank context of one PCP rank of a composed run, in this
process (no process group: a stage that tried a collective with pcp > 1 would fail), and
the first batch its scheduler emits."""

from __future__ import annotations

import torch

from pcpflow.models import build_model
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.pipeline.assemble import load_stages
from pcpflow.pipeline.context import DTYPES, RankContext, allocate_kv_caches
from pcpflow.pipeline.stage import build_config, resolve
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import build_requests
from pcpflow.testing import compose


def context(overrides: list[str], *, rank: int = 0) -> RankContext:
    cfg = compose(overrides)
    stats = CommStats()

    def group(size: int) -> Comm:
        return Comm.solo(stats) if size == 1 else Comm(object(), rank, size, stats)

    dtype = DTYPES[cfg.dtype]
    model = build_model(cfg.model, dtype=dtype, seed=cfg.seed)
    return RankContext(
        config=cfg, pcp=group(cfg.pcp), dcp=group(cfg.dcp), world=group(cfg.world_size),
        device=torch.device("cpu"), dtype=dtype, model=model,
        kv_caches=allocate_kv_caches(model, cfg.kv.num_blocks, cfg.kv.block_size, dtype, torch.device("cpu")),
        stats=stats, requests=build_requests(cfg.workload, vocab_size=model.vocab_size, seed=cfg.seed),
    )


def first_state(ctx: RankContext) -> StepState:
    cfg = ctx.config
    scheduler = Scheduler(
        ctx.requests,
        max_num_batched_tokens=cfg.scheduler.max_num_batched_tokens,
        max_num_seqs=cfg.scheduler.max_num_seqs,
        kv=KVCacheManager(cfg.kv.num_blocks, cfg.kv.block_size, cfg.dcp),
        num_speculative_tokens=cfg.num_speculative_tokens,
    )
    return StepState(scheduler.schedule())


def stage(kind: str, slot: str, ctx: RankContext, **settings):
    """The stage ``kind`` in ``slot``, with the run's settings of that slot when the run
    put it there (``draft``: the draft group), then ``settings``."""
    load_stages()
    cfg = ctx.config
    configured = cfg.draft_stage_config() if slot == "draft" else dict(cfg.pipeline.get(slot) or {})
    base = configured if configured.get("kind") == kind else {}
    cls = resolve(kind, slot)
    return cls(build_config(cls, {**base, "kind": kind, **settings}), ctx)


def run_slots(state: StepState, ctx: RankContext, *kinds: tuple[str, str]) -> StepState:
    for slot, kind in kinds:
        state = stage(kind, slot, ctx)(state)
    return state


TARGET = (("validate", "batch_checks"), ("plan", "dual_chunk_swap"), ("buffers", "persistent"), ("slots", "paged"))
