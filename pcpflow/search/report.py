"""What a search writes: ``search.csv`` (a row per priced layout, as the command line writes
it, with its measures, the objective's value and its rank), ``pruned.csv`` (each layout that
cannot run and why), ``search.md`` and ``search.png`` (the recommendation per objective with
its time breakdown and the term that decides it, the Pareto front, the runner-up and what
would have to change for it to win, the fitted factors and how far they may move), and the
console's lines (the recommendation and the commands that run it)."""

from __future__ import annotations

import csv
import math
import shlex
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from pcpflow.search.evaluate import BURST
from pcpflow.search.plan import count_reasons
from pcpflow.search.run import ALL_DIMS, FULL_LOWEST, SCREEN_LOWEST, Search, same_price, tie_break
from pcpflow.search.space import DIMS, REPLICAS, Layout
from pcpflow.simulate.decide import OBJECTIVES, pareto_front, term_differences

POOL_COLUMNS = ("disagg", "decode_pool_tp", "decode_pool_pcp", "decode_pool_dcp")
MEASURES = ("gpus", "ttft_p90_s", "tpot_p90_s", "throughput_per_gpu", "goodput_per_gpu")
NAMES = {"ttft_p90_s": "TTFT p90", "tpot_p90_s": "TPOT p90", "throughput_per_gpu": "throughput per GPU",
         "goodput_per_gpu": "goodput per GPU", "gpus": "GPUs"}
HIGHER_IS_BETTER = {"throughput_per_gpu", "goodput_per_gpu"}
OBJECTIVE_MEASURE = {"ttft": "ttft_p90_s", "tpot": "tpot_p90_s", "gpus": "gpus", "throughput_per_gpu":
                     "throughput_per_gpu", "goodput_per_gpu": "goodput_per_gpu", "ttft_x_gpus": "ttft_p90_s",
                     "tpot_x_gpus": "tpot_p90_s"}
DROPPED_FROM_COMMANDS = ("mode", "search", "slo.attainment", "decode.mode", "disagg.kind")


def layout_columns(search: Search) -> list[str]:
    names = [d.name for d in DIMS]
    return names + [c for c in POOL_COLUMNS] + ["replicas"]


def _layout_cells(search: Search, layout: Layout) -> dict[str, Any]:
    cells = {d.name: layout.get(d.name) for d in DIMS}
    pools = {c: layout.get(c) for c in POOL_COLUMNS}
    if pools["disagg"] is None:  # NOTE: one pool until disaggregation joins the space (space.pool_dims)
        pools = {"disagg": "none", "decode_pool_tp": None, "decode_pool_pcp": None, "decode_pool_dcp": None}
    return {**cells, **pools, "replicas": layout["replicas"], "overrides": layout.label(search.plan.space.dims)}


def write_report(search: Search, run_dir: Path | None, *, partial: bool = False) -> dict[str, Any]:
    """Write the files (``partial``: interrupted, what was priced so far) and return the
    result sections (``metrics.search``)."""
    rows = _ranked_rows(search)
    summary = _summary(search, rows, partial)
    if run_dir is not None:
        _write_csv(run_dir / "search.csv", rows, _csv_columns(search, rows))
        _write_csv(run_dir / "pruned.csv", _pruned_rows(search), layout_columns(search) + ["gpus", "overrides", "reason"])
        if not partial:
            (run_dir / "search.md").write_text(search_md(search, rows, summary))
            if search.plan.config.output.plots:
                write_search_plot(search, rows, run_dir / "search.png")
    if search.console and not partial:
        print_console(search, summary, run_dir)
    sections = {"outputs": None, "verification": "off: mode=search prices layouts (counts and prices only)",
                "metrics": {"search": summary}}
    if not partial and summary["recommended"] is None:  # NOTE: a search that recommends nothing failed
        from pcpflow.errors import EXIT_FAILED

        sections.update(status="failed", error=unpriced(rows, search.plan.objective), exit_code=EXIT_FAILED)
    return sections


