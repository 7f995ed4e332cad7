"""pcpflow.attention.metadata: the one builder of slot mappings and row metadata (the slots
stage, the drafters and the verifier use it), checked on hand-worked cases."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from pcpflow.attention.metadata import build_attention_metadata, rank_slot_mapping
from pcpflow.layouts.layout import plan_layout

KV = SimpleNamespace(block_size=4, interleave=1)


def _replicated(num_rows: int, pcp_size: int, dcp_size: int):
    return plan_layout(np.ones(num_rows, dtype=np.int64), np.zeros(num_rows, dtype=bool), pcp_size=pcp_size, dcp_size=dcp_size)


def test_replicated_rows_under_dcp_by_hand():
    # Two rows of request rows 0 and 1 at positions 5 and 2, block size 4, DCP 2 (rank 1),
    # on PCP rank 1 of 2. Virtual blocks hold 8 positions; rank 1 owns odd positions.
    tables = np.array([[3, 0], [6, 0]])
    meta = build_attention_metadata(
        _replicated(2, 2, 2), np.array([5, 2]), np.array([0, 1]), tables, np.array([6, 3]),
        kv=KV, pcp_rank=1, dcp_size=2, dcp_rank=1, device="cpu",
    )
    # Every rank holds both rows; rank 0's copy is the canonical writer (rank 1's are -1).
    # Position 5 is rank 1's local position 2 of block 3: slot 14; position 2 is rank 0's.
    assert meta.gathered_slot_mapping.tolist() == [14, -1, -1, -1]
    assert meta.local_row_req_indices.tolist() == [0, 1]
    # Reads: positions [0, 6) hold 3 odd ones; [0, 3) holds 1.
    assert meta.local_row_context_lens.tolist() == [3, 1]
    assert meta.gathered_row_context_lens.tolist() == [3, 1, 3, 1]
    assert meta.dcp_context is None  # no seq_lens: the rest rows take the queries path


def test_a_prefill_split_over_two_pcp_ranks_by_hand():
    # One prefill of 4 tokens over PCP 2: chunks of 1, rank 0 holds positions 0 and 3,
    # rank 1 positions 1 and 2 (DualChunkSwap); block table [5]: slot = 20 + position.
    layout = plan_layout(np.array([4]), np.array([True]), pcp_size=2)
    positions, req = np.arange(4), np.zeros(4, dtype=np.int64)
    tables = np.array([[5]])
    for rank, own in ((0, [0, 3]), (1, [1, 2])):
        meta = build_attention_metadata(
            layout, positions, req, tables, kv=KV, pcp_rank=rank, dcp_size=1, dcp_rank=0, device="cpu"
        )
        # Every rank writes every gathered row (no DCP): rank-major, each rank's rows in order.
        assert meta.gathered_slot_mapping.tolist() == [20, 23, 21, 22]
        assert meta.local_row_context_lens.tolist() == [p + 1 for p in own]  # causal
        assert meta.gathered_row_req_indices is None and meta.dcp_context is None


def test_with_seq_lens_under_dcp_the_context_path_is_prepared():
    layout = plan_layout(np.array([4]), np.array([True]), pcp_size=2, dcp_size=2)
    meta = build_attention_metadata(
        layout, np.arange(4), np.zeros(4, dtype=np.int64), np.array([[5]]),
        kv=KV, pcp_rank=0, dcp_size=2, dcp_rank=0, device="cpu", seq_lens=np.array([4]),
    )
    assert meta.dcp_context is not None
    # Rank 0 reads its own rows (positions 0 and 3) over their whole contexts: 1 and 4 keys.
    assert meta.dcp_context.tensors.row_context_lens.tolist() == [1, 4]
    # ...and, on the queries path, only its DCP shard (even positions): 1 and 2 keys.
    assert meta.local_row_context_lens.tolist() == [1, 2]


def test_rank_slot_mapping_gives_other_dcp_ranks_positions_minus_one():
    # Block size 4, DCP 2, interleave 1: a virtual block holds 8 positions, rank r the ones
    # with p % 2 == r, at local slot p // 2 of block 7.
    slots0 = rank_slot_mapping(np.arange(6), np.zeros(6, dtype=np.int64), np.array([[7]]), KV, dcp_size=2, dcp_rank=0)
    slots1 = rank_slot_mapping(np.arange(6), np.zeros(6, dtype=np.int64), np.array([[7]]), KV, dcp_size=2, dcp_rank=1)
    assert slots0.tolist() == [28, -1, 29, -1, 30, -1]
    assert slots1.tolist() == [-1, 28, -1, 29, -1, 30]
