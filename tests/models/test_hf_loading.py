"""Loading Hugging Face checkpoints: what is rejected, and how (one config problem on
``model.path``, exit code 2, nothing started); the weight name adapter; RoPE scalings
against transformers' own; the shipped ``conf/model/hf.yaml``.

Checkpoints are written by ``scripts/make_tiny_hf_checkpoint.py`` (transformers'
``save_pretrained``); the token-for-token comparison is ``test_hf_parity.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip(
    "transformers", reason="needs transformers to build checkpoints: pip install -e '.[test]'"
)
safetensors_torch = pytest.importorskip("safetensors.torch")

from float64_compute import float64_compute  # noqa: E402
from released_configs import LLAMA4_MAVERICK, LLAMA4_SCOUT, llama4_config  # noqa: E402
from repo_scripts import load_script  # noqa: E402

from pcpflow.errors import ConfigError  # noqa: E402
from pcpflow.models import build_model, model_classes, vocab_size_of  # noqa: E402
from pcpflow.models.common import RopeScaling, scaled_rope  # noqa: E402
from pcpflow.models.hf import HFModel  # noqa: E402
from pcpflow.testing import cli, compose  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


script = load_script("make_tiny_hf_checkpoint")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    script.main(["--arch", "deepseek_v2", "--q-lora-rank", "none", "--out", str(root / "dsv2")])
    return {
        "llama": script.build_checkpoint(root / "llama", "llama"),
        "llama_tied_bias": script.build_checkpoint(
            root / "llama_tied_bias", "llama", tie_word_embeddings=True, bias=True
        ),
        "dsv3": script.build_checkpoint(root / "dsv3", "deepseek_v3"),
        "dsv2": root / "dsv2",
        "gemma3": script.build_checkpoint(root / "gemma3", "gemma3", tie_word_embeddings=True),  # tied, as released
    }


def _copy(src: Path, dst: Path, **config_changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is _DELETE:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_DELETE = object()


def _problem(path: Path | str) -> str:
    """The one problem ``model=hf model.path=path`` is rejected with."""
    with pytest.raises(ConfigError) as exc:
        compose(["model=hf", f"model.path={path}", "pcp=1"])
    (problem,) = exc.value.problems
    assert problem.field == "model.path"
    return problem.allowed


# ------------------------------------------------------------------ validation
def test_bad_checkpoints_are_one_config_problem_on_model_path(ckpts, tmp_path):
    with pytest.raises(ConfigError) as exc:
        compose(["model=hf", "pcp=1"])
    assert [p.field for p in exc.value.problems] == ["model.path"]
    assert "checkpoint directory is required" in exc.value.problems[0].allowed

    assert "no checkpoint directory" in _problem(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert "config.json is missing" in _problem(tmp_path / "empty")
    bad_json = _copy(ckpts["llama"], tmp_path / "bad_json")
    (bad_json / "config.json").write_text("{not json")
    assert "not readable JSON" in _problem(bad_json)

    bloom = _copy(ckpts["llama"], tmp_path / "bloom", architectures=["BloomForCausalLM"])  # NOTE: ALiBi, no RoPE
    msg = _problem(bloom)
    assert "unsupported architecture BloomForCausalLM" in msg
    assert all(a in msg for a in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "DeepseekV3ForCausalLM"))

    # MoE checkpoints load (tests/parallel/test_moe.py); other MoE families and variants are named
    phimoe = _copy(ckpts["llama"], tmp_path / "phimoe", architectures=["PhimoeForCausalLM"], num_local_experts=16)
    assert "unsupported architecture PhimoeForCausalLM: a mixture-of-experts variant" in _problem(phimoe)
    freq = _copy(ckpts["dsv3"], tmp_path / "freq", first_k_dense_replace=1, moe_layer_freq=2)
    assert "moe_layer_freq=2 is not supported" in _problem(freq)
    dense = _copy(ckpts["dsv3"], tmp_path / "dense", n_routed_experts=None, first_k_dense_replace=0)
    assert compose(["model=hf", f"model.path={dense}", "pcp=1"]).model.path == str(dense)

    fp8 = _copy(ckpts["dsv3"], tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    assert "quantized checkpoints (fp8) are not supported" in _problem(fp8)
    dynamic = _copy(
        ckpts["llama"],
        tmp_path / "dynamic",
        rope_parameters=None,
        rope_scaling={"type": "dynamic", "factor": 2.0},
    )
    assert "rope type 'dynamic' is not supported" in _problem(dynamic)
    gelu = _copy(ckpts["llama"], tmp_path / "gelu", hidden_act="gelu")
    assert "hidden_act" in _problem(gelu)
    no_vocab = _copy(ckpts["llama"], tmp_path / "no_vocab", vocab_size=_DELETE)
    msg = _problem(no_vocab)
    assert "vocab_size: Field required" in msg and "hidden_size" not in msg  # not the whole config quoted
    biased = _copy(ckpts["dsv2"], tmp_path / "biased", mlp_bias=True)
    assert "MLP biases (mlp_bias: true) are not supported for DeepSeek checkpoints" in _problem(biased)
    swish = _copy(ckpts["llama"], tmp_path / "swish", hidden_act="swish")  # transformers' ACT2FN: SiLU
    assert compose(["model=hf", f"model.path={swish}", "pcp=1"]).model.path == str(swish)
    no_weights = _copy(ckpts["llama"], tmp_path / "no_weights")
    (no_weights / "model.safetensors").unlink()
    assert "no safetensors weights" in _problem(no_weights)


BROKEN_CONFIGS = {
    # name: (arch, config.json changes, what the one problem says)
    "a number as a string": ("llama", {"hidden_size": "64"}, "hidden_size: Input should be a valid integer (got '64')"),
    "a float where an int belongs": ("dsv3", {"vocab_size": 384.5}, "vocab_size: Input should be a valid integer"),
    "zero heads": ("dsv3", {"num_attention_heads": 0}, "num_attention_heads: Input should be greater than 0"),
    "quantization_config not a mapping": ("llama", {"quantization_config": "fp8"}, "quantization_config must be a mapping"),
    "an unsupported architecture": ("llama", {"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture GPT2LMHeadModel"),
    "architectures not a list": ("llama", {"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names"),
    "a rope factor of the wrong type": ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": "eight",
                                                                      "original_max_position_embeddings": 64}},
                                        "rope_parameters.factor: Input should be a valid number"),
    "rope_parameters not a mapping": ("dsv3", {"rope_parameters": "yarn"}, "rope_parameters must be a mapping"),
}


@pytest.mark.parametrize("mode", ["execute", "simulate"])
@pytest.mark.parametrize("case", sorted(BROKEN_CONFIGS))
def test_a_broken_config_json_is_one_problem_in_both_kinds_of_run(ckpts, tmp_path, case, mode):
    """A config.json with a value of the wrong type or shape is refused before anything starts,
    by the one strict parser both an executed and a simulated run read it with."""
    arch, changes, says = BROKEN_CONFIGS[case]
    broken = _copy(ckpts[arch], tmp_path / "broken", **changes)
    extra = ["mode=simulate", "hardware=h200_sxm"] if mode == "simulate" else ["pcp=1"]
    with pytest.raises(ConfigError) as exc:
        compose(["model=hf", f"model.path={broken}", *extra])
    (problem,) = exc.value.problems
    assert problem.field == "model.path" and says in problem.allowed, problem


def test_cli_rejects_an_moe_checkpoint_with_exit_2_and_starts_nothing(ckpts, tmp_path):
    moe = _copy(ckpts["llama"], tmp_path / "moe", architectures=["PhimoeForCausalLM"])
    run_dir = tmp_path / "run"
    r = cli("model=hf", f"model.path={moe}", f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr
    assert "model.path" in r.stderr and "PhimoeForCausalLM: a mixture-of-experts" in r.stderr
    assert "Qwen3MoeForCausalLM, MixtralForCausalLM" in r.stderr  # the MoE families it does route
    assert "OlmoeForCausalLM" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert not run_dir.exists()
    assert not run_dir.exists(), "nothing may start for an invalid config"


def test_shipped_yaml_and_config(ckpts, tmp_path, monkeypatch):
    raw = yaml.safe_load((REPO / "conf" / "model" / "hf.yaml").read_text())
    assert raw == {"name": "hf", "path": None}
    assert set(raw) == set(HFModel.Config.model_fields)
    assert model_classes()["hf"] is HFModel
    for name, field in HFModel.Config.model_fields.items():
        assert field.description or name == "name", name
    # a relative path is resolved once, where the config is validated
    monkeypatch.chdir(ckpts["llama"].parent)
    cfg = compose(["model=hf", "model.path=llama", "pcp=1"])
    assert cfg.model.path == str(ckpts["llama"]) and os.path.isabs(cfg.model.path)
    assert vocab_size_of(cfg.model) == 384
    with pytest.raises(ConfigError, match="model.path"):
        vocab_size_of(HFModel.Config.model_construct(path=str(tmp_path / "gone")))


# ------------------------------------------------------------------ weights
def _hf_tensors(path: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(str(path / "model.safetensors"))


def test_weights_land_where_the_name_adapter_says(ckpts):
    hf = _hf_tensors(ckpts["dsv3"])
    model = build_model(
        compose(["model=hf", f"model.path={ckpts['dsv3']}", "pcp=1"]).model,
        dtype=torch.float64,
        seed=0,
    )
    layer = model.layers[1]
    assert torch.equal(
        layer.mlp.gate_up_proj.weight,
        torch.cat(
            [hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]]
        ).double(),
    )
    assert torch.equal(
        layer.self_attn.kv_a_proj.weight,
        hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].double(),
    )
    assert torch.equal(
        layer.self_attn.q_a_norm.weight,
        hf["model.layers.1.self_attn.q_a_layernorm.weight"].double(),
    )
    assert torch.equal(
        layer.self_attn.kv_a_norm.weight,
        hf["model.layers.1.self_attn.kv_a_layernorm.weight"].double(),
    )
    assert torch.equal(
        layer.input_norm.weight, hf["model.layers.1.input_layernorm.weight"].double()
    )
    assert torch.equal(model.lm_head.weight, hf["lm_head.weight"].double())
    assert all(p.dtype == torch.float64 for p in model.parameters())
    # the cache holds the latent plus the rope key, not per-head K/V
    spec = model.attn_spec
    assert (spec.num_kv_heads, spec.entry_dim, spec.v_dim) == (1, 32 + 16, 32)

    hf = _hf_tensors(ckpts["llama_tied_bias"])
    model = build_model(
        compose(["model=hf", f"model.path={ckpts['llama_tied_bias']}", "pcp=1"]).model,
        dtype=torch.float32,
        seed=0,
    )
    assert model.lm_head is None and "lm_head.weight" not in hf
    assert torch.equal(
        model.layers[0].self_attn.k_proj.bias, hf["model.layers.0.self_attn.k_proj.bias"]
    )
    assert torch.equal(
        model.layers[0].mlp.gate_up_proj.bias,
        torch.cat([hf["model.layers.0.mlp.gate_proj.bias"], hf["model.layers.0.mlp.up_proj.bias"]]),
    )
    spec = model.attn_spec  # roped K of both kv heads, then V
    assert (spec.num_kv_heads, spec.qk_dim, spec.v_offset, spec.entry_dim) == (2, 16, 32, 64)


def _with_tensors(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = _hf_tensors(dst)
    edit(tensors)
    safetensors_torch.save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_unknown_missing_and_misshapen_tensors_are_errors(ckpts, tmp_path):
    def build(path):
        cfg = compose(["model=hf", f"model.path={path}", "pcp=1"])
        return build_model(cfg.model, dtype=torch.float32, seed=0)

    src = ckpts["llama"]
    good = compose(["model=hf", f"model.path={src}", "pcp=1"]).model

    def load(path):  # the loader, which a library user may call directly, without the driver's checks
        return build_model(good.model_copy(update={"path": str(path)}), dtype=torch.float32, seed=0)

    extra = _with_tensors(
        src,
        tmp_path / "extra",
        lambda t: t.update({"model.layers.0.mlp.fc9.weight": torch.zeros(2)}),
    )
    # The driver reads the safetensors headers before any rank starts (pcpflow.driver.checks) ...
    assert "only tensors the model has a place for; 1 have none: model.layers.0.mlp.fc9.weight" in _problem(extra)
    # ... and the loader says the same.
    with pytest.raises(ValueError, match=r"1 checkpoint tensor\(s\) have no place.*mlp.fc9"):
        load(extra)
    missing = _with_tensors(
        src, tmp_path / "missing", lambda t: t.pop("model.layers.1.mlp.up_proj.weight")
    )
    assert "1 missing: model.layers.1.mlp.up_proj.weight" in _problem(missing)
    with pytest.raises(ValueError, match="does not provide model.layers.1.mlp.up_proj.weight"):
        load(missing)
    shape = _with_tensors(
        src, tmp_path / "shape", lambda t: t.update({"model.norm.weight": torch.ones(63)})
    )
    with pytest.raises(ConfigError, match=r"tensor model.norm.weight has shape \[63\]; config.json implies \[64\]"):
        build(shape)
    with pytest.raises(
        ValueError, match=r"model.norm.weight is \[63\], but norm.weight wants \[64\]"
    ):
        load(shape)
    twice = _with_tensors(src, tmp_path / "twice", lambda t: None)
    (twice / "model.safetensors").rename(twice / "model-1.safetensors")
    safetensors_torch.save_file(
        {"model.norm.weight": torch.ones(64)}, str(twice / "model-2.safetensors")
    )
    assert "1 stored more than once: model.norm.weight" in _problem(twice)
    with pytest.raises(ValueError, match="stored more than once: model.norm.weight"):
        load(twice)
    # an MTP layer past num_hidden_layers (DeepSeek-V3) and saved rotary tables are skipped
    skipped = _with_tensors(
        src,
        tmp_path / "skipped",
        lambda t: t.update(
            {
                "model.layers.2.self_attn.q_proj.weight": torch.zeros(3),
                "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
            }
        ),
    )
    a, b = build(skipped), build(src)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    # a stacked tensor (Phi-3's q, k, v in one) is as tall as its parts together
    phi3 = script.build_checkpoint(tmp_path / "phi3", "phi3")
    name = "model.layers.1.self_attn.qkv_proj.weight"
    short = _with_tensors(phi3, tmp_path / "short", lambda t: t.update({name: t[name][:120]}))
    with pytest.raises(ConfigError, match=rf"tensor {name} has shape \[120, 64\]; config.json implies \[128, 64\]"):
        build(short)
    with pytest.raises(ValueError, match=rf"{name} is \[120, 64\], but it stacks layers.1.self_attn.q_proj.weight, "
                       r"layers.1.self_attn.k_proj.weight, layers.1.self_attn.v_proj.weight: 128 rows"):
        load(short)
    stacked, parts = build(phi3), _hf_tensors(phi3)[name]
    attn = stacked.layers[1].self_attn
    assert torch.equal(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]), parts)



@pytest.mark.parametrize("arch", ["llama", "dsv3"])
def test_missing_and_extra_tensors_exit_2_before_any_rank_starts(ckpts, tmp_path, arch):
    """A tensor the model needs, absent; a tensor with no place in the model; config.json
    giving more layers than are stored: one problem on model.path naming the tensors, exit
    2 from the driver (not exit 1 from the ranks)."""
    src = ckpts[arch]
    some_layer_tensor = sorted(k for k in _hf_tensors(src) if k.startswith("model.layers.0.mlp."))[0]
    missing = _with_tensors(src, tmp_path / "missing", lambda t: t.pop(some_layer_tensor))
    assert f"1 missing: {some_layer_tensor}" in _problem(missing)
    extra = _with_tensors(src, tmp_path / "extra", lambda t: t.update({"model.layers.0.self_attn.bogus.weight": torch.zeros(3)}))
    assert "1 have none: model.layers.0.self_attn.bogus.weight" in _problem(extra)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    more = _copy(src, tmp_path / "more", num_hidden_layers=layers + 1)
    msg = _problem(more)
    assert f"missing: model.layers.{layers}." in msg and "in all)" in msg
    assert f"num_hidden_layers={layers + 1}; the weights hold {layers} layer(s)" in msg
    result = cli("model=hf", f"model.path={missing}", "pcp=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "model.path" in result.stderr + result.stdout
    assert some_layer_tensor in result.stderr + result.stdout and not (tmp_path / "run" / "result.json").exists()


def test_tensors_the_loader_skips_pass_the_pre_run_check(ckpts, tmp_path):
    """What the loader leaves out on purpose is not refused before the run: layers past
    num_hidden_layers (DeepSeek-V3's MTP layers), saved rotary inv_freq."""
    src = ckpts["dsv3"]
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    mtp = _with_tensors(src, tmp_path / "mtp", lambda t: t.update({
        f"model.layers.{layers}.self_attn.kv_a_proj_with_mqa.weight": torch.zeros(3),
        f"model.layers.{layers}.enorm.weight": torch.zeros(3),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8),
    }))
    assert compose(["model=hf", f"model.path={mtp}", "pcp=1"]).model.path == str(mtp)


@pytest.mark.parametrize("stored", ["both, the head differing", "both, the head a copy", "the head alone"])
def test_tied_embeddings_load_as_transformers_ties_them(ckpts, tmp_path, stored):
    """``tie_word_embeddings: true`` and what the files hold: a head stored beside the
    embedding is the model's head (transformers keeps a differing one), a head stored alone
    is the embedding too. The logits of a forward equal transformers' own."""
    def edit(t):
        if stored == "the head alone":
            t["lm_head.weight"] = t.pop("model.embed_tokens.weight")
        else:
            gen = torch.Generator().manual_seed(1)
            t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
            if stored == "both, the head differing":
                t["lm_head.weight"] += torch.randn(t["lm_head.weight"].shape, generator=gen)
    path = _with_tensors(ckpts["llama_tied_bias"], tmp_path / "ckpt", edit)
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
    model = build_model(compose(["model=hf", f"model.path={path}", "pcp=1"]).model, dtype=torch.float64, seed=0)
    with torch.no_grad():
        hidden = want.model(ids).last_hidden_state[0]
        assert torch.allclose(model.compute_logits(hidden), want.lm_head(hidden), atol=1e-12, rtol=0)
        assert torch.equal(model.embed_tokens.weight, want.model.embed_tokens.weight)


# ------------------------------------------------------------------ sliding windows
def _explicit(path: Path, prompt_len: int, output_len: int) -> list[str]:
    return ["model=hf", f"model.path={path}", "pcp=2", "workload=explicit",
            f"workload.prompts=[{list(range(prompt_len))}]".replace(" ", ""), f"workload.output_lens=[{output_len}]"]


@pytest.fixture(scope="module")
def windowed(tmp_path_factory):
    """Mistral and Qwen2 checkpoints whose layers slide over 16 tokens."""
    root = tmp_path_factory.mktemp("window")
    return {arch: script.build_checkpoint(root / arch, arch, sliding_window=16) for arch in ("mistral", "qwen2")}


@pytest.mark.parametrize("arch", ["mistral", "qwen2"])
def test_an_executed_run_attends_through_the_window(windowed, arch):
    """A request longer than the window runs (executed: the sliding layers read their last 16
    keys, tests/models/test_hf_parity.py holds them to transformers); the model's attention
    spec carries config.json's window on the layers transformers slides."""
    from pcpflow.models.hf import HFModel

    path = windowed[arch]
    cfg = compose(_explicit(path, 40, 5))
    assert cfg.model.path == str(path)
    spec = HFModel.from_config(cfg.model, dtype=torch.float32, seed=0, device="meta").attn_spec
    assert (spec.window, spec.window_layers) == (16, (0, 1))


