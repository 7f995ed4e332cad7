"""OLMoE held to transformers: its MoE block (``OlmoeSparseMoeBlock``) and norms from a tiny checkpoint
``save_pretrained`` wrote (``make_tiny_hf_checkpoint.py --arch olmoe``), loaded by pcpflow's ``model=hf``:
the same routing and output in float64 (top-k not renormalised, or renormalised under
``norm_topk_prob``), bit for bit in bfloat16 and float16 (weights scored in float32, rounded to the
model's dtype); the full-width q/k norms rounded before they scale (Llama's, not OLMo 2's); the experts
stored fused (transformers 5's in-memory names, which its loader reads too) loading to the same weights.

float64: ``OlmoeTopKRouter`` softmaxes in float32 (an upcast meant for half precision, a downcast here),
so its float64 reference runs under ``float64_compute`` (as tests/models/test_hf_parity.py's).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="needs transformers for the reference: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from float64_compute import float64_compute  # noqa: E402
from repo_scripts import load_script  # noqa: E402

from pcpflow.errors import ConfigError  # noqa: E402
from pcpflow.models import build_model  # noqa: E402
from pcpflow.models.common import RMSNorm  # noqa: E402
from pcpflow.models.hf_moe import olmoe_moe_settings  # noqa: E402
from pcpflow.models.moe_config import MoEConfig  # noqa: E402
from pcpflow.testing import compose  # noqa: E402

script = load_script("make_tiny_hf_checkpoint")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """The tiny OLMoE (top-2 of 8, not renormalised) and a copy whose config.json renormalises."""
    root = tmp_path_factory.mktemp("olmoe")
    plain = script.build_checkpoint(root / "plain", "olmoe")
    normed = shutil.copytree(plain, root / "normed")
    config = json.loads((normed / "config.json").read_text())
    (normed / "config.json").write_text(json.dumps({**config, "norm_topk_prob": True}))
    return {"plain": plain, "normed": normed}


def pair(path, dtype: torch.dtype):
    """(transformers' OlmoeForCausalLM, pcpflow's model) of the checkpoint at ``path`` in ``dtype``."""
    theirs = transformers.OlmoeForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager").eval()
    ours = build_model(compose(["model=hf", f"model.path={path}", "pcp=1"]).model, dtype=dtype, seed=0)
    return theirs, ours


def test_moe_settings_follow_olmoe_configs():
    """Every layer MoE, softmax over all experts in float32 from the model dtype's logits, weights
    rounded to the model's dtype, no shared expert; ``OlmoeConfig``'s defaults (64 experts, top-8,
    not renormalised) where config.json is silent; ``num_local_experts`` its alias of ``num_experts``."""
    moe = MoEConfig(**olmoe_moe_settings(transformers.OlmoeConfig(intermediate_size=1024).to_dict()))
    defaults = transformers.OlmoeConfig()
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (
        defaults.num_experts, defaults.num_experts_per_tok, defaults.norm_topk_prob) == (64, 8, False)
    assert (moe.intermediate_size, moe.num_shared_experts, moe.n_group, moe.routed_scaling_factor) == (1024, 0, 1, 1.0)
    assert (moe.scoring_func, moe.router_dtype, moe.weights_dtype) == ("softmax", "model", "model")
    assert (moe.first_k_dense_replace, moe.moe_layer_freq) == (0, 1)
    alias = MoEConfig(**olmoe_moe_settings({"intermediate_size": 32, "num_local_experts": 16}))
    assert alias.num_experts == transformers.OlmoeConfig(num_local_experts=16).num_experts == 16
    assert MoEConfig(**olmoe_moe_settings({"intermediate_size": 32, "norm_topk_prob": True})).norm_topk_prob


@pytest.mark.parametrize("name", ["plain", "normed"])
def test_moe_block_matches_transformers_in_float64(checkpoints, name):
    theirs, ours = pair(checkpoints[name], torch.float64)
    x = torch.randn(60, 64, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    for layer in (0, 1):
        block, mine = theirs.model.layers[layer].mlp, ours.layers[layer].mlp
        with float64_compute(), torch.no_grad():
            logits, weights, ids = block.gate(x)
            our_weights, our_ids = mine.gate(x)
            want, got = block(x[None])[0], mine(x)
        assert torch.equal(our_ids, ids) and torch.allclose(our_weights, weights, atol=1e-15, rtol=0)
        assert torch.equal(mine.gate.logits(x), logits)
        sums = our_weights.sum(-1)
        if name == "normed":
            assert torch.allclose(sums, torch.ones_like(sums), atol=1e-15)
        else:  # NOTE: top-2 of 8 softmax scores: well short of 1, so a renormalising router would differ
            assert float(sums.max()) < 0.95
        assert torch.allclose(got, want, atol=1e-13, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_moe_block_is_transformers_bit_for_bit_in_half_precision(checkpoints, dtype):
    """Logits in the model's dtype, softmaxed and chosen in float32, the weights rounded to the model's
    dtype before they scale the experts (``weights_dtype=model``): the same bits on every row."""
    theirs, ours = pair(checkpoints["plain"], dtype)
    x = torch.randn(400, 64, generator=torch.Generator().manual_seed(3)).to(dtype)
    block, mine = theirs.model.layers[1].mlp, ours.layers[1].mlp
    with torch.no_grad():
        _, weights, ids = block.gate(x)
        our_weights, our_ids = mine.gate(x)
        assert our_weights.dtype == dtype
        assert torch.equal(our_ids, ids) and torch.equal(our_weights, weights)
        assert torch.equal(mine(x), block(x[None])[0])


def test_norms_round_before_they_scale_as_transformers(checkpoints):
    """``OlmoeRMSNorm`` rounds to bf16, then scales (Llama's): the layer norms, the final norm and the
    full-width q (64 wide) and k (2 kv heads, 32 wide) norms give transformers' bits; OLMo 2's order
    (scaled in float32, then rounded) differs in bf16."""
    theirs, ours = pair(checkpoints["plain"], torch.bfloat16)
    x = (3 * torch.randn(17, 64, generator=torch.Generator().manual_seed(0))).to(torch.bfloat16)
    layer, their_layer = ours.layers[1], theirs.model.layers[1]
    with torch.no_grad():
        pairs = [(ours.norm(x), theirs.model.norm(x)), (layer.input_norm(x), their_layer.input_layernorm(x)),
                 (layer.post_attention_norm(x), their_layer.post_attention_layernorm(x)),
                 (layer.self_attn.q_norm(x), their_layer.self_attn.q_norm(x)),
                 (layer.self_attn.k_norm(x[:, :32]), their_layer.self_attn.k_norm(x[:, :32]))]
        olmo2_style = RMSNorm(64, layer.self_attn.q_norm.eps, scale_first=True).to(torch.bfloat16)
        olmo2_style.weight.copy_(layer.self_attn.q_norm.weight)
        early = olmo2_style(x)
    for got, want in pairs:
        assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert not torch.equal(early, pairs[3][1])


def test_fused_experts_load_as_transformers_loads_them(checkpoints, tmp_path):
    """The experts of a layer stored as transformers 5 holds them (``mlp.experts.gate_up_proj [E, 2I,
    hidden]``, ``down_proj [E, hidden, I]``): transformers' loader reads them to the weights of the
    per-expert checkpoint, and so does pcpflow's; both spellings at once are one tensor stored twice."""
    plain = checkpoints["plain"]
    theirs = transformers.OlmoeForCausalLM.from_pretrained(plain, dtype=torch.float32)
    fused = tmp_path / "fused"
    fused.mkdir()
    shutil.copy(plain / "config.json", fused / "config.json")
    stored = {k: v.contiguous() for k, v in theirs.state_dict().items()}
    assert stored["model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    safetensors_torch.save_file(stored, str(fused / "model.safetensors"), metadata={"format": "pt"})

    again = transformers.OlmoeForCausalLM.from_pretrained(fused, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(theirs.state_dict().values(), again.state_dict().values()))
    _, from_experts = pair(plain, torch.float32)
    _, from_fused = pair(fused, torch.float32)
    mine, other = from_experts.state_dict(), from_fused.state_dict()
    assert mine.keys() == other.keys() and all(torch.equal(mine[k], other[k]) for k in mine)

    both = tmp_path / "both"
    shutil.copytree(fused, both)
    per_expert = safetensors_torch.load_file(str(plain / "model.safetensors"))
    extra = {k: v for k, v in per_expert.items() if ".experts.0." in k}
    safetensors_torch.save_file(extra, str(both / "experts.safetensors"))
    (both / "model.safetensors").rename(both / "rest.safetensors")
    with pytest.raises(ConfigError) as exc:
        compose(["model=hf", f"model.path={both}", "pcp=1"])
    (problem,) = exc.value.problems
    assert "stored more than once: model.layers.0.mlp.experts." in problem.allowed, problem
