"""One job: validate everything, start the ranks, write ``result.json``.

Validation happens entirely before any rank starts: the run config (pydantic +
cross-field rules), every stage's config (after importing plugins), and the workload
(trace readable, every request fits the KV cache). Problems are reported together,
exit code 2.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import time
from pathlib import Path
from typing import Any

from pcpflow import __version__
from pcpflow.config.run import RunConfig, validate_run_config
from pcpflow.driver.launch import RankFailure, launch_ranks, print_err
from pcpflow.errors import EXIT_FAILED, EXIT_INVALID_CONFIG, ConfigError, Problem
from pcpflow.output.console import ConsoleGone
from pcpflow.output.rundir import (
    RESULT_FILE,
    discard_result,
    failed_result,
    live_lock_owner,
    progress_of,
    release_lock,
    result_of,
    take_lock,
    write_frozen_config,
    write_refusal,
    write_result,
)
from pcpflow.rank.progress import in_flight
from pcpflow.signals import Interrupted, interruptible, raise_if_swallowed
from pcpflow.tokens.text import tokenize_workload


def prepare_job(raw: dict[str, Any], *, kind: str | None = None) -> RunConfig:
    """The validated config of one job; raises ConfigError with every problem found
    (``pcpflow.driver.checks``: the run config, its stages, workload, sizes, checkpoint, seeds).
    ``kind``: "execute" or "simulate" (default: the config's ``mode``)."""
    if raw.get("mode") == "search":  # every layout validated as its own mode=simulate run (pcpflow.search.plan)
        from pcpflow.search.plan import plan_search

        return plan_search(raw, prepare_job).config
    placeholders: frozenset[str] = frozenset()
    raw = load_measured_hardware(raw)
    workload = raw.get("workload")
    if isinstance(workload, dict) and workload.get("kind") == "trace" and workload.get("path"):
        from pcpflow.scheduling.trace import read_once

        raw = {**raw, "workload": {**workload, "path": read_once(workload["path"])}}  # a pipe is read once
    derived: frozenset[str] = frozenset()
    if raw.get("mode") == "simulate":  # a model card's defaults, hardware sizes (docs/simulate.md)
        from pcpflow.simulate.prepare import prepare_raw, unset_derived

        derived = frozenset(unset_derived(raw))
        raw, placeholders = prepare_raw(raw)
    try:
        cfg = _prepared(raw, kind)
    except ConfigError as exc:
        # NOTE: a derived setting is not the user's problem where its inputs are named (a request
        # larger than the HBM left makes the derived kv.num_blocks too small for it as well),
        # and one holding a placeholder never is.
        kept = [p for p in exc.problems if p.field not in placeholders] or exc.problems
        raise ConfigError([p for p in kept if p.field not in derived] or kept) from None
    if placeholders:  # nothing said why they could not be derived: never run on a placeholder
        raise ConfigError([Problem(f, None, "could not be derived from the hardware and workload; set it") for f in sorted(placeholders)])
    return cfg


def load_measured_hardware(raw: dict[str, Any]) -> dict[str, Any]:
    """``hardware=measured hardware.path=FILE``: the file's values under ``hardware``, the
    command line's other ``hardware.*`` on top (ConfigError naming the file's problem)."""
    from pcpflow.config.hardware import load_profile

    hw = raw.get("hardware")
    if not (isinstance(hw, dict) and "path" in hw):
        return raw
    try:
        values = load_profile(hw.get("path"))
    except ValueError as exc:
        raise ConfigError([Problem("hardware.path", hw.get("path"), str(exc))]) from None
    return {**raw, "hardware": _merged(values, {k: v for k, v in hw.items() if k != "path"})}


def _merged(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _prepared(raw: dict[str, Any], kind: str | None) -> RunConfig:
    from pcpflow.driver.checks import check_job, feature_problems

    cfg, problems = validate_run_config(raw, rules=feature_problems)
    if cfg is None:
        raise ConfigError(problems)
    try:
        cfg = tokenize_workload(cfg)
    except ConfigError as exc:
        raise ConfigError(problems + exc.problems) from None
    if hasattr(cfg.workload, "text_problems"):
        problems += cfg.workload.text_problems()
    try:
        cfg = check_job(cfg, raw, kind=kind)
    except ConfigError as exc:
        # NOTE: a setting already in error is not judged again by the job's checks
        refused = {p.field for p in problems}
        problems += [p for p in exc.problems if p.field not in refused]
    if problems:
        raise ConfigError(problems)
    if cfg.sampling.repetition_penalty is None:  # the checkpoint's, recorded in the run's config
        cfg = cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update={"repetition_penalty": cfg.repetition_penalty})})
    return cfg


