"""A simulated run counts exactly what the executed run counts, step by step.

For configs small enough to execute on CPU ranks (tiny GQA and MLA models, pcp <= 4, DCP
with each named ``dcp_rest`` path, both decode modes, both restores, cached prefixes,
chunked prefills beside decodes, drafting), the executed run records each step's
per-rank tokens, attention pairs and collective calls and bytes by purpose (a probe stage
reading the rank's ``CommStats``); the simulated run of the same config must record the
same numbers for the same steps, and time the same requests over the same steps. Every
world size starts its ranks once (``pcpflow.testing.run``).

This is also the proof that a simulated run may skip the slot mappings: none of these
counts changes without them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from pcpflow_test_plugins import step_counts

from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose, run

REPO = Path(__file__).resolve().parents[2]

PROBE = "pcpflow_test_plugins.step_counts:StepCounts"
# Requests longer than the budget (chunked), shorter than 2P (replicated under DCP),
# staggered arrivals, cached prefixes (one cut by the budget), more requests than seats.
WORKLOAD = [
    "workload=explicit",
    "workload.prompt_lens=[5,19,33,3,26]",
    "workload.output_lens=[3,4,2,5,3]",
    "workload.arrival_steps=[0,0,1,2,4]",
    "workload.cached_lens=[0,7,20,0,25]",
    "scheduler.max_num_batched_tokens=16",
    "scheduler.max_num_seqs=4",
    "kv.num_blocks=64",
    "kv.block_size=4",
    "dtype=bfloat16",
    "threads_per_rank=1",
    "output.plots=false",
    "output.progress=false",
]
MOE = ["model=tiny_mla", "model.moe.num_experts=8", "model.moe.top_k=2"]
WINDOW = ["model=tiny_gqa", "model.window=5", "model.window_layers=[1]"]
CHUNKED = ["model=tiny_gqa", "model.window=5", "model.window_layers=[0]", "model.window_kind=chunked"]
# Serving: prompts sharing a stem (prefix hits) in a KV cache small enough to preempt, and a
# Mooncake trace replayed in steps whose hash blocks span whole KV blocks (the simulated run
# keys blocks by the trace's hash ids, the executed one by token ids).
STEM = [(5 * j + 1) % 256 for j in range(20)]
SERVING = [
    "workload.prompts=" + str([STEM + [90 + i, 3 * i] for i in range(4)] + [STEM[:13]]).replace(" ", ""),
    "workload.output_lens=[6]", "workload.arrival_steps=[0,1,1,3,4]", "workload.cached_lens=null",
    "kv.prefix_caching=true",
]
TRACE = [
    "workload=trace", "workload.path=" + str(REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"),
    "workload.max_requests=10", "workload.length_scale=0.015625", "workload.output_len_cap=5",
    "workload.step_ms=1000", "kv.prefix_caching=true", "kv.num_blocks=128",
]
CASES = {
    "pcp1_gqa": ["pcp=1", "model=tiny_gqa"],
    "pcp2_replicated": ["pcp=2", "decode=replicated"],
    "pcp2_dcp2_context_verified": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context", "verify=true"],
    "pcp2_dcp2_queries_gqa": ["pcp=2", "dcp=2", "model=tiny_gqa", "pipeline.forward.dcp_rest=queries", "kv.interleave=2"],
    "pcp4_dcp4_sharded_queries": ["pcp=4", "dcp=4", "decode=sharded", "pipeline.forward.dcp_rest=queries"],
    "pcp4_sampled_rows_balanced": ["pcp=4", "decode=sharded", "decode.assignment=balanced",
                                   "pipeline.restore.kind=sampled_rows", "model=tiny_gqa"],
    "pcp3_dcp3_context": ["pcp=3", "dcp=3", "pipeline.forward.dcp_rest=context"],
    # Tensor parallelism: TP all-reduces, DCP inside PCP, and DCP over TP ranks (both backends).
    "tp2_dcp2_ag_rs": ["tp=2", "pcp=1", "dcp=2", "dcp_comm_backend=ag_rs"],
    "tp2_pcp2_gqa": ["tp=2", "pcp=2", "model=tiny_gqa", "decode=sharded"],
    "tp2_pcp2_dcp2_context": ["tp=2", "pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context"],
    "tp2_pcp2_dcp4_ag_rs": ["tp=2", "pcp=2", "dcp=4", "dcp_comm_backend=ag_rs"],
    "tp2_pcp2_dcp4_a2a": ["tp=2", "pcp=2", "dcp=4", "dcp_comm_backend=a2a", "decode=sharded"],
    "tp2_dcp2_a2a_sampled_rows": ["tp=2", "pcp=1", "dcp=2", "dcp_comm_backend=a2a", "pipeline.restore.kind=sampled_rows"],
    "tp2_pcp2_dcp2_queries_a2a": ["tp=2", "pcp=2", "dcp=2", "dcp_comm_backend=a2a", "pipeline.forward.dcp_rest=queries"],
    # OLMo 2's q/k norms over the whole projection: two all-reduces a layer (tp_qk_norm), KV heads shared
    # by both TP ranks (each sum counted once), and the target drafting with its own layers
    "tp2_pcp2_full_qk_norm_gqa": ["tp=2", "pcp=2", "dcp=2", "model=tiny_gqa", "model.qk_norm=full", "model.num_kv_heads=1",
                                  "pipeline.forward.dcp_rest=queries"],
    "tp2_pcp2_full_qk_norm_self_draft": ["tp=2", "pcp=2", "model=tiny_gqa", "model.qk_norm=full", "draft=self",
                                         "draft.error_rate=0.3", "decode=sharded"],
    # Mixture of experts, each dispatch (all_to_all bytes follow the router: see expected_bytes).
    "moe_local_pcp2": ["pcp=2", *MOE, "moe.dispatch=local"],
    "moe_gather_pcp2": ["pcp=2", "dcp=2", *MOE, "moe.dispatch=gather", "pipeline.forward.dcp_rest=context"],
    "moe_all_to_all_pcp2": ["pcp=2", *MOE, "moe.dispatch=all_to_all", "decode=sharded"],
    "moe_all_to_all_tp2_pcp2": ["tp=2", "pcp=2", *MOE, "moe.dispatch=all_to_all"],
    "moe_gather_tp2_pcp2_dcp4": ["tp=2", "pcp=2", "dcp=4", *MOE, "moe.dispatch=gather"],
    "moe_local_tp2_dcp2": ["tp=2", "pcp=1", "dcp=2", *MOE, "moe.dispatch=local"],
    # Serving: prefix hits, preemptions and the blocks in use, step by step.
    "serving_pcp2_dcp2_preempted": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context", *SERVING,
                                    "kv.num_blocks=8"],
    "serving_pcp1_preempted_gqa": ["pcp=1", "model=tiny_gqa", *SERVING, "kv.num_blocks=14"],
    "serving_trace_pcp2": ["pcp=2", *TRACE],
    # Sampling: one prompt thrice, whose outputs differ (the simulated run keys the blocks
    # holding them by request, not by prompt as greedy ones).
    "serving_pcp1_sampled_preempted": ["pcp=1", "workload.prompts=" + str([STEM[:16]] * 3).replace(" ", ""),
                                       "workload.output_lens=[12]", "workload.arrival_steps=[0,1,1]",
                                       "workload.cached_lens=null", "kv.prefix_caching=true", "kv.num_blocks=12",
                                       "sampling.temperature=0.8"],
    "serving_trace_sampled_preempted": ["pcp=1", *TRACE, "workload.max_requests=3", "workload.output_len_cap=12", "kv.num_blocks=12",
                                        "workload.path=" + str(REPO / "tests" / "simulate" / "data" / "one_prompt_thrice.jsonl"),
                                        "sampling.temperature=0.8"],
    # Rings (pipeline.forward.cp_attention): every variant, both decode modes, both models, an
    # interleave, a ring of three, TP beside it, MoE beside it.
    "pcp2_dcp2_ring_pass_kv": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"],
    "pcp2_dcp2_ring_pass_q_sharded_gqa": ["pcp=2", "dcp=2", "decode=sharded", "model=tiny_gqa", "kv.interleave=2",
                                          "pipeline.forward.cp_attention=ring_pass_q"],
    "pcp3_dcp3_ring_auto": ["pcp=3", "dcp=3", "pipeline.forward.cp_attention=ring_auto"],
    "tp2_pcp2_dcp2_ring_auto_gqa": ["tp=2", "pcp=2", "dcp=2", "model=tiny_gqa", "decode=sharded",
                                    "pipeline.forward.cp_attention=ring_auto"],
    "moe_gather_pcp2_ring_pass_q": ["pcp=2", "dcp=2", *MOE, "moe.dispatch=gather", "pipeline.forward.cp_attention=ring_pass_q"],
    # simulate.cp_decode=ring_pass_q's two halves: the engine's steps, and the ring's
    "pcp2_dcp2_sharded": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=queries"],
    "pcp2_dcp2_sharded_ring_pass_q": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q"],
    # Drafting: self (its executed corruptions, drawn alike), and MTP / DSpark whose random weights
    # propose drafts the target never samples here (simulated: acceptance 0, SIM_ONLY); every
    # drafter under TP, DCP over TP, both DCP backends, MoE beside it, prefix hits (MTP's entries
    # read the next token: the blocks they give up are the scheduler's to count alike).
    "pcp2_dcp2_self_draft": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context", "draft=self",
                             "draft.error_rate=0.3"],
    "serving_pcp2_dcp2_mtp_draft": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", *SERVING, "draft=mtp"],
    "tp2_pcp2_dcp4_mtp_draft_a2a": ["tp=2", "pcp=2", "dcp=4", "dcp_comm_backend=a2a", "decode=sharded", "draft=mtp",
                                    "draft.num_speculative_tokens=3"],
    "tp2_pcp2_dcp2_dspark_draft": ["tp=2", "pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context", "draft=dspark"],
    "tp2_dcp2_dspark_draft_ag_rs": ["tp=2", "pcp=1", "dcp=2", "dcp_comm_backend=ag_rs", "draft=dspark",
                                    "draft.num_speculative_tokens=3"],
    "moe_gather_tp2_pcp2_self_draft": ["tp=2", "pcp=2", *MOE, "moe.dispatch=gather", "draft=self", "draft.error_rate=0.2"],
    "pcp4_replicated_self_draft_gqa": ["pcp=4", "decode=replicated", "model=tiny_gqa", "kv.interleave=2", "draft=self",
                                       "draft.error_rate=0.4"],
    # A sliding window (5 keys) on layer 1 of tiny GQA: one sliding layer's pairs every step too
    # (per_rank_window_attention_work), on each all-gather path and through a ring.
    "pcp2_window_gqa": ["pcp=2", "decode=sharded", *WINDOW],
    "pcp2_dcp2_queries_window_gqa": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", "kv.interleave=2", *WINDOW],
    "pcp2_dcp2_context_window_gqa": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context", *WINDOW],
    "pcp2_dcp2_ring_pass_kv_window_gqa": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv", *WINDOW],
    # Chunked attention (Llama 4's; chunks of 5 on layer 0): one chunked layer's pairs every step,
    # on each all-gather path, through both rings and in the drafter's own layers.
    "pcp2_chunked_gqa": ["pcp=2", "decode=sharded", *CHUNKED],
    "pcp2_dcp2_queries_chunked_gqa": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", "kv.interleave=2",
                                      *CHUNKED],
    "pcp2_dcp2_context_chunked_gqa": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context",
                                      *CHUNKED],
    "pcp2_dcp2_ring_pass_kv_chunked_gqa": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv", *CHUNKED],
    "pcp2_dcp2_ring_pass_q_chunked_gqa": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q",
                                          *CHUNKED],
    "pcp2_dcp2_self_draft_chunked_gqa": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=queries",
                                         "draft=self", "draft.error_rate=0.3", *CHUNKED],
}
SIM_ONLY = {name: ["simulate.draft_acceptance=[0.0]"] for name in CASES if "draft=mtp" in CASES[name]
            or "draft=dspark" in CASES[name]}
"""What only the simulated run of a case is given: the acceptance of drafters without an error model."""
TIMED = ("arrival_step", "first_token_step", "finish_step", "ttft_steps", "tpot_steps", "output_len")


DEFAULT = {"pcp1_gqa", "pcp2_replicated", "pcp2_dcp2_context_verified", "pcp2_dcp2_queries_gqa",
           "tp2_dcp2_ag_rs", "moe_gather_pcp2", "moe_all_to_all_pcp2", "moe_local_tp2_dcp2",
           "serving_pcp2_dcp2_preempted", "serving_trace_pcp2", "serving_pcp1_sampled_preempted",
           "serving_trace_sampled_preempted", "pcp2_dcp2_ring_pass_kv", "pcp2_dcp2_self_draft",
           "pcp2_dcp2_context_window_gqa", "pcp2_dcp2_ring_pass_kv_window_gqa"}
SLOW = set(CASES) - DEFAULT
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]


class Runs:
    """Both runs of every selected case, made per world size on first use (one spawn each)."""

    def __init__(self, tmp_path_factory, selected: set[str]) -> None:
        self.tmp, self.done, self.selected = tmp_path_factory, {}, selected | FIXED

    def __getitem__(self, name):
        if name not in self.done:
            self._run([n for n in CASES if _world(n) == _world(name) and (n in self.selected or n == name)])
        return self.done[name]

    def _run(self, names) -> None:
        cfgs, paths, dirs, sims = [], [], [], {}
        for name in names:
            extra = CASES[name]
            path = self.tmp.mktemp(name) / "steps.jsonl"
            verify = [] if "verify=true" in extra or name.startswith("serving") else ["verify=false"]
            probe = f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{path}'}}]"
            base = _base(name)
            cfgs.append(compose(base + verify + extra + [probe]))
            paths.append(path)
            dirs.append(path.parent if _ring(name) or _window(name) else None)
            # NOTE: the same prefix caching in both runs (executed runs default to off, simulated to on)
            caching = [] if "kv.prefix_caching=true" in extra else ["kv.prefix_caching=false"]
            sim = SimulatedRun(compose(base + [e for e in extra if e != "verify=true"] + caching
                                       + SIM_ONLY.get(name, []) + ["mode=simulate", "hardware=h100_sxm"]))
            sims[name] = (sim, sim.run())
        for name, res, p, d in zip(names, run(cfgs, run_dirs=dirs), paths, dirs):
            self.done[name] = (res, step_counts.executed_steps(p, d), *sims[name])


def _ring(name: str) -> bool:
    return any(o.startswith("pipeline.forward.cp_attention=ring") for o in CASES[name])


def _window(name: str) -> bool:
    """A model with a sliding or chunked layer: its pairs are read from the executed run's metrics.jsonl."""
    return any(o.startswith("model.window=") for o in CASES[name])


