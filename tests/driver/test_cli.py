"""The framework end to end, through the real command line: every shipped YAML composes
and validates, bad input is one report with exit code 2 and nothing started, a crashing
rank ends the job, torchrun works. (A wheel in a clean venv: test_install.py; the
registry: test_stage.py; pipeline assembly: test_pipeline.py; composing and its messages:
test_compose.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from pcpflow.driver.cli import compose_raw
from pcpflow.driver.compose import SWEEP_NEEDS_MULTIRUN, validate_overrides
from pcpflow.driver.compose import config_groups as _config_groups
from pcpflow.driver.job import prepare_job
from pcpflow.errors import ConfigError
from pcpflow.models.card import CARD_NAMES
from pcpflow.testing import cli as in_process

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]
SMALL = ["workload.num_requests=3", "workload.output_len=[2,4]", "output.progress=false", "output.plots=false"]


def pcpflow(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 240):
    full_env = {**os.environ, "PYTHONPATH": f"{TESTS}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "pcpflow", *args],
        cwd=cwd or REPO,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(*args: str) -> tuple[int, str]:
    """``python -m pcpflow ARGS`` in this process (its exit code and stderr): what the
    driver does before any rank starts, without paying for a new Python."""
    r = in_process(*args)
    return r.returncode, r.stderr


def write_trace(path: Path, n: int = 4) -> Path:
    lines = [
        json.dumps({"timestamp": 100 * i, "input_length": 900 + 300 * i, "output_length": 300, "hash_ids": [i]})
        for i in range(n)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


# ------------------------------------------------------------------------- configs
_CARDS = CARD_NAMES  # every shipped card (conf/model/) prices simulated runs only


def test_every_shipped_yaml_composes_and_validates(tmp_path):
    import yaml
    from measured_profile import profile_dict

    (tmp_path / "hardware.yaml").write_text(yaml.safe_dump(profile_dict()))
    needs = {("workload", "trace"): [f"workload.path={write_trace(tmp_path / 't.jsonl')}"],
             # a profile mode=profile measured (here made by hand), of an executable model's dtype
             ("hardware", "measured"): [f"hardware.path={tmp_path / 'hardware.yaml'}", "dtype=float32", "model=tiny_gqa"],
             ("mode", "profile"): ["pcp=1"],
             ("mode", "search"): ["search.gpus=8", "hardware=h100_sxm", "model=llama3_8b"]}
    groups = _config_groups()
    assert {"decode", "model", "workload", "draft", "pipeline"} <= set(groups)
    checked = 0
    for group, options in groups.items():
        for option in options:
            if (group, option) == ("model", "hf"):
                continue  # needs a checkpoint directory: tests/test_hf_*.py build one
            overrides = [f"{group}={option}", *needs.get((group, option), [])]
            if group == "hardware" or (group, option) == ("mode", "simulate"):
                # NOTE: hardware profiles and model cards price simulated runs only.
                overrides += ["mode=simulate"] + ([] if (group, option) == ("hardware", "measured") else ["model=llama3_8b"])
                overrides += [] if group == "hardware" else ["hardware=h100_sxm"]
            elif option in _CARDS:
                overrides += ["mode=simulate", "tp=8", "simulate.weights_dtype=fp8", "hardware=b200"]
            cfg = prepare_job(compose_raw(overrides))
            checked += 1
            if group in ("decode", "model", "workload"):
                node = getattr(cfg, group)
                assert getattr(node, "name", None) == option or getattr(node, "kind", None) == option or getattr(
                    node, "mode", None
                ) == option
    assert checked >= 9


def test_defaults_are_the_documented_embedded_default():
    cfg = prepare_job(compose_raw([]))
    assert (cfg.pcp, cfg.dcp, cfg.tp, cfg.model.name, cfg.verify) == (2, 1, 1, "tiny_mla", True)
    assert cfg.decode.mode == "replicated" and cfg.workload.kind == "synthetic"


def test_field_errors_are_one_report_naming_field_value_and_allowed(tmp_path):
    run_dir = tmp_path / "run"
    r = pcpflow(
        "pcp=0", "decode.assignment=diagonal", "dtype=float16", "+typo_key=1", "scheduler.max_num_seqs=-1",
        f"hydra.run.dir={run_dir}",
    )
    assert r.returncode == 2, r.stderr
    err = r.stderr
    assert "Traceback" not in err and "Traceback" not in r.stdout
    assert "invalid configuration (5 problem(s))" in err
    assert "pcp: got 0; Input should be greater than or equal to 1" in err
    assert "decode.assignment: got 'diagonal'; allowed: round_robin, balanced" in err
    assert "dtype: got 'float16'; allowed: float32, float64, bfloat16 (did you mean 'bfloat16'?)" in err
    assert "typo_key: got 1; not a setting here" in err and "allowed keys:" in err
    assert "scheduler.max_num_seqs: got -1" in err
    assert not run_dir.exists(), "nothing may start for an invalid config"


def test_cross_field_rules(tmp_path):
    bad = {
        ("pcp=2", "dcp=3"): "dcp: got 3; with pcp(2) x tp(1) dcp must be one of [1, 2]",
        ("pcp=1", "dcp=2"): "dcp: got 2; with pcp=1 dcp must divide tp(1)",
        ("kv.block_size=16", "kv.interleave=5"): "kv.interleave: got 5; must divide kv.block_size=16",
        ("decode.assignment=balanced",): "'balanced' places sharded decodes",
        ("tp=3",): "tp: got 3; must divide the model's num_heads (4)",
        ("kv.num_blocks=2",): "kv.num_blocks: got 2",
        ("backend=nccl", "device=cpu"): "nccl needs device=cuda",
    }
    for overrides, message in bad.items():
        with pytest.raises(ConfigError) as exc:
            prepare_job(compose_raw(list(overrides)))
        assert message in exc.value.report(), (overrides, exc.value.report())


def test_unknown_group_option_and_key_and_sweep_without_multirun():
    code, err = cli("decode=shardd")
    assert code == 2 and "decode: got 'shardd'; allowed: replicated, sharded (did you mean 'sharded'?)" in err
    code, err = cli("typo_key=1")
    assert code == 2 and "typo_key: got 1; not a pcpflow setting; top-level settings: pcp, dcp," in err
    code, err = cli("pcp=1,2")
    assert code == 2 and "pcp: got '1,2'; a sweep of values needs -m / --multirun" in err


def test_shell_completion_of_the_pcpflow_script():
    """--help's line, as a user's bash runs it: the pcpflow script completes a group's options;
    --shell-completion without what to do is one problem, exit 2 (Hydra raised a traceback)."""
    code, err = cli("--shell-completion")
    assert code == 2 and "  - --shell-completion: got None; one of install=SHELL, uninstall=SHELL, query=SHELL;" in err
    code, err = cli("-sc", "query=decode=")
    assert code == 2 and "--shell-completion: got 'query=decode='" in err
    bin_dir = Path(sys.executable).parent
    assert (bin_dir / "pcpflow").exists(), "the package's console script"
    line = 'eval "$(pcpflow --shell-completion install=bash)"'
    assert line in in_process("--help").stdout.replace("\n", " ")
    r = subprocess.run(
        ["bash", "-c", line + '; COMP_LINE="pcpflow pcp=2 decode="; COMP_POINT=${#COMP_LINE}; COMP_CWORD=2; '
         'hydra_bash_completion; printf "%s\\n" "${COMPREPLY[@]}"'],
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"},
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )
    assert r.returncode == 0 and r.stdout.split() == [f"decode={o}" for o in sorted(_config_groups()["decode"])], r


def test_cfg_package_and_hydra_commands_refused_as_bad_input():
    """--cfg job -p PACKAGE shows that part, or names the keys where the path leaves the config
    (Hydra: 'package not found', exit 1); two of Hydra's commands at once, a config dir of one's
    own, --resolve without --cfg: a problem each, exit 2 (Hydra: a traceback, exit 1)."""
    r = in_process("--cfg", "job", "-p", "kv.block_size", "kv.block_size=8")
    assert r.returncode == 0 and r.stdout.strip() == "8", r
    code, err = cli("--cfg", "job", "--package=kv.nope")
    assert code == 2 and ("  - --package: got 'kv.nope'; a key of the job's config; at 'nope' its keys are: block_size, "
                          "hybrid, interleave, num_blocks, prefix_caching") in err, err
    code, err = cli("-m", "--cfg", "job", "pcp=1,2")
    assert code == 2 and ("  - --multirun: got '--multirun --cfg'; one of --run, --multirun, --cfg, --info, "
                          "--shell-completion at a time") in err, err
    # a config dir of one's own: Hydra would compose options pcpflow never validated (its check
    # then refused `model=my` as an unknown option); --resolve without --cfg: Hydra's traceback
    code, err = cli("--config-dir", "mycfg", "model=my", "--resolve")
    assert code == 2 and err.splitlines()[1:] == [
        "  - --config-dir: got 'mycfg'; not taken: pcpflow validates every run against its own conf/ (its groups, "
        "its options, their settings); your own model: model=hf model.path=DIR, hardware: hardware=measured "
        "hardware.path=FILE, stages: plugins=[module] (docs/writing-stages.md), any setting: key=value",
        "  - --resolve: got True; only with --cfg (it resolves the config --cfg shows)",
    ], err
    # a value outside a flag's choices (argparse: its error under a dozen lines of usage)
    code, err = cli("--cfg", "pcp=2")
    assert code == 2 and err.splitlines()[1:] == [
        "  - --cfg: got 'pcp=2'; one of job, hydra, all: the word after --cfg is its value (--cfg job pcp=2)"], err
    code, err = cli("--info=foo", "pcp=2")
    assert code == 2 and err.splitlines()[1:] == [
        "  - --info: got 'foo'; one of all, config, defaults, defaults-tree, plugins, searchpath"], err


def test_an_unknown_flag_is_one_problem_with_the_flag_it_is_near():
    """A flag that is none of Hydra's: argparse printed its usage and 'unrecognized arguments';
    a shortened one (--multi) it took for --multirun, which the check before the run never saw
    (it checked one job where Hydra swept two). A flag's value (-p kv) is not a flag."""
    code, err = cli("--multi", "pcp=1,2", "-x", "--pakage=kv", "--foo")
    assert code == 2 and err.splitlines()[1:] == [
        f"  - {flag}: got True; not a flag of pcpflow: key=value overrides (python -m pcpflow --help){near}"
        for flag, near in [("--multi", "; did you mean --multirun?"), ("-x", ""),
                           ("--pakage", "; did you mean --package?"), ("--foo", "")]
    ] + ["  - pcp: got '1,2'; " + SWEEP_NEEDS_MULTIRUN], err


