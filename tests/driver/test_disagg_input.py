"""disagg=pd bad input: exit 2, every problem listed together, each naming its pool and its
numbers, nothing started (checked in process: the driver refuses before any rank)."""

from __future__ import annotations

from pcpflow.config.disagg import pool_config
from pcpflow.config.run import validate_run_config
from pcpflow.driver.compose import compose_raw
from pcpflow.testing import cli


def problems(*args: str) -> list[str]:
    r = cli(*args, "output.progress=false")
    assert r.returncode == 2, r.stderr
    return [line.strip()[2:] for line in r.stderr.splitlines() if line.startswith("  - ")]


def test_pools_that_break_the_grid_rules_name_the_pool_and_the_numbers(tmp_path):
    got = problems("pcp=3", "dcp=2", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=3",
                   "disagg.decode_pool.interleave=3", f"hydra.run.dir={tmp_path / 'run'}")
    assert got[0].startswith("dcp: got 2; the prefill pool (tp=1 pcp=3 dcp=2): with pcp(3) x tp(1) dcp must be one of [1, 3]")
    assert got[1].startswith("disagg.decode_pool.dcp: got 3; the decode pool (tp=1 pcp=2 dcp=3): with pcp(2) x tp(1) "
                             "dcp must be one of [1, 2]")
    assert got[2] == "disagg.decode_pool.interleave: got 3; must divide kv.block_size=16 (the decode pool's blocks)"
    assert len(got) == 3 and not (tmp_path / "run").exists()  # nothing started, no run dir


def test_a_decode_pool_whose_kv_cannot_hold_a_request():
    got = problems("disagg=pd", "disagg.decode_pool.dcp=1", "disagg.decode_pool.num_blocks=3", "workload=explicit",
                   "workload.prompt_lens=[40,20]", "workload.output_lens=[10,4]")
    # 50 tokens need 4 blocks of 16; 24 fit in 2: only request 0 is named
    assert got == ["disagg.decode_pool.num_blocks: got 3; the decode pool (tp=1 pcp=1 dcp=1): workload request 0 needs "
                   "4 blocks (40 prompt + 10 output + 0 speculative tokens at 16 tokens per block); "
                   "disagg.decode_pool.num_blocks must be >= 4"]
    # the prefill pool holds prompts only: 40 tokens in 3 blocks of 16 fit kv.num_blocks=3
    assert problems("disagg=pd", "kv.num_blocks=2", "workload=explicit", "workload.prompt_lens=[40,20]",
                    "workload.output_lens=[10,4]")[0].startswith(
        "kv.num_blocks: got 2; the prefill pool (tp=1 pcp=2 dcp=1): workload request 0 needs 3 blocks (40 prompt + 0 output")


