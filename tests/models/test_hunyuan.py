"""Hunyuan held to transformers, one layer at a time: RoPE's fixed NTK alpha gives
``HunYuanDenseV1RotaryEmbedding``'s frequencies (the released alpha and head too); a one-layer
dense model (q/k norms after RoPE, biases) and a one-layer MoE model (float32 router, top-2 of 8
renormalised, a shared expert, tied embeddings) saved by ``save_pretrained`` give transformers'
logits in float64 (its float32 upcasts promoted by ``float64_compute``), and put the norms before
RoPE they do not; the MoE block chooses transformers' experts and computes its bits in bfloat16,
its router in float32 as ``HunYuanMoEV1Gate`` keeps it.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers for the reference: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from float64_compute import float64_compute, promote_parameters  # noqa: E402
from reference import dense_logits  # noqa: E402
from transformers.models.hunyuan_v1_dense.modeling_hunyuan_v1_dense import (  # noqa: E402
    HunYuanDenseV1RotaryEmbedding,
)
from transformers.models.hunyuan_v1_moe.modeling_hunyuan_v1_moe import HunYuanMoEV1Moe  # noqa: E402

from pcpflow.models.common import RotaryEmbedding  # noqa: E402
from pcpflow.models.hf import HFModel  # noqa: E402
from pcpflow.models.hf_hunyuan import HunyuanDenseCheckpoint  # noqa: E402
from pcpflow.models.hf_moe import HUNYUAN_MOE_RENAMES, hunyuan_moe_settings  # noqa: E402
from pcpflow.models.hf_weights import load_checkpoint  # noqa: E402
from pcpflow.models.moe import MoEMLP  # noqa: E402
from pcpflow.models.moe_config import MoEConfig  # noqa: E402

ALPHA = {"type": "dynamic", "alpha": 50.0, "factor": 1.0}
TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, rope_theta=10000.0, rope_scaling=ALPHA, rms_norm_eps=1e-6,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.mark.parametrize("alpha, head_dim", [(1000.0, 128), (50.0, 24)], ids=["released", "tiny"])
def test_ntk_alpha_gives_transformers_frequencies(alpha, head_dim):
    """theta x alpha^(d / (d - 2)), as ``compute_ntk_alpha_rope_parameters`` (promoted to float64)."""
    raw = {**TINY, "head_dim": head_dim, "rope_scaling": {**ALPHA, "alpha": alpha}}
    config = transformers.HunYuanDenseV1Config(**raw)
    with float64_compute():
        theirs = HunYuanDenseV1RotaryEmbedding(config)
    c = HunyuanDenseCheckpoint.parse(raw, "HunYuanDenseV1ForCausalLM")
    assert (theirs.rope_type, c.rope_scaling) == ("ntk_alpha", None)
    assert c.rope_base == pytest.approx(10000.0 * alpha ** (head_dim / (head_dim - 2)), rel=1e-15)
    ours = RotaryEmbedding(head_dim, c.rope_base).inv_freq
    assert float((ours / theirs.inv_freq - 1).abs().max()) < 1e-14


def _randomized(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter ``N(0, 1/fan_in)``, norms ``1 + N(0, 0.2^2)``, biases ``N(0, 0.1^2)``: logits of a
    few units, and norms that are not the identity."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))
    return model


def _both(tmp_path, arch: str, **changes) -> tuple[torch.Tensor, HFModel, torch.Tensor]:
    """transformers' logits of a one-layer ``arch`` model (random float64 weights, saved with
    ``save_pretrained``), pcpflow's model of the saved checkpoint, and the token ids."""
    config = getattr(transformers, arch.replace("ForCausalLM", "Config"))(**{**TINY, **changes})
    theirs = _randomized(getattr(transformers, arch)(config).double()).eval()
    theirs.save_pretrained(tmp_path)
    ids = torch.randint(0, TINY["vocab_size"], (23,), generator=torch.Generator().manual_seed(1))
    theirs.config._experts_implementation = "eager"  # NOTE: its grouped GEMM takes no float64
    with float64_compute(), torch.no_grad():
        theirs.model.rotary_emb = type(theirs.model.rotary_emb)(config=theirs.config)
        promote_parameters(theirs)
        want = theirs(ids[None]).logits[0]
    ours = HFModel.from_config(HFModel.Config(path=str(tmp_path)), dtype=torch.float64, seed=0)
    return want, ours, ids


