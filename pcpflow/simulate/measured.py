"""Prices read from a measured profile's tables (``mode=profile``, docs/profile.md).

A profile with ``tables`` prices pcpflow's own forward as it executes on the profiled
machine (not a production engine's): MLA attends in its absorbed form for every row, the
attention backend is the one the profile measured, and every op the forward launches costs
what the profile measured it to.

- **Tables are interpolated**: multilinear in the logarithms of the axes and of the seconds
  (a power law between two points is exact). **Outside them**, the roofline with the
  measured peaks: a GEMM at the best rate its dtype reached or its bytes at the streaming
  bandwidth, whichever is slower; attention at the rate of the table's nearest point
  (seconds per pair); a collective by the latency and bandwidth fitted on its own points.
- **GEMMs** by ``(m, n, k)`` at the run's dtype (``F.linear``, as pcpflow's layers run).
- **Attention** by the work of each call as the backend cuts it (``call_work``): pcpflow's
  reference kernel attends a request's run of 32 rows or more in segments of 32 that share one
  key gather, every other row alone, each reading its span (whole blocks from the first its
  rows need, a windowed layer's rows from their window's start, to its longest context), in
  tiles of segments padded to the tile's longest span (``pcpflow.attention.paged.kernel_work``
  counts them as the kernel runs them; a model's windowed layers are priced by their own calls,
  its full layers by theirs);
  a call costs a fixed part per tile, per entry element its tiles gather (the cache entry,
  ``E``), per pair they score a score per head (``H``) and the products (``F = heads x (qk +
  v)``): ``[tiles, E gathered, H scored, F scored] . u``. The tables hold several head shapes
  (``basis``); at every grid point ``u`` is their least-squares fit, by the work of each call
  the profile timed there, with no negative rate (relative error), and the run's head shape is
  priced on it. A call's rows alone take the decode table's rates, its segments the prefill
  table's, each interpolated at its rows and mean keys (outside: the nearest point's rates). A
  fused kernel's call is one tile that gathers and scores its pairs.
- **Memory-bound ops**: the bytes pcpflow's forward moves through its ops other than GEMMs and
  attention, counted on ``meta`` tensors (``pcpflow.simulate.host.elementwise_bytes``), at the
  streaming rate of a copy their size.
- **Collectives**: the table of the same op on a group of as many ranks.
- **Host**: pcpflow's per-step work outside the layers, ``fixed + per_request x requests +
  per_token x tokens``; each op of a layer that is neither a GEMM nor attention costs the
  measured ``host.launch_us``.
"""

from __future__ import annotations

from functools import cached_property

import numpy as np

from pcpflow.config.hardware import PEAK_OF_DTYPE, AttentionTable, HardwareConfig, Tables

DTYPE_OF_PEAK = {v: k for k, v in PEAK_OF_DTYPE.items()}


def interpolate(axes: list[np.ndarray], values: np.ndarray, point: list[float]) -> float:
    """``values`` (seconds on the grid ``axes``) at ``point``, multilinear in logarithms;
    a coordinate outside its axis is clamped to the axis (the caller scales from there)."""
    logs = np.log(np.maximum(values, 1e-15))
    for ax, x in zip(axes, point):
        la = np.log(ax)
        lx = float(np.clip(np.log(max(x, 1e-300)), la[0], la[-1]))
        i = int(np.clip(np.searchsorted(la, lx) - 1, 0, max(len(la) - 2, 0)))
        if len(la) == 1:
            logs = logs[0]
            continue
        w = (lx - la[i]) / (la[i + 1] - la[i])
        logs = logs[i] * (1 - w) + logs[i + 1] * w
    return float(np.exp(logs))


