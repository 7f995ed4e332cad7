"""One rank of a run with a prefill pool and a decode pool (``disagg=pd``, docs/disaggregation.md).

Global ranks ``0 .. Wp-1`` are the prefill pool (the top-level grid), ``Wp ..`` the decode
pool (``disagg.decode_pool``). Every rank runs both pools' schedulers in one deterministic
global loop (``pcpflow.scheduling.pools.PoolLoop``) and the pipeline of its own pool, with
that pool's view of the config (``pool_config``) and its own groups. A global step:

1. **handover** (between steps): the requests the decode pool adopts move, each decode
   rank receiving exactly the entries its layout owns from the prefill ranks that hold
   them (``pcpflow.parallel.transfer``, point to point), then the prefill pool frees their
   blocks;
2. each pool runs its batch (the prefill pool only prefills and samples first tokens);
3. the pools' roots share what every rank's schedulers need (the sampled ids), and rank 0
   what it records (the decode pool's step record and, verifying, its logits): one small
   ``all_gather_object`` over the world, the scheduler's own traffic, not counted;
4. both schedulers update alike on every rank; verification and metrics follow, off the clock.

Drafting runs in both pools as in one: the prefill pool's drafter proposes as each prefill
ends (its own cache of the prompt written there); the proposals go over with the request, as
its first token does (the roots' exchange, step 3), and the handover moves the drafter's
entries of the prompt with the target's (``Stage.own_kv``), so the decode pool verifies them
at its first step and drafts on from its own copy of that cache.
"""

from __future__ import annotations

import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch.distributed as dist

from pcpflow.attention.metadata import rank_slot_mapping
from pcpflow.config.disagg import POOLS, pool_config
from pcpflow.config.run import RunConfig
from pcpflow.layouts.accounting import RING_PURPOSES
from pcpflow.layouts.transfer import KV_TRANSFER
from pcpflow.models import build_model
from pcpflow.output.metrics import MetricsRecorder, draft_record, pool_step_record
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.parallel.moe_dispatch import moe_metrics, moe_step_counts
from pcpflow.parallel.tensor_parallel import shard_model
from pcpflow.parallel.transfer import KVTransfer
from pcpflow.pipeline.assemble import Pipeline, resolve_pipeline
from pcpflow.pipeline.context import DTYPES, RankContext, allocate_kv_caches
from pcpflow.pipeline.state import StepState
from pcpflow.rank.devices import pick_device
from pcpflow.rank.engine import add_ring_totals, batch_record, run_on_cores, runs_ring
from pcpflow.rank.progress import mark_stage, mark_step, mark_transfer, startup_done
from pcpflow.rank.verify import Verifier, reference_blocks
from pcpflow.rank.warmup import warm_up
from pcpflow.scheduling.kv_groups import run_kv_groups
from pcpflow.scheduling.loop import request_columns, request_rows
from pcpflow.scheduling.pools import PoolLoop, PoolStep, pool_schedulers
from pcpflow.scheduling.workload import RequestTable, build_requests
from pcpflow.speculative.drafting import draft_kv_reads_next_token
from pcpflow.tokens.text import decode_outputs, stop_token_ids


def run_pools(cfg: RunConfig, run_dir: Path | None = None) -> dict[str, Any] | None:
    """``pcpflow.rank.engine.run_rank`` for ``disagg=pd``: rank 0 returns the result sections."""
    return run_on_cores(cfg, lambda: _PoolRank(cfg, run_dir).run())


