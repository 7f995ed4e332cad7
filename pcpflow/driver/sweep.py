"""The sweep report: a Hydra callback that, after a multirun, reads every job's
``result.json`` and writes ``sweep.csv`` (a row per job), ``sweep.md`` (the table a person
reads) and ``sweep.png`` (the same comparison as a picture) in the sweep dir.

A sweep dir used again (``hydra.sweep.dir`` given twice) keeps an earlier multirun's jobs
that the new one did not overwrite: each multirun writes an id of its own into the sweep dir
(``MULTIRUN_ID``) and each of its jobs a copy into its job dir, and the report takes the jobs
of the sweep dir's id only.

Also usable on any directory of finished runs: ``python -m pcpflow.driver.sweep DIR`` (the
latest multirun's jobs; every job where no multirun wrote an id).
"""

from __future__ import annotations

import csv
import json
import sys
import uuid
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

from pcpflow.layouts.accounting import tp_share
from pcpflow.output.report import human_bytes

BASE_COLUMNS = [
    "job",
    "mode",
    "overrides",
    "config",
    "status",
    "exact",
    "tokens_match",
    "kv_match",
    "max_abs_logit_diff",
    "num_steps",
    "num_tokens",
    "tokens_per_s",
    "ttft_mean_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "ttft_mean_steps",
    "tpot_mean_ms",
    "tpot_p99_ms",
    "tpot_mean_steps",
    "requests_s",
    "output_tok_s",
    "output_tok_s_per_gpu",
    "total_tok_s",
    "goodput_req_s",
    "goodput_share",
    "kv_usage_mean",
    "kv_usage_max",
    "prefix_hit_rate",
    "preemptions",
    "queue_mean_ms",
    "transfer_bytes",
    "transfer_calls",
    "transfer_ms",
    "prefill_utilization",
    "decode_utilization",
    "tokens_max_over_mean",
    "attention_work_max_over_mean",
    "padding_fraction",
    "framework_overhead_fraction",
    "acceptance_rate",
    "bytes_total",
    "bytes_tp",
    "bytes_pcp_dcp",
    "wall_s",
]
"""Columns every ``sweep.csv`` has, in order; then ``bytes_<purpose>`` and
``calls_<purpose>`` for each collective purpose seen, then ``error``."""


MULTIRUN_ID = ".multirun_id"
"""The file holding a multirun's id: in the sweep dir (the latest multirun's) and in each job dir."""


class SweepReport(Callback):
    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        # NOTE: in the driver, whichever launcher runs the jobs (joblib's run in other processes)
        sweep_dir = Path(str(config.hydra.sweep.dir))
        _STARTED[:] = [sweep_dir]
        sweep_dir.mkdir(parents=True, exist_ok=True)
        (sweep_dir / MULTIRUN_ID).write_text(uuid.uuid4().hex)

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        # NOTE: in the job's process, its dir made (a job of this multirun or a run of its own)
        from hydra.types import RunMode

        if config.hydra.mode == RunMode.MULTIRUN:
            try:
                sweep_id = (Path(str(config.hydra.sweep.dir)) / MULTIRUN_ID).read_text()
                (Path(config.hydra.runtime.output_dir) / MULTIRUN_ID).write_text(sweep_id)
            except OSError:
                pass  # NOTE: the sweep dir's id was removed: no report can tell this job's multirun

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        write_sweep_report(Path(str(config.hydra.sweep.dir)))


_STARTED: list[Path] = []


def forget_sweep() -> None:
    _STARTED.clear()


def started_sweep() -> Path | None:
    """The sweep dir of the multirun this driver process started, if any."""
    return _STARTED[0] if _STARTED else None


