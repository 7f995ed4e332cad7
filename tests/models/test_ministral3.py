"""Ministral 3 held to transformers: the query scaling (``QueryScaling``, form ``ministral3``) is
``get_llama_4_attn_scale`` in float64 and bit for bit in float32 and bfloat16 (the scale rounded to q's
dtype before the product, as ``Ministral3Attention``); the rope settings a config.json gives, read by
pcpflow, are ``Ministral3RotaryEmbedding``'s frequencies and cos/sin factor (the released ones, the tiny
checkpoint's, an mscale_all_dim of 0); the tiny checkpoints (``Ministral3ForCausalLM``, and its language
model inside ``Mistral3ForConditionalGeneration``) give transformers' logits in float64 on a prompt that
crosses the scaling's period twice, and would not without the scaling, with Llama 4's form of it, or
without YaRN's attention factor. transformers' float32 upcasts run under ``float64_compute``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", minversion="5.0", reason="needs transformers>=5 (Ministral 3) for the reference"
)
pytest.importorskip("safetensors")

from float64_compute import float64_compute, promote_parameters  # noqa: E402
from reference import dense_logits  # noqa: E402
from repo_scripts import load_script  # noqa: E402
from transformers.models.ministral3.modeling_ministral3 import (  # noqa: E402
    Ministral3RotaryEmbedding,
    get_llama_4_attn_scale,
)

from pcpflow.models.common import scaled_rope  # noqa: E402
from pcpflow.models.hf import HFModel  # noqa: E402
from pcpflow.models.hf_registry import read_checkpoint_config  # noqa: E402
from pcpflow.models.layers import QueryScaling  # noqa: E402

script = load_script("make_tiny_hf_checkpoint")

RELEASED_ROPE = dict(rope_type="yarn", rope_theta=1_000_000.0, factor=16.0, original_max_position_embeddings=16384,
                     beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0, llama_4_scaling_beta=0.1)


@pytest.mark.parametrize("beta, length, last", [(0.1, 16384, 262144), (0.5, 32, 128)], ids=["released", "tiny"])
def test_query_scaling_is_get_llama_4_attn_scale_in_float64(beta, length, last):
    positions = torch.cat([torch.arange(0, last, 97), torch.arange(length - 3, length + 3),
                           torch.arange(2 * length - 1, 2 * length + 1), torch.tensor([last - 1])])
    with float64_compute():
        want = get_llama_4_attn_scale(positions[None], beta, length)[0, 0, :, 0]
    q = torch.ones(len(positions), 2, 3, dtype=torch.float64)
    got = QueryScaling(length, beta, "ministral3")(q, positions)
    assert want.dtype == torch.float64 and torch.equal(got, want[:, None, None].expand_as(q))
    assert float(want[positions == length]) == pytest.approx(1 + beta * math.log(2), rel=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_query_scaling_rounds_as_ministral3_attention(dtype):
    """transformers rounds the scale to q's dtype, then multiplies; Llama 4's form multiplies in
    float32 and rounds the product, which differs in bfloat16."""
    positions = torch.arange(0, 300)
    q = torch.randn(len(positions), 4, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    want = q * get_llama_4_attn_scale(positions[None], 0.3, 7).to(dtype)[0].transpose(0, 1)
    got = QueryScaling(7, 0.3, "ministral3")(q, positions)
    assert got.dtype == dtype and torch.equal(got, want)
    if dtype == torch.bfloat16:
        scales = 1 + 0.3 * torch.log(1 + torch.floor(positions.float() / 7))
        assert not torch.equal((q * scales[:, None, None]).to(dtype), want)


def _config_dir(tmp_path, rope: dict, head_dim: int, name: str):
    raw = dict(architectures=["Ministral3ForCausalLM"], model_type="ministral3", vocab_size=64, hidden_size=4 * head_dim,
               intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
               head_dim=head_dim, rope_parameters=rope)
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(raw))
    return tmp_path / name


@pytest.mark.parametrize("rope, head_dim", [
    (RELEASED_ROPE, 128),
    (script.ROPE_SCALINGS["ministral3"] | {"rope_theta": 10000.0}, 16),
    # NOTE: Mistral's native "apply_scale" as transformers converts it: no mscale_all_dim, YaRN's default factor
    (RELEASED_ROPE | {"mscale_all_dim": 0.0}, 128),
], ids=["released", "tiny", "mscale_all_dim_0"])
def test_rope_settings_give_transformers_frequencies(tmp_path, rope, head_dim):
    path = _config_dir(tmp_path, rope, head_dim, "c")
    with float64_compute():
        theirs = Ministral3RotaryEmbedding(transformers.AutoConfig.from_pretrained(path))
    c = read_checkpoint_config(path)
    inv_freq, factor = scaled_rope(c.rope_dims, c.rope_theta, c.rope_scaling)
    assert theirs.inv_freq.dtype == torch.float64
    assert float((inv_freq / theirs.inv_freq - 1).abs().max()) < 1e-14
    assert factor == pytest.approx(theirs.attention_scaling, rel=1e-15)
    assert (c.llama_4_scaling_beta, c.llama_4_scaling_length) == (rope["llama_4_scaling_beta"],
                                                                  rope["original_max_position_embeddings"])


# ------------------------------------------------------------------ the whole model
def _transformers_logits(path, ids: torch.Tensor) -> torch.Tensor:
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(path, dtype=torch.float64).eval()
    base = model.model.language_model if arch == "Mistral3ForConditionalGeneration" else model.model
    with float64_compute(), torch.no_grad():
        base.rotary_emb = type(base.rotary_emb)(config=base.config)
        promote_parameters(model)
        return model(ids[None]).logits[0]


@pytest.mark.parametrize("arch, options", [("ministral3", {}), ("ministral3_mm", dict(tie_word_embeddings=True))])
def test_tiny_checkpoint_matches_transformers_in_float64(tmp_path, arch, options):
    path = script.build_checkpoint(tmp_path / arch, arch, **options)
    ids = torch.randint(0, 384, (75,), generator=torch.Generator().manual_seed(1))  # NOTE: past positions 32 and 64
    want = _transformers_logits(path, ids)
    ours = HFModel.from_config(HFModel.Config(path=str(path)), dtype=torch.float64, seed=0)
    assert float((dense_logits(ours, ids) - want).abs().max()) < 1e-12
    attns = [layer.self_attn for layer in ours.layers]
    assert attns[0].query_scaling == QueryScaling(32, 0.5, "ministral3")
    assert attns[0].rotary.attention_factor == pytest.approx((1 + 0.1 * math.log(4)) / (1 + 0.08 * math.log(4)),
                                                             rel=1e-15)
    # each feature bites: the scaling, its offset (Llama 4's form: p + 1), YaRN's cos/sin factor
    for attn in attns:
        attn.query_scaling = None
    assert float((dense_logits(ours, ids) - want).abs().max()) > 1e-3
    for attn in attns:
        attn.query_scaling = QueryScaling(32, 0.5, "llama4")
    assert float((dense_logits(ours, ids) - want).abs().max()) > 1e-3
    for attn in attns:
        attn.query_scaling, attn.rotary.attention_factor = QueryScaling(32, 0.5, "ministral3"), 1.0
    assert float((dense_logits(ours, ids) - want).abs().max()) > 1e-3
