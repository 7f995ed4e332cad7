"""The twin property over layouts nobody chose by hand: seeded random configs (tiny models,
tp 1-2, pcp 1-4, each dcp, both decode modes, both DCP paths and backends, rings, restores,
interleaves, experts, prefix caching in small caches, cached prefixes, staggered arrivals,
small budgets, sliding and chunked windows, OLMo's whole-projection q/k norms, attention sinks,
CUDA-graph modes) run executed on CPU ranks, verified against one rank, and simulated; every
step counts the same (``step_counts.mismatches``: tokens, pairs, collective calls and bytes
by purpose, prefix hits, preemptions, blocks in use). The hand-picked matrix is ``test_simulate_equality.py``; this
one draws its cases from a fixed seed, so a failure names a config to rerun. A second draw
adds ``draft=self`` with corrupted proposals to layouts without a ring.

``dcp_rest`` is always explicit: ``auto`` takes the fewer bytes executed and the faster step
simulated (docs/simulate.md), two choices by design.
"""

from __future__ import annotations

import random

import pytest
from pcpflow_test_plugins import step_counts

from pcpflow.errors import ConfigError
from pcpflow.simulate.engine import SimulatedRun
from pcpflow.testing import compose, run

SEED, CASES = 20261203, 40
PROBE = "pcpflow_test_plugins.step_counts:StepCounts"
SIMULATED = ["mode=simulate", "hardware=h100_sxm"]


def draw(rng: random.Random) -> list[str]:
    """One config's overrides."""
    model = rng.choice(["tiny_gqa", "tiny_mla"])
    tp = rng.choice([1, 1, 2])
    pcp = rng.choice([1, 2, 3, 4]) if tp == 1 else rng.choice([1, 2])
    dcp = rng.choice([1, pcp, tp * pcp])
    ov = [f"model={model}", f"tp={tp}", f"pcp={pcp}", f"dcp={dcp}", f"decode={rng.choice(['replicated', 'sharded'])}",
          "dtype=bfloat16", "output.plots=false", "output.progress=false", "kv.block_size=4",
          f"scheduler.max_num_batched_tokens={rng.choice([8, 16, 40])}", f"scheduler.max_num_seqs={rng.choice([2, 4, 8])}",
          f"pipeline.forward.dcp_rest={rng.choice(['queries', 'context'])}"]
    if dcp == pcp > 1 and rng.random() < 0.3:
        ov.append(f"pipeline.forward.cp_attention={rng.choice(['ring_pass_kv', 'ring_pass_q', 'ring_auto'])}")
    if rng.random() < 0.3:
        ov.append(f"dcp_comm_backend={rng.choice(['ag_rs', 'a2a'])}")
    if rng.random() < 0.2:
        ov.append("pipeline.restore.kind=sampled_rows")
    if rng.random() < 0.2:
        ov.append("kv.interleave=2")
    if model == "tiny_mla" and rng.random() < 0.25:
        ov += ["model.moe.num_experts=8", "model.moe.top_k=2", f"moe.dispatch={rng.choice(['local', 'gather'])}"]
    k = rng.randint(1, 5)
    arrivals = f"workload.arrival_steps=[{','.join(str(rng.randint(0, 4)) for _ in range(k))}]"
    outputs = f"workload.output_lens=[{','.join(str(rng.randint(1, 6)) for _ in range(k))}]"
    if rng.random() < 0.4:  # prompts sharing a stem, in a cache small enough to preempt
        stem = [(5 * j + 1) % 256 for j in range(rng.choice([8, 20]))]
        prompts = [stem + [90 + i, 3 * i][: rng.randint(0, 2)] for i in range(k)]
        ov += ["workload=explicit", "workload.prompts=" + str(prompts).replace(" ", ""), outputs, arrivals,
               "kv.prefix_caching=true", f"kv.num_blocks={rng.choice([12, 20, 64])}"]
    else:
        lens = [rng.randint(1, 40) for _ in range(k)]
        ov += ["workload=explicit", f"workload.prompt_lens=[{','.join(map(str, lens))}]", outputs, arrivals,
               "kv.num_blocks=64"]
        if rng.random() < 0.4:
            ov.append(f"workload.cached_lens=[{','.join(str(rng.randint(0, n - 1)) for n in lens)}]")
    return ov


def gqa_extras(rng: random.Random, ov: list[str]) -> list[str]:
    """A tiny GQA config's own axes, from a generator of their own (the draws above stay as
    they were): a sliding window (on every layer, or on one), q and k normed over the whole
    projection (under TP: OLMo 2's all-reduced sums)."""
    if "model=tiny_gqa" not in ov:
        return []
    out = []
    if rng.random() < 0.5:
        out.append(f"model.window={rng.choice([1, 3, 6])}")
        if rng.random() < 0.5:
            out.append(f"model.window_layers=[{rng.choice([0, 1])}]")
    if rng.random() < 0.3:
        out.append("model.qk_norm=full")
    return out


def later_extras(rng: random.Random, ov: list[str]) -> list[str]:
    """Axes added after the draws above (a generator of their own, so those stay as they
    were): a window of chunks (Llama 4's) instead of a sliding one, gpt-oss's attention sinks,
    and a CUDA-graph mode (on CPU the same dispatch: decode-only steps padded to a capture
    size, counted with their padding)."""
    out = []
    if any(o.startswith("model.window=") for o in ov) and rng.random() < 0.5:
        out.append("model.window_kind=chunked")
    if "model=tiny_gqa" in ov and rng.random() < 0.3:
        out.append("model.sinks=true")
    if rng.random() < 0.4:
        out.append(f"cudagraph_mode={rng.choice(['piecewise', 'full_decode_only', 'full_and_piecewise'])}")
    return out


