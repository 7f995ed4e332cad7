"""The pre-run check layer (``pcpflow.driver.checks``), in-process: every case is a ConfigError
naming the field or file, found before any rank starts (and without building token arrays
or allocating), or a driver outcome of ``run_job`` (exit 2, what result.json says)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from repo_scripts import load_script

from pcpflow.driver.checks import capacity_warnings, check_job
from pcpflow.driver.cli import compose_raw
from pcpflow.driver.job import prepare_job, run_job
from pcpflow.errors import ConfigError
from pcpflow.models.hf_weights import read_safetensors_header
from pcpflow.output.console import ConsoleGone
from pcpflow.output.rundir import LOCK_FILE
from pcpflow.scheduling.memory import host_memory_bytes
from pcpflow.testing import cli, compose

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]


def problems_of(overrides: list[str], **kw) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as e:
        prepare_job(compose_raw(overrides), **kw)
    return [(p.field, p.allowed) for p in e.value.problems]


def fields_of(overrides: list[str], **kw) -> set[str]:
    return {f for f, _ in problems_of(overrides, **kw)}


# ------------------------------------------------------------------------------ sizes
def test_unallocatable_sizes_are_named_before_anything_is_allocated():
    if host_memory_bytes() is None:
        pytest.skip("no way to read this host's memory")
    t0 = time.perf_counter()
    # Each of these alone is far beyond any host: a KV cache of 10**8 blocks x 16 slots
    # x 2 layers is ~10 TB in float64; 10**12 batched tokens of int64 columns ~ 100 TB.
    for override, field in [
        ("kv.num_blocks=100000000", "kv.num_blocks"),
        ("scheduler.max_num_batched_tokens=1000000000000", "scheduler.max_num_batched_tokens"),
        ("scheduler.max_num_seqs=1000000000", "scheduler.max_num_seqs"),
    ]:
        found = problems_of([override, "pcp=1"])
        assert [f for f, _ in found] == [field], found
        assert "this host can allocate" in found[0][1] and "GiB" in found[0][1]
    assert time.perf_counter() - t0 < 30  # nothing of that size was built


def test_host_memory_counts_weights_drafter_caches_and_verify_copies():
    from pcpflow.pipeline.assemble import resolve_pipeline
    from pcpflow.rank.devices import _host_sizes

    def sizes(overrides):
        cfg = compose(["model=tiny_gqa", "workload=explicit", "workload.prompt_lens=[40]", "workload.output_lens=[8]", *overrides])
        return _host_sizes(cfg, np.array([40]), np.array([8]), resolve_pipeline(cfg))

    # Hand-worked, tiny_gqa in float64: a token's entry is 2 layers x (K, V) x 2 KV heads x 16
    # dims = 128 values = 1,024 bytes; its weights 2 x 36,992 (q 64x64, k and v 64x32, o 64x64,
    # gate_up 64x256, down 128x64, two norms) + embeddings and LM head 2 x 256x64 + final norm 64
    # = 106,816 values = 854,528 bytes.
    entry, weights, slots = 1024, 854_528, 64 * 16
    plain = sizes(["pcp=2", "kv.num_blocks=64", "verify=false"])
    assert plain["model"] == 2 * weights and plain["kv.num_blocks"] == 2 * slots * entry
    # verify: each rank's expected copy, and the reference's cache of dcp x the blocks
    # (more than its one seat of ceil(48 / 16) = 3 blocks)
    checked = sizes(["pcp=2", "dcp=2", "kv.num_blocks=64", "verify=true"])
    assert checked["kv.num_blocks"] == 2 * 2 * slots * entry + 2 * slots * entry
    assert checked["model"] == 2 * weights  # tp=1: the reference runs on rank 0's own model
    tp = sizes(["tp=2", "pcp=1", "kv.num_blocks=64", "verify=true"])
    assert tp["model"] == 3 * weights  # and the reference's own whole model
    # a TP rank's cache holds one of the 2 KV heads (and its expected copy); the reference's, both
    assert tp["kv.num_blocks"] == 2 * 2 * slots * entry // 2 + slots * entry
    # the self drafter keeps a second cache as wide as the target's
    drafting = sizes(["pcp=2", "kv.num_blocks=64", "verify=false", "draft=self"])
    assert drafting["kv.num_blocks"] == 2 * slots * 2 * entry


def test_a_model_too_big_for_this_host_is_named():
    if host_memory_bytes() is None:
        pytest.skip("no way to read this host's memory")
    # 2 layers of a 2**24-wide MLP over 64 dims: 2 x 3 x 2**30 float64 values, ~48 GiB a rank
    found = problems_of(["pcp=1", "model.intermediate_size=16777216"])
    assert [f for f, _ in found] == ["model"], found
    assert "this host can allocate" in found[0][1]


def test_a_simulated_kind_of_run_skips_host_memory_limits():
    cfg = compose(["pcp=1"])  # valid
    big = cfg.model_copy(update={"kv": cfg.kv.model_copy(update={"num_blocks": 10**8})})
    with pytest.raises(ConfigError) as e:
        check_job(big, kind="execute")
    assert [p.field for p in e.value.problems] == ["kv.num_blocks"]
    check_job(big, kind="simulate")  # sized from the hardware it prices, not from this host


def test_a_huge_trace_reports_kv_num_blocks_from_its_lengths_alone(tmp_path):
    trace = tmp_path / "huge.jsonl"
    # 10**9 prompt tokens: building its token ids alone would take 8 GB per rank.
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 10**9, "output_length": 10, "hash_ids": [0]}) + "\n")
    t0 = time.perf_counter()
    found = problems_of(["workload=trace", f"workload.path={trace}", "workload.length_scale=1"])
    assert time.perf_counter() - t0 < 30
    assert found[0][0] == "kv.num_blocks"
    # the token ids of 10**9 tokens on every rank, and the reference's cache of one such
    # request (verify=true), may exceed this host too: then it says so
    assert {f for f, _ in found[1:]} <= {"workload", "kv.num_blocks"}
    # hand-worked: ceil((10**9 + 10) / 16) blocks at block_size 16, dcp 1
    assert f"needs {-(-(10**9 + 10) // 16)} blocks" in found[0][1]


def test_request_lengths_equal_the_built_requests(tmp_path):
    from pcpflow.scheduling.workload import build_requests, request_lengths

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": i, "input_length": 700 + 97 * i, "output_length": 30 + i, "hash_ids": [i, i + 1]}) + "\n" for i in range(5)))
    for overrides in (["workload.num_requests=7"], ["workload=explicit", "workload.prompt_lens=[3,9,1]", "workload.output_lens=[2]"],
                      ["workload=trace", f"workload.path={trace}", "workload.output_len_cap=31"]):
        cfg = compose(overrides)
        reqs = build_requests(cfg.workload, vocab_size=128, seed=cfg.seed)
        prompt, output = request_lengths(cfg.workload, vocab_size=128, seed=cfg.seed)
        assert prompt.tolist() == [len(r.prompt_token_ids) for r in reqs]
        assert output.tolist() == [r.max_output_tokens for r in reqs]


# ------------------------------------------------------------------------------ seeds, plugins
def test_seeds_outside_what_the_rng_takes():
    assert fields_of([f"seed={2**64}"]) == {"seed"}
    assert fields_of([f"seed={-(2**63) - 1}"]) == {"seed"}
    compose([f"seed={2**63 - 1}"])  # the edge itself is fine
    assert "workload.seed" in fields_of([f"workload.seed={2**70}"])


@pytest.mark.parametrize(
    "source, expected",
    [("def broken(:\n", "SyntaxError"), ("raise RuntimeError('plugin exploded')\n", "RuntimeError: plugin exploded"),
     ("import no_such_module_pcpflow\n", "ModuleNotFoundError"),
     ("import sys\nsys.exit(3)\n", "importing it called sys.exit(3)"),
     # a built-in stage's kind: the built-ins register first, so it is the plugin's import that fails
     ("from typing import Literal\nfrom pcpflow.stage import Stage, StageConfig, register\n@register\n"
      "class Dup(Stage):\n    kind = 'batch_checks'\n    class Config(StageConfig):\n"
      "        kind: Literal['batch_checks'] = 'batch_checks'\n",
      "stage kind 'batch_checks' is registered twice: pcpflow.stages.validate:BatchChecks and")],
)
def test_a_plugin_that_fails_at_import_is_its_problem(tmp_path, monkeypatch, source, expected):
    name = f"bad_plugin_{abs(hash(source)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    found = problems_of([f"plugins=[{name}]"])
    assert found[0][0] == "plugins[0]" and expected in found[0][1], found
    assert problems_of(["plugins=[not_a_module_anywhere]"])[0][0] == "plugins[0]"
    # through the command line: exit 2 and the one message, whatever code the module exits with
    r = cli(f"plugins=[{name}]")
    assert r.returncode == 2 and f"plugins[0]: got '{name}'" in r.stderr, r.stderr


# ------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    pytest.importorskip("transformers")
    return load_script("make_tiny_hf_checkpoint").build_checkpoint(tmp_path_factory.mktemp("hf") / "llama", "llama")


def _variant(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_checkpoint_files_checked_from_headers(llama, tmp_path):
    weights = llama / "model.safetensors"
    size = weights.stat().st_size
    truncated = _variant(llama, tmp_path / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(size - 100)
    garbage = _variant(llama, tmp_path / "garbage")
    (garbage / "model.safetensors").write_bytes(b"this is not a safetensors file at all" * 10)
    for path, words in [(truncated, f"is truncated: its header says {size} bytes, the file has {size - 100}"),
                        (garbage, "is not safetensors")]:
        found = problems_of(["model=hf", f"model.path={path}", "pcp=1"])
        assert found[0][0] == "model.path" and words in found[0][1], found
    # config.json says 2x the hidden size: every tensor shape disagrees with it
    wrong = _variant(llama, tmp_path / "wrong_shape")
    config = json.loads((wrong / "config.json").read_text())
    config["intermediate_size"] *= 2
    (wrong / "config.json").write_text(json.dumps(config))
    found = problems_of(["model=hf", f"model.path={wrong}", "pcp=1"])
    assert found and all(f == "model.path" for f, _ in found)
    assert any("mlp.down_proj.weight has shape" in a and "config.json implies" in a for _, a in found), found
    assert "embed_tokens" not in " ".join(a for _, a in found)  # untouched by that field
    assert read_safetensors_header(weights)  # the original reads


def _header_lies(src: Path, dst: Path, edit) -> Path:
    """A copy of ``src`` whose safetensors header ``edit`` changed, the data left as it was."""
    import struct

    _variant(src, dst)
    raw = (dst / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (dst / "model.safetensors").write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    return dst


def test_a_safetensors_header_that_lies_is_refused_before_the_ranks_load_it(llama, tmp_path):
    """What safetensors itself refuses as a rank opens the file (a SafetensorError mid-load, exit 1)
    or pcpflow's header reader tripped over (a KeyError, a traceback) is a model.path problem, exit 2."""
    up, down = "model.layers.0.mlp.up_proj.weight", "model.layers.0.mlp.down_proj.weight"  # both F32, 32 kB

    def entry(**kv):
        return lambda h: h[up].update(kv)

    def offsets_of_down(h):
        h[up]["data_offsets"] = list(h[down]["data_offsets"])

    cases = {
        "dtype_lie": (entry(dtype="F16"), f"tensor {up} is F16 [128, 64] (16384 bytes), but its data_offsets"),
        "unknown_dtype": (entry(dtype="F99"), "has dtype 'F99'; a safetensors dtype is one of BOOL"),
        "no_offsets": (lambda h: h[up].pop("data_offsets"), "has data_offsets None; [begin, end]"),
        "text_offsets": (entry(data_offsets=["0", "10"]), "has data_offsets ['0', '10']"),
        "overlap": (offsets_of_down, "overlaps the tensor before it"),
        "not_an_entry": (lambda h: h.update({up: [1, 2]}), f"tensor {up} is not an object with dtype, shape and data_offsets"),
    }
    for name, (edit, words) in cases.items():
        path = _header_lies(llama, tmp_path / name, edit)
        found = problems_of(["model=hf", f"model.path={path}", "pcp=1"])
        assert len(found) == 1 and found[0][0] == "model.path" and words in found[0][1], (name, found)
    longer = _variant(llama, tmp_path / "longer")
    with open(longer / "model.safetensors", "ab") as f:
        f.write(b"\0" * 8)
    found = problems_of(["model=hf", f"model.path={longer}", "pcp=1"])
    assert found[0][0] == "model.path" and "8 bytes after the tensors its header describes" in found[0][1], found


