"""The plan: which PCP rank runs each token of a scheduled batch, in which local row.

Pure numpy (no torch), vectorized over requests and tokens: the only Python loops run
over ranks, or over the O(log R) phases of the balanced decode assignment.

A split prefill of q tokens is cut into 2P chunks of ceil(q/2P) tokens and rank k takes
chunks k and 2P-1-k (DualChunkSwap), so every rank gets one early, cheap chunk and one
late, expensive one. PCP=2, one 7-token prefill::

    global batch:        [A B C D E F G]       chunks [A B | C D | E F | G]
    rank 0 / rank 1:     [A B G] / [C D E F]
    padded gathered:     [A B G _ | C D E F]   (rank-major, each rank padded to N=4)
    padded_gather_idx:   [0 1 6 0   2 3 4 5]   gathered row -> global token
    hidden_restore_idx:  [0 1 4 5 6 7 2]       global token -> its KV writer's row

so ``gathered = global[padded_gather_idx]`` and ``global = gathered[hidden_restore_idx]``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

DECODE_ASSIGNMENTS = ("round_robin", "balanced")


@dataclass(frozen=True, eq=False)
class RankSegments:
    """One rank's segments in local order: a replicated request's whole query, or one
    chunk of a split prefill (rank P-1's chunks P-1 and P stay two segments)."""

    req_idx: np.ndarray  # int64 [S]: global batch request index
    global_start: np.ndarray  # int64 [S]: first global token index of the segment
    length: np.ndarray  # int64 [S]
    local_start: np.ndarray  # int64 [S]: first local row (cumulative, no gaps)

    def __len__(self) -> int:
        return int(self.req_idx.shape[0])


@dataclass(frozen=True, eq=False)
class BatchLayout:
    """Where every token of one global batch (R requests, T tokens) runs on P ranks."""

    pcp_size: int
    dcp_size: int
    shard_decodes: bool
    num_tokens: int  # T = sum(num_scheduled_tokens)
    query_start_loc: np.ndarray  # int64 [R+1]
    replicated: np.ndarray  # bool [R]: the query goes unsplit to its holder(s) (rule
    #   applied to every request, zero-token ones included; those still get no rows)
    # int64 [R]: KV-writer rank of each replicated request (its only holder under
    # shard_decodes, else 0); -1 for split prefills and zero-token requests.
    owner: np.ndarray
    per_rank_num_tokens: np.ndarray  # int64 [P]
    padded_num_tokens: int  # N
    segments: tuple[RankSegments, ...]  # P entries
    # Leading local rows identical on every rank (the replicated decodes); 0 when sharded.
    num_replicated_decode_tokens: int

    # NOTE: the per-token views derive from the segments on first read: a priced step reads
    # none of them (it counts by segment), an executed one reads them all.
    @cached_property
    def padded_gather_idx(self) -> np.ndarray:
        """int64 [P*N], rank-major: gathered row -> global token; 0 on padding rows."""
        rank, _, global_start, length, local_start = self._pieces()
        p, n = self.pcp_size, self.padded_num_tokens
        # The padded gathered view as runs: each rank's pieces, then its padding (a run of
        # n - per_rank_num_tokens rows), so one repeat fills it, padding zeroed after.
        at = _iota(rank.shape[0]) + rank
        run_shift = np.zeros(rank.shape[0] + p, dtype=np.int64)
        run_shift[at] = global_start - rank * n - local_start
        gather_idx = run_shift.repeat(self._run_lengths(at, length))
        gather_idx += _iota(p * n)
        for r, num_real in enumerate(self.per_rank_num_tokens.tolist()):
            gather_idx[r * n + num_real : (r + 1) * n] = 0
        return gather_idx

    @cached_property
    def kv_write_mask(self) -> np.ndarray:
        """bool [P*N]: the one canonical writer row of each token."""
        rank, req, _, length, _ = self._pieces()
        at = _iota(rank.shape[0]) + rank
        run_writes = np.zeros(rank.shape[0] + self.pcp_size, dtype=bool)
        run_writes[at] = self._writes(rank, req)
        return run_writes.repeat(self._run_lengths(at, length))

    @cached_property
    def hidden_restore_idx(self) -> np.ndarray:
        """int64 [T]: global token -> its KV writer's gathered row."""
        rank, req, global_start, length, local_start = self._pieces()
        writes = self._writes(rank, req)
        # The writer pieces tile [0, T): in global order, each is a run of rows.
        order = global_start[writes].argsort(kind="stable")
        shift = (rank * self.padded_num_tokens + local_start - global_start)[writes][order]
        restore_idx = shift.repeat(length[writes][order])
        restore_idx += _iota(self.num_tokens)
        return restore_idx

    def _pieces(self) -> tuple[np.ndarray, ...]:
        """Every rank's segments, rank-major: rank, req_idx, global_start, length, local_start."""
        segs = self.segments
        rank = _iota(self.pcp_size).repeat([len(s) for s in segs])
        cat = [np.concatenate([getattr(s, f) for s in segs]).astype(np.int64, copy=False)
               for f in ("req_idx", "global_start", "length", "local_start")]
        return (rank, *cat)

    def _run_lengths(self, at: np.ndarray, length: np.ndarray) -> np.ndarray:
        """Rows of each run of the gathered view: the pieces ``at``, each rank's padding after."""
        p = self.pcp_size
        run_length = np.empty(at.shape[0] + p, dtype=np.int64)
        run_length[at] = length
        pad_at = np.cumsum([len(s) for s in self.segments]) + _iota(p)
        run_length[pad_at] = self.padded_num_tokens - self.per_rank_num_tokens
        return run_length

    def _writes(self, rank: np.ndarray, req: np.ndarray) -> np.ndarray:
        """bool: the piece writes its KV (every piece, but a replicated request's copies off rank 0)."""
        if self.shard_decodes:
            return np.ones(rank.shape[0], dtype=bool)
        return (rank == 0) | ~self.replicated[req]

    @property
    def is_padding(self) -> np.ndarray:
        """bool [P*N]: the gathered row is padding (past its rank's real tokens)."""
        rows = np.arange(self.padded_num_tokens, dtype=np.int64)
        return (rows[None, :] >= self.per_rank_num_tokens[:, None]).reshape(-1)

    def rank_rows(self, rank: int) -> slice:
        """The rows of ``rank`` in the padded gathered view."""
        if not 0 <= rank < self.pcp_size:
            raise ValueError(f"rank ({rank}) must be in [0, pcp_size ({self.pcp_size}))")
        n = self.padded_num_tokens
        return slice(rank * n, (rank + 1) * n)


@dataclass(frozen=True, eq=False)
class TokenPositions:
    """The positions of a batch's T tokens, held per request: token t of request r sits at
    ``num_computed_tokens[r] + t - query_start_loc[r]``. Indexed by token rows it gives what
    the int64 [T] array gives, without building it (a priced step reads one per segment);
    ``np.asarray`` builds the array."""

    query_start_loc: np.ndarray  # int64 [R+1]
    num_computed_tokens: np.ndarray  # int64 [R]

    @property
    def shape(self) -> tuple[int]:
        return (int(self.query_start_loc[-1]),)

    def __getitem__(self, tokens) -> np.ndarray:
        """Positions of the token rows ``tokens`` (int, in [0, T))."""
        tokens = np.asarray(tokens, dtype=np.int64)
        # NOTE: a token's request is the last one starting at or before it (an empty one
        # starts where the next does)
        req = self.query_start_loc.searchsorted(tokens, side="right") - 1
        return np.asarray(self.num_computed_tokens, dtype=np.int64)[req] + (tokens - self.query_start_loc[req])

    def of_requests(self, tokens: np.ndarray, req: np.ndarray) -> np.ndarray:
        """``self[tokens]`` where ``req`` holds each token's request (a segment's, say): the
        same positions, without searching for the requests."""
        computed = np.asarray(self.num_computed_tokens, dtype=np.int64)
        return computed[req] + (tokens - self.query_start_loc[req])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        qsl = self.query_start_loc
        start = np.asarray(self.num_computed_tokens, dtype=np.int64) - qsl[:-1]
        positions = start.repeat(np.diff(qsl)) + _iota(int(qsl[-1]))
        return positions if dtype is None else positions.astype(dtype, copy=False)


def as_positions(positions) -> np.ndarray | TokenPositions:
    """``positions`` (int [T], or ``TokenPositions``) ready to index by token rows."""
    return positions if isinstance(positions, TokenPositions) else np.asarray(positions, dtype=np.int64)


def plan_layout(
    num_scheduled_tokens,
    is_prefilling,
    *,
    pcp_size: int,
    dcp_size: int = 1,
    shard_decodes: bool = False,
    padded_num_tokens: int | None = None,
    num_computed_tokens=None,
    decode_assignment: str = "round_robin",
) -> BatchLayout:
    """Plan one global batch over ``pcp_size`` ranks.

    Requests with 0 scheduled tokens get no rows. Decodes (``is_prefilling`` False, incl.
    speculative-verify rows of 1+k tokens) are replicated; with ``dcp_size > 1`` so are
    prefills too short to fill 2P chunks, ``(2P-1)*ceil(q/2P) >= q``. Every other prefill
    is split DualChunkSwap-style. A replicated request lives on every rank (rank 0 writes
    its KV) or, with ``shard_decodes``, on its owner only: the k-th replicated request
    (batch order, zero-token rows not counted) on rank ``k % P`` under ``"round_robin"``,
    or by even decode attention work (``num_computed_tokens + num_scheduled_tokens``)
    under ``"balanced"``. Each rank orders its rows decodes first, then prefills, by
    request index, then position. The gathered view pads every rank to
    ``padded_num_tokens`` (default: the largest rank).

    Raises ValueError, naming the numbers, for negative or non-integer token counts,
    mismatched lengths, ``pcp_size < 1``, ``dcp_size`` not in {1, pcp_size}, an unknown
    ``decode_assignment`` or a ``padded_num_tokens`` below the largest rank.
    """
    q = _int_vector(num_scheduled_tokens, "num_scheduled_tokens")
    num_reqs = q.shape[0]
    prefilling = _bool_vector(is_prefilling, "is_prefilling", num_reqs)
    if isinstance(pcp_size, bool) or not isinstance(pcp_size, (int, np.integer)) or pcp_size < 1:
        raise ValueError(f"pcp_size ({pcp_size!r}) must be an integer >= 1")
    if dcp_size not in (1, pcp_size):
        raise ValueError(f"dcp_size ({dcp_size}) must be 1 or pcp_size ({pcp_size})")
    if decode_assignment not in DECODE_ASSIGNMENTS:
        raise ValueError(
            f"decode_assignment {decode_assignment!r} is not one of {list(DECODE_ASSIGNMENTS)}"
        )
    if num_reqs and q.min() < 0:
        bad = int(np.argmax(q < 0))
        raise ValueError(f"num_scheduled_tokens[{bad}] ({q[bad]}) must be >= 0")
    if num_computed_tokens is None:
        computed = np.zeros(num_reqs, dtype=np.int64)
    else:
        computed = _int_vector(num_computed_tokens, "num_computed_tokens", num_reqs)
        if num_reqs and computed.min() < 0:
            bad = int(np.argmax(computed < 0))
            raise ValueError(f"num_computed_tokens[{bad}] ({computed[bad]}) must be >= 0")
    p = int(pcp_size)
    if not shard_decodes and not prefilling.any():
        return _replicated_decodes_layout(q, p, int(dcp_size), padded_num_tokens)
    num_chunks = 2 * p

    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    q.cumsum(out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    chunk_size = (q + (num_chunks - 1)) // num_chunks
    replicated = ~prefilling
    if dcp_size > 1:
        replicated |= (num_chunks - 1) * chunk_size >= q
    held = (replicated & (q > 0)).nonzero()[0]
    owner = np.full(num_reqs, -1, dtype=np.int64)
    if not shard_decodes:
        owner[held] = 0
    elif decode_assignment == "round_robin":
        owner[held] = _iota(held.shape[0]) % p
    else:
        owner[held] = _balanced_owners(computed[held] + q[held], p)

    # Pieces: (request, chunk) pairs in global token order, none empty. A split prefill
    # has cdiv(q, chunk) non-empty chunks, all leading; a replicated request is one chunk
    # of q tokens, on its owner alone or copied to every rank (copy j on rank j). A
    # stable sort by (rank, is_prefilling) then yields each rank's local order.
    span = np.where(replicated, q, chunk_size)
    span_or_1 = np.maximum(span, 1)
    copies = 1 if shard_decodes else p
    # counts = cdiv(q, chunk) for a split prefill, cdiv(copies * q, q) = copies for a
    # replicated request, 0 for a zero-token one.
    counts = np.where(replicated, copies * q, q)
    counts += span_or_1 - 1
    counts //= span_or_1
    req = _iota(num_reqs).repeat(counts)
    first_piece = counts.cumsum()
    first_piece -= counts
    j = _iota(req.shape[0]) - first_piece.repeat(counts)
    # Chunk j of a split prefill runs on rank min(j, 2P-1-j): rank k takes chunks k and
    # 2P-1-k. Copy j < P of a replicated request lands on rank j; a sharded one's only
    # copy (j = 0) on its owner.
    rank = np.minimum(j, (num_chunks - 1) - j)
    if shard_decodes:
        rank += np.maximum(owner, 0)[req]
    start = j * np.where(replicated, 0, chunk_size)[req]
    length = np.minimum(q[req] - start, span[req])
    global_start = query_start_loc[req]
    global_start += start
    key = 2 * rank + prefilling[req]
    local_order = key.astype(np.uint8 if num_chunks <= 128 else np.int64).argsort(kind="stable")
    rank_s = rank[local_order]
    length_s = length[local_order]
    global_start_s = global_start[local_order]
    bounds = rank_s.searchsorted(_iota(p + 1))
    # first_row: first row of each piece in the concatenation of all ranks' real rows.
    first_row = np.zeros(length_s.shape[0] + 1, dtype=np.int64)
    length_s.cumsum(out=first_row[1:])
    rank_first_row = first_row[bounds]
    first_row = first_row[:-1]
    per_rank_num_tokens = rank_first_row[1:] - rank_first_row[:-1]
    largest = max(per_rank_num_tokens.tolist())
    if padded_num_tokens is None:
        n = largest
    elif padded_num_tokens < largest:
        raise ValueError(
            f"padded_num_tokens ({padded_num_tokens}) is smaller than the largest "
            f"rank-local batch ({largest})"
        )
    else:
        n = int(padded_num_tokens)

    local_start = first_row - rank_first_row[rank_s]
    req_s = req[local_order]
    segments = tuple(
        RankSegments(req_s[lo:hi], global_start_s[lo:hi], length_s[lo:hi], local_start[lo:hi])
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())
    )
    num_replicated_decode_tokens = 0 if shard_decodes else int(q[~prefilling].sum())
    return BatchLayout(
        pcp_size=p,
        dcp_size=int(dcp_size),
        shard_decodes=bool(shard_decodes),
        num_tokens=num_tokens,
        query_start_loc=query_start_loc,
        replicated=replicated,
        owner=owner,
        per_rank_num_tokens=per_rank_num_tokens,
        padded_num_tokens=n,
        segments=segments,
        num_replicated_decode_tokens=num_replicated_decode_tokens,
    )


_DECODES_LAYOUTS: dict[tuple, BatchLayout] = {}


def _replicated_decodes_layout(q: np.ndarray, p: int, dcp_size: int, padded_num_tokens: int | None) -> BatchLayout:
    """``plan_layout`` of a batch of decodes copied to every rank (no ``shard_decodes``): every
    rank holds every token in batch order, rank 0 writes the KV. The general plan yields the
    same layout; a decode step (most steps of a serving run) skips its pieces and sorts.

    A function of ``q`` alone (and ``p``, ``dcp_size``, ``padded_num_tokens``): batches that
    repeat it (a serving run's decode steps at one batch size) share one layout, its arrays
    read-only."""
    # NOTE: q is int64 (_int_vector): its bytes say it all
    key = (q.tobytes(), p, dcp_size, padded_num_tokens)
    hit = _DECODES_LAYOUTS.get(key)
    if hit is None:
        hit = _build_replicated_decodes_layout(q, p, dcp_size, padded_num_tokens)
        if len(_DECODES_LAYOUTS) > 1024:  # NOTE: a few hundred at most in a serving run: bounded memory
            _DECODES_LAYOUTS.clear()
        _DECODES_LAYOUTS[key] = hit
    return hit


def _build_replicated_decodes_layout(q: np.ndarray, p: int, dcp_size: int,
                                     padded_num_tokens: int | None) -> BatchLayout:
    num_reqs = q.shape[0]
    query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
    q.cumsum(out=query_start_loc[1:])
    num_tokens = int(query_start_loc[-1])
    held = q > 0
    owner = held.astype(np.int64) - 1  # rank 0 where held, -1 elsewhere
    if padded_num_tokens is None:
        n = num_tokens
    elif padded_num_tokens < num_tokens:
        raise ValueError(
            f"padded_num_tokens ({padded_num_tokens}) is smaller than the largest "
            f"rank-local batch ({num_tokens})"
        )
    else:
        n = int(padded_num_tokens)
    # Each rank's segments: its own copy of every held request, in batch order (a request's
    # local start is its global one: every rank holds every token).
    # NOTE: the ranks' segments are equal: one read-only object stands for all of them.
    held_idx = held.nonzero()[0]
    start = query_start_loc[held_idx]
    segment = RankSegments(held_idx, start, q[held_idx], start)
    replicated, per_rank_num_tokens = np.ones(num_reqs, dtype=bool), np.full(p, num_tokens, dtype=np.int64)
    for a in (held_idx, start, segment.length, query_start_loc, replicated, owner, per_rank_num_tokens):
        a.flags.writeable = False
    return BatchLayout(
        pcp_size=p,
        dcp_size=dcp_size,
        shard_decodes=False,
        num_tokens=num_tokens,
        query_start_loc=query_start_loc,
        replicated=replicated,
        owner=owner,
        per_rank_num_tokens=per_rank_num_tokens,
        padded_num_tokens=n,
        segments=(segment,) * p,
        num_replicated_decode_tokens=num_tokens,
    )


def pad_layout(layout: BatchLayout, padded_num_tokens: int) -> BatchLayout:
    """``layout`` with every rank padded to ``padded_num_tokens`` rows: what ``plan_layout``
    returns for the same batch given that ``padded_num_tokens``, without planning it again
    (padding moves only the gathered rows: rank r's local row i is gathered row ``r * N + i``,
    and the per-token views derive from the segments at the new N)."""
    largest = max(layout.per_rank_num_tokens.tolist())
    if padded_num_tokens < largest:
        raise ValueError(
            f"padded_num_tokens ({padded_num_tokens}) is smaller than the largest "
            f"rank-local batch ({largest})"
        )
    n = int(padded_num_tokens)
    return layout if n == layout.padded_num_tokens else replace(layout, padded_num_tokens=n)


def _balanced_owners(work: np.ndarray, pcp_size: int) -> np.ndarray:
    """Owner rank of each request so that the total ``work`` is even across ranks.

    Longest-processing-time first, vectorized as water-filling: the P largest requests
    go one to each rank; then each phase pours the next half (at least 2P) of the
    remaining requests, largest first, into the ranks below the water level, cutting
    the sorted run at the ranks' deficits. A cut is off by at most one request per
    rank; the later phases, of ever smaller requests, correct it, so the result is
    about as even as LPT's, in O(log(n / P)) numpy phases. Ties break by request index,
    then rank index: every rank computes the same owners.
    """
    # NOTE: a rank's load never exceeds the final mean by more than the largest request:
    # a phase's water level is at most the mean after it, and a cut overshoots a rank's
    # deficit by at most one request (half of one at each end).
    # NOTE: exact integer arithmetic (cut points scaled by 2 * the number of ranks under
    # the water level), so every rank computes the same owners bit for bit.
    n = work.shape[0]
    order = (-work).argsort(kind="stable")
    size = work[order]
    ends = size.cumsum()
    twice_middles = 2 * ends - size  # nondecreasing
    ends = [0, *ends.tolist()]  # ends[k]: total of the k largest
    owner_sorted = np.empty(n, dtype=np.int64)
    first = min(n, pcp_size)
    owner_sorted[:first] = _iota(first)
    load = size[:first].tolist() + [0] * (pcp_size - first)
    lo = first
    while lo < n:
        hi = min(n, lo + max(2 * pcp_size, (n - lo + 1) // 2))
        poured = ends[lo]
        phase = ends[hi] - poured
        by_load = sorted(range(pcp_size), key=load.__getitem__)
        # The water level reaches the k least-loaded ranks while (phase + their load) / k
        # is at least the k-th load; level = total / filled.
        filled = below = 0
        for k, r in enumerate(by_load, 1):
            if phase + below + load[r] < k * load[r]:
                break
            filled, below = k, below + load[r]
        total = phase + below
        # The largest deficit takes the largest requests: each goes to the rank whose
        # deficit holds its midpoint, so a rank takes a contiguous run. The run of the
        # i-th rank ends before the first midpoint at or past the end of the first i+1
        # deficits (in twice-midpoint units: ceil(2 * deficits / filled) + 2 * poured).
        cut_at, acc = [], 0
        for r in by_load[:filled]:
            acc += 2 * (total - filled * load[r])
            cut_at.append(-(-acc // filled) + 2 * poured)
        cuts = twice_middles[lo:hi].searchsorted(cut_at).tolist()
        cuts[-1] = hi - lo  # the last rank under the level takes the rest
        start = lo
        for r, cut in zip(by_load, cuts):
            owner_sorted[start : lo + cut] = r
            load[r] += ends[lo + cut] - ends[start]
            start = lo + cut
        lo = hi
    owner = np.empty_like(owner_sorted)
    owner[order] = owner_sorted
    return owner


_IOTA = np.arange(0, dtype=np.int64)


def _iota(n: int) -> np.ndarray:
    """Read-only ``arange(n)`` (int64), a view of one shared, growing array."""
    global _IOTA
    if _IOTA.shape[0] < n:
        iota = np.arange(max(n, 2 * _IOTA.shape[0]), dtype=np.int64)
        iota.flags.writeable = False
        _IOTA = iota
    return _IOTA[:n]


def _int_vector(values, name: str, expected_len: int | None = None) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        arr = arr.astype(np.int64)
    elif arr.dtype.kind not in "iu":
        raise ValueError(f"{name} must hold integers, got dtype {arr.dtype}")
    if expected_len is not None and arr.shape[0] != expected_len:
        raise ValueError(
            f"{name} has {arr.shape[0]} entries but num_scheduled_tokens has {expected_len}"
        )
    return arr.astype(np.int64, copy=False)


def _bool_vector(values, name: str, expected_len: int) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.shape[0] != expected_len:
        raise ValueError(
            f"{name} has {arr.shape[0]} entries but num_scheduled_tokens has {expected_len}"
        )
    return arr.astype(bool, copy=False)
