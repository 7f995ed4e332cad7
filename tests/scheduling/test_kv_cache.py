import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.scheduling import prefix
from pcpflow.scheduling.kv_cache import KVCacheManager


def test_tokens_per_block_counts_every_dcp_rank():
    kv = KVCacheManager(num_blocks=10, block_size=4, dcp_size=2)
    assert kv.tokens_per_block == 8  # a virtual block: 4 positions on each of 2 DCP ranks
    assert [kv.blocks_needed(n) for n in (0, 1, 8, 9, 16, 17)] == [0, 1, 1, 2, 2, 3]
    np.testing.assert_array_equal(kv.blocks_needed(np.array([0, 8, 9])), [0, 1, 2])


def test_free_queue_order_never_used_first_then_freed_last_block_first():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 9)  # 3 blocks from the front: 0 1 2
    kv.allocate(1, 4)  # 3
    np.testing.assert_array_equal(kv.block_tables([0, 1]), [[0, 1, 2], [3, 0, 0]])
    assert kv.num_free_blocks == 4 and kv.num_used_blocks == 4
    np.testing.assert_array_equal(kv.free(0), [2, 1, 0])  # back of the queue, tail first
    np.testing.assert_array_equal(kv.free_queue(), [4, 5, 6, 7, 2, 1, 0])
    kv.allocate(2, 5)  # 2 blocks from the front: never-used 4 and 5
    np.testing.assert_array_equal(kv.block_tables([1, 2]), [[3, 0], [4, 5]])
    kv.allocate(3, 16)  # 4 blocks: 6, 7, then the oldest freed, 2 and 1
    np.testing.assert_array_equal(kv.block_tables([3]), [[6, 7, 2, 1]])


def test_allocate_grows_an_existing_table():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate(0, 4)
    kv.allocate(1, 4)
    kv.allocate(0, 4)  # already enough: no-op
    assert kv.num_blocks_of(0) == 1
    kv.allocate(0, 12)
    np.testing.assert_array_equal(kv.block_tables([0]), [[0, 2, 3]])
    assert kv.num_free_blocks == 4
    np.testing.assert_array_equal(kv.num_blocks_of_many([0, 1, 5, 99]), [3, 1, 0, 0])


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


def test_prefix_hits_share_blocks_and_lru_eviction_forgets_them():
    kv = KVCacheManager(num_blocks=4, block_size=2, prefix_caching=True)
    keys = np.array([11, 12, 13], dtype=np.uint64)  # chained keys of a 3-block prefix
    kv.allocate(0, 6)  # blocks 0 1 2
    assert kv.cache_blocks(0, 0, keys) == 3 and kv.num_cached_blocks == 3
    assert kv.find_cached(keys, 3).tolist() == [0, 1, 2]
    assert kv.find_cached(np.array([11, 99, 13], dtype=np.uint64), 3).tolist() == [0]  # stops at a miss
    assert kv.find_cached(keys, 2).tolist() == [0, 1]
    # a second request takes the first two while r0 still holds them: shared, counted twice
    hits = kv.find_cached(keys, 2)
    assert kv.evictable(hits) == 0
    kv.allocate(1, 5, cached=hits)  # 3 blocks: 0, 1 shared, and block 3 new
    np.testing.assert_array_equal(kv.block_tables([1]), [[0, 1, 3]])
    assert kv.ref_counts().tolist() == [2, 2, 1, 1] and kv.num_free_blocks == 0
    np.testing.assert_array_equal(kv.free(0), [2])  # only block 2 has no holder left
    np.testing.assert_array_equal(kv.free(1), [3, 1, 0])
    np.testing.assert_array_equal(kv.free_queue(), [2, 3, 1, 0])
    # a hit on free cached blocks takes them out of the queue (they count as allocated)
    hits = kv.find_cached(keys, 3)
    assert hits.tolist() == [0, 1, 2] and kv.evictable(hits) == 3
    kv.allocate(2, 6, cached=hits)
    np.testing.assert_array_equal(kv.free_queue(), [3])
    kv.free(2)  # back: 2, 1, 0 behind 3
    np.testing.assert_array_equal(kv.free_queue(), [3, 2, 1, 0])
    # allocation evicts from the front: block 3 (uncached), then 2 (its key is forgotten)
    kv.allocate(3, 4)
    np.testing.assert_array_equal(kv.block_tables([3]), [[3, 2]])
    assert kv.num_evicted == 1 and kv.block_hash(2) is None
    assert kv.find_cached(keys, 3).tolist() == [0, 1]


