import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.scheduling.kv_cache import KVCacheManager


def test_tokens_per_block_counts_every_dcp_rank():
    kv = KVCacheManager(num_blocks=10, block_size=4, dcp_size=2)
    assert kv.tokens_per_block == 8  # a virtual block: 4 positions on each of 2 DCP ranks
    assert [kv.blocks_needed(n) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    np.testing.assert_array_equal(kv.blocks_needed(np.array([0, 8, 9])), [0, 1, 2])


def test_lowest_free_ids_first_and_reuse_after_free():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 9)  # 3 blocks
    kv.allocate(1, 4)  # 1 block
    np.testing.assert_array_equal(kv.block_tables([0, 1]), [[0, 1, 2], [3, 0, 0]])
    assert kv.num_free_blocks == 4
    np.testing.assert_array_equal(kv.free(0), [0, 1, 2])
    assert kv.num_free_blocks == 7
    kv.allocate(2, 5)  # 2 blocks: the lowest free ids are 0 and 1 again
    np.testing.assert_array_equal(kv.block_tables([2]), [[0, 1]])
    np.testing.assert_array_equal(kv.block_tables([1, 2]), [[3, 0], [0, 1]])


def test_allocate_grows_an_existing_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 4)
    kv.allocate(1, 4)
    kv.allocate(0, 4)  # already enough: no-op
    assert kv.num_blocks_of(0) == 1
    kv.allocate(0, 12)
    np.testing.assert_array_equal(kv.block_tables([0]), [[0, 2, 3]])
    assert kv.num_free_blocks == 4


def test_can_allocate_boundary_and_failed_allocate_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.can_allocate(12) and not kv.can_allocate(13)
    kv.allocate(0, 1)
    assert kv.can_allocate(8) and not kv.can_allocate(9)
    with pytest.raises(RuntimeError, match="only 2 of 3 are free"):
        kv.allocate(1, 9)
    assert kv.num_free_blocks == 2
    with pytest.raises(KeyError):
        kv.block_tables([1])
    kv.allocate(1, 8)
    np.testing.assert_array_equal(kv.block_tables([1]), [[1, 2]])


def test_max_blocks_per_req():
    kv = KVCacheManager(num_blocks=10, block_size=2, max_blocks_per_req=2)
    assert kv.can_allocate(4) and not kv.can_allocate(5)
    with pytest.raises(RuntimeError, match="max_blocks_per_req"):
        kv.allocate(0, 5)


def test_block_tables_padding_width_and_order():
    kv = KVCacheManager(num_blocks=4, block_size=1)
    kv.allocate(7, 0)  # holds a table but no block yet
    np.testing.assert_array_equal(kv.block_tables([7]), [[0]])  # width is at least 1
    kv.allocate(3, 2)
    tables = kv.block_tables(np.array([3, 7, 3]))
    assert tables.dtype == np.int64
    np.testing.assert_array_equal(tables, [[0, 1], [0, 0], [0, 1]])
    assert kv.block_tables(np.zeros(0, dtype=np.int64)).shape == (0, 1)


def test_free_unknown_request_raises():
    kv = KVCacheManager(num_blocks=4, block_size=1)
    with pytest.raises(KeyError):
        kv.free(0)
    kv.allocate(0, 1)
    kv.free(0)
    with pytest.raises(KeyError):
        kv.free(0)


# One op: (req_id, num_tokens) allocates/grows; (req_id, None) frees.
_ops = st.lists(
    st.tuples(st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40))), max_size=60
)


def _replay(ops, num_blocks=16, block_size=2, dcp_size=2):
    kv = KVCacheManager(num_blocks, block_size, dcp_size)
    held: dict[int, list[int]] = {}
    for rid, tokens in ops:
        if tokens is None:
            if rid in held:
                np.testing.assert_array_equal(kv.free(rid), held.pop(rid))
            continue
        have = len(held.get(rid, []))
        need = -(-tokens // (block_size * dcp_size))
        if need - have > kv.num_free_blocks:
            with pytest.raises(RuntimeError):
                kv.allocate(rid, tokens)
            continue
        in_use = {b for bs in held.values() for b in bs}
        lowest_free = [b for b in range(num_blocks) if b not in in_use][: max(0, need - have)]
        kv.allocate(rid, tokens)
        table = kv.block_tables([rid])[0]
        assert table[have:need].tolist() == lowest_free
        held[rid] = table[: max(need, have)].tolist()
        assert (table[max(need, have):] == 0).all()
    return kv, held


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_random_alloc_free_never_overlaps_and_is_deterministic(ops):
    kv, held = _replay(ops)
    blocks = [b for bs in held.values() for b in bs]
    assert len(blocks) == len(set(blocks)), "two requests share a block"
    assert all(0 <= b < 16 for b in blocks)
    assert kv.num_free_blocks == 16 - len(blocks)
    if held:
        ids = np.array(sorted(held))
        width = max(1, max(len(v) for v in held.values()))
        expected = np.zeros((len(ids), width), dtype=np.int64)
        for i, rid in enumerate(ids):
            expected[i, : len(held[rid])] = held[rid]
        np.testing.assert_array_equal(kv.block_tables(ids), expected)
        # the same call sequence on another "rank" hands out the same ids
        kv2, held2 = _replay(ops)
        assert held2 == held
        np.testing.assert_array_equal(kv2.block_tables(ids), expected)


@settings(max_examples=150, deadline=None)
@given(
    _ops,
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), max_size=8, unique_by=lambda t: t[0]),
)
def test_allocate_many_is_allocate_in_a_loop(ops, batch):
    """After any history, one ``allocate_many`` leaves the allocator exactly as the same
    ``allocate`` calls in order would, or (when they would not all fit) changes nothing."""
    looped, _ = _replay(ops)
    batched, _ = _replay(ops)
    ids = [rid for rid, _ in batch]
    tokens = [n for _, n in batch]
    before = (batched.num_free_blocks, batched._is_free.copy(), batched._table.copy())
    try:
        for rid, n in batch:
            looped.allocate(rid, n)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            batched.allocate_many(ids, tokens)
        assert batched.num_free_blocks == before[0]
        np.testing.assert_array_equal(batched._is_free, before[1])
        np.testing.assert_array_equal(batched._table, before[2])
        return
    batched.allocate_many(ids, tokens)
    assert batched.num_free_blocks == looped.num_free_blocks
    for rid in range(21):
        assert batched.num_blocks_of(rid) == looped.num_blocks_of(rid)
    holding = [rid for rid in range(21) if looped.num_blocks_of(rid)]
    if holding:
        np.testing.assert_array_equal(batched.block_tables(holding), looped.block_tables(holding))
