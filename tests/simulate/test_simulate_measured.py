"""Pricing on a measured profile (``pcpflow.simulate.measured``), on hand-made tables whose
answers are worked by hand: power laws that log-log interpolation must reproduce exactly
between grid points, attention linear in what a call moves, the roofline outside the tables,
collectives by their fit, and a whole step of a tiny model summed term by term."""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from measured_profile import (
    BASIS,
    C_E,
    C_F,
    C_H,
    COPY_RATE,
    GEMM_RATE,
    TILE_S,
    pair_cost,
    profile_dict,
)

from pcpflow.config.hardware import HardwareConfig, HeadShape
from pcpflow.simulate.measured import (
    MeasuredCollectives,
    MeasuredKernels,
    attention_coefficients,
    call_work,
    grid_work,
    head_features,
    interpolate,
)
from pcpflow.testing import compose


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "hardware.yaml"
    path.write_text(yaml.safe_dump(profile_dict()))
    return path


def test_interpolation_is_exact_on_a_power_law_between_and_clamped_outside():
    axes = [np.array([1.0, 4.0, 16.0]), np.array([2.0, 8.0])]
    values = np.array([[m * n**2 for n in axes[1]] for m in axes[0]])
    assert interpolate(axes, values, [2.0, 4.0]) == pytest.approx(2.0 * 16.0)  # off both grids
    assert interpolate(axes, values, [16.0, 8.0]) == pytest.approx(16.0 * 64.0)  # a corner
    assert interpolate(axes, values, [100.0, 1.0]) == pytest.approx(16.0 * 4.0)  # clamped to (16, 2)


def test_a_head_shape_is_priced_on_the_coefficients_fitted_to_the_basis():
    basis = [HeadShape(heads=h, kv_heads=kv, head_dim=d) for h, kv, d in BASIS]
    # Seconds of each basis shape at two grid points: 40 us fixed + the per-pair law, x pairs.
    law = [4e-5 + 1000 * pair_cost(2 * kv * d, h, 2 * h * d) for h, kv, d in BASIS]
    one = np.zeros((2, len(BASIS), 2, 5))
    one[..., 1, :] = 1.0  # each point's call: one tile that gathers one entry and scores one pair
    coef = attention_coefficients(basis, np.array([law, [2 * t for t in law]]), one)
    assert coef[0] == pytest.approx([4e-5, 1000 * C_E, 1000 * C_H, 1000 * C_F], rel=1e-6)
    assert coef[1] == pytest.approx(2 * coef[0], rel=1e-6)
    # Llama-ish GQA 12 heads / 4 KV heads of 48: entry 2*4*48, 12 heads, 12*96 products per pair.
    assert float(coef[0] @ head_features(384, 12, 1152)) == pytest.approx(
        4e-5 + 1000 * (C_E * 384 + C_H * 12 + C_F * 1152))
    # Noise never makes a coefficient negative (a price below zero): such a fit drops it.
    noisy = np.array([law]) * np.array([1.3, 0.7, 1.2, 0.8, 1.1, 0.9])
    assert (attention_coefficients(basis, noisy, one[:1]) >= 0).all()


MLA_SHAPES = [(1, 16, 8), (8, 32, 16), (2, 64, 16), (4, 128, 32), (1, 256, 32)]  # heads, kv_lora, rope
M_E, M_H, M_F = 5e-9, 2e-9, 1.1e-9  # MLA's own law: another cost per feature than GQA's


