"""A model's sizes as pricing needs them, from a card (``pcpflow.models.card``) or the
config of a tiny executable model: parameters per layer, the attention kernel's dims,
one cache entry, and how tensor parallelism splits them.

Counts are parameters (multiply-adds per row); ``2 *`` makes FLOPs. MLA attends in two
forms as vLLM does: prefill rows in the expanded (MHA) form, qk = nope + rope and v =
v_head_dim; decode rows in the absorbed (latent) form the executed kernel uses, qk =
kv_lora + rope and v = kv_lora. ``kv_b`` is spent once per row in both forms (it expands
the new rows' latents, or is absorbed into their queries and outputs); prefill also
expands the cached context it reads (``kv_b_params`` per context token).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

from pcpflow.layouts.accounting import ModelShape
from pcpflow.layouts.slots import Window
from pcpflow.models.card import ModelCard

DTYPE_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "fp64": 8, "fp32": 4, "bf16": 2, "fp8": 1, "fp4": 0.5,
               # NOTE: OCP Microscaling Formats (MX) v1.0, MXFP4: 4-bit E2M1 elements in blocks of 32
               # sharing one 8-bit E8M0 scale, (32 x 4 + 8) / 32 = 4.25 bits
               "mxfp4": 0.53125}
"""Bytes per element of the run's ``dtype`` and of the ``simulate.*_dtype`` keys (fp4: two per
byte; mxfp4: two per byte and a block's scale)."""


