"""Paged attention kernels side by side on one batch (CPU or CUDA): the reference, the
fused kernel over a gather of each request's blocks (pcpflow.attention.fused), and
flex_attention straight over the whole paged cache through the block tables (a
``mask_mod`` that maps each cache slot to its request and position), the alternative
the gather was chosen over.

``--windows``: the reference kernel on windowed rows (a sliding window and Llama 4's chunks)
against the same rows without a window, side by side: a prefill chunk and decodes at a long
context; the rows without a window read every block up to their context, which is what the
kernel read for windowed rows before it gathered only each segment's span (the blocks from the
first one its rows' window needs), so the ratio is what the span saves.

    python scripts/bench_attention.py [--device cuda] [--dtype bfloat16] [--cache-x 4]
    python scripts/bench_attention.py --windows [--context 16384 --chunk 4096 --decodes 15]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pcpflow.attention.fused import fused_paged_attention  # noqa: E402
from pcpflow.attention.paged import kernel_work, paged_attention  # noqa: E402
from pcpflow.layouts.slots import window_starts  # noqa: E402
from pcpflow.models.layers import gqa_spec  # noqa: E402


def block_table_flex(q, cache, spec, tables, req, ctx, block):
    """flex over the whole cache: row n sees slot s iff s holds position p < ctx[n] of
    request req[n] (inverse block tables), no gather."""
    from torch.nn.attention.flex_attention import flex_attention

    slots = cache.shape[0]
    slot_req = torch.full((slots,), -1, dtype=torch.long, device=q.device)
    slot_pos = torch.zeros(slots, dtype=torch.long, device=q.device)
    nb = tables.shape[1]
    s = (tables[:, :, None] * block + torch.arange(block, device=q.device)).reshape(tables.shape[0], -1)
    slot_req[s] = torch.arange(tables.shape[0], device=q.device)[:, None].expand_as(s)
    slot_pos[s] = torch.arange(nb * block, device=q.device).expand_as(s)
    neg = torch.tensor(float("-inf"), dtype=q.dtype, device=q.device)

    def score_mod(score, b, h, qi, kj):
        return torch.where((slot_req[kj] == req[qi]) & (slot_pos[kj] < ctx[qi]), score, neg)

    k = spec.keys(cache).transpose(0, 1)[None]
    v = spec.values(cache).transpose(0, 1)[None]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q.transpose(0, 1)[None], k, v, score_mod=score_mod, scale=spec.scale, enable_gqa=True)


def timed(fn, dev: torch.device, repeats: int) -> float:
    """Median seconds of ``fn`` after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def windows(args, dev: torch.device, dtype: torch.dtype, block: int) -> None:
    """A prefill chunk of ``--chunk`` rows ending at ``--context`` and ``--decodes`` decodes at
    ``--context``, through each window, against the same rows without one (one run)."""
    spec = gqa_spec(8, 2, 64)
    g = torch.Generator().manual_seed(0)
    reqs, nb = 1 + args.decodes, -(-args.context // block)
    tables = torch.arange(reqs * nb).view(reqs, nb).to(dev)
    cache = torch.randn(reqs * nb * block, spec.entry_dim, generator=g).to(dev, dtype)
    q = torch.randn(args.chunk + args.decodes, spec.num_heads, spec.qk_dim, generator=g).to(dev, dtype)
    req = torch.cat([torch.zeros(args.chunk, dtype=torch.long), torch.arange(1, reqs)])
    pos = torch.cat([torch.arange(args.context - args.chunk, args.context), torch.full((args.decodes,), args.context - 1)])
    ctx = pos + 1
    full = timed(lambda: paged_attention(q, cache, spec, tables, req.to(dev), ctx.to(dev), block), dev, args.repeats)
    every = kernel_work(req, ctx, num_heads=spec.num_heads, entry_dim=spec.entry_dim, block_size=block)
    print(f"device={dev} dtype={dtype} threads={torch.get_num_threads()} prefill rows={args.chunk} "
          f"decodes={args.decodes} context={args.context} block={block}")
    print(f"{'no window (every block)':>26}: {full * 1e3:9.1f} ms   gathered {every[:, 3].sum():12,.0f}")
    for size, kind in ((args.window, "sliding"), (args.chunk_size, "chunked")):
        starts = torch.from_numpy(window_starts(pos.numpy(), size, kind))
        t = timed(lambda: paged_attention(q, cache, spec, tables, req.to(dev), ctx.to(dev), block, starts.to(dev)),
                  dev, args.repeats)
        work = kernel_work(req, ctx, num_heads=spec.num_heads, entry_dim=spec.entry_dim, block_size=block,
                           starts=starts.numpy())
        print(f"{f'{kind} {size} (span)':>26}: {t * 1e3:9.1f} ms   gathered {work[:, 3].sum():12,.0f}   "
              f"time ratio {t / full:.3f}   gathered ratio {work[:, 3].sum() / every[:, 3].sum():.3f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--context", type=int, default=None, help="default 512 (16384 with --windows)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill rows: default 64 (4096 with --windows)")
    ap.add_argument("--decodes", type=int, default=None, help="default 7 (15 with --windows)")
    ap.add_argument("--cache-x", type=float, default=4.0, help="cache slots / slots in use")
    ap.add_argument("--windows", action="store_true", help="windowed rows against the same rows without a window")
    ap.add_argument("--window", type=int, default=512, help="--windows: the sliding window")
    ap.add_argument("--chunk-size", type=int, default=2048, help="--windows: the chunked window")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    for name, plain, long in (("context", 512, 16384), ("chunk", 64, 4096), ("decodes", 7, 15)):
        if getattr(args, name) is None:
            setattr(args, name, long if args.windows else plain)
    dev, dtype, block = torch.device(args.device), getattr(torch, args.dtype), 16
    if args.windows:
        return windows(args, dev, dtype, block)
    spec = gqa_spec(8, 2, 64)
    g = torch.Generator().manual_seed(0)
    reqs, nb = 1 + args.decodes, -(-args.context // block)
    total = int(reqs * nb * args.cache_x)
    tables = torch.randperm(total, generator=g)[: reqs * nb].view(reqs, nb).to(dev)
    cache = torch.randn(total * block, spec.entry_dim, generator=g).to(dev, dtype)
    q = torch.randn(args.chunk + args.decodes, spec.num_heads, spec.qk_dim, generator=g).to(dev, dtype)
    req = torch.cat([torch.zeros(args.chunk, dtype=torch.long), torch.arange(1, reqs)]).to(dev)
    ctx = torch.cat([torch.arange(args.context - args.chunk + 1, args.context + 1), torch.full((args.decodes,), args.context)]).to(dev)
    a = (q, cache, spec, tables, req, ctx, block)
    ref, _ = paged_attention(*a)
    kernels = {
        "reference": lambda: paged_attention(*a)[0],
        "fused_gather_flex": lambda: fused_paged_attention(*a, kernel="flex")[0],
        "fused_gather_sdpa": lambda: fused_paged_attention(*a, kernel="sdpa")[0],
        "flex_block_tables": lambda: block_table_flex(*a)[0].transpose(0, 1),
    }
    print(f"device={dev} dtype={dtype} rows={q.shape[0]} context={args.context} cache_slots={cache.shape[0]}")
    for name, fn in kernels.items():
        t = timed(fn, dev, 5)
        diff = float((fn().float() - ref.float()).abs().max())
        print(f"{name:>18}: {t * 1e3:8.2f} ms   max|diff| {diff:.2e}")


if __name__ == "__main__":
    main()