def test_cache_blocks_keeps_the_first_holder_of_a_key():
    kv = KVCacheManager(num_blocks=4, block_size=1, prefix_caching=True)
    kv.allocate(0, 1)
    kv.allocate(1, 1)
    key = np.array([5], dtype=np.uint64)
    assert kv.cache_blocks(0, 0, key) == 1
    assert kv.cache_blocks(1, 0, key) == 0  # the same content computed twice: one is found
    assert kv.find_cached(key, 1).tolist() == [0]
    off = KVCacheManager(num_blocks=4, block_size=1)  # prefix caching off: nothing is kept
    off.allocate(0, 1)
    assert off.cache_blocks(0, 0, key) == 0 and off.find_cached(key, 1).tolist() == []


def test_a_private_block_is_cached_without_an_entry_until_its_request_is_preempted():
    """``private``: a block only its own request can ask for holds its hash (cached, counted,
    evicted like any other) without a dict entry; ``index`` gives it one, so that its
    request, readmitted, finds it; evicted, it needs none."""
    kv = KVCacheManager(num_blocks=4, block_size=1, prefix_caching=True)
    kv.allocate(0, 3)  # blocks 0 1 2
    keys = np.array([21, 22, 23], dtype=np.uint64)
    assert kv.cache_block_ids(np.array([0, 1, 2]), keys, np.array([False, True, True])) == 3
    assert kv.num_cached_blocks == 3 and [kv.block_hash(b) for b in range(3)] == [21, 22, 23]
    assert kv.find_cached(keys, 3).tolist() == [0]  # no entry: not found by anyone
    kv.index(0)  # request 0 is about to be preempted
    kv.free(0)
    assert kv.find_cached(keys, 3).tolist() == [0, 1, 2]
    # a second request's private block, then evicted: forgotten like any other
    kv.allocate(1, 1)  # block 3 (never used)
    kv.cache_block_ids(np.array([3]), np.array([31], dtype=np.uint64), np.array([True]))
    kv.free(1)
    np.testing.assert_array_equal(kv.free_queue(), [2, 1, 0, 3])
    kv.allocate(2, 4)  # every block evicted, the private one too
    assert kv.num_evicted == 4 and kv.num_cached_blocks == 0 and kv.block_hash(3) is None
    assert kv.find_cached(keys, 3).tolist() == [] and not kv._unindexed.any()


# -- property: the pool against a list-based model ---------------------------------------------
#
# The model keeps the free queue as a Python list (front first) and the cache as dicts: what
# vLLM's BlockPool does, written plainly. Requests share content by "stem": request r's block
# j holds content (r % 3, j), so requests with the same stem share prefixes.

N, B = 10, 2


