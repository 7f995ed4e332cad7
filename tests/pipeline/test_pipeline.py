"""pcpflow.pipeline.assemble: the assembler loads the built-in stages from its fixed list, puts
one stage in each slot and user stages where they ask, reports every bad slot, and
derives the drafts per step from the draft stage it assembled."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import shared_ranks

from pcpflow.driver.compose import compose_raw, validate_overrides
from pcpflow.driver.job import prepare_job
from pcpflow.errors import ConfigError
from pcpflow.pipeline.assemble import BUILTIN_STAGES, SLOTS, resolve_pipeline
from pcpflow.testing import cli, compose

REPO = Path(__file__).resolve().parents[2]


def test_the_builtin_list_is_every_stage_module():
    files = sorted(p.stem for p in (REPO / "stages").glob("*.py") if p.stem != "__init__")
    assert sorted(m.removeprefix("pcpflow.stages.") for m in BUILTIN_STAGES) == files


def test_one_stage_per_slot_in_order_and_extras_where_they_ask():
    cfg = compose([
        "plugins=[pcpflow_test_plugins.probes]",
        "+pipeline.extra=[{kind: test_call_counter, after: forward}, {kind: test_call_counter, before: plan}]",
    ])
    names = [s.name for s in resolve_pipeline(cfg)]
    assert names == ["validate", "extra[1]:test_call_counter", "plan", "buffers", "slots", "forward",
                     "extra[0]:test_call_counter", "restore", "draft"]
    assert set(SLOTS) <= set(names)


def test_bad_slots_are_reported_together():
    with pytest.raises(ConfigError) as exc:
        validate_overrides(["pipeline.restore.kind=sampled_row", "plugins=[no_such_pkg.stages]"])
    fields = {p.field: p.allowed for p in exc.value.problems}
    assert fields["plugins[0]"] == "an importable module (it is not on sys.path / PYTHONPATH)"
    with pytest.raises(ConfigError) as exc:
        validate_overrides([
            "pipeline.restore.kind=sampled_row", "pipeline.forward.attention=flash",
            "+pipeline.extra=[{kind: none}]",
        ])
    fields = {p.field: p.allowed for p in exc.value.problems}
    assert "did you mean 'sampled_rows'?" in fields["pipeline.restore.kind"]
    assert fields["pipeline.forward.attention"] == "allowed: reference, fused, auto"
    assert fields["pipeline.extra[0]"].startswith("exactly one of after/before")


@pytest.mark.parametrize("entry, expected", [
    # a position off the slots, an unknown setting and a bad value: all three at once
    ("{kind: test_call_counter, after: forwad, bogus: 1, out_dir: [1]}",
     {"pipeline.extra[0].after": "allowed: validate, plan, buffers, slots, forward, restore, draft (did you mean 'forward'?)",
      "pipeline.extra[0].bogus": "not a setting here",
      "pipeline.extra[0].out_dir": "Input should be a valid string"}),
    # a bad kind and a bad position; the kinds listed are those that go in any position
    ("{kind: test_call_countr, before: nowhere}",
     {"pipeline.extra[0].kind": "unknown stage kind 'test_call_countr' (did you mean 'test_call_counter'?); "
                                "kinds for any position: ",
      "pipeline.extra[0].before": "allowed: validate"}),
    # no position at all, and two
    ("{kind: test_call_counter, bogus: 1}",
     {"pipeline.extra[0]": "exactly one of after/before", "pipeline.extra[0].bogus": "not a setting here"}),
    ("{kind: test_call_counter, after: plan, before: forward, out_dir: [1]}",
     {"pipeline.extra[0]": "exactly one of after/before", "pipeline.extra[0].out_dir": "Input should be a valid string"}),
    # a stage of one slot (it would run twice) in a wrong position
    ("{kind: sampled_rows, after: restor}",
     {"pipeline.extra[0].kind": "a stage for any position; 'sampled_rows' fills only the restore slot: "
                                "pipeline.restore.kind=sampled_rows",
      "pipeline.extra[0].after": "allowed: validate"}),
])
def test_every_problem_of_an_extra_stage_is_reported_at_once(entry, expected):
    found = {p.field: p.allowed for p in _problems("plugins=[pcpflow_test_plugins.probes]", f"+pipeline.extra=[{entry}]")}
    assert set(found) == set(expected), found
    for field, says in expected.items():
        assert found[field].startswith(says), (field, found[field])


def test_an_unknown_extra_kind_lists_the_kinds_that_go_in_any_position():
    from pcpflow.pipeline.stage import resolve

    said = {p.field: p.allowed for p in _problems("plugins=[pcpflow_test_plugins.probes]",
                                                     "+pipeline.extra=[{kind: bogus, after: forward}]")}
    listed = said["pipeline.extra[0].kind"].split("kinds for any position: ")[1].split(" (or ")[0].split(", ")
    assert "test_call_counter" in listed and "model" not in listed, listed
    assert all(resolve(k).slots is None for k in listed), listed


def test_an_extra_stage_beside_a_slot_in_error_is_judged_on_its_own():
    """The slot it sits after could not be built (its own problem): the extra stage is still
    checked, and there is no traceback for the missing anchor."""
    found = {p.field: p.allowed for p in _problems(
        "plugins=[pcpflow_test_plugins.probes]", "pipeline.forward.attention=flash",
        "+pipeline.extra=[{kind: test_call_counter, after: forward, out_dir: [1]}]")}
    assert set(found) == {"pipeline.forward.attention", "pipeline.extra[0].out_dir"}, found


def _problems(*overrides: str) -> list:
    with pytest.raises(ConfigError) as exc:
        validate_overrides(list(overrides))
    return exc.value.problems


def test_swapping_a_stage_drops_only_the_shipped_options_it_does_not_know():
    """The shipped forward stage has a ``dcp_rest`` option; a user's forward stage without
    one must still validate when the option was left alone, and be refused when the user
    set it."""
    plugin = ["plugins=[pcpflow_test_plugins.probes]", "pipeline.forward.kind=test_queries_forward"]
    cfg = prepare_job(compose_raw(plugin + ["dcp=2"]))
    assert cfg.pipeline["forward"]["kind"] == "test_queries_forward"
    with pytest.raises(ConfigError) as exc:
        prepare_job(compose_raw(plugin + ["pipeline.forward.dcp_rest=context"]))
    assert "pipeline.forward.dcp_rest: got 'context'; not a setting here" in exc.value.report()


def test_drafts_per_step_come_from_the_assembled_draft_stage():
    assert compose(["draft=self"]).num_speculative_tokens == 3  # conf/draft/self.yaml
    assert compose(["draft=mtp", "draft.num_speculative_tokens=4"]).num_speculative_tokens == 4
    assert compose([]).num_speculative_tokens == 0
    with pytest.raises(ConfigError) as exc:  # the verify row of 1 + k tokens must fit a step
        compose(["draft=self", "scheduler.max_num_batched_tokens=3"])
    assert "must hold a verify row of 1 + 3 speculative tokens" in exc.value.report()
    with pytest.raises(ConfigError) as exc:  # derived, not a setting
        compose(["draft=self", "+num_speculative_tokens=5"])
    assert "num_speculative_tokens: got 5; derived from the draft stage (3)" in exc.value.report()


WRONG_DRAFT_KEYS = ["draft.num_speculative_tokens=3", "pipeline.draft.num_speculative_tokens=3", "num_speculative_tokens=3",
                    "+num_speculative_tokens=3"]


def test_a_plugin_drafter_s_drafts_per_step_hint_is_an_override_that_works():
    """A plugin drafter's settings go under pipeline.draft (the draft group is draft=none): the
    hint for each wrong key is the override that sets them, and that override is accepted."""
    drafter = ["plugins=[pcpflow_test_plugins.toy_drafter]", "pipeline.draft.kind=toy_repeat"]
    hints = {_hint(*drafter, wrong) for wrong in WRONG_DRAFT_KEYS}
    assert hints == {"+pipeline.draft.num_speculative_tokens=3"}, hints
    accepted = cli("--cfg", "job", *drafter, *hints)
    assert accepted.returncode == 0, accepted.stderr
    assert compose([*drafter, *hints]).num_speculative_tokens == 3
    # a bad value there is named there (no draft.* key exists to set instead)
    (bad,) = _problems(*drafter, "+pipeline.draft.num_speculative_tokens=0")
    assert bad.field == "pipeline.draft.num_speculative_tokens", bad
    # a shipped drafter's hint is its group's key, which works as well
    hints = {_hint("draft=mtp", wrong) for wrong in WRONG_DRAFT_KEYS[1:]}
    assert hints == {"draft.num_speculative_tokens=3"}, hints
    assert compose(["draft=mtp", *hints]).num_speculative_tokens == 3


def _hint(*args: str) -> str:
    """The override that the one problem of ``python -m pcpflow ARGS`` says to set."""
    r = cli(*args)
    assert r.returncode == 2, r.stderr
    (line,) = [ln for ln in r.stderr.splitlines() if ln.strip().startswith("- ")]
    assert "set it with " in line, line
    return line.rsplit("set it with ", 1)[-1]


_PROBE: dict[str, Path] = {}


@shared_ranks.matrix("pipeline/user_stage")
def _user_stage():
    out = _PROBE["dir"] = Path(tempfile.mkdtemp(prefix="pcpflow-probe-"))
    return [compose([
        "pcp=2", "plugins=[pcpflow_test_plugins.probes]", "workload.num_requests=3", "workload.output_len=[2,4]",
        f"+pipeline.extra=[{{kind: test_call_counter, after: forward, out_dir: '{out}'}}]",
    ])]


@pytest.mark.dist
@pytest.mark.matrix("pipeline/user_stage")
def test_user_stage_runs_after_its_slot_on_every_rank(shared_runs):
    ((_, result),) = shared_runs["pipeline/user_stage"]
    out = _PROBE["dir"]
    steps = result["metrics"]["num_steps"]
    for rank in (0, 1):
        lines = [json.loads(x) for x in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        assert [x["step"] for x in lines] == list(range(steps))  # once per step, not in the reference
        assert all(x["has_layout"] and x["has_hidden"] and not x["has_logits"] for x in lines)
