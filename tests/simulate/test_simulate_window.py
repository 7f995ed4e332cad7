"""Sliding-window layers in a simulated run: each kind of layer priced by its own pairs.

Invariants: a window wider than every request's context is no window (the same run, figure
for figure); a window that slides prices less attention and nothing else differs (KV writes,
collectives, GEMMs and memory ops keep every entry). Hand-worked: a decode's split-KV read
of at most ``window`` keys per sliding layer, and a prefill band's FlashAttention-3 share
(the published figure, typed in again here), each kind times its layer count.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import yaml
from measured_profile import C_E, C_F, C_H, TILE_S, profile_dict

from pcpflow.simulate import flash
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose

LLAMA = ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "workload=explicit"]
LAYOUTS = {
    "pcp2": ["pcp=2"],
    "dcp2_queries": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries"],
    "dcp2_context_sharded": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context", "decode=sharded"],
    "ring_pass_kv": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"],
    "ring_pass_q_sharded": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q"],
    "dcp_over_tp": ["tp=16", "pcp=1", "dcp=2"],  # 8 KV heads over 16 ranks: DCP over TP ranks
}
LONG = ["workload.prompt_lens=[24576,3000]", "workload.output_lens=[3,5]", "workload.arrival_steps=[0,1]"]
SLOW = {"dcp2_context_sharded", "ring_pass_q_sharded", "dcp_over_tp"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in LAYOUTS]


def _run(overrides):
    sim = SimulatedRun(compose(overrides))
    return sim.run(), sim.records


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


@pytest.mark.parametrize("layout", NAMES)
def test_a_window_wider_than_every_context_is_no_window(layout):
    """Half the layers sliding through 30000 keys, no request reaching 24580: the same run,
    every step's record and price alike; the sliding layer's pairs are the full layer's. Their
    blocks kept (``kv.hybrid=off``): in groups, a block would hold half the layers."""
    plain, plain_steps = _run(LLAMA + LAYOUTS[layout] + LONG)
    wide, wide_steps = _run(LLAMA + LAYOUTS[layout] + LONG + ["model.sliding_window=30000", "model.sliding_layers=16",
                                                             "kv.hybrid=off"])
    window = "per_rank_window_attention_work"
    assert _without(wide["metrics"], window, "wall_s", "clocks") == _without(plain["metrics"], "wall_s", "clocks")
    assert wide["metrics"][window] == plain["metrics"]["per_rank_attention_work"]
    for w, p in zip(wide_steps, plain_steps, strict=True):
        assert w[window] == p["per_rank_attention_work"]
        assert _without(w, window) == p


@pytest.mark.parametrize("layout", NAMES)
def test_a_sliding_window_prices_less_attention_and_nothing_else(layout):
    """Through 2048 keys on 16 of 32 layers: every step that reaches past the window prices
    less attention; the same counts (tokens, pairs of a full layer, collectives) and the same
    GEMM and memory-op seconds every step; a step's sliding pairs are at most its full ones."""
    plain, plain_steps = _run(LLAMA + LAYOUTS[layout] + LONG)
    slid, slid_steps = _run(LLAMA + LAYOUTS[layout] + LONG + ["model.sliding_window=2048", "model.sliding_layers=16"])
    counted = ("per_rank_tokens", "per_rank_attention_work", "collective_calls", "collective_bytes")
    less = 0
    for s, p in zip(slid_steps, plain_steps, strict=True):
        assert {k: s[k] for k in counted} == {k: p[k] for k in counted}
        window, full = s["per_rank_window_attention_work"], s["per_rank_attention_work"]
        assert all(w <= f for w, f in zip(window, full))
        for term in ("gemm", "memory_ops"):
            assert s["purpose_s"][term] == p["purpose_s"][term], (s["step"], term)
        if window == full:
            assert s["purpose_s"]["attention"] == p["purpose_s"]["attention"]
        else:  # NOTE: at most as much: a decode at the kernel floor costs the floor either way
            assert s["purpose_s"]["attention"] <= p["purpose_s"]["attention"]
            less += s["purpose_s"]["attention"] < p["purpose_s"]["attention"]
    assert less >= 1  # the long prompt's prefill at least
    att = lambda r: r["metrics"]["simulate"]["breakdown_s"]["attention"]["exposed_s"]  # noqa: E731
    assert att(slid) < att(plain)
    more = _run(LLAMA + LAYOUTS[layout] + LONG + ["model.sliding_window=2048", "model.sliding_layers=32"])[0]
    assert att(more) < att(slid)  # every layer sliding: less again


