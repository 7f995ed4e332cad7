"""The operators of a simulated step, against hand-worked numbers (NCCL v2.29.7's tuning.cc
and paths.cc read by hand, tiles counted by hand) and the model's own invariants."""

from __future__ import annotations

import numpy as np
import pytest

from pcpflow.parallel.grid import RankGrid
from pcpflow.simulate.collectives import Comm, NcclTuner, net_peer_channels, p2p_rate_gbps
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.host import kernels_per_layer
from pcpflow.simulate.kernels import Kernels
from pcpflow.simulate.price import Placement
from pcpflow.simulate.sizes import model_sizes
from pcpflow.testing import compose

# Round numbers, every efficiency 1, no floor and no launch cost: prices come out in closed form.
UNIT = [
    "mode=simulate", "hardware=h100_sxm", "hardware.peak_tflops.bf16=1", "hardware.hbm_tbps=1", "hardware.sm_count=1",
    "hardware.kernel_floor_us=0", "hardware.host.launch_us=1e-9", "simulate.gemm_efficiency=1",
    "simulate.hbm_efficiency=1", "output.plots=false", "output.progress=false",
]


@pytest.fixture(scope="module")
def h100():
    return compose(["mode=simulate", "hardware=h100_sxm"]).hardware


def test_ring_and_nvls_inside_a_node_as_tuning_cc_prices_them(h100):
    """8 H100s, one node: the ring graph 12 x 30 GB/s, NVLS 8 x 40 with bwInter 60 (profile).
    All-reduce: ring Simple bus bandwidth 360, algorithm bandwidth x 8/14, latency base 8.4 +
    14 steps x 3.4 (NVLink Ring Simple); LL: min(llMaxBw 141 (Hopper, one node), 360 x .5);
    NVLS: 8 x min(40 x .85 x 7/8 x 2 = 59.5, bwInter 60) = 476 (the ~480 GB/s bus bandwidth
    NVLS is known for on H100), x 8/14; latency 25 (NVLink NVLS Simple), no base."""
    t = NcclTuner(h100, Comm(8, 1, 8))
    ar, ring, nvls = 2, 1, 4  # FUNCS.index("all_reduce"), RING, NVLS
    assert t.bandwidth[ar][ring][2] == pytest.approx(360 * 8 / 14)
    assert t.latency[ar][ring][2] == pytest.approx(8.4 + 14 * 3.4)
    assert t.bandwidth[ar][ring][0] == pytest.approx(141 * 8 / 14)
    assert t.latency[ar][ring][0] == pytest.approx(6.6 + 14 * 0.6)
    assert t.bandwidth[ar][nvls][2] == pytest.approx(8 * 40 * .85 * 7 / 8 * 2 * 8 / 14)
    assert t.latency[ar][nvls][2] == pytest.approx(25.0)
    # a 32 KiB all-reduce (a decode's hidden state): ring LL, 15 us + 32768 / (1000 x 80.57) us
    algo, proto, s = t.pick("all_reduce", 32768)
    assert (algo, proto) == ("ring", "LL") and s == pytest.approx((15.0 + 32768 / (1000 * 141 * 8 / 14)) * 1e-6)
    # an all-gather's nBytes is the whole output (ncclFuncMaxSendRecvCount): ring Simple of 8 x 1 GiB
    algo, proto, s = t.pick("all_gather", 8 * 2**30)
    busbw = min(360, 8 * 40 * .85 * 7 / 8 * 7 / 8)  # NVLS all-gather: (ppn-1)/ppn, no algbw conversion
    assert (algo, proto) == ("ring", "Simple") and busbw < 360 * 8 / 7
    assert s == pytest.approx((8.4 + 7 * 3.4 + 8 * 2**30 / (1000 * 360 * 8 / 7)) * 1e-6)


def test_a_large_all_reduce_in_a_node_runs_nvls():
    """search.cc settles NVLS on 8 H100s at 8 channels of bwIntra 40 (9 x 40 <= 18 x 20.6: each
    GPU's link carries every channel, twice as its head) and raises bwInter in pass 2, which no
    path inside a node checks, to 60. A 256 MiB all-reduce (a TP8 prefill of 8K rows of 16384
    bf16): NVLS 25 + 268435456 / (1000 x 476 x 8/14) = 1011.9 us, the ring 8.4 + 14 x 3.4 +
    268435456 / (1000 x 360 x 8/14) = 1361.3 us: NVLS runs. B200: 9 x 80 <= 18 x 40.1 (90 does
    not fit), bwInter 90: 8 x min(80 x .74 x 7/8 x 2, 90) = 720."""
    for name in ("h100_sxm", "h200_sxm", "gtt_h100"):
        hw = compose(["mode=simulate", f"hardware={name}"]).hardware
        algo, proto, s = NcclTuner(hw, Comm(8, 1, 8)).pick("all_reduce", 2**28)
        assert (algo, proto) == ("nvls", "Simple")
        assert s == pytest.approx((25 + 2**28 / (1000 * 476 * 8 / 14)) * 1e-6)
        assert NcclTuner(hw, Comm(8, 1, 8)).time_us("all_reduce", 1, 2, 2**28) == pytest.approx(
            8.4 + 14 * 3.4 + 2**28 / (1000 * 360 * 8 / 14))
    b200 = compose(["mode=simulate", "hardware=b200"]).hardware
    assert NcclTuner(b200, Comm(8, 1, 8)).bandwidth[2][4][2] == pytest.approx(720 * 8 / 14)


