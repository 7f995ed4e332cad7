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

With KV groups (``pcpflow.scheduling.kv_groups``: a model with windowed layers) a request has
a table per group, all over this one pool: a table entry takes a block in every group, and
``release`` hands back a window group's blocks that no future query reads (their entries
point at the null block, ``num_blocks``, from then on). Entry counts (``blocks_needed``,
``num_blocks_of``) are per table; block counts (``num_free_blocks``, a step's growth) are the
pool's: a new entry costs ``num_groups`` blocks. Group 0's table is ``block_tables``'; a
group's blocks are cached under its own keys (the chained hash mixed with the group), and a
hit is vLLM's for full + windowed groups: the longest prefix cached in every full group whose
last window (the keys its first query reads) is cached in every window group.

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
from pcpflow.scheduling.kv_groups import KVGroups

SHOWN_PROBLEMS = 5

# NOTE: a group's cache keys: the chained hash mixed with the group (group 0 keeps its own, so
# that one group caches exactly as before); vLLM keys its cache by (hash, group) alike.
_GROUP_SALT = 0x9E3779B97F4A7C15


def group_keys(hashes: np.ndarray, group) -> np.ndarray:
    """uint64: the cache keys of blocks with chained ``hashes`` in KV group ``group`` (an int;
    or int64 ``[G]`` groups: ``[G, n]`` keys)."""
    if np.ndim(group) == 0 and not group:
        return hashes
    salt = (np.asarray(group, dtype=np.uint64) * np.uint64(_GROUP_SALT & (2**63 - 1))) << np.uint64(1)
    keys = hashes ^ (salt[..., None] if np.ndim(group) else salt)
    keys[keys == 0] = 1  # NOTE: 0 means "not cached"
    return keys


def fit_problems(
    prompt_lens,
    output_lens,
    *,
    num_speculative_tokens: int,
    block_size: int,
    dcp_size: int,
    num_blocks: int,
    max_blocks_per_req: int | None = None,
    groups: KVGroups | None = None,
    max_num_batched_tokens: int | None = None,
    keep_align: int | None = None,
) -> list[Problem]:
    """The one rule for "can this request ever fit": its prompt, every output token and the
    speculative lookahead, alone in the cache (``num_blocks``, or ``max_blocks_per_req`` when
    smaller). A request that cannot would wait forever; one that can always runs, since
    the scheduler preempts every later request for it. Problems (``kv.num_blocks``) name the
    first few such requests and count the rest; arrays of lengths in, no cache built.

    With KV groups a request holds a block per entry in each full group and, in each window
    group, at most ``KVGroups.peak_window_entries`` at once (steps of at most
    ``max_num_batched_tokens`` tokens; ``keep_align``: ``KVCacheManager``'s): the most it ever
    holds, an upper bound."""
    tokens_per_block = block_size * dcp_size
    prompt = np.asarray(prompt_lens, dtype=np.int64)
    output = np.asarray(output_lens, dtype=np.int64)
    tokens = prompt + output + num_speculative_tokens
    entries = -(-tokens // tokens_per_block)
    need = entries
    if groups is not None and groups.hybrid:
        if max_num_batched_tokens is None:
            raise ValueError("KV groups with windows fit by their step size: pass max_num_batched_tokens")
        window = groups.peak_window_entries(tokens, tokens_per_block, max_num_batched_tokens, num_speculative_tokens,
                                            align=keep_align)
        need = groups.num_full * entries + groups.num_windowed * window
    too_many = need > num_blocks
    if max_blocks_per_req is not None:
        too_many |= entries > max_blocks_per_req
    bad = np.flatnonzero(too_many)
    problems = []
    for i in bad[:SHOWN_PROBLEMS].tolist():
        extra = (f" (and max_blocks_per_req, {max_blocks_per_req}, too)"
                 if max_blocks_per_req is not None and entries[i] > max_blocks_per_req else "")
        grouped = (f" in {groups.num_groups} KV groups" if groups is not None and groups.num_groups > 1 else "")
        problems.append(Problem(
            "kv.num_blocks", num_blocks,
            f"workload request {i} needs {need[i]} blocks{grouped} ({prompt[i]} prompt + {output[i]} output + "
            f"{num_speculative_tokens} speculative tokens at {tokens_per_block} tokens per block); "
            f"kv.num_blocks must be >= {need[i]}{extra}",
        ))
    if len(bad) > SHOWN_PROBLEMS:
        problems.append(Problem("kv.num_blocks", num_blocks, f"... and {len(bad) - SHOWN_PROBLEMS} more requests do not "
                                f"fit; the largest needs {int(need.max())} blocks"))
    return problems


class KVCacheManager:
    """Block pool over ``num_blocks`` blocks (ids ``0..num_blocks-1``) and the requests'
    block tables (one per KV group: ``groups``, module docstring).

    Block tables live in one persistent ``[groups, rows, width]`` array; each request holding
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
        groups: KVGroups | None = None,
        keep_align: int | None = None,
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
        # NOTE: one group (no window frees blocks) is the classic cache: every path as before
        self.groups = groups if groups is not None and groups.hybrid else None
        self.num_groups = 1 if self.groups is None else self.groups.num_groups
        self._window_groups = (np.zeros(0, np.int64) if self.groups is None
                               else np.flatnonzero(self.groups.windowed))
        self._full_groups = (np.zeros(1, np.int64) if self.groups is None
                             else np.flatnonzero(~np.asarray(self.groups.windowed)))
        self.null_block = self.num_blocks  # NOTE: past the pool: the entries a window left
        # NOTE: a window group keeps from its first key rounded down to ``keep_align`` positions
        # (a prefill pool keeps what the decode pool's entries hold: ``KVGroups.first_kept``)
        self.keep_align = keep_align
        # NOTE: a window group's table runs past the blocks it holds: unbounded by the pool then
        self._max_given = max_blocks_per_req
        self.max_blocks_per_req = (
            int(max_blocks_per_req) if max_blocks_per_req is not None
            else self.num_blocks if self.groups is None else 2**62
        )
        n = self.num_blocks
        self._ref = np.zeros(n, dtype=np.int64)  # requests holding each block
        self._hash = np.zeros(n, dtype=np.uint64)  # 0 = not cached
        # NOTE: hash -> the block holding it, for every cached block but the private ones
        # below; an evicted block's entry goes with it (``_take``).
        self._cached: dict[int, int] = {}
        self._epoch = 0  # NOTE: bumped whenever _cached changes: a lookup's answer holds while it stays
        self._last_hit: tuple | None = None  # find_hit's latest: (hashes, max_blocks, epoch, answer)
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
        self._table = np.zeros((self.num_groups, 4, 4), dtype=np.int64)
        self._row_num_blocks = np.zeros(4, dtype=np.int64)  # table entries of each row
        self._row_released = np.zeros(4, dtype=np.int64)  # entries a window group gave back
        self._free_rows: list[int] = [0, 1, 2, 3]  # a heap: popped lowest first
        self._row_of = np.full(16, -1, dtype=np.int64)  # req_id -> row, -1 = none

    # -- queries ---------------------------------------------------------------------------

    def blocks_needed(self, num_tokens):
        """Table entries that hold ``num_tokens`` positions (a block each in every group
        that keeps them); int or int64 array."""
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
        """Table entries of ``req_id`` (0 if it holds none): its blocks, with one group."""
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

    def blocks_of(self, req_id: int, group: int = 0) -> np.ndarray:
        """The blocks of ``req_id``'s table in ``group``, in table order (a copy; a window
        group's entries it gave back are the null block)."""
        row = self._row(req_id)
        return np.zeros(0, np.int64) if row < 0 else self._table[group, row, : self._row_num_blocks[row]].copy()

    def tables_of(self, req_id: int) -> np.ndarray:
        """``blocks_of`` every group: ``[num_groups, entries]``."""
        row = self._row(req_id)
        return self._table[:, max(row, 0), : 0 if row < 0 else self._row_num_blocks[row]].copy()

    def ref_counts(self) -> np.ndarray:
        return self._ref.copy()

    def free_queue(self) -> np.ndarray:
        """The free blocks in eviction order (front first)."""
        ids, seqs = self._queue[self._head:self._tail], self._qseq[self._head:self._tail]
        return ids[self._seq_of[ids] == seqs]

    def block_hash(self, block: int) -> int | None:
        h = int(self._hash[block])
        return h or None

    def fit_problems(self, prompt_lens, output_lens, num_speculative_tokens: int = 0,
                     max_num_batched_tokens: int | None = None) -> list[Problem]:
        """``fit_problems`` of this cache (the module's one rule)."""
        return fit_problems(prompt_lens, output_lens, num_speculative_tokens=num_speculative_tokens,
                            block_size=self.block_size, dcp_size=self.dcp_size, num_blocks=self.num_blocks,
                            max_blocks_per_req=self._max_given, groups=self.groups,
                            max_num_batched_tokens=max_num_batched_tokens, keep_align=self.keep_align)

    def can_allocate(self, num_tokens: int) -> bool:
        """Whether a request holding no blocks yet could get room for ``num_tokens``."""
        need = self.blocks_needed(num_tokens)
        return need * self.num_groups <= self._num_free and need <= self.max_blocks_per_req

    # -- prefix cache ----------------------------------------------------------------------

    def find_cached(self, hashes, max_blocks: int) -> np.ndarray:
        """The blocks of the longest cached prefix of a request whose full blocks have the
        chained ``hashes`` (at most ``max_blocks``): one dict lookup per block, up to the
        first miss. Changes nothing (``allocate(..., cached=...)`` takes them). One group's
        (group 0's keys); ``find_hit`` is every group's."""
        if not self.prefix_caching or not self._num_cached or max_blocks <= 0:
            return np.zeros(0, dtype=np.int64)
        return self._find(np.asarray(hashes, dtype=np.uint64), max_blocks)

    def finds_again(self, hashes, max_blocks: int, blocks: np.ndarray) -> bool:
        """Whether ``find_cached(hashes, max_blocks)`` still answers ``blocks``, an earlier
        answer: each still holds its hash (so the cache still maps it there) and the first
        miss after them is still one. ``find_hit``'s answer too (with several groups it is
        looked up again: a window's hit is found from the right)."""
        if blocks.ndim == 2:
            if self.groups is not None:  # NOTE: find_hit keeps its latest answer while it holds
                return False
            blocks = blocks[0]
        n = len(blocks)
        if n and not (self._hash[blocks] == hashes[:n]).all():
            return False
        return n >= min(max_blocks, len(hashes)) or not self._holds(hashes[n].item())

    def find_hit(self, hashes, max_blocks: int) -> np.ndarray:
        """int64 ``[num_groups, n]``: every group's blocks of the longest cached prefix of ``n``
        blocks (``find_cached`` with one group). With KV groups, vLLM's hit for full + windowed
        groups: the longest prefix cached in every full group (left to right, up to the first
        miss), cut to the longest one whose last window, the entries from the one holding its
        first query's first key (``KVGroups.first_kept``), is cached in every window group
        (right to left, up to the first fit); a window group's entries before it are the null
        block. Changes nothing (``allocate(..., cached=...)`` takes them)."""
        if self.groups is None:
            return self.find_cached(hashes, max_blocks)[None]
        memo = self._last_hit
        # NOTE: a head waiting for blocks asks again each step: while the cache maps what it
        # mapped (no block cached, indexed or evicted since), the answer is the same
        if memo is not None and memo[0] is hashes and memo[1] == max_blocks and memo[2] == self._epoch:
            return memo[3]
        given = hashes
        hashes = np.asarray(hashes, dtype=np.uint64)
        n = max(0, min(max_blocks, len(hashes))) if self.prefix_caching and self._num_cached else 0
        found = []
        for g in self._full_groups.tolist():
            found.append(self._find(group_keys(hashes, g), n))
            n = min(n, len(found[-1]))
        n = self._window_hit(hashes, n)
        out = np.full((self.num_groups, n), self.null_block, dtype=np.int64)
        for g, blocks in zip(self._full_groups.tolist(), found):
            out[g] = blocks[:n]
        first = int(self._first_kept(n * self.tokens_per_block))
        for g in self._window_groups.tolist():
            keys = group_keys(hashes[first:n], g).tolist()
            out[g, first:] = np.fromiter(map(self._cached.__getitem__, keys), dtype=np.int64, count=len(keys))
        self._last_hit = (given, max_blocks, self._epoch, out)
        return out

    def _find(self, keys: np.ndarray, n: int) -> np.ndarray:
        """The blocks of the longest prefix of ``keys[:n]`` the cache maps (up to the first miss)."""
        found: list[np.ndarray] = []
        start, size = 0, 16
        while start < n:  # NOTE: in growing chunks, so that a miss stops the lookups early
            chunk = list(map(self._cached.get, keys[start:min(start + size, n)].tolist()))
            end = chunk.index(None) if None in chunk else len(chunk)
            found.append(np.asarray(chunk[:end], dtype=np.int64))
            if end < len(chunk):
                break
            start, size = start + size, 2 * size
        if not found:
            return np.zeros(0, dtype=np.int64)
        return found[0] if len(found) == 1 else np.concatenate(found)

    def _window_hit(self, hashes: np.ndarray, n: int) -> int:
        """The longest ``m <= n`` whose entries ``first_kept(m) .. m - 1`` are cached in every
        window group (0 always fits: nothing to read). Entries are looked up from ``n - 1``
        leftwards in growing chunks, and a prefix is judged once the lookups cover its window."""
        if n <= 0:
            return 0
        U, cached = self.tokens_per_block, self._cached
        lo, size = n, 16
        known = np.zeros(0, dtype=bool)  # entries [lo, n): cached in every window group
        while True:
            start = max(0, lo - size)
            part = np.ones(lo - start, dtype=bool)
            for g in self._window_groups.tolist():
                part &= np.fromiter(map(cached.__contains__, group_keys(hashes[start:lo], g).tolist()),
                                    dtype=bool, count=lo - start)
            known, lo, size = np.concatenate([part, known]), start, 2 * size
            m = np.arange(lo + 1, n + 1, dtype=np.int64)
            first = self._first_kept(m * U)
            judged = first >= lo
            misses = np.concatenate([[0], np.cumsum(~known)])  # misses[k]: among entries [lo, lo + k)
            fits = judged & (misses[m - lo] == misses[np.maximum(first, lo) - lo])
            if fits.any():
                return int(m[fits][-1])
            if lo == 0:
                return 0

    def _first_kept(self, num_computed) -> np.ndarray:
        """``KVGroups.first_kept`` of this pool (its entries, its ``keep_align``)."""
        assert self.groups is not None
        return self.groups.first_kept(num_computed, self.tokens_per_block, self.keep_align)

    def _holds(self, h: int) -> bool:
        """Whether an indexed block holds hash ``h``."""
        return h in self._cached

    def evictable(self, blocks: np.ndarray) -> int:
        """How many of ``blocks`` (cached ones found by ``find_cached`` or ``find_hit``; the
        null block is none) are free: taking them uses up free capacity as new blocks would."""
        blocks = self._real(blocks)
        return int(np.count_nonzero(self._ref[blocks] == 0)) if len(blocks) else 0

    def _real(self, blocks: np.ndarray) -> np.ndarray:
        """``blocks`` (any shape) flat, without the null block."""
        blocks = np.asarray(blocks, dtype=np.int64).reshape(-1)
        return blocks if self.groups is None else blocks[blocks != self.null_block]

    def cache_blocks(self, req_id: int, first: int, hashes: np.ndarray) -> int:
        """Register ``req_id``'s full blocks ``first, first+1, ...`` under ``hashes`` (their
        chained hashes); a block already cached, or a hash another block holds, is left as
        it is. Returns the number of blocks newly cached."""
        n = len(hashes)
        return self.cache_entries(np.full(n, req_id), np.arange(first, first + n), hashes)

    def block_ids(self, req_ids: np.ndarray, entries: np.ndarray, group: int = 0) -> np.ndarray:
        """The block at table entry ``entries[k]`` of request ``req_ids[k]`` in ``group``."""
        return self._table[group, self._row_of[np.asarray(req_ids, dtype=np.int64)], entries]

    def cache_entries(self, req_ids: np.ndarray, entries: np.ndarray, hashes: np.ndarray,
                      private: np.ndarray | None = None) -> int:
        """Full blocks at table entries ``entries[k]`` of requests ``req_ids[k]`` (chained
        ``hashes``) cached in every group, each under its group's keys (``cache_block_ids``);
        a window group's entries it gave back are skipped. Returns blocks newly cached."""
        rows = self._row_of[np.asarray(req_ids, dtype=np.int64)]
        if self.groups is None:
            return self.cache_block_ids(self._table[0, rows, entries], hashes, private)
        # NOTE: every group's blocks in one call (their keys differ by group)
        blocks = self._table[:, rows, entries]
        keys = group_keys(np.asarray(hashes, dtype=np.uint64), np.arange(self.num_groups))
        live = blocks != self.null_block
        return self.cache_block_ids(blocks[live], keys[live],
                                    None if private is None else np.broadcast_to(private, blocks.shape)[live])

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
        self._epoch += 1
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
        blocks = self._real(self._table[:, row, :self._row_num_blocks[row]])
        blocks = blocks[self._unindexed[blocks]]
        if len(blocks):
            self._cached.update(zip(self._hash[blocks].tolist(), blocks.tolist()))
            self._epoch += 1
            self._unindexed[blocks] = False

    # -- mutation --------------------------------------------------------------------------

    def allocate(self, req_id: int, num_tokens: int, cached: np.ndarray | None = None) -> None:
        """Grow ``req_id``'s table to hold ``num_tokens`` positions (no-op if it already does).
        ``cached``: blocks found by ``find_cached`` (or ``find_hit``: ``[num_groups, n]``) for
        a request holding none yet; they become its first table entries (shared, their
        reference counts raised; a window group's null entries stay null)."""
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
        hits = np.zeros((self.num_groups, 0), np.int64) if cached is None else np.asarray(cached, dtype=np.int64)
        hits = hits.reshape(self.num_groups, -1)
        n_hit = hits.shape[1]
        if n_hit and (have or n_hit > need):
            raise ValueError(f"cached blocks go first into an empty table of {need} blocks; "
                             f"request {req_id} holds {have}, {n_hit} cached given")
        # NOTE: an entry costs a block in every group (a window group's entries before its
        # first kept one are among the hit's, as null ones)
        extra = (need - have - n_hit) * self.num_groups
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
        if n_hit:
            self._touch(self._real(hits))
            self._table[:, row, :n_hit] = hits
            if self.groups is not None:
                self._row_released[row] = int(self._first_kept(n_hit * self.tokens_per_block))
        new_blocks = self._take(extra)
        self._table[:, row, have + n_hit:need] = new_blocks.reshape(self.num_groups, -1)
        self._row_num_blocks[row] = need

    def adopted_blocks(self, num_tokens: int) -> int:
        """Blocks ``adopt`` takes for ``num_tokens`` positions: an entry's block in every full
        group and, in every window group, from its first kept entry on."""
        need = self.blocks_needed(num_tokens)
        if self.groups is None:
            return need
        kept = need - min(int(self._first_kept(num_tokens)), need)
        return need * len(self._full_groups) + kept * len(self._window_groups)

    def adopt(self, req_id: int, num_tokens: int) -> np.ndarray:
        """A request handed over from another pool with ``num_tokens`` positions computed there
        (``disagg=pd``; it holds no blocks here): fresh blocks for them, which the transfer
        fills; a window group's entries before its first kept one are the null block (no
        future query reads them, nothing is moved there). Returns its tables ``[num_groups,
        entries]``."""
        req_id = int(req_id)
        if self._row(req_id) >= 0:
            raise ValueError(f"request {req_id} already holds blocks in this pool")
        if self.groups is None:
            self.allocate(req_id, num_tokens)
            return self.blocks_of(req_id)[None]
        need, total = self.blocks_needed(num_tokens), self.adopted_blocks(num_tokens)
        if need > self.max_blocks_per_req or total > self._num_free:
            raise RuntimeError(f"request {req_id} needs {total} blocks for {num_tokens} tokens, only "
                               f"{self._num_free} of {self.num_blocks} are free")
        first = min(int(self._first_kept(num_tokens)), need)
        row = self._claim_row(req_id)
        self._ensure_width(need)
        blocks = self._take(total)
        full = len(self._full_groups) * need
        self._table[self._full_groups, row, :need] = blocks[:full].reshape(len(self._full_groups), need)
        self._table[self._window_groups, row, :first] = self.null_block
        self._table[self._window_groups, row, first:need] = blocks[full:].reshape(len(self._window_groups), need - first)
        self._row_num_blocks[row] = need
        self._row_released[row] = first
        return self._table[:, row, :need].copy()

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
        total = int(extra.sum()) * self.num_groups
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
        ``extra[k] >= 1`` more table entries (a block each in every group), from the front of
        the free queue in request order (what ``allocate`` in a loop does; group by group):
        ``allocate_many`` without its checks of arguments the scheduler derived itself."""
        rows = self._row_of[req_ids]
        have = self._row_num_blocks[rows]
        entries = int(extra.sum())
        total = entries * self.num_groups
        if total > self._num_free:
            raise RuntimeError(f"{total} more blocks wanted, only {self._num_free} of {self.num_blocks} are free")
        need = have + extra
        width = int(need.max())
        if width > self.max_blocks_per_req:
            raise RuntimeError(f"a request needs {width} blocks, more than max_blocks_per_req ({self.max_blocks_per_req})")
        self._ensure_width(width)
        new_blocks = self._take(total).reshape(self.num_groups, entries)
        if entries == len(rows):  # NOTE: the usual step: one entry each
            self._table[:, rows, have] = new_blocks
        else:
            owner = np.repeat(np.arange(len(rows)), extra)
            self._table[:, rows[owner], np.arange(entries) - (extra.cumsum() - extra)[owner] + have[owner]] = new_blocks
        self._row_num_blocks[rows] = need

    def release(self, req_ids: np.ndarray, num_computed: np.ndarray) -> np.ndarray:
        """Window groups give back the blocks of requests ``req_ids`` (holding blocks; int64)
        that no future query reads: the entries before ``KVGroups.first_kept`` of each one's
        ``num_computed`` tokens become the null block, and blocks no other request holds go
        to the back of the free queue (entry order, group by group), cached ones keeping their
        hash. Returns the blocks that became free (none without windows)."""
        if self.groups is None or not len(req_ids):
            return np.zeros(0, dtype=np.int64)
        rows = self._row_of[req_ids]
        lo = self._row_released[rows]
        hi = np.minimum(self._first_kept(num_computed), self._row_num_blocks[rows])
        count = np.maximum(hi - lo, 0)
        n = int(count.sum())
        if not n:
            return np.zeros(0, dtype=np.int64)
        r = np.repeat(rows, count)
        e = np.arange(n, dtype=np.int64) - np.repeat(count.cumsum() - count - lo, count)
        wg = self._window_groups[:, None]
        blocks = self._table[wg, r, e]
        self._table[wg, r, e] = self.null_block
        self._row_released[rows] = np.maximum(lo, hi)
        return self._drop(blocks.reshape(-1), distinct=False)

    def _drop(self, blocks: np.ndarray, *, distinct: bool = True) -> np.ndarray:
        """One holder fewer per appearance in ``blocks`` (``distinct``: each appears once, as
        in one request's tables; a hit's block two requests give back at once appears twice):
        those held by none go to the back of the free queue in this order. Returns them."""
        if distinct:
            self._ref[blocks] -= 1
        else:
            np.subtract.at(self._ref, blocks, 1)
        freed = blocks[self._ref[blocks] == 0]
        if not distinct and len(freed) > 1:
            _, first = np.unique(freed, return_index=True)
            freed = freed[np.sort(first)]
        self._push(freed)
        return freed

    def free(self, req_id: int) -> np.ndarray:
        """Release every block of ``req_id``: blocks no other request holds go to the back of
        the free queue, last table entry first, group by group (cached ones keep their hash).
        Returns the blocks that became free, in that order."""
        row = self._row(req_id)
        if row < 0:
            raise KeyError(f"request {req_id} holds no KV blocks")
        n = int(self._row_num_blocks[row])
        freed = self._drop(self._real(self._table[:, row, :n][:, ::-1]))
        self._table[:, row, :n] = 0
        self._row_num_blocks[row] = 0
        self._row_released[row] = 0
        self._row_of[req_id] = -1
        heapq.heappush(self._free_rows, row)
        return freed

    def block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        """int64 ``[R, W]`` block tables of ``req_ids`` (group 0's); W = most entries among
        them (>= 1), unused entries 0."""
        return self.group_block_tables(req_ids)[0]

    def group_block_tables(self, req_ids: np.ndarray) -> np.ndarray:
        """int64 ``[num_groups, R, W]``: every group's block tables of ``req_ids``
        (``block_tables``; a window group's entries it gave back are the null block)."""
        ids = np.asarray(req_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= len(self._row_of)):
            raise KeyError(f"unknown request ids in {ids.tolist()}")
        rows = self._row_of[ids]
        if (rows < 0).any():
            raise KeyError(f"requests {ids[rows < 0].tolist()} hold no KV blocks")
        width = max(1, int(self._row_num_blocks[rows].max(initial=0)))
        return self._table[:, rows, :width].copy()

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
                self._epoch += len(indexed) > 0
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
            groups, rows, width = self._table.shape
            # NOTE: np.zeros maps its pages lazily: only the rows copied (and later used) are touched
            grown = np.zeros((groups, 2 * rows, width), dtype=np.int64)
            grown[:, :rows] = self._table
            self._table = grown
            self._row_num_blocks = np.concatenate([self._row_num_blocks, np.zeros(rows, np.int64)])
            self._row_released = np.concatenate([self._row_released, np.zeros(rows, np.int64)])
            self._free_rows = list(range(rows, 2 * rows))
        row = heapq.heappop(self._free_rows)
        self._row_of[req_id] = row
        return row

    def _ensure_width(self, width: int) -> None:
        groups, rows, have = self._table.shape
        if width > have:
            new_width = min(max(2 * have, width), self.max_blocks_per_req)
            grown = np.zeros((groups, rows, new_width), dtype=np.int64)
            grown[:, :, :have] = self._table
            self._table = grown
