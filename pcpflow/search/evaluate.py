"""One layout priced through the simulator's library, in this process (a joblib worker's
task): no Hydra job, no run dir, nothing written.

``evaluate`` takes the layout's composed ``mode=simulate`` config, validates it with the
driver's ``prepare`` (after taking the first ``sample`` requests, scaling fitted factors, or
setting an arrival rate: each variant is validated as a run of it would be), runs
``SimulatedRun`` and returns the layout's measures: TTFT and TPOT p90, throughput and
goodput per GPU, GPUs, the exposed seconds of each priced term, the fitted factors' shares.
Goodput (``settings.goodput``) is searched over arrival rates (``pcpflow.search.rates``): a
trace keeps its own arrival pattern, its timestamps scaled (``workload.time_scale``); other
workloads arrive as a Poisson process (``workload.request_rate``).
"""

from __future__ import annotations

import copy
import math
import traceback
from dataclasses import dataclass
from typing import Any

from pcpflow.search.rates import max_rate

BURST = 1e-9
"""A trace's timestamps scaled by this arrive all at once (time_scale must be > 0)."""


@dataclass(frozen=True)
class Settings:
    sample: int | None  # the first requests (None: every one)
    goodput: bool  # search the highest rate keeping the attainment
    attainment: float
    tolerance: float  # the rate search stops when its bracket is this close (relative)
    lowest: float  # ... and gives up below this share of the burst's served rate
    scale: tuple[tuple[str, float], ...] = ()  # fitted factors x these (how far the order holds)


def evaluate(raw: dict[str, Any], prepare, settings: Settings, start_rate: float | None = None) -> dict[str, Any]:
    """The layout's measures (``error``: why it could not be priced)."""
    try:
        return _evaluate(raw, prepare, settings, start_rate)
    except Exception as exc:  # noqa: BLE001 (one layout's failure must not end the search)
        from pcpflow.errors import ConfigError

        # NOTE: a ConfigError's first line is its header only: the problems say what is wrong
        text = " | ".join(str(p) for p in exc.problems) if isinstance(exc, ConfigError) else str(exc)
        return {"error": f"{type(exc).__name__}: {text}".splitlines()[0][:300], "trace": traceback.format_exc()[-2000:]}


