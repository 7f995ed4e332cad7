"""stages/slots.py and stages/forward.py over a hybrid KV cache (``RankContext.kv_groups``): a
tiny GQA model whose windowed layers keep their own block tables runs two steps in one process
(prefills of 40 and 24 tokens, then a chunk and a decode) with the tables a hybrid manager
hands out (blocks drawn at random from the pool; at the second step every window group's
entries before its window point at the null block and the blocks they held are handed out
again, to other groups and requests, stale entries and all), against the classic cache with one
table. The hidden states, hence the logits, must be equal, bit for bit: the same keys are read,
in the same order."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from stage_ctx import TARGET, context, run_slots

from pcpflow.pipeline.context import allocate_kv_caches
from pcpflow.pipeline.state import StepState
from pcpflow.scheduling.batch import GlobalBatch
from pcpflow.scheduling.kv_groups import KVGroups

BLOCK, NUM_BLOCKS, WIDTH = 4, 64, 12
PROMPTS = (48, 24)  # request 0: 40 prompt tokens, then a chunk of 8; request 1: 24, then a decode


def _batch(step: int, tables: np.ndarray, group_tables: np.ndarray | None, ids: np.ndarray) -> GlobalBatch:
    computed = np.array([0, 0] if step == 0 else [40, 24])
    scheduled = np.array([40, 24] if step == 0 else [8, 1])
    starts = np.concatenate([[0], np.cumsum(scheduled)])
    return GlobalBatch(
        step=step, req_ids=np.arange(2), num_scheduled_tokens=scheduled, num_computed_tokens=computed,
        is_prefilling=np.array([True, step == 0]), prompt_lens=np.array(PROMPTS), input_ids=ids[: starts[-1]],
        block_tables=tables, logits_indices=starts[1:] - 1, num_draft_tokens=np.zeros(2, dtype=np.int64),
        group_block_tables=group_tables,
    )


def _hybrid_tables(groups: KVGroups, rng) -> tuple[np.ndarray, np.ndarray]:
    """Both steps' tables ``[G, 2, WIDTH]`` as a hybrid manager would hand them out: at the
    second step the blocks the window groups gave back are the first handed out again."""
    pool = list(rng.permutation(NUM_BLOCKS))
    entries = [(10, 6), (12, 7)]  # entries each request holds at each step (4 positions each)
    first = np.zeros((groups.num_groups, 2, WIDTH), dtype=np.int64)
    for g in range(groups.num_groups):
        for r, n in enumerate(entries[0]):
            first[g, r, :n] = [pool.pop() for _ in range(n)]
    second, freed = first.copy(), []
    kept = groups.first_kept(np.array([40, 24]), BLOCK)
    for g in np.flatnonzero(groups.windowed):
        for r in range(2):
            freed += second[g, r, : kept[r]].tolist()
            second[g, r, : kept[r]] = NUM_BLOCKS  # the null block
    rng.shuffle(freed)
    for g in range(groups.num_groups):
        for r in range(2):
            for e in range(entries[0][r], entries[1][r]):
                second[g, r, e] = freed.pop() if freed else pool.pop()
    return first, second


def _setup(window: list[str], seed: int):
    """A classic context (one table), the same model with a hybrid cache, its groups, token
    ids, the classic table and both steps' hybrid tables (``_hybrid_tables``)."""
    # NOTE: the batches are made here, the groups too: the composed run's own stay classic
    classic = context(["pcp=1", "dtype=float64", "model=tiny_gqa", "model.num_layers=4", f"kv.block_size={BLOCK}",
                       f"kv.num_blocks={NUM_BLOCKS}", "kv.hybrid=off", *window])
    spec = classic.model.attn_spec
    groups = KVGroups.of(4, spec.window_layers, spec.windowed())
    hybrid = dataclasses.replace(classic, kv_groups=groups, kv_caches=allocate_kv_caches(
        classic.model, NUM_BLOCKS, BLOCK, classic.dtype, classic.device, groups=groups))
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, classic.model.vocab_size, size=64)
    one_table = np.zeros((2, WIDTH), dtype=np.int64)
    one_table[0], one_table[1, :7] = np.arange(12), 12 + np.arange(7)
    return classic, hybrid, groups, ids, one_table, _hybrid_tables(groups, rng)


