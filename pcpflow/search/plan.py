"""What a search will screen, decided before anything is priced.

Every layout of the space (``pcpflow.search.space``) becomes the composed config of a
``mode=simulate`` run of it (``candidate_raw``) and is validated by the driver's own
``prepare`` (the rules a run of it meets: the grid, heads, memory, the KV fit, what a
simulation prices): a layout that cannot run is pruned with its problems as the reason.
Bad input is found here, in the driver, before Hydra starts anything (exit 2): the
``search`` section itself, a problem every layout has (it is the input's, not a layout's),
``search.gpus`` below the smallest layout that can run (which, and why the smaller ones
cannot), no layout that can run (the reasons counted), an objective that needs SLOs
without them, ``search.*`` outside ``mode=search`` (``pcpflow.config.run.MODE_SETTINGS``).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import math
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from pcpflow.config.run import RunConfig, SearchConfig, SLOConfig, pydantic_problems
from pcpflow.errors import ConfigError, Problem
from pcpflow.search.space import REPLICAS, Layout, Space, get_path, set_path
from pcpflow.simulate.decide import OBJECTIVES

Prepare = Callable[[dict[str, Any]], RunConfig]
"""The driver's validation of one job's composed config (``pcpflow.driver.job.prepare_job``)."""

SMALLEST_UP_TO = 16
"""Past ``search.gpus``, the smallest layout that can run is looked for up to this many times it."""
SHOWN_REASONS = 4


@dataclass
class Candidate:
    layout: Layout
    raw: dict[str, Any]  # the mode=simulate config of the layout: whole workload, its own arrivals
    problems: list[Problem] = field(default_factory=list)
    cfg: RunConfig | None = None  # validated (None: pruned, or not validated yet)

    @property
    def reason(self) -> str:
        return " | ".join(str(p) for p in self.problems)


@dataclass
class SearchPlan:
    search: SearchConfig
    attainment: float
    objective: str
    slo: bool  # an SLO is set: goodput can be counted
    base: dict[str, Any]  # the composed mode=simulate config, the layout left to the candidates
    space: Space
    layouts: list[Layout]  # every layout of the space (or of search.candidates)
    feasible: list[Candidate]  # validated (every one when enumerated; the first one found with Optuna)
    pruned: list[Candidate]
    optuna: bool  # the space is larger than search.exhaustive_limit: Optuna picks the layouts
    config: RunConfig  # what ``prepare`` answers for mode=search (a feasible layout's, mode=search)
    arrivals: str  # how requests arrive: "in time", "all at once" (can be made timed), "in steps"
    goodput: bool  # the rows price goodput (an SLO, and a rate the workload can be given)
    requests: int  # the workload's requests
    arrival_s: Any  # their arrival times (float64 [requests]; None: in steps)


def layout_raw(base: dict[str, Any], layout: Layout, space: Space) -> dict[str, Any]:
    """The composed mode=simulate config of ``layout``."""
    raw = _copy(base)
    for d in space.dims:
        set_path(raw, d.path, layout[d.name])
    set_path(raw, ("serving", "replicas"), layout["replicas"])
    if layout.get("disagg") != "pd" and isinstance(raw.get("disagg"), dict):
        # NOTE: the pools' settings given on the command line (disagg.transfer, ...) are for the
        # layouts with pools; a run of one pool refuses them
        raw["disagg"] = {"kind": raw["disagg"].get("kind") or "none"}
    if _arrivals(raw) == "all at once":
        # NOTE: replicas take requests as they arrive in time: every layout of the search gets
        # the same burst at 0 s, so that all are priced on one workload
        raw["workload"]["request_rate"] = math.inf
    for key, value in layout.extra:
        set_path(raw, tuple(key.lstrip("+").split(".")), value)
    return raw


def _copy(node: Any) -> Any:
    """A copy of a composed config (dicts, lists and scalars), faster than deepcopy."""
    if isinstance(node, dict):
        return {k: _copy(v) for k, v in node.items()}
    if isinstance(node, list):
        return [_copy(v) for v in node]
    return node


def with_request_rate(layout: Layout) -> Layout:
    """``layout`` as its command line writes it when the search's requests arrive as a burst in time."""
    return Layout(layout.values, (*layout.extra, ("workload.request_rate", math.inf)))


