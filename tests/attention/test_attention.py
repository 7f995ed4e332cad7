"""paged_attention and merge_attention_partials against a naive float64 softmax written
row by row in numpy over explicitly gathered contexts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pcpflow.attention import paged as attention
from pcpflow.attention.paged import (
    accumulation_dtype,
    merge_attention_partials,
    merge_packed_partials,
    pack_partials,
    paged_attention,
    unpack_partials,
)
from pcpflow.layouts.accounting import ModelShape
from pcpflow.models.base import AttentionSpec

torch.set_num_threads(2)

# float64 through torch's kernels against numpy's row-by-row softmax. NOTE: the project's CI
# once saw one tile of torch's result 1.8e-9 from numpy's (relative 9e-7, in a decode row of
# context 12; not reproduced here on any CPU capability). A wrong mask, gather, block or
# merge moves these outputs by more than 1e-4, so 1e-8 still catches every one of them.
TORCH_VS_NUMPY = dict(rtol=0, atol=1e-8)

SPECS = {
    # 4 query heads on 2 kv heads; entry = [K | V]
    "gqa": AttentionSpec(
        num_heads=4, num_kv_heads=2, qk_dim=8, v_dim=8, v_offset=16, entry_dim=32, scale=0.3
    ),
    # MLA: one kv head, values = the first v_dim of the key (the latent)
    "mla": AttentionSpec(
        num_heads=4, num_kv_heads=1, qk_dim=12, v_dim=8, v_offset=0, entry_dim=12, scale=0.25
    ),
    # MHA with v_dim != qk_dim and trailing unused columns in the entry
    "mha": AttentionSpec(
        num_heads=3, num_kv_heads=3, qk_dim=6, v_dim=5, v_offset=18, entry_dim=36, scale=0.4
    ),
}


def naive_attention(q, cache, spec, block_tables, req, ctx, block_size, starts=None):
    """Row by row: gather the context slot by slot (keys ``starts[i] .. ctx[i] - 1``),
    softmax in float64 (numpy)."""
    q, cache = q.double().numpy(), cache.double().numpy()
    n, h = q.shape[:2]
    group = spec.num_heads // spec.num_kv_heads
    out = np.zeros((n, h, spec.v_dim))
    lse = np.full((n, h), -np.inf)
    for i in range(n):
        r, c = int(req[i]), int(ctx[i])
        first = 0 if starts is None else int(starts[i])
        if c <= first:
            continue
        slots = [
            int(block_tables[r, j // block_size]) * block_size + j % block_size for j in range(first, c)
        ]
        entries = cache[slots]
        for head in range(h):
            kvh = head // group
            k = entries[:, kvh * spec.qk_dim : (kvh + 1) * spec.qk_dim]
            v0 = spec.v_offset + kvh * spec.v_dim
            v = entries[:, v0 : v0 + spec.v_dim]
            s = spec.scale * (k @ q[i, head])
            mx = s.max()
            w = np.exp(s - mx)
            out[i, head] = w @ v / w.sum()
            lse[i, head] = mx + np.log(w.sum())
    return out, lse


def random_case(rng, spec, block_size, *, num_reqs=4, max_len=90):
    """Requests with random lengths in shuffled, non-contiguous blocks (unused entries -1),
    query rows that mix long prefill runs, decodes, shuffled rows and context-0 rows."""
    lens = rng.integers(0, max_len, size=num_reqs)
    lens[0] = max_len  # one request long enough for a run of >= _SEGMENT_ROWS rows
    blocks_per_req = -(-lens // block_size)
    max_blocks = int(blocks_per_req.max()) + 1
    num_blocks = int(blocks_per_req.sum()) + 3
    perm = rng.permutation(num_blocks)
    block_tables = np.full((num_reqs, max_blocks), -1)
    used = 0
    for r in range(num_reqs):
        block_tables[r, : blocks_per_req[r]] = perm[used : used + blocks_per_req[r]]
        used += blocks_per_req[r]
    req, ctx = [], []
    # a prefill of request 0 (consecutive rows, causal contexts), then decodes of the others
    start = int(rng.integers(0, 10))
    for p in range(start, lens[0]):
        req.append(0), ctx.append(p + 1)
    for r in range(1, num_reqs):
        req.append(r), ctx.append(int(lens[r]))
    # random rows anywhere, some with context 0 (padding-like)
    for _ in range(20):
        r = int(rng.integers(0, num_reqs))
        req.append(r), ctx.append(int(rng.integers(0, lens[r] + 1)))
    req.extend([0] * 3), ctx.extend([0] * 3)
    n = len(req)
    order = np.arange(n)
    tail = order[lens[0] - start :]
    order[lens[0] - start :] = rng.permutation(tail)  # shuffle only the non-prefill rows
    req, ctx = np.array(req)[order], np.array(ctx)[order]
    cache = torch.from_numpy(rng.standard_normal((num_blocks * block_size, spec.entry_dim)))
    q = torch.from_numpy(rng.standard_normal((n, spec.num_heads, spec.qk_dim)))
    return q, cache, torch.from_numpy(block_tables), torch.from_numpy(req), torch.from_numpy(ctx)


@pytest.mark.parametrize("spec_name", sorted(SPECS))
@pytest.mark.parametrize("block_size", [1, 3, 16])
@pytest.mark.parametrize("tile_elements", [None, 97])
def test_paged_attention_matches_naive(spec_name, block_size, tile_elements, monkeypatch):
    if tile_elements is not None:  # many tiny tiles: every tile boundary path
        monkeypatch.setattr(attention, "_TILE_ELEMENTS", tile_elements)
    spec = SPECS[spec_name]
    rng = np.random.default_rng([block_size, len(spec_name)])
    q, cache, bt, req, ctx = random_case(rng, spec, block_size)
    out, lse = paged_attention(q, cache, spec, bt, req, ctx, block_size)
    ref_out, ref_lse = naive_attention(q, cache, spec, bt, req, ctx, block_size)
    assert out.shape == (q.shape[0], spec.num_heads, spec.v_dim) and out.dtype == torch.float64
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    np.testing.assert_allclose(out.numpy(), ref_out, **TORCH_VS_NUMPY)
    np.testing.assert_allclose(lse.numpy(), ref_lse, **TORCH_VS_NUMPY)
    empty = (ctx == 0).numpy()
    assert empty.any()
    assert (out[empty] == 0).all() and (lse[empty] == float("-inf")).all()


def window_first_keys(ctx, window: int, kind: str):
    """Each row's first key by hand: the last ``window`` keys (sliding), or the keys of the
    row's own chunk of ``window`` positions (chunked: a row at ``ctx - 1`` starts at the
    chunk's first position); 0 for rows without context."""
    ctx = np.asarray(ctx)
    first = np.maximum(ctx - window, 0) if kind == "sliding" else (np.maximum(ctx - 1, 0) // window) * window
    return torch.from_numpy(np.where(ctx > 0, first, 0))


@pytest.mark.parametrize("spec_name", ["gqa", "mla"])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("window", [1, 7, 40])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_a_window_attends_from_each_rows_start(spec_name, block_size, window, kind):
    """Each row reads keys ``starts .. ctx - 1``: a sliding window's (``ctx - window``, at
    least 0) or its chunk's, and rows whose start reaches their context (a DCP shard without a
    key in the window) give 0 and -inf."""
    spec = SPECS[spec_name]
    rng = np.random.default_rng([block_size, window, len(kind)])
    q, cache, bt, req, ctx = random_case(rng, spec, block_size)
    starts = window_first_keys(ctx, window, kind)
    starts[::9] = ctx[::9]  # no key left from the start on
    out, lse = paged_attention(q, cache, spec, bt, req, ctx, block_size, starts)
    ref_out, ref_lse = naive_attention(q, cache, spec, bt, req, ctx, block_size, starts)
    np.testing.assert_allclose(out.numpy(), ref_out, **TORCH_VS_NUMPY)
    np.testing.assert_allclose(lse.numpy(), ref_lse, **TORCH_VS_NUMPY)
    none = (starts >= ctx).numpy()
    assert none.any() and (out[none] == 0).all() and (lse[none] == float("-inf")).all()
    if window < 40:  # the window changes the rows it cuts (not a no-op)
        full, _ = paged_attention(q, cache, spec, bt, req, ctx, block_size)
        cut = ((starts > 0) & (starts < ctx)).numpy()
        assert cut.any() and not torch.allclose(out[cut], full[cut])


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_keys_before_a_window_never_leak_into_the_output(block_size):
    """Slots before every row's window (a freed or stale block's, NaN here) are read with the
    first block a segment needs: the result is attention over the window's keys alone (a
    prefill run of 40 rows through a window of 9, a decode and short rows of another
    request), against a dense float64 softmax over exactly those keys."""
    spec = SPECS["gqa"]
    rng = np.random.default_rng(block_size)
    length, window = 120, 9
    width = -(-length // block_size)
    bt = torch.from_numpy(rng.permutation(2 * width).reshape(2, width))
    cache = torch.from_numpy(rng.standard_normal((2 * width * block_size, spec.entry_dim)))
    req = torch.tensor([0] * 40 + [1] * 3)
    ctx = torch.tensor(list(range(61, 101)) + [120, 50, 51])
    starts = torch.clamp(ctx - window, min=0)
    for r, first in ((0, 61 - window), (1, 50 - window)):  # every slot before the window: NaN
        slots = bt[r, torch.arange(first) // block_size] * block_size + torch.arange(first) % block_size
        cache[slots] = float("nan")
    q = torch.from_numpy(rng.standard_normal((len(req), spec.num_heads, spec.qk_dim)))
    out, lse = paged_attention(q, cache, spec, bt, req, ctx, block_size, starts)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    for n in range(len(req)):
        keys = torch.arange(int(starts[n]), int(ctx[n]))
        entries = cache[bt[req[n], keys // block_size] * block_size + keys % block_size]
        k = spec.keys(entries).repeat_interleave(2, dim=1)  # [K, H, D]
        v = spec.values(entries).repeat_interleave(2, dim=1)
        scores = torch.einsum("hd,khd->hk", q[n], k) * spec.scale
        torch.testing.assert_close(out[n], torch.einsum("hk,khd->hd", scores.softmax(-1), v), rtol=0, atol=1e-12)
        torch.testing.assert_close(lse[n], torch.logsumexp(scores, -1), rtol=0, atol=1e-12)


def test_paged_attention_float32():
    spec = SPECS["gqa"]
    rng = np.random.default_rng(7)
    q, cache, bt, req, ctx = random_case(rng, spec, 5)
    out, lse = paged_attention(q.float(), cache.float(), spec, bt, req, ctx, 5)
    ref_out, ref_lse = naive_attention(q, cache, spec, bt, req, ctx, 5)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    np.testing.assert_allclose(out.numpy(), ref_out, atol=2e-5)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-5, atol=2e-5)


def test_paged_attention_no_context_and_no_rows():
    spec = SPECS["mla"]
    q = torch.randn(5, spec.num_heads, spec.qk_dim, dtype=torch.float64)
    cache = torch.full((8, spec.entry_dim), float("nan"), dtype=torch.float64)  # never read
    bt = torch.tensor([[0, 1]])
    out, lse = paged_attention(
        q, cache, spec, bt, torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long), 4
    )
    assert (out == 0).all() and (lse == float("-inf")).all()
    out, lse = paged_attention(
        q[:0],
        cache,
        spec,
        bt,
        torch.zeros(0, dtype=torch.long),
        torch.zeros(0, dtype=torch.long),
        4,
    )
    assert out.shape == (0, spec.num_heads, spec.v_dim) and lse.shape == (0, spec.num_heads)


@pytest.mark.parametrize("spec_name", ["gqa", "mla"])
def test_long_runs_with_context_zero_rows(spec_name):
    """Long runs whose first rows (a segment's head) have no context, next to runs of
    other requests and trailing padding rows of request 0."""
    spec = SPECS[spec_name]
    rng = np.random.default_rng(5)
    block_size, max_blocks = 4, 30
    bt = torch.from_numpy(rng.permutation(3 * max_blocks).reshape(3, max_blocks))
    cache = torch.from_numpy(rng.standard_normal((3 * max_blocks * block_size, spec.entry_dim)))
    req = [0] + [2] * 70 + [1] * 40 + [0] * 40
    ctx = [50] + [0] * 33 + list(range(1, 38)) + [0, 0] + list(range(80, 118)) + [0] * 40
    req, ctx = torch.tensor(req), torch.tensor(ctx)
    q = torch.from_numpy(rng.standard_normal((len(req), spec.num_heads, spec.qk_dim)))
    out, lse = paged_attention(q, cache, spec, bt, req, ctx, block_size)
    ref_out, ref_lse = naive_attention(q, cache, spec, bt, req, ctx, block_size)
    np.testing.assert_allclose(out.numpy(), ref_out, **TORCH_VS_NUMPY)
    np.testing.assert_allclose(lse.numpy(), ref_lse, **TORCH_VS_NUMPY)


def test_causal_prefill_equals_dense_softmax():
    """One request in identity blocks with contexts position+1 is plain causal attention."""
    spec = SPECS["gqa"]
    rng = np.random.default_rng(3)
    n, block_size = 70, 8
    cache = torch.from_numpy(rng.standard_normal((80, spec.entry_dim)))
    q = torch.from_numpy(rng.standard_normal((n, spec.num_heads, spec.qk_dim)))
    bt = torch.arange(10)[None]
    out, _ = paged_attention(
        q, cache, spec, bt, torch.zeros(n, dtype=torch.long), torch.arange(n) + 1, block_size
    )
    k = spec.keys(cache[:n]).repeat_interleave(2, dim=1)  # [n, H, D]
    v = spec.values(cache[:n]).repeat_interleave(2, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * spec.scale
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    ref = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)


def test_dcp_shards_merge_to_full_attention():
    """Keys of one request dealt to D ranks by (p // I) % D, each rank attending over its
    own dense shard, merge to attention over the whole context."""
    spec = SPECS["mla"]
    rng = np.random.default_rng(11)
    d, interleave, block_size, length = 3, 2, 4, 50
    entries = torch.from_numpy(rng.standard_normal((length, spec.entry_dim)))
    q = torch.from_numpy(rng.standard_normal((length, spec.num_heads, spec.qk_dim)))
    req = torch.zeros(length, dtype=torch.long)
    bt_full = torch.arange(-(-length // block_size))[None]
    full_cache = torch.cat(
        [entries, entries.new_zeros(bt_full.numel() * block_size - length, spec.entry_dim)]
    )
    ref_out, ref_lse = paged_attention(
        q, full_cache, spec, bt_full, req, torch.arange(length) + 1, block_size
    )
    owner = (torch.arange(length) // interleave) % d
    outs, lses = [], []
    for rank in range(d):
        mine = entries[owner == rank]
        cache = torch.cat(
            [mine, mine.new_zeros(bt_full.numel() * block_size - len(mine), spec.entry_dim)]
        )
        local_ctx = torch.cumsum((owner == rank).long(), 0)  # keys <= position on this rank
        o, s = paged_attention(q, cache, spec, bt_full, req, local_ctx, block_size)
        outs.append(o), lses.append(s)
    out, lse = merge_attention_partials(torch.stack(outs), torch.stack(lses))
    torch.testing.assert_close(out, ref_out, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-13, atol=1e-12)


def softmax_over(scores, values):
    """numpy: attention of scores [N, H, K] over values [N, H, K, Dv]; empty K -> 0, -inf."""
    n, h, k = scores.shape
    if k == 0:
        return np.zeros((n, h, values.shape[-1])), np.full((n, h), -np.inf)
    mx = scores.max(-1, keepdims=True)
    w = np.exp(scores - mx)
    out = np.einsum("nhk,nhkd->nhd", w, values) / w.sum(-1)[..., None]
    return out, mx[..., 0] + np.log(w.sum(-1))


@pytest.mark.parametrize("magnitude", [1.0, 1e3, 1e4])
@pytest.mark.parametrize("seed", range(3))
def test_merge_matches_softmax_over_all_keys(magnitude, seed):
    rng = np.random.default_rng(seed)
    n, h, k, dv, p = 6, 3, 40, 5, 4
    scores = rng.standard_normal((n, h, k)) * magnitude
    values = rng.standard_normal((n, h, k, dv))
    shard = rng.integers(0, p - 1, size=k)  # shard p - 1 stays empty
    parts = [softmax_over(scores[..., shard == i], values[..., shard == i, :]) for i in range(p)]
    outs = torch.from_numpy(np.stack([o for o, _ in parts]))
    lses = torch.from_numpy(np.stack([s for _, s in parts]))
    out, lse = merge_attention_partials(outs, lses)
    ref_out, ref_lse = softmax_over(scores, values)
    assert np.isinf(lses[-1].numpy()).all()
    np.testing.assert_allclose(out.numpy(), ref_out, rtol=0, atol=1e-12)
    np.testing.assert_allclose(lse.numpy(), ref_lse, rtol=1e-14, atol=1e-12)


def test_merge_empty_shards_never_nan():
    outs = torch.randn(3, 4, 2, 5, dtype=torch.float64)
    lses = torch.randn(3, 4, 2, dtype=torch.float64) * 1e4
    lses[:, 0] = float("-inf")  # row 0: no shard has keys
    lses[1, 1:] = float("-inf")  # shard 1 empty elsewhere, with garbage outputs
    outs[1, 1:] = float("nan")
    out, lse = merge_attention_partials(outs, lses)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
    keep = [0, 2]
    ref_out, ref_lse = merge_attention_partials(outs[keep, 1:], lses[keep, 1:])
    torch.testing.assert_close(out[1:], ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse[1:], ref_lse, rtol=0, atol=0)
    # a single shard passes through unchanged
    out1, lse1 = merge_attention_partials(outs[:1, 1:], lses[:1, 1:])
    torch.testing.assert_close(out1, outs[0, 1:], rtol=0, atol=1e-15)
    torch.testing.assert_close(lse1, lses[0, 1:], rtol=0, atol=0)


def test_unwritten_slots_never_leak_into_the_output():
    """Slots past a row's context may hold anything (NaN in a fresh cache, stale KV of a
    finished request): the result must equal attention over the written entries alone."""
    spec = AttentionSpec(num_heads=2, num_kv_heads=1, qk_dim=4, v_dim=4, v_offset=0, entry_dim=4, scale=0.5)
    block_size = 4
    gen = torch.Generator().manual_seed(0)
    cache = torch.full((8 * block_size, 4), float("nan"), dtype=torch.float64)
    cache[:3] = torch.randn(3, 4, generator=gen, dtype=torch.float64)
    cache[3] = 1e300  # stale garbage in the same block, past the context
    q = torch.randn(1, 2, 4, generator=gen, dtype=torch.float64)
    out, lse = paged_attention(
        q, cache, spec, torch.tensor([[0, 1]]), torch.tensor([0]), torch.tensor([3]), block_size
    )
    keys = cache[:3]
    scores = (q[0] @ keys.T) * spec.scale
    torch.testing.assert_close(out[0], torch.softmax(scores, -1) @ keys, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse[0], torch.logsumexp(scores, -1), rtol=0, atol=1e-12)


def test_bf16_accumulates_in_float32():
    """bf16 inputs score, softmax and sum in float32: the result equals float32 attention
    over the same (bf16-rounded) numbers, rounded once to bf16; lse stays float32."""
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, qk_dim=8, v_dim=8, v_offset=16, entry_dim=32, scale=0.35)
    gen = torch.Generator().manual_seed(1)
    block_size, ctx = 4, 37
    cache = torch.randn(12 * block_size, 32, generator=gen).to(torch.bfloat16)
    q = torch.randn(3, 4, 8, generator=gen).to(torch.bfloat16)
    tables = torch.arange(12)[None].repeat(3, 1)
    args = (tables, torch.zeros(3, dtype=torch.long), torch.tensor([ctx, 1, 20]), block_size)
    out, lse = paged_attention(q, cache, spec, *args)
    ref_out, ref_lse = paged_attention(q.float(), cache.float(), spec, *args)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(out, ref_out.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)


@pytest.mark.parametrize("dtype, lse_slots", [(torch.bfloat16, 2), (torch.float32, 1), (torch.float64, 1)])
def test_packed_partials_carry_outputs_and_lse_bit_for_bit(dtype, lse_slots):
    """Partials travel in the activation dtype: outputs as they are, each log-sum-exp (float32
    for bf16) bit for bit in ``k`` slots beside them, -inf (an empty shard) included; the
    width is what the accounting counts, and merging the packed partials is merging the
    unpacked ones."""
    gen = torch.Generator().manual_seed(3)
    h, dv, rows, parts = 3, 4, 5, 2
    acc = accumulation_dtype(dtype)
    outs = torch.randn(parts, rows, h, dv, generator=gen).to(dtype)
    lses = (torch.randn(parts, rows, h, generator=gen) * 40).to(acc)
    lses[0, 1] = float("-inf")
    lses[1, 1, 0] = float("-inf")  # row 1, head 0: no key on either shard
    lses[1, 2] = 1.0e30
    packed = torch.stack([pack_partials(o, lse, dtype) for o, lse in zip(outs, lses)])
    assert packed.dtype == dtype and packed.shape == (parts, rows, h * dv + h * lse_slots)
    shape = ModelShape(hidden_size=0, num_layers=1, entry_dim=1, num_heads=h, qk_dim=dv, v_dim=dv,
                       dtype_bytes=torch.finfo(dtype).bits // 8)
    assert packed.shape[-1] == shape.partials_width
    got_o, got_lse = unpack_partials(packed, h, dv)
    assert got_lse.dtype == acc and torch.equal(got_o, outs)
    assert torch.equal(got_lse.view(torch.int32 if acc == torch.float32 else torch.int64),
                       lses.view(torch.int32 if acc == torch.float32 else torch.int64))
    want, _ = merge_attention_partials(outs, lses)
    assert torch.equal(merge_packed_partials(packed, h, dv), want)
    assert torch.equal(want[1, 0], torch.zeros(dv, dtype=want.dtype))


@pytest.mark.parametrize("spec_name", ["gqa", "mla"])
def test_kernel_work_counts_the_tiles_the_kernel_runs(spec_name, monkeypatch):
    """``kernel_work`` (numpy, no tensors: what a measured profile prices a call by) against the
    tiles ``paged_attention`` itself runs, recorded as they go: random rows of a few requests
    (runs shorter and longer than a segment, rows without context, block sizes 1-16, contexts
    short and long enough for tiles of one segment), with no window, a sliding one and a
    chunked one (some rows without a key from their start on), per group the tiles, the
    entries they gather and the pairs they score; the rows with a key and their pairs (the
    keys from start to context) by brute force."""
    spec = SPECS[spec_name]
    seen = []
    tiles = attention._tiles

    def spy(seg_blocks, per_key, block_size, max_blocks):
        for first, stop, blocks in tiles(seg_blocks, per_key, block_size, max_blocks):
            seen.append((per_key, stop - first, blocks * block_size))
            yield first, stop, blocks

    rng = np.random.default_rng(7)
    for trial in range(90):
        block_size = int(rng.choice([1, 4, 16]))
        lens = rng.integers(1, 16_000 if trial % 3 == 0 else 300, size=int(rng.integers(1, 5)))
        req, ctx = [], []
        for _ in range(int(rng.integers(1, 7))):
            r, q = int(rng.integers(lens.size)), int(rng.integers(1, 80))
            first = int(rng.integers(-3, lens[r]))  # below 0: rows without context
            req += [r] * q
            ctx += np.clip(np.arange(first, first + q), 0, lens[r]).tolist()
        starts = None
        if trial % 3:
            starts = window_first_keys(ctx, int(rng.integers(1, 3000)), ("sliding", "chunked")[trial % 2 - 1])
            starts[:: int(rng.integers(5, 40))] += int(rng.integers(0, 50))  # some past their context
        width = int(-(-lens.max() // block_size))
        tables = torch.arange(lens.size * width).view(lens.size, width)
        cache = torch.zeros(lens.size * width * block_size, spec.entry_dim)
        q = torch.zeros(len(req), spec.num_heads, spec.qk_dim)
        seen.clear()
        monkeypatch.setattr(attention, "_tiles", spy)
        paged_attention(q, cache, spec, tables, torch.tensor(req), torch.tensor(ctx), block_size, starts)
        monkeypatch.setattr(attention, "_tiles", tiles)
        ran = np.zeros((2, 3))
        for per_key, t, padded in seen:
            g = (per_key - spec.entry_dim) // (2 * spec.num_heads)
            ran[int(g > 1)] += (1, t * padded, t * g * padded)
        work = attention.kernel_work(req, ctx, num_heads=spec.num_heads, entry_dim=spec.entry_dim,
                                     block_size=block_size, max_blocks=width,
                                     starts=None if starts is None else starts.numpy())
        assert work[:, 2:].tolist() == ran.tolist(), trial
        keys = np.maximum(np.array(ctx) - (0 if starts is None else starts.numpy()), 0)
        assert work[:, 0].sum() == np.count_nonzero(keys) and work[:, 1].sum() == keys.sum(), trial


def test_a_windowed_row_gathers_its_window_not_its_context():
    """Hand-worked (gqa: entry 32, 4 heads): a decode at 16,384 keys through a sliding window
    of 512 reads the blocks of keys 15,872-16,383: 32 blocks of 16 (15,872 = 992 x 16), 512
    entries; through a chunk of 2,048 it reads its chunk (16,384 - 1 = 16,383 is in chunk 7,
    from 14,336): 128 blocks. A window starting mid-block reads that whole block too (from
    16,383 - 500 = 15,883: blocks 992-1023). A prefill run of 64 rows at 16,321-16,384 through
    512: two segments of 32 from 15,809 and 15,841 (blocks 988 and 990) to 16,352 and 16,384
    (blocks 1022 and 1024): 34 blocks each, one tile (2 x 34 x 16 x 288 elements, under
    2^20): 2 x 34 x 16 entries, 32 times as many pairs."""
    spec = SPECS["gqa"]

    def work(ctx, starts):
        return attention.kernel_work([0] * len(ctx), ctx, num_heads=4, entry_dim=32, block_size=16, starts=starts)

    assert work([16384], [15872])[0].tolist() == [1, 512, 1, 512, 512]
    assert work([16384], [14336])[0].tolist() == [1, 2048, 1, 2048, 2048]
    assert work([16384], [15883])[0].tolist() == [1, 501, 1, 512, 512]
    ctx = np.arange(16321, 16385)
    assert work(ctx, ctx - 512)[1].tolist() == [64, 64 * 512, 1, 2 * 34 * 16, 32 * 2 * 34 * 16]
    # No window: each segment reads every block up to its context (1,022 and 1,024 blocks: over
    # half the tile budget at 32 x 4 x 2 + 32 = 288 elements a key, a tile each).
    assert work(ctx, None)[1].tolist() == [64, 1_046_560, 2, 2046 * 16, 32 * 2046 * 16]
    assert (spec.entry_dim, spec.num_heads) == (32, 4)
