"""A simulated run on a measured profile prices the attention calls the executed run makes:
the same calls, each with the same rows' requests and keys and the same block size, every step
and rank (``Pricer.measured_calls``, ``Pricer.measured_ring_calls`` against the reference kernel's
calls recorded inside the executed ranks by ``pcpflow_test_plugins.attention_calls``). The price
of a call is its work as the kernel cuts it (``kernel_work``, checked against the kernel's own
tiles in tests/attention/test_attention.py), so the two together price what the kernel runs."""

from __future__ import annotations

import tempfile
from collections import Counter

import numpy as np
import pytest
import yaml
from measured_profile import profile_dict
from pcpflow_test_plugins import attention_calls

from pcpflow.simulate.price import Pricer
from pcpflow.testing import compose, run

CALLS = "pcpflow_test_plugins.attention_calls:AttentionCalls"
WORK = ["model=tiny_gqa", "dtype=float32", "workload=explicit", "workload.prompt_lens=[45,70,9,33]",
        "workload.cached_lens=[0,40,0,0]", "workload.output_lens=[3]", "scheduler.max_num_batched_tokens=64",
        "scheduler.max_num_seqs=4", "kv.num_blocks=64", "output.plots=false", "output.progress=false"]
# Each all-gather path and both rings, DCP inside PCP and over TP ranks, two interleaves and
# block sizes: prompts under and over a segment (32 rows), a cached prefix, chunked prefills
# beside decodes.
CASES = {
    "pcp=2": ["pcp=2"],
    "dcp=2 queries replicated": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", "decode=replicated"],
    "dcp=2 context sharded": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context", "decode=sharded",
                              "kv.interleave=2", "kv.block_size=8"],
    "dcp over tp": ["tp=2", "dcp=2", "pcp=1", "model.num_kv_heads=1"],
    "ring pass-KV": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"],
    "ring pass-Q sharded": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_q", "decode=sharded"],
}


def _key(block_size: int, req, ctx) -> tuple:
    return int(block_size), tuple(int(x) for x in req), tuple(int(x) for x in ctx)


@pytest.fixture(scope="module")
def executed():
    """Every case executed once, ranks started once per world size: (step, rank) -> calls."""
    folders = {name: tempfile.mkdtemp(prefix="pcpflow-calls-") for name in CASES}
    cfgs = [compose([*WORK, *case, "verify=false", "plugins=[pcpflow_test_plugins.attention_calls]",
                     f"+pipeline.extra=[{{kind: '{CALLS}', after: forward, dir: '{folders[name]}'}}]"])
            for name, case in CASES.items()]
    run(cfgs)
    return {name: attention_calls.read(folders[name]) for name in CASES}


@pytest.mark.parametrize("name", list(CASES))
def test_a_simulated_run_prices_the_calls_the_executed_run_makes(name, executed, tmp_path, monkeypatch):
    from pcpflow.simulate.engine import simulate_run

    (tmp_path / "hw.yaml").write_text(yaml.safe_dump(profile_dict()))
    cfg = compose([*WORK, *CASES[name], "mode=simulate", "hardware=measured", f"hardware.path={tmp_path / 'hw.yaml'}"])
    priced: list[dict[tuple[int, int], list[tuple]]] = []  # per step: (PCP rank, TP rank in DCP) -> calls
    gather, ring = Pricer.measured_calls, Pricer.measured_ring_calls

    def gathered(self, *a, **k):
        out = gather(self, *a, **k)
        priced.append({(r, j): [(self.block_size, c[0], c[1]) for c in calls]
                       for r, per_tp in enumerate(out) for j, calls in enumerate(per_tp)})
        return out

    def ringed(self, plan):
        out = ring(self, plan)
        step: dict[tuple[int, int], list[tuple]] = {}
        for (r, _), calls in out.items():
            step.setdefault((r, 0), []).extend((bs, req, lens) for req, lens, bs in calls)
        priced.append(step)
        return out

    monkeypatch.setattr(Pricer, "measured_calls", gathered)
    monkeypatch.setattr(Pricer, "measured_ring_calls", ringed)
    simulate_run(cfg)
    got = executed[name]
    tp, dcp_tp, layers = cfg.tp, cfg.grid.dcp_tp, cfg.model.num_layers
    assert len(priced) == 1 + max(s for s, _ in got) > 3  # every step priced once, prefills and decodes
    compared = 0
    for (step, rank), calls in sorted(got.items()):
        ran = Counter(_key(*c) for c in calls if any(calls_ctx > 0 for calls_ctx in c[2]))
        r, j = rank // tp, rank % tp % dcp_tp
        want = Counter()
        for bs, req, ctx in priced[step][r, j]:
            if np.any(np.asarray(ctx) > 0):
                want[_key(bs, req, ctx)] += layers
        assert ran == want, (name, step, rank)
        compared += sum(ran.values())
    assert compared >= len(priced) * layers  # at least a call a layer every step