class Model:
    def __init__(self):
        self.queue = list(range(N))
        self.ref = [0] * N
        self.key_of: dict[int, int] = {}  # block -> key
        self.block_of: dict[int, int] = {}  # key -> block
        self.tables: dict[int, list[int]] = {}

    def take(self, n):
        out, self.queue = self.queue[:n], self.queue[n:]
        for b in out:
            self.ref[b] = 1
            if b in self.key_of:
                key = self.key_of.pop(b)
                if self.block_of.get(key) == b:
                    del self.block_of[key]
        return out

    def find(self, keys):
        found = []
        for k in keys:
            if k not in self.block_of:
                break
            found.append(self.block_of[k])
        return found

    def allocate(self, rid, need, hits):
        for b in hits:
            if self.ref[b] == 0:
                self.queue.remove(b)
            self.ref[b] += 1
        table = self.tables.setdefault(rid, [])
        table += hits
        table += self.take(need - len(table))

    def free(self, rid):
        freed = []
        for b in reversed(self.tables.pop(rid)):
            self.ref[b] -= 1
            if self.ref[b] == 0:
                freed.append(b)
        self.queue += freed
        return freed

    def cache(self, rid, first, keys):
        for b, k in zip(self.tables[rid][first:], keys):
            if b not in self.key_of and k not in self.block_of:
                self.key_of[b], self.block_of[k] = k, b


def _keys(rid, n):
    stem = rid % 3
    return prefix.keys(prefix.chain(prefix.mix(stem, np.arange(n, dtype=np.uint64))))


# op: (rid, tokens) grows rid (a request holding nothing looks up its prefix first);
#     (rid, None) frees rid; every full block of a grown request is cached.
_ops = st.lists(st.tuples(st.integers(0, 8), st.one_of(st.none(), st.integers(1, 12))), max_size=80)


