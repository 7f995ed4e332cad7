"""How fast a simulated run prices real lengths (a benchmark, not a test)::

    python scripts/bench_simulate.py            # both cases, wall seconds against their targets

1. a 1,048,576-token prefill of Llama3-405B at tp=8 pcp=dcp=16 on gtt_h100 (target 10 s), by the
   all-gather paths and by the ring (``pipeline.forward.cp_attention=ring_pass_kv``);
2. the bundled Mooncake head (1,000 requests, real lengths: length_scale=1) at tp=8 pcp=8,
   Llama3-70B on h200_sxm (target 20 s);
3. the same head on Gemma 3 27B (52 of 62 layers slide), every block kept and in KV groups
   (``kv.hybrid``): the time and the peak KV (blocks x layers a block holds) side by side.

"validate" is composing and validating the config (the driver's work before any step,
which builds the requests); "run" is the simulated run itself. Targets are for the two
together, on 2 cores.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CASES = {
    "1M prefill, 405B tp8 pcp=dcp=16": (
        ["mode=simulate", "model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8", "tp=8",
         "pcp=16", "dcp=16", "workload=explicit", "workload.prompt_lens=[1048576]", "workload.output_lens=[1]"],
        10.0,
    ),
    "1M ring pass-KV, 405B tp8 pcp=dcp=16": (
        ["mode=simulate", "model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8", "tp=8",
         "pcp=16", "dcp=16", "pipeline.forward.cp_attention=ring_pass_kv", "workload=explicit",
         "workload.prompt_lens=[1048576]", "workload.output_lens=[1]"],
        10.0,
    ),
    "Mooncake head x1000, 70B tp8 pcp=8": (
        ["mode=simulate", "model=llama3_70b", "hardware=h200_sxm", "tp=8", "pcp=8", "workload=trace",
         f"workload.path={ROOT / 'scripts/data/mooncake_conversation_head.jsonl'}", "workload.max_requests=1000",
         "workload.length_scale=1"],
        20.0,
    ),
    # NOTE: a windowed model's KV groups side by side (kv.hybrid): 7 groups, blocks handed back every step
    "Mooncake head x1000, Gemma3-27B, kept": (
        ["mode=simulate", "model=gemma3_27b", "hardware=h200_sxm", "tp=8", "pcp=8", "workload=trace",
         f"workload.path={ROOT / 'scripts/data/mooncake_conversation_head.jsonl'}", "workload.max_requests=1000",
         "workload.length_scale=1", "kv.hybrid=off"],
        20.0,
    ),
    "Mooncake head x1000, Gemma3-27B, hybrid": (
        ["mode=simulate", "model=gemma3_27b", "hardware=h200_sxm", "tp=8", "pcp=8", "workload=trace",
         f"workload.path={ROOT / 'scripts/data/mooncake_conversation_head.jsonl'}", "workload.max_requests=1000",
         "workload.length_scale=1"],
        20.0,
    ),
}


def main() -> int:
    from pcpflow.simulate.engine import simulate_run
    from pcpflow.testing import compose

    worst, totals = 0.0, {}
    print(f"{'case':40s} {'validate s':>10s} {'run s':>8s} {'total s':>8s} {'cpu s':>7s} {'target':>7s} {'steps':>6s}  TTFT / TPOT")
    for name, (overrides, target) in CASES.items():
        t0, c0 = time.perf_counter(), time.process_time()
        cfg = compose(overrides + ["output.plots=false", "output.progress=false"])
        t1 = time.perf_counter()
        m = simulate_run(cfg)["metrics"]
        t2, cpu = time.perf_counter(), time.process_time() - c0
        tpot = m["tpot"]["mean_s"]
        print(f"{name:40s} {t1 - t0:10.2f} {t2 - t1:8.2f} {t2 - t0:8.2f} {cpu:7.2f} {target:7.0f} {m['num_steps']:6d}  "
              f"{m['ttft']['mean_s'] * 1e3:.0f} ms / " + (f"{tpot * 1e3:.1f} ms" if tpot else "-"))
        worst = max(worst, (t2 - t0) / target)
        totals[name] = (t2 - t0, m["kv_usage"]["max"] * cfg.kv.num_blocks * (m["kv_groups"] or {}).get(
            "layers_per_block", 62))
    kept, hybrid = totals["Mooncake head x1000, Gemma3-27B, kept"], totals["Mooncake head x1000, Gemma3-27B, hybrid"]
    print(f"Gemma3-27B hybrid / kept: {hybrid[0] / kept[0]:.2f}x the time, {hybrid[1] / kept[1]:.2f}x the peak KV "
          "(blocks x layers per block)")
    print("cpu s: this process's CPU time; on a shared machine wall time also counts the waits for a core")
    return 0 if worst <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