def close_interrupted_jobs(sweep_dir: Path, exc: Any, *, wait_s: float = 5.0) -> list[Path]:
    """Every job of an interrupted sweep that was still running gets its ``result.json``.

    A job that a parallel launcher (joblib) ran in a worker process is killed with its worker
    when the driver is interrupted (joblib aborts its pool with SIGKILL), mostly before it
    could write "interrupted" itself: its run dir is left with the lock of a dead process and
    no result. A job whose process is still alive gets ``wait_s`` to write its own. Returns
    the dirs written."""
    import time

    from pcpflow.output.rundir import (
        LOCK_FILE,
        RESULT_FILE,
        failed_result,
        live_lock_owner,
        progress_of,
        release_lock_of_dead,
        write_result,
    )

    locked = sorted(sweep_dir.glob(f"*/{LOCK_FILE}"))
    deadline = time.monotonic() + wait_s
    while any(live_lock_owner(p.parent) is not None for p in locked) and time.monotonic() < deadline:
        time.sleep(0.1)
    closed = []
    for lock in locked:
        job_dir = lock.parent
        if live_lock_owner(job_dir) is not None or not lock.exists():
            continue
        if not (job_dir / RESULT_FILE).exists():
            try:
                config = json.loads((job_dir / "config.json").read_text())
            except (OSError, ValueError):
                config = {}
            try:
                write_result(job_dir, failed_result(str(exc), config, exc.exit_code, run_dir=str(job_dir), **progress_of(job_dir)))
                closed.append(job_dir)
            except OSError:
                continue
        release_lock_of_dead(job_dir)
    return closed


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    """A row per job directory of the sweep dir's multirun holding a ``result.json``, in job
    order. ``config`` is the job's overrides that differ between jobs (what the sweep varies)."""
    rows, overrides, settings = [], [], []
    for result_path in sorted(_this_multirun(sweep_dir.glob("*/result.json"), sweep_dir), key=_job_order):
        result = _read_result(result_path)
        settings.append(_headline_settings(result.get("config") or {}))
        job_dir = result_path.parent
        m, v = result.get("metrics") or {}, result.get("verify") or {}
        ttft, tpot, balance = m.get("ttft") or {}, m.get("tpot") or {}, m.get("balance") or {}
        overrides.append(_overrides(job_dir))
        row: dict[str, Any] = {
            "job": job_dir.name,
            "mode": (result.get("config") or {}).get("mode"),
            "overrides": " ".join(overrides[-1]),
            "status": result.get("status"),
            "exact": v.get("passed") if v else None,
            "tokens_match": v.get("tokens_match"),
            "kv_match": v.get("kv_match"),
            "max_abs_logit_diff": v.get("max_abs_logit_diff"),
            "num_steps": m.get("num_steps"),
            "num_tokens": m.get("num_tokens"),
            "tokens_per_s": _round(m.get("tokens_per_s"), 1),
            "ttft_mean_ms": _ms(ttft.get("mean_s")),
            "ttft_p90_ms": _ms(ttft.get("p90_s")),
            "ttft_p99_ms": _ms(ttft.get("p99_s")),
            "ttft_mean_steps": _round(ttft.get("mean_steps"), 2),
            "tpot_mean_ms": _ms(tpot.get("mean_s")),
            "tpot_p99_ms": _ms(tpot.get("p99_s")),
            "tpot_mean_steps": _round(tpot.get("mean_steps"), 2),
            **_serving_columns(m),
            "tokens_max_over_mean": _round(balance.get("tokens_max_over_mean"), 4),
            "attention_work_max_over_mean": _round(balance.get("attention_work_max_over_mean"), 4),
            "padding_fraction": _round(balance.get("padding_fraction"), 4),
            "framework_overhead_fraction": _round(m.get("framework_overhead_fraction"), 4),
            "acceptance_rate": _round(m.get("acceptance_rate"), 4),
            "bytes_total": sum((m.get("collective_bytes") or {}).values()) if m else None,
            "wall_s": _round(m.get("wall_s"), 2),
        }
        # TP bytes beside the PCP/DCP ones (blank when no TP all-reduce ran)
        share = tp_share(m.get("collective_bytes") or {})
        tp_ran = any(k.endswith("tp_all_reduce") for k in m.get("collective_bytes") or {})
        row["bytes_tp"] = share["tp"] if tp_ran else None
        row["bytes_pcp_dcp"] = share["pcp_dcp"] if tp_ran else None
        for purpose, nbytes in (m.get("collective_bytes") or {}).items():
            row[f"bytes_{purpose}"] = nbytes
        for purpose, calls in (m.get("collective_calls") or {}).items():
            row[f"calls_{purpose}"] = calls
        if result.get("status") != "ok" and result.get("error"):
            row["error"] = str(result["error"]).strip().splitlines()[0][:200]
        if row["mode"] == "search":
            row["search"] = m.get("search")
        rows.append(row)
    common = set.intersection(*map(set, overrides)) if len(rows) > 1 else set()
    fixed = [f"{k}={v}" for k, v in settings[0].items() if all(s.get(k) == v for s in settings)] if rows else []
    for row, job_overrides in zip(rows, overrides):
        row["config"] = " ".join(o for o in job_overrides if o not in common) or row["job"]
        row["common_overrides"] = [o for o in job_overrides if o in common]
        row["fixed_settings"] = fixed
    return rows