@dataclass(frozen=True)
class ModelSizes:
    attention: str  # gqa | mla
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int  # gqa K/V heads; 1 for MLA's latent
    entry_dim: int  # one cache entry (all K/V heads), per token and layer
    decode_qk_dim: int  # the executed kernel's per-head dims (absorbed for MLA)
    decode_v_dim: int
    prefill_qk_dim: int  # the prefill kernel's (expanded for MLA)
    prefill_v_dim: int
    attn_params: int  # projections of one layer
    kv_b_params: int  # MLA latent expansion (0 for GQA)
    dense_mlp_params: int  # one dense MLP
    num_dense_layers: int
    expert_params: int  # one routed or shared expert (0 when dense)
    num_experts: int
    top_k: int
    num_shared_experts: int
    tie_word_embeddings: bool
    shared_expert_gate: bool = False  # a learned sigmoid gate on the shared experts (Qwen2-MoE)
    head_dims: tuple[int, ...] = ()  # gqa: (head_dim,); mla: (q_lora, kv_lora, nope, rope, v)
    dense_intermediate: int = 0  # a dense MLP's inner width
    moe_intermediate: int = 0  # one expert's inner width
    sliding_window: int | None = None  # the sliding layers' window (keys a row sees, itself included)
    sliding_layers: int = 0  # how many layers attend through it (the others to every key)
    window_kind: str = "sliding"  # or "chunked": sliding_window is the chunk size (Llama 4), those layers chunked
    full_qk_norm: bool = False  # q and k normed over the whole projection (OLMo 2): TP all-reduces them
    gated_mlp: bool = True  # the dense MLP's gate and up (False: up alone, StarCoder2 and Phi)
    layer_norm: bool = False  # the norms are LayerNorms with a bias (StarCoder2, Phi, StableLM), not RMSNorms

    @property
    def window(self) -> Window | None:
        """The window (with its kind) one sliding or chunked layer's pairs are counted through
        (``attention_work``'s ``window``); None when no layer has one."""
        return Window(self.sliding_window, self.window_kind) if self.sliding_layers and self.sliding_window else None

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def router_outputs(self) -> int:
        """Logits an MoE layer's router computes per row: one per expert, and the shared gate's."""
        return self.num_experts + int(self.shared_expert_gate)

    def kv_heads_per_rank(self, tp: int) -> int:
        """GQA K/V heads one TP rank holds (replicated when tp > heads); MLA: the latent."""
        return max(1, self.num_kv_heads // tp) if self.attention == "gqa" else 1

    def entry_dim_per_rank(self, tp: int) -> int:
        return self.entry_dim * self.kv_heads_per_rank(tp) // self.num_kv_heads

    @functools.lru_cache(maxsize=64)  # NOTE: a frozen value of frozen inputs; every step asks for it
    def shape_per_rank(self, tp: int, dtype_bytes: int) -> ModelShape:
        """``pcpflow.layouts.accounting.ModelShape`` of one TP rank: its heads, its cache entry."""
        return ModelShape(
            hidden_size=self.hidden_size,
            num_layers=self.num_layers,
            entry_dim=self.entry_dim_per_rank(tp),
            num_heads=self.num_heads // tp,
            qk_dim=self.decode_qk_dim,
            v_dim=self.decode_v_dim,
            dtype_bytes=dtype_bytes,
            full_qk_norm=self.full_qk_norm,
        )

    def active_params_per_row(self) -> int:
        """Linear-layer parameters one token meets, all layers (router and experts it routes to)."""
        moe = self.num_moe_layers * (
            (self.top_k + self.num_shared_experts) * self.expert_params + self.hidden_size * self.router_outputs
        )
        return self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params + moe

    def dense_params_per_row(self) -> int:
        """Linear-layer parameters one token meets outside the MoE blocks, all layers (split by tp)."""
        return self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params

    def layer_weight_params(self, experts_touched: float) -> float:
        """Linear-layer parameters read in one step, all layers, when each MoE layer
        touches ``experts_touched`` routed experts."""
        moe = self.num_moe_layers * (
            (experts_touched + self.num_shared_experts) * self.expert_params + self.hidden_size * self.router_outputs
        )
        return self.num_layers * self.attn_params + self.num_dense_layers * self.dense_mlp_params + moe

    def total_weight_params(self) -> int:
        return int(self.layer_weight_params(self.num_experts))

    @property
    def routed_expert_params(self) -> int:
        """Every routed expert of every MoE layer (``simulate.expert_weights_dtype`` stores them;
        shared experts and routers are not routed: ``weights_dtype``)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    def attention_gemms(self, tp: int) -> list[tuple[str, int, int]]:
        """One layer's attention projections on one TP rank: (name, N, K) of ``[rows, K] x
        [K, N]``. GQA: fused QKV (its K/V heads, at least one), o. MLA: q_a and kv_a whole
        (replicated, as ``shard_attention`` leaves them), q_b, kv_b (absorbed into the queries
        and outputs per row: the same multiply-adds), o."""
        h, heads = self.hidden_size, self.num_heads // tp
        if self.attention == "gqa":
            (d,) = self.head_dims
            kv = self.kv_heads_per_rank(tp)
            return [("qkv_proj", (heads + 2 * kv) * d, h), ("o_proj", h, heads * d)]
        q_lora, kv_lora, nope, rope, v = self.head_dims
        q = [("q_a_proj", q_lora, h), ("q_b_proj", heads * (nope + rope), q_lora)] if q_lora else \
            [("q_proj", heads * (nope + rope), h)]
        return q + [("kv_a_proj", kv_lora + rope, h), ("kv_b_proj", heads * (nope + v), kv_lora),
                    ("o_proj", h, heads * v)]

    def mlp_gemms(self, tp: int) -> list[tuple[str, int, int]]:
        """A dense layer's MLP on one TP rank (column-parallel gate_up, or up without a gate;
        row-parallel down)."""
        i = self.dense_intermediate // tp
        up = ("gate_up_proj", 2 * i, self.hidden_size) if self.gated_mlp else ("up_proj", i, self.hidden_size)
        return [up, ("down_proj", self.hidden_size, i)]

    def expert_gemms(self) -> list[tuple[str, int, int]]:
        """One expert (routed or shared), never split over TP (``shard_mlp``)."""
        i = self.moe_intermediate
        return [("expert_gate_up", 2 * i, self.hidden_size), ("expert_down", self.hidden_size, i)]

    @property
    def embedding_params(self) -> int:
        """Embedding plus LM head (one matrix when tied)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)


def model_sizes(model) -> ModelSizes:
    """Sizes of a ``model:`` config: a card, or tiny_mla / tiny_gqa (their executed shapes)."""
    name = getattr(model, "name", None)
    if isinstance(model, ModelCard) or name in ("tiny_gqa", "tiny_mla"):
        c = model
        common = dict(
            dense_intermediate=c.intermediate_size,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            num_layers=c.num_layers,
            num_heads=c.num_heads,
            dense_mlp_params=(3 if getattr(c, "gated_mlp", True) else 2) * c.hidden_size * c.intermediate_size,
            tie_word_embeddings=c.tie_word_embeddings,
            **_moe_sizes(getattr(c, "moe", None), c.num_layers, c.hidden_size, c.intermediate_size),
        )
        if isinstance(model, ModelCard):
            common.update(sliding_window=c.sliding_window, sliding_layers=c.sliding_layers, window_kind=c.window_kind,
                          full_qk_norm=c.full_qk_norm, gated_mlp=c.gated_mlp,
                          layer_norm=c.layer_norm)
        elif name == "tiny_gqa":  # NOTE: its window on the layers it names, as its executed spec has it
            common.update(sliding_window=c.window, sliding_layers=len(c.sliding_layers()), window_kind=c.window_kind,
                          full_qk_norm=c.qk_norm == "full")
        gqa = c.attention == "gqa" if isinstance(model, ModelCard) else name == "tiny_gqa"
        if gqa:
            return _gqa(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, **common)
        return _mla(
            c.hidden_size, c.num_heads, c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim,
            c.qk_rope_head_dim, c.v_head_dim, **common,
        )
    raise ValueError(f"no sizes for model {name!r}: simulate takes a card, hf (config.json), tiny_mla or tiny_gqa")


