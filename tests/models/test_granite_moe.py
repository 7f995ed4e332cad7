"""Granite's mixture of experts held to transformers: ``GraniteMoeMoE`` (and GraniteMoeShared's
``shared_mlp`` beside it) with random weights, saved under the names Granite checkpoints store
(``block_sparse_moe.router.layer``, ``input_linear``, ``output_linear``, ``shared_mlp.*``), loaded
through ``GRANITE_MOE_RENAMES`` into pcpflow's ``MoEMLP``: the same experts and weights, the same
output (float64), bit for bit in bfloat16 and float16 (weights scored in float32, rounded to the
model's dtype); a Granite 4.0 hybrid without experts: its shared MLP as the layer's MLP.

float64: ``GraniteMoeTopKRouter`` takes ``.float()`` of its logits (an upcast meant for half
precision, a downcast here), so its float64 reference runs under ``float64_compute`` (as
tests/models/test_hf_parity.py's).
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
from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE  # noqa: E402
from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMLP  # noqa: E402
from transformers.models.granitemoeshared.modeling_granitemoeshared import GraniteMoeSharedMLP  # noqa: E402

from pcpflow.models.common import GatedMLP  # noqa: E402
from pcpflow.models.hf_granite import SHARED_MLP_AS_MLP  # noqa: E402
from pcpflow.models.hf_moe import GRANITE_MOE_RENAMES, gqa_moe_settings  # noqa: E402
from pcpflow.models.hf_weights import load_checkpoint  # noqa: E402
from pcpflow.models.moe import MoEMLP  # noqa: E402
from pcpflow.models.moe_config import MoEConfig  # noqa: E402

SHARED = "GraniteMoeSharedForCausalLM"


def tiny_config(**changes):
    fields = dict(hidden_size=64, intermediate_size=24, num_local_experts=16, num_experts_per_tok=4,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=64,
                  shared_intermediate_size=48)
    config = transformers.GraniteMoeSharedConfig(**{**fields, **changes})
    config._experts_implementation = "eager"  # NOTE: what from_pretrained sets; standalone experts have none
    return config


class OneLayer(nn.Module):
    """Parameters named as a decoder stack's: ``layers.0.mlp.*``."""

    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = mlp