_HEADLINE = ("pcp", "dcp", "tp", "decode.mode", "decode.assignment", "model.name", "dtype",
             "workload.kind", "draft.kind", "scheduler.max_num_batched_tokens", "kv.block_size")
"""The settings a sweep's picture names when every job has the same value."""


_SERVING_COLUMNS = (  # column, where in metrics, decimals
    ("requests_s", "throughput.requests_s", 4), ("output_tok_s", "throughput.output_tok_s", 1),
    ("output_tok_s_per_gpu", "throughput.output_tok_s_per_gpu", 1), ("total_tok_s", "throughput.total_tok_s", 1),
    ("goodput_req_s", "goodput.req_s", 4), ("goodput_share", "goodput.share", 4),
    ("kv_usage_mean", "kv_usage.mean", 4), ("kv_usage_max", "kv_usage.max", 4),
    ("prefix_hit_rate", "prefix_cache.hit_rate", 4), ("preemptions", "preemptions", 0),
    # disagg=pd (blank without pools): the handovers, each pool's share of the run clock
    ("transfer_bytes", "transfer.bytes", 0), ("transfer_calls", "transfer.calls", 0),
    ("prefill_utilization", "pools.prefill.utilization", 4), ("decode_utilization", "pools.decode.utilization", 4),
)


def _serving_columns(m: dict[str, Any]) -> dict[str, Any]:
    """The serving metrics of a job (blank where a run predates them)."""
    def at(path: str) -> Any:
        node: Any = m
        for part in path.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        return node

    return {**{col: _round(at(path), n) for col, path, n in _SERVING_COLUMNS}, "queue_mean_ms": _ms(m.get("queue_s")),
            "transfer_ms": _ms(at("transfer.s"))}


def _headline_settings(config: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key in _HEADLINE:
        node: Any = config
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[key.replace(".mode", "").replace(".name", "").replace(".kind", "")] = node
    return out


def write_sweep_report(sweep_dir: Path, *, announce: bool = True) -> list[dict[str, Any]]:
    rows = collect_rows(sweep_dir)
    if not rows:
        return rows
    if any(r.get("mode") == "search" for r in rows):  # NOTE: a search's result is its recommendation, not a run
        from pcpflow.search.sweep import search_row, write_search_sweep

        write_search_sweep([search_row(r, r.get("search")) for r in rows], sweep_dir)
        if announce:
            print(f"pcpflow: sweep report of {len(rows)} search(es): {sweep_dir / 'sweep.md'}", file=sys.stderr)
        return rows
    purposes = sorted(
        {k.removeprefix("bytes_") for r in rows for k in r if k.startswith("bytes_")}
        - {"total", "tp", "pcp_dcp"}
    )
    from pcpflow.simulate.decide import COLUMNS as DECISION_COLUMNS
    from pcpflow.simulate.decide import decide, term_columns

    decision = decide(rows, sweep_dir)  # gpus, pareto, rank (by simulate.objective), <term>_s
    columns = (
        BASE_COLUMNS
        + DECISION_COLUMNS
        + term_columns(rows)
        + [f"bytes_{p}" for p in purposes]
        + [f"calls_{p}" for p in purposes]
        + ["error"]
    )
    with open(sweep_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in columns})
    (sweep_dir / "sweep.md").write_text(_markdown(rows, purposes) + decision)
    _plot(rows, purposes, sweep_dir / "sweep.png")
    if announce:
        print(f"pcpflow: sweep report of {len(rows)} job(s): {sweep_dir / 'sweep.md'}", file=sys.stderr)
    return rows


