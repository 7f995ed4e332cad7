"""A search, start to end: screen every layout that can run, price the best in full, say how
far the fitted factors may move before the order changes, write the report.

1. **Screen** (``search.sample``: each layout on the workload's first requests, or all of
   them): exhaustively, or, when the space holds more than ``search.exhaustive_limit``
   layouts, the ``search.trials`` that Optuna's TPE sampler picks (it proposes values per
   dimension; a proposal that names no layout of the space, or one that cannot run, is
   pruned and told so). Work is spread over ``search.jobs`` joblib workers.
2. **Price in full** the ``search.top_k`` best by the objective: the whole workload, goodput
   (when SLOs are set) to a finer tolerance. Where the screen already was the full price (the
   sample holds every request and the same quantities were computed) it is kept as is.
3. **How sure**: the recommended layout and its runner-up re-priced with each fitted factor
   (``metrics.simulate.fitted``) scaled from 0.5x to 2x: where the order flips.

Ctrl-C (or SIGTERM): what was priced is written (search.csv, pruned.csv) and the search ends
as interrupted (exit 130 / 143).
"""

from __future__ import annotations

import math
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pcpflow.output.report import Phases
from pcpflow.search.evaluate import Settings, evaluate
from pcpflow.search.plan import Candidate, SearchPlan, _validate, candidate, plan_search
from pcpflow.search.space import DIMS, pool_dims
from pcpflow.simulate.decide import OBJECTIVES

ALL_DIMS = DIMS + pool_dims(True)
"""Every dimension a layout may have (one without pools shows none of the pools')."""
SCREEN_TOLERANCE, FULL_TOLERANCE = 0.25, 0.05
"""How close the goodput rate search brackets the rate: on the screen, and priced in full."""
SCREEN_LOWEST, FULL_LOWEST = 1 / 16, 1 / 64
SCALES = (0.5, 0.67, 0.8, 0.9, 1.1, 1.25, 1.5, 2.0)
"""The factors each fitted factor is scaled by to see where the order of the top two flips."""


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


WORKER_START_S = 6.0
"""About what a joblib worker costs to start on 2 loaded cores (imports torch, counts a layer's
kernels once): less work than this left is priced in this process."""


_workers_started = False
"""Set once joblib's workers ran: loky keeps them, so later batches go straight to them."""


def parallel(tasks: list[tuple], jobs: int, *, more: int = 0):
    """``(i, evaluate(*tasks[i]))`` as each finishes: in this process while the work left
    (these tasks and ``more`` like them to come) looks smaller than starting workers would
    cost (judged by the last task's time; the first pays this process's one-off costs),
    then over ``jobs`` joblib workers."""
    global _workers_started
    i = 0
    while i < len(tasks) and not (_workers_started and jobs > 1):
        t = time.perf_counter()
        yield i, evaluate(*tasks[i])
        i += 1
        if jobs > 1 and i >= 2 and (time.perf_counter() - t) * (len(tasks) - i + more) > WORKER_START_S:
            break
    if i == len(tasks):
        return
    _workers_started = True
    from joblib import Parallel, delayed

    with Parallel(n_jobs=jobs, return_as="generator_unordered") as pool:  # NOTE: one size: loky keeps its workers
        yield from pool(delayed(_indexed)(k, tasks[k]) for k in range(i, len(tasks)))


def screen_sample(sample: int | None, arrival_s, goodput: bool) -> int | None:
    """The requests a layout is screened on: the first ``sample``, widened, where goodput is
    searched on timed arrivals that all come at once in them (no rate to scale: a trace's
    head often does), to the first that arrives later."""
    if sample is None or not goodput or arrival_s is None or sample >= len(arrival_s):
        return sample
    later = np.flatnonzero(arrival_s[sample - 1:] != arrival_s[0]) if (arrival_s[:sample] == arrival_s[0]).all() else []
    return sample + int(later[0]) if len(later) else sample


def _indexed(i: int, args: tuple) -> tuple[int, dict[str, Any]]:
    return i, evaluate(*args)