@settings(max_examples=200, deadline=None)
@given(_ops)
def test_pool_matches_the_list_model_and_loses_nothing(ops):
    kv = KVCacheManager(N, B, prefix_caching=True)
    m = Model()
    looked_up = []  # earlier lookups (keys, longest, answer): finds_again tells whether each still holds
    for rid, tokens in ops:
        for keys, longest, answer in looked_up[-4:]:
            assert kv.finds_again(keys, longest, answer) == (kv.find_cached(keys, longest).tolist() == answer.tolist())
        if tokens is None:
            if rid in m.tables:
                assert kv.free(rid).tolist() == m.free(rid)
            continue
        need = -(-tokens // B)
        held = m.tables.get(rid)
        hits = []
        if held is None:
            longest = (tokens - 1) // B
            hits = m.find(_keys(rid, longest).tolist())
            assert kv.find_cached(_keys(rid, longest), longest).tolist() == hits
            looked_up.append((_keys(rid, longest), longest, kv.find_cached(_keys(rid, longest), longest)))
        have = len(held or []) + len(hits)
        new = max(0, need - have) + sum(m.ref[b] == 0 for b in hits)
        if new > len(m.queue):
            with pytest.raises(RuntimeError):
                kv.allocate(rid, tokens, cached=np.array(hits, dtype=np.int64) if held is None else None)
            continue
        kv.allocate(rid, tokens, cached=np.array(hits, dtype=np.int64) if held is None else None)
        m.allocate(rid, max(need, len(held or [])), hits)
        full = tokens // B
        keys = _keys(rid, full)
        kv.cache_blocks(rid, 0, keys)
        m.cache(rid, 0, keys.tolist())
        # the same state, seen every way
        assert kv.free_queue().tolist() == m.queue
        assert kv.ref_counts().tolist() == m.ref
        for r, table in m.tables.items():
            assert kv.blocks_of(r).tolist() == table
        # no block lost or owned twice: every block is free exactly once or held, and a
        # held block's count is the number of tables holding it
        held_by = np.bincount([b for t in m.tables.values() for b in t], minlength=N)
        queue = kv.free_queue()
        assert sorted(queue.tolist()) == [b for b in range(N) if held_by[b] == 0]
        np.testing.assert_array_equal(kv.ref_counts(), held_by)
        assert kv.num_free_blocks == len(queue)
        # a block shared by two tables is a cached (read-only) one
        assert all(kv.block_hash(b) is not None for b in np.flatnonzero(held_by > 1))
        # the prefix cache's index holds exactly the cached blocks: no entry outlives its block
        assert kv._cached == m.block_of
    for r in list(m.tables):
        kv.free(r)
    assert not kv.ref_counts().any() and kv.num_free_blocks == N
    assert sorted(kv.free_queue().tolist()) == list(range(N))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40))), max_size=60),
    st.lists(st.tuples(st.integers(0, 20), st.integers(0, 40)), max_size=8, unique_by=lambda t: t[0]),
)
def test_allocate_many_is_allocate_in_a_loop(ops, batch):
    """After any history, one ``allocate_many`` leaves the pool exactly as the same
    ``allocate`` calls in order would, or (when they would not all fit) changes nothing."""

    def replay():
        kv = KVCacheManager(16, 2, 2)
        for rid, tokens in ops:
            if tokens is None:
                if kv.num_blocks_of(rid) or rid < len(kv._row_of) and kv._row_of[rid] >= 0:
                    kv.free(rid)
            elif kv.blocks_needed(tokens) - kv.num_blocks_of(rid) <= kv.num_free_blocks:
                kv.allocate(rid, tokens)
        return kv

    looped, batched = replay(), replay()
    ids = [rid for rid, _ in batch]
    tokens = [n for _, n in batch]
    before = (batched.num_free_blocks, batched.free_queue(), batched._table.copy())
    try:
        for rid, n in batch:
            looped.allocate(rid, n)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            batched.allocate_many(ids, tokens)
        assert batched.num_free_blocks == before[0]
        np.testing.assert_array_equal(batched.free_queue(), before[1])
        np.testing.assert_array_equal(batched._table, before[2])
        return
    batched.allocate_many(ids, tokens)
    assert batched.num_free_blocks == looped.num_free_blocks
    np.testing.assert_array_equal(batched.free_queue(), looped.free_queue())
    for rid in range(21):
        assert batched.num_blocks_of(rid) == looped.num_blocks_of(rid)
    holding = [rid for rid in range(21) if looped.num_blocks_of(rid)]
    if holding:
        np.testing.assert_array_equal(batched.block_tables(holding), looped.block_tables(holding))


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 12), st.one_of(st.none(), st.integers(0, 40))), max_size=60),
    st.lists(st.integers(1, 3), min_size=1, max_size=8),
)
def test_grow_is_allocate_in_a_loop(ops, extra):
    """``grow`` (the scheduler's step: requests holding blocks each get one or more) leaves
    the pool as ``allocate`` in a loop would, or refuses and changes nothing."""
    def replay():
        kv = KVCacheManager(16, 2, 2)
        for rid, tokens in ops:
            if tokens is None:
                if kv.num_blocks_of(rid):
                    kv.free(rid)
            elif kv.blocks_needed(tokens) - kv.num_blocks_of(rid) <= kv.num_free_blocks:
                kv.allocate(rid, tokens)
        return kv

    looped, grown = replay(), replay()
    holding = [rid for rid in range(13) if looped.num_blocks_of(rid)][:len(extra)]
    extra = np.array(extra[:len(holding)], dtype=np.int64)
    if not holding:
        return
    want = [(looped.num_blocks_of(rid) + k) * 4 for rid, k in zip(holding, extra.tolist())]  # 4 tokens a block
    before = (grown.num_free_blocks, grown.free_queue(), grown._table.copy())
    if int(extra.sum()) > looped.num_free_blocks:
        with pytest.raises(RuntimeError):
            grown.grow(np.array(holding), extra)
        assert grown.num_free_blocks == before[0]
        np.testing.assert_array_equal(grown.free_queue(), before[1])
        np.testing.assert_array_equal(grown._table, before[2])
        return
    for rid, n in zip(holding, want):
        looped.allocate(rid, n)
    grown.grow(np.array(holding), extra)
    assert grown.num_free_blocks == looped.num_free_blocks
    np.testing.assert_array_equal(grown.free_queue(), looped.free_queue())
    np.testing.assert_array_equal(grown.block_tables(holding), looped.block_tables(holding))