def _arrivals(raw: dict[str, Any]) -> str:
    """How the workload's requests arrive. "all at once": no arrivals in time or steps were
    given (explicit: all at step 0; synthetic: one a step), searched as a burst in time."""
    wl = raw.get("workload") or {}
    if wl.get("kind") == "trace":
        return "in time" if wl.get("step_ms") is None else "in steps"
    if wl.get("request_rate") is not None:
        return "in time"
    if wl.get("arrival_steps") is not None or wl.get("arrival_every") is not None:
        return "in steps"
    return "all at once"


_PLANS: dict[str, SearchPlan] = {}


def plan_search(raw: dict[str, Any], prepare: Prepare) -> SearchPlan:
    """The plan of the search ``raw`` describes (ConfigError with every problem of bad
    input); once per config in this process (the driver validates, then runs)."""
    key = json.dumps(raw, sort_keys=True, default=str)
    if key not in _PLANS:
        _PLANS.clear()
        _PLANS[key] = _plan(raw, prepare)
    return _PLANS[key]


def _plan(raw: dict[str, Any], prepare: Prepare) -> SearchPlan:
    problems: list[Problem] = []
    try:
        search = SearchConfig.model_validate(raw.get("search") or {})
    except ValidationError as exc:
        problems += pydantic_problems(exc, "search", SearchConfig)
        search = None
    slo_raw = dict(raw.get("slo") or {})
    try:
        attainment = SLOConfig.model_validate({"attainment": slo_raw.get("attainment", 0.9)}).attainment
    except ValidationError as exc:
        problems += pydantic_problems(exc, "slo", SLOConfig)
        attainment = 0.9
    if search is not None and search.gpus is None:
        problems.append(Problem("search.gpus", None, "required in mode=search: the GPUs to lay out (search.gpus=32)"))
    base = copy.deepcopy(raw)
    base["mode"] = "simulate"
    base.pop("search", None)
    base.setdefault("slo", {}).pop("attainment", None)
    fixed, experts, pools = _fixed(base), _has_experts(base), "disagg" in RunConfig.model_fields
    arrivals = _arrivals(base)
    pool_keys = [k.replace("decode_pool_", "decode_pool.") for k in ("decode_pool_tp", "decode_pool_pcp",
                                                                     "decode_pool_dcp") if k in fixed]
    pool_keys += pool_settings(base)
    if fixed.get("disagg") == "none" and pool_keys:  # NOTE: mode=simulate refuses it too; a search ignored it
        problems.append(Problem("disagg.kind", "none", f"disagg.{pool_keys[0]} is a setting of the pools, which "
                                "need disagg.kind=pd: drop one"))
    space = Space(search.gpus if search and search.gpus else 1, fixed=fixed, experts=experts,
                  fill=arrivals != "in steps", pools_available=pools)
    if problems:  # the input's other problems too, judged on the smallest layout
        probe = Candidate(space.layout({"tp": 1, "pcp": 1, "dcp": 1, **fixed}), {})
        probe.raw = layout_raw(base, probe.layout, space)
        problems += [p for p in _validate(probe, prepare, None) if p.field.split(".")[0] not in _LAYOUT_FIELDS]
        raise ConfigError(problems)
    assert search is not None and search.gpus is not None
    objective = (base.get("simulate") or {}).get("objective") or "ttft"
    if search.candidates is not None:
        layouts, problems = space.candidates(search.candidates)
        if problems:
            raise ConfigError(problems)
        if not layouts:
            raise ConfigError([Problem("search.candidates", [], "at least one layout ('tp=8 pcp=4 dcp=4')")])
    else:
        layouts = space.enumerate()
    optuna = search.candidates is None and len(layouts) > search.exhaustive_limit
    if optuna and importlib.util.find_spec("optuna") is None:
        raise ConfigError([Problem("search.exhaustive_limit", search.exhaustive_limit,
                                   f"the space holds {len(layouts)} layouts: more than this is searched by Optuna, "
                                   "which is not installed (pip install -e '.[search]'); or enumerate them all "
                                   f"(search.exhaustive_limit={len(layouts)}), or fix some keys on the command line")])
    feasible, pruned = _screenable(layouts, base, space, prepare, gpus=search.gpus, stop_at_first=optuna)
    if not feasible:
        raise ConfigError(_none_feasible(pruned, base, space, prepare, search))
    cfg = feasible[0].cfg
    assert cfg is not None
    slo = cfg.slo.model_copy(update={"attainment": attainment})
    config = cfg.model_copy(update={"mode": "search", "search": search, "slo": slo})
    has_slo = cfg.slo.ttft_s is not None or cfg.slo.tpot_s is not None
    table = _requests(cfg)
    if "tpot_s" in OBJECTIVES[objective].needs and int(table.output_lens.max(initial=0)) < 2:
        raise ConfigError([_no_tpot(cfg, objective)])
    no_rate = _no_rate(cfg, table.arrival_s if table.timed else None) or _in_steps(base)
    if no_rate is not None and has_slo and OBJECTIVES[objective].needs_slo:
        raise ConfigError([no_rate])
    goodput = has_slo and arrivals != "in steps" and no_rate is None
    return SearchPlan(search, attainment, objective, has_slo, base, space, layouts, feasible, pruned, optuna,
                      config, arrivals, goodput, len(table), table.arrival_s if table.timed else None)


