"""Attention sinks (gpt-oss's: one learned softmax logit per query head that reads no value)
executed on every path. The sink joins each row's softmax once, over the row's whole context,
so a DCP shard or a ring hop must not add it to its partial: every path applies it where a
row's result is whole (``pcpflow.attention.paged.with_sinks``), the owner of the row's heads
with its own heads' sinks. A tiny GQA model with sinks (its second layer also sliding, as
gpt-oss alternates) runs the corner-case workload under each way attention crosses the ranks,
verified against one rank in float64 and, token for token, against a dense reference that
appends the sink to the scores and drops its probability (tests/reference.py, as transformers'
eager gpt-oss attention). The merge itself is held to that definition on random shards."""

from __future__ import annotations

import pytest
import shared_ranks
import torch
from exactness import assert_exact, corner_case_workload

from pcpflow.attention.paged import merge_attention_partials, paged_attention, with_sinks
from pcpflow.models.layers import gqa_spec
from pcpflow.testing import compose

SINKS = ["model=tiny_gqa", "model.sinks=true", "model.window=5", "model.window_layers=[1]"]

# (pcp, overrides): DCP over TP ranks (the owner applies its own heads' sinks after the
# reduce-scatter) first; then the all-gather path, DCP queries and context, both rings, the
# all-to-all backend and the fused kernel.
CASES = [
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "decode=sharded"]),
    (2, ["dcp=1", "tp=2"]),
    (2, ["dcp=2", "pipeline.forward.dcp_rest=context", "kv.block_size=4", "kv.interleave=2"]),
    (3, ["dcp=3", "decode=sharded", "pipeline.forward.dcp_rest=queries"]),
    (2, ["dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"]),
    (2, ["dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q", "kv.block_size=4"]),
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "dcp_comm_backend=a2a"]),
    (1, ["dcp=1", "pipeline.forward.attention=fused"]),
]
DEFAULT = 1


def _configs(cases):
    return [compose([*corner_case_workload(p), *SINKS, *extra]) for p, extra in cases]


shared_ranks.matrix("sinks/default")(lambda: _configs(CASES[:DEFAULT]))
shared_ranks.matrix("sinks/slow")(lambda: _configs(CASES[DEFAULT:]))


def _check(runs) -> None:
    assert runs
    for cfg, result in runs:
        assert cfg.model.sinks
        assert_exact(cfg, result)


@pytest.mark.matrix("sinks/default")
def test_sinks_are_exact_on_every_path(shared_runs):
    _check(shared_runs["sinks/default"])


@pytest.mark.slow
@pytest.mark.matrix("sinks/slow")
def test_sinks_are_exact_on_every_path_slow(shared_runs):
    _check(shared_runs["sinks/slow"])


def test_sinks_change_what_the_model_computes():
    """Not a no-op: the dense reference's logits with sinks differ from those without them at
    every position (a sink takes mass from every row, the first included)."""
    from reference import reference_forward

    from pcpflow.models import build_model

    def logits(*extra):
        cfg = compose(["model=tiny_gqa", *extra])
        model = build_model(cfg.model, dtype=torch.float64, seed=cfg.seed)
        return reference_forward(model, torch.arange(12) * 7 % 256)[0]

    plain, sunk = logits(), logits("model.sinks=true")
    assert bool(((sunk - plain).abs().amax(-1) > 1e-6).all())


@pytest.mark.parametrize("shards", [1, 2, 3])
def test_merged_shards_through_the_sink_are_the_softmax_with_one_more_logit(shards):
    """Partials over disjoint key shards (one of them empty for some rows), merged, then
    ``with_sinks``: equal in float64 to the definition, a softmax over the row's scores and the
    head's sink with the sink's probability dropped; rows without keys stay 0."""
    gen = torch.Generator().manual_seed(shards)
    heads, kv_heads, dim, block, ctx = 4, 2, 8, 4, 11
    spec = gqa_spec(heads, kv_heads, dim)
    cache = torch.randn(3 * block * 4, spec.entry_dim, generator=gen, dtype=torch.float64)
    q = torch.randn(ctx + 1, heads, dim, generator=gen, dtype=torch.float64)
    sinks = 2 * torch.randn(heads, generator=gen, dtype=torch.float64)
    tables = torch.tensor([[5, 2, 9]])
    lens = torch.arange(ctx + 1)  # row n sees keys 0 .. n - 1 (row 0: none)
    parts = []
    for s in range(shards):  # shard s: keys lo <= j < hi, through a row start and length
        lo, hi = ctx * s // shards, ctx * (s + 1) // shards
        parts.append(paged_attention(q, cache, spec, tables.expand(1, -1), torch.zeros_like(lens),
                                     lens.clamp(max=hi), block, torch.full_like(lens, lo)))
    out, lse = merge_attention_partials(torch.stack([o for o, _ in parts]), torch.stack([x for _, x in parts]))
    got = with_sinks(out, lse, sinks)

    slots = tables[0, torch.arange(ctx) // block] * block + torch.arange(ctx) % block
    keys = spec.keys(cache[slots]).repeat_interleave(heads // kv_heads, 1)
    values = spec.values(cache[slots]).repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("nhd,jhd->nhj", q, keys) * spec.scale
    scores = scores.masked_fill(torch.arange(ctx)[None, None, :] >= lens[:, None, None], float("-inf"))
    probs = torch.softmax(torch.cat([scores, sinks[None, :, None].expand(ctx + 1, -1, 1)], -1), -1)[..., :ctx]
    want = torch.einsum("nhj,jhd->nhd", probs, values)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-13)
    assert bool((got[0] == 0).all())
    assert with_sinks(out, lse, None) is out
