"""Mixture-of-experts layers under PCP are exact.

- Routing (``pcpflow.models.moe.route``) equals a per-token float64 reference written from
  DeepSeek's description (sigmoid + correction bias for selection, group-limited top-k,
  normalised and scaled weights; V2 softmax), and a hand-worked case where the bias
  changes which experts win but not their weights.
- Every ``moe.dispatch`` (local, gather, all_to_all) x pcp x dcp x decode mode passes
  pcpflow's float64 verification (tokens equal the single rank, logits within 1e-9, KV
  caches exact) and generates the single-rank tokens; each token is routed once
  (tokens per expert sum to top_k x tokens x MoE layers).
- Padded rows reach no expert: on a one-step prefill with padding, the rows each expert
  receives equal the single rank's (which has no padding), in every mode.
- ``model=hf`` DeepSeek-V3 / V2 MoE checkpoints give transformers' own greedy tokens and
  logits (float64 reference: transformers' eager experts under ``PromoteFloat32``).
- Bad MoE settings are one problem each, exit code 2, before any rank starts.

Every spawned config runs in one ``pcpflow.testing.run`` call (ranks start once per world
size); the full matrix is ``slow``.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="builds tiny checkpoints: pip install -e '.[test]'"
)

from pcpflow.errors import ConfigError  # noqa: E402
from pcpflow.layouts.accounting import (  # noqa: E402
    moe_all_to_all_calls,
    moe_gather_collectives,
    moe_uniform_send_rows,
    traffic_factor,
)
from pcpflow.layouts.layout import plan_layout  # noqa: E402
from pcpflow.models.common import GatedMLP  # noqa: E402
from pcpflow.models.moe import LocalDispatch, MoEMLP, expert_slice, route, sliced_mlp  # noqa: E402
from pcpflow.models.moe_config import MoEConfig  # noqa: E402
from pcpflow.testing import cli, compose, run  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TOP_K, HIDDEN, NUM_LAYERS, MOE_LAYERS = 2, 64, 3, 2
MOE = [
    "model.moe.num_experts=8",
    f"model.moe.top_k={TOP_K}",
    "model.moe.n_group=2",
    "model.moe.topk_group=1",
    "model.moe.intermediate_size=24",
    "model.moe.routed_scaling_factor=2.5",
    "model.moe.first_k_dense_replace=1",  # layer 0 dense, layers 1-2 MoE
    f"model.num_layers={NUM_LAYERS}",
]
QUIET = ["output.plots=false", "output.progress=false", "dtype=float64"]


# ------------------------------------------------------------------ routing
def reference_route(logits: np.ndarray, bias: np.ndarray, moe: MoEConfig) -> list[dict[int, float]]:
    """Per token: {expert: weight}, straight from DeepSeek-V3's / V2's description."""
    e, g, k = moe.num_experts, moe.n_group, moe.top_k
    size = e // g
    out = []
    for row in logits:
        if moe.scoring_func == "sigmoid":
            scores = 1 / (1 + np.exp(-row))
            choice = scores + bias
            group_score = [sum(sorted(choice[i * size : (i + 1) * size])[-2:]) for i in range(g)]
        else:
            scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
            choice = scores
            group_score = [max(choice[i * size : (i + 1) * size]) for i in range(g)]
        groups = sorted(range(g), key=lambda i: -group_score[i])[: moe.topk_group] if g > 1 else [0]
        allowed = [x for x in range(e) if x // size in groups]
        chosen = sorted(allowed, key=lambda x: -choice[x])[:k]
        w = np.array([scores[x] for x in chosen])
        if moe.norm_topk_prob:
            w = w / w.sum()
        out.append(dict(zip(chosen, w * moe.routed_scaling_factor)))
    return out


ROUTINGS = [
    MoEConfig(num_experts=8, top_k=2),
    MoEConfig(num_experts=16, top_k=4, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    MoEConfig(num_experts=8, top_k=3, n_group=2, topk_group=1, norm_topk_prob=False),
    MoEConfig(num_experts=8, top_k=2, scoring_func="softmax", norm_topk_prob=False),
    MoEConfig(num_experts=12, top_k=2, n_group=3, topk_group=2, scoring_func="softmax"),
]


def _routing_id(m: MoEConfig) -> str:
    return f"{m.scoring_func}-E{m.num_experts}-k{m.top_k}-g{m.n_group}"


@pytest.mark.parametrize("moe", ROUTINGS, ids=_routing_id)
def test_routing_matches_a_per_token_reference(moe):
    rng = np.random.default_rng(moe.num_experts + moe.top_k)
    logits = rng.normal(size=(300, moe.num_experts))
    bias = rng.normal(scale=0.1, size=moe.num_experts) if moe.scoring_func == "sigmoid" else None
    bias_t = None if bias is None else torch.from_numpy(bias)
    weights, ids = route(torch.from_numpy(logits), bias_t, moe)
    want = reference_route(logits, np.zeros(moe.num_experts) if bias is None else bias, moe)
    for i, expected in enumerate(want):
        got = dict(zip(ids[i].tolist(), weights[i].tolist()))
        assert set(got) == set(expected), i
        for x, w in expected.items():
            assert abs(got[x] - w) < 1e-12


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "qwen3_moe_normed", "mixtral", "qwen3_vl_moe"])
def test_softmax_routers_choose_as_transformers_in_bfloat16(family):
    """Qwen2-MoE, Qwen3-MoE, Mixtral and Qwen3-VL-MoE routers (``router_dtype=model``; Qwen3-VL-MoE's
    always renormalised): bf16 rows, bf16 router weights;
    the same experts as transformers' own router module on every row, the same weights to bf16
    rounding. Their logits are bf16 products, so ties and near-ties fall as transformers'."""
    from pcpflow.models.moe import TopKRouter

    e, k, h = 16, 4, 64
    if family == "mixtral":
        theirs = transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter(
            transformers.MixtralConfig(hidden_size=h, num_local_experts=e, num_experts_per_tok=k))
        norm = True
    elif family == "qwen2_moe":
        theirs = transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter(
            transformers.Qwen2MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k))
        norm = False
    elif family == "qwen3_vl_moe":
        theirs = transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeTextTopKRouter(
            transformers.Qwen3VLMoeTextConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k))
        norm = True
    else:
        norm = family.endswith("normed")
        theirs = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter(
            transformers.Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm))
    gen = torch.Generator().manual_seed(3)
    weight = (torch.randn(e, h, generator=gen) / h**0.5).to(torch.bfloat16)
    x = torch.randn(400, h, generator=gen).to(torch.bfloat16)
    theirs = theirs.to(torch.bfloat16)
    with torch.no_grad():
        theirs.weight.copy_(weight)
        _, their_w, their_ids = theirs(x)
    # NOTE: the Qwens' routers round the weights to the logits' dtype (bf16), Mixtral's keeps them in float32
    moe = MoEConfig(num_experts=e, top_k=k, num_shared_experts=0, scoring_func="softmax", norm_topk_prob=norm,
                    router_dtype="model", weights_dtype="scores" if family == "mixtral" else "model")
    ours = TopKRouter(h, moe).to(torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(weight)
        our_w, our_ids = ours(x)
    assert torch.equal(our_ids, their_ids)
    assert our_w.dtype == their_w.dtype and torch.equal(our_w, their_w)
    if family != "qwen3_vl_moe":  # NOTE: and the loader reads each family's checkpoints with that rounding
        from pcpflow.models.hf_moe import gqa_moe_settings

        arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}.get(family, "Qwen3MoeForCausalLM")
        assert MoEConfig(**gqa_moe_settings({}, arch)).weights_dtype == moe.weights_dtype


