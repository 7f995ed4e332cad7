"""Prefix hits and preemptions executed exactly: tokens and logits equal the single-rank
reference, and every reused block holds what the reference writes recomputing that prefix
(``pcpflow.rank.verify``: a request that starts past what the reference holds is recomputed
first, and the run's cache at those positions must equal it), at pcp 1/2/4, with DCP, with
tp=2, in both decode modes.

The workloads share prefixes on purpose: prompts that begin with a common stem (token ids
given), arriving over several steps so that later ones find the earlier ones' blocks; a
Mooncake trace whose scaled hash blocks span whole KV blocks (length_scale 1/64: 8 tokens
per 512-token hash block, block_size 4); and a KV cache small enough that running requests
are preempted and readmitted (their prompt and outputs prefilled again, prefix hits
allowed). Each case asserts a minimum number of hit tokens and, with few blocks, of
preemptions: a case where nothing is reused or preempted would prove nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import shared_ranks

from pcpflow.testing import compose

REPO = Path(__file__).resolve().parents[2]
TRACE = REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"
STEM = [(7 * j + 3) % 256 for j in range(24)]
PROMPTS = [STEM + [100 + i, 50 + i, 7 + i] for i in range(5)] + [STEM[:9] + [3, 3]]
STEMS = [
    "workload=explicit", f"workload.prompts={json.dumps(PROMPTS)}", "workload.output_lens=[9]",
    "workload.arrival_steps=[0,2,2,3,5,5]", "kv.block_size=4", "kv.prefix_caching=true",
    "scheduler.max_num_batched_tokens=40", "scheduler.max_num_seqs=4",
]
TRACE_RUN = [
    "workload=trace", f"workload.path={TRACE}", "workload.max_requests=8", "workload.length_scale=0.015625",
    "workload.output_len_cap=4", "kv.block_size=4", "kv.prefix_caching=true", "scheduler.max_num_seqs=2",
    "scheduler.max_num_batched_tokens=128",
]
# (name, overrides, minimum hit tokens, minimum preemptions)
CASES = {
    "serving/pcp=1": [
        ("stems", ["pcp=1", *STEMS, "kv.num_blocks=64"], 96, 0),
        ("stems_preempted", ["pcp=1", *STEMS, "kv.num_blocks=12"], 96, 3),
    ],
    "serving/pcp=2": [
        ("pcp2_replicated_preempted", ["pcp=2", "decode=replicated", *STEMS, "kv.num_blocks=12"], 96, 3),
        ("pcp2_dcp2_sharded_preempted", ["pcp=2", "dcp=2", "decode=sharded", *STEMS, "kv.num_blocks=6"], 64, 2),
    ],
    "serving/pcp=2 slow": [
        ("trace_pcp2_dcp2", ["pcp=2", "dcp=2", "decode=sharded", *TRACE_RUN, "kv.num_blocks=128"], 48, 0),
        ("tp2_dcp2_preempted", ["tp=2", "pcp=1", "dcp=2", *STEMS, "kv.num_blocks=6"], 64, 2),
    ],
    "serving/pcp=4 slow": [
        ("pcp4_dcp4_sharded_preempted", ["pcp=4", "dcp=4", "decode=sharded", *STEMS, "kv.num_blocks=4"], 48, 1),
        ("pcp4_replicated_preempted", ["pcp=4", "decode=replicated", *STEMS, "kv.num_blocks=12"], 96, 3),
        ("tp2_pcp2_sharded_preempted", ["tp=2", "pcp=2", "decode=sharded", "model=tiny_gqa", *STEMS, "kv.num_blocks=12"], 96, 3),
    ],
}
QUIET = ["output.plots=false", "output.progress=false"]

for _name, _cases in CASES.items():
    shared_ranks.matrix(_name)(lambda cases=_cases: [compose(o + QUIET) for _, o, _, _ in cases])


def _check(name: str, shared_runs) -> None:
    for (case, _, min_hits, min_preempted), (_, result) in zip(CASES[name], shared_runs[name]):
        v, m = result["verify"], result["metrics"]
        assert v["passed"] and v["tokens_match"] and v["kv_match"], (case, v)
        assert m["prefix_cache"]["hit_tokens"] >= min_hits, (case, m["prefix_cache"])
        assert m["preemptions"] >= min_preempted, (case, m["preemptions"])
        # every hit and every readmission was recomputed by the reference and compared
        assert v["positions_recomputed"] >= m["prefix_cache"]["hit_tokens"], case


@pytest.mark.dist
@pytest.mark.matrix("serving/pcp=1")
def test_prefix_hits_and_preemptions_exact_on_one_rank(shared_runs):
    _check("serving/pcp=1", shared_runs)


@pytest.mark.dist
@pytest.mark.matrix("serving/pcp=2")
def test_prefix_hits_and_preemptions_exact_pcp2(shared_runs):
    _check("serving/pcp=2", shared_runs)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.matrix("serving/pcp=2 slow")
def test_trace_hits_and_tp_exact(shared_runs):
    _check("serving/pcp=2 slow", shared_runs)


@pytest.mark.slow
@pytest.mark.dist
@pytest.mark.matrix("serving/pcp=4 slow")
def test_prefix_hits_and_preemptions_exact_pcp4_and_tp2_pcp2(shared_runs):
    _check("serving/pcp=4 slow", shared_runs)


@shared_ranks.matrix("serving/detects")
def _detects():
    plugin = "pcpflow_test_plugins.faults"
    fault = f"+pipeline.extra=[{{kind: '{plugin}:WrongPrefixBlock', after: validate, rank: 0, step: 0}}]"
    return [compose(["pcp=2", f"plugins=[{plugin}]", *STEMS, "kv.num_blocks=64", fault] + QUIET)]


@pytest.mark.dist
@pytest.mark.matrix("serving/detects")
def test_a_wrong_reused_block_fails_verification(shared_runs):
    """A hit served from another block than the one holding the prefix: the run's cache at
    the reused positions differs from the reference's recomputation."""
    (_, result), = shared_runs["serving/detects"]
    v = result["verify"]
    assert not v["passed"] and not v["kv_match"] and v["kv_mismatched_slots"] >= 1, v