def _base(name: str) -> list[str]:
    """WORKLOAD, or (a case choosing another workload) its settings outside ``workload``."""
    if "workload=trace" in CASES[name]:
        return [o for o in WORKLOAD if not o.startswith("workload")]
    return WORKLOAD


def _axis(name: str, axis: str) -> int:
    return next((int(o.split("=")[1]) for o in CASES[name] if o.startswith(f"{axis}=")), 1)


def _world(name: str) -> int:
    return _axis(name, "tp") * _axis(name, "pcp")


def _dcp_over_tp(name: str) -> bool:
    """DCP spanning TP ranks: the probe counts pairs per DCP shard (``ctx.dcp_size``), the
    engine and the simulator per PCP rank (``grid.layout_dcp``); the totals are compared."""
    return _axis(name, "dcp") > _axis(name, "pcp")  # dcp in {1, pcp, tp*pcp}, or dcp | tp at pcp=1


def _counted(record: dict, expected: set) -> dict:
    """Bytes by purpose but those a simulation can only expect (all_to_all MoE routing)."""
    return {k: v for k, v in record.items() if k not in expected}


FIXED = {"pcp2_dcp2_context_verified", "pcp2_replicated"}  # read by the tests without a case parameter


@pytest.fixture(scope="module")
def both(tmp_path_factory, request):
    here = request.node.nodeid.split("::")[0]
    selected = {item.callspec.params["name"] for item in request.session.items
                if item.nodeid.startswith(here) and hasattr(item, "callspec") and "name" in item.callspec.params}
    return Runs(tmp_path_factory, selected)