def test_non_finite_weights_are_reported_by_the_loader_naming_the_tensor(llama, tmp_path):
    from safetensors.torch import load_file, save_file

    from pcpflow.models import build_model

    bad = _variant(llama, tmp_path / "nan")
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name].clone()
    tensors[name][0, :3] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    cfg = compose(["model=hf", f"model.path={bad}", "pcp=1"])  # the driver reads headers only
    with pytest.raises(ValueError, match=rf"non-finite .*{name} \(3 of"):
        build_model(cfg.model, dtype=torch.float64, seed=0)


# ------------------------------------------------------------------------------ run dir
def test_run_dir_problems_end_the_job_with_exit_2(tmp_path, capsys):
    raw = compose_raw(["pcp=1"])
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert run_job(raw, a_file, console=False) == 2
    assert "hydra.run.dir" in capsys.readouterr().err and a_file.read_text() == "x"
    assert run_job(raw, a_file / "below", console=False) == 2
    # a live run (this test's parent process stands in for it) holds the dir
    live = tmp_path / "live"
    live.mkdir()
    (live / LOCK_FILE).write_text(f"{os.getppid()} python -m pcpflow\n")
    (live / "result.json").write_text('{"status": "ok"}')
    assert run_job(raw, live, console=False) == 2
    assert "is running in it" in capsys.readouterr().err
    assert json.loads((live / "result.json").read_text()) == {"status": "ok"}  # not ours to touch
    # a dead owner's lock is stale; a config error there replaces the old "ok", kept aside
    (live / LOCK_FILE).write_text("999999999 gone\n")
    assert run_job(compose_raw(["pcp=1", "kv.num_blocks=1"]), live, console=False) == 2
    result = json.loads((live / "result.json").read_text())
    assert result["status"] == "failed" and "kv.num_blocks" in result["error"] and result["exit_code"] == 2
    assert json.loads((live / "result.previous.json").read_text()) == {"status": "ok"}
    assert not (live / LOCK_FILE).exists()


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_run_dir_where_no_directory_can_be_made_is_refused_even_for_root(tmp_path, monkeypatch):
    # root passes os.access everywhere, in /proc too; mkdir there fails all the same
    for args, field in [(["--cfg", "job", "hydra.run.dir=/proc/pcpflow-nope"], "hydra.run.dir"),
                        (["-m", "pcp=1,2", "hydra.sweep.dir=/proc/pcpflow-nope"], "hydra.sweep.dir")]:
        r = cli(*args)
        assert r.returncode == 2 and f"- {field}: got '/proc/pcpflow-nope'" in r.stderr and "Traceback" not in r.stderr
    monkeypatch.chdir(tmp_path)
    for key in ("hydra.run.dir", "hydra.sweep.dir"):  # empty: Hydra would write into the current dir
        r = cli(*(["-m", "pcp=1,2"] if "sweep" in key else []), f"{key}=")
        assert r.returncode == 2 and f"- {key}: got ''; a directory's path" in r.stderr
    # a dir that can be made is not made by the check (nothing appears for a refused command)
    r = cli("pcp=3", "dcp=5", f"hydra.run.dir={tmp_path / 'new' / 'run'}")
    assert r.returncode == 2 and list(tmp_path.iterdir()) == []


