"""The price of a step, against hand-worked numbers and the model's own invariants."""

from __future__ import annotations

import math

import pytest

from pcpflow.config.hardware import HardwareConfig, Link
from pcpflow.parallel.grid import RankGrid
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.price import Placement, collective_seconds
from pcpflow.simulate.sizes import model_sizes
from pcpflow.testing import compose

# Round numbers, every efficiency 1: prices come out in closed form.
UNIT = [
    "mode=simulate", "hardware=h100_sxm", "hardware.peak_tflops.bf16=1", "hardware.hbm_tbps=1",
    "simulate.gemm_efficiency=1", "simulate.attention_efficiency=1", "simulate.hbm_efficiency=1",
    "simulate.ring_step_us=0.5", "output.plots=false", "output.progress=false",
]
HW = HardwareConfig(
    name="x", gpus_per_node=8, hbm_gib=80, hbm_tbps=3, peak_tflops={"bf16": 1000, "fp8": 2000},
    nvlink={"busbw_gbps": 400, "latency_us": 1}, network={"busbw_gbps": 40, "latency_us": 5},
)


def test_collectives_follow_nccl_tests_bus_bandwidth():
    link = Link(busbw_gbps=100, latency_us=2)
    s = 1e6  # bytes each rank passes in
    # all_gather of 4 ranks: pcpflow counts 4*3*s received; nccl-tests: (n-1)/n of the 4s output
    assert collective_seconds("all_gather", 4 * 3 * s, 4, link) == pytest.approx(3 * 2e-6 + 3 * s / 100e9)
    # all_to_all of an s-byte buffer per rank: (n-1)/n of it
    assert collective_seconds("all_to_all", 3 * s, 4, link) == pytest.approx(3 * 2e-6 + 0.75 * s / 100e9)
    # all_reduce of s bytes over 8: 2(n-1)/n of it, 2(n-1) hops
    assert collective_seconds("all_reduce", 2 * 7 * s, 8, link) == pytest.approx(14 * 2e-6 + 2 * 7 / 8 * s / 100e9)
    assert collective_seconds("all_gather", 0, 1, link) == 0


@pytest.mark.parametrize(
    "tp, pcp, dcp, expect",
    [
        (8, 2, 2, {"tp": "nvlink", "pcp": "network", "dcp": "network"}),  # CP across nodes
        (16, 1, 1, {"tp": "network", "pcp": "nvlink", "dcp": "nvlink"}),  # TP spans two nodes
        (2, 4, 4, {"tp": "nvlink", "pcp": "nvlink", "dcp": "nvlink"}),  # 8 ranks, one node
        (4, 4, 16, {"tp": "nvlink", "pcp": "network", "dcp": "network"}),
    ],
)
def test_a_group_crosses_the_network_only_when_its_ranks_span_nodes(tp, pcp, dcp, expect):
    place = Placement(RankGrid(tp=tp, pcp=pcp, dcp=dcp), HW)
    links = {g: "nvlink" if place.link(g) is HW.nvlink else "network" for g in expect}
    assert links == expect
    for g, kind in expect.items():
        if kind == "network":
            assert place.link(g).latency_us == HW.network.latency_us


@pytest.mark.parametrize(
    "tp, pcp, group, op, busbw",
    [
        (8, 2, "pcp", "all_gather", 40),  # a CP group: one GPU per node, its own NIC
        (8, 4, "pcp", "all_to_all", 40),
        (16, 1, "tp", "all_reduce", 320),  # 8 GPUs per node drive 8 NICs: 8 x 40
        (16, 1, "tp", "all_gather", 320),
        (2, 8, "pcp", "all_reduce", 160),  # ranks 0, 2, .., 14: 4 per node, 4 NICs
        (32, 1, "tp", "all_reduce", 320),  # 4 nodes, still 8 NICs each
        # all-to-all over 16 ranks, 8 per node: 8/16 of each rank's data leaves the node through
        # its NIC while 7/16 crosses NVLink; busbw = (15/16) S / max(8/16 S/40, 7/16 S/400)
        (16, 1, "tp", "all_to_all", 15 / 8 * 40),
        (2, 4, "pcp", "all_reduce", 400),  # one node: NVLink
    ],
)
def test_a_spread_group_drives_the_nics_of_its_gpus_in_each_node(tp, pcp, group, op, busbw):
    """One NIC per GPU: a ring over k GPUs of each node runs k rings, one per NIC (at most
    NVLink's bandwidth); an all-to-all sends what leaves the node through the sender's NIC."""
    assert Placement(RankGrid(tp=tp, pcp=pcp, dcp=1), HW).link(group, op).busbw_gbps == pytest.approx(busbw)