class Search:
    """One search's state: the plan, its rows (a row per priced layout), the pruned layouts."""

    def __init__(self, raw: dict[str, Any], prepare, run_dir: Path | None, *, overrides: list[str] | None = None,
                 console: bool = True) -> None:
        self.plan: SearchPlan = plan_search(raw, prepare)
        self.prepare, self.run_dir, self.console = prepare, run_dir, console
        self.overrides = overrides
        self.jobs = self.plan.search.jobs or cores()
        self.objective = OBJECTIVES[self.plan.objective]
        self.rows: dict[tuple, dict[str, Any]] = {}
        self.pruned: list[Candidate] = list(self.plan.pruned)
        self.total = self.plan.requests
        sample = screen_sample(self.plan.search.sample, self.plan.arrival_s, self.objective.needs_slo)
        self.sample = sample if sample is not None and sample < self.total else None
        self.screen_settings = Settings(self.sample, self.objective.needs_slo, self.plan.attainment,
                                        SCREEN_TOLERANCE, SCREEN_LOWEST)
        self.full_settings = Settings(None, self.plan.goodput, self.plan.attainment, FULL_TOLERANCE, FULL_LOWEST)
        self.sensitivity: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.wall_s: dict[str, float] = {}
        self.screened = 0
        self.progress = Phases(enabled=console and self.plan.config.output.progress)

    # -- the three stages -----------------------------------------------------------------------

    def run(self) -> None:
        with self.progress:
            t = time.perf_counter()
            on = f"the first {self.sample} requests" if self.sample is not None else "the whole workload"
            if self.plan.optuna:
                self.progress.phase(f"screen (Optuna) on {on}", self.plan.search.trials)
                self._screen_optuna()
            else:
                self.progress.phase(f"screen on {on}", len(self.plan.feasible))
                self._screen(self.plan.feasible)
            self.wall_s["screen"] = time.perf_counter() - t
            t = time.perf_counter()
            self._price_in_full()
            self.wall_s["full"] = time.perf_counter() - t
            t = time.perf_counter()
            self._how_sure()
            self.wall_s["sensitivity"] = time.perf_counter() - t
        self.wall_s["total"] = time.perf_counter() - self.started

    def _screen(self, candidates: list[Candidate]) -> None:
        tasks = [(c.raw, self.prepare, self.screen_settings) for c in candidates]
        for i, result in parallel(tasks, self.jobs):
            self._record(candidates[i], result, "screen")

    def _record(self, c: Candidate, result: dict[str, Any], priced: str) -> dict[str, Any]:
        row = self.rows.get(c.layout.values) or {"layout": c.layout, "raw": c.raw}
        row.update({k: v for k, v in result.items() if k != "trace"})
        row["priced"] = priced
        row["requests"] = result.get("requests")
        self.rows[c.layout.values] = row
        if priced == "screen":
            self.screened += 1
        self.progress.advance()
        return row

    def on_whole(self, row: dict[str, Any]) -> bool:
        """The row's measures are the whole workload's: priced in full, or screened on every
        request (its TTFT, TPOT and throughput then are the full price's; only its goodput
        was bracketed more coarsely)."""
        return row["priced"] == "full" or self.sample is None

    def value(self, row: dict[str, Any], objective: str | None = None) -> float | None:
        obj = OBJECTIVES[objective or self.plan.objective]
        if row.get("error"):
            return None
        return obj.value(measures_of(row))

    def ranked(self, priced: str | None = None) -> list[dict[str, Any]]:
        """Rows best first: those priced in full, then those only screened (each by its own
        value); rows without a value (an objective that does not apply, an error) last."""
        def key(r: dict[str, Any]) -> tuple:
            v = self.value(r)
            return (r["priced"] != "full", v is None, self.objective.key(v) if v is not None else 0.0, *tie_break(r))

        rows = [r for r in self.rows.values() if priced is None or r["priced"] == priced]
        return sorted(rows, key=key)

    def _price_in_full(self) -> None:
        top = [r for r in self.ranked() if self.value(r) is not None][: self.plan.search.top_k]
        same = self.sample is None and not self.full_settings.goodput and not self.screen_settings.goodput
        if same:  # NOTE: the screen priced the whole workload with the same quantities: that is the full price
            for r in self.rows.values():
                r["priced"] = "full"
            return
        candidates = [Candidate(r["layout"], r["raw"]) for r in top]
        tasks = [(c.raw, self.prepare, self.full_settings,
                  r.get("goodput_req_s") if self.sample is None else None) for c, r in zip(candidates, top)]
        self.progress.phase("price the best in full", len(tasks))
        for i, result in parallel(tasks, self.jobs):
            self._record(candidates[i], result, "full")

    def _screen_optuna(self) -> None:
        """Optuna's TPE sampler picks layouts, ``jobs`` at a time, until ``search.trials``
        were screened or the space ran out."""
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        plan, space = self.plan, self.plan.space
        names = [d.name for d in space.dims] + ["replicas"]
        choices = {n: sorted({lay[n] for lay in plan.layouts}, key=lambda x: (x is None, str(x))) for n in names}
        choices = {n: v for n, v in choices.items() if len(v) > 1}
        known = {lay.values for lay in plan.layouts}
        sampler = optuna.samplers.TPESampler(seed=int(plan.config.seed))
        direction = "maximize" if self.objective.higher_is_better else "minimize"
        study = optuna.create_study(direction=direction, sampler=sampler)
        told = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED)
        seen: dict[tuple, float | None] = {}
        for c in plan.feasible:  # validated while planning: screened first
            seen[c.layout.values] = None
        for c in plan.pruned:  # validated while planning too: pruned once, not again when TPE proposes them
            seen[c.layout.values] = None
        todo = list(plan.feasible)
        unseen = list(plan.layouts)  # the random picks' order, drawn lazily
        random.Random(int(plan.config.seed)).shuffle(unseen)
        unseen = iter(unseen)
        while self.screened < plan.search.trials and len(seen) < len(known):
            if len(study.get_trials(deepcopy=False)) > self.screened + 256:  # NOTE: study.trials deep-copies every trial
                # NOTE: a study of what TPE reads only (no trial is pending here): Optuna walks
                # every trial, failed ones too, at each suggestion.
                kept = study.get_trials(deepcopy=False, states=told)
                study = optuna.create_study(direction=direction, sampler=sampler)
                study.add_trials(kept)
            batch: list[tuple[Any, Candidate]] = [(None, c) for c in todo]
            todo = []
            misses = 0
            while len(batch) < self.jobs * 2 and self.screened + len(batch) < plan.search.trials:
                trial = study.ask()
                params = {n: trial.suggest_categorical(n, v) for n, v in choices.items()}
                layout = space.from_params(params)
                if layout is None or layout.values not in known or layout.values in seen:
                    # NOTE: told as failed, which TPE leaves out of its history: each ask costs
                    # the history's length, and TPE proposing what it has would grow it
                    # without bound (6,500 trials for 390 layouts, 80% of a search's time).
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    misses += 1
                    if misses > 20 * self.jobs:  # NOTE: TPE keeps proposing what it has: take an unseen one at random
                        layout = next((lay for lay in unseen if lay.values not in seen), None)
                        if layout is None:
                            break
                        trial = None
                    else:
                        continue
                seen[layout.values] = None
                c = candidate(plan.base, layout, space)
                if _validate(c, self.prepare, plan.search.gpus):  # NOTE: ~3 ms here, less than a worker's round trip
                    self.pruned.append(c)
                    if trial is not None:  # NOTE: failed too: ~15 pruned a screened layout would make each ask slow
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    continue
                batch.append((trial, c))
            if not batch:
                break
            tasks = [(c.raw, self.prepare, self.screen_settings) for _, c in batch]
            for i, result in parallel(tasks, self.jobs, more=plan.search.trials - self.screened - len(batch)):
                trial, c = batch[i]
                row = self._record(c, result, "screen")
                v = self.value(row)
                seen[c.layout.values] = v
                if trial is not None:
                    if v is None or not math.isfinite(v):
                        study.tell(trial, state=optuna.trial.TrialState.FAIL)
                    else:
                        study.tell(trial, v)

    # -- how sure ------------------------------------------------------------------------------

    def top_two(self) -> tuple[dict[str, Any] | None, dict[str, Any] | None, list[dict[str, Any]]]:
        """The recommended row, its runner-up (the best whose objective is worse; else the
        best that does not price the same) and the rows that price the same as the
        recommended."""
        full = [r for r in self.ranked("full") if self.value(r) is not None]
        if not full:
            return None, None, []
        best = full[0]
        ties = [r for r in full[1:] if same_price(best, r)]
        v = self.value(best)
        runner = next((r for r in full[1:] if not _close(self.value(r), v)), None)
        runner = runner or next((r for r in full[1:] if not same_price(best, r)), None)
        return best, runner, ties

    def _how_sure(self) -> None:
        """Each fitted factor scaled outwards from 1 on each side of the grid (``SCALES``, at
        most 1): the recommended layout and its runner-up re-priced at the side's end first;
        where the order still holds there it is taken to hold on the whole side, where it
        flips the first flip is bisected on the grid.

        The walk prices on the screening sample (the whole workload without one), which need not
        order the two as pricing them in full did: a sample's p90s, a goodput bracketed to 25%.
        So the pair is re-priced unscaled that way first, and where the runner-up comes out ahead
        nothing is walked (``resolved`` false): each point would differ from the order by the
        pricing's noise, not by the factor. A factor that is no part of either layout's time
        cannot move the order: it holds on the whole grid, unpriced.

        NOTE: this assumes the order changes at most once on each side, as it does when each
        layout's time is a sum of terms each inversely proportional to the factor or free of
        it (the difference a/f + b changes sign once). Overlaps priced as a max of two terms
        can in principle break it; the grid's every point would cost four times the runs."""
        best, runner, _ = self.top_two()
        if best is None or runner is None:
            return
        factors = sorted(best.get("fitted") or {})
        settings = replace(self.full_settings, sample=self.sample,
                           tolerance=SCREEN_TOLERANCE if self.sample is not None else FULL_TOLERANCE)
        grids = {(f, side): [s for s in scales if best["fitted"][f]["value"] * s <= 1.0]
                 for f in factors for side, scales in (("low", sorted((x for x in SCALES if x < 1), reverse=True)),
                                                       ("high", sorted(x for x in SCALES if x > 1)))}
        idle = {f for f in factors if all(_share(row, f) == 0 for row in (best, runner))}
        keeps: dict[str, dict[float, bool]] = {f: {} for f in factors}
        for (f, _), grid in grids.items():
            if f in idle:
                keeps[f].update(dict.fromkeys(grid, True))
        self.progress.phase("how sure: fitted factors scaled", None)
        resolved = idle == set(factors) or self._holds(best, runner, settings, [()]) == [True]
        walked = [k for k, grid in grids.items() if grid and k[0] not in idle] if resolved else []
        bracket = {k: (-1, None) for k in walked}  # (last index held, first flipped)
        while True:
            asks = [(k, i) for k, (held, flipped) in bracket.items()
                    if (i := _next_scale(held, flipped, len(grids[k]))) is not None]
            if not asks:
                break
            holds = self._holds(best, runner, settings, [((f, grids[(f, side)][i]),) for (f, side), i in asks])
            for ((f, side), i), held in zip(asks, holds):
                if held is None:  # NOTE: a point that cannot be priced ends its side's walk
                    bracket.pop((f, side))
                    continue
                keeps[f][grids[(f, side)][i]] = held
                h, fl = bracket[(f, side)]
                bracket[(f, side)] = (i, fl) if held else (h, i)
        unknown = dict.fromkeys(("low", "high", "flips_low", "flips_high"))
        for f in factors:
            self.sensitivity[f] = {"value": best["fitted"][f]["value"], "share": best["fitted"][f]["share"],
                                   **(order_holds(keeps[f]) if resolved or f in idle else unknown),
                                   "resolved": resolved or f in idle,
                                   "on": "the screening sample" if self.sample is not None else "the whole workload"}

    def _holds(self, best: dict[str, Any], runner: dict[str, Any], settings: Settings,
               scales: list[tuple[tuple[str, float], ...]]) -> list[bool | None]:
        """For each set of scaled factors, whether the recommended layout still prices at least
        as well as its runner-up (None: either could not be priced)."""
        tasks = []
        for scale in scales:
            for row in (best, runner):
                # NOTE: a scaled factor moves the goodput by a fraction: its rate search starts
                # at the unscaled rate, at every scale and unscaled alike (the start decides how
                # many runs it takes, and where in its bracket the rate is found)
                tasks.append((row["raw"], self.prepare, replace(settings, scale=scale), row.get("goodput_req_s")))
        values: dict[int, float | None] = {}
        for j, result in parallel(tasks, self.jobs):
            self.progress.advance()
            values[j] = None if result.get("error") else self.objective.value(measures_of(result))
        out: list[bool | None] = []
        for n in range(len(scales)):
            a, b = values.get(2 * n), values.get(2 * n + 1)
            out.append(None if a is None or b is None else self.objective.key(a) <= self.objective.key(b))
        return out


