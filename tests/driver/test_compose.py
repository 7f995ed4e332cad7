"""pcpflow.driver.compose: one command line, every problem in one report, with the hint that
fixes each; and the help page and ``--cfg job`` of the command line."""

from __future__ import annotations

import pytest

from pcpflow.driver.cli import main, planned_run_dir
from pcpflow.driver.compose import compose_raw, options_having, validate_overrides
from pcpflow.errors import ConfigError


def problems_of(overrides: list[str]) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        validate_overrides(overrides)
    return {p.field: p.allowed for p in exc.value.problems}


def test_an_unknown_key_a_bad_value_and_a_cross_field_error_are_reported_together():
    found = problems_of(["foo=1", "pcp=0", "kv.interleave=3", "dtype=float16"])
    assert set(found) == {"foo", "pcp", "kv.interleave", "dtype"}
    assert found["pcp"] == "Input should be greater than or equal to 1"
    assert found["kv.interleave"] == "must divide kv.block_size=16"


def test_a_bad_value_does_not_hide_a_bad_stage_or_an_unfitting_workload():
    found = problems_of(["pcp=0", "pipeline.restore.kind=sampled_row", "kv.num_blocks=2"])
    assert {"pcp", "pipeline.restore.kind", "kv.num_blocks"} <= set(found)
    assert "did you mean 'sampled_rows'?" in found["pipeline.restore.kind"]


def test_a_plain_unknown_key_gets_did_you_mean():
    found = problems_of(["pcpp=2", "workload.num_request=3", "kv.blok_size=8"])
    assert found == {
        "pcpp": "not a pcpflow setting (did you mean 'pcp'?)",
        "workload.num_request": "not a pcpflow setting (did you mean 'workload.num_requests'?)",
        "kv.blok_size": "not a pcpflow setting (did you mean 'kv.block_size'?)",
    }


def test_a_key_of_another_group_option_names_that_option():
    found = problems_of(["workload.prompt_lens=[3]", "model.path=/x", "+workload.output_lens=[2]"])
    assert found["workload.prompt_lens"].startswith("workload.prompt_lens is a setting of workload=explicit;")
    assert found["model.path"].startswith("model.path is a setting of model=hf;")
    assert "workload=explicit" in found["workload.output_lens"]  # refused by pydantic, same hint
    assert options_having("workload.path") == ["workload=trace"]
    assert options_having("workload.seed") == [f"workload={o}" for o in ("explicit", "synthetic", "trace")]


def test_a_bad_group_option_and_a_plus_on_a_set_key():
    found = problems_of(["decode=shard", "+pcp=3"])
    assert found == {
        "decode": "allowed: replicated, sharded (did you mean 'sharded'?)",
        "+pcp": "pcp is already set by the config: drop the '+'",
    }


def test_the_trace_error_names_the_bundled_trace_of_the_clone():
    found = problems_of(["workload=trace"])
    assert "scripts/data/mooncake_conversation_head.jsonl" in found["workload.path"]
    assert "shared/" not in found["workload.path"]


def test_a_good_command_line_composes_with_its_values():
    raw = compose_raw(["pcp=4", "dcp=4", "decode=sharded"])
    assert (raw["pcp"], raw["dcp"], raw["decode"]["mode"]) == (4, 4, "sharded")


def test_help_is_pcpflow_s_own_page(capsys):
    assert main(["--help"]) == 0
    page = capsys.readouterr().out
    assert page.startswith("pcpflow: run, verify, measure and sweep")
    # groups and their options come from conf/ (defaults starred), settings from the models
    assert "  workload   explicit, synthetic*, trace" in page
    assert "  kv.block_size                      KV slots per physical block [16]" in page
    assert "2 invalid configuration" in page and "result.json" in page
    assert "num_speculative_tokens" not in page  # derived, not a setting
    # a nested section's settings, each with its default (no placeholder for the section)
    assert "  disagg.decode_pool.tp              tensor parallel size of the decode pool [1]" in page
    assert "Undefined" not in page


def test_cfg_job_validates_like_a_run(capsys):
    assert main(["--cfg", "job", "pcp=0"]) == 2
    assert "pcp: got 0" in capsys.readouterr().err


