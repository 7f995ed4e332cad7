"""stages/mtp.py (``mtp``): at one rank, every proposal is what a dense, cache-free
forward of the MTP head's weights proposes (at pcp 2-4 the slow
matrix of tests/speculative/test_spec_engine.py checks that every rank proposes what one rank does)."""

from __future__ import annotations

from drafting_reference import assert_proposals_match_the_dense_forward, one_rank_drafting


def test_mtp_proposes_what_its_dense_forward_proposes():
    cfg, res, ranks = one_rank_drafting("mtp")
    assert res["verify"]["passed"]
    assert_proposals_match_the_dense_forward("mtp", cfg, res, ranks)
