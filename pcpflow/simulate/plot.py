"""``load.png`` of a simulated run: compute, memory and communication time per rank."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

PARTS = (("per_rank_compute_s", "compute (FLOP-bound)"), ("per_rank_memory_s", "memory (HBM-bound)"),
         ("per_rank_communication_s", "communication (not hidden)"))


def write_load_plot(run_dir: Path) -> None:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not records:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals = {k: np.sum([r[k] for r in records], axis=0) for k, _ in PARTS}
    ranks = np.arange(len(totals[PARTS[0][0]]))
    fig, ax = plt.subplots(figsize=(max(5, 0.5 * len(ranks) + 3), 4))
    bottom = np.zeros(len(ranks))
    for key, label in PARTS:
        ax.bar(ranks, totals[key], bottom=bottom, label=label)
        bottom += totals[key]
    ax.set_xlabel("PCP rank (its TP ranks cost the same)")
    ax.set_ylabel("simulated seconds, all steps")
    ax.set_title(f"simulated time per rank over {len(records)} steps (a step lasts as long as its slowest rank)")
    ax.set_xticks(ranks)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(Path(run_dir) / "load.png", dpi=110)
    plt.close(fig)