def drafter_sizes(layer, num_layers: int, target: ModelSizes) -> ModelSizes:
    """Sizes of a drafter of ``num_layers`` MLA decoder layers ``layer``
    (``pcpflow.speculative.drafting.MLALayerConfig``) at the target's hidden size, sharing its
    vocabulary (its embedding and LM head)."""
    return _mla(
        target.hidden_size, layer.num_heads, layer.q_lora_rank, layer.kv_lora_rank, layer.qk_nope_head_dim,
        layer.qk_rope_head_dim, layer.v_head_dim, dense_intermediate=layer.intermediate_size,
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, num_layers=num_layers, num_heads=layer.num_heads,
        dense_mlp_params=3 * target.hidden_size * layer.intermediate_size, tie_word_embeddings=True,
        **_moe_sizes(None, num_layers, target.hidden_size, layer.intermediate_size),
    )


def target_layers(target: ModelSizes, num_layers: int) -> ModelSizes:
    """Sizes of ``num_layers`` of the target's own decoder layers (its last ones: MoE where it
    has MoE layers), its vocabulary shared: DeepSeek-V3's MTP module as the simulator prices it.
    They attend to every key: pcpflow's drafters have no sliding window."""
    moe = min(num_layers, target.num_moe_layers) if target.num_experts else 0
    return replace(target, num_layers=num_layers, num_dense_layers=num_layers - moe, sliding_window=None,
                   sliding_layers=0, full_qk_norm=False)


def _moe_sizes(moe, num_layers: int, hidden: int, intermediate: int) -> dict:
    """The MoE fields of ``ModelSizes`` (``pcpflow.models.moe_config.MoEConfig``; None:
    dense): layers ``>= first_k_dense_replace``, every ``moe_layer_freq``-th, are MoE
    (``pcpflow.models.moe.is_moe_layer``), each expert a gated MLP of its width."""
    if moe is None:
        return dict(num_dense_layers=num_layers, expert_params=0, num_experts=0, top_k=0, num_shared_experts=0,
                    moe_intermediate=0)
    past = max(0, num_layers - moe.first_k_dense_replace)
    num_moe = -(-past // moe.moe_layer_freq)
    return dict(
        num_dense_layers=num_layers - num_moe,
        expert_params=3 * hidden * (moe.intermediate_size or intermediate),
        moe_intermediate=moe.intermediate_size or intermediate,
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        num_shared_experts=moe.num_shared_experts,
        shared_expert_gate=moe.shared_expert_gate,
    )


def _gqa(h: int, heads: int, kv_heads: int, d: int, **common) -> ModelSizes:
    return ModelSizes(
        attention="gqa",
        num_kv_heads=kv_heads,
        entry_dim=2 * kv_heads * d,
        decode_qk_dim=d,
        decode_v_dim=d,
        prefill_qk_dim=d,
        prefill_v_dim=d,
        attn_params=h * heads * d + 2 * h * kv_heads * d + heads * d * h,
        kv_b_params=0,
        head_dims=(d,),
        **common,
    )


def _mla(h, heads, q_lora, kv_lora, nope, rope, v, **common) -> ModelSizes:
    q = h * heads * (nope + rope) if not q_lora else h * q_lora + q_lora * heads * (nope + rope)
    kv_b = kv_lora * heads * (nope + v)
    return ModelSizes(
        attention="mla",
        num_kv_heads=1,
        entry_dim=kv_lora + rope,
        decode_qk_dim=kv_lora + rope,
        decode_v_dim=kv_lora,
        prefill_qk_dim=nope + rope,
        prefill_v_dim=v,
        attn_params=q + h * (kv_lora + rope) + kv_b + heads * v * h,
        kv_b_params=kv_b,
        head_dims=(q_lora or 0, kv_lora, nope, rope, v),
        **common,
    )