def _share(row: dict[str, Any], factor: str) -> float | None:
    """The share of the row's time that ``factor`` prices (None: not priced)."""
    return ((row.get("fitted") or {}).get(factor) or {}).get("share")


def _next_scale(held: int, flipped: int | None, n: int) -> int | None:
    """The grid index to price next on a side of ``n`` scales (index -1: scale 1, where the
    order holds), or None when the first flip is found or the side holds to its end."""
    if flipped is None:
        return n - 1 if held < n - 1 else None
    return (held + flipped) // 2 if flipped - held > 1 else None


def order_holds(keeps: dict[float, bool]) -> dict[str, float | None]:
    """From scale 1 outwards, how far the order holds: ``low``/``high`` the last scale it
    holds at on each side, ``flips_low``/``flips_high`` the first where it does not (None:
    it holds to the end of the grid)."""
    out: dict[str, float | None] = {"low": 1.0, "high": 1.0, "flips_low": None, "flips_high": None}
    for side, scales in (("low", sorted((s for s in keeps if s < 1), reverse=True)),
                         ("high", sorted(s for s in keeps if s > 1))):
        for s in scales:
            if keeps[s]:
                out[side] = s
            else:
                out[f"flips_{side}"] = s
                break
    return out


def measures_of(row: dict[str, Any]) -> dict[str, Any]:
    return {"ttft_s": row.get("ttft_p90_s"), "tpot_s": row.get("tpot_p90_s"), "gpus": row.get("gpus"),
            "throughput_per_gpu": row.get("throughput_per_gpu"), "goodput_per_gpu": row.get("goodput_per_gpu")}


