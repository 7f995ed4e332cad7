"""buffers: this rank's batch, staged in persistent preallocated buffers.

Capacity is fixed at start: ``max_num_batched_tokens`` token rows and
``2 * max_num_seqs`` segments (a request has at most two chunks on one rank), so a step
never allocates and a graph-captured forward could replay on the same storage.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from pcpflow.layouts.tensors import int64_tensor
from pcpflow.pipeline.stage import Stage, StageConfig, register
from pcpflow.pipeline.state import LocalBatch, StepState


@register
class PersistentBuffers(Stage):
    kind = "persistent"
    slots = ("buffers",)

    class Config(StageConfig):
        kind: Literal["persistent"] = "persistent"

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        sched, dev = ctx.config.scheduler, ctx.device
        self.max_tokens = sched.max_num_batched_tokens
        self.max_segments = 2 * sched.max_num_seqs
        i64 = dict(dtype=torch.int64, device=dev)
        self.input_ids = torch.zeros(self.max_tokens, **i64)
        self.positions = torch.zeros(self.max_tokens, **i64)
        self.token_req_indices = torch.zeros(self.max_tokens, **i64)
        self.is_padding = torch.ones(self.max_tokens, dtype=torch.bool, device=dev)
        self.query_start_loc = torch.zeros(self.max_segments + 1, **i64)
        self.seq_lens = torch.zeros(self.max_segments, **i64)
        self.segment_req_indices = torch.zeros(self.max_segments, **i64)

    def __call__(self, state: StepState) -> StepState:
        layout, b, rank = state.layout, state.batch, self.ctx.pcp_rank
        assert layout is not None, "buffers runs after plan"
        n = layout.padded_num_tokens
        seg = layout.segments[rank]
        if n > self.max_tokens or len(seg) > self.max_segments:
            raise RuntimeError(
                f"rank-local batch of {n} rows / {len(seg)} segments exceeds the buffers "
                f"({self.max_tokens} rows = scheduler.max_num_batched_tokens, "
                f"{self.max_segments} segments = 2 * scheduler.max_num_seqs)"
            )
        rows = layout.rank_rows(rank)
        gather, pad = layout.padded_gather_idx[rows], layout.is_padding[rows]
        _put(self.input_ids, np.where(pad, 0, b.input_ids[gather]))
        _put(self.positions, np.where(pad, 0, b.positions[gather]))
        _put(self.token_req_indices, np.where(pad, 0, b.req_indices[gather]))
        self.is_padding[:n].copy_(torch.from_numpy(pad))

        s = len(seg)
        qsl = np.zeros(s + 1, dtype=np.int64)
        np.cumsum(seg.length, out=qsl[1:])
        # A chunk attends to everything before it: seq_len = its last position + 1.
        first_pos = b.num_computed_tokens[seg.req_idx] + seg.global_start - b.query_start_loc[seg.req_idx]
        _put(self.query_start_loc, qsl)
        _put(self.seq_lens, first_pos + seg.length)
        _put(self.segment_req_indices, seg.req_idx)
        state.local = LocalBatch(
            num_tokens=int(layout.per_rank_num_tokens[rank]),
            num_padded_tokens=n,
            input_ids=self.input_ids[:n],
            positions=self.positions[:n],
            token_req_indices=self.token_req_indices[:n],
            is_padding=self.is_padding[:n],
            query_start_loc=self.query_start_loc[: s + 1],
            seq_lens=self.seq_lens[:s],
            segment_req_indices=self.segment_req_indices[:s],
            gather_idx=gather,
        )
        return state


def _put(buf: torch.Tensor, values: np.ndarray) -> None:
    buf[: len(values)].copy_(int64_tensor(values))