def test_mla_is_priced_on_its_own_shapes_and_on_gqa_s_in_an_older_profile():
    doc = profile_dict()
    att = doc["tables"]["attention"]
    att["basis"] += [{"kind": "mla", "heads": h, "kv_heads": 1, "head_dim": lora, "rope_dim": rope}
                     for h, lora, rope in MLA_SHAPES]
    for phase in ("prefill", "decode"):
        t = att[phase]["float32"]
        mla = [[[TILE_S * w[..., 2].sum() + M_E * (lo + ro) * w[..., 3].sum()
                 + (M_H * h + M_F * h * (2 * lo + ro)) * w[..., 4].sum() for (h, lo, ro), w in zip(MLA_SHAPES, point)]
                for point in plane] for plane in grid_work("reference", phase, t["rows"], t["keys"],
                                                          [HeadShape(kind="mla", heads=h, kv_heads=1, head_dim=lo,
                                                                     rope_dim=ro) for h, lo, ro in MLA_SHAPES], 16)]
        t["seconds"] = [[[*p, *m] for p, m in zip(plane, mplane)] for plane, mplane in zip(t["seconds"], mla)]
    hw = HardwareConfig.model_validate(doc)
    k = MeasuredKernels(hw, dtype="float32")
    # DeepSeek-like absorbed MLA, 16 heads over a 512 + 64 latent: entry 576, 16 x (576 + 512) products.
    # Two segments of 32 rows, contexts up to 1,032 and 1,064, padded to blocks of 16: 1,040 and 1,072;
    # a tile each (1,072 x (32 x 2 x 16 + 576) elements pass half of 2^20): 2,112 entries, 32 x as many pairs.
    w = head_features(576, 16, 16 * 1088)
    work = call_work("reference", np.zeros(64, dtype=np.int64), np.arange(1001, 1065), None, heads=16, entry=576,
                     block_size=16)  # one request's 64 new rows after 1,000 cached: contexts 1,001-1,064
    assert work.tolist() == [[0] * 5, [64, 64 * 1032.5, 2, 2112, 32 * 2112]]
    assert k.call(work, w, "mla") == pytest.approx(
        2 * TILE_S + M_E * 576 * 2112 + (M_H * 16 + M_F * 16 * 1088) * 32 * 2112)
    assert k.call(work, w, "gqa") == pytest.approx(
        2 * TILE_S + C_E * 576 * 2112 + (C_H * 16 + C_F * 16 * 1088) * 32 * 2112)
    older = MeasuredKernels(HardwareConfig.model_validate(profile_dict()), dtype="float32")
    assert older.call(work, w, "mla") == pytest.approx(k.call(work, w, "gqa"))


def test_a_basis_needs_four_gqa_shapes_and_an_mla_shape_one_latent():
    doc = profile_dict()
    doc["tables"]["attention"]["basis"][0] = {"kind": "mla", "heads": 2, "kv_heads": 2, "head_dim": 16}
    with pytest.raises(ValueError, match="kv_heads=1"):
        HardwareConfig.model_validate(doc)
    doc["tables"]["attention"]["basis"][:3] = [{"kind": "mla", "heads": 2, "kv_heads": 1, "head_dim": 16}] * 3
    with pytest.raises(ValueError, match="four gqa head shapes"):
        HardwareConfig.model_validate(doc)


def test_gemms_interpolate_inside_and_take_the_roofline_outside():
    hw = HardwareConfig.model_validate(profile_dict())
    k = MeasuredKernels(hw, dtype="float32")
    assert k.gemm_scalar(100, 300, 2000)[0] == pytest.approx(2 * 100 * 300 * 2000 / GEMM_RATE)
    # 8192 rows is past the table: FLOPs at the peak (1.3 s) against bytes at the copy rate.
    flops = 2 * 8192 * 4096 * 4096
    moved = (8192 * 4096 + 4096 * 4096 + 8192 * 4096) * 4
    assert k.gemm_scalar(8192, 4096, 4096)[0] == pytest.approx(max(flops / GEMM_RATE, moved / COPY_RATE))
    secs, _ = k.gemm(np.array([0, 10]), 64, 64, count=3)
    assert secs.tolist() == pytest.approx([0.0, 3 * 2 * 10 * 64 * 64 / GEMM_RATE])


