"""A measured CPU profile whose every table is a law written down here (hand-worked prices:
``tests/simulate/test_simulate_measured.py``, ``tests/profile/test_profile.py``)."""

from __future__ import annotations

BASIS = [(1, 1, 16), (8, 1, 16), (8, 8, 16), (2, 2, 64), (4, 1, 128), (8, 8, 64)]
GEMM_RATE = 1e11  # FLOP/s: every GEMM of the table takes 2 m n k / GEMM_RATE
COPY_RATE = 2e10  # B/s moved by a copy (read + written)
C_E, C_H, C_F = 3e-9, 5e-9, 7e-10  # seconds per pair: per entry element, per head, per product
TILE_S = 1e-4  # the reference kernel's seconds per tile beside its work


def pair_cost(entry: float, heads: float, products: float) -> float:
    return C_E * entry + C_H * heads + C_F * products


def kernel_seconds(work, entry: float, heads: float, products: float) -> float:
    """The law of this machine's reference kernel: a fixed part per tile, each entry element
    its tiles gather ``C_E``, each pair they score ``C_H`` a head and ``C_F`` a product
    (``work``: ``pcpflow.attention.paged.kernel_work``'s rows, summed)."""
    tiles, gathered, scored = (float(work[..., i].sum()) for i in (2, 3, 4))
    return TILE_S * tiles + C_E * entry * gathered + (C_H * heads + C_F * products) * scored


def attention_law(phase: str, rows: list[int], keys: list[int], shapes=None) -> list:
    """``[rows][keys][basis]`` seconds of the calls the profile times (``attention_requests``)
    on the reference kernel of ``kernel_seconds``' law, GQA ``shapes`` (heads, kv heads, dim)."""
    from pcpflow.attention.paged import kernel_work
    from pcpflow.simulate.measured import attention_requests, request_rows

    out = []
    for r in rows:
        plane = []
        for k in keys:
            req, ctx = request_rows(attention_requests(phase, r, k))
            plane.append([kernel_seconds(kernel_work(req, ctx, num_heads=h, entry_dim=2 * kv * d, block_size=16),
                                         2 * kv * d, h, 2 * h * d) for h, kv, d in shapes or BASIS])
        out.append(plane)
    return out


def profile_dict(**over) -> dict:
    """A CPU profile whose every table is a law written down here."""
    axis = [1, 64, 4096]
    gemm = [[[2 * m * n * k / GEMM_RATE for k in axis] for n in axis] for m in axis]
    rows, keys = [1, 32, 1024], [1, 64, 4096]
    attention = {phase: attention_law(phase, rows, keys) for phase in ("prefill", "decode")}
    sizes = [1024, 2**20, 2**28]
    doc = {
        "name": "measured", "device": "cpu", "cpu": "intel", "gpus_per_node": 2, "hbm_gib": 16.0,
        "hbm_tbps": COPY_RATE / 1e12,
        "peak_tflops": {"fp32": GEMM_RATE / 1e12, "bf16": None, "fp8": None},
        "kernel_floor_us": 1.0,
        "host": {"launch_us": 10.0, "graph_launch_us": None, "kernels_per_layer": 40},
        "overlap": {"host": False, "p2p": False},
        "measured": {"date": "2026-12-01", "device": "cpu: hand-made", "torch": "2.13.0", "backend": "gloo",
                     "tp": 1, "pcp": 2, "threads_per_rank": 1, "dtypes": ["float32"], "quick": True,
                     "status": "complete", "elapsed_s": 1.0},
        "tables": {
            "gemm": {"float32": {"m": axis, "n": axis, "k": axis, "seconds": gemm}},
            "attention": {"backend": "reference",
                          "basis": [{"heads": h, "kv_heads": kv, "head_dim": d} for h, kv, d in BASIS],
                          "prefill": {"float32": {"rows": rows, "keys": keys, "seconds": attention["prefill"]}},
                          "decode": {"float32": {"rows": rows, "keys": keys, "seconds": attention["decode"]}}},
            "memory": {"bytes": sizes, "seconds": [2 * b / COPY_RATE for b in sizes]},
            "launch": {"op_us": 1.0, "layer_op_us": {"gqa": 10.0, "mla": 10.0}},
            "host": {"requests": [1], "tokens": [1], "seconds": [0.0], "fixed_us": 1000.0, "per_request_us": 100.0,
                     "per_token_us": 10.0},
            "collectives": [{"group": "pcp", "ranks": 2, "op": op, "bytes": [1000, 10**6],
                             "seconds": [1e-4 + 1000 / 1e9, 1e-4 + 10**6 / 1e9], "latency_us": 100.0, "gbps": 1.0}
                            for op in ("all_gather", "all_reduce", "reduce_scatter", "all_to_all", "broadcast",
                                       "sendrecv")],
            "sync": {"work_s": [0.001], "excess_s": [0.0], "fixed_us": 0.0, "per_work": 0.0},  # no wait
        },
    }
    doc.update(over)
    return doc
