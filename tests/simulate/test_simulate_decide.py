"""A simulated sweep's report: each row carries its priced terms as ``<term>_s`` columns, and
sweep.md says, for the top jobs, which terms decide their order (hand-made result files)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from pcpflow.driver.sweep import write_sweep_report


def _job(root: Path, name: str, pcp: int, ttft_s: float, terms: dict[str, float], objective: str = "ttft") -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    (d / ".hydra" / "overrides.yaml").write_text(f"- pcp={pcp}\n")
    metrics = {"num_steps": 1, "num_tokens": 10, "ttft": {"mean_s": ttft_s, "p90_s": ttft_s, "mean_steps": 1.0},
               "tpot": {"mean_s": None}, "collective_bytes": {}, "collective_calls": {},
               "simulate": {"breakdown_s": {k: {"exposed_s": v, "hidden_s": 0.0} for k, v in terms.items()}}}
    result = {"status": "ok", "config": {"mode": "simulate", "pcp": pcp, "tp": 8, "simulate": {"objective": objective}},
              "metrics": metrics}
    (d / "result.json").write_text(json.dumps(result))


def test_rows_carry_their_terms_and_the_report_names_what_decides_the_order(tmp_path):
    _job(tmp_path, "0", 1, 3.0, {"gemm": 2.0, "attention": 0.5, "tp_all_reduce": 0.5})
    _job(tmp_path, "1", 2, 1.6, {"gemm": 1.0, "attention": 0.25, "tp_all_reduce": 0.25, "kv_gather": 0.1})
    _job(tmp_path, "2", 4, 1.0, {"gemm": 0.5, "attention": 0.125, "tp_all_reduce": 0.125, "kv_gather": 0.25})
    write_sweep_report(tmp_path, announce=False)
    with open(tmp_path / "sweep.csv") as f:
        rows = {r["job"]: r for r in csv.DictReader(f)}
    assert {"gemm_s", "attention_s", "tp_all_reduce_s", "kv_gather_s"} <= set(rows["0"])
    assert float(rows["1"]["gemm_s"]) == 1.0 and rows["0"]["kv_gather_s"] == ""
    assert [rows[j]["rank"] for j in ("2", "1", "0")] == ["1", "2", "3"]
    md = (tmp_path / "sweep.md").read_text()
    assert "## What decides the order of the top 3" in md
    # #2 (pcp=2) against #1 (pcp=4): gemm +500 ms decides, then attention and tp_all_reduce +125 ms,
    # kv_gather -150 ms; the three largest differences are named, largest first
    line = next(ln for ln in md.splitlines() if ln.startswith("- #1"))
    assert "#2 spends gemm +500.0 ms, kv_gather -150.0 ms" in line
    line = next(ln for ln in md.splitlines() if ln.startswith("- #2"))
    assert line.split("spends ")[1].startswith("gemm +1000.0 ms")


def test_jobs_without_the_objectives_measure_are_named_not_ranked(tmp_path):
    # every request generated one token: no TPOT to rank by (the rows above have tpot mean None)
    _job(tmp_path, "0", 1, 3.0, {"gemm": 2.0}, objective="tpot")
    _job(tmp_path, "1", 2, 1.6, {"gemm": 1.0}, objective="tpot")
    write_sweep_report(tmp_path, announce=False)
    with open(tmp_path / "sweep.csv") as f:
        assert [r["rank"] for r in csv.DictReader(f)] == ["", ""]
    md = (tmp_path / "sweep.md").read_text()
    (line,) = [ln for ln in md.splitlines() if ln.startswith("- **Not ranked**")]
    assert "2 job(s) (pcp=1, pcp=2) have no TPOT" in line
