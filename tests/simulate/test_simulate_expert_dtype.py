"""Routed experts stored in their own dtype (``simulate.expert_weights_dtype``; gpt-oss's MXFP4):
the bytes a GPU holds and the experts' GEMMs, worked by hand from the cards' config.json sizes."""

from __future__ import annotations

import json

import pytest

from pcpflow.errors import ConfigError
from pcpflow.models.card import card_from_hf_config
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.prepare import weight_bytes_per_gpu
from pcpflow.simulate.sizes import model_sizes
from pcpflow.testing import cli, compose

GIB = 2**30
MXFP4 = (32 * 4 + 8) / 32 / 8  # OCP MX v1.0: 32 E2M1 elements of 4 bits and one 8-bit E8M0 scale, bytes each
DECODE = ["mode=simulate", "hardware=h200_sxm", "model=gpt_oss_20b", "workload=explicit", "workload.prompt_lens=[1000]",
          "workload.output_lens=[2]", "output.plots=false", "output.progress=false"]


def gpt_oss_params(layers: int, experts: int) -> tuple[int, int, int]:
    """(attention and router, routed experts, embedding and head) parameters of a gpt-oss model
    from its config.json: hidden 2880, 64 query heads and 8 K/V heads of 64, experts 2880 wide
    (gate, up, down), vocabulary 201,088, untied; biases and sinks not counted."""
    h, heads, kv, d, i, vocab = 2880, 64, 8, 64, 2880, 201088
    attention = h * heads * d + 2 * h * kv * d + heads * d * h
    return layers * (attention + h * experts), layers * experts * 3 * h * i, 2 * vocab * h


@pytest.mark.parametrize("name, layers, experts, published_params, checkpoint_gib",
                         [("gpt_oss_120b", 36, 128, 116.83e9, 60.8), ("gpt_oss_20b", 24, 32, 20.91e9, 12.8)])
def test_a_gpt_oss_gpu_holds_its_experts_in_mxfp4(name, layers, experts, published_params, checkpoint_gib):
    """At tp=1 one GPU holds the bf16 attention, routers, embedding and head and the MXFP4
    experts: gpt-oss-120b (2 x 0.97B + 0.53125 x 114.66B + 2 x 1.16B) = 65.17 GB = 60.7 GiB, which
    OpenAI's model card (arXiv 2508.10925) gives as the checkpoint's 60.8 GiB (12.8 GiB for
    gpt-oss-20b: 13.75 GB here) and says runs within 80 GB; its parameters are the card's 116.83B
    (20.91B) less the biases and sinks the card does not count. At tp=8 the experts split 8 ways,
    the 8 K/V heads one a rank (nothing whole)."""
    cfg = compose(["mode=simulate", "hardware=h100_sxm", f"model={name}"])
    assert (cfg.simulate.weights_dtype, cfg.simulate.expert_weights_dtype) == ("bf16", "mxfp4")
    sizes = model_sizes(cfg.model)
    rest, routed, embedding = gpt_oss_params(layers, experts)
    assert rest + routed + embedding == pytest.approx(published_params, rel=5e-3)
    held = weight_bytes_per_gpu(sizes, "bf16", 1, "mxfp4")
    assert held == pytest.approx(2 * rest + MXFP4 * routed + 2 * embedding, rel=1e-12)
    assert held / GIB == pytest.approx(checkpoint_gib, rel=0.01)
    assert weight_bytes_per_gpu(sizes, "bf16", 8, "mxfp4") == pytest.approx(
        (2 * rest + MXFP4 * routed) / 8 + 2 * embedding, rel=1e-12)
    if name == "gpt_oss_120b":
        assert 55e9 < held < 70e9 and held < cfg.hardware.hbm_gib * GIB * cfg.simulate.hbm_utilization
        # bf16 experts (233.6 GB) would not fit one H100
        with pytest.raises(ConfigError) as exc:
            compose(["mode=simulate", "hardware=h100_sxm", f"model={name}", "simulate.expert_weights_dtype=bf16"])
        assert "the weights do not fit" in str(exc.value)


def test_null_experts_are_the_weights_dtype_and_price_as_before():
    """A card without expert_weights_dtype (DeepSeek-V3's fp8) prices its experts at
    weights_dtype: the run is the same, step for step, as one that names it; so is gpt-oss with
    its card's mxfp4 taken away and bf16 experts named; the bytes function agrees bit for bit."""
    base = ["mode=simulate", "hardware=h200_sxm", "model=deepseek_v3", "tp=8", "workload=explicit",
            "workload.prompt_lens=[2000]", "workload.output_lens=[3]", "output.plots=false", "output.progress=false"]
    for plain, named in ((base, base + ["simulate.expert_weights_dtype=fp8"]),
                         (DECODE + ["model.expert_weights_dtype=null"], DECODE + ["simulate.expert_weights_dtype=bf16"])):
        a, b = SimulatedRun(compose(plain)), SimulatedRun(compose(named))
        assert a.cfg.simulate.expert_weights_dtype == b.cfg.simulate.expert_weights_dtype
        a.run(), b.run()
        assert [r["purpose_s"] for r in a.records] == [r["purpose_s"] for r in b.records]
    sizes = model_sizes(compose(base).model)
    for tp in (1, 8):
        assert weight_bytes_per_gpu(sizes, "fp8", tp) == weight_bytes_per_gpu(sizes, "fp8", tp, "fp8")