def test_a_call_is_priced_by_the_segments_and_tiles_the_kernel_cuts_it_in():
    """tiny_gqa's head shape (entry 64, 4 heads, 128 products; a row alone keeps 4 x 2 + 64 = 72
    elements a key, a segment of 32 rows 320) on the profile's law (``kernel_seconds``).
    Eight requests of 32 rows after 1,000 cached: a segment each, contexts up to 1,032 padded to
    1,040; 2^20 // (1,040 x 320) = 3 segments a tile: 3 tiles, 8 x 1,040 entries, 32 times as
    many pairs. Of 31 rows: every row alone (a run shorter than a segment), 248 of them at
    1,001-1,031 keys, padded to 1,008 (8 a request), 1,024 (16) and 1,040 (7); longest first, 14
    a tile at 1,040 (4 tiles), 14 at 1,024 (9 tiles, then one that takes the last 2 of 1,024 and
    12 of 1,008, padded to 1,024), 14 at 1,008 (52 left: 4 tiles): 18 tiles, 254,016 entries.
    One row fewer a request costs 2.5 times as much. Past the table (2,048 decode rows of
    8,192 keys; 8,192 x 72 x 2 > 2^20: a tile each) the nearest point's rates."""
    hw = HardwareConfig.model_validate(profile_dict())
    k = MeasuredKernels(hw, dtype="float32")
    w = head_features(64, 4, 128)
    u = C_E * 64 + C_H * 4 + C_F * 128  # a row alone: a pair per entry gathered

    def work(rows: int, cached: int, requests: int) -> np.ndarray:
        req = np.repeat(np.arange(requests), rows)
        ctx = np.tile(np.arange(cached + 1, cached + rows + 1), requests)
        return call_work("reference", req, ctx, None, heads=4, entry=64, block_size=16)

    whole = work(32, 1000, 8)
    assert whole[1, 2:].tolist() == [3, 8 * 1040, 32 * 8 * 1040]
    assert k.call(whole, w) == pytest.approx(3 * TILE_S + C_E * 64 * 8320 + (C_H * 4 + C_F * 128) * 32 * 8320)
    alone = work(31, 1000, 8)
    assert alone[0, 2:].tolist() == [18, 254_016, 254_016] and not alone[1].any()
    assert k.call(alone, w) == pytest.approx(18 * TILE_S + 254_016 * u)
    assert k.call(alone, w) / k.call(whole, w) == pytest.approx(2.52, abs=0.01)
    decodes = work(1, 8191, 2048)
    assert decodes[0, 2:].tolist() == [2048, 2048 * 8192, 2048 * 8192]
    assert k.call(decodes, w) == pytest.approx(2048 * TILE_S + 2048 * 8192 * u)
    # A call of rows and mean keys alone (a ring's on an older path, the smallest call) is cut as
    # the profile's own call at that point: one row of one key, padded to a block of 16.
    assert k.attention_fixed(w) == pytest.approx(TILE_S + 16 * u)


def test_memory_ops_move_at_the_rate_of_a_copy_their_size():
    hw = HardwareConfig.model_validate(profile_dict())
    k = MeasuredKernels(hw, dtype="float32")
    assert float(k.memory(1e6, op_bytes=4096)) == pytest.approx(1e6 / COPY_RATE)


def test_counted_bytes_of_a_norm_and_an_mlp_by_hand():
    """float32 rows of width h: RMSNorm's pow (h in, h out), mean (h, 1), + eps (1, 1), rsqrt
    (1, 1), x * r (h + 1, h), weight * x (h + h, h): 7h + 6 per row and the weight once.
    The gated MLP beside its GEMMs: silu(gate) (I, I), * up (2I, I): 5I per row."""
    import torch

    from pcpflow.models.common import GatedMLP, RMSNorm, build_uninitialized
    from pcpflow.simulate.host import counted_bytes

    h, inter, rows = 48, 80, 7
    x = torch.empty(rows, h, device="meta")
    norm = build_uninitialized(lambda: RMSNorm(h, 1e-6), device="meta")
    mlp = build_uninitialized(lambda: GatedMLP(h, inter), device="meta")
    with torch.no_grad():
        assert counted_bytes(lambda: norm(x)) == 4 * (rows * (7 * h + 6) + h)
        assert counted_bytes(lambda: mlp(x)) == 4 * rows * 5 * inter