def test_nvls_across_nodes_reaches_the_heads_nics(h100):
    """TP over nodes, 8 GPUs a node: the NVLS graph's bwInter is what each head's NIC path takes
    (one GPU's network graph, 2 x 24 = 48, per NVLS channel: 8 NICs / 8 channels), below the 60
    a node alone reaches. NVLS Tree's bus bandwidth per channel: two nodes min(59.5, 2 x 48,
    perChMaxNVLSTreeBw 57.7) = 57.7; four nodes min(59.5, 48, 45.5) = 45.5; x nRanks / nSteps."""
    assert NcclTuner(h100, Comm(16, 2, 8)).bandwidth[2][5][2] == pytest.approx(8 * 57.7 * 16 / 30)
    assert NcclTuner(h100, Comm(32, 4, 8)).bandwidth[2][5][2] == pytest.approx(8 * 45.5 * 32 / 62)


def test_a_cp_group_gathers_with_pat_when_small_and_the_ring_when_large(h100):
    """16 ranks, one per node (a CP group): PAT is on (ncclPatEnable). PAT all-gather: bus
    bandwidth 2 x 24 x .75, no algorithm-bandwidth conversion, latency 8 + log2(16) x 14/3.5
    + 16 x 2.8; the ring: 2 x 24 x 16/15, latency 8.4 + 15 inter-node steps x 14 (NET Tree
    Simple, ppn = 1): PAT wins small messages, the ring large ones."""
    t = NcclTuner(h100, Comm(16, 16, 1))
    ag, ring, pat = 0, 1, 6
    assert t.bandwidth[ag][pat][2] == pytest.approx(36.0)
    assert t.latency[ag][pat][2] == pytest.approx(8.0 + 4 * 14 / 3.5 + 16 * 2.8)
    assert t.bandwidth[ag][ring][2] == pytest.approx(48 * 16 / 15)
    assert t.latency[ag][ring][2] == pytest.approx(8.4 + 15 * 14.0)
    assert t.pick("all_gather", 2**20)[:2] == ("pat", "Simple")
    assert t.pick("all_gather", 2**30)[:2] == ("ring", "Simple")
    assert NcclTuner(h100, Comm(16, 2, 8)).bandwidth[ag][pat] == [0.0, 0.0, 0.0]  # 8 GPUs a node: no PAT


def test_a_spread_group_drives_one_nic_per_gpu(h100):
    """TP16 on two nodes: 8 GPUs per node bring 8 NICs, each the one-GPU graph (2 x 24), capped
    by the node's NVLink ring (360): ring all-reduce at 360 x 16/30, never one NIC's 48."""
    t = NcclTuner(h100, Comm(16, 2, 8))
    assert t.bandwidth[2][1][2] == pytest.approx(360 * 16 / 30)
    assert NcclTuner(h100, Comm(2, 2, 1)).bandwidth[2][1][2] == pytest.approx(48 * 2 / 2)


def test_point_to_point_channels_follow_paths_cc(h100):
    """Channels to a network peer: max(1 NIC, ceil(50 / 14)) = 4, a power of two; halved while
    4 x ceil(nranks / 8) exceeds the p2p channels (the 2-channel ring doubled: 4)."""
    assert net_peer_channels(h100, Comm(4, 4, 1)) == 4
    assert net_peer_channels(h100, Comm(16, 16, 1)) == 2
    assert net_peer_channels(h100, Comm(32, 32, 1)) == 1
    assert p2p_rate_gbps(h100, Comm(4, 4, 1), network=True) == pytest.approx(50)  # 56, at most the NIC
    assert p2p_rate_gbps(h100, Comm(16, 16, 1), network=True, efficiency=0.5) == pytest.approx(2 * 14 * 0.5)
    assert p2p_rate_gbps(h100, Comm(4, 4, 1), network=True, efficiency=0.5, peers=3) == pytest.approx(50)


def test_groups_are_placed_on_nodes_tp_innermost(h100):
    place = Placement(RankGrid(tp=8, pcp=4, dcp=4), h100)
    assert place.comm("tp") == Comm(8, 1, 8) and place.comm("pcp") == Comm(4, 4, 1)
    assert not place.network("tp") and place.network("dcp")
    assert Placement(RankGrid(tp=2, pcp=4, dcp=4), h100).comm("pcp") == Comm(4, 1, 4)  # 8 GPUs: one node


