"""The warm-up before the run clock (``pcpflow.rank.warmup``) leaves no trace in the run: the
same configuration with ``warmup=true`` and ``warmup=false`` computes the same tokens,
verified against one rank, and counts the same steps, tokens and collectives (calls and
bytes by purpose, the ring's sends, the pools' handovers), while ``metrics.warmup_s`` says it
ran. A pipeline with a user's stage runs none: that stage would see its steps."""

from __future__ import annotations

import pytest
import shared_ranks

from pcpflow.testing import compose

SMALL = ["workload.num_requests=4", "output.plots=false", "output.progress=false"]
LAYOUTS = {
    "pcp=2 dcp=2 sharded": ["pcp=2", "dcp=2", "decode=sharded"],
    "ring pass-KV": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv", "model=tiny_gqa"],
    "tp=2 experts all_to_all": ["tp=2", "pcp=1", "model.moe.num_experts=4", "model.moe.top_k=2", "moe.dispatch=all_to_all"],
    "pools": ["pcp=2", "disagg=pd", "disagg.decode_pool.pcp=1"],
}
USER_STAGE = ["pcp=2", "plugins=[docs.examples.token_counter]", "+pipeline.extra=[{kind: token_counter, after: plan, every: 50}]"]
COUNTED = ("num_steps", "num_tokens", "num_generated_tokens", "per_rank_tokens", "collective_calls", "collective_bytes",
           "preemptions", "prefix_cache")


@shared_ranks.matrix("warmup")
def _warmup():
    return [compose([*ov, *SMALL, f"warmup={w}"]) for ov in LAYOUTS.values() for w in ("true", "false")] + [
        compose([*USER_STAGE, *SMALL])]


@pytest.mark.dist
@pytest.mark.matrix("warmup")
def test_warm_up_changes_nothing_the_run_computes_or_counts(shared_runs):
    runs = [r for _, r in shared_runs["warmup"]]
    for k, name in enumerate(LAYOUTS):
        warm, cold = runs[2 * k], runs[2 * k + 1]
        for r in (warm, cold):
            assert r["verify"]["passed"], (name, r["verify"])
        assert warm["outputs"] == cold["outputs"], name
        for key in COUNTED:
            assert warm["metrics"].get(key) == cold["metrics"].get(key), (name, key)
        if "transfer" in cold["metrics"]:  # the pools' handovers, but their seconds
            assert ({k: v for k, v in warm["metrics"]["transfer"].items() if k != "s"}
                    == {k: v for k, v in cold["metrics"]["transfer"].items() if k != "s"}), name
        assert warm["metrics"]["collective_calls"], name  # every layout here moves something
        assert warm["metrics"]["warmup_s"] > 0, name
        assert cold["metrics"]["warmup_s"] is None, name


@pytest.mark.dist
@pytest.mark.matrix("warmup")
def test_no_warm_up_with_a_users_stage(shared_runs):
    _, user = shared_runs["warmup"][-1]
    assert user["verify"]["passed"]
    assert user["metrics"]["warmup_s"] is None
