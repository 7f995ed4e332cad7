"""Chunked layers (Llama 4's chunked attention) in a simulated run: priced by their own pairs.

A row at position p of a chunked layer sees the keys ``p - p % C .. p``. Invariants: a chunk
longer than every request is no window (the same run, figure for figure); chunks that cut
prices less attention than full layers and nothing else differs. Hand-worked: a decode's
split-KV read of ``p % C + 1`` keys per chunked layer, and a prefill cut where its chunks
begin, each piece a causal block at FlashAttention-3's published figure (typed in again
here), each kind times its layer count; the pairs counted row by row.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose

LLAMA = ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "workload=explicit"]
LAYOUTS = {
    "pcp2": ["pcp=2"],
    "ring_pass_kv": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"],
    "dcp2_queries": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries"],
    "ring_pass_q_sharded": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q"],
    "dcp_over_tp": ["tp=16", "pcp=1", "dcp=2"],
}
LONG = ["workload.prompt_lens=[24576,3000]", "workload.output_lens=[3,5]", "workload.arrival_steps=[0,1]"]
DEFAULT = {"ring_pass_kv"}
NAMES = [n if n in DEFAULT else pytest.param(n, marks=pytest.mark.slow) for n in LAYOUTS]
WINDOW = "per_rank_window_attention_work"


def _run(overrides):
    sim = SimulatedRun(compose(overrides))
    return sim.run(), sim.records


def _without(d: dict, *keys) -> dict:
    return {k: v for k, v in d.items() if k not in keys}


def _chunks(size: int, layers: int = 16, hybrid: str = "off") -> list[str]:
    """Chunked layers; their blocks kept (``kv.hybrid=off``: every figure but attention's the
    same as without chunks; ``test_simulate_hybrid_kv`` prices what giving blocks back changes)."""
    return [f"model.sliding_window={size}", f"model.sliding_layers={layers}", "model.window_kind=chunked",
            f"kv.hybrid={hybrid}"]


@pytest.mark.parametrize("layout", NAMES)
def test_a_chunk_longer_than_every_request_is_no_window(layout):
    plain, plain_steps = _run(LLAMA + LAYOUTS[layout] + LONG)
    wide, wide_steps = _run(LLAMA + LAYOUTS[layout] + LONG + _chunks(30000))
    assert _without(wide["metrics"], WINDOW, "wall_s", "clocks") == _without(plain["metrics"], "wall_s", "clocks")
    assert wide["metrics"][WINDOW] == plain["metrics"]["per_rank_attention_work"]
    for w, p in zip(wide_steps, plain_steps, strict=True):
        assert w[WINDOW] == p["per_rank_attention_work"]
        assert _without(w, WINDOW) == p


@pytest.mark.parametrize("layout", NAMES)
def test_chunks_price_less_attention_and_nothing_else(layout):
    """Chunks of 2048 on 16 of 32 layers: the same counts and GEMM and memory-op seconds every
    step, a step's chunked pairs at most its full ones, less attention in all; and less than
    a sliding window of the same size (a row sees at most, not always, 2048 keys)."""
    plain, plain_steps = _run(LLAMA + LAYOUTS[layout] + LONG)
    cut, cut_steps = _run(LLAMA + LAYOUTS[layout] + LONG + _chunks(2048))
    counted = ("per_rank_tokens", "per_rank_attention_work", "collective_calls", "collective_bytes")
    for s, p in zip(cut_steps, plain_steps, strict=True):
        assert {k: s[k] for k in counted} == {k: p[k] for k in counted}
        assert all(w <= f for w, f in zip(s[WINDOW], s["per_rank_attention_work"]))
        for term in ("gemm", "memory_ops"):
            assert s["purpose_s"][term] == p["purpose_s"][term], (s["step"], term)
        assert s["purpose_s"]["attention"] <= p["purpose_s"]["attention"]
    att = lambda r: r["metrics"]["simulate"]["breakdown_s"]["attention"]["exposed_s"]  # noqa: E731
    assert att(cut) < att(plain)
    slid = _run(LLAMA + LAYOUTS[layout] + LONG + ["model.sliding_window=2048", "model.sliding_layers=16"])[0]
    assert sum(cut["metrics"][WINDOW]) < sum(slid["metrics"][WINDOW]) and att(cut) < att(slid)


def test_a_chunked_decode_reads_its_chunk_by_hand():
    """A decode at position 20000 (pcp=1, tp=1), chunks of 8192: 20000 = 2 x 8192 + 3616, so
    it reads 3617 keys on each of the 16 chunked layers, 20001 on the 16 full ones (split-KV
    at the HBM share; Llama 3 8B bf16: 4096 bytes a key and layer; 3.35 TB/s x 0.9)."""
    _, steps = _run(LLAMA + ["pcp=1", "workload.prompt_lens=[20000]", "workload.output_lens=[2]", *_chunks(8192)])
    decode = steps[-1]
    assert decode["num_prefill_tokens"] == 0 and decode[WINDOW] == [3617]
    hbm, floor = 3.35e12 * 0.9, 2e-6
    full = max(16 * 4096 * 20001 / hbm, 16 * floor)
    chunked = max(16 * 4096 * 3617 / hbm, 16 * floor)
    assert decode["purpose_s"]["attention"] == pytest.approx(full + chunked, rel=1e-12)


FIG_5C = {512: 467, 1024: 565, 2048: 625, 4096: 638, 8192: 646, 16384: 648}  # without causal mask, TF/s
FIG_5D = {512: 292, 1024: 423, 2048: 521, 4096: 579, 8192: 602, 16384: 616}  # with causal mask


def _figure(table, keys):
    """The figure at ``keys``, linear in log2(keys) between published lengths, of 989 TF/s."""
    return float(np.interp(np.log2(keys), np.log2(list(table)), list(table.values()))) / 989


def test_a_chunked_prefill_is_cut_where_its_chunks_begin_by_hand():
    """8192 new rows at positions 1024 .. 9215 (1024 cached, pcp=1), chunks of 4096 on 16 of 32
    layers. A full layer: one block, rows seeing 1025 .. 9216 keys (8192 x 1025 pairs at the
    non-causal figure of 9216, the rest at the causal one of 8191). A chunked layer, three
    pieces: rows 1024 .. 4095 over 0 .. p (3072 x 1025 pairs non-causal at 4096 keys, 3072 x
    3071 / 2 causal at 3071), rows 4096 .. 8191 over 4096 .. p (a square: 4096 non-causal at
    4096, 4096 x 4095 / 2 causal at 4095), rows 8192 .. 9215 over 8192 .. p (1024 at 1024,
    1024 x 1023 / 2 at 1023). 4 query heads a KV head fill whole tiles; 2 x 32 x 256 FLOPs a
    pair and layer at 989.5 TF/s."""
    _, steps = _run(LLAMA + ["pcp=1", "workload.prompt_lens=[9216]", "workload.cached_lens=[1024]",
                             "workload.output_lens=[1]", "scheduler.max_num_batched_tokens=8192", *_chunks(4096)])
    prefill = steps[-1]  # NOTE: after the cached prefix's own step
    assert prefill["num_prefill_tokens"] == 8192
    assert prefill[WINDOW] == [sum(p - p // 4096 * 4096 + 1 for p in range(1024, 9216))]
    full = 8192 * 1025 / _figure(FIG_5C, 9216) + 8192 * 8191 / 2 / _figure(FIG_5D, 8191)
    chunked = (3072 * 1025 / _figure(FIG_5C, 4096) + 3072 * 3071 / 2 / _figure(FIG_5D, 3071)
               + 4096 / _figure(FIG_5C, 4096) + 4096 * 4095 / 2 / _figure(FIG_5D, 4095)
               + 1024 / _figure(FIG_5C, 1024) + 1024 * 1023 / 2 / _figure(FIG_5D, 1023))
    per_pair = 2 * 32 * 256 / 989.5e12
    assert prefill["purpose_s"]["attention"] == pytest.approx(16 * per_pair * (full + chunked), rel=1e-9)


def test_a_checkpoint_config_with_chunked_layers_gives_a_chunked_card(tmp_path, monkeypatch):
    """card_from_hf_config reads ``window_kind`` where the parsed config exposes it (the Llama 4
    family's), else the window slides; the card validates either way."""
    import json

    import pcpflow.models.hf_registry as hf
    from pcpflow.models.card import ModelCard, card_from_hf_config

    (tmp_path / "config.json").write_text(json.dumps(dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=256, intermediate_size=512,
        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=4, vocab_size=1000,
        max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=64,
        tie_word_embeddings=False)))
    sliding = card_from_hf_config(tmp_path)
    assert (sliding["sliding_window"], sliding["sliding_layers"], sliding["window_kind"]) == (64, 4, "sliding")

    read = hf.read_checkpoint_config

    class Chunked:
        def __init__(self, c):
            self._c = c

        def __getattr__(self, name):
            return "chunked" if name == "window_kind" else getattr(self._c, name)

    monkeypatch.setattr(hf, "read_checkpoint_config", lambda *a, **k: Chunked(read(*a, **k)))
    chunked = card_from_hf_config(tmp_path)
    assert chunked == {**sliding, "window_kind": "chunked"}
    card = ModelCard(**chunked)
    assert (card.window_kind, card.sliding_window, card.sliding_layers) == ("chunked", 64, 4)