def test_a_gemm_runs_in_tiles_and_waves(h100):
    """sm_count 4, 1 TFLOP/s: a wave lasts one 128 x 128 tile on one SM. 256 x 256 x 64 is 4
    tiles, one wave: 4 SMs x 128 x 128 x 2 x 64 FLOP-slots; one row more makes 6 tiles, two
    waves; one row takes an 8-row tile (wgmma's smallest N) and stays memory-bound."""
    hw = h100.model_copy(update={"sm_count": 4, "kernel_floor_us": 0.0,
                                 "peak_tflops": h100.peak_tflops.model_copy(update={"bf16": 1.0})})
    k = Kernels(hw, gemm_efficiency=1.0, hbm_efficiency=1.0)
    kw = dict(peak_key="bf16", w_bytes=2, a_bytes=2)
    wave = 4 * 128 * 128 * 2 * 64 / 1e12
    assert float(k.gemm(256, 256, 64, **kw)[0]) == pytest.approx(wave)
    assert float(k.gemm(257, 256, 64, **kw)[0]) == pytest.approx(2 * wave)
    t, compute = k.gemm(1, 256, 64, **kw)
    assert float(t) == pytest.approx(max(4 * 8 * 128 * 2 * 64 / 1e12, (64 + 256 * 64 + 256) * 2 / (3.35e12)))
    assert k.gemm_scalar(257, 256, 64, **kw)[0] == pytest.approx(float(k.gemm(257, 256, 64, **kw)[0]))


def test_one_prefill_by_hand():
    """tiny_gqa (2 layers, h=64, 4 heads, 2 KV heads, d=16, MLP 128, vocab 256), one 64-token
    prompt at pcp=1, one SM at 1 TFLOP/s and 1 TB/s, no floors. GEMMs, 64 rows in a 64-row
    tile: qkv (N=128, K=64) and o (N=64, K=64) one tile each, gate_up (N=256) two, down (K=128)
    one tile of twice the K; the LM head on 1 row, an 8-row tile, N=256: two tiles. Attention:
    FlashAttention-3's published figure (arXiv 2407.08608 Fig. 5, of 989 TF/s): the 64 rows,
    two query heads a KV head packed, fill one 128-row tile; the 64 pairs every row sees (its
    first key) at the non-causal 512-key share (467) scaled by 64 / 512 keys, the other
    64 x 65 / 2 - 64 at the causal one (292) scaled by 63 / 512."""
    run = SimulatedRun(compose(UNIT + ["model=tiny_gqa", "pcp=1", "workload=explicit", "workload.prompt_lens=[64]",
                                       "workload.output_lens=[1]"]))
    m = run.run()["metrics"]
    layer = 64 * 128 * 2 * (64 + 64 + 2 * 64 + 128)
    gemm = (2 * layer + 2 * 8 * 128 * 2 * 64) / 1e12
    pairs = 64 * 65 // 2
    at_peak = 64 / (467 / 989 * 64 / 512) + (pairs - 64) / (292 / 989 * 63 / 512)
    attention = 2 * 4 * 2 * (16 + 16) * at_peak / 1e12
    row_bytes = 2 * (10 * 64 + 2 * (4 + 2) * 16 + 3 * 128) + 2 * 2 * 16 * 2  # activations, and the KV write
    memory = 64 * 2 * row_bytes / 1e12
    terms = m["simulate"]["breakdown_s"]
    assert terms["gemm"]["exposed_s"] == pytest.approx(gemm, rel=1e-9)
    assert terms["attention"]["exposed_s"] == pytest.approx(attention, rel=1e-9)
    assert terms["memory_ops"]["exposed_s"] == pytest.approx(memory, rel=1e-9)
    assert m["ttft"]["mean_s"] == pytest.approx(gemm + attention + memory, rel=1e-6)
    assert m["per_rank_attention_work"] == [pairs]


@pytest.mark.parametrize("extra", [
    [],
    ["pipeline.forward.cp_attention=ring_pass_kv"],
    ["pipeline.forward.cp_attention=ring_pass_q"],
    # a batch-1 decode's query travels from its owner: the rank that only receives waits for it
    ["simulate.cp_decode=ring_pass_q", "workload.prompt_lens=[20000]", "cudagraph_mode=full_decode_only"],
    ["simulate.cp_decode=ring_pass_q", "decode=replicated"],
], ids=["allgather", "pass_kv", "pass_q", "ring_decode_one_query", "ring_decode_replicated"])
def test_every_step_is_the_sum_of_its_exposed_terms(extra):
    run = SimulatedRun(compose(["mode=simulate", "hardware=h200_sxm", "model=llama3_70b", "tp=8", "pcp=2", "dcp=2",
                                "decode=sharded", "workload=explicit", "workload.prompt_lens=[20000,3000]",
                                "workload.output_lens=[4]", "output.plots=false", *extra]))
    m = run.run()["metrics"]
    for r in run.records:
        assert sum(r["purpose_s"].values()) == pytest.approx(r["step_s"], rel=1e-9)
        totals = [sum(x) for x in zip(r["per_rank_compute_s"], r["per_rank_memory_s"], r["per_rank_communication_s"])]
        assert r["step_s"] == pytest.approx(max(totals))
    exposed = sum(v["exposed_s"] for v in m["simulate"]["breakdown_s"].values())
    assert exposed == pytest.approx(run.clock, rel=1e-9)