def unpriced(rows: list[dict[str, Any]], objective: str) -> str:
    """Why no layout could be recommended: the commonest error, or no value for the objective."""
    errors = Counter(r["error"] for r in rows if r.get("error"))
    if errors:
        error, n = errors.most_common(1)[0]
        return f"no layout could be priced: {n} of {len(rows)} failed with {error} (search.csv says why)"
    return f"no layout could be priced: none of {len(rows)} has a value for {objective} (search.csv)"


# -- rows ---------------------------------------------------------------------------------------

def _ranked_rows(search: Search) -> list[dict[str, Any]]:
    out = []
    ranked = search.ranked()
    values = [search.value(r) for r in ranked]
    dims = ("ttft_p90_s", "tpot_p90_s", "goodput_per_gpu", "gpus")
    # NOTE: a row screened on a sample has the sample's measures: set against the whole
    # workload's it would "dominate" them (fewer requests queue less), so it is left off
    whole = [r for r in ranked if not r.get("error") and search.on_whole(r)]
    usable = [d for d in dims if all(r.get(d) is not None for r in whole)]
    ok = [r for r in whole if all(r.get(d) is not None for d in usable)]
    front = pareto_front([tuple(-r[d] if d in HIGHER_IS_BETTER else r[d] for d in usable) for r in ok])
    on_front = {id(r) for r, f in zip(ok, front) if f}
    judged = {id(r) for r in ok}
    for i, (r, v) in enumerate(zip(ranked, values)):
        row = {**_layout_cells(search, r["layout"]), **{m: r.get(m) for m in MEASURES},
               "objective": search.plan.objective, "objective_value": v,
               "rank": i + 1 if v is not None else None,
               "pareto": id(r) in on_front if id(r) in judged else None,
               "priced": r["priced"], "requests": r.get("requests"), "goodput_bound": r.get("goodput_bound"),
               "runs": r.get("runs"), "error": r.get("error")}
        for term, s in (r.get("breakdown_s") or {}).items():
            row[f"{term}_s"] = s
        row["_row"] = r
        out.append(row)
    return out


def _csv_columns(search: Search, rows: list[dict[str, Any]]) -> list[str]:
    first = ["gemm_s", "attention_s", "memory_ops_s", "host_launch_s"]
    terms = {k for r in rows for k in r if k.endswith("_s") and k not in MEASURES and k not in ("ttft_p90_s", "tpot_p90_s")}
    return (layout_columns(search) + list(MEASURES) + ["objective", "objective_value", "rank", "pareto", "priced",
            "requests", "goodput_bound", "runs", "overrides"] + [t for t in first if t in terms]
            + sorted(terms - set(first)) + ["error"])


def _pruned_rows(search: Search) -> list[dict[str, Any]]:
    return [{**_layout_cells(search, c.layout), "gpus": c.layout.gpus, "reason": c.reason} for c in search.pruned]


def _write_csv(path: Path, rows: list[dict[str, Any]], columns: list[str]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: _cell(r.get(k)) for k in columns})


def _cell(v: Any) -> Any:
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}" if math.isfinite(v) else str(v)
    return v


# -- the summary ----------------------------------------------------------------------------------

def _summary(search: Search, rows: list[dict[str, Any]], partial: bool) -> dict[str, Any]:
    plan = search.plan
    best, runner, ties = search.top_two()
    full = [r for r in rows if r["priced"] == "full"]
    return {
        "objective": plan.objective,
        "gpus": plan.search.gpus,
        "space": len(plan.layouts),
        "method": "optuna" if plan.optuna else "exhaustive",
        "pruned": len(search.pruned),
        "screened": search.screened,
        "screened_on": (f"the first {search.sample} of {search.total} requests" if search.sample is not None
                        else f"the whole workload ({search.total} requests)"),
        "sampled": search.screened if search.sample is not None else 0,
        "priced_in_full": len(full),
        "jobs": search.jobs,
        "wall_s": search.wall_s,
        "interrupted": partial,
        "recommended": _brief(search, best),
        "runner_up": _brief(search, runner),
        "ties": len(ties),
        "sensitivity": search.sensitivity,
        "pruned_reasons": [{"layouts": n, "reason": k} for n, k, _ in count_reasons(search.pruned)],
    }


