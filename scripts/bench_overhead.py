"""Framework overhead per step vs the model forward, measured side by side.

One rank's step (rank 0 of P) runs through pcpflow's real stages, stage by stage, on the
same batch, repeat after repeat, and each stage's median µs is reported:

- framework: ``validate``, ``plan`` (plan_layout), ``buffers`` (staging the rank-local
  batch), ``slots`` (slot mapping and attention metadata) and the restore's own indexing
  (``all_rows`` and ``sampled_rows``);
- model: the ``forward`` stage — the tiny model over rank 0's rows, with the cache writes
  and attention (DCP partials and merge included).

Collectives are stubbed (``ZeroCostGroup``: every collective returns a preallocated
buffer of the right shape and moves nothing), and the restore is timed with the LM head
stubbed out, so neither column holds communication and the restore column is indexing
only. The ratio framework / forward is taken from medians of the same run, the stages of
each repeat running back to back in pipeline order.

Batches:
  (a) 255 decodes (contexts 500..30000) + one 7937-token prefill chunk (after 16384), P=4, 8;
  (a') the same shape at 1/100 of the lengths (what the CPU runs of the tiny model use);
  (b) steps of pcpflow's scheduler over the Mooncake conversation trace at real lengths
      (8192-token budget, 256 seqs, 50 ms per step), sampled from the steady state.

    python scripts/bench_overhead.py            # full run
    python scripts/bench_overhead.py --quick    # smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from compare_layouts import DEFAULT_TRACE, trace_batches

from pcpflow.models import build_model
from pcpflow.parallel.comm import Comm, CommStats
from pcpflow.pipeline.assemble import resolve_pipeline
from pcpflow.pipeline.context import RankContext
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.testing import compose

BLOCK_SIZE = 16
LAYOUTS = {  # name -> overrides (dcp=P is filled in per P)
    "replicated": ["decode=replicated"],
    "sharded": ["decode=sharded"],
    "dcp=P replicated": ["decode=replicated", "dcp=P"],
}
FRAMEWORK = ("validate", "plan", "buffers", "slots", "restore_index")


class ZeroCostGroup:
    """A stand-in process group of ``size`` ranks seen from rank 0: every collective
    returns a zeroed buffer of the right shape, allocated once and reused."""

    group = None
    stats = None

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size
        self._buffers: dict[tuple, torch.Tensor] = {}

    def _buffer(self, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        key = (shape, like.dtype, like.device)
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(shape, dtype=like.dtype, device=like.device)
        return self._buffers[key]

    def all_gather(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return self._buffer((self.size * t.shape[0], *t.shape[1:]), t)

    def all_to_all(self, t: torch.Tensor, purpose: str) -> torch.Tensor:
        return self._buffer(tuple(t.shape), t)

    def broadcast(self, t, src, purpose):
        return t

    def all_reduce(self, t, purpose, op="sum"):
        return t

    def barrier(self) -> None:
        pass


class NoLMHead:
    """The model as the restore stage sees it, minus the LM head (a [S, 1] slice)."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden[:, :1]