@pytest.mark.parametrize("args, shown", [
    (["pcp=3", "--cfg", "job", "-p", "pcp", "dcp=3"], "3"),  # overrides on both sides of a flag
    (["--info", "pcp=3"], "pcp: 3"),  # --info takes a word of its choices only
    (["dcp=1", "--info", "config", "pcp=3"], "pcp: 3"),
    (["--cfg", "job", "-p", "pcp", "--", "pcp=3"], "3"),  # argparse's end of flags
])
def test_hydras_flags_stand_anywhere_among_the_overrides(args, shown):
    """Hydra's argparse reads the overrides as one run of words ('unrecognized arguments: dcp=3'),
    and a valueless --info took the override after it for its value ('invalid choice: pcp=3')."""
    r = in_process(*args)
    assert r.returncode == 0 and shown in r.stdout.splitlines(), r


def test_hydras_help_is_given_beside_a_jobs_overrides():
    """Hydra's help on Hydra (its flags, its groups) with the job's override beside it: a traceback."""
    r = pcpflow("--hydra-help", "pcp=3")
    assert r.returncode == 0 and "== Flags ==" in r.stdout.splitlines(), r.stderr[-2000:]


def test_an_override_hydra_refuses_is_named_by_its_key_on_one_line():
    """Hydra's grammar refuses an override: the problem names its key and what it got, Hydra's
    reason on the same line (it reported the whole command line, over two or three lines)."""
    code, err = cli("workload=explicit", "workload.prompt_lens=[1,2", "tp=2", "pcp", "dcp=1)", "tp=x")
    grammar = "https://hydra.cc/docs/1.2/advanced/override_grammar/basic"
    assert code == 2 and err.splitlines() == [
        "pcpflow: invalid configuration (4 problem(s)):",
        "  - workload.prompt_lens: got '[1,2'; a value in Hydra's override grammar (no viable alternative at "
        f"input '[1,2'; {grammar})",
        f"  - pcp: got 'pcp'; key=value in Hydra's override grammar (missing EQUAL at '<EOF>'; {grammar})",
        f"  - dcp: got '1)'; a value in Hydra's override grammar (extraneous input ')' expecting <EOF>; {grammar})",
        "  - tp: got 'x'; Input should be a valid integer, unable to parse string as an integer",  # the rest still checked
    ], err
    # composed where no command line was prechecked (torchrun's rank 0): listed beside the other problems
    with pytest.raises(ConfigError) as exc:
        validate_overrides(["pcp=[1,2", "tp=x"])
    assert [str(p) for p in exc.value.problems] == [
        f"pcp: got '[1,2'; a value in Hydra's override grammar (no viable alternative at input '[1,2'; {grammar})",
        "tp: got 'x'; Input should be a valid integer, unable to parse string as an integer",
    ]
    # an interpolation that names no key: the key that holds it, and the rest still checked
    with pytest.raises(ConfigError) as exc:
        validate_overrides(["pcp=${oops}", "tp=x"])
    assert [str(p) for p in exc.value.problems] == [
        "pcp: got '${oops}'; Interpolation key 'oops' not found",
        "tp: got 'x'; Input should be a valid integer, unable to parse string as an integer",
    ]