class _PoolRank:
    def __init__(self, cfg: RunConfig, run_dir: Path | None) -> None:
        if not dist.is_initialized() or dist.get_world_size() != cfg.world_size:
            have = dist.get_world_size() if dist.is_initialized() else 1
            raise RuntimeError(f"disagg=pd needs torch.distributed with both pools' {cfg.world_size} ranks, got {have}")
        self.cfg, self.rank = cfg, dist.get_rank()
        prefill_grid, decode_grid = cfg.grid, cfg.disagg.decode_grid
        self.offset = prefill_grid.world_size
        self.pool = "prefill" if self.rank < self.offset else "decode"
        self.pools = {name: pool_config(cfg, name) for name in POOLS}
        mine = self.mine = self.pools[self.pool]
        self.stats = CommStats()
        specs = resolve_pipeline(mine)  # first: it imports the plugins
        # NOTE: every rank makes every pool's groups (group creation is collective)
        comms = [prefill_grid.build(self.rank, self.stats, timeout_s=cfg.collective_timeout_s),
                 decode_grid.build(self.rank, self.stats, timeout_s=cfg.collective_timeout_s, offset=self.offset)]
        comms = comms[0] if self.pool == "prefill" else comms[1]
        device, dtype = pick_device(cfg.device), DTYPES[cfg.dtype]
        model = build_model(cfg.model, dtype=dtype, seed=cfg.seed, device=device)
        full_spec = model.attn_spec
        # NOTE: both pools run one model: the same KV groups (each pool's own blocks and tables)
        self.groups = groups = run_kv_groups(cfg, model.num_layers, full_spec.window_layers, full_spec.windowed())
        shard_model(model, comms["tp"], comms["tp"].rank, comms["tp"].size)
        self.requests = build_requests(cfg.workload, vocab_size=model.vocab_size, seed=cfg.seed)
        table = RequestTable.from_requests(self.requests)
        table.max_concurrency = cfg.workload.max_concurrency
        self.table = table
        stops = stop_token_ids(cfg.model, ignore_eos=getattr(cfg.workload, "ignore_eos", True))
        self.prefill, self.decode = pool_schedulers(table, self.pools["prefill"], self.pools["decode"], stop_token_ids=stops,
                                                    history=cfg.repetition_penalty != 1,
                                                    draft_kv_reads_next_token=draft_kv_reads_next_token(specs),
                                                    groups=groups)
        self.ctx = RankContext(
            config=mine, pcp=comms["pcp"], dcp=comms["dcp"], world=comms["world"], device=device, dtype=dtype,
            model=model, kv_caches=allocate_kv_caches(model, mine.kv.num_blocks, mine.kv.block_size, dtype, device,
                                                      groups=groups),
            stats=self.stats, requests=self.requests, tp=comms["tp"], dcp_heads=comms["dcp_heads"], kv_groups=groups,
        )
        self.pipeline = Pipeline(specs, self.ctx, on_stage=mark_stage)
        self.specs = specs
        self.world = Comm(dist.group.WORLD, self.rank, cfg.world_size, None)  # unaccounted: control, verification
        own = [kv for kvs in self.ctx.own_kv.values() for kv in kvs]  # a drafter's cache
        self.transfer = KVTransfer(
            rank=self.rank, prefill=prefill_grid, decode=decode_grid, prefill_interleave=self.pools["prefill"].kv.interleave,
            decode_interleave=self.pools["decode"].kv.interleave, caches=[(full_spec, self.ctx.kv_caches), *own],
            block_size=cfg.kv.block_size, transfer=cfg.disagg.transfer, stats=self.stats, groups=groups,
        )
        self.verifier = _PoolVerifier(self, specs) if cfg.verify else None
        self.is_root = self.rank == 0
        self.pool_root = self.rank in (0, self.offset)
        self.recorder = MetricsRecorder(
            run_dir / "metrics.jsonl" if (self.is_root and run_dir is not None) else None,
            pcp_size=cfg.pcp + cfg.disagg.decode_pool.pcp,
            num_to_generate=int(table.output_lens.sum()),
        )
        self.loop = PoolLoop(self.prefill, self.decode, max_steps=cfg.max_steps, on_step=mark_step)
        # NOTE: a pool that runs a ring (the prefill pool's pipeline.forward.cp_attention; pool_config)
        self.rings = {name: runs_ring(self.pools[name]) for name in POOLS}
        self.moe_run: np.ndarray | None = None  # rank 0: both pools' MoE counts, by global rank

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict[str, Any] | None:
        startup_done(self.cfg.startup_timeout_s, self.cfg.collective_timeout_s)
        self.warmup_s = warm_up(self.mine, self.ctx, self.specs)  # each pool on its own groups
        self.world.barrier()  # NOTE: both pools' clocks start together, as the one-pool run's
        t0 = time.perf_counter()
        try:
            for ps in self.loop.steps():
                self._step(ps)
        finally:
            self.recorder.close()
        return self._result(time.perf_counter() - t0) if self.is_root else None

    def _step(self, ps: PoolStep) -> None:
        t0 = time.perf_counter()
        moved = self._hand_over(ps)
        freed = self.loop.handover.release([h[0] for h in ps.handed])
        t_pool = time.perf_counter()
        batch = ps.prefill if self.pool == "prefill" else ps.decode
        state = None
        if batch is not None:
            sched = self.prefill if self.pool == "prefill" else self.decode
            self.ctx.extras["step_stats"] = sched.stats
            state = self.pipeline(StepState(batch))
        pool_s = time.perf_counter() - t_pool
        calls, nbytes = self.stats.end_step()
        mark_stage("exchange")
        moe = moe_step_counts(self.ctx) if state is not None else None  # NOTE: over the pool: each of its ranks
        # NOTE: a ring's point-to-point sends, this rank's (the handover's were taken request by request)
        payload: dict[str, Any] = {"moved": moved, "sent": self.stats.take_sent()}
        if self.pool_root and state is not None:
            payload["tokens"] = state.sampled_token_ids
            payload["drafts"] = state.draft_token_ids
            sched = self.prefill if self.pool == "prefill" else self.decode
            payload["record"] = batch_record(self.ctx, state, calls=calls, nbytes=nbytes, step_s=pool_s,
                                             generated=self.loop.generated, to_generate=self.recorder.num_to_generate,
                                             serving=sched.stats, time_s=float(self.loop.step_start[ps.step]))
            if moe is not None:
                payload["record"].update(moe_metrics(moe))
                payload["moe"] = moe
            if self.verifier is not None and self.pool == "decode":
                payload["logits"] = state.logits.cpu() if state.logits is not None else None
        every: list[Any] = [None] * self.cfg.world_size
        dist.all_gather_object(every, payload)
        roots = {"prefill": every[0], "decode": every[self.offset]}
        po, do = self.loop.update(ps, roots["prefill"].get("tokens"), roots["decode"].get("tokens"))
        for sched, batch, pool in ((self.prefill, ps.prefill, "prefill"), (self.decode, ps.decode, "decode")):
            if batch is not None and roots[pool].get("drafts") is not None:
                sched.set_draft_tokens(batch, roots[pool]["drafts"])
        step_s = time.perf_counter() - t0
        transfer = self._transfer_record(ps, every)
        self.loop.advance(ps, step_s)
        if self.verifier is not None:
            mark_stage("verify")
            self.verifier.global_step(ps, state, roots, po, do, freed)
        if self.is_root:
            records = {"prefill": roots["prefill"].get("record"), "decode": roots["decode"].get("record")}
            for pool, first in (("prefill", 0), ("decode", self.offset)):
                self._add_moe(roots[pool].get("moe"), first)
                if records[pool] is not None and self.rings[pool]:
                    self._add_ring_sent(records[pool], every[first:first + self.pools[pool].world_size])
            pools = self.pools
            record = pool_step_record(
                ps.step, records, pcp={n: pools[n].pcp for n in POOLS},
                num_blocks={n: pools[n].kv.num_blocks for n in POOLS},
                stats={"prefill": self.prefill.stats, "decode": self.decode.stats}, transfer=transfer,
                queue=len(self.loop.handover), step_s=step_s, time_s=float(self.loop.step_start[ps.step]),
                generated=self.loop.generated, to_generate=self.recorder.num_to_generate)
            if do is not None:  # NOTE: drafts are verified on the decode pool only
                record.update(draft_record(do))
            self.recorder.step(record)

    @staticmethod
    def _add_ring_sent(record: dict[str, Any], payloads: list[dict[str, Any]]) -> None:
        """A pool's ring sends, each of its ranks' (their step payloads), into the pool's step
        record as a one-pool run records them (``_Steps._per_rank_sent``)."""
        per_calls = {p: [int(x["sent"].get(p, (0, 0))[0]) for x in payloads] for p in RING_PURPOSES}
        per_bytes = {p: [int(x["sent"].get(p, (0, 0))[1]) for x in payloads] for p in RING_PURPOSES}
        add_ring_totals(record["collective_calls"], record["collective_bytes"], per_calls, per_bytes)
        record["per_rank_collective_calls"], record["per_rank_collective_bytes"] = per_calls, per_bytes

    def _add_moe(self, counts: np.ndarray | None, first: int) -> None:
        """Add one pool's MoE counts of a step (``[W_pool, 2, E]``) to the run's, whose rows
        are the global ranks (the prefill pool's, then the decode pool's)."""
        if counts is None:
            return
        if self.moe_run is None:
            self.moe_run = np.zeros((self.cfg.world_size, *counts.shape[1:]), dtype=counts.dtype)
        self.moe_run[first:first + len(counts)] += counts

    def _hand_over(self, ps: PoolStep) -> list[tuple[int, int, float]]:
        """Move each adopted request's entries, one request after another: this rank's
        (messages, bytes) sent and seconds per request."""
        out = []
        for i, n, src, dst in ps.handed:
            mark_transfer(i)
            seconds = self.transfer.move(n, src, dst)
            sent = self.stats.step_sent.pop(KV_TRANSFER, [0, 0])
            out.append((int(sent[0]), int(sent[1]), seconds))
        return out

    def _transfer_record(self, ps: PoolStep, every: list[dict[str, Any]]) -> dict[str, Any]:
        """The handover of this step over every rank: per request, the messages and bytes
        all ranks sent and the slowest rank's seconds (into the handover's columns)."""
        if not ps.handed:
            return {}
        moved = np.array([p["moved"] for p in every], dtype=np.float64).reshape(len(every), len(ps.handed), 3)
        calls, nbytes = moved[:, :, 0].sum(axis=0), moved[:, :, 1].sum(axis=0)
        seconds = moved[:, :, 2].max(axis=0)
        ids = [h[0] for h in ps.handed]
        for k, i in enumerate(ids):
            self.loop.handover.record(i, int(calls[k]), int(nbytes[k]), float(seconds[k]))
        return {"req_ids": ids, "tokens": [h[1] for h in ps.handed], "calls": int(calls.sum()),
                "bytes": int(nbytes.sum()), "s": float(seconds.sum())}

    # ------------------------------------------------------------------ the result
    def _result(self, wall_s: float) -> dict[str, Any]:
        cfg, loop = self.cfg, self.loop
        cols = request_columns(self.prefill, loop.step_start, loop.step_end)
        serving = {"prompt_lens": self.table.prompt_lens, "gpus": cfg.world_size, "ttft_slo_s": cfg.slo.ttft_s,
                   "tpot_slo_s": cfg.slo.tpot_s}
        outputs = self.prefill.outputs() or {}
        metrics = self.recorder.summary(cols, wall_s, serving=serving)
        metrics["warmup_s"] = self.warmup_s  # rank 0's: the prefill pool's
        metrics["kv_groups"] = None if self.groups is None else self.groups.describe()
        if self.moe_run is not None:
            metrics.update(moe_metrics(self.moe_run))
        metrics.update(self.recorder.pool_metrics(loop.clock, {n: self.pools[n].world_size for n in POOLS},
                                                  cfg.disagg.transfer))
        result: dict[str, Any] = {
            "outputs": [outputs.get(r.req_id, []) for r in self.requests],
            "requests": loop.handover.with_columns(request_rows(cols, self.requests)),
            "metrics": metrics,
        }
        texts = decode_outputs(cfg.model, result["outputs"])
        if texts is not None:
            result["texts"] = texts
        if self.verifier is not None:
            result["verify"] = self.verifier.summary()
        return result