def no_goodput(search: Search, best: dict[str, Any] | None) -> str | None:
    """What to say when goodput is the objective and even the best layout keeps the attainment
    at no rate it tried: every layout then ties at 0 and the other measures order them."""
    if best is None or search.plan.objective != "goodput_per_gpu" or best.get("goodput_per_gpu") != 0:
        return None
    slo = search.plan.config.slo
    lowest = FULL_LOWEST if best.get("priced") == "full" else SCREEN_LOWEST
    targets = " and ".join(f"{k} <= {v:g} s" for k, v in (("TTFT", slo.ttft_s), ("TPOT", slo.tpot_s)) if v)
    return (f"no layout priced keeps {search.plan.attainment:.0%} of requests within {targets} at any rate it "
            f"tried (down to 1/{1 / lowest:g} of its burst's rate): all tie at goodput 0 and TTFT, TPOT "
            f"and throughput order them; loosen slo.* or lower slo.attainment")


def _brief(search: Search, r: dict[str, Any] | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"layout": r["layout"].label(search.plan.space.dims), **{m: r.get(m) for m in MEASURES},
            "objective_value": search.value(r), "breakdown_s": r.get("breakdown_s"),
            "fitted": r.get("fitted"), "simulate_command": simulate_command(search, r["layout"]),
            "goodput_command": goodput_command(search, r), "execute_command": execute_command(search, r["layout"])}


# -- commands -----------------------------------------------------------------------------------

def _layout_key(o: str, pools: bool) -> bool:
    """A key of the search's own or of the layout (the layout's values replace them); a
    setting of the pools (``disagg.transfer``, ``disagg.decode_pool.num_blocks``, ...) is kept
    for a layout with pools (``pools``) only: a run without them refuses it."""
    key = o.lstrip("+~").split("=", 1)[0]
    keys = {d.key for d in (*ALL_DIMS, REPLICAS)} | set(DROPPED_FROM_COMMANDS)
    return key in keys or key.startswith("search.") or (key.startswith("disagg.") and not pools)


def _given(search: Search, layout: Layout) -> list[str]:
    if search.overrides is None:
        return ["<this command's other settings>"]
    pools = layout.get("disagg") == "pd"
    return [o for o in search.overrides if not _layout_key(o, pools) and not o.startswith("hydra.")]


def simulate_command(search: Search, layout: Layout, setting: str | None = None) -> str:
    """The mode=simulate run of ``layout``; ``setting`` ("key=value") replaces that key's."""
    parts = ["python", "-m", "pcpflow", "mode=simulate", *_given(search, layout),
             *layout.overrides(search.plan.space.dims)]
    if setting is not None:
        key = setting.split("=", 1)[0]
        parts = [p for p in parts if p.lstrip("+~").split("=", 1)[0] != key] + [setting]
    return " ".join(p if p.startswith("<") else shlex.quote(p) for p in parts)


def goodput_command(search: Search, row: dict[str, Any]) -> str | None:
    """The simulated run of ``row``'s layout with the requests offered at its goodput rate
    (``goodput_per_gpu`` x GPUs: a trace's timestamps scaled, else Poisson arrivals at that
    rate; every request at once where even that kept the attainment): at least
    ``slo.attainment`` of its requests meet the SLOs (``metrics.goodput.share``). None where
    no goodput was found."""
    rate, bound = row.get("goodput_req_s"), row.get("goodput_bound")
    if not rate or bound in (None, "below") or search.overrides is None:
        return None
    wl = search.plan.config.workload
    rate = math.inf if bound == "burst" else rate
    if wl.kind == "trace":
        t = search.plan.arrival_s  # NOTE: the timestamps already x workload.time_scale
        own = (len(t) - 1) / float(t.max() - t.min())
        setting = f"workload.time_scale={wl.time_scale * (BURST if math.isinf(rate) else own / rate)!r}"
    else:
        setting = f"workload.request_rate={rate!r}"
    return simulate_command(search, row["layout"], setting)


