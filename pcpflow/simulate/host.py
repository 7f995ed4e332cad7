"""The host side of a step: the kernels a layer launches, counted from pcpflow's own forward.

``kernels_per_layer`` builds one decoder layer of the model card at one TP rank's shapes on
the ``meta`` device (no memory, no arithmetic), runs it through the path a CUDA device takes
(the fused attention kernel, ``pcpflow.attention.fused``, in its static form: the paged write
and ``fused_decode_attention`` with the SDPA kernel) under a ``TorchDispatchMode``, and counts
the ATen ops that launch a kernel: every op but views (``OpOverload.is_view``). The count is
pcpflow's own: its RMSNorm is several kernels (cast, square, mean, rsqrt, scale), its RoPE
computes cos/sin and rotates with slicing arithmetic, its GEMMs are plain ``mm``. A
production engine fuses norms with the residual add, RoPE into one kernel and quantizes
activations for FP8 GEMMs in the GEMM's prologue: around 15 kernels per layer (docs/simulate.md
lists both). ``hardware.host.kernels_per_layer`` overrides the count for such an engine.

Per step (``Host.step``): eager, every kernel and every collective costs ``launch_us`` of
host time; a full CUDA graph replays the whole forward for one ``graph_launch_us``;
piecewise graphs (vLLM: everything but attention) replay one piece per layer plus one and
launch the attention kernels eagerly. The host runs ahead of the GPU and waits once per
step (sampling reads the logits), so a step takes the longer of the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from pcpflow.simulate.sizes import ModelSizes

EMBED_AND_SAMPLE = 3  # embedding lookup, LM head, greedy sample: one kernel each


@dataclass(frozen=True)
class LayerKernels:
    total: int  # kernels one decoder layer launches
    attention: int  # of which the attention backend's (write, attend)
    norm: int  # one RMSNorm (the final norm outside the layers)


def kernels_per_layer(sizes: ModelSizes, tp: int) -> LayerKernels:
    """pcpflow's forward of one decoder layer of ``sizes`` at one TP rank's shapes."""
    return _count(sizes.attention, sizes.hidden_size, sizes.num_heads // tp, max(1, sizes.num_kv_heads // tp),
                  sizes.head_dims, max(1, sizes.dense_intermediate // tp), _block_kind(sizes))


def _block_kind(sizes: ModelSizes) -> tuple[bool, bool]:
    """(gated MLP, LayerNorms): what else than its shapes sets a layer's kernels."""
    return sizes.gated_mlp, sizes.layer_norm


def _layer(make_attn, hidden: int, inter: int, kind: tuple[bool, bool], device: str):
    """One decoder layer of the card on ``device``, with its MLP and norms (``_block_kind``)."""
    from pcpflow.models.common import DecoderLayer, PlainMLP, build_uninitialized

    gated, layer_norm = kind

    def make():
        mlp = None if gated else PlainMLP(hidden, inter)
        return DecoderLayer(make_attn(), hidden, inter, 1e-6, mlp=mlp, norm_bias=layer_norm)

    return build_uninitialized(make, device=device)


def _attention_module(attention: str, hidden: int, heads: int, kv_heads: int, dims: tuple[int, ...]):
    """A builder of one layer's attention module of the card, and its KV spec."""
    from pcpflow.models.common import RotaryEmbedding
    from pcpflow.models.layers import GQAAttention, MLAAttention, gqa_spec, mla_spec

    if attention == "gqa":
        (d,) = dims
        spec = gqa_spec(heads, kv_heads, d)

        def make_attn():
            return GQAAttention(hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads, head_dim=d,
                                rotary=RotaryEmbedding(d, 10000.0))
    else:
        q_lora, kv_lora, nope, rope, v = dims
        spec = mla_spec(heads, kv_lora, rope, 1.0)

        def make_attn():
            return MLAAttention(hidden_size=hidden, num_heads=heads, q_lora_rank=q_lora or None,
                                kv_lora_rank=kv_lora, nope_dim=nope, rope_dim=rope, v_dim=v,
                                rotary=RotaryEmbedding(rope, 10000.0), latent_norm_eps=1e-6)

    return make_attn, spec