def test_a_simulated_run_prices_the_window(windowed):
    """A simulated run reads the window from config.json into its card and prices the sliding
    layers by their own pairs (tests/simulate/test_simulate_window.py): a request longer than
    the window is no problem there either."""
    sim = ["mode=simulate", "hardware=h100_sxm", "model=hf", f"model.path={windowed['mistral']}", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[40]", "workload.output_lens=[5]"]
    card = compose(sim).model
    assert (card.sliding_window, card.sliding_layers) == (16, 2)


def test_a_request_past_longrope_s_original_length_exits_2_when_executed(tmp_path):
    """LongRoPE: past its original length (128 here) transformers ropes a whole forward with
    long_factor, the cached prompt's keys included; pcpflow ropes each position once, so an
    executed run takes requests up to that length only (exit 2 on model.path, before any rank
    starts). A simulated run prices the same attention whatever the frequencies: it runs."""
    path = script.build_checkpoint(tmp_path / "phi3", "phi3")
    assert compose(_explicit(path, 120, 8)).model.path == str(path)  # 128 tokens
    with pytest.raises(ConfigError) as exc:
        compose(_explicit(path, 120, 9))
    (problem,) = exc.value.problems
    assert problem.field == "model.path" and "original_max_position_embeddings=128" in problem.allowed
    assert "the longest request reaches 129 tokens" in problem.allowed
    run_dir = tmp_path / "run"
    r = cli(*_explicit(path, 120, 9), f"hydra.run.dir={run_dir}")
    assert r.returncode == 2 and "longrope" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not run_dir.exists()
    sim = compose(["mode=simulate", "hardware=h100_sxm", "model=hf", f"model.path={path}", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[4096]", "workload.output_lens=[4]"])
    assert sim.model.name == "hf_card"


def test_longrope_is_read_as_phi3_config_reads_it(tmp_path):
    """Phi-3's config.json spells LongRoPE ``longrope``, or ``su`` / ``yarn`` as older ones
    did (``Phi3Config`` reads both as ``longrope``); ``factor`` absent is max / original length;
    the frequencies and the cos/sin factor equal transformers' ``longrope`` (evaluated in
    float32 there); a factor list of the wrong length is refused, naming it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pcpflow.models.hf_registry import read_checkpoint_config

    short, long = [1.0, 1.1, 1.3, 2.0, 2.5, 4.0], [2.0, 3.0, 4.0, 6.0, 9.0, 12.0]
    base = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=64, intermediate_size=128,
                num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, vocab_size=384,
                max_position_embeddings=4096, original_max_position_embeddings=512, partial_rotary_factor=0.75,
                rope_theta=10000.0)
    theirs = transformers.Phi3Config(**base, rope_scaling={"rope_type": "longrope", "short_factor": short,
                                                           "long_factor": long})
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS["longrope"](theirs, "cpu")
    assert want_factor == pytest.approx((1 + torch.log(torch.tensor(8.0)).item() / torch.log(torch.tensor(512.0)).item()) ** 0.5)
    for spelling in ("longrope", "su", "yarn"):
        (tmp_path / spelling).mkdir()
        (tmp_path / spelling / "config.json").write_text(json.dumps(
            {**base, "rope_scaling": {"type": spelling, "short_factor": short, "long_factor": long}}))
        c = read_checkpoint_config(tmp_path / spelling)
        assert (c.rope_scaling.rope_type, c.rope_scaling.factor, c.rope_limit) == ("longrope", 8.0, 512), spelling
        inv_freq, factor = scaled_rope(c.rope_dims, c.rope_theta, c.rope_scaling)
        torch.testing.assert_close(inv_freq, want_inv_freq.double(), rtol=1e-6, atol=0)
        assert factor == pytest.approx(want_factor, rel=1e-12)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text(json.dumps(
        {**base, "rope_scaling": {"type": "longrope", "short_factor": short[:4], "long_factor": long}}))
    with pytest.raises(ValueError, match="longrope short_factor has 4 numbers; RoPE rotates 12 dims of a head"):
        read_checkpoint_config(tmp_path / "bad")


def test_which_layers_slide_is_read_as_transformers_reads_it(ckpts, tmp_path):
    """Mistral: every layer, unless sliding_window is null (absent: transformers' 4096).
    Qwen2/3: only with use_sliding_window, on the layers from max_window_layers (or those
    layer_types names); Qwen2-MoE as its config class says. Llama has no window whatever
    config.json says."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    def window(arch, **fields):
        path = _copy(ckpts["llama"], tmp_path / f"w{len(list(tmp_path.iterdir()))}", architectures=[arch], **fields)
        c = read_checkpoint_config(path)
        return c.window, c.sliding_layers

    assert window("MistralForCausalLM", sliding_window=None) == (None, [])
    assert window("MistralForCausalLM", sliding_window=_DELETE) == (4096, [0, 1])
    assert window("LlamaForCausalLM", sliding_window=8) == (None, [])
    assert window("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=False) == (None, [])
    assert window("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=1) == (8, [1])
    assert window("Qwen2ForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=2) == (None, [])
    assert window("Qwen3ForCausalLM", sliding_window=8, use_sliding_window=True,
                  layer_types=["sliding_attention", "full_attention"]) == (8, [0])
    assert window("Qwen3ForCausalLM", sliding_window=_DELETE, use_sliding_window=True, max_window_layers=0) == (4096, [0, 1])
    # Qwen2-MoE: Qwen2MoeConfig writes sliding_window 0 for none, and slides the even layers below
    # max_window_layers where it is given no layer_types (its own rule, read from transformers here)
    assert window("Qwen2MoeForCausalLM", sliding_window=0, use_sliding_window=False) == (None, [])
    theirs = transformers.Qwen2MoeConfig(num_hidden_layers=2, use_sliding_window=True, sliding_window=8,
                                         max_window_layers=2).layer_types
    assert window("Qwen2MoeForCausalLM", sliding_window=8, use_sliding_window=True, max_window_layers=2) == (
        8, [i for i, kind in enumerate(theirs) if kind == "sliding_attention"]) == (8, [0])


# ------------------------------------------------------------------ what each family builds
def test_each_gqa_family_builds_the_parameters_transformers_has(tmp_path):
    """Built from the same config.json, pcpflow's model has a parameter (after the loader's
    renames) for exactly each of transformers' tensors, of its shape: Qwen2's q/k/v biases
    and no o bias, Qwen3's per-head q/k norms over its explicit head_dim, Mistral's none;
    Qwen3-MoE's dense layer 0 and MoE layer 1 (router, experts), Mixtral's
    ``block_sparse_moe`` experts ``w1``/``w3``/``w2`` on every layer, GLM-4.5's q/k/v biases
    without an o bias, q/k norms, router bias and shared expert; Gemma 3's four norms a layer,
    q/k norms and (``attention_bias``) q/k/v/o biases; Granite's fused experts, shared MLP and
    q/k/v/o biases (a Granite 4.0 hybrid without experts: its shared MLP as the layer's MLP);
    StarCoder2's, Phi's, StableLM's, Nemotron's, GPT-NeoX's and GPT-J's LayerNorm weights and biases,
    Phi's and GPT-J's LM head bias, GPT-NeoX's fused ``query_key_value``."""
    from pcpflow.models.hf_registry import read_checkpoint
    from pcpflow.models.hf_weights import plan_names

    for arch in ("qwen2", "qwen3", "mistral", "llama", "phi3", "smollm3", "granite", "qwen2_moe", "qwen3_moe", "mixtral",
                 "glm4_moe", "gemma3", "gemma2", "granitemoe", "granitemoeshared", "granite4", "granite4_dense",
                 "olmoe", "starcoder2", "phi", "stablelm", "nemotron", "gpt_neox", "gptj"):
        path = script.build_checkpoint(tmp_path / arch, arch, bias=True)  # Qwen2, Mistral and Phi-3 ignore it
        theirs = {k: tuple(v.shape) for k, v in _hf_tensors(path).items()}
        checkpoint = read_checkpoint(path)
        ours = HFModel(checkpoint)
        params = {n: tuple(p.shape) for n, p in ours.named_parameters()}
        plan = plan_names(list(theirs), list(params), checkpoint.renames, num_layers=checkpoint.num_hidden_layers)
        assert (plan.unknown, plan.unfilled, plan.twice) == ([], [], []), arch
        for hf, targets in plan.targets.items():
            if plan.rules[hf].experts:  # NOTE: Granite's experts of a layer, stacked along a new first dim
                assert theirs[hf] == (len(targets), *params[targets[0][0]]), (arch, hf)
            elif all(part is None for _, part in targets):  # one parameter, or several stacked (Phi-3's qkv_proj)
                assert theirs[hf] == (sum(params[n][0] for n, _ in targets), *params[targets[0][0]][1:]), (arch, hf)
        if arch == "phi3":  # NOTE: qkv_proj is q (4 heads x 16), then k and v (2 kv heads x 16 each)
            assert theirs["model.layers.0.self_attn.qkv_proj.weight"] == (64 + 32 + 32, 64)
        if arch == "gpt_neox":  # NOTE: every head its own k and v, whatever num_key_value_heads the config carries
            assert theirs["gpt_neox.layers.0.attention.query_key_value.weight"] == (3 * 64, 64)


def test_real_checkpoint_configs_size_a_simulated_run(tmp_path):
    """config.json of Qwen2.5-0.5B-Instruct, Qwen3-0.6B and Mistral-7B-Instruct-v0.3 (their
    published numbers): a simulated run sizes Qwen3's explicit head_dim (128, not
    hidden/heads = 64), GQA KV heads and tied embeddings; none has a window in effect."""
    from pcpflow.models.card import card_from_hf_config
    from pcpflow.models.hf_registry import read_checkpoint_config

    configs = {
        "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
                             num_attention_heads=14, num_key_value_heads=2, num_hidden_layers=24, vocab_size=151936,
                             max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
                             use_sliding_window=False, sliding_window=32768, max_window_layers=21),
        "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
                           num_attention_heads=16, num_key_value_heads=8, head_dim=128, num_hidden_layers=28, vocab_size=151936,
                           max_position_embeddings=40960, rope_theta=1000000, rms_norm_eps=1e-6, tie_word_embeddings=True,
                           attention_bias=False, use_sliding_window=False, sliding_window=None, max_window_layers=28),
        "mistral-7b-v0.3": dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                                intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                                vocab_size=32768, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-5,
                                sliding_window=None, tie_word_embeddings=False),
    }
    want = {"qwen2.5-0.5b": (2, 64, True), "qwen3-0.6b": (8, 128, True), "mistral-7b-v0.3": (8, 128, False)}
    for name, config in configs.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        card = card_from_hf_config(tmp_path / name)
        assert (card["attention"], card["num_kv_heads"], card["head_dim"], card["tie_word_embeddings"]) == ("gqa", *want[name]), name
        assert read_checkpoint_config(tmp_path / name).window is None, name
        cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path / name}", "pcp=2",
                       "workload=explicit", "workload.prompt_lens=[4096]", "workload.output_lens=[2]"])
        kv, d = want[name][:2]
        assert (cfg.model.num_kv_heads, cfg.model.head_dim) == (kv, d), name


# config.json of SmolLM3-3B (a NoPE layer in four, tied), Granite-3.1-2B and -8B-Instruct (their
# multipliers), with their published parameter counts (billions)
REAL_LLAMA_STYLE_CONFIGS = {
    "smollm3-3b": (dict(architectures=["SmolLM3ForCausalLM"], model_type="smollm3", hidden_size=2048,
                        intermediate_size=11008, num_attention_heads=16, num_key_value_heads=4, num_hidden_layers=36,
                        vocab_size=128256, max_position_embeddings=65536, rope_theta=5000000.0, rms_norm_eps=1e-6,
                        no_rope_layer_interval=4, use_sliding_window=False, sliding_window=None), 3.08),
    "granite-3.1-2b": (dict(architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=2048,
                            intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=40,
                            vocab_size=49155, max_position_embeddings=131072, rope_theta=5000000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                            attention_multiplier=0.015625, logits_scaling=8.0), 2.53),
    "granite-3.1-8b": (dict(architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096,
                            intermediate_size=12800, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=40,
                            vocab_size=49155, max_position_embeddings=131072, rope_theta=10000000.0, rms_norm_eps=1e-5,
                            tie_word_embeddings=True, embedding_multiplier=12.0, residual_multiplier=0.22,
                            attention_multiplier=0.0078125, logits_scaling=16.0), 8.17),
}


@pytest.mark.parametrize("name", REAL_LLAMA_STYLE_CONFIGS)
def test_real_smollm3_and_granite_configs_size_a_simulated_run(tmp_path, name):
    """SmolLM3's and Granite's config.json come to their published parameter counts (tied
    embeddings counted once: SmolLM3 ties them unless config.json says otherwise, as
    ``SmolLM3Config``); every fourth SmolLM3 layer has no RoPE, as transformers' own config
    class lists them; Granite's softmax scale is its attention_multiplier."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    config, total_b = REAL_LLAMA_STYLE_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=4", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    assert cfg.model.tie_word_embeddings
    assert (sizes.total_weight_params() + sizes.embedding_params) / 1e9 == pytest.approx(total_b, abs=0.02)
    c = read_checkpoint_config(tmp_path)
    if name.startswith("smollm3"):
        theirs = transformers.SmolLM3Config(**{k: v for k, v in config.items() if k != "architectures"})
        assert c.rope_layers == [bool(x) for x in theirs.no_rope_layers]
        assert c.rope_layers.count(False) == 9 and not c.rope_layers[3] and c.rope_layers[4]
    else:
        assert c.attn_spec().scale == config["attention_multiplier"]


def test_smollm3_nope_layers_and_windows_are_read_as_smollm3_config_reads_them(tmp_path):
    """``no_rope_layers`` as given (1: RoPE), else every ``no_rope_layer_interval``-th layer
    without; a window (``use_sliding_window``) on the NoPE layers only, as ``SmolLM3Config``
    lays them out; a list of the wrong length or values is refused, naming the field."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    base = dict(architectures=["SmolLM3ForCausalLM"], hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, num_hidden_layers=6, vocab_size=384)

    def read(name, **fields):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({**base, **fields}))
        return read_checkpoint_config(tmp_path / name)

    assert read("given", no_rope_layers=[1, 0, 1, 1, 0, 1]).rope_layers == [True, False, True, True, False, True]
    assert read("interval", no_rope_layer_interval=3).rope_layers == [True, True, False, True, True, False]
    windowed = read("window", no_rope_layer_interval=3, use_sliding_window=True, sliding_window=8)
    theirs = transformers.SmolLM3Config(**{k: v for k, v in base.items() if k != "architectures"},
                                        no_rope_layer_interval=3, use_sliding_window=True, sliding_window=8)
    assert windowed.sliding_layers == [i for i, t in enumerate(theirs.layer_types) if t == "sliding_attention"] == [2, 5]
    assert windowed.window == 8 and read("no_window", no_rope_layer_interval=3, sliding_window=8).window is None
    with pytest.raises(ValueError, match=r"no_rope_layers must give each of the 6 layers 1 \(RoPE\) or 0"):
        read("short", no_rope_layers=[1, 0, 1])


