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
            _check_output_dir(overrides, multirun)
        except ConfigError as exc:
            print(exc.report(), file=sys.stderr)
            return EXIT_INVALID_CONFIG
    return run_hydra(argv)


def _check_output_dir(overrides: list[str], multirun: bool) -> None:
    """A run / sweep dir given on the command line must be creatable and not held by a live
    run (Hydra would write its .hydra/ files into it, or fail with a traceback, first)."""
    from pcpflow.checks import check_run_dir
    from pcpflow.rundir import live_lock_owner

    key = "hydra.sweep.dir=" if multirun else "hydra.run.dir="
    given = [o.split("=", 1)[1] for o in overrides if o.startswith(key)]
    if not given or "${" in given[-1]:
        return
    path = Path(given[-1])
    check_run_dir(path, create=False)
    owner = None if multirun else live_lock_owner(path)
    if owner is not None:
        raise ConfigError([Problem("hydra.run.dir", str(path), f"a run dir no live run uses; pid {owner} is running in it")])


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

    from pcpflow.signals import Interrupted

    _EXIT_CODES.clear()
    _SWEEP_DIR.clear()
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pcpflow", *argv]
    try:
        hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(_task)()
    except Interrupted as exc:
        # NOTE: the sweep stops here (Hydra's launcher would run the remaining jobs on);
        # the report lists the jobs that ran, the interrupted one as failed.
        if _SWEEP_DIR:
            from pcpflow.sweep import write_sweep_report

            rows = write_sweep_report(Path(_SWEEP_DIR[0]))
            print(f"pcpflow: sweep interrupted after {len(rows)} job(s)", file=sys.stderr)
        return exc.exit_code
    finally:
        sys.argv = saved
    return max(_EXIT_CODES, default=EXIT_OK)


_SWEEP_DIR: list[str] = []


def _task(cfg: Any) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from pcpflow.job import run_job
    from pcpflow.signals import Interrupted

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    hc = HydraConfig.get()
    if hc.mode == RunMode.MULTIRUN and not _SWEEP_DIR:
        _SWEEP_DIR.append(str(hc.sweep.dir))
    run_dir = Path(hc.runtime.output_dir)
    code = run_job(raw, run_dir)
    _EXIT_CODES.append(code)
    if code - 128 in (2, 15):  # SIGINT, SIGTERM
        raise Interrupted(code - 128)
    return code


# ---------------------------------------------------------------------------- torchrun
def torchrun_main(argv: list[str]) -> int:
    """This process is one rank of an externally launched job (``pcpflow.bootstrap``):
    rank 0 composes and checks the config, every rank runs the engine."""
    from pcpflow.bootstrap import torchrun_rank

    overrides, multirun, _ = split_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    return torchrun_rank(lambda: _torchrun_job(overrides, multirun, world))


def _torchrun_job(overrides: list[str], multirun: bool, world: int) -> dict[str, Any]:
    from pcpflow.checks import check_run_dir
    from pcpflow.job import prepare_job
    from pcpflow.rundir import failed_result, write_frozen_config, write_result

    run_dir = None
    try:
        if multirun:
            raise ConfigError([Problem("--multirun", True, "not available under torchrun; run sweeps with python -m pcpflow -m")])
        raw = compose_raw([o for o in overrides if not _is_hydra_override(o)])
        run_dir = _torchrun_run_dir(overrides)
        check_run_dir(run_dir)
        cfg = prepare_job(raw)
        if cfg.world_size != world:
            raise ConfigError(
                [Problem("pcp", cfg.pcp, f"tp*pcp = {cfg.world_size} must equal the {world} ranks torchrun started")]
            )
    except ConfigError as exc:
        if run_dir is not None and run_dir.is_dir():
            write_result(run_dir, failed_result(exc.report(), {"overrides": overrides}, EXIT_INVALID_CONFIG))
        return {"error": exc.report(), "exit_code": EXIT_INVALID_CONFIG}
    write_frozen_config(cfg, run_dir)
    return {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir)}


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