@lru_cache(maxsize=32)
def _count(attention: str, hidden: int, heads: int, kv_heads: int, dims: tuple[int, ...], inter: int,
           kind: tuple[bool, bool] = (True, False)) -> LayerKernels:
    import torch

    from pcpflow.attention.fused import fused_decode_attention
    from pcpflow.models.common import build_uninitialized, make_norm

    make_attn, spec = _attention_module(attention, hidden, heads, kv_heads, dims)
    meta, dt, n, block = "meta", torch.bfloat16, 4, 16
    layer = _layer(make_attn, hidden, inter, kind, meta).to(dt)
    norm = build_uninitialized(lambda: make_norm(hidden, 1e-6, bias=kind[1]), device=meta).to(dt)

    class StaticAttention:
        """The backend's static (CUDA-graph) form: paged write, one fused decode kernel."""

        calls = 0

        def __call__(self, layer_idx, q, kv, sinks=None):
            cache = torch.empty(8 * block, spec.entry_dim, device=meta, dtype=dt)
            slots = torch.empty(n, dtype=torch.long, device=meta)
            with op_count() as c:
                cache.index_copy_(0, slots, kv)
                out, _ = fused_decode_attention(q, cache, spec, torch.empty(n, 4, dtype=torch.long, device=meta),
                                                torch.empty(n, dtype=torch.long, device=meta), block, kernel="sdpa")
            StaticAttention.calls += c.n
            return out

    x = torch.empty(n, hidden, device=meta, dtype=dt)
    positions = torch.empty(n, dtype=torch.long, device=meta)
    with torch.no_grad():
        with op_count() as c:
            layer(x, positions, 0, StaticAttention())
        with op_count() as cn:
            norm(x)
    return LayerKernels(total=c.n, attention=StaticAttention.calls, norm=cn.n)


def op_count(weight=None):
    """A ``TorchDispatchMode`` that counts the ATen ops run under it (``.n``): each op but
    views counts 1, or ``weight(func, args, kwargs, out)``."""
    return _op_count_mode()(weight)


