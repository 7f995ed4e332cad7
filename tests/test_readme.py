"""Every command in README.md's ```bash blocks, as written, from a copy of the clone.

A few run end to end (quick as written). The rest are at least composed and validated
in-process exactly as a run would: pip installs (their extras must exist), the test
command (it must be what .ci/run runs), sweeps and torchrun (every job, and the world
size torchrun starts), GPU runs (only the "no CUDA device here" problems may remain), and
a placeholder checkpoint path (replaced by a tiny checkpoint). A command of a kind this
file does not know fails the test, so that a new README example cannot go unchecked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent

# Run end to end, exactly as written (each quick on 2 cores).
END_TO_END = {
    "python -m pcpflow",
    "python -m pcpflow --help",
    # a simulated run starts no ranks: the 1M-token layout of the published figures, priced
    "python -m pcpflow mode=simulate model=llama3_405b hardware=gtt_h100 simulate.weights_dtype=fp8 "
    "tp=8 pcp=16 dcp=16 workload=explicit 'workload.prompt_lens=[1048576]' 'workload.output_lens=[1]'",
}
# Measure, then predict: this machine's quick profile, and a run priced on it (the slow test
# that runs every command checks what they wrote).
PROFILE = "python -m pcpflow mode=profile pcp=2 profile.quick=true hydra.run.dir=outputs/profile"
PRICED = ("python -m pcpflow mode=simulate hardware=measured hardware.path=outputs/profile/hardware.yaml "
          "dtype=float32 model=tiny_gqa pcp=2")


def readme_commands(text: str) -> list[list[str]]:
    """Each command (argv) of the ```bash blocks, in order; `a && b` is two commands."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            tokens = shlex.split(line, comments=True)
            while tokens:
                cut = tokens.index("&&") if "&&" in tokens else len(tokens)
                commands.append(tokens[:cut])
                tokens = tokens[cut + 1 :]
    return commands


def test_readme_commands_are_found():
    commands = [shlex.join(c) for c in readme_commands((REPO / "README.md").read_text())]
    assert "python -m pcpflow" in commands and len(commands) >= 10
    assert all(c in commands for c in [*END_TO_END, PROFILE, PRICED]), "a command the tests check left the README"


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    return _copy_clone(tmp_path_factory.mktemp("clone"))


def _copy_clone(root: Path) -> Path:
    """A copy of the files a clone has (tracked, plus new files git does not ignore)."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    for name in listed:
        src = REPO / name
        if src.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / name)
    return root


class TinyCheckpoints:
    """Tiny random checkpoints, made on first use (in-process: transformers builds them)."""

    def __init__(self, root: Path) -> None:
        self.root, self.paths = root, {}
        self.made: dict[str, Path] = {}  # the --out a README command names -> where it went

    def make(self, script: Path, args: list[str]) -> None:
        """Run the README's own make_tiny_hf_checkpoint command (its flags as written)."""
        import runpy

        at = args.index("--out")
        out = self.root / f"made{len(self.made)}"
        runpy.run_path(str(script))["main"]([*args[:at], "--out", str(out), *args[at + 2 :]])
        assert (out / "config.json").is_file(), "the checkpoint it writes"
        self.made[args[at + 1]] = out

    def __getitem__(self, arch: str) -> Path:
        if arch not in self.paths:
            import runpy

            make = runpy.run_path(str(REPO / "scripts" / "make_tiny_hf_checkpoint.py"))["main"]
            make(["--arch", arch, "--out", str(self.root / arch)])
            self.paths[arch] = self.root / arch
        return self.paths[arch]


@pytest.fixture(scope="module")
def tiny_checkpoints(tmp_path_factory) -> TinyCheckpoints:
    return TinyCheckpoints(tmp_path_factory.mktemp("ckpt"))


def _env(clone: Path, bin_dir: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(clone), "OMP_NUM_THREADS": "1",
            "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}


def _python_on_path(clone: Path, tmp_path: Path) -> dict[str, str]:
    """An environment whose ``python`` (as the README writes it) is this interpreter.
    NOTE: a script, not a symlink: a venv's python reached through a link in another folder
    misses its pyvenv.cfg and runs as the base Python."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return _env(clone, bin_dir)


@pytest.mark.dist
def test_readme_end_to_end_commands_run_as_written(clone, tmp_path):
    env = _python_on_path(clone, tmp_path)
    ran = {}
    for argv in readme_commands((clone / "README.md").read_text()):
        line = shlex.join(argv)
        if line in END_TO_END and line not in ran:
            ran[line] = subprocess.run(line, shell=True, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
            assert ran[line].returncode == 0, (line, ran[line].stderr[-3000:])
    assert set(ran) == END_TO_END
    assert ran["python -m pcpflow --help"].stdout.startswith("pcpflow: ")
    results = [json.loads(p.read_text()) for p in (clone / "outputs").rglob("result.json")]
    (sim,) = [r for r in results if r["config"]["mode"] == "simulate" and r["config"]["hardware"]["name"] == "gtt_h100"]
    assert sim["status"] == "ok" and sim["config"]["verify"] is False
    # Meta's CP paper: 77 s for this 1M-token prefill on 16 nodes x 8 H100 (shared/published)
    assert sim["metrics"]["num_tokens"] == 1048576 and abs(sim["metrics"]["ttft"]["mean_s"] / 77.0 - 1) < 0.15
    (result_file,) = [p for p in (clone / "outputs").rglob("result.json")
                      if json.loads(p.read_text())["config"]["mode"] == "execute"]  # the default run
    result = json.loads(result_file.read_text())
    assert result["status"] == "ok" and result["error"] is None and result["verify"]["passed"]
    run_dir = result_file.parent
    frozen = json.loads((run_dir / "config.json").read_text())
    assert frozen == result["config"] and frozen["pcp"] == 2
    assert len(result["outputs"]) == frozen["workload"]["num_requests"]
    assert (run_dir / "metrics.jsonl").exists() and (run_dir / "load.png").exists()
    assert list((run_dir / "logs").rglob("*.log")), "per-rank logs under the run dir"
    # the README's run-dir table: Hydra's files too
    assert (run_dir / "cli.log").exists() and (run_dir / ".hydra" / "overrides.yaml").exists()


# Commands that read nothing another command writes and that no other command reads: they run
# beside the others (scripts/validate_measured.py profiles, executes and prices by itself, about
# half of the commands' time), not before or after them.
BESIDE = ("python scripts/validate_measured.py",)


@pytest.mark.slow
def test_every_readme_command_runs_as_written(tmp_path_factory):
    """Every command the README shows, run as written in a clone of its own, in order (a later
    command reads what an earlier one wrote; ``BESIDE``'s alongside the others). Two kinds are run
    elsewhere: ``pip install`` (tests/test_install.py installs a wheel in a clean venv) and the test
    command (.ci/run)."""
    root = tmp_path_factory.mktemp("every")
    repo = _copy_clone(root / "clone")
    env = _python_on_path(repo, root)
    lines = [shlex.join(argv) for argv in readme_commands((repo / "README.md").read_text())
             if argv[:2] != ["pip", "install"] and argv[:3] != ["python", "-m", "pytest"]]
    beside = {line: subprocess.Popen(line, shell=True, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True) for line in lines if line in BESIDE}
    assert len(beside) == len(BESIDE), f"README no longer shows {set(BESIDE) - set(beside)}: drop it from BESIDE"
    try:
        for line in lines:
            if line not in beside:
                done = subprocess.run(line, shell=True, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
                assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-3000:])
        for line, proc in beside.items():
            out, err = proc.communicate(timeout=900)
            assert proc.returncode == 0, (line, out[-2000:], err[-3000:])
    finally:  # NOTE: a failure above leaves nothing of theirs running (the shell, its ranks)
        for proc in beside.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert len(lines) >= 20
    clone = repo
    results = [json.loads(p.read_text()) for p in (clone / "outputs").rglob("result.json")]
    # The profile measured this machine on 2 ranks (gloo) and a simulated run priced on it.
    profile = yaml.safe_load((clone / "outputs" / "profile" / "hardware.yaml").read_text())
    assert profile["measured"]["status"] == "complete" and profile["measured"]["pcp"] == 2
    assert profile["tables"]["gemm"]["float32"] and {c["group"] for c in profile["tables"]["collectives"]} == {"pcp"}
    assert {c["op"] for c in profile["tables"]["collectives"]} >= {"all_gather", "all_reduce", "all_to_all", "sendrecv"}
    (priced,) = [r for r in results if r["config"]["mode"] == "simulate"
                 and (r["config"]["hardware"].get("path") or "").endswith("outputs/profile/hardware.yaml")]
    assert priced["status"] == "ok" and priced["metrics"]["ttft"]["mean_s"] > 0
    assert priced["metrics"]["simulate"]["collectives"]["restore"] == {"measured": priced["metrics"]["num_steps"]}
    # The search (16 GPUs, tp fixed at 8): its report beside it, the recommendation keeps tp=8
    (search,) = [p for p in (clone / "outputs").rglob("result.json") if json.loads(p.read_text())["config"]["mode"] == "search"]
    found = json.loads(search.read_text())
    assert found["status"] == "ok" and found["metrics"]["search"]["recommended"]["layout"].startswith("tp=8 ")
    assert (search.parent / "search.csv").is_file() and (search.parent / "search.md").is_file()
    _check_pooled(results)


def _check_pooled(results: list[dict]) -> None:
    """The README's executed disagg=pd runs: docs/disaggregation.md's worked example's layouts,
    and a ring in the prefill pool (interleave 1 on both sides)."""
    pooled = {((r["config"]["pipeline"] or {}).get("forward") or {}).get("cp_attention", "allgather"): r
              for r in results if r["config"]["mode"] == "execute" and r["config"]["disagg"]["kind"] == "pd"}
    assert set(pooled) == {"allgather", "ring_auto"}, set(pooled)
    # by hand: every prompt moves once (the latent is sharded by the decode pool's DCP, not
    # replicated over its TP): (kv_lora_rank + rope dim) float64 values per position and layer;
    # a message per route and layer (layerwise): the example's 4 routes for a prompt of >= 4
    # tokens (interleaves 2 -> 1), 2 for one of >= 2 (interleaves 1 -> 1: prefill rank r to the
    # decode pool's DCP rank r)
    for ring, routes in (("allgather", 4), ("ring_auto", 2)):
        run = pooled[ring]
        assert run["status"] == "ok" and run["verify"]["passed"]
        t, pools, rows = run["metrics"]["transfer"], run["metrics"]["pools"], run["requests"]
        model = run["config"]["model"]
        per_token = (model["kv_lora_rank"] + model["qk_rope_head_dim"]) * 8 * model["num_layers"]
        handed = [r for r in rows if r["output_len"] > 1]
        assert all(r["prompt_len"] >= routes for r in handed) and t["requests"] == len(handed) > 0
        assert t["bytes"] == per_token * sum(r["prompt_len"] for r in handed)
        assert t["calls"] == routes * model["num_layers"] * len(handed)
        assert sum(r["transfer_bytes"] for r in rows) == t["bytes"] and pools["decode"]["tokens"] > 0
    steps, ran = pooled["ring_auto"]["metrics"]["pools"], pooled["ring_auto"]["metrics"]["cp_attention_steps"]
    assert ran.get("ring_pass_kv", 0) + ran.get("ring_pass_q", 0) == steps["prefill"]["steps"] > 0, ran
    assert ran["allgather"] == steps["decode"]["steps"], ran


@pytest.mark.slow  # NOTE: a superset runs in test_every_readme_command_runs_as_written (slow too)
def test_every_readme_command_composes_and_validates_as_written(clone, tiny_checkpoints, monkeypatch):
    """One pass over every command (in-process: composing is cheap, starting ranks is not)."""
    monkeypatch.chdir(clone)  # relative paths (scripts/data/...) as a user in the clone has them
    monkeypatch.syspath_prepend(str(clone))  # plugins named from the clone root (docs/examples)
    failures = []
    checked = 0
    for argv in readme_commands((clone / "README.md").read_text()):
        try:
            _check(argv, clone, tiny_checkpoints)
            checked += 1
        except AssertionError as exc:
            failures.append(f"{shlex.join(argv)}\n    {exc}")
    assert not failures, "README commands that do not hold:\n" + "\n".join(failures)
    assert checked >= 10


def _check(argv: list[str], clone: Path, checkpoints: TinyCheckpoints) -> None:
    if argv[:2] == ["pip", "install"]:
        return _check_pip(argv[2:], clone)
    if argv[:3] == ["python", "-m", "pytest"]:
        ci = [shlex.split(line, comments=True) for line in (clone / ".ci" / "run").read_text().splitlines()]
        assert any(t[:1] in (["python"], ["python3"]) and t[1:] == argv[1:] for t in ci), \
            "the README's test command must be the one .ci/run runs"
        return None
    if argv[:3] == ["python", "-m", "pcpflow"]:
        return _check_pcpflow(argv[3:], None, checkpoints)
    if argv[0] == "torchrun" and "pcpflow" in argv:
        at = argv.index("pcpflow")
        assert argv[at - 1] == "-m", "torchrun ... -m pcpflow"
        flags = argv[1 : at - 1]
        nproc = next((int(f.split("=")[1]) for f in flags if f.startswith("--nproc-per-node=")), None)
        if "--nproc-per-node" in flags:
            nproc = int(flags[flags.index("--nproc-per-node") + 1])
        assert nproc is not None, "torchrun needs --nproc-per-node"
        return _check_pcpflow(argv[at + 1 :], nproc, checkpoints)
    if argv[:2] == ["python", "scripts/validate_measured.py"]:
        # Its matrix composes and validates as executed runs (the run itself takes minutes).
        import runpy

        assert runpy.run_path(str(clone / argv[1]))["check"]() == 0
        return None
    if argv[:2] == ["python", "scripts/make_tiny_hf_checkpoint.py"]:
        # Run as written, but into a temporary dir that the later commands' model.path maps to.
        return checkpoints.make(clone / argv[1], argv[2:])
    raise AssertionError("tests/test_readme.py does not know how to check this kind of command")


def _check_pip(args: list[str], clone: Path) -> None:
    import tomllib

    project = tomllib.loads((clone / "pyproject.toml").read_text())["project"]
    for i, a in enumerate(args):
        if a == "-e":
            target = args[i + 1]
            m = re.fullmatch(r"\.(?:\[([\w,]+)\])?", target)
            assert m, f"pip install -e {target}: expected . or .[extras]"
            for extra in filter(None, (m.group(1) or "").split(",")):
                assert extra in project["optional-dependencies"], f"no extra {extra!r} in pyproject.toml"
        elif a.startswith("torch=="):
            dep = next(d for d in project["dependencies"] if d.startswith("torch"))
            from packaging.specifiers import SpecifierSet

            assert a.split("==")[1] in SpecifierSet(dep[len("torch"):]), f"{a} outside {dep}"


def _check_pcpflow(args: list[str], nproc: int | None, checkpoints: TinyCheckpoints) -> None:
    import torch

    from pcpflow.driver.cli import precheck, split_args
    from pcpflow.errors import ConfigError
    from pcpflow.testing import compose

    args = [_with_checkpoint(a, checkpoints) for a in args]
    if "--help" in args or "-h" in args:
        return None
    if "mode=profile" in args:  # what it writes (a profile of this machine), made by hand: later commands read it
        from measured_profile import profile_dict

        run_dir = Path(next(a.split("=", 1)[1] for a in args if a.startswith("hydra.run.dir=")))
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "hardware.yaml").write_text(yaml.safe_dump(profile_dict()))
    overrides, multirun, _ = split_args(args)
    try:
        precheck(overrides, multirun)
    except ConfigError as exc:
        # A GPU command on a machine without one: only that may be wrong.
        other = [p for p in exc.problems if torch.cuda.is_available() or "no CUDA device" not in p.allowed]
        assert not other, exc.report()
        return None
    if nproc is not None:
        cfg = compose([o for o in overrides if not o.startswith("hydra.")])
        assert cfg.world_size == nproc, f"torchrun starts {nproc} ranks, the config needs {cfg.world_size}"
    return None


def _with_checkpoint(arg: str, checkpoints: TinyCheckpoints) -> str:
    """A checkpoint path the user supplies (DIR, /models/...) becomes a tiny checkpoint of
    the architecture its name suggests; a path an earlier command makes stays."""
    key, sep, value = arg.partition("=")
    if key != "model.path" or not sep:
        return arg
    if value in checkpoints.made:
        return f"model.path={checkpoints.made[value]}"
    if Path(value).exists():
        return arg
    arch = "deepseek_v3" if "deepseek" in value.lower() or "dsv" in value.lower() else "llama"
    return f"model.path={checkpoints[arch]}"