def test_planned_run_dir_without_hydra_run_dir():
    """The default run dir resolves outside a Hydra run (it used to need hydra.job.num)."""
    run_dir = planned_run_dir(["pcp=4"])
    assert run_dir.parts[0] == "outputs" and len(run_dir.parts) == 3
    assert planned_run_dir(["pcp=4", "hydra.run.dir=/tmp/x"]).as_posix() == "/tmp/x"


def test_a_setting_of_another_mode_is_refused_naming_the_mode():
    # hardware is read only by simulated runs; in an executed run it would be ignored
    found = problems_of(["hardware=h200_sxm"])
    assert list(found) == ["hardware"] and "a setting of mode=simulate" in found["hardware"]
    assert "this run is mode=execute" in found["hardware"]
    # simulate.* is not in an executed run's config: Hydra cannot place it, and says whose it is
    found = problems_of(["simulate.gemm_efficiency=0.5"])
    assert found == {"simulate.gemm_efficiency": "simulate.gemm_efficiency is a setting of mode=simulate; "
                     "add mode=simulate to the command line"}
    # added with '+', it composes, and the mode rule names the key that was set
    with pytest.raises(ConfigError) as exc:
        validate_overrides(["+simulate.gemm_efficiency=0.5"])
    (p,) = exc.value.problems
    assert p.field == "simulate" and p.given == {"simulate.gemm_efficiency": 0.5} and "mode=simulate" in p.allowed
    # in its own mode the same settings are fine
    validate_overrides(["mode=simulate", "model=llama3_8b", "hardware=h200_sxm", "simulate.gemm_efficiency=0.5"])


def test_a_validator_s_message_is_shown_without_pydantic_s_prefix():
    found = problems_of(["workload.prompt_len=[9,3]"])
    assert found["workload.prompt_len"] == "prompt_len is [min, max] with 1 <= min <= max; got [9, 3]"


def test_an_empty_workload_is_refused_once():
    """No request at all: refused naming the list, not run as zero requests (nor left to
    fail inside the run); the list falling back to its default is not a second problem."""
    assert problems_of(["workload=explicit", "workload.prompt_lens=[]"]) == {
        "workload.prompt_lens": "List should have at least 1 item after validation, not 0"}
    assert list(problems_of(["workload=explicit", "workload.prompts=[]", "workload.prompt_lens=[5]"])) == ["workload.prompts"]
    assert list(problems_of(["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=explicit",
                             "workload.prompt_lens=[]"])) == ["workload.prompt_lens"]


def test_a_rule_that_reads_a_setting_in_error_is_not_judged_on_its_default():
    """pcp=0 falls back to pcp=2 so that the rest can be checked; dcp's rule, which reads pcp,
    would quote that default (pcp(2)), a value the user never gave."""
    found = problems_of(["pcp=0", "dcp=3"])
    assert list(found) == ["pcp"]
    found = problems_of(["pcp=0", "kv.interleave=3"])  # a problem that does not read pcp still shows
    assert set(found) == {"pcp", "kv.interleave"}


def test_settings_only_an_executed_run_reads_are_refused_in_a_simulated_one():
    sim = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm"]
    found = problems_of([*sim, "verify_options.logits_atol=0.1", "output.save_logits=true"])
    assert set(found) == {"verify_options", "output.save_logits"}
    assert all("a setting of mode=execute" in v for v in found.values())
    validate_overrides(["verify_options.logits_atol=0.1", "output.save_logits=true"])  # executed: fine


def test_an_unknown_key_inside_a_known_section_lists_the_section_s_settings():
    found = problems_of(["kv.foo=1", "mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "disagg=pd",
                         "disagg.decode_pool.foo=1"])
    assert found["kv.foo"] == "not a setting of kv; its settings: block_size, hybrid, interleave, num_blocks, prefix_caching"
    assert found["disagg.decode_pool.foo"].startswith("not a setting of disagg.decode_pool; its settings: cp_attention, dcp, ")
    assert " tp" in found["disagg.decode_pool.foo"]


def test_dspark_with_no_target_layer_is_refused():
    # no hidden state to feed the drafter; None (the default) is first, middle and last
    assert problems_of(["draft=dspark", "draft.target_layers=[]"]) == {
        "draft.target_layers": "List should have at least 1 item after validation, not 0"}


def test_version_is_pcpflow_s_own(capsys):
    from pcpflow import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith(f"pcpflow {__version__} (torch ")


def test_a_profile_of_no_dtype_is_refused():
    assert problems_of(["mode=profile", "profile.dtypes=[]"]) == {
        "profile.dtypes": "List should have at least 1 item after validation, not 0"}


