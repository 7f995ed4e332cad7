"""Paged KV-cache bookkeeping, as vLLM's KV cache manager does it: a block pool with reference
counts, a least-recently-used free queue and (``prefix_caching``) full blocks found again by
the chained hash of their tokens.

Every rank runs the same manager on the same call sequence, so every rank hands out the same
block ids. Under DCP a block-table entry is a *virtual block* of ``block_size * dcp_size``
positions; each DCP rank stores its ``block_size`` of them in its own physical block with
the same id, so one table serves every DCP rank (``pcpflow.layouts.slots`` maps a position to
its rank and slot), and one hash covers every DCP shard of the entry.

The pool (vLLM's ``BlockPool``):
- a block is *in use* while a request holds it (``ref_count > 0``; a prefix hit shares a
  block between requests), else *free*;
- free blocks wait in a queue, oldest first: blocks never used in id order, then blocks in
  the order they were freed (a request frees its blocks last block first, so that a
  prompt's tail is evicted before its head). Allocation takes from the front;
- with prefix caching, a full block keeps its hash while free: a later request whose
  prefix has that hash takes it back out of the queue (a *hit*), until allocation reaches
  it at the front of the queue and evicts it (the hash is forgotten).

The queue is an array with lazy deletion (a hit leaves its stale entry behind; an entry is
live while its sequence number is the block's), so taking k blocks and freeing a request
are array operations. The hash -> block dict holds exactly the cached blocks (an evicted
block's entry goes with it), so Python-level work runs per newly cached, looked-up or
evicted block only; and a block whose hash only its own request
can ever ask for (``RequestTable.private_from``: a simulated run knows every prompt) holds
it without an entry until that request is preempted.
"""

from __future__ import annotations

