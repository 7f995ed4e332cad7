"""Drafting in a simulated run (``pcpflow.simulate.drafting``): the acceptance it is given,
what drafting costs and saves, and the memory a drafter takes. That its counts are the
executed run's is ``test_simulate_equality.py``'s (the drafting cases)."""

from __future__ import annotations

import math

import pytest

from pcpflow.errors import ConfigError
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.prepare import block_bytes, kv_budget_bytes
from pcpflow.simulate.sizes import model_sizes
from pcpflow.testing import compose

SIM = ["mode=simulate", "hardware=h200_sxm", "output.plots=false", "output.progress=false", "workload=explicit"]
DSV3 = [*SIM, "model=deepseek_v3", "tp=8", "pcp=2", "dcp=2", "workload.prompt_lens=[32000,16000,8000,64000]",
        "workload.output_lens=[200]"]
MTP = ["draft=mtp"]  # simulate.draft_layer auto: the card's own MoE layer


def _metrics(overrides: list[str]) -> dict:
    return SimulatedRun(compose(overrides)).run()["metrics"]


@pytest.mark.parametrize("rates, k", [([0.85], 1), ([0.9, 0.5, 0.2], 3)])
def test_drafts_are_accepted_at_the_given_rates(rates, k):
    """Per verify row, the drafts accepted are in expectation sum_j prod_{i<=j} a_i (the first
    rejection ends a row's run): 0.85 for one draft at 0.85; 0.9 + 0.9*0.5 + 0.9*0.5*0.2 = 1.44
    for [0.9, 0.5, 0.2]. Thousands of seeded draws land within 3% of it."""
    expected = sum(math.prod(rates[: j + 1]) for j in range(k))
    m = _metrics([*SIM, "model=llama3_8b", "draft=mtp", f"draft.num_speculative_tokens={k}",
                  f"simulate.draft_acceptance={rates}".replace(" ", ""), f"workload.prompt_lens={[500] * 16}".replace(" ", ""),
                  "workload.output_lens=[400]"])
    assert m["draft_verify_rows"] > 2000
    assert m["mean_accepted_per_step"] == pytest.approx(expected, rel=0.03)
    assert m["acceptance_rate"] == pytest.approx(expected / k, rel=0.03)


def test_what_drafting_costs_and_saves_on_deepseek_v3():
    """DeepSeek-V3 decoding four requests (memory-bound: each step reads the weights its rows
    reach) with its MTP module priced as one more of its MoE layers: drafts accepted at 85%
    make a token cheaper than without drafting (1.57 tokens a step for about one step's reads);
    drafts never accepted make it dearer (the drafter's layer and the verify rows, whose three
    tokens a request reach more experts than one); the draft stage's terms say what it costs."""
    plain = _metrics(DSV3)
    good = _metrics([*DSV3, *MTP, "simulate.draft_acceptance=[0.85]"])
    bad = _metrics([*DSV3, *MTP, "simulate.draft_acceptance=[0.0]"])
    assert good["tpot"]["mean_s"] < 0.85 * plain["tpot"]["mean_s"] < bad["tpot"]["mean_s"]
    assert good["num_steps"] < plain["num_steps"] == bad["num_steps"]
    terms = good["simulate"]["breakdown_s"]
    assert {"draft_gemm", "draft_attention", "draft_memory_ops", "draft_restore", "draft_tp_all_reduce"} <= set(terms)
    draft_s = sum(v["exposed_s"] for k, v in terms.items() if k.startswith("draft_"))
    assert good["stage_s"]["draft"] == pytest.approx(draft_s, rel=1e-9)
    assert 0 < good["draft_time_fraction"] < 0.2


