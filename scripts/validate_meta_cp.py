"""Simulated TTFT against the ten published figures of Meta's context-parallel inference
paper (arXiv 2411.01783; ../shared/published/meta-cp-inference.md): Llama3-405B, FP8
weights, TP8 per node, CP across nodes (pcp = dcp = nodes), one request, full prefill.

Two figures fit the two efficiency factors (``FITTED``); the other eight are predictions::

    python scripts/validate_meta_cp.py          # the side-by-side table
    python scripts/validate_meta_cp.py --fit    # re-derive the two efficiencies
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

# (CP nodes, context tokens, published TTFT ms, where in the paper)
PUBLISHED = [
    (1, 8_192, 1_740, "Table 6"),
    (1, 32_768, 7_658, "Table 6"),
    (1, 131_072, 42_010, "Table 6"),
    (2, 8_192, 999, "Table 6"),
    (2, 32_768, 4_015, "Table 6"),
    (2, 131_072, 21_042, "Table 6"),
    (4, 131_072, 10_950, "Table 7"),
    (8, 131_072, 5_850, "Section 4 text"),
    (16, 131_072, 3_800, "abstract"),
    (16, 1_048_576, 77_000, "abstract"),
]
FITTED = {(1, 8_192): "gemm_efficiency", (1, 131_072): "attention_efficiency"}
"""The figures the efficiencies are fitted on: 8K on one node is GEMM-bound, 128K on one
node spends most of its time in attention; neither has inter-node communication."""
TOLERANCE = 0.15


def overrides(nodes: int, context: int, extra=()) -> list[str]:
    return [
        "mode=simulate", "model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8",
        "tp=8", f"pcp={nodes}", f"dcp={nodes}", "workload=explicit",
        f"workload.prompt_lens=[{context}]", "workload.output_lens=[1]",
        "pipeline.restore.kind=sampled_rows",  # Meta samples the last token only
        "output.plots=false", "output.progress=false", *extra,
    ]


def simulate(nodes: int, context: int, extra=()) -> dict:
    from pcpflow.simulate.engine import simulate_run
    from pcpflow.testing import compose

    return simulate_run(compose(overrides(nodes, context, extra)))["metrics"]


def table(extra=()) -> list[dict]:
    rows = []
    for nodes, context, ms, where in PUBLISHED:
        sim_ms = simulate(nodes, context, extra)["ttft"]["mean_s"] * 1e3
        rows.append({
            "nodes": nodes, "gpus": 8 * nodes, "context": context, "published_ms": ms,
            "simulated_ms": sim_ms, "error": sim_ms / ms - 1, "where": where,
            "role": FITTED.get((nodes, context), "predicted"),
        })
    return rows


def fit() -> dict[str, float]:
    """The two efficiencies that reproduce the FITTED figures exactly: TTFT is
    ``gemm/e_g + attention/e_a + rest`` for these GEMM- and attention-bound runs."""
    a, b = [], []
    for (nodes, context), _ in FITTED.items():
        m = simulate(nodes, context, ["simulate.gemm_efficiency=1", "simulate.attention_efficiency=1"])
        s = m["simulate"]["purpose_s"]
        ms = next(p[2] for p in PUBLISHED if p[:2] == (nodes, context))
        rest = m["ttft"]["mean_s"] - s["gemm"] - s["attention"]
        a.append([s["gemm"], s["attention"]])
        b.append(ms / 1e3 - rest)
    inv = np.linalg.solve(np.asarray(a), np.asarray(b))
    return {"gemm_efficiency": float(1 / inv[0]), "attention_efficiency": float(1 / inv[1])}


def markdown(rows: list[dict]) -> str:
    out = ["| CP nodes x TP8 | GPUs | context | published ms | simulated ms | error | role |",
           "|---|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['nodes']} | {r['gpus']} | {r['context']:,} | {r['published_ms']:,} | "
                   f"{r['simulated_ms']:,.0f} | {r['error']:+.1%} | {r['role']} ({r['where']}) |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fit", action="store_true", help="re-derive the two efficiencies and print them")
    args = ap.parse_args(argv)
    if args.fit:
        for k, v in fit().items():
            print(f"simulate.{k}={v:.4f}")
        return 0
    rows = table()
    print(markdown(rows))
    bad = [r for r in rows if r["role"] == "predicted" and abs(r["error"]) > TOLERANCE]
    print(f"\n{len(rows) - len(FITTED) - len(bad)}/{len(rows) - len(FITTED)} predictions within {TOLERANCE:.0%}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