def test_collectives_interpolate_their_points_and_use_their_fit_outside():
    c = MeasuredCollectives(HardwareConfig.model_validate(profile_dict()).tables)
    assert c.seconds("all_gather", 2, 1000) == pytest.approx(1e-4 + 1e-6)
    assert c.seconds("all_gather", 2, 10**8) == pytest.approx(1e-4 + 0.1)  # the fit: 100 us + bytes / 1 GB/s
    assert not c.has("all_gather", 4)


def test_a_step_is_the_sum_of_its_measured_terms(profile_path, tmp_path):
    """tiny_gqa (hidden 64, 4 heads / 2 KV heads of 16, MLP 128, 2 layers, vocab 256) at pcp=1:
    one prompt of 16 tokens, then one decode; every term of each step worked by hand."""
    from pcpflow.simulate.engine import simulate_run
    from pcpflow.simulate.host import elementwise_bytes, kernels_per_layer
    from pcpflow.simulate.sizes import model_sizes

    cfg = compose(["mode=simulate", "hardware=measured", f"hardware.path={profile_path}", "dtype=float32", "pcp=1",
                   "model=tiny_gqa", "workload=explicit", "workload.prompt_lens=[16]", "workload.output_lens=[2]",
                   "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64", "output.plots=false"])
    simulate_run(cfg, tmp_path)
    steps = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    # The ops of a layer that are neither a GEMM (5 kernels: qkv, o, gate_up, down, + the split
    # k/v) nor the attention backend's: the profile's 40 per layer less those.
    attention_ops = kernels_per_layer(model_sizes(cfg.model), 1).attention
    inline_ops = 2 * (40 - 5 - attention_ops)
    u = C_E * 64 + C_H * 4 + C_F * 128  # attention seconds per pair (entry 64, 4 heads, 128 products)
    # The prompt's 16 rows each alone (a run shorter than a segment), contexts 1-16 padded to a
    # block of 16, in one tile: 256 entries and pairs; the decode's one row of 17 keys: 32.
    # The layer's other ops' bytes as pcpflow's forward moves them (counted on meta tensors,
    # test_counted_bytes_of_a_norm_and_an_mlp_by_hand); at the rate of a copy.
    row_bytes, fixed_bytes = elementwise_bytes(model_sizes(cfg.model), 1, "float32")

    def gemms(rows: int) -> float:
        per_layer = 2 * rows * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128) / GEMM_RATE
        return 2 * per_layer + 2 * 1 * 256 * 64 / GEMM_RATE  # 2 layers, the LM head on the sampled row

    def step(rows: int, gathered: int, tokens: int) -> float:
        return (gemms(rows) + 2 * (TILE_S + gathered * u) + 2 * (rows * row_bytes + fixed_bytes) / COPY_RATE
                + inline_ops * 10e-6 + (1000 + 100 * 1 + 10 * tokens) * 1e-6)

    assert steps[0]["step_s"] == pytest.approx(step(16, 16 * 16, 16), rel=1e-9)
    assert steps[1]["step_s"] == pytest.approx(step(1, 32, 1), rel=1e-9)
    assert steps[1]["purpose_s"]["host_work"] == pytest.approx((1000 + 100 + 10) * 1e-6)


