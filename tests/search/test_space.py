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


def test_pools_join_the_space_as_prefill_and_decode_grids_counted_by_hand():
    # 4 GPUs, one CUDA-graph mode. A prefill pool whose GPUs divide 4 and leave room, beside a
    # decode pool (pcp 1, tp a power of two, dcp dividing tp) in the GPUs left; one instance (no
    # replicas); the decode mode is the decode pool's (pcp 1: replicated):
    #   prefill tp1 pcp1 dcp1 (1 GPU), 3 left: decode pools tp1 dcp1, tp2 dcp1, tp2 dcp2          -> 3
    #   prefill of 2 GPUs, 2 left: the same 3 decode pools beside
    #     tp1 pcp2 dcp1, tp2 pcp1 dcp1, tp2 pcp1 dcp2 (1 each), tp1 pcp2 dcp2 (3 dcp_rest,
    #     and the 3 rings in the prefill pool, the DCP path's dcp_rest left at auto)          -> 9 x 3 = 27
    space = Space(4, fixed={"cudagraph_mode": "none"}, experts=False, fill=True, pools_available=True)
    pools = [lay for lay in space.enumerate() if lay["disagg"] == "pd"]
    assert len(pools) == 30 and len({lay.values for lay in pools}) == 30
    assert all(lay["replicas"] == 1 and lay.world <= 4 for lay in pools)
    rings = [lay for lay in pools if lay["cp_attention"] != "allgather"]
    assert {(lay["tp"], lay["pcp"], lay["dcp"], lay["dcp_rest"]) for lay in rings} == {(1, 2, 2, "auto")}
    assert len(rings) == 9 and {lay["decode"] for lay in pools} == {"replicated"}
    decode_pools = {(lay["decode_pool_tp"], lay["decode_pool_pcp"], lay["decode_pool_dcp"]) for lay in pools}
    assert decode_pools == {(1, 1, 1), (2, 1, 1), (2, 1, 2)}
    # one pool is the space it was, its decode pool keys at their defaults
    one = [lay for lay in space.enumerate() if lay["disagg"] == "none"]
    assert len(one) == len(Space(4, fixed={"cudagraph_mode": "none"}, experts=False, fill=True).enumerate())
    assert {(lay["decode_pool_tp"], lay["decode_pool_dcp"]) for lay in one} == {(1, 1)}
    # written as the command line writes it
    lay = next(lay for lay in pools if lay["tp"] == 2 and lay["dcp"] == 2 and lay["decode_pool_dcp"] == 2)
    assert lay.label(space.dims) == "tp=2 pcp=1 dcp=2 disagg=pd disagg.decode_pool.tp=2 disagg.decode_pool.dcp=2"
