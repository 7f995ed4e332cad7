"""Compare context-parallel layouts on the Mooncake conversation trace.

(a) Planner only, at the trace's real lengths (no model): the trace's requests, arriving as
    recorded, go through pcpflow's own scheduler (``pcpflow.scheduling.scheduler.Scheduler``, every
    sampled token stood in by 0: lengths and timing do not depend on token values), and
    every step's batch is planned for each layout, pcp in {1, 2, 4, 8} x decode
    {replicated, sharded round_robin, sharded balanced} x dcp in {1, pcp}. Per layout:
    - per-rank token balance (max/mean per step, mean over steps) and padding;
    - decode attention work, (query, key) pairs of decode rows: balance over ranks, and
      the busiest rank's share of one rank's worth (1.0 = every rank does all of it);
    - bytes moved per step by purpose, priced by ``pcpflow.layouts.accounting`` (the definition
      CPAttention and the restore stages follow) at a real model shape; restore both
      ``all_rows`` and ``sampled_rows``; with dcp > 1 the DCP bytes of each path of the
      rest rows side by side: ``auto`` (the default: per step, the path that moves fewer
      bytes), all ``queries`` and all ``context``, and how often auto gathers contexts;
    - with ``--tp N``, every layout N-way tensor parallel inside each PCP rank: heads split,
      the TP all-reduces (``tp_all_reduce``) beside the PCP/DCP bytes, all of the job's
      ranks counted;
    - planner time, ``plan_layout`` median µs per step.
(b) Full runs at scaled lengths (``workload=trace workload.length_scale=...``) through the
    real engine (``pcpflow.testing.run``, verification on): tokens/s, TTFT/TPOT and
    whether the run was exact. Ranks share this machine's cores, so times compare layouts
    under the same conditions, not hardware.

Writes ``planner.csv``, ``runs.csv`` and ``compare_layouts.png`` in ``--out``.

    python scripts/compare_layouts.py                 # full comparison
    python scripts/compare_layouts.py --quick         # smoke run (used by the test suite)
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pcpflow.layouts.accounting import (
    DCP_REST_POLICIES,
    ModelShape,
    attention_rows,
    attention_work,
    layer_collectives,
    plan_dcp_rest,
    restore_collective,
    step_collectives,
    step_traffic,
    tp_layer_collectives,
    tp_local_shape,
)
from pcpflow.layouts.layout import plan_layout
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import TraceWorkload, build_requests

FULL_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
BUNDLED_TRACE = REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"  # first 1,000 requests
DEFAULT_TRACE = FULL_TRACE if FULL_TRACE.exists() else BUNDLED_TRACE

MODEL_SHAPES = {
    # MLA: the cache holds the 512-d latent + 64-d rope key; queries absorbed (128 heads x 576).
    "deepseek_v3": ModelShape(
        hidden_size=7168,
        num_layers=61,
        entry_dim=576,
        num_heads=128,
        qk_dim=576,
        v_dim=512,
        dtype_bytes=2,
    ),
    # GQA: 8 kv heads x 128 for K and V.
    "llama3_70b": ModelShape(
        hidden_size=8192,
        num_layers=80,
        entry_dim=2 * 8 * 128,
        num_heads=64,
        qk_dim=128,
        v_dim=128,
        dtype_bytes=2,
    ),
    "tiny_mla": ModelShape(
        hidden_size=64, num_layers=2, entry_dim=48, num_heads=4, qk_dim=48, v_dim=32, dtype_bytes=8
    ),
}
DECODES = {  # name -> (decode mode, assignment)
    "replicated": ("replicated", "round_robin"),
    "sharded": ("sharded", "round_robin"),
    "sharded+balanced": ("sharded", "balanced"),
}
DCP_PURPOSES = ("dcp_decode_partials", "dcp_query_gather", "dcp_partials", "dcp_context_gather")


@dataclass(frozen=True)
class Layout:
    pcp: int
    dcp: int
    decode: str  # a DECODES key

    @property
    def name(self) -> str:
        return f"pcp={self.pcp} dcp={self.dcp} {self.decode}" if self.pcp > 1 else "pcp=1"

    def overrides(self) -> list[str]:
        mode, assignment = DECODES[self.decode]
        return [
            f"pcp={self.pcp}",
            f"dcp={self.dcp}",
            f"decode={mode}",
            f"decode.assignment={assignment}",
        ]


def layouts(pcps: list[int]) -> list[Layout]:
    out = []
    for p in pcps:
        if p == 1:
            out.append(Layout(1, 1, "replicated"))
            continue
        for d in (1, p):
            out += [Layout(p, d, decode) for decode in DECODES]
    return out


# ----------------------------------------------------------------------------- (a) planner
def trace_batches(
    path: Path,
    *,
    max_requests: int,
    step_ms: float = 50.0,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    max_steps: int | None = None,
) -> list[GlobalBatch]:
    """The batches pcpflow's scheduler emits for the trace at real lengths (arrivals as
    recorded, ``step_ms`` per step), every sampled token stood in by 0."""
    requests = build_requests(
        TraceWorkload(path=str(path), max_requests=max_requests, length_scale=1.0, step_ms=step_ms),
        vocab_size=2,
        seed=0,
    )
    # NOTE: big blocks keep block tables small; the planner never reads them.
    block = 1024
    need = sum(-(-(r.prompt_len + r.max_output_tokens) // block) for r in requests)
    sched = Scheduler(
        requests,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        kv=KVCacheManager(need, block),
    )
    batches = []
    while not sched.done and (max_steps is None or sched.step < max_steps):
        batch = sched.schedule()
        if batch is None:
            continue
        sched.update(batch, np.zeros(len(batch.logits_indices), dtype=np.int64))
        batches.append(batch)
    return batches


@dataclass
class PlannerStats:
    layout: Layout
    plan_us: list[float] = field(default_factory=list)
    token_ratio: list[float] = field(default_factory=list)  # per step max/mean over ranks
    decode_ratio: list[float] = field(default_factory=list)
    padded_rows: int = 0
    real_rows: int = 0
    tokens: np.ndarray | None = None  # run totals per rank
    work: np.ndarray | None = None
    decode_work: np.ndarray | None = None
    one_rank_decode_work: int = 0
    bytes: dict[str, int] = field(default_factory=dict)  # dcp_rest=auto, restore all_rows
    sampled_restore_bytes: int = 0
    dcp_bytes: dict[str, int] = field(default_factory=dict)  # dcp_rest policy -> DCP bytes
    rest_steps: int = 0  # steps whose rest rows take a DCP path (dcp > 1)
    context_steps: int = 0  # ... of which auto takes the context path
    steps: int = 0

    def add(self, batch: GlobalBatch, shape: ModelShape, tp: int = 1) -> None:
        """``shape``: one TP rank's (``tp_local_shape``); bytes count all ``tp * pcp`` ranks."""
        lay = self.layout

        def traffic(colls) -> dict[str, int]:
            return step_traffic(
                colls, pcp_size=lay.pcp, dcp_size=lay.dcp, dtype_bytes=shape.dtype_bytes, tp_size=tp
            )[1]

        mode, assignment = DECODES[lay.decode]
        t0 = time.perf_counter_ns()
        layout = plan_layout(
            batch.num_scheduled_tokens,
            batch.is_prefilling,
            pcp_size=lay.pcp,
            dcp_size=lay.dcp,
            shard_decodes=mode == "sharded",
            num_computed_tokens=batch.num_computed_tokens,
            decode_assignment=assignment,
        )
        self.plan_us.append((time.perf_counter_ns() - t0) / 1e3)
        tokens = layout.per_rank_num_tokens
        decode_rows = ~batch.is_prefilling[batch.req_indices]
        rests = {
            policy: plan_dcp_rest(
                layout, batch.seq_lens, policy=policy, dcp_size=lay.dcp, interleave=1, shape=shape
            )
            for policy in DCP_REST_POLICIES
        }
        rest_mode = rests["auto"].mode
        work = attention_work(
            layout, batch.positions, dcp_size=lay.dcp, interleave=1, dcp_rest=rest_mode
        )
        decode_work = attention_work(
            layout,
            batch.positions,
            dcp_size=lay.dcp,
            interleave=1,
            request_mask=~batch.is_prefilling,
            dcp_rest=rest_mode,
        )
        if self.tokens is None:
            self.tokens, self.work, self.decode_work = (
                np.zeros(len(a), np.int64) for a in (tokens, work, decode_work)
            )
        self.tokens += tokens
        self.work += work
        self.decode_work += decode_work
        self.one_rank_decode_work += int((batch.positions[decode_rows] + 1).sum())
        self.token_ratio.append(_max_over_mean(tokens))
        if decode_work.sum():
            self.decode_ratio.append(_max_over_mean(decode_work))
        self.padded_rows += layout.pcp_size * layout.padded_num_tokens
        self.real_rows += int(tokens.sum())
        colls = step_collectives(
            layout, batch.logits_indices, dcp_size=lay.dcp, shape=shape, dcp_rest=rests["auto"]
        )
        colls += tp_layer_collectives(layout, tp_size=tp, shape=shape) * shape.num_layers
        for k, v in traffic(colls).items():
            self.bytes[k] = self.bytes.get(k, 0) + v
        sampled = restore_collective(
            layout, batch.logits_indices, kind="sampled_rows", hidden_size=shape.hidden_size
        )
        self.sampled_restore_bytes += traffic([sampled]).get("restore", 0)
        for policy, rest in rests.items():
            per_layer = layer_collectives(layout, dcp_size=lay.dcp, shape=shape, dcp_rest=rest)
            dcp = sum(traffic([c for c in per_layer if c.group == "dcp"]).values())
            self.dcp_bytes[policy] = self.dcp_bytes.get(policy, 0) + dcp * shape.num_layers
        if lay.dcp > 1 and attention_rows(layout)[1]:
            self.rest_steps += 1
            self.context_steps += rest_mode == "context"
        self.steps += 1

    def row(self) -> dict:
        def mib(n: int) -> float:
            return n / self.steps / 2**20

        dcp = sum(self.bytes.get(k, 0) for k in DCP_PURPOSES)
        total = sum(self.bytes.values())
        return {
            "layout": self.layout.name,
            "pcp": self.layout.pcp,
            "dcp": self.layout.dcp,
            "decode": self.layout.decode,
            "steps": self.steps,
            "token_balance_step_mean": float(np.mean(self.token_ratio)),
            "token_balance_run": _max_over_mean(self.tokens),
            "padding_fraction": 1 - self.real_rows / self.padded_rows,
            "decode_work_balance_step_mean": float(np.mean(self.decode_ratio))
            if self.decode_ratio
            else 1.0,
            "decode_work_busiest_share": float(self.decode_work.max() / self.one_rank_decode_work)
            if self.one_rank_decode_work
            else 0.0,
            "attention_work_balance_run": _max_over_mean(self.work),
            "kv_gather_mib_per_step": mib(self.bytes.get("kv_gather", 0)),
            "tp_mib_per_step": mib(self.bytes.get("tp_all_reduce", 0)),
            "dcp_mib_per_step": mib(dcp),
            "dcp_queries_mib_per_step": mib(self.dcp_bytes.get("queries", 0)),
            "dcp_context_mib_per_step": mib(self.dcp_bytes.get("context", 0)),
            "auto_context_step_fraction": self.context_steps / self.rest_steps
            if self.rest_steps
            else None,
            "restore_all_rows_mib_per_step": mib(self.bytes.get("restore", 0)),
            "restore_sampled_rows_mib_per_step": mib(self.sampled_restore_bytes),
            "total_mib_per_step": mib(total),
            "plan_us_median": statistics.median(self.plan_us),
            "plan_us_p90": float(np.percentile(self.plan_us, 90)),
        }