# config.json of Phi-3-mini-4k-instruct (no RoPE scaling, a 2047-token window) and Phi-4-mini-instruct
# (LongRoPE on 3/4 of a head: 48 factors, their values left out here), with their published
# parameter counts (billions: 3.8 both)
REAL_PHI3_CONFIGS = {
    "phi-3-mini-4k": (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
                           num_attention_heads=32, num_key_value_heads=32, num_hidden_layers=32, vocab_size=32064,
                           max_position_embeddings=4096, original_max_position_embeddings=4096, rope_theta=10000.0,
                           rope_scaling=None, rms_norm_eps=1e-5, sliding_window=2047, tie_word_embeddings=False), 3.8),
    "phi-4-mini": (dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, intermediate_size=8192,
                        num_attention_heads=24, num_key_value_heads=8, num_hidden_layers=32, vocab_size=200064,
                        max_position_embeddings=131072, original_max_position_embeddings=4096, rope_theta=10000.0,
                        partial_rotary_factor=0.75, rms_norm_eps=1e-5, sliding_window=262144, tie_word_embeddings=True,
                        rope_scaling={"type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48}), 3.8),
}


@pytest.mark.parametrize("name", REAL_PHI3_CONFIGS)
def test_real_phi3_checkpoint_configs_size_a_simulated_run(tmp_path, name):
    """A simulated run of a Phi-3 family config.json counts the parameters its model card
    publishes (3.8B, to its rounding); its window (Phi-3-mini-4k's 2047, every layer) is read
    into the card, which prices requests longer than it too."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    config, total_b = REAL_PHI3_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2", "workload=explicit"]
    cfg = compose([*sim, "workload.prompt_lens=[2000]", "workload.output_lens=[47]"])
    sizes = model_sizes(cfg.model)
    assert (sizes.total_weight_params() + sizes.embedding_params) / 1e9 == pytest.approx(total_b, abs=0.05)
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    assert (cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.head_dim) == (heads, kv_heads, 3072 // heads)
    window = read_checkpoint_config(tmp_path).window
    assert window == config["sliding_window"]
    longer = compose([*sim, "workload.prompt_lens=[2000]", "workload.output_lens=[48]"]).model  # past the window
    assert (longer.sliding_window, longer.sliding_layers) == (window, 32)


# config.json of Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B, Qwen3-30B-A3B, Qwen3-235B-A22B (as transformers 4
# wrote them: num_experts) and Mixtral-8x7B-v0.1, with their published parameter counts (billions:
# total, active per token).
REAL_MOE_CONFIGS = {
    "qwen1.5-moe-a2.7b": (dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048,
                               intermediate_size=5632, moe_intermediate_size=1408, shared_expert_intermediate_size=5632,
                               num_attention_heads=16, num_key_value_heads=16, num_hidden_layers=24, vocab_size=151936,
                               num_experts=60, num_experts_per_tok=4, norm_topk_prob=False, decoder_sparse_step=1,
                               max_position_embeddings=8192, rope_theta=1000000.0, rms_norm_eps=1e-6,
                               tie_word_embeddings=False, use_sliding_window=False, sliding_window=32768,
                               max_window_layers=21), (14.3, 2.7)),
    "qwen2-57b-a14b": (dict(architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=3584,
                            intermediate_size=18944, moe_intermediate_size=2560, shared_expert_intermediate_size=20480,
                            num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, vocab_size=151936,
                            num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, decoder_sparse_step=1,
                            max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                            tie_word_embeddings=False, use_sliding_window=False, sliding_window=131072,
                            max_window_layers=28), (57, 14)),
    "qwen3-30b-a3b": (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
                           intermediate_size=6144, moe_intermediate_size=768, num_attention_heads=32,
                           num_key_value_heads=4, head_dim=128, num_hidden_layers=48, vocab_size=151936,
                           num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                           mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
                           rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                           sliding_window=None, max_window_layers=48), (30.5, 3.3)),
    "qwen3-235b-a22b": (dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=4096,
                             intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=64,
                             num_key_value_heads=4, head_dim=128, num_hidden_layers=94, vocab_size=151936,
                             num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                             mlp_only_layers=[], max_position_embeddings=40960, rope_theta=1000000.0,
                             rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
                             sliding_window=None, max_window_layers=94), (235, 22)),
    "mixtral-8x7b": (dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096,
                          intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32,
                          vocab_size=32000, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
                          rope_theta=1000000.0, rms_norm_eps=1e-5, sliding_window=None, tie_word_embeddings=False),
                     (46.7, 12.9)),
    # GLM-4.5 (transformers 4's names; its MTP layer, past num_hidden_layers, is not counted) and
    # GLM-4.5-Air: 355B and 106B in all (their cards count active parameters without the embedding)
    "glm-4.5": (dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=5120,
                     intermediate_size=12288, moe_intermediate_size=1536, num_attention_heads=96, num_key_value_heads=8,
                     head_dim=128, num_hidden_layers=92, vocab_size=151552, n_routed_experts=160, n_shared_experts=1,
                     num_experts_per_tok=8, first_k_dense_replace=3, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=2.5, partial_rotary_factor=0.5, use_qk_norm=True, attention_bias=True,
                     max_position_embeddings=131072, rope_theta=1000000, rms_norm_eps=1e-5, tie_word_embeddings=False,
                     num_nextn_predict_layers=1), (355, None)),
    "glm-4.5-air": (dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=4096,
                         intermediate_size=10944, moe_intermediate_size=1408, num_attention_heads=96,
                         num_key_value_heads=8, head_dim=128, num_hidden_layers=46, vocab_size=151552,
                         n_routed_experts=128, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1,
                         n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, partial_rotary_factor=0.5,
                         use_qk_norm=False, attention_bias=True, max_position_embeddings=131072, rope_theta=1000000,
                         rms_norm_eps=1e-5, tie_word_embeddings=False, num_nextn_predict_layers=1), (106, None)),
}


@pytest.mark.parametrize("name", REAL_MOE_CONFIGS)
def test_real_moe_checkpoint_configs_size_a_simulated_run(tmp_path, name):
    """A simulated run of a Qwen2-MoE, Qwen3-MoE, Mixtral or GLM-4.5 config.json counts the parameters their model
    cards publish (total, and active per token: attention, the router, top-k experts; plus
    embedding and head), within the published figures' rounding."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    config, (total_b, active_b) = REAL_MOE_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tp = 8 if config["num_attention_heads"] % 8 == 0 else 4  # NOTE: Qwen2-57B has 28 heads
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", f"tp={tp}", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    experts = config.get("num_experts") or config.get("num_local_experts") or config["n_routed_experts"]
    # NOTE: Qwen2-MoE's one shared expert, k experts wide, is k shared experts summed
    shared = config.get("shared_expert_intermediate_size", 0) // config.get("moe_intermediate_size", 1)
    assert (sizes.num_experts, sizes.top_k, sizes.num_shared_experts, sizes.shared_expert_gate) == (
        experts, config["num_experts_per_tok"], config.get("n_shared_experts", shared), shared > 0)
    assert sizes.num_dense_layers == config.get("first_k_dense_replace", 0)
    total = (sizes.total_weight_params() + sizes.embedding_params) / 1e9
    active = (sizes.active_params_per_row() + sizes.embedding_params) / 1e9
    # NOTE: the published figures are rounded (22B is 21.5-22.5B): 3% covers their last digit
    assert total == pytest.approx(total_b, rel=0.03), total
    assert active_b is None or active == pytest.approx(active_b, rel=0.03), active
    assert read_checkpoint_config(tmp_path).window is None


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"eos_token_id": "x"}', "generation_config.json: eos_token_id must be a token id or a list of token ids; got 'x'"),
        ('{"eos_token_id": [1, "x"]}', "eos_token_id must be a token id or a list of token ids; got [1, 'x']"),
        ('{"eos_token_id": {"a": 1}}', "eos_token_id must be a token id or a list of token ids; got {'a': 1}"),
        ('{"eos_token_id": true}', "eos_token_id must be a token id or a list of token ids; got True"),
        ("{nope", "generation_config.json is not readable JSON, so its eos_token_id cannot be read"),
        ("[3]", "generation_config.json is not a JSON object, so its eos_token_id cannot be read"),
    ],
)
def test_an_unreadable_eos_token_id_exits_2_naming_the_file(ckpts, tmp_path, text, says):
    """A malformed generation_config.json is refused before any rank starts, not a bare
    int() error in the ranks (exit 1) nor silently ignored (generation would not stop at EOS)."""
    path = _copy(ckpts["llama"], tmp_path / "ckpt")
    (path / "generation_config.json").write_text(text)
    assert says in _problem(path)
    result = cli("model=hf", f"model.path={path}", "pcp=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert result.returncode == 2 and "generation_config.json" in result.stderr + result.stdout


def test_eos_token_ids_are_read_as_transformers_generate_reads_them(ckpts, tmp_path):
    """generation_config.json's when the checkpoint has one — even without an eos_token_id,
    as transformers' ``generation_config`` has none then — else config.json's."""
    from types import SimpleNamespace

    from pcpflow.tokens.text import eos_token_ids

    path = _copy(ckpts["llama"], tmp_path / "ckpt", eos_token_id=7)
    model = SimpleNamespace(name="hf", path=str(path))
    (path / "generation_config.json").write_text('{"eos_token_id": [5, 2, 5]}')
    assert eos_token_ids(model) == [2, 5]
    (path / "generation_config.json").write_text('{"bos_token_id": 0}')
    assert transformers.AutoModelForCausalLM.from_pretrained(path).generation_config.eos_token_id is None
    assert eos_token_ids(model) == []
    (path / "generation_config.json").unlink()
    assert eos_token_ids(model) == [7]



# ------------------------------------------------------------------ Gemma 3
GEMMA3_REFUSED = {
    # name: (config.json changes, what the one problem says)
    "attention soft-capping": ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0 is not supported"),
    "a logit soft-cap of 0": ({"final_logit_softcapping": 0.0}, "final_logit_softcapping: Input should be greater than 0"),
    "bidirectional": ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
    "another activation": ({"hidden_activation": "gelu"}, "hidden_activation: Input should be 'gelu_pytorch_tanh'"),
    "a layer type per layer": ({"layer_types": ["full_attention"]}, "layer_types has 1 entries; num_hidden_layers is 2"),
    "an unknown layer type": ({"layer_types": ["sliding_attention", "chunked_attention"]},
                              "layer_types.1: Input should be 'sliding_attention' or 'full_attention'"),
    "rope_parameters not by layer type": ({"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
                                          "rope_parameters of a Gemma 3 config.json maps each layer type"),
    "a rope factor of the wrong type": ({"rope_parameters": {"full_attention": {"rope_type": "linear", "factor": "8"}}},
                                        "rope_parameters.full_attention.factor: Input should be a valid number"),
}


@pytest.mark.parametrize("case", GEMMA3_REFUSED)
def test_gemma3_features_pcpflow_does_not_run_are_refused_by_name(ckpts, tmp_path, case):
    """Gemma 2's soft-capping, bidirectional attention and
    config.json values transformers' Gemma 3 would not read as pcpflow does: one problem on
    model.path naming the field (exit 2 before any rank starts, as every config problem)."""
    changes, says = GEMMA3_REFUSED[case]
    assert says in _problem(_copy(ckpts["gemma3"], tmp_path / "ckpt", **changes))


def _text_config(path: Path, **changes) -> Path:
    config = json.loads((path / "config.json").read_text())
    config["text_config"].update(changes)
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_multimodal_gemma3_runs_its_language_model(tmp_path):
    """Gemma3ForConditionalGeneration (gemma-3-4b and up; config.json model_type gemma3): its
    text_config and the tensors under language_model., the vision tower and projector left in
    the file (tests/models/test_hf_parity.py holds the tokens to transformers'). Refused by name:
    a text_config of another model, and a logit soft-cap transformers' multimodal class ignores;
    a tensor the language model lacks is still named."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    path = script.build_checkpoint(tmp_path / "mm", "gemma3_mm", tie_word_embeddings=True, sliding_window=7)
    assert any(n.startswith("vision_tower.") for n in _stored(path))  # what is skipped is there
    c = read_checkpoint_config(path)
    assert (type(c).__name__, c.hidden_size, c.window, c.sliding_layers) == ("Gemma3MultimodalCheckpoint", 80, 7, [0])
    assert compose(["model=hf", f"model.path={path}", "pcp=2"]).model.path == str(path)
    by_type = _copy(path, tmp_path / "by_type", architectures=_DELETE)  # model_type gemma3 names it
    assert type(read_checkpoint_config(by_type)).__name__ == "Gemma3MultimodalCheckpoint"
    capped = _text_config(_copy(path, tmp_path / "capped"), final_logit_softcapping=30.0)
    assert "final_logit_softcapping=30.0 is not supported" in _problem(capped)
    other = _text_config(_copy(path, tmp_path / "other"), model_type="llama")
    assert "text_config.model_type must be gemma3_text; got 'llama'" in _problem(other)
    deeper = _text_config(_copy(path, tmp_path / "deeper"), num_hidden_layers=3, layer_types=["sliding_attention"] * 3)
    assert "language_model.model.layers.2.self_attn.q_proj.weight" in _problem(deeper)


def _stored(path: Path) -> list[str]:
    from pcpflow.models.hf import stored_names

    return stored_names(path)


def test_gemma3_layer_types_and_rope_are_read_as_transformers_reads_them(ckpts, tmp_path):
    """Which layers slide and each layer type's RoPE, against transformers' ``Gemma3TextConfig``
    read from the same config.json: ``layer_types``, else every ``sliding_window_pattern``-th
    layer full (hand-worked below); RoPE as transformers 5 writes it (keyed by layer type) and as
    transformers 4 did (``rope_theta`` + ``rope_scaling`` for full layers, ``rope_local_base_freq``
    for sliding ones)."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    S, F = "sliding_attention", "full_attention"
    v4_rope = dict(rope_parameters=_DELETE, rope_theta=500000.0, rope_local_base_freq=20000.0,
                   rope_scaling={"rope_type": "linear", "factor": 4.0})
    variants = {
        "as saved": ({}, [S, F], 72),
        "every 3rd full": (dict(num_hidden_layers=8, layer_types=_DELETE, sliding_window_pattern=3),
                           [S, S, F, S, S, F, S, S], 72),
        "every 6th full, the default": (dict(num_hidden_layers=7, layer_types=_DELETE), [S, S, S, S, S, F, S], 72),
        "no layer slides": (dict(layer_types=[F, F]), [F, F], None),
        "transformers' default window": (dict(sliding_window=_DELETE), [S, F], 4096),
        "transformers 4's rope fields": (v4_rope, [S, F], 72),
        "a scaled sliding rope": (dict(rope_parameters={S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 100.0}}),
                                  [S, F], 72),
    }
    for i, (name, (changes, kinds, window)) in enumerate(variants.items()):
        path = _copy(ckpts["gemma3"], tmp_path / str(i), **{"sliding_window": 72, **changes})
        ours, theirs = read_checkpoint_config(path), transformers.AutoConfig.from_pretrained(path)
        assert ours.kinds == theirs.layer_types == kinds, name
        assert ours.window == window, name
        for kind, (theta, scaling) in {F: (ours.rope_theta, ours.rope_scaling),
                                       S: (ours.local_rope_theta, ours.local_rope_scaling)}.items():
            want = theirs.rope_parameters[kind]
            assert theta == want["rope_theta"], (name, kind)
            assert (scaling and (scaling.rope_type, scaling.factor)) == (
                None if want["rope_type"] == "default" else (want["rope_type"], want["factor"])), (name, kind)


def test_gemma3_window_is_the_last_sliding_window_keys(ckpts, tmp_path):
    """transformers' sliding layers see the last ``sliding_window`` keys, the query's own
    included: with a window of 16 a 16-token prompt's logits are those of an unbounded window,
    a 17-token prompt's are not. pcpflow's attention spec carries that window on the sliding
    layer (``AttentionSpec.window``: ``max(0, p + 1 - window) .. p``), and runs longer requests."""
    ids = torch.tensor([[(7 * i + 3) % 384 for i in range(17)]])

    def last_logits(window: int, n: int) -> torch.Tensor:
        path = _copy(ckpts["gemma3"], tmp_path / f"w{window}-{n}", sliding_window=window)
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        with torch.no_grad():
            return model(ids[:, :n]).logits[0, -1]

    torch.testing.assert_close(last_logits(16, 16), last_logits(4096, 16), rtol=0, atol=1e-12)
    assert float((last_logits(16, 17) - last_logits(4096, 17)).abs().max()) > 1e-3

    from pcpflow.models.hf import HFModel

    path = _copy(ckpts["gemma3"], tmp_path / "sixteen", sliding_window=16)
    cfg = compose(_explicit(path, 40, 5))
    spec = HFModel.from_config(cfg.model, dtype=torch.float32, seed=0, device="meta").attn_spec
    assert (spec.window, spec.window_layers) == (16, (0,))  # layer_types: sliding, then full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
def test_gemma3_embedding_and_norms_round_as_transformers(ckpts, dtype):
    """The embedding scale is sqrt(hidden_size) rounded to the weights' dtype (bf16: sqrt(80) is
    9.0), and the (1 + w) norms scale in float32 before rounding: the same bits as transformers'
    ``Gemma3TextScaledWordEmbedding`` and ``Gemma3RMSNorm`` loaded from the same checkpoint (in
    float64, its norms run under ``float64_compute``: they would downcast to float32). Tied
    embeddings (transformers' default for Gemma 3) give no head of its own."""
    path = ckpts["gemma3"]
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model = build_model(compose(["model=hf", f"model.path={path}", "pcp=1"]).model, dtype=dtype, seed=0)
    assert model.lm_head is None
    ids = torch.arange(0, 384, 7)
    x = 3 * torch.randn(len(ids), 80, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(dtype)
    promoted = float64_compute() if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad():
        assert torch.equal(model.embed(ids), want.model.embed_tokens(ids))
        heads = x[:, :72].unflatten(-1, (3, 24))
        ours = [model.norm(x), model.layers[1].self_attn.k_norm(heads), model.layers[0].attn_out_norm(x),
                model.layers[0].post_attention_norm(x)]
        with promoted:
            layer = want.model.layers[0]
            theirs = [want.model.norm(x), want.model.layers[1].self_attn.k_norm(heads),
                      layer.post_attention_layernorm(x), layer.pre_feedforward_layernorm(x)]
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype == dtype and torch.equal(a, b)


# config.json of gemma-3-270m (transformers 4.55, layer_types) and gemma-3-1b (4.50,
# sliding_window_pattern) as published, with their published parameter counts
GEMMA3_COMMON = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_attention_heads=4,
                     num_key_value_heads=1, head_dim=256, vocab_size=262144, max_position_embeddings=32768,
                     query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                     rope_scaling=None, sliding_window=512, attn_logit_softcapping=None, final_logit_softcapping=None,
                     hidden_activation="gelu_pytorch_tanh", attention_bias=False)
REAL_GEMMA3_CONFIGS = {
    "gemma-3-270m": dict(GEMMA3_COMMON, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                         use_bidirectional_attention=False,
                         layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3),
    "gemma-3-1b": dict(GEMMA3_COMMON, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                       sliding_window_pattern=6, rope_theta=1000000, rope_local_base_freq=10000, eos_token_id=[1, 106]),
}


@pytest.mark.parametrize("name", REAL_GEMMA3_CONFIGS)
def test_real_gemma3_configs_size_a_simulated_run(tmp_path, name):
    """gemma-3-270m's model card counts 268M parameters (170M of them the embedding, 100M the
    transformer blocks), gemma-3-1b's 1.0B: pcpflow's model of each config.json has transformers'
    parameters exactly, the simulated card the card's counts (linear layers and the tied
    embedding, to the published figures' rounding), GQA with one KV head of 256, and the 512-token
    window on its sliding layers in the card of a simulated run past it."""
    from pcpflow.models.card import card_from_hf_config
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    (tmp_path / "config.json").write_text(json.dumps(REAL_GEMMA3_CONFIGS[name]))
    ours = build_uninitialized(lambda: HFModel(read_checkpoint_config(tmp_path)), "meta")
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.parameters())
    card = card_from_hf_config(tmp_path)
    assert (card["attention"], card["num_kv_heads"], card["head_dim"], card["tie_word_embeddings"]) == ("gqa", 1, 256, True)
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[500]"]
    sizes = model_sizes(compose([*sim, "workload.output_lens=[12]"]).model)
    total, embedding = sizes.total_weight_params() + sizes.embedding_params, sizes.embedding_params
    if name == "gemma-3-270m":
        assert count / 1e6 == pytest.approx(268, abs=0.5)  # NOTE: published to the million
        assert total / 1e6 == pytest.approx(268, abs=0.5)  # the norms are 0.06M
        assert (embedding / 1e6, sizes.total_weight_params() / 1e6) == (pytest.approx(170, abs=5), pytest.approx(100, abs=5))
    else:
        assert count / 1e9 == pytest.approx(1.0, abs=0.05) and total / 1e9 == pytest.approx(1.0, abs=0.05)
    card = compose([*sim, "workload.output_lens=[13]"]).model  # 513 tokens: past the window
    assert (card.sliding_window, card.sliding_layers) == (512, 15 if name == "gemma-3-270m" else 22)


# config.json of gemma-3-4b-it, -12b-it and -27b-it as published (transformers 4.50: a text_config
# that writes only what differs from Gemma3TextConfig's defaults; the vision tower's config
# abridged to SigLIP's sizes), with the Gemma 3 technical report's non-embedding parameters
# (Table 1, millions)
GEMMA3_MM_VISION = dict(hidden_size=1152, image_size=896, intermediate_size=4304, model_type="siglip_vision_model",
                        num_attention_heads=16, num_hidden_layers=27, patch_size=14, vision_use_head=False)
GEMMA3_MM_TEXT = dict(model_type="gemma3_text", rope_scaling={"factor": 8.0, "rope_type": "linear"}, sliding_window=1024)
REAL_GEMMA3_MM_CONFIGS = {
    "gemma-3-4b": (dict(GEMMA3_MM_TEXT, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34), 3209),
    "gemma-3-12b": (dict(GEMMA3_MM_TEXT, hidden_size=3840, intermediate_size=15360, num_attention_heads=16,
                         num_hidden_layers=48, num_key_value_heads=8), 10759),
    "gemma-3-27b": (dict(GEMMA3_MM_TEXT, head_dim=128, hidden_size=5376, intermediate_size=21504,
                         num_attention_heads=32, num_hidden_layers=62, num_key_value_heads=16,
                         query_pre_attn_scalar=168), 25600),
}