def test_hybrid_kv_on_is_refused_beside_what_keeps_every_block():
    window = ["model=tiny_gqa", "model.window=8", "model.window_layers=[1]", "kv.hybrid=on"]
    validate_overrides(window)  # alone it runs
    validate_overrides(window + ["cudagraph_mode=full_and_piecewise"])  # a decode graph holds a table per group
    validate_overrides(window + ["disagg=pd"])  # a handover moves each group's entries
    validate_overrides(window + ["draft=mtp"])  # a drafter goes by the full group's table
    # every layer windowed: no full group's table for a drafter (auto keeps one group)
    found = problems_of(["model=tiny_gqa", "model.window=8", "kv.hybrid=on", "draft=mtp"])
    assert found["kv.hybrid"].startswith("a drafter's caches go by a full layer's table, and every layer")
    validate_overrides(["model=tiny_gqa", "model.window=8", "draft=mtp"])


# Command lines Hydra reads each way: options of every group, values of each type, ``+`` / ``++``
# / ``~``, lists, interpolations, and each kind of mistake.
_COMMAND_LINES = [
    [],
    ["pcp=4", "dcp=4", "decode=sharded"],
    ["model=tiny_mla", "model.num_layers=3", "kv.block_size=8", "tp=2"],
    ["kv.block_size=8", "model=tiny_gqa", "model=tiny_mla"],  # the last choice wins; a value after a choice
    ["mode=simulate", "model=llama3_70b", "hardware=h200_sxm", "simulate.weights_dtype=fp8"],
    ["mode=search", "search.gpus=16", "tp=8"],
    ["disagg=pd", "workload=explicit", "workload.prompt_lens=[5,9]", "workload.output_lens=[2,3]"],
    ["draft=mtp", "++draft.num_speculative_tokens=2", "~seed"],
    ["workload.num_requests=${pcp}", "pcp=3"],
    ["+nope=1", "kv.block_size=8"],
    ["+pcp=2"],
    ["nope=1", "pcp=x", "kv.blok_size=3"],
    ["model=nope", "pcp=2"],
    ["~model", "pcp=2"],
    ["pcp=${oops}"],
    ["model={num_layers: 2}"],
    ["hydra.job.chdir=false", "pcp=2"],
]


@pytest.mark.parametrize("overrides", _COMMAND_LINES, ids=lambda o: " ".join(o) or "defaults")
def test_composing_on_kept_options_gives_what_hydra_composes(overrides, monkeypatch):
    """The options a command line chooses are composed once and kept: every command line
    gives what Hydra composing the whole of it gives, the same config and the same problems
    (the reference: the same function with the kept composition turned off)."""
    import pcpflow.driver.compose as compose

    got = compose.compose_checked(overrides)
    got = got[0], [str(p) for p in got[1]]
    again = compose.compose_checked(overrides)  # from what was kept
    monkeypatch.setattr(compose, "_compose_on_cached_defaults", lambda _: None)
    ref = compose.compose_checked(overrides)
    assert got == (ref[0], [str(p) for p in ref[1]]) == (again[0], [str(p) for p in again[1]])


def test_an_edited_yaml_is_read_again(tmp_path, monkeypatch):
    """What is kept belongs to conf/'s files as they were: an edited option is composed anew."""
    import shutil

    import pcpflow.driver.compose as compose

    conf = tmp_path / "conf"
    shutil.copytree(compose.conf_dir(), conf)
    monkeypatch.setattr(compose, "conf_dir", lambda: str(conf))
    assert compose.compose_raw(["model=tiny_gqa"])["model"]["num_layers"] != 7
    yaml = conf / "model" / "tiny_gqa.yaml"
    yaml.write_text(yaml.read_text().replace("num_layers:", "num_layers: 7 #", 1))
    assert compose.compose_raw(["model=tiny_gqa"])["model"]["num_layers"] == 7


def test_bench_compose_runs_each_case_both_ways(capsys):
    """scripts/bench_compose.py (its --quick set): a row per case, Hydra composing the whole
    command line beside the kept options, and their ratio."""
    from repo_scripts import load_script

    assert load_script("bench_compose").main(["--quick"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    assert [r[:16].strip() for r in rows] == ["one job", "sweep precheck", "mixed"]
    assert all(len(r.split()) >= 5 and r.endswith("x") for r in rows), rows
