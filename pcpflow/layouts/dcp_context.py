"""The DCP *context path*'s index arithmetic: how the rest rows' whole contexts are
gathered from their DCP shards and laid out again (``pcpflow.attention.context_parallel`` runs it).

Kept apart from the attention backend so that the step state can name what the ``slots``
stage prepares without importing the backend that consumes it.
"""

from __future__ import annotations

from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from pcpflow.layouts.accounting import rest_requests
from pcpflow.layouts.layout import BatchLayout
from pcpflow.layouts.slots import dcp_local_seq_lens
from pcpflow.layouts.tensors import int64_tensor


class ContextPlan(NamedTuple):
    """Index arrays of the context path (``context_gather_plan``)."""

    send_slots: np.ndarray  # int64 [M]: this rank's cache slots it sends, in order
    source: np.ndarray  # int64 [S]: gathered row of each slot of the reassembled contexts
    block_tables: np.ndarray  # int64 [K, max_blocks]: each sequence's reassembled blocks


def context_gather_plan(
    seq_lens,
    block_tables,
    *,
    block_size: int,
    dcp_size: int,
    dcp_rank: int,
    interleave: int,
) -> ContextPlan:
    """How the whole contexts ``[0, L_k)`` of K sequences are gathered from their DCP
    shards and laid out again (numpy, vectorized; no loop per sequence or token).

    Every rank sends its entries of local positions ``[0, l_jk)`` of each sequence
    (``l_jk = dcp_local_seq_lens(L_k, D, j, I)``), sequences concatenated, padded with
    slot 0 to ``M = max_j sum_k l_jk`` rows, at slot ``block_tables[k, lp // B]*B + lp % B``.
    In the gathered ``[D*M]`` rows, rank ``j``'s entry ``lp`` of sequence ``k`` is row
    ``j*M + sum_{k'<k} l_jk' + lp``. The reassembled contexts hold sequence ``k`` in
    ``ceil(L_k/B)`` blocks of its own, after the blocks of the sequences before it:
    position ``p`` comes from rank ``(p // I) % D``, local position
    ``(p // (I*D))*I + p % I`` (``pcpflow.layouts.slots``); the tail of the last block reads row 0
    (never attended). D=2, I=1, one sequence of 5: rank 0 sends positions 0, 2, 4, rank 1
    positions 1, 3 (and a pad), gathered ``[0 2 4 | 1 3 _]``, ``source = [0 3 1 4 2 ...]``.
    """
    lens = np.asarray(seq_lens, dtype=np.int64)
    tables = np.asarray(block_tables, dtype=np.int64)
    num_seqs, b, d, i = lens.shape[0], block_size, dcp_size, interleave
    seq = np.arange(num_seqs, dtype=np.int64)
    counts = np.stack([dcp_local_seq_lens(lens, d, j, i) for j in range(d)])  # [D, K]
    first = np.cumsum(counts, axis=1) - counts  # each sequence's first row in a rank's part
    m = int(counts.sum(axis=1).max()) if num_seqs else 0

    mine = counts[dcp_rank]
    of = np.repeat(seq, mine)
    lp = np.arange(of.shape[0], dtype=np.int64) - np.repeat(first[dcp_rank], mine)
    send_slots = np.zeros(m, dtype=np.int64)
    send_slots[: of.shape[0]] = tables[of, lp // b] * b + lp % b

    blocks = -(-lens // b)
    first_block = np.cumsum(blocks) - blocks
    of = np.repeat(seq, blocks * b)
    p = np.arange(of.shape[0], dtype=np.int64) - np.repeat(first_block * b, blocks * b)
    owner = (p // i) % d
    row = owner * m + first[owner, of] + (p // (i * d)) * i + p % i
    source = np.where(p < lens[of], row, 0)
    width = int(blocks.max()) if num_seqs else 0
    last = max(int(blocks.sum()) - 1, 0)
    new_tables = np.minimum(first_block[:, None] + np.arange(width, dtype=np.int64), last)
    return ContextPlan(send_slots, source, new_tables)


class ContextTensors(NamedTuple):
    send_slots: torch.Tensor  # [M]
    source: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [R, max_blocks]: the reassembled blocks, by batch row
    row_context_lens: torch.Tensor  # [N]: keys each local row reads of its whole context


class ContextGather:
    """What the context path needs on one rank for one step, from the global batch
    (``slots`` builds it). The index tensors are made once, on first use, and shared by
    every layer and by a draft prefill over the same rows."""

    def __init__(
        self,
        layout: BatchLayout,
        seq_lens: np.ndarray,
        block_tables: np.ndarray,
        row_context_lens: np.ndarray,
        *,
        block_size: int,
        dcp_size: int,
        dcp_rank: int,
        interleave: int,
        device: torch.device,
    ) -> None:
        self.layout = layout
        self.seq_lens = np.asarray(seq_lens, dtype=np.int64)  # [R]: num_computed + num_scheduled
        self.block_tables = block_tables  # [R, max_blocks]: the global batch's
        self.row_context_lens = row_context_lens  # [N]: local rows, position + 1 (0: padding)
        self.block_size, self.interleave = block_size, interleave
        self.dcp_size, self.dcp_rank, self.device = dcp_size, dcp_rank, device

    @cached_property
    def tensors(self) -> ContextTensors:
        reqs = rest_requests(self.layout)
        plan = context_gather_plan(
            self.seq_lens[reqs],
            self.block_tables[reqs],
            block_size=self.block_size,
            dcp_size=self.dcp_size,
            dcp_rank=self.dcp_rank,
            interleave=self.interleave,
        )
        # NOTE: rows keep their batch request index; other requests' rows are never read.
        tables = np.zeros((self.seq_lens.shape[0], plan.block_tables.shape[1]), dtype=np.int64)
        tables[reqs] = plan.block_tables

        def to(a: np.ndarray) -> torch.Tensor:
            return int64_tensor(a, self.device)

        return ContextTensors(
            to(plan.send_slots), to(plan.source), to(tables), to(self.row_context_lens)
        )