@pytest.mark.parametrize("window", [
    ["model.window=8", "model.window_layers=[1,2]"],  # full (0, 3), windowed (1, 2): one group of two each
    ["model.window=8", "model.window_layers=[0,2,3]", "model.window_kind=chunked"],  # (1,), (0,), (2,), (3,)
])
def test_a_hybrid_cache_attends_exactly_as_one_table(window):
    classic, hybrid, groups, ids, one_table, (first, second) = _setup(window, seed=0)
    assert groups.num_windowed >= 1 and groups.num_full >= 1
    assert (second == NUM_BLOCKS).any(axis=-1)[np.flatnonzero(groups.windowed)].all()  # a window left blocks

    for step, tables in enumerate((first, second)):
        want = run_slots(StepState(_batch(step, one_table, None, ids)), classic, *TARGET, ("forward", "model"))
        got = run_slots(StepState(_batch(step, tables[0], tables, ids)), hybrid,
                        *TARGET, ("forward", "model"))
        assert got.attn_groups is not None and len(got.attn_groups) == groups.num_groups
        assert got.attn is got.attn_groups[0] and want.attn_groups is None
        n = int(_batch(step, one_table, None, ids).num_tokens)
        assert torch.isfinite(got.hidden[:n]).all()
        assert torch.equal(got.hidden[:n], want.hidden[:n]), f"step {step}"
        assert torch.equal(hybrid.model.compute_logits(got.hidden[:n]), classic.model.compute_logits(want.hidden[:n]))

    # every layer's entries sit where its group's table says: the classic cache's, moved; the
    # null block was never written
    positions = [np.arange(48), np.arange(25)]
    for layer in range(4):
        g = int(groups.layer_group[layer])
        kept = groups.first_kept(np.array([40, 24]), BLOCK) if groups.windowed[g] else np.zeros(2, dtype=np.int64)
        for r, p in enumerate(positions):
            p = p[p // BLOCK >= kept[r]]
            at = second[g, r, p // BLOCK] * BLOCK + p % BLOCK
            was = one_table[r, p // BLOCK] * BLOCK + p % BLOCK
            assert torch.equal(hybrid.kv_caches[layer][at], classic.kv_caches[layer][was]), (layer, r)
        null = hybrid.kv_caches[layer][NUM_BLOCKS * BLOCK:]
        assert null.shape[0] == BLOCK and torch.isnan(null).all()


def test_a_decode_graph_reads_each_layer_through_its_groups_table():
    """``DecodeGraphs`` (the static forward a full CUDA graph replays; eager here) holds one slot
    mapping and one table per KV group: over the hybrid tables of the second step (null entries
    before each window, blocks handed out again) it computes what it computes over one table."""
    from pcpflow.rank.cudagraph import DecodeGraphs

    classic, hybrid, groups, ids, one_table, (first, second) = _setup(["model.window=8", "model.window_layers=[1,2]"],
                                                                      seed=1)
    run_slots(StepState(_batch(0, one_table, None, ids)), classic, *TARGET, ("forward", "model"))
    run_slots(StepState(_batch(0, first[0], first, ids)), hybrid, *TARGET, ("forward", "model"))
    want = run_slots(StepState(_batch(1, one_table, None, ids)), classic, *TARGET)
    got = run_slots(StepState(_batch(1, second[0], second, ids)), hybrid, *TARGET)
    n = int(_batch(1, one_table, None, ids).num_tokens)
    one = DecodeGraphs(classic, None, capture=False)(want)[:n]
    per_group = DecodeGraphs(hybrid, None, capture=False)(got)[:n]
    assert torch.isfinite(per_group).all()
    assert torch.equal(per_group, one)