def test_an_option_of_hydras_own_groups_hydra_has_not_is_a_problem_named():
    r = cli("-m", "pcp=1,2", "hydra/launcher=jobllib")
    assert r.returncode == 2 and "- hydra/launcher: got 'jobllib'; allowed: basic, joblib (did you mean 'joblib'?)" in r.stderr


def test_hydras_own_settings_it_would_refuse_or_pcpflow_does_not_take_are_problems_named(tmp_path, monkeypatch):
    """Hydra refused them once started (exit 1, a message over several lines); hydra.job.chdir=true
    ran the job in the run dir, where the command's relative paths do not lead (the trace below
    was looked for under the run dir)."""
    r = cli("hydra.nope=1", "hydra.job.chdir=maybe", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.splitlines()[1:] == [
        "  - hydra.nope: got 1; Key 'nope' not in 'HydraConf'",
        "  - hydra.job.chdir: got 'maybe'; Value 'maybe' is not a valid bool (type str)",
    ], r.stderr
    # a launcher's setting is checked against the launcher the command picks
    r = cli("-m", "pcp=1,2", "hydra/launcher=joblib", "hydra.launcher.n_jobs=abc", "hydra.launcher.nope=1",
            f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 2 and r.stderr.splitlines()[1:] == [
        "  - hydra.launcher.n_jobs: got 'abc'; Value 'abc' of type 'str' could not be converted to Integer",
        "  - hydra.launcher.nope: got 1; Key 'nope' not in 'JobLibLauncherConf'",
    ], r.stderr
    # Hydra itself cannot set its sweeper's params from the command line ('NoneType' object has no attribute 'get')
    r = cli("-m", 'hydra.sweeper.params={pcp:"1,2"}', f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 2 and r.stderr.splitlines()[1:] == [
        "  - hydra.sweeper.params: got {'pcp': '1,2'}; the sweep itself, after -m: -m pcp=1,2 dcp=1,2 (Hydra cannot "
        "set hydra.sweeper.params from the command line)"], r.stderr
    monkeypatch.chdir(Path(__file__).resolve().parents[2])  # the repository, where the trace's path leads
    r = cli("hydra.job.chdir=true", "workload=trace", "workload.path=scripts/data/mooncake_conversation_head.jsonl",
            f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2 and r.stderr.splitlines()[1:] == [
        "  - hydra.job.chdir: got True; false: pcpflow runs where it is started (the paths a command gives are read "
        "from there) and writes into the run dir either way"], r.stderr


@pytest.mark.parametrize("error, said", [
    (ValueError("too many fds"), "ValueError: too many fds"),  # multiprocessing's fork server's own limit
    # an OS error that is not the run dir's: sendmsg's EINVAL past Linux's 253 descriptors, a file elsewhere
    (OSError(errno.EINVAL, "Invalid argument"), "OSError: [Errno 22] Invalid argument"),
    (FileNotFoundError(errno.ENOENT, "No such file or directory", "/dev/shm/gone"),
     "FileNotFoundError: [Errno 2] No such file or directory: '/dev/shm/gone'"),
])
def test_a_fault_of_the_driver_itself_is_one_line_and_a_failed_result(error, said, tmp_path, monkeypatch, capsys):
    import pcpflow.driver.job as job

    def launch(cfg, run_dir):
        raise error

    monkeypatch.setattr(job, "launch_ranks", launch)
    run_dir = tmp_path / "run"
    assert run_job(compose_raw(["pcp=2"]), run_dir, console=False) == 1
    err = capsys.readouterr().err
    assert f"pcpflow: the driver failed: {said}" in err and "Traceback" not in err and "run dir" not in err
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["exit_code"], result["error"]) == ("failed", 1, f"the driver failed: {said}")
    assert "raise error" in (run_dir / "logs" / "driver_error.txt").read_text()
    assert not (run_dir / LOCK_FILE).exists()


@pytest.mark.parametrize("where", ["summary", "run"])
def test_a_console_closed_while_a_job_prints_keeps_an_honest_result(where, tmp_path, monkeypatch):
    # ``| head``: the reader leaves; a finished run's result stands (its exit code too), one not
    # finished is failed, saying why (the real pipe: test_cli.py's closed console, slow)
    import pcpflow.driver.job as job
    import pcpflow.output.report as report

    def closed(*args, **kwargs):
        raise ConsoleGone(errno.EPIPE, "Broken pipe")  # NOTE: what a guarded console raises (pcpflow.output.console)

    monkeypatch.setattr(*((report, "print_summary", closed) if where == "summary" else (job, "launch_ranks", closed)))
    run_dir = tmp_path / "run"
    code = run_job(compose_raw(["pcp=1", "workload.num_requests=1", "output.plots=false"]), run_dir)
    result = json.loads((run_dir / "result.json").read_text())
    assert not (run_dir / LOCK_FILE).exists()
    if where == "summary":
        assert (code, result["status"], result["exit_code"]) == (0, "ok", 0)
    else:
        assert (code, result["status"], result["exit_code"]) == (1, "failed", 1)
        assert result["error"] == "the console could not be written (Broken pipe) before the run ended"


def test_a_storage_error_of_the_run_dir_mid_run_is_said_as_the_run_dirs(tmp_path, monkeypatch, capsys):
    import pcpflow.driver.job as job

    run_dir = tmp_path / "run"

    def launch(cfg, run_dir_):
        raise OSError(errno.ENOSPC, "No space left on device", str(run_dir / "metrics.jsonl"))

    monkeypatch.setattr(job, "launch_ranks", launch)
    assert run_job(compose_raw(["pcp=2"]), run_dir, console=False) == 1
    err = capsys.readouterr().err
    assert f"the run dir {run_dir} cannot be written: No space left on device ({run_dir / 'metrics.jsonl'})" in err
    assert not (run_dir / "logs" / "driver_error.txt").exists()


def test_more_ranks_than_the_fork_server_can_start_are_refused_naming_the_setting():
    # Linux passes at most 253 descriptors in one message (SCM_MAX_FD), multiprocessing's fork
    # server 4 of its own, and torch's elastic launcher hands each rank both ends of every rank's
    # result queue: 124 ranks start (measured: pcp=124 ran, pcp=125 failed with EINVAL, 126+ with
    # "too many fds"); the probe below finds the same bound with the queues alone
    done = cli("pcp=125", "workload.num_requests=1")
    assert done.returncode == 2
    assert "pcp: got 125; tp*pcp = 125 ranks: pcpflow's own launch starts at most 124 on one host" in done.stderr
    done = cli("tp=2", "pcp=63", "workload.num_requests=1")
    assert done.returncode == 2 and "pcp: got 63; tp*pcp = 126 ranks" in done.stderr
    done = cli("pcp=124", "workload.num_requests=1", "--cfg", "job")
    assert done.returncode == 0 and "starts at most" not in done.stderr


_PROBE = """
import errno, multiprocessing, sys

def start(n):
    ctx = multiprocessing.get_context("forkserver")
    queues = {i: ctx.SimpleQueue() for i in range(n)}  # kept: the child opens their locks by name
    proc = ctx.Process(target=len, args=(queues,))
    proc.start()
    proc.join(30)
    return proc.exitcode

assert start(124) == 0
try:
    start(125)
except OSError as exc:
    print(errno.errorcode[exc.errno])
"""


@pytest.mark.skipif("forkserver" not in __import__("multiprocessing").get_all_start_methods(), reason="no fork server")
def test_the_fork_server_passes_a_process_the_queues_of_124_ranks_and_not_125():
    # NOTE: in a Python of its own: a refused start takes its fork server down, and this one's serves the ranks
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["EINVAL"]


def test_a_library_error_that_replaced_the_signal_in_a_job_is_the_signal_not_a_driver_fault(tmp_path, monkeypatch, capsys):
    # torch elastic's metrics wrapper fails in its `finally` when a signal lands before its first
    # line (docs/faults.md); inside the driver's handler a job's own is the same one (nested)
    import signal

    import pcpflow.driver.job as job
    from pcpflow.signals import interruptible

    def launch(cfg, run_dir):
        try:
            signal.raise_signal(signal.SIGTERM)
            time.sleep(0.05)
        finally:
            raise UnboundLocalError("cannot access local variable 'start'")

    monkeypatch.setattr(job, "launch_ranks", launch)
    run_dir = tmp_path / "run"
    with pytest.raises(BaseException) as outer:  # the driver's handler, as `python -m pcpflow` has it
        with interruptible():
            code = run_job(compose_raw(["pcp=2"]), run_dir, console=False)
            raise SystemExit(code)
    assert isinstance(outer.value, SystemExit) and outer.value.code == 143
    result = json.loads((run_dir / "result.json").read_text())
    assert (result["status"], result["error"], result["exit_code"]) == ("failed", "interrupted by SIGTERM", 143)
    assert not (run_dir / "logs" / "driver_error.txt").exists()


def test_more_ranks_than_cores_warns():
    cores = len(os.sched_getaffinity(0))
    cfg = compose(["pcp=1"]).model_copy(update={"pcp": 4 * cores + 1, "device": "cpu"})
    (warning,) = capacity_warnings(cfg)
    assert f"{4 * cores + 1} ranks" in warning and f"{cores} CPU core" in warning
    assert capacity_warnings(compose(["pcp=1"]).model_copy(update={"device": "cpu"})) == []
    # with pools, the count names both (the decode pool: tp=2 pcp=2, 4 ranks)
    pools = compose(["disagg=pd", f"pcp={4 * cores}", "disagg.decode_pool.tp=2", "disagg.decode_pool.pcp=2"])
    (warning,) = capacity_warnings(pools.model_copy(update={"device": "cpu"}))
    assert f"{4 * cores + 4} ranks ({4 * cores} prefill + 4 decode)" in warning and "tp*pcp" not in warning
    # cpu_bind=cores asks for cores of their own: where the ranks do not fit, they run unbound, and it says so
    assert capacity_warnings(compose(["pcp=1", "cpu_bind=cores"]).model_copy(update={"device": "cpu"})) == []
    over = compose(["pcp=1", "cpu_bind=cores"]).model_copy(update={"pcp": cores + 1, "device": "cpu"})
    assert capacity_warnings(over) == [f"cpu_bind=cores: tp*pcp = {cores + 1} ranks x threads_per_rank=1 need "
                                       f"{cores + 1} cores of their own, this job may use {cores}: the OS places the "
                                       "threads (metrics.cpu_cores: null)"]


def test_sweep_report_flags_a_truncated_result_and_reports_the_rest(tmp_path):
    for job, text in [("0", json.dumps({"status": "ok", "metrics": {"num_steps": 3}})), ("1", '{"status": "ok", "metr')]:
        (tmp_path / job).mkdir()
        (tmp_path / job / "result.json").write_text(text)
    r = subprocess.run([sys.executable, "-m", "pcpflow.driver.sweep", str(tmp_path)], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    assert r.returncode == 0, r.stderr
    rows = (tmp_path / "sweep.csv").read_text().splitlines()
    assert len(rows) == 3 and ",ok," in rows[1] and ",unreadable," in rows[2] and "1/result.json" in rows[2]


# ------------------------------------------------------------------------------ config fuzz
_OVERRIDES = st.sampled_from([
    "pcp=1", "pcp=2", "pcp=3", "pcp=0", "pcp=-1", "dcp=2", "dcp=3", "tp=2", "decode=sharded", "decode=bogus",
    "dtype=float32", "dtype=int8", "seed=-5", f"seed={2**64}", "seed=abc", "verify=false", "verify=maybe",
    "kv.block_size=0", "kv.block_size=1", "kv.num_blocks=1", "kv.num_blocks=100000000", "kv.interleave=4",
    "scheduler.max_num_seqs=1", "scheduler.max_num_batched_tokens=1", "scheduler.max_num_batched_tokens=1000000000000",
    "workload=explicit", "workload=trace", "workload.prompt_lens=[1,2]", "workload.output_lens=[1,2,3]",
    "workload.num_requests=0", "workload.prompt_len=[9,3]", "draft=mtp", "draft=dspark", "draft=self",
    "pipeline.restore.kind=sampled_rows", "pipeline.forward.kind=nope", "plugins=[no_such_plugin]",
    "+nonsense=1", "collective_timeout_s=0", "startup_timeout_s=-1", "max_steps=0", "threads_per_rank=0",
    "model=tiny_gqa", "model.num_layers=0", "sampling.temperature=0.5", "mode=simulate", "model=hf",
])


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_OVERRIDES, min_size=1, max_size=5, unique_by=lambda o: o.split("=")[0]))
def test_config_fuzz_every_outcome_is_valid_or_one_clean_config_error(overrides):
    try:
        prepare_job(compose_raw(overrides))
    except ConfigError as exc:
        assert exc.problems and all(p.field and p.allowed for p in exc.problems)
        assert "Traceback" not in exc.report()


def test_a_missing_optional_dependency_names_the_extra(monkeypatch, tmp_path):
    import importlib.util
    import runpy

    from pcpflow.errors import missing_extra

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("safetensors", "transformers") else real(name, *a))
    message = missing_extra(("safetensors", "numpy"), "hf")
    assert message.startswith("safetensors not installed: install pcpflow's 'hf' extra") and "pip install" in message
    assert missing_extra(("numpy",), "hf") is None
    # the driver: model=hf without safetensors is one problem naming the extra
    from types import SimpleNamespace

    from pcpflow.models.hf import checkpoint_problems

    (problem,) = checkpoint_problems(SimpleNamespace(name="hf", path=str(tmp_path)))
    assert problem.field == "model" and "'hf' extra" in problem.allowed
    # the checkpoint maker: one line naming the extra, no traceback
    main = runpy.run_path(str(REPO / "scripts" / "make_tiny_hf_checkpoint.py"))["main"]
    with pytest.raises(SystemExit) as exit_:
        main(["--arch", "llama", "--out", str(tmp_path / "ckpt")])
    assert str(exit_.value.code).startswith("make_tiny_hf_checkpoint.py: transformers and safetensors not installed")
    assert not (tmp_path / "ckpt").exists()


# ------------------------------------------------------------------------------ messages
def test_a_refused_boolean_keeps_a_custom_error_beside_it():
    """The boolean check judges the other fields all the same: a plugin's own error type
    (``PydanticCustomError``) is said beside it, as pydantic said it."""
    from pydantic import ValidationError, field_validator
    from pydantic_core import PydanticCustomError

    from pcpflow.errors import Settings

    class Plugin(Settings):
        flag: bool = False
        n: int = 0

        @field_validator("n")
        @classmethod
        def _small(cls, v):
            if v > 3:
                raise PydanticCustomError("too_big", "at most 3, got {n}", {"n": v})
            return v

    with pytest.raises(ValidationError) as e:
        Plugin.model_validate({"flag": "yes", "n": 5})
    assert [(x["loc"], x["type"], x["msg"]) for x in e.value.errors()] == [
        (("flag",), "bool_type", "Input should be a valid boolean"), (("n",), "too_big", "at most 3, got 5")]


@pytest.mark.parametrize("args, field, says", [
    (["verify=maybe"], "verify", "got 'maybe'; allowed: true, false"),
    (["output.plots=3"], "output.plots", "got 3; allowed: true, false"),
    (["mode=profile", "profile.quick=often"], "profile.quick", "got 'often'; allowed: true, false"),
    # true or false only: pydantic's lax 'yes', 'on' and 1 would pass for a boolean the message says is not one
    (["verify=1"], "verify", "got 1; allowed: true, false"),
    (["kv.prefix_caching=yes"], "kv.prefix_caching", "got 'yes'; allowed: true, false"),
    (["workload.ignore_eos=on"], "workload.ignore_eos", "got 'on'; allowed: true, false"),
    # drafts per step where no drafter runs: the drafters that take them, whichever key tried
    (["+pipeline.draft.num_speculative_tokens=3"], "pipeline.draft.num_speculative_tokens",
     "got 3; draft.num_speculative_tokens is a setting of draft=dspark / draft=mtp / draft=self; add draft=dspark"),
    # one problem, one message: a value that is not a list is not also judged as its entries
    (["plugins=boom"], "plugins", "got 'boom'; a list"),
    # a dtype given twice is one problem naming it; a wrong name given twice is one problem too
    (["mode=profile", "profile.dtypes=[bfloat16,float32,bfloat16]"], "profile.dtypes",
     "bfloat16 is given 2 times; allowed: float32, float64, bfloat16, each at most once"),
    (["mode=profile", "profile.dtypes=[float32,3,float32]"], "profile.dtypes",
     "float32 is given 2 times; 3 is not a dtype name; allowed: float32, float64, bfloat16, each at most once"),
    (["mode=profile", "profile.dtypes=[bf16,bf16]"], "profile.dtypes",
     "bf16 is not a dtype name (did you mean 'bfloat16'?), given 2 times; allowed: float32, float64, bfloat16, each at most once"),
    # a tp refused: every rule it breaks, and the values the model allows
    (["tp=3"], "tp", "must divide the model's num_heads (4) and MLP width intermediate_size (128); allowed: [1, 2, 4]"),
    (["model=tiny_gqa", "tp=3"], "tp", "must divide the model's num_heads (4) and MLP width intermediate_size (128); "
     "the model's num_kv_heads (2) must be a multiple of tp or divide it; allowed: [1, 2, 4]"),
])
def test_one_message_per_problem_naming_the_allowed_values(args, field, says):
    r = cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 1 and lines[0].startswith(f"- {field}: ") and says in lines[0], lines


@pytest.mark.parametrize("args, line", [
    # the run config's, with the closest choice where one is close
    (["dtype=bf16"], "dtype: got 'bf16'; allowed: float32, float64, bfloat16 (did you mean 'bfloat16'?)"),
    (["decode=sharded", "decode.assignment=diagonal"], "decode.assignment: got 'diagonal'; allowed: round_robin, balanced"),
    # a stage's config
    (["pipeline.forward.attention=fusd"],
     "pipeline.forward.attention: got 'fusd'; allowed: reference, fused, auto (did you mean 'fused'?)"),
    # a list of choices (a profile's dtypes), a section of a simulated and of a searched run
    (["mode=profile", "profile.dtypes=[float32,3]"],
     "profile.dtypes: got ['float32', 3]; 3 is not a dtype name; allowed: float32, float64, bfloat16, each at most once"),
    (["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "serving.router=random"],
     "serving.router: got 'random'; allowed: round_robin, least_loaded, prefix_aware"),
    (["mode=search", "search.gpus=8", "hardware=h100_sxm", "simulate.objective=ttfx"],
     "simulate.objective: got 'ttfx'; allowed: ttft, tpot, gpus, ttft_x_gpus, tpot_x_gpus, throughput_per_gpu, "
     "goodput_per_gpu (did you mean 'ttft'?)"),
    # the key that picks a model or workload names itself, not the whole section
    (["workload.kind=bogus"], "workload.kind: got 'bogus'; allowed: synthetic, explicit, trace"),
])
def test_a_fixed_choice_names_the_choices(args, line):
    r = cli(*args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert lines == [f"- {line}"], lines
