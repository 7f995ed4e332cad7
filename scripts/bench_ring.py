"""Ring attention (pass-KV, pass-Q, Meta's rule) against the all-gather paths, on CPU ranks
(gloo), at a few lengths: wall time and bytes side by side in one run.

    python scripts/bench_ring.py [--pcp 2] [--lengths 1024 4096] [--repeats 3] [--model tiny_mla]

Every path runs with the KV sharded over the ranks (dcp = pcp; ``allgather`` is vLLM's paths
with ``dcp_rest=auto``) in the same rank processes (``pcpflow.testing.run``: ranks start once),
the paths interleaved repeat by repeat, ``verify=false``. Three cases per length L:

- ``prefill``: one prompt of L tokens, nothing cached (one step);
- ``cached``: L tokens of which all but L/16 are cached (the measured step is the continuation);
- ``decode``: 4 requests at a context of L, decoding (the median of the steps where all 4 do).

For each: the measured steps' run-clock seconds (``step_s``, pipeline and scheduler) and the
bytes their attention moved (every purpose of ``collective_bytes`` but ``restore``), the median
over the repeats, and both as ratios to ``allgather``. Wall times on a shared 2-core machine
are noisy: compare ratios within one run, and read the bytes as exact.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PATHS = ("allgather", "ring_pass_kv", "ring_pass_q", "ring_auto")
CASES = ("prefill", "cached", "decode")
DECODES, DECODE_STEPS = 4, 8


def overrides(case: str, length: int, path: str, *, pcp: int, model: str, dtype: str) -> list[str]:
    new = max(1, length // 16)
    if case == "prefill":
        prompts, cached, outputs = [length], None, 1
    elif case == "cached":
        prompts, cached, outputs = [length], [length - new], 1
    else:
        prompts, cached, outputs = [length] * DECODES, [length - 1] * DECODES, DECODE_STEPS + 1
    blocks = -(-DECODES * (length + DECODE_STEPS + 16) // (16 * pcp)) + 64
    out = [
        f"pcp={pcp}", f"dcp={pcp}", f"model={model}", f"dtype={dtype}", "verify=false", "workload=explicit",
        f"workload.prompt_lens=[{','.join(map(str, prompts))}]", f"workload.output_lens=[{outputs}]",
        f"scheduler.max_num_batched_tokens={max(length, 64)}", "scheduler.max_num_seqs=8",
        "kv.block_size=16", f"kv.num_blocks={blocks}", "output.plots=false", "output.progress=false",
        f"pipeline.forward.cp_attention={path}",
    ]
    if cached:
        out.append(f"workload.cached_lens=[{','.join(map(str, cached))}]")
    return out


def measured(run_dir: Path, case: str) -> tuple[float, int, str]:
    """(seconds, attention bytes, variants that ran) of the case's measured steps."""
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    if case == "decode":  # the steps where all requests decode: the same batch each time
        steps = [s for s in steps if s["num_prefill_tokens"] == 0 and s["num_tokens"] == DECODES]
        chosen = [sorted(steps, key=lambda s: s["step_s"])[len(steps) // 2]]
    else:
        chosen = steps[-1:]  # the whole prefill (prefill) or the continuation (cached)
    nbytes = sum(v for s in chosen for k, v in s["collective_bytes"].items() if k != "restore")
    ran = "/".join(sorted({s["cp_attention"].replace("ring_", "") for s in chosen}))
    return sum(s["step_s"] for s in chosen), nbytes, ran


def main(argv: list[str] | None = None) -> str:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pcp", type=int, default=2)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--model", default="tiny_mla")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=CASES)
    args = ap.parse_args(argv)

    from pcpflow.testing import compose, run

    root = Path(tempfile.mkdtemp(prefix="pcpflow-bench-ring-"))
    jobs, cfgs, dirs = [], [], []
    for rep in range(args.repeats):
        for length in args.lengths:
            for case in args.cases:
                for path in PATHS:
                    d = root / f"{rep}-{length}-{case}-{path}"
                    d.mkdir()
                    jobs.append((length, case, path))
                    cfgs.append(compose(overrides(case, length, path, pcp=args.pcp, model=args.model, dtype=args.dtype)))
                    dirs.append(d)
    run(cfgs, run_dirs=dirs, timeout_s=1800)
    seconds: dict[tuple, list[float]] = {}
    nbytes: dict[tuple, int] = {}
    ran: dict[tuple, str] = {}
    for job, d in zip(jobs, dirs):
        s, b, r = measured(d, job[1])
        seconds.setdefault(job, []).append(s)
        nbytes[job], ran[job] = b, r  # bytes are the same every repeat

    lines = [
        f"pcp=dcp={args.pcp}, {args.model}, {args.dtype}, CPU ranks (gloo), median of {args.repeats}",
        "",
        "| case | L | path | ran | ms | x allgather | attention MiB | x allgather |",
        "|---|--:|---|---|--:|--:|--:|--:|",
    ]
    wins = []
    for length in args.lengths:
        for case in args.cases:
            base = (length, case, "allgather")
            t0, b0 = statistics.median(seconds[base]), nbytes[base]
            t_of = {p: statistics.median(seconds[(length, case, p)]) for p in PATHS}
            b_of = {p: nbytes[(length, case, p)] for p in PATHS}
            best_t = min(t_of, key=t_of.get)
            fewest = [p for p in PATHS if b_of[p] == min(b_of.values())]
            for path in PATHS:
                job = (length, case, path)
                t, b = statistics.median(seconds[job]), nbytes[job]
                lines.append(f"| {case} | {length:,} | {path} | {ran[job]} | {t * 1e3:,.1f} | {t / t0:.2f} | "
                             f"{b / 2**20:,.2f} | {b / b0 if b0 else float('nan'):.2f} |")
            wins.append(f"- {case} at L={length:,}: fastest {best_t} ({t_of[best_t] / t0:.2f}x allgather's time), "
                        f"fewest bytes {' = '.join(fewest)} ({b_of[fewest[0]] / b0 if b0 else float('nan'):.2f}x)")
    text = "\n".join(lines + ["", *wins])
    print(text)
    return text


if __name__ == "__main__":
    main()
