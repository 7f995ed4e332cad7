"""disagg=pd executed: a prefill pool hands each request's KV to a decode pool, exact.

Every run is verified against the single rank (tokens, logits, and every rank of both pools
holding exactly what it owns, the decode ranks' handed-over entries included). The bytes
each handover moved are checked against what the decode ranks' layouts own, computed from
the layout rules (their DCP shards' positions, their TP slices' columns); a corrupted
transfer is caught. Drafting (mtp, self, dspark) runs across the pools as on one rank: the
same tokens, the same proposals at every (request, position) and the same acceptance as
the one-rank run without pools, the drafter's own cache of the prompt moved and counted
with the target's. Pools run in the session's shared ranks (tests/shared_ranks.py).
"""

from __future__ import annotations

import tempfile

import numpy as np
import pytest
import shared_ranks
from pcpflow_test_plugins import draft_probe

from pcpflow.config.disagg import pool_config
from pcpflow.layouts.slots import dcp_local_seq_lens
from pcpflow.models import build_model
from pcpflow.parallel.grid import Axis
from pcpflow.parallel.tensor_parallel import local_spec
from pcpflow.testing import compose

QUIET = ["output.plots=false", "output.progress=false", "kv.block_size=4"]
STEM = [(7 * j + 3) % 200 + 1 for j in range(16)]
# Prompts sharing a 16-token stem (prefix hits on the prefill pool: two blocks of 4 x dcp 2),
# arriving over a few steps, through pools too small to take them all at once: the queue
# holds prefill blocks while the decode pool is full, and the decode pool preempts.
FULL = [
    "workload=explicit",
    "workload.prompts=" + str([STEM + [50 + i, 9 * i + 1, 3] for i in range(5)] + [STEM[:11]]).replace(" ", ""),
    "workload.output_lens=[7,5,6,8,4,6]", "workload.arrival_steps=[0,0,1,3,4,4]",
    "kv.prefix_caching=true", "kv.num_blocks=7", "scheduler.max_num_batched_tokens=24",
    "disagg.decode_pool.num_blocks=6", "disagg.decode_pool.max_num_seqs=3",
]
CASES = {
    # the README's second command's geometry: prefill pcp=2 dcp=2 interleave 2, decode tp=2 dcp=2
    # interleave 1 (one decode block draws from both prefill ranks)
    "pcp2_dcp2_i2_to_tp2_dcp2_full": ["pcp=2", "dcp=2", "kv.interleave=2", "disagg=pd", "disagg.decode_pool.tp=2",
                                      "disagg.decode_pool.dcp=2", *FULL],
    # Meta's ring in the prefill pool (ring_auto: pass-KV or pass-Q step by step, over the prefix
    # hits' cached keys), its KV sharded over the ring as DCP shards it, to the decode pool above
    "ring_auto_pcp2_dcp2_to_tp2_dcp2_full": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_auto", "disagg=pd",
                                             "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2", *FULL],
    # a ring in the decode pool (ring_auto: Meta's rule, its sharded decodes and the prefills of
    # the requests it preempted and recomputes), behind an all-gather prefill pool
    "pcp2_to_pcp2_dcp2_decode_ring_full": ["pcp=2", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
                                           "disagg.decode_pool.cp_attention=ring_auto", "decode=sharded", *FULL],
}
SLOW = {
    "readme_pcp4_to_pcp2_dcp2": ["pcp=4", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2"],
    # GQA with 2 KV heads over a decode tp of 4: each head on two decode ranks, both receive it
    "gqa_pcp2_dcp2_to_tp4": ["model=tiny_gqa", "pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=4",
                             "disagg.transfer=after_prefill"],
    "tp2_pcp2_dcp4_to_tp2_dcp2_i2": ["tp=2", "pcp=2", "dcp=4", "disagg=pd", "disagg.decode_pool.tp=2",
                                     "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=2",
                                     "disagg.transfer=after_prefill"],
    "sharded_decodes_pcp2_dcp2": ["pcp=2", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
                                  "decode=sharded", *FULL],
    "gqa_tp2_to_pcp2_dcp2_i4_full": ["model=tiny_gqa", "tp=2", "pcp=1", "disagg=pd", "disagg.decode_pool.pcp=2",
                                     "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=4", *FULL],
}
FAULTS = "plugins=[pcpflow_test_plugins.faults]"
CORRUPT = ("+pipeline.extra=[{kind: 'pcpflow_test_plugins.faults:TransferFault', after: forward, rank: 3, step: 0, "
           "corrupt: true}]")


# Experts in both pools: every MoE layer of 3 (layer 0 dense), 4 experts, top 2; the pools' MoE
# counts are measured over each pool's own ranks (a pool's root alone once waited for the
# other ranks in an all-gather they never joined).
MOE_TOP_K, MOE_LAYERS = 2, 2
MOE_POOLS = ["pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2",
             "model.moe.num_experts=4", f"model.moe.top_k={MOE_TOP_K}", "model.moe.first_k_dense_replace=1",
             "model.num_layers=3", "workload=explicit", "workload.prompt_lens=[9,14,5]", "workload.output_lens=[4,3,2]"]


# The decode pool's budget and seats above the prefill pool's: its batches are legal by its own
# (the reference, which runs both pools' batches, once judged them by the prefill pool's)
BUDGETS = ["model=tiny_gqa", "workload=explicit", "workload.prompt_lens=[3,3,3,3,3,3]", "workload.output_lens=[12]",
           "workload.ignore_eos=true", "scheduler.max_num_batched_tokens=4", "scheduler.max_num_seqs=2", "disagg=pd",
           "disagg.decode_pool.max_num_batched_tokens=16", "disagg.decode_pool.max_num_seqs=6"]


EXACT = [*CASES, "corrupt", "moe", "budgets"]  # the matrix's runs, in order


def _exact_run(shared_runs, name: str):
    return shared_runs["disagg/exact"][EXACT.index(name)]


@shared_ranks.matrix("disagg/exact")
def _exact():
    cases = [compose([*QUIET, *o]) for o in CASES.values()]
    corrupt = compose([*QUIET, "pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2",
                       "workload=explicit", "workload.prompt_lens=[9,14]", "workload.output_lens=[3]", FAULTS, CORRUPT])
    return [*cases, corrupt, compose([*QUIET, *MOE_POOLS]), compose([*QUIET, *BUDGETS])]


@shared_ranks.matrix("disagg/exact-slow")
def _exact_slow():
    return [compose([*QUIET, *o]) for o in SLOW.values()]


# The shipped drafters' own caches, by hand: self a copy of the target's; mtp one MLA layer and
# dspark draft.num_layers (default 1) of them, each entry the latent (draft.layer.kv_lora_rank,
# default 32) and the rope key (qk_rope_head_dim, default 16), whole on every TP rank.
DRAFT_LATENT = 32 + 16


def owned_bytes(cfg, prompt_len: int) -> int:
    """What the decode pool's ranks own of a prompt's entries, from the layout rules: each
    rank's DCP shard of the positions x its TP slice's cache entry x layers x the dtype; a
    drafter's own cache the same way (its entry, its layers)."""
    d = pool_config(cfg, "decode")
    model = build_model(cfg.model, dtype=__import__("torch").float64, seed=0, device="meta")
    spec = model.attn_spec
    elem = {"float64": 8, "float32": 4, "bfloat16": 2}[cfg.dtype]
    draft = cfg.draft_stage_config().get("kind") if cfg.draft_enabled else None
    total = 0
    for r in range(d.grid.world_size):
        mine = int(dcp_local_seq_lens([prompt_len], d.dcp, d.grid.coords(r)[Axis.DCP], d.kv.interleave)[0])
        width = local_spec(spec, r % d.tp, d.tp).entry_dim if d.tp > 1 else spec.entry_dim
        total += mine * width * model.num_layers * elem
        if draft == "self":
            total += mine * width * model.num_layers * elem
        elif draft in ("mtp", "dspark"):
            total += mine * DRAFT_LATENT * elem
    return total


def check(cfg, result):
    assert result["verify"]["passed"], result["verify"]
    assert result["verify"]["kv_match"] and result["verify"]["num_token_mismatches"] == 0
    rows = result["requests"]
    handed = [r for r in rows if r["handover_step"] is not None]
    assert handed, "no request was handed over"
    for r in rows:
        if r["output_len"] > 1:
            # TTFT is the prefill pool's: its first token came before the handover
            assert r["handover_step"] > r["first_token_step"] and r["finish_step"] >= r["handover_step"]
        assert r["transfer_bytes"] == (owned_bytes(cfg, r["prompt_len"]) if r["handover_step"] is not None else 0)
    m = result["metrics"]
    assert m["transfer"]["bytes"] == sum(r["transfer_bytes"] for r in rows) == m["collective_bytes"]["kv_transfer"]
    assert m["transfer"]["requests"] == len(handed)
    assert m["pools"]["prefill"]["tokens"] + m["pools"]["decode"]["tokens"] == m["num_tokens"]
    assert 0 < m["pools"]["prefill"]["utilization"] <= 1 and 0 < m["pools"]["decode"]["utilization"] <= 1


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_both_pools_exact_and_each_decode_rank_receives_what_it_owns(shared_runs):
    cfg, result = _exact_run(shared_runs, "pcp2_dcp2_i2_to_tp2_dcp2_full")
    check(cfg, result)
    rows = result["requests"]
    # both pools full: some request waited for the decode pool holding its prefill blocks,
    # prefix hits were sent like any block, and the decode pool preempted (recomputed there)
    assert any(r["handover_step"] > r["first_token_step"] + 1 for r in rows if r["handover_step"] is not None)
    assert result["metrics"]["prefix_cache"]["hit_tokens"] >= 16
    assert sum(r["num_preemptions"] for r in rows) >= 1
    assert result["verify"]["positions_recomputed"] >= 16  # the prefix hits, recomputed by the reference


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_a_decode_pool_with_a_larger_budget_is_verified_by_its_own(shared_runs):
    cfg, result = _exact_run(shared_runs, "budgets")
    assert "error" not in result and result["verify"]["passed"], result.get("error") or result["verify"]
    assert len(result["outputs"]) == 6 and all(len(o) == 12 for o in result["outputs"])


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_a_corrupted_transfer_is_caught(shared_runs):
    _, result = _exact_run(shared_runs, "corrupt")
    assert not result["verify"]["passed"] and not result["verify"]["kv_match"]
    assert result["verify"]["kv_mismatched_slots"] >= 1


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_experts_in_both_pools(shared_runs):
    """Exact, and the MoE counts cover both pools by global rank: 4 rows (the prefill pool's
    two ranks, then the decode pool's two), each rank's experts fed, and every token the pools
    ran routed to its top 2 experts in each of the 2 MoE layers."""
    cfg, result = _exact_run(shared_runs, "moe")
    check(cfg, result)
    m = result["metrics"]
    rows = np.array(m["moe_expert_rows"])
    assert rows.shape == (4, 4) and (rows.sum(axis=1) > 0).all()
    assert sum(m["moe_tokens_per_expert"]) == MOE_TOP_K * MOE_LAYERS * m["num_tokens"]


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_a_ring_in_the_prefill_pool(shared_runs):
    """Exact with the ring in the prefill pool (prefix hits and preemptions as in the first
    case), its hops counted (ring_totals of every prefill rank's sends: one hop a layer of
    the 2-layer model per step at pcp=2); the decode pool ran its DCP path."""
    cfg, result = _exact_run(shared_runs, "ring_auto_pcp2_dcp2_to_tp2_dcp2_full")
    check(cfg, result)
    assert result["metrics"]["prefix_cache"]["hit_tokens"] >= 16
    m = result["metrics"]
    calls = m["collective_calls"]
    hops = calls.get("ring_send_kv", 0) + calls.get("ring_send_q", 0)
    assert hops > 0 and hops % 2 == 0, calls
    # every prefill batch ran the ring, every decode batch the DCP path
    ran = m["cp_attention_steps"]
    assert ran["allgather"] == m["pools"]["decode"]["steps"] > 0, ran
    assert ran.get("ring_pass_kv", 0) + ran.get("ring_pass_q", 0) == m["pools"]["prefill"]["steps"] > 0, ran


@pytest.mark.dist
@pytest.mark.matrix("disagg/exact")
def test_a_ring_in_the_decode_pool(shared_runs):
    """Exact with Meta's ring in the decode pool (disagg.decode_pool.cp_attention), preempting
    there as in the first case: every decode-pool batch ran a ring, every prefill batch the
    all-gather path, and the decode pool's ring moved bytes."""
    cfg, result = _exact_run(shared_runs, "pcp2_to_pcp2_dcp2_decode_ring_full")
    check(cfg, result)
    m = result["metrics"]
    assert sum(r["num_preemptions"] for r in result["requests"]) >= 1
    ran = m["cp_attention_steps"]
    assert ran["allgather"] == m["pools"]["prefill"]["steps"] > 0, ran
    assert ran.get("ring_pass_kv", 0) + ran.get("ring_pass_q", 0) == m["pools"]["decode"]["steps"] > 0, ran
    assert sum(m["collective_bytes"].get(p, 0) for p in ("ring_send_kv", "ring_send_q", "ring_all2all")) > 0


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("disagg/exact-slow")
def test_more_pools_exact(shared_runs):
    for cfg, result in shared_runs["disagg/exact-slow"]:
        check(cfg, result)


# -- drafting across the pools ----------------------------------------------------------------
# Prompts of 1 token, within a block, over the budget (chunked on the prefill pool), arriving
# over steps, more requests than the decode pool's seats (the queue holds them): no preemption,
# so that every request drafts where the one-rank run drafts.
DRAFT_WORKLOAD = ["workload=explicit", "workload.prompt_lens=[1,5,8,13,30]", "workload.output_lens=[7,6,7,5,7]",
                  "workload.arrival_steps=[0,0,1,2,3]", "scheduler.max_num_batched_tokens=20",
                  "scheduler.max_num_seqs=4", "dtype=float64"]
DECODE_SEATS = "disagg.decode_pool.max_num_seqs=3"
DRAFT_CASES = {
    "mtp_pcp2_to_pcp2_dcp2": ["draft=mtp", "pcp=2", "disagg=pd", "disagg.decode_pool.pcp=2",
                              "disagg.decode_pool.dcp=2"],
    # the target's own continuation: acceptance 1 only if the decode pool's copy of its cache is right
    "self_pcp2_dcp2_i2_to_tp2_dcp2_after_prefill": ["draft=self", "pcp=2", "dcp=2", "kv.interleave=2", "disagg=pd",
                                                    "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2",
                                                    "disagg.transfer=after_prefill"],
}
DRAFT_SLOW = {
    "dspark_tp2_to_pcp2_dcp2_i2": ["draft=dspark", "tp=2", "disagg=pd", "disagg.decode_pool.pcp=2",
                                   "disagg.decode_pool.dcp=2", "disagg.decode_pool.interleave=2"],
    # a GQA target (heads split over decode TP) and an MLA drafter (whole on every TP rank): two route sets
    "mtp_gqa_pcp2_to_tp2": ["model=tiny_gqa", "draft=mtp", "pcp=2", "disagg=pd", "disagg.decode_pool.tp=2"],
    # (draft.error_rate draws its corruption per step and batch row: a schedule's, not a request's)
    "dspark_gqa_tp2_to_pcp2_dcp2_i4_after_prefill": ["model=tiny_gqa", "draft=dspark", "tp=2", "disagg=pd",
                                                     "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
                                                     "disagg.decode_pool.interleave=4", "disagg.transfer=after_prefill"],
}
_PROBES: dict[str, str] = {}
PROBE = "pcpflow_test_plugins.draft_probe:DraftProbe"


def _probed(name: str, overrides: list[str]):
    _PROBES[name] = tempfile.mkdtemp(prefix=f"pcpflow-{name.replace('/', '-')}-")
    probe = f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{_PROBES[name]}'}}]"
    return compose([*QUIET, *DRAFT_WORKLOAD, *overrides, probe])


def _one_rank(overrides: list[str]) -> list[str]:
    """The one-rank run without pools of a pooled case: its model and drafter."""
    return ["pcp=1", *(o for o in overrides if o.startswith(("model=", "draft")))]


def _draft_matrix(cases):
    out = []
    for name, o in cases.items():
        out += [_probed(name, [*o, DECODE_SEATS]), _probed(f"{name}/one_rank", _one_rank(o))]
    return out


@shared_ranks.matrix("disagg/draft")
def _draft():
    return _draft_matrix(DRAFT_CASES)


@shared_ranks.matrix("disagg/draft-slow")
def _draft_slow():
    return _draft_matrix(DRAFT_SLOW)


def proposals(name: str) -> dict[tuple[int, int], list[int]]:
    return draft_probe.proposals(_PROBES[name])


DRAFT_COUNTS = ("draft_proposed", "draft_accepted", "draft_verify_rows", "acceptance_rate")


def check_drafting(name: str, pooled, one_rank) -> None:
    (cfg, result), (_, ref) = pooled, one_rank
    check(cfg, result)
    assert result["outputs"] == ref["outputs"], name
    assert sum(r["num_preemptions"] for r in result["requests"]) == 0, name
    got, want = proposals(name), proposals(f"{name}/one_rank")
    assert len(want) >= 10 and got == want, name
    m, w = result["metrics"], ref["metrics"]
    assert {k: m[k] for k in DRAFT_COUNTS} == {k: w[k] for k in DRAFT_COUNTS}, name
    assert all(r["handover_step"] is not None for r in result["requests"]), name


@pytest.mark.dist
@pytest.mark.matrix("disagg/draft")
def test_drafting_across_the_pools_is_the_one_rank_run(shared_runs):
    runs = shared_runs["disagg/draft"]
    for k, name in enumerate(DRAFT_CASES):
        check_drafting(name, runs[2 * k], runs[2 * k + 1])
    self_run = runs[2][1]["metrics"]
    assert self_run["acceptance_rate"] == 1.0  # the target's own continuation, from the moved cache


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("disagg/draft-slow")
def test_more_drafting_across_the_pools(shared_runs):
    runs = shared_runs["disagg/draft-slow"]
    for k, name in enumerate(DRAFT_SLOW):
        check_drafting(name, runs[2 * k], runs[2 * k + 1])
