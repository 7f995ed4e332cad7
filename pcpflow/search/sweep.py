"""The sweep report of a multirun of searches (``python -m pcpflow -m mode=search
search.gpus=8,16``): a row per job with what it recommends and its measures, in
``sweep.csv`` and ``sweep.md`` (``pcpflow.driver.sweep`` hands search sweeps here: a search's
result holds no run of its own, only its recommendation)."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

COLUMNS = ["job", "config", "status", "objective", "recommended", "gpus", "ttft_p90_ms", "tpot_p90_ms",
           "throughput_per_gpu", "goodput_per_gpu", "objective_value", "runner_up", "space", "pruned",
           "priced_in_full", "error"]
HEADERS = {"config": "config", "status": "status", "objective": "objective", "recommended": "recommended",
           "gpus": "GPUs", "ttft_p90_ms": "TTFT p90 ms", "tpot_p90_ms": "TPOT p90 ms",
           "throughput_per_gpu": "tok/s/GPU", "goodput_per_gpu": "goodput req/s/GPU",
           "objective_value": "objective value", "space": "layouts", "pruned": "pruned",
           "priced_in_full": "priced in full"}


def search_row(row: dict[str, Any], summary: dict[str, Any] | None) -> dict[str, Any]:
    """A sweep row (``pcpflow.driver.sweep.collect_rows``) with its search's recommendation."""
    s = summary or {}
    rec = s.get("recommended") or {}
    out = {k: row.get(k) for k in ("job", "config", "status", "error")}
    out.update(objective=s.get("objective"), recommended=rec.get("layout"), gpus=rec.get("gpus"),
               ttft_p90_ms=_ms(rec.get("ttft_p90_s")), tpot_p90_ms=_ms(rec.get("tpot_p90_s")),
               throughput_per_gpu=_round(rec.get("throughput_per_gpu")),
               goodput_per_gpu=_round(rec.get("goodput_per_gpu")), objective_value=rec.get("objective_value"),
               runner_up=(s.get("runner_up") or {}).get("layout"), space=s.get("space"), pruned=s.get("pruned"),
               priced_in_full=s.get("priced_in_full"))
    return out


def write_search_sweep(rows: list[dict[str, Any]], sweep_dir: Path) -> None:
    """sweep.csv and sweep.md of ``rows`` (``search_row``)."""
    with open(sweep_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in COLUMNS})
    shown = [c for c in HEADERS if any(r.get(c) is not None for r in rows)]
    lines = ["# pcpflow sweep of searches", "",
             "Each job's recommended layout and its measures (its run dir's search.md says why).", "",
             "| " + " | ".join(HEADERS[c] for c in shown) + " |",
             "|" + "|".join("---" if c in ("config", "status", "objective", "recommended") else "--:"
                            for c in shown) + "|"]
    for r in rows:
        cells = [_cell(c, r.get(c)) for c in shown]
        lines.append("| " + " | ".join(cells) + " |")
    failed = [r for r in rows if r.get("error")]
    if failed:
        lines += ["", "## Failures", ""] + [f"- `{r['config']}`: {r['error']}" for r in failed]
    (sweep_dir / "sweep.md").write_text("\n".join(lines) + "\n")


def _cell(column: str, v: Any) -> str:
    if v is None:
        return ""
    if column == "recommended":
        return f"`{v}`"
    return f"{v:.6g}" if isinstance(v, float) else str(v)


def _ms(v: Any) -> Any:
    return round(v * 1e3, 3) if isinstance(v, (int, float)) else None


def _round(v: Any) -> Any:
    return round(v, 4) if isinstance(v, (int, float)) else None
