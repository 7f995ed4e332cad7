"""stages/dspark.py (``dspark``): at one rank, every block of proposals is what a dense,
cache-free forward of the drafter's weights over the fused target layers proposes (at
pcp 2-4 the slow matrix of tests/speculative/test_spec_engine.py checks that ranks propose alike)."""

from __future__ import annotations

from drafting_reference import assert_proposals_match_the_dense_forward, one_rank_drafting


def test_dspark_proposes_what_its_dense_forward_proposes():
    cfg, res, ranks = one_rank_drafting("dspark")
    assert res["verify"]["passed"]
    assert_proposals_match_the_dense_forward("dspark", cfg, res, ranks)
