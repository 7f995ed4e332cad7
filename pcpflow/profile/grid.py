"""The sizes a profile measures: model-independent grids (powers of two and four), a full one
and a quick one (``profile.quick``: tests). Validated shapes lie between their points."""

from __future__ import annotations

from dataclasses import dataclass

# The attention price is linear in what a call moves per key (the cache entry), per pair and
# head (the scores) and per pair (the products): four coefficients, fitted without a negative
# one on these head shapes (heads, kv heads, head dim) at every point of the grid
# (``pcpflow.simulate.measured``). Six shapes for four unknowns: a least-squares fit, not a
# solve that amplifies each measure's noise.
ATTENTION_BASIS = ((1, 1, 16), (8, 1, 16), (8, 8, 16), (2, 2, 64), (4, 1, 128), (8, 8, 64))
# MLA's absorbed attention (a latent entry that is both key and value) runs another path of
# the backend, at another cost per feature: its own coefficients, fitted on these shapes
# (heads, kv_lora_rank, rope_dim) whose latents span the cards' (DeepSeek: 512 + 64).
MLA_BASIS = ((1, 16, 8), (8, 32, 16), (2, 64, 16), (4, 128, 32), (1, 256, 32))


def basis_shapes() -> list[dict[str, int | str]]:
    """Every head shape the attention section measures, as ``HeadShape`` fields, in order."""
    return ([{"heads": h, "kv_heads": kv, "head_dim": d} for h, kv, d in ATTENTION_BASIS]
            + [{"kind": "mla", "heads": h, "kv_heads": 1, "head_dim": lora, "rope_dim": rope}
               for h, lora, rope in MLA_BASIS])


@dataclass(frozen=True)
class Grid:
    gemm_m: tuple[int, ...]
    gemm_nk: tuple[int, ...]
    prefill_rows: tuple[int, ...]
    prefill_keys: tuple[int, ...]  # mean keys a query row attends
    decode_rows: tuple[int, ...]
    decode_keys: tuple[int, ...]
    memory_bytes: tuple[int, ...]
    collective_bytes: tuple[int, ...]
    host_batches: tuple[int, ...]  # requests of one host-work run (a prefill step, then decodes)
    host_prompt: int  # tokens of each prompt
    host_long_prompt: int  # one request alone, to tell tokens from requests
    sync_work_s: tuple[float, ...]  # work every rank does before the collective the sync section times
    min_time_s: float  # a point is repeated until it has run this long (at least once)
    max_repeats: int
    # the buffer cold operands are taken from (``sections.ColdPool``); None: twice the
    # last-level cache the OS reports, 256 MiB .. 2 GiB
    cold_pool_bytes: int | None = None


FULL = Grid(
    gemm_m=(1, 4, 16, 64, 256, 1024, 4096),
    gemm_nk=(64, 256, 1024, 4096),
    prefill_rows=(32, 256, 2048),
    prefill_keys=(16, 64, 512, 2048),
    decode_rows=(1, 8, 32),
    decode_keys=(16, 64, 512, 2048),
    memory_bytes=tuple(4 ** i for i in range(6, 14)),  # 4 KiB .. 64 MiB
    collective_bytes=tuple(4 ** i for i in range(3, 13)),  # 64 B .. 16 MiB
    host_batches=(1, 4, 16, 64),
    host_prompt=32,
    host_long_prompt=1024,
    sync_work_s=(0.00025, 0.001, 0.004, 0.016, 0.064),
    min_time_s=0.02,
    max_repeats=20,
)

QUICK = Grid(
    gemm_m=(1, 16, 256),
    gemm_nk=(64, 512),
    prefill_rows=(32, 512),
    prefill_keys=(64, 1024),
    decode_rows=(1, 16),
    decode_keys=(64, 1024),
    memory_bytes=(4 ** 7, 4 ** 10, 4 ** 12),
    collective_bytes=(4 ** 4, 4 ** 7, 4 ** 10),
    host_batches=(1, 8),
    host_prompt=16,
    host_long_prompt=256,
    sync_work_s=(0.0005, 0.004),
    min_time_s=0.004,
    max_repeats=5,
    cold_pool_bytes=32 << 20,  # tests: the schema and the arithmetic, not this machine's caches
)


def grid_of(quick: bool) -> Grid:
    return QUICK if quick else FULL