@lru_cache(maxsize=1)
def _op_count_mode():
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpCount(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # NOTE: it never runs under torch.compile: without this, torch wraps the dispatch in
            # Dynamo's ``disable``, which imports torch._dynamo (~1 s) at the first op even on
            # CPU tensors (on meta ones, torch's Python reference kernels import it anyway)
            return False

        def __init__(self, weight) -> None:
            super().__init__()
            self.weight, self.n = weight, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not func.is_view:
                self.n += 1 if self.weight is None else self.weight(func, args, kwargs, out)
            return out

    return OpCount


GEMM_OPS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::linear"})


def elementwise_bytes(sizes: ModelSizes, tp: int, dtype: str) -> tuple[float, float]:
    """Bytes one decoder layer's ops other than its GEMMs and its attention call read and
    write, as ``(per row, fixed)`` at ``dtype``: pcpflow's forward at one TP rank's shapes on
    ``meta`` tensors, every op's tensor arguments and results summed (its RMSNorm's square,
    mean and scales, RoPE's arithmetic, residual adds, the activation). Measured on two row
    counts: ``bytes(n) = fixed + per_row x n``. A CPU runs each of them as a pass over memory."""
    heads, kv_heads = sizes.num_heads // tp, max(1, sizes.num_kv_heads // tp)
    inter = max(1, sizes.dense_intermediate // tp)
    return _elementwise(sizes.attention, sizes.hidden_size, heads, kv_heads, sizes.head_dims, inter, dtype,
                        _block_kind(sizes))


def _tensor_bytes(x) -> int:
    import torch

    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_tensor_bytes(y) for y in x) if isinstance(x, (list, tuple)) else 0


def counted_bytes(fn, *, skip=GEMM_OPS) -> int:
    """Bytes the ops ``fn()`` dispatches read and write (every tensor argument and result of
    each op but views and ``skip``); run it on ``meta`` tensors to count without computing.
    A function called inside may set ``counted_bytes.paused`` to leave its ops out."""
    def tensor_bytes(func, args, kwargs, out) -> int:
        if counted_bytes.paused or func.name().split(".")[0] in skip:
            return 0
        return _tensor_bytes(args) + _tensor_bytes(list(kwargs.values())) + _tensor_bytes(out)

    counted_bytes.paused = False
    with op_count(tensor_bytes) as c:
        fn()
    return c.n


counted_bytes.paused = False


@lru_cache(maxsize=32)
def _elementwise(attention: str, hidden: int, heads: int, kv_heads: int, dims: tuple[int, ...], inter: int,
                 dtype: str, kind: tuple[bool, bool] = (True, False)) -> tuple[float, float]:
    import torch

    dt = getattr(torch, dtype)
    make_attn, spec = _attention_module(attention, hidden, heads, kv_heads, dims)
    layer = _layer(make_attn, hidden, inter, kind, "meta").to(dt)

    def attend(_layer, q, _kv, sinks=None):
        counted_bytes.paused = True  # the attention call (KV write, kernel) is priced apart
        out = q.new_empty(q.shape[0], spec.num_heads, spec.v_dim)
        counted_bytes.paused = False
        return out

    counted = []
    for n in (8, 16):
        x = torch.empty(n, hidden, device="meta", dtype=dt)
        positions = torch.empty(n, dtype=torch.long, device="meta")
        with torch.no_grad():
            counted.append(counted_bytes(lambda x=x, positions=positions: layer(x, positions, 0, attend)))
    per_row = (counted[1] - counted[0]) / 8
    return float(per_row), float(max(counted[0] - 8 * per_row, 0.0))


@lru_cache(maxsize=32)
def moe_ops(num_experts: int, top_k: int, num_shared: int, shared_gate: bool = False) -> tuple[float, float]:
    """Ops an MoE layer of pcpflow's forward launches, beside those its dense counterpart
    would: (fixed, per reached expert). Routing depends on the data, so the layer runs on
    real minimal tensors (CPU) for one row (``top_k`` experts reached) and for enough rows to
    reach them all; the difference over the experts it adds is the cost of one."""
    import torch

    from pcpflow.models.moe import MoEMLP
    from pcpflow.models.moe_config import MoEConfig

    torch.manual_seed(0)
    moe = MoEMLP(8, 8, MoEConfig(num_experts=num_experts, top_k=top_k, num_shared_experts=num_shared,
                                 shared_expert_gate=shared_gate), 0)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_()
        counts, reached = [], []
        for rows in (1, 64 * num_experts):
            x = torch.randn(rows, 8)
            ids = moe.gate(x)[1]
            reached.append(len(torch.unique(ids)))
            with op_count() as c:
                moe(x)
            counts.append(c.n)
    per_expert = (counts[1] - counts[0]) / max(reached[1] - reached[0], 1)
    return counts[0] - per_expert * reached[0], per_expert


@dataclass(frozen=True)
class Host:
    """Host seconds of one step, by how it runs (``cudagraph`` dispatch)."""

    launch_s: float
    graph_launch_s: float
    layer: LayerKernels
    num_layers: int
    override: int | None = None
    moe_ops: tuple[float, float] = (0.0, 0.0)  # an MoE layer's ops: fixed, per reached expert (``moe_ops``)

    @property
    def per_layer(self) -> int:
        return self.override or self.layer.total

    def kernels(self) -> int:
        """Kernels of one forward (every layer, the final norm, embedding, LM head, sample)."""
        return self.num_layers * self.per_layer + self.layer.norm + EMBED_AND_SAMPLE

    def step(self, runtime_mode: str, collective_calls: int) -> float:
        """``runtime_mode``: full (a graph replays it all), piecewise (attention eager), none."""
        if runtime_mode == "full":
            return self.graph_launch_s
        if runtime_mode == "piecewise":
            attention = self.num_layers * self.layer.attention
            return (self.num_layers + 1) * self.graph_launch_s + (attention + collective_calls) * self.launch_s
        return (self.kernels() + collective_calls) * self.launch_s
