"""CUDA-graph modes: vLLM's capture sizes and dispatch, the rejected combination, and
runs in every mode that pad and dispatch like graphs do, exact against the single rank
(on CPU the graph body runs eagerly; nothing here needs a GPU)."""

from __future__ import annotations

import numpy as np
import pytest

from pcpflow.errors import ConfigError
from pcpflow.layouts.layout import plan_layout
from pcpflow.rank.cudagraph import (
    FULL_WITH_PCP,
    default_capture_sizes,
    dispatch,
    is_uniform_decode,
    num_tokens_for_dispatch,
)
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.testing import cli, compose, run


def test_default_capture_sizes_are_vllms():
    # min(2 * max_num_seqs, 512, token budget) bounds vLLM's 1, 2, 4, 8.., 256.. list.
    assert default_capture_sizes(8, 128) == [1, 2, 4, 8, 16]
    assert default_capture_sizes(3, 128) == [1, 2, 4]
    big = default_capture_sizes(256, 8192)
    assert big[:5] == [1, 2, 4, 8, 16] and big[-3:] == [480, 496, 512]
    assert 248 in big and 252 not in big and 264 not in big and 272 in big
    assert len(big) == 3 + 31 + 17
    assert default_capture_sizes(256, 100)[-1] == 96


SIZES = [1, 2, 4, 8, 16]


@pytest.mark.parametrize(
    "mode, uniform, want",
    [
        ("none", True, ("none", None)),
        ("piecewise", True, ("piecewise", 8)),
        ("piecewise", False, ("piecewise", 8)),
        ("full_decode_only", True, ("full", 8)),
        ("full_decode_only", False, ("none", None)),
        ("full_and_piecewise", True, ("full", 8)),
        ("full_and_piecewise", False, ("piecewise", 8)),
        ("full", False, ("full", 8)),
    ],
)
def test_dispatch_by_mode(mode, uniform, want):
    d = dispatch(mode, 5, uniform, SIZES)
    assert (d.runtime_mode, d.num_tokens) == want


def test_dispatch_past_the_largest_size_runs_unpadded_and_sizes_are_exact_fits():
    assert dispatch("full", 17, True, SIZES).runtime_mode == "none"
    assert dispatch("piecewise", 16, False, SIZES).num_tokens == 16
    assert dispatch("piecewise", 1, False, SIZES).num_tokens == 1


def _batch(q, computed, prefilling):
    q = np.asarray(q)
    return GlobalBatch(
        step=0,
        req_ids=np.arange(len(q)),
        num_scheduled_tokens=q,
        num_computed_tokens=np.asarray(computed),
        is_prefilling=np.asarray(prefilling),
        prompt_lens=np.asarray(computed) + q,
        input_ids=np.zeros(int(q.sum()), dtype=np.int64),
        block_tables=np.zeros((len(q), 4), dtype=np.int64),
        logits_indices=np.zeros(0, dtype=np.int64),
        num_draft_tokens=np.zeros(len(q), dtype=np.int64),
    )


def test_dispatch_size_comes_from_the_largest_rank():
    """pcp=2, a 7-token prefill and two decodes: chunks of 2, rank 0 holds A B G (3),
    rank 1 C D E F (4), and both hold the two replicated decodes: 5 and 6 rows."""
    b = _batch([7, 1, 1], [0, 5, 9], [True, False, False])
    layout = plan_layout(b.num_scheduled_tokens, b.is_prefilling, pcp_size=2)
    assert layout.per_rank_num_tokens.tolist() == [5, 6]
    assert num_tokens_for_dispatch(layout) == 6
    assert not is_uniform_decode(b)
    assert dispatch("piecewise", 6, False, SIZES).num_tokens == 8
    assert is_uniform_decode(_batch([1, 1, 0], [3, 9, 2], [False, False, True]))
    assert not is_uniform_decode(_batch([1, 3], [3, 9], [False, False]))  # 1 vs 1+2 drafts


