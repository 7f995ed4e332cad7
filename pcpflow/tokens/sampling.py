"""Seeded sampling that every rank and the single-rank reference draw identically.

A draw is inverse-CDF sampling with a keyed uniform: ``u`` in (0, 1) is a counter-based
hash (splitmix64) of (seed, request id, position of the generated token), and the token is
the first whose cumulative probability under ``softmax(logits / T)`` (restricted to what
top-k and top-p keep, renormalized) exceeds ``u``. ``u`` is a pure function of the key, not
of a random stream's state, so the draw does not depend on which rank computes it, on the
batch it sits in, or on how many draws came before: equal logits give the same token, and
in float64 (logits equal to ~1e-12) every pcp/dcp/decode layout draws the reference's
tokens. (Gumbel-max with a keyed noise per token draws the same distribution but hashes
all S x V entries: 139 ms for 8 rows of a 128k vocabulary on one CPU thread, against
~10 ms for a softmax and a cumsum.)

Speculative decoding stays exact without rejection sampling: the target's token at a
position is a deterministic function of its logits there and the key, so accepting a
draft exactly when it equals the target's keyed draw (the scheduler's greedy rule)
yields token for token what decoding without drafts yields.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pcpflow.tokens.sampling_config import SamplingConfig


def apply_repetition_penalty(logits: torch.Tensor, penalty: float, history) -> torch.Tensor:
    """``logits`` ``[S, V]`` with transformers' repetition penalty (``RepetitionPenaltyLogitsProcessor``):
    every token row ``s`` has seen — ``history`` is ``(sample, token id)`` per seen token
    (``GlobalBatch.sampled_history``), repeats allowed — is penalized once: a logit ``l``
    becomes ``l * penalty`` where ``l < 0``, else ``l / penalty``."""
    sample, ids = history
    seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    seen[torch.from_numpy(sample).to(logits.device), torch.from_numpy(ids).to(logits.device)] = True
    return torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)


def _u64(value: int) -> int:
    """An unsigned 64-bit constant as the int64 with the same bits (torch has no uint64 math)."""
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _u64(0x9E3779B97F4A7C15)
_MIX1 = _u64(0xBF58476D1CE4E5B9)
_MIX2 = _u64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    # NOTE: int64 >> is arithmetic; masking the sign-extended bits makes it logical.
    return (x >> s) & ((1 << (64 - s)) - 1)


def _splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finalizer on int64 tensors (wrapping multiplication = uint64 bits)."""
    z = x + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    return z ^ _shr(z, 31)