def test_a_sliding_decode_reads_at_most_the_window_by_hand():
    """A decode at position 20000 (pcp=1, tp=1) reads its 20001 keys on each of the 16 full
    layers and the last 1000 on each of the 16 sliding ones: split-KV at the HBM share, each
    kind at least a kernel floor per layer. Llama 3 8B in bf16: a key is 8 KV heads x 128 x 2
    (K, V) x 2 bytes = 4096 bytes a layer; its 2 x 32 heads x 256 FLOPs stay below the bytes'
    time at 989.5 TF/s against 3.35 TB/s x 0.9."""
    _, steps = _run(LLAMA + ["pcp=1", "workload.prompt_lens=[20000]", "workload.output_lens=[2]",
                             "model.sliding_window=1000", "model.sliding_layers=16"])
    decode = steps[-1]
    assert decode["num_prefill_tokens"] == 0 and decode["per_rank_window_attention_work"] == [1000]
    hbm, floor = 3.35e12 * 0.9, 2e-6
    full = max(16 * 4096 * 20001 / hbm, 16 * floor)
    sliding = max(16 * 4096 * 1000 / hbm, 16 * floor)
    assert decode["purpose_s"]["attention"] == pytest.approx(full + sliding, rel=1e-12)


FIG_5C = {512: 467, 1024: 565, 2048: 625, 4096: 638, 8192: 646, 16384: 648}  # without causal mask, TF/s
FIG_5D = {512: 292, 1024: 423, 2048: 521, 4096: 579, 8192: 602, 16384: 616}  # with causal mask


def _figure(table, keys):
    """The figure at ``keys``, linear in log2(keys) between published lengths, of 989 TF/s."""
    return float(np.interp(np.log2(keys), np.log2(list(table)), list(table.values()))) / 989


def test_a_sliding_prefill_band_is_priced_at_its_windows_length_by_hand():
    """8192 new rows after 1024 cached (pcp=1), window 1024 on 16 of 32 layers. A full layer:
    one block, rows seeing 1025 .. 9216 keys: 8192 x 1025 pairs at the non-causal figure of
    9216 keys, the rest (8192 x 8191 / 2) at the causal figure of 8191. A sliding layer: every
    row past its window's start, 1024 keys each: 8192 x 1024 pairs at the non-causal figure of
    1024. 4 query heads a KV head pack 32768 rows, 256 whole tiles. FLOPs a pair and layer:
    2 x 32 heads x 256; at 989.5 TF/s."""
    _, steps = _run(LLAMA + ["pcp=1", "workload.prompt_lens=[9216]", "workload.cached_lens=[1024]",
                             "workload.output_lens=[1]", "scheduler.max_num_batched_tokens=8192",
                             "model.sliding_window=1024", "model.sliding_layers=16"])
    prefill = steps[-1]  # NOTE: after the cached prefix's own step
    assert prefill["num_prefill_tokens"] == 8192 and prefill["per_rank_window_attention_work"] == [8192 * 1024]
    full = 8192 * 1025 / _figure(FIG_5C, 9216) + 8192 * 8191 / 2 / _figure(FIG_5D, 8191)
    sliding = 8192 * 1024 / _figure(FIG_5C, 1024)
    per_pair = 2 * 32 * 256 / 989.5e12
    assert prefill["purpose_s"]["attention"] == pytest.approx(16 * per_pair * (full + sliding), rel=1e-9)


def test_a_sliding_run_is_cut_where_its_window_starts_to_slide_by_hand():
    """Ten rows at positions 0..9, window 4: rows 0..3 see every key before them (a causal
    block: 1 .. 4 keys, 10 pairs), rows 4..9 the last 4 each (a band: 24 pairs, no causal
    part). At pcp=2 over two shards (interleave 1: even positions on shard 0): rank 0 holds
    0..2 and 9, rank 1 the run 3..8; every run over each shard (the queries path)."""
    from pcpflow.layouts.layout import plan_layout

    layout = plan_layout(np.array([10]), np.array([True]), pcp_size=1)
    b = flash.engine_blocks(layout, np.arange(10), np.array([True]), dcp_size=1, interleave=1, dcp_rest="queries",
                            window=4)
    assert [b.rows.tolist(), b.k_first.tolist(), b.k_last.tolist(), b.pairs.tolist()] == [[4, 6], [1, 4], [4, 4], [10, 24]]
    layout = plan_layout(np.array([10]), np.array([True]), pcp_size=2, dcp_size=2)
    b = flash.engine_blocks(layout, np.arange(10), np.array([True]), dcp_size=2, interleave=1, dcp_rest="queries",
                            window=4)
    got = sorted(zip(b.bin.tolist(), b.rows.tolist(), b.k_first.tolist(), b.k_last.tolist(), b.pairs.tolist()))
    # (shard, rows, keys of the first row, of the last, pairs)
    want = [
        (0, 3, 1, 2, 4), (1, 3, 0, 1, 2),  # rows 0..2 (causal): shard 0 holds 0, 2; shard 1 holds 1
        (0, 1, 2, 2, 2), (1, 1, 2, 2, 2),  # row 3, the last before the window slides: 0..3, two a shard
        (0, 5, 2, 2, 10), (1, 5, 2, 2, 10),  # rows 4..8: [p - 3, p], two a shard
        (0, 1, 2, 2, 2), (1, 1, 2, 2, 2),  # row 9: 6..9
    ]
    assert got == sorted(want)