@pytest.mark.parametrize("name", REAL_GEMMA3_MM_CONFIGS)
def test_real_multimodal_gemma3_configs_size_their_language_model(tmp_path, name):
    """The language model of gemma-3-4b/12b/27b: transformers' own parameter count of it
    (Gemma3ForConditionalGeneration's language_model, tied head), the report's non-embedding
    count to the million, read from text_config with Gemma3TextConfig's defaults (8 heads, 4 KV
    heads, head_dim 256, vocabulary 262,208); its 1024-key window on 5 layers of 6."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    text, non_embedding = REAL_GEMMA3_MM_CONFIGS[name]
    raw = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=text,
               vision_config=GEMMA3_MM_VISION, mm_tokens_per_image=256, image_token_index=262144,
               boi_token_index=255999, eoi_token_index=256000, eos_token_id=[1, 106])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = read_checkpoint_config(tmp_path)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    with torch.device("meta"):
        theirs = transformers.Gemma3ForConditionalGeneration(transformers.AutoConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.model.language_model.parameters())
    embedding = ours.embed_tokens.weight.numel()
    assert (count - embedding) / 1e6 == pytest.approx(non_embedding, abs=0.5)
    assert (c.vocab_size, c.kv_heads, c.window, len(c.sliding_layers)) == (
        262208, text.get("num_key_value_heads", 4), 1024, c.num_hidden_layers - c.num_hidden_layers // 6)
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[1000]", "workload.output_lens=[8]"]
    sizes = model_sizes(compose(sim).model)
    assert sizes.total_weight_params() / 1e6 == pytest.approx(non_embedding, rel=0.001)


def test_the_gemma3_27b_card_is_its_config_json_s():
    """``model=gemma3_27b`` is what ``model=hf`` reads from gemma-3-27b-it's config.json (the
    same sizes, window and sliding layers), so a simulated run of either prices the same model."""
    from pcpflow.models.card import ModelCard, card_from_hf_config

    text, _ = REAL_GEMMA3_MM_CONFIGS["gemma-3-27b"]
    raw = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", text_config=text,
               vision_config=GEMMA3_MM_VISION)
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        from_config = ModelCard(**card_from_hf_config(d))
    card = compose(["mode=simulate", "hardware=h200_sxm", "model=gemma3_27b"]).model
    skip = {"name", "source"}
    assert card.model_dump(exclude=skip) == from_config.model_dump(exclude=skip)


# config.json of Qwen2.5-VL-7B-Instruct as published (transformers 4.49: the text model's fields at the
# top, M-RoPE as rope_scaling; the vision tower's config abridged): 8.29B parameters, 0.67B of them
# the vision tower's
QWEN25_VL_7B = dict(architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                    hidden_size=3584, intermediate_size=18944, max_position_embeddings=128000, max_window_layers=28,
                    num_attention_heads=28, num_hidden_layers=28, num_key_value_heads=4, rms_norm_eps=1e-06,
                    rope_theta=1000000.0, sliding_window=32768, tie_word_embeddings=False, use_sliding_window=False,
                    vocab_size=152064, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 24]},
                    vision_config=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                                       out_hidden_size=3584, spatial_merge_size=2, patch_size=14, window_size=112,
                                       fullatt_block_indexes=[7, 15, 23, 31]))


def test_qwen25_vl_reads_its_language_model_from_the_top_level(tmp_path):
    """Qwen2.5-VL's older config.json writes the text model's fields at the top: read as a Qwen2
    text model's (q/k/v biases, no window without use_sliding_window), M-RoPE as plain RoPE at its
    theta (its sections cover a head's 64 frequencies; ones that do not are refused by name), and
    transformers' own parameter count of the language model and head: 7.62B of the published 8.29B."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config

    (tmp_path / "config.json").write_text(json.dumps(QWEN25_VL_7B))
    c = read_checkpoint_config(tmp_path)
    assert (type(c).__name__, c.kv_heads, c.dim, c.rope_theta, c.rope_scaling, c.window) == (
        "Qwen2VLCheckpoint", 4, 128, 1e6, None, None)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    with torch.device("meta"):
        theirs = transformers.Qwen2_5_VLForConditionalGeneration(transformers.AutoConfig.from_pretrained(tmp_path))
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in theirs.model.language_model.parameters()) + theirs.lm_head.weight.numel()
    assert count / 1e9 == pytest.approx(7.62, abs=0.01) and ours.layers[0].self_attn.q_proj.bias is not None
    bad = dict(QWEN25_VL_7B, rope_scaling={"type": "mrope", "mrope_section": [16, 24, 16]})
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="mrope_section must split a head's 64 rotated frequencies"):
        read_checkpoint_config(tmp_path)


# ------------------------------------------------------------------ Qwen3-VL
# config.json of Qwen3-VL-2B, -4B, -8B-Instruct and Qwen3-VL-30B-A3B-Instruct as published (transformers 4.57:
# the language model in text_config, M-RoPE as rope_scaling; the vision tower's config left out: transformers'
# defaults stand in for it, pcpflow never reads it)
QWEN3_VL_TEXT = dict(attention_bias=False, head_dim=128, hidden_act="silu", max_position_embeddings=262144,
                     num_key_value_heads=8, rms_norm_eps=1e-06, rope_theta=5000000, vocab_size=151936,
                     rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"})


def _qwen3_vl(tied: bool, **text) -> dict:
    return dict(architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl", tie_word_embeddings=tied,
                text_config=dict(QWEN3_VL_TEXT, model_type="qwen3_vl_text", tie_word_embeddings=tied, **text))


REAL_QWEN3_VL_CONFIGS = {
    "Qwen3-VL-2B": _qwen3_vl(True, hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16),
    "Qwen3-VL-4B": _qwen3_vl(True, hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32),
    "Qwen3-VL-8B": _qwen3_vl(False, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                             num_attention_heads=32),
    "Qwen3-VL-30B-A3B": dict(
        architectures=["Qwen3VLMoeForConditionalGeneration"], model_type="qwen3_vl_moe", tie_word_embeddings=False,
        text_config=dict(QWEN3_VL_TEXT, model_type="qwen3_vl_moe_text", hidden_size=2048, intermediate_size=6144,
                         num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, decoder_sparse_step=1,
                         mlp_only_layers=[], moe_intermediate_size=768, norm_topk_prob=True, num_experts=128,
                         num_experts_per_tok=8)),
}


@pytest.mark.parametrize("name", REAL_QWEN3_VL_CONFIGS)
def test_real_qwen3_vl_configs_build_transformers_language_model(tmp_path, name):
    """Qwen3-VL's config.json: Qwen3's attention (head_dim 128, GQA, q/k norms), RoPE plain at its theta (the
    M-RoPE keys read as the three equal ids text gives), no window; transformers' own parameter count of the
    language model and head, the head tied to the embedding exactly when the top-level
    ``tie_word_embeddings`` says (2B, 4B); the MoE's routing as ``Qwen3VLMoeTextConfig`` builds it."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config

    config = REAL_QWEN3_VL_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = read_checkpoint_config(tmp_path)
    text = config["text_config"]
    assert (c.kv_heads, c.dim, c.rope_theta, c.rope_scaling, c.window) == (text["num_key_value_heads"], 128, 5e6,
                                                                           None, None)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    with torch.device("meta"):
        theirs = getattr(transformers, config["architectures"][0])(transformers.AutoConfig.from_pretrained(tmp_path))
    lm = theirs.model.language_model
    tied = theirs.lm_head.weight is lm.embed_tokens.weight
    assert tied == c.tie_word_embeddings == config["tie_word_embeddings"]
    count = sum(p.numel() for p in ours.parameters())
    assert count == sum(p.numel() for p in lm.parameters()) + (0 if tied else theirs.lm_head.weight.numel())
    assert ours.layers[0].self_attn.q_norm is not None
    if c.moe is not None:
        m = lm.layers[0].mlp
        assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.norm_topk_prob) == (
            m.gate.num_experts, m.gate.top_k, m.experts.intermediate_dim, True)
        assert (c.moe.first_k_dense_replace, c.moe.moe_layer_freq, c.moe.num_shared_experts) == (0, 1, 0)


def test_qwen3_vl_configs_size_a_simulated_run_by_hand(tmp_path):
    """Linear-layer parameters of Qwen3-VL-8B's and -30B-A3B's language models counted by hand from their
    config.json (the vision tower is not priced): attention 4096x4096 (q), 2 x 4096x1024 (k, v), 4096x4096 (o)
    and an MLP 3 x 4096x12288 on each of 8B's 36 layers, untied (8.19B with the embedding and head, Qwen3-8B's
    size); 30B-A3B's 48 layers of attention 2048x4096, 2 x 2048x512, 4096x2048, a router 2048x128 and 128
    experts 3 x 2048x768, of which 8 a token (30.5B, 3.35B active: Qwen3-30B-A3B's 30.5B / 3.3B)."""
    from pcpflow.simulate.sizes import model_sizes

    def attention(h, heads, kv, d=128):
        return 2 * h * heads * d + 2 * h * kv * d

    embedding = 2 * 151936
    dense = (36 * (attention(4096, 32, 8) + 3 * 4096 * 12288), 36 * (attention(4096, 32, 8) + 3 * 4096 * 12288),
             embedding * 4096)
    expert = 3 * 2048 * 768
    moe = (48 * (attention(2048, 32, 4) + 2048 * 128 + 128 * expert), 48 * (attention(2048, 32, 4) + 2048 * 128
                                                                              + 8 * expert), embedding * 2048)
    for name, (total, active, embed), (total_b, active_b) in (("Qwen3-VL-8B", dense, (8.19, 8.19)),
                                                              ("Qwen3-VL-30B-A3B", moe, (30.53, 3.35))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(REAL_QWEN3_VL_CONFIGS[name]))
        cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path / name}", "tp=4",
                       "pcp=2", "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
        sizes = model_sizes(cfg.model)
        assert (cfg.model.num_kv_heads, cfg.model.head_dim) == (REAL_QWEN3_VL_CONFIGS[name]["text_config"][
            "num_key_value_heads"], 128)
        assert (sizes.total_weight_params(), sizes.active_params_per_row(), sizes.embedding_params) == (
            total, active, embed), name
        assert (total + embed) / 1e9 == pytest.approx(total_b, abs=0.01)
        assert (active + embed) / 1e9 == pytest.approx(active_b, abs=0.01)


