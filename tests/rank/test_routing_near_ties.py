"""The verifier routes the reference as the run did where a router nearly ties
(``pcpflow.rank.routing``), and nowhere else.

- Hand-worked (no ranks): one row whose experts 1 and 2 tie within 0.002 in the reference
  and swap in the run. Within the tolerance the reference takes the run's experts, weighted
  by its own logits (softmax over the pair, by hand), and lists a near-tie; past it, or in
  float64 (no allowance), it keeps its own and lists a mismatch; a row where both agree is
  neither.
- Executed: the tiny MLA with 4 experts, top 2, at pcp=2 dcp=2 in bfloat16 (DCP merges
  attention in another order than one rank, so a router can flip where two experts nearly
  tie: seed 1 flipped layer 1 of one token at step 10 before, failing verification with a
  logit off by 3.1). Now every seed passes, with the near-ties listed (at least one over
  the seeds), each a real swap within the tolerance; and a float32 run through pools
  (``disagg=pd``: the decode pool's router logits go to rank 0) passes with none; a bf16
  run whose readmissions reuse their own blocks passes: the reference recomputes those
  positions routed as the run did where it took the run's experts (``RecalledRouting``).
- The allowance hides no misrouted row: a run whose rank 1 sends one row to an expert its
  router did not choose (``WrongExpert``; the router's logits there agree) fails on its KV,
  with no near-tie taken.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pcpflow.models.moe import MoEMLP
from pcpflow.models.moe_config import MoEConfig
from pcpflow.rank.routing import ForcedRouting, RoutingReport, prefix_keys
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.testing import compose, run

MOE = MoEConfig(num_experts=4, top_k=2, scoring_func="softmax", norm_topk_prob=True, routed_scaling_factor=2.0)


def _batch(num_tokens: int) -> GlobalBatch:
    return GlobalBatch(
        step=7, req_ids=np.array([5]), num_scheduled_tokens=np.array([num_tokens]),
        num_computed_tokens=np.array([10]), is_prefilling=np.array([True]), prompt_lens=np.array([10 + num_tokens]),
        input_ids=np.zeros(num_tokens, dtype=np.int64), block_tables=np.zeros((1, 4), dtype=np.int64),
        logits_indices=np.zeros(0, dtype=np.int64), num_draft_tokens=np.zeros(1, dtype=np.int64),
    )


# Row 0: the reference ranks experts 0 > 1 > 2 (1 and 2 0.002 apart); the run swapped 1 and 2.
# Row 1: both choose {0, 3}.
REF = torch.tensor([[3.0, 1.001, 0.999, -1.0], [2.0, -1.0, -2.0, 1.5]], dtype=torch.float64)
RUN = torch.tensor([[3.0, 0.999, 1.001, -1.0], [2.0, -1.0, -2.0, 1.5]], dtype=torch.float64)


def _route(run: torch.Tensor, atol: float | None, swapped: bool = False):
    """Route REF's rows through the hook; ``swapped``: the reference holds token 1 in row 0
    and token 0 in row 1 (a layout puts decodes first), padding after them."""
    moe = MoEMLP(8, 8, MOE, layer=3)
    report = RoutingReport()
    hook = ForcedRouting(([3], run[:, None, :]), atol, _batch(2), report, keys=lambda tokens: tokens.astype(np.uint64))
    if swapped:
        logits = torch.cat([REF[[1, 0]], torch.zeros(1, 4, dtype=REF.dtype)])
        weights, ids = hook.for_rows(np.array([1, 0, -1]))(moe, logits)
        weights, ids = weights[[1, 0]], ids[[1, 0]]
    else:
        weights, ids = hook.for_rows(np.array([0, 1]))(moe, REF.clone())
    return {int(e): float(w) for e, w in zip(ids[0], weights[0])}, sorted(ids[1].tolist()), report


def test_prefix_keys_key_every_prefix_apart():
    """Position p's key is the prefix cache's chain over tokens[:p+1] (blocks of one token):
    it does not depend on what follows, and no two prefixes of 500 random tokens share one."""
    tokens = np.random.default_rng(0).integers(0, 50_000, 500)
    keys = prefix_keys(tokens)
    assert keys[:7].tolist() == prefix_keys(tokens[:7]).tolist()
    assert len(set(keys.tolist())) == len(keys)
    other = tokens.copy()
    other[3] += 1  # a change at position 3 changes every key from there on, none before
    moved = prefix_keys(other) != keys
    assert not moved[:3].any() and moved[3:].all()


@pytest.mark.parametrize("swapped", [False, True], ids=["in-order", "rows-reordered"])
def test_a_near_tie_takes_the_run_experts_weighted_by_the_reference_logits(swapped):
    chosen, other, report = _route(RUN, atol=0.25, swapped=swapped)
    # softmax weights of experts 0 and 2 renormalised over the pair: e^3 / (e^3 + e^0.999), x 2.0
    w0 = math.exp(3.0) / (math.exp(3.0) + math.exp(0.999))
    assert chosen == pytest.approx({0: 2.0 * w0, 2: 2.0 * (1 - w0)}, rel=1e-12)
    assert other == [0, 3]
    assert report.num_near_ties == 1 and report.num_mismatches == 0
    assert report.near_ties == [{"step": 7, "layer": 3, "req_id": 5, "position": 10, "run_experts": [0, 2],
                                 "reference_experts": [0, 1], "router_logit_diff": pytest.approx(0.002)}]
    assert report.max_logit_diff == pytest.approx(0.002)
    assert report.summary(0.25)["routing_match"]
    assert report.taken == {(0, 3): [0, 2]}  # (token 0's key, layer 3): recalled where recomputed


@pytest.mark.parametrize("atol", [1e-3, None], ids=["past-the-tolerance", "float64"])
def test_a_swap_past_the_tolerance_keeps_the_reference_routing_and_fails(atol):
    chosen, _, report = _route(RUN, atol=atol)
    assert set(chosen) == {0, 1}  # the reference's own experts
    assert report.num_near_ties == 0 and report.num_mismatches == 1
    assert report.mismatches[0]["run_experts"] == [0, 2] and report.mismatches[0]["reference_experts"] == [0, 1]
    assert not report.summary(1.0)["routing_match"]


def test_router_logits_past_the_tolerance_fail_even_where_the_experts_agree():
    run = REF.clone()
    run[1, 1] += 0.5  # row 1 still chooses {0, 3}
    _, other, report = _route(run, atol=0.25)
    assert other == [0, 3] and report.num_near_ties == report.num_mismatches == 0
    assert report.max_logit_diff == pytest.approx(0.5)
    assert not report.summary(0.25)["routing_match"] and report.summary(1.0)["routing_match"]


FAULTS = "pcpflow_test_plugins.faults"
EXECUTED = ["model=tiny_mla", "model.moe.num_experts=4", "model.moe.top_k=2", "output.plots=false",
            "output.progress=false"]


@pytest.mark.slow  # NOTE: seven executed runs of their own ranks (11 s): the default set's budget
def test_bf16_moe_with_dcp_verifies_with_its_routing_near_ties_listed():
    seeds = [0, 1, 2, 3]
    cfgs = [compose([*EXECUTED, "pcp=2", "dcp=2", "dtype=bfloat16", f"seed={s}"]) for s in seeds]
    cfgs.append(compose([*EXECUTED, "pcp=2", "dcp=2", "dtype=float32", "disagg=pd", "disagg.decode_pool.pcp=2",
                         "disagg.decode_pool.dcp=2"]))
    # 8 experts in 2 groups, TP beside PCP, replicated decodes; few blocks: 3 preemptions, whose
    # readmissions find their own blocks, so the reference recomputes 176 positions, near-ties
    # among them (before they were recalled there, 24 KV slots were off by up to 0.93)
    cfgs.append(compose(["model=tiny_mla", "model.moe.num_experts=8", "model.moe.top_k=2", "model.moe.n_group=2",
                         "model.moe.topk_group=1", "tp=2", "pcp=2", "dtype=bfloat16", "seed=42", "moe.dispatch=all_to_all",
                         "decode=replicated", "kv.prefix_caching=true", "kv.num_blocks=24", "output.plots=false",
                         "output.progress=false"]))
    # float32 (the allowance active): rank 1 sends one row of the first MoE layer to an expert its
    # router did not choose, at step 2
    wrong = compose([*EXECUTED, "pcp=2", "dcp=2", "dtype=float32", f"plugins=[{FAULTS}]",
                     f"+pipeline.extra=[{{kind: '{FAULTS}:WrongExpert', after: slots, rank: 1, step: 2}}]"])
    *results, misrouted = run([*cfgs, wrong])
    v = misrouted["verify"]
    assert not v["passed"] and v["kv_mismatched_slots"] > 0 and v["num_routing_near_ties"] == 0, v
    ties = 0
    for cfg, res in zip(cfgs, results):
        v = res["verify"]
        assert v["passed"], (cfg.seed, v)
        assert v["num_routing_mismatches"] == 0 and v["routing_match"]
        assert 0 < v["max_abs_router_logit_diff"] <= v["tolerance"]
        for tie in v["routing_near_ties"]:
            assert tie["run_experts"] != tie["reference_experts"]
            assert tie["router_logit_diff"] <= v["tolerance"]
        ties += v["num_routing_near_ties"]
    assert results[len(seeds)]["verify"]["num_routing_near_ties"] == 0  # float32: rounding far inside any tie
    assert ties >= 1  # seed 1's flip at step 10 (measured on this CPU)
    recomputed = results[-1]["verify"]
    assert recomputed["positions_recomputed"] > 0 and recomputed["num_routing_near_ties"] > 0