def transformers_pair(config, dtype: torch.dtype, seed: int):
    """transformers' ``GraniteMoeMoE`` and ``GraniteMoeSharedMLP`` with random weights in ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    moe, shared = GraniteMoeMoE(config), GraniteMoeSharedMLP(config)
    with torch.no_grad():
        for p in (*moe.parameters(), *shared.parameters()):
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
    return moe.to(dtype), shared.to(dtype)


def checkpoint_of(path, moe: GraniteMoeMoE, shared: GraniteMoeSharedMLP):
    """The two modules' tensors as a Granite checkpoint names them (transformers' own
    ``conversion_mapping`` for ``granitemoe``, which ``save_pretrained`` writes back)."""
    path.mkdir()
    layer = "model.layers.0."
    tensors = {
        layer + "block_sparse_moe.router.layer.weight": moe.router.weight,
        layer + "block_sparse_moe.input_linear.weight": moe.experts.gate_up_proj,
        layer + "block_sparse_moe.output_linear.weight": moe.experts.down_proj,
        layer + "shared_mlp.input_linear.weight": shared.input_linear.weight,
        layer + "shared_mlp.output_linear.weight": shared.output_linear.weight,
    }
    tensors = {k: v.detach().contiguous() for k, v in tensors.items()}
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    return path


def ours_of(config, dtype: torch.dtype, path) -> MoEMLP:
    moe = MoEConfig(**gqa_moe_settings(config.to_dict(), SHARED))
    ours = MoEMLP(config.hidden_size, config.intermediate_size, moe, layer=0).to(dtype)
    load_checkpoint(OneLayer(ours), path, GRANITE_MOE_RENAMES, num_layers=1)
    return ours


def test_moe_settings_follow_granite_configs():
    """Every layer MoE, topk_softmax scored in float32 and rounded to the model's dtype; the shared
    MLP as shared experts (48 = 2 x 24); GraniteMoeConfig's and GraniteMoeHybridConfig's defaults."""
    moe = MoEConfig(**gqa_moe_settings(tiny_config().to_dict(), SHARED))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.num_shared_experts) == (16, 4, 24, 2)
    assert (moe.scoring_func, moe.router_dtype, moe.weights_dtype) == ("topk_softmax", "model", "model")
    assert (moe.first_k_dense_replace, moe.moe_layer_freq, moe.shared_expert_gate) == (0, 1, False)
    assert not (moe.router_bias or moe.expert_bias)
    plain, hybrid = transformers.GraniteMoeConfig(), transformers.GraniteMoeHybridConfig()
    omitted = MoEConfig(**gqa_moe_settings({"intermediate_size": 512}, "GraniteMoeForCausalLM"))
    assert (omitted.num_experts, omitted.top_k, omitted.num_shared_experts) == (
        plain.num_local_experts, plain.num_experts_per_tok, 0)
    in_hybrid = MoEConfig(**gqa_moe_settings({"intermediate_size": 512}, "GraniteMoeHybridForCausalLM"))
    assert in_hybrid.num_shared_experts * 512 == hybrid.shared_intermediate_size
    assert gqa_moe_settings({"intermediate_size": 512, "num_local_experts": 0}, "GraniteMoeHybridForCausalLM") is None


@pytest.fixture(scope="module")
def float64_pair(tmp_path_factory):
    config = tiny_config()
    moe, shared = transformers_pair(config, torch.float64, seed=0)
    path = checkpoint_of(tmp_path_factory.mktemp("granite") / "f64", moe, shared)
    x = torch.randn(60, config.hidden_size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    return moe, shared, ours_of(config, torch.float64, path), x


def test_routing_matches_transformers(float64_pair):
    moe, _, ours, x = float64_pair
    with float64_compute(), torch.no_grad():
        logits, weights, ids = moe.router(x)
        our_weights, our_ids = ours.gate(x)
        assert torch.equal(our_ids, ids) and torch.allclose(our_weights, weights, atol=1e-15, rtol=0)
        assert torch.equal(ours.gate.logits(x), logits)


def test_moe_layer_with_its_shared_mlp_matches_transformers(float64_pair):
    """GraniteMoeSharedDecoderLayer's MLP: the experts' weighted sum plus the shared MLP, unscaled."""
    moe, shared, ours, x = float64_pair
    with float64_compute(), torch.no_grad():
        routed, want = moe(x[None])[0], moe(x[None])[0] + shared(x)
        got = ours(x)
    assert torch.allclose(got, want, atol=1e-13, rtol=0)
    assert not torch.allclose(got, routed, atol=1e-3)  # NOTE: the shared MLP counts


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_layer_is_transformers_bit_for_bit_in_half_precision(tmp_path, dtype):
    """The top-k of the logits widened to float32, softmaxed there and rounded to the model's dtype
    before they scale the experts (``weights_dtype=model``): bit for bit, where gpt-oss's softmax in
    the model's dtype would differ from transformers' on some rows."""
    config = tiny_config()
    moe, shared = transformers_pair(config, dtype, seed=2)
    ours = ours_of(config, dtype, checkpoint_of(tmp_path / "half", moe, shared))
    x = torch.randn(400, config.hidden_size, generator=torch.Generator().manual_seed(3)).to(dtype)
    with torch.no_grad():
        _, weights, ids = moe.router(x)
        our_weights, our_ids = ours.gate(x)
        assert our_weights.dtype == dtype
        assert torch.equal(our_ids, ids) and torch.equal(our_weights, weights)
        assert torch.equal(ours(x), moe(x[None])[0] + shared(x))


def test_a_hybrid_without_experts_runs_its_shared_mlp_as_the_layer_mlp(tmp_path):
    config = transformers.GraniteMoeHybridConfig(hidden_size=64, shared_intermediate_size=40, num_local_experts=0,
                                                 mamba_n_heads=8)
    theirs = GraniteMoeHybridMLP(config).double()
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in theirs.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) / p.shape[-1] ** 0.5)
    (tmp_path / "dense").mkdir()
    safetensors_torch.save_file({f"model.layers.0.shared_mlp.{k}": v for k, v in theirs.state_dict().items()},
                                str(tmp_path / "dense" / "model.safetensors"))
    ours = GatedMLP(64, 40).double()
    load_checkpoint(OneLayer(ours), tmp_path / "dense", SHARED_MLP_AS_MLP, num_layers=1)
    x = torch.randn(9, 64, generator=gen, dtype=torch.float64)
    assert torch.allclose(ours(x), theirs(x), atol=1e-14, rtol=0)
