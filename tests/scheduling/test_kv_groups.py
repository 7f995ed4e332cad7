"""KV groups (vLLM's hybrid KV cache manager): the grouping rule against vLLM's design doc's
worked examples, the pool's counts by hand, and a property run: whatever the batching,
preemptions and prefix hits, every key a windowed layer reads is in its group's table and
holds the request's own token, and every block comes back."""

import numpy as np
import pytest
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from test_scheduler import V, _prompts, fake_model, reference

from pcpflow.layouts.slots import Window
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import Request

# -- the grouping rule (vLLM docs/design/hybrid_kv_cache_manager.md, "Allocation") --------------


def _check_layout(groups: KVGroups, num_layers: int, window_layers: set[int]) -> None:
    """Every layer in exactly one group of its own kind; (group, slot) pairs distinct."""
    seen = sorted(layer for g in groups.layers for layer in g)
    assert seen == list(range(num_layers))
    pairs = set(zip(groups.layer_group.tolist(), groups.layer_slot.tolist()))
    assert len(pairs) == num_layers
    for g, layers in enumerate(groups.layers):
        assert all((layer in window_layers) == groups.windowed[g] for layer in layers)
        assert len(layers) <= groups.size


def test_groups_as_vllms_worked_examples():
    w = Window(32)
    # Case 1 (toy): 1 full + 3 sliding layers -> a group per layer, a block holds one layer
    g = KVGroups.of(4, [1, 2, 3], w)
    assert (g.num_full, g.num_windowed, g.size) == (1, 3, 1)
    _check_layout(g, 4, {1, 2, 3})
    # Case 2: 10 full + 20 sliding -> groups full.0-9, sw.0-9, sw.10-19 (page of 10 layers)
    window_layers = set(range(10, 30))
    g = KVGroups.of(30, window_layers, w)
    assert (g.num_groups, g.num_full, g.size) == (3, 1, 10)
    assert g.layers == (tuple(range(10)), tuple(range(10, 20)), tuple(range(20, 30)))
    _check_layout(g, 30, window_layers)
    # Case 3: Gemma-3-27b, 10 full + 52 sliding (every 6th layer full) -> 10 layers per group, the
    # last sliding group sw.50, sw.51 and 8 padding layers
    window_layers = {i for i in range(62) if (i + 1) % 6}
    g = KVGroups.of(62, window_layers, Window(1024))
    assert (g.num_groups, g.num_full, g.num_windowed, g.size) == (7, 1, 6, 10)
    assert len(g.layers[-1]) == 2
    _check_layout(g, 62, window_layers)


def test_one_group_without_a_windowed_layer_and_a_window_only_model():
    g = KVGroups.of(4, [], None)
    assert g.num_groups == 1 and not g.hybrid
    g = KVGroups.of(4, [0, 1], None)  # no window: nothing slides
    assert g.num_groups == 1 and not g.hybrid
    g = KVGroups.of(4, range(4), Window(8))  # Mistral 7B v0.1: every layer slides
    assert (g.num_groups, g.num_windowed, g.size) == (1, 1, 4) and g.hybrid
    assert KVCacheManager(8, 4, groups=KVGroups.of(4, [], None)).num_groups == 1


def test_the_design_docs_allocation_example():
    # block_size 16, sliding window 32, a request of 112 tokens, 10 full + 20 sliding layers:
    # 11 blocks, 7 for the full group and 2 for each sliding group (the doc's figure)
    g = KVGroups.of(30, range(10, 30), Window(32))
    kv = KVCacheManager(64, 16, groups=g)
    kv.allocate(0, 112)
    assert kv.num_used_blocks == 3 * 7
    freed = kv.release(np.array([0]), np.array([112]))
    assert kv.num_used_blocks == 11 and len(freed) == 2 * 5
    tables = kv.group_block_tables([0])[:, 0]
    assert (tables[0] != kv.null_block).all()
    # the next query (position 112) reads keys 81..112: entries 5 and 6 hold 81..111
    assert (tables[1:, :5] == kv.null_block).all() and (tables[1:, 5:] != kv.null_block).all()
    assert len(set(tables[tables != kv.null_block].tolist())) == 11
    assert set(kv.free(0).tolist()) == set(tables[tables != kv.null_block].tolist())
    assert kv.num_free_blocks == 64