def test_spreading_tp_over_two_nodes_costs_what_its_nics_carry():
    """TP16 on two 8-GPU nodes: an all-reduce moves 2(n-1)/n of the data at 8 NICs' bus
    bandwidth (h100_sxm: 8 x 45 GB/s = its NVLink's 360), not one NIC's."""
    hw = compose(["mode=simulate", "hardware=h100_sxm"]).hardware
    place = Placement(RankGrid(tp=16, pcp=1, dcp=1), hw)
    s = 256e6
    t = collective_seconds("all_reduce", 2 * 15 * s, 16, place.link("tp", "all_reduce"))
    assert t == pytest.approx(30 * hw.network.latency_us * 1e-6 + 2 * 15 / 16 * s / (8 * hw.network.busbw_gbps * 1e9))


def test_one_gemm_bound_prefill_by_hand():
    """tiny_gqa (L=2, h=64, 4 heads, 2 KV heads, d=16, MLP 128, vocab 256), one 64-token
    prompt on one rank at 1 TFLOP/s and 1 TB/s: the TTFT is the one prefill step."""
    run = SimulatedRun(compose(UNIT + ["model=tiny_gqa", "pcp=1", "workload=explicit",
                                       "workload.prompt_lens=[64]", "workload.output_lens=[1]"]))
    m = run.run()["metrics"]
    attn_params = 64 * 64 + 2 * 64 * 2 * 16 + 64 * 64  # q, k, v, o
    mlp = 3 * 64 * 128
    gemm = 2 * (2 * (attn_params + mlp) * 64 + 256 * 64 * 1)  # 64 rows, 1 sampled row
    weights = (2 * (attn_params + mlp) + 256 * 64) * 2  # bf16, lm head; read once
    pairs = 64 * 65 // 2
    attn = 2 * 4 * 2 * pairs * (16 + 16)  # heads, layers
    kv = 2 * 2 * 16 * 2 * 2 * pairs / 128  # entry bytes x layers, once per 128-row query tile
    assert gemm / 1e12 > weights / 1e12 and attn / 1e12 > kv / 1e12  # both compute-bound
    assert m["ttft"]["mean_s"] == pytest.approx(gemm / 1e12 + attn / 1e12, rel=1e-12)
    assert m["per_rank_attention_work"] == [pairs]


def test_decode_reads_weights_and_kv_from_hbm():
    """A 1-row decode is HBM-bound: weights once plus the KV it reads, at 1 TB/s."""
    run = SimulatedRun(compose(UNIT + ["model=tiny_gqa", "pcp=1", "workload=explicit",
                                       "workload.prompt_lens=[64]", "workload.output_lens=[2]",
                                       "hardware.peak_tflops.bf16=1000"]))
    run.run()
    decode = run.records[1]
    weights = (2 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 128) + 256 * 64) * 2
    kv = 65 * 2 * 2 * 16 * 2 * 2  # 65 keys x entry (K and V, 2 heads, d=16) x bf16 x 2 layers
    assert decode["step_s"] == pytest.approx((weights + kv) / 1e12, rel=1e-12)
    assert decode["per_rank_memory_s"] == [pytest.approx(decode["step_s"])]


def test_step_lasts_as_long_as_its_slowest_rank():
    run = SimulatedRun(compose(UNIT + ["model=tiny_gqa", "pcp=2", "decode=sharded", "workload=explicit",
                                       "workload.prompt_lens=[40,9]", "workload.output_lens=[3]"]))
    run.run()
    for r in run.records:
        totals = [sum(x) for x in zip(r["per_rank_compute_s"], r["per_rank_memory_s"], r["per_rank_communication_s"])]
        assert r["step_s"] == pytest.approx(max(totals))
    assert any(len({round(t, 15) for t in r["per_rank_compute_s"]}) > 1 for r in run.records)  # ranks differ