def test_each_collective_waits_for_the_slowest_rank_as_the_sync_table_says(tmp_path):
    """The same pcp=2 run priced on a sync table of no wait and on one (fixed 100 us, 5% of the work).
    Each step waits ``calls x fixed + per_work x busy``: its collective calls (the prefill: two
    KV gathers and the restore, 3; a decode: the restore, 1), and its time outside them on the
    table-less run. At pcp=1 no collective runs, and nothing waits."""
    from pcpflow.simulate.engine import simulate_run

    def steps(sync: dict | None, pcp: int) -> list[dict]:
        doc = profile_dict()
        if sync:
            doc["tables"]["sync"] = sync
        name = f"{pcp}-{bool(sync)}"
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(doc))
        cfg = compose(["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / name}.yaml", "dtype=float32",
                       f"pcp={pcp}", "model=tiny_gqa", "workload=explicit", "workload.prompt_lens=[16]",
                       "workload.output_lens=[2]", "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64",
                       "output.plots=false"])
        (tmp_path / name).mkdir()
        simulate_run(cfg, tmp_path / name)
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    sync = {"work_s": [0.001, 0.004], "excess_s": [0.00015, 0.0003], "fixed_us": 100.0, "per_work": 0.05}
    plain, waiting = steps(None, 2), steps(sync, 2)
    assert [sum(r["collective_calls"].values()) for r in plain] == [3, 1]
    for a, b in zip(plain, waiting):
        calls = sum(a["collective_calls"].values())
        busy = a["step_s"] - sum(a["purpose_s"][p] for p in a["collective_calls"])
        wait = calls * 100e-6 + 0.05 * busy
        assert b["purpose_s"]["sync_wait"] == pytest.approx(wait, rel=1e-9)
        assert b["step_s"] == pytest.approx(a["step_s"] + wait, rel=1e-9)
    one = steps(sync, 1)
    assert all("sync_wait" not in r["purpose_s"] for r in one)


def test_the_sync_fit_recovers_the_law_it_was_made_from():
    from pcpflow.profile.sections import fit_sync

    work = [0.00025, 0.001, 0.004, 0.016, 0.064]
    fit = fit_sync(work, [120e-6 + 0.04 * w for w in work])
    assert fit["fixed_us"] == pytest.approx(120.0, rel=1e-6) and fit["per_work"] == pytest.approx(0.04, rel=1e-6)
    assert fit_sync(work, [0.0] * 5)["fixed_us"] == 0 and fit_sync(work, [0.0] * 5)["per_work"] == 0


U = C_E * 64 + C_H * 4 + C_F * 128  # tiny_gqa's pair (entry 64, 4 heads, 128 products), as above
FIXED = TILE_S + 16 * U  # the smallest call the profile timed: one row of one key, padded to a block of 16


def _ring_steps(tmp_path, variant: str, hop_bytes: int) -> list[dict]:
    """tiny_gqa at pcp = dcp = 2 under ``variant``, one prompt of 16 tokens and two outputs, on
    the hand-made profile with a send/recv point at ``hop_bytes`` (100 us + the bytes at 1 GB/s);
    no overlap: a CPU's transfers run on the thread that computes."""
    from pcpflow.simulate.engine import simulate_run

    doc = profile_dict()
    (sendrecv,) = [c for c in doc["tables"]["collectives"] if c["op"] == "sendrecv"]
    sendrecv["bytes"], sendrecv["seconds"] = [hop_bytes, 10**6], [1e-4 + hop_bytes / 1e9, 1e-4 + 10**6 / 1e9]
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(doc))
    cfg = compose(["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}", "dtype=float32",
                   "pcp=2", "dcp=2", f"pipeline.forward.cp_attention={variant}", "model=tiny_gqa", "workload=explicit",
                   "workload.prompt_lens=[16]", "workload.output_lens=[2]", "scheduler.max_num_batched_tokens=64",
                   "kv.num_blocks=64", "output.plots=false"])
    simulate_run(cfg, tmp_path)
    return [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]


def test_a_ring_step_is_its_calls_and_hops_on_the_tables(tmp_path):
    """Pass-KV, every call as the executed ring makes it: rows alone (runs under 32 rows), a
    travelling block read with blocks of one entry (no padding), one tile each here. DualChunkSwap
    gives rank 0 positions 0-3 and 12-15, rank 1 positions 4-11; every row stays. Rank 0: its own
    block (rows see 1-4 and 5-8 of its keys: one tile of 8 rows at 8, 64 entries), then rank 1's
    (rows 12-15 see all 8 of 4-11, rows 0-3 none: 32); rank 1: its own (1-8: 64), rank 0's (4
    each: 32). Each rank sends its block once: 8 entries of 2 KV heads x 16 x (K, V) in float32,
    2,048 B. The decode after it is a row every rank holds, over each rank's shard of 17 keys
    (positions p on rank p % 2: 9 on rank 0), paged: padded to a block of 16."""
    prefill, decode = _ring_steps(tmp_path, "ring_pass_kv", 2048)
    assert prefill["cp_attention"] == "ring_pass_kv"
    assert prefill["purpose_s"]["attention"] == pytest.approx(2 * (2 * TILE_S + (64 + 32) * U), rel=1e-9)  # 2 layers
    assert prefill["purpose_s"]["ring_send_kv"] == pytest.approx(2 * (1e-4 + 2048 / 1e9), rel=1e-9)
    assert decode["purpose_s"]["attention"] == pytest.approx(2 * (TILE_S + 16 * U), rel=1e-9)