def test_chunked_window_over_dcp_virtual_blocks():
    # dcp=2, block_size 2: an entry is 4 positions; chunks of 8: a query at p reads p - p % 8 ..
    g = KVGroups.of(2, [1], Window(8, "chunked"))
    assert g.first_kept([0, 7, 8, 13, 16], 4).tolist() == [0, 0, 2, 2, 4]
    kv = KVCacheManager(32, 2, 2, groups=g)
    kv.allocate(0, 14)  # 4 entries x 2 groups
    assert kv.num_used_blocks == 8
    assert len(kv.release(np.array([0]), np.array([13]))) == 2  # entries 0, 1 of the chunked group
    assert len(kv.release(np.array([0]), np.array([14]))) == 0  # given back once
    assert kv.num_used_blocks == 6


def test_fit_counts_a_window_groups_peak():
    g = KVGroups.of(2, [1], Window(8))
    kv = KVCacheManager(12, 4, groups=g)
    # 40 tokens: 10 entries in the full group; the window group holds at most
    # ceil((8 - 1 + 4) / 4) + 1 = 4 entries in steps of 4 tokens
    assert kv.fit_problems([30], [10], 0, max_num_batched_tokens=4)[0].allowed.startswith(
        "workload request 0 needs 14 blocks in 2 KV groups")
    assert KVCacheManager(14, 4, groups=g).fit_problems([30], [10], 0, max_num_batched_tokens=4) == []
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        kv.fit_problems([30], [10])


def _window_hit_by_brute_force(groups, cached: np.ndarray, n: int, U: int) -> int:
    for m in range(n, 0, -1):
        first = int(groups.first_kept(m * U, U))
        if cached[first:m].all():
            return m
    return 0


@settings(max_examples=200, deadline=None)
@given(mask=st.lists(st.booleans(), min_size=0, max_size=80), window=st.integers(1, 40),
       chunked=st.booleans(), U=st.integers(1, 8))
def test_window_hit_is_the_longest_prefix_whose_window_is_cached(mask, window, chunked, U):
    groups = KVGroups.of(2, [1], Window(window, "chunked" if chunked else "sliding"))
    kv = KVCacheManager(4, U, groups=groups, prefix_caching=True)
    hashes = np.arange(1, len(mask) + 1, dtype=np.uint64) * np.uint64(977)
    cached = np.asarray(mask, dtype=bool)
    from pcpflow.scheduling.kv_cache import group_keys

    kv._cached.update((int(k), 0) for k in group_keys(hashes[cached], 1))
    assert kv._window_hit(hashes, len(mask)) == _window_hit_by_brute_force(groups, cached, len(mask), U)


# -- property: windows keep what their queries read ---------------------------------------------