def test_ring_hides_the_exchange_behind_attention():
    """With the KV exchange far slower than attention, a ring hides (n-1)/n of the
    attention behind it; with it far faster, it hides the exchange entirely; it pays for
    writing its n = 2 partial outputs and merging them: 2 written, 2 read, 1 written, which
    is 2n = 4 passes beyond the one output a single call writes, over 256 rows x 4 heads x
    (16 x 2 + 4) bytes in each of 2 layers, at 1 TB/s."""
    base = UNIT + ["model=tiny_gqa", "pcp=2", "workload=explicit", "workload.prompt_lens=[512]",
                   "workload.output_lens=[1]", "hardware.nvlink.latency_us=0"]
    for bw in (1e-6, 1e6):
        ring, none = (SimulatedRun(compose(base + [f"hardware.nvlink.busbw_gbps={bw}", f"simulate.overlap={o}"]))
                      for o in ("ring", "none"))
        ring.run(), none.run()
        p = none.records[0]["purpose_s"]
        hidden = min(p["kv_gather"], p["attention"] * (2 - 1) / 2)
        merge = 4 * 256 * 4 * 2 * (16 * 2 + 4) / 1e12
        steps = 1 * 2 * 0.5e-6  # n-1 = 1 ring iteration in each of 2 layers, 0.5 us each
        assert ring.records[0]["purpose_s"]["ring_merge"] == pytest.approx(merge)
        assert ring.records[0]["purpose_s"]["ring_step"] == pytest.approx(steps)
        assert ring.records[0]["step_s"] == pytest.approx(none.records[0]["step_s"] - hidden + merge + steps,
                                                          rel=1e-9)


def test_each_ring_iteration_costs_ring_step_us_unless_a_full_graph_replays_it():
    """pcp=4 runs 3 ring iterations in each of tiny_gqa's 2 layers: 6 x ring_step_us more
    per step, prefill or decode; a decode step replayed as a full CUDA graph pays none."""
    base = UNIT + ["model=tiny_gqa", "pcp=4", "dcp=4", "decode=sharded", "workload=explicit",
                   "workload.prompt_lens=[512]", "workload.output_lens=[3]"]

    def steps(*extra):
        run = SimulatedRun(compose(base + list(extra)))
        run.run()
        return [r["step_s"] for r in run.records]

    free, paid = steps("simulate.ring_step_us=0"), steps("simulate.ring_step_us=7")
    assert [p - f for f, p in zip(free, paid)] == pytest.approx([6 * 7e-6] * 3, rel=1e-6)
    graphs = ["cudagraph_mode=full_decode_only", "cudagraph_capture_sizes=[1,2,4]"]
    free, paid = steps("simulate.ring_step_us=0", *graphs), steps("simulate.ring_step_us=7", *graphs)
    assert [p - f for f, p in zip(free, paid)] == pytest.approx([6 * 7e-6, 0, 0], abs=1e-12)


def test_moe_reads_the_experts_its_rows_reach():
    from pcpflow.simulate.price import _experts_touched

    sizes = model_sizes(compose(["mode=simulate", "hardware=b200", "model=deepseek_v3", "tp=8",
                                 "simulate.weights_dtype=fp8"]).model)
    assert (sizes.num_experts, sizes.top_k, sizes.num_shared_experts, sizes.num_dense_layers) == (256, 8, 1, 3)
    assert _experts_touched(sizes, 1) == pytest.approx(8)
    assert _experts_touched(sizes, 10**5) == pytest.approx(256)
    # active parameters of DeepSeek-V3: ~37B (its model card), of 671B
    assert sizes.active_params_per_row() + sizes.embedding_params / 2 == pytest.approx(37e9, rel=0.05)
    assert sizes.total_weight_params() + sizes.embedding_params == pytest.approx(671e9, rel=0.02)


def test_llama3_405b_card_has_405b_parameters():
    sizes = model_sizes(compose(["mode=simulate", "hardware=b200", "model=llama3_405b", "tp=8"]).model)
    assert sizes.total_weight_params() + sizes.embedding_params == pytest.approx(405.8e9, rel=0.01)
    assert math.isclose(sizes.entry_dim_per_rank(8), 2 * 128)  # 1 of 8 KV heads, K and V


def test_auto_dcp_rest_takes_the_faster_path_per_step():
    base = ["mode=simulate", "hardware=gtt_h100", "model=llama3_70b", "tp=8", "pcp=4", "dcp=4", "workload=explicit",
            "workload.prompt_lens=[65536,3000]", "workload.cached_lens=[64000,0]", "workload.output_lens=[3]",
            "output.plots=false"]
    runs = {}
    for rest in ("auto", "queries", "context"):
        runs[rest] = SimulatedRun(compose(base + [f"pipeline.forward.dcp_rest={rest}"]))
        runs[rest].run()
    for a, q, c in zip(*(runs[k].records for k in ("auto", "queries", "context"))):
        assert a["step_s"] == pytest.approx(min(q["step_s"], c["step_s"]))
    assert {r["dcp_rest"] for r in runs["auto"].records} == {"queries", "context"}  # both win somewhere
