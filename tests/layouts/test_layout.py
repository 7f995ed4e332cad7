"""pcpflow.layouts.layout: hand-worked layouts, properties over random batches, and an
independent per-token reference planner."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pcpflow.layouts.layout import TokenPositions, pad_layout, plan_layout

REPO = Path(__file__).resolve().parents[2]
PROPERTY = settings(max_examples=80, deadline=None, database=None)


def segments_of(layout, rank):
    s = layout.segments[rank]
    return list(zip(s.req_idx.tolist(), s.global_start.tolist(), s.length.tolist(),
                    s.local_start.tolist()))


# --------------------------------------------------------------------------------------
# Hand-worked cases.
# --------------------------------------------------------------------------------------


def test_seven_token_prefill_pcp2():
    # 4 chunks of 2: [0 1 | 2 3 | 4 5 | 6]; rank 0 takes chunks 0 and 3, rank 1 chunks 1, 2.
    layout = plan_layout([7], [True], pcp_size=2)
    assert layout.per_rank_num_tokens.tolist() == [3, 4]
    assert layout.padded_num_tokens == 4
    assert layout.padded_gather_idx.tolist() == [0, 1, 6, 0, 2, 3, 4, 5]
    assert layout.kv_write_mask.tolist() == [True, True, True, False] + [True] * 4
    assert layout.hidden_restore_idx.tolist() == [0, 1, 4, 5, 6, 7, 2]
    assert layout.is_padding.tolist() == [False] * 3 + [True] + [False] * 4
    assert segments_of(layout, 0) == [(0, 0, 2, 0), (0, 6, 1, 2)]
    assert segments_of(layout, 1) == [(0, 2, 2, 0), (0, 4, 2, 2)]
    assert layout.replicated.tolist() == [False]
    assert layout.owner.tolist() == [-1]
    assert layout.num_replicated_decode_tokens == 0
    assert layout.query_start_loc.tolist() == [0, 7]
    assert layout.num_tokens == 7


def test_pcp3_decodes_and_prefills():
    # req 0: decode (token 0); req 1: 10-token prefill (tokens 1..10), chunks of 2:
    #   [1 2 | 3 4 | 5 6 | 7 8 | 9 10 | -]; req 2: 3-token spec-verify decode (11..13);
    # req 3: 4-token prefill (14..17), chunks of 1: [14 | 15 | 16 | 17 | - | -].
    # Rank k takes chunks k and 5-k; decodes go first on every rank, rank 0 writes them.
    layout = plan_layout([1, 10, 3, 4], [False, True, False, True], pcp_size=3)
    assert layout.per_rank_num_tokens.tolist() == [7, 9, 10]
    assert layout.padded_num_tokens == 10
    assert layout.padded_gather_idx.tolist() == (
        [0, 11, 12, 13, 1, 2, 14, 0, 0, 0]
        + [0, 11, 12, 13, 3, 4, 9, 10, 15, 0]
        + [0, 11, 12, 13, 5, 6, 7, 8, 16, 17]
    )
    assert layout.kv_write_mask.tolist() == (
        [True] * 7 + [False] * 3
        + [False] * 4 + [True] * 5 + [False]
        + [False] * 4 + [True] * 6
    )
    assert layout.hidden_restore_idx.tolist() == [
        0, 4, 5, 14, 15, 24, 25, 26, 27, 16, 17, 1, 2, 3, 6, 18, 28, 29,
    ]
    assert layout.num_replicated_decode_tokens == 4
    assert layout.replicated.tolist() == [True, False, True, False]
    assert layout.owner.tolist() == [0, -1, 0, -1]
    assert segments_of(layout, 1) == [
        (0, 0, 1, 0), (2, 11, 3, 1), (1, 3, 2, 4), (1, 9, 2, 6), (3, 15, 1, 8),
    ]
    assert layout.rank_rows(2) == slice(20, 30)


def test_sharded_owners_skip_zero_token_rows():
    # Replicated requests with tokens: 0, 2, 4, 5 -> ordinals 0..3 -> ranks 0, 1, 0, 1.
    q = [1, 0, 2, 0, 1, 1]
    layout = plan_layout(q, [False, False, False, True, False, False], pcp_size=2,
                         shard_decodes=True)
    assert layout.owner.tolist() == [0, -1, 1, -1, 0, 1]
    # tokens: req 0 -> 0, req 2 -> 1 2, req 4 -> 3, req 5 -> 4
    assert layout.per_rank_num_tokens.tolist() == [2, 3]
    assert layout.padded_gather_idx.tolist() == [0, 3, 0, 1, 2, 4]
    assert layout.kv_write_mask.tolist() == [True, True, False, True, True, True]
    assert layout.hidden_restore_idx.tolist() == [0, 3, 4, 1, 5]
    assert layout.num_replicated_decode_tokens == 0


def test_dcp_short_prefill_sharded_is_restored_from_its_owner():
    # P=2, dcp=2: 3-token prefill has chunks of 1 and only 3 of 4 filled -> replicated,
    # the 2nd replicated request -> rank 1. The 10-token prefill (chunks of 3) is split:
    # tokens 4..13 as [4 5 6 | 7 8 9 | 10 11 12 | 13].
    q, pre = [1, 3, 10], [False, True, True]
    layout = plan_layout(q, pre, pcp_size=2, dcp_size=2, shard_decodes=True)
    assert layout.replicated.tolist() == [True, True, False]
    assert layout.owner.tolist() == [0, 1, -1]
    assert layout.padded_num_tokens == 9
    assert layout.padded_gather_idx.tolist() == (
        [0, 4, 5, 6, 13, 0, 0, 0, 0] + [1, 2, 3, 7, 8, 9, 10, 11, 12]
    )
    assert layout.kv_write_mask.tolist() == [True] * 5 + [False] * 4 + [True] * 9
    assert layout.hidden_restore_idx.tolist() == [0, 9, 10, 11, 1, 2, 3, 12, 13, 14, 15, 16, 17, 4]

    # Replicated decodes instead: the short prefill is on both ranks (after the decodes,
    # among the prefills), rank 0 writes it; only the decode counts as a leading row.
    layout = plan_layout(q, pre, pcp_size=2, dcp_size=2)
    assert layout.padded_gather_idx.tolist() == (
        [0, 1, 2, 3, 4, 5, 6, 13, 0, 0] + [0, 1, 2, 3, 7, 8, 9, 10, 11, 12]
    )
    assert layout.hidden_restore_idx.tolist() == [0, 1, 2, 3, 4, 5, 6, 14, 15, 16, 17, 18, 19, 7]
    assert layout.num_replicated_decode_tokens == 1
    # Without DCP the same 3-token prefill is split (one token on each of 3 chunks).
    assert plan_layout(q, pre, pcp_size=2).replicated.tolist() == [True, False, False]


def test_explicit_padding():
    layout = plan_layout([7], [True], pcp_size=2, padded_num_tokens=6)
    assert layout.padded_gather_idx.tolist() == [0, 1, 6, 0, 0, 0, 2, 3, 4, 5, 0, 0]
    assert layout.hidden_restore_idx.tolist() == [0, 1, 6, 7, 8, 9, 2]
    assert layout.is_padding.tolist() == [False] * 3 + [True] * 3 + [False] * 4 + [True] * 2
    assert layout.rank_rows(1) == slice(6, 12)
    with pytest.raises(ValueError, match=r"padded_num_tokens \(3\).*\(4\)"):
        plan_layout([7], [True], pcp_size=2, padded_num_tokens=3)


def test_balanced_small_case_is_optimal():
    # works 101, 11, 11, 11, 61, 31 on 2 ranks: the best split is {101, 11} / {61, 31, 11, 11}.
    layout = plan_layout([1] * 6, [False] * 6, pcp_size=2, shard_decodes=True,
                         num_computed_tokens=[100, 10, 10, 10, 60, 30],
                         decode_assignment="balanced")
    work = np.array([101, 11, 11, 11, 61, 31])
    loads = np.bincount(layout.owner, weights=work, minlength=2)
    assert sorted(loads.tolist()) == [112, 114]
    assert layout.owner[0] != layout.owner[4]


def test_empty_and_idle_batches():
    layout = plan_layout([], [], pcp_size=3)
    assert layout.num_tokens == 0 and layout.padded_num_tokens == 0
    assert layout.padded_gather_idx.shape == (0,) and layout.hidden_restore_idx.shape == (0,)
    assert [len(s) for s in layout.segments] == [0, 0, 0]
    layout = plan_layout([0, 0], [True, False], pcp_size=2, padded_num_tokens=2)
    assert layout.padded_gather_idx.tolist() == [0, 0, 0, 0]
    assert not layout.kv_write_mask.any()
    assert layout.owner.tolist() == [-1, -1]


def test_pcp1_holds_everything_in_order():
    layout = plan_layout([3, 1, 5], [True, False, True], pcp_size=1)
    assert layout.padded_gather_idx.tolist() == [3, 0, 1, 2, 4, 5, 6, 7, 8]
    assert layout.kv_write_mask.all()
    assert layout.hidden_restore_idx.tolist() == [1, 2, 3, 0, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(num_scheduled_tokens=[1, -2], is_prefilling=[False, True], pcp_size=2),
         r"num_scheduled_tokens\[1\] \(-2\)"),
        (dict(num_scheduled_tokens=[1, 2], is_prefilling=[False], pcp_size=2),
         r"is_prefilling has 1 entries but num_scheduled_tokens has 2"),
        (dict(num_scheduled_tokens=[1], is_prefilling=[False], pcp_size=0), r"pcp_size \(0\)"),
        (dict(num_scheduled_tokens=[1], is_prefilling=[False], pcp_size=2, dcp_size=4),
         r"dcp_size \(4\) must be 1 or pcp_size \(2\)"),
        (dict(num_scheduled_tokens=[1], is_prefilling=[False], pcp_size=2,
              decode_assignment="greedy"), r"'greedy'.*round_robin.*balanced"),
        (dict(num_scheduled_tokens=[1, 1], is_prefilling=[False, False], pcp_size=2,
              num_computed_tokens=[3]), r"num_computed_tokens has 1 entries.*has 2"),
        (dict(num_scheduled_tokens=[1], is_prefilling=[False], pcp_size=2,
              num_computed_tokens=[-5]), r"num_computed_tokens\[0\] \(-5\)"),
        (dict(num_scheduled_tokens=[[1]], is_prefilling=[False], pcp_size=2), r"1-D"),
        (dict(num_scheduled_tokens=[1.5], is_prefilling=[False], pcp_size=2), r"integers"),
    ],
)
def test_bad_input_names_the_numbers(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_layout(**kwargs)


def test_layout_and_slots_do_not_import_torch():
    code = "import sys, pcpflow.layouts.layout, pcpflow.layouts.slots; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)


def test_bench_script_quick_run():
    # Keeps scripts/bench_layout.py (loop reference, trace scheduler, tables) from rotting.
    result = subprocess.run([sys.executable, "scripts/bench_layout.py", "--quick"], cwd=REPO,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------
# Random batches.
# --------------------------------------------------------------------------------------

KINDS = ("idle_decode", "idle_prefill", "decode", "spec", "prefill_1", "prefill_2p_minus_1",
         "prefill_any", "prefill_2p_multiple")


@st.composite
def batches(draw):
    p = draw(st.integers(1, 8))
    kinds = draw(st.lists(st.sampled_from(KINDS), max_size=10))
    q, pre = [], []
    for kind in kinds:
        q.append({
            "idle_decode": 0, "idle_prefill": 0, "decode": 1,
            "spec": draw(st.integers(2, 5)), "prefill_1": 1, "prefill_2p_minus_1": 2 * p - 1,
            "prefill_any": draw(st.integers(1, 90)),
            "prefill_2p_multiple": 2 * p * draw(st.integers(1, 3)),
        }[kind])
        pre.append(kind.startswith(("prefill", "idle_prefill")))
    computed = draw(st.lists(st.integers(0, 5000), min_size=len(q), max_size=len(q)))
    return dict(
        num_scheduled_tokens=np.array(q, dtype=np.int64),
        is_prefilling=np.array(pre, dtype=bool),
        pcp_size=p,
        dcp_size=draw(st.sampled_from([1, p])),
        shard_decodes=draw(st.booleans()),
        decode_assignment=draw(st.sampled_from(["round_robin", "balanced"])),
        num_computed_tokens=np.array(computed, dtype=np.int64),
        extra_padding=draw(st.one_of(st.none(), st.integers(0, 4))),
    )


def plan(batch, padded=None):
    kwargs = {k: v for k, v in batch.items() if k != "extra_padding"}
    layout = plan_layout(**kwargs)
    if batch["extra_padding"] is not None and padded is None:
        layout = plan_layout(**kwargs,
                             padded_num_tokens=layout.padded_num_tokens + batch["extra_padding"])
    return layout


def reference_layout(batch, owner):
    """Per-token planner: decide each token's rank(s) from its chunk, then sort each rank's
    tokens by (is_prefilling, request, position). ``owner``: each replicated request's
    single holder under shard_decodes; None for the round-robin rule."""
    q, pre = batch["num_scheduled_tokens"].tolist(), batch["is_prefilling"].tolist()
    p, dcp, shard = batch["pcp_size"], batch["dcp_size"], batch["shard_decodes"]
    starts = np.concatenate([[0], np.cumsum(q)]).astype(int).tolist()
    replicated = []
    for n, is_pre in zip(q, pre):
        chunk = -(-n // (2 * p))
        filled = sum(1 for j in range(2 * p) if j * chunk < n)
        replicated.append(not is_pre or (dcp > 1 and filled < 2 * p))
    if owner is None:  # round robin: the k-th replicated request with tokens -> rank k % P
        held = [r for r, n in enumerate(q) if n > 0 and replicated[r]]
        owner = [-1] * len(q)
        for ordinal, r in enumerate(held):
            owner[r] = ordinal % p if shard else 0
    rows = [[] for _ in range(p)]  # (sort key, token, writes, segment id)
    for r, n in enumerate(q):
        chunk = -(-n // (2 * p))
        rep = replicated[r]
        for offset in range(n):
            key, token = (pre[r], r, offset), starts[r] + offset
            if rep:
                holders = [owner[r]] if shard else list(range(p))
                for k in holders:
                    rows[k].append((key, token, k == holders[0], (r, -1)))
            else:
                j = offset // chunk
                rows[j if j < p else 2 * p - 1 - j].append((key, token, True, (r, j)))
    for rank_rows in rows:
        rank_rows.sort()
    per_rank = [len(rank_rows) for rank_rows in rows]
    n_pad = max(per_rank)
    if batch["extra_padding"] is not None:
        n_pad += batch["extra_padding"]
    gather = np.zeros(p * n_pad, dtype=np.int64)
    mask = np.zeros(p * n_pad, dtype=bool)
    restore = np.full(starts[-1], -1, dtype=np.int64)
    segments = []
    for k, rank_rows in enumerate(rows):
        segs = []
        for i, (_, token, writes, seg_id) in enumerate(rank_rows):
            gather[k * n_pad + i] = token
            if writes:
                mask[k * n_pad + i] = True
                restore[token] = k * n_pad + i
            if i == 0 or rank_rows[i - 1][3] != seg_id:
                segs.append([seg_id[0], token, 1, i])
            else:
                segs[-1][2] += 1
        segments.append([tuple(s) for s in segs])
    return dict(replicated=replicated, owner=owner, per_rank=per_rank, n_pad=n_pad, gather=gather,
                mask=mask, restore=restore, segments=segments)


@PROPERTY
@given(batches())
def test_matches_per_token_reference(batch):
    assert_matches_reference(batch)


@PROPERTY
@given(batches().map(lambda b: {**b, "is_prefilling": np.zeros_like(b["is_prefilling"])}))
def test_decode_steps_match_per_token_reference(batch):
    # NOTE: replicated decodes take plan_layout's shortcut; sharded ones its general path
    layout = assert_matches_reference(batch)
    for seg in layout.segments:
        for name in ("req_idx", "global_start", "length", "local_start"):
            assert getattr(seg, name).dtype == np.int64, name


def assert_matches_reference(batch):
    layout = plan(batch)
    balanced = batch["shard_decodes"] and batch["decode_assignment"] == "balanced"
    # The balanced policy itself is checked in test_owners; here its owners are given.
    owner = layout.owner.tolist() if balanced else None
    ref = reference_layout(batch, owner)
    assert layout.replicated.tolist() == ref["replicated"]
    if not balanced:
        assert layout.owner.tolist() == ref["owner"]
    assert layout.per_rank_num_tokens.tolist() == ref["per_rank"]
    assert layout.padded_num_tokens == ref["n_pad"]
    np.testing.assert_array_equal(layout.padded_gather_idx, ref["gather"])
    np.testing.assert_array_equal(layout.kv_write_mask, ref["mask"])
    np.testing.assert_array_equal(layout.hidden_restore_idx, ref["restore"])
    assert [segments_of(layout, k) for k in range(batch["pcp_size"])] == ref["segments"]
    for name in ("query_start_loc", "owner", "per_rank_num_tokens", "padded_gather_idx",
                 "hidden_restore_idx"):
        assert getattr(layout, name).dtype == np.int64, name
    return layout


@PROPERTY
@given(batches())
def test_invariants(batch):
    layout = plan(batch)
    t, p, n = layout.num_tokens, layout.pcp_size, layout.padded_num_tokens
    gather, mask = layout.padded_gather_idx, layout.kv_write_mask
    restore = layout.hidden_restore_idx
    assert gather.shape == mask.shape == (p * n,) and restore.shape == (t,)
    np.testing.assert_array_equal(gather[restore], np.arange(t))
    assert mask[restore].all()
    assert mask.sum() == t
    padding = layout.is_padding
    assert (gather[padding] == 0).all() and not mask[padding].any()
    assert ((np.arange(p * n) % n >= np.repeat(layout.per_rank_num_tokens, n)) == padding).all()
    # Each rank's segments tile its real rows in order.
    for k, seg in enumerate(layout.segments):
        assert (seg.length > 0).all()
        ends = np.cumsum(seg.length)
        np.testing.assert_array_equal(seg.local_start, ends - seg.length)
        assert (ends[-1] if len(seg) else 0) == layout.per_rank_num_tokens[k]
        rows = gather[layout.rank_rows(k)]
        for g, length, lo in zip(seg.global_start, seg.length, seg.local_start):
            np.testing.assert_array_equal(rows[lo : lo + length], np.arange(g, g + length))


@PROPERTY
@given(batches())
def test_chunk_ownership_and_local_order(batch):
    layout = plan(batch)
    p, n = layout.pcp_size, layout.padded_num_tokens
    q, pre = batch["num_scheduled_tokens"], batch["is_prefilling"]
    qsl = layout.query_start_loc
    real = ~layout.is_padding
    rank_of_row = np.arange(p * n) // max(n, 1)
    for r in np.flatnonzero(~layout.replicated & (q > 0)):
        chunk = -(-int(q[r]) // (2 * p))
        for offset in range(int(q[r])):
            holders = rank_of_row[real & (layout.padded_gather_idx == qsl[r] + offset)]
            k = offset // chunk
            assert holders.tolist() == [min(k, 2 * p - 1 - k)]
    for k in range(p):
        tokens = layout.padded_gather_idx[layout.rank_rows(k)][: layout.per_rank_num_tokens[k]]
        req = np.searchsorted(qsl, tokens, side="right") - 1
        keys = list(zip(pre[req].tolist(), req.tolist(), tokens.tolist()))
        assert keys == sorted(keys) and len(set(keys)) == len(keys)


@PROPERTY
@given(batches())
def test_owners(batch):
    layout = plan(batch)
    p = layout.pcp_size
    q = batch["num_scheduled_tokens"]
    held = layout.replicated & (q > 0)
    assert (layout.owner[~held] == -1).all()
    if not batch["shard_decodes"]:
        assert (layout.owner[held] == 0).all()
        return
    assert ((layout.owner[held] >= 0) & (layout.owner[held] < p)).all()
    # Every replicated request lives on exactly its owner.
    for r in np.flatnonzero(held):
        first = layout.query_start_loc[r]
        rows = np.flatnonzero(~layout.is_padding & (layout.padded_gather_idx == first))
        assert (rows // layout.padded_num_tokens).tolist() == [layout.owner[r]]
    if batch["decode_assignment"] == "round_robin":
        assert layout.owner[held].tolist() == (np.arange(held.sum()) % p).tolist()
    else:
        work = (batch["num_computed_tokens"] + q)[held]
        if len(work):
            loads = np.bincount(layout.owner[held], weights=work, minlength=p)
            assert loads.max() <= loads.mean() + work.max()
        again = plan_layout(**{k: v for k, v in batch.items() if k != "extra_padding"})
        np.testing.assert_array_equal(again.owner, layout.owner)


@PROPERTY
@given(batches())
def test_leading_decode_rows_are_identical_on_every_rank(batch):
    layout = plan(batch)
    nd = layout.num_replicated_decode_tokens
    q, pre = batch["num_scheduled_tokens"], batch["is_prefilling"]
    if batch["shard_decodes"]:
        assert nd == 0
        return
    assert nd == int(q[~pre].sum())
    view = layout.padded_gather_idx.reshape(layout.pcp_size, -1)[:, :nd]
    assert (view == view[0]).all()
    assert layout.kv_write_mask.reshape(layout.pcp_size, -1)[1:, :nd].sum() == 0


def test_a_repeated_decode_batch_shares_one_read_only_layout():
    q, pre = np.array([1, 0, 1, 3], dtype=np.int64), np.zeros(4, dtype=bool)
    first = plan_layout(q, pre, pcp_size=2)
    again = plan_layout(q.copy(), pre, pcp_size=2, num_computed_tokens=[5, 6, 7, 8])  # no part of their layout
    assert again is first
    assert segments_of(first, 0) == segments_of(first, 1) == [(0, 0, 1, 0), (2, 1, 1, 1), (3, 2, 3, 2)]
    assert first.owner.tolist() == [0, -1, 0, 0] and first.per_rank_num_tokens.tolist() == [5, 5]
    for a in (first.query_start_loc, first.replicated, first.owner, first.per_rank_num_tokens,
              first.segments[0].req_idx):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = a[0]
    assert plan_layout(q, pre, pcp_size=2, padded_num_tokens=8).padded_num_tokens == 8  # its own entry


@PROPERTY
@given(batches())
def test_segment_positions_by_request_are_the_tokens_positions(batch):
    layout = plan(batch)
    q, c = batch["num_scheduled_tokens"], batch["num_computed_tokens"]
    positions = TokenPositions(layout.query_start_loc, c)
    per_token = [int(c[r]) + i for r, n in enumerate(q.tolist()) for i in range(n)]
    for seg in layout.segments:
        got = positions.of_requests(seg.global_start, seg.req_idx).tolist()
        assert got == [per_token[t] for t in seg.global_start.tolist()]
        assert got == positions[seg.global_start].tolist()


@PROPERTY
@given(batches())
def test_explicit_padding_only_appends_rows(batch):
    batch = {**batch, "extra_padding": None}
    tight = plan(batch)
    extra = 3
    kwargs = {k: v for k, v in batch.items() if k != "extra_padding"}
    padded = plan_layout(**kwargs, padded_num_tokens=tight.padded_num_tokens + extra)
    n, p = tight.padded_num_tokens, tight.pcp_size
    np.testing.assert_array_equal(
        padded.padded_gather_idx.reshape(p, n + extra)[:, :n], tight.padded_gather_idx.reshape(p, n)
    )
    assert padded.kv_write_mask.reshape(p, n + extra)[:, n:].sum() == 0
    rank, row = np.divmod(tight.hidden_restore_idx, max(n, 1))
    np.testing.assert_array_equal(padded.hidden_restore_idx, rank * (n + extra) + row)
    if tight.per_rank_num_tokens.max() > 0:
        with pytest.raises(ValueError, match="padded_num_tokens"):
            plan_layout(**kwargs, padded_num_tokens=int(tight.per_rank_num_tokens.max()) - 1)


@PROPERTY
@given(batches(), st.integers(0, 5))
def test_padding_a_plan_is_planning_it_padded(batch, extra):
    kwargs = {k: v for k, v in batch.items() if k != "extra_padding"}
    tight = plan_layout(**kwargs)
    n = tight.padded_num_tokens + extra
    padded, planned = pad_layout(tight, n), plan_layout(**kwargs, padded_num_tokens=n)
    # NOTE: the per-token views are properties (derived on first read), not fields
    views = ("padded_gather_idx", "kv_write_mask", "hidden_restore_idx", "is_padding")
    for name in [f.name for f in fields(planned)] + list(views):
        a, b = getattr(padded, name), getattr(planned, name)
        if name == "segments":
            for sa, sb in zip(a, b, strict=True):
                for g in fields(sb):
                    np.testing.assert_array_equal(getattr(sa, g.name), getattr(sb, g.name))
        elif isinstance(b, np.ndarray):
            assert a.dtype == b.dtype, name
            np.testing.assert_array_equal(a, b, err_msg=name)
        else:
            assert a == b, name
    if tight.per_rank_num_tokens.max() > 0:
        with pytest.raises(ValueError, match="padded_num_tokens"):
            pad_layout(tight, int(tight.per_rank_num_tokens.max()) - 1)


def test_accepts_lists_and_other_int_dtypes():
    a = plan_layout(np.array([3, 1, 9], dtype=np.int32), np.array([1, 0, 1], dtype=np.int8),
                    pcp_size=2, num_computed_tokens=np.array([0, 4, 2], dtype=np.uint16))
    b = plan_layout([3, 1, 9], [True, False, True], pcp_size=2, num_computed_tokens=[0, 4, 2])
    np.testing.assert_array_equal(a.padded_gather_idx, b.padded_gather_idx)
    np.testing.assert_array_equal(a.hidden_restore_idx, b.hidden_restore_idx)
    assert a.query_start_loc.dtype == np.int64