def test_a_drafters_cache_and_weights_take_hbm_from_the_kv_cache():
    """Derived KV blocks: ``self`` keeps a second copy of every entry (a block costs twice, the
    weights are the target's own), so the blocks the HBM holds halve; an MTP module priced as
    one of DeepSeek-V3's layers adds its weights and one layer's latent per token."""
    long = [f"workload.prompt_lens={[120000] * 10}".replace(" ", ""), "workload.output_lens=[8]"]  # 1.2M tokens: more than fit
    base = [*SIM, "model=llama3_8b", "tp=1", *long]
    plain, drafting = compose(base), compose([*base, "draft=self"])
    sizes = model_sizes(plain.model)
    free = kv_budget_bytes(sizes, plain.hardware, plain.simulate, tp=1)
    per_block = block_bytes(sizes, tp=1, block_size=plain.kv.block_size, kv_dtype="bf16")
    assert plain.kv.num_blocks == int(free // per_block)
    assert drafting.kv.num_blocks == int(free // (2 * per_block))

    dsv3 = [*SIM, "model=deepseek_v3", "tp=8", *long]
    plain, mtp = compose(dsv3), compose([*dsv3, *MTP, "simulate.draft_acceptance=[0.8]"])
    sizes = model_sizes(plain.model)
    free = kv_budget_bytes(sizes, plain.hardware, plain.simulate, tp=8)
    per_block = block_bytes(sizes, tp=8, block_size=16, kv_dtype="bf16")
    layer = per_block / sizes.num_layers
    assert plain.kv.num_blocks == int(free // per_block)
    assert mtp.kv.num_blocks < int(free // (per_block + layer))  # less than the latent alone leaves: its weights too


def test_auto_prices_a_cards_drafter_as_its_own_layers():
    """``simulate.draft_layer=auto``: on a model card the drafter is the card's own layer (a
    tiny draft.layer of 4 heads would not even split over tp=8); on a tiny model, draft.layer."""
    card = compose([*DSV3, "draft=mtp", "simulate.draft_acceptance=[0.8]"])
    assert card.simulate.draft_layer == "auto" and card.simulate.drafter_layers(card.model) == "target"
    tiny = compose([*SIM, "model=tiny_mla", "draft=mtp", "simulate.draft_acceptance=[0.8]", "workload.prompt_lens=[9]",
                    "workload.output_lens=[3]"])
    assert tiny.simulate.drafter_layers(tiny.model) == "config"
    with pytest.raises(ConfigError) as exc:
        compose([*DSV3, "draft=mtp", "simulate.draft_acceptance=[0.8]", "simulate.draft_layer=config"])
    assert [p.field for p in exc.value.problems] == ["tp"]  # the 4-head draft.layer does not split over 8 ranks


def test_a_drafters_kv_moves_at_the_caches_dtype():
    """simulate.kv_dtype=fp8: the draft stage's KV gathers move one byte an element, as the
    target's do (half their bf16 bytes); its other collectives keep the activations' dtype."""
    base = [*SIM, "model=llama3_8b", "tp=2", "pcp=2", "dcp=2", "draft=self", "draft.error_rate=0.3",
            "pipeline.forward.dcp_rest=context", "workload.prompt_lens=[3000,5000]", "workload.output_lens=[4]"]
    bf16, fp8 = (_metrics([*base, f"simulate.kv_dtype={d}"])["collective_bytes"] for d in ("bf16", "fp8"))
    for purpose in ("kv_gather", "draft_kv_gather", "dcp_context_gather", "draft_dcp_context_gather"):
        assert fp8[purpose] * 2 == pytest.approx(bf16[purpose], rel=1e-6), purpose
    for purpose in ("tp_all_reduce", "draft_dcp_decode_partials"):
        assert fp8[purpose] == bf16[purpose], purpose


def test_a_drafter_that_reuses_the_targets_moe_layers_routes_its_own_rows():
    """``draft=self`` on an MoE target under moe.dispatch=gather: the executed drafter runs the
    target's layers without the forward's dispatch (LOCAL: no moe_* collective in its counts,
    test_simulate_equality), so its phases are priced with local routing too."""
    cfg = compose([*SIM, "model=deepseek_v3", "tp=8", "pcp=2", "moe.dispatch=gather", "draft=self",
                   "workload.prompt_lens=[4000]", "workload.output_lens=[3]"])
    run = SimulatedRun(cfg)
    assert run.pricer.moe_dispatch == "gather" and run.drafting.pricer.moe_dispatch == "local"
    assert run.drafting.pricer.sizes is run.sizes
