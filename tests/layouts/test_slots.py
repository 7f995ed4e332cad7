"""pcpflow.layouts.slots: DCP ownership, dense local positions and paged-KV slots, checked by
hand and against per-token Python recomputations."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.layout import plan_layout
from pcpflow.layouts.slots import (
    PAD_SLOT_ID,
    compute_slot_mapping,
    dcp_local_positions,
    dcp_local_seq_lens,
    dcp_owner,
    dcp_shard_len_sums,
    expand_to_gathered,
)

PROPERTY = settings(max_examples=80, deadline=None, database=None)


def test_pad_slot_id():
    assert PAD_SLOT_ID == -1


@pytest.mark.parametrize("p, interleave", [(1, 1), (2, 1), (3, 2), (4, 4), (5, 3)])
def test_shard_len_sums_are_the_sums_of_shard_lengths(p, interleave):
    sums = dcp_shard_len_sums(np.arange(0, 200), p, interleave)
    for rank in range(p):
        lens = dcp_local_seq_lens(np.arange(1, 200), p, rank, interleave)
        assert sums[rank].tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()


def test_owner_and_local_positions_by_hand():
    # D=2, I=2: runs of two positions alternate between the ranks.
    p = np.arange(10)
    assert dcp_owner(p, 2, 2).tolist() == [0, 0, 1, 1, 0, 0, 1, 1, 0, 0]
    assert dcp_local_positions(p, 2, 2).tolist() == [0, 1, 0, 1, 2, 3, 2, 3, 4, 5]
    # I=1: round robin over 3 ranks.
    assert dcp_owner(p, 3, 1).tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    assert dcp_local_positions(p, 3, 1).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3]
    # 7 positions, D=2, I=2: rank 0 owns 0 1 4 5, rank 1 owns 2 3 6.
    assert dcp_local_seq_lens([7], 2, 0, 2).tolist() == [4]
    assert dcp_local_seq_lens([7], 2, 1, 2).tolist() == [3]
    assert dcp_local_seq_lens([0, 1, 2, 3], 2, 1, 2).tolist() == [0, 0, 0, 1]


def test_slot_mapping_by_hand():
    # B=4, D=2, I=2, request 0 on DCP rank 0 uses blocks 7 then 3. Rank 0 owns positions
    # 0 1 4 5 8 9 -> local 0..5 -> block 7 offsets 0..3, then block 3 offsets 0, 1.
    tables = np.array([[7, 3], [0, 0]])
    slots = compute_slot_mapping(np.arange(10), np.zeros(10, dtype=int), tables, 4,
                                 dcp_size=2, dcp_rank=0, interleave=2)
    assert slots.tolist() == [28, 29, -1, -1, 30, 31, -1, -1, 12, 13]
    assert slots.dtype == np.int64
    # B=4, D=2, I=4, 9 positions: DCP rank 1 owns 4..7 only and has allocated one block
    # (5); position 8 (rank 0's) must not be looked up in its table.
    slots = compute_slot_mapping(np.arange(9), np.zeros(9, dtype=int), [[5]], 4,
                                 dcp_size=2, dcp_rank=1, interleave=4)
    assert slots.tolist() == [-1, -1, -1, -1, 20, 21, 22, 23, -1]
    # Without DCP: slot = block * B + offset, blocks of 4 positions.
    slots = compute_slot_mapping([0, 3, 4, 6, 1], [0, 0, 0, 0, 1], [[7, 3], [5, 9]], 4)
    assert slots.tolist() == [28, 31, 12, 14, 21]


def test_bad_arguments_name_the_numbers():
    with pytest.raises(ValueError, match=r"interleave \(3\).*block_size \(16\)"):
        compute_slot_mapping([0], [0], [[0]], 16, dcp_size=2, interleave=3)
    with pytest.raises(ValueError, match=r"dcp_rank \(2\).*dcp_size \(2\)"):
        compute_slot_mapping([0], [0], [[0]], 16, dcp_size=2, dcp_rank=2)
    with pytest.raises(ValueError, match=r"dcp_rank \(-1\)"):
        dcp_local_seq_lens([4], 2, -1, 1)
    with pytest.raises(ValueError, match=r"positions \(2,\) and req_indices \(3,\)"):
        compute_slot_mapping([0, 1], [0, 0, 0], [[0]], 16)


def test_expand_to_gathered_by_hand():
    # 7-token prefill at pcp=2: gathered rows [0 1 6 _ | 2 3 4 5].
    layout = plan_layout([7], [True], pcp_size=2)
    slots = 100 + np.arange(7)
    assert expand_to_gathered(slots, layout).tolist() == [100, 101, 106, -1, 102, 103, 104, 105]
    # Replicated decodes: only rank 0's copy writes.
    layout = plan_layout([1, 1], [False, False], pcp_size=2)
    assert expand_to_gathered([5, 9], layout).tolist() == [5, 9, -1, -1]
    # One row per KV cache group.
    two_groups = expand_to_gathered(np.array([[5, 9], [1, 2]]), layout)
    assert two_groups.tolist() == [[5, 9, -1, -1], [1, 2, -1, -1]]
    with pytest.raises(ValueError, match="slot_mapping has 3 tokens, the layout 2"):
        expand_to_gathered([1, 2, 3], layout)
    # Empty batch padded to a graph size: all padding.
    empty = plan_layout([], [], pcp_size=2, padded_num_tokens=2)
    assert expand_to_gathered(np.zeros(0, dtype=int), empty).tolist() == [-1] * 4


@st.composite
def kv_cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    dcp = draw(st.integers(1, 4))
    interleave = draw(st.sampled_from(sorted({1, 2, block_size} & set(range(1, block_size + 1)))))
    num_reqs = draw(st.integers(1, 4))
    max_len = draw(st.integers(1, 80))
    virtual_blocks = -(-max_len // (block_size * dcp))
    # Distinct physical blocks on this rank: a permutation of a block pool.
    pool = draw(st.permutations(range(num_reqs * virtual_blocks + 3)))
    tables = np.array(pool[: num_reqs * virtual_blocks]).reshape(num_reqs, virtual_blocks)
    lens = draw(st.lists(st.integers(0, max_len), min_size=num_reqs, max_size=num_reqs))
    req = np.repeat(np.arange(num_reqs), lens)
    pos = np.concatenate([np.arange(n) for n in lens]) if sum(lens) else np.zeros(0, int)
    return dict(block_size=block_size, dcp=dcp, interleave=interleave, tables=tables,
                req=req, pos=pos, lens=np.array(lens))


def slot_by_hand(p, r, tables, block_size, dcp, rank, interleave):
    """One token: walk the rank's positions of request r in order and count."""
    if (p // interleave) % dcp != rank:
        return -1
    local = sum(1 for x in range(p) if (x // interleave) % dcp == rank)
    return int(tables[r][local // block_size]) * block_size + local % block_size


@PROPERTY
@given(kv_cases(), st.data())
def test_slot_mapping_matches_per_token_recomputation(case, data):
    rank = data.draw(st.integers(0, case["dcp"] - 1))
    slots = compute_slot_mapping(case["pos"].astype(np.int32), case["req"], case["tables"],
                                 case["block_size"], dcp_size=case["dcp"], dcp_rank=rank,
                                 interleave=case["interleave"])
    expected = [slot_by_hand(int(p), int(r), case["tables"], case["block_size"], case["dcp"],
                             rank, case["interleave"]) for p, r in zip(case["pos"], case["req"])]
    assert slots.dtype == np.int64
    assert slots.tolist() == expected


@PROPERTY
@given(kv_cases())
def test_each_position_has_one_owner_and_owned_slots_are_unique(case):
    d, b, i = case["dcp"], case["block_size"], case["interleave"]
    per_rank = np.stack([
        compute_slot_mapping(case["pos"], case["req"], case["tables"], b, dcp_size=d,
                             dcp_rank=k, interleave=i)
        for k in range(d)
    ])
    owned = per_rank != PAD_SLOT_ID
    assert (owned.sum(axis=0) == 1).all()
    np.testing.assert_array_equal(np.argmax(owned, axis=0), dcp_owner(case["pos"], d, i))
    for k in range(d):
        mine = per_rank[k][owned[k]]
        assert len(np.unique(mine)) == len(mine)
        # A rank's shard of each request is dense: local positions 0, 1, 2, ... in order.
        for r, n in enumerate(case["lens"]):
            local = dcp_local_positions(np.arange(n), d, i)[dcp_owner(np.arange(n), d, i) == k]
            np.testing.assert_array_equal(local, np.arange(len(local)))
            assert len(local) == dcp_local_seq_lens([n], d, k, i)[0]


@PROPERTY
@given(st.lists(st.integers(0, 300), max_size=8), st.integers(1, 5), st.sampled_from([1, 2, 3, 8]))
def test_local_seq_lens_count_owned_positions(lens, dcp, interleave):
    lens = np.array(lens, dtype=np.int64)
    total = np.zeros_like(lens)
    for rank in range(dcp):
        got = dcp_local_seq_lens(lens.astype(np.int32), dcp, rank, interleave)
        brute = [sum(1 for p in range(n) if (p // interleave) % dcp == rank) for n in lens]
        assert got.dtype == np.int64 and got.tolist() == brute
        total += got
    np.testing.assert_array_equal(total, lens)


@PROPERTY
@given(st.lists(st.integers(0, 40), min_size=1, max_size=6), st.integers(1, 4), st.data())
def test_expand_to_gathered_writes_each_token_once(q, pcp, data):
    pre = data.draw(st.lists(st.booleans(), min_size=len(q), max_size=len(q)))
    layout = plan_layout(q, pre, pcp_size=pcp, shard_decodes=data.draw(st.booleans()))
    slots = 1000 + np.arange(layout.num_tokens)
    gathered = expand_to_gathered(slots, layout)
    assert gathered.dtype == np.int64
    np.testing.assert_array_equal(gathered[layout.hidden_restore_idx], slots)
    assert (gathered[~layout.kv_write_mask] == PAD_SLOT_ID).all()
    written = gathered[gathered != PAD_SLOT_ID]
    assert sorted(written.tolist()) == slots.tolist()


def test_a_read_only_index_array_reaches_torch_without_a_warning_and_unaliased():
    import warnings

    from pcpflow.layouts.tensors import int64_tensor

    a = np.arange(5, dtype=np.int64)
    a.flags.writeable = False  # as a decode-only layout's shared segments are
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        t = int64_tensor(a)
    assert t.tolist() == [0, 1, 2, 3, 4]
    t[0] = 7  # the tensor owns a copy: the shared array is untouched
    assert a[0] == 0
    b = np.arange(3, dtype=np.int32)
    assert str(int64_tensor(b).dtype) == "torch.int64" and int64_tensor(b).tolist() == [0, 1, 2]
