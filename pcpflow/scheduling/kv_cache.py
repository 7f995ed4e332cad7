"""Paged KV-cache bookkeeping: a deterministic block allocator and per-request block tables.

Every rank runs the same allocator on the same call sequence, so every rank hands out the
same block ids: free blocks are taken lowest id first. Under DCP a block-table entry is a
*virtual block* of ``block_size * dcp_size`` positions; each DCP rank stores its
``block_size`` of them in its own physical block with the same id, so one table serves
every DCP rank (``pcpflow.layouts.slots`` maps a position to its rank and slot).
"""

from __future__ import annotations

import numpy as np

from pcpflow.errors import Problem

SHOWN_PROBLEMS = 5


def fit_problems(
    prompt_lens,
    output_lens,
    *,
    num_speculative_tokens: int,
    block_size: int,
    dcp_size: int,
    num_blocks: int,
    max_blocks_per_req: int | None = None,
) -> list[Problem]:
    """The one rule for "can this request ever fit": its prompt, every output token and the
    speculative lookahead, alone in the cache (``num_blocks``, or ``max_blocks_per_req`` when
    smaller). A request that cannot would wait forever. Problems (``kv.num_blocks``) name the
    first few such requests and count the rest; arrays of lengths in, no cache built."""
    tokens_per_block = block_size * dcp_size
    limit = num_blocks if max_blocks_per_req is None else min(num_blocks, max_blocks_per_req)
    prompt = np.asarray(prompt_lens, dtype=np.int64)
    output = np.asarray(output_lens, dtype=np.int64)
    need = -(-(prompt + output + num_speculative_tokens) // tokens_per_block)
    bad = np.flatnonzero(need > limit)
    problems = []
    for i in bad[:SHOWN_PROBLEMS].tolist():
        extra = (f" (and max_blocks_per_req, {max_blocks_per_req}, too)"
                 if max_blocks_per_req is not None and need[i] > max_blocks_per_req else "")
        problems.append(Problem(
            "kv.num_blocks", num_blocks,
            f"workload request {i} needs {need[i]} blocks ({prompt[i]} prompt + {output[i]} output + "
            f"{num_speculative_tokens} speculative tokens at {tokens_per_block} tokens per block); "
            f"kv.num_blocks must be >= {need[i]}{extra}",
        ))
    if len(bad) > SHOWN_PROBLEMS:
        problems.append(Problem("kv.num_blocks", num_blocks, f"... and {len(bad) - SHOWN_PROBLEMS} more requests do not "
                                f"fit; the largest needs {int(need.max())} blocks"))
    return problems


class KVCacheManager:
    """Block allocator over ``num_blocks`` blocks (ids ``0..num_blocks-1``).

    Block tables live in one persistent ``[rows, width]`` array; each request holding
    blocks owns a row (rows are recycled), so ``block_tables`` is a single gather.
    Request ids must be non-negative ints (workload request indices).
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        dcp_size: int = 1,
        max_blocks_per_req: int | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1 or dcp_size < 1:
            raise ValueError(
                f"num_blocks ({num_blocks}), block_size ({block_size}) and dcp_size "
                f"({dcp_size}) must all be >= 1"
            )
        if max_blocks_per_req is not None and max_blocks_per_req < 1:
            raise ValueError(f"max_blocks_per_req ({max_blocks_per_req}) must be >= 1 or None")
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.dcp_size = int(dcp_size)
        self.tokens_per_block = self.block_size * self.dcp_size
        self.max_blocks_per_req = (
            self.num_blocks if max_blocks_per_req is None else int(max_blocks_per_req)
        )
        self._is_free = np.ones(self.num_blocks, dtype=bool)
        self._num_free = self.num_blocks
        # NOTE: the table grows by doubling (rows and width) so that memory follows the
        # live requests, not num_blocks x every request id ever seen.
        self._table = np.zeros((4, 4), dtype=np.int64)
        self._row_num_blocks = np.zeros(4, dtype=np.int64)
        self._free_rows: list[int] = [3, 2, 1, 0]  # popped lowest first
        self._row_of = np.full(16, -1, dtype=np.int64)  # req_id -> row, -1 = none

    # -- queries ---------------------------------------------------------------------------

    def blocks_needed(self, num_tokens):
        """Blocks (table entries) that hold ``num_tokens`` positions; int or int64 array."""
        n = np.asarray(num_tokens, dtype=np.int64)
        blocks = -(-n // self.tokens_per_block)
        return int(blocks) if blocks.ndim == 0 else blocks

    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    def num_blocks_of(self, req_id: int) -> int:
        """Blocks currently held by ``req_id`` (0 if it holds none)."""
        row = self._row(req_id)
        return 0 if row < 0 else int(self._row_num_blocks[row])

    def fit_problems(self, prompt_lens, output_lens, num_speculative_tokens: int = 0) -> list[Problem]:
        """``fit_problems`` of this cache (the module's one rule)."""
        return fit_problems(prompt_lens, output_lens, num_speculative_tokens=num_speculative_tokens,
                            block_size=self.block_size, dcp_size=self.dcp_size, num_blocks=self.num_blocks,
                            max_blocks_per_req=self.max_blocks_per_req)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks yet could get room for ``num_tokens``."""
        need = self.blocks_needed(num_tokens)
        return need <= self._num_free and need <= self.max_blocks_per_req

    # -- mutation --------------------------------------------------------------------------

    def allocate(self, req_id: int, num_tokens: int) -> None:
        """Grow ``req_id``'s table to hold ``num_tokens`` positions (no-op if it already does)."""
        req_id = int(req_id)
        if req_id < 0:
            raise ValueError(f"req_id must be >= 0, got {req_id}")
        need = self.blocks_needed(num_tokens)
        if need > self.max_blocks_per_req:
            raise RuntimeError(
                f"request {req_id} needs {need} blocks for {num_tokens} tokens, more than "
                f"max_blocks_per_req ({self.max_blocks_per_req})"
            )
        row = self._row(req_id)
        have = 0 if row < 0 else int(self._row_num_blocks[row])
        extra = need - have
        if extra <= 0:
            if row < 0:
                self._claim_row(req_id)
            return
        if extra > self._num_free:
            raise RuntimeError(
                f"request {req_id} needs {extra} more blocks for {num_tokens} tokens, "
                f"only {self._num_free} of {self.num_blocks} are free"
            )
        if row < 0:
            row = self._claim_row(req_id)
        self._ensure_width(need)
        new_blocks = np.flatnonzero(self._is_free)[:extra]
        self._is_free[new_blocks] = False
        self._num_free -= extra
        self._table[row, have:need] = new_blocks
        self._row_num_blocks[row] = need

    def allocate_many(self, req_ids, num_tokens) -> None:
        """``allocate(req_ids[i], num_tokens[i])`` for every i, in order, as array operations
        (a Python step only per request that holds no blocks yet)."""
        ids = np.asarray(req_ids, dtype=np.int64).reshape(-1)
        need = self.blocks_needed(np.asarray(num_tokens, dtype=np.int64).reshape(-1))
        if ids.shape != need.shape:
            raise ValueError(f"{len(ids)} req_ids but {len(need)} num_tokens")
        if not len(ids):
            return
        if ids.min() < 0:
            raise ValueError(f"req_id must be >= 0, got {int(ids.min())}")
        if len(np.unique(ids)) != len(ids):
            raise ValueError(f"req_ids must be distinct, got {ids.tolist()}")
        if need.max() > self.max_blocks_per_req:
            i = int(np.argmax(need))
            raise RuntimeError(
                f"request {ids[i]} needs {need[i]} blocks, more than max_blocks_per_req "
                f"({self.max_blocks_per_req})"
            )
        known = ids < len(self._row_of)
        rows = np.where(known, self._row_of[np.where(known, ids, 0)], -1)
        have = np.where(rows >= 0, self._row_num_blocks[rows], 0)
        extra = np.maximum(need - have, 0)
        total = int(extra.sum())
        if total > self._num_free:
            raise RuntimeError(
                f"requests {ids.tolist()} need {total} more blocks, only {self._num_free} of "
                f"{self.num_blocks} are free"
            )
        for i in np.flatnonzero(rows < 0).tolist():
            rows[i] = self._claim_row(int(ids[i]))
        self._ensure_width(int(need.max()))
        # Lowest free ids first, handed out in request order: what allocate() in a loop does.
        new_blocks = np.flatnonzero(self._is_free)[:total]
        self._is_free[new_blocks] = False
        self._num_free -= total
        owner = np.repeat(np.arange(len(ids)), extra)
        column = np.arange(total) - (extra.cumsum() - extra)[owner] + have[owner]
        self._table[rows[owner], column] = new_blocks
        self._row_num_blocks[rows] = np.maximum(need, have)

    def free(self, req_id: int) -> np.ndarray:
        """Release every block of ``req_id``; returns their ids in table order."""
        row = self._row(req_id)
        if row < 0:
            raise KeyError(f"request {req_id} holds no KV blocks")
        n = int(self._row_num_blocks[row])
        freed = self._table[row, :n].copy()
        self._is_free[freed] = True
        self._num_free += n
        self._table[row, :n] = 0
        self._row_num_blocks[row] = 0
        self._row_of[req_id] = -1
        self._free_rows.append(row)
        self._free_rows.sort(reverse=True)
        return freed

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        """int64 ``[R, W]`` block tables of ``req_ids``; W = most blocks among them (>= 1),
        unused entries 0."""
        ids = np.asarray(req_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._row_of)):
            raise KeyError(f"unknown request ids in {ids.tolist()}")
        rows = self._row_of[ids]
        if (rows < 0).any():
            raise KeyError(f"requests {ids[rows < 0].tolist()} hold no KV blocks")
        width = max(1, int(self._row_num_blocks[rows].max(initial=0)))
        return self._table[rows, :width].copy()

    # -- internals -------------------------------------------------------------------------

    def _row(self, req_id: int) -> int:
        req_id = int(req_id)
        return int(self._row_of[req_id]) if 0 <= req_id < len(self._row_of) else -1

    def _claim_row(self, req_id: int) -> int:
        if req_id >= len(self._row_of):
            grown = np.full(max(2 * len(self._row_of), req_id + 1), -1, dtype=np.int64)
            grown[: len(self._row_of)] = self._row_of
            self._row_of = grown
        if not self._free_rows:
            rows, width = self._table.shape
            self._table = np.concatenate([self._table, np.zeros((rows, width), np.int64)])
            self._row_num_blocks = np.concatenate([self._row_num_blocks, np.zeros(rows, np.int64)])
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        row = self._free_rows.pop()
        self._row_of[req_id] = row
        return row

    def _ensure_width(self, width: int) -> None:
        rows, have = self._table.shape
        if width > have:
            new_width = min(max(2 * have, width), self.max_blocks_per_req)
            grown = np.zeros((rows, new_width), dtype=np.int64)
            grown[:, :have] = self._table
            self._table = grown