import collections
import heapq

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
    smaller). A request that cannot would wait forever; one that can always runs, since
    the scheduler preempts every later request for it. Problems (``kv.num_blocks``) name the
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
    """Block pool over ``num_blocks`` blocks (ids ``0..num_blocks-1``) and the requests'
    block tables.

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
        *,
        prefix_caching: bool = False,
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
        self.prefix_caching = bool(prefix_caching)
        self.max_blocks_per_req = (
            self.num_blocks if max_blocks_per_req is None else int(max_blocks_per_req)
        )
        n = self.num_blocks
        self._ref = np.zeros(n, dtype=np.int64)  # requests holding each block
        self._hash = np.zeros(n, dtype=np.uint64)  # 0 = not cached
        # NOTE: hash -> the block holding it, for every cached block but the private ones
        # below; an evicted block's entry goes with it (``_take``).
        self._cached: dict[int, int] = {}
        self._num_cached = 0
        # NOTE: cached blocks whose hash only their own request can ask for (``cache_block_ids``'
        # ``private``) stay out of the dict until that request is preempted (``index``).
        self._unindexed = np.zeros(n, dtype=bool)
        # The free queue: entries [head, tail) of _queue, live while _qseq matches _seq_of.
        self._queue = np.arange(n, dtype=np.int64)
        self._qseq = np.arange(n, dtype=np.int64)
        self._seq_of = np.arange(n, dtype=np.int64)  # a free block's live entry; -1 in use
        self._head, self._tail, self._next_seq = 0, n, n
        self._num_free = n
        self.num_evicted = 0
        # NOTE: the table grows by doubling (rows and width) so that memory follows the
        # live requests, not num_blocks x every request id ever seen.
        self._table = np.zeros((4, 4), dtype=np.int64)
        self._row_num_blocks = np.zeros(4, dtype=np.int64)
        self._free_rows: list[int] = [0, 1, 2, 3]  # a heap: popped lowest first
        self._row_of = np.full(16, -1, dtype=np.int64)  # req_id -> row, -1 = none

    # -- queries ---------------------------------------------------------------------------

    def blocks_needed(self, num_tokens):
        """Blocks (table entries) that hold ``num_tokens`` positions; int or int64 array."""
        n = np.asarray(num_tokens, dtype=np.int64)
        blocks = -(-n // self.tokens_per_block)
        return int(blocks) if blocks.ndim == 0 else blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached ones included: they are evicted when needed)."""
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Blocks holding a hash, in use or free."""
        return self._num_cached

    def num_blocks_of(self, req_id: int) -> int:
        """Blocks currently held by ``req_id`` (0 if it holds none)."""
        row = self._row(req_id)
        return 0 if row < 0 else int(self._row_num_blocks[row])

    def num_blocks_of_many(self, req_ids) -> np.ndarray:
        """``num_blocks_of`` each of ``req_ids`` (int64 array)."""
        rows = self._rows_of(np.asarray(req_ids, dtype=np.int64))
        return np.where(rows >= 0, self._row_num_blocks[rows], 0)

    def num_blocks_held(self, req_ids: np.ndarray) -> np.ndarray:
        """``num_blocks_of_many`` of requests that each hold blocks (int64 ``req_ids``): the
        scheduler's running requests, without the checks for ids holding none."""
        return self._row_num_blocks[self._row_of[req_ids]]

    def blocks_of(self, req_id: int) -> np.ndarray:
        """The blocks ``req_id`` holds, in table order (a copy)."""
        row = self._row(req_id)
        return np.zeros(0, np.int64) if row < 0 else self._table[row, : self._row_num_blocks[row]].copy()

    def ref_counts(self) -> np.ndarray:
        return self._ref.copy()

    def free_queue(self) -> np.ndarray:
        """The free blocks in eviction order (front first)."""
        ids, seqs = self._queue[self._head:self._tail], self._qseq[self._head:self._tail]
        return ids[self._seq_of[ids] == seqs]

    def block_hash(self, block: int) -> int | None:
        h = int(self._hash[block])
        return h or None

    def fit_problems(self, prompt_lens, output_lens, num_speculative_tokens: int = 0) -> list[Problem]:
        """``fit_problems`` of this cache (the module's one rule)."""
        return fit_problems(prompt_lens, output_lens, num_speculative_tokens=num_speculative_tokens,
                            block_size=self.block_size, dcp_size=self.dcp_size, num_blocks=self.num_blocks,
                            max_blocks_per_req=self.max_blocks_per_req)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks yet could get room for ``num_tokens``."""
        need = self.blocks_needed(num_tokens)
        return need <= self._num_free and need <= self.max_blocks_per_req

    # -- prefix cache ----------------------------------------------------------------------

    def find_cached(self, hashes, max_blocks: int) -> np.ndarray:
        """The blocks of the longest cached prefix of a request whose full blocks have the
        chained ``hashes`` (at most ``max_blocks``): one dict lookup per block, up to the
        first miss. Changes nothing (``allocate(..., cached=...)`` takes them)."""
        if not self.prefix_caching or not self._num_cached or max_blocks <= 0:
            return np.zeros(0, dtype=np.int64)
        hashes = np.asarray(hashes, dtype=np.uint64)
        found: list[np.ndarray] = []
        start, size = 0, 16
        while start < max_blocks:  # NOTE: in growing chunks, so that a miss stops the lookups early
            keys = hashes[start:min(start + size, max_blocks)]
            chunk = list(map(self._cached.get, keys.tolist()))
            end = chunk.index(None) if None in chunk else len(chunk)
            found.append(np.asarray(chunk[:end], dtype=np.int64))
            if end < len(keys):
                break
            start, size = start + size, 2 * size
        return found[0] if len(found) == 1 else np.concatenate(found)

    def finds_again(self, hashes, max_blocks: int, blocks: np.ndarray) -> bool:
        """Whether ``find_cached(hashes, max_blocks)`` still answers ``blocks``, an earlier
        answer: each still holds its hash (so the cache still maps it there) and the first
        miss after them is still one."""
        n = len(blocks)
        if n and not (self._hash[blocks] == hashes[:n]).all():
            return False
        return n >= min(max_blocks, len(hashes)) or not self._holds(hashes[n].item())

    def _holds(self, h: int) -> bool:
        """Whether an indexed block holds hash ``h``."""
        return h in self._cached

    def evictable(self, blocks: np.ndarray) -> int:
        """How many of ``blocks`` (cached ones found by ``find_cached``) are free: taking them
        uses up free capacity as new blocks would."""
        return int(np.count_nonzero(self._ref[blocks] == 0)) if len(blocks) else 0

    def cache_blocks(self, req_id: int, first: int, hashes: np.ndarray) -> int:
        """Register ``req_id``'s full blocks ``first, first+1, ...`` under ``hashes`` (their
        chained hashes); a block already cached, or a hash another block holds, is left as
        it is. Returns the number of blocks newly cached."""
        n = len(hashes)
        return self.cache_block_ids(self.block_ids(np.full(n, req_id), np.arange(first, first + n)), hashes)

    def block_ids(self, req_ids: np.ndarray, entries: np.ndarray) -> np.ndarray:
        """The block at table entry ``entries[k]`` of request ``req_ids[k]``."""
        return self._table[self._row_of[np.asarray(req_ids, dtype=np.int64)], entries]

    def cache_block_ids(self, blocks: np.ndarray, hashes: np.ndarray, private: np.ndarray | None = None) -> int:
        """``cache_blocks`` by block id. A block holds a hash exactly while the cache maps
        that hash to it: a hash another block holds is left as it is, and of a hash computed
        twice in one call the first block wins. Per block, one ``setdefault`` (and a probe
        when a hash was cached already or came twice); the rest are array operations.

        ``private`` (bool per block): blocks whose hash no other request can compute or ask
        for (``RequestTable.private_from``), of a request never preempted: they hold their
        hash without a dict entry, until ``index`` gives them one for their own request's
        lookup. Nothing another request sees changes."""
        if not self.prefix_caching or not len(hashes):
            return 0
        hashes = np.asarray(hashes, dtype=np.uint64)
        todo = self._hash[blocks] == 0
        n_own = 0
        if private is not None:
            mine = todo & private
            n_own = int(np.count_nonzero(mine))
            if n_own:
                own = blocks[mine]
                self._hash[own] = hashes[mine]
                self._unindexed[own] = True
                self._num_cached += n_own
                todo ^= mine
        if not todo.any():  # NOTE: the usual call: every block private, or cached already
            return n_own
        if not todo.all():
            blocks, hashes = blocks[todo], hashes[todo]
        keys = hashes.tolist()
        cached = self._cached
        before = len(cached)
        # NOTE: setdefault leaves a hash another block holds where it is, and keeps the first
        # block of a hash computed twice in one call: one dict operation per block
        collections.deque(map(cached.setdefault, keys, blocks.tolist()), maxlen=0)
        if len(cached) - before < len(keys):  # rare: the blocks setdefault passed over stay uncached
            won = np.fromiter(map(cached.__getitem__, keys), dtype=np.int64, count=len(keys)) == blocks
            blocks, hashes = blocks[won], hashes[won]
        self._hash[blocks] = hashes
        self._num_cached += len(blocks)
        return n_own + len(blocks)

    def index(self, req_id: int) -> None:
        """Give ``req_id``'s private cached blocks their dict entries (before it is preempted:
        readmitted, it looks its own blocks up)."""
        row = self._row(req_id)
        if row < 0:
            return
        blocks = self._table[row, :self._row_num_blocks[row]]
        blocks = blocks[self._unindexed[blocks]]
        if len(blocks):
            self._cached.update(zip(self._hash[blocks].tolist(), blocks.tolist()))
            self._unindexed[blocks] = False

    # -- mutation --------------------------------------------------------------------------

    def allocate(self, req_id: int, num_tokens: int, cached: np.ndarray | None = None) -> None:
        """Grow ``req_id``'s table to hold ``num_tokens`` positions (no-op if it already does).
        ``cached``: blocks found by ``find_cached`` for a request holding none yet; they
        become its first table entries (shared, their reference counts raised)."""
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
        hits = np.zeros(0, np.int64) if cached is None else np.asarray(cached, dtype=np.int64)
        if len(hits) and (have or len(hits) > need):
            raise ValueError(f"cached blocks go first into an empty table of {need} blocks; "
                             f"request {req_id} holds {have}, {len(hits)} cached given")
        extra = need - have - len(hits)
        if extra + self.evictable(hits) > self._num_free:
            raise RuntimeError(
                f"request {req_id} needs {extra + self.evictable(hits)} more blocks for {num_tokens} "
                f"tokens, only {self._num_free} of {self.num_blocks} are free"
            )
        if row < 0:
            row = self._claim_row(req_id)
        if need <= have:
            return
        self._ensure_width(need)
        if len(hits):
            self._touch(hits)
            self._table[row, :len(hits)] = hits
        new_blocks = self._take(extra)
        self._table[row, have + len(hits):need] = new_blocks
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
        rows = self._rows_of(ids)
        if len(ids) > 1:
            ordered = np.sort(ids)
            if (ordered[1:] == ordered[:-1]).any():
                raise ValueError(f"req_ids must be distinct, got {ids.tolist()}")
        if need.max() > self.max_blocks_per_req:
            i = int(np.argmax(need))
            raise RuntimeError(
                f"request {ids[i]} needs {need[i]} blocks, more than max_blocks_per_req "
                f"({self.max_blocks_per_req})"
            )
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
        more = extra > 0
        if more.any():
            self.grow(ids[more], extra[more])

    def grow(self, req_ids: np.ndarray, extra: np.ndarray) -> None:
        """Running requests' step: each of ``req_ids`` (distinct, holding blocks) gets
        ``extra[k] >= 1`` more blocks, from the front of the free queue in request order (what
        ``allocate`` in a loop does): ``allocate_many`` without its checks of arguments the
        scheduler derived itself."""
        rows = self._row_of[req_ids]
        have = self._row_num_blocks[rows]
        total = int(extra.sum())
        if total > self._num_free:
            raise RuntimeError(f"{total} more blocks wanted, only {self._num_free} of {self.num_blocks} are free")
        need = have + extra
        width = int(need.max())
        if width > self.max_blocks_per_req:
            raise RuntimeError(f"a request needs {width} blocks, more than max_blocks_per_req ({self.max_blocks_per_req})")
        self._ensure_width(width)
        new_blocks = self._take(total)
        if total == len(rows):  # NOTE: the usual step: one block each
            self._table[rows, have] = new_blocks
        else:
            owner = np.repeat(np.arange(len(rows)), extra)
            self._table[rows[owner], np.arange(total) - (extra.cumsum() - extra)[owner] + have[owner]] = new_blocks
        self._row_num_blocks[rows] = need

    def free(self, req_id: int) -> np.ndarray:
        """Release every block of ``req_id``: blocks no other request holds go to the back of
        the free queue, last table entry first (cached ones keep their hash). Returns the
        blocks that became free, in that order."""
        row = self._row(req_id)
        if row < 0:
            raise KeyError(f"request {req_id} holds no KV blocks")
        n = int(self._row_num_blocks[row])
        blocks = self._table[row, :n][::-1].copy()
        self._ref[blocks] -= 1
        freed = blocks[self._ref[blocks] == 0]
        self._push(freed)
        self._table[row, :n] = 0
        self._row_num_blocks[row] = 0
        self._row_of[req_id] = -1
        heapq.heappush(self._free_rows, row)
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

    # -- the pool --------------------------------------------------------------------------

    def _take(self, k: int) -> np.ndarray:
        """The first ``k`` live blocks of the free queue, now in use by one request (a cached
        one is evicted: its hash forgotten)."""
        if k <= 0:
            return np.zeros(0, dtype=np.int64)
        out, need, head = [], k, self._head
        while need:
            end = min(self._tail, head + max(2 * need, 64))
            ids = self._queue[head:end]
            live = np.flatnonzero(self._seq_of[ids] == self._qseq[head:end])
            if len(live) >= need:
                out.append(ids[live[:need]])
                head += int(live[need - 1]) + 1
                need = 0
            else:
                out.append(ids[live])
                need -= len(live)
                head = end
                if end == self._tail and need:
                    raise AssertionError("the free queue holds fewer blocks than counted")
        self._head = head
        blocks = out[0] if len(out) == 1 else np.concatenate(out)
        self._seq_of[blocks] = -1
        self._ref[blocks] = 1
        self._num_free -= k
        if self.prefix_caching:
            hashed = blocks[self._hash[blocks] != 0]
            if len(hashed):
                indexed = hashed[~self._unindexed[hashed]]
                cached = self._cached
                for h in self._hash[indexed].tolist():  # NOTE: a loop beats map(cached.__delitem__, ...)
                    del cached[h]
                self._unindexed[hashed] = False
                self._hash[hashed] = 0  # evicted: forgotten
                self.num_evicted += len(hashed)
                self._num_cached -= len(hashed)
        return blocks

    def _touch(self, blocks: np.ndarray) -> None:
        """Cached blocks taken by a hit: out of the free queue if free, one more holder."""
        free = blocks[self._ref[blocks] == 0]
        self._seq_of[free] = -1
        self._num_free -= len(free)
        self._ref[blocks] += 1

    def _push(self, blocks: np.ndarray) -> None:
        n = len(blocks)
        if not n:
            return
        if self._tail + n > len(self._queue):
            self._compact(n)
        seqs = np.arange(self._next_seq, self._next_seq + n, dtype=np.int64)
        self._queue[self._tail:self._tail + n] = blocks
        self._qseq[self._tail:self._tail + n] = seqs
        self._seq_of[blocks] = seqs
        self._tail += n
        self._next_seq += n
        self._num_free += n

    def _compact(self, room: int) -> None:
        ids, seqs = self._queue[self._head:self._tail], self._qseq[self._head:self._tail]
        live = self._seq_of[ids] == seqs
        ids, seqs = ids[live], seqs[live]
        size = max(2 * (len(ids) + room), self.num_blocks + room)
        self._queue = np.zeros(size, dtype=np.int64)
        self._qseq = np.zeros(size, dtype=np.int64)
        self._queue[:len(ids)], self._qseq[:len(ids)] = ids, seqs
        self._head, self._tail = 0, len(ids)

    # -- internals -------------------------------------------------------------------------

    def _rows_of(self, ids: np.ndarray) -> np.ndarray:
        """The table row of each of ``ids`` (non-negative), -1 where none."""
        if not len(ids) or int(ids.max()) < len(self._row_of):
            return self._row_of[ids]
        known = ids < len(self._row_of)
        return np.where(known, self._row_of[np.where(known, ids, 0)], -1)

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
            # NOTE: np.zeros maps its pages lazily: only the rows copied (and later used) are touched
            grown = np.zeros((2 * rows, width), dtype=np.int64)
            grown[:rows] = self._table
            self._table = grown
            self._row_num_blocks = np.concatenate([self._row_num_blocks, np.zeros(rows, np.int64)])
            self._free_rows = list(range(rows, 2 * rows))
        row = heapq.heappop(self._free_rows)
        self._row_of[req_id] = row
        return row

    def _ensure_width(self, width: int) -> None:
        rows, have = self._table.shape
        if width > have:
            new_width = min(max(2 * have, width), self.max_blocks_per_req)
            grown = np.zeros((rows, new_width), dtype=np.int64)
            grown[:, :have] = self._table
            self._table = grown