def test_qwen3_vl_runs_its_language_model_on_text(tmp_path):
    """Qwen3VLForConditionalGeneration and Qwen3VLMoeForConditionalGeneration: every tensor of the language
    model has its place (``model.language_model.*``, ``lm_head``), the ``model.visual.*`` tower (its DeepStack
    mergers too: visual features only) is left in the file; the MoE's fused experts load as transformers loads
    them whether stored as released (``[E, hidden, 2I]``, ``[E, I, hidden]``) or as transformers 5's
    ``save_pretrained`` writes them (``[E, 2I, hidden]``, ``[E, hidden, I]``); a square one is read as it is
    stored, as transformers reads it. Tokens are held to transformers' in tests/models/test_hf_parity.py."""
    from pcpflow.models.hf import checkpoint_problems
    from pcpflow.models.hf_llama import QWEN3_VL_MOE_EXPERTS
    from pcpflow.models.hf_registry import read_checkpoint_config

    dense = script.build_checkpoint(tmp_path / "dense", "qwen3_vl", tie_word_embeddings=True)
    c = read_checkpoint_config(dense)
    assert (type(c).__name__, c.architecture, c.dim, c.tie_word_embeddings) == (
        "Qwen3VLCheckpoint", "Qwen3ForCausalLM", 24, True)
    assert any(n.startswith("model.visual.deepstack_merger_list.") for n in _stored(dense))
    released = script.build_checkpoint(tmp_path / "released", "qwen3_vl_moe")
    assert _hf_tensors(released)["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 48)
    saved = shutil.copytree(released, tmp_path / "saved")
    script.transpose_fused_experts(saved)  # NOTE: back to the layout save_pretrained wrote
    assert _hf_tensors(saved)["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 48, 64)
    theirs = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(released, dtype=torch.float64)
    experts = theirs.model.language_model.layers[1].mlp.experts
    for path in (dense, released, saved):
        cfg = compose(["model=hf", f"model.path={path}", "pcp=1"])
        assert checkpoint_problems(cfg.model) == [], path
        if path != dense:
            ours = build_model(cfg.model, dtype=torch.float64, seed=0).layers[1].mlp.experts
            assert all(torch.equal(e.gate_up_proj.weight, experts.gate_up_proj[j]) and
                       torch.equal(e.down_proj.weight, experts.down_proj[j]) for j, e in enumerate(ours))
    gate_up = QWEN3_VL_MOE_EXPERTS[0]  # NOTE: 8 experts' gate_up_proj [2I, hidden] each
    assert gate_up.read_as((8, 64, 48), [(48, 64)] * 8) is gate_up
    assert not gate_up.read_as((8, 48, 64), [(48, 64)] * 8).transposed
    assert not gate_up.read_as((8, 64, 64), [(64, 64)] * 8).transposed


def test_qwen3_vl_configs_are_read_as_transformers_reads_them(tmp_path):
    """The top level's ``tie_word_embeddings`` ties the head (transformers' default false where absent; the
    text_config's is not read); the MoE always renormalises its top-k (``norm_topk_prob: false`` too);
    ``use_sliding_window`` is no window (Qwen3-VL's attention has none); RoPE scaling (YaRN) read beside the
    M-RoPE keys. Refused by name: another text_config model type, ``mlp_only_layers``, an ``mrope`` rope type
    (transformers has no such RoPE to build either)."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    dense = script.build_checkpoint(tmp_path / "dense", "qwen3_vl")
    moe = script.build_checkpoint(tmp_path / "moe", "qwen3_vl_moe")
    for name, top, text in (("top-absent", _DELETE, True), ("top", True, False)):
        path = _text_config(_copy(dense, tmp_path / name, tie_word_embeddings=top), tie_word_embeddings=text)
        with torch.device("meta"):
            theirs = transformers.Qwen3VLForConditionalGeneration(transformers.AutoConfig.from_pretrained(path))
        tied = theirs.lm_head.weight is theirs.model.language_model.embed_tokens.weight
        assert read_checkpoint_config(path).tie_word_embeddings == tied == (top is True), name
    unnormed = _text_config(_copy(moe, tmp_path / "unnormed"), norm_topk_prob=False)
    assert read_checkpoint_config(unnormed).moe.norm_topk_prob
    window = _text_config(_copy(dense, tmp_path / "window"), use_sliding_window=True, sliding_window=4)
    assert read_checkpoint_config(window).window is None
    yarn = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128, "rope_theta": 10000.0,
            "mrope_section": [4, 4, 4], "mrope_interleaved": True}
    scaling = read_checkpoint_config(_text_config(_copy(dense, tmp_path / "yarn"), rope_parameters=yarn)).rope_scaling
    assert (scaling.rope_type, scaling.factor, scaling.original_max_position_embeddings) == ("yarn", 2.0, 128)
    other = _text_config(_copy(dense, tmp_path / "other"), model_type="qwen3")
    assert "text_config.model_type must be qwen3_vl_text; got 'qwen3'" in _problem(other)
    only = _text_config(_copy(moe, tmp_path / "only"), mlp_only_layers=[0])
    assert "mlp_only_layers=[0] is not supported; supported: []" in _problem(only)
    mrope = _text_config(_copy(dense, tmp_path / "mrope"), rope_parameters={"type": "mrope", "mrope_section": [4, 4, 4]})
    assert "rope type 'mrope' is not supported" in _problem(mrope)


def test_qwen3_vl_moe_block_is_transformers_bit_for_bit_in_bfloat16(tmp_path):
    """Qwen3-VL-MoE's MoE block in bfloat16, loaded from the same checkpoint: transformers' own outputs bit for
    bit (``Qwen3VLMoeTextTopKRouter``'s renormalised top-k rounded to bfloat16 before they scale the experts:
    ``weights_dtype: model``; scaling by the float32 weights would round a quarter of the outputs otherwise)."""
    path = script.build_checkpoint(tmp_path / "moe", "qwen3_vl_moe")
    theirs = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(path, dtype=torch.bfloat16,
                                                                              experts_implementation="eager")
    mlp = build_model(compose(["model=hf", f"model.path={path}", "pcp=1"]).model, dtype=torch.bfloat16,
                      seed=0).layers[1].mlp
    x = torch.randn(2000, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    with torch.no_grad():
        want = theirs.model.language_model.layers[1].mlp(x[None])[0]
        assert mlp.moe.weights_dtype == "model" and torch.equal(mlp(x), want)
        mlp.moe = mlp.gate.moe = mlp.moe.model_copy(update={"weights_dtype": "scores"})
        assert (mlp(x) != want).float().mean() > 0.1


@pytest.mark.parametrize("sections, dim", [([24, 20, 20], 128), ([4, 4, 4], 24), ([2, 1, 1], 16)])
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_vl_moe"])
def test_qwen3_vl_interleaved_mrope_on_text_is_plain_rope(family, sections, dim):
    """transformers' Qwen3-VL text rotary embedding, run in float64 (``PromoteFloat32``), given the three
    equal position ids a text has: cos and sin are exactly plain RoPE of its inverse frequencies (the
    interleaving takes every frequency from the same ids), and pcpflow's plain RoPE to float64 rounding
    (released sections over head 128, the tiny checkpoints', sections short of the head). Given ids that
    differ, as an image's, the frequencies the sections give H and W (every third from the second, and from
    the third) would differ: what text never sees."""
    from pcpflow.models.common import RotaryEmbedding

    module = getattr(transformers.models, family)
    prefix = "Qwen3VLMoe" if family.endswith("moe") else "Qwen3VL"
    config = getattr(transformers, f"{prefix}TextConfig")(
        hidden_size=4 * dim, num_attention_heads=4, head_dim=dim,
        rope_parameters={"rope_type": "default", "rope_theta": 5e6, "mrope_section": sections, "mrope_interleaved": True})
    positions = torch.cat([torch.arange(300), torch.tensor([4095, 65535, 262143])])
    x = torch.zeros(1, dtype=torch.float64)
    with float64_compute(), torch.no_grad():
        rotary = getattr(getattr(module, f"modeling_{family}"), f"{prefix}TextRotaryEmbedding")(config)
        cos, sin = rotary(x, positions[None, None].expand(3, 1, -1))
        angles = positions.double()[:, None] * rotary.inv_freq
        image_cos, _ = rotary(x, torch.stack([positions, positions + 7, positions + 13])[:, None])
    assert cos.dtype == torch.float64 and cos.shape == (1, len(positions), dim)
    assert torch.equal(cos[0], torch.cat([angles.cos()] * 2, -1)) and torch.equal(sin[0], torch.cat([angles.sin()] * 2, -1))
    our_cos, our_sin = RotaryEmbedding(dim, 5e6).cos_sin(positions, torch.float64)
    torch.testing.assert_close(cos[0, :, : dim // 2], our_cos[:, 0], rtol=0, atol=1e-10)
    torch.testing.assert_close(sin[0, :, : dim // 2], our_sin[:, 0], rtol=0, atol=1e-10)
    j = torch.arange(dim // 2)
    by_image = ((j % 3 == 1) & (j < 3 * sections[1])) | ((j % 3 == 2) & (j < 3 * sections[2]))
    assert torch.equal((image_cos[0, :, : dim // 2] != cos[0, :, : dim // 2]).any(0), by_image)


# config.json of Mistral-Small-3.1-24B-Instruct-2503 as published (its text_config; the Pixtral
# vision tower's config abridged): "24B" parameters, 0.4B of them the vision tower's
MISTRAL_SMALL_31 = dict(
    architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3", image_token_index=10, spatial_merge_size=2,
    multimodal_projector_bias=False, projector_hidden_act="gelu", vision_feature_layer=-1,
    text_config=dict(head_dim=128, hidden_size=5120, intermediate_size=32768, max_position_embeddings=131072,
                     model_type="mistral", num_attention_heads=32, num_hidden_layers=40, num_key_value_heads=8,
                     rms_norm_eps=1e-05, rope_theta=1000000000.0, sliding_window=None, vocab_size=131072),
    vision_config=dict(head_dim=64, hidden_size=1024, image_size=1540, intermediate_size=4096, model_type="pixtral",
                       num_attention_heads=16, num_hidden_layers=24, patch_size=14, rope_theta=10000.0),
)


def test_multimodal_mistral3_runs_its_language_model(tmp_path):
    """Mistral3ForConditionalGeneration (Mistral Small 3.1 / 3.2): a Mistral language model from
    text_config under language_model., the Pixtral tower unread (tokens held to transformers'
    in tests/models/test_hf_parity.py). Mistral Small 3.1's config.json: transformers' parameter
    count of its language model and head (untied: both stored), 23.6B of the published 24B, no
    window (sliding_window null)."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config

    path = script.build_checkpoint(tmp_path / "tiny", "mistral3", sliding_window=7)
    c = read_checkpoint_config(path)
    assert (type(c).__name__, c.architecture, c.window) == ("Mistral3Checkpoint", "MistralForCausalLM", 7)
    assert compose(["model=hf", f"model.path={path}", "pcp=2"]).model.path == str(path)
    other = _text_config(_copy(path, tmp_path / "other"), model_type="qwen2")
    assert "text_config.model_type must be mistral or ministral3; got 'qwen2'" in _problem(other)

    (tmp_path / "small").mkdir()
    (tmp_path / "small" / "config.json").write_text(json.dumps(MISTRAL_SMALL_31))
    c = read_checkpoint_config(tmp_path / "small")
    ours = build_uninitialized(lambda: HFModel(c, tied=False), "meta")
    with torch.device("meta"):
        theirs = transformers.Mistral3ForConditionalGeneration(transformers.AutoConfig.from_pretrained(tmp_path / "small"))
    count = sum(p.numel() for p in ours.parameters())
    want = sum(p.numel() for p in theirs.model.language_model.parameters()) + theirs.lm_head.weight.numel()
    assert count == want and count / 1e9 == pytest.approx(23.57, abs=0.01) and c.window is None


# ------------------------------------------------------------------ Ministral 3
def test_ministral3_is_read_as_transformers_reads_it(tmp_path):
    """Ministral3ForCausalLM and, as Ministral 3 is released, its language model inside
    Mistral3ForConditionalGeneration (text_config model_type ministral3; the head tied as the top level
    says): Mistral's layers with YaRN (mscale 1, mscale_all_dim 0.8) and the query scaling's beta and
    period read from the rope settings; where config.json is silent, Ministral3Config's defaults (its
    rope settings whatever rope_theta says, eps, head_dim, KV heads, no window), as transformers builds them
    (tests/models/test_ministral3.py holds the numbers to transformers', test_hf_parity.py the tokens)."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    causal = script.build_checkpoint(tmp_path / "causal", "ministral3")
    mm = script.build_checkpoint(tmp_path / "mm", "ministral3_mm", tie_word_embeddings=True)
    for path, kind, tied in ((causal, "Ministral3Checkpoint", False), (mm, "Ministral3MultimodalCheckpoint", True)):
        c = read_checkpoint_config(path)
        s = c.rope_scaling
        assert (type(c).__name__, c.architecture, c.tie_word_embeddings, c.window) == (
            kind, "Ministral3ForCausalLM", tied, None)
        assert (s.rope_type, s.factor, s.original_max_position_embeddings, s.mscale, s.mscale_all_dim) == (
            "yarn", 4.0, 32, 1.0, 0.8)
        assert (c.llama_4_scaling_beta, c.llama_4_scaling_length, c.query_scaling.period) == (0.5, 32, 32)
        assert compose(["model=hf", f"model.path={path}", "pcp=2"]).model.path == str(path)

    bare = dict(architectures=["Ministral3ForCausalLM"], model_type="ministral3", vocab_size=64, hidden_size=64,
                intermediate_size=32, num_hidden_layers=1, num_attention_heads=8, rope_theta=5e5)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text(json.dumps(bare))
    c = read_checkpoint_config(tmp_path / "bare")
    theirs = transformers.AutoConfig.from_pretrained(tmp_path / "bare")
    rope = theirs.rope_parameters
    s = c.rope_scaling
    assert (c.rope_theta, s.rope_type, s.factor, s.original_max_position_embeddings, s.beta_fast, s.beta_slow,
            s.mscale, s.mscale_all_dim, c.llama_4_scaling_beta) == (
        rope["rope_theta"], rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"],
        rope["beta_fast"], rope["beta_slow"], rope["mscale"], rope["mscale_all_dim"], rope["llama_4_scaling_beta"])
    assert (c.rms_norm_eps, c.dim, c.kv_heads, c.window, c.tie_word_embeddings, c.max_position_embeddings) == (
        theirs.rms_norm_eps, theirs.head_dim, theirs.num_key_value_heads, theirs.sliding_window,
        theirs.tie_word_embeddings, theirs.max_position_embeddings)
    plain = _copy(tmp_path / "bare", tmp_path / "plain", rope_parameters={
        "rope_type": "default", "rope_theta": 1e4, "llama_4_scaling_beta": 0.0, "original_max_position_embeddings": 8})
    c = read_checkpoint_config(plain)
    assert (c.rope_scaling, c.llama_4_scaling_beta, c.query_scaling) == (None, 0.0, None)  # NOTE: a scale of 1


@pytest.mark.parametrize("rope, says", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, "no llama_4_scaling_beta"),
    ({"rope_type": "default", "llama_4_scaling_beta": 0.1}, "no original_max_position_embeddings"),
    ({"rope_type": "linear", "factor": 2.0, "llama_4_scaling_beta": 0.1}, "no original_max_position_embeddings"),
], ids=["no beta", "default without a length", "linear without a length"])
def test_ministral3_rope_settings_transformers_cannot_run_are_refused(tmp_path, rope, says):
    """A query scaling without its beta or its period is one problem on model.path, naming the missing
    setting; transformers builds such a model and fails in its first forward."""
    config = dict(architectures=["Ministral3ForCausalLM"], model_type="ministral3", vocab_size=64, hidden_size=64,
                  intermediate_size=32, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, rope_parameters={"rope_theta": 1e4, **rope}, pad_token_id=None)
    path = script.build_checkpoint(tmp_path / "tiny", "ministral3", num_layers=1)
    bad = _copy(path, tmp_path / "bad", rope_parameters=config["rope_parameters"])
    assert says in _problem(bad)
    model = transformers.Ministral3ForCausalLM(transformers.Ministral3Config(**config))
    with pytest.raises(TypeError):
        model(torch.tensor([[1, 2, 3]]))


# The text_config sizes of Ministral-3-3B, -8B and -14B-2512 (Base, Instruct and Reasoning share a language
# model; the 3B ties its head) with their rope settings, and Instruct-2512's FP8 quantization_config (the
# Pixtral tower's config abridged as Mistral Small 3.1's)
MINISTRAL3_TEXT = dict(model_type="ministral3", head_dim=128, num_attention_heads=32, num_key_value_heads=8,
                       vocab_size=131072, max_position_embeddings=262144, rms_norm_eps=1e-05, sliding_window=None,
                       rope_parameters=dict(beta_fast=32.0, beta_slow=1.0, factor=16.0, llama_4_scaling_beta=0.1,
                                            mscale=1.0, mscale_all_dim=1.0, original_max_position_embeddings=16384,
                                            rope_theta=1000000.0, rope_type="yarn", type="yarn"))
REAL_MINISTRAL3 = {  # (text_config sizes, tied, the model card's language model in billions)
    "ministral-3-3b": (dict(hidden_size=3072, intermediate_size=9216, num_hidden_layers=26), True, 3.4),
    "ministral-3-8b": (dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=34), False, 8.4),
    "ministral-3-14b": (dict(hidden_size=5120, intermediate_size=16384, num_hidden_layers=40), False, 13.5),
}


@pytest.mark.parametrize("name", REAL_MINISTRAL3)
def test_real_ministral3_configs_size_a_simulated_run_by_hand(tmp_path, name):
    """Per layer q and o (hidden x 32 heads x 128), k and v (hidden x 8 x 128), the MLP's three
    hidden x intermediate and two norms; the embedding (and an untied head) and the final norm: pcpflow's
    model of the config.json, transformers' language model and head, and a simulated run (its linear
    layers and embeddings) all hold that many, the model cards' 3.4B / 8.4B / 13.5B to within 1.2%.
    Instruct-2512's FP8 weights: priced as fp8 in a simulated run, refused in an executed one."""
    from pcpflow.models.card import card_from_hf_config
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    text, tied, card_b = REAL_MINISTRAL3[name]
    h, inner, n = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    linear = n * (2 * h * 32 * 128 + 2 * h * 8 * 128 + 3 * h * inner)
    embeddings = 131072 * h * (1 if tied else 2)
    raw = dict(architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3", image_token_index=10,
               spatial_merge_size=2, text_config={**MINISTRAL3_TEXT, **text}, tie_word_embeddings=tied,
               vision_config=MISTRAL_SMALL_31["vision_config"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    c = read_checkpoint_config(tmp_path)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    with torch.device("meta"):
        theirs = transformers.Mistral3ForConditionalGeneration(transformers.AutoConfig.from_pretrained(tmp_path))
    count = linear + embeddings + (2 * n + 1) * h
    assert sum(p.numel() for p in ours.parameters()) == count
    head = 0 if tied else theirs.lm_head.weight.numel()
    assert sum(p.numel() for p in theirs.model.language_model.parameters()) + head == count
    assert count / 1e9 == pytest.approx(card_b, rel=0.012)
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"]
    sizes = model_sizes(compose(sim).model)
    assert (sizes.total_weight_params(), sizes.embedding_params) == (linear, embeddings)
    assert (c.kv_heads, c.dim, c.window, c.llama_4_scaling_length) == (8, 128, None, 16384)

    (tmp_path / "fp8").mkdir()
    fp8 = dict(raw, quantization_config={"activation_scheme": "static", "quant_method": "fp8"})
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(fp8))
    assert card_from_hf_config(tmp_path / "fp8")["weights_dtype"] == "fp8"
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\) are not supported"):
        read_checkpoint_config(tmp_path / "fp8")


# config.json of gemma-2-2b-it and gemma-2-9b-it as published (transformers 4.42), with their
# published parameter counts (billions: 2.61, 9.24)
GEMMA2_COMMON = dict(architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=256, vocab_size=256000,
                     max_position_embeddings=8192, query_pre_attn_scalar=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                     sliding_window=4096, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                     hidden_activation="gelu_pytorch_tanh", hidden_act="gelu_pytorch_tanh", attention_bias=False)
REAL_GEMMA2_CONFIGS = {
    "gemma-2-2b": (dict(GEMMA2_COMMON, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                        num_attention_heads=8, num_key_value_heads=4), 2.61),
    "gemma-2-9b": (dict(GEMMA2_COMMON, hidden_size=3584, intermediate_size=14336, num_hidden_layers=42,
                        num_attention_heads=16, num_key_value_heads=8), 9.24),
}


@pytest.mark.parametrize("name", REAL_GEMMA2_CONFIGS)
def test_real_gemma2_configs_size_a_simulated_run_and_read_as_transformers(tmp_path, name):
    """Gemma 2's config.json: transformers' own parameter count, the published one to its
    rounding (tied embedding counted once), its even layers sliding as ``Gemma2Config`` lays
    them out (4096 keys, in the card of a simulated run past them), both soft-caps read, no q/k norms."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    config, total_b = REAL_GEMMA2_CONFIGS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    c = read_checkpoint_config(tmp_path)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    theirs_config = transformers.AutoConfig.from_pretrained(tmp_path)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(theirs_config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    assert c.sliding_layers == [i for i, t in enumerate(theirs_config.layer_types) if t == "sliding_attention"]
    assert c.sliding_layers == list(range(0, config["num_hidden_layers"], 2))
    assert (c.attn_spec().softcap, ours.final_logit_softcapping, c.attn_spec().scale) == (50.0, 30.0, 256**-0.5)
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[4000]"]
    sizes = model_sizes(compose([*sim, "workload.output_lens=[96]"]).model)
    assert (sizes.total_weight_params() + sizes.embedding_params) / 1e9 == pytest.approx(total_b, abs=0.01)
    card = compose([*sim, "workload.output_lens=[97]"]).model  # 4097 tokens: past the window
    assert (card.sliding_window, card.sliding_layers) == (4096, config["num_hidden_layers"] // 2)


# ------------------------------------------------------------------ rope
@pytest.mark.parametrize(
    "params",
    [
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 2.0,
            "high_freq_factor": 8.0,
            "original_max_position_embeddings": 8192,
        },
        {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 0.8,
        },
        {
            "rope_type": "yarn",
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 128,
            "truncate": False,
        },
        {
            "rope_type": "yarn",
            "factor": 2.0,
            "original_max_position_embeddings": 64,
            "attention_factor": 1.3,
        },
        {"rope_type": "linear", "factor": 4.0},
    ],
    ids=lambda p: "-".join(f"{v}" for v in p.values()),
)
@pytest.mark.parametrize("dim", [16, 64, 128])
def test_scaled_rope_equals_transformers(params, dim):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = transformers.LlamaConfig(
        hidden_size=dim * 4,
        num_attention_heads=4,
        head_dim=dim,
        max_position_embeddings=16384,
        rope_theta=10000.0,
        rope_scaling=dict(params),
    )
    want_inv_freq, want_factor = ROPE_INIT_FUNCTIONS[params["rope_type"]](config, "cpu")
    scaling = RopeScaling(**params)
    inv_freq, factor = scaled_rope(dim, 10000.0, scaling)
    assert inv_freq.dtype == torch.float64 and inv_freq.shape == want_inv_freq.shape
    # transformers evaluates these in float32
    torch.testing.assert_close(inv_freq, want_inv_freq.double(), rtol=1e-6, atol=0)
    assert factor == pytest.approx(want_factor, rel=1e-12)


# config.json of Mistral-7B-v0.1 as published: a 4096-key window on every layer
MISTRAL_V01 = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096, intermediate_size=14336,
                   num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, vocab_size=32000,
                   max_position_embeddings=32768, rope_theta=10000.0, rms_norm_eps=1e-5, sliding_window=4096,
                   tie_word_embeddings=False)


@pytest.mark.parametrize("name, config, want", [
    # five sliding layers, then a full one (layer_types), 18 layers: 15 slide
    ("gemma-3-270m", REAL_GEMMA3_CONFIGS["gemma-3-270m"], (512, 15)),
    # every sliding_window_pattern-th (6th) layer full: layers 5, 11, 17, 23 of 26, the 22 others slide
    ("gemma-3-1b", REAL_GEMMA3_CONFIGS["gemma-3-1b"], (512, 22)),
    ("gemma-2-2b", REAL_GEMMA2_CONFIGS["gemma-2-2b"][0], (4096, 13)),  # the even layers of 26
    ("mistral-7b-v0.1", MISTRAL_V01, (4096, 32)),  # every layer
    ("mistral-7b-v0.3", dict(MISTRAL_V01, sliding_window=None, vocab_size=32768), (None, 0)),  # none
])
def test_a_checkpoints_sliding_layers_come_to_its_card(tmp_path, name, config, want):
    """A simulated run of a checkpoint prices its sliding layers: the card has its window and
    how many layers slide, as the published layouts give them, and so do the run's sizes."""
    from pcpflow.layouts.slots import Window
    from pcpflow.models.card import card_from_hf_config
    from pcpflow.simulate.sizes import model_sizes

    (tmp_path / "config.json").write_text(json.dumps(config))
    card = card_from_hf_config(tmp_path)
    assert (card["sliding_window"], card["sliding_layers"]) == want
    sizes = model_sizes(compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "pcp=2",
                                 "workload=explicit", "workload.prompt_lens=[300]", "workload.output_lens=[2]"]).model)
    assert (sizes.sliding_window, sizes.sliding_layers, sizes.window) == (*want, Window(want[0]) if want[1] else None)


# ------------------------------------------------------------------ OLMo 2 / 3
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_olmo_norms_round_as_transformers(tmp_path, dtype):
    """OLMo's norms scale in float32 before rounding (``Olmo2RMSNorm``: "main diff with Llama"):
    the same bits as transformers' layer, final and full-width q/k norms loaded from the same
    checkpoint; a Llama-style norm (scale after rounding) differs in bf16."""
    from pcpflow.models.common import RMSNorm

    path = script.build_checkpoint(tmp_path / "olmo2", "olmo2")
    want = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model = build_model(compose(["model=hf", f"model.path={path}", "pcp=1"]).model, dtype=dtype, seed=0)
    x = 3 * torch.randn(17, 64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(dtype)
    layer, theirs = model.layers[1], want.model.layers[1]
    with torch.no_grad():
        pairs = [(model.norm(x), want.model.norm(x)), (layer.attn_out_norm(x), theirs.post_attention_layernorm(x)),
                 (layer.mlp_out_norm(x), theirs.post_feedforward_layernorm(x)),
                 (layer.self_attn.q_norm(x), theirs.self_attn.q_norm(x))]
        llama_style = RMSNorm(64, model.norm.eps).to(dtype)
        llama_style.weight.copy_(model.norm.weight)
        late = llama_style(x)
    for ours, reference in pairs:
        assert ours.dtype == reference.dtype == dtype and torch.equal(ours, reference)
    assert torch.equal(late, pairs[0][1]) == (dtype != torch.bfloat16)


def _sized_as_transformers(path: Path, config: dict):
    """Write ``config`` to ``path``/config.json: (pcpflow's checkpoint config, its model on meta,
    transformers' config) of it, the model's parameters counted and held to transformers' own."""
    from pcpflow.models.common import build_uninitialized
    from pcpflow.models.hf_registry import read_checkpoint_config

    (path / "config.json").write_text(json.dumps(config))
    c = read_checkpoint_config(path)
    ours = build_uninitialized(lambda: HFModel(c), "meta")
    theirs_config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(theirs_config)
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in theirs.parameters())
    return c, ours, theirs_config


# config.json of OLMo-2-1124-7B and OLMo-2-0325-32B as published, with their parameter counts (billions)
OLMO2_COMMON = dict(architectures=["Olmo2ForCausalLM"], model_type="olmo2", attention_bias=False, rms_norm_eps=1e-6,
                    rope_scaling=None, rope_theta=500000, tie_word_embeddings=False, vocab_size=100352)
REAL_OLMO2_CONFIGS = {
    "OLMo-2-1124-7B": (dict(OLMO2_COMMON, hidden_size=4096, intermediate_size=11008, max_position_embeddings=4096,
                            num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=32), 7.30),
    "OLMo-2-0325-32B": (dict(OLMO2_COMMON, hidden_size=5120, intermediate_size=27648, max_position_embeddings=4096,
                             num_attention_heads=40, num_hidden_layers=64, num_key_value_heads=8), 32.23),
}


