"""Chunked attention (``AttentionSpec.window_kind="chunked"``, Llama 4's) executed on every
path: a tiny GQA model whose first layer attends within chunks of 5 positions (a row at p
sees keys ``p - p % 5 .. p``) runs the length corner cases (a 150-token prompt prefilled in
chunks that cut the attention chunks anywhere, prompts shorter and longer than a chunk,
requests arriving late) under each way attention crosses the ranks. Every run must verify
against one rank in float64 (logits, tokens, every rank's KV cache) and its tokens must be
the dense reference's: a forward written from the weights that masks keys ``j < i - i % 5``
itself (tests/reference.py), no pcpflow attention, cache or layout in it."""

from __future__ import annotations

import pytest
import shared_ranks
from exactness import assert_exact, corner_case_workload

from pcpflow.testing import compose

CHUNKED = ["model=tiny_gqa", "model.window=5", "model.window_layers=[0]", "model.window_kind=chunked"]

# (pcp, overrides): the all-gather paths (no DCP; DCP queries and context; DCP over TP ranks,
# both backends), both rings, the fused kernel and drafting through the target's own layers.
CASES = [
    (3, ["dcp=3", "decode=sharded", "pipeline.forward.dcp_rest=queries"]),
    (2, ["dcp=2", "pipeline.forward.dcp_rest=context", "kv.block_size=4", "kv.interleave=2"]),
    (2, ["dcp=2", "pipeline.forward.cp_attention=ring_pass_kv"]),
    (2, ["dcp=1"]),
    (2, ["dcp=2", "decode=sharded", "pipeline.forward.cp_attention=ring_pass_q", "kv.block_size=4", "kv.interleave=2"]),
    (3, ["dcp=3", "pipeline.forward.cp_attention=ring_auto", "kv.interleave=5"]),
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "decode=sharded"]),
    (2, ["dcp=4", "tp=2", "model.num_kv_heads=1", "dcp_comm_backend=a2a"]),
    (1, ["dcp=1", "pipeline.forward.attention=fused"]),
    (2, ["dcp=2", "draft=self", "draft.error_rate=0.3"]),
]
DEFAULT = 1  # the first case (sharded decodes through DCP queries): the default set's budget


def _configs(cases):
    return [compose([*corner_case_workload(p), *CHUNKED, *extra]) for p, extra in cases]


shared_ranks.matrix("chunked/default")(lambda: _configs(CASES[:DEFAULT]))
shared_ranks.matrix("chunked/slow")(lambda: _configs(CASES[DEFAULT:]))


def _check(runs) -> None:
    assert runs
    for cfg, result in runs:
        assert cfg.model.window == 5 and cfg.model.window_kind == "chunked"
        assert_exact(cfg, result)


@pytest.mark.matrix("chunked/default")
def test_a_chunked_layer_is_exact_on_every_path(shared_runs):
    _check(shared_runs["chunked/default"])


@pytest.mark.slow
@pytest.mark.matrix("chunked/slow")
def test_a_chunked_layer_is_exact_on_every_path_slow(shared_runs):
    _check(shared_runs["chunked/slow"])


def _reference_logits(*extra):
    import torch
    from reference import reference_forward

    from pcpflow.models import build_model

    cfg = compose(["model=tiny_gqa", *extra])
    model = build_model(cfg.model, dtype=torch.float64, seed=cfg.seed)
    return reference_forward(model, torch.arange(12) * 7 % 256)[0]


def test_chunks_change_what_a_long_prompt_attends_to():
    """Not a no-op: the dense reference's logits with chunks differ from those without them
    past the first chunk, and equal them within it."""
    import torch

    full, chunked = _reference_logits(), _reference_logits(*CHUNKED[1:])
    torch.testing.assert_close(chunked[:5], full[:5], rtol=0, atol=1e-12)
    assert float((chunked[5:] - full[5:]).abs().amin(-1).max()) > 0 and not torch.allclose(chunked[5:], full[5:])


def test_chunks_are_not_a_sliding_window_of_their_size():
    """Chunked is its own mask: a row at the start of a chunk sees itself only where a sliding
    window of the same size sees the 4 keys before it too; the two agree only within the first
    chunk (both see every key there)."""
    import torch

    sliding = _reference_logits(*CHUNKED[1:3])
    chunked = _reference_logits(*CHUNKED[1:])
    torch.testing.assert_close(chunked[:5], sliding[:5], rtol=0, atol=1e-12)
    assert not torch.allclose(chunked[5:], sliding[5:])
    # NOTE: row 5 opens the second chunk: it sees only itself, row 4 of the sliding layer 5 keys
    assert float((chunked[5] - sliding[5]).abs().max()) > 1e-6
