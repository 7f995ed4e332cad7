"""Deliberate faults, to prove that verification and failure handling can fail a run.

Each fault fires on one rank at one step; inserted with
``+pipeline.extra=[{kind: pcpflow_test_plugins.faults:<Class>, after: <slot>, rank: R, step: S}]``
(``rank`` is the global rank). Raise (``Crash``), leave (``Exit``), stall (``Stall``) or signal
(``SendSignal``) on rank R at step S, or slow its start-up (``SlowStart``); stall or die inside
a ring's point-to-point exchange (``RingFault``). Others corrupt what verification must catch:
a KV write (``MisplacedKVWrite``), a hidden state (``PerturbedHidden``), an expert
(``WrongExpert``), a prefix block (``WrongPrefixBlock``), a handover (``TransferFault``), an
entry of the drafter's own cache (``CorruptedDraftKV``).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import Field

from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import StepState


class _FaultConfig(StageConfig):
    rank: int = Field(0, ge=0, description="global rank the fault fires on")
    step: int = Field(0, ge=0, description="scheduler step it fires at (first batch at or after it)")


class _Fault(Stage):
    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        self.fired = False

    def _mine(self) -> bool:
        """This process is the fault's global rank (under disagg=pd a pool's ``ctx.world``
        numbers its own ranks from 0), and not the single-rank reference."""
        rank = dist.get_rank() if dist.is_initialized() else 0
        return not self.ctx.is_reference and rank == self.config.rank

    def _due(self, state: StepState) -> bool:
        if self.fired or not self._mine():
            return False
        if state.batch.step < self.config.step:
            return False
        self.fired = True
        return True


@register
class MisplacedKVWrite(_Fault):
    """After ``slots``: one token this rank writes lands one slot further on (with KV groups,
    in the layers of group ``group``)."""

    kind = "test_misplaced_kv_write"

    class Config(_FaultConfig):
        kind: Literal["test_misplaced_kv_write"] = "test_misplaced_kv_write"
        group: int = Field(0, ge=0, description="the KV group whose write moves (StepState.attn_groups)")

    def _meta(self, state: StepState):
        return state.attn if state.attn_groups is None else state.attn_groups[self.config.group]

    def _due(self, state: StepState) -> bool:
        return bool((self._meta(state).gathered_slot_mapping >= 0).any()) and super()._due(state)

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            sm = self._meta(state).gathered_slot_mapping
            i = int(torch.nonzero(sm >= 0)[0])
            sm[i] += 1
        return state


@register
class WrongExpert(_Fault):
    """Before ``forward``: the first MoE layer sends one row this rank writes to another
    expert than its router chose (the router's logits stay as they are, so verification's
    routing near-tie allowance sees no difference there: the row's output must show it)."""

    kind = "test_wrong_expert"

    class Config(_FaultConfig):
        kind: Literal["test_wrong_expert"] = "test_wrong_expert"

    def __call__(self, state: StepState) -> StepState:
        from pcpflow.parallel.moe_dispatch import ROUTING_KEY

        if self._due(state):
            extras = self.ctx.extras
            extras[ROUTING_KEY] = _WrongOnce(extras.get(ROUTING_KEY), extras, ROUTING_KEY)
        return state


class _WrongOnce:
    """A routing that wraps the installed one (the verifier's record) for one forward and
    moves one row's first expert to the next expert it did not choose."""

    def __init__(self, inner, extras: dict, key: str) -> None:
        self.inner, self.extras, self.key = inner, extras, key

    def for_rows(self, tokens: np.ndarray):
        self.extras[self.key] = self.inner  # NOTE: one forward only
        inner = self.inner.for_rows(tokens)
        done = [False]

        def hook(moe, logits):
            weights, ids = inner(moe, logits)
            mine = np.flatnonzero(tokens >= 0)
            if not done[0] and len(mine):
                done[0] = True
                row = int(mine[0])
                chosen = set(ids[row].tolist())
                ids = ids.clone()
                ids[row, 0] = next(e for e in range(moe.moe.num_experts) if e not in chosen)
            return weights, ids

        return hook


@register
class PerturbedHidden(_Fault):
    """After ``forward``: a sampled row that this rank canonically holds is off by 1e-3
    (rows of replicated requests that another rank writes are never read, so
    perturbing those must change nothing)."""

    kind = "test_perturbed_hidden"

    class Config(_FaultConfig):
        kind: Literal["test_perturbed_hidden"] = "test_perturbed_hidden"

    def __call__(self, state: StepState) -> StepState:
        layout, n = state.layout, state.layout.padded_num_tokens
        held = layout.hidden_restore_idx[state.batch.logits_indices]
        mine = held[held // n == self.ctx.pcp_rank] % n
        if len(mine) and self._due(state):
            state.hidden = state.hidden.clone()
            state.hidden[int(mine[0])] += 1e-3
        return state


@register
class Crash(_Fault):
    """Anywhere: raises on one rank."""

    kind = "test_crash"

    class Config(_FaultConfig):
        kind: Literal["test_crash"] = "test_crash"

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            raise RuntimeError(f"injected failure on rank {self.ctx.pcp_rank} at step {state.batch.step}")
        return state


@register
class Stall(_Fault):
    """Anywhere: sleeps on one rank (a deadlock, a stuck kernel), then carries on."""

    kind = "test_stall"

    class Config(_FaultConfig):
        kind: Literal["test_stall"] = "test_stall"
        seconds: float = Field(100.0, gt=0)

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            time.sleep(self.config.seconds)
        return state


@register
class Exit(_Fault):
    """Anywhere: the rank leaves with ``code``: ``sys.exit`` (Python unwinds) or, with
    ``hard``, ``os._exit`` (no unwinding, no error file: as a crash looks)."""

    kind = "test_exit"

    class Config(_FaultConfig):
        kind: Literal["test_exit"] = "test_exit"
        code: int = 0
        hard: bool = False

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            sys.stdout.flush()
            if self.config.hard:
                os._exit(self.config.code)
            sys.exit(self.config.code)
        return state


@register
class SendSignal(_Fault):
    """Anywhere: sends ``signal`` to this rank's process, or with ``to_parent`` to the
    process that started it (the driver or torchrun's agent: as a user's Ctrl-C or a
    scheduler's SIGTERM reaches a job)."""

    kind = "test_signal"

    class Config(_FaultConfig):
        kind: Literal["test_signal"] = "test_signal"
        signal: Literal["SIGINT", "SIGTERM", "SIGHUP", "SIGKILL", "SIGSTOP"] = "SIGINT"
        to_parent: bool = False
        stamp: str | None = Field(None, description="a file to write the time of the signal to")

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            if self.config.stamp:
                Path(self.config.stamp).write_text(repr(time.time()))
            pid = _launcher_pid() if self.config.to_parent else os.getpid()
            os.kill(pid, getattr(signal, self.config.signal))
            time.sleep(30)  # the signal ends the job; a step that went on would hide that
        return state


def _launcher_pid() -> int:
    """The process that started the ranks: the parent, or past a multiprocessing fork
    server (pcpflow's own launch forks ranks from one) the server's parent."""
    pid = os.getppid()
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"multiprocessing.forkserver" in cmdline:
            stat = Path(f"/proc/{pid}/stat").read_text()
            pid = int(stat.rsplit(")", 1)[1].split()[1])  # field 4: ppid
    except OSError:
        pass
    return pid


@register
class SlowStart(_Fault):
    """Start-up (built with the pipeline, before the first step): sleeps on one rank, as a
    slow model load does."""

    kind = "test_slow_start"

    class Config(_FaultConfig):
        kind: Literal["test_slow_start"] = "test_slow_start"
        seconds: float = Field(10.0, gt=0)
        stop: bool = Field(False, description="SIGSTOP the rank instead (frozen in start-up, as under a debugger)")

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        if self._mine():
            if config.stop:
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(config.seconds)

    def __call__(self, state: StepState) -> StepState:
        return state


@register
class WrongPrefixBlock(_Fault):
    """Before ``slots``: the first continued prefill at or after ``step`` (a prefix hit)
    reads its first block from another block id, as a prefix cache that handed out the
    wrong block would (every rank: the table is global)."""

    kind = "test_wrong_prefix_block"

    class Config(_FaultConfig):
        kind: Literal["test_wrong_prefix_block"] = "test_wrong_prefix_block"

    def _due(self, state: StepState) -> bool:
        b = state.batch
        if self.fired or self.ctx.is_reference or b.step < self.config.step:
            return False
        self.fired = bool((b.is_prefilling & (b.num_computed_tokens > 0)).any())
        return self.fired

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            b = state.batch
            row = int(np.flatnonzero(b.is_prefilling & (b.num_computed_tokens > 0))[0])
            b.block_tables[row, 0] = (b.block_tables[row, 0] + 1) % self.ctx.config.kv.num_blocks
        return state


@register
class BlockResult(_Fault):
    """Anywhere: makes ``<path>/result.json`` a directory, so that the run dir cannot take its
    result any more (as a run dir that fills up or turns read-only mid-run)."""

    kind = "test_block_result"

    class Config(_FaultConfig):
        kind: Literal["test_block_result"] = "test_block_result"
        path: str

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            (Path(self.config.path) / "result.json").mkdir(parents=True, exist_ok=True)
        return state


@register
class RingFault(_Fault):
    """Before ``forward``: this rank's ``hop``-th ring exchange of the step (0 = the first)
    stalls for ``seconds`` or, with ``die``, ends the process (``os._exit``: no Python error,
    as a crash does), while its peers wait on their point-to-point transfers."""

    kind = "test_ring_fault"

    class Config(_FaultConfig):
        kind: Literal["test_ring_fault"] = "test_ring_fault"
        hop: int = Field(1, ge=0)
        seconds: float = Field(100.0, gt=0)
        die: bool = False

    def __call__(self, state: StepState) -> StepState:
        if self._due(state):
            from pcpflow.parallel.comm import Comm

            original, calls, cfg = Comm.ring_exchange, [0], self.config

            def faulty(comm, sends, recvs):
                if calls[0] == cfg.hop:
                    sys.stdout.flush()
                    if cfg.die:
                        os._exit(0)
                    time.sleep(cfg.seconds)
                calls[0] += 1
                return original(comm, sends, recvs)

            Comm.ring_exchange = faulty
        return state


@register
class TransferFault(_Fault):
    """Anywhere (disagg=pd): on global rank ``rank``, from step ``step`` on, the ``call``-th
    handover transfer this rank takes part in (0 = the first) stalls for ``seconds`` or, with
    ``die``, ends the process (``os._exit``), while its peers wait on their point-to-point
    messages; with ``corrupt``, a decode rank lands one received value off by 1 (what
    verification must catch)."""

    kind = "test_transfer_fault"

    class Config(_FaultConfig):
        kind: Literal["test_transfer_fault"] = "test_transfer_fault"
        call: int = Field(0, ge=0)
        seconds: float = Field(100.0, gt=0)
        die: bool = False
        corrupt: bool = False

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        # NOTE: the handover runs before any stage of the step: the transfer is patched now
        if self._mine():
            self._patch()

    def __call__(self, state: StepState) -> StepState:
        return state

    def _patch(self) -> None:
        from pcpflow.parallel.transfer import KVTransfer
        from pcpflow.rank.progress import where

        original, calls, cfg = KVTransfer.move, [0], self.config

        def faulty(tr, num_tokens, src, dst):
            local = tr.rank - tr.offset
            mine = [r for r in tr.routes(num_tokens) if (r.src == tr.rank if tr.in_prefill else r.dst == local)]
            if not mine or where()[0] < cfg.step:
                return original(tr, num_tokens, src, dst)
            hit = calls[0] == cfg.call
            calls[0] += 1
            if hit:  # NOTE: once: ranks shared by many configs (tests/shared_ranks.py) run the rest untouched
                KVTransfer.move = original
            if hit and not cfg.corrupt:
                sys.stdout.flush()
                if cfg.die:
                    os._exit(0)
                time.sleep(cfg.seconds)
            seconds = original(tr, num_tokens, src, dst)
            if hit and cfg.corrupt and not tr.in_prefill:
                r = mine[0]
                target = tr.caches[0]
                g = target.groups[0]
                slot = tr._slots(r.positions[:1], dst, {g}, target.moved.dst, r.dst, target.layers[0].device)[g]
                col = target.columns(tr.decode, r.dst, r.heads, False)[:1]
                target.layers[0][slot, col] += 1.0
            return seconds

        KVTransfer.move = faulty


@register
class CorruptedDraftKV(_Fault):
    """After ``draft``: one entry of the drafter's own cache (``RankContext.own_kv`` of the draft
    slot's stage, its first layer) that this rank holds is off by 1: the newest token of the
    step's first row with tokens whose position this rank owns (a position the step
    committed). With ``path``, writes ``{step, rank, req_id, position, slot}`` there as JSON
    (``rank``: the global rank, as verification names it)."""

    kind = "test_corrupted_draft_kv"

    class Config(_FaultConfig):
        kind: Literal["test_corrupted_draft_kv"] = "test_corrupted_draft_kv"
        path: str | None = Field(None, description="a file to write what was corrupted to")

    def __call__(self, state: StepState) -> StepState:
        import json

        from pcpflow.attention.metadata import rank_slot_mapping

        b, ctx = state.batch, self.ctx
        # NOTE: each row's first token is its oldest uncomputed one: committed, with or without drafts
        firsts = b.query_start_loc[:-1][b.num_scheduled_tokens > 0]
        slots = rank_slot_mapping(b.positions[firsts], b.req_indices[firsts], b.block_tables, ctx.config.kv,
                                  dcp_size=ctx.dcp_size, dcp_rank=ctx.dcp_rank)
        mine = np.flatnonzero(slots >= 0)
        if not len(mine) or not self._due(state):
            return state
        token, slot = int(firsts[mine[0]]), int(slots[mine[0]])
        (_, caches), *_ = ctx.own_kv["draft"]
        caches[0][slot] += 1.0
        if self.config.path:
            record = {"step": b.step, "rank": dist.get_rank() if dist.is_initialized() else 0, "req_id": int(b.req_ids[b.req_indices[token]]),
                      "position": int(b.positions[token]), "slot": slot}
            Path(self.config.path).write_text(json.dumps(record))
        return state