def test_multirun_validates_every_job_before_starting_any(tmp_path):
    code, err = cli("-m", "pcp=2,3", "dcp=2", f"hydra.sweep.dir={tmp_path / 'sweep'}", *SMALL)
    assert code == 2
    assert "[pcp=3] dcp: got 2" in err and "[pcp=2]" not in err
    assert not (tmp_path / "sweep").exists()


def test_missing_or_malformed_trace_names_file_and_line(tmp_path):
    code, err = cli("workload=trace", f"workload.path={tmp_path / 'nope.jsonl'}")
    assert code == 2 and f"workload.path: got '{tmp_path / 'nope.jsonl'}'" in err
    bad = write_trace(tmp_path / "bad.jsonl")
    bad.write_text(bad.read_text() + "{not json\n")
    code, err = cli("workload=trace", f"workload.path={bad}", "workload.max_requests=10")
    assert code == 2 and "bad.jsonl:5" in err, err


# ------------------------------------------------------------------------- running
def _alive_with_marker(marker: str) -> list[int]:
    alive = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if marker.encode() in (proc / "environ").read_bytes():
                alive.append(int(proc.name))
        except OSError:
            continue
    return alive


@pytest.mark.dist
def test_every_ranks_print_reaches_the_console_once_with_its_rank(tmp_path):
    # docs/writing-stages.md's example stage, as documented: each rank prints every 5 steps.
    r = pcpflow("pcp=2", "plugins=[docs.examples.token_counter]",
                "+pipeline.extra=[{kind: token_counter, after: plan, every: 5}]",
                f"hydra.run.dir={tmp_path}", *SMALL)
    assert r.returncode == 0, r.stderr[-2000:]
    steps = json.loads((tmp_path / "result.json").read_text())["metrics"]["num_steps"]
    due = [s for s in range(steps) if s % 5 == 0]
    assert due, steps
    for rank in (0, 1):
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith(f"[rank{rank}]:step ")]
        assert [int(ln.split()[1].rstrip(":")) for ln in lines] == due, r.stdout
        assert all(f"pcp rank {rank} holds " in ln for ln in lines)
    # and the rank's own log has them too
    (log,) = tmp_path.glob("logs/*/attempt_0/1/stdout.log")
    assert log.read_text().count("pcp rank 1 holds ") == len(due)
    # the launcher's log holds no traceback of a run that went well
    assert "Traceback" not in (tmp_path / "logs" / "launcher.log").read_text()


