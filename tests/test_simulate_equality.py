"""A simulated run counts exactly what the executed run counts, step by step.

For configs small enough to execute on CPU ranks (tiny GQA and MLA models, pcp <= 4, DCP
with each named ``dcp_rest`` path, both decode modes, both restores, cached prefixes,
chunked prefills beside decodes, no drafting), the executed run records each step's
per-rank tokens, attention pairs and collective calls and bytes by purpose (a probe stage
reading the rank's ``CommStats``); the simulated run of the same config must record the
same numbers for the same steps, and time the same requests over the same steps. Every
world size starts its ranks once (``pcpflow.testing.run``).

This is also the proof that a simulated run may skip the slot mappings: none of these
counts changes without them.
"""

from __future__ import annotations

import pytest
from pcpflow_test_plugins import step_counts

from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose, run

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
CASES = {
    "pcp1_gqa": ["pcp=1", "model=tiny_gqa"],
    "pcp2_replicated": ["pcp=2", "decode=replicated"],
    "pcp2_dcp2_context_verified": ["pcp=2", "dcp=2", "decode=sharded", "pipeline.forward.dcp_rest=context", "verify=true"],
    "pcp2_dcp2_queries_gqa": ["pcp=2", "dcp=2", "model=tiny_gqa", "pipeline.forward.dcp_rest=queries", "kv.interleave=2"],
    "pcp4_dcp4_sharded_queries": ["pcp=4", "dcp=4", "decode=sharded", "pipeline.forward.dcp_rest=queries"],
    "pcp4_sampled_rows_balanced": ["pcp=4", "decode=sharded", "decode.assignment=balanced",
                                   "pipeline.restore.kind=sampled_rows", "model=tiny_gqa"],
    "pcp3_dcp3_context": ["pcp=3", "dcp=3", "pipeline.forward.dcp_rest=context"],
}
COUNTED = ("per_rank_tokens", "padded_num_tokens", "per_rank_attention_work", "dcp_rest",
           "collective_calls", "collective_bytes")
TIMED = ("arrival_step", "first_token_step", "finish_step", "ttft_steps", "tpot_steps", "output_len")


SLOW = {"pcp4_dcp4_sharded_queries", "pcp4_sampled_rows_balanced", "pcp3_dcp3_context"}
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in CASES]


class Runs:
    """Both runs of every case, made per world size on first use (one spawn each)."""

    def __init__(self, tmp_path_factory) -> None:
        self.tmp, self.done = tmp_path_factory, {}

    def __getitem__(self, name):
        if name not in self.done:
            self._run([n for n in CASES if _pcp(n) == _pcp(name)])
        return self.done[name]

    def _run(self, names) -> None:
        cfgs, paths, sims = [], [], {}
        for name in names:
            extra = CASES[name]
            path = self.tmp.mktemp(name) / "steps.jsonl"
            verify = [] if "verify=true" in extra else ["verify=false"]
            probe = f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{path}'}}]"
            cfgs.append(compose(WORKLOAD + verify + extra + [probe]))
            paths.append(path)
            sim = SimulatedRun(compose(WORKLOAD + [e for e in extra if e != "verify=true"] + ["mode=simulate", "hardware=h100_sxm"]))
            sims[name] = (sim, sim.run())
        for name, res, p in zip(names, run(cfgs), paths):
            self.done[name] = (res, step_counts.read(p), *sims[name])


def _pcp(name: str) -> str:
    return next(o for o in CASES[name] if o.startswith("pcp="))


@pytest.fixture(scope="module")
def both(tmp_path_factory):
    return Runs(tmp_path_factory)


@pytest.mark.parametrize("name", NAMES)
def test_every_step_counts_the_same(both, name):
    _, executed_steps, sim, _ = both[name]
    assert [s["step"] for s in sim.records] == [s["step"] for s in executed_steps]
    for ex, si in zip(executed_steps, sim.records):
        for key in COUNTED:
            assert si[key] == ex[key], (name, ex["step"], key)


@pytest.mark.parametrize("name", NAMES)
def test_same_requests_over_the_same_steps(both, name):
    executed, _, _, simulated = both[name]
    for ex, si in zip(executed["requests"], simulated["requests"]):
        assert {k: si[k] for k in TIMED} == {k: ex[k] for k in TIMED}
    m_ex, m_si = executed["metrics"], simulated["metrics"]
    for key in ("num_steps", "num_tokens", "per_rank_tokens", "per_rank_attention_work", "collective_bytes", "collective_calls"):
        assert m_si[key] == m_ex[key], key


def test_cached_prefix_executes_exactly(both):
    """The executed continued prefill (cached prefix first, then the rest) is exact."""
    executed, steps, _, _ = both["pcp2_dcp2_context_verified"]
    assert executed["verify"]["passed"]
    assert any(s["dcp_rest"] == "context" for s in steps)


def test_simulated_run_is_not_verified(both):
    _, _, sim, simulated = both["pcp2_replicated"]
    assert sim.cfg.verify is False
    assert "nothing to verify" in simulated["verification"]
