"""gpt-oss's mixture of experts held to transformers: ``GptOssMLP`` with random weights,
saved under its checkpoint names, loaded through ``GPT_OSS_MOE_RENAMES`` into pcpflow's
``MoEMLP`` (float64: the same output, the same routing; bfloat16: bit for bit); the expert
shares every dispatch computes (intermediate slices, expert ranges) summing to the whole
with biases; MXFP4 dequantized bit for bit as transformers does, and an MXFP4 checkpoint
loading to the weights of its dense twin.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip(
    "transformers", reason="needs transformers for the reference: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402
from transformers.models.gpt_oss.configuration_gpt_oss import GptOssConfig  # noqa: E402
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP, GptOssTopKRouter  # noqa: E402

from pcpflow.models.common import GatedMLP, swiglu_clamped  # noqa: E402
from pcpflow.models.hf_moe import GPT_OSS_MOE_RENAMES, gqa_moe_settings  # noqa: E402
from pcpflow.models.hf_weights import load_checkpoint, plan_names  # noqa: E402
from pcpflow.models.moe import MoEMLP, expert_slice, sliced_mlp  # noqa: E402
from pcpflow.models.moe_config import (
    MoEConfig,  # noqa: E402
    moe_config_problems,  # noqa: E402
)
from pcpflow.models.mxfp4 import dense_shape as mxfp4_dense_shape  # noqa: E402
from pcpflow.models.mxfp4 import dequantize_mxfp4  # noqa: E402

ARCH = "GptOssForCausalLM"


def tiny_config(**changes) -> GptOssConfig:
    fields = dict(hidden_size=32, intermediate_size=12, num_local_experts=6, num_experts_per_tok=3,
                  num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64)
    return GptOssConfig(**{**fields, **changes})


class OneLayer(nn.Module):
    """Parameters named as a decoder stack's: ``layers.0.mlp.*``."""

    def __init__(self, mlp: MoEMLP) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].mlp = mlp


def ours_of(config: GptOssConfig) -> MoEMLP:
    moe = MoEConfig(**gqa_moe_settings(config.to_dict(), ARCH))
    return MoEMLP(config.hidden_size, config.intermediate_size, moe, layer=0)


def save(path, tensors: dict[str, torch.Tensor]):
    path.mkdir()
    tensors = {f"model.layers.0.mlp.{k}": v.contiguous() for k, v in tensors.items()}
    safetensors_torch.save_file(tensors, str(path / "model.safetensors"))
    return path


def loaded(path, config: GptOssConfig) -> MoEMLP:
    mlp = ours_of(config).double()
    load_checkpoint(OneLayer(mlp), path, GPT_OSS_MOE_RENAMES, num_layers=1)
    return mlp


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """transformers' GptOssMLP (float64, random weights large enough that both clamps bite)
    and pcpflow's MoEMLP loaded from its tensors."""
    config = tiny_config(swiglu_limit=3.0)
    gen = torch.Generator().manual_seed(0)
    hf = GptOssMLP(config).double()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
    path = save(tmp_path_factory.mktemp("gpt_oss") / "dense", dict(hf.state_dict()))
    x = torch.randn(40, config.hidden_size, generator=gen, dtype=torch.float64)
    return config, hf, loaded(path, config), x


def test_moe_settings_follow_gpt_oss_config():
    given = tiny_config(swiglu_limit=5.5).to_dict()
    moe = MoEConfig(**gqa_moe_settings(given, ARCH))
    assert (moe.num_experts, moe.top_k, moe.intermediate_size) == (6, 3, 12)
    assert (moe.swiglu_alpha, moe.swiglu_limit) == (given["swiglu_alpha"], 5.5)
    assert (moe.scoring_func, moe.router_dtype, moe.activation) == ("topk_softmax", "model", "swiglu_clamped")
    assert moe.router_bias and moe.expert_bias and moe.num_shared_experts == 0
    assert (moe.first_k_dense_replace, moe.moe_layer_freq) == (0, 1)  # every layer is MoE
    default = GptOssConfig()
    omitted = MoEConfig(**gqa_moe_settings({}, ARCH))
    assert (omitted.num_experts, omitted.top_k, omitted.intermediate_size) == (
        default.num_local_experts, default.num_experts_per_tok, default.intermediate_size)
    assert (omitted.swiglu_alpha, omitted.swiglu_limit) == (default.swiglu_alpha, default.swiglu_limit)


def test_moe_layer_matches_transformers(pair):
    config, hf, ours, x = pair
    want, _ = hf(x[None])
    gate_up = x @ hf.experts.gate_up_proj[0] + hf.experts.gate_up_proj_bias[0]
    assert (gate_up[:, ::2] > config.swiglu_limit).any() and (gate_up[:, 1::2].abs() > config.swiglu_limit).any()
    assert torch.allclose(ours(x), want[0], atol=1e-12, rtol=0)


