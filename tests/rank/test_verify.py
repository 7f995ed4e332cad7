"""pcpflow.rank.verify: the verifier checks a run without touching it, and checks the drafter's
own cache as the target's (one wrong entry on one rank fails the run, named)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
import shared_ranks
import torch

from pcpflow.testing import compose, run


def test_the_verifier_never_writes_the_caches_of_the_run_it_checks(monkeypatch):
    """Requests finish and free their blocks mid-run (2 seats and 8 blocks of 4 for 4
    requests that need 3-4 blocks each), the blocks are reused: between two steps the run's
    caches must not change (a verifier that resets freed blocks to NaN in them fails)."""
    from pcpflow.rank import engine

    seen = {}
    original = engine.RankContext

    def keep(*args, **kwargs):
        ctx = original(*args, **kwargs)
        if not ctx.is_reference:
            seen["ctx"] = ctx
        return ctx

    monkeypatch.setattr(engine, "RankContext", keep)
    watch = "{kind: 'pcpflow_test_plugins.probes:CacheWatch', mark: %s, %s: %s}"
    cfg = compose([
        "pcp=1", "workload=explicit", "workload.prompt_lens=[9,7,10,5]", "workload.output_lens=[2,6,3,4]",
        "scheduler.max_num_seqs=2",
        "kv.num_blocks=8", "kv.block_size=4",
        "+pipeline.extra=[" + watch % ("start", "before", "validate") + "," + watch % ("end", "after", "draft") + "]",
    ])
    (result,) = run([cfg])
    assert result["verify"]["passed"]
    extras = seen["ctx"].extras
    assert "cache_copy" in extras and extras["cache_changes_between_steps"] == 0
    # Blocks were freed and reused: request 2 started after request 0 had finished.
    req = {r["req_id"]: r for r in result["requests"]}
    assert req[2]["first_token_step"] > req[0]["finish_step"]
    assert [len(o) for o in result["outputs"]] == [2, 6, 3, 4]


_CORRUPTED: dict[str, Path] = {}  # where the fault writes what it corrupted


@shared_ranks.matrix("verify/draft_kv")
def _corrupted_draft_kv():
    _CORRUPTED["what"] = Path(tempfile.mkdtemp(prefix="pcpflow-corrupted-draft-kv-")) / "what.json"
    fault = ("+pipeline.extra=[{kind: 'pcpflow_test_plugins.faults:CorruptedDraftKV', after: draft, rank: 1, step: 2, "
             f"path: '{_CORRUPTED['what']}'}}]")
    return [compose(["pcp=2", "dcp=2", "decode=sharded", "draft=mtp", "dtype=float64", "workload=explicit",
                     "workload.prompt_lens=[9,6]", "workload.output_lens=[5]", "kv.prefix_caching=true",
                     "plugins=[pcpflow_test_plugins.faults]", "output.progress=false", fault])]


@pytest.mark.dist
@pytest.mark.matrix("verify/draft_kv")
def test_one_corrupted_entry_of_the_drafters_own_cache_fails_verification_naming_it(shared_runs):
    """The drafter's own cache is checked like the target's: one entry off by 1 on rank 1
    (after the draft stage, at a position the step committed) fails the run (exit 1), and
    the failure names the drafter's cache, the rank, the request and the position; the
    target's cache and the tokens still match."""
    from pcpflow.output.rundir import result_of

    ((_, result),) = shared_runs["verify/draft_kv"]
    what = json.loads(_CORRUPTED["what"].read_text())
    v = result["verify"]
    assert not v["passed"] and not v["draft_kv_match"] and v["draft_kv_mismatched_slots"] >= 1, v
    assert v["tokens_match"] and v["kv_match"] and v["logits_match"], v
    assert v["max_abs_draft_kv_diff"] == pytest.approx(1.0), v
    first = v["kv_mismatches"][0]
    assert {k: first[k] for k in ("cache", "rank", "step", "req_id", "position", "slot", "layer")} == {
        "cache": "drafter KV cache (draft=mtp)", **what, "layer": 0}, (first, what)
    (failure,) = v["failures"]
    assert failure.startswith("drafter KV cache (draft=mtp)") and f"rank {what['rank']} " in failure, failure
    assert f"request {what['req_id']}, position {what['position']} " in failure, failure
    assert result_of(result, {})["exit_code"] == 1


def test_a_slot_written_apart_is_named_by_how():
    from pcpflow.rank.verify import written_apart

    def nan(*cols):  # a 4-column entry, NaN (unwritten) at cols
        return torch.tensor([i in cols for i in range(4)])

    assert written_apart(nan(0, 1, 2, 3), nan()) == "never written"
    assert written_apart(nan(2), nan()) == "never written"  # in part
    assert written_apart(nan(), nan(0, 1, 2, 3)) == "a write where none was expected"
    assert written_apart(nan(0, 1), nan(2, 3)) == "written in other columns than expected"
    assert written_apart(nan(1), nan(1)) is None and written_apart(nan(), nan()) is None
