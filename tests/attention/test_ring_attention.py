"""pcpflow.attention.ring: ring attention (pass-KV, pass-Q, Meta's rule) over a KV cache
sharded over the ring is exact, and counted as ``pcpflow.layouts.accounting`` says.

Each run's workload holds, for a prompt of L tokens, one request per cached-prefix size
from none to all-but-one token (``workload.cached_lens = 0..L-1``: each prefix prefilled
first, then continued), and a longer prompt with a cached prefix whose continuation is
chunked under the token budget while the others decode (chunked prefills beside decodes).
Short continuations are replicated under DCP, long ones split, so every row kind of the
ring (rows every rank holds, rows whose queries stay, rows whose queries travel) runs.

Every run must pass pcpflow's verification in float64 (logits and tokens equal the single
rank's, every rank's KV cache holds exactly the entries of the positions it owns), its tokens
must be the dense reference's, and, on every rank and every step, what the rank's rings sent
(calls and bytes of ``ring_send_kv``, ``ring_send_q``, ``ring_all2all``) must equal
``ring_step_traffic`` recomputed here from the step's batch alone; the run's totals and
per-rank figures in ``result.json`` must be their sums.
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import shared_ranks
from exactness import dense_reference_agrees
from pcpflow_test_plugins import ring_counts

from pcpflow.layouts.accounting import RING_PURPOSES, ModelShape, ring_step_traffic
from pcpflow.layouts.layout import plan_layout
from pcpflow.testing import compose

OUTPUT_LEN = 3
BLOCK = 4  # interleave in {1, 2, 4} must divide it
COUNTS = "pcpflow_test_plugins.ring_counts:RingCounts"


def workload(pcp: int) -> tuple[list[int], list[int]]:
    """(prompt lengths, cached lengths): every cached size of a (4P+1)-token prompt, and a
    60-token prompt with 25 cached whose 35-token continuation exceeds the 32-token budget."""
    short = 4 * pcp + 1
    return [short] * short + [60], list(range(short)) + [25]


def overrides(pcp: int, *extra: str, tp: int = 1) -> list[str]:
    prompts, cached = workload(pcp)
    folder = tempfile.mkdtemp(prefix="pcpflow-ring-counts-")
    return [
        f"pcp={pcp}", f"dcp={pcp}", f"tp={tp}", "workload=explicit", "dtype=float64",
        f"workload.prompt_lens=[{','.join(map(str, prompts))}]",
        f"workload.cached_lens=[{','.join(map(str, cached))}]",
        f"workload.output_lens=[{OUTPUT_LEN}]",
        "scheduler.max_num_batched_tokens=32", "scheduler.max_num_seqs=4", f"kv.block_size={BLOCK}",
        "plugins=[pcpflow_test_plugins.ring_counts]",
        f"+pipeline.extra=[{{kind: '{COUNTS}', after: forward, dir: '{folder}'}}]",
        *extra,
    ]


def case(variant: str, decode: str, model: str, interleave: int) -> list[str]:
    return [f"pipeline.forward.cp_attention=ring_{variant}", f"decode={decode}", f"model={model}",
            f"kv.interleave={interleave}"]


# At every pcp, each variant with both decode modes, both models and every interleave
# across the sizes. The default set runs one case per variant, at pcp 2 and 3 (a ring of
# three is the smallest where a hop forwards what it received).
CASES = {
    2: [case("pass_kv", "replicated", "tiny_mla", 1), case("pass_q", "sharded", "tiny_gqa", 2),
        case("auto", "sharded", "tiny_mla", 4), case("auto", "replicated", "tiny_gqa", 1)],
    3: [case("pass_kv", "replicated", "tiny_mla", 1), case("pass_kv", "sharded", "tiny_gqa", 2),
        case("pass_q", "replicated", "tiny_gqa", 4), case("pass_q", "sharded", "tiny_mla", 1),
        case("auto", "replicated", "tiny_mla", 2), case("auto", "sharded", "tiny_gqa", 4)],
    4: [case("pass_kv", "sharded", "tiny_mla", 4), case("pass_kv", "replicated", "tiny_gqa", 1),
        case("pass_q", "sharded", "tiny_gqa", 2), case("pass_q", "replicated", "tiny_mla", 4),
        case("auto", "sharded", "tiny_mla", 1), case("auto", "replicated", "tiny_gqa", 2)],
}
DEFAULT = [(2, 0), (2, 1), (3, 5)]  # (pcp, index in CASES[pcp])


@shared_ranks.matrix("ring/default")
def _default():
    return [compose(overrides(p, *CASES[p][i])) for p, i in DEFAULT]


for _pcp, _cases in CASES.items():
    shared_ranks.matrix(f"ring/pcp={_pcp}")(
        lambda p=_pcp, cs=_cases: [compose(overrides(p, *c)) for i, c in enumerate(cs) if (p, i) not in DEFAULT]
    )


@shared_ranks.matrix("ring/tp=2")
def _tp2():
    return [compose(overrides(2, *case(v, d, m, i), tp=2)) for v, d, m, i in
            [("pass_kv", "sharded", "tiny_gqa", 1), ("pass_q", "replicated", "tiny_mla", 2),
             ("auto", "replicated", "tiny_gqa", 4)]]


@shared_ranks.matrix("ring/draft")
def _drafting():
    return [
        compose(overrides(2, *case("auto", "replicated", "tiny_mla", 1), "draft=mtp")),
        compose(overrides(3, *case("pass_q", "sharded", "tiny_gqa", 2), "draft=self", "draft.error_rate=0.3")),
        compose(overrides(3, *case("pass_kv", "replicated", "tiny_mla", 4), "draft=dspark")),
        compose(overrides(2, *case("pass_q", "sharded", "tiny_mla", 2), "draft=self")),
    ]


def assert_exact(cfg, result, label) -> None:
    v = result["verify"]
    assert v["passed"] and v["tokens_match"] and v["kv_match"] and v["num_token_mismatches"] == 0, (label, v)
    assert v["max_abs_logit_diff"] <= 1e-9 and v["max_abs_kv_diff"] <= 1e-9, label
    assert v["num_steps_checked"] == result["metrics"]["num_steps"], label
    assert all(len(o) == OUTPUT_LEN for o in result["outputs"]), label
    assert dense_reference_agrees(cfg, result), f"{label}: tokens differ from the dense reference"


def assert_counted(cfg, result, label) -> None:
    """Every rank, every step: what it sent == ring_step_traffic from the batch alone."""
    folder = next(e["dir"] for e in cfg.pipeline["extra"] if e["kind"] == COUNTS)
    steps = ring_counts.read(folder)
    assert len(steps) == result["metrics"]["num_steps"], label
    world = cfg.tp * cfg.pcp
    per_rank_total = {p: np.zeros(world, dtype=np.int64) for p in RING_PURPOSES}
    calls_total, bytes_total = {}, {}
    for step, lines in steps.items():
        assert sorted(x["rank"] for x in lines) == list(range(world)), (label, step)
        x = lines[0]
        q, c = np.array(x["num_scheduled"]), np.array(x["num_computed"])
        layout = plan_layout(q, np.array(x["is_prefilling"]), pcp_size=cfg.pcp, dcp_size=cfg.pcp,
                             shard_decodes=cfg.decode.mode == "sharded", num_computed_tokens=c,
                             decode_assignment=x["decode_assignment"], padded_num_tokens=x["padded_num_tokens"])
        positions = np.repeat(c, q) + np.arange(q.sum()) - np.repeat(np.cumsum(q) - q, q)
        entry, heads, qk, dv, dtype_bytes, layers = x["shape"]
        shape = ModelShape(hidden_size=0, num_layers=layers, entry_dim=entry, num_heads=heads, qk_dim=qk,
                           v_dim=dv, dtype_bytes=dtype_bytes)
        want = ring_step_traffic(layout, positions, variant=x["cp_attention"].removeprefix("ring_"), shape=shape,
                                 interleave=cfg.kv.interleave, tp_size=cfg.tp)
        for line in lines:
            r = line["rank"]
            got = {p: tuple(line["sent"].get(p, (0, 0))) for p in RING_PURPOSES}
            assert got == {p: (int(want.calls[p][r]), int(want.bytes[p][r])) for p in RING_PURPOSES}, (label, step, r)
        for p in RING_PURPOSES:
            per_rank_total[p] += want.bytes[p]
        c_, b_ = want.totals()
        for p in c_:
            calls_total[p] = calls_total.get(p, 0) + c_[p]
            bytes_total[p] = bytes_total.get(p, 0) + b_[p]
    m = result["metrics"]
    assert {p: m["per_rank_collective_bytes"][p] for p in RING_PURPOSES} == {
        p: v.tolist() for p, v in per_rank_total.items()}, label
    assert {p: m["collective_calls"][p] for p in calls_total} == calls_total, label
    assert {p: m["collective_bytes"][p] for p in bytes_total} == bytes_total, label
    assert not {p for p in m["collective_calls"] if p.startswith(("kv_gather", "dcp_"))}, label  # no all-gather path


def check(runs, *, drafting: bool = False) -> None:
    for cfg, result in runs:
        policy = cfg.pipeline["forward"]["cp_attention"]
        label = f"pcp={cfg.pcp} tp={cfg.tp} {policy} {cfg.decode.mode} {cfg.model.name} I={cfg.kv.interleave}"
        assert_exact(cfg, result, label)
        assert_counted(cfg, result, label)
        ran = result["metrics"]["cp_attention_steps"]
        if policy == "ring_auto":  # Meta's rule takes each side on this workload
            assert set(ran) == {"ring_pass_kv", "ring_pass_q"}, (label, ran)
        else:
            assert set(ran) == {policy}, (label, ran)
        if not drafting:
            # every token fed (prompt + all outputs but the last) scores position + 1 keys
            n = np.array(workload(cfg.pcp)[0]) + OUTPUT_LEN - 1
            assert sum(result["metrics"]["per_rank_attention_work"]) == int((n * (n + 1) // 2).sum()), label


@pytest.mark.dist
@pytest.mark.matrix("ring/default")
def test_rings_match_single_rank_and_count_as_accounting_says(shared_runs):
    check(shared_runs["ring/default"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.parametrize("pcp", [pytest.param(p, marks=pytest.mark.matrix(f"ring/pcp={p}")) for p in sorted(CASES)])
def test_rings_match_single_rank_at_every_size(pcp, shared_runs):
    check(shared_runs[f"ring/pcp={pcp}"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("ring/tp=2")
def test_rings_beside_tensor_parallel(shared_runs):
    check(shared_runs["ring/tp=2"])


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("ring/draft")
def test_rings_with_drafting(shared_runs):
    check(shared_runs["ring/draft"], drafting=True)


@pytest.mark.parametrize("pcp", sorted(CASES))
def test_matrix_covers_every_variant_decode_mode_model_and_interleave(pcp):
    seen = {tuple(c) for c in CASES[pcp]}
    opts = [dict(o.split("=", 1) for o in c) for c in seen]
    variants = {o["pipeline.forward.cp_attention"] for o in opts}
    assert variants == {"ring_pass_kv", "ring_pass_q", "ring_auto"}
    if pcp > 2:  # pcp=2: one decode mode per variant, the rest at 3 and 4
        for v in variants:
            mine = [o for o in opts if o["pipeline.forward.cp_attention"] == v]
            assert {o["decode"] for o in mine} == {"replicated", "sharded"}
        assert {o["model"] for o in opts} == {"tiny_mla", "tiny_gqa"}
        assert {o["kv.interleave"] for o in opts} == {"1", "2", "4"}


def test_workload_has_every_cached_size_and_a_chunked_continuation():
    for pcp in CASES:
        prompts, cached = workload(pcp)
        short = prompts[0]
        assert cached[:short] == list(range(short)) and prompts[-1] - cached[-1] > 32


@pytest.mark.dist
@pytest.mark.slow
def test_bench_ring_runs_every_path_and_reports_what_ran():
    from repo_scripts import load_script

    text = load_script("bench_ring").main(["--lengths", "64", "--repeats", "1"])
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    ran = {(r[0].strip("| "), r[2]): r[3] for r in rows}
    assert len(rows) == 3 * 4
    assert ran[("prefill", "ring_auto")] == "pass_kv"  # nothing cached: Meta's rule passes KV
    assert ran[("cached", "ring_auto")] == "pass_q"  # 4 new of 64 tokens (6%) < 1/4 (tiny_mla)
    assert ran[("decode", "ring_pass_kv")] == "pass_kv" and ran[("prefill", "allgather")] == "allgather"
