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
from pcpflow.testing import compose

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
    assert fields["pipeline.forward.attention"] == "Input should be 'reference', 'fused' or 'auto'"
    assert fields["pipeline.extra[0]"].startswith("exactly one of after/before")


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
