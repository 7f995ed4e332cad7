"""Sliding-window attention (``AttentionSpec.window``) executed on every path: a tiny GQA model
whose second layer slides over 5 keys runs the length corner cases (a 150-token prompt
prefilled in chunks, prompts shorter and longer than the window, requests arriving late) under
each way attention crosses the ranks. Every run must verify against one rank in float64
(logits, tokens, every rank's KV cache) and its tokens must be the dense reference's: a forward
written from the weights that masks keys ``j <= i - window`` itself (tests/reference.py), no
pcpflow attention, cache or layout in it. Hugging Face windows are held to transformers in
tests/models/test_hf_parity.py."""

from __future__ import annotations

import pytest
import shared_ranks
from exactness import assert_exact, corner_case_workload

from pcpflow.testing import compose

WINDOW = ["model=tiny_gqa", "model.window=5", "model.window_layers=[1]"]

# (pcp, overrides): the all-gather paths (no DCP; DCP queries and context; DCP over TP ranks,
# both backends), both rings, the fused kernel and drafting through the target's own layers.
CASES = [
    (2, ["dcp=2", "pipeline.forward.dcp_rest=context", "kv.block_size=4", "kv.interleave=2"]),
    (2, ["dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"]),
    (3, ["dcp=3", "decode=sharded", "pipeline.forward.dcp_rest=queries"]),
    (2, ["dcp=1"]),
    (2, ["dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q", "kv.block_size=4", "kv.interleave=2"]),
    (3, ["dcp=3", "pipeline.forward.cp_attention=ring_auto", "kv.interleave=5"]),
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "decode=sharded"]),
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "dcp_comm_backend=a2a"]),
    (1, ["dcp=1", "pipeline.forward.attention=fused"]),
    (2, ["dcp=2", "draft=self", "draft.error_rate=0.3"]),
]
DEFAULT = 3  # the first cases: a DCP context path, a ring, sharded decodes through DCP queries


def _configs(cases):
    return [compose([*corner_case_workload(p), *WINDOW, *extra]) for p, extra in cases]


shared_ranks.matrix("window/default")(lambda: _configs(CASES[:DEFAULT]))
shared_ranks.matrix("window/slow")(lambda: _configs(CASES[DEFAULT:]))


def _check(runs) -> None:
    assert runs
    for cfg, result in runs:
        assert cfg.model.window == 5
        assert_exact(cfg, result)


@pytest.mark.matrix("window/default")
def test_a_sliding_layer_is_exact_on_every_path(shared_runs):
    _check(shared_runs["window/default"])


@pytest.mark.slow
@pytest.mark.matrix("window/slow")
def test_a_sliding_layer_is_exact_on_every_path_slow(shared_runs):
    _check(shared_runs["window/slow"])


def test_the_window_changes_what_a_long_prompt_attends_to():
    """Not a no-op: the dense reference's logits with the window differ from those without it
    past the window, and equal them while the prompt is within it."""
    import torch
    from reference import reference_forward

    from pcpflow.models import build_model

    def logits(*extra):
        cfg = compose(["model=tiny_gqa", *extra])
        model = build_model(cfg.model, dtype=torch.float64, seed=cfg.seed)
        return reference_forward(model, torch.arange(12) * 7 % 256)[0]

    full, slid = logits(), logits(*WINDOW[1:])
    torch.testing.assert_close(slid[:5], full[:5], rtol=0, atol=1e-12)
    assert float((slid[5:] - full[5:]).abs().amin(-1).max()) > 0 and not torch.allclose(slid[5:], full[5:])
