"""Meta's ring attention variants (arXiv 2411.01783 sec. 3), priced only: what each ring step
sends, counted here from the layout until the executed ring (``pipeline.forward.cp_attention``)
lands with its own count in ``pcpflow.layouts.accounting``; the lead wires that count in.
Purposes are the executed ring's: ``ring_send_kv``, ``ring_send_q``, ``ring_all2all``.

A ring runs over the DCP group when it is the PCP group (``dcp = pcp``, tp innermost): the KV
cache is sharded over the ring. Per layer, on the rows past the replicated-decode prefix
(``rest``, ``N - nd`` per rank):

- **pass-KV**: ``n - 1`` SendRecv steps, each passing on the KV block a rank holds: its shard
  of the contexts of the requests with rest rows (``context_rows``: ``M`` entries, the rows
  the engine's context gather pads to). Each rank attends its own rows over every block.
- **pass-Q**: ``n - 1`` SendRecv steps of the rank's rest queries (``rest x heads x qk``);
  every rank attends every query chunk over its own shard; one all-to-all returns the
  partial outputs and log-sum-exps to the queries' owners (the engine's ``dcp_partials``).
- **decode ring pass-Q** (``simulate.cp_decode=ring_pass_q``): the batch's ``B`` decode
  queries padded to a multiple of the ring, ``ceil(B / n)`` rows per rank, passed around in
  ``n - 1`` steps; one all-to-all of partials back (replacing ``dcp_decode_partials``).

Each SendRecv of step ``i`` overlaps the partial attention of step ``i - 1`` (its own stream);
the all-to-all and the merge of the ``n`` partials follow the loop (``pcpflow.simulate.price``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pcpflow.layouts.accounting import ModelShape

RING_PURPOSES = ("ring_send_kv", "ring_send_q", "ring_all2all")
RING_PREFILL = ("ring_pass_kv", "ring_pass_q", "ring_auto")


@dataclass(frozen=True)
class RingSend:
    """One purpose of a ring, per layer: ``calls`` per layer, ``tensor_bytes`` one rank sends
    per call (point to point to its ring neighbour, or its whole all-to-all buffer)."""

    purpose: str
    op: str  # sendrecv | all_to_all
    calls: int
    tensor_bytes: int

    def group_bytes(self, n: int) -> int:
        """What every rank receives from the others, summed (``Comm``'s count): a SendRecv
        step moves each rank's block to one neighbour; an all-to-all (n-1)/n of each buffer."""
        if self.op == "sendrecv":
            return n * self.tensor_bytes
        return (n - 1) * self.tensor_bytes


def pass_kv(n: int, context_rows: int, shape: ModelShape, kv_bytes: float) -> list[RingSend]:
    if n <= 1 or not context_rows:
        return []
    return [RingSend("ring_send_kv", "sendrecv", n - 1, int(context_rows * shape.entry_dim * kv_bytes))]


def pass_q(n: int, rest: int, shape: ModelShape) -> list[RingSend]:
    """Partial outputs travel in the activation dtype, their log-sum-exps in fp32 (what
    FlashAttention-3 returns)."""
    if n <= 1 or not rest:
        return []
    q = rest * shape.num_heads * shape.qk_dim * shape.dtype_bytes
    partials = n * rest * shape.num_heads * (shape.v_dim * shape.dtype_bytes + 4)
    return [RingSend("ring_send_q", "sendrecv", n - 1, q), RingSend("ring_all2all", "all_to_all", 1, partials)]


def decode_pass_q(n: int, decodes: int, shape: ModelShape) -> list[RingSend]:
    """Decode ring pass-Q over ``n`` KV shards for ``decodes`` rows (padded to a multiple of n)."""
    if n <= 1 or not decodes:
        return []
    chunk = math.ceil(decodes / n)
    return pass_q(n, chunk, shape)


def meta_algorithm1(*, new_tokens: int, cached_tokens: int, n: int, num_heads: int, num_kv_heads: int,
                    compute_flops: float, bandwidth: float, elem_bytes: float) -> str:
    """Meta's closed-form choice between pass-KV and pass-Q (arXiv 2411.01783 sec. 3.4,
    Algorithm 1, as re-derived here): pass-KV when its per-step KV (``2 (T+P)/N x NKV x D x e``)
    hides behind a step's attention (``4 T (T+P)/N^2 x NH x D`` FLOPs at ``C``), i.e.
    ``T >= N C NKV e / (2 NH BW)``, or when the miss rate ``T / (T+P)`` is at least
    ``2 NKV / NH - 4 T BW / (N C e)`` (pass-Q's queries are smaller than pass-KV's KV below
    ``2 NKV / NH``, less what pass-Q's all-to-all costs); else pass-Q. Returns the engine's
    name of the path: ``context`` (pass-KV) or ``queries`` (pass-Q)."""
    t, p = float(new_tokens), float(cached_tokens)
    if t <= 0:
        return "queries"
    hides = t >= n * compute_flops * num_kv_heads * elem_bytes / (2 * num_heads * bandwidth)
    miss = t / (t + p) >= 2 * num_kv_heads / num_heads - 4 * t * bandwidth / (n * compute_flops * elem_bytes)
    return "context" if hides or miss else "queries"
