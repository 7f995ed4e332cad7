"""The tiny models: chunked prefill + decode through a paged cache equals one prefill,
both equal a dense causal reference written from the weights (non-absorbed MLA), seeded
builds are reproducible across dtypes, and greedy decoding does not collapse."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from pydantic import TypeAdapter, ValidationError
from reference import reference_forward

from pcpflow.attention.paged import paged_attention
from pcpflow.models import ModelConfig, build_model, model_classes
from pcpflow.models.tiny_gqa import TinyGQA
from pcpflow.models.tiny_mla import TinyMLA

torch.set_num_threads(2)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf" / "model"
CONFIGS = {
    "tiny_mla": TinyMLA.Config(),
    "tiny_gqa": TinyGQA.Config(),
    "tiny_mla_full_q_tied": TinyMLA.Config(
        q_lora_rank=None, tie_word_embeddings=True, num_layers=3
    ),
    "tiny_gqa_mha": TinyGQA.Config(num_kv_heads=4, num_layers=3),
}


class PagedCache:
    """A single-rank paged KV cache backend: each call writes the rows' entries at their
    slots, then attends each row over its request up to position + 1."""

    def __init__(self, model, num_reqs, max_len, block_size=4, seed=0):
        spec = model.attn_spec
        dtype = model.embed_tokens.weight.dtype
        blocks_per_req = -(-max_len // block_size)
        num_blocks = num_reqs * blocks_per_req + 5
        perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
        self.block_tables = perm[: num_reqs * blocks_per_req].view(num_reqs, blocks_per_req)
        self.block_size = block_size
        self.spec = spec
        self.caches = [
            torch.zeros(num_blocks * block_size, spec.entry_dim, dtype=dtype)
            for _ in range(model.num_layers)
        ]
        self.layers_called = []

    def set_batch(self, req_indices, positions):
        self.req = req_indices
        self.positions = positions
        blocks = self.block_tables[req_indices, positions // self.block_size]
        self.slots = blocks * self.block_size + positions % self.block_size

    def __call__(self, layer, q, kv, sinks=None):
        self.layers_called.append(layer)
        self.caches[layer][self.slots] = kv
        out, _ = paged_attention(
            q,
            self.caches[layer],
            self.spec,
            self.block_tables,
            self.req,
            self.positions + 1,
            self.block_size,
        )
        return out


def run_steps(model, cache, tokens, steps):
    """Run a schedule: each step is a list of (request, start, end) token ranges.
    Returns the logits of every (request, position) computed."""
    logits = {}
    for step in steps:
        req = torch.cat([torch.full((e - s,), r) for r, s, e in step])
        pos = torch.cat([torch.arange(s, e) for r, s, e in step])
        ids = torch.stack([tokens[r][p] for r, p in zip(req.tolist(), pos.tolist(), strict=True)])
        cache.set_batch(req, pos)
        hidden, _ = model(ids, pos, cache)
        for row, lg in enumerate(model.compute_logits(hidden)):
            logits[(int(req[row]), int(pos[row]))] = lg
    return logits


def random_tokens(seed, lens, vocab=256):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g) for n in lens]


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_chunked_prefill_and_decode_equal_one_prefill_and_dense_reference(name):
    model = build_model(CONFIGS[name], dtype=torch.float64, seed=3)
    lens = [45, 19, 7]
    tokens = random_tokens(0, lens)
    # one step: every request prefilled whole (request 0 long enough for a segment run)
    one = run_steps(
        model, PagedCache(model, 3, 48), tokens, [[(r, 0, n) for r, n in enumerate(lens)]]
    )
    # chunked prefills interleaved with single-token decodes, several requests per step
    steps = [
        [(0, 0, 10), (1, 0, 5)],
        [(1, 5, 6), (0, 10, 33), (2, 0, 1)],
        [(2, 1, 2), (1, 6, 13), (0, 33, 34)],
        [(0, 34, 35), (2, 2, 7)],
        *[
            [(0, p, p + 1)] + ([(1, 13 + i, 14 + i)] if 13 + i < 19 else [])
            for i, p in enumerate(range(35, 45))
        ],
    ]
    cache = PagedCache(model, 3, 48, block_size=3, seed=1)
    chunked = run_steps(model, cache, tokens, steps)
    assert sorted(one) == sorted(chunked) == [(r, p) for r, n in enumerate(lens) for p in range(n)]
    for key in one:
        torch.testing.assert_close(chunked[key], one[key], rtol=0, atol=1e-10)
    for r, n in enumerate(lens):
        ref, _ = reference_forward(model, tokens[r])
        got = torch.stack([one[(r, p)] for p in range(n)])
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-10)
    # every forward called the backend once per layer, in order
    num_layers = CONFIGS[name].num_layers
    assert cache.layers_called == list(range(num_layers)) * len(steps)


@pytest.mark.parametrize("name", ["tiny_mla", "tiny_gqa"])
def test_aux_layers_are_residuals_after_each_layer(name):
    model = build_model(CONFIGS[name], dtype=torch.float64, seed=5)
    (ids,) = random_tokens(1, [12])
    cache = PagedCache(model, 1, 12)
    cache.set_batch(torch.zeros(12, dtype=torch.long), torch.arange(12))
    hidden, aux = model(ids, torch.arange(12), cache, aux_layers=(0, 1))
    _, residuals = reference_forward(model, ids)
    assert sorted(aux) == [0, 1] and hidden.shape == (12, model.hidden_size)
    for i in (0, 1):
        torch.testing.assert_close(aux[i], residuals[i], rtol=0, atol=1e-10)
    _, none = model(ids, torch.arange(12), cache)
    assert none == {}


@pytest.mark.parametrize("name", ["tiny_mla", "tiny_gqa"])
def test_seeded_build_is_deterministic_and_dtype_independent(name):
    before = torch.get_rng_state()
    a = build_model(CONFIGS[name], dtype=torch.float64, seed=7)
    b = build_model(CONFIGS[name], dtype=torch.float64, seed=7)
    c = build_model(CONFIGS[name], dtype=torch.float64, seed=8)
    f = build_model(CONFIGS[name], dtype=torch.float32, seed=7)
    assert torch.equal(torch.get_rng_state(), before), "building must not touch the global RNG"
    sa, sb, sc, sf = (m.state_dict() for m in (a, b, c, f))
    assert sa.keys() == sb.keys() == sf.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)
    assert all(sf[k].dtype == torch.float32 and torch.equal(sf[k], sa[k].float()) for k in sa)
    assert not a.training and not any(p.requires_grad for p in a.parameters())

    (ids,) = random_tokens(2, [40])
    out = {}
    for label, m in (("f64", a), ("f32", f)):
        cache = PagedCache(m, 1, 40)
        cache.set_batch(torch.zeros(40, dtype=torch.long), torch.arange(40))
        hidden, _ = m(ids, torch.arange(40), cache)
        out[label] = m.compute_logits(hidden)
    assert out["f32"].dtype == torch.float32
    torch.testing.assert_close(out["f32"].double(), out["f64"], rtol=0, atol=1e-4)


@pytest.mark.parametrize("name", ["tiny_mla", "tiny_gqa"])
def test_greedy_decoding_does_not_collapse(name):
    model = build_model(CONFIGS[name], dtype=torch.float64, seed=0)
    prompts = random_tokens(4, [6, 11, 16])
    gaps = []
    for r, prompt in enumerate(prompts):
        cache = PagedCache(model, 1, len(prompt) + 48)
        seq = prompt.tolist()
        logits = run_steps(model, cache, [prompt], [[(0, 0, len(prompt))]])[(0, len(prompt) - 1)]
        generated = []
        for _ in range(48):
            top2 = logits.topk(2).values
            gaps.append(float(top2[0] - top2[1]))
            generated.append(int(logits.argmax()))
            seq.append(generated[-1])
            logits = run_steps(model, cache, [torch.tensor(seq)], [[(0, len(seq) - 1, len(seq))]])[
                (0, len(seq) - 1)
            ]
        assert len(set(generated)) >= 8, f"prompt {r}: greedy output collapsed: {generated}"
    gaps = np.array(gaps)
    # float32 logits are good to ~1e-5 here; near-ties would make float32 runs flip tokens
    assert np.mean(gaps < 1e-3) < 0.02 and np.median(gaps) > 0.1, np.sort(gaps)[:10]


@pytest.mark.parametrize("name", ["tiny_mla", "tiny_gqa"])
def test_shipped_yaml_is_the_default_config(name):
    raw = yaml.safe_load((CONF_DIR / f"{name}.yaml").read_text())
    config = TypeAdapter(ModelConfig).validate_python(raw)
    assert type(config) is model_classes()[name].Config
    assert config == model_classes()[name].Config()
    assert set(raw) == set(model_classes()[name].Config.model_fields)


def test_config_validation():
    adapter = TypeAdapter(ModelConfig)
    with pytest.raises(ValidationError, match="num_kv_heads"):
        adapter.validate_python({"name": "tiny_gqa", "num_heads": 4, "num_kv_heads": 3})
    with pytest.raises(ValidationError, match="extra"):
        adapter.validate_python({"name": "tiny_mla", "hidden": 64})
    with pytest.raises(ValidationError):
        adapter.validate_python({"name": "tiny_mla", "qk_rope_head_dim": 7})
    with pytest.raises(ValidationError):
        adapter.validate_python({"name": "tiny_gpt"})
    assert adapter.validate_python({"name": "tiny_mla", "q_lora_rank": None}).q_lora_rank is None
    for cls in (TinyMLA.Config, TinyGQA.Config):
        for field_name, field in cls.model_fields.items():
            assert field.description or field_name == "name", field_name


def test_attention_specs():
    mla = build_model(TinyMLA.Config(), dtype=torch.float64, seed=0).attn_spec
    assert (mla.num_kv_heads, mla.qk_dim, mla.v_dim, mla.v_offset, mla.entry_dim) == (
        1,
        48,
        32,
        0,
        48,
    )
    assert mla.scale == pytest.approx(1 / math.sqrt(32))
    gqa = build_model(TinyGQA.Config(), dtype=torch.float64, seed=0).attn_spec
    assert (gqa.num_kv_heads, gqa.qk_dim, gqa.v_dim, gqa.v_offset, gqa.entry_dim) == (
        2,
        16,
        16,
        32,
        64,
    )
    assert gqa.scale == pytest.approx(0.25)