def test_a_package_crossing_the_ring_alone_pays_its_hops_one_after_another():
    """The ring's loop as it runs (``ring_loop``). Four ranks starting together, every package
    the same (s = 1, attention a = 3 a hop): each hop is s, hidden. One package crossing alone
    (origin 0, as a batch-1 decode's query): rank h + 1 receives it at iteration h, once rank h
    has it: rank 2 waits 2 s for it and 1 s for its own send, rank 1 2 s, rank 0 its one send;
    rank 3, idle until it comes, waits 3 s on the last hop. A transfer starts when both ends
    reach it: a receiver late by 2 makes the sender's hop 3."""
    from pcpflow.simulate.price import ring_loop

    P = 4
    balanced = ring_loop(np.full((P, P), 3.0), np.ones((P, P - 1)))
    assert balanced[:, : P - 1].tolist() == [[1.0] * 3] * 4 and not balanced[:, -1].any()
    alone = np.zeros((P, P - 1))
    alone[[0, 1, 2], [0, 1, 2]] = 1.0  # rank h sends the package at iteration h
    hop = ring_loop(np.zeros((P, P)), alone)
    assert hop.sum(axis=1).tolist() == [1.0, 2.0, 3.0, 3.0]
    assert hop[3, :3].tolist() == [0.0, 0.0, 3.0]  # idle until the package comes: all its wait on the last hop
    # three ranks: rank 1 sends 2 to rank 2 at iteration 0, rank 0 sends 1 to rank 1 at iteration 1,
    # where rank 1 arrives 2 late: the sender waits for it
    late = ring_loop(np.zeros((3, 3)), np.array([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]))
    assert late[:, :2].tolist() == [[0.0, 3.0], [2.0, 1.0], [2.0, 0.0]]
    assert ring_loop(np.zeros((3, 3)), np.array([[0.0, 1.0], [2.0, 0.0], [0.0, 0.0]]), overlap=False).tolist() == \
        late.tolist()  # no attention: overlap changes nothing


def test_a_decodes_query_pays_every_hop_of_its_ring():
    """Batch 1, ``decode=sharded`` over CP4 x TP8 (Meta's pass-Q decode): the one query hops
    from its owner through the three other ranks, each hop after the one before, then the
    partials come back in one all-to-all: the slowest rank's exposed hops a layer are 3, not
    the 2 a rank sends and receives itself."""
    run = SimulatedRun(compose(RING405 + ["pcp=4", "dcp=4", "workload.prompt_lens=[8192]", "workload.output_lens=[3]",
                                          "decode=sharded", "simulate.cp_decode=ring_pass_q",
                                          "cudagraph_mode=full_decode_only"]))
    run.run()
    decode, L = run.records[-1], run.sizes.num_layers
    hop_b = (16 * 128 + 2 * 128) * 2  # a query of 16 heads x 128 and the new token's KV entry, bf16
    hop = run.pricer.place.seconds("sendrecv", "dcp", float(hop_b))[0]
    ring = sum(decode["purpose_s"].get(k, 0.0) for k in ("ring_send_q", "ring_send_kv"))
    # latency-bound: a hop without the KV entry (past its owner) costs within 2% of one with it
    assert ring == pytest.approx(3 * L * hop, rel=0.02)


def test_host_launches_every_kernel_eagerly_and_one_graph_when_replayed():
    """A decode of llama3_8b at batch 1 on h100 is host-bound eagerly (~100 kernels a layer
    at 6.4 us each) and GPU-bound replayed as a full CUDA graph (one launch)."""
    base = ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "pcp=1", "workload=explicit",
            "workload.prompt_lens=[512]", "workload.output_lens=[3]", "output.plots=false"]
    eager, graphed = (SimulatedRun(compose(base + extra)) for extra in ([], ["cudagraph_mode=full_decode_only"]))
    eager.run(), graphed.run()
    host = eager.pricer.host
    kernels = host.kernels()
    assert kernels == 32 * host.per_layer + host.layer.norm + 3
    decode = eager.records[-1]
    gpu = sum(v for k, v in decode["purpose_s"].items() if k != "host_launch")
    assert decode["step_s"] == pytest.approx(kernels * 6.4e-6)  # no collective at tp=1
    assert decode["purpose_s"]["host_launch"] == pytest.approx(kernels * 6.4e-6 - gpu)
    g = graphed.records[-1]
    assert g["purpose_s"]["host_launch"] == 0 and g["hidden_s"]["host_launch"] == pytest.approx(15e-6)
    assert g["step_s"] < decode["step_s"]


