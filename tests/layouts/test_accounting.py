"""Collective accounting: the exact collectives of each step, against layouts worked by hand.

Each case runs a short explicit workload at pcp=2 (float64 tiny_mla) and checks, per step,
every collective call in issue order (op, purpose, per-rank tensor shape), the step's
calls and bytes by purpose, and the run totals users read in ``result.json`` — so an
accidental extra gather, a missing one or a wrong size fails a test. The expected values
are derived below from the layout rules (DESIGN.md, "plan"), the model's sizes and the
bytes model documented in ``pcpflow.parallel.comm``; none is read from the code under test.

Rows per rank, from the layout rules: a prefill of q tokens is cut into 2P = 4 chunks of
ceil(q/4) tokens, rank 0 takes chunks 0 and 3, rank 1 chunks 1 and 2 (empty chunks
dropped); decodes are replicated (every rank, decode=replicated) or the k-th one lives on
rank k mod 2 (decode=sharded); with dcp > 1 a prefill with 3*ceil(q/4) >= q is
replicated like a decode. Each rank is padded to N = the largest rank's rows.

With dcp > 1 the rows past the replicated decodes take the ``queries`` path (queries
gathered, partials all-to-all'd back) or the ``context`` path (each rank's shard of the
whole contexts of their requests all-gathered, padded to ``M``, the most entries one rank
holds); ``auto`` takes the one that moves fewer bytes. The query-path cases pin
``pipeline.forward.dcp_rest=queries``.

A test-only stage (``CollectiveProbe``, placed after the last slot) turns on
``CommStats.log`` and records each step's calls as Comm saw them.
"""

from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pytest
import shared_ranks

from pcpflow.config.run import parse_run_config
from pcpflow.layouts.accounting import (
    QUERIES,
    ModelShape,
    plan_dcp_rest,
    step_collectives,
    step_traffic,
)
from pcpflow.layouts.layout import plan_layout
from pcpflow.pipeline.stage import Stage, StageConfig
from pcpflow.testing import compose

# ----------------------------------------------------------------------------- sizes
# tiny_mla (conf/model/tiny_mla.yaml) in float64.
HIDDEN = 64  # hidden_size: one restored row
LATENT, ROPE = 32, 16  # kv_lora_rank, qk_rope_head_dim
ENTRY = LATENT + ROPE  # a cache entry: the latent plus the shared rope key
HEADS = 4
QK = LATENT + ROPE  # a query row per head, absorbed into latent space, plus its rope part
PARTIAL = HEADS * LATENT + HEADS  # packed partial attention: per-head latent output + lse
LAYERS = 2
F64 = 8
P = D = 2  # pcp, and dcp when it is on


def gather(purpose: str, *shape: int) -> dict[str, Any]:
    """An all_gather over 2 ranks: each receives the other's tensor (P*(P-1) copies)."""
    return {
        "op": "all_gather",
        "purpose": purpose,
        "shape": list(shape),
        "bytes": P * (P - 1) * math.prod(shape) * F64,
    }


def to_all(purpose: str, *shape: int) -> dict[str, Any]:
    """An all_to_all over 2 ranks: each sends the other half of its tensor, (D-1) tensors'
    worth in all."""
    return {
        "op": "all_to_all",
        "purpose": purpose,
        "shape": list(shape),
        "bytes": (D - 1) * math.prod(shape) * F64,
    }


def step(layer: list[dict[str, Any]], restore_rows: int) -> list[dict[str, Any]]:
    """A step: the same collectives in every layer, then the restore's gather of hidden rows."""
    return layer * LAYERS + [gather("restore", restore_rows, HIDDEN)]


