"""The step state: one object flows through the pipeline's slots each step.

Each stage reads what earlier stages wrote and fills its own fields; no stage reaches
into another's internals. ``extras`` is free space for user stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from pcpflow.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    import torch

    from pcpflow.layouts.layout import BatchLayout
    from pcpflow.scheduling.batch import GlobalBatch


@dataclass(frozen=True)
class BatchDescriptor:
    """How one step runs: ``runtime_mode`` none | piecewise | full, at ``num_tokens`` rows
    per rank (None: unpadded, the largest rank's count)."""

    runtime_mode: Literal["none", "piecewise", "full"]
    num_tokens: int | None


@dataclass
class LocalBatch:
    """The rank-local batch (views into persistent buffers), written by ``buffers``.

    Rows are this rank's tokens in local order (decodes first, then prefills) followed
    by padding up to ``num_padded_tokens``. Each *segment* (a contiguous run of one
    request's tokens on this rank) is one local request row.
    """

    num_tokens: int
    num_padded_tokens: int
    input_ids: torch.Tensor  # int64 [num_padded_tokens]; 0 on padding
    positions: torch.Tensor  # int64 [num_padded_tokens]; 0 on padding
    token_req_indices: torch.Tensor  # int64 [num_padded_tokens]: global batch row; 0 on padding
    is_padding: torch.Tensor  # bool [num_padded_tokens]
    query_start_loc: torch.Tensor  # int64 [num_segments + 1]
    seq_lens: torch.Tensor  # int64 [num_segments]: segment's last position + 1
    segment_req_indices: torch.Tensor  # int64 [num_segments]: global batch row
    gather_idx: np.ndarray  # int64 [num_padded_tokens]: global token of each local row


@dataclass
class StepState:
    """Everything one step knows, filled slot by slot."""

    batch: GlobalBatch
    layout: BatchLayout | None = None
    dispatch: BatchDescriptor | None = None  # the step's CUDA-graph mode and size (plan)
    local: LocalBatch | None = None
    attn: AttentionMetadata | None = None  # group 0's with KV groups (``attn_groups``)
    # a hybrid KV cache's metadata, one per KV group (``RankContext.kv_groups``; ``attn`` is
    # the first): each group's layers write and read through its own block tables; None: one group
    attn_groups: tuple[AttentionMetadata, ...] | None = None
    hidden: torch.Tensor | None = None  # [num_padded_tokens, hidden]: local final hidden
    aux_hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> local
    restored_hidden: torch.Tensor | None = None  # [T, hidden]: the global batch (all_rows)
    sample_hidden: torch.Tensor | None = None  # [S, hidden]: restored rows to sample
    logits: torch.Tensor | None = None  # [S, vocab]
    scores: torch.Tensor | None = None  # [S, vocab]: the logits a repetition penalty changed (None: the logits)
    sampled_token_ids: np.ndarray | None = None  # int64 [S]
    draft_token_ids: np.ndarray | None = None  # int64 [R, k], -1 = none proposed
    timings: dict[str, float] = field(default_factory=dict)  # stage name -> seconds
    extras: dict[str, Any] = field(default_factory=dict)