@pytest.mark.parametrize("name", REAL_OLMO2_CONFIGS)
def test_real_olmo2_configs_size_a_simulated_run_with_its_norm_all_reduces(tmp_path, name):
    """OLMo 2's config.json: transformers' own parameter count (to the published 7.3B / 32.2B),
    and a simulated run at tp=8 issues and prices the q/k norms' all-reduces (two a layer)."""
    from pcpflow.driver.cli import compose_raw
    from pcpflow.driver.job import prepare_job
    from pcpflow.simulate.engine import simulate_run

    config, total_b = REAL_OLMO2_CONFIGS[name]
    _, ours, _ = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(total_b, abs=0.01)
    sim = ["mode=simulate", "hardware=h100_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=1",
           "workload=explicit", "workload.prompt_lens=[2048]", "workload.output_lens=[2]", "output.plots=false",
           f"hydra.run.dir={tmp_path / 'run'}"]
    m = simulate_run(prepare_job(compose_raw(sim)))["metrics"]
    layers = config["num_hidden_layers"]
    assert m["collective_calls"]["tp_qk_norm"] == 2 * layers * m["num_steps"]
    assert m["collective_calls"]["tp_all_reduce"] == 2 * layers * m["num_steps"]
    assert m["simulate"]["breakdown_s"]["tp_qk_norm"]["exposed_s"] > 0


# ------------------------------------------------------------------ Cohere 2
# config.json of c4ai-command-r7b-12-2024 and c4ai-command-a-03-2025 as published, with their
# parameter counts (billions: 8.03, 111)
COHERE2_COMMON = dict(architectures=["Cohere2ForCausalLM"], model_type="cohere2", attention_bias=False,
                      layer_norm_eps=1e-05, logit_scale=0.25, rope_theta=50000, sliding_window=4096,
                      sliding_window_pattern=4, vocab_size=256000)
REAL_COHERE2_CONFIGS = {
    "command-r7b": (dict(COHERE2_COMMON, hidden_size=4096, intermediate_size=14336, max_position_embeddings=132096,
                         num_attention_heads=32, num_hidden_layers=32, num_key_value_heads=8), 8.03),
    "command-a": (dict(COHERE2_COMMON, hidden_size=12288, intermediate_size=36864, max_position_embeddings=131072,
                       num_attention_heads=96, num_hidden_layers=64, num_key_value_heads=8), 111.1),
}


@pytest.mark.parametrize("name", REAL_COHERE2_CONFIGS)
def test_real_cohere2_configs_size_a_simulated_run(tmp_path, name):
    """Cohere 2's config.json: transformers' own parameter count (tied embedding counted once) to
    the published 8.03B / 111B, three layers of four sliding over 4096 keys as ``Cohere2Config``
    lays them out (the card of a simulated run past the window carries them), the full ones NoPE."""
    config, total_b = REAL_COHERE2_CONFIGS[name]
    c, ours, theirs_config = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(total_b, abs=0.05)
    assert c.sliding_layers == [i for i, t in enumerate(theirs_config.layer_types) if t == "sliding_attention"]
    assert [layer.self_attn.rotary is None for layer in ours.layers][:4] == [False, False, False, True]
    assert (ours.logit_scale, ours.lm_head, c.rms_norm_eps) == (0.25, None, 1e-5)
    sim = ["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=2",
           "workload=explicit", "workload.prompt_lens=[8000]", "workload.output_lens=[4]"]
    card = compose(sim).model
    assert (card.sliding_window, card.sliding_layers, card.num_kv_heads) == (4096, 3 * config["num_hidden_layers"] // 4, 8)


# ------------------------------------------------------------------ Seed-OSS, EXAONE 4.0
# config.json of Seed-OSS-36B-Instruct (512K context) and EXAONE-4.0-32B as published, with their
# parameter counts (billions: 36.15, 32.0)
SEED_OSS_36B = dict(architectures=["SeedOssForCausalLM"], model_type="seed_oss", attention_bias=True,
                    attention_out_bias=False, mlp_bias=False, head_dim=128, hidden_size=5120, intermediate_size=27648,
                    max_position_embeddings=524288, num_attention_heads=80, num_hidden_layers=64,
                    num_key_value_heads=8, rms_norm_eps=1e-06, rope_theta=10000000.0, tie_word_embeddings=False,
                    vocab_size=155136)
EXAONE4_32B = dict(architectures=["Exaone4ForCausalLM"], model_type="exaone4", head_dim=128, hidden_size=5120,
                   intermediate_size=27392, max_position_embeddings=131072, num_attention_heads=40, num_hidden_layers=64,
                   num_key_value_heads=8, rms_norm_eps=1e-05, rope_theta=1000000.0, sliding_window=4096,
                   sliding_window_pattern="LLLG", tie_word_embeddings=False, vocab_size=102400,
                   rope_scaling={"factor": 16.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                                 "original_max_position_embeddings": 8192, "rope_type": "llama3"},
                   layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 16)


ERNIE45_03B = dict(architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", head_dim=128, hidden_size=1024,
                   intermediate_size=3072, max_position_embeddings=131072, num_attention_heads=16, num_hidden_layers=18,
                   num_key_value_heads=2, rms_norm_eps=1e-05, rope_theta=500000, use_bias=False,
                   tie_word_embeddings=True, vocab_size=103424)


@pytest.mark.parametrize("config, total_b", [(SEED_OSS_36B, 36.15), (EXAONE4_32B, 32.0), (ERNIE45_03B, 0.36)],
                         ids=["seed-oss-36b", "exaone-4.0-32b", "ernie-4.5-0.3b"])
def test_real_seed_oss_and_exaone4_configs_size_as_published(tmp_path, config, total_b):
    """transformers' own parameter count, to the published 36B / 32B / 0.36B; Seed-OSS's q/k/v
    biases and no o bias; ERNIE's interleaved RoPE; EXAONE's three sliding layers of four, its full
    layers without RoPE."""
    c, ours, theirs_config = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(total_b, rel=0.005)
    attn = ours.layers[3].self_attn
    if config["model_type"] == "ernie4_5":
        assert (attn.rotary.interleaved, attn.q_proj.bias, ours.lm_head) == (True, None, None)
        return
    if config["model_type"] == "seed_oss":
        assert (attn.q_proj.bias is not None, attn.o_proj.bias is None, attn.head_dim) == (True, True, 128)
        return
    assert c.sliding_layers == [i for i, t in enumerate(theirs_config.layer_types) if t == "sliding_attention"]
    assert (c.window, attn.rotary, ours.layers[0].self_attn.rotary is not None) == (4096, None, True)


# config.json of GLM-4-9B-0414 (Glm4ForCausalLM) and GLM-4-9B-chat-hf (GlmForCausalLM), without the fields
# whose transformers defaults pcpflow must know: head_dim (128), partial_rotary_factor (0.5), attention_bias (true)
GLM_9B = dict(hidden_size=4096, intermediate_size=13696, num_attention_heads=32, num_key_value_heads=2,
              num_hidden_layers=40, vocab_size=151552, rms_norm_eps=1e-05, rope_theta=10000.0,
              max_position_embeddings=32768, tie_word_embeddings=False)


@pytest.mark.parametrize("arch, model_type", [("Glm4ForCausalLM", "glm4"), ("GlmForCausalLM", "glm")])
def test_glm_configs_read_transformers_defaults_and_size_as_transformers(tmp_path, arch, model_type):
    """GLM's defaults as transformers': q/k/v biases and none on o, RoPE on adjacent pairs of the first 64 of
    128 dims; GLM-4's two more norms a layer (sandwich). Counted by hand: 40 layers of q/k/v/o (32 query and
    2 kv heads of 128, q/k/v biases), a gate/up/down MLP 13696 wide and 2 norms (GLM-4: 4), a final norm, and
    untied embedding and head (9.40B for GLM-4-9B-0414) -- and held to transformers' own count."""
    c, ours, _ = _sized_as_transformers(tmp_path, dict(GLM_9B, architectures=[arch], model_type=model_type))
    sandwich = arch == "Glm4ForCausalLM"
    h, q, kv = 4096, 32 * 128, 2 * 2 * 128
    layer = h * (q + kv) + (q + kv) + q * h + 3 * h * 13696 + (4 if sandwich else 2) * h
    assert sum(p.numel() for p in ours.parameters()) == 40 * layer + h + 2 * 151552 * h
    attn = ours.layers[0].self_attn
    assert (c.dim, c.rope_dims, attn.rotary.dim, attn.rotary.interleaved) == (128, 64, 64, True)
    assert (attn.q_proj.bias is not None, attn.o_proj.bias, ours.layers[0].mlp.gate_up_proj.bias) == (True, None, None)
    assert isinstance(ours.layers[0].attn_out_norm, torch.nn.Identity) is not sandwich


def _gpt_oss_config(layers: int, experts: int) -> dict:
    """config.json of openai/gpt-oss-120b (36 layers, 128 experts) and gpt-oss-20b (24, 32), as released."""
    return dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", attention_bias=True, head_dim=64, hidden_act="silu",
        hidden_size=2880, intermediate_size=2880, initial_context_length=4096, max_position_embeddings=131072,
        num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=layers, num_local_experts=experts,
        num_experts_per_tok=4, experts_per_token=4, rms_norm_eps=1e-5, sliding_window=128, swiglu_limit=7.0,
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        rope_scaling=dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                          original_max_position_embeddings=4096),
        rope_theta=150000, router_aux_loss_coef=0.9, tie_word_embeddings=False, vocab_size=201088,
        eos_token_id=200002, pad_token_id=199999,
        quantization_config=dict(quant_method="mxfp4", modules_to_not_convert=[
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]),
    )


# OpenAI's gpt-oss model card (2025), table 1: parameters in billions, total and active per token
# (its active count takes the unembedding and not the embedding).
REAL_GPT_OSS = {"gpt-oss-120b": ((36, 128), 116.83, 5.13), "gpt-oss-20b": ((24, 32), 20.91, 3.61)}


@pytest.mark.parametrize("name", REAL_GPT_OSS)
def test_real_gpt_oss_configs_read_and_size_a_simulated_run(tmp_path, name):
    """A released gpt-oss config.json (MXFP4 experts, which an executed run dequantizes) reads as
    transformers' GptOssConfig does: YaRN untruncated, every even layer sliding over 128 keys, 4 of
    its experts per token routed on biased logits with the clamped SwiGLU; and a simulated run counts
    the parameters OpenAI's model card publishes."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    (layers, experts), total_b, active_b = REAL_GPT_OSS[name]
    (tmp_path / "config.json").write_text(json.dumps(_gpt_oss_config(layers, experts)))
    c = read_checkpoint_config(tmp_path)
    assert (c.window, len(c.sliding_layers), c.sliding_layers[:2]) == (128, layers // 2, [0, 2])
    assert (c.rope_theta, c.rope_scaling.rope_type, c.rope_scaling.factor, c.rope_scaling.truncate) == (
        150000, "yarn", 32.0, False)
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.num_shared_experts) == (experts, 4, 2880, 0)
    assert (m.scoring_func, m.router_bias, m.expert_bias, m.activation, m.swiglu_limit) == (
        "topk_softmax", True, True, "swiglu_clamped", 7.0)
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    unembedding = 201088 * 2880
    total = (sizes.total_weight_params() + sizes.embedding_params) / 1e9
    active = (sizes.active_params_per_row() + unembedding) / 1e9
    # NOTE: 1%: the card's figures count biases and sinks (a few million), which the sizes leave out
    assert total == pytest.approx(total_b, rel=0.01), total
    assert active == pytest.approx(active_b, rel=0.01), active
    assert (cfg.model.sliding_window, cfg.model.sliding_layers) == (128, layers // 2)


def test_gpt_oss_quantized_other_than_mxfp4_is_refused(tmp_path):
    """gpt-oss's MXFP4 experts are dequantized at load; any other quantization is refused by name."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    raw = _gpt_oss_config(24, 32)
    raw["quantization_config"] = {"quant_method": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"quantized checkpoints \(fp8\) are not supported"):
        read_checkpoint_config(tmp_path)


# ------------------------------------------------------------------ Llama 4
# Meta's model cards (2025-04): parameters in billions, total and active per token. The totals
# count the vision encoder too (under 1B), which pcpflow, running text alone, does not.
REAL_LLAMA4 = {
    "scout-17b-16e": (LLAMA4_SCOUT, 109, 17),
    "maverick-17b-128e": (LLAMA4_MAVERICK, 400, 17),
}


@pytest.mark.parametrize("name", REAL_LLAMA4)
def test_real_llama4_configs_read_and_size_a_simulated_run(tmp_path, name):
    """A released Llama 4 config.json reads as transformers' Llama4TextConfig does (every fourth
    layer NoPE, the others chunked over 8192 keys; Scout's llama3 RoPE scaling; MoE on every layer
    (Scout) or every other one (Maverick), top-1 with a shared expert, the dense layers'
    intermediate_size_mlp), and a simulated run counts the parameters Meta's model cards publish."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.simulate.sizes import model_sizes

    options, total_b, active_b = REAL_LLAMA4[name]
    (tmp_path / "config.json").write_text(json.dumps(llama4_config(**options)))
    c = read_checkpoint_config(tmp_path)
    nope = [i for i, rope in enumerate(c.rope_layers) if not rope]
    assert nope == list(range(3, 48, 4))
    assert c.chunked_layers == [i for i in range(48) if i not in nope]
    spec = c.attn_spec()
    assert (spec.window, spec.window_kind, spec.num_heads, spec.num_kv_heads, spec.qk_dim) == (8192, "chunked", 40, 8, 128)
    assert c.rope_theta == 500000.0
    if options["rope_scaling"] is None:
        assert c.rope_scaling is None
    else:
        s = c.rope_scaling
        assert (s.rope_type, s.factor, s.low_freq_factor, s.high_freq_factor, s.original_max_position_embeddings) == (
            "llama3", 16.0, 1.0, 1.0, 8192)
    m = c.moe
    assert (m.num_experts, m.top_k, m.intermediate_size, m.num_shared_experts) == (options["experts"], 1, 8192, 1)
    assert (m.scoring_func, m.weights_on, m.router_bias, m.expert_bias) == ("topk_sigmoid", "input", False, False)
    assert (m.first_k_dense_replace, m.moe_layer_freq, c.intermediate_size) == (options["step"] - 1, options["step"], 16384)
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    assert (cfg.model.sliding_window, cfg.model.sliding_layers, cfg.model.window_kind) == (8192, 36, "chunked")
    assert sizes.num_dense_layers == 48 - 48 // options["step"]
    total = (sizes.total_weight_params() + sizes.embedding_params) / 1e9
    active = (sizes.active_params_per_row() + sizes.embedding_params) / 1e9
    # NOTE: 2%: the published figures are rounded, and their totals hold the vision encoder
    assert total == pytest.approx(total_b, rel=0.02), total
    assert active == pytest.approx(active_b, rel=0.02), active


@pytest.fixture(scope="module")
def llama4_ckpt(tmp_path_factory):
    return script.build_checkpoint(tmp_path_factory.mktemp("llama4") / "llama4", "llama4", chunk=16)


def test_llama4_layers_are_read_as_transformers_lays_them_out(llama4_ckpt, tmp_path):
    """The tiny Llama 4 checkpoint's config.json as transformers wrote it: layer 3 NoPE and full,
    layers 0-2 chunked with RoPE; MoE on 1 and 3; the same model when config.json leaves
    ``no_rope_layers``, ``layer_types`` and ``moe_layers`` to their defaults."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    c = read_checkpoint_config(llama4_ckpt)
    assert (c.rope_layers, c.chunked_layers, c.window) == ([True, True, True, False], [0, 1, 2], 16)
    assert (c.moe.first_k_dense_replace, c.moe.moe_layer_freq) == (1, 2)
    bare = _copy(llama4_ckpt, tmp_path / "bare", no_rope_layers=_DELETE, layer_types=_DELETE, moe_layers=_DELETE)
    b = read_checkpoint_config(bare)
    assert (b.rope_layers, b.kinds, b.moe) == (c.rope_layers, c.kinds, c.moe)
    unchunked = _copy(llama4_ckpt, tmp_path / "unchunked", layer_types=_DELETE, attention_chunk_size=None)
    assert read_checkpoint_config(unchunked).window is None


def test_unsupported_llama4_configs_are_named(llama4_ckpt, tmp_path):
    """A Llama 4 config.json pcpflow would not run as transformers does is refused naming the field."""
    uneven = _copy(llama4_ckpt, tmp_path / "uneven", moe_layers=[0, 1, 3])
    assert "moe_layers=[0, 1, 3] is not supported" in _problem(uneven)
    dynamic = _copy(llama4_ckpt, tmp_path / "dynamic", rope_parameters={"rope_type": "dynamic", "factor": 2.0})
    assert "rope type 'dynamic' is not supported" in _problem(dynamic)
    short = _copy(llama4_ckpt, tmp_path / "short", no_rope_layers=[1, 1, 0])
    assert "no_rope_layers has 3 entries; num_hidden_layers is 4" in _problem(short)
    chunkless = _copy(llama4_ckpt, tmp_path / "chunkless", attention_chunk_size=None)
    assert "attention_chunk_size is null" in _problem(chunkless)
    vision = {"architectures": ["Llama4ForConditionalGeneration"], "text_config": {"model_type": "llama"}}
    (tmp_path / "mm").mkdir()
    (tmp_path / "mm" / "config.json").write_text(json.dumps(vision))
    assert "text_config.model_type must be llama4_text; got 'llama'" in _problem(tmp_path / "mm")


# ------------------------------------------------------------------ Hunyuan
def _hunyuan_config(path: Path, **changes) -> Path:
    """A Hunyuan config.json alone (what is read before any tensor): the tiny dense model's fields."""
    raw = dict(architectures=["HunYuanDenseV1ForCausalLM"], model_type="hunyuan_v1_dense", vocab_size=1000,
               hidden_size=64, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
               num_key_value_heads=2, head_dim=24, rope_theta=10000.0,
               rope_scaling={"type": "dynamic", "alpha": 50.0, "factor": 1.0}, tie_word_embeddings=True)
    path.mkdir()
    (path / "config.json").write_text(json.dumps({**raw, **changes}))
    return path