def test_routing_matches_transformers(pair):
    _, hf, ours, x = pair
    logits, scores, ids = hf.router(x)
    weights, our_ids = ours.gate(x)
    assert torch.equal(our_ids, ids) and torch.equal(weights, scores)
    assert torch.equal(ours.gate.logits(x), logits)
    # verification's hook: given ids are weighted by the softmax over those ids' logits alone
    other = torch.roll(ids, 1, dims=0)
    forced, same = ours.gate.select(logits, other)
    assert torch.equal(same, other)
    assert torch.allclose(forced, logits.gather(1, other).softmax(-1), atol=1e-15, rtol=0)


def test_router_keeps_bfloat16_as_transformers():
    config = tiny_config(num_local_experts=16, num_experts_per_tok=4)
    gen = torch.Generator().manual_seed(1)
    hf = GptOssTopKRouter(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    hf = hf.to(torch.bfloat16)
    ours = ours_of(config).gate
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.bias.copy_(hf.bias)
    x = torch.randn(64, config.hidden_size, generator=gen).to(torch.bfloat16)
    _, scores, ids = hf(x)
    weights, our_ids = ours(x)
    assert weights.dtype == torch.bfloat16
    assert torch.equal(our_ids, ids) and torch.equal(weights, scores)


def test_moe_layer_is_transformers_in_bfloat16_up_to_gemm_blocking(tmp_path):
    """bf16 throughout: routing in the model dtype, biases added to the rounded products.

    pcpflow keeps an expert's gate and up rows as two halves where transformers interleaves
    them: a CPU GEMM kernel may tile those output columns differently and round a column's fp32
    sum the other way (on an AVX2-only machine, 19 of these 6400 outputs differ, by at most
    0.03 at a row scale of ~10; bit-for-bit where the kernels tile alike). Rounding in another order,
    the bias added before the product is rounded, moves ~64% of them: the bound below holds
    the order."""
    config = tiny_config(hidden_size=64, intermediate_size=48, num_local_experts=8, num_experts_per_tok=4)
    gen = torch.Generator().manual_seed(5)
    hf = GptOssMLP(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf = hf.to(torch.bfloat16)
    path = save(tmp_path / "bf16", dict(hf.state_dict()))
    ours = ours_of(config).to(torch.bfloat16)
    load_checkpoint(OneLayer(ours), path, GPT_OSS_MOE_RENAMES, num_layers=1)
    x = torch.randn(100, config.hidden_size, generator=gen).to(torch.bfloat16)
    with torch.no_grad():
        got, want = ours(x).float(), hf(x[None])[0][0].float()
    differs = got != want
    assert differs.float().mean() < 0.02, f"{int(differs.sum())} of {differs.numel()} outputs differ"
    # NOTE: a step of an intermediate moves an output by the weights after it: bounded by bf16's
    # epsilon at the row's scale, not at the element's (an output near 0 cancels)
    assert ((got - want).abs() <= 2.0**-7 * want.abs().amax(dim=-1, keepdim=True)).all()


def test_fused_expert_shapes_as_the_checkpoint_stores_them():
    """What the header check (``hf._tensor_problems``) wants of each gpt-oss tensor, from
    pcpflow's parameter shapes; an MXFP4 pair's dense shape is transformers'."""
    e, h, i = 4, 64, 32
    ours = {"gate.weight": (e, h), "gate.bias": (e,), "gate_up_proj.weight": (2 * i, h), "gate_up_proj.bias": (2 * i,),
            "down_proj.weight": (h, i), "down_proj.bias": (h,)}
    want = {"router.weight": (e, h), "router.bias": (e,), "experts.gate_up_proj": (e, h, 2 * i),
            "experts.gate_up_proj_bias": (e, 2 * i), "experts.down_proj": (e, i, h), "experts.down_proj_bias": (e, h)}
    for rule in GPT_OSS_MOE_RENAMES:
        shape = ours[rule.ours.removeprefix("layers.{i}.mlp.").removeprefix("experts.{j}.")]
        targets = [shape] * (e if rule.experts else 1)
        assert rule.checkpoint_shape(targets) == want[rule.hf.removeprefix("model.layers.{i}.mlp.")]
    blocks = torch.zeros(e, 2 * i, h // 32, 16, dtype=torch.uint8)
    scales = torch.zeros(e, 2 * i, h // 32, dtype=torch.uint8)
    assert mxfp4_dense_shape(tuple(blocks.shape)) == tuple(convert_moe_packed_tensors(blocks, scales).shape)


@pytest.mark.parametrize("width,parts", [(7, 3), (2, 3), (1, 4)])
def test_biased_expert_shares_sum_to_the_expert(width, parts):
    """Every partition ``expert_slice`` makes, empty parts included, adds down's bias once."""
    gen = torch.Generator().manual_seed(2)
    mlp = GatedMLP(16, width, bias=True, glu=lambda g, u: swiglu_clamped(g, u, alpha=1.702, limit=1.0)).double()
    with torch.no_grad():
        for p in mlp.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64))
    x = torch.randn(5, 16, generator=gen, dtype=torch.float64)
    bounds = [expert_slice(width, p, parts) for p in range(parts)]
    assert any(lo == hi for lo, hi in bounds) == (width < parts)
    total = sum(sliced_mlp(mlp, x, lo, hi) for lo, hi in bounds)
    assert torch.allclose(total, mlp(x), atol=1e-12, rtol=0)


def test_every_dispatch_share_sums_to_the_layer(pair):
    """``gather`` runs an intermediate share of every expert on each rank, ``all_to_all`` a
    range of whole experts: either way the shares sum to the layer's output."""
    _, _, ours, x = pair
    weights, ids = ours.gate(x)
    whole, _ = ours.run_experts(x, ids, weights)
    assert torch.allclose(whole, ours(x), atol=0, rtol=0)
    for n in (2, 5):
        sliced = sum(ours.run_experts(x, ids, weights, part=(k, n))[0] for k in range(n))
        assert torch.allclose(sliced, whole, atol=1e-12, rtol=0)
    owned = sum(ours.run_experts(x, ids, weights, experts=range(e, e + 2))[0] for e in range(0, 6, 2))
    assert torch.allclose(owned, whole, atol=1e-12, rtol=0)


def test_dequantize_mxfp4_is_transformers_bit_for_bit():
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 5, 2), generator=gen, dtype=torch.uint8)
    scales[0, 0, 0], scales[0, 0, 1] = 0, 254  # the smallest and largest finite exponents
    for dtype in (torch.bfloat16, torch.float32, torch.float64):
        want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
        got = dequantize_mxfp4(blocks, scales, dtype)
        assert got.dtype == dtype and got.shape == want.shape == (3, 64, 5)
        assert torch.equal(got, want)
    # by hand: byte 0x27 holds 6.0 (low nibble 0b0111, first) then 1.0 (high nibble 0b0010); scale 128: times 2
    one = dequantize_mxfp4(torch.full((1, 1, 1, 16), 0x27, dtype=torch.uint8), torch.full((1, 1, 1), 128, dtype=torch.uint8),
                           torch.float64)
    assert one[0, :2, 0].tolist() == [12.0, 2.0]


