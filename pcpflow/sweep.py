"""The sweep report: a Hydra callback that, after a multirun, reads every job's
``result.json`` and writes ``sweep.csv`` (a row per job), ``sweep.md`` (the table a person
reads) and ``sweep.png`` (the same comparison as a picture) in the sweep dir.

Also usable on any directory of finished runs: ``python -m pcpflow.sweep DIR``.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

BASE_COLUMNS = [
    "job",
    "overrides",
    "status",
    "tokens_match",
    "kv_match",
    "max_abs_logit_diff",
    "num_steps",
    "num_tokens",
    "tokens_per_s",
    "ttft_mean_ms",
    "tpot_mean_ms",
    "tokens_max_over_mean",
    "attention_work_max_over_mean",
    "framework_overhead_fraction",
    "acceptance_rate",
    "wall_s",
]


class SweepReport(Callback):
    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        write_sweep_report(Path(str(config.hydra.sweep.dir)))


def collect_rows(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for result_path in sorted(sweep_dir.glob("*/result.json"), key=_job_order):
        result = json.loads(result_path.read_text())
        job_dir = result_path.parent
        overrides = _overrides(job_dir)
        m, v = result.get("metrics") or {}, result.get("verify") or {}
        row: dict[str, Any] = {
            "job": job_dir.name,
            "overrides": " ".join(overrides),
            "status": result.get("status"),
            "tokens_match": v.get("tokens_match"),
            "kv_match": v.get("kv_match"),
            "max_abs_logit_diff": v.get("max_abs_logit_diff"),
            "num_steps": m.get("num_steps"),
            "num_tokens": m.get("num_tokens"),
            "tokens_per_s": _round(m.get("tokens_per_s"), 1),
            "ttft_mean_ms": _ms((m.get("ttft") or {}).get("mean_s")),
            "tpot_mean_ms": _ms((m.get("tpot") or {}).get("mean_s")),
            "tokens_max_over_mean": _round((m.get("balance") or {}).get("tokens_max_over_mean"), 4),
            "attention_work_max_over_mean": _round((m.get("balance") or {}).get("attention_work_max_over_mean"), 4),
            "framework_overhead_fraction": _round(m.get("framework_overhead_fraction"), 4),
            "acceptance_rate": _round(m.get("acceptance_rate"), 4),
            "wall_s": _round(m.get("wall_s"), 2),
        }
        for purpose, nbytes in (m.get("collective_bytes") or {}).items():
            row[f"bytes_{purpose}"] = nbytes
        if result.get("status") != "ok" and result.get("error"):
            row["error"] = str(result["error"]).splitlines()[0][:200]
        rows.append(row)
    return rows


def write_sweep_report(sweep_dir: Path) -> list[dict[str, Any]]:
    rows = collect_rows(sweep_dir)
    if not rows:
        return rows
    extra = sorted({k for r in rows for k in r} - set(BASE_COLUMNS))
    columns = BASE_COLUMNS + extra
    with open(sweep_dir / "sweep.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        for r in rows:
            writer.writerow({k: r.get(k) for k in columns})
    (sweep_dir / "sweep.md").write_text(_markdown(rows, columns))
    _plot(rows, sweep_dir / "sweep.png")
    print(f"pcpflow: sweep report of {len(rows)} job(s): {sweep_dir / 'sweep.md'}", file=sys.stderr)
    return rows


def _markdown(rows: list[dict[str, Any]], columns: list[str]) -> str:
    shown = [c for c in columns if c != "job" and any(r.get(c) is not None for r in rows)]
    header = {
        "overrides": "config",
        "max_abs_logit_diff": "max |Δlogit|",
        "tokens_per_s": "tokens/s",
        "ttft_mean_ms": "TTFT ms",
        "tpot_mean_ms": "TPOT ms",
        "tokens_max_over_mean": "token balance",
        "attention_work_max_over_mean": "attn balance",
        "framework_overhead_fraction": "overhead",
        "num_steps": "steps",
        "num_tokens": "tokens",
    }
    lines = [
        "# pcpflow sweep",
        "",
        "Balance is max/mean over ranks (1.0 = perfect); bytes are summed over ranks "
        "(what each rank received from the others).",
        "",
        "| " + " | ".join(header.get(c, c.replace("bytes_", "bytes ")) for c in shown) + " |",
        "|" + "---|" * len(shown),
    ]
    for r in rows:
        lines.append("| " + " | ".join(_cell(r.get(c)) for c in shown) + " |")
    return "\n".join(lines) + "\n"


def _cell(v: Any) -> str:
    if v is None:
        return ""
    if isinstance(v, bool):
        return "yes" if v else "**NO**"
    if isinstance(v, float):
        return f"{v:.2e}" if (v and abs(v) < 1e-3) else f"{v:g}"
    return str(v)


def _plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [r["overrides"] or r["job"] for r in rows]
    panels = [
        ("tokens_per_s", "tokens/s (run clock)"),
        ("attention_work_max_over_mean", "attention work max/mean"),
        ("ttft_mean_ms", "mean TTFT (ms)"),
    ]
    purposes = sorted({k for r in rows for k in r if k.startswith("bytes_")})
    fig, axes = plt.subplots(1, 4, figsize=(16, 0.45 * len(rows) + 2.2), sharey=True)
    y = np.arange(len(rows))
    for ax, (key, title) in zip(axes, panels):
        vals = [r.get(key) or 0 for r in rows]
        colors = ["tab:blue" if r["status"] == "ok" else "tab:red" for r in rows]
        ax.barh(y, vals, color=colors)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="x", alpha=0.3)
    left = np.zeros(len(rows))
    for purpose in purposes:
        vals = np.array([(r.get(purpose) or 0) / 2**20 for r in rows], dtype=float)
        axes[3].barh(y, vals, left=left, label=purpose.removeprefix("bytes_"))
        left += vals
    axes[3].set_title("MiB moved per collective purpose", fontsize=10)
    if purposes:
        axes[3].legend(fontsize=7)
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    fig.suptitle("pcpflow sweep (red: failed run)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _overrides(job_dir: Path) -> list[str]:
    path = job_dir / ".hydra" / "overrides.yaml"
    if not path.exists():
        return []
    from omegaconf import OmegaConf

    return [str(o) for o in OmegaConf.load(path)]


def _job_order(path: Path) -> tuple[int, str]:
    name = path.parent.name
    return (int(name), name) if name.isdigit() else (1 << 30, name)


def _round(v: Any, n: int) -> Any:
    return round(v, n) if isinstance(v, (int, float)) else v


def _ms(v: Any) -> Any:
    return round(v * 1e3, 2) if isinstance(v, (int, float)) else None


if __name__ == "__main__":
    rows = write_sweep_report(Path(sys.argv[1]))
    sys.exit(0 if rows else 1)
