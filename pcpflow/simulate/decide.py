"""Decision support for sweeps and searches: the objectives (``simulate.objective``, one
vocabulary for both), the Pareto front, and the priced terms that decide an order.

A sweep ranks its jobs by the objective and marks the Pareto front of (TTFT, TPOT, GPUs), all
three lower-is-better; each simulated row gets its priced terms (``<term>_s``: exposed seconds
of ``metrics.simulate.breakdown_s``) and, for the top jobs, the terms that decide their order.
``pcpflow.driver.sweep`` calls ``decide`` on its rows; the objective is the sweep's
``simulate.objective`` (one for the whole sweep). ``pcpflow.search`` ranks layouts by the same
objectives."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Objective:
    """One objective over a layout's measures (``ttft_s``, ``tpot_s``, ``gpus``,
    ``throughput_per_gpu``, ``goodput_per_gpu``): the product of those it ``needs``."""

    needs: tuple[str, ...]
    higher_is_better: bool = False
    needs_slo: bool = False

    def value(self, measures: dict[str, Any]) -> float | None:
        out = 1.0
        for k in self.needs:
            v = measures.get(k)
            if v is None:
                return None
            out *= float(v)
        return out

    def key(self, value: float) -> float:
        """Sorts best first."""
        return -value if self.higher_is_better else value


OBJECTIVES = {
    "ttft": Objective(("ttft_s",)),
    "tpot": Objective(("tpot_s",)),
    "gpus": Objective(("gpus",)),
    "ttft_x_gpus": Objective(("ttft_s", "gpus")),  # GPU-seconds per first token
    "tpot_x_gpus": Objective(("tpot_s", "gpus")),  # GPU-seconds per output token
    "throughput_per_gpu": Objective(("throughput_per_gpu",), higher_is_better=True),  # output tokens/s
    "goodput_per_gpu": Objective(("goodput_per_gpu",), higher_is_better=True, needs_slo=True),  # requests/s
}
FRONT = ("ttft_mean_ms", "tpot_mean_ms", "gpus")
MISSING = {"ttft_s": "TTFT (no request got its first token)",
           "tpot_s": "TPOT (no request generated more than one token: workload.output_len(s))",
           "gpus": "GPU count", "throughput_per_gpu": "output throughput (no token generated)",
           "goodput_per_gpu": "goodput (it needs an SLO: slo.ttft_s, slo.tpot_s)"}
"""Why a job has no value for a measure an objective needs."""


def sweep_measures(row: dict[str, Any]) -> dict[str, Any]:
    """A sweep row's measures: means (ms) as the sweep reports them, goodput at the job's own
    arrivals (a sweep runs each job once; a search searches the rate)."""
    gpus, goodput = row.get("gpus"), row.get("goodput_req_s")
    return {"ttft_s": row.get("ttft_mean_ms"), "tpot_s": row.get("tpot_mean_ms"), "gpus": gpus,
            "throughput_per_gpu": row.get("output_tok_s_per_gpu"),
            "goodput_per_gpu": goodput / gpus if goodput is not None and gpus else None}
COLUMNS = ["gpus", "pareto", "rank"]
TOP = 3  # the top jobs whose order sweep.md explains


def term_columns(rows: list[dict[str, Any]]) -> list[str]:
    """The ``<term>_s`` columns ``decide`` added (gemm, attention, memory_ops, host_launch
    first, then collective purposes by name)."""
    first = ["gemm_s", "attention_s", "memory_ops_s", "host_launch_s"]
    seen = {k for r in rows for k in r.get("_terms", ())}
    return [c for c in first if c in seen] + sorted(seen - set(first))


def pareto_front(points: list[tuple[float, ...]]) -> list[bool]:
    """Which points no other point dominates (<= everywhere, < somewhere)."""
    return [
        not any(all(q_i <= p_i for q_i, p_i in zip(q, p)) and q != p for q in points)
        for p in points
    ]


def decide(rows: list[dict[str, Any]], sweep_dir: Path) -> str:
    """Add ``gpus``, ``pareto`` and ``rank`` to each row; return the markdown section."""
    objective = "ttft"
    for r in rows:
        result = _result(sweep_dir / r["job"])
        cfg = result.get("config") or {}
        sim = (result.get("metrics") or {}).get("simulate") or {}
        # NOTE: every GPU the run priced (replicas, both pools of disagg=pd), else the grid's
        r["gpus"] = sim.get("gpus") or (int(cfg.get("tp", 1)) * int(cfg.get("pcp", 1)) if cfg else None)
        objective = (cfg.get("simulate") or {}).get("objective", objective)
        breakdown = sim.get("breakdown_s") or {}
        r["_terms"] = tuple(f"{t}_s" for t in breakdown)
        for term, v in breakdown.items():
            r[f"{term}_s"] = round(v["exposed_s"], 6)
    ok = [r for r in rows if r.get("status") == "ok" and r.get("gpus")]
    dims = [k for k in FRONT if all(r.get(k) is not None for r in ok)]
    for r, on in zip(ok, pareto_front([tuple(r[k] for k in dims) for r in ok])):
        r["pareto"] = on
    obj = OBJECTIVES[objective]
    ranked = [r for r in ok if obj.value(sweep_measures(r)) is not None]
    key = lambda r: obj.key(obj.value(sweep_measures(r)))  # noqa: E731
    for i, r in enumerate(sorted(ranked, key=key), start=1):
        r["rank"] = i
    better = "higher" if obj.higher_is_better else "lower"
    lines = ["", f"## Ranked by {objective} ({better} is better); Pareto front of {', '.join(dims)}", "",
             "| rank | config | TTFT ms | TPOT ms | GPUs | Pareto |", "|--:|---|--:|--:|--:|:-:|"]
    for r in sorted(ranked, key=key):
        fmt = lambda v: "" if v is None else f"{v:.1f}"  # noqa: E731
        lines.append(f"| {r['rank']} | {r['config']} | {fmt(r.get('ttft_mean_ms'))} | "
                     f"{fmt(r.get('tpot_mean_ms'))} | {r['gpus']} | {'yes' if r.get('pareto') else ''} |")
    lines += ["", "- **Pareto**: no other job is at least as good in every one of those and better in one."]
    unranked = [r for r in ok if r not in ranked]
    if unranked:
        missing = [k for k in obj.needs if any(sweep_measures(r).get(k) is None for r in unranked)]
        lines.append(f"- **Not ranked**: {len(unranked)} job(s) ({', '.join(r['config'] for r in unranked[:3])}"
                     f"{', ...' if len(unranked) > 3 else ''}) have no {', no '.join(MISSING[k] for k in missing)}.")
    lines += _deciding_terms(sorted(ranked, key=key)[:TOP])
    return "\n".join(lines) + "\n"


def _deciding_terms(top: list[dict[str, Any]]) -> list[str]:
    """For each pair of neighbours among the top jobs, the priced terms whose exposed
    seconds differ the most between them (summed over each run's steps)."""
    terms = term_columns(top)
    if len(top) < 2 or not terms:
        return []
    out = ["", f"## What decides the order of the top {len(top)}", "",
           "Exposed seconds of each priced term (metrics.simulate.breakdown_s), summed over the run's steps; "
           "the terms that differ the most between neighbours:", ""]
    for a, b in zip(top, top[1:]):
        big = term_differences(a, b, terms)
        cells = ", ".join(f"{t.removesuffix('_s')} {d * 1e3:+.1f} ms" for d, t in big if d)
        out.append(f"- #{a['rank']} `{a['config']}` before #{b['rank']} `{b['config']}`: "
                   f"#{b['rank']} spends {cells or 'the same in every term'}")
    return out


def term_differences(a: dict[str, Any], b: dict[str, Any], terms: list[str], n: int = 3) -> list[tuple[float, str]]:
    """The ``n`` terms whose seconds differ the most from ``a`` to ``b`` (b - a, largest
    magnitude first; ties by name)."""
    diff = sorted(((b.get(t) or 0.0) - (a.get(t) or 0.0), t) for t in terms)
    return sorted(diff, key=lambda d: -abs(d[0]))[:n]


def _result(job_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((job_dir / "result.json").read_text())
    except (OSError, ValueError):
        return {}
