"""Llama 4's mixture of experts held to transformers: ``Llama4TextMoe`` with random weights,
saved under its checkpoint names, loaded through ``LLAMA4_MOE_RENAMES`` into pcpflow's ``MoEMLP``
(``topk_sigmoid`` routing, ``weights_on=input``): the same experts chosen and the same output
(float64 to rounding, transformers' float32 sigmoid promoted by ``float64_compute``; bfloat16
bit for bit), top-1 as released and top-2 (transformers sums every
expert's output); the expert shares every dispatch computes (intermediate slices for gather,
expert ranges for all_to_all) summing to the whole when the weights scale the experts' inputs.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="needs transformers for the reference: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from float64_compute import float64_compute  # noqa: E402
from transformers.models.llama4.configuration_llama4 import Llama4TextConfig  # noqa: E402
from transformers.models.llama4.modeling_llama4 import Llama4TextMoe  # noqa: E402

from pcpflow.models.hf_moe import LLAMA4_MOE_RENAMES, llama4_moe_settings  # noqa: E402
from pcpflow.models.hf_weights import load_checkpoint  # noqa: E402
from pcpflow.models.moe import MoEMLP  # noqa: E402
from pcpflow.models.moe_config import (
    MoEConfig,  # noqa: E402
    moe_config_problems,  # noqa: E402
)


def tiny_config(**changes) -> Llama4TextConfig:
    fields = dict(hidden_size=32, intermediate_size=12, intermediate_size_mlp=24, num_local_experts=6,
                  num_experts_per_tok=1, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=8, vocab_size=64)
    return Llama4TextConfig(**{**fields, **changes})


class OneLayer(nn.Module):
    """Parameters named as a decoder stack's: ``layers.0.mlp.*``."""

    def __init__(self, mlp: MoEMLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = mlp


def pair(tmp_path, dtype: torch.dtype, **changes) -> tuple[Llama4TextMoe, MoEMLP, torch.Tensor]:
    """transformers' Llama4TextMoe with random weights and pcpflow's MoEMLP loaded from its
    tensors (saved as ``model.layers.0.feed_forward.*``), both in ``dtype``, and rows to run."""
    config = tiny_config(**changes)
    gen = torch.Generator().manual_seed(0)
    hf = Llama4TextMoe(config).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    tensors = {f"model.layers.0.feed_forward.{k}": v.contiguous() for k, v in hf.state_dict().items()}
    safetensors_torch.save_file(tensors, str(tmp_path / "model.safetensors"))
    moe = MoEConfig(**llama4_moe_settings(config.to_dict()))
    ours = MoEMLP(config.hidden_size, config.intermediate_size_mlp, moe, layer=0).double()
    load_checkpoint(OneLayer(ours), tmp_path, LLAMA4_MOE_RENAMES, num_layers=1)
    x = torch.randn(40, config.hidden_size, generator=gen, dtype=torch.float64)
    return hf.to(dtype), ours.to(dtype), x.to(dtype)


@pytest.mark.parametrize("top_k", [1, 2])
def test_moe_matches_transformers_in_float64(tmp_path, top_k):
    hf, ours, x = pair(tmp_path, torch.float64, num_experts_per_tok=top_k)
    with torch.no_grad():
        with float64_compute():  # NOTE: Llama4Router's sigmoid in float32 is a downcast here
            want, logits = hf(x)
        _, ids = ours.gate(x)
        got = ours(x)
    assert torch.equal(ids.sort(dim=-1).values, logits.topk(top_k, dim=-1).indices.sort(dim=-1).values)
    assert float((got - want).abs().max()) < 1e-12


def test_moe_matches_transformers_bit_for_bit_in_bfloat16(tmp_path):
    """The score is the sigmoid of the chosen logit in float32, rounded to bfloat16 before it
    scales the expert's input (``Llama4Router``): one rounding misplaced changes bits."""
    hf, ours, x = pair(tmp_path, torch.bfloat16)
    with torch.no_grad():
        want, _ = hf(x)
        got = ours(x)
    assert torch.equal(got, want)


def test_weighting_the_output_instead_is_not_llama4(tmp_path):
    """What ``weights_on=input`` guards against: the SwiGLU is not linear, so ``w * expert(x)``
    differs from transformers' ``expert(w * x)``."""
    hf, ours, x = pair(tmp_path, torch.float64)
    ours.moe = ours.moe.model_copy(update={"weights_on": "output"})
    with torch.no_grad():
        assert float((ours(x) - hf(x)[0]).abs().max()) > 1e-3


@pytest.mark.parametrize("top_k", [1, 2])
def test_dispatch_shares_sum_to_the_routed_experts(tmp_path, top_k):
    """gather's intermediate shares and all_to_all's expert ranges, each computed on the
    input-scaled rows, sum to the routed experts' output."""
    _, ours, x = pair(tmp_path, torch.float64, num_experts_per_tok=top_k)
    with torch.no_grad():
        weights, ids = ours.gate(x)
        whole, _ = ours.run_experts(x, ids, weights)
        slices = sum(ours.run_experts(x, ids, weights, part=(k, 3))[0] for k in range(3))
        ranges = sum(ours.run_experts(x, ids, weights, experts=range(lo, lo + 2))[0] for lo in (0, 2, 4))
    assert float((slices - whole).abs().max()) < 1e-12
    assert float((ranges - whole).abs().max()) < 1e-12


def test_topk_sigmoid_routes_over_all_experts():
    moe = MoEConfig(num_experts=8, top_k=1, n_group=2, topk_group=1, scoring_func="topk_sigmoid")
    (problem,) = moe_config_problems(moe)
    assert (problem.field, problem.given) == ("model.moe.n_group", 2)
    assert "topk_sigmoid routes over all experts" in problem.allowed
