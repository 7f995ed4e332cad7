"""pcpflow.simulate.flash: FlashAttention-3's published figure (arXiv 2407.08608, Fig. 5 (c),
(d): BF16, head dim 128, H100 SXM5 at 989 TF/s), and the calls a step's attention makes.

The figure's points are the paper's numbers typed in again here; the shapes are checked
against the executed counts (``attention_work``, ``ring_attention_work``) over random batches:
the blocks' pairs must add up to what the executed run records, rank by rank."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.accounting import attention_work, ring_attention_work
from pcpflow.layouts.layout import plan_layout
from pcpflow.layouts.ring import plan_ring
from pcpflow.layouts.slots import Window
from pcpflow.simulate import flash

PROPERTY = settings(max_examples=60, deadline=None, database=None)
FIG_5C = {512: 467, 1024: 565, 2048: 625, 4096: 638, 8192: 646, 16384: 648}  # without causal mask
FIG_5D = {512: 292, 1024: 423, 2048: 521, 4096: 579, 8192: 602, 16384: 616}  # with causal mask


@pytest.mark.parametrize("causal, figure", [(False, FIG_5C), (True, FIG_5D)])
def test_share_is_the_published_figure_interpolated_and_capped(causal, figure):
    for seqlen, tflops in figure.items():
        assert flash.share(seqlen, causal=causal) == pytest.approx(tflops / 989)
    # halfway in log2 between 2K and 4K: halfway between their figures
    assert flash.share(2 ** 11.5, causal=causal) == pytest.approx((figure[2048] + figure[4096]) / 2 / 989)
    assert flash.share(10**6, causal=causal) == pytest.approx(figure[16384] / 989)  # the plateau
    # below 512 keys a query tile costs its 512-key time
    assert flash.share(128, causal=causal) == pytest.approx(figure[512] / 989 / 4)


def test_a_square_block_is_the_figures_point():
    """s rows over their own s keys, causal: the figure's causal point at s (its FLOPs count
    s^2 / 2 pairs); every row over s earlier keys: the non-causal point."""
    s = 8192
    causal = flash.Blocks(np.zeros(1, np.int64), np.array([s]), np.array([1]), np.array([s]), np.array([s * (s + 1) // 2]))
    assert causal.peak_pairs()[0] == pytest.approx(s * s / 2 / (602 / 989), rel=2e-3)
    full = flash.Blocks(np.zeros(1, np.int64), np.array([s]), np.array([s]), np.array([s]), np.array([s * s]))
    assert full.peak_pairs()[0] == pytest.approx(s * s / (646 / 989))
    # 100 rows fill 100/128 of a tile; packed 16 query heads a KV head, 1600 rows fill 12.5 tiles of 13
    few = flash.Blocks(np.zeros(1, np.int64), np.array([100]), np.array([s]), np.array([s]), np.array([100 * s]))
    assert few.peak_pairs()[0] == pytest.approx(100 * s / (646 / 989) * 128 / 100)
    assert few.peak_pairs(group=16)[0] == pytest.approx(100 * s / (646 / 989) * 13 * 128 / 1600)


@st.composite
def batches(draw):
    """Random batches as tests/layouts/test_ring.py draws them: prefills split and replicated,
    decodes replicated and sharded, cached prefixes, every interleave, P = 2..5."""
    p = draw(st.integers(2, 5))
    num = draw(st.integers(1, 6))
    q, c, pre = [], [], []
    for _ in range(num):
        is_pre = draw(st.booleans())
        c.append(draw(st.integers(0, 30)))
        q.append(draw(st.integers(1, 40)) if is_pre else draw(st.integers(1, 3)))
        pre.append(is_pre)
    return dict(q=np.array(q), c=np.array(c), pre=np.array(pre), p=p, interleave=draw(st.sampled_from([1, 2, 4])),
                shard=draw(st.booleans()), variant=draw(st.sampled_from(["pass_kv", "pass_q"])))


def _layout(case):
    q, c = case["q"], case["c"]
    layout = plan_layout(q, case["pre"], pcp_size=case["p"], dcp_size=case["p"], shard_decodes=case["shard"],
                         num_computed_tokens=c)
    positions = np.repeat(c, q) + np.arange(q.sum()) - np.repeat(np.cumsum(q) - q, q)
    return layout, positions


@PROPERTY
@given(batches())
def test_a_rings_calls_score_the_executed_rings_pairs(case):
    """Per rank, the loop's blocks (staying rows over each origin's block, visiting rows over
    each host's keys) and the rows every rank holds after it add up to ``ring_attention_work``."""
    layout, positions = _layout(case)
    p = case["p"]
    plan = plan_ring(layout, positions, variant=case["variant"], interleave=case["interleave"])
    rb = flash.ring_blocks(plan, layout, positions, case["pre"])
    loop = np.bincount(rb.loop.bin // p, weights=rb.loop.pairs, minlength=p)
    after = np.bincount(rb.after.bin, weights=rb.after.pairs, minlength=p)
    got = loop + after + rb.loop_decode_pairs.sum(axis=1) + rb.after_decode_pairs
    want = ring_attention_work(layout, positions, variant=case["variant"], interleave=case["interleave"])
    assert got.tolist() == want.tolist()
    assert (rb.loop.k_first <= rb.loop.k_last).all() and (rb.loop.pairs >= rb.loop.rows * rb.loop.k_first).all()


@PROPERTY
@given(batches(), st.sampled_from([1, 2, 3, 7, 16, 1000]))
def test_a_sliding_layers_ring_calls_score_its_pairs(case, window):
    """The same on a sliding layer: each run's rows before its window slides, then its band
    (every row over its window's keys, a block without a causal part), add up per rank to
    ``ring_attention_work`` through the window."""
    layout, positions = _layout(case)
    p = case["p"]
    plan = plan_ring(layout, positions, variant=case["variant"], interleave=case["interleave"])
    rb = flash.ring_blocks(plan, layout, positions, case["pre"], window=window)
    loop = np.bincount(rb.loop.bin // p, weights=rb.loop.pairs, minlength=p)
    after = np.bincount(rb.after.bin, weights=rb.after.pairs, minlength=p)
    got = loop + after + rb.loop_decode_pairs.sum(axis=1) + rb.after_decode_pairs
    want = ring_attention_work(layout, positions, variant=case["variant"], interleave=case["interleave"], window=window)
    assert got.tolist() == want.tolist()
    for b in (rb.loop, rb.after):  # no row loops over more than its window
        assert (b.k_first <= b.k_last).all() and (b.k_last <= window).all() and (b.pairs <= b.rows * window).all()


@PROPERTY
@given(batches(), st.sampled_from([1, 2, 3, 7, 16, 1000]))
def test_a_sliding_layers_engine_calls_score_its_prefill_pairs(case, window):
    layout, positions = _layout(case)
    p, inter = case["p"], case["interleave"]
    for dcp, mode in ((1, "queries"), (p, "context"), (p, "queries")):
        lay = plan_layout(case["q"], case["pre"], pcp_size=p, dcp_size=dcp, shard_decodes=case["shard"],
                          num_computed_tokens=case["c"])
        blocks = flash.engine_blocks(lay, positions, case["pre"], dcp_size=dcp, interleave=inter, dcp_rest=mode,
                                     window=window)
        want = attention_work(lay, positions, dcp_size=dcp, interleave=inter, dcp_rest=mode, request_mask=case["pre"],
                              window=window)
        got = np.zeros(p) if blocks is None else np.bincount(blocks.bin, weights=blocks.pairs, minlength=p)
        assert got.tolist() == want.tolist(), (dcp, mode)
        if blocks is not None:
            assert (blocks.k_first <= blocks.k_last).all() and (blocks.k_last <= window).all()
            assert (blocks.pairs <= blocks.rows * window).all()


CHUNKS = st.sampled_from([1, 2, 3, 7, 16, 1000])


def _fits_its_chunk(b, size):
    """Blocks of a chunked layer: every row over at most ``size`` keys, the first row's keys
    at most the last's, and at least ``rows x k_first`` pairs, at most ``rows x k_last``."""
    assert (b.k_first >= 0).all() and (b.k_first <= b.k_last).all() and (b.k_last <= size).all()
    assert (b.pairs >= b.rows * b.k_first).all() and (b.pairs <= b.rows * b.k_last).all()


@PROPERTY
@given(batches(), CHUNKS)
def test_a_chunked_layers_ring_calls_score_its_pairs(case, size):
    """On a chunked layer: each run cut where its chunks begin, every piece over its chunk's
    keys only, add up per rank to ``ring_attention_work`` through the chunks."""
    layout, positions = _layout(case)
    p = case["p"]
    window = Window(size, "chunked")
    plan = plan_ring(layout, positions, variant=case["variant"], interleave=case["interleave"])
    rb = flash.ring_blocks(plan, layout, positions, case["pre"], window=window)
    loop = np.bincount(rb.loop.bin // p, weights=rb.loop.pairs, minlength=p)
    after = np.bincount(rb.after.bin, weights=rb.after.pairs, minlength=p)
    got = loop + after + rb.loop_decode_pairs.sum(axis=1) + rb.after_decode_pairs
    want = ring_attention_work(layout, positions, variant=case["variant"], interleave=case["interleave"], window=window)
    assert got.tolist() == want.tolist()
    for b in (rb.loop, rb.after):
        _fits_its_chunk(b, size)


@PROPERTY
@given(batches(), CHUNKS)
def test_a_chunked_layers_engine_calls_score_its_prefill_pairs(case, size):
    layout, positions = _layout(case)
    p, inter = case["p"], case["interleave"]
    window = Window(size, "chunked")
    for dcp, mode in ((1, "queries"), (p, "context"), (p, "queries")):
        lay = plan_layout(case["q"], case["pre"], pcp_size=p, dcp_size=dcp, shard_decodes=case["shard"],
                          num_computed_tokens=case["c"])
        blocks = flash.engine_blocks(lay, positions, case["pre"], dcp_size=dcp, interleave=inter, dcp_rest=mode,
                                     window=window)
        want = attention_work(lay, positions, dcp_size=dcp, interleave=inter, dcp_rest=mode, request_mask=case["pre"],
                              window=window)
        got = np.zeros(p) if blocks is None else np.bincount(blocks.bin, weights=blocks.pairs, minlength=p)
        assert got.tolist() == want.tolist(), (dcp, mode)
        if blocks is not None:
            _fits_its_chunk(blocks, size)


def test_a_chunked_run_is_cut_where_its_chunks_begin_by_hand():
    """Ten rows at positions 0..9, chunks of 4: rows 0..3 see 0 .. themselves (1 .. 4 keys, 10
    pairs), rows 4..7 see 4 .. themselves (the same block), rows 8, 9 see 8 .. themselves (1, 2
    keys, 3 pairs): each a causal block as if its chunk were a prompt of its own. Over two
    shards (interleave 1: even positions on shard 0), every row (the queries path)."""
    from pcpflow.layouts.layout import plan_layout

    window = Window(4, "chunked")
    layout = plan_layout(np.array([10]), np.array([True]), pcp_size=1)
    b = flash.engine_blocks(layout, np.arange(10), np.array([True]), dcp_size=1, interleave=1, dcp_rest="queries",
                            window=window)
    got = sorted(zip(b.rows.tolist(), b.k_first.tolist(), b.k_last.tolist(), b.pairs.tolist()))
    assert got == sorted([(4, 1, 4, 10), (4, 1, 4, 10), (2, 1, 2, 3)])
    layout = plan_layout(np.array([10]), np.array([True]), pcp_size=2, dcp_size=2)
    b = flash.engine_blocks(layout, np.arange(10), np.array([True]), dcp_size=2, interleave=1, dcp_rest="queries",
                            window=window)
    # rank 0 holds rows 0..2 and 9, rank 1 the run 3..8: pieces 0..2 | 3 | 4..7 | 8 | 9
    got = sorted(zip(b.bin.tolist(), b.rows.tolist(), b.k_first.tolist(), b.k_last.tolist(), b.pairs.tolist()))
    # (shard, rows, keys of the first row, of the last, pairs)
    want = [
        (0, 3, 1, 2, 4), (1, 3, 0, 1, 2),  # rows 0..2 over 0..p: shard 0 holds 0, 2; shard 1 holds 1
        (0, 1, 2, 2, 2), (1, 1, 2, 2, 2),  # row 3: 0..3, two a shard
        (0, 4, 1, 2, 6), (1, 4, 0, 2, 4),  # rows 4..7 over 4..p: shard 0 holds 4, 6; shard 1 holds 5, 7
        (0, 1, 1, 1, 1), (1, 1, 0, 0, 0),  # row 8: itself (shard 0)
        (0, 1, 1, 1, 1), (1, 1, 1, 1, 1),  # row 9: 8 (shard 0), 9 (shard 1)
    ]
    assert got == sorted(want)


@PROPERTY
@given(batches())
def test_the_engines_calls_score_its_prefill_pairs(case):
    """Each rank's prefill runs over their contexts (without DCP, or on the context path), and
    every gathered prefill run over each shard (the queries path), score exactly
    ``attention_work``'s prefill pairs."""
    layout, positions = _layout(case)
    p, inter = case["p"], case["interleave"]
    for dcp, mode in ((1, "queries"), (p, "context"), (p, "queries")):
        lay = plan_layout(case["q"], case["pre"], pcp_size=p, dcp_size=dcp, shard_decodes=case["shard"],
                          num_computed_tokens=case["c"])
        blocks = flash.engine_blocks(lay, positions, case["pre"], dcp_size=dcp, interleave=inter, dcp_rest=mode)
        want = attention_work(lay, positions, dcp_size=dcp, interleave=inter, dcp_rest=mode, request_mask=case["pre"])
        got = np.zeros(p) if blocks is None else np.bincount(blocks.bin, weights=blocks.pairs, minlength=p)
        assert got.tolist() == want.tolist(), (dcp, mode)