class _PoolVerifier(Verifier):
    """The single-rank reference on global rank 0 checks both pools: each pool's batch
    (logits and tokens on rank 0, the decode pool's logits sent there), every rank's cache
    against what it should hold, and each handover: the decode ranks' caches must then hold
    the reference's entries of the prompt exactly where their layout puts them, the prefill
    pool's freed blocks are taken over as any freed blocks are."""

    def __init__(self, rank: _PoolRank, specs) -> None:
        table = rank.table
        ref_blocks = reference_blocks(list(rank.pools.values()), table.prompt_lens + table.output_lens)
        # NOTE: the reference runs both pools' batches: its budget is the larger of theirs
        budget = {k: max(getattr(c.scheduler, k) for c in rank.pools.values())
                  for k in ("max_num_batched_tokens", "max_num_seqs")}
        both = rank.mine.model_copy(update={"scheduler": rank.mine.scheduler.model_copy(update=budget)})
        super().__init__(both, rank.ctx, specs, rank.world, rank.prefill, ref_blocks=ref_blocks)
        self.in_prefill = rank.pool == "prefill"
        self.decode_root = rank.offset

    def global_step(self, ps: PoolStep, state: StepState | None, roots: dict[str, dict], po, do, freed: np.ndarray) -> None:
        self._handed(ps, freed)
        if ps.prefill is not None:
            seen = state if self.in_prefill else None
            router = self.gather_router_logits(state) if self.in_prefill else None
            self.check(ps.prefill, seen, po, mine=self.in_prefill, router_logits=router)
        if ps.decode is not None:
            seen = None
            if self.is_root:
                r = roots["decode"]
                seen = SimpleNamespace(batch=ps.decode, logits=r.get("logits"), sampled_token_ids=r.get("tokens"))
            self.check(ps.decode, seen, do, mine=not self.in_prefill, router_logits=self._decode_router_logits(state))
        elif ps.handed:
            self._compare(ps.step, mine=not self.in_prefill)

    def _decode_router_logits(self, state: StepState | None):
        """The decode pool's router logits of its batch, gathered in that pool and sent from
        its root to rank 0 (every rank calls it); None without experts."""
        if self.routing is None:
            return None
        box = [None]
        if not self.in_prefill:
            layers_logits = self.gather_router_logits(state)
            if layers_logits is not None:
                box = [(layers_logits[0], layers_logits[1].cpu())]
        dist.broadcast_object_list(box, src=self.decode_root, group=self.world.group)
        return box[0]

    def _handed(self, ps: PoolStep, freed: np.ndarray) -> None:
        """The reference's entries of every handed-over prompt go where the decode ranks own
        them; the prefill ranks take over the blocks the handover freed."""
        if not ps.handed:
            return
        lens = [n for _, n, _, _ in ps.handed]
        flat, entries = self._entries(sum(lens))  # NOTE: the drafter's cache of the prompt moves too (Stage.own_kv)
        if self.is_root:
            at = 0
            for i, n, _, _ in ps.handed:
                tables = self.ref_kv.block_tables(np.array([i]))  # NOTE: the reference keeps one group
                slots = rank_slot_mapping(np.arange(n), np.zeros(n, np.int64), tables, self.cfg.kv)
                self._read_reference(slots, [e[:, at:at + n] for e in entries])
                at += n
        self.world.broadcast(flat, src=0, purpose="verify")
        if self.in_prefill:
            self.take_over(freed)
            return
        width = max(dst.shape[1] for _, _, _, dst in ps.handed)
        tables = np.zeros((ps.handed[0][3].shape[0], len(ps.handed), width), dtype=np.int64)  # [G, R, W]
        for k, (_, _, _, dst) in enumerate(ps.handed):
            tables[:, k, :dst.shape[1]] = dst
        positions = np.concatenate([np.arange(n) for n in lens])
        rows = np.repeat(np.arange(len(lens)), lens)
        req_ids = np.array([i for i, _, _, _ in ps.handed], dtype=np.int64)
        # NOTE: a window group's entries before the first the decode pool keeps are null: not expected
        self.expect_at(positions, rows, tables[0], entries, req_ids=req_ids[rows], group_tables=tables)