def test_a_pass_q_ring_step_pays_each_visits_two_calls_and_its_queries_hops(tmp_path):
    """The same prompt under pass-Q: every row travels. A visiting package's queries attend the
    host's rows (host 0 at h = 0: its own 8 queries over its 8 keys, one tile at 8: 64 entries; at
    h = 1 rank 1's 4-11 over 0-3: 32; host 1: 64, then rank 0's 12-15 over 4-11: 32), each visit
    two calls: the cached shard, empty here (a call that reads no key costs the smallest the
    profile timed, ``FIXED``), and the host's new keys. A hop sends the 8 queries (8 x 4 heads x
    16 x 4 B = 2,048 B) and the new KV of the 4 rows the other rank owns (positions p on rank
    p % 2: 4 x 64 x 4 B = 1,024 B): 3,072 B; a third of it KV, two thirds queries."""
    prefill = _ring_steps(tmp_path, "ring_pass_q", 3072)[0]
    assert prefill["purpose_s"]["attention"] == pytest.approx(2 * (2 * FIXED + 2 * TILE_S + (64 + 32) * U), rel=1e-9)
    hop = 2 * (1e-4 + 3072 / 1e9)  # 2 layers
    assert prefill["purpose_s"]["ring_send_q"] == pytest.approx(hop * 2 / 3, rel=1e-9)
    assert prefill["purpose_s"]["ring_send_kv"] == pytest.approx(hop / 3, rel=1e-9)


def test_the_pools_handover_on_a_measured_profile_is_its_send_recv_table(tmp_path):
    """disagg=pd on a CPU profile (no NCCL graphs): each request's KV goes prefill rank ->
    decode rank at the send/recv table's fitted law (100 us a message, 1 GB/s). One prompt of
    16 tokens: 16 entries of 64 float32 in each of 2 layers, 8,192 B, in 2 messages (layerwise:
    one a layer): 2 x 100 us + 8,192 B / 1 GB/s, exposed or hidden behind the prefill step. It
    crashed before (NCCL's rate read the profile's missing NVLink). A profile of one rank timed no
    send/recv: the pools are refused, naming disagg.kind."""
    from pcpflow.simulate.pools import pooled_run
    from pcpflow.testing import cli

    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(profile_dict()))
    common = ["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}", "dtype=float32", "pcp=1",
              "model=tiny_gqa", "disagg=pd", "workload=explicit", "workload.prompt_lens=[16]", "workload.output_lens=[2]",
              "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64", "output.plots=false"]
    result = pooled_run(compose(common), tmp_path)
    moved = result["metrics"]["simulate"]["breakdown_s"]["kv_transfer"]
    assert moved["exposed_s"] + moved["hidden_s"] == pytest.approx(2 * 100e-6 + 8192 / 1e9, rel=1e-9)
    one = profile_dict()
    one["tables"]["collectives"] = [c for c in one["tables"]["collectives"] if c["op"] != "sendrecv"]
    (tmp_path / "one.yaml").write_text(yaml.safe_dump(one))
    r = cli(*[c if not c.startswith("hardware.path=") else f"hardware.path={tmp_path / 'one.yaml'}" for c in common],
            "output.progress=false")
    assert r.returncode == 2 and any(ln.strip().startswith("- disagg.kind: got 'pd'; the profile") and "send/recv" in ln
                                     for ln in r.stderr.splitlines()), r.stderr