def tie_break(row: dict[str, Any]) -> tuple[Any, ...]:
    """Among equal objectives, the better on the other measures first (TTFT, TPOT, goodput,
    throughput, GPUs; a missing one last); among layouts that price the same, the one with
    the fewest settings away from their defaults, then by its command line. NOTE: without the
    last two, equal rows kept the order the workers finished in: two runs of one search could
    recommend different layouts."""
    m = measures_of(row)
    inf = float("inf")
    lower = [m[k] if m[k] is not None else inf for k in ("ttft_s", "tpot_s")]
    higher = [-m[k] if m[k] is not None else inf for k in ("goodput_per_gpu", "throughput_per_gpu")]
    layout = row["layout"]
    dims = tuple(d for d in ALL_DIMS if layout.get(d.name, KeyError) is not KeyError)
    return (*lower, *higher, m["gpus"] if m["gpus"] is not None else inf, len(layout.overrides(dims)),
            layout.label(dims))


def _close(a: float | None, b: float | None, rel: float = 1e-9) -> bool:
    if a is None or b is None:
        return a is b
    return abs(a - b) <= rel * max(abs(a), abs(b), 1e-30)


def same_price(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two layouts whose every measure is equal (they differ only where nothing is priced)."""
    ma, mb = measures_of(a), measures_of(b)
    return all(_close(ma[k], mb[k]) for k in ma)
