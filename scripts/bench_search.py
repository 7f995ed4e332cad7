"""How fast ``mode=search`` screens layouts (a benchmark, not a test)::

    python scripts/bench_search.py                 # every case, figures against their targets
    python scripts/bench_search.py --case long     # one of them: long | long_pools | mooncake

1. **one long request** (``long``): Llama3-405B (fp8 weights) on GTT H100s, one 131,072-token
   prompt and 64 output tokens, the one-pool layouts of ``search.gpus=128`` GPUs
   (``disagg.kind=none``: a single request has no decode traffic to disaggregate; 2,350
   layouts, exhaustive); target: at least 500 layouts screened in at most 60 s on 2 cores.
   ``long_pools``: the same with prefill/decode pools in the space (28,950 layouts, past
   ``search.exhaustive_limit``: Optuna picks 500: the target's count), against the same target.
2. **the Mooncake head**: the bundled trace's 1,000 requests at their real lengths
   (``length_scale=1``) and timestamps, DeepSeek-V3 on H200s, ``search.gpus=64``, SLOs
   (TTFT 2 s, TPOT 50 ms) and ``simulate.objective=goodput_per_gpu``: each layout's goodput
   searched over arrival rates on a sample of the trace's first requests, the best priced in
   full on all 1,000; target: at least 50 layouts in at most 10 minutes on 2 cores, saying how
   many were screened on a sample.

Each case runs ``python -m pcpflow mode=search ...`` in a fresh process (imports, validation,
the workers' start-up and the report all count) and reads its ``result.json``. The load
average is printed beside: on a shared machine wall time also counts the waits for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "scripts" / "data" / "mooncake_conversation_head.jsonl"
CASES = {
    "long": (["model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8", "search.gpus=128",
              "workload=explicit", "workload.prompt_lens=[131072]", "workload.output_lens=[64]",
              "simulate.objective=ttft", "disagg.kind=none"], 60.0, 500),
    "long_pools": (["model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8", "search.gpus=128",
                    "workload=explicit", "workload.prompt_lens=[131072]", "workload.output_lens=[64]",
                    "simulate.objective=ttft", "search.trials=500"], 60.0, 500),
    "mooncake": (["model=deepseek_v3", "hardware=h200_sxm", "search.gpus=64", "workload=trace", f"workload.path={TRACE}",
                  "workload.max_requests=1000", "workload.length_scale=1", "slo.ttft_s=2", "slo.tpot_s=0.05",
                  "simulate.objective=goodput_per_gpu", "search.sample=50", "search.top_k=2", "search.trials=60",
                  "cudagraph_mode=full_and_piecewise"], 600.0, 50),
}


def run_case(name: str, extra: list[str]) -> dict:
    overrides, target_s, target_n = CASES[name]
    with tempfile.TemporaryDirectory() as d:
        load = os.getloadavg()[0]
        c0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, "-m", "pcpflow", "mode=search", *overrides, *extra,
                               "output.progress=false", f"hydra.run.dir={d}"], capture_output=True, text=True,
                              cwd=ROOT)
        wall = time.perf_counter() - t0
        c1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (c1.ru_utime + c1.ru_stime) - (c0.ru_utime + c0.ru_stime)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-3000:])
            raise SystemExit(f"{name}: exit {proc.returncode}")
        s = json.loads((Path(d) / "result.json").read_text())["metrics"]["search"]
    return {**s, "case": name, "wall_s": wall, "cpu_s": cpu, "search_wall_s": s["wall_s"], "load": load, "target_s": target_s,
            "target_n": target_n}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), action="append")
    ap.add_argument("overrides", nargs="*", help="more overrides for every case (e.g. search.jobs=2)")
    args = ap.parse_args(argv)
    ok = True
    print(f"{'case':9s} {'space':>6s} {'pruned':>6s} {'screened':>8s} {'on a sample':>11s} {'in full':>7s} "
          f"{'wall s':>7s} {'cpu s':>6s} {'screen s':>8s} {'full s':>7s} {'target':>12s} {'load':>5s}  recommended")
    for name in args.case or list(CASES):
        r = run_case(name, args.overrides)
        met = r["screened"] >= r["target_n"] and r["wall_s"] <= r["target_s"]
        ok &= met
        rec = (r["recommended"] or {}).get("layout", "-")
        print(f"{name:9s} {r['space']:6d} {r['pruned']:6d} {r['screened']:8d} {r['sampled']:11d} "
              f"{r['priced_in_full']:7d} {r['wall_s']:7.1f} {r['cpu_s']:6.1f} {r['search_wall_s'].get('screen', 0):8.1f} {r['search_wall_s'].get('full', 0):7.1f} "
              f"{'>=' + str(r['target_n']) + ' in ' + str(int(r['target_s'])) + 's':>12s} {r['load']:5.2f}  {rec}"
              + ("" if met else "   (target missed)"))
        print(f"          screened on {r['screened_on']} ({r['method']}, up to {r['jobs']} workers); cpu s: the "
              "processes' CPU time (workers included)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