def planner_comparison(
    batches: list[GlobalBatch], grid: list[Layout], shape: ModelShape, tp: int = 1
) -> list[dict]:
    stats = [PlannerStats(lay) for lay in grid]
    local = tp_local_shape(shape, tp)
    for batch in batches:
        if batch.num_tokens == 0:
            continue
        for s in stats:  # NOTE: layouts take turns per step, so all see the same machine load
            s.add(batch, local, tp)
    return [s.row() for s in stats]


def _max_over_mean(x) -> float:
    x = np.asarray(x, dtype=np.float64)
    return float(x.max() / x.mean()) if len(x) and x.mean() > 0 else 1.0


# ----------------------------------------------------------------------------- (b) runs
def full_runs(
    grid: list[Layout],
    trace: Path,
    *,
    max_requests: int,
    length_scale: float,
    output_len_cap: int,
    warmup: bool = True,
) -> list[dict]:
    import torch

    from pcpflow.testing import compose, run

    base = [
        "workload=trace",
        f"workload.path={trace}",
        f"workload.max_requests={max_requests}",
        f"workload.length_scale={length_scale}",
        f"workload.output_len_cap={output_len_cap}",
        "dtype=float64",
        "verify=true",
    ]
    cfgs = [compose(base + lay.overrides()) for lay in grid]
    # NOTE: the first run in a rank process pays one-time costs (lazy imports, allocator
    # and kernel warm-up); a discarded two-step run per world size absorbs them.
    warmups = (
        {c.world_size: c.model_copy(update={"max_steps": 2}) for c in reversed(cfgs)}
        if warmup
        else {}
    )
    # NOTE: pcp=1 runs in this process; give it one thread, like every spawned rank.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    try:
        results = run(list(warmups.values()) + cfgs)[len(warmups) :]
    finally:
        torch.set_num_threads(threads)
    elapsed = time.perf_counter() - t0
    rows = []
    for lay, res in zip(grid, results):
        m, v = res["metrics"], res.get("verify") or {}
        rows.append(
            {
                "layout": lay.name,
                "pcp": lay.pcp,
                "dcp": lay.dcp,
                "decode": lay.decode,
                "exact": bool(v.get("passed")),
                "max_abs_logit_diff": v.get("max_abs_logit_diff"),
                "steps": m["num_steps"],
                "tokens": m["num_tokens"],
                "tokens_per_s": m["tokens_per_s"],
                "ttft_mean_ms": _ms(m["ttft"]["mean_s"]),
                "tpot_mean_ms": _ms(m["tpot"]["mean_s"]),
                "token_balance": m["balance"]["tokens_max_over_mean"],
                "attention_work_balance": m["balance"]["attention_work_max_over_mean"],
                "collective_kib": sum(m["collective_bytes"].values()) / 1024,
                "framework_overhead_fraction": m["framework_overhead_fraction"],
            }
        )
    print(f"(b) {len(grid)} runs in {elapsed:.1f}s", file=sys.stderr)
    return rows