# ------------------------------------------------------------------------------ sweep.md
_HEADERS = {  # column -> (header, cell formatter)
    "config": ("config", str),
    "status": ("status", lambda v: v if v == "ok" else f"**{v}**"),
    "exact": ("exact", lambda v: "yes" if v else "**NO**"),
    "max_abs_logit_diff": ("max \\|Δlogit\\|", lambda v: f"{v:.1e}"),
    "num_steps": ("steps", str),
    "num_tokens": ("tokens", str),
    "tokens_per_s": ("tokens/s", lambda v: f"{v:.0f}"),
    "ttft_mean_ms": ("TTFT ms", lambda v: f"{v:.1f}"),
    "tpot_mean_ms": ("TPOT ms", lambda v: f"{v:.1f}"),
    "ttft_p99_ms": ("TTFT p99 ms", lambda v: f"{v:.1f}"),
    "tpot_p99_ms": ("TPOT p99 ms", lambda v: f"{v:.1f}"),
    "output_tok_s_per_gpu": ("out tok/s/GPU", lambda v: f"{v:,.0f}"),
    "goodput_req_s": ("goodput req/s", lambda v: f"{v:.2f}"),
    "kv_usage_mean": ("KV use", lambda v: f"{v:.0%}"),
    "prefix_hit_rate": ("prefix hits", lambda v: f"{v:.0%}"),
    "preemptions": ("preempted", str),
    "transfer_bytes": ("handed over", lambda v: human_bytes(v)),
    "transfer_ms": ("transfer ms", lambda v: f"{v:.1f}"),
    "prefill_utilization": ("prefill busy", lambda v: f"{v:.0%}"),
    "decode_utilization": ("decode busy", lambda v: f"{v:.0%}"),
    "tokens_max_over_mean": ("token balance", lambda v: f"{v:.3f}"),
    "attention_work_max_over_mean": ("attn balance", lambda v: f"{v:.3f}"),
    "padding_fraction": ("padding", lambda v: f"{v:.1%}"),
    "framework_overhead_fraction": ("overhead", lambda v: f"{v:.1%}"),
    "acceptance_rate": ("acceptance", lambda v: f"{v:.1%}"),
    "bytes_tp": ("TP bytes", lambda v: human_bytes(v)),
    "bytes_pcp_dcp": ("PCP/DCP bytes", lambda v: human_bytes(v)),
}


_NOTES = {  # column shown -> what it means
    "exact": "- **exact**: tokens, logits and every rank's KV cache match the single-rank reference "
    "(`verify=true`; blank when not checked).",
    "tokens_per_s": "- **tokens/s, TTFT, TPOT**: on the run clock (pipeline + scheduler time, verification "
    "excluded); means over requests.",
    "output_tok_s_per_gpu": "- **out tok/s/GPU**: output tokens per second per GPU over the requests' span (first "
    "arrival to last finish); **goodput**: requests per second meeting every SLO (`slo.ttft_s`, `slo.tpot_s`); "
    "**KV use**: the time-weighted share of KV blocks in use; **prefix hits**: cached prompt tokens / prompt tokens; "
    "**preempted**: running requests preempted for blocks (docs/serving.md).",
    "transfer_bytes": "- **handed over**, **transfer ms**: `disagg=pd`'s KV moved from the prefill pool to the decode "
    "pool and the time requests waited for it; **prefill / decode busy**: each pool's share of the run clock spent "
    "running a step (docs/disaggregation.md).",
    "tokens_max_over_mean": "- **balance**: max/mean over PCP ranks of the run's tokens and attention (query, key) "
    "pairs; 1.000 is perfect. **padding**: padded rows / all rows.",
    "framework_overhead_fraction": "- **overhead**: framework stages (validate, plan, buffers, slots) / all stage time.",
    "bytes_tp": "- **bytes**: per collective purpose, what every rank received from the others, summed over "
    "ranks (pcpflow.parallel.comm), and the number of calls; with tp > 1 **TP bytes** (the `tp_all_reduce`s) beside "
    "**PCP/DCP bytes** (everything else).",
}

EXECUTED_TIMES = (
    "- **What the times mean here**: these jobs ran on this machine's CPU cores with a tiny model, "
    "so their seconds rank how pcpflow's ranks share those cores, not what the layouts cost on GPUs. "
    "The counts (tokens, balance, bytes, calls) are the layout's own at any scale. For GPU prices run "
    "the same sweep with `mode=simulate model=<card> hardware=<gpu>` (docs/simulate.md)."
)
SIMULATED_TIMES = (
    "- **tokens/s, TTFT, TPOT**: simulated: every step priced on the hardware profile "
    "(docs/simulate.md); means over requests."
)


