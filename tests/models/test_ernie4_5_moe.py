"""ERNIE 4.5's MoE block held to transformers' ``Ernie4_5_MoeSparseMoeBlock``, loaded from the tensors
``save_pretrained`` writes (each expert's gate/up/down, ``moe_statics.e_score_correction_bias [1, E]``,
two shared experts): float32 router logits, the top-2 of 8 chosen on the softmax plus the selection bias
and weighted by the unbiased softmax, renormalised by ``max(sum, moe_norm_min)`` with a ``moe_norm_min``
that bites, the weights rounded to the model's dtype. The same experts and outputs in float64 (its float32
router promoted by ``float64_compute``), bit for bit in bfloat16 (weights drawn representable there, as the
router and the bias stay float32 in transformers); without the bias, or with the clamp left out, the choices
and weights differ.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers for the reference: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from float64_compute import float64_compute  # noqa: E402
from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeSparseMoeBlock  # noqa: E402

from pcpflow.models.hf_llama import LlamaCheckpoint  # noqa: E402
from pcpflow.models.hf_moe import ernie_moe_settings  # noqa: E402
from pcpflow.models.hf_weights import load_checkpoint  # noqa: E402
from pcpflow.models.moe import MoEMLP  # noqa: E402
from pcpflow.models.moe_config import MoEConfig  # noqa: E402

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=24, moe_num_experts=8, moe_k=2, moe_intermediate_size=32,
            moe_num_shared_experts=2, moe_norm_min=0.3, use_bias=False)


class _OneLayer(torch.nn.Module):
    def __init__(self, mlp: MoEMLP) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Module()])
        self.layers[0].mlp = mlp


def _pair(tmp_path, dtype: torch.dtype) -> tuple[Ernie4_5_MoeSparseMoeBlock, MoEMLP, torch.Tensor]:
    config = transformers.Ernie4_5_MoeConfig(**TINY)
    config._experts_implementation = "eager"
    theirs = Ernie4_5_MoeSparseMoeBlock(config).double()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            value = 0.1 * noise if name.endswith("bias") else noise / math.sqrt(p.shape[-1])
            p.copy_(value.to(dtype))  # NOTE: representable in dtype, so both start from the same numbers
    state = dict(theirs.state_dict())
    gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
    state["moe_statics.e_score_correction_bias"] = state.pop("gate.moe_statics.e_score_correction_bias")
    for e in range(len(down)):
        gate, up = gate_up[e].chunk(2)
        state |= {f"experts.{e}.gate_proj.weight": gate, f"experts.{e}.up_proj.weight": up,
                  f"experts.{e}.down_proj.weight": down[e]}
    tensors = {f"model.layers.0.mlp.{k}": v.contiguous() for k, v in state.items()}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    moe = MoEConfig(**ernie_moe_settings(config.to_dict()))
    ours = MoEMLP(config.hidden_size, config.intermediate_size, moe, layer=0).to(dtype)
    load_checkpoint(_OneLayer(ours), tmp_path, LlamaCheckpoint.renames, num_layers=1)
    theirs = theirs.to(dtype)
    if dtype != torch.float64:  # NOTE: from_pretrained keeps them float32 (_keep_in_fp32_modules_strict)
        theirs.gate.float()
    x = 2 * torch.randn(200, config.hidden_size, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    return theirs, ours, x.to(dtype)


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return weights.gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_moe_block_matches_transformers(tmp_path, dtype):
    theirs, ours, x = _pair(tmp_path, dtype)
    with float64_compute() if dtype == torch.float64 else torch.no_grad(), torch.no_grad():
        _, their_weights, their_ids = theirs.gate(x)
        weights, ids = ours.gate(x)
        want, got = theirs(x[None])[0], ours(x)
        (w, i), (tw, ti) = _sorted(weights, ids), _sorted(their_weights, their_ids)
        assert torch.equal(i, ti) and weights.dtype == their_weights.dtype == dtype
        sums = weights.sum(-1).double()
        assert float(sums.min()) < 0.99 and float(sums.max()) > 0.99  # NOTE: the clamp at 0.3 bites on some rows
        if dtype == torch.float64:
            assert torch.allclose(w, tw, atol=1e-15, rtol=0) and torch.allclose(got, want, atol=1e-13, rtol=0)
        else:
            assert torch.equal(w, tw) and torch.equal(got, want)
        unbiased = ours.gate.e_score_correction_bias.clone()
        ours.gate.e_score_correction_bias.zero_()
        assert not torch.equal(_sorted(*ours.gate(x))[1], ti)
        ours.gate.e_score_correction_bias.copy_(unbiased)
        ours.gate.moe = ours.gate.moe.model_copy(update={"norm_min": None})
        assert not torch.allclose(ours.gate(x)[0].double(), weights.double())