def test_mxfp4_experts_decode_at_their_bytes_on_hopper():
    """One decode row of gpt-oss-20b on H200 (4.8 TB/s x 0.9; bf16 989.5 TF/s x 0.4235, 132 SMs;
    the kernel floor set to 0): each of 24 layers runs its 4 reached experts on 1 row. A GEMM
    takes the longer of its bytes and its 8 x 128 tiles (one wave: one tile on one SM) at the bf16 peak: mxfp4 on
    Hopper is weight-only, dequantized in the kernel. gate_up (5760 x 2880) is memory-bound at
    both dtypes: its time falls by the bytes, to ~0.27; down (2880 x 2880) at mxfp4 hits its
    tile's 1.86 us at the bf16 peak, so the experts' time falls to ~0.34, not below the byte
    ratio 0.53125 / 2. The step's GEMMs differ by exactly that saving (the rest is bf16 in both)."""
    hbm, tile = 4.8e12 * 0.9, 8 * 128 * 2 * 2880 / (989.5e12 * 0.4235 / 132)  # one tile on one SM of 132

    def expert(n, k, w):
        return max((k * 2 + n * k * w + n * 2) / hbm, tile)

    bf16 = 24 * 4 * (expert(5760, 2880, 2) + expert(2880, 2880, 2))
    mx = 24 * 4 * (expert(5760, 2880, MXFP4) + expert(2880, 2880, MXFP4))
    assert expert(5760, 2880, MXFP4) / expert(5760, 2880, 2) == pytest.approx(0.266, abs=1e-3)
    assert MXFP4 / 2 < mx / bf16 < 0.35
    runs = {d: SimulatedRun(compose(DECODE + ["hardware.kernel_floor_us=0", f"simulate.expert_weights_dtype={d}"]))
            for d in ("bf16", "mxfp4")}
    for run in runs.values():
        run.run()
    gemm = {d: run.records[1]["purpose_s"]["gemm"] for d, run in runs.items()}
    assert gemm["bf16"] - gemm["mxfp4"] == pytest.approx(bf16 - mx, rel=1e-9)


def test_mxfp4_is_weight_only_on_blackwell_too_and_fp4_needs_its_peak():
    """vLLM's default MXFP4 MoE on Blackwell is FlashInfer's MXFP4 x BF16: mxfp4 experts compute at
    the activations' peak on B200 as on H200; fp4 (W4A4) experts at B200's FP4 peak, refused on
    H100 (no FP4 tensor cores), naming the field and what it takes."""
    keys = {hw: SimulatedRun(compose(DECODE + [f"hardware={hw}"])).pricer.e_key for hw in ("h200_sxm", "b200")}
    assert keys == {"h200_sxm": "bf16", "b200": "bf16"}
    fp4 = SimulatedRun(compose(DECODE + ["hardware=b200", "simulate.expert_weights_dtype=fp4"])).pricer
    assert (fp4.e_key, fp4.e_bytes, fp4.w_key) == ("fp4", 0.5, "bf16")
    with pytest.raises(ConfigError) as exc:
        compose(DECODE + ["hardware=h100_sxm", "simulate.expert_weights_dtype=fp4"])
    [p] = exc.value.problems
    assert p.field == "simulate.expert_weights_dtype" and "no fp4 tensor-core peak" in p.allowed
    assert "mxfp4" in p.allowed


def test_an_unknown_expert_dtype_exits_2_naming_the_field(tmp_path):
    r = cli(*DECODE, "simulate.expert_weights_dtype=int3", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "simulate.expert_weights_dtype" in ln)
    assert "int3" in line and all(d in line for d in ("bf16", "fp8", "fp4", "mxfp4"))


def _config_json(tmp_path, name: str, raw: dict) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    return str(d)


MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
               num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
               num_local_experts=8, num_experts_per_tok=2, rope_theta=1e6, rms_norm_eps=1e-5, sliding_window=None)


def test_an_mxfp4_config_json_stores_its_experts_in_mxfp4(tmp_path):
    """quantization_config.quant_method mxfp4 (gpt-oss's: the experts alone) makes the card's
    experts mxfp4 and leaves its weights bf16; without it the experts follow the weights."""
    plain = card_from_hf_config(_config_json(tmp_path, "plain", MIXTRAL))
    quant = card_from_hf_config(_config_json(tmp_path, "mxfp4", {**MIXTRAL, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}}))
    assert (plain["weights_dtype"], plain["expert_weights_dtype"]) == ("bf16", None)
    assert (quant["weights_dtype"], quant["expert_weights_dtype"]) == ("bf16", "mxfp4")


# openai/gpt-oss-120b's config.json (https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json)
GPT_OSS_120B = dict(architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, intermediate_size=2880,
                    num_hidden_layers=36, num_local_experts=128, num_experts_per_tok=4, experts_per_token=4,
                    vocab_size=201088, head_dim=64, num_attention_heads=64, num_key_value_heads=8,
                    sliding_window=128, layer_types=["sliding_attention", "full_attention"] * 18,
                    tie_word_embeddings=False, attention_bias=True, rms_norm_eps=1e-5, rope_theta=150000,
                    max_position_embeddings=131072, swiglu_limit=7.0, initial_context_length=4096,
                    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 4096},
                    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": [
                        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})


def test_the_gpt_oss_card_is_its_config_json_s(tmp_path):
    """``model=gpt_oss_120b`` prices what ``model=hf`` reads from its config.json: the same sizes,
    window, sliding layers, routing and expert dtype."""
    path = _config_json(tmp_path, "gpt_oss_120b", GPT_OSS_120B)
    from_config = card_from_hf_config(path)
    card = compose(["mode=simulate", "hardware=h200_sxm", "model=gpt_oss_120b"]).model
    hf = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={path}"]).model
    assert model_sizes(hf) == model_sizes(card)
    assert (from_config["weights_dtype"], from_config["expert_weights_dtype"]) == ("bf16", "mxfp4")
    assert hf.moe == card.moe and (hf.sliding_window, hf.sliding_layers) == (card.sliding_window, card.sliding_layers)
