"""Tensor parallelism beside PCP and DCP is exact, and its traffic is what accounting says.

Every run is checked against the single rank (tp=1, pcp=1, dcp=1, in-process on rank 0):
float64 logits within 1e-9, equal tokens, and every rank's cache holding exactly the
reference's entries for the positions it owns and the KV heads it holds (NaN elsewhere);
the tokens are also the greedy continuation of a dense, cache-free forward
(tests/reference.py). Prompts are odd (never a multiple of 2*pcp), one is longer than
the token budget (a continued prefill), drafting makes speculative rows of 1+k tokens and,
with a budget of 8, a prefill left without budget behind them (a zero-token row; checked on
the scheduler alone by ``test_workload_has_continued_zero_token_and_speculative_rows``).

Ranks start once per world size for all configs of that size (``pcpflow.testing.run``);
the default set runs a few configs at 2 and 4 ranks; ``-m slow`` the whole matrix,
including the two tiny 8-rank grids (tp=4 pcp=2, one thread per rank).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import shutil
import tempfile
from pathlib import Path
from typing import Literal

import numpy as np
import pytest
import shared_ranks
import torch
from exactness import dense_reference_agrees

from pcpflow.errors import ConfigError
from pcpflow.layouts.accounting import (
    ModelShape,
    dcp_over_tp_collectives,
    plan_dcp_rest,
    step_traffic,
    tp_layer_collectives,
    tp_step_collectives,
)
from pcpflow.layouts.layout import plan_layout
from pcpflow.models.layers import gqa_spec, mla_spec
from pcpflow.parallel.grid import RankGrid
from pcpflow.parallel.tensor_parallel import entry_columns, kv_heads_of, local_spec
from pcpflow.pipeline.stage import Stage, StageConfig
from pcpflow.testing import cli, compose

WORKLOAD = [
    "workload=explicit",
    "workload.prompt_lens=[3,1,1,11,7]",
    "workload.output_lens=[4]",
    "workload.arrival_steps=[0,0,0,0,3]",
    "scheduler.max_num_batched_tokens=8",  # < 11: continued prefill; 3 verify rows of 3 > 8
    "scheduler.max_num_seqs=4",
    "kv.block_size=4",
    "dtype=float64",
    "output.plots=false",
    "output.progress=false",
]
TINY = [  # 8 ranks on a shared CPU: two short prompts
    "workload=explicit",
    "workload.prompt_lens=[5,9]",
    "workload.output_lens=[3]",
    "scheduler.max_num_batched_tokens=8",
    "kv.block_size=4",
    "dtype=float64",
    "output.plots=false",
    "output.progress=false",
]


def _cfg(tp, pcp, dcp, decode, model, *extra, workload=WORKLOAD, backend="ag_rs"):
    cfg = compose(
        [*workload, f"tp={tp}", f"pcp={pcp}", f"dcp={dcp}", f"decode={decode}", f"model={model}", *extra]
    )
    # NOTE: set on the validated config (a top-level key the installed conf may predate).
    return cfg.model_copy(update={"dcp_comm_backend": backend})


def _label(cfg) -> str:
    draft = cfg.draft_stage_config().get("kind")
    return (
        f"tp={cfg.tp} pcp={cfg.pcp} dcp={cfg.dcp} {cfg.decode.mode} {cfg.model.name} "
        f"{cfg.dcp_comm_backend} draft={draft}"
    )


def assert_exact(cfg, result) -> None:
    v, label = result["verify"], _label(cfg)
    assert v["passed"], f"{label}: {v}"
    assert v["tokens_match"] and v["kv_match"] and v["num_token_mismatches"] == 0, label
    assert v["max_abs_logit_diff"] <= 1e-9 and v["max_abs_kv_diff"] <= 1e-9, label
    assert v["num_tokens_checked"] > 0, label
    assert [len(o) for o in result["outputs"]] == [r["output_len"] for r in result["requests"]]
    assert dense_reference_agrees(cfg, result), f"{label}: tokens differ from the dense reference"
    if cfg.tp > 1:
        assert result["metrics"]["collective_calls"].get("tp_all_reduce", 0) > 0, label


# ----------------------------------------------------------------------------- traffic probe
class TPTrafficProbe(Stage):
    """Test-only stage after ``restore``: rank 0 appends this step's (calls, bytes) by
    purpose as counted by the run's ``CommStats`` and as priced by
    ``pcpflow.layouts.accounting.tp_step_collectives`` from the layout alone."""

    kind = "test_tp_traffic_probe"

    class Config(StageConfig):
        kind: Literal["test_tp_traffic_probe"] = "test_tp_traffic_probe"
        path: str

    def __call__(self, state):
        ctx, cfg = self.ctx, self.ctx.config
        spec, model = ctx.model.attn_spec, ctx.model
        shape = ModelShape(
            hidden_size=model.hidden_size,
            num_layers=model.num_layers,
            entry_dim=spec.entry_dim,
            num_heads=spec.num_heads,
            qk_dim=spec.qk_dim,
            v_dim=spec.v_dim,
            dtype_bytes=ctx.kv_caches[0].element_size(),
        )
        b, layout = state.batch, state.layout
        rest = plan_dcp_rest(
            layout,
            b.seq_lens,
            policy=state.attn.dcp_rest or "queries",
            dcp_size=ctx.dcp_size,
            interleave=cfg.kv.interleave,
            shape=shape,
        )
        colls = tp_step_collectives(
            layout,
            b.logits_indices,
            tp_size=ctx.tp.size,
            dcp_size=ctx.dcp_size,
            shape=shape,
            dcp_rest=rest,
            restore=(cfg.pipeline.get("restore") or {}).get("kind") or "all_rows",
            backend=cfg.dcp_comm_backend,
        )
        priced = step_traffic(
            colls, pcp_size=ctx.pcp_size, dcp_size=ctx.dcp_size, dtype_bytes=shape.dtype_bytes, tp_size=ctx.tp.size
        )
        if ctx.world.rank == 0:
            counted = (dict(ctx.stats.step_calls), dict(ctx.stats.step_bytes))
            with open(self.config.path, "a") as f:
                f.write(json.dumps({"step": b.step, "counted": counted, "priced": priced}) + "\n")
        return state


class CorruptOneHead(Stage):
    """Test-only fault after ``forward``: at step ``step``, global rank ``rank`` (not the
    verifier's) shifts one written K element of its layer-0 cache by 1e-3."""

    kind = "test_tp_corrupt_one_head"

    class Config(StageConfig):
        kind: Literal["test_tp_corrupt_one_head"] = "test_tp_corrupt_one_head"
        rank: int = 1
        step: int = 1

    def __call__(self, state):
        ctx = self.ctx
        if not ctx.is_reference and ctx.world.rank == self.config.rank and state.batch.step == self.config.step:
            slots = state.attn.gathered_slot_mapping
            slot = int(slots[slots >= 0][0])
            ctx.kv_caches[0][slot, 0] += 1e-3
        return state


def _probed(cfg, path):
    pipeline = dict(cfg.pipeline)
    probe = {"kind": f"{__name__}:TPTrafficProbe", "after": "restore", "path": str(path)}
    pipeline["extra"] = [*(pipeline.get("extra") or []), probe]
    return cfg.model_copy(update={"pipeline": pipeline})


# ----------------------------------------------------------------------------- the runs
DEFAULT = [
    # tp=2 pcp=1: DCP inside the TP group (MLA), with an MTP drafter under TP too
    (2, 1, 2, "replicated", "tiny_mla", ("draft=mtp",), "ag_rs"),
    # tp=2 pcp=2: dcp = tp*pcp over all four ranks (MLA), dcp = pcp (GQA)
    (2, 2, 4, "replicated", "tiny_mla", (), "ag_rs"),
    (2, 2, 2, "sharded", "tiny_gqa", (), "ag_rs"),
    # tp=4 pcp=1: GQA KV heads (2) replicated over pairs of TP ranks, DCP within a pair
    (4, 1, 2, "replicated", "tiny_gqa", (), "a2a"),
]
PROBED = {1, 2, 3}  # DEFAULT indices whose traffic is compared with accounting's price


def _allowed(tp, pcp, model) -> list[int]:
    grid = RankGrid(tp=tp, pcp=pcp)
    dcps = [d for d in grid.allowed_dcp() if d in {1, pcp, tp * pcp}]
    if model == "tiny_gqa":  # 2 KV heads: TP ranks share a head only in pairs at tp=4
        share = max(1, tp // 2)
        dcps = [d for d in dcps if share % RankGrid(tp=tp, pcp=pcp, dcp=d).dcp_tp == 0]
    return dcps


SLOW = [
    (tp, pcp, dcp, decode, model, extra, backend)
    for tp in (2, 4)
    for pcp in (1, 2)
    for model in ("tiny_mla", "tiny_gqa")
    for dcp in _allowed(tp, pcp, model)
    for decode in ("replicated", "sharded")
    for extra, backend in (((), "ag_rs"), (("draft=mtp",), "a2a"))
    if tp * pcp <= 4 or (dcp == tp * pcp and decode == "sharded" and not extra)
] + [
    (2, 2, 4, "replicated", "tiny_mla", ("draft=dspark",), "a2a"),
    (2, 1, 1, "replicated", "tiny_gqa", ("draft=self",), "ag_rs"),
    (4, 2, 2, "replicated", "tiny_gqa", (), "ag_rs"),
    (2, 2, 2, "sharded", "tiny_mla", ("pipeline.restore.kind=sampled_rows", "kv.interleave=2"), "ag_rs"),
]


_PROBES: dict[int, Path] = {}  # DEFAULT index -> the probe file its run writes


@shared_ranks.matrix("tp/default")
def _default_configs():
    tmp = Path(tempfile.mkdtemp(prefix="pcpflow-test-tp-"))
    atexit.register(shutil.rmtree, tmp, True)
    cfgs = []
    for i, (tp, pcp, dcp, decode, model, extra, backend) in enumerate(DEFAULT):
        cfg = _cfg(tp, pcp, dcp, decode, model, *extra, backend=backend)
        if i in PROBED:
            _PROBES[i] = tmp / f"probe{i}.jsonl"
            cfg = _probed(cfg, _PROBES[i])
        cfgs.append(cfg)
    faulty = _cfg(2, 2, 2, "sharded", "tiny_gqa")  # rank 1: TP rank 1, KV head 1
    fault = {"kind": f"{__name__}:CorruptOneHead", "after": "forward", "rank": 1, "step": 1}
    return [*cfgs, faulty.model_copy(update={"pipeline": {**faulty.pipeline, "extra": [fault]}})]


@shared_ranks.matrix("tp/slow")
def _slow_configs():
    return [
        _cfg(tp, pcp, dcp, decode, model, *extra, workload=WORKLOAD if tp * pcp <= 4 else TINY, backend=backend)
        for tp, pcp, dcp, decode, model, extra, backend in SLOW
    ]


@pytest.fixture(scope="module")
def default_runs(shared_runs):
    pairs = shared_runs["tp/default"]
    cfgs, results = [c for c, _ in pairs], [r for _, r in pairs]
    records = {i: [json.loads(x) for x in p.read_text().splitlines()] for i, p in _PROBES.items()}
    return cfgs[:-1], results[:-1], records, results[-1]


@pytest.mark.dist
@pytest.mark.matrix("tp/default")
def test_tp_runs_equal_the_single_rank(default_runs):
    cfgs, results, _, _ = default_runs
    for cfg, result in zip(cfgs, results):
        assert_exact(cfg, result)
    # One model, any grid: the same tokens (float64 leaves no room for drift).
    by_model: dict[tuple, list] = {}
    for cfg, result in zip(cfgs, results):
        by_model.setdefault(cfg.model.name, []).append(result["outputs"])
    for outs in by_model.values():
        assert all(o == outs[0] for o in outs)


@pytest.mark.dist
@pytest.mark.matrix("tp/default")
def test_run_traffic_is_accountings_price_step_by_step(default_runs):
    _, _, records, _ = default_runs
    for i, recs in records.items():
        assert recs, DEFAULT[i]
        for rec in recs:
            assert rec["counted"] == rec["priced"], (DEFAULT[i], rec)
        total = sum(r["counted"][1].get("tp_all_reduce", 0) for r in recs)
        assert total > 0


@pytest.mark.dist
@pytest.mark.matrix("tp/default")
def test_ag_rs_and_a2a_move_what_their_names_say(default_runs):
    cfgs, results, _, _ = default_runs
    for cfg, result in zip(cfgs, results):
        purposes = set(result["metrics"]["collective_calls"])
        if RankGrid(tp=cfg.tp, pcp=cfg.pcp, dcp=cfg.dcp).dcp_tp == 1:
            assert "dcp_lse_gather" not in purposes
        elif cfg.dcp_comm_backend == "ag_rs":
            assert {"dcp_query_gather", "dcp_lse_gather", "dcp_output_reduce_scatter"} <= purposes
            assert {"dcp_decode_query_gather", "dcp_decode_output_reduce_scatter"} <= purposes
            assert "dcp_partials" not in purposes and "dcp_decode_partials" not in purposes
        else:
            assert {"dcp_query_gather", "dcp_partials", "dcp_decode_partials"} <= purposes
            assert "dcp_lse_gather" not in purposes and "dcp_decode_lse_gather" not in purposes


@pytest.mark.dist
@pytest.mark.matrix("tp/default")
def test_kv_check_reads_every_tp_ranks_heads(default_runs):
    """One K element of TP rank 1's own KV head, off by 1e-3: the run fails on its cache
    (the logits may still pass: one key barely moves them)."""
    v = default_runs[3]["verify"]
    assert not v["passed"] and not v["kv_match"] and v["kv_mismatched_slots"] >= 1, v


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("tp/slow")
def test_tp_matrix_equals_the_single_rank(shared_runs):
    for cfg, result in shared_runs["tp/slow"]:
        assert_exact(cfg, result)


def test_workload_has_continued_zero_token_and_speculative_rows():
    """The scheduler alone (global, so every rank's batches) on WORKLOAD with 2 drafts per
    decode: a prompt continued over steps, a prefill left without budget behind three
    verify rows (a zero-token row) and verify rows of 1 + 2 tokens."""
    from pcpflow.scheduling.kv_cache import KVCacheManager
    from pcpflow.scheduling.scheduler import Scheduler
    from pcpflow.scheduling.workload import build_requests

    cfg = _cfg(2, 1, 1, "replicated", "tiny_mla", "draft=mtp")
    sched = Scheduler(
        build_requests(cfg.workload, vocab_size=256, seed=0),
        max_num_batched_tokens=8,
        max_num_seqs=4,
        kv=KVCacheManager(256, 4, 1),
        num_speculative_tokens=2,
    )
    zero = verify = continued = 0
    while not sched.done:
        b = sched.schedule()
        if b is None:
            continue
        q = b.num_scheduled_tokens
        zero += int((q == 0).sum())
        verify += int((~b.is_prefilling & (q == 3)).sum())
        continued += int((b.is_prefilling & (b.num_computed_tokens > 0) & (q > 0)).sum())
        sched.update(b, np.zeros(len(b.logits_indices), dtype=np.int64))
        sched.set_draft_tokens(b, np.full((b.num_reqs, 2), 7, dtype=np.int64))
    assert zero >= 1 and verify >= 3 and continued >= 1, (zero, verify, continued)


# ----------------------------------------------------------------------------- slices
def test_kv_heads_split_or_shared():
    assert [list(kv_heads_of(t, 2, 4)) for t in range(2)] == [[0, 1], [2, 3]]
    assert [list(kv_heads_of(t, 4, 2)) for t in range(4)] == [[0], [0], [1], [1]]
    assert [list(kv_heads_of(t, 4, 1)) for t in range(4)] == [[0]] * 4


def test_local_specs_and_entry_columns():
    gqa = gqa_spec(4, 2, 3)  # entry: K of heads 0, 1 (cols 0-5), then V (cols 6-11)
    loc = local_spec(gqa, 1, 2)
    assert (loc.num_heads, loc.num_kv_heads, loc.entry_dim, loc.v_offset) == (2, 1, 6, 3)
    assert entry_columns(gqa, 1, 2).tolist() == [3, 4, 5, 9, 10, 11]
    assert entry_columns(gqa, 2, 4).tolist() == [3, 4, 5, 9, 10, 11]
    mla = mla_spec(4, 8, 2, 0.5)  # the latent is shared: every column on every rank
    assert local_spec(mla, 1, 2).num_heads == 2 and local_spec(mla, 1, 2).entry_dim == 10
    assert entry_columns(mla, 1, 2).tolist() == list(range(10))


# ----------------------------------------------------------------------------- accounting
def test_tp_traffic_hand_derived():
    """tp=2 pcp=1 dcp=2, one prefill of 3 tokens (N = 3 rows), MLA at 2 local heads,
    qk 48, Dv 32, hidden 64, float64: per layer a query gather 3x2x48 x8 B x D(D-1)=2,
    an lse gather 6x2 x8 x2, a reduce-scatter 6x2x32 x8 x(D-1)=1, and two all-reduces
    3x64 x8 x 2(tp-1)=2."""
    layout = plan_layout(np.array([3]), np.array([True]), pcp_size=1)
    shape = ModelShape(hidden_size=64, num_layers=1, entry_dim=48, num_heads=2, qk_dim=48, v_dim=32, dtype_bytes=8)
    ag_rs = dcp_over_tp_collectives(layout, dcp_size=2, shape=shape, backend="ag_rs")
    assert step_traffic(ag_rs, pcp_size=1, dcp_size=2, dtype_bytes=8, tp_size=2)[1] == {
        "dcp_query_gather": 3 * 2 * 48 * 8 * 2,
        "dcp_lse_gather": 6 * 2 * 8 * 2,
        "dcp_output_reduce_scatter": 6 * 2 * 32 * 8,
    }
    a2a = dcp_over_tp_collectives(layout, dcp_size=2, shape=shape, backend="a2a")
    assert step_traffic(a2a, pcp_size=1, dcp_size=2, dtype_bytes=8, tp_size=2)[1] == {
        "dcp_query_gather": 3 * 2 * 48 * 8 * 2,
        "dcp_partials": 6 * (2 * 32 + 2) * 8,
    }
    tp = tp_layer_collectives(layout, tp_size=2, shape=shape)
    assert step_traffic(tp, pcp_size=1, dcp_size=1, dtype_bytes=8, tp_size=2) == (
        {"tp_all_reduce": 2},
        {"tp_all_reduce": 2 * 3 * 64 * 8 * 2},
    )
    # OLMo 2's q and k norms: one number a row each, all-reduced (float64 here: its own dtype)
    olmo = tp_layer_collectives(layout, tp_size=2, shape=dataclasses.replace(shape, full_qk_norm=True))
    assert step_traffic(olmo, pcp_size=1, dcp_size=1, dtype_bytes=8, tp_size=2) == (
        {"tp_all_reduce": 2, "tp_qk_norm": 2},
        {"tp_all_reduce": 2 * 3 * 64 * 8 * 2, "tp_qk_norm": 2 * 3 * 1 * 8 * 2},
    )


def test_replicated_decodes_gather_queries_over_heads_only():
    """tp=2 pcp=2 dcp=4, two replicated decodes (nd = 2 on both PCP ranks), MLA at 2 local
    heads, float64: the queries go around the T = 2 ranks of one PCP rank (both PCP
    ranks' blocks do it: x2), the lse of the T blocks and the rescaled outputs around all
    D = 4. A gather over all 4 ranks would move 4*3 / (2 * 2*1) = 3x the query bytes."""
    layout = plan_layout(np.array([1, 1]), np.array([False, False]), pcp_size=2, dcp_size=2)
    shape = ModelShape(hidden_size=64, num_layers=1, entry_dim=48, num_heads=2, qk_dim=48, v_dim=32, dtype_bytes=8)
    colls = dcp_over_tp_collectives(layout, dcp_size=4, shape=shape, backend="ag_rs")
    assert step_traffic(colls, pcp_size=2, dcp_size=4, dtype_bytes=8, tp_size=2)[1] == {
        "dcp_decode_query_gather": 2 * (2 * 2 * 48 * 8 * 2),
        "dcp_decode_lse_gather": (2 * 2) * 2 * 8 * 12,
        "dcp_decode_output_reduce_scatter": (4 * 2) * 2 * 32 * 8 * 3,
    }
    a2a = dcp_over_tp_collectives(layout, dcp_size=4, shape=shape, backend="a2a")
    assert step_traffic(a2a, pcp_size=2, dcp_size=4, dtype_bytes=8, tp_size=2)[1] == {
        "dcp_decode_query_gather": 2 * (2 * 2 * 48 * 8 * 2),
        "dcp_decode_partials": (4 * 2) * (2 * 32 + 2) * 8 * 3,
    }


def test_every_group_of_an_axis_is_counted():
    """tp=2 pcp=2: two PCP groups run the same kv_gather and restore, two TP groups the
    same all-reduces: each is counted twice over its one group's traffic."""
    layout = plan_layout(np.array([8]), np.array([True]), pcp_size=2)  # N = 4 rows per rank
    shape = ModelShape(hidden_size=64, num_layers=1, entry_dim=48, num_heads=2, qk_dim=48, v_dim=32, dtype_bytes=8)
    colls = tp_step_collectives(layout, np.array([7]), tp_size=2, dcp_size=1, shape=shape)
    _, nbytes = step_traffic(colls, pcp_size=2, dcp_size=1, dtype_bytes=8, tp_size=2)
    assert nbytes == {
        "kv_gather": 2 * (4 * 48 * 8 * 2),
        "restore": 2 * (4 * 64 * 8 * 2),
        "tp_all_reduce": 2 * 2 * (4 * 64 * 8 * 2),
    }


# ----------------------------------------------------------------------------- bad input
def _problems(overrides) -> str:
    with pytest.raises(ConfigError) as exc:
        compose(["output.plots=false", *overrides])
    return str(exc.value)


def test_bad_tp_names_the_numbers():
    msg = _problems(["tp=3", "pcp=1"])
    assert "num_heads (4)" in msg and "intermediate_size (128)" in msg
    # one problem for tp, with what it may be: the divisors of 4 heads that divide 128 too
    assert msg.count("tp: got 3") == 1 and msg.rstrip().endswith("allowed: [1, 2, 4]"), msg
    msg = _problems(["tp=4", "pcp=1", "model=tiny_gqa", "model.num_heads=12", "model.num_kv_heads=6"])
    # 12 heads: 1, 2, 3, 4, 6, 12; of those the MLP width 128 takes 1, 2, 4; 6 KV heads split (1, 2 divide
    # 6) or shared (a multiple of 6): not 4
    assert msg.count("tp: got 4") == 1 and msg.rstrip().endswith("allowed: [1, 2]"), msg
    assert "num_kv_heads (6)" in msg
    msg = _problems(["tp=2", "pcp=1", "model.intermediate_size=129"])
    assert "intermediate_size (129)" in msg and "num_heads" not in msg
    msg = _problems(["tp=2", "pcp=2", "dcp=3"])
    assert "dcp" in msg and "[1, 2, 4]" in msg
    msg = _problems(["tp=2", "pcp=1", "draft=mtp", "draft.layer.num_heads=3"])
    assert "draft.layer" in msg and "num_heads (3)" in msg


def test_gqa_dcp_over_tp_needs_shared_kv_heads():
    msg = _problems(["tp=2", "pcp=2", "dcp=4", "model=tiny_gqa"])  # 2 KV heads, one per rank
    assert "num_kv_heads=2" in msg and "largest dcp that works is 2" in msg
    msg = _problems(["tp=4", "pcp=1", "dcp=4", "model=tiny_gqa"])  # pairs share a head
    assert "largest dcp that works is 2" in msg
    compose(["tp=4", "pcp=1", "dcp=2", "model=tiny_gqa"])  # within a pair: fine
    compose(["tp=2", "pcp=2", "dcp=4", "model=tiny_mla"])  # one latent: any dcp


def test_too_few_local_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    msg = _problems(["tp=2", "pcp=2", "device=cuda"])
    assert "needs 4 GPUs on this node, 2 visible" in msg
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # torchrun: 2 ranks per node
    compose(["tp=2", "pcp=2", "device=cuda", "backend=gloo"])


def test_cli_exits_2_before_any_rank_starts(tmp_path):
    proc = cli("tp=3", "pcp=2", f"hydra.run.dir={tmp_path / 'run'}")
    assert proc.returncode == 2, proc.stderr
    assert "num_heads (4)" in proc.stderr + proc.stdout
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- sharding math
class _ThreadGroup:
    """TP ranks as threads of one process: ``all_reduce`` sums every rank's tensor in rank
    order (the sharded models are checked without process groups)."""

    def __init__(self, size: int) -> None:
        import threading

        self.size, self.barrier, self.parts = size, threading.Barrier(size), [None] * size

    def comm(self, rank: int):
        group = self

        class _Comm:
            def all_reduce(self, t, purpose, op="sum"):
                assert purpose == "tp_all_reduce"
                group.parts[rank] = t.clone()
                group.barrier.wait()
                total = sum(group.parts[1:], group.parts[0].clone())
                group.barrier.wait()
                return t.copy_(total)

        return _Comm()


def _dense_attention(spec):
    """Causal attention of one sequence over its own new entries (no cache)."""

    def attn(layer, q, kv, sinks=None):
        k, v = spec.keys(kv), spec.values(kv)  # [n, kvh, d]
        group = spec.num_heads // spec.num_kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,mhd->hnm", q, k) * spec.scale
        n = q.shape[0]
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)

    return attn


@pytest.mark.parametrize("model", ["tiny_mla", "tiny_gqa"])
@pytest.mark.parametrize("tp", [2, 4])
def test_sharded_model_is_the_whole_model(model, tp):
    """Each TP rank's slice, its row-parallel outputs summed, computes the tp=1 model: the
    same logits (float64, to rounding) on every rank, without any process group. tiny_gqa
    has 2 KV heads: split at tp=2, shared by pairs of ranks at tp=4."""
    import threading

    from pcpflow.models import build_model
    from pcpflow.parallel.tensor_parallel import shard_model

    cfg = compose([f"model={model}", "pcp=1"]).model
    whole = build_model(cfg, dtype=torch.float64, seed=0)
    ids = torch.tensor([3, 17, 101, 5, 250, 9, 42])
    pos = torch.arange(len(ids))
    with torch.no_grad():
        want = whole.compute_logits(whole(ids, pos, _dense_attention(whole.attn_spec))[0])
    group, got = _ThreadGroup(tp), [None] * tp
    shards = [shard_model(build_model(cfg, dtype=torch.float64, seed=0), group.comm(r), r, tp) for r in range(tp)]

    def rank(r):
        with torch.no_grad():
            hidden, _ = shards[r](ids, pos, _dense_attention(shards[r].attn_spec))
            got[r] = shards[r].compute_logits(hidden)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(tp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in range(tp):
        assert torch.allclose(got[r], want, rtol=0, atol=1e-12), (r, float((got[r] - want).abs().max()))
    assert shards[0].attn_spec.num_heads == whole.attn_spec.num_heads // tp
    width = {p.numel() for n, p in shards[0].named_parameters() if n.endswith("mlp.down_proj.weight")}
    assert width == {whole.hidden_size * 128 // tp}
