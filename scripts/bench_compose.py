"""How fast a command line is composed and checked, Hydra composing the whole of it against
composing on the options kept from an earlier command line (``driver.compose``), side by side.

Cases (each command line composed and validated as ``python -m pcpflow`` does before a run):

- ``one job``: the same layout at 24 seeds (what a test suite, ``--cfg job`` or a job's own
  check does again and again);
- ``sweep precheck``: the check before a multirun, ``pcp=1,2,4 tp=1,2 decode=... seed=1,2,3``
  over both tiny models (every job composed and validated: 3 x 2 x 2 x 3 x 2 = 72 jobs);
- ``mixed``: each shipped model, then each hardware, simulated (a new choice each time: what
  is kept helps least).

    python scripts/bench_compose.py            # every case, 3 repeats
    python scripts/bench_compose.py --quick    # one repeat of a smaller set (the test suite's)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import pcpflow.driver.compose as compose  # noqa: E402
from pcpflow.driver.cli import precheck  # noqa: E402
from pcpflow.driver.compose import config_groups, validate_overrides  # noqa: E402


def _one_job(n: int) -> None:
    for seed in range(n):
        validate_overrides(["pcp=4", "dcp=4", "decode=sharded", f"seed={seed}"])


def _sweep(seeds: int) -> None:
    precheck(["pcp=1,2,4", "tp=1,2", "decode=replicated,sharded", f"seed={','.join(map(str, range(seeds)))}",
              "model=tiny_gqa,tiny_mla"], multirun=True)


def _mixed(models: list[str], hardware: list[str]) -> None:
    for m in models:
        validate_overrides(["mode=simulate", f"model={m}", "hardware=h200_sxm", f"tp={1 if m.startswith('tiny') else 8}"])
    for h in hardware:
        validate_overrides(["mode=simulate", "model=llama3_8b", f"hardware={h}"])


def _timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        compose._defaults_config.cache_clear()  # NOTE: each repeat starts with nothing kept
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repeat of a smaller set")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else 3
    groups = config_groups()
    models = [m for m in groups["model"] if m != "hf"][: 2 if args.quick else None]
    hardware = [h for h in groups["hardware"] if h != "measured"][: 2 if args.quick else None]
    seeds = 1 if args.quick else 3
    cases = {
        "one job": (lambda: _one_job(4 if args.quick else 24), 4 if args.quick else 24),
        "sweep precheck": (lambda: _sweep(seeds), 24 * seeds),
        "mixed": (lambda: _mixed(models, hardware), len(models) + len(hardware)),
    }
    kept = compose._compose_on_cached_defaults
    validate_overrides([])  # NOTE: Hydra's and pydantic's first-time costs are nobody's
    print(f"{'case':<16}{'lines':>6}{'Hydra whole (s)':>17}{'kept options (s)':>18}{'ratio':>8}")
    for name, (fn, lines) in cases.items():
        compose._compose_on_cached_defaults = lambda _: None
        try:
            whole = _timed(fn, repeats)
        finally:
            compose._compose_on_cached_defaults = kept
        fast = _timed(fn, repeats)
        print(f"{name:<16}{lines:>6}{whole:>17.2f}{fast:>18.2f}{whole / fast:>7.1f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