SIMULATE_ONLY = ("hardware", "simulate.", "serving.", "workload.request_rate", "slo.")


def execute_command(search: Search, layout: Layout) -> str | None:
    """The executed run of ``layout`` (its ranks compute, verified), where the model can run
    (a model card has no weights); None otherwise."""
    model = (search.plan.base.get("model") or {}).get("name")
    if model not in ("tiny_mla", "tiny_gqa", "hf"):
        return None
    given = [o for o in _given(search, layout) if not o.lstrip("+~").startswith(SIMULATE_ONLY)]
    keep = [o for o in layout.overrides(search.plan.space.dims) if not o.startswith(("serving.", "workload.request_rate"))]
    return " ".join(p if p.startswith("<") else shlex.quote(p) for p in ["python", "-m", "pcpflow", *given, *keep])


# -- search.md ------------------------------------------------------------------------------------

def _fmt(measure: str, v: Any) -> str:
    if v is None:
        return "-"
    if measure in ("ttft_p90_s", "tpot_p90_s"):
        return f"{v * 1e3:.1f} ms" if v < 1 else f"{v:.3g} s"
    if measure == "gpus":
        return str(int(v))
    if measure == "throughput_per_gpu":
        return f"{v:.4g} tok/s"
    if measure == "goodput_per_gpu":
        return f"{v:.4g} req/s"
    return f"{v:.4g}"


