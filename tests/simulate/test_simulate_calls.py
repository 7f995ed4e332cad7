"""A simulated run on a measured profile prices the attention calls the executed run makes:
the same calls, each with the same rows' requests, keys and window starts and the same block
size, every step, rank and layer (``Pricer.measured_calls``, ``Pricer.measured_ring_calls``,
each kind of layer by its own calls: a windowed one's rows from their starts, against the
reference kernel's calls recorded inside the executed ranks by
``pcpflow_test_plugins.attention_calls``). The price of a call is its work as the kernel cuts
it (``kernel_work``, checked against the kernel's own tiles in
tests/attention/test_attention.py), so the two together price what the kernel runs."""

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
# beside decodes; tiny_gqa's second layer through a sliding or a chunked window in most.
SLIDING = ["model.window=5", "model.window_layers=[1]"]
CHUNKED = ["model.window=16", "model.window_kind=chunked", "model.window_layers=[1]"]
CASES = {
    "pcp=2 sliding": ["pcp=2", *SLIDING],
    "dcp=2 queries replicated": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=queries", "decode=replicated"],
    "dcp=2 context sharded chunked": ["pcp=2", "dcp=2", "pipeline.forward.dcp_rest=context", "decode=sharded",
                                      "kv.interleave=2", "kv.block_size=8", *CHUNKED],
    "dcp over tp sliding": ["tp=2", "dcp=2", "pcp=1", "model.num_kv_heads=1", *SLIDING],
    "ring pass-KV sliding": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_kv", *SLIDING],
    "ring pass-Q sharded chunked": ["pcp=2", "dcp=2", "pipeline.forward.cp_attention=ring_pass_q", "decode=sharded",
                                    *CHUNKED],
}


def _key(block_size: int, req, ctx, starts) -> tuple:
    """A call's block size, rows' requests, keys and starts (None: every row from key 0)."""
    starts = [0] * len(req) if starts is None else starts
    return int(block_size), *(tuple(int(x) for x in a) for a in (req, ctx, starts))


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
    priced: list[dict[tuple[int, int], Counter]] = []  # per step: (PCP rank, TP rank in DCP) -> calls x layers
    kinds: set = set()  # (layers, window) each step's layers were priced through
    price, gather, ring = Pricer.price, Pricer._measured_attention, Pricer._measured_ring_attention

    def step(self, *a, **k):
        priced.append({})
        return price(self, *a, **k)

    def add(self, layers, window, calls_of_rank) -> None:
        kinds.add((layers, window))
        for rank, calls in calls_of_rank:
            counter = priced[-1].setdefault(rank, Counter())
            for bs, req, ctx, starts in calls:
                if np.any(np.asarray(ctx) > 0):
                    counter[_key(bs, req, ctx, starts)] += self.sizes.num_layers if layers is None else layers

    def gathered(self, batch, layout, counts, layers=None, window=None):
        out = self.measured_calls(batch, layout, counts, window)
        add(self, layers, window, (((r, j), [(self.block_size, *c[:2], c[3]) for c in calls])
                                   for r, per_tp in enumerate(out) for j, calls in enumerate(per_tp)))
        return gather(self, batch, layout, counts, layers, window)

    def ringed(self, plan, layers=None, window=None):
        out = self.measured_ring_calls(plan, window)
        add(self, layers, window, (((r, 0), [(bs, req, lens, starts) for req, lens, bs, starts in calls])
                                   for (r, _), calls in out.items()))
        return ring(self, plan, layers, window)

    monkeypatch.setattr(Pricer, "price", step)
    monkeypatch.setattr(Pricer, "_measured_attention", gathered)
    monkeypatch.setattr(Pricer, "_measured_ring_attention", ringed)
    simulate_run(cfg)
    got = executed[name]
    tp, dcp_tp, layers = cfg.tp, cfg.grid.dcp_tp, cfg.model.num_layers
    assert len(priced) == 1 + max(s for s, _ in got) > 3  # every step priced once, prefills and decodes
    if cfg.model.window is not None:  # the windowed layer priced apart from the full one in some step
        assert any(w is not None for _, w in kinds), kinds
    compared = 0
    for (step_, rank), calls in sorted(got.items()):
        ran = Counter(_key(*c) for c in calls if any(calls_ctx > 0 for calls_ctx in c[2]))
        want = priced[step_].get((rank // tp, rank % tp % dcp_tp), Counter())
        assert ran == want, (name, step_, rank)
        compared += sum(ran.values())
    assert compared >= len(priced) * layers  # at least a call a layer every step
