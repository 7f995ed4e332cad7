"""The space a search walks: hand-counted layouts, each once, candidates as written."""

from __future__ import annotations

from pcpflow.search.space import Space


def test_two_gpus_hold_seventeen_distinct_layouts_counted_by_hand():
    # tp x pcp x dcp whose GPUs divide 2, one CUDA-graph mode:
    #   tp1 pcp1 dcp1: 1 (a decode mode, dcp_rest and rings change nothing at pcp=1)
    #   tp1 pcp2 dcp1: 2 (replicated | sharded decodes)
    #   tp1 pcp2 dcp2: 2 decode modes x (allgather x 3 dcp_rest + 3 rings) = 12
    #   tp2 pcp1 dcp1, tp2 pcp1 dcp2 (DCP over TP: the queries path, dcp_rest moot): 2
    space = Space(2, fixed={"cudagraph_mode": "none"}, experts=False, fill=True)
    layouts = space.enumerate()
    assert len(layouts) == 17
    assert len({lay.values for lay in layouts}) == 17
    by_grid = {}
    for lay in layouts:
        by_grid.setdefault((lay["tp"], lay["pcp"], lay["dcp"]), []).append(lay)
    assert {k: len(v) for k, v in by_grid.items()} == {(1, 1, 1): 1, (1, 2, 1): 2, (1, 2, 2): 12, (2, 1, 1): 1,
                                                        (2, 1, 2): 1}
    # replicas fill the GPUs: two copies of the one-GPU layout, one of the others
    assert [lay["replicas"] for lay in by_grid[(1, 1, 1)]] == [2]
    assert all(lay["replicas"] == 1 and lay.gpus == 2 for k, v in by_grid.items() if k != (1, 1, 1) for lay in v)
    rings = [lay for lay in by_grid[(1, 2, 2)] if lay["cp_attention"] != "allgather"]
    assert len(rings) == 6 and all(lay["dcp_rest"] == "auto" for lay in rings)


def test_every_layout_is_its_own_canonical_form_and_fills_the_gpus():
    space = Space(16, fixed={}, experts=True, fill=True)
    layouts = space.enumerate()
    assert layouts and all(16 % lay.world == 0 and lay.gpus == 16 for lay in layouts)
    assert all(space.canonical(dict(lay.values)) == lay for lay in layouts[::37])
    # MoE dispatch is searched for a model with experts; gather needs pcp > 1
    assert {lay["moe_dispatch"] for lay in layouts} == {"local", "gather", "all_to_all"}
    assert all(lay["moe_dispatch"] != "gather" for lay in layouts if lay["pcp"] == 1)
    assert {lay["moe_dispatch"] for lay in Space(16, fixed={}, experts=False, fill=True).enumerate()} == {None}


def test_fixed_dimensions_stay_fixed_and_arrivals_in_steps_keep_one_replica():
    space = Space(8, fixed={"tp": 2, "decode": "sharded"}, experts=False, fill=False)
    layouts = space.enumerate()
    assert {lay["tp"] for lay in layouts} == {2} and {lay["decode"] for lay in layouts} == {"sharded"}
    assert {lay["replicas"] for lay in layouts} == {1} and {lay["pcp"] for lay in layouts} == {1, 2, 4}


def test_candidate_strings_are_layouts_as_written_sweeps_expand_and_other_keys_ride_along():
    space = Space(32, fixed={}, experts=False, fill=True)
    layouts, problems = space.candidates(["tp=8 pcp=4 dcp=4", "tp=8 pcp=1,2 decode=sharded", "tp=16 kv.interleave=2"])
    assert problems == []
    labels = [lay.label(space.dims) for lay in layouts]
    assert labels == ["tp=8 pcp=4 dcp=4", "tp=8 pcp=1 dcp=1 decode=sharded serving.replicas=4",
                      "tp=8 pcp=2 dcp=1 decode=sharded serving.replicas=2",
                      "tp=16 pcp=1 dcp=1 serving.replicas=2 kv.interleave=2"]
    _, bad = space.candidates(["tp=8 pcp=="])
    assert bad and bad[0].field == "search.candidates[0]"
