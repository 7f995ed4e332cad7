"""Model cards: a model's sizes without weights (``conf/model/<card>.yaml``), for simulated
runs (``mode=simulate``, ``pcpflow.simulate``). ``model=hf model.path=DIR`` becomes a card
too when simulating: only ``config.json`` is read (``card_from_hf_config``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from pcpflow.models.moe_config import MoEConfig

CARD_NAMES = ("llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3")


class ModelCard(BaseModel):
    """GQA (Llama) or MLA (DeepSeek) decoder sizes; ``moe`` set: MoE MLPs."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Literal["llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3", "hf_card"]
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
    weights_dtype: Literal["bf16", "fp8"] = Field("bf16", description="the checkpoint's linear weights (simulate.weights_dtype: null takes it)")
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


def card_from_hf_config(path: str | Path) -> dict:
    """The card (as a plain dict) of a Hugging Face checkpoint directory's config.json
    (Llama or DeepSeek V2/V3, MoE included); ValueError saying what is wrong."""
    from pcpflow.models.hf import read_config_json

    path = Path(path).expanduser().resolve()
    file = path / "config.json"
    raw = read_config_json(path)
    model_type = str(raw.get("model_type", ""))
    try:
        card = {
            "name": "hf_card",
            "source": str(file),
            "vocab_size": raw["vocab_size"],
            "hidden_size": raw["hidden_size"],
            "num_layers": raw["num_hidden_layers"],
            "num_heads": raw["num_attention_heads"],
            "intermediate_size": raw["intermediate_size"],
            "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
            "weights_dtype": "fp8" if (raw.get("quantization_config") or {}).get("quant_method") == "fp8" else "bf16",
        }
        if model_type.startswith("deepseek"):
            card.update(
                attention="mla",
                q_lora_rank=raw.get("q_lora_rank"),
                kv_lora_rank=raw["kv_lora_rank"],
                qk_nope_head_dim=raw["qk_nope_head_dim"],
                qk_rope_head_dim=raw["qk_rope_head_dim"],
                v_head_dim=raw["v_head_dim"],
            )
            if raw.get("n_routed_experts"):
                card["moe"] = {
                    "num_experts": raw["n_routed_experts"],
                    "top_k": raw["num_experts_per_tok"],
                    "intermediate_size": raw.get("moe_intermediate_size"),
                    "num_shared_experts": raw.get("n_shared_experts") or 0,
                    "first_k_dense_replace": raw.get("first_k_dense_replace", 0),
                    "moe_layer_freq": raw.get("moe_layer_freq", 1),
                }
        elif model_type in ("llama", "mistral", "qwen2"):
            heads = raw["num_attention_heads"]
            card.update(
                attention="gqa",
                num_kv_heads=raw.get("num_key_value_heads", heads),
                head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            )
        else:
            raise ValueError(f"model_type={model_type!r} is not supported; supported: llama, deepseek_v2, deepseek_v3")
    except KeyError as exc:
        raise ValueError(f"{file} has no {exc.args[0]!r}") from None
    return card