def keyed_uniform(seed: int, req_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """float64 ``[S]`` in (0, 1): the uniform of draw s, a pure function of
    (seed, req_ids[s], positions[s])."""
    key = _splitmix64(torch.full_like(req_ids, int(seed) & ((1 << 63) - 1), dtype=torch.int64))
    key = _splitmix64(key ^ req_ids.to(torch.int64))
    key = _splitmix64(key ^ positions.to(torch.int64))
    # top 53 bits, centred in their interval: never exactly 0 or 1
    return (_shr(key, 11).to(torch.float64) + 0.5) * (1.0 / (1 << 53))


class _Cuts(NamedTuple):
    """What top-k and top-p keep of each row ``[S, V]``, and what they measured to decide."""

    keep: torch.Tensor  # bool [S, V]: both cuts (the most likely token always)
    top_k_keep: torch.Tensor  # bool [S, V]: top-k's alone
    kth: torch.Tensor | None  # float64 [S, 1]: the k-th logit (None: no top-k cut)
    before: torch.Tensor | None  # float64 [S, V]: per sorted token, the top-k-kept mass strictly before it (None: no top-p)
    order: torch.Tensor | None  # int64 [S, V]: the tokens sorted by probability (descending, stable)


def _cuts(logits: torch.Tensor, config: SamplingConfig) -> _Cuts:
    logits = logits.to(torch.float64)
    top_k_keep, kth = torch.ones_like(logits, dtype=torch.bool), None
    if config.top_k and config.top_k < logits.shape[-1]:
        kth = torch.topk(logits, config.top_k, dim=-1).values[:, -1:]
        top_k_keep = logits >= kth
    if config.top_p == 1:
        return _Cuts(top_k_keep, top_k_keep, kth, None, None)
    probs = torch.softmax((logits / config.temperature).masked_fill(~top_k_keep, -torch.inf), dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    before = sorted_p.cumsum(dim=-1) - sorted_p
    # a token is kept while the mass strictly before it is below top_p
    keep = top_k_keep & torch.zeros_like(top_k_keep).scatter(-1, order, before < config.top_p)
    return _Cuts(keep, top_k_keep, kth, before, order)


def kept_tokens(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """bool ``[S, V]``: the tokens top-k and top-p keep (the most likely token always)."""
    return _cuts(logits, config).keep


def probabilities(logits: torch.Tensor, config: SamplingConfig) -> torch.Tensor:
    """float64 ``[S, V]``: ``softmax(logits / T)`` over the kept tokens, 0 elsewhere."""
    scaled = logits.to(torch.float64) / config.temperature
    if config.top_k or config.top_p < 1:
        scaled = scaled.masked_fill(~kept_tokens(logits, config), -torch.inf)
    return torch.softmax(scaled, dim=-1)


def _inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    cdf = probs.cumsum(dim=-1)
    # NOTE: u is scaled by the row's total (1 up to rounding) so that it never passes the
    # end; a token of probability 0 never holds the first cdf > u
    x = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, x, right=True).squeeze(-1)


def sample(
    logits: torch.Tensor, config: SamplingConfig, seed: int, req_ids: np.ndarray, positions: np.ndarray
) -> np.ndarray:
    """int64 ``[S]``: one token per logits row. ``req_ids`` / ``positions`` are each row's
    request and the position of the token it generates (the draw's key)."""
    if config.greedy:
        # NOTE: ties go to the lowest token id (torch.argmax), as greedy always did.
        return logits.argmax(dim=-1).cpu().numpy().astype(np.int64)
    device = logits.device
    rid = torch.as_tensor(np.asarray(req_ids, dtype=np.int64), device=device)
    pos = torch.as_tensor(np.asarray(positions, dtype=np.int64), device=device)
    tokens = _inverse_cdf(probabilities(logits, config), keyed_uniform(seed, rid, pos))
    return tokens.cpu().numpy().astype(np.int64)


def sample_batch(logits: torch.Tensor, config: SamplingConfig, seed: int, batch) -> np.ndarray:
    """``sample`` for the rows of a ``GlobalBatch``: keyed by request id and the position
    each sampled token generates (its own position + 1)."""
    req_ids = batch.req_ids[batch.logits_req_indices]
    positions = batch.positions[batch.logits_indices] + 1
    return sample(logits, config, seed, req_ids, positions)


def decision_gap(
    ref_logits: torch.Tensor, got: int, want: int, config: SamplingConfig, seed: int, req_id: int, position: int
) -> float:
    """How close the reference's choice was, in logit units, for a draw that differs.

    Greedy: the reference's top-2 logit gap. Sampling: how far ``u`` lies from the
    reference's cumulative probability at the edge of ``got``'s interval, times ``T / 2``
    (logits that differ by at most ``d`` move each cumulative probability by at most
    ~``2 d / T``), or, when less, how near the kept set was to another (``_cut_gap``: a
    renormalized CDF moves every edge); where the reference did not keep ``got`` at all, how
    far ``got`` was from being kept (``_keep_gap``). The verifier accepts a draw when this
    is <= 2 * tol.
    """
    row = ref_logits.to(torch.float64).reshape(-1)
    if config.greedy:
        top2 = torch.topk(row, 2).values
        return float(top2[0] - top2[1])
    cuts = _cuts(row[None], config)
    if not cuts.keep[0, got]:
        return _keep_gap(row, got, cuts, config)
    cdf = probabilities(row[None], config)[0].cumsum(dim=-1)
    u = float(keyed_uniform(seed, torch.tensor([req_id]), torch.tensor([position]))[0]) * float(cdf[-1])
    edge = float(cdf[got]) if got < want else float(cdf[got - 1])
    return min(config.temperature / 2 * abs(u - edge), _cut_gap(row, cuts, config))


def _keep_gap(row: torch.Tensor, got: int, cuts: _Cuts, config: SamplingConfig) -> float:
    """How far a token the reference dropped was from being kept, in logit units: below
    top-k's k-th logit by that much; top-p: the mass before it exceeds ``top_p`` by ``m``,
    which logits within ``d`` move by at most ~``2 d / T``: ``T m / 2``. ``row`` is
    ``cuts``'s one row."""
    if not cuts.top_k_keep[0, got]:
        return float(cuts.kth[0, 0]) - float(row[got])
    before, order = cuts.before[0], cuts.order[0]
    return config.temperature / 2 * (float(before[(order == got).nonzero()[0, 0]]) - config.top_p)


def _cut_gap(row: torch.Tensor, cuts: _Cuts, config: SamplingConfig) -> float:
    """How near the reference's kept set was to another, in logit units: top-k's k-th against
    its (k+1)-th logit; top-p's mass before its last kept token and before its first dropped
    one, against ``top_p``, times ``T / 2``. Infinite when nothing is cut. ``row`` is
    ``cuts``'s one row."""
    gaps = [float("inf")]
    top_k_keep = cuts.top_k_keep[0]
    if cuts.kth is not None and not top_k_keep.all():  # NOTE: all kept: every logit past the k-th ties it
        gaps.append(float(cuts.kth[0, 0]) - float(row[~top_k_keep].max()))
    if cuts.before is not None:
        before, order = cuts.before[0], cuts.order[0]
        inside = before < config.top_p
        margins = [config.top_p - float(before[inside].max())]
        dropped = ~inside & top_k_keep[order]
        if dropped.any():
            margins.append(float(before[dropped].min()) - config.top_p)
        gaps.append(config.temperature / 2 * min(margins))
    return min(gaps)