@pytest.mark.parametrize("name", NAMES)
def test_every_step_counts_the_same(both, name):
    _, executed_steps, sim, _ = both[name]
    assert not step_counts.mismatches(sim.records, executed_steps, ring=_ring(name), dcp_over_tp=_dcp_over_tp(name))
    if _ring(name):  # the ring ran, every step, and the all-gather paths never did
        assert all(s["cp_attention"].startswith("ring_") for s in executed_steps), name
        assert not {p for s in executed_steps for p in s["collective_calls"] if p.startswith(("kv_gather", "dcp_"))}


@pytest.mark.parametrize("name", NAMES)
def test_same_requests_over_the_same_steps(both, name):
    executed, _, _, simulated = both[name]
    for ex, si in zip(executed["requests"], simulated["requests"]):
        assert {k: si[k] for k in TIMED} == {k: ex[k] for k in TIMED}
    m_ex, m_si = executed["metrics"], simulated["metrics"]
    expected = set(m_si["simulate"]["expected_bytes"])
    for key in ("num_steps", "num_tokens", "per_rank_tokens", "per_rank_attention_work", "collective_calls"):
        assert m_si[key] == m_ex[key], key
    assert m_si.get(step_counts.WINDOW) == m_ex.get(step_counts.WINDOW)
    if _window(name):  # the window (5 keys, or chunks of 5) cuts the longer prompts' rows: fewer pairs than a full layer's
        assert sum(m_ex[step_counts.WINDOW]) < sum(m_ex["per_rank_attention_work"])
    assert _counted(m_si["collective_bytes"], expected) == _counted(m_ex["collective_bytes"], expected)


