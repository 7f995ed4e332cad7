"""pcpflow.attention.context_parallel: decode context parallelism is exact: KV sharded over the DCP group by
``kv.interleave``, partial attention merged across shards, with replicated and with
sharded decodes (which vLLM does not allow with dcp > 1), and the rows past the
replicated decodes on either DCP path: ``queries`` (gathered, partials merged),
``context`` (the shards of their contexts gathered) or ``auto`` (per step, by bytes).

Every run must pass pcpflow's verification in float64: logits and tokens equal the
single-rank reference, and each rank's cache holds exactly the reference's entries for
the positions it owns ((p // I) % dcp == rank) and nothing anywhere else. Tokens are
also checked against the dense reference forward.
"""

from __future__ import annotations

import numpy as np
import pytest
import shared_ranks
from exactness import OUTPUT_LEN, assert_exact, corner_case_workload

from pcpflow.testing import compose

BLOCK = 6  # interleave in {1, 2, BLOCK} must divide it
INTERLEAVES = (1, 2, BLOCK)


def prompt_lens(pcp: int) -> list[int]:
    """The length corner cases of ``corner_case_workload`` (1, 2P-1, 2P, 2P+1), then a
    194-token prompt continued over four steps under the 64-token budget, whose last
    chunk (4 tokens at a context of 194) is cheaper to serve by gathering queries than
    contexts, and a 23-token prompt arriving after it (when the others decode)."""
    return [1, 2 * pcp - 1, 2 * pcp, 2 * pcp + 1, 194, 23]


# (dcp_rest, decode, assignment, model, restore): at every size, each path with both
# decode modes, both models (MODELS index, rotated by pcp) and every interleave.
CASES = [
    ("queries", "replicated", "round_robin", 0, "all_rows"),
    ("queries", "sharded", "balanced", 1, "sampled_rows"),
    ("queries", "sharded", "round_robin", 0, "all_rows"),
    ("context", "replicated", "round_robin", 1, "sampled_rows"),
    ("context", "sharded", "round_robin", 0, "all_rows"),
    ("context", "replicated", "round_robin", 0, "all_rows"),
    ("auto", "sharded", "balanced", 0, "sampled_rows"),
    ("auto", "replicated", "round_robin", 1, "all_rows"),
    ("auto", "sharded", "round_robin", 1, "sampled_rows"),
]
MODELS = ("tiny_mla", "tiny_gqa")


def matrix(pcp: int) -> list[list[str]]:
    lens = prompt_lens(pcp)
    base = corner_case_workload(pcp) + [
        f"dcp={pcp}",
        f"kv.block_size={BLOCK}",
        f"workload.prompt_lens=[{','.join(map(str, lens))}]",
        "workload.arrival_steps=[0,0,1,1,2,11]",
    ]
    return [
        base
        + [
            f"pipeline.forward.dcp_rest={rest}",
            f"decode={d}",
            f"decode.assignment={a}",
            f"model={MODELS[(m + pcp) % 2]}",
            f"kv.interleave={INTERLEAVES[(j + pcp) % 3]}",
            f"pipeline.restore.kind={r}",
        ]
        for j, (rest, d, a, m, r) in enumerate(CASES)
    ]


for _pcp in (2, 3, 4):
    shared_ranks.matrix(f"cp_attention/pcp={_pcp}")(lambda p=_pcp: [compose(o) for o in matrix(p)])


@pytest.mark.dist
@pytest.mark.parametrize(
    "pcp",
    [
        pytest.param(2, marks=pytest.mark.matrix("cp_attention/pcp=2")),
        # NOTE: 9 runs each: CI's slow set (the default set has pcp=3 and 4 in test_engine).
        pytest.param(3, marks=[pytest.mark.matrix("cp_attention/pcp=3"), pytest.mark.slow]),
        pytest.param(4, marks=[pytest.mark.matrix("cp_attention/pcp=4"), pytest.mark.slow]),
    ],
)
def test_dcp_equals_pcp_matches_single_rank(pcp, shared_runs):
    runs = shared_runs[f"cp_attention/pcp={pcp}"]
    cfgs, results = [c for c, _ in runs], [r for _, r in runs]
    # Every generated token is fed back but the last: request r runs prompt + 5 tokens
    # through the model, a token at position p scores p + 1 keys in all, whichever path,
    # when every row lives on one rank (sharded decodes; replicated rows count per holder).
    lens = np.array(prompt_lens(pcp)) + OUTPUT_LEN - 1
    total_work = {"sharded": int((lens * (lens + 1) // 2).sum())}
    for cfg, result in zip(cfgs, results):
        assert_exact(cfg, result)
        rest = cfg.pipeline["forward"]["dcp_rest"]
        label = f"pcp={pcp} {rest} {cfg.decode.mode} {cfg.model.name} I={cfg.kv.interleave}"
        calls = result["metrics"]["collective_calls"]
        queries = calls.get("dcp_query_gather", 0)
        assert queries == calls.get("dcp_partials", 0), label
        contexts = calls.get("dcp_context_gather", 0)
        # Prefill chunks always need the other shards' KV: one path or the other, per
        # layer; auto takes each at least once on this workload.
        if rest == "queries":
            assert queries > 0 and contexts == 0, label
        elif rest == "context":
            assert contexts > 0 and queries == 0, label
        else:
            assert queries > 0 and contexts > 0, label
        if cfg.decode.mode == "replicated":
            assert calls.get("dcp_decode_partials", 0) > 0, label
        else:  # sharded decodes are rest rows
            assert "dcp_decode_partials" not in calls, label
        work = sum(result["metrics"]["per_rank_attention_work"])
        assert work == total_work.setdefault(cfg.decode.mode, work), label


@pytest.mark.parametrize("pcp", [2, 3, 4])
def test_matrix_covers_every_path_with_every_setting(pcp):
    seen = set()
    for overrides in matrix(pcp):
        opts = dict(o.split("=", 1) for o in overrides)
        rest = opts["pipeline.forward.dcp_rest"]
        seen |= {
            (rest, "decode", opts["decode"]),
            (rest, "model", opts["model"]),
            (rest, "interleave", opts["kv.interleave"]),
        }
    for rest in ("queries", "context", "auto"):
        want = {(rest, "decode", d) for d in ("replicated", "sharded")}
        want |= {(rest, "model", m) for m in MODELS}
        want |= {(rest, "interleave", str(i)) for i in INTERLEAVES}
        assert want <= seen, want - seen


def test_dcp_local_shard_sizes_add_up():
    """Each rank stores about 1/dcp of every context: the shard lengths of all ranks sum
    to the context and differ by at most the interleave (hand-checkable arithmetic)."""
    from pcpflow.layouts.slots import dcp_local_seq_lens

    seq_lens = np.arange(0, 200)
    for d in (2, 3, 4):
        for i in (1, 2, 6):
            shards = np.stack([dcp_local_seq_lens(seq_lens, d, r, i) for r in range(d)])
            assert (shards.sum(0) == seq_lens).all()
            assert (shards.max(0) - shards.min(0) <= i).all()