def pool_settings(base: dict[str, Any]) -> list[str]:
    """The pools' settings other than their grid that the command line moved from their
    defaults (``transfer``, ``decode_pool.num_blocks``, ...), as ``disagg.`` keys end."""
    from pcpflow.config.disagg import DisaggConfig

    given, default = base.get("disagg") or {}, DisaggConfig()
    pool = given.get("decode_pool") or {}
    out = [f"decode_pool.{k}" for k, v in pool.items()
           if k not in ("tp", "pcp", "dcp") and v != getattr(default.decode_pool, k, v)]
    return out + (["transfer"] if given.get("transfer", default.transfer) != default.transfer else [])


def _requests(cfg: RunConfig):
    from pcpflow.models import vocab_size_of
    from pcpflow.simulate.prepare import requests_of

    return requests_of(cfg.workload, vocab_size_of(cfg.model), cfg.seed)


def _no_tpot(cfg: RunConfig, objective: str) -> Problem:
    """An objective of TPOT on a workload whose requests each generate one token: no layout
    has a TPOT to rank by."""
    wl = cfg.workload
    source = {"explicit": "workload.output_lens", "synthetic": "workload.output_len"}.get(
        wl.kind, "the output lengths of workload.path (x workload.length_scale, at most workload.output_len_cap)")
    return Problem("simulate.objective", objective, f"TPOT is the time between a request's output tokens, and no "
                   f"request here generates more than one ({source}): give them more output tokens, or rank by "
                   "ttft, ttft_x_gpus, gpus or throughput_per_gpu")