def test_mxfp4_checkpoint_loads_as_its_dense_twin(tmp_path):
    config = tiny_config(hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)
    e, h, i = 4, 64, 32
    gen = torch.Generator().manual_seed(4)

    def packed(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
        return blocks, torch.randint(116, 124, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)

    gu_blocks, gu_scales = packed(2 * i, h)
    down_blocks, down_scales = packed(h, i)
    rest = {"router.weight": torch.randn(e, h, generator=gen), "router.bias": torch.randn(e, generator=gen),
            "experts.gate_up_proj_bias": torch.randn(e, 2 * i, generator=gen),
            "experts.down_proj_bias": torch.randn(e, h, generator=gen)}
    quantized = save(tmp_path / "mxfp4", {**rest, "experts.gate_up_proj_blocks": gu_blocks,
                                          "experts.gate_up_proj_scales": gu_scales,
                                          "experts.down_proj_blocks": down_blocks,
                                          "experts.down_proj_scales": down_scales})
    dense = save(tmp_path / "dense", {**rest,
                                      "experts.gate_up_proj": convert_moe_packed_tensors(gu_blocks, gu_scales,
                                                                                         dtype=torch.float32),
                                      "experts.down_proj": convert_moe_packed_tensors(down_blocks, down_scales,
                                                                                      dtype=torch.float32)})
    want, got = loaded(dense, config).state_dict(), loaded(quantized, config).state_dict()
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    # and the transformers layer of the dense twin agrees with pcpflow's of the quantized one
    hf = GptOssMLP(config).double()
    hf.load_state_dict({k.removeprefix("model.layers.0.mlp."): v.double()
                        for k, v in safetensors_torch.load_file(str(dense / "model.safetensors")).items()})
    x = torch.randn(8, h, generator=gen, dtype=torch.float64)
    assert torch.allclose(loaded(quantized, config)(x), hf(x[None])[0][0], atol=1e-12, rtol=0)


def test_lone_mxfp4_half_has_no_place():
    names = ["model.layers.0.mlp.experts.down_proj_blocks"]
    params = [f"layers.0.mlp.experts.{j}.down_proj.weight" for j in range(2)]
    plan = plan_names(names, params, GPT_OSS_MOE_RENAMES, num_layers=1)
    assert plan.unknown == names and plan.unfilled == ["model.layers.0.mlp.experts.down_proj"] * 2


def test_grouped_topk_softmax_is_a_problem():
    moe = MoEConfig(num_experts=8, top_k=2, n_group=2, topk_group=1, scoring_func="topk_softmax")
    [problem] = moe_config_problems(moe)
    assert problem.field == "model.moe.n_group" and "topk_softmax" in problem.allowed