def _ms(s):
    return None if s is None else s * 1e3


# ----------------------------------------------------------------------------- output
PLANNER_COLUMNS = [  # key, header, format
    ("layout", "layout", "{}"),
    ("token_balance_step_mean", "token bal.", "{:.3f}"),
    ("padding_fraction", "padding", "{:.1%}"),
    ("decode_work_balance_step_mean", "decode work bal.", "{:.3f}"),
    ("decode_work_busiest_share", "busiest decode share", "{:.3f}"),
    ("attention_work_balance_run", "attn work bal. (run)", "{:.3f}"),
    ("kv_gather_mib_per_step", "kv_gather MiB/step", "{:.1f}"),
    ("tp_mib_per_step", "tp_all_reduce", "{:.1f}"),
    ("dcp_mib_per_step", "dcp MiB/step auto", "{:.1f}"),
    ("dcp_queries_mib_per_step", "queries", "{:.1f}"),
    ("dcp_context_mib_per_step", "context", "{:.1f}"),
    ("auto_context_step_fraction", "auto: context steps", "{:.0%}"),
    ("restore_all_rows_mib_per_step", "restore MiB/step all_rows", "{:.1f}"),
    ("restore_sampled_rows_mib_per_step", "sampled_rows", "{:.2f}"),
    ("plan_us_median", "plan µs/step", "{:.0f}"),
]
RUN_COLUMNS = [
    ("layout", "layout", "{}"),
    ("exact", "exact", "{}"),
    ("steps", "steps", "{}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
    ("ttft_mean_ms", "TTFT ms", "{:.1f}"),
    ("tpot_mean_ms", "TPOT ms", "{:.1f}"),
    ("token_balance", "token bal.", "{:.3f}"),
    ("attention_work_balance", "attn bal.", "{:.3f}"),
    ("collective_kib", "collective KiB", "{:.0f}"),
]


def print_table(title: str, rows: list[dict], columns) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for _, header, _ in columns:
        table.add_column(
            header, justify="left" if header == "layout" else "right", no_wrap=header == "layout"
        )
    for r in rows:
        table.add_row(*(("—" if r.get(k) is None else fmt.format(r[k])) for k, _, fmt in columns))
    Console(width=220).print(table)


def write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def plot(path: Path, planner: list[dict], runs: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [  # (rows, keys, title, legend names, x scale (None: linear), reference line)
        (
            planner,
            ["token_balance_step_mean", "decode_work_balance_step_mean"],
            "(a) balance: max/mean per step",
            ["tokens", "decode attention work"],
            None,
            1.0,
        ),
        (
            planner,
            ["decode_work_busiest_share"],
            "(a) busiest rank's decode work\n(1 = all of it)",
            None,
            None,
            None,
        ),
        (
            planner,
            [
                "kv_gather_mib_per_step",
                "dcp_queries_mib_per_step",
                "dcp_mib_per_step",
                "restore_all_rows_mib_per_step",
                "restore_sampled_rows_mib_per_step",
            ],
            "(a) MiB per step (log scale)",
            [
                "kv_gather",
                "dcp (queries path)",
                "dcp (auto)",
                "restore all_rows",
                "restore sampled_rows",
            ],
            "log",
            None,
        ),
        (planner, ["plan_us_median"], "(a) plan_layout µs per step (median)", None, None, None),
    ]
    if runs:
        panels += [
            (runs, ["tokens_per_s"], "(b) scaled runs: tokens/s", None, None, None),
            (
                runs,
                ["ttft_mean_ms", "tpot_mean_ms"],
                "(b) mean TTFT / TPOT (ms)",
                ["TTFT", "TPOT"],
                None,
                None,
            ),
        ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 0.32 * len(planner) + 2.6))
    for i, (ax, (rows, keys, name, legend, scale, ref)) in enumerate(zip(axes, panels)):
        y = np.arange(len(rows))
        h = 0.8 / len(keys)
        for j, key in enumerate(keys):
            v = np.array([r[key] if r[key] is not None else np.nan for r in rows], dtype=float)
            if scale == "log":
                v[v <= 0] = np.nan  # nothing moved: no bar
            ax.barh(
                y + (j - (len(keys) - 1) / 2) * h,
                np.nan_to_num(v),
                height=h,
                label=legend[j] if legend else None,
            )
        if scale == "log":
            ax.set_xscale("log")
        if ref is not None:
            ax.axvline(ref, color="grey", lw=0.8, ls="--")
        ax.set_title(name, fontsize=9)
        ax.grid(axis="x", alpha=0.3)
        if legend:
            ax.legend(
                fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.04), ncol=2, frameon=False
            )
        # Layout names on the first panel of each part.
        first = i == 0 or (rows is runs and panels[i - 1][0] is not runs)
        names = [("" if r.get("exact", True) else "✗ ") + r["layout"] for r in rows]
        ax.set_yticks(y, names if first else [""] * len(y), fontsize=7)
        ax.invert_yaxis()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: few requests and steps, pcp <= 4, two tiny full runs",
    )
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--out", type=Path, default=Path("compare_layouts"))
    ap.add_argument("--requests", type=int, default=600, help="(a) trace requests, from the start")
    ap.add_argument(
        "--step-ms", type=float, default=50.0, help="(a) ms of trace time per scheduler step"
    )
    ap.add_argument(
        "--max-steps", type=int, default=None, help="(a) stop the simulation after this many steps"
    )
    ap.add_argument(
        "--model",
        choices=sorted(MODEL_SHAPES),
        default="deepseek_v3",
        help="(a) shape that prices bytes",
    )
    ap.add_argument("--pcp", default="1,2,4,8", help="(a) pcp sizes")
    ap.add_argument(
        "--tp", type=int, default=1, help="(a) TP ranks per PCP rank (bytes of all tp*pcp ranks)"
    )
    ap.add_argument("--run-pcp", default="1,2,4", help="(b) pcp sizes of the full runs ('' = none)")
    ap.add_argument("--run-requests", type=int, default=12, help="(b) trace requests per run")
    ap.add_argument("--length-scale", type=float, default=0.01, help="(b) workload.length_scale")
    ap.add_argument("--output-len-cap", type=int, default=8, help="(b) workload.output_len_cap")
    args = ap.parse_args(argv)
    if args.quick:
        args.requests, args.max_steps, args.pcp, args.run_requests = 40, 150, "1,2,4", 2
        args.length_scale, args.output_len_cap = 0.004, 2
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.trace.exists():
        print(f"trace {args.trace} not found", file=sys.stderr)
        return 2
    shape = MODEL_SHAPES[args.model]

    t0 = time.perf_counter()
    batches = trace_batches(
        args.trace, max_requests=args.requests, step_ms=args.step_ms, max_steps=args.max_steps
    )
    sim_s = time.perf_counter() - t0
    grid = layouts([int(p) for p in args.pcp.split(",")])
    t0 = time.perf_counter()
    planner = planner_comparison(batches, grid, shape, args.tp)
    plan_s = time.perf_counter() - t0
    busy = [b for b in batches if b.num_tokens]
    decodes = np.mean([int((~b.is_prefilling & (b.num_scheduled_tokens > 0)).sum()) for b in busy])
    print_table(
        f"(a) planner only, real lengths: {args.requests} trace requests, {len(busy)} steps"
        f"{f' (cut at --max-steps {args.max_steps})' if args.max_steps else ''} "
        f"(8192-token budget, 256 seqs, {args.step_ms:g} ms/step; per step {np.mean([b.num_tokens for b in busy]):.0f} "
        f"tokens, {decodes:.0f} decodes); bytes at {args.model}, tp={args.tp} "
        f"({shape.num_layers} layers, {8 * shape.dtype_bytes}-bit)",
        planner,
        PLANNER_COLUMNS,
    )
    print(
        f"scheduler simulation {sim_s:.1f}s, planning + accounting of {len(grid)} layouts {plan_s:.1f}s",
        file=sys.stderr,
    )
    write_csv(args.out / "planner.csv", planner)

    runs: list[dict] = []
    run_grid = layouts([int(p) for p in args.run_pcp.split(",") if p.strip()])
    if args.quick:
        run_grid = [Layout(1, 1, "replicated"), Layout(2, 2, "sharded")]
    if run_grid:
        runs = full_runs(
            run_grid,
            args.trace,
            max_requests=args.run_requests,
            length_scale=args.length_scale,
            output_len_cap=args.output_len_cap,
            warmup=not args.quick,
        )
        print_table(
            f"(b) full runs, scaled lengths: {args.run_requests} trace requests x {args.length_scale:g}, outputs <= "
            f"{args.output_len_cap}, tiny_mla float64, verify on (ranks share this machine's cores)",
            runs,
            RUN_COLUMNS,
        )
        write_csv(args.out / "runs.csv", runs)
    plot(
        args.out / "compare_layouts.png",
        planner,
        runs,
        f"compare_layouts: {args.trace.name}, bytes at {args.model}",
    )
    print(f"wrote {args.out}/planner.csv, runs.csv, compare_layouts.png", file=sys.stderr)
    return 0 if all(r["exact"] for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