def variant(raw: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``raw`` with the first ``settings.sample`` requests and the fitted factors scaled."""
    raw = copy.deepcopy(raw)
    if settings.sample is not None:
        raw["workload"] = sampled(raw["workload"], settings.sample, int(raw.get("seed") or 0))
    for name, factor in settings.scale:
        sim = raw.setdefault("simulate", {})
        sim[name] = min(1.0, float(sim[name]) * factor)
    return raw


def sampled(workload: dict[str, Any], n: int, seed: int = 0) -> dict[str, Any]:
    """The workload's first ``n`` requests (a trace: its first lines after ``skip``; a
    synthetic workload: its first ``n``, spelled out; ``seed``: the run's)."""
    wl = dict(workload)
    kind = wl.get("kind")
    if kind == "trace":
        wl["max_requests"] = min(n, int(wl.get("max_requests") or n))
    elif kind == "synthetic":
        wl = first_synthetic(wl, n, seed)
    else:
        for key in ("prompt_lens", "prompts", "texts", "chats", "text_token_ids", "cached_lens", "arrival_steps",
                    "output_lens"):
            if isinstance(wl.get(key), list) and (key != "output_lens" or len(wl[key]) > 1):
                wl[key] = wl[key][:n]
    return wl


def first_synthetic(workload: dict[str, Any], n: int, seed: int) -> dict[str, Any]:
    """A synthetic workload's first ``n`` requests as an explicit one: the same lengths,
    arrivals and block identities. NOTE: ``num_requests=n`` would not be them: the generator
    draws every prompt length, then every output length, so the first output lengths of a
    shorter draw are other ones."""
    from pcpflow.scheduling.workload import SyntheticWorkload, request_lengths

    cfg = SyntheticWorkload.model_validate(workload)
    if n >= cfg.num_requests:
        return workload
    prompt, output = request_lengths(cfg, seed=seed, vocab_size=1)  # NOTE: lengths only: no token is drawn
    out = {"kind": "explicit", "prompt_lens": prompt[:n].tolist(), "output_lens": output[:n].tolist(),
           "request_rate": cfg.request_rate, "max_concurrency": cfg.max_concurrency, "seed": cfg.seed,
           "ignore_eos": cfg.ignore_eos}
    if cfg.request_rate is None:  # arrivals in steps: request i at floor(i * arrival_every), 1 when null
        every = 1.0 if cfg.arrival_every is None else cfg.arrival_every
        out["arrival_steps"] = [math.floor(i * every) for i in range(n)]
    return out


def at_rate(raw: dict[str, Any], rate: float, own_rate: float | None) -> dict[str, Any]:
    """``raw`` arriving at ``rate`` requests/s (inf: all at once)."""
    raw = copy.deepcopy(raw)
    wl = raw["workload"]
    if wl.get("kind") == "trace":
        assert own_rate is not None
        wl["time_scale"] = float(wl.get("time_scale") or 1.0) * (BURST if math.isinf(rate) else own_rate / rate)
    else:
        wl["request_rate"] = rate
    return raw


def _run(raw: dict[str, Any], prepare, give_up_below: float | None = None) -> tuple[Any, dict[str, Any]]:
    """The layout's simulated run, as the driver runs it (``disagg=pd``: both pools).
    ``give_up_below``: a rate probe's attainment target; the run stops once it cannot reach
    it (``pcpflow.simulate.slo_watch``), its ``goodput.share`` then the most it could reach."""
    cfg = prepare(raw)
    if cfg.disagg.enabled:
        from pcpflow.simulate.pools import PooledRun as Run
    else:
        from pcpflow.simulate.engine import SimulatedRun as Run
    return cfg, Run(cfg, None, keep_records=False, give_up_below=give_up_below).run()["metrics"]


def measures(m: dict[str, Any]) -> dict[str, Any]:
    sim = m.get("simulate") or {}
    goodput = m.get("goodput") or {}
    return {
        "ttft_p90_s": (m.get("ttft") or {}).get("p90_s"),
        "tpot_p90_s": (m.get("tpot") or {}).get("p90_s"),
        "ttft_mean_s": (m.get("ttft") or {}).get("mean_s"),
        "throughput_per_gpu": (m.get("throughput") or {}).get("output_tok_s_per_gpu"),
        "gpus": sim.get("gpus"),
        "requests": m.get("num_requests"),  # NOTE: the pools' metrics have no "serving" section
        "attainment": goodput.get("share"),
        "breakdown_s": {k: v["exposed_s"] for k, v in (sim.get("breakdown_s") or {}).items()},
        "fitted": {k: {"value": v["value"], "share": v["share"]} for k, v in (sim.get("fitted") or {}).items()},
        "steps": m.get("num_steps"),
    }


def _evaluate(raw: dict[str, Any], prepare, settings: Settings, start_rate: float | None) -> dict[str, Any]:
    raw = variant(raw, settings)
    cfg, m = _run(raw, prepare)
    out = measures(m)
    out["runs"] = 1
    if not settings.goodput:
        return out
    own = _own_rate(cfg)
    wl = raw["workload"]
    burst_now = (wl.get("kind") != "trace" and wl.get("request_rate") is not None and math.isinf(wl["request_rate"]))
    burst = m if burst_now else _run(at_rate(raw, math.inf, own), prepare)[1]
    warm = start_rate is not None and 0 < start_rate < math.inf  # a screen's answer: bracket it closely
    # NOTE: a probe answers only "attainment >= target?": it may stop once the answer is no
    found = max_rate(lambda r: _share(_run(at_rate(raw, r, own), prepare, settings.attainment)[1]),
                     burst_attainment=_share(burst), burst_rate=burst["throughput"]["requests_s"],
                     target=settings.attainment, tolerance=settings.tolerance, start=start_rate if warm else None,
                     step=1 + 2 * settings.tolerance if warm else 2.0, lowest=settings.lowest,
                     floor_first=not warm)
    # NOTE: found.tried starts with the burst, which is this run itself when the workload is a burst
    out.update(goodput_req_s=found.rate, goodput_per_gpu=found.rate / out["gpus"], goodput_bound=found.bound,
               goodput_tried=found.tried, runs=found.runs + (not burst_now))
    return out


def _share(m: dict[str, Any]) -> float:
    """The share of requests that met every SLO; a run in which none finished met none."""
    share = m["goodput"]["share"]
    return 0.0 if share is None else share


def _own_rate(cfg) -> float | None:
    """A trace's mean arrival rate at its own (scaled) timestamps."""
    if cfg.workload.kind != "trace":
        return None
    from pcpflow.models import vocab_size_of
    from pcpflow.simulate.prepare import requests_of

    t = requests_of(cfg.workload, vocab_size_of(cfg.model), cfg.seed).arrival_s
    span = float(t.max() - t.min()) if t is not None and len(t) > 1 else 0.0
    if span <= 0:
        raise ValueError("the trace's requests all arrive at once: there is no rate to scale "
                         "(goodput searches the rate by scaling its timestamps)")
    return (len(t) - 1) / span