def test_correction_bias_picks_the_experts_not_their_weights():
    """Scores [0.9, 0.1, 0.6, 0.55] in groups {0, 1} and {2, 3}, one group, two experts.
    Unbiased, group {2, 3} wins (0.6 + 0.55 > 0.9 + 0.1): weights 0.6/1.15, 0.55/1.15.
    A bias of +0.2 on expert 1 makes group {0, 1} win (1.2 > 1.15), with the unbiased
    weights 0.9 and 0.1."""
    moe = MoEConfig(num_experts=4, top_k=2, n_group=2, topk_group=1)
    scores = torch.tensor([[0.9, 0.1, 0.6, 0.55]], dtype=torch.float64)
    logits = torch.log(scores / (1 - scores))
    w, ids = route(logits, torch.zeros(4, dtype=torch.float64), moe)
    want = {2: 0.6 / 1.15, 3: 0.55 / 1.15}
    assert dict(zip(ids[0].tolist(), w[0].tolist())) == pytest.approx(want)
    w, ids = route(logits, torch.tensor([0, 0.2, 0, 0], dtype=torch.float64), moe)
    assert dict(zip(ids[0].tolist(), w[0].tolist())) == pytest.approx({0: 0.9, 1: 0.1})


@pytest.mark.parametrize("width,parts", [(7, 3), (2, 3), (24, 4)])
def test_expert_shares_sum_to_the_expert(width, parts):
    torch.manual_seed(0)
    mlp = GatedMLP(16, width).double()
    x = torch.randn(5, 16, dtype=torch.float64)
    bounds = [expert_slice(width, p, parts) for p in range(parts)]
    assert bounds[0][0] == 0 and bounds[-1][1] == width
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    total = sum(sliced_mlp(mlp, x, lo, hi) for lo, hi in bounds)
    assert torch.allclose(total, mlp(x), atol=1e-12, rtol=0)