def test_kernels_per_layer_are_counted_from_pcpflows_forward():
    """The count is the forward's, not the card's sizes: the same at 8B and 405B shapes (one
    TP rank), and it holds the layer's six GEMMs (q, k, v, o, gate_up, down) and its attention
    backend's write and kernel."""
    small = kernels_per_layer(model_sizes(compose(["mode=simulate", "hardware=b200", "model=llama3_8b"]).model), 1)
    big = kernels_per_layer(model_sizes(compose(["mode=simulate", "hardware=b200", "model=llama3_405b", "tp=8"]).model), 8)
    assert small == big
    assert small.total > 6 + small.attention and small.attention >= 2
    mla = kernels_per_layer(model_sizes(compose(["mode=simulate", "hardware=b200", "model=deepseek_v3", "tp=8"]).model), 8)
    assert mla.total != small.total  # MLA's own forward (latent norms, absorbed queries)


def test_a_profile_may_override_the_kernel_count():
    base = ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "pcp=1", "workload=explicit",
            "workload.prompt_lens=[512]", "workload.output_lens=[2]", "output.plots=false"]
    run = SimulatedRun(compose(base + ["hardware.host.kernels_per_layer=15"]))
    run.run()
    assert run.pricer.host.kernels() == 32 * 15 + run.pricer.host.layer.norm + 3


def test_auto_dcp_rest_takes_the_faster_path_and_shows_metas_rule_beside():
    base = ["mode=simulate", "hardware=gtt_h100", "model=llama3_70b", "tp=8", "pcp=4", "dcp=4", "workload=explicit",
            "workload.prompt_lens=[65536,3000]", "workload.cached_lens=[64000,0]", "workload.output_lens=[3]",
            "output.plots=false"]
    runs = {}
    for rest in ("auto", "queries", "context"):
        runs[rest] = SimulatedRun(compose(base + [f"pipeline.forward.dcp_rest={rest}"]))
        runs[rest].run()
    for a, q, c in zip(*(runs[k].records for k in ("auto", "queries", "context"))):
        assert a["step_s"] == pytest.approx(min(q["step_s"], c["step_s"]))
        if a["dcp_rest"] == "context":
            assert c["step_s"] < q["step_s"]
    assert {r["dcp_rest"] for r in runs["auto"].records} == {"queries", "context"}  # both win somewhere
    assert all(r.get("dcp_rest_meta_rule") in ("queries", "context") for r in runs["auto"].records if r["num_prefill_tokens"])


RING405 = ["mode=simulate", "hardware=gtt_h100", "model=llama3_405b", "simulate.weights_dtype=fp8", "tp=8",
           "workload=explicit", "workload.output_lens=[1]", "output.plots=false", "output.progress=false"]


@pytest.mark.parametrize("new, ran", [(5_100, "ring_pass_kv"), (4_900, "ring_pass_q")])
def test_ring_auto_takes_the_executed_rule_with_the_hardwares_rates(new, ran):
    """``choose_ring_variant`` (the executed rule) with gtt_h100's numbers, CP4 x TP8, 405B: one
    rank's KV entry 2 x 128 bf16 (2 bytes), 16 query heads of 128. Attention at the dense peak's
    FlashAttention-3 plateau share, 800 x 648 / 989 TF/s; the ring's link 4 network channels x
    14 GB/s x p2p_efficiency (26.0 GB/s, under the NIC's 50). pass-KV hides once T x 2 x 16 x 256
    x BW >= 4 x C x 256 x 2: T >= 5,036. Both sides stay under the miss-rate test (2 x 1 / 16 of
    128K)."""
    from pcpflow.config.hardware import SimulateConfig

    bw = 4 * 14e9 * SimulateConfig().p2p_efficiency
    threshold = 4 * 800e12 * 648 / 989 * 256 * 2 / (2 * 16 * 256 * bw)
    assert 4_900 < threshold < 5_100
    run = SimulatedRun(compose(RING405 + ["pcp=4", "dcp=4", "workload.prompt_lens=[131072]",
                                          f"workload.cached_lens=[{131_072 - new}]",
                                          "pipeline.forward.cp_attention=ring_auto"]))
    run.run()
    assert run.records[-1]["cp_attention"] == ran


def test_a_ring_hides_its_hop_behind_the_iteration_it_overlaps():
    """pass-KV at pcp=dcp=2, one 32K prefill: one hop a layer (iteration 0), each rank's block
    of 16,384 KV entries (one rank's 1 KV head x 128 x K and V, bf16) to the other rank over the
    network. Hand-priced: NET Simple latency 14 us, then 4 channels x 14 GB/s x p2p_efficiency
    at most the NIC. It hides behind the iteration's attention; on a slow link the rest is
    exposed: hidden + exposed is the hop's whole time, every layer."""
    base = RING405 + ["pcp=2", "dcp=2", "workload.prompt_lens=[32768]", "pipeline.forward.cp_attention=ring_pass_kv"]

    def step(efficiency):
        run = SimulatedRun(compose(base + [f"simulate.p2p_efficiency={efficiency}"]))
        run.run()
        return run.records[0]

    fast, slow = step(0.4646), step(0.001)
    for r in (fast, slow):
        assert r["cp_attention"] == "ring_pass_kv" and "kv_gather" not in r["collective_calls"]
        assert r["collective_calls"]["ring_send_kv"] == 126  # P - 1 = 1 hop a layer
    assert fast["purpose_s"]["ring_send_kv"] == 0 and fast["hidden_s"]["ring_send_kv"] > 0
    hop = 14e-6 + 16_384 * 256 * 2 / min(50e9, 4 * 14e9 * 0.001)
    assert slow["purpose_s"]["ring_send_kv"] + slow["hidden_s"]["ring_send_kv"] == pytest.approx(126 * hop, rel=1e-9)
    assert 0 < slow["hidden_s"]["ring_send_kv"] < slow["purpose_s"]["attention"]


