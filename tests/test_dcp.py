"""Decode context parallelism is exact: KV sharded over the DCP group by
``kv.interleave``, partial attention merged across shards, with replicated and with
sharded decodes (which vLLM does not allow with dcp > 1).

Every run must pass pcpflow's verification in float64: logits and tokens equal the
single-rank reference, and each rank's cache holds exactly the reference's entries for
the positions it owns ((p // I) % dcp == rank) and nothing anywhere else. Tokens are
also checked against the dense reference forward.
"""

from __future__ import annotations

import numpy as np
import pytest

from pcpflow.testing import compose, run
from test_engine import assert_exact, corner_case_workload

BLOCK = 6  # interleave in {1, 2, BLOCK} must divide it

# (decode, assignment, model, interleave, restore): each dimension covered at every size.
CASES = [
    ("replicated", "round_robin", "tiny_mla", 1, "all_rows"),
    ("sharded", "round_robin", "tiny_gqa", 2, "all_rows"),
    ("sharded", "balanced", "tiny_mla", BLOCK, "sampled_rows"),
    ("replicated", "round_robin", "tiny_gqa", BLOCK, "sampled_rows"),
]


@pytest.mark.dist
@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_dcp_equals_pcp_matches_single_rank(pcp):
    base = corner_case_workload(pcp) + [f"dcp={pcp}", f"kv.block_size={BLOCK}"]
    cfgs = [
        compose(
            base
            + [
                f"decode={d}",
                f"decode.assignment={a}",
                f"model={m}",
                f"kv.interleave={i}",
                f"pipeline.restore.kind={r}",
            ]
        )
        for d, a, m, i, r in CASES
    ]
    results = run(cfgs)
    for cfg, result in zip(cfgs, results):
        assert_exact(cfg, result)
        calls = result["metrics"]["collective_calls"]
        # Prefill chunks always need the other shards' attention.
        assert calls.get("dcp_query_gather", 0) > 0 and calls.get("dcp_partials", 0) > 0
        if cfg.decode.mode == "replicated":
            assert calls.get("dcp_decode_partials", 0) > 0
        else:  # sharded decodes take the gathered-query path only
            assert "dcp_decode_partials" not in calls


def test_dcp_local_shard_sizes_add_up():
    """Each rank stores about 1/dcp of every context: the shard lengths of all ranks sum
    to the context and differ by at most the interleave (hand-checkable arithmetic)."""
    from pcpflow.slots import dcp_local_seq_lens

    seq_lens = np.arange(0, 200)
    for d in (2, 3, 4):
        for i in (1, 2, 6):
            shards = np.stack([dcp_local_seq_lens(seq_lens, d, r, i) for r in range(d)])
            assert (shards.sum(0) == seq_lens).all()
            assert (shards.max(0) - shards.min(0) <= i).all()
