"""The exactness a PCP/DCP run must show against one rank: the corner-case workload that
tests/rank/test_engine.py and its neighbours run, and the assertions they share."""

from __future__ import annotations

import torch
from reference import greedy_matches

from pcpflow.models import build_model

OUTPUT_LEN = 6


def corner_case_workload(pcp: int) -> list[str]:
    lens = [1, 2 * pcp - 1, 2 * pcp, 2 * pcp + 1, 150, 23]
    return [
        f"pcp={pcp}",
        "workload=explicit",
        f"workload.prompt_lens=[{','.join(map(str, lens))}]",
        f"workload.output_lens=[{OUTPUT_LEN}]",
        "workload.arrival_steps=[0,0,1,1,2,5]",
        "scheduler.max_num_batched_tokens=64",  # < 150: that prompt is continued
        "scheduler.max_num_seqs=4",  # < 6 requests: some wait for a seat
        "kv.block_size=5",
        "dtype=float64",
    ]


_dense_models: dict[str, torch.nn.Module] = {}


def dense_reference_agrees(cfg, result) -> bool:
    key = cfg.model.model_dump_json()  # NOTE: a tiny model's settings (a window) change it
    model = _dense_models.get(key)
    if model is None:
        model = _dense_models[key] = build_model(cfg.model, dtype=torch.float64, seed=cfg.seed)
    return all(
        greedy_matches(model, row["prompt_token_ids"], out)
        for row, out in zip(result["requests"], result["outputs"])
    )


def assert_exact(cfg, result) -> None:
    v = result["verify"]
    label = f"pcp={cfg.pcp} dcp={cfg.dcp} decode={cfg.decode.mode}/{cfg.decode.assignment} model={cfg.model.name}"
    assert v["passed"], f"{label}: {v}"
    assert v["tokens_match"] and v["kv_match"] and v["num_token_mismatches"] == 0, label
    assert v["max_abs_logit_diff"] <= 1e-9 and v["max_abs_kv_diff"] <= 1e-9, label
    assert v["num_tokens_checked"] > 0 and v["num_steps_checked"] == result["metrics"]["num_steps"], label
    assert [len(o) for o in result["outputs"]] == [r["output_len"] for r in result["requests"]], label
    assert all(len(o) == OUTPUT_LEN for o in result["outputs"]), label
    assert dense_reference_agrees(cfg, result), f"{label}: tokens differ from the dense reference"