def test_decode_ring_pass_q_counts_what_the_executed_ring_sends():
    """A sharded decode under ``simulate.cp_decode=ring_pass_q`` at pcp=dcp=2, TP8 (70B: 8 query
    heads of 128 a rank): the prefill step takes the engine; each decode step runs the ring:
    its holder (rank 0: the first decode, round robin) sends the query (8 x 128 bf16) one hop a
    layer, with the new KV entry (1 KV head x 128 x K and V) when rank 1 owns it (the last
    step's position 8,193: (8193 // 1) % 2 = 1), and one all-to-all a layer returns rank 1's
    partial (8 x 128 outputs in bf16 + 8 log-sum-exps in float32) to it; every TP rank runs its own ring
    (bytes x 8)."""
    base = ["mode=simulate", "hardware=gtt_h100", "model=llama3_70b", "tp=8", "pcp=2", "dcp=2", "decode=sharded",
            "workload=explicit", "workload.prompt_lens=[8192]", "workload.output_lens=[3]", "output.plots=false"]
    engine = SimulatedRun(compose(base))
    ring = SimulatedRun(compose(base + ["simulate.cp_decode=ring_pass_q"]))
    m_engine, m_ring = engine.run()["metrics"], ring.run()["metrics"]
    assert [r["cp_attention"] for r in ring.records] == ["allgather", "ring_pass_q", "ring_pass_q"]
    assert m_ring["cp_attention_steps"] == {"allgather": 1, "ring_pass_q": 2}
    assert any(p.startswith("dcp_") for p in engine.records[-1]["collective_calls"])
    last = ring.records[-1]
    calls, nbytes = last["collective_calls"], last["collective_bytes"]
    assert not {p for p in calls if p.startswith(("dcp_", "kv_gather"))}
    assert calls["ring_send_q"] == calls["ring_send_kv"] == calls["ring_all2all"] == 80
    assert nbytes["ring_send_q"] == 8 * 80 * 8 * 128 * 2
    assert nbytes["ring_send_kv"] == 8 * 80 * 2 * 128 * 2
    assert nbytes["ring_all2all"] == 8 * 80 * (8 * 128 * 2 + 8 * 4)
    per_rank = last["per_rank_collective_bytes"]["ring_send_q"]  # global rank = pcp_rank * 8 + tp_rank
    assert sorted([per_rank[0], per_rank[8]]) == [0, 80 * 8 * 128 * 2] and len(set(per_rank[:8])) == 1
    assert "priced_only" not in m_ring["simulate"] and "priced_only" not in m_engine["simulate"]
    # The all-to-all ends on each rank once its sends and its receives are done: the holder sends
    # nothing and receives the partial (2,080 bytes a TP rank), as long as rank 1's send of it, on
    # whichever rank the step reports. Hand-priced as the hop above: NET latency 14 us, then 4
    # channels x 14 GB/s x p2p_efficiency (at most the NIC's 50 GB/s).
    a2a = 80 * (14e-6 + 2_080 / min(50e9, 4 * 14e9 * 0.4646))
    for record in ring.records[1:]:
        assert record["purpose_s"]["ring_all2all"] == pytest.approx(a2a, rel=1e-9)


def test_kv_dtype_sizes_the_kv_that_moves_and_is_read():
    base = ["mode=simulate", "hardware=h200_sxm", "model=llama3_70b", "tp=8", "pcp=2", "workload=explicit",
            "workload.prompt_lens=[65536]", "workload.output_lens=[2]", "output.plots=false"]
    bf16, fp8 = (SimulatedRun(compose(base + [f"simulate.kv_dtype={d}"])) for d in ("bf16", "fp8"))
    bf16.run(), fp8.run()
    assert fp8.records[0]["collective_bytes"]["kv_gather"] * 2 == bf16.records[0]["collective_bytes"]["kv_gather"]
    assert fp8.records[0]["collective_bytes"]["restore"] == bf16.records[0]["collective_bytes"]["restore"]
    # the decode reads its 65,537 keys once (above the per-layer floor): half the bytes, half the time
    assert fp8.records[1]["purpose_s"]["attention"] == pytest.approx(bf16.records[1]["purpose_s"]["attention"] / 2)


