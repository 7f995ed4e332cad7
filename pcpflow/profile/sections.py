"""What one rank measures, section by section. Every rank of the profile runs the same
sections at the same time (on a CPU they share its caches and memory bandwidth, as a run's
ranks do); each returns its figures, and ``pcpflow.profile.rank`` averages them over the
ranks (collectives: the slowest rank).

- ``launch``: a trivial op's dispatch, and pcpflow's decoder layer at minimal widths (GQA and
  MLA) over the ops it launches (views and module code included): what one op of pcpflow's
  forward costs; on a GPU also a CUDA graph replay;
- ``memory``: a copy of ``bytes`` (read and written once), by size;
- ``gemm``: ``F.linear`` by ``(m, n, k)`` for each dtype;
- ``attention``: one layer's call into the run's attention backend (the KV write and the
  kernel) by (query rows, mean keys per row), prefill (one request's chunk, or several) and
  decode (one row per request), at six GQA head shapes and five MLA ones (``grid.ATTENTION_BASIS``,
  ``grid.MLA_BASIS``);
- ``host``: pcpflow's own per-step work outside the forward's layers (scheduler, validate,
  plan, buffers, slots, the restore's indexing and sampling, the forward's per-step part) by
  requests and tokens: the real engine on a minimal model with one and two layers;
- ``collectives``: each collective a run issues, on every group of the grid, by message size;
- ``sync``: how long a collective waits for the slowest rank after ``w`` seconds of work on
  every rank, beyond the work and the collective themselves.

**Operands come from memory, not from the cache.** A run's step streams every layer's weights
and KV between two uses of one layer's: a model larger than the last-level cache meets each
weight and each KV block cold. Timing one call in a loop on the same tensors measures it hot
(on a 2-core VM, a 1 x 6144 x 768 float32 GEMM took 0.66 ms hot, 1.34 ms cold, and 1.09 ms
inside a run of a 95 MB model). So the memory, GEMM and attention sections take their
weights, copies and KV caches from ``ColdPool``: views into a buffer of twice the last-level
cache, each call a fresh one, so that between two uses of the same bytes the whole buffer has
been read. Inputs that a run has just produced (activations, queries) stay hot.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pcpflow.profile.grid import Grid, basis_shapes
from pcpflow.simulate.measured import attention_requests, nonneg_lstsq

LONG_S = 0.25
TORCH_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def last_level_cache_bytes(device: torch.device) -> int | None:
    """The largest data cache the device reports: a GPU's L2, a CPU's last level (sysfs)."""
    if device.type == "cuda":
        return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0)) or None
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or None


def cold_pool_bytes(grid: Grid, device: torch.device) -> int:
    if grid.cold_pool_bytes is not None:
        return grid.cold_pool_bytes
    cache = last_level_cache_bytes(device) or (128 << 20)
    return int(min(max(2 * cache, 256 << 20), 2 << 30))


class ColdPool:
    """Cold operands: views into one buffer of ``nbytes`` (per dtype, filled once), handed out
    in turn from a cursor that wraps around it, each 4 KiB aligned. A view's bytes were last
    touched a whole buffer ago: with the buffer twice the last-level cache, they come from
    memory, as a run's weights and KV do."""

    ALIGN = 4096

    def __init__(self, nbytes: int, device: torch.device):
        self.nbytes, self.device = nbytes, device
        self._buffer: torch.Tensor | None = None
        self._cursor = 0

    def _buffer_of(self, dtype: torch.dtype) -> torch.Tensor:
        if self._buffer is None or self._buffer.dtype != dtype:
            self._buffer = None  # one dtype's buffer at a time
            n = self.nbytes // torch.empty((), dtype=dtype).element_size()
            self._buffer = torch.empty(n, dtype=dtype, device=self.device).uniform_(-1.0, 1.0)
        return self._buffer

    def views(self, shape: tuple[int, ...], dtype: torch.dtype, count: int) -> list[torch.Tensor]:
        """``count`` distinct tensors of ``shape`` (at most the buffer's worth at once)."""
        buf = self._buffer_of(dtype)
        size = int(np.prod(shape))
        item = buf.element_size()
        step = -(-size * item // self.ALIGN) * self.ALIGN // item
        if step > buf.numel():  # larger than the pool: cold by its own size, a tensor of its own
            return [torch.empty(shape, dtype=dtype, device=self.device).uniform_(-1.0, 1.0)]
        out = []
        for _ in range(min(count, max(1, buf.numel() // step))):
            if self._cursor + step > buf.numel():
                self._cursor = 0
            out.append(buf[self._cursor:self._cursor + size].view(shape))
            self._cursor += step
        return out

    def cycle(self, shape: tuple[int, ...], dtype: torch.dtype, calls: int) -> Callable[[], torch.Tensor]:
        """A fresh view for each of ``calls`` calls (then the same ones again)."""
        views = self.views(shape, dtype, calls)
        it = itertools.cycle(views)
        return it.__next__


@dataclass
class Bench:
    """What a section needs on this rank: where it runs, what to time, and a tick per point."""

    device: torch.device
    grid: Grid
    dtypes: list[str]
    attention: str  # pipeline.forward.attention (reference | fused | auto)
    block_size: int
    comms: dict[str, Any]  # distinct groups of the grid with more than one rank: name -> Comm
    tick: Callable[[int], None] = lambda n: None
    run_cfg: Any = None  # the profile's RunConfig (the host section derives its runs from it)
    cold: ColdPool | None = None

    def __post_init__(self) -> None:
        if self.cold is None:
            self.cold = ColdPool(cold_pool_bytes(self.grid, self.device), self.device)

    @property
    def calls(self) -> int:
        """The most calls ``timed`` makes of one function: a cold operand for each."""
        return self.grid.max_repeats + 1

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn: Callable[[], Any]) -> float:
        """The median seconds of one ``fn()``: one warm-up, then repeated until ``min_time_s``
        has passed (at most ``max_repeats``). A call of more than ``LONG_S`` is its own
        measure (its warm-up would double the section)."""
        t = time.perf_counter()
        fn()
        self.sync()
        first = time.perf_counter() - t
        if first > LONG_S:
            return first
        times: list[float] = []
        start = time.perf_counter()
        while len(times) < self.grid.max_repeats and (not times or time.perf_counter() - start < self.grid.min_time_s):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        # NOTE: the median, not the least time: an executed run meets the machine as it is (its
        # other work, its jitter), and a profile predicts runs. On a 2-core VM the least time of
        # an attention call was about half its typical one, and predictions fell short by as much.
        return statistics.median(times)


# ------------------------------------------------------------------------------ launch
def launch(b: Bench) -> dict[str, Any]:
    x = torch.zeros(1, device=b.device)
    n = 200 if b.grid.max_repeats <= 5 else 2000

    def many() -> None:
        for _ in range(n):
            x.add_(1.0)

    out: dict[str, Any] = {"op_us": b.timed(many) / n * 1e6, "layer_op_us": {}}
    b.tick(1)
    for kind in ("gqa", "mla"):
        out["layer_op_us"][kind] = _layer_op_us(b, kind)
        b.tick(1)
    if b.device.type == "cuda":
        out["graph_replay_us"] = _graph_replay_us(b)
    return out


def minimal_model_config(kind: str, *, layers: int = 1, tp: int = 1) -> dict[str, Any]:
    """A tiny model at minimal widths: its ops cost their launch, not their arithmetic."""
    common = dict(vocab_size=256, hidden_size=32, num_layers=layers, intermediate_size=32)
    if kind == "gqa":
        return dict(name="tiny_gqa", num_heads=2 * tp, num_kv_heads=tp, head_dim=8, **common)
    return dict(name="tiny_mla", num_heads=2 * tp, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8,
                qk_rope_head_dim=8, v_head_dim=8, **common)


def _layer_op_us(b: Bench, kind: str) -> float:
    from pydantic import TypeAdapter

    from pcpflow.models import ModelConfig, build_model
    from pcpflow.simulate.host import op_count

    model = build_model(TypeAdapter(ModelConfig).validate_python(minimal_model_config(kind)), dtype=torch.float32,
                        seed=0, device=b.device)
    layer, spec, rows = model.layers[0], model.attn_spec, 4
    x = torch.randn(rows, 32, device=b.device)
    positions = torch.arange(rows, device=b.device)

    def attend(_layer, q, _kv, sinks=None):  # the backend is measured apart (the attention section)
        return q.new_zeros(q.shape[0], spec.num_heads, spec.v_dim)

    with torch.no_grad():
        with op_count() as count:
            layer(x, positions, 0, attend)
        seconds = b.timed(lambda: layer(x, positions, 0, attend))
    return seconds / max(count.n, 1) * 1e6


def _graph_replay_us(b: Bench) -> float:
    x = torch.zeros(1, device=b.device)
    g = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1.0)
        g.capture_begin()
        x.add_(1.0)
        g.capture_end()
    torch.cuda.synchronize()
    return b.timed(g.replay) * 1e6


# ------------------------------------------------------------------------------ memory
def memory(b: Bench) -> dict[str, Any]:
    seconds = []
    for nbytes in b.grid.memory_bytes:
        pairs = itertools.cycle([tuple(v) for v in b.cold.views((2, nbytes // 4), torch.float32, b.calls)])

        def copy() -> None:
            src, dst = next(pairs)
            dst.copy_(src)

        seconds.append(b.timed(copy))
        b.tick(1)
    return {"bytes": list(b.grid.memory_bytes), "seconds": seconds}


# ------------------------------------------------------------------------------ gemm
def gemm(b: Bench, dtype: str) -> dict[str, Any]:
    dt, g = TORCH_DTYPES[dtype], b.grid
    big = max(g.gemm_m)
    x_all = torch.randn(big, max(g.gemm_nk), device=b.device).to(dt)
    seconds = []
    with torch.no_grad():
        for m in g.gemm_m:
            plane = []
            for n in g.gemm_nk:
                row = []
                for k in g.gemm_nk:
                    x, w = x_all[:m, :k].contiguous(), b.cold.cycle((n, k), dt, b.calls)
                    row.append(b.timed(lambda: F.linear(x, w())))
                plane.append(row)
            seconds.append(plane)
            b.tick(len(g.gemm_nk) ** 2)
    return {"m": list(g.gemm_m), "n": list(g.gemm_nk), "k": list(g.gemm_nk), "seconds": seconds}


# ------------------------------------------------------------------------------ attention
def attention(b: Bench, dtype: str, phase: str) -> dict[str, Any]:
    from pcpflow.attention.fused import attention_kernel
    from pcpflow.models.layers import gqa_spec, mla_spec

    kernel = attention_kernel(b.attention, b.device)
    g, dt = b.grid, TORCH_DTYPES[dtype]
    specs = [gqa_spec(s["heads"], s["kv_heads"], s["head_dim"]) if s.get("kind") != "mla" else
             mla_spec(s["heads"], s["head_dim"], s["rope_dim"], (s["head_dim"] + s["rope_dim"]) ** -0.5)
             for s in basis_shapes()]
    rows_axis = g.prefill_rows if phase == "prefill" else g.decode_rows
    keys_axis = g.prefill_keys if phase == "prefill" else g.decode_keys
    seconds = []
    with torch.no_grad():
        for rows in rows_axis:
            plane = []
            for keys in keys_axis:
                requests = attention_requests(phase, rows, keys)
                point = []
                for spec in specs:
                    call = _attention_call(kernel, spec, requests, b.block_size, dt, b.device, cold=b.cold,
                                           calls=b.calls)
                    point.append(b.timed(call))
                plane.append(point)
                b.tick(1)
            seconds.append(plane)
    return {"rows": list(rows_axis), "keys": list(keys_axis), "seconds": seconds}


def _attention_call(kernel, spec, requests, block_size: int, dtype: torch.dtype, device: torch.device, *,
                    cold: ColdPool | None = None, calls: int = 1):
    """One layer's attention as ``CPAttention`` makes it at one rank: the new rows' KV
    written through their slots, then the kernel over each row's context; with ``cold``,
    each call on a fresh KV cache from the pool."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    lens = [c + q for c, q in requests]
    blocks = [-(-n // block_size) for n in lens]
    table = torch.zeros(len(requests), max(blocks), dtype=torch.long)
    start = 0
    for i, nb in enumerate(blocks):
        table[i, :nb] = torch.arange(start, start + nb)
        start += nb
    shape = (start * block_size, spec.entry_dim)
    if cold is None:
        caches = itertools.repeat(torch.randn(*shape, generator=gen).to(dtype=dtype, device=device))
    else:
        caches = itertools.cycle(cold.views(shape, dtype, calls))
    req = torch.cat([torch.full((q,), i) for i, (_, q) in enumerate(requests)])
    ctx = torch.cat([torch.arange(c + 1, c + q + 1) for c, q in requests])
    pos = ctx - 1
    slots = (table[req, pos // block_size] * block_size + pos % block_size).to(device)
    rows = len(req)
    q = torch.randn(rows, spec.num_heads, spec.qk_dim, generator=gen).to(dtype=dtype, device=device)
    kv = torch.randn(rows, spec.entry_dim, generator=gen).to(dtype=dtype, device=device)
    table, req, ctx = table.to(device), req.to(device), ctx.to(device)

    def call() -> None:
        cache = next(caches)
        cache.index_copy_(0, slots, kv)
        kernel(q, cache, spec, table, req, ctx, block_size)

    return call


# ------------------------------------------------------------------------------ host
def host(b: Bench) -> dict[str, Any]:
    """The engine itself (``pcpflow.rank.engine.run_rank``), one rank on each of the profile's
    ranks at once, a minimal model with one and two layers: a prefill step of ``B`` prompts,
    then decodes of ``B`` rows; one long prompt alone. Per step its requests, tokens, layers,
    the seconds outside the forward and the forward's. One rank: no collective in them (the
    run's are priced as collectives)."""
    from pcpflow.rank.engine import run_rank

    g, points = b.grid, []
    runs = [(batch, g.host_prompt) for batch in g.host_batches] + [(1, g.host_long_prompt)]
    with tempfile.TemporaryDirectory(prefix="pcpflow-profile-host-") as tmp:
        for i, (batch, prompt) in enumerate([runs[0], *runs]):  # the first run warms up
            for layers in (1, 2):
                cfg = _host_config(b.run_cfg, batch, prompt, layers)
                run_dir = Path(tmp) / f"{i}-{layers}"
                run_dir.mkdir()
                run_rank(cfg, run_dir)
                if i:
                    points += _host_points(run_dir / "metrics.jsonl", layers)
            b.tick(1)
    return {"points": points}


def _host_config(run_cfg, batch: int, prompt: int, layers: int):
    from pcpflow.config.run import RunConfig
    from pcpflow.profile.checks import without_drafting

    # NOTE: the pipeline draws on pipeline.draft over the draft group: drafting is no part of the host work
    raw = without_drafting(run_cfg).model_dump(mode="json")
    raw.update(
        mode="execute", verify=False, dtype="float32", max_steps=None, tp=1, pcp=1, dcp=1,
        model=minimal_model_config("gqa", layers=layers),
        workload={"kind": "explicit", "prompt_lens": [prompt] * batch, "output_lens": [6]},
        scheduler={"max_num_batched_tokens": max(prompt * batch, 64), "max_num_seqs": max(batch, 1)},
        kv={"block_size": run_cfg.kv.block_size, "num_blocks": 2 * batch * (-(-(prompt + 8) // run_cfg.kv.block_size)) + 8,
            "interleave": 1},
        output={"plots": False, "progress": False, "save_logits": False},
        profile={}, hardware=None, cudagraph_mode="none", plugins=[],
        pipeline={k: v for k, v in raw["pipeline"].items() if k != "extra"},
    )
    return RunConfig.model_validate(raw)


def _host_points(metrics: Path, layers: int) -> list[list[float]]:
    import json

    out = []
    for line in metrics.read_text().splitlines():
        rec = json.loads(line)
        forward = (rec.get("stage_s") or {}).get("forward", 0.0)
        out.append([rec["num_reqs"], rec["num_tokens"], layers, rec["step_s"] - forward, forward])
    return out


def fit_host(points: list[list[float]]) -> dict[str, Any]:
    """``outside = a + b requests + c tokens`` and ``forward = a' + b' requests + c' tokens +
    layers (d + e requests + f tokens)`` by least squares on each shape's median time (steps and
    ranks alike, as ``Bench.timed``): the host table's fit is the part outside the forward
    plus the forward's per-step part (``a'``, ``b'``, ``c'``); the layers are priced by their
    ops (``launch``) and kernels. Its points: each one-layer shape, less the fitted layer."""
    shapes: dict[tuple[float, float, float], list[list[float]]] = {}
    for reqs, toks, layers, outside, forward in points:
        shapes.setdefault((reqs, toks, layers), []).append([outside, forward])
    p = np.asarray([[*k, *np.median(np.asarray(v), axis=0)] for k, v in sorted(shapes.items())], dtype=np.float64)
    reqs, toks, layers, outside, forward = p.T
    one = np.ones_like(reqs)
    a = nonneg_lstsq(np.stack([one, reqs, toks], 1), outside)
    f = nonneg_lstsq(np.stack([one, reqs, toks, layers, layers * reqs, layers * toks], 1), forward)
    total = a + f[:3]
    sel = layers == 1
    per_step = outside[sel] + forward[sel] - (f[3] + f[4] * reqs[sel] + f[5] * toks[sel])
    return {
        "requests": [int(x) for x in reqs[sel]], "tokens": [int(x) for x in toks[sel]],
        "seconds": [float(max(x, 0.0)) for x in per_step],
        "fixed_us": float(total[0] * 1e6), "per_request_us": float(total[1] * 1e6),
        "per_token_us": float(total[2] * 1e6),
    }


# ------------------------------------------------------------------------------ collectives
def collectives(b: Bench) -> list[dict[str, Any]]:
    """Every op a run issues (``pcpflow.parallel.comm.Comm``: all-gather, all-reduce,
    reduce-scatter, all-to-all, broadcast; a ring's send/recv) on every group of the grid
    with more than one rank, by one rank's tensor bytes; a barrier before each call so that
    it times the collective, not a peer's lateness. The mean of the calls: their times are a
    heavy tail, and a run pays the mean (a small all-reduce's was 1.7x its median on a 2-core
    VM)."""
    from pcpflow.config.hardware import COLLECTIVE_OPS

    out = []
    for name, comm in b.comms.items():
        for op in COLLECTIVE_OPS:
            seconds = []
            for nbytes in b.grid.collective_bytes:
                seconds.append(_collective_seconds(b, comm, op, nbytes))
                b.tick(1)
            out.append({"group": name, "ranks": comm.size, "op": op, "bytes": list(b.grid.collective_bytes),
                        "seconds": seconds})
    return out


def _collective_seconds(b: Bench, comm, op: str, nbytes: int) -> float:
    n = comm.size
    elems = max(n, nbytes // 4 // n * n)  # divisible by the group (all-to-all, reduce-scatter)
    t = torch.ones(elems, dtype=torch.float32, device=b.device)
    recv = torch.empty_like(t)
    call = {
        "all_gather": lambda: comm.all_gather(t, "profile"),
        "all_reduce": lambda: comm.all_reduce(t, "profile"),
        "reduce_scatter": lambda: comm.reduce_scatter(t, "profile"),
        "all_to_all": lambda: comm.all_to_all(t, "profile"),
        "broadcast": lambda: comm.broadcast(t, 0, "profile"),
        "sendrecv": lambda: comm.ring_exchange([(t, "profile")], [recv]).wait(),
    }[op]
    repeats = 3 if nbytes >= 1 << 20 else max(3, b.grid.max_repeats)
    call()
    times = []
    for _ in range(repeats):
        comm.barrier()
        b.sync()
        start = time.perf_counter()
        call()
        b.sync()
        times.append(time.perf_counter() - start)
    return statistics.mean(times)


def monotone(seconds: list[float]) -> list[float]:
    """Each size's time no more than any larger size's: a larger message never costs less, so
    a small one that took longer waited for something else (a descheduled peer)."""
    out, least = [], float("inf")
    for t in reversed(seconds):
        least = min(least, t)
        out.append(least)
    return out[::-1]


def fit_collective(nbytes: list[int], seconds: list[float]) -> tuple[float, float]:
    """(latency_us, GB/s) of ``seconds = latency + bytes / bandwidth``, least squares on the
    relative error (small and large messages weigh alike), both kept positive."""
    x, y = np.asarray(nbytes, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    coef = nonneg_lstsq(np.stack([w, x * w], 1), np.ones_like(y))
    lat, per_byte = coef
    if per_byte <= 0:  # flat: the largest message's time is its latency
        per_byte = 1e-12
    return float(lat * 1e6), float(1.0 / per_byte / 1e9)


# ------------------------------------------------------------------------------ sync
SYNC_BUDGET_S, SYNC_ROUNDS = 3.0, 6  # seconds of one point of the sync section (full grid); rounds


def sync(b: Bench) -> dict[str, Any]:
    """The wait for the slowest rank. Every rank does the same work for about ``w`` seconds,
    then one collective (a one-element all-reduce on the largest group), many times over.
    The profile's collectives table times each call after a barrier, when every rank arrives
    at once. A run's ranks arrive as their work lets them. With every core busy, whatever
    else the machine runs (the OS, the driver, a VM's host) delays one rank, and the others
    wait for it. The excess is the loop's mean time less two things: the work's own mean
    (every rank working at the same time, no collective) and the bare collective's median.
    Means, not medians: a run's TTFT and TPOT are means, and the waits are a heavy tail.

    NOTE: timing each iteration's work and collective apart within the one loop (the waits
    read directly) gave 2-3x these excesses at 64 ms and fitted the validation runs worse
    (docs/profile.md); the loops are kept apart."""
    comm = max(b.comms.values(), key=lambda c: c.size)
    a = torch.randn(128, 128, device=b.device)
    one = torch.zeros(1, device=b.device)
    unit = b.timed(lambda: a @ a)
    # NOTE: the waits are a heavy tail, so a point's mean needs many iterations: each point
    # runs for about ``budget`` seconds, its two loops alternating in rounds (a drift of the
    # machine's speed during the point weighs on both alike).
    budget = SYNC_BUDGET_S if b.grid.max_repeats > 5 else SYNC_BUDGET_S / 10
    work_s, excess = [], []
    for w in b.grid.sync_work_s:
        reps = max(1, round(w / unit))
        iters = max(2, round(budget / 2 / SYNC_ROUNDS / w))  # per loop and round

        def work() -> None:
            for _ in range(reps):
                a @ a
            b.sync()

        def collective() -> None:
            comm.all_reduce(one, "profile")
            b.sync()

        def loop(fn, n: int) -> list[float]:
            comm.barrier()
            times = []
            for _ in range(n):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return times

        alone, together = [], []
        for _ in range(SYNC_ROUNDS):
            alone += loop(work, iters)
            together += loop(lambda: (work(), collective()), iters)
        bare = statistics.median(loop(collective, 200))
        work_s.append(statistics.mean(alone))  # the work as it ran (about w: one timed call sized its repeats)
        excess.append(max(statistics.mean(together) - statistics.mean(alone) - bare, 0.0))
        b.tick(1)
    return {"work_s": work_s, "excess_s": excess}


def fit_sync(work_s: list[float], excess_s: list[float]) -> dict[str, Any]:
    """``excess = fixed + per_work x work`` (least squares on the relative error, both kept
    non-negative): a collective's mean wait for the slowest rank after ``work`` seconds of
    work. A point under a tenth of the largest excess weighs as that tenth (an excess of 0,
    a noisy mean clipped, must not pin the fit)."""
    x, y = np.asarray(work_s, dtype=np.float64), np.asarray(excess_s, dtype=np.float64)
    w = 1.0 / np.maximum(y, max(0.1 * float(y.max(initial=0.0)), 1e-9))
    fixed, per_work = nonneg_lstsq(np.stack([w, x * w], 1), y * w)
    return {"work_s": [float(v) for v in x], "excess_s": [float(v) for v in y], "fixed_us": float(fixed * 1e6),
            "per_work": float(per_work)}