@pytest.mark.parametrize("card, options", [("llama4_scout", "LLAMA4_SCOUT"), ("llama4_maverick", "LLAMA4_MAVERICK")])
def test_the_llama4_cards_are_their_config_json_s(tmp_path, card, options):
    """``model=llama4_scout`` / ``llama4_maverick`` price what ``model=hf`` reads from the released
    config.json: the same sizes, chunked layers (36 of 48, chunks of 8192) and routing (Scout's MoE
    on every layer, Maverick's on every other one)."""
    import json

    import released_configs

    from pcpflow.models.card import card_from_hf_config
    from pcpflow.simulate.sizes import model_sizes

    (tmp_path / "config.json").write_text(json.dumps(released_configs.llama4_config(**getattr(released_configs, options))))
    run = ["mode=simulate", "hardware=h200_sxm", "tp=8"]  # NOTE: neither fits one GPU in bf16
    shipped = compose([*run, f"model={card}"]).model
    read = compose([*run, "model=hf", f"model.path={tmp_path}"]).model
    assert model_sizes(read) == model_sizes(shipped)
    fields = card_from_hf_config(tmp_path)
    for name in ("sliding_window", "sliding_layers", "window_kind", "intermediate_size", "num_kv_heads", "head_dim"):
        assert getattr(shipped, name) == fields[name], name
    assert shipped.moe == read.moe
    assert (shipped.sliding_window, shipped.sliding_layers, shipped.window_kind) == (8192, 36, "chunked")