def test_fp4_weights_price_their_gemms_at_the_fp4_peak():
    """B200's FP4 peak is twice its FP8 one: compute-bound GEMMs take half the time."""
    base = ["mode=simulate", "hardware=b200", "model=llama3_70b", "tp=8", "workload=explicit",
            "workload.prompt_lens=[16384]", "workload.output_lens=[1]", "output.plots=false", "hardware.kernel_floor_us=0"]
    fp8, fp4 = (SimulatedRun(compose(base + [f"simulate.weights_dtype={d}"])) for d in ("fp8", "fp4"))
    fp8.run(), fp4.run()
    ratio = fp4.records[0]["purpose_s"]["gemm"] / fp8.records[0]["purpose_s"]["gemm"]
    assert 0.5 <= ratio < 0.55  # the LM head stays bf16


def test_the_fitted_factors_are_two_and_say_their_share():
    m = SimulatedRun(compose(RING405 + ["pcp=4", "dcp=4", "workload.prompt_lens=[131072]",
                                        "pipeline.forward.cp_attention=ring_pass_kv"])).run()["metrics"]
    fitted = m["simulate"]["fitted"]
    assert set(fitted) == {"gemm_efficiency", "p2p_efficiency"}
    for f in fitted.values():
        assert 0 <= f["share"] <= 1 and f["fitted_on"] and 0 < f["value"] <= 1
    assert fitted["gemm_efficiency"]["share"] > 0.3  # a 128K prefill is mostly GEMMs and attention
    assert np.isclose(fitted["p2p_efficiency"]["share"], 0.0)  # the ring's SendRecv all hides


def test_the_lm_head_is_whole_on_every_tp_rank():
    """pcpflow replicates the LM head (pcpflow.parallel.tensor_parallel: every TP rank computes
    every logit, no gather), so a decode's LM head reads the whole 128,256 x 16,384 bf16 matrix
    on each rank at any tp: (16384 x 2 + 128256 x 16384 x 2 + 128256 x 2) B at 2.4 TB/s x 0.9 =
    1.946 ms (its tiles: 8 waves of 132 8 x 128 tiles at 800 x 0.4235 TF/s, 0.105 ms)."""
    lm = (16384 * 2 + 128256 * 16384 * 2 + 128256 * 2) / (2.4e12 * 0.9)
    for tp in (8, 16):
        run = SimulatedRun(compose(["mode=simulate", "hardware=gtt_h100", "model=llama3_405b", f"tp={tp}",
                                    "simulate.weights_dtype=fp8", "output.plots=false"]))
        assert run.pricer._dense_cost(0, 1)[0] == pytest.approx(lm, rel=1e-12)


def test_weights_a_tp_rank_holds():
    """Llama 3 405B, fp8, tp=16: the linear weights 126 x (16384 x 16384 x 2 (q, o) + 2 x 16384
    x 1024 (k, v) + 3 x 16384 x 53248) split 16 ways; its 8 KV heads over 16 ranks leave each
    rank one whole (126 x 2 x 16384 x 128 x (1 - 8/16) more); embedding and LM head whole in
    bf16 (2 x 128256 x 16384 x 2 B)."""
    from pcpflow.simulate.prepare import weight_bytes_per_gpu

    sizes = model_sizes(compose(["mode=simulate", "hardware=gtt_h100", "model=llama3_405b", "tp=8",
                                 "simulate.weights_dtype=fp8"]).model)
    linear = 126 * (16384 * 16384 * 2 + 2 * 16384 * 1024 + 3 * 16384 * 53248)
    kv_whole = 126 * 2 * 16384 * 128 * (1 - 8 / 16)
    embed = 2 * 128256 * 16384 * 2
    assert weight_bytes_per_gpu(sizes, "fp8", 16) == pytest.approx(linear / 16 + kv_whole + embed, rel=1e-12)
    assert weight_bytes_per_gpu(sizes, "fp8", 8) == pytest.approx(linear / 8 + embed, rel=1e-12)


def test_mla_latent_projections_are_whole_on_every_tp_rank():
    """DeepSeek-V3, fp8, tp=8. Linear weights: 61 MLA layers of q_a 7168 x 1536, q_b 1536 x
    128 x 192, kv_a 7168 x 576, kv_b 512 x 128 x 256, o 16384 x 7168; 3 dense MLPs 3 x 7168 x
    18432; 58 MoE layers of 257 experts 3 x 7168 x 2048 and a 7168 x 256 router. q_a and kv_a
    stay whole on every rank (61 x 7168 x (1536 + 576), split by none); embedding and LM head
    129280 x 7168 each, bf16."""
    from pcpflow.simulate.prepare import weight_bytes_per_gpu

    sizes = model_sizes(compose(["mode=simulate", "hardware=h200_sxm", "model=deepseek_v3", "tp=8"]).model)
    attention = 7168 * 1536 + 1536 * 128 * 192 + 7168 * 576 + 512 * 128 * 256 + 128 * 128 * 7168
    linear = 61 * attention + 3 * 3 * 7168 * 18432 + 58 * (257 * 3 * 7168 * 2048 + 7168 * 256)
    whole = 61 * 7168 * (1536 + 576)
    embed = 2 * 129280 * 7168 * 2
    assert weight_bytes_per_gpu(sizes, "fp8", 8) == pytest.approx((linear - whole) / 8 + whole + embed, rel=1e-12)
    assert weight_bytes_per_gpu(sizes, "fp8", 1) == pytest.approx(linear + embed, rel=1e-12)