# ----------------------------------------------------------------------------- workloads
# W9: requests A, B (1-token prompts) at step 0, C (9 tokens) at step 1, 3 outputs each:
#   step 0: A, B prefill;  step 1: A, B decode + C prefills all 9;  step 2: A, B, C decode.
# W10: the same with a 10-token C (with dcp=2, 9 tokens would be replicated: 3*3 >= 9).
# PREFILL: one step, prompts of 40 and 24 tokens.
# CONTINUED: X (5 tokens) and Y (14) at step 0, a 10-token budget, 2 outputs each:
#   step 0: X prefills all 5, Y its first 5;  step 1: X decodes, Y prefills the 9 tokens
#   after its 5 computed ones (context 14);  step 2: Y decodes (X is done).
WORKLOADS = {
    "W9": [
        "workload.prompt_lens=[1,1,9]",
        "workload.arrival_steps=[0,0,1]",
        "workload.output_lens=[3]",
        "max_steps=3",
    ],
    "W10": [
        "workload.prompt_lens=[1,1,10]",
        "workload.arrival_steps=[0,0,1]",
        "workload.output_lens=[3]",
        "max_steps=3",
    ],
    "PREFILL": ["workload.prompt_lens=[40,24]", "workload.output_lens=[1]", "max_steps=1"],
    "CONTINUED": [
        "workload.prompt_lens=[5,14]",
        "workload.output_lens=[2]",
        "scheduler.max_num_batched_tokens=10",
        "max_steps=3",
    ],
}
# The batches those workloads schedule (q per request, is_prefilling, sampled token rows,
# tokens already computed per request).
BATCHES = {
    "W9": [
        ([1, 1], [True, True], [0, 1], [0, 0]),
        ([1, 1, 9], [False, False, True], [0, 1, 10], [1, 1, 0]),
        ([1, 1, 1], [False] * 3, [0, 1, 2], [2, 2, 9]),
    ],
    "W10": [
        ([1, 1], [True, True], [0, 1], [0, 0]),
        ([1, 1, 10], [False, False, True], [0, 1, 11], [1, 1, 0]),
        ([1, 1, 1], [False] * 3, [0, 1, 2], [2, 2, 10]),
    ],
    "PREFILL": [([40, 24], [True, True], [39, 63], [0, 0])],
    "CONTINUED": [
        ([5, 5], [True, True], [4, 9], [0, 0]),
        ([1, 9], [False, True], [0, 9], [5, 5]),
        ([1], [False], [0], [14]),
    ],
}