def compare(a: dict[str, Any], b: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Where ``a`` is better than ``b`` and where ``b`` is better, each "measure by r x"."""
    wins, losses = [], []
    for m in MEASURES:
        va, vb = a.get(m), b.get(m)
        if va is None or vb is None or va == vb:
            continue
        if m in HIGHER_IS_BETTER:
            better, ratio = va > vb, (va / vb if vb else math.inf) if va > vb else (vb / va if va else math.inf)
        else:
            better, ratio = va < vb, (vb / va if va else math.inf) if va < vb else (va / vb if vb else math.inf)
        text = f"{NAMES[m]} by {ratio:.4g}x"
        (wins if better else losses).append(text)
    return wins, losses


def deciding_terms(a: dict[str, Any], b: dict[str, Any], n: int = 3) -> list[tuple[float, str]]:
    """The terms that put ``a`` before ``b``: where ``b`` spends the most more (its exposed
    seconds, b - a), largest first; then the largest where ``b`` spends less (what offsets)."""
    ta, tb = a.get("breakdown_s") or {}, b.get("breakdown_s") or {}
    terms = sorted(set(ta) | set(tb))
    diffs = [(d, t) for d, t in term_differences(ta, tb, terms, len(terms)) if d]
    more = sorted((x for x in diffs if x[0] > 0), key=lambda x: -x[0])
    less = sorted((x for x in diffs if x[0] < 0), key=lambda x: x[0])
    return (more[: n - 1] + less[:1]) if more else less[:n]


def _breakdown(r: dict[str, Any], n: int = 6) -> str:
    b = r.get("breakdown_s") or {}
    total = sum(b.values()) or 1.0
    top = sorted(b.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {_seconds(v)} ({v / total:.0%})" for k, v in top if v > 0)


def _signed(v: float) -> str:
    return ("+" if v > 0 else "-") + _seconds(abs(v))


def _seconds(v: float) -> str:
    return f"{v * 1e3:.1f} ms" if abs(v) < 1 else f"{v:.3g} s"


def search_md(search: Search, rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    plan = search.plan
    cfg = plan.config
    obj = OBJECTIVES[plan.objective]
    model = getattr(cfg.model, "name", "?")
    hw = cfg.hardware.name if cfg.hardware is not None else "?"
    lab = lambda r: f"`{r['layout'].label(plan.space.dims)}`"  # noqa: E731
    lines = [f"# Search: {model} on {summary['gpus']} x {hw}, objective {plan.objective} "
             f"({'higher' if obj.higher_is_better else 'lower'} is better)", ""]
    lines += [f"- **Space**: {summary['space']} layouts ({summary['method']}); **pruned** before any pricing: "
              f"{summary['pruned']} (pruned.csv); **screened**: {summary['screened']} on {summary['screened_on']}; "
              f"**priced in full** (whole workload): {summary['priced_in_full']}.",
              f"- Workers: up to {summary['jobs']} (joblib; less work than a worker's start-up is priced in this "
              f"process); wall time {summary['wall_s'].get('total', 0):.1f} s "
              f"(screen {summary['wall_s'].get('screen', 0):.1f}, full {summary['wall_s'].get('full', 0):.1f}, "
              f"fitted factors {summary['wall_s'].get('sensitivity', 0):.1f}).",
              "- TTFT and TPOT are p90 over the workload's requests at its own arrivals; throughput is output "
              "tokens/s per GPU; goodput per GPU is the highest request rate at which "
              f"{plan.attainment:.0%} of requests meet every SLO (DistServe), divided by the GPUs."]
    best, runner, ties = search.top_two()
    if best is None:
        lines += ["", "No layout was priced in full."]
        return "\n".join(lines) + "\n"
    lines += ["", "## Recommended", "", f"**{lab(best)}**: " + ", ".join(
        f"{NAMES[m]} {_fmt(m, best.get(m))}" for m in MEASURES), ""]
    lines += [f"- **{warning}**" for warning in [no_goodput(search, best)] if warning]
    lines += [f"- Time breakdown (exposed seconds of the run at the workload's arrivals): {_breakdown(best)}."]
    if ties:
        lines.append(f"- {len(ties)} other layout(s) price the same (they differ only where nothing is priced): "
                     + ", ".join(lab(t) for t in ties[:5]) + (" ..." if len(ties) > 5 else "") + ".")
    lines += [f"- Simulate it: `{simulate_command(search, best['layout'])}`"]
    at_goodput = goodput_command(search, best)
    if at_goodput:
        lines += [f"- At its goodput rate ({best['goodput_per_gpu'] * best['gpus']:.4g} req/s offered; at least "
                  f"{search.plan.attainment:.0%} of requests meet the SLOs, `metrics.goodput.share`): `{at_goodput}`"]
    ex = execute_command(search, best["layout"])
    lines += [f"- Execute it: `{ex}`" if ex else
              "- Execute it: a model card has no weights; `model=hf model.path=DIR` (a checkpoint) runs the layout."]
    if runner is not None:
        wins, losses = compare(best, runner)
        terms = deciding_terms(best, runner)
        lines += ["", "## The runner-up, and what would have to change", "",
                  f"{lab(best)} beats {lab(runner)} " + ("by " + "; by ".join(w.split(" by ", 1)[1] + " on " +
                                                                              w.split(" by ")[0] for w in wins)
                                                      if wins else "on no measure")
                  + ("; " + lab(runner) + " wins " + "; ".join(losses) if losses else "") + "."]
        v1, v2 = search.value(best), search.value(runner)
        if v1 is not None and v2 is not None and v1 and v2 and v1 != v2:
            lines.append(f"- For the runner-up to win, its {plan.objective} would have to improve by "
                         f"{to_win(v1, v2, obj.higher_is_better)}, all else equal.")
        elif v1 == v2:
            lines.append(f"- They tie on {plan.objective}: the other measures order them.")
        if terms:
            d, t = terms[0]
            lines.append(f"- The term that decides it: **{t}** (the runner-up spends {_seconds(abs(d))} "
                         f"{'more' if d > 0 else 'less'} there)"
                         + (", then " + ", ".join(f"{tt} {_signed(dd)}" for dd, tt in terms[1:]) if terms[1:] else "")
                         + "; exposed seconds summed over the run's steps.")
    lines += _per_objective(search, rows)
    lines += _sensitivity(search)
    lines += _front(search, rows)
    lines += _table(search, rows)
    lines += ["", "## Pruned before pricing (counted)", ""]
    counted = count_reasons(search.pruned)
    lines += [f"- {n} x {example}" for n, _, example in counted[:12]] or ["- none"]
    return "\n".join(lines) + "\n"


def to_win(best: float, runner: float, higher_is_better: bool) -> str:
    """How much the runner-up's objective must improve to reach the best's, as a factor and a
    percentage, each rounded away from what falls short (applied to the runner-up's value,
    either one reaches the best's): "1.018x (+1.74%)", "1.046x (-4.35%)"."""
    ratio = best / runner if higher_is_better else runner / best
    change = (ratio - 1) if higher_is_better else (1 - 1 / ratio)
    return f"{_ceil(ratio, 4)}x ({'+' if higher_is_better else '-'}{_ceil(change * 100, 2, places=True)}%)"


def _ceil(x: float, digits: int, *, places: bool = False) -> str:
    """``x`` rounded up to ``digits`` significant digits (``places``: decimal places)."""
    from decimal import ROUND_CEILING, Decimal

    d = Decimal(repr(x))
    up = d.quantize(Decimal(1).scaleb(-digits if places else d.adjusted() - digits + 1), rounding=ROUND_CEILING)
    return f"{up:f}" if places else f"{up.normalize():f}"


def _per_objective(search: Search, rows: list[dict[str, Any]]) -> list[str]:
    out = ["", "## Recommended per objective", "",
           "| objective | best layout | value | priced | breakdown | term that decides it (against the next) |",
           "|---|---|--:|---|---|---|"]
    for name, obj in OBJECTIVES.items():
        scored = [(search.value(r["_row"], name), r["_row"]) for r in rows]
        scored = [(v, r) for v, r in scored if v is not None]
        if not scored:
            continue
        # NOTE: a row screened on the whole workload has this objective's full price unless
        # it is goodput (bracketed more coarsely on the screen): it competes with those priced in full
        exact = lambda r: r["priced"] == "full" or (search.sample is None and not obj.needs_slo)  # noqa: E731
        scored.sort(key=lambda vr: (not exact(vr[1]), obj.key(vr[0]), vr[1]["priced"] != "full", *tie_break(vr[1])))
        v, r = scored[0]
        nxt = next((rr for vv, rr in scored[1:] if not same_price(r, rr)), None)
        terms = deciding_terms(r, nxt, 1) if nxt is not None else []
        decide = f"{terms[0][1]} ({_signed(terms[0][0])})" if terms else "-"
        out.append(f"| {name} | `{r['layout'].label(search.plan.space.dims)}` | {_objective_text(name, v)} | {r['priced']} | "
                   f"{_breakdown(r, 3)} | {decide} |")
    return out


def _objective_text(name: str, v: float) -> str:
    unit = {"ttft": " s", "tpot": " s", "ttft_x_gpus": " GPU-s", "tpot_x_gpus": " GPU-s",
            "throughput_per_gpu": " tok/s", "goodput_per_gpu": " req/s"}.get(name, "")
    return f"{v:.4g}{unit}"


def _sensitivity(search: Search) -> list[str]:
    out = ["", "## How sure: the fitted factors", ""]
    if not search.sensitivity:
        return out + ["No runner-up to compare with (or no fitted factor): nothing to move."]
    out += ["Each fitted factor (metrics.simulate.fitted) scaled from 0.5x to 2x (at most 1), the recommended "
            "layout and its runner-up re-priced at each:", "",
            "| factor | value | share of the recommended's time | order holds from | to | flips at |",
            "|---|--:|--:|--:|--:|---|"]
    for f, s in search.sensitivity.items():
        if not s["resolved"]:
            out.append(f"| {f} | {s['value']:.4g} | {s['share']:.0%} | - | - | not walked (below) |")
            continue
        flips = [f"{x}x" for x in (s["flips_low"], s["flips_high"]) if x is not None]
        out.append(f"| {f} | {s['value']:.4g} | {s['share']:.0%} | {s['low']}x | {s['high']}x | "
                   f"{', '.join(flips) or 'nowhere in 0.5x-2x'} |")
    on = next(iter(search.sensitivity.values()))["on"]
    out += ["", f"Re-priced on {on}. A factor that is 0% of both layouts' time holds everywhere, unpriced."]
    if not all(s["resolved"] for s in search.sensitivity.values()):
        out += ["", f"Not walked: unscaled, {on} prices the runner-up ahead, where pricing in full ranked it "
                "second: the two are within that pricing's resolution, so every point would differ by its noise, "
                "not by the factor." + (" `search.sample=null` re-prices on the whole workload." if search.sample
                                        is not None else "")]
    return out


def _front(search: Search, rows: list[dict[str, Any]]) -> list[str]:
    front = [r for r in rows if r["pareto"]]
    out = ["", "## Pareto front (TTFT p90, TPOT p90, goodput per GPU, GPUs)", "",
           "No other layout priced on the whole workload is at least as good on every one and better on one"
           + (f" (those screened only on the first {search.sample} requests are left off: their measures are the "
              "sample's; search.csv leaves their pareto empty)." if search.sample is not None else "."), "",
           "| layout | TTFT p90 | TPOT p90 | goodput per GPU | GPUs | priced |", "|---|--:|--:|--:|--:|---|"]
    for r in front[:30]:
        out.append(f"| `{r['overrides']}` | {_fmt('ttft_p90_s', r['ttft_p90_s'])} | {_fmt('tpot_p90_s', r['tpot_p90_s'])}"
                   f" | {_fmt('goodput_per_gpu', r['goodput_per_gpu'])} | {r['gpus']} | {r['priced']} |")
    if len(front) > 30:
        out.append(f"| ... {len(front) - 30} more in search.csv (pareto) | | | | | |")
    return out


def _table(search: Search, rows: list[dict[str, Any]]) -> list[str]:
    k = search.plan.search.top_k
    out = ["", f"## Ranked (the first {k}; every priced layout in search.csv)", "",
           "| rank | layout | GPUs | TTFT p90 | TPOT p90 | throughput/GPU | goodput/GPU | priced |",
           "|--:|---|--:|--:|--:|--:|--:|---|"]
    for r in rows[:k]:
        out.append(f"| {r['rank'] or '-'} | `{r['overrides']}` | {r['gpus']} | {_fmt('ttft_p90_s', r['ttft_p90_s'])} | "
                   f"{_fmt('tpot_p90_s', r['tpot_p90_s'])} | {_fmt('throughput_per_gpu', r['throughput_per_gpu'])} | "
                   f"{_fmt('goodput_per_gpu', r['goodput_per_gpu'])} | {r['priced']} |")
    return out


# -- search.png ------------------------------------------------------------------------------------

def write_search_plot(search: Search, rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r["ttft_p90_s"] is not None and not r.get("error")]
    if not ok:
        return
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    tpot = lambda r: r["tpot_p90_s"] * 1e3 if r["tpot_p90_s"] is not None else 0.0  # noqa: E731
    for priced, color, alpha in (("screen", "0.7", 0.5), ("full", "tab:blue", 0.9)):
        pts = [r for r in ok if r["priced"] == priced]
        ax.scatter([r["ttft_p90_s"] for r in pts], [tpot(r) for r in pts], s=[8 + 2 * (r["gpus"] or 1) ** 0.5 for r in pts],
                   c=color, alpha=alpha, label=f"{'screened' if priced == 'screen' else 'priced in full'} ({len(pts)})")
    front = [r for r in ok if r["pareto"]]
    ax.scatter([r["ttft_p90_s"] for r in front], [tpot(r) for r in front], facecolors="none", edgecolors="tab:red",
               s=60, label="Pareto front (TTFT, TPOT, goodput/GPU, GPUs)")
    best = next((r for r in ok if r["rank"] == 1), None)
    if best is not None:
        ax.scatter([best["ttft_p90_s"]], [tpot(best)], marker="*", s=250, c="gold", edgecolors="k", zorder=5,
                   label=f"recommended: {best['overrides']}"[:90])
    ax.set_xscale("log")
    ax.set_xlabel("TTFT p90 (s)")
    ax.set_ylabel("TPOT p90 (ms)")
    ax.set_title(f"{len(ok)} priced layouts, objective {search.plan.objective}")
    ax.legend(fontsize=7, loc="best")
    top = [r for r in rows if r["priced"] == "full" and r["_row"].get("breakdown_s")][:6]
    terms = sorted({t for r in top for t in r["_row"]["breakdown_s"]},
                   key=lambda t: -max(r["_row"]["breakdown_s"].get(t, 0) for r in top))[:8]
    left = [0.0] * len(top)
    for t in terms:
        vals = [r["_row"]["breakdown_s"].get(t, 0.0) for r in top]
        bx.barh(range(len(top)), vals, left=left, label=t)
        left = [a + b for a, b in zip(left, vals)]
    bx.set_yticks(range(len(top)))
    bx.set_yticklabels([f"#{r['rank']} {r['overrides']}"[:60] for r in top], fontsize=7)
    bx.invert_yaxis()
    bx.set_xlabel("exposed seconds, summed over steps (the run at the workload's arrivals)")
    bx.set_title("time breakdown of the best priced in full")
    if terms:  # NOTE: nothing priced in full (every layout failed or has no value): no bars to name
        bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the console --------------------------------------------------------------------------------

def print_console(search: Search, summary: dict[str, Any], run_dir: Path | None) -> None:
    rec, run = summary["recommended"], summary["runner_up"]
    lines = [f"pcpflow search: {summary['space']} layouts ({summary['method']}), {summary['pruned']} pruned before "
             f"pricing, {summary['screened']} screened on {summary['screened_on']}, {summary['priced_in_full']} "
             f"priced in full; {summary['wall_s'].get('total', 0):.1f} s (up to {summary['jobs']} joblib worker(s))"]
    if rec is None:
        lines.append(unpriced(_ranked_rows(search), summary["objective"]))
    else:
        lines.append(f"recommended ({summary['objective']}): {rec['layout']}: "
                     + " · ".join(f"{NAMES[m]} {_fmt(m, rec[m])}" for m in MEASURES if rec.get(m) is not None))
        warning = no_goodput(search, search.top_two()[0])
        if warning:
            lines.append(f"  {warning}")
        if run is not None:
            lines.append(f"  runner-up: {run['layout']}: "
                         + " · ".join(f"{NAMES[m]} {_fmt(m, run[m])}" for m in MEASURES if run.get(m) is not None))
        lines.append(f"  simulate it: {rec['simulate_command']}")
        if rec["goodput_command"]:
            lines.append(f"  at its goodput rate ({rec['goodput_per_gpu'] * rec['gpus']:.4g} req/s; at least "
                         f"{search.plan.attainment:.0%} meet the SLOs, metrics.goodput.share): "
                         f"{rec['goodput_command']}")
        lines.append(f"  execute it:  {rec['execute_command']}" if rec["execute_command"] else
                     "  execute it:  not with a model card (no weights); model=hf model.path=DIR runs the layout")
    if run_dir is not None:
        lines.append(f"report: {run_dir / 'search.md'} (search.csv, pruned.csv, search.png)")
    print("\n".join(lines), file=sys.stdout, flush=True)