# ----------------------------------------------------------------------------- batches
def with_fresh_blocks(batch: GlobalBatch, dcp: int) -> tuple[GlobalBatch, int]:
    """The batch over a cache just big enough for it (its requests' blocks, in order)."""
    kv_tokens = batch.seq_lens
    tokens_per_block = BLOCK_SIZE * dcp
    num_blocks = int((-(-kv_tokens // tokens_per_block)).sum())
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, dcp)
    for req_id, n in zip(batch.req_ids.tolist(), kv_tokens.tolist()):
        kv.allocate(req_id, n)
    return batch.with_block_tables(kv.block_tables(batch.req_ids)), num_blocks


def decodes_plus_prefill(
    num_decodes: int, ctx: tuple[int, int], prefill: int, prefill_computed: int
) -> GlobalBatch:
    rng = np.random.default_rng(0)
    q = np.r_[np.ones(num_decodes, dtype=np.int64), prefill]
    computed = np.r_[rng.integers(*ctx, num_decodes), prefill_computed].astype(np.int64)
    prefilling = np.r_[np.zeros(num_decodes, dtype=bool), True]
    qsl = np.r_[0, np.cumsum(q)]
    return GlobalBatch(
        step=0,
        req_ids=np.arange(len(q), dtype=np.int64),
        num_scheduled_tokens=q,
        num_computed_tokens=computed,
        is_prefilling=prefilling,
        prompt_lens=np.where(prefilling, computed + q, 1),  # the chunk completes its prompt
        input_ids=np.zeros(int(q.sum()), dtype=np.int64),
        block_tables=np.zeros((len(q), 1), dtype=np.int64),
        logits_indices=(qsl[1:] - 1).astype(np.int64),
        num_draft_tokens=np.zeros(len(q), dtype=np.int64),
    )


def sampled_trace_steps(
    num: int, max_requests: int, max_steps: int | None, *, budget: int = 8192, min_decodes: int = 8
) -> list[GlobalBatch]:
    batches = trace_batches(
        DEFAULT_TRACE, max_requests=max_requests, max_steps=max_steps, max_num_batched_tokens=budget
    )
    batches = [b for b in batches if b.num_tokens]
    # Skip the ramp-up: the last two thirds, steps with decodes and a prefill chunk.
    steady = [
        b
        for b in batches[len(batches) // 3 :]
        if (~b.is_prefilling).sum() >= min_decodes and b.is_prefilling.any()
    ]
    picks = np.linspace(0, len(steady) - 1, min(num, len(steady))).astype(int)
    return [steady[i] for i in picks]


# ----------------------------------------------------------------------------- timing
@dataclass
class Row:
    batch: str
    pcp: int
    layout: str
    num_tokens: int
    num_reqs: int
    rank_rows: int
    us: dict[str, float]  # stage -> median µs


def bench(name: str, batch: GlobalBatch, pcp: int, layout: str, repeats: int) -> Row:
    overrides = [o.replace("dcp=P", f"dcp={pcp}") for o in LAYOUTS[layout]]
    dcp = pcp if f"dcp={pcp}" in overrides else 1
    batch, num_blocks = with_fresh_blocks(batch, dcp)
    cfg = compose(
        [
            f"pcp={pcp}",
            *overrides,
            "model=tiny_mla",
            "dtype=float32",
            "verify=false",
            f"scheduler.max_num_batched_tokens={max(batch.num_tokens, 128)}",
            f"scheduler.max_num_seqs={max(batch.num_reqs, 8)}",
            f"kv.block_size={BLOCK_SIZE}",
            f"kv.num_blocks={num_blocks}",
        ]
    )
    model = build_model(cfg.model, dtype=torch.float32, seed=0)
    caches = [
        torch.zeros(num_blocks * BLOCK_SIZE, model.attn_spec.entry_dim)
        for _ in range(model.num_layers)
    ]
    ctx = RankContext(
        config=cfg,
        pcp=ZeroCostGroup(pcp),  # type: ignore[arg-type]
        dcp=ZeroCostGroup(dcp) if dcp > 1 else Comm.solo(),  # type: ignore[arg-type]
        world=ZeroCostGroup(pcp),  # type: ignore[arg-type]
        device=torch.device("cpu"),
        dtype=torch.float32,
        model=model,
        kv_caches=caches,
        stats=CommStats(),
    )
    # NOTE: the restore stages see the model without its LM head: their time is indexing.
    restore_ctx = RankContext(**{**ctx.__dict__, "model": NoLMHead()})
    specs = {s.name: s for s in resolve_pipeline(cfg)}
    stages = [
        (name, specs[name].cls(specs[name].config, ctx))
        for name in ("validate", "plan", "buffers", "slots", "forward")
    ]
    restores = {}
    for kind in ("all_rows", "sampled_rows"):
        cls = resolve_pipeline(
            cfg.model_copy(update={"pipeline": {**cfg.pipeline, "restore": {"kind": kind}}})
        )
        spec = next(s for s in cls if s.name == "restore")
        restores[f"restore_index_{kind}"] = spec.cls(spec.config, restore_ctx)
    times: dict[str, list[float]] = {}
    state = None
    with torch.no_grad():
        for r in range(repeats + 1):  # the first repeat warms up and is not counted
            state = StepState(batch)
            for stage_name, stage in [*stages, *restores.items()]:
                t0 = time.perf_counter_ns()
                state = stage(state)
                if r:
                    times.setdefault(stage_name, []).append((time.perf_counter_ns() - t0) / 1e3)
    us = {k: statistics.median(v) for k, v in times.items()}
    us["restore_index"] = us["restore_index_all_rows"]
    assert state is not None and state.layout is not None
    return Row(
        name, pcp, layout, batch.num_tokens, batch.num_reqs, state.layout.padded_num_tokens, us
    )


# ----------------------------------------------------------------------------- output
def print_table(rows: list[Row], title: str, notes: list[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    heads = [
        "batch",
        "P",
        "layout",
        "rows/rank",
        "validate",
        "plan",
        "buffers",
        "slots",
        "restore idx (all / sampled)",
        "framework µs",
        "forward µs",
        "framework / forward",
    ]
    for h in heads:
        table.add_column(
            h, justify="left" if h in ("batch", "layout") else "right", no_wrap=h == "batch"
        )
    for r in rows:
        fw = sum(r.us[k] for k in FRAMEWORK)
        table.add_row(
            r.batch,
            str(r.pcp),
            r.layout,
            str(r.rank_rows),
            *(f"{r.us[k]:,.0f}" for k in ("validate", "plan", "buffers", "slots")),
            f"{r.us['restore_index_all_rows']:,.0f} / {r.us['restore_index_sampled_rows']:,.0f}",
            f"{fw:,.0f}",
            f"{r.us['forward']:,.0f}",
            f"{fw / r.us['forward']:.2%}",
        )
    console = Console(width=200)
    console.print(table)
    for n in notes:
        console.print(n)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="smoke run: small batches, 2 repeats")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--trace-steps", type=int, default=2, help="(b) trace steps sampled")
    ap.add_argument("--trace-requests", type=int, default=300, help="(b) trace requests simulated")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a rank runs with 1)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    repeats = 2 if args.quick else args.repeats

    cases: list[tuple[str, GlobalBatch, list[int]]] = []
    if args.quick:
        cases.append(
            ("31 decodes + 512 prefill (small)", decodes_plus_prefill(31, (50, 400), 512, 256), [4])
        )
        trace = sampled_trace_steps(1, 30, 120, budget=256, min_decodes=2)
    else:
        cases.append(
            (
                "(a) 255 decodes + 7937 prefill",
                decodes_plus_prefill(255, (500, 30000), 7937, 16384),
                [4, 8],
            )
        )
        # The same shape at the lengths of the CPU runs (x0.01): little attention per row.
        cases.append(
            (
                "(a') the same x0.01: 255 decodes + 80 prefill",
                decodes_plus_prefill(255, (5, 300), 80, 164),
                [4, 8],
            )
        )
        trace = sampled_trace_steps(args.trace_steps, args.trace_requests, None)
    for i, b in enumerate(trace):
        n_dec = int((~b.is_prefilling & (b.num_scheduled_tokens > 0)).sum())
        label = f"(b) trace step {b.step}: {n_dec} decodes, {b.num_tokens - n_dec} prefill tokens"
        cases.append((label, b, [4] if args.quick else [4, 8]))

    rows = []
    t0 = time.perf_counter()
    for name, batch, pcps in cases:
        for p in pcps:
            for layout in LAYOUTS:
                if args.quick and layout == "sharded":
                    continue
                rows.append(bench(name, batch, p, layout, repeats))
    print_table(
        rows,
        f"framework stages vs model forward, rank 0, median µs of {repeats} repeats "
        f"(tiny_mla float32, {args.threads} thread(s), collectives stubbed)",
        [
            (
                "framework = validate + plan + buffers + slots + restore indexing (all_rows); the "
                "run summary's framework_overhead_s counts validate + plan + buffers + slots."
            ),
            (
                "forward = the tiny model over rank 0's rows (projections, MLP, cache writes, "
                "paged attention; with dcp=P also the partial attention and its merge)."
            ),
            f"{len(rows)} cases in {time.perf_counter() - t0:.1f}s",
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