def test_tp16_over_two_nodes_decodes_with_tree_ll(h100):
    """TP16 on two nodes (tp innermost: ranks 0-15 on nodes 0 and 1; with pcp=2 the PCP group
    {0, 16} is one rank on each of nodes 0 and 2). A decode's all-reduce, 1 x 16384 bf16 =
    32 KiB: Tree LL latency 6.8 + 2 x ((16/2 - 1) x 0.6 + log2(2) x 5.0) = 25.2 us (NVLink
    Tree LL inside, NET Tree LL across); bandwidth min(16 x 22.5 x .92 / 3.8, llMaxBw 39 (an
    Intel host, 2 nodes)) x .5 = 19.5 GB/s, x 0.7 (treeCorrectionFactor[LL] at 32768 >> 6 =
    2^9): 25.2 + 32768 / (1000 x 13.65) = 27.60 us. Ring LL: 6.6 + 28 x max(0.6, 1.0 network
    overhead) + 2 x 2.7 = 40 us of latency: the tree runs."""
    place = Placement(RankGrid(tp=16, pcp=2, dcp=2), h100)
    assert place.comm("tp") == Comm(16, 2, 8) and place.comm("pcp") == Comm(2, 2, 1)
    t = NcclTuner(h100, Comm(16, 2, 8))
    assert t.latency[2][0][0] == pytest.approx(6.8 + 2 * (7 * 0.6 + 5.0))
    assert t.latency[2][1][0] == pytest.approx(6.6 + 28 * 1.0 + 2 * 2.7)
    algo, proto, s = t.pick("all_reduce", 32768)
    assert (algo, proto) == ("tree", "LL")
    assert s == pytest.approx((25.2 + 32768 / (1000 * 39 * .5 * .7)) * 1e-6)


def test_a_tree_over_one_gpu_a_node_is_the_plain_tree_pattern(h100):
    """tuning.cc (v2.29.7) takes 15% off Tree's bus bandwidth when maxTreePattern is TREE, the
    pattern search.cc gives a node that holds one GPU of the communicator. Two ranks on two
    nodes: the one-GPU network graph 2 x 24 = 48, Tree all-reduce min(48 x .92, 2 x 41.4
    (perChMaxTreeBw, Hopper, 2 nodes)) x .85 x .5 = 18.768 GB/s. Eight GPUs a node keep
    BALANCED_TREE: TP16 over two nodes min(360 x .92, 16 x 41.4) x .5 = 165.6. Ranks 0-3 and 8
    of a 9-rank group (nodes of 4 and 1): the single-GPU node makes it TREE."""
    assert NcclTuner(h100, Comm(2, 2, 1)).bandwidth[2][0][2] == pytest.approx(48 * .92 * .85 * .5)
    assert NcclTuner(h100, Comm(16, 2, 8)).bandwidth[2][0][2] == pytest.approx(360 * .92 * .5)
    assert Comm(5, 2, 4, 1).tree_pattern and not Comm(16, 2, 8).tree_pattern
    assert Placement(RankGrid(tp=4, pcp=3, dcp=3), h100).comm("dcp") == Comm(3, 2, 2, 1)


def test_nvls_tree_on_blackwell_with_an_x86_host_takes_the_tree_correction():
    """v2.29.7 ncclTopoGetAlgoTime: NVLS Tree all-reduce bandwidth x treeCorrectionFactor on
    compute capability >= 100 and an x86 host. B200 (Intel host), TP16 over two nodes, 1 MiB:
    log2(2^20 >> 6) = 14, the Simple row's factor .5; NVLS Tree: 8 channels, bwIntra 80,
    bwInter min(90, 8 NICs x 48 / 8 channels) = 48: min(80 x .74 x 7/8 x 2 = 103.6, 2 x 48 (two
    nodes), perChMaxNVLSTreeBw 96 (Blackwell, 2 nodes)) = 96, x 8 x 16/30; latency 25 + 2 x 20.9."""
    b200 = compose(["mode=simulate", "hardware=b200"]).hardware
    t = NcclTuner(b200, Comm(16, 2, 8))
    bw = 8 * 96 * 16 / 30
    assert t.bandwidth[2][5][2] == pytest.approx(bw)
    assert t.time_us("all_reduce", 5, 2, 2**20) == pytest.approx(25 + 2 * 20.9 + 2**20 / (1000 * bw * .5))
    h100 = compose(["mode=simulate", "hardware=h100_sxm"]).hardware  # Hopper: no correction
    t = NcclTuner(h100, Comm(16, 2, 8))
    assert t.time_us("all_reduce", 5, 2, 2**20) == pytest.approx(t.latency[2][5][2] + 2**20 / (1000 * t.bandwidth[2][5][2]))
