"""The PCP engine is exact: every layout computes what one rank computes.

Each parametrized case starts its ranks once (pcpflow.testing.run) and runs the whole
decode-mode x model matrix in them, on an explicit workload built to hit the length
corner cases of DualChunkSwap at that pcp: prompts of 1, 2P-1, 2P and 2P+1 tokens, a
prompt longer than the token budget (continued prefills), more requests than
``max_num_seqs`` and an odd block size.

Two independent checks per run:
- pcpflow's own verification (the single-rank pipeline in lockstep: logits, tokens,
  every rank's KV cache) must pass in float64 to 1e-9;
- the generated tokens must be the greedy continuation under a dense, cache-free
  forward written directly from the weights (tests/reference.py).
"""

from __future__ import annotations

import os

import pytest
import shared_ranks

from pcpflow.testing import compose

MODELS = ("tiny_mla", "tiny_gqa")
DECODES = ("replicated", "sharded")
from exactness import assert_exact, corner_case_workload  # noqa: E402


def _corner_cases(pcp: int):
    # NOTE: at pcp=2 the sharded runs bind each rank to a core of its own (cpu_bind): the same tokens
    bind = {d: ["cpu_bind=cores"] if pcp == 2 and d == "sharded" else [] for d in DECODES}
    return lambda: [compose(corner_case_workload(pcp) + [f"decode={d}", f"model={m}", *bind[d]])
                    for d in DECODES for m in MODELS]


for _pcp in (1, 2, 3, 4):
    shared_ranks.matrix(f"engine/pcp={_pcp}")(_corner_cases(_pcp))


@pytest.mark.dist
@pytest.mark.parametrize("pcp", [pytest.param(p, marks=pytest.mark.matrix(f"engine/pcp={p}")) for p in (1, 2, 3, 4)])
def test_pcp_matches_single_rank_on_length_corner_cases(pcp, shared_runs):
    runs = shared_runs[f"engine/pcp={pcp}"]
    cfgs, results = [c for c, _ in runs], [r for _, r in runs]
    for cfg, result in zip(cfgs, results):
        assert_exact(cfg, result)
        tokens = result["metrics"]["per_rank_tokens"]
        assert len(tokens) == pcp and sum(tokens) >= result["metrics"]["num_tokens"]
        if cfg.cpu_bind == "cores" and len(os.sched_getaffinity(0)) >= pcp:  # rank 0 on the first core
            assert result["metrics"]["cpu_cores"] == [min(os.sched_getaffinity(0))]
    # Same model, any layout: the same tokens (float64 leaves no room for drift).
    for m in MODELS:
        outs = [r["outputs"] for c, r in zip(cfgs, results) if c.model.name == m]
        assert all(o == outs[0] for o in outs)


@shared_ranks.matrix("engine/narrow")
def _narrow():
    base = corner_case_workload(3)
    return [
        compose(base + ["dtype=float32", "decode=sharded"]),
        compose(base + ["cudagraph_mode=piecewise", "cudagraph_capture_sizes=[16,32]", "decode=replicated", "model=tiny_gqa"]),
        compose(base + ["dtype=bfloat16", "dcp=3", "model=tiny_gqa", "pipeline.forward.dcp_rest=queries"]),
    ]


@pytest.mark.dist
@pytest.mark.matrix("engine/narrow")
def test_narrow_dtypes_within_tolerance_and_padding_rows_never_written(shared_runs):
    """float32 and bfloat16 verification use their documented tolerances (a differing
    token only at a near-tie); padding every rank up to a CUDA-graph capture size
    (piecewise: every step) adds rows that must never reach the cache."""
    runs = shared_runs["engine/narrow"]
    cfgs = [c for c, _ in runs]
    r32, rpad, rbf16 = (r for _, r in runs)
    v = r32["verify"]
    assert v["passed"] and v["tolerance"] == pytest.approx(1e-4), v
    assert v["max_abs_logit_diff"] <= 1e-4
    assert_exact(cfgs[1], rpad)
    assert rpad["metrics"]["balance"]["padding_fraction"] > 0
    v = rbf16["verify"]
    assert v["passed"] and v["tolerance"] == pytest.approx(0.25), v
    assert v["max_abs_logit_diff"] <= 0.25 and v["max_abs_kv_diff"] <= 0.25
    assert all(t["top2_gap"] <= 0.5 for t in v["near_ties"])
    # Partial attention travels as bf16 outputs with each float32 log-sum-exp in two bf16
    # slots: per step, partials / gathered queries = D*rest*H*(dv + 2)*2 / (rest*H*qk*2*D)
    # over a DCP group of D, i.e. (dv + 2)/qk = 18/16 for tiny_gqa (2*17/16 in float32).
    b = rbf16["metrics"]["collective_bytes"]
    assert b["dcp_partials"] / b["dcp_query_gather"] == pytest.approx(18 / 16)