def nonneg_lstsq(a: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with every coefficient >= 0 (a negative one is dropped, the rest refit)."""
    keep = np.ones(a.shape[1], dtype=bool)
    x = np.zeros(a.shape[1])
    for _ in range(a.shape[1]):
        sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
        if (sol >= 0).all():
            x[keep] = sol
            return x
        idx = np.flatnonzero(keep)
        keep[idx[np.argmin(sol)]] = False
        if not keep.any():
            break
    return x


def attention_requests(phase: str, rows: int, keys: int) -> list[tuple[int, int]]:
    """(cached tokens, new rows) of each request of one measured call: ``rows`` query rows
    whose mean context is about ``keys``. Decode: ``rows`` requests of one row at ``keys - 1``
    cached. Prefill: the fewest chunks whose rows fit their context (a chunk of ``q`` rows
    after ``c`` cached tokens has mean context ``c + (q + 1) / 2``), sizes differing by one."""
    if phase == "decode":
        return [(keys - 1, 1)] * rows
    n = max(1, -(-(rows + 1) // (2 * keys)))  # q = rows / n <= 2 keys - 1
    q, extra = divmod(rows, n)
    out = []
    for i in range(n):
        size = q + (1 if i < extra else 0)
        out.append((max(0, round(keys - (size + 1) / 2)), size))
    return out


def request_rows(requests: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """int64 rows' request and context of a call's ``(cached, new)`` requests: each chunk's
    rows at positions ``cached ..``, each seeing its position plus one keys."""
    req = np.repeat(np.arange(len(requests)), [q for _, q in requests])
    ctx = np.concatenate([np.arange(c + 1, c + q + 1) for c, q in requests])
    return req, ctx


def call_work(backend: str, req: np.ndarray, ctx: np.ndarray, decode: np.ndarray | None, *, heads: float,
              entry: float, block_size: int, starts: np.ndarray | None = None) -> np.ndarray:
    """``[2, 5]`` (``pcpflow.attention.paged.WORK_FIELDS``): one call's work for its rows
    (request ``req``, context ``ctx``, first key ``starts`` on a windowed layer, None: 0; rows
    without a key add nothing), row 0 priced on the decode table, row 1 on the prefill table.
    The reference kernel: its rows alone and its long runs' segments, each in its tiles
    (``kernel_work``: what it gathers and scores from each segment's first needed block, pads
    included). A fused kernel: its decode rows (``decode``, bool) and the rest, one call; it
    gathers and scores every key up to each row's context, windowed or not
    (``pcpflow.attention.fused`` masks the keys before a row's start), so ``starts`` changes
    nothing there."""
    if backend == "reference":
        from pcpflow.attention.paged import kernel_work

        return kernel_work(req, ctx, num_heads=int(round(heads)), entry_dim=int(round(entry)), block_size=block_size,
                           starts=starts)
    out = np.zeros((2, 5))
    decode = np.zeros(len(ctx), dtype=bool) if decode is None else decode
    for i, rows in enumerate((decode & (ctx > 0), ~decode & (ctx > 0))):
        pairs = float(ctx[rows].sum())
        out[i] = rows.sum(), pairs, 1.0, pairs, pairs
    out[:, 2] *= out[:, 0] > 0
    if out[1, 0]:  # NOTE: one call holds both: one fixed part
        out[0, 2] = 0.0
    return out


def work_features(work: np.ndarray, features: np.ndarray) -> np.ndarray:
    """``[..., 4]``: ``head_features`` times a call's counts (``work``'s tiles, entries
    gathered, pairs scored twice), the terms of its price: fixed parts, entries, scores,
    products."""
    return features * work[..., [2, 3, 4, 4]]


def head_features(entry: float, heads: float, products: float) -> np.ndarray:
    """``[1, E, H, F]``: a call's fixed part, the cache entry gathered per key, the scores per
    pair (one per head), the products per pair (``heads x (qk + v)``)."""
    return np.array([1.0, entry, heads, products])


def shape_features(b) -> np.ndarray:
    """``head_features`` of a basis ``HeadShape``: GQA's K and V entries, or MLA's one latent
    (``head_dim + rope_dim``) scored at its full width and summed at ``head_dim``."""
    if b.kind == "mla":
        entry = b.head_dim + b.rope_dim
        return head_features(entry, b.heads, b.heads * (entry + b.head_dim))
    return head_features(2.0 * b.kv_heads * b.head_dim, b.heads, 2.0 * b.heads * b.head_dim)


def fitted_kind(basis, kind: str) -> str:
    """The basis kind a run's ``kind`` of attention is priced on: its own when the profile
    measured at least four of its shapes (four coefficients), else GQA's (older profiles)."""
    return kind if sum(b.kind == kind for b in basis) >= 4 else "gqa"


def attention_coefficients(basis, seconds: np.ndarray, work: np.ndarray, kind: str = "gqa") -> np.ndarray:
    """``u`` at every grid point (``seconds[..., basis]`` -> ``[..., 4]``): the seconds of the
    basis head shapes of ``kind`` fitted by ``work_features(work, [1, E, H, F]) . u`` (each
    shape's call's counts, ``work[..., basis, 2, 5]``), no coefficient negative, each shape's
    relative error weighing alike."""
    pick = [i for i, b in enumerate(basis) if b.kind == kind]
    feats = np.array([shape_features(basis[i]) for i in pick])
    seconds = np.asarray(seconds)[..., pick]
    flat = seconds.reshape(-1, seconds.shape[-1])
    a = work_features(np.asarray(work)[..., pick, :, :], feats[:, None, :]).sum(axis=-2).reshape(-1, *feats.shape)
    out = np.empty((flat.shape[0], 4))
    for i, t in enumerate(flat):
        w = 1.0 / np.maximum(t, 1e-12)
        out[i] = nonneg_lstsq(a[i] * w[:, None], np.ones_like(t))
    return out.reshape(*seconds.shape[:-1], 4)


def grid_work(backend: str, phase: str, rows: list[int], keys: list[int], basis, block_size: int) -> np.ndarray:
    """``[rows, keys, basis, 2, 5]``: ``call_work`` of the call the profile timed at each grid
    point (``attention_requests``) for each basis head shape."""
    out = np.zeros((len(rows), len(keys), len(basis), 2, 5))
    for i, r in enumerate(rows):
        for j, k in enumerate(keys):
            req, ctx = request_rows(attention_requests(phase, int(r), int(k)))
            decode = np.full(len(ctx), phase == "decode")
            for b, shape in enumerate(basis):
                f = shape_features(shape)
                out[i, j, b] = call_work(backend, req, ctx, decode, heads=f[2], entry=f[1], block_size=block_size)
    return out


class MeasuredKernels:
    """``pcpflow.simulate.kernels.Kernels``' interface on a profile's tables, at the run's dtype."""

    def __init__(self, hw: HardwareConfig, *, dtype: str) -> None:
        assert hw.tables is not None and dtype in hw.tables.gemm, "simulate_problems refuses the run first"
        self.hw, self.tables, self.dtype = hw, hw.tables, dtype
        g = hw.tables.gemm[dtype]
        self._gemm_axes = [np.asarray(g.m, float), np.asarray(g.n, float), np.asarray(g.k, float)]
        self._gemm = np.asarray(g.seconds, dtype=np.float64)
        peak = hw.peak(PEAK_OF_DTYPE[dtype])
        self._peak = (peak or 0.0) * 1e12
        self.hbm = hw.hbm_tbps * 1e12
        self.floor = hw.kernel_floor_us * 1e-6
        self.sms = hw.sm_count or 1
        self._cache: dict[tuple[int, int, int], tuple[float, bool]] = {}

    def peak(self, key: str) -> float:
        return self._peak

    # ------------------------------------------------------------------ GEMMs
    def gemm_scalar(self, m: int, n: int, k: int, **_: object) -> tuple[float, bool]:
        """Seconds of one ``[m, k] x [k, n]`` and whether its compute (not its bytes) bounds it."""
        if m <= 0:
            return 0.0, False
        key = (int(m), int(n), int(k))
        hit = self._cache.get(key)
        if hit is None:
            hit = self._cache[key] = self._gemm_seconds(*key)
        return hit

    def gemm(self, m, n: int, k: int, *, count=1, **_: object):
        m = np.atleast_1d(np.asarray(m, dtype=np.float64))
        out = [self.gemm_scalar(int(round(x)), n, k) for x in m.ravel()]
        sec = np.array([s for s, _ in out]).reshape(m.shape)
        bound = np.array([b for _, b in out]).reshape(m.shape)
        return np.asarray(count, dtype=np.float64) * sec, bound

    def _gemm_seconds(self, m: int, n: int, k: int) -> tuple[float, bool]:
        flops = 2.0 * m * n * k
        inside = all(ax[0] <= x <= ax[-1] for ax, x in zip(self._gemm_axes, (m, n, k)))
        if inside:
            t = interpolate(self._gemm_axes, self._gemm, [m, n, k])
            return t, flops / self._peak >= self._bytes(m, n, k) / self.hbm
        t_c, t_m = flops / self._peak, self._bytes(m, n, k) / self.hbm
        return max(t_c, t_m, self.floor), t_c >= t_m

    def _bytes(self, m: int, n: int, k: int) -> float:
        from pcpflow.simulate.sizes import DTYPE_BYTES

        return (m * k + n * k + m * n) * DTYPE_BYTES[self.dtype]

    # ------------------------------------------------------------------ attention
    @cached_property
    def _attention(self) -> dict[tuple[str, str], tuple[list[np.ndarray], np.ndarray]]:
        """Per (phase, attention kind): the grid's axes and the rates fitted at every point on
        the basis shapes that kind is priced on (``fitted_kind``), by the work of each call
        the profile timed."""
        att = self.tables.attention
        out = {}
        for phase in ("prefill", "decode"):
            t: AttentionTable | None = getattr(att, phase).get(self.dtype) if att else None
            if t is not None:
                axes = [np.asarray(t.rows, float), np.asarray(t.keys, float)]
                work = grid_work(att.backend, phase, t.rows, t.keys, att.basis, att.block_size)
                fits = {k: attention_coefficients(att.basis, np.asarray(t.seconds, float), work, k)
                        for k in {fitted_kind(att.basis, kind) for kind in ("gqa", "mla")}}
                for kind in ("gqa", "mla"):
                    out[phase, kind] = (axes, fits[fitted_kind(att.basis, kind)])
        return out

    @property
    def backend(self) -> str:
        return self.tables.attention.backend

    def call(self, work: np.ndarray, features: np.ndarray, kind: str = "gqa") -> float:
        """One call's seconds from its work (``call_work``): row 0 at the decode table's rates,
        row 1 at the prefill table's, each at the grid point of its rows and mean keys."""
        return sum(self._priced(phase, work[i], features, kind) for i, phase in enumerate(("decode", "prefill")))

    def _priced(self, phase: str, work: np.ndarray, features: np.ndarray, kind: str) -> float:
        """``work`` (one row of ``call_work``) at every grid point's rates, interpolated at its
        rows and mean keys: outside the table, the nearest point's rates times its counts."""
        rows, pairs = float(work[0]), float(work[1])
        if rows <= 0 or pairs <= 0:
            return 0.0
        axes, rates = self._attention[phase, kind]
        return interpolate(axes, np.maximum(rates @ work_features(work, features), 1e-12), [rows, pairs / rows])

    def attention(self, phase: str, rows: float, keys: float, features: np.ndarray, kind: str = "gqa") -> float:
        """One call's seconds: ``rows`` query rows attending ``keys`` keys each on average,
        for the head shape of ``features`` (``head_features``) of attention ``kind`` (gqa |
        mla), cut in segments and tiles as the call the profile timed at that point (its
        ``rows x keys`` pairs), at ``phase``'s rates."""
        if rows <= 0 or keys <= 0:
            return 0.0
        req, ctx = request_rows(attention_requests(phase, max(int(round(rows)), 1), max(int(round(keys)), 1)))
        work = call_work(self.backend, req, ctx, np.full(len(ctx), phase == "decode"), heads=features[2],
                         entry=features[1], block_size=self.tables.attention.block_size).sum(axis=0)
        work[3:] *= rows * keys / work[1]  # NOTE: the asked pairs, the timed call's structure
        work[:2] = rows, rows * keys
        return self._priced(phase, work, features, kind)

    def attention_fixed(self, features: np.ndarray, kind: str = "gqa") -> float:
        """The seconds of the smallest decode call measured: one call's fixed cost."""
        axes, _ = self._attention["decode", kind]
        return self.attention("decode", axes[0][0], axes[1][0], features, kind)

    # ------------------------------------------------------------------ memory
    def memory(self, nbytes, op_bytes: float | None = None):
        """Seconds of memory-bound ops moving ``nbytes``, each moving about ``op_bytes`` (read
        and written): at the rate of a copy of half that (in cache when small); past the
        table, the largest copy's."""
        m = self.tables.memory
        half = float(op_bytes) / 2 if op_bytes else float(m.bytes[-1])
        copy = np.asarray(m.bytes, float)
        half = min(max(half, copy[0]), copy[-1])
        rate = 2 * half / interpolate([copy], np.asarray(m.seconds, float), [half])
        return np.asarray(nbytes, dtype=np.float64) / rate


class MeasuredCollectives:
    """Collectives from a profile's tables: the same op on a group of as many ranks."""

    def __init__(self, tables: Tables) -> None:
        self._by: dict[tuple[str, int], object] = {}
        for c in tables.collectives:
            self._by.setdefault((c.op, c.ranks), c)

    def has(self, op: str, ranks: int) -> bool:
        return (op, ranks) in self._by

    def seconds(self, op: str, ranks: int, tensor_bytes: float) -> float:
        c = self._by[(op, ranks)]
        x = np.asarray(c.bytes, float)
        if x[0] <= tensor_bytes <= x[-1] and len(x) > 1:
            return interpolate([x], np.asarray(c.seconds, float), [tensor_bytes])
        return c.latency_us * 1e-6 + tensor_bytes / (c.gbps * 1e9)

    def rate_gbps(self, op: str, ranks: int) -> float:
        return self._by[(op, ranks)].gbps

    def latency_s(self, op: str, ranks: int) -> float:
        return self._by[(op, ranks)].latency_us * 1e-6

    def smallest(self, op: str) -> int | None:
        """The smallest group ``op`` was measured on (None: never)."""
        return min((r for o, r in self._by if o == op), default=None)


def host_seconds(tables: Tables, requests: int, tokens: int) -> float:
    """pcpflow's per-step host work outside the layers."""
    h = tables.host
    return (h.fixed_us + h.per_request_us * requests + h.per_token_us * tokens) * 1e-6


def sync_wait_seconds(tables: Tables, calls: int, busy_s) -> float:
    """How long a step's ``calls`` collectives wait, in all, for the slowest rank (0 without a
    sync table or a collective): each call its fixed wait, and the work between them (the
    busiest rank's ``busy_s``, the step's time outside its collectives) its share:
    ``calls x fixed + per_work x busy``, the sync table's fit summed over the step's calls."""
    t = tables.sync
    if t is None or calls <= 0:
        return 0.0
    return calls * t.fixed_us * 1e-6 + t.per_work * float(np.max(busy_s))


def launch_us(hw: HardwareConfig, attention: str) -> float:
    """One op of pcpflow's forward: the layer's own measure for its attention kind, else
    ``host.launch_us``."""
    launch = hw.tables.launch if hw.tables else None
    if launch and attention in launch.layer_op_us:
        return launch.layer_op_us[attention]
    return hw.host.launch_us


def dtype_of(key: str) -> str:
    """The run dtype of a peak key (``fp32`` -> ``float32``)."""
    return DTYPE_OF_PEAK.get(key, key)
