"""TP and MoE as a simulated step counts and prices them, against hand-worked numbers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from pcpflow.layouts.accounting import (
    ModelShape,
    grid_step_collectives,
    moe_all_to_all_step_traffic,
    step_traffic,
)
from pcpflow.layouts.layout import plan_layout
from pcpflow.pipeline.state import StepState
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.sizes import model_sizes
from pcpflow.testing import compose

MOE = ["model=tiny_mla", "model.moe.num_experts=8", "model.moe.top_k=2"]
BASE = ["mode=simulate", "hardware=h100_sxm", "output.plots=false", "output.progress=false", "workload=explicit",
        "workload.prompt_lens=[12]", "workload.output_lens=[2]", "dtype=float32"]


def test_tiny_mla_with_experts_is_priced_as_moe():
    dense = model_sizes(compose(BASE).model)
    moe = model_sizes(compose(BASE + MOE + ["model.moe.first_k_dense_replace=1"]).model)
    assert (dense.num_experts, dense.num_dense_layers) == (0, 2)
    # 2 layers, the first dense; experts are gated MLPs of width 128 on hidden 64
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.num_dense_layers) == (8, 2, 1, 1)
    assert moe.expert_params == 3 * 64 * 128
    every_other = model_sizes(compose(BASE + MOE + ["model.moe.moe_layer_freq=2"]).model)
    assert every_other.num_moe_layers == 1  # of layers 0 and 1, every 2nd from 0: layer 0


def _layout(pcp: int, lens=(8, 5)):
    return plan_layout(np.array(lens), np.array([True, True]), pcp_size=pcp)


def _shape(layers: int = 3) -> ModelShape:
    return ModelShape(hidden_size=10, num_layers=layers, entry_dim=6, num_heads=2, qk_dim=6, v_dim=4, dtype_bytes=2)


def test_moe_layers_have_one_tp_all_reduce_and_gather_adds_three_calls():
    layout = _layout(2)
    n = layout.padded_num_tokens
    colls = grid_step_collectives(layout, np.array([7, 12]), tp_size=2, dcp_size=1, shape=_shape(3),
                                  num_moe_layers=2, moe_dispatch="gather")
    calls, nbytes = step_traffic(colls, pcp_size=2, dcp_size=1, dtype_bytes=2, tp_size=2)
    # 1 dense layer x 2 all-reduces + 2 MoE layers x 1 (o_proj), and each MoE layer's TP sum
    assert calls["tp_all_reduce"] == 4
    assert calls["moe_gather"] == 2 and calls["moe_reduce_scatter"] == 4  # PCP reduce-scatter + TP all-reduce
    # all_gather over 2 PCP ranks, n x 10 each, both TP columns (copies): 2 * (n*10*2 * 2*1) per layer
    assert nbytes["moe_gather"] == 2 * 2 * n * 10 * 2 * 2
    # reduce-scatter of 2n x 10 (factor 1) over 2 TP copies + all-reduce of n x 10 (factor 2) over 2 PCP copies
    assert nbytes["moe_reduce_scatter"] == 2 * (2 * (2 * n * 10 * 2 * 1) + 2 * (n * 10 * 2 * 2))
    local = grid_step_collectives(layout, np.array([7, 12]), tp_size=2, dcp_size=1, shape=_shape(3),
                                  num_moe_layers=2, moe_dispatch="local")
    assert not [c for c in local if c.purpose.startswith("moe_")]


def test_all_to_all_counts_calls_exactly_and_bytes_from_the_send_matrix():
    send = np.array([[3, 5, 0, 0], [0, 0, 0, 0], [1, 2, 4, 0], [0, 0, 0, 0]])  # tp=2: odd ranks send nothing
    calls, nbytes = moe_all_to_all_step_traffic(send, num_moe_layers=2, padded_num_tokens=6, tp_size=2,
                                                hidden_size=10, top_k=2, dtype_bytes=2)
    assert calls == {"moe_counts": 2, "moe_dispatch": 4, "moe_combine": 4}
    moved = 5 + 1 + 2  # off the diagonal
    assert nbytes["moe_counts"] == 2 * 4 * 3 * 4 * 8
    assert nbytes["moe_dispatch"] == 2 * (moved * 10 * 2 + moved * 4 * 8)
    # combine back, then TP rank 0's broadcast of 6 x 10 to 1 other rank, in both TP groups
    assert nbytes["moe_combine"] == 2 * (moved * 10 * 2 + 6 * 10 * 2 * 1 * 2)


def test_uniform_routing_moves_the_expected_rows():
    run = SimulatedRun(compose(BASE + MOE + ["pcp=2", "tp=1", "moe.dispatch=all_to_all"]))
    run.run()
    r = run.records[0]  # the 12-token prefill: 6 real rows per rank
    # a row leaves its rank unless both its experts are among the rank's 4: 1 - C(4,2)/C(8,2)
    crossing = 6 * (1 - math.comb(4, 2) / math.comb(8, 2))
    moved = 2 * round(crossing)
    assert r["collective_calls"]["moe_dispatch"] == 2 * 2 and r["collective_calls"]["moe_counts"] == 2
    assert r["collective_bytes"]["moe_dispatch"] == 2 * (moved * 64 * 4 + moved * 2 * 2 * 8)
    assert r["expected_bytes"] == ["moe_dispatch", "moe_combine"]


def test_local_experts_are_not_split_by_tp_and_gather_splits_them_by_world():
    """The GEMM FLOPs of the prefill step (12 rows, 1 sampled) on one rank of each PCP rank."""
    def flops(extra):
        run = SimulatedRun(compose(BASE + MOE + extra))
        batch = run.scheduler.schedule()
        layout = run.plan(StepState(batch)).layout
        return float(run.pricer._gemms(layout, batch, 1.0)[2][0])

    # tp=2 halves the attention, not the MoE block (router, 2 routed and 1 shared expert per
    # row) under local dispatch, nor the LM head (every TP rank computes every logit)
    sizes = model_sizes(compose(BASE + MOE).model)
    moe_part = 2 * sizes.num_moe_layers * 12 * ((sizes.top_k + 1) * sizes.expert_params + 64 * 8)
    f1, f2 = flops(["pcp=1", "tp=1"]), flops(["pcp=1", "tp=2"])
    # MLA's q_a and kv_a projections are not split over TP either (replicated); the LM head on the sampled row
    replicated = 2 * sizes.num_layers * 12 * 64 * (sizes.head_dims[0] + sizes.head_dims[1] + sizes.head_dims[3])
    replicated += 2 * 1 * sizes.vocab_size * 64
    assert (f1 - moe_part - replicated) == pytest.approx(2 * (f2 - moe_part - replicated), rel=1e-9)
    # gather over tp=2: each rank runs all 12 rows with half of every expert, the shared one whole
    g2 = flops(["pcp=1", "tp=2", "moe.dispatch=gather"])
    routed = 2 * sizes.num_moe_layers * 12 * sizes.top_k * sizes.expert_params
    assert f2 - g2 == pytest.approx(routed / 2, rel=1e-9)


def test_dcp_over_tp_prices_every_gathered_row_on_each_shard():
    from pcpflow.simulate.price import _busiest_shard

    # tp=2 pcp=1 dcp=2: both TP ranks hold the 12 prefill rows (positions 0..11) and split
    # the heads; DCP shard 0 holds the even positions, shard 1 the odd. Every row (all
    # heads, gathered from both ranks) is scored on each shard: row p meets p//2 + 1 keys
    # on shard 0 (sum 42) and (p+1)//2 on shard 1 (sum 36); the slower shard sets the time.
    run = SimulatedRun(compose(BASE + ["pcp=1", "tp=2", "dcp=2"]))
    run.run()
    assert run.records[0]["per_rank_attention_work"] == [78]  # per PCP rank, as the executed run records it
    layout = plan_layout(np.array([12]), np.array([True]), pcp_size=1)
    assert _busiest_shard(layout, np.arange(12), run.grid, 1, "queries", None).tolist() == [42]