@pytest.mark.parametrize("window", [["model.window=5"], ["model.window=32", "model.window_kind=chunked"]])
def test_a_measured_profile_prices_a_windowed_layer_by_the_blocks_its_kernel_reads(tmp_path, window):
    """pcpflow's reference kernel reads a windowed row's blocks from its window's first one on:
    a measured profile prices tiny_gqa's windowed layer (1 of 2) by those calls, the full layer
    by its own. One prompt of 40 (pcp=1, blocks of 16; a run of 32 rows or more goes in
    segments of 32: rows 0-31 and 32-39), then two decodes; the profile's law is
    ``TILE_S`` a tile, ``E = C_E x 64`` an entry gathered, ``S = C_H x 4 + C_F x 128`` a pair
    scored (a segment scores 32 rows a key). Full layer: the segments reach 32 and 40 keys (2
    and 3 blocks), one tile at 3 blocks: 96 entries, 32 x 96 pairs; the decodes at 41 and 42
    keys read 3 blocks: 48. Windowed layer (sliding through 5: rows 32-39 from keys 28-35, so
    from block 1; chunks of 32: from key 32, block 2): the first segment from block 0 (2
    blocks), the second 2 (sliding) or 1 (chunked) blocks, one tile at 2 blocks: 64 entries;
    each decode from block 2 (sliding: keys 36 and 37 on; chunked: 32 on): 16. Everything else
    is the run without a window."""
    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(profile_dict()))
    common = ["mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}", "dtype=float32", "pcp=1",
              "model=tiny_gqa", "workload=explicit", "workload.prompt_lens=[40]", "workload.output_lens=[3]",
              "scheduler.max_num_batched_tokens=64", "kv.num_blocks=64", "output.plots=false"]
    plain, plain_steps = _run(common)
    slid, slid_steps = _run(common + window + ["model.window_layers=[1]"])
    e, s = C_E * 64, C_H * 4 + C_F * 128
    prefill_full, prefill_window = TILE_S + 96 * e + 32 * 96 * s, TILE_S + 64 * e + 32 * 64 * s
    decode_full, decode_window = TILE_S + 48 * (e + s), TILE_S + 16 * (e + s)
    assert [st["num_prefill_tokens"] for st in slid_steps] == [40, 0, 0]
    want = [prefill_full + prefill_window] + [decode_full + decode_window] * 2
    for st, p, w in zip(slid_steps, plain_steps, want, strict=True):
        assert st["purpose_s"]["attention"] == pytest.approx(w, rel=1e-9)
        assert _without(st["purpose_s"], "attention") == _without(p["purpose_s"], "attention")
    assert [p["purpose_s"]["attention"] for p in plain_steps] == pytest.approx(
        [2 * prefill_full, 2 * decode_full, 2 * decode_full], rel=1e-9)
    json.dumps(slid["metrics"])  # the window's field is plain JSON


@pytest.mark.parametrize("fields, says", [
    (["model.sliding_window=4096"], "go together"),  # a window without the layers it slides on
    (["model.sliding_layers=4"], "go together"),  # sliding layers without their window
    (["model.sliding_window=4096", "model.sliding_layers=33"], "exceeds num_layers (32)"),
])
def test_a_cards_window_and_its_layers_go_together(fields, says):
    from pcpflow.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        compose(LLAMA + ["workload.prompt_lens=[10]", "workload.output_lens=[1]"] + fields)
    assert any(says in str(p) for p in exc.value.problems), exc.value.problems