@pytest.mark.parametrize("arch, changes", [
    ("HunYuanDenseV1ForCausalLM", dict(attention_bias=True, intermediate_size=80)),
    ("HunYuanMoEV1ForCausalLM", dict(num_experts=8, moe_topk=[2], tie_word_embeddings=True)),
], ids=["dense", "moe"])
def test_one_layer_matches_transformers_in_float64(tmp_path, arch, changes):
    want, ours, ids = _both(tmp_path, arch, **changes)
    assert float((dense_logits(ours, ids) - want).abs().max()) < 1e-12
    attn = ours.layers[0].self_attn
    attn.qk_norm_after_rope = False  # NOTE: Qwen3's order: norms before RoPE, which does not commute with them
    assert float((dense_logits(ours, ids) - want).abs().max()) > 1e-3


def _moe_pair(tmp_path, dtype: torch.dtype) -> tuple[HunYuanMoEV1Moe, MoEMLP, torch.Tensor]:
    """transformers' HunYuanMoEV1Moe (its router float32, as ``from_pretrained`` keeps it) and
    pcpflow's MoEMLP loaded from its tensors through ``HUNYUAN_MOE_RENAMES``, in ``dtype``, and rows;
    weights drawn representable in ``dtype``, so both start from the same numbers."""
    config = transformers.HunYuanMoEV1Config(**{**TINY, "num_experts": 8, "moe_topk": 2})
    config._experts_implementation = "eager"
    hf = _randomized(HunYuanMoEV1Moe(config, layer_idx=0).double())
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(dtype))
    tensors = {f"model.layers.0.mlp.{k}": v.contiguous() for k, v in _saved(hf).items()}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    ours = MoEMLP(config.hidden_size, config.intermediate_size,
                  MoEConfig(**hunyuan_moe_settings(config.to_dict())), layer=0).to(dtype)
    load_checkpoint(_OneLayer(ours), tmp_path, HUNYUAN_MOE_RENAMES, num_layers=1)
    hf = hf.to(dtype)
    hf.gate.wg.float()
    x = 2 * torch.randn(64, config.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return hf, ours, x.to(dtype)


def _saved(moe: HunYuanMoEV1Moe) -> dict[str, torch.Tensor]:
    """The block's tensors as ``save_pretrained`` writes them: each expert's gate, up and down."""
    state = dict(moe.state_dict())
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    for e in range(len(down)):
        gate, up = gate_up[e].chunk(2)
        state |= {f"experts.{e}.gate_proj.weight": gate, f"experts.{e}.up_proj.weight": up,
                  f"experts.{e}.down_proj.weight": down[e]}
    return state


class _OneLayer(torch.nn.Module):
    """Parameters named as a decoder stack's: ``layers.0.mlp.*``."""

    def __init__(self, mlp: MoEMLP) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = mlp


def test_moe_block_matches_transformers_bit_for_bit_in_bfloat16(tmp_path):
    hf, ours, x = _moe_pair(tmp_path, torch.bfloat16)
    with torch.no_grad():
        _, their_weights, their_ids = hf.gate(x)
        weights, ids = ours.gate(x)
        want, got = hf(x[None])[0], ours(x)
    order, their_order = ids.argsort(dim=-1), their_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), their_ids.gather(1, their_order))
    assert torch.equal(weights.gather(1, order), their_weights.gather(1, their_order))
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)


def test_config_names_are_read_as_transformers_aliases_them():
    """``num_local_experts`` and ``num_experts_per_tok`` (``HunYuanMoEV1Config.attribute_map``) read as
    ``num_experts`` and ``moe_topk``."""
    moe = hunyuan_moe_settings(dict(num_local_experts=6, num_experts_per_tok=3, num_hidden_layers=2))
    assert (moe["num_experts"], moe["top_k"]) == (6, 3)