CASES: dict[str, dict[str, Any]] = {
    # pcp=2, dcp=1, replicated decodes.
    "replicated": {
        "workload": "W9",
        "overrides": ["decode.mode=replicated"],
        "steps": [
            # A, B: chunk 0 of each (1 token) -> rank 0: rows [2, 0], N=2, no decodes: both move.
            step([gather("kv_gather", 2, ENTRY)], 2),
            # nd=2 decodes on both ranks; C in chunks of 3: rank 0 [0,3), rank 1 [3,9):
            # rows [2+3, 2+6], N=8: the 6 rows past the decodes move.
            step([gather("kv_gather", 6, ENTRY)], 8),
            # Decodes only, replicated: rows [3, 3], nothing past nd=3: no kv_gather at all.
            step([], 3),
        ],
        "per_rank_tokens": [2 + 5 + 3, 0 + 8 + 3],
        # (query, key) pairs: a row at position p reads p+1 keys.
        # step 0: [1+1, 0]; step 1: rank 0 A,B at pos 1 (2+2) + C pos 0..2 (1+2+3),
        # rank 1 2+2 + C pos 3..8 (4+...+9 = 39); step 2: A, B at pos 2 (3+3) + C pos 9 (10).
        "per_rank_attention_work": [2 + (4 + 6) + 16, 0 + (4 + 39) + 16],
    },
    # pcp=2, dcp=1, sharded decodes: every row moves.
    "sharded": {
        "workload": "W9",
        "overrides": ["decode.mode=sharded"],
        "steps": [
            step([gather("kv_gather", 2, ENTRY)], 2),  # as above: rows [2, 0]
            # A -> rank 0, B -> rank 1; C as above: rows [1+3, 1+6], N=7, all 7 move.
            step([gather("kv_gather", 7, ENTRY)], 7),
            # A -> 0, B -> 1, C (third) -> 0: rows [2, 1], N=2: both move.
            step([gather("kv_gather", 2, ENTRY)], 2),
        ],
        "per_rank_tokens": [2 + 4 + 2, 0 + 7 + 1],
        "per_rank_attention_work": [2 + (2 + 6) + (3 + 10), 0 + (2 + 39) + 3],
    },
    # Restore only the sampled rows (each request's last token), from their KV writer.
    "replicated_sampled_rows": {
        "workload": "W9",
        "overrides": ["decode.mode=replicated", "pipeline.restore.kind=sampled_rows"],
        "steps": [
            # Samples A, B (both on rank 0): rank counts [2, 0] -> 2 rows each (N was 2).
            step([gather("kv_gather", 2, ENTRY)], 2),
            # A, B decodes (written by rank 0), C's last token (position 8, chunk 2: rank 1):
            # counts [2, 1] -> 2 rows each instead of N=8.
            step([gather("kv_gather", 6, ENTRY)], 2),
            # Three decodes, all written by rank 0: counts [3, 0] -> 3 rows (N was 3).
            step([], 3),
        ],
        "per_rank_tokens": [10, 11],
    },
    # pcp=2, dcp=2, replicated decodes: queries gathered, partials merged across DCP.
    "dcp_replicated": {
        "workload": "W10",
        "overrides": ["dcp=2", "decode.mode=replicated", "pipeline.forward.dcp_rest=queries"],
        "steps": [
            # A, B: 1-token prefills, 3*1 >= 1: replicated on both ranks, but prefills, so
            # not in the decode prefix (nd=0): rows [2, 2], N=2, both move.
            step(
                [
                    gather("kv_gather", 2, ENTRY),
                    gather("dcp_query_gather", 2, HEADS, QK),
                    to_all("dcp_partials", D * 2, PARTIAL),
                ],
                2,
            ),
            # nd=2 decodes; C (10 tokens, chunks of 3, 3*3 < 10: split): rank 0 [0,3)+[9,10),
            # rank 1 [3,9): rows [2+4, 2+6], N=8, 6 rows past the decodes.
            step(
                [
                    gather("kv_gather", 6, ENTRY),
                    gather("dcp_decode_partials", 2, PARTIAL),
                    gather("dcp_query_gather", 6, HEADS, QK),
                    to_all("dcp_partials", D * 6, PARTIAL),
                ],
                8,
            ),
            # Decodes only: only the decode partials move.
            step([gather("dcp_decode_partials", 3, PARTIAL)], 3),
        ],
        "per_rank_tokens": [2 + 6 + 3, 2 + 8 + 3],
    },
    # pcp=2, dcp=2, sharded decodes (and short prefills): everything moves.
    "dcp_sharded": {
        "workload": "W10",
        "overrides": ["dcp=2", "decode.mode=sharded", "pipeline.forward.dcp_rest=queries"],
        "steps": [
            # A, B replicated-short prefills, sharded: A -> rank 0, B -> rank 1: rows [1, 1].
            step(
                [
                    gather("kv_gather", 1, ENTRY),
                    gather("dcp_query_gather", 1, HEADS, QK),
                    to_all("dcp_partials", D * 1, PARTIAL),
                ],
                1,
            ),
            # A -> 0, B -> 1, C split as above: rows [1+4, 1+6], N=7.
            step(
                [
                    gather("kv_gather", 7, ENTRY),
                    gather("dcp_query_gather", 7, HEADS, QK),
                    to_all("dcp_partials", D * 7, PARTIAL),
                ],
                7,
            ),
            # A -> 0, B -> 1, C -> 0: rows [2, 1], N=2.
            step(
                [
                    gather("kv_gather", 2, ENTRY),
                    gather("dcp_query_gather", 2, HEADS, QK),
                    to_all("dcp_partials", D * 2, PARTIAL),
                ],
                2,
            ),
        ],
        "per_rank_tokens": [1 + 5 + 2, 1 + 7 + 1],
    },
    # pcp=2, dcp=2, the context path, interleave 1: position p lives on rank p % 2.
    "dcp_context_interleave_1": {
        "workload": "CONTINUED",
        "overrides": ["dcp=2", "kv.interleave=1", "pipeline.forward.dcp_rest=context"],
        "steps": [
            # X and Y (5 tokens each): chunks of 2, 3*2 >= 5: replicated short prefills on
            # both ranks, not decodes (nd=0): rows [10, 10], N=10, all move. Contexts: X and
            # Y positions [0, 5): rank 0 holds 0, 2, 4 of each (6), rank 1 1, 3 (4): M=6.
            step(
                [gather("kv_gather", 10, ENTRY), gather("dcp_context_gather", 6, ENTRY)],
                10,
            ),
            # X decodes (nd=1); Y's 9 tokens: chunks of 3, 3*3 >= 9: replicated: rows
            # [1+9, 1+9], N=10, 9 past the decode. Y's context [0, 14): 7 positions per rank.
            step(
                [
                    gather("kv_gather", 9, ENTRY),
                    gather("dcp_decode_partials", 1, PARTIAL),
                    gather("dcp_context_gather", 7, ENTRY),
                ],
                10,
            ),
            step([gather("dcp_decode_partials", 1, PARTIAL)], 1),  # Y's decode only
        ],
        "per_rank_tokens": [10 + 10 + 1, 10 + 10 + 1],
        # Rest rows: each rank scores its own rows over the whole context (position + 1);
        # replicated decodes: over its shard. Step 0: X, Y positions 0..4 on both ranks
        # (15 + 15); step 1: X's decode at position 5 (6 keys: 3 per rank) + Y's positions
        # 5..13 (6 + ... + 14 = 90); step 2: Y's decode at 14 (15 keys: rank 0 8, rank 1 7).
        "per_rank_attention_work": [30 + (3 + 90) + 8, 30 + (3 + 90) + 7],
    },
    # The same under auto and interleave 2 (positions 0,1 | 2,3 | 4,5 ... alternate ranks).
    # auto picks the context path: per layer it moves 2*1*M*48 (all_gather of M entries)
    # against 2*1*rest*4*48 (queries) + 1*2*rest*132 (partials), M < rest in both steps.
    "dcp_auto_interleave_2": {
        "workload": "CONTINUED",
        "overrides": ["dcp=2", "kv.interleave=2"],
        "steps": [
            # X, Y positions [0, 5): rank 0 holds 0, 1, 4 of each (6), rank 1 2, 3 (4): M=6.
            step(
                [gather("kv_gather", 10, ENTRY), gather("dcp_context_gather", 6, ENTRY)],
                10,
            ),
            # Y's [0, 14): rank 0 holds 0,1,4,5,8,9,12,13 (8), rank 1 2,3,6,7,10,11 (6): M=8.
            step(
                [
                    gather("kv_gather", 9, ENTRY),
                    gather("dcp_decode_partials", 1, PARTIAL),
                    gather("dcp_context_gather", 8, ENTRY),
                ],
                10,
            ),
            step([gather("dcp_decode_partials", 1, PARTIAL)], 1),
        ],
        "per_rank_tokens": [21, 21],
        # As above but X's decode (6 keys) splits 4 (0,1,4,5) / 2 (2,3) and Y's decode at
        # position 14 (15 keys) 8 / 7 (14 is on rank 1).
        "per_rank_attention_work": [30 + (4 + 90) + 8, 30 + (2 + 90) + 7],
    },
    # A prefill-heavy step: 40 tokens in chunks of 10 and 24 in chunks of 6, two chunks per
    # rank: rows [20+12, 20+12], N=32.
    "prefill_all_rows": {
        "workload": "PREFILL",
        "overrides": ["pipeline.restore.kind=all_rows"],
        "steps": [step([gather("kv_gather", 32, ENTRY)], 32)],
        "per_rank_tokens": [32, 32],
    },
    # The two samples (positions 39 and 23) are both in chunk 3, on rank 0: counts [2, 0],
    # so each rank sends 2 rows instead of 32.
    "prefill_sampled_rows": {
        "workload": "PREFILL",
        "overrides": ["pipeline.restore.kind=sampled_rows"],
        "steps": [step([gather("kv_gather", 32, ENTRY)], 2)],
        "per_rank_tokens": [32, 32],
    },
}

