"""Model cards: a model's sizes without weights (``conf/model/<card>.yaml``), for simulated
runs (``mode=simulate``, ``pcpflow.simulate``). ``model=hf model.path=DIR`` becomes a card
too when simulating: only ``config.json`` is read (``card_from_hf_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from pcpflow.errors import Settings
from pcpflow.models.moe_config import MoEConfig

CARD_NAMES = ("llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3", "gemma3_27b", "gpt_oss_20b", "gpt_oss_120b",
              "llama4_scout", "llama4_maverick")


class ModelCard(Settings):
    """GQA (Llama) or MLA (DeepSeek) decoder sizes; ``moe`` set: MoE MLPs."""

    name: Literal["llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3", "gemma3_27b", "gpt_oss_20b", "gpt_oss_120b",
                  "llama4_scout", "llama4_maverick", "hf_card"]
    source: str | None = Field(None, description="where the sizes come from (hf_card: the config.json)")
    attention: Literal["gqa", "mla"] = Field(description="gqa: K/V heads; mla: latent cache")
    vocab_size: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    num_heads: int = Field(ge=1, description="query heads")
    num_kv_heads: int | None = Field(None, ge=1, description="gqa: K/V heads")
    head_dim: int | None = Field(None, ge=1, description="gqa: per-head dim")
    q_lora_rank: int | None = Field(None, ge=1, description="mla: query low rank (None: full q_proj)")
    kv_lora_rank: int | None = Field(None, ge=1, description="mla: latent width")
    qk_nope_head_dim: int | None = Field(None, ge=1)
    qk_rope_head_dim: int | None = Field(None, ge=1)
    v_head_dim: int | None = Field(None, ge=1)
    intermediate_size: int = Field(ge=1, description="dense MLP width")
    tie_word_embeddings: bool = False
    sliding_window: int | None = Field(
        None, ge=1, description="the sliding layers' window: the last `sliding_window` keys of each row, itself "
        "included (Mistral's, Gemma's); with window_kind chunked, the chunk size (Llama 4's attention_chunk_size); "
        "null: none")
    sliding_layers: int = Field(0, ge=0, description="how many of the layers attend through sliding_window (the "
                                "others to every key; with window_kind chunked, the chunked layers); 0: none")
    window_kind: Literal["sliding", "chunked"] = Field(
        "sliding", description="how those layers read: sliding (the last sliding_window keys) | chunked (Llama 4: a "
        "row at position p sees keys p - p % sliding_window .. p, its own chunk up to itself)")
    gated_mlp: bool = Field(True, description="the dense MLP has gate and up projections (SwiGLU / GeGLU: three "
                            "matrices); false: up and down alone (StarCoder2, Phi: two)")
    layer_norm: bool = Field(False, description="the norms are LayerNorms with a bias (StarCoder2, Phi, StableLM: "
                             "one kernel each); false: RMSNorms")
    full_qk_norm: bool = Field(False, description="q and k each normed over the whole projection, all heads at "
                               "once (OLMo 2 and 3): under TP, two all-reduces of a number a row per layer")
    weights_dtype: Literal["bf16", "fp8"] = Field("bf16", description="the checkpoint's linear weights (simulate.weights_dtype: null takes it)")
    expert_weights_dtype: Literal["bf16", "fp8", "mxfp4"] | None = Field(
        None, description="the routed experts' stored weights (mxfp4: gpt-oss's; simulate.expert_weights_dtype: "
        "null takes it); null: as weights_dtype")
    moe: MoEConfig | None = Field(None, description="MoE MLPs (pcpflow.models.moe_config); None: dense")

    @model_validator(mode="after")
    def _attention_sizes(self) -> ModelCard:
        need = (
            ("num_kv_heads", "head_dim")
            if self.attention == "gqa"
            else ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
        )
        missing = [k for k in need if getattr(self, k) is None]
        if missing:
            raise ValueError(f"attention={self.attention} needs {', '.join(missing)}")
        return self

    @model_validator(mode="after")
    def _sliding_layers(self) -> ModelCard:
        if self.sliding_layers > self.num_layers:
            raise ValueError(f"sliding_layers ({self.sliding_layers}) exceeds num_layers ({self.num_layers})")
        if (self.sliding_window is None) != (self.sliding_layers == 0):
            raise ValueError(f"sliding_window ({self.sliding_window}) and sliding_layers ({self.sliding_layers}) "
                             "go together: a window needs the layers it slides on, sliding layers their window")
        return self


def card_from_hf_config(path: str | Path) -> dict:
    """The card (as a plain dict) of a Hugging Face checkpoint directory's config.json
    (every GQA family pcpflow executes, Gemma and the LayerNorm families included, or DeepSeek V2/V3 MLA, MoE
    included), read by the same strict parser an executed run loads it with, its sliding window and how
    many layers slide as that parser reads them (``window``, ``sliding_layers``); ValueError saying what is wrong."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    path = Path(path).expanduser().resolve()
    c = read_checkpoint_config(path, sizes_only=True)
    card = {
        "name": "hf_card",
        "source": str(path / "config.json"),
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "num_layers": c.num_hidden_layers,
        "num_heads": c.num_attention_heads,
        "intermediate_size": c.intermediate_size,
        "tie_word_embeddings": c.tie_word_embeddings,
        "weights_dtype": "fp8" if c.quant_method == "fp8" else "bf16",
        # NOTE: mxfp4 quantizes the routed experts alone (gpt-oss's modules_to_not_convert: the rest stays bf16)
        "expert_weights_dtype": "mxfp4" if c.quant_method == "mxfp4" else None,
        # NOTE: DeepSeek's configs have no window (no attribute); a GQA family's is None without sliding layers
        "sliding_window": getattr(c, "window", None),
        "sliding_layers": len(getattr(c, "sliding_layers", ())),
        # NOTE: a family with chunked layers (Llama 4) says so; the others slide
        "window_kind": getattr(c, "window_kind", "sliding"),
        "full_qk_norm": c.full_qk_norm,
        "gated_mlp": c.gated_mlp,
        "layer_norm": c.layer_norm,
    }
    if hasattr(c, "kv_lora_rank"):  # DeepSeek: latent attention
        card.update(attention="mla", q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank,
                    qk_nope_head_dim=c.qk_nope_head_dim, qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim)
    else:
        card.update(attention="gqa", num_kv_heads=c.kv_heads, head_dim=c.dim)
    if c.moe is not None:
        card["moe"] = c.moe.model_dump()
    return card