DRAFTING = [n for n in NAMES if "draft" in (n if isinstance(n, str) else n.values[0])]


@pytest.mark.parametrize("name", DRAFTING)
def test_drafting_verifies_and_accepts_what_the_executed_run_did(both, name):
    """The simulated run proposes, verifies and accepts as many drafts as the executed run
    (``self``: its corruptions drawn alike; MTP / DSpark: none accepted, the executed run's
    random drafter accepting none either), and its draft stage counts the same collectives
    (``draft_*`` purposes; ``self``'s layers' TP all-reduces under the target's)."""
    executed, steps, _, simulated = both[name]
    m_ex, m_si = executed["metrics"], simulated["metrics"]
    for key in ("draft_proposed", "draft_accepted", "draft_steps", "draft_verify_rows"):
        assert m_si[key] == m_ex[key], key
    assert m_ex["draft_proposed"] > 0 and any(p.startswith("draft_") for p in m_ex["collective_calls"])
    if "draft=self" in CASES[name]:
        assert 0 < m_ex["draft_accepted"] < m_ex["draft_proposed"], "the corruptions reject some drafts, not all"


@pytest.mark.parametrize("name", [n for n in NAMES if (n if isinstance(n, str) else n.values[0]).startswith("serving")])
def test_serving_cases_reuse_and_preempt(both, name):
    """The serving cases exercise what they are for (hits; preemptions with few blocks),
    and the executed side is exact."""
    executed, steps, _, _ = both[name]
    assert executed["verify"]["passed"], name
    assert sum(s["prefix_hit_tokens"] for s in steps) >= 12, name
    if "preempted" in name:
        assert sum(s["num_preempted"] for s in steps) >= 1, name