def _no_rate(cfg: RunConfig, arrival_s: Any) -> Problem | None:
    """Why goodput (the highest arrival rate keeping the SLOs) cannot be searched on this
    input, naming the setting; None: it can."""
    if cfg.max_steps is not None:
        return Problem("max_steps", cfg.max_steps, "goodput counts the requests that meet every SLO at each rate, "
                       "so every request must finish: unset max_steps in a search that ranks by goodput_per_gpu "
                       "(or rank by another simulate.objective)")
    wl = cfg.workload
    at_once = arrival_s is not None and len(arrival_s) > 1 and float(arrival_s.max() - arrival_s.min()) <= 0
    if wl.kind == "trace" and at_once:
        return Problem("workload.path", str(wl.path), f"its {len(arrival_s)} requests (workload.max_requests, "
                       "workload.skip) all arrive at once: goodput scales a trace's timestamps to search the rate, "
                       "and these have none to scale; take more of the trace (workload.max_requests), or rank by "
                       "another simulate.objective (ttft, tpot, throughput_per_gpu, ...)")
    return None


def _in_steps(base: dict[str, Any]) -> Problem | None:
    """Goodput searches the arrival rate in time: arrivals in steps have none to give (the
    setting that puts them in steps named); None where they arrive in time or can."""
    if _arrivals(base) != "in steps":
        return None
    wl = base["workload"]
    key = next(k for k in ("step_ms", "arrival_steps", "arrival_every") if wl.get(k) is not None)
    return Problem(f"workload.{key}", wl[key], "puts the arrivals in steps, and goodput searches the arrival rate in "
                   f"time (requests/s): leave workload.{key} out (a trace replays its timestamps, a synthetic "
                   "workload takes workload.request_rate), or rank by another simulate.objective (ttft, tpot, "
                   "throughput_per_gpu, ...)")


_LAYOUT_FIELDS = {"tp", "pcp", "dcp", "decode", "pipeline", "moe", "cudagraph_mode", "serving", "disagg", "kv",
                  "workload", "scheduler"}
"""Fields whose problems a probe layout's sizes may cause (not the input's own)."""


def _fixed(base: dict[str, Any]) -> dict[str, Any]:
    """The dimensions the command line fixed: those not null in the composed config."""
    from pcpflow.search.space import DIMS, pool_dims

    dims = (*DIMS, *pool_dims("disagg" in RunConfig.model_fields), REPLICAS)
    return {d.name: get_path(base, d.path) for d in dims if get_path(base, d.path) is not None}


def _has_experts(base: dict[str, Any]) -> bool:
    model = base.get("model") or {}
    if model.get("name") == "hf":
        from pcpflow.models.card import card_from_hf_config

        try:
            model = card_from_hf_config(model.get("path") or "")
        except ValueError:
            return False
    moe = model.get("moe") or {}
    return bool(model.get("num_experts") or moe.get("num_experts"))


def _validate(c: Candidate, prepare: Prepare, gpus: int | None) -> list[Problem]:
    try:
        c.cfg = prepare(c.raw)
        c.problems = []
    except ConfigError as exc:
        c.problems = list(exc.problems)
    if gpus is not None and c.layout.gpus > gpus:
        c.problems.append(Problem("search.gpus", gpus, f"this layout needs {c.layout.gpus} GPUs "
                                  f"({c.layout.world} per instance x {c.layout['replicas']} replicas)"))
    return c.problems


def _screenable(layouts: list[Layout], base: dict[str, Any], space: Space, prepare: Prepare, *, gpus: int,
                stop_at_first: bool = False) -> tuple[list[Candidate], list[Candidate]]:
    """Each layout validated (``stop_at_first``: until one can run; Optuna validates the
    rest as it picks them); a problem every layout has is the input's (ConfigError)."""
    feasible, pruned = [], []
    if stop_at_first:  # NOTE: the likeliest to run first: the largest instance (the most memory), then defaults
        defaults = {d.name: d.default for d in space.dims}

        def likeliest(lay: Layout) -> tuple[int, int]:
            values = dict(lay.values)  # NOTE: Layout.get builds this dict at every call
            return -lay.world, sum(values.get(k, v) != v for k, v in defaults.items())

        layouts = sorted(layouts, key=likeliest)
    for layout in layouts:
        c = candidate(base, layout, space)
        if _validate(c, prepare, gpus):
            pruned.append(c)
        else:
            feasible.append(c)
            if stop_at_first:
                break
    if not feasible and pruned and (shared := _shared(pruned, space)):
        raise ConfigError(shared)
    return feasible, pruned