def _notes(rows: list[dict[str, Any]], shown: list[str], purposes: list[str]) -> list[str]:
    simulated = all(r.get("mode") == "simulate" for r in rows)
    notes = [text for column, text in _NOTES.items()
             if (column in shown or (column == "bytes_tp" and purposes))
             and not (simulated and column == "tokens_per_s")]
    if simulated:
        notes.insert(0, SIMULATED_TIMES)
    elif any(r.get("mode") == "execute" for r in rows):
        notes.append(EXECUTED_TIMES)
    return notes


def _shown(rows: list[dict[str, Any]]) -> list[str]:
    """The columns sweep.md shows: those with a value; the serving ones where they say
    something (throughput per GPU and KV use for simulated sweeps, hits and preemptions
    where any happened)."""
    simulated = all(r.get("mode") == "simulate" for r in rows)
    shown = []
    for c in _HEADERS:
        values = [r.get(c) for r in rows if r.get(c) is not None]
        if not values:
            continue
        if c in ("output_tok_s_per_gpu", "kv_usage_mean", "ttft_p99_ms", "tpot_p99_ms") and not simulated:
            continue
        if c in ("prefix_hit_rate", "preemptions") and not any(values):
            continue
        shown.append(c)
    return shown


def _markdown(rows: list[dict[str, Any]], purposes: list[str]) -> str:
    shown = _shown(rows)
    header = [_HEADERS[c][0] for c in shown] + [f"{p} (calls)" for p in purposes]
    if purposes:
        header.append("bytes total")
    lines = ["# pcpflow sweep", ""]
    common = _common_overrides(rows)
    if common:
        lines += [f"Every job: `{' '.join(common)}`.", ""]
    fixed = rows[0].get("fixed_settings") if rows else None
    if fixed:
        lines += [f"Fixed in every job: `{' '.join(fixed)}`.", ""]
    lines += [
        "| " + " | ".join(header) + " |",
        "|"
        + "|".join("---" if c in ("config", "status", "exact") else "--:" for c in shown)
        + "|--:" * (len(purposes) + bool(purposes))
        + "|",
    ]
    for r in rows:
        cells = ["" if r.get(c) is None else _HEADERS[c][1](r[c]) for c in shown]
        cells += [
            f"{human_bytes(r[f'bytes_{p}'])} ({r.get(f'calls_{p}', '?')})"
            if r.get(f"bytes_{p}") is not None
            else "—"
            for p in purposes
        ]
        if purposes:
            cells.append(human_bytes(r["bytes_total"]) if r.get("bytes_total") is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_notes(rows, shown, purposes)]
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "## Failures", ""] + [f"- `{r['config']}`: {r['error']}" for r in failed]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- sweep.png
def _plot(rows: list[dict[str, Any]], purposes: list[str], path: Path) -> dict[str, Any]:
    """Writes sweep.png; returns what it drew that a reader relies on (title, the value
    labels of each panel, the balance axis) so that tests can check it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [
        ("✗ " if r.get("exact") is False or r["status"] != "ok" else "") + r["config"] for r in rows
    ]
    ok = np.array([r["status"] == "ok" for r in rows])
    y = np.arange(len(rows))

    def val(key: str) -> np.ndarray:
        return np.array(
            [r.get(key) if r.get(key) is not None else np.nan for r in rows], dtype=float
        )

    fig, axes = plt.subplots(1, 4, figsize=(17, 0.42 * len(rows) + 2.4), sharey=True)

    def bars(ax, series, title, fmt, unit_line=None):
        h = 0.8 / len(series)
        for i, (key, name, color) in enumerate(series):
            v = val(key)
            off = (i - (len(series) - 1) / 2) * h
            ax.barh(
                y + off,
                np.nan_to_num(v),
                height=h,
                color=color,
                label=name if len(series) > 1 else None,
            )
            ax.barh(
                (y + off)[~ok],
                np.nan_to_num(v)[~ok],
                height=h,
                color="none",
                edgecolor="tab:red",
                hatch="//",
            )
            for yi, vi in zip(y + off, v):
                if np.isfinite(vi):
                    ax.annotate(f" {vi:{fmt}}", (vi, yi), va="center", fontsize=7)
        top = np.nanmax([np.nanmax(np.r_[val(k), 0.0]) for k, _, _ in series])
        ax.set_xlim(0.0, max(top * 1.22, unit_line or 0.0, 1e-9))
        if unit_line is not None:
            ax.axvline(unit_line, color="grey", lw=0.8, ls="--")
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
        if len(series) > 1:
            _legend_below(ax, len(series))

    bars(axes[0], [("tokens_per_s", "tokens/s", "tab:blue")], "tokens/s (run clock)", ".0f")
    bars(
        axes[1],
        [("ttft_mean_ms", "TTFT", "tab:purple"), ("tpot_mean_ms", "TPOT", "tab:olive")],
        "mean TTFT / TPOT (ms)",
        ".1f",
    )
    bars(
        axes[2],
        [
            ("tokens_max_over_mean", "tokens", "tab:green"),
            ("attention_work_max_over_mean", "attention work", "tab:orange"),
        ],
        "balance: max/mean over ranks (1 = even)",
        ".3f",
        unit_line=1.0,
    )
    left = np.zeros(len(rows))
    cmap = plt.get_cmap("tab10")
    for i, purpose in enumerate(purposes):
        v = np.nan_to_num(val(f"bytes_{purpose}")) / 2**20
        axes[3].barh(y, v, left=left, color=cmap(i), label=purpose)
        left += v
    axes[3].set_title("MiB moved, by collective purpose", fontsize=10)
    axes[3].grid(axis="x", alpha=0.3)
    for yi, total in zip(y, left):
        if total:
            axes[3].annotate(f" {total:.2f}", (total, yi), va="center", fontsize=7)
    axes[3].set_xlim(right=max(left.max(initial=0.0) * 1.18, 1e-3))
    if purposes:
        _legend_below(axes[3], len(purposes))
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    common = _common_overrides(rows)
    fixed = rows[0].get("fixed_settings") or []
    fig.suptitle(
        "pcpflow sweep"
        + (f"  ({' '.join(common)})" if common else "")
        + "   ✗ / hatched: failed or not exact"
        + (f"\nfixed in every job: {' '.join(fixed)}" if fixed else ""),
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    drawn = {
        "title": fig._suptitle.get_text(),
        "value_labels": [[t.get_text().strip() for t in ax.texts] for ax in axes],
        "balance_xlim": axes[2].get_xlim(),
    }
    plt.close(fig)
    return drawn


def _legend_below(ax, n: int) -> None:
    ax.legend(
        fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.06), ncol=min(n, 3), frameon=False
    )


# ------------------------------------------------------------------------------ helpers
def _read_result(path: Path) -> dict[str, Any]:
    """A job's result.json; one that cannot be read (truncated by a crash or a full disk)
    becomes a failed row naming the file, and the other jobs are still reported."""
    try:
        result = json.loads(path.read_text())
        if isinstance(result, dict):
            return result
        problem = f"not a JSON object ({type(result).__name__})"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"unreadable ({exc})"
    return {"status": "unreadable", "error": f"{path}: {problem}"}


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def _common_overrides(rows: list[dict[str, Any]]) -> list[str]:
    return rows[0]["common_overrides"] if rows else []


def _this_multirun(paths: Any, sweep_dir: Path) -> list[Path]:
    """Of ``paths`` (a file in each job dir), those of the jobs of the sweep dir's latest
    multirun (every one where no multirun wrote its id)."""
    try:
        sweep_id = (sweep_dir / MULTIRUN_ID).read_text()
    except OSError:
        return list(paths)
    out = []
    for path in paths:
        try:
            if (path.parent / MULTIRUN_ID).read_text() == sweep_id:
                out.append(path)
        except OSError:
            pass  # NOTE: no id: a job of none of the multiruns that wrote one
    return out


def _job_order(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def _round(v: Any, n: int) -> Any:
    return round(v, n) if isinstance(v, (int, float)) and not isinstance(v, bool) else v


def _ms(v: Any) -> Any:
    return round(v * 1e3, 2) if isinstance(v, (int, float)) else None


if __name__ == "__main__":
    rows = write_sweep_report(Path(sys.argv[1]))
    sys.exit(0 if rows else 1)