def run_job(raw: dict[str, Any], run_dir: Path, *, console: bool = True, in_sweep: bool = False,
            overrides: list[str] | None = None) -> int:
    """Validate, launch, record. Returns the exit code (0 ok, 1 failed, 2 invalid,
    130 / 143 interrupted; a sweep says that last one itself)."""
    from pcpflow.driver.checks import check_run_dir

    try:
        check_run_dir(run_dir)
    except ConfigError as exc:  # no run dir to write result.json into
        print_err(exc.report())
        return EXIT_INVALID_CONFIG
    owner = live_lock_owner(run_dir)
    if owner is not None:  # that run owns result.json and metrics.jsonl: leave them alone
        print_err(ConfigError([Problem("hydra.run.dir", str(run_dir), f"a run dir no live run uses; pid {owner} is running in it")]).report())
        return EXIT_INVALID_CONFIG
    take_lock(run_dir)
    try:
        with interruptible():
            return _run_job(raw, run_dir, console=console, in_sweep=in_sweep, overrides=overrides)
    except Interrupted as exc:
        return _interrupted(exc, raw, run_dir, announce=not in_sweep)
    except ConsoleGone as exc:  # NOTE: stdout took no more (``| head``, ``> /dev/full``): a finished run's result stands
        with contextlib.suppress(OSError, ValueError):
            return int(json.loads((run_dir / RESULT_FILE).read_text())["exit_code"])
        with contextlib.suppress(OSError):
            write_result(run_dir, failed_result(f"the console could not be written ({exc.strerror or exc}) before the "
                                                "run ended", raw, EXIT_FAILED))
        return EXIT_FAILED
    except OSError as exc:  # the run dir went away, filled up or turned read-only mid-run
        if not _run_dir_fault(exc, run_dir):
            return _driver_failed(exc, raw, run_dir)
        where = exc.filename2 or exc.filename or run_dir  # os.replace names its target second
        print_err(f"pcpflow: the run dir {run_dir} cannot be written: {exc.strerror or exc} ({where}); the run stopped")
        with contextlib.suppress(OSError):
            write_result(run_dir, failed_result(f"the run dir cannot be written: {exc}", raw, EXIT_FAILED))
        return EXIT_FAILED
    except Exception as exc:  # NOTE: the driver's own fault (a launcher's limit, a bug): still one line and result.json
        interrupted = Interrupted.of(exc)  # NOTE: or a library's error that replaced our Interrupted (nested: not converted)
        if interrupted is not None:
            return _interrupted(interrupted, raw, run_dir, announce=not in_sweep)
        return _driver_failed(exc, raw, run_dir)
    finally:
        release_lock(run_dir)


_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO, errno.EFBIG})


def _run_dir_fault(exc: OSError, run_dir: Path) -> bool:
    """Whether ``exc`` is the run dir's (a file of it gone, full, read-only), not the driver's own
    (a launcher's limit, a pipe): a file it names lies in the run dir, or, naming none (a write's
    flush), it is a storage error."""
    names = [os.path.abspath(os.fsdecode(n)) for n in (exc.filename, exc.filename2) if n is not None]
    if not names:
        return exc.errno in _STORAGE_ERRNOS
    top = os.path.abspath(run_dir)
    return any(os.path.commonpath([n, top]) == top for n in names)


def _driver_failed(exc: Exception, raw: dict[str, Any], run_dir: Path) -> int:
    """An error no stage or rank reported, raised in this process: one line naming it, its
    traceback in ``logs/driver_error.txt``, result.json ``failed`` with it, exit 1."""
    import traceback

    error = f"the driver failed: {type(exc).__name__}: {exc}"
    trace = run_dir / "logs" / "driver_error.txt"
    try:
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(traceback.format_exc())
        where = f"; traceback: {trace}"
    except OSError:
        where = ""
    print_err(f"pcpflow: {error}{where}; result.json: {run_dir / 'result.json'}")
    with contextlib.suppress(OSError):
        write_result(run_dir, failed_result(error, raw, EXIT_FAILED, run_dir=str(run_dir)))
    return EXIT_FAILED


def _interrupted(exc: Interrupted, raw: dict[str, Any], run_dir: Path, *, announce: bool, note: str = "",
                 started: bool = True, **extra: Any) -> int:
    """``started``: the run dir is this run's (its config valid, an older result discarded);
    before that, an older run's result.json is kept aside, as a refused command keeps it."""
    error = str(exc) if started else f"{exc} before the run started"
    if announce:
        kept = getattr(exc, "note", None)  # what an interrupted search kept
        print_err(f"pcpflow: {error}{note}{'; ' + kept if kept else ''}; result.json: {run_dir / 'result.json'}")
    with contextlib.suppress(OSError):  # a run dir that cannot be written: the line above says it all
        (write_result if started else write_refusal)(run_dir, failed_result(error, raw, exc.exit_code, run_dir=str(run_dir),
                                                                            **extra))
    return exc.exit_code


