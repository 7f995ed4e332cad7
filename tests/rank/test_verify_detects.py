"""Verification can fail: a single wrong KV write or a hidden state off by 1e-3 on one
rank must fail the run (a checker that cannot fail proves nothing)."""

from __future__ import annotations

import pytest
import shared_ranks

from pcpflow.testing import compose

PLUGIN = "pcpflow_test_plugins.faults"


def fault(kind: str, after: str, rank: int, step: int) -> str:
    return f"+pipeline.extra=[{{kind: '{PLUGIN}:{kind}', after: {after}, rank: {rank}, step: {step}}}]"


@shared_ranks.matrix("verify_detects")
def _faults():
    base = ["pcp=2", f"plugins=[{PLUGIN}]", "workload.num_requests=4"]
    return [
        compose(base),
        compose(base + [fault("MisplacedKVWrite", "slots", rank=1, step=2)]),
        compose(base + ["dcp=2", fault("MisplacedKVWrite", "slots", rank=1, step=2)]),
        # Sharded decodes: rank 1 canonically holds sampled rows (with replicated decodes
        # rank 0 holds nearly all of them: a prefill's last chunk is rank 0's).
        compose(base + ["decode=sharded", fault("PerturbedHidden", "forward", rank=1, step=2)]),
    ]


@pytest.mark.dist
@pytest.mark.matrix("verify_detects")
def test_verification_catches_one_misplaced_kv_write_and_one_perturbed_row(shared_runs):
    clean, kv_fault, dcp_kv_fault, hidden_fault = (r for _, r in shared_runs["verify_detects"])
    assert clean["verify"]["passed"]
    for bad in (kv_fault, dcp_kv_fault):
        v = bad["verify"]
        assert not v["passed"] and not v["kv_match"] and v["kv_mismatched_slots"] >= 1, v
    v = hidden_fault["verify"]
    assert not v["passed"] and v["max_abs_logit_diff"] > v["tolerance"], v
