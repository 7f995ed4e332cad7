"""Benchmark ``plan_layout`` against a plain loop planner of the same algorithm.

The loop planner below iterates once per request per rank and builds segments one
object at a time, as the vLLM MRV2 PCP manager does; every case asserts that both
planners produce identical layouts before timing them side by side.

Cases:
  (a) 255 decodes + one 7937-token prefill chunk, P=4 and P=8;
  (b) 1024 requests at P=8: one step of a 16384-token budget (decodes, spec-verify rows,
      idle rows, prefill chunks); (b') the same count with ~45k prefill tokens;
  (c) batches from a chunked-prefill scheduler run over the Mooncake conversation trace
      (max_num_batched_tokens 8192, max_num_seqs 256), plus the decode attention-work
      balance (max/mean per rank) of round_robin vs balanced owner assignment.

    python scripts/bench_layout.py            # full run
    python scripts/bench_layout.py --quick    # smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pcpflow.layouts.layout import BatchLayout, plan_layout  # noqa: E402

FULL_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
BUNDLED_TRACE = REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"  # first 1,000 requests
DEFAULT_TRACE = FULL_TRACE if FULL_TRACE.exists() else BUNDLED_TRACE
MODES = {  # name -> (shard_decodes, decode_assignment)
    "replicated": (False, "round_robin"),
    "sharded": (True, "round_robin"),
    "sharded+balanced": (True, "balanced"),
}


# --------------------------------------------------------------------------------------
# Loop reference: the vLLM MRV2 PCP manager's planning code, as plain Python — one
# iteration per request per rank, segment objects re-sorted and rebuilt with
# dataclasses.replace — with pcpflow's two changes: replicated requests are restored from
# their owner (also the short prefills that DCP replicates), and the balanced assignment.
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RankSegment:
    global_batch_req_idx: int
    global_batch_slice: slice
    rank_local_batch_slice: slice

    @property
    def num_tokens(self) -> int:
        return self.global_batch_slice.stop - self.global_batch_slice.start


class LoopPlanner:
    def __init__(self, pcp_size, dcp_size, shard_decodes, decode_assignment):
        self.pcp_world_size = pcp_size
        self.dcp_world_size = dcp_size
        self.shard_decode_requests = shard_decodes
        self.decode_assignment = decode_assignment

    def replicated_requests(self, num_scheduled_tokens, is_prefilling):
        num_chunks = 2 * self.pcp_world_size
        query_lens = np.asarray(num_scheduled_tokens, dtype=np.int64)
        replicated = ~np.asarray(is_prefilling, dtype=np.bool_)
        if self.dcp_world_size > 1:
            chunk_sizes = (query_lens + num_chunks - 1) // num_chunks
            replicated |= (num_chunks - 1) * chunk_sizes >= query_lens
        return replicated

    def owners(self, num_scheduled_tokens, num_computed_tokens, replicated):
        owner = [-1] * len(num_scheduled_tokens)
        held = [i for i, n in enumerate(num_scheduled_tokens) if n > 0 and replicated[i]]
        if not self.shard_decode_requests:
            for i in held:
                owner[i] = 0
        elif self.decode_assignment == "round_robin":
            for ordinal, i in enumerate(held):
                owner[i] = ordinal % self.pcp_world_size
        else:
            work = [int(num_computed_tokens[i] + num_scheduled_tokens[i]) for i in held]
            _loop_balanced_owners(held, work, self.pcp_world_size, owner)
        return owner

    @staticmethod
    def _reorder_segments(segments, is_prefilling):
        def sort_key(segment):
            req_idx = segment.global_batch_req_idx
            return (bool(is_prefilling[req_idx]), req_idx, segment.global_batch_slice.start)

        segments.sort(key=sort_key)
        rank_offset = 0
        for index, segment in enumerate(segments):
            segments[index] = replace(
                segment,
                rank_local_batch_slice=slice(rank_offset, rank_offset + segment.num_tokens),
            )
            rank_offset += segment.num_tokens
        return segments

    def _iter_rank_chunks(self, rank, num_scheduled_tokens, is_prefilling, owner):
        num_chunks = 2 * self.pcp_world_size
        replicated = self.replicated_requests(num_scheduled_tokens, is_prefilling)
        for req_idx, num_tokens in enumerate(num_scheduled_tokens):
            query_len = int(num_tokens)
            if query_len == 0:
                continue
            if not replicated[req_idx]:
                chunk_size = (query_len + num_chunks - 1) // num_chunks
                chunk_indices = (rank, num_chunks - 1 - rank)
            elif self.shard_decode_requests:
                chunk_size = query_len
                chunk_indices = (0,) if rank == owner[req_idx] else ()
            else:
                chunk_size = query_len
                chunk_indices = (0,)
            for chunk_idx in chunk_indices:
                chunk_offset = chunk_idx * chunk_size
                chunk_len = min(chunk_size, query_len - chunk_offset)
                if chunk_len <= 0:
                    continue
                yield req_idx, chunk_offset, chunk_len

    def _get_rank_segments(self, rank, num_scheduled_tokens, is_prefilling, query_start_loc, owner):
        rank_segments = []
        rank_offset = 0
        for req_idx, chunk_offset, chunk_len in self._iter_rank_chunks(
            rank, num_scheduled_tokens, is_prefilling, owner
        ):
            chunk_start = int(query_start_loc[req_idx]) + chunk_offset
            rank_segments.append(
                RankSegment(
                    global_batch_req_idx=req_idx,
                    global_batch_slice=slice(chunk_start, chunk_start + chunk_len),
                    rank_local_batch_slice=slice(rank_offset, rank_offset + chunk_len),
                )
            )
            rank_offset += chunk_len
        return self._reorder_segments(rank_segments, is_prefilling)

    def plan(self, num_scheduled_tokens, num_computed_tokens, is_prefilling,
             padded_num_tokens=None) -> dict:
        num_scheduled_tokens = np.asarray(num_scheduled_tokens, dtype=np.int64)
        is_prefilling = np.asarray(is_prefilling, dtype=bool)
        query_start_loc = np.zeros(len(num_scheduled_tokens) + 1, dtype=np.int64)
        np.cumsum(num_scheduled_tokens, out=query_start_loc[1:])
        replicated = self.replicated_requests(num_scheduled_tokens, is_prefilling)
        owner = self.owners(num_scheduled_tokens, num_computed_tokens, replicated)
        segments_by_rank, per_rank_num_tokens = [], []
        for rank in range(self.pcp_world_size):
            segments = self._get_rank_segments(
                rank, num_scheduled_tokens, is_prefilling, query_start_loc, owner
            )
            segments_by_rank.append(segments)
            per_rank_num_tokens.append(sum(segment.num_tokens for segment in segments))

        hidden_restore_idx = np.empty(int(query_start_loc[-1]), dtype=np.int64)
        if padded_num_tokens is None:
            padded_num_tokens = max(per_rank_num_tokens)
        elif padded_num_tokens < max(per_rank_num_tokens):
            raise ValueError(f"{padded_num_tokens} < {max(per_rank_num_tokens)}")
        num_expanded_tokens = padded_num_tokens * self.pcp_world_size
        padded_gather_idx = np.zeros(num_expanded_tokens, dtype=np.int64)
        kv_write_mask = np.zeros(num_expanded_tokens, dtype=np.bool_)
        for rank, segments in enumerate(segments_by_rank):
            expanded_rank_offset = rank * padded_num_tokens
            for segment in segments:
                rows = slice(
                    expanded_rank_offset + segment.rank_local_batch_slice.start,
                    expanded_rank_offset + segment.rank_local_batch_slice.stop,
                )
                padded_gather_idx[rows] = np.arange(
                    segment.global_batch_slice.start, segment.global_batch_slice.stop,
                    dtype=np.int64,
                )
                # Each replicated request is written (and restored) by its owner only.
                if replicated[segment.global_batch_req_idx] and (
                    rank != owner[segment.global_batch_req_idx]
                ):
                    continue
                kv_write_mask[rows] = True
                hidden_restore_idx[segment.global_batch_slice] = np.arange(
                    rows.start, rows.stop, dtype=np.int64
                )
        return {
            "replicated": replicated,
            "owner": np.array(owner, dtype=np.int64),
            "per_rank_num_tokens": np.array(per_rank_num_tokens, dtype=np.int64),
            "padded_num_tokens": padded_num_tokens,
            "padded_gather_idx": padded_gather_idx,
            "kv_write_mask": kv_write_mask,
            "hidden_restore_idx": hidden_restore_idx,
            "segments": [
                [(s.global_batch_req_idx, s.global_batch_slice.start, s.num_tokens,
                  s.rank_local_batch_slice.start) for s in segments]
                for segments in segments_by_rank
            ],
        }


def loop_plan(num_scheduled_tokens, is_prefilling, *, pcp_size, dcp_size=1,
              shard_decodes=False, padded_num_tokens=None, num_computed_tokens=None,
              decode_assignment="round_robin") -> dict:
    if num_computed_tokens is None:
        num_computed_tokens = np.zeros(len(num_scheduled_tokens), dtype=np.int64)
    planner = LoopPlanner(pcp_size, dcp_size, shard_decodes, decode_assignment)
    return planner.plan(num_scheduled_tokens, num_computed_tokens, is_prefilling,
                        padded_num_tokens)


def _loop_balanced_owners(held, work, pcp_size, owner) -> None:
    """LPT as water-filling phases (see ``pcpflow.layouts.layout._balanced_owners``), one request
    at a time, in exact integers scaled by 2 * (number of ranks below the level)."""
    by_work = sorted(range(len(held)), key=lambda k: (-work[k], held[k]))
    sizes = [work[k] for k in by_work]
    load = [0] * pcp_size
    for r, k in enumerate(by_work[:pcp_size]):
        owner[held[k]] = r
        load[r] = sizes[r]
    lo = min(pcp_size, len(sizes))
    while lo < len(sizes):
        hi = min(len(sizes), lo + max(2 * pcp_size, (len(sizes) - lo + 1) // 2))
        phase = sum(sizes[lo:hi])
        by_load = sorted(range(pcp_size), key=lambda r: (load[r], r))
        filled, below = 0, 0
        for k, r in enumerate(by_load, 1):
            below += load[r]
            if phase + below < k * load[r]:
                break
            filled, level_k = k, phase + below  # level = level_k / filled
        bounds, acc = [], 0
        for r in by_load[:filled]:
            acc += 2 * (level_k - filled * load[r])
            bounds.append(acc)
        poured = 0
        added = [0] * pcp_size
        for k in range(lo, hi):
            middle = filled * (2 * poured + sizes[k])
            slot = min(sum(1 for b in bounds if b <= middle), filled - 1)
            r = by_load[slot]
            owner[held[by_work[k]]] = r
            added[r] += sizes[k]
            poured += sizes[k]
        load = [a + b for a, b in zip(load, added)]
        lo = hi


def assert_same(layout: BatchLayout, ref: dict) -> None:
    for name in ("replicated", "owner", "per_rank_num_tokens", "padded_gather_idx",
                 "kv_write_mask", "hidden_restore_idx"):
        got, want = getattr(layout, name), ref[name]
        assert got.dtype == want.dtype and np.array_equal(got, want), name
    assert layout.padded_num_tokens == ref["padded_num_tokens"]
    for seg, want in zip(layout.segments, ref["segments"], strict=True):
        got = list(zip(seg.req_idx.tolist(), seg.global_start.tolist(), seg.length.tolist(),
                       seg.local_start.tolist()))
        assert got == want, "segments"


# --------------------------------------------------------------------------------------
# Batches.
# --------------------------------------------------------------------------------------


@dataclass
class Batch:
    q: np.ndarray
    is_prefilling: np.ndarray
    computed: np.ndarray


def batch_decodes_plus_prefill(rng: np.random.Generator) -> Batch:
    q = np.r_[np.ones(255, dtype=np.int64), 7937]
    computed = np.r_[rng.integers(500, 30000, 255), 16384]
    return Batch(q, q > 1, computed)


def batch_1024_step(rng: np.random.Generator) -> Batch:
    """1024 running requests in one step of a 16384-token budget: 960 decodes, 40
    spec-verify rows (2..5 tokens), 16 idle rows, 8 prefill chunks taking the rest."""
    q = np.r_[np.ones(960), rng.integers(2, 6, 40), np.zeros(16), np.zeros(8)].astype(np.int64)
    cuts = np.sort(rng.choice(np.arange(1, 16384 - q.sum()), 7, replace=False))
    q[-8:] = np.diff(np.r_[0, cuts, 16384 - q.sum()])
    pre = np.r_[np.zeros(1000, dtype=bool), rng.random(16) < 0.5, np.ones(8, dtype=bool)]
    order = rng.permutation(1024)
    return Batch(q[order], pre[order], rng.integers(0, 30000, 1024))


def batch_1024_prefill_heavy(rng: np.random.Generator) -> Batch:
    """1024 requests, ~5% of them prefill chunks of up to 2047 tokens (~45k tokens)."""
    kind = rng.choice(4, size=1024, p=[0.86, 0.06, 0.05, 0.03])  # decode/spec/prefill/idle
    q = np.select(
        [kind == 0, kind == 1, kind == 2],
        [1, rng.integers(2, 6, 1024), rng.integers(1, 2048, 1024)],
        0,
    ).astype(np.int64)
    return Batch(q, (kind == 2) | ((kind == 3) & (rng.random(1024) < 0.5)),
                 rng.integers(0, 30000, 1024))


@dataclass
class _Running:
    prompt: int
    output: int
    computed: int = 0
    decoded: int = 0


def trace_batches(path: Path, num_steps: int, max_tokens=8192, max_seqs=256) -> list[Batch]:
    """Chunked-prefill scheduling of the trace, all requests queued at once (saturated).

    Each step: running decodes first (1 token each), then the running partial prefills,
    then new requests, each prefill chunk capped by the remaining token budget. A request
    finishes after ``output_length`` decode steps; a running prefill left without budget
    stays in the batch as a zero-token row.
    """
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    rows.sort(key=lambda r: r["timestamp"])
    waiting = collections.deque(_Running(r["input_length"], r["output_length"]) for r in rows)
    running: list[_Running] = []
    batches = []
    for _ in range(num_steps):
        budget = max_tokens
        sched = {}
        for r in running:
            if r.computed >= r.prompt and budget > 0:
                sched[id(r)] = 1
                budget -= 1
        for r in running:
            if r.computed < r.prompt:
                sched[id(r)] = min(r.prompt - r.computed, budget)
                budget -= sched[id(r)]
        while waiting and len(running) < max_seqs and budget > 0:
            r = waiting.popleft()
            running.append(r)
            sched[id(r)] = min(r.prompt, budget)
            budget -= sched[id(r)]
        if not running:
            break
        batches.append(Batch(
            np.array([sched.get(id(r), 0) for r in running], dtype=np.int64),
            np.array([r.computed < r.prompt for r in running], dtype=bool),
            np.array([r.computed for r in running], dtype=np.int64),
        ))
        for r in running:
            n = sched.get(id(r), 0)
            if r.computed >= r.prompt:
                r.decoded += n
            r.computed += n
        running = [r for r in running if r.decoded < r.output]
    return batches


# --------------------------------------------------------------------------------------
# Measurement.
# --------------------------------------------------------------------------------------


def median_us(fns, repeats: int, interleave: bool) -> list[float]:
    """Median µs per call of each function. Interleaved, the calls alternate, so both
    see the same machine load and plan_layout runs with caches the loop left cold, as in
    a real step; otherwise each runs back to back (warm)."""
    times = [[] for _ in fns]
    for fn in fns:
        fn()
    order = [(fn, t) for _ in range(repeats) for fn, t in zip(fns, times)]
    if not interleave:
        order.sort(key=lambda pair: fns.index(pair[0]))
    for fn, t in order:
        t0 = time.perf_counter_ns()
        fn()
        t.append(time.perf_counter_ns() - t0)
    return [statistics.median(t) / 1e3 for t in times]


def time_case(batch: Batch, p: int, mode: str, repeats: int) -> tuple[float, float, float]:
    """(loop µs, plan_layout µs interleaved with the loop, plan_layout µs back to back)."""
    shard, assignment = MODES[mode]
    kwargs = dict(pcp_size=p, shard_decodes=shard, decode_assignment=assignment,
                  num_computed_tokens=batch.computed)
    assert_same(plan_layout(batch.q, batch.is_prefilling, **kwargs),
                loop_plan(batch.q, batch.is_prefilling, **kwargs))
    loop, vec = median_us([lambda: loop_plan(batch.q, batch.is_prefilling, **kwargs),
                           lambda: plan_layout(batch.q, batch.is_prefilling, **kwargs)],
                          repeats, interleave=True)
    (warm,) = median_us([lambda: plan_layout(batch.q, batch.is_prefilling, **kwargs)],
                        repeats, interleave=False)
    return loop, vec, warm


def decode_work_imbalance(batch: Batch, p: int, assignment: str) -> float:
    """max / mean over ranks of the decode attention work (c + q) each rank owns."""
    layout = plan_layout(batch.q, batch.is_prefilling, pcp_size=p, shard_decodes=True,
                         num_computed_tokens=batch.computed, decode_assignment=assignment)
    held = layout.owner >= 0
    work = np.bincount(layout.owner[held], weights=(batch.computed + batch.q)[held], minlength=p)
    return float(work.max() / work.mean())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smoke run: few repeats, few steps")
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--steps", type=int, default=3000, help="scheduler steps to simulate")
    ap.add_argument("--samples", type=int, default=40, help="trace steps sampled")
    args = ap.parse_args(argv)
    repeats = 3 if args.quick else 100
    steps, samples = (300, 3) if args.quick else (args.steps, args.samples)
    rng = np.random.default_rng(0)

    rows = []  # (case, P, mode, loop µs, plan_layout µs interleaved, plan_layout µs warm)
    a = batch_decodes_plus_prefill(rng)
    for p in (4, 8):
        for mode in MODES:
            rows.append(("(a) 255 decodes + 7937 prefill", p, mode,
                         *time_case(a, p, mode, repeats)))
    for name, b in (("(b) 1024 requests, 16k tokens", batch_1024_step(rng)),
                    ("(b') 1024 requests, 45k tokens", batch_1024_prefill_heavy(rng))):
        for mode in MODES:
            rows.append((name, 8, mode, *time_case(b, 8, mode, repeats)))

    balance = []  # (P, round_robin mean, worst, balanced mean, worst)
    notes = []
    if args.trace.exists():
        batches = trace_batches(args.trace, steps)
        # Skip the ramp-up: sample the last two thirds, steps with >= 16 decodes.
        steady = [bt for bt in batches[len(batches) // 3 :] if (~bt.is_prefilling).sum() >= 16]
        picks = np.linspace(0, len(steady) - 1, min(samples, len(steady))).astype(int)
        picked = [steady[i] for i in picks]
        for p in (4, 8):
            for mode in MODES:
                per_step = [time_case(bt, p, mode, max(3, repeats // 10)) for bt in picked]
                rows.append((f"(c) trace, {len(picked)} steps", p, mode,
                             *(statistics.median(col) for col in zip(*per_step))))
            ratios = {asg: [decode_work_imbalance(bt, p, asg) for bt in picked]
                      for asg in ("round_robin", "balanced")}
            balance.append((p, *(f(ratios[asg]) for asg in ratios for f in (np.mean, np.max))))
        notes.append(
            f"(c): {len(batches)} scheduler steps simulated, {len(picked)} sampled from the "
            f"steady state; per step {np.mean([len(bt.q) for bt in picked]):.0f} requests, "
            f"{np.mean([(~bt.is_prefilling & (bt.q > 0)).sum() for bt in picked]):.0f} decodes, "
            f"{np.mean([bt.q.sum() for bt in picked]):.0f} tokens on average"
        )
    else:
        notes.append(f"trace {args.trace} not found: case (c) skipped")
    notes.append("interleaved: loop and plan_layout calls alternate (plan_layout starts with "
                 "the caches the loop left); back to back: plan_layout alone, warm")
    _print_tables(rows, balance, notes)
    return 0


def _print_tables(rows, balance, notes) -> None:
    head = ("case", "P", "decode mode", "loop µs", "plan_layout µs", "speed-up",
            "back to back µs", "speed-up")
    body = [(c, str(p), m, f"{lo:,.0f}", f"{v:,.1f}", f"{lo / v:,.1f}x", f"{w:,.1f}",
             f"{lo / w:,.1f}x") for c, p, m, lo, v, w in rows]
    bal_head = ("P", "round_robin mean", "round_robin worst", "balanced mean", "balanced worst")
    bal_body = [(str(p), *(f"{x:.4f}" for x in vals)) for p, *vals in balance]
    tables = [("plan time, median µs per plan (loop reference vs plan_layout, interleaved)",
               head, body),
              ("(c) decode attention work (c + q) per rank, max/mean, sharded decodes",
               bal_head, bal_body)]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        for title, h, b in tables:
            if b:
                print(title)
                for r in (h, *b):
                    print(" | ".join(r))
                print()
        print("\n".join(notes))
        return
    console = Console(width=max(120, Console().width))
    for title, h, b in tables:
        if not b:
            continue
        table = Table(title=title)
        for col in h:
            table.add_column(col, justify="left" if col in ("case", "decode mode") else "right")
        for r in b:
            table.add_row(*r)
        console.print(table)
    for note in notes:
        console.print(note)


if __name__ == "__main__":
    sys.exit(main())