def test_full_with_pcp_is_refused_with_vllms_reason():
    with pytest.raises(ConfigError) as err:
        compose(["pcp=2", "cudagraph_mode=full"])
    assert [p.field for p in err.value.problems] == ["cudagraph_mode"]
    assert err.value.problems[0].allowed == FULL_WITH_PCP
    compose(["pcp=1", "cudagraph_mode=full"])  # one rank: allowed, as in vLLM
    with pytest.raises(ConfigError, match="cudagraph_capture_sizes"):
        compose(["cudagraph_capture_sizes=[8,4096]"])


def test_full_with_pcp_exits_2_before_ranks_start(tmp_path):
    r = cli("pcp=2", "cudagraph_mode=full", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert not (tmp_path / "run").exists()
    assert "cudagraph_mode: got 'full'" in r.stderr and "dispatched apart from the decodes" in r.stderr
    assert "Traceback" not in r.stderr


BASE = [
    "workload=explicit",
    "workload.prompt_lens=[13,6,3]",
    "workload.output_lens=[4,6,5]",
    "scheduler.max_num_batched_tokens=16",
    "output.plots=false",
    "output.progress=false",
]


@pytest.mark.dist
def test_every_mode_pads_and_dispatches_exact_against_the_single_rank():
    """pcp=2 runs in each mode pad every step to a capture size (padding rows never
    written: kv_match), and a pcp=1 fused run in full_decode_only runs its decode steps
    through the graph body (eagerly on CPU): all exact against the single rank, the same
    tokens as the unpadded run."""
    cfgs = [compose(BASE + ["pcp=2", "decode=sharded"])]
    cfgs += [
        compose(BASE + ["pcp=2", "decode=sharded", f"cudagraph_mode={m}"])
        for m in ("piecewise", "full_decode_only", "full_and_piecewise")
    ]
    cfgs.append(
        compose(
            BASE
            + ["pcp=1", "model=tiny_gqa", "cudagraph_mode=full_decode_only", "pipeline.forward.attention=fused"]
        )
    )
    cfgs.append(compose(BASE + ["pcp=1", "model=tiny_gqa"]))
    results = run(cfgs)
    for cfg, r in zip(cfgs, results):
        v = r["verify"]
        assert v["passed"] and v["tokens_match"] and v["kv_match"], (cfg.cudagraph_mode, v)
    plain, piecewise, decode_only, both, graphs, eager = results
    for r in (piecewise, decode_only, both):
        assert r["outputs"] == plain["outputs"]
    assert graphs["outputs"] == eager["outputs"]
    steps = lambda r: r["metrics"]["cudagraph"]["steps"]
    assert set(steps(plain)) == {"none"}
    assert set(steps(piecewise)) == {"piecewise"}
    assert set(steps(both)) == {"full", "piecewise"}
    assert steps(decode_only)["full"] == steps(both)["full"] > 0
    assert steps(decode_only)["none"] == steps(both)["piecewise"]
    # Padding to capture sizes: more padded rows than the unpadded run.
    assert piecewise["metrics"]["balance"]["padding_fraction"] > plain["metrics"]["balance"]["padding_fraction"]
    g = graphs["metrics"]["cudagraph"]
    assert g["graph_forward_steps"] == g["steps"]["full"] > 0


def test_pad_slot_is_outside_the_cache_view():
    """A graph's padded rows write one spare row past the cache: the cache (what the
    verifier and every kernel read) never sees it."""
    import torch

    from pcpflow.models.base import AttentionSpec
    from pcpflow.pipeline.context import allocate_kv_caches, with_pad_slot

    class Model:
        attn_spec = AttentionSpec(num_heads=2, num_kv_heads=1, qk_dim=4, v_dim=4, v_offset=0, entry_dim=4, scale=1.0)
        num_layers = 2

    (cache, _) = allocate_kv_caches(Model(), 3, 4, torch.float64, torch.device("cpu"))
    assert cache.shape == (12, 4) and cache.is_contiguous()
    base = with_pad_slot(cache)
    assert base.shape == (13, 4) and base.data_ptr() == cache.data_ptr()
    base.index_copy_(0, torch.tensor([12, 12]), torch.ones(2, 4, dtype=torch.float64))
    assert torch.isnan(cache).all() and (base[12] == 1).all()
    with pytest.raises(ValueError, match="spare pad row"):
        with_pad_slot(torch.zeros(12, 4))
