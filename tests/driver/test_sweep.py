"""The reports a person reads: the sweep report, the per-run outputs, and the layout
comparison and overhead scripts (smoke runs).

- A two-job multirun through the real command line writes sweep.csv / sweep.md /
  sweep.png, and each job's metrics.jsonl (schema and hand-derived values of its lines)
  and load.png.
- ``write_sweep_report`` on a hand-made directory of result.json files (no ranks).
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo_scripts import load_script as _script

from pcpflow.driver.sweep import BASE_COLUMNS, MULTIRUN_ID, _markdown, write_sweep_report

REPO = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# tiny_mla in float64: hidden 64, cache entry 32 (latent) + 16 (rope key), 2 layers.
HIDDEN, ENTRY, LAYERS, F64 = 64, 48, 2, 8


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sweep") / "sweep"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pcpflow",
            "-m",
            "pcp=1,2",
            "workload=explicit",
            "workload.prompt_lens=[5,9]",
            "workload.output_lens=[2]",
            f"hydra.sweep.dir={out}",
        ],
        check=False,
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.dist
def test_multirun_writes_csv_md_png(sweep_dir):
    with open(sweep_dir / "sweep.csv") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2
    assert list(rows[0])[: len(BASE_COLUMNS)] == BASE_COLUMNS
    common = "workload=explicit workload.prompt_lens=[5,9] workload.output_lens=[2]"
    for row, pcp in zip(rows, (1, 2)):
        assert row["job"] == str(pcp - 1)
        assert row["overrides"] == f"pcp={pcp} {common}"
        assert row["config"] == f"pcp={pcp}"  # what the sweep varies
        assert (row["status"], row["exact"], row["tokens_match"], row["kv_match"]) == (
            "ok",
            "True",
            "True",
            "True",
        )
        # Step 0 prefills 5 + 9 prompt tokens, step 1 decodes the second output of each.
        assert (row["num_steps"], row["num_tokens"]) == ("2", str(5 + 9 + 2))
    assert rows[0]["bytes_total"] == "0"  # one rank moves nothing
    # pcp=2, from the hand-derived steps in test_per_step_metrics_lines below.
    assert int(rows[1]["bytes_kv_gather"]) == 2 * (2 * 9 * ENTRY * F64)
    assert int(rows[1]["bytes_restore"]) == 2 * 9 * HIDDEN * F64 + 2 * 2 * HIDDEN * F64
    assert (rows[1]["calls_kv_gather"], rows[1]["calls_restore"]) == ("2", "2")

    md = (sweep_dir / "sweep.md").read_text()
    assert f"Every job: `{common}`" in md
    header = next(line for line in md.splitlines() if line.startswith("| config"))
    for column in (
        "status",
        "exact",
        "steps",
        "tokens/s",
        "TTFT ms",
        "TPOT ms",
        "token balance",
        "attn balance",
        "kv_gather (calls)",
        "restore (calls)",
    ):
        assert column in header, column
    body = [line for line in md.splitlines() if line.startswith("| pcp=")]
    assert [line.split(" | ")[0] for line in body] == ["| pcp=1", "| pcp=2"]
    assert all(" | ok | yes | " in line for line in body)
    assert (sweep_dir / "sweep.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.dist
def test_per_step_metrics_lines(sweep_dir):
    """Every metrics.jsonl line has the documented fields; pcp=2's values by hand:

    step 0: prompts of 5 and 9 tokens, each cut into 4 chunks (2 and 3 tokens), rank 0
    takes chunks 0 and 3, rank 1 chunks 1 and 2: rank 0 [0,2) of the first and [0,3) of
    the second (5 rows), rank 1 [2,5) and [3,9) (9 rows); N=9 padded rows per rank, all
    gathered in each of 2 layers, all restored.
    step 1: two replicated decodes (positions 5 and 9) on both ranks: no KV gather.
    """
    lines = [json.loads(s) for s in (sweep_dir / "1" / "metrics.jsonl").read_text().splitlines()]
    fields = {
        "step",
        "num_reqs",
        "num_tokens",
        "num_prefill_tokens",
        "per_rank_tokens",
        "padded_num_tokens",
        "per_rank_attention_work",
        "collective_calls",
        "collective_bytes",
        "stage_s",
        "step_s",
        "num_generated",
        "num_to_generate",
        "max_abs_logit_diff",
    }
    for line in lines:
        assert fields <= set(line), fields - set(line)
        assert set(line["stage_s"]) == {
            "validate",
            "plan",
            "buffers",
            "slots",
            "forward",
            "restore",
            "draft",
            "restore.indexing",  # a part of restore's time (framework overhead)
            "restore.sample",  # a part of restore's time (logits and sampling)
        }
        stages = {k: v for k, v in line["stage_s"].items() if "." not in k}
        assert all(v >= 0 for v in line["stage_s"].values()) and line["step_s"] >= sum(stages.values())
        assert line["stage_s"]["restore.indexing"] <= line["stage_s"]["restore"]
    s0, s1 = lines
    assert (s0["step"], s0["num_tokens"], s0["num_prefill_tokens"]) == (0, 14, 14)
    assert (s0["per_rank_tokens"], s0["padded_num_tokens"]) == ([5, 9], 9)
    # A row at position p scores p + 1 keys: rank 0 (1+2) + (1+2+3), rank 1 (3+4+5) + (4+...+9).
    assert s0["per_rank_attention_work"] == [3 + 6, 12 + 39]
    assert s0["collective_calls"] == {"kv_gather": LAYERS, "restore": 1}
    # all_gather over 2 ranks: each receives the other's tensor, 2 * 1 copies.
    assert s0["collective_bytes"] == {
        "kv_gather": LAYERS * 2 * 9 * ENTRY * F64,
        "restore": 2 * 9 * HIDDEN * F64,
    }
    assert (s1["per_rank_tokens"], s1["per_rank_attention_work"]) == ([2, 2], [6 + 10, 6 + 10])
    assert s1["collective_calls"] == {"restore": 1}
    assert s1["collective_bytes"] == {"restore": 2 * 2 * HIDDEN * F64}
    assert (s1["num_generated"], s1["num_to_generate"]) == (4, 4)

    one_rank = [json.loads(s) for s in (sweep_dir / "0" / "metrics.jsonl").read_text().splitlines()]
    assert [(r["per_rank_tokens"], r["collective_calls"]) for r in one_rank] == [
        ([14], {}),
        ([2], {}),
    ]
    for job in ("0", "1"):
        assert (sweep_dir / job / "load.png").read_bytes()[:8] == PNG_MAGIC


@pytest.mark.dist
def test_run_summary_splits_framework_overhead(sweep_dir):
    m = json.loads((sweep_dir / "1" / "result.json").read_text())["metrics"]
    stage = m["stage_s"]
    framework = sum(stage[k] for k in ("validate", "plan", "buffers", "slots", "restore.indexing"))
    assert m["framework_overhead_s"] == pytest.approx(framework)
    stage_total = sum(v for k, v in stage.items() if "." not in k)  # parts are inside their stage
    assert stage["restore.indexing"] <= stage["restore"]
    assert m["framework_overhead_fraction"] == pytest.approx(framework / stage_total)


# ----------------------------------------------------------------------------- unit
def _job(root: Path, name: str, overrides: list[str] | None, result: dict) -> None:
    d = root / name
    (d / ".hydra").mkdir(parents=True)
    if overrides is not None:
        (d / ".hydra" / "overrides.yaml").write_text("".join(f"- {o}\n" for o in overrides))
    (d / "result.json").write_text(json.dumps(result))


def _metrics(tokens_per_s: float, kv_bytes: int | None) -> dict:
    m = {
        "num_steps": 10,
        "num_tokens": 100,
        "tokens_per_s": tokens_per_s,
        "wall_s": 1.5,
        "ttft": {"mean_s": 0.02, "p90_s": 0.03, "mean_steps": 1.0},
        "tpot": {"mean_s": 0.005, "p90_s": 0.006, "mean_steps": 1.0},
        "balance": {
            "tokens_max_over_mean": 1.25,
            "attention_work_max_over_mean": 1.5,
            "padding_fraction": 0.1,
        },
        "framework_overhead_fraction": 0.04,
        "collective_bytes": {},
        "collective_calls": {},
    }
    if kv_bytes is not None:
        m["collective_bytes"] = {"kv_gather": kv_bytes, "restore": 1024}
        m["collective_calls"] = {"kv_gather": 4, "restore": 2}
    return m


def test_write_sweep_report_on_result_files(tmp_path):
    verify_ok = {
        "passed": True,
        "tokens_match": True,
        "kv_match": True,
        "max_abs_logit_diff": 1e-15,
    }
    verify_bad = {
        "passed": False,
        "tokens_match": False,
        "kv_match": True,
        "max_abs_logit_diff": 0.5,
    }
    _job(
        tmp_path,
        "0",
        ["pcp=1", "seed=3"],
        {"status": "ok", "verify": verify_ok, "metrics": _metrics(100.0, None)},
    )
    _job(
        tmp_path,
        "1",
        ["pcp=2", "seed=3"],
        {"status": "ok", "verify": verify_ok, "metrics": _metrics(150.0, 3 * 2**20)},
    )
    _job(
        tmp_path,
        "2",
        ["pcp=4", "seed=3"],
        {
            "status": "failed",
            "error": "verification against the single-rank reference failed\nmore",
            "verify": verify_bad,
            "metrics": _metrics(90.0, 2048),
        },
    )
    _job(
        tmp_path,
        "10",
        ["pcp=8", "seed=3"],
        {"status": "failed", "error": "rank 3 failed: boom", "exit_code": 1},
    )
    (tmp_path / "not_a_job").mkdir()

    rows = write_sweep_report(tmp_path)
    assert [r["job"] for r in rows] == ["0", "1", "2", "10"]  # numeric job order
    with open(tmp_path / "sweep.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["config"] for r in csv_rows] == ["pcp=1", "pcp=2", "pcp=4", "pcp=8"]
    assert [r["status"] for r in csv_rows] == ["ok", "ok", "failed", "failed"]
    assert [r["exact"] for r in csv_rows] == ["True", "True", "False", ""]
    assert (
        csv_rows[1]["bytes_kv_gather"] == str(3 * 2**20) and csv_rows[1]["calls_kv_gather"] == "4"
    )
    assert csv_rows[1]["bytes_total"] == str(3 * 2**20 + 1024)
    assert csv_rows[0]["bytes_kv_gather"] == "" and csv_rows[0]["bytes_total"] == "0"
    assert (csv_rows[1]["ttft_mean_ms"], csv_rows[1]["tpot_mean_ms"]) == ("20.0", "5.0")
    assert csv_rows[2]["error"] == "verification against the single-rank reference failed"
    assert csv_rows[3]["error"] == "rank 3 failed: boom" and csv_rows[3]["num_steps"] == ""

    md = (tmp_path / "sweep.md").read_text()
    assert "Every job: `seed=3`" in md
    table = [line for line in md.splitlines() if line.startswith("| pcp=")]
    assert len(table) == 4
    assert " | ok | yes | " in table[1] and "3.0 MiB (4)" in table[1] and "1.0 KiB (2)" in table[1]
    assert " | **failed** | **NO** | " in table[2]
    assert "## Failures" in md and "- `pcp=8`: rank 3 failed: boom" in md
    assert (tmp_path / "sweep.png").read_bytes()[:8] == PNG_MAGIC


def test_sweep_png_labels_values_states_fixed_settings_and_starts_balance_at_0(tmp_path):
    from pcpflow.driver.sweep import _plot, collect_rows

    def config(pcp):
        return {"pcp": pcp, "dcp": 1, "tp": 1, "dtype": "float64", "decode": {"mode": "sharded", "assignment": "round_robin"},
                "model": {"name": "tiny_gqa"}, "workload": {"kind": "synthetic"}, "draft": {"kind": "none"},
                "scheduler": {"max_num_batched_tokens": 64}, "kv": {"block_size": 16}}

    for job, pcp, tps in (("0", 1, 100.0), ("1", 2, 150.0)):
        _job(tmp_path, job, [f"pcp={pcp}"], {"status": "ok", "config": config(pcp), "metrics": _metrics(tps, 2048)})
    rows = collect_rows(tmp_path)
    drawn = _plot(rows, ["kv_gather", "restore"], tmp_path / "sweep.png")
    assert drawn["title"].endswith(
        "fixed in every job: dcp=1 tp=1 decode=sharded decode.assignment=round_robin model=tiny_gqa "
        "dtype=float64 workload=synthetic draft=none scheduler.max_num_batched_tokens=64 kv.block_size=16"
    )
    tokens_per_s, latency, balance, mib = drawn["value_labels"]
    assert tokens_per_s == ["100", "150"]
    assert latency == ["20.0", "20.0", "5.0", "5.0"]  # TTFT bars, then TPOT bars (ms)
    assert balance == ["1.250", "1.250", "1.500", "1.500"]
    assert mib == ["0.00", "0.00"]  # 2048 + 1024 bytes
    assert drawn["balance_xlim"][0] == 0.0
    write_sweep_report(tmp_path)
    assert "Fixed in every job: `dcp=1 tp=1 decode=sharded " in (tmp_path / "sweep.md").read_text()


def test_single_job_and_missing_overrides(tmp_path):
    _job(tmp_path, "0", None, {"status": "ok", "metrics": _metrics(10.0, None)})
    rows = write_sweep_report(tmp_path)
    assert rows[0]["config"] == "0" and rows[0]["exact"] is None
    assert "| 0 | ok | 10 | 100 | " in (tmp_path / "sweep.md").read_text()
    assert write_sweep_report(tmp_path / "0") == []  # no jobs below a job dir


def test_a_sweep_dir_used_again_reports_the_latest_multiruns_jobs_only(tmp_path):
    # jobs 0 and 1 of the latest multirun (id "new"), job 2 of an earlier one, job 3 of none
    for name, sweep_id in (("0", "new"), ("1", "new"), ("2", "old"), ("3", None)):
        _job(tmp_path, name, [f"pcp={name}"], {"status": "ok", "metrics": _metrics(10.0, None)})
        if sweep_id is not None:
            (tmp_path / name / MULTIRUN_ID).write_text(sweep_id)
    assert [r["job"] for r in write_sweep_report(tmp_path, announce=False)] == ["0", "1", "2", "3"]  # no id: all
    (tmp_path / MULTIRUN_ID).write_text("new")
    assert [r["job"] for r in write_sweep_report(tmp_path, announce=False)] == ["0", "1"]


@pytest.mark.slow  # NOTE: ~10 s; the default set keeps to 6 minutes
def test_two_multiruns_into_one_sweep_dir(tmp_path):
    """The second multirun (2 jobs) overwrites jobs 0 and 1 of the first (3 jobs), not job 2:
    its report has its own 2 jobs, as it would in a fresh dir."""
    def multirun(swept: str) -> list[dict]:
        r = subprocess.run([sys.executable, "-m", "pcpflow", "-m", "mode=simulate", "model=llama3_8b",
                            "hardware=h100_sxm", swept, "workload.num_requests=2", "output.plots=false",
                            f"hydra.sweep.dir={tmp_path}"], check=False, cwd=REPO, capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        with open(tmp_path / "sweep.csv") as f:
            return list(csv.DictReader(f))

    assert [(r["job"], r["config"]) for r in multirun("pcp=1,2,4")] == [("0", "pcp=1"), ("1", "pcp=2"), ("2", "pcp=4")]
    assert [(r["job"], r["config"]) for r in multirun("tp=1,2")] == [("0", "tp=1"), ("1", "tp=2")]
    assert (tmp_path / "2" / "result.json").exists()  # the earlier job is kept, not reported
    assert "pcp=4" not in (tmp_path / "sweep.md").read_text()


# ----------------------------------------------------------------------------- scripts


@pytest.fixture
def keep_torch_threads():
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.mark.dist
@pytest.mark.slow
def test_compare_layouts_quick(tmp_path, keep_torch_threads):
    """The trace comparison runs end to end; its numbers obey what the layouts imply."""
    assert _script("compare_layouts").main(["--quick", "--out", str(tmp_path)]) == 0
    with open(tmp_path / "planner.csv") as f:
        planner = {row["layout"]: row for row in csv.DictReader(f)}
    # pcp=1, then pcp=2 and 4, each x dcp {1, pcp} x {replicated, sharded, sharded+balanced}.
    assert len(planner) == 1 + 2 * 2 * 3
    one = planner["pcp=1"]
    assert float(one["total_mib_per_step"]) == 0 and float(one["token_balance_step_mean"]) == 1
    for p in (2, 4):
        for d in (1, p):
            rep = planner[f"pcp={p} dcp={d} replicated"]
            # Every rank holds every replicated decode: no rank is above the mean, and each
            # does all of the decode attention (dcp=1) or its 1/p shard of the keys (dcp=p,
            # up to one key per row where a context does not split evenly).
            assert float(rep["decode_work_balance_step_mean"]) == pytest.approx(
                1.0, rel=1e-2 if d > 1 else 1e-12
            )
            assert float(rep["decode_work_busiest_share"]) == pytest.approx(
                1.0 / d, rel=1e-2 if d > 1 else 1e-12
            )
            assert (float(rep["dcp_mib_per_step"]) > 0) == (d > 1)
            for decode in ("replicated", "sharded", "sharded+balanced"):
                row = planner[f"pcp={p} dcp={d} {decode}"]
                assert (
                    0
                    < float(row["restore_sampled_rows_mib_per_step"])
                    < float(row["restore_all_rows_mib_per_step"])
                )
                # A timing: plan_layout costs 0.1-1.2 ms on these batches (docs/benchmarks.md);
                # the bounds leave room for a loaded machine and catch a unit slip (s, ns).
                assert 1.0 <= float(row["plan_us_median"]) <= 1e5
    with open(tmp_path / "runs.csv") as f:
        runs = list(csv.DictReader(f))
    assert [r["layout"] for r in runs] == ["pcp=1", "pcp=2 dcp=2 sharded"]
    assert all(r["exact"] == "True" for r in runs)
    assert (tmp_path / "compare_layouts.png").read_bytes()[:8] == PNG_MAGIC


def test_bench_overhead_quick(capsys, keep_torch_threads):
    assert _script("bench_overhead").main(["--quick"]) == 0
    out = capsys.readouterr().out
    assert "framework / forward" in out and "trace step" in out


def test_sweep_md_explains_the_columns_it_has_and_what_the_times_mean(tmp_path):
    executed, simulated = tmp_path / "executed", tmp_path / "simulated"
    verify = {"passed": True, "tokens_match": True, "kv_match": True, "max_abs_logit_diff": 0.0}
    for i, pcp in enumerate((1, 2)):
        _job(executed, str(i), [f"pcp={pcp}"], {"status": "ok", "config": {"mode": "execute", "pcp": pcp},
                                                 "verify": verify, "metrics": _metrics(100.0, None)})
        m = {**_metrics(100.0, None), "framework_overhead_fraction": None}
        _job(simulated, str(i), [f"pcp={pcp}"], {"status": "ok", "config": {"mode": "simulate", "pcp": pcp}, "metrics": m})
    write_sweep_report(executed)
    write_sweep_report(simulated)
    md_exec, md_sim = (executed / "sweep.md").read_text(), (simulated / "sweep.md").read_text()
    assert "**exact**" in md_exec and "What the times mean here" in md_exec and "mode=simulate" in md_exec
    assert "**exact**" not in md_sim and "**overhead**" not in md_sim and "What the times mean here" not in md_sim
    assert "priced on the hardware profile" in md_sim


def test_serving_columns_and_when_sweep_md_shows_them(tmp_path):
    serving = {
        "throughput": {"requests_s": 2.5, "output_tok_s": 800.0, "output_tok_s_per_gpu": 50.0, "total_tok_s": 9000.0},
        "goodput": {"req_s": 1.25, "share": 0.5}, "kv_usage": {"mean": 0.4, "max": 0.9},
        "prefix_cache": {"hit_rate": 0.25}, "preemptions": 3, "queue_s": 0.012,
    }
    for name, preempted in (("0", 3), ("1", 0)):
        m = {**_metrics(100.0, None), **serving, "preemptions": preempted}
        m["ttft"]["p99_s"], m["tpot"]["p99_s"] = 0.5, 0.05
        _job(tmp_path, name, [f"pcp={int(name) + 1}"], {"status": "ok", "config": {"mode": "simulate"}, "metrics": m})
    rows = write_sweep_report(tmp_path, announce=False)
    row = rows[0]
    assert (row["requests_s"], row["output_tok_s_per_gpu"], row["goodput_req_s"], row["goodput_share"]) == (2.5, 50.0, 1.25, 0.5)
    assert (row["kv_usage_mean"], row["kv_usage_max"], row["prefix_hit_rate"], row["preemptions"]) == (0.4, 0.9, 0.25, 3)
    assert (row["ttft_p99_ms"], row["tpot_p99_ms"], row["queue_mean_ms"]) == (500.0, 50.0, 12.0)
    header = (tmp_path / "sweep.csv").read_text().splitlines()[0].split(",")
    for column in ("ttft_p99_ms", "requests_s", "output_tok_s_per_gpu", "goodput_req_s", "kv_usage_mean",
                   "prefix_hit_rate", "preemptions", "queue_mean_ms"):
        assert column in header, column
    md = (tmp_path / "sweep.md").read_text()
    assert "goodput req/s" in md and "out tok/s/GPU" in md and "preempted" in md and "KV use" in md
    # an executed sweep without hits or preemptions keeps its table as it was
    assert "preempted" not in _markdown([{**r, "mode": "execute", "preemptions": 0, "prefix_hit_rate": 0.0} for r in rows], [])


def test_an_interrupted_sweep_closes_the_jobs_whose_process_was_killed(tmp_path):
    """joblib kills its workers when the driver is interrupted: a job dir left with a dead
    process's lock and no result gets "interrupted"; a finished job and one that wrote its own
    result keep theirs."""
    import signal

    from pcpflow.driver.sweep import close_interrupted_jobs
    from pcpflow.output.rundir import LOCK_FILE, failed_result, result_of, write_result
    from pcpflow.signals import Interrupted

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    jobs = {name: tmp_path / name for name in ("0", "1", "2")}
    for job in jobs.values():
        job.mkdir()
        (job / "config.json").write_text(json.dumps({"pcp": int(job.name) + 1}))
    write_result(jobs["0"], result_of({}, {"pcp": 1}))  # finished, lock released
    for name in ("1", "2"):
        (jobs[name] / LOCK_FILE).write_text(f"{dead.pid} python -m pcpflow\n")
    write_result(jobs["2"], failed_result("rank 1 failed: boom", {"pcp": 3}, 1))  # wrote its own, then was killed
    closed = close_interrupted_jobs(tmp_path, Interrupted(signal.SIGINT), wait_s=0)
    assert closed == [jobs["1"]]
    got = {n: json.loads((j / "result.json").read_text()) for n, j in jobs.items()}
    assert got["0"]["status"] == "ok" and got["2"]["error"] == "rank 1 failed: boom"
    assert (got["1"]["status"], got["1"]["error"], got["1"]["exit_code"]) == ("failed", "interrupted by SIGINT", 130)
    assert got["1"]["config"] == {"pcp": 2}
    assert not any((j / LOCK_FILE).exists() for j in jobs.values())


def test_a_sweeps_exit_code_counts_the_jobs_other_processes_ran(tmp_path, monkeypatch):
    """joblib runs the jobs in worker processes: the driver reads their codes from the result.json
    files this sweep wrote (an older file in the dir is not this sweep's)."""
    import time

    from pcpflow.driver import sweep
    from pcpflow.driver.cli import _sweep_exit_codes
    from pcpflow.output.rundir import failed_result, result_of, write_result

    monkeypatch.setattr(sweep, "_STARTED", [tmp_path])
    write_result(tmp_path / "9", failed_result("an older sweep's", {}, 1))
    os.utime(tmp_path / "9" / "result.json", (0, 0))
    since = time.time()
    write_result(tmp_path / "0", result_of({}, {}))
    assert _sweep_exit_codes(since) == [0]
    write_result(tmp_path / "1", failed_result("rank 0 failed: boom", {}, 1))
    (tmp_path / "2").mkdir()
    (tmp_path / "2" / "result.json").write_text("{trunc")
    assert sorted(_sweep_exit_codes(since)) == [0, 1, 1]