def test_heads_the_decode_pools_tp_does_not_split():
    got = problems("model=tiny_gqa", "disagg=pd", "disagg.decode_pool.tp=3")
    # one problem naming every number that refuses it, and what tp may be
    assert got == ["disagg.decode_pool.tp: got 3; the decode pool (tp=3 pcp=1 dcp=1): must divide the model's num_heads (4) "
                   "and MLP width intermediate_size (128); the model's num_kv_heads (2) must be a multiple of tp or divide "
                   "it; allowed: [1, 2, 4]"]
    got = problems("mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "pcp=1", "disagg=pd", "disagg.decode_pool.tp=3")
    assert got == ["disagg.decode_pool.tp: got 3; the decode pool (tp=3 pcp=1 dcp=1): must divide the model's num_heads (32) "
                   "and MLP width intermediate_size (14336); the model's num_kv_heads (8) must be a multiple of tp or "
                   "divide it; allowed: [1, 2, 4, 8, 16, 32]"], got


def test_decode_pool_settings_without_pd():
    got = problems("disagg.decode_pool.tp=2", "disagg.transfer=after_prefill")
    assert got == ["disagg.decode_pool.tp: got 2; disagg.decode_pool.tp is a setting of disagg=pd; add disagg=pd to the "
                   "command line",
                   "disagg.transfer: got 'after_prefill'; disagg.transfer is a setting of disagg=pd; add disagg=pd to the "
                   "command line"]
    raw = compose_raw([])
    raw["disagg"] = {"kind": "none", "decode_pool": {"dcp": 2}}
    _, found = validate_run_config(raw)
    assert [str(p) for p in found] == ["disagg: got {'disagg.decode_pool.dcp': 2}; settings of disagg=pd, and this run is "
                                       "disagg=none: add disagg=pd or leave them out"]


def test_every_problem_together():
    got = problems("pcp=3", "dcp=2", "disagg=pd", "disagg.decode_pool.num_blocks=1", "disagg.decode_pool.dcp=5",
                   "pipeline.forward.cp_attention=ring_pass_kv", "disagg.transfer=eager")
    fields = [p.split(":")[0] for p in got]
    for field in ("dcp", "disagg.decode_pool.dcp", "pipeline.forward.cp_attention", "disagg.transfer"):
        assert field in fields, (field, got)


def test_simulated_rings_inside_a_pool():
    got = problems("mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "pcp=2", "dcp=2", "disagg=pd",
                   "simulate.cp_decode=ring_pass_q")
    assert "simulate.cp_decode: got 'ring_pass_q'; with disagg=pd the decode pool runs the attention its own key " \
           "names: use engine and disagg.decode_pool.cp_attention=ring_pass_q" in got, got


def test_each_pool_has_its_own_ring():
    ring = ["pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.pcp=2", "disagg.decode_pool.dcp=2",
            "pipeline.forward.cp_attention=ring_pass_kv"]
    cfg, found = validate_run_config(compose_raw(ring))
    assert found == []
    assert pool_config(cfg, "prefill").pipeline["forward"]["cp_attention"] == "ring_pass_kv"
    assert pool_config(cfg, "decode").pipeline["forward"]["cp_attention"] == "allgather"
    # the decode pool's ring is its own key, on its own grid
    cfg, found = validate_run_config(compose_raw([*ring, "disagg.decode_pool.cp_attention=ring_pass_q"]))
    assert found == [] and pool_config(cfg, "decode").pipeline["forward"]["cp_attention"] == "ring_pass_q"
    got = problems("pcp=2", "dcp=2", "disagg=pd", "disagg.decode_pool.tp=2", "disagg.decode_pool.dcp=2",
                   "disagg.decode_pool.cp_attention=ring_auto")
    assert got == ["disagg.decode_pool.cp_attention: got 'ring_auto'; the decode pool (tp=2 pcp=1 dcp=2): a ring "
                   "needs the KV sharded over the ring: pcp > 1 and dcp = pcp; got pcp=1 dcp=2 (use disagg.decode_pool.dcp=2 "
                   "disagg.decode_pool.pcp=2, or disagg.decode_pool.cp_attention=allgather)"], got
    # a decode pool size it takes from the top-level key says so
    got = problems("disagg=pd", "kv.num_blocks=4")
    assert any(p.startswith("disagg.decode_pool.num_blocks: got 4; the decode pool (tp=1 pcp=1 dcp=1), which takes "
                            "kv.num_blocks as disagg.decode_pool.num_blocks is null: ") for p in got), got
    # the prefill pool's grid must hold the ring: the ring's own rule, on the top-level keys
    got = problems("pcp=2", "dcp=1", "disagg=pd", "pipeline.forward.cp_attention=ring_pass_kv")
    assert any(p.startswith("pipeline.forward.cp_attention: got 'ring_pass_kv'; a ring needs the KV sharded over the "
                            "ring: pcp > 1 and dcp = pcp; got pcp=2 dcp=1") for p in got), got


def test_a_profile_measures_one_grid():
    got = problems("mode=profile", "disagg=pd")
    assert "disagg: got 'pd'; mode=profile measures one rank grid: run it with disagg=none" in got, got


def test_a_drafter_is_checked_on_each_pool_and_is_not_simulated():
    # drafting runs with disagg=pd; its layer must split over the decode pool's TP too
    got = problems("disagg=pd", "draft=mtp", "draft.layer.num_heads=2", "disagg.decode_pool.tp=4")
    assert got == ["disagg.decode_pool.tp: got 4; the decode pool (tp=4 pcp=1 dcp=1): must divide the drafter "
                   "(draft.layer)'s num_heads (2); allowed: [1, 2]"]
    assert problems("disagg=pd", "draft=mtp", "mode=simulate", "hardware=h100_sxm", "simulate.draft_acceptance=[0.8]") == [
        "draft: got 'mtp'; drafting is simulated on one pool; with disagg=pd use draft=none"]
