"""Bad simulated settings (issues 25 and 26): one line per real problem, exit 2, nothing run,
never a traceback; every problem of a command listed together."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from measured_profile import profile_dict

from pcpflow.driver.compose import validate_overrides
from pcpflow.errors import ConfigError
from pcpflow.testing import cli, compose

REPO = Path(__file__).resolve().parents[2]
RUN = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=explicit", "workload.prompt_lens=[1000]",
       "workload.output_lens=[2]", "output.plots=false", "output.progress=false"]


def problems(*overrides: str, base: list[str] = RUN) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        validate_overrides([*base, *overrides])
    found = {}
    for p in exc.value.problems:
        assert p.field not in found, f"{p.field} reported twice"
        found[p.field] = f"{p.given} | {p.allowed}"
    return found


def test_fp4_weights_need_an_fp4_peak():
    found = problems("simulate.weights_dtype=fp4")
    assert list(found) == ["simulate.weights_dtype"]
    assert "h100_sxm has no fp4 tensor-core peak" in found["simulate.weights_dtype"] and "allowed: bf16, fp8, fp32" in found["simulate.weights_dtype"]
    assert compose([*RUN, "hardware=b200", "simulate.weights_dtype=fp4"]).simulate.weights_dtype == "fp4"


def test_fp4_in_a_sweep_refuses_the_sweep_in_one_line(tmp_path):
    r = cli("-m", *RUN, "simulate.weights_dtype=fp8,fp4", f"hydra.sweep.dir={tmp_path / 'sweep'}")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "KeyError" not in r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert len(lines) == 1 and lines[0].strip().startswith("- [simulate.weights_dtype=fp4] simulate.weights_dtype")
    assert "fp4 tensor-core peak" in lines[0]


def test_a_zero_block_size_is_one_clean_problem(tmp_path):
    assert list(problems("kv.block_size=0")) == ["kv.block_size"]
    r = cli(*RUN, "kv.block_size=0", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2 and "ZeroDivisionError" not in r.stderr and "Traceback" not in r.stderr
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("key", ["simulate.gemm_efficiency", "simulate.p2p_efficiency", "simulate.hbm_utilization",
                                 "hardware.hbm_tbps", "hardware.peak_tflops.bf16", "hardware.nvlink.ring.channel_gbps",
                                 "hardware.network.nic_gbps", "hardware.host.launch_us", "hardware.kernel_floor_us"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_values_are_refused(key, value):
    found = problems(f"{key}={value}")
    assert list(found) == [key], found  # and no false kv.num_blocks line beside it
    assert "finite" in found[key] or "greater than" in found[key]


def test_an_inf_never_gives_an_ok_run_or_nan_in_result_json(tmp_path):
    r = cli(*RUN, "hardware.hbm_tbps=inf", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2
    text = (tmp_path / "result.json").read_text()
    assert json.loads(text)["status"] == "failed" and "NaN" not in text and "Infinity" not in text


@pytest.mark.parametrize("override, field", [
    ("simulate.gemm_efficiency=2", "simulate.gemm_efficiency"),
    ("simulate.hbm_utilization=0", "simulate.hbm_utilization"),
    ("hardware.hbm_gib=-1", "hardware.hbm_gib"),
    ("simulate.kv_dtype=fp16", "simulate.kv_dtype"),
])
def test_one_invalid_setting_reports_only_itself(override, field):
    assert list(problems(override)) == [field]


def test_an_unknown_hardware_is_reported_once():
    found = problems("hardware=h100")
    assert list(found) == ["hardware"] and "h100_sxm" in found["hardware"]


def test_a_huge_block_size_blames_the_block_size():
    found = problems("kv.block_size=1e9")
    assert list(found) == ["kv.block_size"], found
    assert "one block of 1000000000 tokens needs" in found["kv.block_size"]


def test_an_extra_stage_is_refused_in_a_simulated_run():
    found = problems("plugins=[pcpflow_test_plugins.probes]",
                     "+pipeline.extra=[{kind: 'pcpflow_test_plugins.step_counts:StepCounts', after: draft, path: x}]")
    assert "pipeline.extra" in found and "an extra stage would not run" in found["pipeline.extra"]


@pytest.mark.parametrize("override, replacement", [
    ("simulate.ring_step_us=543", "hardware.host.launch_us"),
    ("+simulate.ring_step_us=543", "hardware.host.launch_us"),
    ("simulate.overlap=ring", "simulate.cp_decode"),
    ("simulate.attention_efficiency=0.675", "FlashAttention-3's published throughput"),
])
def test_removed_settings_name_their_replacement(override, replacement):
    found = problems(override)
    (field,) = found
    assert field == override.lstrip("+").split("=")[0] and "removed" in found[field] and replacement in found[field]


def test_a_decode_ring_needs_kv_shards_over_its_ring():
    """The executed ring runs over the PCP group with the KV sharded over it: dcp = pcp > 1
    (dcp=1 holds the whole cache on every rank; DCP over TP ranks has no ring)."""
    found = problems("pcp=2", "simulate.cp_decode=ring_pass_q")
    assert list(found) == ["simulate.cp_decode"], found
    for args, got in ((("pcp=2",), "pcp=2 dcp=1"), (("pcp=1", "tp=8", "dcp=2"), "pcp=1 dcp=2")):
        found = problems(*args, "simulate.cp_decode=ring_pass_q")
        assert "pcp > 1 and dcp = pcp" in found["simulate.cp_decode"] and f"got {got}" in found["simulate.cp_decode"]
    assert compose([*RUN, "pcp=2", "dcp=2", "simulate.cp_decode=ring_pass_q"]).simulate.cp_decode == "ring_pass_q"


def test_a_dtype_without_a_peak_is_refused():
    found = problems("dtype=float64")
    assert list(found) == ["dtype"] and "bfloat16 (bf16)" in found["dtype"] and "float32 (fp32)" in found["dtype"]
    assert compose([*RUN, "dtype=float32"]).dtype == "float32"


def test_every_problem_is_listed_together():
    found = problems("simulate.weights_dtype=fp4", "simulate.gemm_efficiency=nan", "kv.block_size=0",
                     "simulate.ring_step_us=1", "pcp=2")
    assert {"simulate.weights_dtype", "simulate.gemm_efficiency", "kv.block_size", "simulate.ring_step_us"} <= set(found)
    assert "kv.num_blocks" not in found and "scheduler.max_num_batched_tokens" not in found



@pytest.mark.parametrize("extra", [[], ["disagg=pd"]])
def test_a_missing_hardware_profile_does_not_hide_the_other_problems(extra):
    """Without a profile nothing can be derived (kv.num_blocks, a decode pool's blocks): the
    command's own problems are listed beside it, and no placeholder is judged."""
    base = [o for o in RUN if not o.startswith("hardware")]
    found = problems("workload.request_rate=0", "slo.ttft_s=-1", "workload.max_concurrency=0", *extra, base=base)
    assert set(found) == {"hardware", "workload.request_rate", "slo.ttft_s", "workload.max_concurrency"}, found
    assert "h200_sxm" in found["hardware"] and "mode=simulate" in found["hardware"]

TRACE = [*(o for o in RUN if not o.startswith("workload")), "workload=trace",
         f"workload.path={REPO / 'scripts' / 'data' / 'mooncake_conversation_head.jsonl'}", "workload.max_requests=4"]


@pytest.mark.parametrize("base, override, key", [
    (RUN, "slo.ttft_s=inf", "slo.ttft_s"),
    (RUN, "slo.tpot_s=inf", "slo.tpot_s"),
    (TRACE, "workload.time_scale=inf", "workload.time_scale"),  # it hung: arrivals at inf * 0
    (TRACE, "workload.step_ms=inf", "workload.step_ms"),
])
def test_only_request_rate_means_something_by_inf(base, override, key):
    found = problems(override, base=base)
    assert list(found) == [key] and "finite" in found[key]
    validate_overrides([*RUN, "workload.request_rate=inf"])  # all at once: valid


@pytest.mark.parametrize("override, key", [
    ("pcp=true", "pcp"), ("serving.replicas=true", "serving.replicas"),
    ("workload.max_concurrency=true", "workload.max_concurrency"), ("workload.request_rate=true", "workload.request_rate"),
    ("slo.ttft_s=false", "slo.ttft_s"), ("simulate.gemm_efficiency=true", "simulate.gemm_efficiency"),
])
def test_a_boolean_is_not_a_number(override, key):
    found = problems(override)
    assert list(found) == [key], found
    assert found[key].startswith(override.split("=")[1] + " |") and "valid" in found[key]


def test_a_request_larger_than_the_hbm_left_is_one_problem():
    """The derived kv.num_blocks is too small for it as well; only what the user can change is
    named (it said kv.num_blocks must be >= 1250001 beside it, which no setting could give)."""
    base = [o for o in RUN if not o.startswith(("workload.prompt_lens", "workload.output_lens"))]
    found = problems("workload.prompt_lens=[20000000]", "workload.output_lens=[4]", base=base)
    assert list(found) == ["workload"] and "GiB are left" in found["workload"]
    found = problems("workload.prompt_lens=[200000]", "workload.output_lens=[4]", "kv.num_blocks=100", base=base)
    assert list(found) == ["kv.num_blocks"] and "must be >= 12501" in found["kv.num_blocks"]  # set by the user: named


def test_a_mistyped_mode_is_one_problem_not_every_setting_of_the_mode_meant():
    """mode=simulat left mode=execute behind, which refused the hardware and the model card too."""
    found = problems("mode=simulat", base=[o for o in RUN if o != "mode=simulate"])
    assert list(found) == ["mode"] and "did you mean 'simulate'" in found["mode"]


def test_texts_in_a_simulated_run_are_one_problem_naming_what_to_give():
    base = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=explicit"]
    for source in ("workload.texts=[hello]", "workload.chats=[[{role: user, content: hi}]]"):
        with pytest.raises(ConfigError) as exc:
            validate_overrides([*base, source])
        (p,) = exc.value.problems
        assert p.field == source.split("=")[0] and "prices prompt lengths" in p.allowed and "prompt_lens" in p.allowed


MEASURED = ["mode=simulate", "hardware=measured", "dtype=float32", "model=tiny_gqa", "pcp=2", "output.plots=false",
            "output.progress=false"]


def _cut(*at: int, keep: int):
    """An edit of a profile: the list at index path ``at`` of prefill.float32.seconds cut to ``keep`` entries."""
    def edit(doc):
        node = doc["tables"]["attention"]["prefill"]["float32"]["seconds"]
        for i in at[:-1]:
            node = node[i]
        node[at[-1]] = node[at[-1]][:keep]
    return edit


def _decode_of(dtype: str):
    def edit(doc):
        att = doc["tables"]["attention"]
        att["decode"] = {dtype: att["decode"]["float32"]}
    return edit


@pytest.mark.parametrize("edit, field, says", [
    # a phase's table missing: that table named, not the run's dtype (profile_dict measured float32 throughout)
    (lambda d: d["tables"]["attention"].pop("decode"), "hardware.tables.attention.decode",
     "got <missing>; the profile {path} has no decode attention table; a simulated run prices decode attention on "
     "tables.attention.decode.float32"),
    (lambda d: d["tables"]["attention"].update(prefill={}), "hardware.tables.attention.prefill",
     "got {{}}; the profile {path} has no prefill attention table"),
    (_decode_of("bfloat16"), "hardware.tables.attention.decode",
     "got ['bfloat16']; the profile {path} measured float32 in tables.gemm and tables.attention.prefill, but its "
     "decode attention table has bfloat16 only"),
    # a short row: that row named by its index, with the length it needs
    (_cut(1, 2, keep=3), "hardware.tables.attention.prefill.float32.seconds.1.2",
     "got 3 entries; 6 entries, one per head shape of basis (seconds must be 3 x 3 x 6, [rows][keys][basis]); this list "
     "is at rows=32, keys=4096"),
    (_cut(1, keep=2), "hardware.tables.attention.prefill.float32.seconds.1",
     "got 2 entries; 3 entries, one per point of keys (seconds must be 3 x 3, [rows][keys]); this list is at rows=32"),
    (lambda d: d["tables"]["gemm"]["float32"]["seconds"][2].pop(), "hardware.tables.gemm.float32.seconds.2",
     "got 2 entries; 3 entries, one per point of n (seconds must be 3 x 3 x 3, [m][n][k]); this list is at m=4096"),
    # the file itself
    ("", "hardware.path", "the profile file {path} is empty"),
    ("/dev/null", "hardware.path", "/dev/null exists but is not a regular file (a character device)"),
])
def test_a_bad_measured_profile_is_one_problem_naming_its_table_or_file(tmp_path, edit, field, says):
    path = tmp_path / "hardware.yaml"
    if edit == "/dev/null":
        path = Path("/dev/null")
    elif edit == "":
        path.write_text("")
    else:
        doc = profile_dict()
        edit(doc)
        path.write_text(yaml.safe_dump(doc))
    assert list(problems(f"hardware.path={path}", base=MEASURED)) == [field]
    r = cli(*MEASURED, f"hardware.path={path}")
    lines = [ln.strip() for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"- {field}: "), r.stderr
    assert says.format(path=path) in lines[0], lines[0]


def test_a_missing_profile_file_still_says_it_does_not_exist(tmp_path):
    found = problems(f"hardware.path={tmp_path / 'nope.yaml'}", base=MEASURED)
    assert list(found) == ["hardware.path"] and "does not exist" in found["hardware.path"]


def test_hardware_path_without_hardware_measured_is_one_problem(tmp_path):
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(profile_dict()))
    found = problems(f"hardware.path={path}", base=[o for o in MEASURED if o != "hardware=measured"])
    assert list(found) == ["hardware.path"] and "add hardware=measured" in found["hardware.path"], found


def test_drafting_a_simulator_cannot_count_is_refused_by_name():
    """mtp / dspark need an acceptance (their random weights' is not a deployment's); a ring or
    a plugin drafter beside drafting is named; self takes its error_rate."""
    found = problems("draft=mtp")
    assert list(found) == ["simulate.draft_acceptance"]
    assert "e.g. simulate.draft_acceptance=[0.85]" in found["simulate.draft_acceptance"]
    assert list(problems("draft=dspark", "simulate.draft_acceptance=[1.5]")) == ["simulate.draft_acceptance.0"]
    assert list(problems("draft=self", "simulate.draft_acceptance=[]")) == ["simulate.draft_acceptance"]
    found = problems("draft=self", "pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv")
    assert "drafting is simulated beside the engine's all-gather paths" in found["draft"]
    assert compose([*RUN, "draft=self"]).simulate.draft_acceptance is None
    assert compose([*RUN, "draft=mtp", "simulate.draft_acceptance=[0.9,0.7]"]).simulate.draft_acceptance == [0.9, 0.7]
