"""``serving.png``: how a run served its requests. Over time: the share of KV blocks in use,
and the requests running and waiting (each replica its own line); and the distributions of
TTFT and TPOT (empirical CDFs, with p50 / p99 marked, and the SLO with the share that meets it
where the run has one: ``slo.ttft_s``, ``slo.tpot_s``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

import numpy as np


def _result(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "result.json").read_text()) if (run_dir / "result.json").exists() else {}


def _latencies(run_dir: Path, result: dict[str, Any]) -> dict[str, np.ndarray]:
    """Each request's TTFT and TPOT (s): from result.json's rows, else requests.csv."""
    rows = result.get("requests")
    if rows:
        return {k: np.array([r[k] for r in rows if r.get(k) is not None], dtype=float) for k in ("ttft_s", "tpot_s")}
    path = run_dir / (result.get("requests_file") or "requests.csv")
    if not path.exists():
        return {"ttft_s": np.zeros(0), "tpot_s": np.zeros(0)}
    with open(path) as f:
        header = next(csv.reader(f))
    data = np.loadtxt(path, delimiter=",", skiprows=1, ndmin=2)
    out = {k: data[:, header.index(k)] for k in ("ttft_s", "tpot_s")}
    return {k: v[~np.isnan(v)] for k, v in out.items()}


def write_serving_plot(run_dir: Path) -> dict[str, Any] | None:
    """Writes serving.png; returns what it drew (series per replica, quantiles) for tests."""
    run_dir = Path(run_dir)
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return None
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    records = [r for r in records if "kv_usage" in r]
    if not records:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    replica = np.array([r.get("replica", 0) for r in records])
    t = np.array([r["time_s"] for r in records], dtype=float)
    usage = np.array([r["kv_usage"] for r in records], dtype=float)
    running = np.array([r["num_running"] for r in records], dtype=float)
    waiting = np.array([r["num_waiting"] for r in records], dtype=float)
    result = _result(run_dir)
    lat = _latencies(run_dir, result)
    slo = ((result.get("metrics") or {}).get("goodput") or {}).get("slo") or {}
    fig, axes = plt.subplots(2, 2, figsize=(12, 7))
    drawn: dict[str, Any] = {"replicas": sorted(set(replica.tolist())), "quantiles": {}}
    for r in drawn["replicas"]:
        m = replica == r
        name = f" (replica {r})" if len(drawn["replicas"]) > 1 else ""
        axes[0, 0].step(t[m], 100 * usage[m], where="post", lw=1, label=f"KV blocks in use{name}")
        axes[0, 1].step(t[m], running[m], where="post", lw=1, label=f"running{name}")
        axes[0, 1].step(t[m], waiting[m], where="post", lw=1, ls="--", label=f"waiting{name}")
    axes[0, 0].set_ylabel("% of KV blocks in use")
    axes[0, 0].set_ylim(0, 105)
    axes[0, 1].set_ylabel("requests")
    for ax in axes[0]:
        ax.set_xlabel("run clock, s (steps only; simulated runs: the priced time)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax, key, label in ((axes[1, 0], "ttft_s", "TTFT"), (axes[1, 1], "tpot_s", "TPOT")):
        v = np.sort(lat[key])
        if len(v):
            ax.plot(v, np.arange(1, len(v) + 1) / len(v), lw=1.2)
            p50, p99 = np.percentile(v, [50, 99])
            for q, value in (("p50", p50), ("p99", p99)):
                ax.axvline(value, color="grey", lw=0.8, ls="--")
                ax.annotate(f" {q} {value:.3g} s", (value, 0.05 if q == "p50" else 0.15), fontsize=7)
            drawn["quantiles"][key] = (float(p50), float(p99))
            if slo.get(key) is not None:
                meets = float(np.searchsorted(v, slo[key], side="right") / len(v))
                ax.axvline(slo[key], color="tab:red", lw=1)
                ax.annotate(f" SLO {slo[key]:.3g} s: {meets:.0%} meet it", (slo[key], 0.9), fontsize=7, color="tab:red")
                drawn.setdefault("slo", {})[key] = (float(slo[key]), meets)
        ax.set_xlabel(f"{label}, s")
        ax.set_ylabel("share of requests at or below")
        ax.grid(alpha=0.3)
    fig.suptitle(f"serving: {len(records)} steps, {len(lat['ttft_s'])} requests with a first token", fontsize=10)
    fig.tight_layout()
    fig.savefig(run_dir / "serving.png", dpi=110)
    plt.close(fig)
    return drawn