# Whole prefill-heavy synthetic runs (6 requests, 24-96 prompt and 2-4 output tokens,
# all at step 0), to check that sampled_rows stays exact.
SMALL_SYNTHETIC = [
    "workload.num_requests=6",
    "workload.prompt_len=[24,96]",
    "workload.output_len=[2,4]",
    "workload.arrival_every=0",
]
SYNTHETIC = {
    "synthetic_all_rows": ["pipeline.restore.kind=all_rows"],
    "synthetic_sampled_rows": ["pipeline.restore.kind=sampled_rows"],
    "synthetic_sampled_rows_dcp_sharded": [
        "pipeline.restore.kind=sampled_rows",
        "dcp=2",
        "decode.mode=sharded",
    ],
}


# ----------------------------------------------------------------------------- the probe
class CollectiveProbe(Stage):
    """Test-only stage: turns on ``CommStats.log`` and, after the last slot, appends this
    step's collectives (each call, and calls/bytes by purpose) to ``path`` (rank 0)."""

    kind = "test_collective_probe"

    class Config(StageConfig):
        kind: Literal["test_collective_probe"] = "test_collective_probe"
        path: str

    def __init__(self, config, ctx) -> None:
        super().__init__(config, ctx)
        ctx.stats.log = []
        self.seen = 0

    def __call__(self, state):
        stats = self.ctx.stats
        calls = [
            {"op": op, "purpose": purpose, "shape": list(shape)}
            for op, purpose, shape in stats.log[self.seen :]
        ]
        self.seen = len(stats.log)
        if self.ctx.world.rank == 0:
            record = {
                "step": state.batch.step,
                "calls": calls,
                "step_calls": dict(stats.step_calls),
                "step_bytes": dict(stats.step_bytes),
            }
            with open(self.config.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return state


def _with(base: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """``base`` with dotted ``key=value`` overrides (values as YAML scalars/lists)."""
    import yaml

    raw = json.loads(json.dumps(base))
    for o in overrides:
        key, value = o.split("=", 1)
        *path, leaf = key.split(".")
        node = raw
        for part in path:
            node = node[part]
        node[leaf] = yaml.safe_load(value)
    return raw


_RUNS: dict[str, Any] = {}


@shared_ranks.matrix("accounting")
def _accounting_matrix():
    """Every case and synthetic run (2 ranks, shared with the session's other matrices)."""
    tmp = Path(tempfile.mkdtemp(prefix="pcpflow-accounting-"))
    explicit = compose(
        ["pcp=2", "workload=explicit", "dtype=float64", "model=tiny_mla"]
    ).model_dump(mode="json")
    synthetic = compose(["pcp=2", "dtype=float64", "model=tiny_mla", *SMALL_SYNTHETIC]).model_dump(
        mode="json"
    )
    names, cfgs, probes = [], [], {}
    for name, case in CASES.items():
        raw = _with(explicit, WORKLOADS[case["workload"]] + case["overrides"])
        probes[name] = tmp / f"{name}.jsonl"
        probe = {"kind": f"{__name__}:CollectiveProbe", "after": "draft", "path": str(probes[name])}
        raw["pipeline"]["extra"] = [probe]
        names.append(name)
        cfgs.append(parse_run_config(raw))
    for name, overrides in SYNTHETIC.items():
        names.append(name)
        cfgs.append(parse_run_config(_with(synthetic, overrides)))
    _RUNS.update(names=names, probes=probes)
    return cfgs


@pytest.fixture(scope="module")
def runs(shared_runs):
    results = [r for _, r in shared_runs["accounting"]]
    names, probes = _RUNS["names"], _RUNS["probes"]
    out = {}
    for name, result in zip(names, results):
        records = None
        if name in probes:
            records = [json.loads(line) for line in probes[name].read_text().splitlines()]
        out[name] = (result, records)
    return out


def _by_purpose(calls: list[dict[str, Any]]) -> tuple[dict[str, int], dict[str, int]]:
    n: dict[str, int] = {}
    b: dict[str, int] = {}
    for c in calls:
        n[c["purpose"]] = n.get(c["purpose"], 0) + 1
        b[c["purpose"]] = b.get(c["purpose"], 0) + c["bytes"]
    return n, b


# ----------------------------------------------------------------------------- tests
@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.matrix("accounting")
def test_each_step_does_exactly_the_hand_derived_collectives(runs, name):
    case = CASES[name]
    result, records = runs[name]
    assert result["verify"]["passed"], result["verify"]
    assert [r["step"] for r in records] == list(range(len(case["steps"])))
    for rec, want in zip(records, case["steps"]):
        label = f"{name} step {rec['step']}"
        assert rec["calls"] == [{k: c[k] for k in ("op", "purpose", "shape")} for c in want], label
        want_calls, want_bytes = _by_purpose(want)
        assert rec["step_calls"] == want_calls, label
        assert rec["step_bytes"] == want_bytes, label


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.matrix("accounting")
def test_run_totals_users_read_are_the_sum_of_the_steps(runs, name):
    case = CASES[name]
    m = runs[name][0]["metrics"]
    want_calls, want_bytes = _by_purpose([c for s in case["steps"] for c in s])
    assert m["collective_calls"] == want_calls
    assert m["collective_bytes"] == want_bytes
    assert m["num_steps"] == len(case["steps"])
    assert m["per_rank_tokens"] == case["per_rank_tokens"]
    if "per_rank_attention_work" in case:
        assert m["per_rank_attention_work"] == case["per_rank_attention_work"]


@pytest.mark.dist
@pytest.mark.matrix("accounting")
def test_sampled_rows_restore_saves_exactly_the_unsampled_rows(runs):
    full = runs["prefill_all_rows"][0]["metrics"]["collective_bytes"]
    sampled = runs["prefill_sampled_rows"][0]["metrics"]["collective_bytes"]
    # P*(P-1) copies of (N - m) rows of 64 float64s: N=32 padded rows, m=2 sampled rows.
    assert full["restore"] - sampled["restore"] == 2 * 1 * (32 - 2) * HIDDEN * F64
    assert full["kv_gather"] == sampled["kv_gather"]
    assert runs["prefill_all_rows"][0]["outputs"] == runs["prefill_sampled_rows"][0]["outputs"]


@pytest.mark.dist
@pytest.mark.matrix("accounting")
def test_sampled_rows_restore_is_exact_and_moves_less_on_a_whole_run(runs):
    full, _ = runs["synthetic_all_rows"]
    for name in ("synthetic_sampled_rows", "synthetic_sampled_rows_dcp_sharded"):
        result, _ = runs[name]
        v = result["verify"]
        assert v["passed"] and v["tokens_match"] and v["kv_match"], (name, v)
        assert v["max_abs_logit_diff"] <= 1e-9
        assert result["outputs"] == full["outputs"], name
    sampled = runs["synthetic_sampled_rows"][0]["metrics"]
    assert sampled["collective_bytes"]["restore"] < full["metrics"]["collective_bytes"]["restore"]
    assert (
        sampled["collective_bytes"]["kv_gather"] == full["metrics"]["collective_bytes"]["kv_gather"]
    )
    assert sampled["collective_calls"] == full["metrics"]["collective_calls"]


@pytest.mark.parametrize("name", list(CASES))
def test_layout_only_accounting_matches_the_hand_derivation(name):
    """``pcpflow.layouts.accounting`` (what planner-only tools use) prices each step the same."""
    case = CASES[name]
    dcp = D if "dcp=2" in case["overrides"] else 1
    restore = (
        "sampled_rows" if "pipeline.restore.kind=sampled_rows" in case["overrides"] else "all_rows"
    )
    policy = next(
        (o.split("=")[1] for o in case["overrides"] if o.startswith("pipeline.forward.dcp_rest=")),
        "auto",
    )
    interleave = 2 if "kv.interleave=2" in case["overrides"] else 1
    shape = ModelShape(HIDDEN, LAYERS, ENTRY, HEADS, QK, LATENT, F64)
    for (q, prefilling, logits, computed), want in zip(BATCHES[case["workload"]], case["steps"]):
        layout = plan_layout(
            q,
            prefilling,
            pcp_size=P,
            dcp_size=dcp,
            shard_decodes="decode.mode=sharded" in case["overrides"],
        )
        rest = plan_dcp_rest(
            layout,
            np.add(q, computed),
            policy=policy,
            dcp_size=dcp,
            interleave=interleave,
            shape=shape,
        )
        got = step_collectives(
            layout, np.array(logits), dcp_size=dcp, shape=shape, dcp_rest=rest, restore=restore
        )
        assert [{"op": c.op, "purpose": c.purpose, "shape": list(c.shape)} for c in got] == [
            {k: c[k] for k in ("op", "purpose", "shape")} for c in want
        ]
        assert step_traffic(got, pcp_size=P, dcp_size=dcp, dtype_bytes=F64) == _by_purpose(want)


def test_single_rank_groups_move_nothing():
    layout = plan_layout([5, 1], [True, False], pcp_size=1)
    shape = ModelShape(HIDDEN, LAYERS, ENTRY, HEADS, QK, LATENT, F64)
    got = step_collectives(layout, np.array([4, 5]), dcp_size=1, shape=shape, dcp_rest=QUERIES)
    assert step_traffic(got, pcp_size=1, dcp_size=1, dtype_bytes=F64) == ({}, {})


def test_auto_gathers_queries_for_a_short_chunk_of_a_long_context():
    """dcp=2, one 4-token prefill after 96 computed tokens (context 100): chunks of 1,
    3*1 < 4, so it is split: rows [2, 2], rest=2. Context path: M = 50 entries of 48 per
    rank, all-gathered: 2*1*50*48 = 4800 elements. Queries path: 2*1*2*4*48 = 768 (queries)
    + 1*(2*2)*132 = 528 (partials) = 1296. auto takes the queries; a 40-token prefill from
    scratch (rows [20, 20], M = 20: 1920 < 2*1*20*192 + 1*40*132) takes the context."""
    shape = ModelShape(HIDDEN, LAYERS, ENTRY, HEADS, QK, LATENT, F64)
    tail = plan_layout([4], [True], pcp_size=P, dcp_size=D, num_computed_tokens=[96])
    got = plan_dcp_rest(tail, [100], policy="auto", dcp_size=D, interleave=1, shape=shape)
    assert got == QUERIES
    forced = plan_dcp_rest(tail, [100], policy="context", dcp_size=D, interleave=1, shape=shape)
    assert (forced.mode, forced.context_rows) == ("context", 50)
    fresh = plan_layout([40], [True], pcp_size=P, dcp_size=D)
    got = plan_dcp_rest(fresh, [40], policy="auto", dcp_size=D, interleave=1, shape=shape)
    assert (got.mode, got.context_rows) == ("context", 20)
    colls = step_collectives(fresh, np.array([39]), dcp_size=D, shape=shape, dcp_rest=got)
    assert step_traffic(colls, pcp_size=P, dcp_size=D, dtype_bytes=F64)[1] == {
        "kv_gather": LAYERS * 2 * 20 * ENTRY * F64,
        "dcp_context_gather": LAYERS * 2 * 20 * ENTRY * F64,
        "restore": 2 * 20 * HIDDEN * F64,
    }


# ----------------------------------------------------------------------------- rings
# Ring counts (pcpflow.layouts.accounting's ring table) on layouts worked by hand, at the
# tiny_mla sizes above; the executed runs' own counts are compared with these functions
# every step in tests/attention/test_ring_attention.py.
SHAPE = ModelShape(HIDDEN, LAYERS, ENTRY, HEADS, QK, LATENT, F64)


def test_ring_pass_kv_full_prefill_by_hand():
    from pcpflow.layouts.accounting import ring_step_traffic

    # P=2, I=1, one 8-token prefill, nothing cached: rank 0 holds positions 0 1 6 7, rank 1
    # 2 3 4 5; each block is its rank's 4 new entries. One hop per layer: each rank sends
    # its block; no query travels, no partial comes back.
    layout = plan_layout([8], [True], pcp_size=2, dcp_size=2)
    t = ring_step_traffic(layout, np.arange(8), variant="pass_kv", shape=SHAPE, interleave=1)
    block = 4 * ENTRY * F64
    assert {k: v.tolist() for k, v in t.calls.items()} == {
        "ring_send_kv": [LAYERS, LAYERS], "ring_send_q": [0, 0], "ring_all2all": [0, 0]}
    assert t.bytes["ring_send_kv"].tolist() == [LAYERS * block] * 2
    assert t.totals() == ({"ring_send_kv": LAYERS}, {"ring_send_kv": 2 * LAYERS * block})
    # at tp=2 each PCP rank's two TP ranks run a ring each: global ranks 0, 1 | 2, 3
    assert ring_step_traffic(layout, np.arange(8), variant="pass_kv", shape=SHAPE, interleave=1,
                             tp_size=2).bytes["ring_send_kv"].tolist() == [LAYERS * block] * 4


def test_ring_pass_q_cached_continuation_by_hand():
    from pcpflow.layouts.accounting import ring_step_traffic

    # P=4, I=1: 2 new tokens after 10 cached, held by rank 0 (sharded decodes keep the short
    # prefill on one rank). Positions 10 and 11 belong to ranks 2 and 3. Rank 0's package
    # travels 0 -> 1 -> 2 -> 3: both queries every hop; their KV: both entries to rank 1,
    # both to rank 2 (which keeps position 10), position 11 alone to rank 3.
    layout = plan_layout([2], [True], pcp_size=4, dcp_size=4, shard_decodes=True, num_computed_tokens=[10])
    t = ring_step_traffic(layout, np.array([10, 11]), variant="pass_q", shape=SHAPE, interleave=1)
    q_bytes = 2 * HEADS * QK * F64
    assert t.calls["ring_send_kv"].tolist() == [LAYERS, LAYERS, LAYERS, 0]
    assert t.bytes["ring_send_kv"].tolist() == [LAYERS * 2 * ENTRY * F64, LAYERS * 2 * ENTRY * F64,
                                                LAYERS * 1 * ENTRY * F64, 0]
    assert t.calls["ring_send_q"].tolist() == [LAYERS, LAYERS, LAYERS, 0]
    assert t.bytes["ring_send_q"].tolist() == [LAYERS * q_bytes] * 3 + [0]
    # the all-to-all: ranks 1-3 return the two rows' partials to rank 0; everyone calls it
    assert t.calls["ring_all2all"].tolist() == [LAYERS] * 4
    assert t.bytes["ring_all2all"].tolist() == [0] + [LAYERS * 2 * PARTIAL * F64] * 3


def test_ring_replicated_decodes_only_exchange_partials():
    from pcpflow.layouts.accounting import ring_step_traffic

    # P=3: two replicated decodes: nothing travels; each rank sends its partials of both
    # rows to the two others.
    layout = plan_layout([1, 1], [False, False], pcp_size=3, dcp_size=3, num_computed_tokens=[5, 9])
    t = ring_step_traffic(layout, np.array([5, 9]), variant="pass_kv", shape=SHAPE, interleave=1)
    assert t.calls["ring_send_kv"].sum() == t.calls["ring_send_q"].sum() == 0
    assert t.bytes["ring_all2all"].tolist() == [LAYERS * 2 * 2 * PARTIAL * F64] * 3
    assert t.totals() == ({"ring_all2all": LAYERS}, {"ring_all2all": 3 * LAYERS * 4 * PARTIAL * F64})


def test_ring_attention_work_by_hand():
    from pcpflow.layouts.accounting import ring_attention_work

    layout = plan_layout([8], [True], pcp_size=2, dcp_size=2)
    # pass-KV: each rank scores its own rows over all their keys: 1+2+7+8 and 3+4+5+6
    assert ring_attention_work(layout, np.arange(8), variant="pass_kv", interleave=1).tolist() == [18, 18]
    # pass-Q: every query scores, on each rank, that rank's new keys at or before it:
    # rank 0 holds keys 0 1 6 7 (queries 0..7 see 1 2 2 2 2 2 3 4 of them), rank 1 keys
    # 2..5 (0 0 1 2 3 4 4 4)
    assert ring_attention_work(layout, np.arange(8), variant="pass_q", interleave=1).tolist() == [18, 18]
    # a replicated decode at position 9 (10 keys), I=2: rank 0 holds 0 1 4 5 8 9, rank 1 2 3 6 7
    layout = plan_layout([1], [False], pcp_size=2, dcp_size=2, num_computed_tokens=[9])
    assert ring_attention_work(layout, np.array([9]), variant="pass_q", interleave=2).tolist() == [6, 4]


def test_meta_rule_picks_pass_kv_at_a_high_miss_rate():
    from pcpflow.layouts.accounting import choose_ring_variant

    # GQA, 8 query heads over 2 KV heads of 16: an entry is 2*2*16, a query row 8*16:
    # pass-KV when T / (T + P) >= 2 * 2 / 8 = 1/2
    gqa = ModelShape(hidden_size=64, num_layers=1, entry_dim=64, num_heads=8, qk_dim=16, v_dim=16, dtype_bytes=2)

    def pick(new, cached, shape=gqa, **hw):
        layout = plan_layout([new], [True], pcp_size=2, dcp_size=2, num_computed_tokens=[cached])
        return choose_ring_variant("ring_auto", layout, cached + np.arange(new), shape=shape, **hw)

    assert pick(100, 100) == "pass_kv" and pick(100, 101) == "pass_q" and pick(100, 0) == "pass_kv"
    # MLA (tiny_mla): one latent entry for all 4 heads: pass-KV from a miss rate of 1/4
    assert pick(100, 300, SHAPE) == "pass_kv" and pick(100, 301, SHAPE) == "pass_q"
    # with a machine: pass-KV also when its hop hides behind its attention,
    # T >= P * C * entry_bytes / (2 * H * (qk + dv) * BW) = 2 * 1000 * 128 / (2*8*32 * 1) = 500
    assert pick(500, 10**6, peak_flops=1000.0, bandwidth=1.0) == "pass_kv"
    assert pick(499, 10**6, peak_flops=1000.0, bandwidth=1.0) == "pass_q"
    # decodes only: pass-Q (Meta's decode); the fixed variants are what they say
    decodes = plan_layout([1, 1], [False, False], pcp_size=2, dcp_size=2, num_computed_tokens=[4, 7])
    assert choose_ring_variant("ring_auto", decodes, np.array([4, 7]), shape=gqa) == "pass_q"
    assert choose_ring_variant("ring_pass_kv", decodes, np.array([4, 7]), shape=gqa) == "pass_kv"
    with pytest.raises(ValueError, match="ring_pass_kv, ring_pass_q, ring_auto"):
        choose_ring_variant("allgather", decodes, np.array([4, 7]), shape=gqa)
