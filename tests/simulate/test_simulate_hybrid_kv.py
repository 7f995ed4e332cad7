"""Hybrid KV in a simulated run: windowed layers give back the blocks their window left
(``pcpflow.scheduling.kv_groups``), counted by the scheduler the executed run uses.

Hand-worked on llama3_8b with 16 of its 32 layers chunked over 2048 keys (two groups of 16
layers: a block holds 16 layers' entries), one 24,576-token prompt prefilled in chunks of
2048 at block_size 16: the full group ends at 1537 entries; at the last prefill step (2048
tokens from 22,528) the chunked group holds the entries of positions 22,528 .. 24,575 only
(128), so the pool's peak is 1536 + 128 = 1664 blocks of 16 layers, where keeping every
block peaks at 1537 blocks of 32.
"""

from __future__ import annotations

from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.pools import PooledRun
from pcpflow.testing import compose

RUN = ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "workload=explicit",
       "model.sliding_window=2048", "model.sliding_layers=16", "model.window_kind=chunked",
       "workload.prompt_lens=[24576]", "workload.output_lens=[3]", "scheduler.max_num_batched_tokens=2048"]


def _peak_blocks(overrides) -> tuple[int, dict]:
    cfg = compose(RUN + overrides)
    sim = SimulatedRun(cfg)
    out = sim.run()
    usage = max(r["kv_usage"] for r in sim.records)
    return round(usage * cfg.kv.num_blocks), out["metrics"]


def test_a_chunked_group_holds_its_chunk_and_a_block_holds_its_group():
    peak, metrics = _peak_blocks(["kv.num_blocks=4000"])
    assert peak == 1536 + 128
    assert metrics["kv_groups"] == {"groups": 2, "full": 1, "windowed": 1, "layers_per_block": 16,
                                    "window": {"size": 2048, "kind": "chunked"}}
    kept, metrics = _peak_blocks(["kv.num_blocks=4000", "kv.hybrid=off"])
    assert kept == 1537 and metrics["kv_groups"] is None
    assert peak * 16 < kept * 32


def test_the_derived_pool_is_what_the_request_can_hold():
    """Left unset, the pool is the most the workload can hold at once, plus one: kept, 1537
    blocks; with groups, 1537 in the full group and, in the chunked one, the bound of
    ``KVGroups.peak_window_entries``: the 2047 keys before a step's first query and the step's
    2048, in blocks of 16, and one that the span may straddle: 256 + 1."""
    assert compose(RUN + ["kv.hybrid=off"]).kv.num_blocks == 1537 + 1
    assert compose(RUN).kv.num_blocks == 1537 + 257 + 1


def test_a_handover_moves_a_chunked_layer_from_its_chunk():
    """Two pools (``disagg=pd``, one rank each): a 24,000-token prompt's next query (at 24,000)
    reads its chunk from 24,000 - 24,000 % 2048 = 22,528, a decode-pool entry's start (16
    positions): the chunked layers move 1,472 positions, the full ones 24,000, each position
    and layer 8 KV heads x (128 + 128) bf16 = 4,096 B."""
    pools = ["workload.prompt_lens=[24000]", "disagg=pd", "kv.num_blocks=4000", "disagg.decode_pool.num_blocks=4000"]
    moved = PooledRun(compose(RUN + pools)).run()["metrics"]
    assert moved["transfer"]["bytes"] == 4096 * 16 * (24000 + 1472)
    assert moved["kv_groups"]["groups"] == 2
    kept = PooledRun(compose(RUN + pools + ["kv.hybrid=off"])).run()["metrics"]
    assert kept["transfer"]["bytes"] == 4096 * 32 * 24000 and kept["kv_groups"] is None