def test_padding_rows_reach_no_expert_in_the_layer():
    moe = MoEConfig(num_experts=4, top_k=2, num_shared_experts=0)
    layer = MoEMLP(16, 32, moe, layer=0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()
        x = torch.randn(6, 16, dtype=torch.float64)
        padding = torch.tensor([False, True, False, False, True, True])
        seen = {}
        observe = lambda _layer, ids, rows: seen.update(ids=ids, rows=rows)  # noqa: E731
        out = LocalDispatch(padding, observe)(layer, x)
    assert torch.equal(out[padding], torch.zeros(3, 16, dtype=torch.float64))
    assert int(seen["rows"].sum()) == 2 * 3  # top_k x real rows
    full = layer(x)  # no dispatch installed: every row routed
    assert torch.allclose(out[~padding], full[~padding], atol=1e-12, rtol=0)


# ------------------------------------------------------------------ engine matrix
def workload(pcp: int) -> list[str]:
    """Lengths 1 and 2P-1, 2P+1 for P = 2 and 4 (DualChunkSwap's corners, padding) and a
    prompt longer than the token budget (continued prefill), decoded for four tokens; the
    same at every pcp, so that every run's tokens can be compared with the single rank's."""
    return [
        "workload=explicit",
        "workload.prompt_lens=[1,3,5,7,9,41]",
        "workload.output_lens=[4]",
        "workload.arrival_steps=[0,0,1,1,2,2]",
        "scheduler.max_num_batched_tokens=32",
        "kv.block_size=8",
    ]


def case_overrides(mode: str, pcp: int, dcp: int, decode: str) -> list[str]:
    grid = [f"moe.dispatch={mode}", f"pcp={pcp}", f"dcp={dcp}", f"decode={decode}"]
    return [*MOE, *QUIET, *workload(pcp), *grid]


# Default: each mode with replicated (rows routed once per copy) and sharded decodes
# between these, the padded prefill at pcp=4 and the checkpoint cases.
DEFAULT_CASES = [
    ("gather", 2, 1, "replicated"),
    ("all_to_all", 2, 2, "replicated"),
    ("gather", 4, 4, "sharded"),
]
FULL_CASES = [
    (mode, pcp, dcp, decode)
    for mode in ("local", "gather", "all_to_all")
    for pcp in (1, 2, 4)
    for dcp in sorted({1, pcp})
    for decode in ("replicated", "sharded")
]
PADDED_PROMPTS = [13, 6]  # one step at pcp=4: 19 tokens in 8 chunks, ranks padded


def padded_overrides(mode: str, pcp: int) -> list[str]:
    return [
        *MOE,
        *QUIET,
        "workload=explicit",
        f"workload.prompt_lens=[{','.join(map(str, PADDED_PROMPTS))}]",
        "workload.output_lens=[1]",
        f"moe.dispatch={mode}",
        f"pcp={pcp}",
    ]


def assert_exact(cfg, result) -> None:
    v = result["verify"]
    label = f"moe.dispatch={cfg.moe.dispatch} pcp={cfg.pcp} dcp={cfg.dcp} decode={cfg.decode.mode}"
    assert v["passed"], (label, v)
    assert v["tokens_match"] and v["kv_match"], (label, v)
    assert v["max_abs_logit_diff"] <= 1e-9, (label, v["max_abs_logit_diff"])


def assert_each_token_routed_once(result) -> None:
    m = result["metrics"]
    assert sum(m["moe_tokens_per_expert"]) == TOP_K * m["num_tokens"] * MOE_LAYERS


def _check_case(case, engine_results):
    cfg, result = engine_results[("matrix", *case)]
    assert_exact(cfg, result)
    single_cfg, single = engine_results[("single",)]
    assert result["outputs"] == single["outputs"]
    assert all(len(o) == 4 for o in result["outputs"])
    assert_each_token_routed_once(result)
    m, w = result["metrics"], cfg.world_size
    rows = np.array(m["moe_expert_rows"])
    assert rows.shape == (w, 8)
    if case[0] == "all_to_all":
        per_rank = 8 // w
        for rank in range(w):
            outside = np.delete(rows[rank], range(rank * per_rank, (rank + 1) * per_rank))
            assert not outside.any(), "a rank ran an expert it does not own"
        # every real (token, expert) pair ran once, at the expert's owner
        assert rows.sum() >= sum(m["moe_tokens_per_expert"])
        if w > 1:
            nbytes = m["collective_bytes"]
            assert nbytes["moe_dispatch"] * HIDDEN == nbytes["moe_combine"] * (HIDDEN + 2 * TOP_K)
    if case[0] == "gather":
        assert (rows == rows[0]).all(), "every rank computes a share of every gathered row"
    if case[0] == "local" or w == 1:
        assert not any(k.startswith("moe_") for k in m["collective_bytes"])


@pytest.mark.dist
@pytest.mark.parametrize("case", DEFAULT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_dispatch_is_exact(case, engine_results):
    _check_case(case, engine_results)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize(
    "case", [c for c in FULL_CASES if c not in DEFAULT_CASES], ids=lambda c: "-".join(map(str, c))
)
def test_dispatch_is_exact_full_matrix(case, engine_results):
    _check_case(case, engine_results)


@pytest.mark.dist
@pytest.mark.parametrize("mode", ["local", "gather", "all_to_all"])
def test_padded_rows_never_reach_an_expert(mode, engine_results):
    """One prefill step of 19 tokens at pcp=4: every rank padded to the largest rank. The
    rows each expert receives equal the single rank's (no padding there); padded rows
    reaching experts would add ``top_k`` rows each."""
    layout = plan_layout(np.array(PADDED_PROMPTS), np.array([True, True]), pcp_size=4)
    n, real = layout.padded_num_tokens, sum(PADDED_PROMPTS)
    assert 4 * n > real, "the case must have padding"
    _, single = engine_results[("padded", "local", 1)]
    want = np.array(single["metrics"]["moe_expert_rows"])[0]
    assert want.sum() == TOP_K * real * MOE_LAYERS
    cfg, result = engine_results[("padded", mode, 4)]
    assert_exact(cfg, result)
    assert result["metrics"]["num_steps"] == 1
    rows = np.array(result["metrics"]["moe_expert_rows"])
    if mode == "gather":
        assert (rows == want).all()  # each rank: a share of every real gathered row
        nbytes = result["metrics"]["collective_bytes"]
        calls = moe_gather_collectives(n, 4, HIDDEN) * MOE_LAYERS
        for purpose in ("moe_gather", "moe_reduce_scatter"):
            expected = sum(c.nbytes(4, 8) for c in calls if c.purpose == purpose)
            assert nbytes[purpose] == expected
    else:
        assert (rows.sum(axis=0) == want).all()
    # and the single-rank layer of the same config counts what the reference routes
    _, single_mode = engine_results[("padded", mode, 1)]
    assert (np.array(single_mode["metrics"]["moe_expert_rows"])[0] == want).all()


def test_all_to_all_accounting_model():
    """Rows to oneself move nothing; each moved row carries h values and 2k float64."""
    send = np.array([[3, 1], [2, 5]])
    calls = dict.fromkeys(["moe_counts", "moe_dispatch", "moe_combine"], 0)
    for purpose, nbytes in moe_all_to_all_calls(send, hidden_size=10, top_k=2, dtype_bytes=4):
        calls[purpose] += nbytes
    assert calls == {
        "moe_counts": 2 * 8 * traffic_factor("all_gather", 2),
        "moe_dispatch": 3 * (40 + 32),
        "moe_combine": 3 * 40,
    }
    assert moe_all_to_all_calls(np.array([[7]]), hidden_size=10, top_k=2, dtype_bytes=4) == []
    # uniform routing, 8 experts over 4 ranks, 2 per token: a rank is missed with
    # probability C(6, 2) / C(8, 2) = 15/28, so 10 rows send it 10 * 13/28 on average
    expected = moe_uniform_send_rows(np.array([10, 0, 0, 0]), top_k=2, num_experts=8, num_ranks=4)
    assert expected.shape == (4, 4)
    assert np.allclose(expected[0], 10 * 13 / 28) and not expected[1:].any()


# ------------------------------------------------------------------ bad input
def _problems(overrides: list[str]) -> list[tuple[str, str]]:
    with pytest.raises(ConfigError) as exc:
        compose(overrides)
    return [(p.field, p.allowed) for p in exc.value.problems]


@pytest.mark.parametrize(
    "overrides,field,words",
    [
        (["moe.dispatch=gather"], "moe.dispatch", "has no experts"),
        (["model=tiny_gqa", "moe.dispatch=local"], "moe.dispatch", "has no experts"),
        (["model.moe.num_experts=8", "model.moe.top_k=9"], "model.moe.top_k", "num_experts (8)"),
        (
            ["model.moe.num_experts=8", "model.moe.n_group=3"],
            "model.moe.n_group",
            "must divide num_experts (8)",
        ),
        (
            ["model.moe.num_experts=8", "model.moe.n_group=2", "model.moe.topk_group=3"],
            "model.moe.topk_group",
            "n_group (2)",
        ),
        (
            ["model.moe.num_experts=6", "pcp=4", "moe.dispatch=all_to_all"],
            "moe.dispatch",
            "divisible by 4",
        ),
        (["model.moe.top_k=3"], "model.moe", "num_experts is 0"),
    ],
)
def test_bad_moe_settings_are_one_problem(overrides, field, words):
    ((got_field, allowed),) = _problems(overrides)
    assert got_field == field and words in allowed, allowed


def test_bad_moe_settings_exit_2_before_any_rank(tmp_path):
    run_dir = tmp_path / "run"
    r = cli("moe.dispatch=gather", f"hydra.run.dir={run_dir}")
    assert r.returncode == 2, r.stderr
    assert "moe.dispatch" in r.stderr and "Traceback" not in r.stderr + r.stdout
    assert not run_dir.exists()


# ------------------------------------------------------------------ Hugging Face
HF_PROMPT_LENS, HF_OUTPUT_LENS = [1, 7, 30], [4, 3, 5]
# (checkpoint, dtype, pcp, dcp, decode, dispatch)
HF_CASES = [
    ("dsv3_moe", "float64", 1, 1, "replicated", "gather"),
    ("dsv3_moe", "float64", 2, 1, "sharded", "all_to_all"),
    ("dsv3_moe", "float64", 4, 4, "sharded", "local"),
    ("qwen3_moe", "float64", 2, 2, "replicated", "all_to_all"),
    ("qwen2_moe", "float64", 2, 2, "sharded", "gather"),
]
HF_SLOW_CASES = [
    ("dsv3_moe", "float64", 4, 4, "sharded", "gather"),
    ("dsv2_moe", "float64", 2, 2, "replicated", "gather"),
    ("dsv3_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("dsv3_moe", "float64", 4, 1, "replicated", "local"),
    ("dsv3_moe", "float64", 4, 4, "replicated", "all_to_all"),
    ("dsv2_moe", "float64", 4, 4, "sharded", "all_to_all"),
    ("qwen3_moe", "float32", 4, 4, "sharded", "local"),
    ("mixtral", "float32", 4, 4, "sharded", "gather"),
    ("qwen3_moe", "float64", 2, 2, "sharded", "gather", "tp=2"),
    ("mixtral", "float64", 2, 1, "replicated", "all_to_all"),
    ("mixtral", "float32", 2, 2, "replicated", "all_to_all", "tp=2"),
    ("glm4_moe", "float64", 2, 2, "sharded", "gather"),
    ("glm4_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("glm4_moe", "float64", 2, 1, "sharded", "local", "tp=2"),
    ("qwen2_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("qwen2_moe", "float64", 2, 2, "replicated", "local", "tp=2"),
    ("gpt_oss", "float64", 2, 2, "sharded", "gather"),
    ("gpt_oss", "float64", 4, 4, "replicated", "all_to_all"),
    ("gpt_oss", "float32", 2, 2, "replicated", "gather", "tp=2"),
    ("gpt_oss", "float64", 2, 1, "sharded", "all_to_all", "tp=2"),
    # Llama 4: top-1 of the raw logits, each expert's *input* scaled by the sigmoid score (every mode
    # must scale before the expert: gather's intermediate shares, all_to_all's owners), a shared expert
    ("llama4", "float64", 2, 2, "sharded", "gather"),
    ("llama4", "float32", 4, 4, "replicated", "all_to_all"),
    ("llama4", "float64", 4, 1, "sharded", "local"),
    ("llama4", "float64", 2, 2, "replicated", "all_to_all", "tp=2"),
    ("llama4", "float32", 2, 1, "sharded", "gather", "tp=2"),
    # Hunyuan-A13B: softmax over float32 router logits, top-2 renormalised, a shared expert, every layer
    ("hunyuan_moe", "float64", 2, 2, "sharded", "gather"),
    ("hunyuan_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("hunyuan_moe", "float64", 4, 1, "sharded", "local"),
    ("hunyuan_moe", "float64", 2, 2, "replicated", "all_to_all", "tp=2"),
    # Granite: the top-2 logits softmaxed, fused expert tensors; a shared MLP beside the experts (GraniteMoeShared,
    # Granite 4.0's attention-only hybrid)
    ("granitemoe", "float64", 2, 2, "sharded", "gather"),
    ("granitemoe", "float32", 4, 4, "replicated", "all_to_all"),
    ("granitemoeshared", "float64", 4, 1, "replicated", "all_to_all"),
    ("granite4", "float64", 2, 2, "sharded", "gather", "tp=2"),
    ("granite4", "float32", 2, 2, "replicated", "all_to_all", "tp=2"),
    ("granite4", "float64", 4, 4, "sharded", "local"),
    # OLMoE: the top-2 of a softmax over all 8 experts, not renormalised, weights rounded to the model's dtype;
    # full-width q/k norms (all-reduced over TP) and clip_qkv in its attention
    ("olmoe", "float64", 2, 2, "sharded", "gather"),
    ("olmoe", "float32", 4, 4, "replicated", "all_to_all"),
    ("olmoe", "float64", 2, 2, "replicated", "all_to_all", "tp=2"),
    # Qwen3-VL-MoE's language model: softmax top-2 always renormalised, fused experts stored transposed
    ("qwen3_vl_moe", "float64", 2, 2, "sharded", "gather"),
    ("qwen3_vl_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("qwen3_vl_moe", "float64", 4, 1, "sharded", "local"),
    ("qwen3_vl_moe", "float64", 2, 2, "replicated", "all_to_all", "tp=2"),
    # ERNIE 4.5 MoE: top-2 chosen on the float32 softmax plus the selection bias, renormalised by max(sum,
    # moe_norm_min) (a clamp that bites), two shared experts; layer 0 dense
    ("ernie4_5_moe", "float64", 2, 2, "sharded", "gather"),
    ("ernie4_5_moe", "float32", 4, 4, "replicated", "all_to_all"),
    ("ernie4_5_moe", "float64", 2, 2, "replicated", "all_to_all", "tp=2"),
]
# MoE layers of each tiny checkpoint (make_tiny_hf_checkpoint.tiny_config, 2 layers): DeepSeek's
# layer 0 is dense (first_k_dense_replace=1), Qwen2/3-MoE's, GLM-4.5's and ERNIE 4.5's too, Mixtral's, gpt-oss's, Hunyuan's,
# Granite's and OLMoE's are not; Llama 4's 4 layers alternate dense and MoE (interleave_moe_layer_step=2).
HF_MOE_LAYERS = {"dsv3_moe": 1, "dsv2_moe": 1, "qwen2_moe": 1, "qwen3_moe": 1, "mixtral": 2, "glm4_moe": 1, "gpt_oss": 2,
                 "llama4": 2, "hunyuan_moe": 2, "granitemoe": 2, "granitemoeshared": 2, "granite4": 2, "olmoe": 2,
                 "qwen3_vl_moe": 2, "ernie4_5_moe": 1}
# Experts per token of each tiny checkpoint: 2, but Llama 4's 1 (its released models' num_experts_per_tok).
HF_TOP_K = {"llama4": 1}


class _Checkpoints(dict):
    """The tiny MoE checkpoints, each written on first use (a default run needs a few of them)."""

    OPTIONS = {
        "dsv3_moe": ("deepseek_v3", dict(moe=True)),
        "dsv2_moe": ("deepseek_v2", dict(moe=True)),
        "qwen2_moe": ("qwen2_moe", {}),
        "qwen3_moe": ("qwen3_moe", {}),
        "mixtral": ("mixtral", {}),
        "glm4_moe": ("glm4_moe", dict(bias=True)),
        "gpt_oss": ("gpt_oss", dict(bias=True)),
        "llama4": ("llama4", {}),  # NOTE: transformers' chunk of 8192 keys: longer than any request here
        "hunyuan_moe": ("hunyuan_moe", dict(bias=True)),
        "granitemoe": ("granitemoe", {}),
        "granitemoeshared": ("granitemoeshared", {}),
        "granite4": ("granite4", {}),
        "olmoe": ("olmoe", dict(bias=True)),
        "qwen3_vl_moe": ("qwen3_vl_moe", {}),
        "ernie4_5_moe": ("ernie4_5_moe", {}),
    }

    def __init__(self, root: Path) -> None:
        super().__init__()
        self.root = root

    def __missing__(self, name: str) -> Path:
        from repo_scripts import load_script

        arch, options = self.OPTIONS[name]
        path = self[name] = load_script("make_tiny_hf_checkpoint").build_checkpoint(
            self.root / name, arch, seed=0, **options)
        return path


@pytest.fixture(scope="module")
def moe_checkpoints(tmp_path_factory):
    return _Checkpoints(tmp_path_factory.mktemp("hf_moe"))


def _hf_prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(7)
    return [rng.integers(0, vocab_size, n).tolist() for n in HF_PROMPT_LENS]


def transformers_greedy(path: Path, prompts, dtype: str):
    """(tokens, logits [n, vocab]) per prompt from ``generate``; float64 runs transformers'
    eager experts (its grouped GEMM takes no float64) under ``PromoteFloat32``."""
    from float64_compute import float64_compute, promote_parameters

    # NOTE: by config.json's architecture: a multimodal one (Qwen3-VL-MoE) has no AutoModelForCausalLM class
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    model = getattr(transformers, arch).from_pretrained(
        path, dtype=getattr(torch, dtype), experts_implementation="eager"
    ).eval()
    promote = dtype == "float64"
    if promote:
        base = getattr(model.model, "language_model", model.model)
        with float64_compute():
            base.rotary_emb = type(base.rotary_emb)(config=base.config)
        promote_parameters(model)
    out = []
    with float64_compute() if promote else torch.no_grad(), torch.no_grad():
        for prompt, n in zip(prompts, HF_OUTPUT_LENS):
            g = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=n,
                min_new_tokens=n,
                output_logits=True,
                return_dict_in_generate=True,
            )
            out.append((g.sequences[0, len(prompt) :].tolist(), torch.cat(g.logits).double()))
    return out


def hf_overrides(path: Path, prompts, dtype, pcp, dcp, decode, mode, *extra) -> list[str]:
    return [
        *extra,
        "model=hf",
        f"model.path={path}",
        f"dtype={dtype}",
        f"pcp={pcp}",
        f"dcp={dcp}",
        f"decode={decode}",
        f"moe.dispatch={mode}",
        "workload=explicit",
        f"workload.prompts={json.dumps(prompts).replace(' ', '')}",
        f"workload.output_lens={json.dumps(HF_OUTPUT_LENS).replace(' ', '')}",
        "scheduler.max_num_batched_tokens=16",
        "output.save_logits=true",
        "output.plots=false",
        "output.progress=false",
    ]


def _slow_selected(request) -> bool:
    items = request.session.items
    return any(i.get_closest_marker("slow") and i.module.__name__ == __name__ for i in items)


@pytest.fixture(scope="module")
def results(request, moe_checkpoints):
    """Rank 0's result of every config of this module — engine matrix, padded prefill,
    checkpoints — from one ``run`` call (ranks start once per world size)."""
    slow = _slow_selected(request)
    cases = DEFAULT_CASES + ([c for c in FULL_CASES if c not in DEFAULT_CASES] if slow else [])
    configs = {("matrix", *c): compose(case_overrides(*c)) for c in cases}
    configs[("single",)] = compose([*MOE, *QUIET, *workload(1), "pcp=1"])
    for pcp in (1, 4):
        for mode in ("local", "gather", "all_to_all"):
            configs[("padded", mode, pcp)] = compose(padded_overrides(mode, pcp))
    vocab = json.loads((moe_checkpoints["dsv3_moe"] / "config.json").read_text())["vocab_size"]
    prompts = _hf_prompts(vocab)
    for case in HF_CASES + (HF_SLOW_CASES if slow else []):
        ckpt, *rest = case
        configs[("hf", *case)] = compose(hf_overrides(moe_checkpoints[ckpt], prompts, *rest))
    out = run(list(configs.values()))
    return {key: (cfg, res) for (key, cfg), res in zip(configs.items(), out)}


@pytest.fixture(scope="module")
def engine_results(results):
    return results


@pytest.fixture(scope="module")
def hf_results(results, moe_checkpoints):
    vocab = json.loads((moe_checkpoints["dsv3_moe"] / "config.json").read_text())["vocab_size"]
    prompts = _hf_prompts(vocab)
    keys = [k[1:3] for k in results if k[0] == "hf"]
    refs = {
        key: transformers_greedy(moe_checkpoints[key[0]], prompts, key[1])
        for key in dict.fromkeys(keys)
    }
    return prompts, refs, {k[1:]: res for k, (_, res) in results.items() if k[0] == "hf"}


def _hf_check(case, hf_results):
    ckpt, dtype, *_ = case
    prompts, refs, results = hf_results
    result = results[case]
    assert result["verify"]["passed"], result["verify"]
    tol = {"float64": 1e-10, "float32": 1e-5}[dtype]
    for i, (tokens, logits) in enumerate(refs[(ckpt, dtype)]):
        assert result["outputs"][i] == tokens, f"request {i}"
        got = torch.tensor(result["logits"][i], dtype=torch.float64)
        assert float((got - logits).abs().max()) <= tol, f"request {i}"
    routed = HF_MOE_LAYERS[ckpt] * HF_TOP_K.get(ckpt, 2) * result["metrics"]["num_tokens"]
    assert sum(result["metrics"]["moe_tokens_per_expert"]) == routed


@pytest.mark.dist
@pytest.mark.parametrize("case", HF_CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_checkpoint_matches_transformers(case, hf_results):
    _hf_check(case, hf_results)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("case", HF_SLOW_CASES, ids=lambda c: "-".join(map(str, c)))
def test_moe_checkpoint_matches_transformers_more(case, hf_results):
    _hf_check(case, hf_results)


def _checkpoint_problem(path) -> str:
    with pytest.raises(ConfigError) as exc:
        compose(["model=hf", f"model.path={path}", "pcp=1"])
    (problem,) = exc.value.problems
    assert problem.field == "model.path"
    return problem.allowed


def _edit(src: Path, dst: Path, **changes) -> Path:
    import shutil

    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_unsupported_moe_checkpoints_are_named(moe_checkpoints, tmp_path):
    v3 = moe_checkpoints["dsv3_moe"]
    phimoe = _edit(v3, tmp_path / "phimoe", architectures=["PhimoeForCausalLM"])
    says = _checkpoint_problem(phimoe)
    assert "unsupported architecture PhimoeForCausalLM: a mixture-of-experts variant" in says
    listed = says.split("supported MoE checkpoints: ")[1]
    for name in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Glm4MoeForCausalLM",
                 "Ernie4_5_MoeForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "GptOssForCausalLM",
                 "Llama4ForCausalLM", "HunYuanMoEV1ForCausalLM", "GraniteMoeForCausalLM", "OlmoeForCausalLM"):
        assert name in listed, name
    assert "OlmoeForCausalLM" in says
    shared = _edit(v3, tmp_path / "shared", architectures=["Qwen2MoeForCausalLM"], num_experts=8,
                   moe_intermediate_size=32, shared_expert_intermediate_size=48)
    assert "shared_expert_intermediate_size=48 is not supported; supported: a multiple of moe_intermediate_size (32)" \
        in _checkpoint_problem(shared)
    # NOTE: the config.json is refused before any tensor is read: a DeepSeek checkpoint relabelled will do
    glm = _edit(v3, tmp_path / "glm", architectures=["Glm4MoeForCausalLM"], scoring_func="softmax")
    assert "scoring_func='softmax' is not supported" in _checkpoint_problem(glm)
    only = _edit(v3, tmp_path / "only", architectures=["Qwen3MoeForCausalLM"], mlp_only_layers=[0])
    assert "mlp_only_layers=[0] is not supported; supported: []" in _checkpoint_problem(only)
    mixtral_k = _edit(v3, tmp_path / "mixtral_k", architectures=["MixtralForCausalLM"], num_local_experts=8,
                      num_experts_per_tok=9)
    assert "moe.top_k=9: must be <= num_experts (8)" in _checkpoint_problem(mixtral_k)
    greedy = _edit(v3, tmp_path / "greedy", topk_method="greedy")
    assert "topk_method='greedy'" in _checkpoint_problem(greedy)
    freq = _edit(v3, tmp_path / "freq", moe_layer_freq=2)
    assert "moe_layer_freq=2 is not supported" in _checkpoint_problem(freq)
    v2 = _edit(moe_checkpoints["dsv2_moe"], tmp_path / "v2", topk_method="noaux_tc")
    assert "DeepSeek-V2 MoE routing topk_method='noaux_tc'" in _checkpoint_problem(v2)
    top_k = _edit(v3, tmp_path / "top_k", num_experts_per_tok=9)
    assert "top_k" in _checkpoint_problem(top_k)


@pytest.mark.dist
@pytest.mark.slow
def test_dispatch_is_exact_under_tensor_parallelism():
    """tp=2 x pcp=2, DCP within PCP and over all four ranks: a MoE block stays whole on
    every TP rank and ``moe.dispatch`` places its experts; every mode verifies exact and
    generates the single rank's tokens."""
    single = compose([*MOE, *QUIET, *workload(2), "pcp=1"])
    cfgs = [
        compose(case_overrides(mode, 2, dcp, decode) + ["tp=2"])
        for mode, dcp, decode in (("local", 4, "sharded"), ("gather", 2, "replicated"), ("all_to_all", 4, "sharded"))
    ]
    ref, *results = run([single, *cfgs])
    for cfg, result in zip(cfgs, results):
        assert cfg.tp == 2 and cfg.world_size == 4
        assert_exact(cfg, result)
        assert result["outputs"] == ref["outputs"], cfg.moe.dispatch
