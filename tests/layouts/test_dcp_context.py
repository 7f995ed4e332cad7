"""pcpflow.layouts.dcp_context: the DCP context path's index arithmetic, by hand and against the
real slot mapping on random contexts."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.dcp_context import context_gather_plan
from pcpflow.layouts.slots import compute_slot_mapping


def test_context_gather_plan_by_hand():
    """D=2, I=2, B=4; sequences of 5 and 3 with block tables [[7, 1], [3, 9]].
    Sequence 0: positions 0,1,4 on rank 0 (local 0,1,2), 2,3 on rank 1 (local 0,1);
    sequence 1: 0,1 on rank 0, 2 on rank 1. Rank 0 sends 3 + 2 = 5 entries, rank 1 2 + 1:
    M = 5. Local position lp of a sequence is at slot table[lp // 4] * 4 + lp % 4."""
    tables = np.array([[7, 1], [3, 9]])
    plans = [
        context_gather_plan([5, 3], tables, block_size=4, dcp_size=2, dcp_rank=r, interleave=2)
        for r in (0, 1)
    ]
    # Rank 0: seq 0 local 0,1,2 -> block 7: 28, 29, 30; seq 1 local 0,1 -> block 3: 12, 13.
    assert plans[0].send_slots.tolist() == [28, 29, 30, 12, 13]
    # Rank 1: seq 0 local 0,1 -> 28, 29; seq 1 local 0 -> 12; padded with slot 0 to M.
    assert plans[1].send_slots.tolist() == [28, 29, 12, 0, 0]
    # Gathered rows: rank 0 [s0p0 s0p1 s0p4 s1p0 s1p1 | s0p2 s0p3 s1p2 pad pad].
    # Reassembled: sequence 0 in blocks 0-1 (8 slots, 5 used), sequence 1 in block 2.
    for plan in plans:
        assert plan.source.tolist() == [0, 1, 5, 6, 2, 0, 0, 0] + [3, 4, 7, 0]
        assert plan.block_tables.tolist() == [[0, 1], [2, 2]]


@settings(max_examples=60, deadline=None)
@given(
    lens=st.lists(st.integers(1, 40), min_size=1, max_size=5),
    dcp=st.sampled_from([2, 3, 4]),
    interleave=st.sampled_from([1, 2, 4]),
    offset=st.integers(0, 3),
)
def test_context_gather_reassembles_every_context(lens, dcp, interleave, offset):
    """Write each position's id into the DCP shards through the real slot mapping, run
    every rank's send, concatenate (the all-gather), pick ``source``: each sequence's
    positions come back in order, in the blocks its new table names."""
    b = 4
    lens = np.array(lens)
    virt = -(-lens // (b * dcp))  # blocks each sequence needs per rank
    # Scattered, distinct blocks per sequence (the same table on every rank).
    width = int(virt.max())
    tables = (np.arange(len(lens) * width).reshape(len(lens), width) * 3 + offset) % 997
    num_slots = (int(tables.max()) + 1) * b
    caches = []
    for r in range(dcp):
        cache = np.full(num_slots, -1)
        for k, n in enumerate(lens):
            pos = np.arange(n)
            slots = compute_slot_mapping(
                pos, np.full(n, k), tables, b, dcp_size=dcp, dcp_rank=r, interleave=interleave
            )
            cache[slots[slots >= 0]] = 1000 * k + pos[slots >= 0]
        caches.append(cache)
    plans = [
        context_gather_plan(
            lens, tables, block_size=b, dcp_size=dcp, dcp_rank=r, interleave=interleave
        )
        for r in range(dcp)
    ]
    gathered = np.concatenate([caches[r][p.send_slots] for r, p in enumerate(plans)])
    for plan in plans:
        assert (plan.source == plans[0].source).all()
        rebuilt = gathered[plan.source]
        for k, n in enumerate(lens):
            j = np.arange(n)
            slot = plan.block_tables[k, j // b] * b + j % b
            assert (rebuilt[slot] == 1000 * k + j).all()
