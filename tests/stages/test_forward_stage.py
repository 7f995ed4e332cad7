"""stages/forward.py (``model``): at one rank, every row's hidden state is the dense,
cache-free forward of its prefix (tests/reference.py), and the KV of every token lands in
the cache."""

from __future__ import annotations

import torch
from reference import reference_forward
from stage_ctx import TARGET, context, first_state, run_slots

PROMPT = [5, 17, 3, 99, 42, 7, 250]


def test_hidden_states_equal_the_dense_reference():
    ctx = context(["pcp=1", "workload=explicit", f"workload.prompts=[{PROMPT}]".replace(" ", ""), "workload.output_lens=[2]"])
    state = run_slots(first_state(ctx), ctx, *TARGET, ("forward", "model"))
    logits = ctx.model.compute_logits(state.hidden[: len(PROMPT)])
    want, _ = reference_forward(ctx.model, torch.tensor(PROMPT))
    assert (logits.double() - want.double()).abs().max() <= 1e-9
    assert state.attn.dcp_rest == "queries"  # no DCP: nothing else to take
    # Every token's KV was written: the slots of the 7 positions hold numbers, the rest NaN.
    slots = state.attn.gathered_slot_mapping[: len(PROMPT)]
    for cache in ctx.kv_caches:
        assert not torch.isnan(cache[slots]).any()
        assert int((~torch.isnan(cache).all(dim=1)).sum()) == len(PROMPT)


def test_a_ring_without_the_kv_sharded_over_it_is_refused_before_anything_starts(tmp_path):
    from pcpflow.testing import cli

    rule = "a ring needs the KV sharded over the ring: pcp > 1 and dcp = pcp"
    for args, got in {
        ("pcp=1", "pipeline.forward.cp_attention=ring_pass_q"): "pcp=1 dcp=1",
        ("pcp=2", "pipeline.forward.cp_attention=ring_pass_kv"): "pcp=2 dcp=1",
        ("tp=2", "pcp=2", "dcp=4", "pipeline.forward.cp_attention=ring_auto"): "pcp=2 dcp=4",
    }.items():
        run_dir = tmp_path / "_".join(args).replace("=", "")
        r = cli(*args, f"hydra.run.dir={run_dir}")
        assert r.returncode == 2, (args, r.stderr)
        assert f"pipeline.forward.cp_attention: got '{args[-1].split('=')[1]}'" in r.stderr, r.stderr
        assert rule in r.stderr and f"got {got}" in r.stderr and "Traceback" not in r.stderr
        assert not run_dir.exists()
    r = cli("mode=simulate", "hardware=h100_sxm", "pcp=2", "pipeline.forward.cp_attention=ring_pass_kv",
            f"hydra.run.dir={tmp_path / 'sim'}")
    assert r.returncode == 2 and "pcp=2 dcp=1" in r.stderr and "Traceback" not in r.stderr, r.stderr
    r = cli("pcp=2", "pipeline.forward.cp_attention=ring", f"hydra.run.dir={tmp_path / 'typo'}")
    assert r.returncode == 2 and "ring_pass_kv" in r.stderr and "ring_auto" in r.stderr, r.stderr