def _shared(pruned: list[Candidate], space: Space) -> list[Problem]:
    """The problems every pruned layout has, of keys the search does not choose: the input's."""
    # NOTE: a key the search chooses (tp, ...) is no input's: every layout of a few GPUs can
    # share its problem (tp=1, the only tp on 1 GPU, too small) and more GPUs would mend it
    searched = {".".join(d.path) for d in (*space.dims, REPLICAS) if d.name not in space.fixed}
    common = set.intersection(*({_identity(p) for p in c.problems} for c in pruned))
    return [p for p in pruned[0].problems if _identity(p) in common and p.field != "search.gpus"
            and p.field not in searched]


_GRID_QUOTED = re.compile(r"\b(tp|pcp|dcp)=\d+")


def _identity(p: Problem) -> tuple[str, str, str]:
    """A problem as every layout that has it states it: its field, the value given and its
    rule, without the grid the rule quotes (``the decode pool (tp=2 pcp=1 dcp=2): ...``,
    ``got pcp=1 dcp=2``): that is each layout's own, the problem is not. NOTE: other numbers
    stay: a size (``its KV cache needs 9.1 GiB per GPU``) differs where more GPUs mend it."""
    return p.field, repr(p.given), _GRID_QUOTED.sub(r"\1=N", p.allowed)


def candidate(base: dict[str, Any], layout: Layout, space: Space) -> Candidate:
    if _arrivals(base) == "all at once":
        layout = with_request_rate(layout)
    return Candidate(layout, layout_raw(base, layout, space))


def reason_key(p: Problem) -> str:
    """A problem without its numbers: what the reasons are counted by."""
    text = re.split(r"[;:]\s", p.allowed, maxsplit=1)[0]
    return f"{p.field}: " + re.sub(r"\d+(\.\d+)?", "N", text)


def count_reasons(pruned: list[Candidate]) -> list[tuple[int, str, str]]:
    """(layouts, reason without numbers, one full example) by how many layouts each prunes."""
    counts: Counter[str] = Counter()
    example: dict[str, str] = {}
    for c in pruned:
        for k in {reason_key(p): str(p) for p in c.problems}.items():
            counts[k[0]] += 1
            example.setdefault(k[0], k[1])
    return [(n, k, example[k]) for k, n in counts.most_common()]


def reasons_text(pruned: list[Candidate], shown: int = SHOWN_REASONS) -> str:
    counted = count_reasons(pruned)
    parts = [f"{n} x {example}" for n, _, example in counted[:shown]]
    more = f"; and {len(counted) - shown} other reason(s)" if len(counted) > shown else ""
    return "; ".join(parts) + more