@settings(max_examples=80, deadline=None)
@given(
    spec=st.lists(st.tuples(st.integers(1, 30), st.integers(1, 8), st.integers(0, 3), st.integers(0, 24)),
                  min_size=1, max_size=6),
    budget=st.integers(1, 16),
    seqs=st.integers(1, 4),
    block_size=st.integers(1, 4),
    dcp=st.sampled_from([1, 2]),
    window=st.integers(1, 12),
    chunked=st.booleans(),
    layers=st.sampled_from([(2, [1]), (3, [1, 2]), (2, [0, 1])]),
    extra_blocks=st.integers(0, 6),
    prefix_caching=st.booleans(),
    k=st.sampled_from([0, 0, 2]),
    reads_next=st.booleans(),
    draft_seed=st.integers(0, 2**16),
)
def test_windows_hold_every_key_their_queries_read(spec, budget, seqs, block_size, dcp, window, chunked, layers,
                                                   extra_blocks, prefix_caching, k, reads_next, draft_seed):
    """Each step, in every group's table: a full group holds every position before the row, a
    window group every key from the row's window start (``Window.starts``) on, each the
    request's own token (a hit's blocks included); entries before ``first_kept`` are the null
    block; a block being written belongs to its writer alone; the outputs are the unbatched
    reference's and every block comes back. Drafting (``k``; a drafter reading the next token
    cuts prefix hits, ``reads_next``): its lookahead is allocated in every group."""
    num_layers, window_layers = layers
    w = Window(window, "chunked" if chunked else "sliding")
    groups = KVGroups.of(num_layers, window_layers, w)
    assume(groups.num_full or not (k or reads_next))  # NOTE: a drafter goes by a full group's table
    U = block_size * dcp
    prompts = _prompts([(p, s) for p, _, _, s in spec], shared=prefix_caching)
    reqs = [Request(i, prompts[i], o, a) for i, (_, o, a, _) in enumerate(spec)]
    lengths = np.array([len(r.prompt_token_ids) + r.max_output_tokens for r in reqs])
    entries = -(-lengths // U)
    entries = -(-(lengths + k) // U)
    window = groups.peak_window_entries(lengths + k, U, budget, k)
    need = int((groups.num_full * entries + groups.num_windowed * window).max())
    kv = KVCacheManager(need + extra_blocks, block_size, dcp, groups=groups, prefix_caching=prefix_caching)
    s = Scheduler(reqs, max_num_batched_tokens=budget, max_num_seqs=seqs, kv=kv, num_speculative_tokens=k,
                  draft_kv_reads_next_token=reads_next)
    rng = np.random.default_rng(draft_seed)
    ref = {r.req_id: reference(r) for r in reqs}
    slot = {}  # (block, position in the virtual block) -> token written there
    for _ in range(3000):
        if s.done:
            break
        b = s.schedule()
        if b is None:
            continue
        tables = b.group_block_tables
        assert tables is not None and (tables[0] == b.block_tables).all()
        outs, refs = s.outputs(), kv.ref_counts()
        for i, rid in enumerate(b.req_ids.tolist()):
            c, q = int(b.num_computed_tokens[i]), int(b.num_scheduled_tokens[i])
            history = reqs[rid].prompt_token_ids.tolist() + outs[rid]
            first = int(groups.first_kept(c, U))
            start = int(w.starts(c)) if q else c
            for g in range(groups.num_groups):
                table = tables[g, i]
                lo = start if groups.windowed[g] else 0
                held = [slot.get((int(table[p // U]), p % U)) for p in range(lo, c)]
                assert held == history[lo:c], (rid, g, c)
                if groups.windowed[g]:
                    assert (table[:first] == kv.null_block).all()
                for j in range(q):
                    block = int(table[(c + j) // U])
                    assert block != kv.null_block and refs[block] == 1, "a written block is shared"
            toks = b.input_ids[b.query_start_loc[i]:b.query_start_loc[i + 1]].tolist()
            for g in range(groups.num_groups):
                for j, t in enumerate(toks):
                    slot[(int(tables[g, i, (c + j) // U]), (c + j) % U)] = t
        sampled = []
        for t in b.logits_indices.tolist():  # NOTE: a row reads what came before it: its drafts too
            row = int(b.req_indices[t])
            rid, c = int(b.req_ids[row]), int(b.num_computed_tokens[row])
            history = reqs[rid].prompt_token_ids.tolist() + outs[rid]
            sampled.append(fake_model(history[:c] + b.input_ids[b.query_start_loc[row]:t + 1].tolist()))
        s.update(b, np.array(sampled, dtype=np.int64))
        if k:  # NOTE: proposals right w.p. 0.6 each, sometimes fewer (-1)
            outs = s.outputs()
            drafts = np.full((b.num_reqs, k), -1, dtype=np.int64)
            for i, rid in enumerate(b.req_ids.tolist()):
                truth = ref[rid][len(outs[rid]):len(outs[rid]) + k]
                n = k if rng.random() < 0.7 else rng.integers(0, k + 1)
                drafts[i, :min(n, len(truth))] = [t if rng.random() > 0.4 else int(rng.integers(0, V))
                                                  for t in truth[:n]]
            s.set_draft_tokens(b, drafts)
    assert s.done
    cols = s.timing_columns()
    event(f"preempted: {bool(cols['num_preemptions'].any())}, prefix hit: {bool(cols['prefix_hit_tokens'].any())}")
    assert s.outputs() == ref
    assert kv.num_free_blocks == kv.num_blocks and not kv.ref_counts().any()


def test_a_prefix_hit_takes_the_window_its_first_query_reads():
    # request 1 repeats request 0's 40-token prompt after it finished: the full group's blocks
    # and the window group's last ones (released as request 0 went on, but cached) are found
    groups = KVGroups.of(2, [1], Window(6))
    kv = KVCacheManager(64, 4, groups=groups, prefix_caching=True)
    prompt = np.arange(40, dtype=np.int64) % 5
    reqs = [Request(0, prompt, 3, 0), Request(1, prompt.copy(), 2, 6)]
    s = Scheduler(reqs, max_num_batched_tokens=8, max_num_seqs=2, kv=kv)
    tables = None
    while not s.done:
        b = s.schedule()
        if b is None:
            continue
        if 1 in b.req_ids.tolist() and tables is None:
            i = b.req_ids.tolist().index(1)
            tables, c = b.group_block_tables[:, i], int(b.num_computed_tokens[i])
        s.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
    # (40 - 1) // 4 = 9 entries hit: positions 0..35; the query at 36 reads keys 31..36
    assert c == 36
    assert (tables[0, :9] != kv.null_block).all()
    assert (tables[1, :7] == kv.null_block).all() and (tables[1, 7:9] != kv.null_block).all()
    assert s.timing_columns()["prefix_hit_tokens"].tolist() == [0, 36]