@pytest.mark.slow
def test_ring_auto_ran_both_variants(both):
    """The workload's cached prefixes (0 to 25 of 33 tokens) take Meta's rule both ways."""
    _, executed_steps, sim, _ = both["pcp3_dcp3_ring_auto"]
    assert {s["cp_attention"] for s in executed_steps} == {"ring_pass_kv", "ring_pass_q"}


@pytest.mark.slow
def test_decode_ring_counts_the_executed_rings_decode_steps(both):
    """``simulate.cp_decode=ring_pass_q``: a step of decodes only counts what the executed
    ring pass-Q counts for it, every other step what the engine's paths count (the schedule
    does not depend on the attention's path: both executed runs take the same steps)."""
    _, engine, _, _ = both["pcp2_dcp2_sharded"]
    _, ring, _, _ = both["pcp2_dcp2_sharded_ring_pass_q"]
    sim = SimulatedRun(compose(WORKLOAD + CASES["pcp2_dcp2_sharded"] + ["kv.prefix_caching=false",
                               "simulate.cp_decode=ring_pass_q", "mode=simulate", "hardware=h100_sxm"]))
    sim.run()
    assert [s["step"] for s in engine] == [s["step"] for s in ring] == [r["step"] for r in sim.records]
    kinds = set()
    for e, r, si in zip(engine, ring, sim.records):
        ex = r if si["cp_attention"] == "ring_pass_q" else e
        kinds.add(si["cp_attention"])
        for key in step_counts.COUNTED:
            assert si.get(key) == ex[key], (ex["step"], key)
    assert kinds == {"allgather", "ring_pass_q"}


def test_cached_prefix_executes_exactly(both):
    """The executed continued prefill (cached prefix first, then the rest) is exact."""
    executed, steps, _, _ = both["pcp2_dcp2_context_verified"]
    assert executed["verify"]["passed"]
    assert any(s["dcp_rest"] == "context" for s in steps)


def test_simulated_run_is_not_verified(both):
    _, _, sim, simulated = both["pcp2_replicated"]
    assert sim.cfg.verify is False
    assert "nothing to verify" in simulated["verification"]


def test_routed_bytes_are_expected_not_counted(both):
    """all_to_all MoE: every call is counted exactly, and the bytes that follow the router
    are flagged; uniform top-2-of-8 routing over 2 ranks expects 1 - C(4,2)/C(8,2) = 11/14
    of the real rows to cross, and a seeded tiny router is not far from uniform."""
    executed, _, sim, simulated = both["moe_all_to_all_pcp2"]
    assert simulated["metrics"]["simulate"]["expected_bytes"] == ["moe_dispatch", "moe_combine"]
    assert all(r["expected_bytes"] == ["moe_dispatch", "moe_combine"] for r in sim.records)
    ex, si = executed["metrics"]["collective_bytes"], simulated["metrics"]["collective_bytes"]
    for purpose in ("moe_dispatch", "moe_combine"):
        assert 0.8 < si[purpose] / ex[purpose] < 1.25, purpose  # measured: 1.02
