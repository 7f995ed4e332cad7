"""``mode=profile`` and ``hardware=measured`` (issue 28): the profile's schema, its partial
form, loading it (overrides on top, ``--cfg job``), the fits and request shapes by hand, and
bad input: one clear problem each, exit 2, nothing started."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from measured_profile import profile_dict

from pcpflow.config.hardware import HardwareConfig
from pcpflow.errors import ConfigError
from pcpflow.profile.document import Document, borrowed_sections
from pcpflow.profile.sections import attention_requests, fit_collective, fit_host, monotone
from pcpflow.testing import cli, compose

SIM = ["mode=simulate", "hardware=measured", "dtype=float32", "model=tiny_gqa", "pcp=2", "output.plots=false",
       "output.progress=false"]


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(profile_dict()))
    return path


def _one_problem(*args: str) -> str:
    r = cli(*args)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "Traceback" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_a_measured_profile_loads_under_hardware_with_overrides_on_top(profile_path):
    cfg = compose([*SIM, f"hardware.path={profile_path}", "hardware.host.launch_us=3"])
    assert cfg.hardware.name == "measured" and cfg.hardware.path == str(profile_path)
    assert cfg.hardware.host.launch_us == 3 and cfg.hardware.host.kernels_per_layer == 40  # the rest: the file's
    assert cfg.hardware.tables.host.fixed_us == 1000 and not cfg.hardware.overlap.host


def test_cfg_job_shows_the_loaded_values(profile_path):
    r = cli("--cfg", "job", *SIM, f"hardware.path={profile_path}")
    assert r.returncode == 0, r.stderr
    shown = yaml.safe_load(r.stdout)
    assert shown["hardware"]["path"] == str(profile_path) and shown["hardware"]["tables"]["host"]["fixed_us"] == 1000
    # a part of it (-p), from the loaded profile too; a key the loaded config lacks is bad input
    r = cli("--cfg", "job", "-p", "hardware.tables.host", *SIM, f"hardware.path={profile_path}")
    assert r.returncode == 0 and yaml.safe_load(r.stdout) == shown["hardware"]["tables"]["host"], r
    r = cli("--cfg", "job", "-p", "hardware.tables.host.fixed_us", *SIM, f"hardware.path={profile_path}")
    assert r.returncode == 0 and float(r.stdout) == 1000, r
    r = cli("--cfg", "job", "-p", "hardware.tables.nope", *SIM, f"hardware.path={profile_path}")
    assert r.returncode == 2 and "- --package: got 'hardware.tables.nope'; a key of the job's config; at 'nope'" in r.stderr


@pytest.mark.parametrize("args, field, says", [
    (["hardware.path=/no/such/profile.yaml"], "hardware.path", "does not exist"),
    (["hardware.path={bad}"], "hardware.path", "does not parse"),
    (["hardware.path={path}", "dtype=bfloat16"], "dtype", "measured float32"),
    (["hardware.path={path}", "pcp=4"], "pcp", "groups of 2 ranks"),
    (["hardware.path={path}", "pipeline.forward.attention=fused"], "pipeline.forward.attention", "reference"),
    (["hardware.path={partial}"], "hardware.path", "lacks gemm:float32"),
])
def test_a_bad_profile_is_one_clear_problem(tmp_path, profile_path, args, field, says):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    partial = tmp_path / "partial.yaml"
    doc = profile_dict()
    doc["measured"].update(status="partial", missing=["gemm:float32", "collectives"])
    partial.write_text(yaml.safe_dump(doc))
    paths = {"path": profile_path, "bad": bad, "partial": partial}
    line = _one_problem(*SIM, *(a.format(**paths) for a in args), f"hydra.run.dir={tmp_path / 'run'}")
    assert line.strip().startswith(f"- {field}:") and says in line, line


@pytest.mark.parametrize("value", [True, "1e-5"])
def test_a_table_entry_is_a_number_as_written(tmp_path, value):
    """A boolean or a string inside a table is refused, named down to the entry (a boolean
    is never a number): not priced as 1.0 s or parsed from the string."""
    doc = profile_dict()
    doc["tables"]["memory"]["seconds"][0] = value
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(doc))
    line = _one_problem(*SIM, f"hardware.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
    assert line.strip().startswith("- hardware.tables.memory.seconds.0:") and "a valid number" in line, line


def test_hardware_path_needs_hardware_measured(profile_path):
    line = _one_problem("mode=simulate", "hardware=h100_sxm", "model=llama3_8b", f"hardware.path={profile_path}")
    assert "hardware.path" in line and "hardware=measured" in line


def test_profile_settings_belong_to_mode_profile():
    line = _one_problem("profile.quick=true")
    assert "profile" in line and "mode=profile" in line


def test_a_world_this_machine_cannot_start_is_refused():
    import os

    cores = len(os.sched_getaffinity(0))
    line = _one_problem("mode=profile", f"pcp={cores + 1}")
    assert line.strip().startswith("- pcp:") and f"this machine has {cores}" in line
    line = _one_problem("mode=profile", "pcp=1", "profile.collectives_from=measured")
    assert "profile.collectives_from" in line and "h200_sxm" in line


def test_an_interrupted_profile_says_partial_and_what_it_lacks(tmp_path):
    doc = Document(tmp_path / "hardware.yaml", device="cpu: test", backend="gloo", tp=1, pcp=2, threads=1,
                   dtypes=["float32"], quick=True, attention="reference", block_size=16, sections=["launch", "memory", "gemm:float32"],
                   collectives_from=None)
    doc.add("memory", {"bytes": [4096, 1 << 20], "seconds": [1e-6, 1e-4]}, seconds=0.5)
    written = doc.write(elapsed_s=1.0)
    on_disk = yaml.safe_load((tmp_path / "hardware.yaml").read_text())
    assert on_disk == written
    assert on_disk["measured"]["status"] == "partial" and on_disk["measured"]["missing"] == ["launch", "gemm:float32"]
    assert on_disk["tables"]["memory"]["bytes"] == [4096, 1 << 20]
    with pytest.raises(ConfigError) as err:
        compose([*SIM, f"hardware.path={tmp_path / 'hardware.yaml'}"])
    (problem,) = err.value.problems
    assert problem.field == "hardware.path" and "partial" in problem.allowed and "launch, gemm:float32" in problem.allowed


def test_a_section_it_could_not_measure_names_its_source():
    borrowed = borrowed_sections("h200_sxm")
    assert borrowed["nvlink"]["from"] == "h200_sxm" and borrowed["network"]["from"] == "h200_sxm"
    gpu = {**profile_dict(device="gpu", sm_count=132, overlap={"host": True, "p2p": True}), **borrowed}
    gpu["tables"] = {k: v for k, v in gpu["tables"].items() if k != "collectives"}
    hw = HardwareConfig.model_validate(gpu)
    assert hw.nvlink.from_ == "h200_sxm" and hw.nccl and hw.arch == "hopper"


def test_the_shipped_profiles_stay_valid_and_say_they_are_not_measured():
    from pcpflow.paths import conf_dir

    for path in (Path(conf_dir()) / "hardware").glob("*.yaml"):
        if path.stem == "measured":
            continue
        hw = HardwareConfig.model_validate(yaml.safe_load(path.read_text()))
        assert hw.tables is None and hw.measured is None and hw.overlap.host and hw.nccl, path.stem


def test_prefill_and_decode_shapes_have_the_rows_and_mean_keys_asked():
    assert attention_requests("decode", 4, 512) == [(511, 1)] * 4
    for rows, keys in [(32, 64), (2048, 64), (512, 512), (2048, 2048), (100, 7)]:
        reqs = attention_requests("prefill", rows, keys)
        assert sum(q for _, q in reqs) == rows
        pairs = sum(q * c + q * (q + 1) / 2 for c, q in reqs)  # row i of a chunk sees c + i keys
        assert abs(pairs / rows - keys) <= 1.0, (rows, keys, reqs)
    assert attention_requests("prefill", 2048, 2048) == [(1024, 2048)]  # (1024 + 2049 / 2): 2048.5


def test_fits_recover_the_laws_they_were_made_from():
    sizes = [64, 4096, 1 << 20, 1 << 24]
    lat, gbps = fit_collective(sizes, [150e-6 + b / 2e9 for b in sizes])
    assert lat == pytest.approx(150.0, rel=1e-6) and gbps == pytest.approx(2.0, rel=1e-6)
    points = []
    for reqs, toks in [(1, 16), (4, 64), (16, 256), (1, 1024), (4, 4), (1, 1)]:
        for layers in (1, 2):
            outside = 1e-3 + 5e-5 * reqs + 2e-6 * toks
            forward = 2e-4 + 1e-6 * toks + layers * (3e-4 + 1e-5 * reqs)
            points.append([reqs, toks, layers, outside, forward])
    fit = fit_host(points)
    assert fit["fixed_us"] == pytest.approx(1200, rel=1e-6)
    assert fit["per_request_us"] == pytest.approx(50, rel=1e-6) and fit["per_token_us"] == pytest.approx(3, rel=1e-6)
    one = sorted(p for p in points if p[2] == 1)
    assert list(zip(fit["requests"], fit["tokens"])) == [(p[0], p[1]) for p in one]
    assert np.allclose(fit["seconds"], [p[3] + p[4] - (3e-4 + 1e-5 * p[0]) for p in one])
    # Each shape's median counts: one slow repeat among three changes nothing, two of three do.
    slower = [[*p[:3], p[3] * 3, p[4] * 2] for p in points]
    assert fit_host(points + points + slower)["fixed_us"] == pytest.approx(fit["fixed_us"])
    assert fit_host(points + slower + slower)["fixed_us"] == pytest.approx(3 * 1000 + 2 * 200, rel=1e-6)


def test_a_larger_message_never_costs_less():
    assert monotone([3e-3, 2e-4, 5e-4, 4e-4, 1e-3]) == [2e-4, 2e-4, 4e-4, 4e-4, 1e-3]


def test_every_profile_key_is_in_help():
    text = cli("--help").stdout
    for key in ("profile.quick", "profile.dtypes", "profile.collectives_from"):
        assert key in text, key
    assert "profile" in text.split("config groups")[1].split("settings")[0]  # mode=profile listed


def test_cold_operands_are_fresh_views_a_whole_pool_apart():
    """A 64 KiB float32 pool: 100-element views sit 4 KiB apart (1,024 elements), so the pool
    holds 16; asking for 20 gives those 16, and the next ask goes on from where the cursor
    stopped, wrapping to the start. A view larger than the pool is a tensor of its own."""
    import torch

    from pcpflow.profile.sections import ColdPool

    pool = ColdPool(64 << 10, torch.device("cpu"))
    views = pool.views((100,), torch.float32, 20)
    base = pool._buffer_of(torch.float32).data_ptr()
    assert [(v.data_ptr() - base) // 4 for v in views] == [1024 * i for i in range(16)]
    assert all(v.shape == (100,) and v.abs().max() <= 1 for v in views)  # filled, uniform in [-1, 1]
    again = pool.views((2, 50), torch.float32, 3)  # the cursor wrapped: 0, then on
    assert [(v.data_ptr() - base) // 4 for v in again] == [0, 1024, 2048]
    big = pool.views((2, 32768), torch.float32, 5)
    assert len(big) == 1 and big[0].shape == (2, 32768) and big[0].untyped_storage().data_ptr() != base
    nxt = pool.cycle((10,), torch.float32, 2)
    first, second, third = nxt(), nxt(), nxt()
    assert first.data_ptr() != second.data_ptr() and third.data_ptr() == first.data_ptr()


def test_the_cold_pool_is_twice_the_last_level_cache_within_bounds(monkeypatch):
    import torch

    from pcpflow.profile import sections
    from pcpflow.profile.grid import FULL, QUICK

    cpu = torch.device("cpu")
    assert sections.cold_pool_bytes(QUICK, cpu) == 32 << 20
    for cache, pool in ((480 << 20, 960 << 20), (32 << 20, 256 << 20), (4 << 30, 2 << 30), (None, 256 << 20)):
        monkeypatch.setattr(sections, "last_level_cache_bytes", lambda device, c=cache: c)
        assert sections.cold_pool_bytes(FULL, cpu) == pool


def _edit(doc: dict, path: str, value) -> None:
    """Set (or, with ``...``, remove) the value at a dotted path of a profile dict."""
    *parents, last = path.split(".")
    node = doc
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    if value is ...:
        del node[last]
    else:
        node[int(last) if isinstance(node, list) else last] = value


@pytest.mark.parametrize("path, value, field, says", [
    ("tables.collectives.0.seconds.1", -0.001, "hardware.tables.collectives.0.seconds.1", "greater than 0"),
    ("tables.gemm.float32.seconds.0.0.0", -1.0, "hardware.tables.gemm.float32.seconds.0.0.0", "greater than 0"),
    ("tables.memory.seconds.0", 0.0, "hardware.tables.memory.seconds.0", "greater than 0"),
    ("tables.memory.bytes", [1024, 2**20], "hardware.tables.memory.seconds", "one value per point of bytes"),
    ("tables.collectives.0.bytes", [10**6, 1000], "hardware.tables.collectives.0.bytes", "strictly increasing"),
    ("tables.gemm.float32.m", [1, 64], "hardware.tables.gemm.float32.seconds", "must be 2 x 3 x 3"),
    ("tables.host", ..., "hardware.tables.host", "required"),
    ("tables.launch", ..., "hardware.tables.launch", "required"),
    ("tables.memory", ..., "hardware.tables.memory", "required"),
    ("tables.gemm", ..., "hardware.tables.gemm", "required"),
    ("tables.attention", ..., "hardware.tables.attention", "required"),
    ("tables.sync", ..., "hardware.tables.sync", "slowest rank"),
    ("tables", ..., "hardware.tables", "gemm, attention, memory, launch, host"),
    ("measured", ..., "hardware.path", "no measured section"),
])
def test_a_broken_table_is_one_problem_naming_it(tmp_path, path, value, field, says):
    doc = profile_dict()
    _edit(doc, path, value)
    broken = tmp_path / "broken.yaml"
    broken.write_text(yaml.safe_dump(doc))
    line = _one_problem(*SIM, f"hardware.path={broken}", f"hydra.run.dir={tmp_path / 'run'}")
    assert line.strip().startswith(f"- {field}:") and says in line, line
    assert len(line) < 600, line  # the table or field at fault, never the whole profile


def test_a_profile_of_one_rank_needs_no_collectives_or_sync(tmp_path):
    doc = profile_dict()
    doc["tables"].update(collectives=[], sync=None)
    assert HardwareConfig.model_validate(doc).tables.sync is None


def test_validate_measured_reprices_an_earlier_runs_executed_times(tmp_path, profile_path, capsys):
    """``scripts/validate_measured.py --reprice DIR``: an earlier run's executed times against the
    price this code gives on its profile, nothing executed. The row's simulated TTFT is the one a
    simulated run of the same configuration gives; its error is against the file's executed
    median (10 ms)."""
    import json
    import runpy

    from pcpflow.simulate.engine import simulate_run

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "validate_measured.py"))
    name = "host 8x24 pcp=1"
    row = dict(script["MATRIX"])[name]
    executed = [{"ttft": t, "tpot": 0.002, "step": 0.003} for t in (0.0099, 0.010, 0.0101)]
    run = tmp_path / "run"
    run.mkdir()
    (run / "validate_measured.json").write_text(json.dumps(
        {"profile": str(profile_path), "load": {"before": [], "after": [], "cores": 2}, "executed": {name: executed}}))
    assert script["main"](["--reprice", str(run), "--only", "host 8x24 pcp=1"]) == 0
    out = capsys.readouterr().out
    sim = simulate_run(compose(script["simulated_overrides"](row, str(profile_path))))["metrics"]["ttft"]["mean_s"]
    line = next(ln for ln in out.splitlines() if ln.startswith(f"| {name} |"))
    assert f"10.0 / {sim * 1e3:.1f} ({sim / 0.010 - 1:+.0%}, ±2%)" in line
    assert script["main"](["--reprice", str(run), "--only", "gemm"]) == 2  # a row the run never executed


@pytest.mark.slow  # NOTE: ~10 s; the default set keeps to 6 minutes
def test_validate_measured_prices_each_row_on_the_profile_of_its_own_world_size(tmp_path, capsys):
    """A CPU op runs faster beside idle cores than beside busy ranks, so ``validate_measured.py``
    profiles each world size of its rows and prices a row on its own: given a one-rank and a
    two-rank profile (their laws 3x apart), a pcp=1 row is priced as a simulated run on the
    one-rank profile, pcp=2 and tp=2 rows on the two-rank one; a world without its own profile
    takes the nearest."""
    import json
    import runpy

    from pcpflow.simulate.engine import simulate_run

    script = runpy.run_path(str(Path(__file__).resolve().parents[2] / "scripts" / "validate_measured.py"))
    one, two = tmp_path / "one.yaml", tmp_path / "two.yaml"
    slow = profile_dict()
    slow["measured"]["pcp"] = 1
    slow["tables"]["gemm"]["float32"]["seconds"] = [[[3 * t for t in n] for n in m] for m in slow["tables"]["gemm"]["float32"]["seconds"]]
    one.write_text(yaml.safe_dump(slow))
    two.write_text(yaml.safe_dump(profile_dict()))
    profiles = script["profiles_by_world"]([str(two), str(one)])
    assert profiles == {1: str(one), 2: str(two)}
    partial = tmp_path / "partial.yaml"
    doc = profile_dict()
    doc["measured"].update(status="partial", missing=["collectives"])
    partial.write_text(yaml.safe_dump(doc))
    for bad in (tmp_path / "nowhere.yaml", partial):  # one line naming --profile, exit 2, no traceback
        with pytest.raises(SystemExit) as exc:
            script["profiles_by_world"]([str(bad)])
        assert exc.value.code == 2
    rows = dict(script["MATRIX"])
    assert script["profile_for"](profiles, rows["gemm 1x1200 pcp=1"]) == str(one)
    assert script["profile_for"](profiles, rows["gemm 1x1200 pcp=2"]) == str(two)
    assert script["profile_for"](profiles, rows["gemm 3x600 tp=2"]) == str(two)
    assert script["profile_for"]({1: str(one)}, rows["gemm 3x600 tp=2"]) == str(one)

    names = ["gemm 1x1200 pcp=1", "gemm 1x1200 pcp=2"]
    run = tmp_path / "run"
    run.mkdir()
    executed = {n: [{"ttft": 0.5, "tpot": 0.01, "step": 0.05}] * 3 for n in names}
    (run / "validate_measured.json").write_text(json.dumps(
        {"profiles": {"1": str(one), "2": str(two)}, "load": {"before": [], "after": [], "cores": 2}, "executed": executed}))
    assert script["main"](["--reprice", str(run), "--only", "gemm 1x1200"]) == 0
    out = capsys.readouterr().out
    for name, path in zip(names, (one, two)):
        sim = simulate_run(compose(script["simulated_overrides"](rows[name], str(path))))["metrics"]["ttft"]["mean_s"]
        line = next(ln for ln in out.splitlines() if ln.startswith(f"| {name} |"))
        assert f"500.0 / {sim * 1e3:.1f} " in line, (line, sim)


def test_a_cpu_profile_of_another_world_size_is_named_when_a_run_prices_on_it(tmp_path, profile_path):
    """The profile was measured with two busy ranks: a pcp=1 run on it says so and how to
    measure its own; a pcp=2 run, as many ranks as measured, hears nothing."""
    run = [*SIM, f"hardware.path={profile_path}"]
    one = cli(*run, "pcp=1", f"hydra.run.dir={tmp_path / 'one'}")
    assert one.returncode == 0, one.stderr[-2000:]
    warned = [ln for ln in one.stderr.splitlines() if ln.startswith("pcpflow: warning: hardware.path was measured")]
    assert len(warned) == 1 and "on 2 busy rank(s)" in warned[0] and "mode=profile tp=1 pcp=1" in warned[0], one.stderr
    two = cli(*run, "pcp=2", f"hydra.run.dir={tmp_path / 'two'}")
    assert two.returncode == 0 and "warning" not in two.stderr, two.stderr[-2000:]


def test_an_earlier_profile_in_the_run_dir_is_set_aside(tmp_path, monkeypatch):
    """A profile run into a dir that holds an older hardware.yaml sets it aside before it
    measures: an interrupted run never passes the older file off as what it kept."""
    from pcpflow.driver import job

    (tmp_path / "hardware.yaml").write_text("older: true\n")
    seen = []
    monkeypatch.setattr(job, "launch_ranks", lambda cfg, run_dir, work: seen.append((run_dir / "hardware.yaml").exists()) or {})
    job._profile(compose(["mode=profile", "pcp=1", "profile.quick=true"]), tmp_path, console=False)
    assert seen == [False] and (tmp_path / "hardware.previous.yaml").read_text() == "older: true\n"
    assert job._partial_note(compose(["mode=profile", "pcp=1"]), tmp_path) == ""


def test_a_profile_measures_the_shipped_stages_only(tmp_path):
    """Its host section runs the engine: a user's plugins or extra stages would be measured
    as if they were pcpflow's own, or break it. They are refused by name, each its own
    problem, beside the other problems of the command, and nothing is started."""
    run = tmp_path / "run"
    r = cli("mode=profile", "pcp=1", "profile.quick=true", "plugins=[pcpflow_test_plugins.probes]",
            "+pipeline.extra=[{kind: test_call_counter, after: forward}]",
            "pipeline.forward.kind=pcpflow_test_plugins.probes:QueriesOnlyForward", "pipeline.restore.kind=sampled_row",
            f"hydra.run.dir={run}")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = {ln.strip()[2:].split(":", 1)[0]: ln for ln in r.stderr.splitlines() if ln.strip().startswith("- ")}
    assert set(lines) == {"plugins", "pipeline.extra", "pipeline.forward.kind", "pipeline.restore.kind"}, r.stderr
    for field in ("plugins", "pipeline.extra", "pipeline.forward.kind"):
        assert "mode=profile measures the shipped stages only" in lines[field], lines[field]
    assert "one of model" in lines["pipeline.forward.kind"]
    assert not run.exists()
    # pcpflow's own stages are what it measures: a shipped choice of a slot is one of them
    assert compose(["mode=profile", "pcp=1", "pipeline.restore.kind=sampled_rows"]).pipeline["restore"]["kind"] == "sampled_rows"


def test_a_profile_s_plugin_that_does_not_import_is_one_problem():
    """Plugins are refused in a profile whatever they are: why one would not import is moot."""
    line = _one_problem("mode=profile", "pcp=1", "plugins=[no_such_module_pcpflow]")
    assert line.strip() == ("- plugins: got ['no_such_module_pcpflow']; none: mode=profile measures the shipped "
                            "stages only; leave them out of the profile's command")


NO_DRAFTING = "a setting of mode=execute: mode=profile measures the shipped engine without drafting; leave it out"


@pytest.mark.parametrize("args, field, given", [
    (["draft=mtp"], "draft", "'mtp'"),
    # the drafter's settings are the same problem, said once
    (["draft=dspark", "draft.num_speculative_tokens=5", "draft.block_attention=sideways"], "draft", "'dspark'"),
    # a drafter's key without one: not "add draft=dspark", which would be refused in turn
    (["draft.num_speculative_tokens=3"], "draft.num_speculative_tokens", "3"),
    (["pipeline.draft.kind=self"], "pipeline.draft.kind", "'self'"),
    # a plugin's drafter: the plugins refused, and the drafter (not as a stage that is not pcpflow's own)
    (["plugins=[pcpflow_test_plugins.toy_drafter]", "pipeline.draft.kind=toy_repeat"], "pipeline.draft.kind", "'toy_repeat'"),
])
def test_a_profile_refuses_drafting(args, field, given):
    """Its host section runs the shipped engine without a drafter: draft settings would be
    accepted and ignored, so they are refused as a setting of another mode is."""
    r = cli("mode=profile", "pcp=1", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    drafting = [ln for ln in lines if NO_DRAFTING in ln]
    assert len(drafting) == 1 and drafting[0].startswith(f"- {field}: got {given}; {NO_DRAFTING}"), lines
    assert all(ln.startswith("- plugins:") for ln in lines if ln not in drafting), lines


def test_the_host_section_runs_the_shipped_pipeline_without_drafting():
    """A run's drafter (draft=mtp fills pipeline.draft too) is no part of pcpflow's per-step host work
    (a profile refuses one before it starts; the section leaves it out all the same)."""
    from pcpflow.pipeline.assemble import resolve_pipeline
    from pcpflow.profile.sections import _host_config

    cfg = _host_config(compose(["pcp=1", "draft=mtp"]).model_copy(update={"mode": "profile"}), 2, 16, 1)
    assert [s.cls.kind for s in resolve_pipeline(cfg)][-1] == "none" and cfg.num_speculative_tokens == 0