@pytest.mark.dist
@pytest.mark.parametrize("pcp", [1, pytest.param(3, marks=pytest.mark.slow)])
def test_a_crashing_rank_ends_the_job_promptly_with_its_error(tmp_path, pcp):
    marker = f"PCPFLOW_TEST_MARK_{uuid.uuid4().hex}"
    rank = pcp - 1
    run_dir = tmp_path / "run"
    start = time.monotonic()
    r = pcpflow(
        f"pcp={pcp}",
        "plugins=[pcpflow_test_plugins.faults]",
        f"+pipeline.extra=[{{kind: 'pcpflow_test_plugins.faults:Crash', after: forward, rank: {rank}, step: 2}}]",
        f"hydra.run.dir={run_dir}",
        *SMALL,
        env={marker: "1"},
        timeout=120,
    )
    elapsed = time.monotonic() - start
    assert r.returncode == 1, r.stderr
    # the root cause comes first on the console; torch's launcher messages stay in logs/
    first = next(line for line in r.stderr.splitlines() if line.strip())
    assert first.startswith(f"pcpflow: rank {rank} failed: RuntimeError: injected failure on rank"), r.stderr[:2000]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and "injected failure" in result["error"]
    assert elapsed < 120  # NOTE: a hang would hit the subprocess timeout instead
    deadline = time.monotonic() + 10  # the fork server leaves a moment after the driver
    while _alive_with_marker(marker) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _alive_with_marker(marker) == [], "no rank process may outlive the job"


