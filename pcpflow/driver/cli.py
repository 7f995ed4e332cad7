"""``python -m pcpflow [overrides]``: the driver.

1. Every job's config is composed and validated *before* Hydra starts anything (for a
   multirun, every combination), so a bad value is one clear report and exit code 2,
   with no rank started and no traceback.
2. Hydra then runs the job(s): each composes, writes its frozen config and starts its
   own ranks (``pcpflow.driver.job``); a callback writes the sweep report.
3. Under torchrun / srun (RANK and WORLD_SIZE set) this process *is* a rank: rank 0
   composes and validates, broadcasts the config, and every rank runs the engine.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from pcpflow.driver.compose import (
    SWEEP_NEEDS_MULTIRUN,
    compose_raw,
    hydra_problems,
    syntax_problems,
    uses_measured,
    validate_overrides,
    with_measured_overrides,
    with_searched_groups,
)
from pcpflow.driver.compose import is_hydra_override as _is_hydra_override
from pcpflow.driver.interrupted import interrupted_before_the_job, interrupted_early, named_run_dir
from pcpflow.errors import EXIT_FAILED, EXIT_INVALID_CONFIG, EXIT_OK, ConfigError, Problem
from pcpflow.output.console import ConsoleGone, guard_console
from pcpflow.paths import conf_dir
from pcpflow.signals import HANDLED, Interrupted, interruptible, raise_if_swallowed

_FLAGS_WITH_VALUE = {"--cfg", "-c", "--package", "-p", "--info", "-i", "--config-path", "-cp",
                     "--config-name", "-cn", "--config-dir", "-cd", "--experimental-rerun"}
_NO_RUN_FLAGS = {"--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--version",
                 "--shell-completion", "-sc", "--resolve"}


def entry() -> None:
    """The process entry point (``python -m pcpflow``, the ``pcpflow`` script)."""
    import logging

    # NOTE: a log line (Hydra's, to stdout) that cannot be written is dropped, not a traceback on
    # stderr: a closed pipe (``| head``) is what it meets
    logging.raiseExceptions = False
    guard_console()
    try:
        code = main()
    except ConsoleGone as exc:  # NOTE: stdout took no more (``| head``, ``> /dev/full``) of what a command prints
        code = 128 + signal.SIGPIPE if exc.errno == errno.EPIPE else EXIT_FAILED  # NOTE: as SIGPIPE would end it
    # NOTE: the job is over and result.json written: a signal in the last moments of the
    # interpreter's teardown must not turn a finished run's exit code into 130.
    for s in HANDLED:
        signal.signal(s, signal.SIG_IGN)
    sys.exit(code)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # NOTE: first thing, so that a Ctrl-C during imports, validation or between a sweep's jobs
    # ends as one during the steps does: one line, exit 130 / 143 / 129, result.json where it can.
    with interruptible():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            try:
                return torchrun_main(argv)
            except BaseException as exc:  # importing torch and the engine, before the rank's own handling
                if (interrupted := Interrupted.of(exc)) is None:
                    raise
                return interrupted_early(interrupted, argv)
        run_dir: list[Path] = []
        try:
            return _main(argv, run_dir)
        except BaseException as exc:
            # NOTE: also a library's error that replaced our Interrupted on its way out (numpy's
            # half-done import, Hydra's or OmegaConf's cleanup): ``Interrupted.of``. Before Hydra
            # resolved the run dir (its import takes a while), the one the command names
            # outright is the run's.
            if (interrupted := Interrupted.of(exc)) is None:
                raise
            return interrupted_before_the_job(interrupted, run_dir[0] if run_dir else named_run_dir(argv))


def _main(argv: list[str], run_dir: list[Path]) -> int:
    """``run_dir`` receives the run dir a single run will use, as soon as it is known."""
    _PLANNED_JOBS.clear()
    if _help_or_version(argv):
        return EXIT_OK
    if problems := _hydra_flag_problems(argv):
        print(ConfigError(problems + _config_problems(argv)).report(), file=sys.stderr)
        return EXIT_INVALID_CONFIG
    argv = with_searched_groups(argv)
    overrides, multirun, no_run = split_args(argv)
    # NOTE: `--cfg job` shows what a run would run: it is validated like one.
    if not no_run or any(a.split("=", 1)[0] in ("--cfg", "-c") for a in argv):
        try:
            if not (multirun or no_run):
                run_dir.append(planned_run_dir(overrides))
                if "${" in (_named_run_dir(overrides) or "${"):  # Hydra would resolve it again, later
                    argv = [a for a in argv if not a.startswith("hydra.run.dir=")] + [f"hydra.run.dir={run_dir[0]}"]
            precheck(overrides, multirun)
            _check_package(argv, overrides)
            _check_output_dir(overrides, multirun)
            raise_if_swallowed()
        except ConfigError as exc:
            print(exc.report(), file=sys.stderr)
            if run_dir and run_dir[0].is_dir():
                _record_refusal(run_dir[0], exc, overrides)
            return EXIT_INVALID_CONFIG
    argv = with_measured_overrides(argv)
    if no_run and _shows_job(argv) and uses_measured(overrides):
        return _print_job(overrides, _flag_value(argv, ("--package", "-p")))
    return run_hydra(argv)


def _config_problems(argv: list[str]) -> list[Problem]:
    """The config's problems, listed beside the flags' (none where a config of one's own is named:
    its overrides are not pcpflow's to check)."""
    if any(a.partition("=")[0] in _OWN_CONFIG or a.partition("=")[0] in _OWN_CONFIG.values() for a in argv):
        return []
    overrides, multirun, _ = split_args(with_searched_groups(argv))
    try:
        precheck(overrides, multirun)
    except ConfigError as exc:
        return exc.problems
    return []


def _help_or_version(argv: list[str]) -> bool:
    """``--help`` / ``--version``: pcpflow's own (Hydra's would describe its app), printed."""
    if "--help" in argv or "-h" in argv:
        from pcpflow.driver.help import help_text

        print(help_text())
        return True
    if "--version" in argv:  # NOTE: pcpflow's, and what it runs on (Hydra would print its own)
        import hydra
        import torch

        from pcpflow import __version__

        print(f"pcpflow {__version__} (torch {torch.__version__}, hydra {hydra.__version__}, "
              f"python {sys.version.split()[0]})")
        return True
    return False


def _flag_value(argv: list[str], names: tuple[str, ...]) -> str | None:
    """The last value given to a flag (``-p kv`` or ``--package=kv``; ``''``: none where one is
    needed; None: not given, or ``--info`` without one)."""
    value = None
    for i, a in enumerate(argv):
        name, eq, v = a.partition("=")
        if name in names:
            following = argv[i + 1] if i + 1 < len(argv) else None
            value = v if eq else (following if _takes_next(a, following) else
                                  None if _optional_choices(name) else "")
    return value


def _check_package(argv: list[str], overrides: list[str]) -> None:
    """``--cfg job -p PACKAGE`` shows a part of the config that exists (Hydra: exit 1)."""
    package = _flag_value(argv, ("--package", "-p"))
    if package is not None and _shows_job(argv):
        _package_of(_job_config(overrides), package)


def _job_config(overrides: list[str]) -> dict[str, Any]:
    """What ``--cfg job`` shows: the composed job, a measured profile's values under ``hardware``."""
    raw = compose_raw([o for o in overrides if not _is_hydra_override(o)])
    if not uses_measured(overrides):
        return raw
    from pcpflow.driver.job import load_measured_hardware

    return load_measured_hardware(raw)


def _package_of(node: Any, package: str) -> Any:
    """The part of ``node`` at the dotted ``package`` (``_global_``: all of it), or a problem naming it."""
    for part in [p for p in package.split(".") if p and p != "_global_"]:
        if not isinstance(node, dict) or part not in node:
            inside = ", ".join(sorted(node)) if isinstance(node, dict) else "none (a value)"
            raise ConfigError([Problem("--package", package, f"a key of the job's config; at {part!r} its keys "
                                       f"are: {inside}")])
        node = node[part]
    return node


_OWN_CONFIG = {
    "--config-dir": "-cd", "--config-path": "-cp", "--config-name": "-cn", "--experimental-rerun": None,
}
_OWN_CONFIG_INSTEAD = (
    "not taken: pcpflow validates every run against its own conf/ (its groups, its options, their "
    "settings); your own model: model=hf model.path=DIR, hardware: hardware=measured hardware.path=FILE, "
    "stages: plugins=[module] (docs/writing-stages.md), any setting: key=value"
)


def _hydra_flag_problems(argv: list[str]) -> list[Problem]:
    """Hydra's flags used as pcpflow cannot take them: a problem each (Hydra would raise a
    traceback, exit 1, or compose a config pcpflow never validated)."""
    flags = {a.partition("=")[0] for a in argv if a.startswith("-")}
    problems = [Problem(long, _flag_value(argv, (long, short) if short else (long,)), _OWN_CONFIG_INSTEAD)
                for long, short in _OWN_CONFIG.items() if flags & {long, short}]
    if "--resolve" in flags and not flags & {"--cfg", "-c", "--help", "-h"}:
        problems.append(Problem("--resolve", True, "only with --cfg (it resolves the config --cfg shows)"))
    for (long, short), (choices, optional) in _CHOICE_FLAGS.items():
        value = _flag_value(argv, (long, short)) if flags & {long, short} else None
        if value is not None and value not in choices:
            order = "" if optional else f": the word after {long} is its value ({long} {choices[0]} pcp=2)"
            problems.append(Problem(long, value, f"one of {', '.join(choices)}{order}"))
    problems += [Problem(flag, True, _NOT_A_FLAG + _near(flag)) for flag in _unknown_flags(argv)]
    return [p for p in (*problems, _one_command_problem(argv), _shell_completion_problem(argv)) if p]


_KNOWN_FLAGS = _FLAGS_WITH_VALUE | _NO_RUN_FLAGS | {"--run", "-r", "--multirun", "-m", "--"}
_NOT_A_FLAG = "not a flag of pcpflow: key=value overrides (python -m pcpflow --help)"


def _unknown_flags(argv: list[str]) -> list[str]:
    """The words that look like flags and are none of Hydra's (argparse printed its usage and
    "unrecognized arguments"; a shortened ``--multi`` it took for ``--multirun``, unseen by the
    precheck). A flag's value (``-p kv``) is not one."""
    unknown, value = [], False
    for arg, following in zip(argv, [*argv[1:], None]):
        if not value and arg.startswith("-") and arg.partition("=")[0] not in _KNOWN_FLAGS:
            unknown.append(arg.partition("=")[0])
        value = not value and _takes_next(arg, following)
    return list(dict.fromkeys(unknown))


def _near(flag: str) -> str:
    """``; did you mean --multirun?`` where a flag is close to one of Hydra's."""
    import difflib

    close = difflib.get_close_matches(flag, sorted(f for f in _KNOWN_FLAGS if f.startswith("--")), n=1, cutoff=0.75)
    starts = [f for f in sorted(_KNOWN_FLAGS) if f.startswith("--") and len(flag) > 2 and f.startswith(flag)]
    near = starts[:1] or close
    return f"; did you mean {near[0]}?" if near else ""


_CHOICE_FLAGS = {("--cfg", "-c"): (("job", "hydra", "all"), False),
                 ("--info", "-i"): (("all", "config", "defaults", "defaults-tree", "plugins", "searchpath"), True)}
"""Hydra's flags with a fixed choice (argparse: an error and its usage over a dozen lines), and
whether the value may be left out (then only one of the choices is taken for it)."""


def _takes_next(arg: str, following: str | None) -> bool:
    """Whether flag ``arg`` takes the word after it as its value: ``--cfg job``, ``-p kv``;
    ``--info`` only a word of its choices (``pcp=2 --info config``; ``--info pcp=2`` is
    ``--info`` and an override). ``--cfg=job`` holds its own."""
    if arg not in _FLAGS_WITH_VALUE or following is None:
        return False
    choices = _optional_choices(arg)
    return choices is None or following in choices


def _optional_choices(flag: str) -> tuple[str, ...] | None:
    """The choices of a flag whose value may be left out (``--info``); None for any other flag."""
    return next((choices for pair, (choices, optional) in _CHOICE_FLAGS.items() if flag in pair and optional), None)


_COMMANDS = {"--run": "-r", "--multirun": "-m", "--cfg": "-c", "--info": "-i", "--shell-completion": "-sc"}


def _one_command_problem(argv: list[str]) -> Problem | None:
    """Hydra does one of a run, a sweep, --cfg, --info and shell completion (it raises a
    traceback for two)."""
    given = [long for long, short in _COMMANDS.items() if any(a.partition("=")[0] in (long, short) for a in argv)]
    if len(given) < 2:
        return None
    return Problem(given[0], " ".join(given), f"one of {', '.join(_COMMANDS)} at a time (Hydra does one of them)")


_SHELLS = ("bash", "fish", "zsh")


def _shell_completion_problem(argv: list[str]) -> Problem | None:
    """Hydra's shell completion takes one of install= / uninstall= / query= with a shell (it
    raises a traceback otherwise). It completes the ``pcpflow`` script's command lines: bash's
    and zsh's completion reads ``python -m pcpflow`` as a script named ``-m`` and gives nothing."""
    if not any(a in ("--shell-completion", "-sc") for a in argv):
        return None
    given = [a for a in argv if a.partition("=")[0] in ("install", "uninstall", "query")]
    if len(given) == 1 and given[0].partition("=")[2] in _SHELLS:
        return None
    return Problem("--shell-completion", " ".join(given) or None,
                   f"one of install=SHELL, uninstall=SHELL, query=SHELL; SHELL: {', '.join(_SHELLS)} "
                   "(e.g. eval \"$(pcpflow --shell-completion install=bash)\")")


def _shows_job(argv: list[str]) -> bool:
    """``--cfg job`` (or ``-c job``), as Hydra reads it."""
    return _flag_value(argv, ("--cfg", "-c")) == "job"


def _print_job(overrides: list[str], package: str | None) -> int:
    """``--cfg job [-p PACKAGE]`` with ``hardware=measured``: the job's config with the profile's
    values loaded under ``hardware`` (Hydra itself composes only the file's path)."""
    from omegaconf import OmegaConf

    node = _package_of(_job_config(overrides), package or "")
    print(OmegaConf.to_yaml(OmegaConf.create(node)) if isinstance(node, dict) else node, end="" if isinstance(node, dict) else "\n")
    return EXIT_OK


def _check_output_dir(overrides: list[str], multirun: bool) -> None:
    """A run / sweep dir given on the command line must be creatable and not held by a live
    run (Hydra would write its .hydra/ files into it, or fail with a traceback, first)."""
    from pcpflow.driver.checks import check_run_dir
    from pcpflow.output.rundir import live_lock_owner

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    given = [o.split("=", 1)[1] for o in overrides if o.startswith(key + "=")]
    if not given or "${" in given[-1]:
        return
    if not given[-1].strip():  # NOTE: Hydra would take it as the current dir and write the run there
        raise ConfigError([Problem(key, given[-1], "a directory's path (empty: none given)")])
    path = Path(given[-1])
    check_run_dir(path, create=False, field=key)
    owner = None if multirun else live_lock_owner(path)
    if owner is not None:
        raise ConfigError([Problem("hydra.run.dir", str(path), f"a run dir no live run uses; pid {owner} is running in it")])


def _named_run_dir(overrides: list[str]) -> str | None:
    """``hydra.run.dir`` as given (None: not given, or empty: refused, no dir of the run's)."""
    given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.run.dir=")]
    return given[-1] if given and given[-1].strip() else None


def _record_refusal(run_dir: Path, exc: ConfigError, overrides: list[str]) -> None:
    """An invalid command whose run dir exists leaves ``failed`` in it, so that an earlier
    run's ``ok`` there never looks current (a dir held by a live run is left alone; a dir
    that does not exist is not made: nothing starts for an invalid command)."""
    from pcpflow.output.rundir import failed_result, live_lock_owner, write_refusal

    if live_lock_owner(run_dir) is not None:
        return
    try:
        write_refusal(run_dir, failed_result(exc.report(), {"overrides": overrides}, EXIT_INVALID_CONFIG))
    except OSError:  # the report already named the run dir if that is the problem
        pass


def split_args(argv: list[str]) -> tuple[list[str], bool, bool]:
    """(config overrides, is multirun, is a Hydra info command that runs no job)."""
    overrides, skip = [], False
    multirun = no_run = False
    for arg, following in zip(argv, [*argv[1:], None]):
        if skip:
            skip = False
            continue
        if arg in ("-m", "--multirun"):
            multirun = True
        elif arg.startswith("-"):
            no_run |= arg.split("=", 1)[0] in _NO_RUN_FLAGS
            skip = _takes_next(arg, following)
        else:
            overrides.append(arg)
    return overrides, multirun, no_run


# ---------------------------------------------------------------------------- precheck
def precheck(overrides: list[str], multirun: bool) -> None:
    """Compose and validate every job the command line describes."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    ours = [o for o in overrides if not _is_hydra_override(o)]
    problems: list[Problem] = []
    try:
        parsed = OverridesParser.create().parse_overrides(ours)
    except OverrideParseException:  # NOTE: each one named; the rest of the command still checked
        refused = syntax_problems(ours)
        problems += refused.values()
        parsed = OverridesParser.create().parse_overrides([o for o in ours if o not in refused])
    choices: list[list[str]] = []
    swept: list[bool] = []
    for o in parsed:
        if o.is_sweep_override() and not multirun:  # NOTE: said, and each job it would sweep still checked
            problems.append(Problem(o.get_key_element(), o.input_line.split("=", 1)[-1], SWEEP_NEEDS_MULTIRUN))
        swept.append(o.is_sweep_override())
        if o.is_sweep_override():
            choices.append([_override_line(o, v) for v in o.sweep_string_iterator()])
        else:
            choices.append([o.input_line])
    jobs = list(itertools.product(*choices)) or [()]
    _PLANNED_JOBS[:] = [len(jobs)]
    found: list[list[Problem]] = []
    for job in jobs:
        try:
            validate_overrides(list(job))
            found.append([])
        except ConfigError as exc:
            found.append(exc.problems)
    # A problem every job has is said once; the others name their job by its swept values.
    everywhere = set.intersection(*(set(map(str, f)) for f in found)) if len(jobs) > 1 else set()
    for job, job_problems in zip(jobs, found):
        label = " ".join(o for o, is_swept in zip(job, swept) if is_swept)
        for p in job_problems:
            if str(p) in everywhere:
                problems.append(p)
            else:
                problems.append(Problem(f"[{label}] {p.field}" if len(jobs) > 1 else p.field, p.given, p.allowed))
    problems += hydra_problems([o for o in overrides if _is_hydra_override(o)])
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


def _overrides_first(argv: list[str]) -> list[str]:
    """The overrides, then Hydra's flags with their values: Hydra's argparse reads the
    overrides as one run of words, so ``pcp=4 -m dcp=1,4`` failed ("unrecognized arguments:
    dcp=1,4"), and a valueless ``--info`` before an override takes it for its value. The flags'
    meaning does not depend on where they stand."""
    flags, overrides, value = [], [], False
    for arg, following in zip(argv, [*argv[1:], None]):
        if arg == "--":  # NOTE: argparse's end of its flags: the overrides come first, so it is not needed
            continue
        if value or arg.startswith("-"):
            flags.append(arg)
            value = not value and _takes_next(arg, following)
        else:
            overrides.append(arg)
    if "--hydra-help" in flags:  # NOTE: Hydra's help on Hydra: the job's overrides are not its (a traceback)
        overrides = [o for o in overrides if _is_hydra_override(o)]
    return overrides + flags


def run_hydra(argv: list[str]) -> int:
    import hydra

    from pcpflow.driver.sweep import forget_sweep

    _EXIT_CODES.clear()
    forget_sweep()
    saved = sys.argv
    sys.argv = [saved[0] if saved else "pcpflow", *_overrides_first(argv)]
    started = time.time()
    try:
        hydra.main(config_path=conf_dir(), config_name="config", version_base=None)(_task)()
    except Interrupted as exc:
        # NOTE: the sweep stops here (Hydra's launcher would run the remaining jobs on);
        # the report lists the jobs that ran, the interrupted one as failed.
        from pcpflow.driver.sweep import close_interrupted_jobs, started_sweep, write_sweep_report

        sweep_dir = started_sweep()
        if sweep_dir is None and not _EXIT_CODES:
            raise  # NOTE: no job took it (Hydra still composing): the run dir's result says so (main)
        if sweep_dir is not None:
            close_interrupted_jobs(sweep_dir, exc)
            rows = write_sweep_report(sweep_dir, announce=False)
            report = f"; report: {sweep_dir / 'sweep.md'}" if rows else ""
            # the job(s) it stopped: one with the basic launcher, as many as ran at once with joblib
            cut = [str(_job_number(r["job"])) for r in rows if str(r.get("error", "")).startswith("interrupted")]
            during = f" and during job {cut[0]}" if len(cut) == 1 else f" and during jobs {', '.join(cut)}" if cut else ""
            planned = _PLANNED_JOBS[0] if _PLANNED_JOBS else 0
            never = f" ({planned - len(rows)} of {planned} not run)" if planned > len(rows) else ""
            print(f"pcpflow: sweep {exc} after {len(rows) - len(cut)} job(s){during}{never}{report}", file=sys.stderr, flush=True)
        return exc.exit_code
    finally:
        sys.argv = saved
    return max([*_EXIT_CODES, *_sweep_exit_codes(since=started)], default=EXIT_OK)


def _sweep_exit_codes(since: float) -> list[int]:
    """The exit codes in the result.json files this multirun's jobs wrote.

    NOTE: a parallel launcher (joblib) runs ``_task`` in worker processes, whose codes never
    reach ``_EXIT_CODES`` here: without these, a sweep whose job failed would exit 0."""
    from pcpflow.driver.sweep import started_sweep

    sweep_dir = started_sweep()
    codes = []
    for path in sweep_dir.glob("*/result.json") if sweep_dir is not None else ():
        try:
            if path.stat().st_mtime >= since - 1:
                codes.append(int(json.loads(path.read_text()).get("exit_code", EXIT_FAILED)))
        except (OSError, ValueError, TypeError, AttributeError):  # unreadable: the report says so
            codes.append(EXIT_FAILED)
    return codes


_PLANNED_JOBS: list[int] = []
"""How many jobs the command line's sweep makes (``precheck``): an interrupted sweep says how many never ran."""


def _job_number(name: str) -> int | str:
    """A job's number as the console counts (1-based; its dir is Hydra's 0-based num)."""
    return int(name) + 1 if name.isdigit() else name


def _task(cfg: Any) -> int:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode
    from omegaconf import OmegaConf

    from pcpflow.driver.job import run_job

    raw = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(raw, dict)
    raw.pop("hydra", None)
    hc = HydraConfig.get()
    run_dir = Path(hc.runtime.output_dir)
    code = run_job(raw, run_dir, in_sweep=hc.mode == RunMode.MULTIRUN, overrides=list(hc.overrides.task))
    _EXIT_CODES.append(code)
    if code - 128 in {int(s) for s in HANDLED}:  # the job was interrupted: the sweep stops too
        raise Interrupted(code - 128)
    return code


# ---------------------------------------------------------------------------- torchrun
ONE_PROCESS = {
    "search": "a search runs in one process, starting no ranks",
    "simulate": "a simulated run is one process, starting no ranks",
    "profile": "a profile starts the ranks it measures itself",
}
"""The modes pcpflow runs itself, not on ranks torchrun started, and why."""


def torchrun_main(argv: list[str]) -> int:
    """This process is one rank of an externally launched job (``pcpflow.rank.bootstrap``):
    rank 0 composes and checks the config, every rank runs the engine."""
    from pcpflow.rank.bootstrap import torchrun_rank

    if {"--help", "-h", "--version"} & set(argv):  # NOTE: said once, by rank 0; no rank starts a job
        if os.environ["RANK"] == "0":
            _help_or_version(argv)
        return EXIT_OK
    overrides, multirun, _ = split_args(argv)
    world = int(os.environ["WORLD_SIZE"])
    job: dict[str, Any] = {}  # rank 0's: the job it prepared

    def prepare() -> dict[str, Any]:
        job.update(_torchrun_job(argv, overrides, multirun, world))
        return job

    code = torchrun_rank(prepare)
    if "run_dir" in job:
        code = _torchrun_plots(job, code)
    return code


def _torchrun_plots(job: dict[str, Any], code: int) -> int:
    """Rank 0 draws the run dir's plots once every rank is done, as pcpflow's launcher does
    after its ranks: a run that finished (ok, or its verification failed), not one a rank ended."""
    from pcpflow.driver.job import write_run_plots
    from pcpflow.output.rundir import failed_result, write_result

    run_dir = Path(job["run_dir"])
    try:
        result = json.loads((run_dir / "result.json").read_text())
    except (OSError, ValueError):
        return code
    finished = "failed_rank" not in result and result.get("exit_code") in (EXIT_OK, EXIT_FAILED)
    if not (finished and job["config"]["output"]["plots"]):
        return code
    try:
        write_run_plots(job["config"]["mode"], run_dir)
    except Interrupted as exc:  # NOTE: as the launcher's run ends: interrupted, whatever the steps did
        with contextlib.suppress(OSError):
            write_result(run_dir, failed_result(str(exc), job["config"], exc.exit_code, run_dir=str(run_dir),
                                                launcher="external (torchrun)"))
        print(f"pcpflow: {exc} (rank 0); result.json: {run_dir / 'result.json'}", file=sys.stderr, flush=True)
        return exc.exit_code
    return code


def _torchrun_flag_problems(argv: list[str], multirun: bool) -> list[Problem]:
    """Hydra's flags, where Hydra does not run (torchrun starts the ranks of one run): each a
    problem, with the command that does it."""
    problems = [Problem("--multirun", True, "not available under torchrun; run sweeps with python -m pcpflow -m")
                ] if multirun else []
    hydra_flags = _FLAGS_WITH_VALUE | _NO_RUN_FLAGS | set(_COMMANDS) | set(_COMMANDS.values())
    for a in argv:
        flag = a.partition("=")[0]
        if not a.startswith("-") or flag in ("-m", "--multirun", "-r", "--run", "--"):  # NOTE: --run: what a rank does
            continue
        if flag in hydra_flags:
            given = (_flag_value(argv, (flag,)) if flag in _FLAGS_WITH_VALUE else None) or True
            problems.append(Problem(flag, given, f"not available under torchrun (Hydra does not run there): "
                                    f"python -m pcpflow {flag} ... does it"))
        else:
            problems.append(Problem(flag, True, _NOT_A_FLAG + _near(flag)))
    return problems


def _torchrun_job(argv: list[str], overrides: list[str], multirun: bool, world: int) -> dict[str, Any]:
    from pcpflow.driver.checks import check_run_dir
    from pcpflow.output.rundir import (
        discard_result,
        failed_result,
        write_frozen_config,
        write_refusal,
    )

    run_dir = None
    try:
        problems = _torchrun_flag_problems(argv, multirun)
        run_dir = planned_run_dir(overrides)
        check_run_dir(run_dir)
        mode = next((o.split("=", 1)[1] for o in reversed(overrides) if o.startswith("mode=")), None)
        if mode in ONE_PROCESS:  # NOTE: torchrun's ranks run the engine: an executed run, whatever else the config says
            raise ConfigError([*problems, Problem("mode", mode, f"{ONE_PROCESS[mode]}: python -m pcpflow mode={mode} ...; "
                                                  "torchrun starts the ranks of an executed run (mode=execute)")])
        try:  # NOTE: the driver's own check: the same problems in the same words, Hydra's settings too
            precheck(overrides, multirun)
        except ConfigError as exc:
            problems += exc.problems
        if problems:
            raise ConfigError(problems)
        cfg = validate_overrides([o for o in overrides if not _is_hydra_override(o)])
        if cfg.world_size != world:
            ranks = (f"tp*pcp = {cfg.world_size}" if not cfg.disagg.enabled else
                     f"both pools' ranks ({cfg.grid.world_size} prefill + {cfg.disagg.decode_grid.world_size} decode "
                     f"= {cfg.world_size})")
            raise ConfigError([Problem("pcp", cfg.pcp, f"{ranks} must equal the {world} ranks torchrun started")])
    except ConfigError as exc:
        if run_dir is not None and run_dir.is_dir():
            write_refusal(run_dir, failed_result(exc.report(), {"overrides": overrides}, EXIT_INVALID_CONFIG))
        return {"error": exc.report(), "exit_code": EXIT_INVALID_CONFIG}
    except Interrupted as exc:  # composing / checking: the run dir the run would use says so (an older result kept aside)
        if run_dir is not None:
            with contextlib.suppress(OSError):
                write_refusal(run_dir, failed_result(f"{exc} before the run started", {"overrides": overrides}, exc.exit_code,
                                                    run_dir=str(run_dir), launcher="external (torchrun)"))
        raise
    discard_result(run_dir)
    write_frozen_config(cfg, run_dir)
    return {"config": cfg.model_dump(mode="json"), "run_dir": str(run_dir)}


def planned_run_dir(overrides: list[str]) -> Path:
    """``hydra.run.dir`` as a plain run resolves it (``${now:...}`` now, so that the run uses
    this very dir). Only that node is resolved: the rest of Hydra's own config (a sweep's
    ``${hydra.job.num}``) exists only inside a Hydra run, and the run's own overrides may
    still be invalid."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    named = _named_run_dir(overrides)
    if named is not None:
        return Path(str(OmegaConf.create({"dir": named}).dir))
    with initialize_config_dir(config_dir=conf_dir(), version_base=None):
        cfg = compose(config_name="config", overrides=[], return_hydra_config=True)
        return Path(str(OmegaConf.select(cfg, "hydra.run.dir")))