def _run_job(raw: dict[str, Any], run_dir: Path, *, console: bool, in_sweep: bool,
             overrides: list[str] | None = None) -> int:
    from pcpflow.output.report import Progress, print_summary

    started = time.time()
    try:
        cfg = prepare_job(raw)
        raise_if_swallowed()
    except ConfigError as exc:
        print_err(exc.report())
        # NOTE: an older run's result.json is kept aside, so that its "ok" never looks current
        write_refusal(run_dir, failed_result(exc.report(), raw, EXIT_INVALID_CONFIG))
        return EXIT_INVALID_CONFIG
    except Interrupted as exc:  # validating: the dir is not this run's yet
        return _interrupted(exc, raw, run_dir, announce=not in_sweep, started=False)
    discard_result(run_dir)  # the dir is this run's now
    from pcpflow.driver.checks import capacity_warnings, generation_warnings, profile_warnings

    for warning in [*capacity_warnings(cfg), *profile_warnings(cfg), *generation_warnings(cfg)] if cfg.mode != "search" else ():
        print_err(f"pcpflow: warning: {warning}")
    if cfg.mode == "search":
        return _search(raw, run_dir, console=console, in_sweep=in_sweep, overrides=overrides, started=started)
    write_frozen_config(cfg, run_dir)
    config = cfg.model_dump(mode="json")
    try:
        if cfg.mode == "profile":
            sections = _profile(cfg, run_dir, console=console)
        else:
            with Progress(run_dir / "metrics.jsonl", enabled=console and cfg.output.progress):
                sections = launch_ranks(cfg, run_dir) if cfg.mode == "execute" else _simulate(cfg, run_dir)
    except RankFailure as exc:
        print_err(f"pcpflow: {exc}")
        if exc.details:
            print_err(exc.details.rstrip())
        write_result(run_dir, failed_result(str(exc), config, EXIT_FAILED, failed_rank=exc.rank, **in_flight(str(exc)),
                                            **_progress(cfg, run_dir)))
        return EXIT_FAILED
    except Interrupted as exc:
        return _interrupted(exc, config, run_dir, announce=not in_sweep, note=_partial_note(cfg, run_dir),
                            **_progress(cfg, run_dir))
    clocks = (sections.get("metrics") or {}).get("clocks")
    if clocks is not None:
        clocks["job_s"] = time.time() - started
    result = result_of(sections, config, run_dir=str(run_dir), started_at=started, pcpflow_version=__version__)
    write_result(run_dir, result)
    if cfg.output.plots:
        write_run_plots(cfg.mode, run_dir)
    if console:
        print_summary(result)
    return result["exit_code"]


def write_run_plots(mode: str, run_dir: Path) -> None:
    """``load.png`` and ``serving.png`` from the run dir's metrics.jsonl and result.json, once
    the run is over (pcpflow's launcher, and rank 0 of a torchrun job); a profile has none."""
    from pcpflow.output.serving_plot import write_serving_plot

    if mode == "profile":
        return
    if mode == "simulate":
        from pcpflow.simulate.plot import write_load_plot

        write_load_plot(run_dir)
    else:
        from pcpflow.output.report import write_plots

        write_plots(run_dir)
    write_serving_plot(run_dir)


def _search(raw: dict[str, Any], run_dir: Path, *, console: bool, in_sweep: bool, overrides: list[str] | None,
            started: float) -> int:
    """``mode=search``: the layouts screened and priced in this process (``pcpflow.search``);
    config.json is the search's composed config (each layout's is in search.csv)."""

    from pcpflow.output.rundir import CONFIG_FILE, dumps
    from pcpflow.search.job import run_search

    (run_dir / CONFIG_FILE).write_text(dumps(raw) + "\n")
    try:
        sections = run_search(raw, run_dir, prepare_job, overrides=overrides, console=console)
    except Interrupted as exc:
        return _interrupted(exc, raw, run_dir, announce=not in_sweep)
    result = result_of(sections, raw, run_dir=str(run_dir), started_at=started, pcpflow_version=__version__)
    write_result(run_dir, result)
    return result["exit_code"]


def _profile(cfg: RunConfig, run_dir: Path, *, console: bool) -> dict[str, Any]:
    """``mode=profile``: the run's ranks measure (``pcpflow.profile.rank.measure``) instead
    of running the engine; a bar of grid points done."""
    from pcpflow.output.report import Progress
    from pcpflow.profile.document import PROFILE_FILE
    from pcpflow.profile.rank import PROGRESS_FILE, measure

    older = run_dir / PROFILE_FILE
    if older.exists():  # NOTE: an earlier profile in this dir is set aside, never taken for this run's
        older.replace(older.with_name(f"{older.stem}.previous{older.suffix}"))
    with Progress(run_dir / PROGRESS_FILE, enabled=console and cfg.output.progress, unit="points"):
        return launch_ranks(cfg, run_dir, work=measure)


def _progress(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    """How far a run that did not finish got (its steps: ``metrics.jsonl``); a profile says it itself."""
    return {} if cfg.mode == "profile" else progress_of(run_dir)


def _partial_note(cfg: RunConfig, run_dir: Path) -> str:
    """What an interrupted profile kept (rank 0 rewrites it after every section)."""
    if cfg.mode != "profile":
        return ""
    from pcpflow.profile.document import PROFILE_FILE

    path = run_dir / PROFILE_FILE
    return f"; kept what was measured: {path} (partial)" if path.exists() else ""


def _simulate(cfg: RunConfig, run_dir: Path) -> dict[str, Any]:
    if cfg.disagg.enabled:  # a prefill pool and a decode pool
        from pcpflow.simulate.pools import pooled_run

        return pooled_run(cfg, run_dir)
    from pcpflow.simulate.engine import simulate_run

    return simulate_run(cfg, run_dir)

