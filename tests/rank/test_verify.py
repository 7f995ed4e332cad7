"""pcpflow.rank.verify: the verifier checks a run without touching it."""

from __future__ import annotations

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