def test_hunyuan_rope_is_read_as_transformers_reads_it(tmp_path):
    """A ``dynamic`` rope with an alpha (or ``ntk_alpha``) is a fixed NTK stretch of the base, whatever
    else it says, in either spelling of the settings; another scaling reads as every family's."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    c = read_checkpoint_config(_hunyuan_config(tmp_path / "alpha"))
    assert (c.rope_alpha, c.rope_scaling, c.rope_base) == (50.0, None, 10000.0 * 50.0 ** (24 / 22))
    v5 = read_checkpoint_config(_hunyuan_config(tmp_path / "v5", rope_scaling=None, rope_theta=None, rope_parameters={
        "rope_type": "ntk_alpha", "alpha": 1000, "rope_theta": 20000.0, "beta_fast": 32, "mscale": 1.0}))
    assert (v5.rope_alpha, v5.rope_theta, v5.rope_scaling) == (1000.0, 20000.0, None)
    linear = read_checkpoint_config(_hunyuan_config(tmp_path / "linear", rope_scaling={"type": "linear", "factor": 4.0}))
    assert (linear.rope_alpha, linear.rope_scaling.rope_type, linear.rope_base) == (None, "linear", 10000.0)


@pytest.mark.parametrize("changes, says", [
    (dict(rope_scaling={"type": "dynamic", "factor": 2.0}),
     "rope_scaling of type 'dynamic' without an alpha is not supported (dynamic NTK"),
    (dict(rope_scaling={"type": "dynamic", "alpha": "1000"}), "rope_scaling.alpha must be a positive number; got '1000'"),
    (dict(rope_scaling={"type": "yarn_hunyuan", "factor": 2.0}), "rope type 'yarn_hunyuan' is not supported"),
    (dict(architectures=["HunYuanMoEV1ForCausalLM"], num_experts=8, moe_topk=[2, 3, 2]),
     "moe_topk=[2, 3, 2] is not supported; supported: the same top-k on every layer"),
    (dict(architectures=["HunYuanMoEV1ForCausalLM"], num_experts=8, moe_topk=[2, 2]),
     "moe_topk must give each of the 3 layers its experts per token; got [2, 2]"),
    (dict(architectures=["HunYuanMoEV1ForCausalLM"], num_experts=[8, 8, 8], moe_topk=2),
     "num_experts must be one number of experts for every layer"),
    (dict(architectures=["HunYuanMoEV1ForCausalLM"], num_experts=8, moe_topk=9), "moe.top_k=9: must be <= num_experts (8)"),
], ids=["dynamic-ntk", "alpha-string", "unknown-type", "topk-by-layer", "topk-short", "experts-by-layer", "topk-past"])
def test_hunyuan_configs_pcpflow_does_not_run_are_named(tmp_path, changes, says):
    assert says in _problem(_hunyuan_config(tmp_path / "c", **changes))


def test_hunyuan_configs_size_a_simulated_run_by_hand(tmp_path):
    """Linear-layer parameters counted by hand from the config (tied: one embedding matrix), the same
    as transformers' own model of it holds: attention 64x96 (q), 2 x 64x48 (k, v), 96x64 (o); the dense
    MLP 3 x 64x80; the MoE router 64x8, 8 routed experts and one shared, each 3 x 64x80."""
    from pcpflow.models.card import ModelCard, card_from_hf_config
    from pcpflow.simulate.sizes import model_sizes

    attention, mlp, embedding = 64 * 96 + 2 * 64 * 48 + 96 * 64, 3 * 64 * 80, 1000 * 64
    cases = {"dense": ({}, 3 * (attention + mlp)),
             "moe": (dict(architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", num_experts=8,
                          moe_topk=[2] * 3), 3 * (attention + 64 * 8 + 9 * mlp))}
    for name, (changes, layers) in cases.items():
        path = _hunyuan_config(tmp_path / name, **changes)
        card = ModelCard(**card_from_hf_config(path))
        sizes = model_sizes(card)
        assert (card.num_kv_heads, card.head_dim, card.tie_word_embeddings) == (2, 24, True)
        assert (sizes.total_weight_params(), sizes.embedding_params) == (layers, embedding), name
        _sized_as_transformers(path, json.loads((path / "config.json").read_text()))


# The size fields of Hunyuan-A13B-Instruct's config.json (64 experts, 8 of them and a shared one per
# token, tied embeddings); its model card: 80B parameters, 13B active.
HUNYUAN_A13B = dict(architectures=["HunYuanMoEV1ForCausalLM"], model_type="hunyuan_v1_moe", hidden_size=4096,
                    intermediate_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                    head_dim=128, vocab_size=128167, num_experts=64, moe_topk=[8] * 32, num_shared_expert=[1] * 32,
                    moe_intermediate_size=[3072] * 32, tie_word_embeddings=True, rope_theta=10000.0,
                    rope_scaling={"alpha": 1000.0, "beta_fast": 32, "beta_slow": 1, "factor": 1.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0, "type": "dynamic"})


def test_hunyuan_a13b_config_sizes_as_its_model_card(tmp_path):
    from pcpflow.simulate.sizes import model_sizes

    c, _, _ = _sized_as_transformers(tmp_path, HUNYUAN_A13B)
    assert (c.moe.num_experts, c.moe.top_k, c.moe.num_shared_experts, c.rope_alpha) == (64, 8, 1, 1000.0)
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[32768]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    total = (sizes.total_weight_params() + sizes.embedding_params) / 1e9
    active = (sizes.active_params_per_row() + sizes.embedding_params) / 1e9
    # NOTE: the card's figures are rounded to the billion
    assert total == pytest.approx(80, rel=0.03), total
    assert active == pytest.approx(13, rel=0.03), active
# ------------------------------------------------------------------ Granite MoE, Granite 4.0
# config.json of granite-3.1-1b-a400m-instruct and granite-3.1-3b-a800m-instruct: the fields that size them
# (their multipliers, which size nothing, left out); hand-made Granite 4.0 hybrids with attention layers only
GRANITE_MOE_COMMON = dict(architectures=["GraniteMoeForCausalLM"], model_type="granitemoe", intermediate_size=512,
                          num_key_value_heads=8, num_experts_per_tok=8, vocab_size=49155, max_position_embeddings=131072,
                          rope_theta=10000000.0, tie_word_embeddings=True)
GRANITE4_COMMON = dict(architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", hidden_size=1536,
                       num_attention_heads=12, num_key_value_heads=4, num_hidden_layers=6, vocab_size=100352,
                       layer_types=["attention"] * 6, position_embedding_type="rope", tie_word_embeddings=True)
GRANITE_CONFIGS = {
    "granite-3.1-1b-a400m": dict(GRANITE_MOE_COMMON, hidden_size=1024, num_attention_heads=16, num_hidden_layers=24,
                                 num_local_experts=32),
    "granite-3.1-3b-a800m": dict(GRANITE_MOE_COMMON, hidden_size=1536, num_attention_heads=24, num_hidden_layers=32,
                                 num_local_experts=40),
    # experts 512 wide and a shared MLP of two experts' width
    "granite4-moe": dict(GRANITE4_COMMON, intermediate_size=512, shared_intermediate_size=1024, num_local_experts=64,
                         num_experts_per_tok=6),
    # no experts: the shared MLP (4096 wide) is each layer's MLP, whatever intermediate_size says
    "granite4-dense": dict(GRANITE4_COMMON, intermediate_size=512, shared_intermediate_size=4096, num_local_experts=0,
                           tie_word_embeddings=False),
}


def _granite_counts(c: dict) -> tuple[int, int]:
    """(linear parameters of all layers, those one token meets) of a Granite config.json, by hand:
    q/k/v/o, the router, each expert's gate/up/down, the shared MLP's."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"]
    d = h // heads
    attention = 2 * h * heads * d + 2 * h * kv * d
    experts, k = c["num_local_experts"], c["num_experts_per_tok"] if c["num_local_experts"] else 0
    expert, shared = 3 * h * c["intermediate_size"], 3 * h * c.get("shared_intermediate_size", 0)
    total = attention + experts * (expert + h) + shared
    active = attention + k * expert + experts * h + shared
    return c["num_hidden_layers"] * total, c["num_hidden_layers"] * active


@pytest.mark.parametrize("name", GRANITE_CONFIGS)
def test_granite_moe_and_granite4_configs_size_a_simulated_run(tmp_path, name):
    """pcpflow's model of each config has transformers' own parameter count; a simulated run counts
    the linear layers' parameters as derived by hand from config.json (all, and those a token meets:
    top-k experts, the router and the shared MLP), its embedding once when tied."""
    from pcpflow.simulate.sizes import model_sizes

    config = GRANITE_CONFIGS[name]
    _, ours, _ = _sized_as_transformers(tmp_path, config)
    cfg = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=4", "pcp=2",
                   "workload=explicit", "workload.prompt_lens=[8192]", "workload.output_lens=[2]"])
    sizes = model_sizes(cfg.model)
    total, active = _granite_counts(config)
    h, layers = config["hidden_size"], config["num_hidden_layers"]
    embedding = config["vocab_size"] * h * (1 if config["tie_word_embeddings"] else 2)
    assert (sizes.total_weight_params(), sizes.active_params_per_row(), sizes.embedding_params) == (total, active, embedding)
    norms = (2 * layers + 1) * h
    assert sum(p.numel() for p in ours.parameters()) == total + embedding + norms
    experts = config["num_local_experts"]
    assert (sizes.num_experts, sizes.num_dense_layers) == (experts, 0 if experts else layers)


def _granite4(tmp_path: Path, name: str, **changes) -> Path:
    """A tiny Granite 4.0 hybrid checkpoint (attention layers only) with ``changes`` to its config.json."""
    src = tmp_path / "granite4"
    if not src.exists():
        script.build_checkpoint(src, "granite4")
    return _copy(src, tmp_path / name, **changes)


@pytest.mark.parametrize("mode", ["execute", "simulate"])
def test_granite4_mamba_layers_are_refused_naming_them(tmp_path, mode):
    """A hybrid config.json whose layer_types name Mamba2 layers (either spelling), or none (transformers
    then makes every layer Mamba), is one problem on model.path that names the field, the layers and why,
    in an executed and a simulated run alike."""
    extra = ["mode=simulate", "hardware=h200_sxm"] if mode == "simulate" else ["pcp=1"]

    def problem(path: Path) -> str:
        with pytest.raises(ConfigError) as exc:
            compose(["model=hf", f"model.path={path}", *extra])
        (p,) = exc.value.problems
        assert p.field == "model.path"
        return p.allowed

    for name, kinds in (("legacy", ["mamba", "attention"]), ("v5", ["linear_attention", "full_attention"])):
        says = problem(_granite4(tmp_path, name, layer_types=kinds))
        assert "layer_types names 1 of 2 layers mamba (layers 0): Mamba2 state-space layers" in says, says
        assert "supported: every layer attention" in says
    says = problem(_granite4(tmp_path, "absent", layer_types=_DELETE))
    assert "layer_types is required: without it transformers' GraniteMoeHybridConfig makes all 2 layers Mamba2" in says
    says = problem(_granite4(tmp_path, "unknown", layer_types=["attention", "sliding_attention"]))
    assert "layer_types: unknown layer type(s) ['sliding_attention']" in says
    assert "layer_types has 3 entries; num_hidden_layers is 2" in problem(
        _granite4(tmp_path, "long", layer_types=["attention"] * 3))


