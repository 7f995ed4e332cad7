"""Paged-KV slot arithmetic, with the KV cache optionally sharded over DCP ranks.

Pure numpy (no torch), vectorized. With DCP size D and interleave I, the positions of a
request are dealt to the DCP ranks in runs of I: position p lives on rank (p // I) % D,
packed densely into that rank's blocks. D=2, I=2::

    position:       0 1 2 3 4 5 6 7 8 9
    dcp owner:      0 0 1 1 0 0 1 1 0 0
    local position: 0 1 0 1 2 3 2 3 4 5

Since I divides the block size B, the owner's block index is ``p // (B*D)`` on every
rank: one block table row ("virtual blocks" of B*D positions) serves all DCP ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

if TYPE_CHECKING:
    from pcpflow.layouts.layout import BatchLayout

PAD_SLOT_ID = -1


def dcp_owner(positions, dcp_size: int, interleave: int) -> np.ndarray:
    """DCP rank that stores the KV of each position: ``(p // I) % D``."""
    _check_dcp(dcp_size, 0, interleave)
    return (np.asarray(positions, dtype=np.int64) // interleave) % dcp_size


def dcp_local_positions(positions, dcp_size: int, interleave: int) -> np.ndarray:
    """Index of each position inside its owner's dense shard: ``(p // (I*D)) * I + p % I``."""
    _check_dcp(dcp_size, 0, interleave)
    p = np.asarray(positions, dtype=np.int64)
    return (p // (interleave * dcp_size)) * interleave + p % interleave


def dcp_global_positions(local_positions, dcp_size: int, dcp_rank: int, interleave: int) -> np.ndarray:
    """The position of each entry ``lp`` of ``dcp_rank``'s dense shard (the inverse of
    ``dcp_local_positions`` on that rank): ``(lp // I) * I*D + rank * I + lp % I``."""
    _check_dcp(dcp_size, dcp_rank, interleave)
    lp = np.asarray(local_positions, dtype=np.int64)
    return (lp // interleave) * (interleave * dcp_size) + dcp_rank * interleave + lp % interleave


def dcp_local_seq_lens(seq_lens, dcp_size: int, dcp_rank: int, interleave: int) -> np.ndarray:
    """How many of the positions ``[0, L)`` of each sequence ``dcp_rank`` stores."""
    _check_dcp(dcp_size, dcp_rank, interleave)
    lens = np.asarray(seq_lens, dtype=np.int64)
    period = interleave * dcp_size
    # NOTE: minimum/maximum, not np.clip: the same, at a fraction of its overhead on short arrays
    tail = np.minimum(np.maximum(lens % period - dcp_rank * interleave, 0), interleave)
    return (lens // period) * interleave + tail


def window_starts(positions, window: int | None, kind: str = "sliding") -> np.ndarray:
    """int64: the first key a row at each position sees through a sliding window of
    ``window`` keys (itself included: ``max(0, position + 1 - window)``), or, ``kind="chunked"``,
    through chunks of ``window`` positions (its chunk's first: ``position - position % window``,
    Llama 4's chunked attention); 0 without one."""
    pos = np.asarray(positions, dtype=np.int64)
    if window is None:
        return np.zeros_like(pos)
    if kind == "chunked":
        return pos - pos % window
    if kind != "sliding":
        raise ValueError(f"window kind must be 'sliding' or 'chunked', got {kind!r}")
    return np.maximum(pos + 1 - window, 0)


@dataclass(frozen=True)
class Window:
    """The keys a windowed layer's rows see: the last ``size`` (``sliding``: Mistral's and
    Gemma's sliding layers) or their own chunk of ``size`` positions up to themselves
    (``chunked``: Llama 4's chunked attention). ``window=`` takes one of these, or an int for a
    sliding window of that size."""

    size: int
    kind: Literal["sliding", "chunked"] = "sliding"

    def starts(self, positions) -> np.ndarray:
        """int64: each row's first key (``window_starts``)."""
        return window_starts(positions, self.size, self.kind)

    @property
    def chunked(self) -> bool:
        return self.kind == "chunked"


def as_window(window: Window | int | None, kind: str = "sliding") -> Window | None:
    """``window`` as a ``Window`` (an int: ``kind``'s window of that size); None stays None."""
    if window is None or isinstance(window, Window):
        return window
    return Window(int(window), kind)


def chunk_runs(first, rows, size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Runs of ``rows`` rows at positions ``first ..`` cut where chunks of ``size`` positions
    begin (a chunked window's): (run, first position, rows, the chunk's first position), int64
    [pieces] each, in run order; every row of a piece sees the keys ``chunk start .. itself``."""
    first = np.asarray(first, dtype=np.int64).reshape(-1)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    c0 = first // size
    count = np.where(rows > 0, (first + rows - 1) // size - c0 + 1, 0)
    run = np.repeat(np.arange(first.shape[0], dtype=np.int64), count)
    chunk = c0[run] + np.arange(run.shape[0], dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
    start = chunk * size
    lo = np.maximum(start, first[run])
    return run, lo, np.minimum(start + size, first[run] + rows[run]) - lo, start


def dcp_shard_lens(seq_lens, dcp_size: int, interleave: int) -> np.ndarray:
    """``[dcp_size, n]``: ``dcp_local_seq_lens`` of every DCP rank at once."""
    _check_dcp(dcp_size, 0, interleave)
    lens = np.asarray(seq_lens, dtype=np.int64).reshape(1, -1)
    ranks = np.arange(dcp_size, dtype=np.int64)[:, None]
    period = interleave * dcp_size
    return (lens // period) * interleave + np.minimum(np.maximum(lens % period - ranks * interleave, 0), interleave)


def dcp_shard_len_sums(x, dcp_size: int, interleave: int) -> np.ndarray:
    """``[dcp_size, n]``: ``sum_{y=1}^{x} dcp_local_seq_lens(y)`` of every DCP rank, the pairs
    rows at positions ``0 .. x-1`` score over each shard (a row at position ``q`` sees the
    shard's entries ``<= q``). Equal to ``x * L(x) - (sum of the shard's positions below x)``,
    ``L = dcp_local_seq_lens``; the shard's i-th entry sits at ``(i // I) * D * I + rank * I + i % I``."""
    x = np.asarray(x, dtype=np.int64)
    ll = dcp_shard_lens(x, dcp_size, interleave)
    i_ = interleave
    q, s = ll // i_, ll % i_
    sum_div = i_ * q * (q - 1) // 2 + s * q  # sum_{i < ll} i // I
    sum_mod = q * i_ * (i_ - 1) // 2 + s * (s - 1) // 2  # sum_{i < ll} i % I
    ranks = np.arange(dcp_size, dtype=np.int64)[:, None]
    return x[None, :] * ll - (dcp_size * i_ * sum_div + ranks * i_ * ll + sum_mod)


def compute_slot_mapping(
    positions,
    req_indices,
    block_tables,
    block_size: int,
    *,
    dcp_size: int = 1,
    dcp_rank: int = 0,
    interleave: int = 1,
) -> np.ndarray:
    """KV slot of each token on ``dcp_rank``; ``PAD_SLOT_ID`` where another rank stores it.

    ``block_tables[r, v]`` is the block holding virtual block ``v`` (positions
    ``[v*B*D, (v+1)*B*D)``) of request ``r`` on this DCP rank.
    """
    _check_dcp(dcp_size, dcp_rank, interleave)
    if block_size < 1:
        raise ValueError(f"block_size ({block_size}) must be >= 1")
    if block_size % interleave:
        raise ValueError(f"interleave ({interleave}) must divide block_size ({block_size})")
    pos = np.asarray(positions, dtype=np.int64)
    req = np.asarray(req_indices, dtype=np.int64)
    if pos.shape != req.shape:
        raise ValueError(f"positions {pos.shape} and req_indices {req.shape} differ in shape")
    tables = np.asarray(block_tables)
    if tables.ndim != 2:
        raise ValueError(f"block_tables must be 2-D [num_reqs, max_blocks], got {tables.shape}")
    if pos.size and pos.min() < 0:
        raise ValueError(f"positions must be >= 0, got {int(pos.min())}")
    if dcp_size == 1:
        return tables[req, pos // block_size].astype(np.int64) * block_size + pos % block_size
    # NOTE: look up owned positions only: another rank's position may lie past the blocks
    # this rank has allocated for the request.
    owned = (pos // interleave) % dcp_size == dcp_rank
    local = dcp_local_positions(pos[owned], dcp_size, interleave)
    slots = np.full(pos.shape, PAD_SLOT_ID, dtype=np.int64)
    slots[owned] = tables[req[owned], local // block_size] * block_size + local % block_size
    return slots


def expand_to_gathered(slot_mapping, layout: BatchLayout) -> np.ndarray:
    """A global-batch slot mapping ``[..., T]`` in the layout's padded gathered view.

    Only each token's canonical KV writer row keeps its slot; replicas and padding get
    ``PAD_SLOT_ID``, so every token is written exactly once.
    """
    slots = np.asarray(slot_mapping, dtype=np.int64)
    if slots.shape[-1:] != (layout.num_tokens,):
        raise ValueError(
            f"slot_mapping has {slots.shape[-1] if slots.ndim else 0} tokens, "
            f"the layout {layout.num_tokens}"
        )
    if layout.num_tokens == 0:
        return np.full(slots.shape[:-1] + layout.kv_write_mask.shape, PAD_SLOT_ID, np.int64)
    return np.where(layout.kv_write_mask, slots[..., layout.padded_gather_idx], PAD_SLOT_ID)


def _check_dcp(dcp_size: int, dcp_rank: int, interleave: int) -> None:
    if dcp_size < 1:
        raise ValueError(f"dcp_size ({dcp_size}) must be >= 1")
    if not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank ({dcp_rank}) must be in [0, dcp_size ({dcp_size}))")
    if interleave < 1:
        raise ValueError(f"interleave ({interleave}) must be >= 1")
