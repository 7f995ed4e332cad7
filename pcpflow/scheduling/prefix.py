"""Chained block hashes for automatic prefix caching (vLLM's scheme, vectorized).

A request's KV blocks (one block-table entry: ``block_size * dcp`` tokens) are keyed by a
chained hash: block j's key depends on its own tokens and on every block before it, so two
requests share the key of block j exactly when their first ``(j + 1)`` blocks hold the same
tokens. The chain is a polynomial one, ``P_j = R * P_{j-1} + c_j`` mod 2^64 with ``c_j``
a hash of block j's content, computed for a whole run of blocks at once from prefix sums
(``R`` is odd, so it has an inverse mod 2^64); the key is ``P_j`` finalized by splitmix64
(0 is never a key: it means "not cached").

What ``c_j`` is made of:
- executed runs hash the block's token ids (``token_contents``);
- simulated runs hold no token ids: the workload tells which blocks are equal (a trace's
  ``hash_ids``, a random prompt's own identity; ``pcpflow.scheduling.workload``), and a block
  holding generated tokens is keyed by its prompt and its index (greedy outputs follow
  from the prompt: ``output_base``; sampled ones from the request, ``Scheduler(sampled_outputs=True)``).
"""

from __future__ import annotations

import numpy as np

R = np.uint64(0x9E3779B97F4A7C15)
"""The chain's multiplier: ``P_j = R * P_{j-1} + c_j``."""
_R = R
_RINV = np.uint64(pow(0x9E3779B97F4A7C15, -1, 2**64))
_TOKEN_MUL = np.uint64(0xBF58476D1CE4E5B9)
_OUT_SALT = np.uint64(0x94D049BB133111EB)
ROOT = np.uint64(0x2545F4914F6CDD1D)
"""The chain value before a request's first block."""


# NOTE: splitmix64's constants, made once (a numpy scalar costs as much as a small array operation)
_GAMMA, _M1, _M2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def splitmix64(x) -> np.ndarray:
    """A bijective 64-bit mixer (Vigna's splitmix64 finalizer), elementwise on uint64 (at
    least 1-d: array arithmetic wraps silently, scalar arithmetic would warn); in place on a
    fresh copy, so one temporary at a time."""
    z = np.atleast_1d(np.asarray(x, dtype=np.uint64)) + _GAMMA
    t = z >> _S30
    z ^= t
    z *= _M1
    np.right_shift(z, _S27, out=t)
    z ^= t
    z *= _M2
    np.right_shift(z, _S31, out=t)
    z ^= t
    return z


def mix(*parts) -> np.ndarray:
    """One uint64 per element from several uint64 (broadcast, at least 1-d) inputs."""
    h = np.zeros(1, dtype=np.uint64)
    for p in parts:
        h = mix_with(h, p)
    return h


def mix_with(mixed, part) -> np.ndarray:
    """``mix(*head, part)`` from ``mixed = mix(*head)``: a head shared by many elements
    (a prompt's, a trace block's) is mixed once, then gathered."""
    return splitmix64(mixed * _R + np.atleast_1d(np.asarray(part)).astype(np.uint64))


_POWERS = {"up": np.ones(1, dtype=np.uint64), "down": np.ones(1, dtype=np.uint64)}  # R^i and R^-i, grown as needed


def _powers(n: int) -> tuple[np.ndarray, np.ndarray]:
    """R^0..R^n and R^-0..R^-n (mod 2^64)."""
    if len(_POWERS["up"]) <= n:
        size = max(n + 1, 2 * len(_POWERS["up"]))
        for name, base in (("up", _R), ("down", _RINV)):
            pw = np.full(size, base, dtype=np.uint64)
            pw[0] = 1
            _POWERS[name] = np.cumprod(pw, dtype=np.uint64)
    return _POWERS["up"], _POWERS["down"]


def chain(contents: np.ndarray, start=ROOT, lengths=None) -> np.ndarray:
    """``P_j = R * P_{j-1} + c_j`` (mod 2^64) for j = 0..n-1, from ``P_{-1} = start``:
    the chain values of a run of blocks with contents ``c``. ``lengths``: several runs back
    to back, each chained from ``start`` (one value, or one per run)."""
    c = np.asarray(contents, dtype=np.uint64)
    n = len(c)
    if not n:
        return np.zeros(0, dtype=np.uint64)
    if lengths is None:
        up, down = _powers(n)
        with np.errstate(over="ignore"):
            return up[:n] * np.cumsum(c * down[:n], dtype=np.uint64) + up[1:n + 1] * np.uint64(start)
    # NOTE: j = each block's index in its run; each run's sums start from where the last one's ended
    lengths = np.asarray(lengths, dtype=np.int64)
    up, down = _powers(int(lengths.max()))
    first = np.cumsum(lengths) - lengths
    run = np.repeat(np.arange(len(lengths)), lengths)
    j = np.arange(n) - first[run]
    start = np.asarray(start, dtype=np.uint64)
    if start.ndim:  # NOTE: one start per run; a single one multiplies as a scalar, no gather
        start = np.broadcast_to(start, lengths.shape)[run]
    with np.errstate(over="ignore"):
        s = np.cumsum(c * down[j], dtype=np.uint64)
        s -= np.concatenate([np.zeros(1, np.uint64), s])[first][run]
        return up[j] * s + up[j + 1] * start


def keys(chain_values: np.ndarray) -> np.ndarray:
    """The cache keys of chain values: finalized, never 0."""
    k = splitmix64(chain_values)
    k[k == 0] = 1
    return k


def token_contents(tokens: np.ndarray, tokens_per_block: int) -> np.ndarray:
    """``c_j`` of each full block of ``tokens`` (a multiple of ``tokens_per_block`` long)."""
    t = np.asarray(tokens, dtype=np.int64).astype(np.uint64).reshape(-1, tokens_per_block)
    with np.errstate(over="ignore"):
        weights = splitmix64(np.arange(tokens_per_block, dtype=np.uint64) * _TOKEN_MUL)
        return splitmix64((splitmix64(t + np.uint64(1)) * weights).sum(axis=1, dtype=np.uint64))


def output_base(prompt_key) -> np.ndarray:
    """What ``output_contents_at`` takes from the prompt alone (a scheduler keeps it per request,
    so that a decode's newly full block costs one ``splitmix64``)."""
    return mix(np.asarray(prompt_key, dtype=np.uint64), _OUT_SALT) * _R


def output_contents_at(base: np.ndarray, blocks) -> np.ndarray:
    """``c_j`` of blocks ``blocks`` that hold generated tokens, in a run that knows no token
    ids: their content follows from the whole prompt (``base``: its ``output_base``) and j,
    ``mix(prompt_key, salt, j)``'s last round."""
    return splitmix64(base + np.asarray(blocks, dtype=np.uint64))