def valid(ov: list[str]) -> bool:
    try:
        compose(ov), compose(ov + ["verify=false"] + SIMULATED)
    except ConfigError:
        return False
    return True


def cases() -> list[list[str]]:
    rng, out = random.Random(SEED), []
    while len(out) < CASES:
        ov = draw(rng)
        ov += gqa_extras(random.Random(f"{SEED}:{len(out)}"), ov)
        ov += later_extras(random.Random(f"{SEED}:later:{len(out)}"), ov)
        if valid(ov):
            out.append(ov)
    return out


def _value(ov: list[str], key: str) -> int:
    return next(int(o.split("=")[1]) for o in ov if o.startswith(f"{key}="))


def drafting_cases() -> list[list[str]]:
    """Random layouts (no ring: drafting is simulated beside the all-gather paths) drafting with
    ``self``, a seeded share of its proposals corrupted: its simulated acceptance is the
    executed one, so the whole schedule and the draft stage's counts must be too."""
    rng, out = random.Random(SEED + 1), []
    while len(out) < DRAFTING_CASES:
        ov = [o for o in draw(rng) if not o.startswith("pipeline.forward.cp_attention=")]
        ov += ["draft=self", f"draft.num_speculative_tokens={rng.randint(1, 3)}",
               f"draft.error_rate={rng.choice([0.2, 0.4, 0.6])}"]
        if valid(ov):
            out.append(ov)
    return out


DRAFTING_CASES = 16


@pytest.mark.slow
@pytest.mark.parametrize("which", ["layouts", "drafting"])
def test_random_layouts_count_what_their_executed_runs_count(tmp_path, which):
    drawn = cases() if which == "layouts" else drafting_cases()
    if which == "drafting":
        results = _same_counts(tmp_path, drawn, [False] * len(drawn))
        proposed = sum(r["metrics"].get("draft_proposed", 0) for r in results)
        accepted = sum(r["metrics"].get("draft_accepted", 0) for r in results)
        assert 0 < accepted < proposed, (accepted, proposed)  # drafts kept and drafts rolled back
        assert any(_value(ov, "tp") == 2 for ov in drawn) and any(_value(ov, "dcp") > 1 for ov in drawn)
        return
    rings = [any(o.startswith("pipeline.forward.cp_attention=ring") for o in ov) for ov in drawn]
    # the seed reaches what the draw is for
    assert any(rings) and any("kv.prefix_caching=true" in ov for ov in drawn)
    assert any("model.moe.num_experts=8" in ov for ov in drawn) and any(_value(ov, "tp") == 2 for ov in drawn)
    assert {_value(ov, "pcp") for ov in drawn} >= {1, 2, 3, 4}
    windowed = [ov for ov in drawn if any(o.startswith("model.window=") for o in ov)]
    assert any(rings[drawn.index(ov)] for ov in windowed) and any(_value(ov, "dcp") > 1 for ov in windowed)
    assert any("model.qk_norm=full" in ov and _value(ov, "tp") == 2 for ov in drawn)
    assert any("model.window_kind=chunked" in ov for ov in drawn) and any("model.sinks=true" in ov for ov in drawn)
    graphs = [ov for ov in drawn if any(o.startswith("cudagraph_mode=") for o in ov)]
    assert any(_value(ov, "pcp") > 1 for ov in graphs) and any(rings[drawn.index(ov)] for ov in graphs)
    _same_counts(tmp_path, drawn, rings)


def _same_counts(tmp_path, drawn: list[list[str]], rings: list[bool]) -> list[dict]:
    """Each config executed (verified against one rank) and simulated: every step the same counts."""
    cfgs, dirs, sims = [], [], []
    for i, (ov, ring) in enumerate(zip(drawn, rings)):
        d = tmp_path / f"case{i}"
        d.mkdir()
        cfgs.append(compose(ov + [f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{d / 'steps.jsonl'}'}}]"]))
        dirs.append(d)
        caching = [] if "kv.prefix_caching=true" in ov else ["kv.prefix_caching=false"]  # executed runs default off
        sim = SimulatedRun(compose(ov + caching + ["verify=false"] + SIMULATED))
        sim.run()
        sims.append(sim)
    results = run(cfgs, run_dirs=[d if ring else None for d, ring in zip(dirs, rings)])
    failed = {}
    for ov, ring, d, sim, result in zip(drawn, rings, dirs, sims, results):
        assert result["verify"]["passed"], (" ".join(ov), result["verify"])  # exact, as one rank computes
        executed = step_counts.executed_steps(d / "steps.jsonl", d if ring else None)
        assert executed, " ".join(ov)
        wrong = step_counts.mismatches(sim.records, executed, ring=ring, dcp_over_tp=_value(ov, "dcp") > _value(ov, "pcp"))
        m_ex, m_si = result["metrics"], sim.recorder
        if (m_ex.get("draft_proposed", 0), m_ex.get("draft_accepted", 0)) != (m_si.draft_proposed, m_si.draft_accepted):
            wrong.append(f"drafts proposed/accepted: simulated {m_si.draft_proposed}/{m_si.draft_accepted}, executed "
                         f"{m_ex.get('draft_proposed', 0)}/{m_ex.get('draft_accepted', 0)}")
        if wrong:
            failed[" ".join(ov)] = wrong[:3]
    assert not failed, failed
    return results