def test_dcp_calls_are_priced_by_the_rows_keys_on_the_ranks_shard(tmp_path):
    """tiny_gqa at pcp = dcp = 2 (queries path), one prompt of 16 tokens, then a decode. The
    prefill's rest call on each rank: both ranks' 16 rows (rank 0's positions 0-3 and 12-15, rank
    1's 4-11: one request's run, under 32 rows: each row alone) over the rank's shard, positions
    p on rank p % 2: a row at p sees p // 2 + 1 keys on rank 0, (p + 1) // 2 on rank 1 (row 0 none,
    left out). At most 8: each padded to a block of 16, one tile: 256 entries on rank 0, 240 on
    rank 1. The decode row (17 keys, every rank holds it) over each shard: 9 and 8, padded: 16."""
    from pcpflow.simulate.engine import simulate_run

    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(profile_dict()))
    cfg = compose(["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}", "dtype=float32",
                   "pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", "decode=replicated", "model=tiny_gqa",
                   "workload=explicit", "workload.prompt_lens=[16]", "workload.output_lens=[2]",
                   "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64", "output.plots=false"])
    simulate_run(cfg, tmp_path)
    prefill, decode = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert prefill["purpose_s"]["attention"] == pytest.approx(2 * (TILE_S + 256 * U), rel=1e-9)  # 2 layers, rank 0
    assert decode["purpose_s"]["attention"] == pytest.approx(2 * (TILE_S + 16 * U), rel=1e-9)


def test_a_fused_kernels_call_is_one_tile_that_gathers_and_scores_its_pairs():
    """A fused kernel (a GPU profile) does not cut a call: its decode rows at the decode table's
    rates and its other rows at the prefill table's, one fixed part for the call (3 decode rows
    over 100-102 keys: 303 pairs; 2 prefill rows over 7-8 keys: 15; a row without context adds
    nothing)."""
    req = np.array([0, 1, 2, 3, 3, 4])
    ctx = np.array([100, 101, 102, 7, 8, 0])
    decode = np.array([True, True, True, False, False, False])
    work = call_work("fused", req, ctx, decode, heads=4, entry=64, block_size=16)
    assert work.tolist() == [[3, 303, 0, 303, 303], [2, 15, 1, 15, 15]]
    alone = call_work("fused", req[:3], ctx[:3], decode[:3], heads=4, entry=64, block_size=16)
    assert alone.tolist() == [[3, 303, 1, 303, 303], [0, 0, 0, 0, 0]]


def test_dcp_over_tp_ranks_prices_each_tp_ranks_calls_over_its_shard(tmp_path):
    """tiny_gqa with one KV head at tp = dcp = 2, pcp = 1: each TP rank holds 2 heads and the KV
    head (entry 32, 2 heads, 2 x 32 products) and attends the rows of both TP ranks' heads, one block after the
    other, over its own shard (positions p on DCP rank p % 2). The prompt's 16 rows twice: one
    request's run of 32 rows (rows without keys on rank 1 left out), one segment of 32 at up to 8
    keys, padded to 16: a tile, 16 entries, 32 x 16 pairs. The decode row twice over 9 (rank 0) or
    8 keys: two rows alone, each padded to 16: 32 entries and pairs. Both TP ranks cost alike."""
    from pcpflow.simulate.engine import simulate_run

    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(profile_dict()))
    cfg = compose(["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}", "dtype=float32",
                   "tp=2", "dcp=2", "pcp=1", "model=tiny_gqa", "model.num_kv_heads=1", "workload=explicit",
                   "workload.prompt_lens=[16]",
                   "workload.output_lens=[2]", "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64",
                   "output.plots=false"])
    simulate_run(cfg, tmp_path)
    prefill, decode = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    per_pair = C_H * 2 + C_F * 64  # a pair scored by 2 heads of 32 + 32
    assert prefill["purpose_s"]["attention"] == pytest.approx(2 * (TILE_S + C_E * 32 * 16 + per_pair * 32 * 16),
                                                              rel=1e-9)
    assert decode["purpose_s"]["attention"] == pytest.approx(2 * (TILE_S + (C_E * 32 + per_pair) * 32), rel=1e-9)
