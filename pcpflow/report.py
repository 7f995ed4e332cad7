"""What a person sees: the progress bar, the summary table, the plots.

The progress bar lives in the driver and follows ``metrics.jsonl`` (rank 0 appends a
line per step), so rank processes never draw on the console.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.progress import Progress as _RichProgress
from rich.table import Table

_console = Console(stderr=True)


class Progress:
    """Context manager: a bar of generated tokens while the ranks run (TTY only)."""

    def __init__(self, metrics_path: Path, enabled: bool = True) -> None:
        self.path = metrics_path
        self.enabled = enabled and _console.is_terminal
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Progress:
        if self.enabled:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)

    def _run(self) -> None:
        columns = (
            TextColumn("[bold]pcpflow[/] step {task.fields[step]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tokens"),
            TimeElapsedColumn(),
        )
        with _RichProgress(*columns, console=_console, transient=True) as bar:
            task = bar.add_task("run", total=None, step=0)
            offset = 0
            while not self._stop.wait(0.2):
                if not self.path.exists():
                    continue
                with open(self.path) as f:
                    f.seek(offset)
                    lines = f.readlines()
                    offset = f.tell()
                for line in lines:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    bar.update(task, completed=rec["num_generated"], total=rec["num_to_generate"], step=rec["step"])


def print_summary(result: dict[str, Any]) -> None:
    cfg, m = result["config"], result.get("metrics", {})
    console = Console()
    title = (
        f"pcpflow  pcp={cfg['pcp']} dcp={cfg['dcp']} decode={cfg['decode']['mode']}"
        f"/{cfg['decode']['assignment']}  model={cfg['model']['name']}  {cfg['dtype']}"
    )
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("metric", style="bold")
    table.add_column("value")
    status = result["status"]
    table.add_row("status", f"[green]{status}[/]" if status == "ok" else f"[red]{status}[/]")
    if result.get("verification"):  # mode=simulate
        table.add_row("verification", str(result["verification"]))
    sim = m.get("simulate") if m else None
    if sim:
        table.add_row(
            "simulated on",
            f"{sim['hardware']} · {sim['gpus']} GPUs ({sim['nodes']} nodes) · tp={cfg['tp']} · weights {sim['weights_dtype']}"
            f" · overlap {sim['overlap']} · {sim['tflops_per_gpu']:.0f} TF/s per GPU",
        )
    v = result.get("verify")
    if v:
        table.add_row(
            "exact vs 1 rank",
            f"tokens {'match' if v['tokens_match'] else 'DIFFER'} · KV {'match' if v['kv_match'] else 'DIFFERS'} · "
            f"max |Δlogit| {v['max_abs_logit_diff']:.2e} (tol {v['tolerance']:.0e})"
            + (f" · {len(v['near_ties'])} near-tie(s)" if v["near_ties"] else ""),
        )
    if m:
        table.add_row("steps / tokens", f"{m['num_steps']} steps · {m['num_tokens']} tokens · {m['num_generated_tokens']} generated")
        table.add_row("throughput", f"{m['tokens_per_s']:.0f} tokens/s (run clock {m['run_s']:.2f}s, wall {m['wall_s']:.2f}s)")
        ttft, tpot = m["ttft"], m["tpot"]
        if ttft["mean_s"] is not None:
            table.add_row("TTFT", f"mean {ttft['mean_s'] * 1e3:.1f} ms · p90 {ttft['p90_s'] * 1e3:.1f} ms · {ttft['mean_steps']:.1f} steps")
        if tpot["mean_s"] is not None:
            table.add_row("TPOT", f"mean {tpot['mean_s'] * 1e3:.1f} ms · {tpot['mean_steps']:.2f} steps")
        b = m["balance"]
        table.add_row(
            "balance (max/mean)",
            f"tokens {b['tokens_max_over_mean']:.3f} · attention work {b['attention_work_max_over_mean']:.3f} · "
            f"padding {b['padding_fraction']:.1%}",
        )
        if m["collective_bytes"]:
            table.add_row(
                "collective bytes",
                " · ".join(f"{k} {_human(v)} ({m['collective_calls'][k]} calls)" for k, v in m["collective_bytes"].items()),
            )
        table.add_row("framework overhead", f"{m['framework_overhead_s'] * 1e3:.1f} ms ({m['framework_overhead_fraction']:.1%} of stage time)")
        if "acceptance_rate" in m:
            table.add_row(
                "speculative",
                f"acceptance {m['acceptance_rate']:.1%} · {m['mean_accepted_per_step']:.2f} accepted/step · "
                f"draft {m['draft_time_fraction']:.1%} of step time",
            )
    for label, shown in first_outputs(result):
        table.add_row(label, shown)
    table.add_row("results", str(Path(result["run_dir"]) / "result.json"))
    console.print(table)


# --- text out
SHOWN_OUTPUTS = 3
SHOWN_CHARS = 200


def first_outputs(result: dict[str, Any]) -> list[tuple[str, str]]:
    """(label, shown) rows for the first requests' outputs: their text where the
    checkpoint has a tokenizer, else their token ids, cut to one readable line."""
    from rich.markup import escape

    texts, outputs = result.get("texts"), result.get("outputs") or []
    rows = []
    for i, ids in enumerate(outputs[:SHOWN_OUTPUTS]):
        shown = repr(texts[i]) if texts is not None else str(ids)
        if len(shown) > SHOWN_CHARS:
            shown = shown[: SHOWN_CHARS - 3] + "..."
        rows.append((f"output {i}", escape(f"{shown} ({len(ids)} tokens)")))
    if len(outputs) > SHOWN_OUTPUTS:
        rows.append(("", f"... {len(outputs) - SHOWN_OUTPUTS} more in result.json"))
    return rows
# --- end text out


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def write_plots(run_dir: Path) -> None:
    """``load.png``: tokens and attention work per rank over the steps, and how uneven
    each step is (max/mean over ranks; ranks that overlap in the first two panels are
    even)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    steps = np.array([r["step"] for r in records])
    tokens = np.array([r["per_rank_tokens"] for r in records], dtype=float)
    work = np.array([r["per_rank_attention_work"] for r in records], dtype=float)
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True, height_ratios=(3, 3, 2))
    for ax, data, label in ((axes[0], tokens, "tokens"), (axes[1], work, "attention work (q·k pairs)")):
        for rank in range(data.shape[1]):
            ax.plot(steps, data[:, rank], lw=1.2, label=f"rank {rank}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(ncol=min(8, tokens.shape[1]), fontsize=8)
    for data, label, color in ((tokens, "tokens", "tab:green"), (work, "attention work", "tab:orange")):
        mean = data.mean(axis=1)
        ratio = np.divide(data.max(axis=1), mean, out=np.ones_like(mean), where=mean > 0)
        axes[2].plot(steps, ratio, lw=1.2, color=color, label=label)
    axes[2].axhline(1.0, color="grey", lw=0.8, ls="--")
    axes[2].set_ylabel("max/mean over ranks")
    axes[2].legend(fontsize=8)
    axes[2].grid(alpha=0.3)
    axes[2].set_xlabel("step")
    fig.suptitle("per-rank load per step")
    fig.tight_layout()
    fig.savefig(run_dir / "load.png", dpi=110)
    plt.close(fig)