# NOTE: every torchrun launch is slow, here and in tests/driver/test_faults.py; the default set takes the
# torchrun path with torch's variables set and no torchrun: the two tests below (a run of one rank in a
# new Python; rank 0 refusing a command, in this process)
@pytest.mark.dist
@pytest.mark.slow
def test_torchrun_launch_runs_the_same_worker(tmp_path):
    run_dir = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(TESTS), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "pcpflow"]
    r = subprocess.run(
        [*cmd, "pcp=2", f"hydra.run.dir={run_dir}", *SMALL], env=env, capture_output=True, text=True, timeout=240
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "ok" and result["verify"]["passed"] and result["launcher"].startswith("external")
    r = subprocess.run([*cmd, "pcp=3", *SMALL], env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0 and "must equal the 2 ranks torchrun started" in r.stderr + r.stdout
    # the modes pcpflow runs in one process (or on ranks it starts) are refused by name, not run as an engine
    for mode, says in (("simulate", "a simulated run is one process"), ("profile", "a profile starts the ranks it measures")):
        mode_dir = tmp_path / mode
        r = subprocess.run([*cmd, f"mode={mode}", "pcp=2", f"hydra.run.dir={mode_dir}", *SMALL], env=env,
                           capture_output=True, text=True, timeout=240)
        assert r.returncode != 0 and f"mode: got '{mode}'; {says}" in r.stderr + r.stdout, r.stderr[-2000:]
        assert json.loads((mode_dir / "result.json").read_text())["exit_code"] == 2


@pytest.mark.dist
def test_a_torchrun_run_dir_holds_the_plots_a_run_dir_holds(tmp_path):
    """Rank 0 of an externally launched job writes load.png and serving.png after the run, as
    pcpflow's launcher does. One rank started with torch's variables (as srun does), not
    torchrun itself: the same path through the driver, seconds cheaper."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run_dir = tmp_path / "run"
    env = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "OMP_NUM_THREADS": "1"}
    r = pcpflow("pcp=1", f"hydra.run.dir={run_dir}", *[a for a in SMALL if not a.startswith("output.plots")], env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((run_dir / "result.json").read_text())["launcher"].startswith("external")
    assert (run_dir / "load.png").stat().st_size > 0 and (run_dir / "serving.png").stat().st_size > 0


@pytest.mark.parametrize("args", [
    ["workload.prompt_lens=[5]"],  # a key of another option of its group names that option
    ["draft=mtp", "pipeline.draft.num_speculative_tokens=3"],  # the drafter's own override
    ["workload.prompt_lens=[5]", "pcp=0", "dtype=bf16"],  # a key Hydra cannot place and bad values, together
    ["pcp=1,2", "dcp=0"],  # a sweep without -m (rank 0 named the whole command line, and said nothing else)
    ["hydra.nope=1", "hydra.job.chdir=true", "pcp=0"],  # Hydra's own settings (they were dropped unread)
])
def test_torchrun_refuses_a_command_as_python_m_pcpflow_does(tmp_path, monkeypatch, args):
    """Rank 0 of an external launch composes and checks the config as the driver does: the same
    problems, the same words. One rank with torch's variables (as srun starts it), in this process:
    a refused config starts no process group."""
    run_dir = tmp_path / "run"
    code, driver = cli(*args, f"hydra.run.dir={run_dir}")
    assert code == 2 and not run_dir.exists(), driver
    _one_rank_of_torchrun(monkeypatch)
    code, rank = cli(*args, f"hydra.run.dir={run_dir}")
    assert code == 2, rank
    problems = [ln for ln in driver.splitlines() if ln.startswith("  - ")]
    assert problems and problems == [ln for ln in rank.splitlines() if ln.startswith("  - ")], rank
    assert json.loads((run_dir / "result.json").read_text())["exit_code"] == 2  # rank 0 records it in the run dir


def _one_rank_of_torchrun(monkeypatch) -> None:
    """This process as rank 0 of a world of one, as torchrun / srun start it."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)}.items():
        monkeypatch.setenv(key, value)


def test_hydras_flags_under_torchrun_are_refused_or_answered_not_dropped(tmp_path, monkeypatch):
    """Hydra does not run on torchrun's ranks: its flags were dropped and a job ran
    (``torchrun ... -m pcpflow --cfg job`` ran the default job, ``--help`` too, ``--foo`` was
    not read). Now each flag is a problem naming the command that does it, beside the
    config's problems; --help and --version are answered, and no job starts."""
    _one_rank_of_torchrun(monkeypatch)
    run_dir = tmp_path / "run"
    code, err = cli("--cfg", "job", "-p", "kv", "--foo", "pcp=0", f"hydra.run.dir={run_dir}")
    assert code == 2 and err.splitlines()[1:] == [
        "  - --cfg: got 'job'; not available under torchrun (Hydra does not run there): python -m pcpflow --cfg ... does it",
        "  - -p: got 'kv'; not available under torchrun (Hydra does not run there): python -m pcpflow -p ... does it",
        "  - --foo: got True; not a flag of pcpflow: key=value overrides (python -m pcpflow --help)",
        "  - pcp: got 0; Input should be greater than or equal to 1",
    ], err
    assert json.loads((run_dir / "result.json").read_text())["exit_code"] == 2
    for flag, says in (("--help", "usage:"), ("--version", "pcpflow ")):
        r = in_process(flag, f"hydra.run.dir={tmp_path / flag}")
        assert r.returncode == 0 and says in r.stdout and not (tmp_path / flag).exists(), r.stdout + r.stderr


# ------------------------------------------------------------------------------ run dirs
def test_a_run_dir_that_cannot_take_its_result_mid_run_ends_with_a_message_and_no_lock(tmp_path, monkeypatch):
    from pcpflow.output.rundir import LOCK_FILE

    monkeypatch.syspath_prepend(str(TESTS))
    run_dir = tmp_path / "run"
    fault = f"+pipeline.extra=[{{kind: 'pcpflow_test_plugins.faults:BlockResult', after: forward, step: 1, path: '{run_dir}'}}]"
    code, err = cli("pcp=1", f"hydra.run.dir={run_dir}", "plugins=[pcpflow_test_plugins.faults]", fault, *SMALL)
    assert code == 1, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines == [f"pcpflow: the run dir {run_dir} cannot be written: Is a directory ({run_dir / 'result.json'}); the run stopped"]
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.slow
def test_a_console_that_closes_mid_sweep_ends_nothing_and_prints_no_error(tmp_path):
    """``python -m pcpflow -m ... | head -1``: once the reader has gone, every later write (Hydra's
    log lines, each job's summary, the sweep's table) meets a closed pipe. The sweep still runs
    every job, writes its report and exits with its jobs' code; no traceback, no "Logging error"."""
    sweep = tmp_path / "sweep"
    args = [sys.executable, "-m", "pcpflow", "-m", "mode=simulate", "hardware=h200_sxm", "pcp=1,2",
            "output.plots=false", f"hydra.sweep.dir={sweep}"]
    with subprocess.Popen(args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert "Launching 2 jobs" in proc.stdout.readline()
        proc.stdout.close()  # what `head -1` does after its line
        err = proc.stderr.read()
        code = proc.wait(timeout=240)
    assert code == 0, err
    assert "Traceback" not in err and "Logging error" not in err and "Broken pipe" not in err, err
    assert (sweep / "sweep.md").exists()
    for job in ("0", "1"):
        assert json.loads((sweep / job / "result.json").read_text())["status"] == "ok"


def test_a_sweep_dir_that_cannot_be_made_is_named_as_the_sweep_dir(tmp_path):
    (tmp_path / "a_file").write_text("")
    code, err = cli("-m", "pcp=1,2", f"hydra.sweep.dir={tmp_path / 'a_file' / 'sweep'}")
    assert code == 2 and "hydra.sweep.dir: got" in err and "hydra.run.dir" not in err, err


def test_a_stage_that_returns_none_is_named(tmp_path, monkeypatch):
    (tmp_path / "returns_none.py").write_text(
        "from typing import Literal\n"
        "from pcpflow.stage import Stage, StageConfig, register\n\n"
        "@register\n"
        "class Forgetful(Stage):\n"
        "    kind = 'forgetful'\n\n"
        "    class Config(StageConfig):\n"
        "        kind: Literal['forgetful'] = 'forgetful'\n\n"
        "    def __call__(self, state):\n"
        "        state.extras['seen'] = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    run_dir = tmp_path / "run"
    code, err = cli("pcp=1", f"hydra.run.dir={run_dir}", "plugins=[returns_none]",
                    "+pipeline.extra=[{kind: forgetful, after: plan}]", *SMALL)
    result = json.loads((run_dir / "result.json").read_text())
    assert code == 1 and "stage extra[0]:forgetful" in result["error"], result["error"]
    assert "returned NoneType: a stage returns the step state" in result["error"]


def test_a_refused_option_is_one_problem_once_across_a_sweep(tmp_path):
    code, err = cli("-m", "mode=simulate", "model=llama3_8b", "hardware=h100", "pcp=1,2")
    assert code == 2
    lines = [line for line in err.splitlines() if line.startswith("  - ")]
    # not again as "no hardware" (its default, left behind), nor once per job
    assert lines == ["  - hardware: got 'h100'; allowed: b200, gtt_h100, h100_sxm, h200_sxm, measured "
                     "(did you mean 'h100_sxm'?)"], err


def test_an_invalid_command_replaces_an_older_ok_result_in_its_run_dir(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "result.json").write_text(json.dumps({"status": "ok", "error": None, "exit_code": 0}))
    code, err = cli("pcp=0", f"hydra.run.dir={run_dir}")
    assert code == 2
    result = json.loads((run_dir / "result.json").read_text())
    assert result["status"] == "failed" and result["exit_code"] == 2 and "pcp: got 0" in result["error"]
    # a run dir that does not exist is not made for a refused command
    code, _ = cli("pcp=0", f"hydra.run.dir={tmp_path / 'never'}")
    assert code == 2 and not (tmp_path / "never").exists()


def test_a_ctrl_c_while_a_run_validates_keeps_the_older_result_aside(tmp_path, monkeypatch, capsys):
    """Hydra has started the run; its config is not valid yet (the dir is not this run's):
    the interrupted run's result.json must not cost the older one, as a refused command's does not."""
    import signal

    from pcpflow.driver import job
    from pcpflow.signals import Interrupted

    def interrupted(raw, **kw):
        raise Interrupted(signal.SIGINT)

    monkeypatch.setattr(job, "prepare_job", interrupted)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    older = {"status": "ok", "error": None, "exit_code": 0}
    (run_dir / "result.json").write_text(json.dumps(older))
    assert job.run_job({"pcp": 1}, run_dir) == 130
    assert json.loads((run_dir / "result.previous.json").read_text()) == older
    result = json.loads((run_dir / "result.json").read_text())
    assert result["exit_code"] == 130 and result["error"] == "interrupted by SIGINT before the run started"
    assert capsys.readouterr().err.strip() == f"pcpflow: interrupted by SIGINT before the run started; result.json: {run_dir / 'result.json'}"


@pytest.mark.parametrize("rank", [None, "0", "1"])
def test_a_ctrl_c_while_pcpflow_imports_itself_leaves_a_result_where_the_command_names_the_run_dir(
        tmp_path, monkeypatch, capsys, rank):
    """``python -m pcpflow`` catches a Ctrl-C before the driver (pydantic, Hydra) is imported:
    the run dir is known only where the command names it; under torchrun rank 0 writes there."""
    import signal

    from pcpflow.driver.interrupted import interrupted_early
    from pcpflow.signals import Interrupted

    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    if rank is not None:
        monkeypatch.setenv("RANK", rank)
        monkeypatch.setenv("WORLD_SIZE", "2")
    run_dir = tmp_path / "run"
    assert interrupted_early(Interrupted(signal.SIGINT), ["pcp=2", f"hydra.run.dir={run_dir}"]) == 130
    ranked = "" if rank is None else f" (rank {rank})"
    writes = rank in (None, "0")
    where = f"; result.json: {run_dir / 'result.json'}" if writes else ""
    assert capsys.readouterr().err == f"pcpflow: interrupted by SIGINT before the run started{ranked}{where}\n"
    assert (run_dir / "result.json").exists() == writes
    # a dir left for Hydra to compose, or a sweep's, is not known yet: the line only
    assert interrupted_early(Interrupted(signal.SIGINT), ["-m", "pcp=1,2", f"hydra.run.dir={tmp_path / 'x'}"]) == 130
    assert interrupted_early(Interrupted(signal.SIGINT), ["hydra.run.dir=runs/${now:%H}"]) == 130
    assert not (tmp_path / "x").exists() and not (tmp_path / "runs").exists()
