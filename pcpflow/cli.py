"""``python -m pcpflow [overrides]``: the driver.

1. Every job's config is composed and validated *before* Hydra starts anything (for a
   multirun, every combination), so a bad value is one clear report and exit code 2,
   with no rank started and no traceback.
2. Hydra then runs the job(s): each composes, writes its frozen config and starts its
   own ranks (``pcpflow.job``); a callback writes the sweep report.
3. Under torchrun / srun (RANK and WORLD_SIZE set) this process *is* a rank: rank 0
   composes and validates, broadcasts the config, and every rank runs the engine.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path
from typing import Any

from pcpflow.compose import compose_raw, validate_overrides
from pcpflow.compose import config_groups as _config_groups  # noqa: F401  (tests, scripts)
from pcpflow.compose import is_hydra_override as _is_hydra_override
from pcpflow.errors import EXIT_INVALID_CONFIG, EXIT_OK, ConfigError, Problem
from pcpflow.paths import conf_dir

_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                     "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_NO_RUN_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version",
                 "--shell-completion", "-sc", "--resolve"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return torchrun_main(argv)
    if "--help" in argv or "-h" in argv:
        from pcpflow.help import help_text

        print(help_text())
        return EXIT_OK
    overrides, multirun, no_run = split_args(argv)
    # NOTE: `--cfg job` shows what a run would run: it is validated like one.
    if not no_run or any(a.split("=", 1)[0] in ("--cfg", "-c") for a in argv):
        try:
            precheck(overrides, multirun)
        except ConfigError as exc:
            print(exc.report(), file=sys.stderr)
            return EXIT_INVALID_CONFIG
    return run_hydra(argv)


def split_args(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(config overrides, is multirun, is a Hydra info command that runs no job)."""
    overrides, skip = [], False
    multirun = no_run = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            no_run |= flag in _NO_RUN_FLAGS
            skip = flag in _FLAGS_WITH_VALUE and "=" not in arg
        else:
            overrides.append(arg)
    return overrides, multirun, no_run


# ---------------------------------------------------------------------------- precheck
def precheck(overrides: list[str], multirun: bool) -> None:
    """Compose and validate every job the command line describes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        parsed = OverridesParser.create().parse_overrides(
            [o for o in overrides if not _is_hydra_override(o)]
        )
    except OverrideParseException as exc:
        raise ConfigError([Problem("<command line>", " ".join(overrides), str(exc).strip())]) from None
    choices: list[list[str]] = []
    swept: list[bool] = []
    for o in parsed:
        swept.append(o.is_sweep_override())
        if o.is_sweep_override():
            if not multirun:
                raise ConfigError(
                    [Problem(o.get_key_element(), o.input_line.split("=", 1)[-1], "a sweep of values needs -m / --multirun")]
                )
            choices.append([_override_line(o, v) for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    jobs = list(itertools.product(*choices)) or [()]
    problems: list[Problem] = []
    for job in jobs:
        try:
            validate_overrides(list(job))
        except ConfigError as exc:
            # A job is named by its swept values only: what tells it apart from the others.
            label = " ".join(o for o, is_swept in zip(job, swept) if is_swept)
            for p in exc.problems:
                problems.append(Problem(f"[{label}] {p.field}" if len(jobs) > 1 else p.field, p.given, p.allowed))
    if problems:
        raise ConfigError(_dedupe(problems))


def _override_line(o: Any, value: str) -> str:
    prefix = {"ADD": "+", "FORCE_ADD": "++", "DEL": "~"}.get(o.type.name, "")
    key = o.get_key_element()
    return f"{prefix}{key}={value}"


def _dedupe(problems: list[Problem]) -> list[Problem]:
    seen, out = set(), []
    for p in problems:
        key = str(p)
        if key not in seen:
            seen.add(key)
            out.append(p)
    return out


# ---------------------------------------------------------------------------- hydra run
_EXIT_CODES: list[int] = []


def run_hydra(argv: list[str]) -> int:
    import hydra

    _EXIT_CODES.clear()
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pcpflow", *argv]
    try:
        hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(_task)()
    finally:
        sys.argv = saved
    return max(_EXIT_CODES, default=EXIT_OK)


def _task(cfg: Any) -> int:
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from pcpflow.job import run_job

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    run_dir = Path(HydraConfig.get().runtime.output_dir)
    code = run_job(raw, run_dir)
    _EXIT_CODES.append(code)
    return code


# ---------------------------------------------------------------------------- torchrun
def torchrun_main(argv: list[str]) -> int:
    """This process is one rank of an externally launched job."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from pcpflow.engine import run_rank
    from pcpflow.job import prepare_job, write_result
    from pcpflow.launch import write_frozen_config
    from pcpflow.stage import load_stage_sources

    overrides, multirun, _ = split_args(argv)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    payload: list[Any] = [None]
    if rank == 0:
        try:
            if multirun:
                raise ConfigError([Problem("--multirun", True, "not available under torchrun; run sweeps with python -m pcpflow -m")])
            raw = compose_raw([o for o in overrides if not _is_hydra_override(o)])
            cfg = prepare_job(raw)
            if cfg.world_size != world:
                raise ConfigError(
                    [Problem("pcp", cfg.pcp, f"tp*pcp = {cfg.world_size} must equal the {world} ranks torchrun started")]
                )
            run_dir = _torchrun_run_dir(overrides)
            write_frozen_config(cfg, run_dir)
            payload = [{"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir)}]
        except ConfigError as exc:
            payload = [{"error": exc.report()}]
    dist.broadcast_object_list(payload, src=0)
    job = payload[0]
    if "error" in job:
        if rank == 0:
            print(job["error"], file=sys.stderr)
        dist.destroy_process_group()
        return EXIT_INVALID_CONFIG
    from pcpflow.config import parse_run_config

    cfg = parse_run_config(job["config"])
    load_stage_sources(cfg.plugins)
    run_dir = Path(job["run_dir"])
    try:
        sections = run_rank(cfg, run_dir)
    except Exception as exc:
        if rank == 0:
            write_result(run_dir, {"status": "failed", "error": f"rank 0 failed: {type(exc).__name__}: {exc}",
                                   "config": job["config"], "exit_code": 1})
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    if rank != 0:
        return EXIT_OK
    from pcpflow.report import print_summary

    verify = sections.get("verify") if sections else None
    ok = verify is None or verify["passed"]
    result = {"status": "ok" if ok else "failed", "exit_code": 0 if ok else 1, "config": job["config"],
              **(sections or {}), "run_dir": str(run_dir), "launcher": "external (torchrun)"}
    write_result(run_dir, result)
    print_summary(result)
    return result["exit_code"]


def _torchrun_run_dir(overrides: list[str]) -> Path:
    """``hydra.run.dir`` as a plain run resolves it. Only that node is resolved: the rest of
    Hydra's own config (a sweep's ``${hydra.job.num}``) exists only inside a Hydra run."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    for o in overrides:
        if o.startswith("hydra.run.dir="):
            return Path(o.split("=", 1)[1])
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(
            config_name="config",
            overrides=[o for o in overrides if not _is_hydra_override(o)],
            return_hydra_config=True,
        )
        return Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