def _none_feasible(pruned: list[Candidate], base: dict[str, Any], space: Space, prepare: Prepare,
                   search: SearchConfig) -> list[Problem]:
    """Why nothing can run: too few GPUs (the smallest layout that can, and why every
    smaller one cannot), or no layout at all (the reasons counted)."""
    gpus = search.gpus
    assert gpus is not None
    fits = [c for c in pruned if all(p.field == "search.gpus" for p in c.problems)]
    if search.candidates is not None:
        if fits:
            c = min(fits, key=lambda x: x.layout.gpus)
            return [Problem("search.gpus", gpus, f"at least {c.layout.gpus}: the smallest candidate that can run, "
                            f"'{c.layout.label(space.dims)}', needs {c.layout.gpus} GPUs; the others: "
                            f"{reasons_text(pruned)}")]
        return [Problem("search.candidates", search.candidates,
                        f"no candidate can run ({len(pruned)} pruned): {reasons_text(pruned)}")]
    up_to = gpus * SMALLEST_UP_TO
    wide = _skeleton_space(space, up_to)
    above = [lay for lay in wide.up_to(up_to) if gpus < lay.gpus]
    smallest, beyond = _first_that_runs(above, base, wide, prepare)
    if smallest is None and beyond and (shared := _shared(beyond, space)):
        return shared  # NOTE: a fixed key no count mends (tp=3 of 32 heads): the input's, as on a count it divides
    # NOTE: an instance's GPUs divide search.gpus; one that does not may still fit in them (tp=2 on 5 GPUs)
    narrow = _skeleton_space(space, gpus)
    below = sorted((lay for lay in narrow.up_to(gpus) if lay.gpus < gpus and gpus % lay.world),
                   key=lambda lay: -lay.gpus)
    largest, _ = _first_that_runs(below, base, narrow, prepare)
    if pruned:
        why = f"the {len(pruned)} layout(s) of the space are pruned: {reasons_text(pruned)}"
    else:
        given = " ".join(f"{d.key}={space.fixed[d.name]}" for d in (*space.dims, REPLICAS) if d.name in space.fixed)
        why = f"no layout of {gpus} GPU(s) has what the command line fixed ({given})"
    if largest is not None:
        fewer = (f"'{largest.label(space.dims)}' runs on {largest.gpus} of them, but the search lays out only "
                 "instances whose GPUs divide search.gpus" + (" (replicas fill them)" if "replicas" not in space.fixed
                                                               else ""))
        above_text = (f"the smallest layout that can run above {gpus} GPUs is '{smallest.label(space.dims)}' "
                      f"({smallest.gpus} GPUs)" if smallest is not None else f"none above {gpus} up to {up_to}")
        at_least = f" or at least {smallest.gpus}" if smallest is not None else ""
        return [Problem("search.gpus", gpus, f"{largest.gpus}{at_least}: {fewer}; {above_text}; {why}")]
    if smallest is not None:
        return [Problem("search.gpus", gpus, f"at least {smallest.gpus}: the smallest layout that can run is "
                        f"'{smallest.label(space.dims)}' ({smallest.gpus} GPUs); {why}")]
    if beyond:  # NOTE: the largest first: its reason is the one more GPUs no longer mend
        why = (f"the {len(beyond)} layout(s) of {gpus + 1} to {up_to} GPUs are pruned: "
               f"{reasons_text(beyond[::-1])}; and on {gpus} GPU(s), {why}")
    return [Problem("search.gpus", gpus, f"no layout can run, up to {up_to} GPUs; {why}")]


GRID_DIMS = ("tp", "pcp", "dcp", "decode_pool_tp", "decode_pool_pcp", "decode_pool_dcp")
"""The dimensions that say how many GPUs a layout runs on (both pools' grids)."""


def _skeleton_space(space: Space, gpus: int) -> Space:
    """The layouts of up to ``gpus`` GPUs that tell how many GPUs run: the grids only, both
    pools' where the command line fixed pools (the other dimensions at their defaults, unless
    the command line fixed them), one instance unless the command line fixed the replicas."""
    skeleton_fixed = {d.name: d.default for d in space.dims if d.name not in GRID_DIMS}
    return Space(gpus, fixed={**skeleton_fixed, **space.fixed}, experts=space.experts, fill=False,
                 pools_available=space.pools)


def _first_that_runs(layouts: list[Layout], base: dict[str, Any], space: Space,
                     prepare: Prepare) -> tuple[Layout | None, list[Candidate]]:
    """The first of ``layouts`` that can run (None: none), and those pruned before it.
    ``Space.up_to`` lists every count the grid's products reach (tp=2 dcp=3 runs on 6 GPUs,
    pcp=3), not only search.gpus x 2^k; fixed replicas multiply an instance's GPUs."""
    pruned = []
    for layout in layouts:
        c = candidate(base, layout, space)
        if not _validate(c, prepare, None):
            return layout, pruned
        pruned.append(c)
    return None, pruned