def test_granite_configs_are_read_as_transformers_reads_them(tmp_path):
    """``layers_block_type`` is ``layer_types`` (GraniteMoeHybridConfig's attribute_map); the hybrid ropes
    only with ``position_embedding_type: rope`` (``nope`` or absent: no rotary embedding, as
    transformers builds it), GraniteMoe always; a shared MLP that is not a whole number of experts,
    GraniteMoe without experts and an unknown position embedding are refused, naming the field."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    alias = _granite4(tmp_path, "alias", layer_types=_DELETE, layers_block_type=["attention", "attention"])
    assert read_checkpoint_config(alias).layer_types == ["attention", "attention"]
    for kind, ropes in (("rope", True), ("nope", False), (_DELETE, False)):
        path = _granite4(tmp_path, f"pe-{kind if isinstance(kind, str) else 'absent'}", position_embedding_type=kind)
        theirs = transformers.GraniteMoeHybridForCausalLM(transformers.AutoConfig.from_pretrained(path))
        assert (theirs.model.rotary_emb is not None) == ropes
        assert read_checkpoint_config(path).rope_layers == [ropes, ropes]
        assert all((layer.self_attn.rotary is not None) == ropes for layer in HFModel(read_checkpoint_config(path)).layers)
    assert "position_embedding_type: Input should be 'rope' or 'nope'" in _problem(
        _granite4(tmp_path, "alibi", position_embedding_type="alibi"))
    assert ("shared_intermediate_size=48 is not supported; supported: a multiple of intermediate_size (32), or 0 "
            "(none)") in _problem(_granite4(tmp_path, "shared48", shared_intermediate_size=48))
    plain = _granite4(tmp_path, "plain", architectures=["GraniteMoeForCausalLM"], model_type="granitemoe",
                      num_local_experts=0)
    assert "num_local_experts must be a positive integer (every GraniteMoeForCausalLM layer is MoE); got 0" in _problem(plain)
    ignored = _granite4(tmp_path, "moe-nope", architectures=["GraniteMoeForCausalLM"], model_type="granitemoe",
                        position_embedding_type="nope", shared_intermediate_size=0)
    assert read_checkpoint_config(ignored).rope_layers == [True, True]  # NOTE: GraniteMoe ignores the field


# ------------------------------------------------------------------ OLMoE
# The size fields of OLMoE-1B-7B-0924's config.json (and -0125's, and their -Instruct's: the same
# architecture); AllenAI's card and paper: 6.9B parameters in all, 1.3B active per token (embedding and
# head included; "1B" without them).
OLMOE_1B_7B = dict(architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048, intermediate_size=1024,
                   num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, vocab_size=50304,
                   num_experts=64, num_experts_per_tok=8, norm_topk_prob=False, clip_qkv=None, attention_bias=False,
                   rms_norm_eps=1e-5, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=4096,
                   tie_word_embeddings=False)


def test_olmoe_1b_7b_config_sizes_as_counted_by_hand(tmp_path):
    """Counted from config.json alone: per layer q/k/v/o 4 x 2048^2, the router 64 x 2048 and 64 experts
    of 3 x 2048 x 1024 (8 of them a token's); q/k norms 2 x 2048 and two layer norms; the embedding and
    an untied head 50304 x 2048 each. pcpflow's model and transformers' both hold that many parameters,
    a simulated run counts the linear ones (all, and those a token meets), which come to the published
    6.9B / 1.3B; at tp=8 it issues and prices the full-width q/k norms' all-reduces (two a layer)."""
    from pcpflow.driver.cli import compose_raw
    from pcpflow.driver.job import prepare_job
    from pcpflow.simulate.engine import simulate_run
    from pcpflow.simulate.sizes import model_sizes

    h, i, layers, experts, k, vocab = 2048, 1024, 16, 64, 8, 50304
    attention, router, expert = 4 * h * h, experts * h, 3 * h * i
    total, active = layers * (attention + router + experts * expert), layers * (attention + router + k * expert)
    embedding, norms = 2 * vocab * h, layers * 4 * h + h
    c, ours, _ = _sized_as_transformers(tmp_path, OLMOE_1B_7B)
    assert sum(p.numel() for p in ours.parameters()) == total + embedding + norms == 6_919_161_856
    assert (c.moe.num_experts, c.moe.top_k, c.moe.intermediate_size, c.moe.norm_topk_prob) == (64, 8, 1024, False)
    sim = ["mode=simulate", "hardware=h100_sxm", "model=hf", f"model.path={tmp_path}", "tp=8", "pcp=1",
           "workload=explicit", "workload.prompt_lens=[2048]", "workload.output_lens=[2]", "output.plots=false",
           f"hydra.run.dir={tmp_path / 'run'}"]
    sizes = model_sizes(compose(sim).model)
    assert (sizes.total_weight_params(), sizes.active_params_per_row(), sizes.embedding_params) == (
        total, active, embedding)
    assert (sizes.num_experts, sizes.top_k, sizes.num_shared_experts, sizes.num_dense_layers) == (64, 8, 0, 0)
    # NOTE: the published figures are rounded to the tenth of a billion
    assert (total + embedding) / 1e9 == pytest.approx(6.9, abs=0.05)
    assert (active + embedding) / 1e9 == pytest.approx(1.3, abs=0.05) and active / 1e9 == pytest.approx(1.0, abs=0.1)
    m = simulate_run(prepare_job(compose_raw(sim)))["metrics"]
    assert m["collective_calls"]["tp_qk_norm"] == 2 * layers * m["num_steps"]


@pytest.mark.parametrize("changes, says", [
    (dict(head_dim=8), "head_dim=8 is not supported; supported: hidden_size / num_attention_heads (16)"),
    (dict(clip_qkv=0), "clip_qkv: Input should be greater than 0"),
    (dict(num_experts=8, num_experts_per_tok=9), "moe.top_k=9: must be <= num_experts (8)"),
    (dict(num_experts="8"), "num_experts must be an integer; got '8'"),
], ids=["head-dim", "clip-zero", "top-k", "experts-string"])
def test_olmoe_configs_pcpflow_does_not_run_are_named(tmp_path, changes, says):
    path = script.build_checkpoint(tmp_path / "olmoe", "olmoe")
    assert says in _problem(_copy(path, tmp_path / "changed", **changes))


def test_olmoe_configs_are_read_as_transformers_reads_them(tmp_path):
    """``num_local_experts`` is ``num_experts`` (OlmoeConfig's attribute_map); omitted, the MoE fields are
    OlmoeConfig's (64 experts, top-8, not renormalised); ``clip_qkv`` reaches every layer's attention;
    ``head_dim`` equal to hidden / heads is accepted; ``model_type`` alone names the architecture."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    src = script.build_checkpoint(tmp_path / "olmoe", "olmoe")
    alias = _copy(src, tmp_path / "alias", num_experts=_DELETE, num_local_experts=4)
    assert read_checkpoint_config(alias).moe.num_experts == transformers.AutoConfig.from_pretrained(alias).num_experts == 4
    omitted = _copy(src, tmp_path / "omitted", num_experts=_DELETE, num_experts_per_tok=_DELETE,
                    norm_topk_prob=_DELETE)
    theirs = transformers.AutoConfig.from_pretrained(omitted)
    moe = read_checkpoint_config(omitted).moe
    assert (moe.num_experts, moe.top_k, moe.norm_topk_prob) == (
        theirs.num_experts, theirs.num_experts_per_tok, theirs.norm_topk_prob) == (64, 8, False)
    c = read_checkpoint_config(_copy(src, tmp_path / "typed", architectures=_DELETE, head_dim=16))
    assert (c.architecture, c.clip_qkv, c.dim) == ("OlmoeForCausalLM", 1.5, 16)
    assert all(layer.self_attn.clip_qkv == 1.5 for layer in HFModel(c).layers)


ERNIE45_MOE = dict(architectures=["Ernie4_5_MoeForCausalLM"], model_type="ernie4_5_moe")


def _ernie_defaults() -> dict:
    """The config.json ``save_pretrained`` writes of ``Ernie4_5_MoeConfig()`` (transformers documents its
    defaults as ERNIE-4.5-21B-A3B's: 28 layers, 64 experts, top-6, two shared experts, tied)."""
    return {**transformers.Ernie4_5_MoeConfig().to_dict(), **ERNIE45_MOE}


@pytest.mark.slow
def test_ernie4_5_moe_defaults_size_as_transformers_and_21b(tmp_path):
    """transformers' defaults: its parameter count (about 21B), its MoE layers (1 to 27, the
    ``Ernie4_5_MoeSparseMoeBlock`` ones), top-6 of 64 chosen with the selection bias, two shared experts."""
    c, ours, theirs_config = _sized_as_transformers(tmp_path, _ernie_defaults())
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(theirs_config)
    sparse = [i for i, layer in enumerate(theirs.model.layers) if hasattr(layer.mlp, "gate")]
    assert [i for i, layer in enumerate(ours.layers) if hasattr(layer.mlp, "gate")] == sparse == list(range(1, 28))
    moe = c.moe
    assert (moe.num_experts, moe.top_k, moe.num_shared_experts, moe.intermediate_size) == (64, 6, 2, 1536)
    assert (moe.scoring_func, moe.selection_bias, moe.norm_min, moe.weights_dtype) == ("softmax", True, 1e-12, "model")
    assert (c.tie_word_embeddings, ours.layers[1].self_attn.rotary.interleaved) == (True, True)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(21.8, rel=0.02)


@pytest.mark.parametrize("start, end, interval", [(2, -1, 2), (0, 5, 3), (7, -1, 1)])
def test_ernie4_5_moe_layers_are_transformers(tmp_path, start, end, interval):
    """The MoE layers ``moe_layer_start_index`` / ``_end_index`` / ``_interval`` give: transformers' (layer
    i sparse when ``(i + 1) % interval == 0`` and ``start <= i <= end``); none at all: a dense model."""
    from pcpflow.models.hf_registry import read_checkpoint_config

    raw = dict(ERNIE45_MOE, num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
               num_key_value_heads=2, head_dim=16, vocab_size=96, moe_num_experts=4, moe_k=2, moe_intermediate_size=32,
               moe_layer_start_index=start, moe_layer_end_index=end, moe_layer_interval=interval)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    theirs = transformers.AutoConfig.from_pretrained(tmp_path)
    want = [i for i in range(6) if (i + 1) % interval == 0 and theirs.moe_layer_start_index <= i <= theirs.moe_layer_end_index]
    from pcpflow.models.moe import moe_layers

    assert moe_layers(read_checkpoint_config(tmp_path).moe, 6) == want


@pytest.mark.parametrize("changes, says", [
    (dict(use_bias=True), "use_bias=True is not supported for Ernie4_5_MoeForCausalLM; supported: false"),
    (dict(moe_layer_end_index=3), "moe_layer_end_index=3 is not supported; supported: -1 or one at or past the last "
                                  "MoE layer (5)"),
    (dict(moe_k=9), "moe.top_k=9: must be <= num_experts (8)"),
], ids=["use-bias", "end-early", "top-k"])
def test_ernie4_5_moe_configs_pcpflow_does_not_run_are_named(tmp_path, changes, says):
    raw = {**ERNIE45_MOE, **dict(num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=16, vocab_size=96, moe_num_experts=8, moe_k=2,
                                 moe_intermediate_size=32), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert says in _problem(tmp_path)


# ------------------------------------------------------------------ Gemma 1
# config.json of gemma-2b-it and gemma-7b-it as published (their fields that size and shape the
# model), with the parameter counts of their model cards (billions: 2.51 and 8.54)
GEMMA_COMMON = dict(architectures=["GemmaForCausalLM"], model_type="gemma", head_dim=256, hidden_act="gelu",
                    max_position_embeddings=8192, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=256000,
                    attention_bias=False)
REAL_GEMMA_CONFIGS = {
    "gemma-2b-it": (dict(GEMMA_COMMON, hidden_size=2048, intermediate_size=16384, num_attention_heads=8,
                         num_hidden_layers=18, num_key_value_heads=1), 2.51),
    "gemma-7b-it": (dict(GEMMA_COMMON, hidden_size=3072, intermediate_size=24576, num_attention_heads=16,
                         num_hidden_layers=28, num_key_value_heads=16), 8.54),
}


@pytest.mark.parametrize("name", REAL_GEMMA_CONFIGS)
def test_real_gemma1_configs_read_as_transformers_reads_them(tmp_path, name):
    """Gemma 1's published config.json: transformers' own parameter count (the cards' 2.51B /
    8.54B), every layer full attention, the softmax scale head_dim ** -0.5 (256: 1/16, not
    hidden/heads' 2048/8), tied embeddings, the released "gelu" run as the tanh approximation
    (transformers' reading: exact GELU would change every logit: tests/models/test_hf_parity.py)."""
    config, params = REAL_GEMMA_CONFIGS[name]
    c, ours, theirs = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(params, abs=0.005)
    assert theirs.hidden_act == "gelu_pytorch_tanh"
    spec = c.attn_spec()
    assert (spec.scale, spec.window, spec.softcap) == (1 / 16, None, None)
    assert c.tie_word_embeddings and len(c.kinds) == config["num_hidden_layers"]


@pytest.mark.parametrize("changes, says", [
    ({"hidden_act": "relu"}, "hidden_act: Input should be 'gelu' or 'gelu_pytorch_tanh'"),
    ({"final_logit_softcapping": 30.0}, "final_logit_softcapping=30.0 is not supported"),
    ({"attn_logit_softcapping": 50.0}, "which transformers' GemmaForCausalLM does not apply"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention=true is not supported"),
])
def test_gemma1_values_transformers_reads_otherwise_are_refused(tmp_path, changes, says):
    (tmp_path / "config.json").write_text(json.dumps(dict(REAL_GEMMA_CONFIGS["gemma-2b-it"][0], **changes)))
    assert says in _problem(tmp_path)


# ------------------------------------------------------------------ Cohere 1
# config.json of aya-expanse-8b and c4ai-command-r-v01 as published (the fields that size and shape
# them), with the parameter counts of their cards (billions: 8.03 and 35)
COHERE_COMMON = dict(architectures=["CohereForCausalLM"], model_type="cohere", vocab_size=256000, layer_norm_eps=1e-5,
                     max_position_embeddings=8192, use_qk_norm=False, tie_word_embeddings=True)
REAL_COHERE_CONFIGS = {
    "aya-expanse-8b": (dict(COHERE_COMMON, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                            num_attention_heads=32, num_key_value_heads=8, logit_scale=0.125, rope_theta=10000), 8.03),
    "c4ai-command-r-v01": (dict(COHERE_COMMON, hidden_size=8192, intermediate_size=22528, num_hidden_layers=40,
                                num_attention_heads=64, num_key_value_heads=64, logit_scale=0.0625,
                                rope_theta=8000000.0), 35.0),
}


@pytest.mark.parametrize("name", REAL_COHERE_CONFIGS)
def test_real_cohere1_configs_read_as_transformers_reads_them(tmp_path, name):
    """Cohere 1's published config.json: transformers' own parameter count (the cards' to their
    rounding), every layer full and rotated, its RoPE base and logit scale read."""
    config, params = REAL_COHERE_CONFIGS[name]
    c, ours, theirs = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(params, rel=0.01)
    assert c.kinds == ["full_attention"] * config["num_hidden_layers"] and c.attn_spec().window is None
    assert (c.rope_theta, c.logit_scale) == (config["rope_theta"], config["logit_scale"])


def test_cohere1_reads_transformers_defaults_and_refuses_qk_norms(tmp_path):
    """Without a RoPE base transformers' CohereConfig rotates with 500,000 (not Llama's 10,000);
    Command R+'s per-head q/k LayerNorms (use_qk_norm) are refused by name."""
    config = {k: v for k, v in REAL_COHERE_CONFIGS["aya-expanse-8b"][0].items() if k != "rope_theta"}
    c, _, theirs = _sized_as_transformers(tmp_path, config)
    assert c.rope_theta == theirs.rope_parameters["rope_theta"] == 500_000.0
    (tmp_path / "config.json").write_text(json.dumps(dict(config, use_qk_norm=True)))
    assert "use_qk_norm=true is not supported" in _problem(tmp_path)


# ------------------------------------------------------------------ LayerNorm families: StarCoder2, Phi, StableLM, Nemotron
# config.json of starcoder2-3b/7b/15b, phi-1_5, phi-2, stablelm-3b-4e1t, stablelm-2-1_6b, Nemotron-Mini-4B-Instruct and
# Minitron-8B-Base as published, with the parameter counts their model cards give (billions)
STARCODER2_COMMON = dict(architectures=["Starcoder2ForCausalLM"], model_type="starcoder2", hidden_act="gelu_pytorch_tanh",
                         max_position_embeddings=16384, norm_epsilon=1e-5, sliding_window=4096, use_bias=True,
                         vocab_size=49152)
PHI_COMMON = dict(architectures=["PhiForCausalLM"], model_type="phi", hidden_act="gelu_new", layer_norm_eps=1e-5,
                  max_position_embeddings=2048, num_attention_heads=32, qk_layernorm=False, rope_theta=10000.0,
                  tie_word_embeddings=False, vocab_size=51200)
STABLELM_COMMON = dict(architectures=["StableLmForCausalLM"], model_type="stablelm", hidden_act="silu", layer_norm_eps=1e-5,
                       max_position_embeddings=4096, num_attention_heads=32, num_key_value_heads=32,
                       partial_rotary_factor=0.25, rope_theta=10000, tie_word_embeddings=False)
NEMOTRON_COMMON = dict(architectures=["NemotronForCausalLM"], model_type="nemotron", attention_bias=False, head_dim=128,
                       hidden_act="relu2", max_position_embeddings=4096, norm_eps=1e-5, num_hidden_layers=32,
                       num_key_value_heads=8, partial_rotary_factor=0.5, rope_theta=10000, tie_word_embeddings=False,
                       vocab_size=256000)
NEOX_COMMON = dict(architectures=["GPTNeoXForCausalLM"], model_type="gpt_neox", hidden_act="gelu", layer_norm_eps=1e-5,
                   max_position_embeddings=2048, rotary_emb_base=10000, rotary_pct=0.25, tie_word_embeddings=False,
                   use_parallel_residual=True)
REAL_LAYERNORM_CONFIGS = {
    "starcoder2-3b": (dict(STARCODER2_COMMON, hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                           num_attention_heads=24, num_key_value_heads=2, rope_theta=999999.4420358813), 3.03),
    "starcoder2-7b": (dict(STARCODER2_COMMON, hidden_size=4608, intermediate_size=18432, num_hidden_layers=32,
                           num_attention_heads=36, num_key_value_heads=4, rope_theta=1000000), 7.17),
    "starcoder2-15b": (dict(STARCODER2_COMMON, hidden_size=6144, intermediate_size=24576, num_hidden_layers=40,
                            num_attention_heads=48, num_key_value_heads=4, rope_theta=100000, tie_word_embeddings=False),
                       15.96),
    "phi-1_5": (dict(PHI_COMMON, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24,
                     partial_rotary_factor=0.5), 1.42),
    "phi-2": (dict(PHI_COMMON, hidden_size=2560, intermediate_size=10240, num_hidden_layers=32, num_key_value_heads=32,
                   partial_rotary_factor=0.4), 2.78),
    "stablelm-3b-4e1t": (dict(STABLELM_COMMON, hidden_size=2560, intermediate_size=6912, num_hidden_layers=32,
                              use_qkv_bias=False, vocab_size=50304), 2.80),
    "stablelm-2-1_6b": (dict(STABLELM_COMMON, hidden_size=2048, intermediate_size=5632, num_hidden_layers=24,
                             use_qkv_bias=True, vocab_size=100352), 1.64),
    "Nemotron-Mini-4B-Instruct": (dict(NEMOTRON_COMMON, hidden_size=3072, intermediate_size=9216,
                                       num_attention_heads=24), 4.19),
    # NOTE: head_dim 128 where hidden / heads is 85.3
    "Minitron-8B-Base": (dict(NEMOTRON_COMMON, hidden_size=4096, intermediate_size=16384, num_attention_heads=48), 8.27),
    "pythia-1.4b": (dict(NEOX_COMMON, hidden_size=2048, intermediate_size=8192, num_attention_heads=16,
                         num_hidden_layers=24, vocab_size=50304), 1.41),
    "pythia-6.9b": (dict(NEOX_COMMON, hidden_size=4096, intermediate_size=16384, num_attention_heads=32,
                         num_hidden_layers=32, vocab_size=50432), 6.86),
    "gpt-neox-20b": (dict(NEOX_COMMON, hidden_act="gelu_fast", hidden_size=6144, intermediate_size=24576,
                          num_attention_heads=64, num_hidden_layers=44, vocab_size=50432), 20.55),
    # NOTE: GPT-2's names; n_inner null: four times n_embd
    "gpt-j-6b": (dict(architectures=["GPTJForCausalLM"], model_type="gptj", activation_function="gelu_new",
                      layer_norm_epsilon=1e-5, n_embd=4096, n_head=16, n_inner=None, n_layer=28, n_positions=2048,
                      rotary_dim=64, tie_word_embeddings=False, vocab_size=50400), 6.05),
}


@pytest.mark.parametrize("name", REAL_LAYERNORM_CONFIGS)
def test_real_layernorm_configs_read_as_transformers_reads_them(tmp_path, name):
    """StarCoder2's, Phi's, StableLM's, Nemotron's, GPT-NeoX's and GPT-J's published config.json: transformers'
    own parameter count
    (the cards' to their rounding), RoPE on transformers' ``rotary_ndims`` of a head, StarCoder2's
    window on every layer; a simulated run of it counts the matrices transformers' model has (two
    a plain MLP, three a gated one), its LayerNorms and MLP kind carried on the card."""
    from pcpflow.simulate.sizes import model_sizes

    config, params = REAL_LAYERNORM_CONFIGS[name]
    c, ours, theirs_config = _sized_as_transformers(tmp_path, config)
    assert sum(p.numel() for p in ours.parameters()) / 1e9 == pytest.approx(params, rel=0.01)
    head = config.get("head_dim") or theirs_config.hidden_size // theirs_config.num_attention_heads
    if hasattr(theirs_config, "rotary_dim"):  # NOTE: GPT-J's own field, no rope_parameters
        rotated = theirs_config.rotary_dim
    else:
        rotated = int(head * theirs_config.rope_parameters.get("partial_rotary_factor", 1.0))
    assert {layer.self_attn.rotary.dim for layer in ours.layers} == {rotated}
    starcoder2 = name.startswith("starcoder2")
    assert c.attn_spec().window == (4096 if starcoder2 else None)
    assert c.sliding_layers == (list(range(theirs_config.num_hidden_layers)) if starcoder2 else [])
    card = compose(["mode=simulate", "hardware=h200_sxm", "model=hf", f"model.path={tmp_path}", "tp=4", "pcp=2",
                    "workload=explicit", "workload.prompt_lens=[8000]", "workload.output_lens=[4]"]).model
    assert (card.gated_mlp, card.layer_norm, card.head_dim) == (name.startswith("stablelm"), True, head)
    sizes = model_sizes(card)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(theirs_config)
    matrices = sum(p.numel() for p in theirs.parameters() if p.dim() == 2)
    assert sizes.total_weight_params() + sizes.embedding_params == matrices


def test_layernorm_families_refuse_what_they_do_not_compute(tmp_path):
    """Per-head q/k LayerNorms (Phi's and StableLM 2 12B's ``qk_layernorm``), an activation
    pcpflow does not have (the supported ones listed) and a GPT-J ``rotary_dim`` that is null or no
    even part of a head are each refused by name."""
    cases = [
        (dict(REAL_LAYERNORM_CONFIGS["phi-2"][0], qk_layernorm=True), "qk_layernorm=true is not supported"),
        (dict(REAL_LAYERNORM_CONFIGS["stablelm-2-1_6b"][0], qk_layernorm=True), "qk_layernorm=true is not supported"),
        (dict(REAL_LAYERNORM_CONFIGS["starcoder2-3b"][0], hidden_act="relu"),
         "hidden_act 'relu' is not supported; supported: gelu_pytorch_tanh, gelu, gelu_new, silu, swish, relu2, gelu_fast"),
        (dict(REAL_LAYERNORM_CONFIGS["gpt-j-6b"][0], rotary_dim=None), "rotary_dim: Input should be a valid integer"),
        (dict(REAL_LAYERNORM_CONFIGS["gpt-j-6b"][0], rotary_dim=65), "RoPE's dims (65 of a head of 256"),
    ]
    for config, message in cases:
        (tmp_path / "config.json").write_text(json.dumps(config))
        (tmp_path / "model.safetensors").write_bytes(b"")
        assert message in _problem(tmp_path), config


def test_layer_kernels_follow_the_mlp_and_norm_kinds():
    """The host's kernel count of a layer is pcpflow's own forward of it: a plain MLP launches one
    kernel fewer than a gated one (no multiply of gate and up; its up is one GEMM as gate_up is),
    and a LayerNorm is one kernel (torch's fused ``native_layer_norm``) where the RMSNorm is several."""
    from pcpflow.simulate.host import _count

    shapes = ("gqa", 256, 4, 2, (64,), 512)
    gated, plain = _count(*shapes, (True, False)), _count(*shapes, (False, False))
    assert gated.total - plain.total == 1 and gated.attention == plain.attention
    layer_norm = _count(*shapes, (True, True))
    assert layer_norm.norm == 1 < gated.norm
    assert gated.total - layer_norm.total == 2 * (gated.norm - 1)  # the layer's two norms


def test_layernorm_families_norms_and_activations_are_transformers_bit_for_bit():
    """Nemotron's LayerNorm1P (``weight + 1`` rounded in the weight's dtype) and each ``hidden_act`` the
    LayerNorm families read are transformers' own, bit for bit in bfloat16 and float32."""
    from transformers.activations import ACT2FN
    from transformers.models.nemotron.modeling_nemotron import NemotronLayerNorm1P

    from pcpflow.models.common import ACTIVATIONS, OffsetLayerNorm
    from pcpflow.models.hf_layernorm import HF_ACTIVATIONS

    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32):
        x = (3 * torch.randn(64, 96, generator=gen)).to(dtype)
        theirs, ours = NemotronLayerNorm1P(96, eps=1e-5).to(dtype), OffsetLayerNorm(96, eps=1e-5).to(dtype)
        with torch.no_grad():
            for norm in (theirs, ours):
                norm.weight.copy_(0.3 * torch.randn(96, generator=torch.Generator().manual_seed(1)))
                norm.bias.copy_(0.1 * torch.randn(96, generator=torch.Generator().manual_seed(2)))
            assert torch.equal(ours(x), theirs(x)), dtype
        for name, act in HF_ACTIVATIONS.items():
            assert torch.equal(ACTIVATIONS[act](x), ACT2FN[name](x)), (name, dtype)


def test_gpt_neox_reads_its_older_fields_and_skips_its_mask_buffers(tmp_path):
    """Pythia's config.json spells RoPE as ``rotary_pct`` / ``rotary_emb_base`` (read where
    ``rope_parameters`` says nothing, as transformers does); its safetensors carry each layer's old
    causal-mask buffers (``attention.bias``, ``attention.masked_bias``), which are left unread rather
    than refused."""
    from pcpflow.models.hf_registry import read_checkpoint_config
    from pcpflow.models.hf_weights import plan_names

    config = dict(REAL_LAYERNORM_CONFIGS["pythia-1.4b"][0], rotary_pct=0.5, rotary_emb_base=25000)
    c, ours, theirs = _sized_as_transformers(tmp_path, config)
    assert (c.rope_theta, c.partial_rotary_factor) == (25000, 0.5) == (
        theirs.rope_parameters["rope_theta"], theirs.rope_parameters["partial_rotary_factor"])
    c, _, theirs = _sized_as_transformers(tmp_path, dict(config, rope_parameters={
        "rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}))
    assert (c.rope_theta, c.partial_rotary_factor) == (5e5, 0.25) == (
        theirs.rope_parameters["rope_theta"], theirs.rope_parameters["partial_rotary_factor"])
    names = [n for n, _ in _hf_tensors(script.build_checkpoint(tmp_path / "neox", "gpt_neox")).items()]
    buffers = ["gpt_neox.layers.0.attention.bias", "gpt_neox.layers.1.attention.masked_bias"]
    checkpoint = read_checkpoint_config(tmp_path / "neox")
    params = [n for n, _ in HFModel(checkpoint).named_parameters()]
    plan = plan_names(names + buffers, params, checkpoint.renames, num_layers=2, skip=checkpoint.skip)
    assert (plan.unknown, plan.unfilled, plan.twice) == ([], [], [])
