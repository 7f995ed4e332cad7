"""mode=search end to end (in this process, one worker): what it writes, that a row is the
simulated run of its layout, the order against Meta's given TTFTs, bad input, Ctrl-C."""

from __future__ import annotations

import csv
import json

import pytest

from pcpflow.testing import cli, compose

ONE_REQUEST = ["mode=search", "model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8",
               "workload=explicit", "workload.prompt_lens=[8192]", "workload.output_lens=[4]", "search.jobs=1",
               "output.progress=false"]


def _rows(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_a_search_over_candidates_writes_its_report_and_each_row_is_its_layouts_simulated_run(tmp_path):
    r = cli(*ONE_REQUEST, "search.gpus=32", "search.top_k=2",
            "search.candidates=['tp=8 pcp=1','tp=8 pcp=2 dcp=2','tp=8 pcp=4 dcp=4 decode=sharded','tp=4']",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rows = _rows(tmp_path / "search.csv")
    assert len(rows) == 3 and {r_["priced"] for r_ in rows} == {"full"}  # one request: the screen is the full price
    # ranked by TTFT p90, best first, ranks 1..3
    ttft = [float(r_["ttft_p90_s"]) for r_ in rows]
    assert ttft == sorted(ttft) and [r_["rank"] for r_ in rows] == ["1", "2", "3"]
    assert all(r_["objective"] == "ttft" and float(r_["objective_value"]) == float(r_["ttft_p90_s"]) for r_ in rows)
    # tp=4 cannot hold 405B's fp8 weights on a GTT H100: pruned with the reason, never priced
    (pruned,) = _rows(tmp_path / "pruned.csv")
    assert pruned["tp"] == "4" and "the weights do not fit" in pruned["reason"]
    # a row is exactly what mode=simulate says of the same layout (replicas filling 32 GPUs)
    from pcpflow.simulate.engine import simulate_run

    for row in rows:
        cfg = compose(["mode=simulate", *ONE_REQUEST[1:7], *row["overrides"].split()])
        m = simulate_run(cfg)["metrics"]
        assert float(row["ttft_p90_s"]) == pytest.approx(m["ttft"]["p90_s"], rel=1e-5)
        assert float(row["tpot_p90_s"]) == pytest.approx(m["tpot"]["p90_s"], rel=1e-5)
        assert int(row["gpus"]) == m["simulate"]["gpus"] == 32
    md = (tmp_path / "search.md").read_text()
    for section in ("## Recommended", "## The runner-up", "## Recommended per objective", "## How sure: the fitted factors",
                    "## Pareto front", "## Pruned before pricing"):
        assert section in md
    assert "gemm_efficiency" in md and "p2p_efficiency" in md
    assert (tmp_path / "search.png").is_file()
    _assert_the_front_is_the_undominated_rows(rows)
    # the runner-up sentence: the best beats the next by the ratio of their TTFT p90s in search.csv
    best_row, runner_row = rows[0], rows[1]
    ratio = float(runner_row["ttft_p90_s"]) / float(best_row["ttft_p90_s"])
    assert ratio > 1
    assert f"`{best_row['overrides']}` beats `{runner_row['overrides']}` by {ratio:.4g}x on TTFT p90" in md
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and result["metrics"]["search"]["pruned"] == 1
    best = rows[0]["overrides"]
    assert f"recommended (ttft): {best}" in r.stdout
    assert "python -m pcpflow mode=simulate model=llama3_405b hardware=gtt_h100" in r.stdout


def _assert_the_front_is_the_undominated_rows(rows):
    """Pareto by definition: a row is on the front iff no other row is at least as good on
    every measure (TTFT and TPOT p90, GPUs lower; goodput per GPU higher, where counted) and
    better on one."""
    def measures(r):
        out = [float(r["ttft_p90_s"]), float(r["tpot_p90_s"]), float(r["gpus"])]
        return out + ([-float(r["goodput_per_gpu"])] if r["goodput_per_gpu"] else [])

    for r in rows:
        dominated = any(all(a <= b for a, b in zip(measures(o), measures(r))) and measures(o) != measures(r)
                        for o in rows if o is not r)
        assert (r["pareto"] == "True") == (not dominated), (r["overrides"], r["pareto"])


@pytest.mark.slow
def test_the_order_matches_metas_given_ttfts_where_they_differ_by_more_than_ten_percent(tmp_path):
    # arXiv 2411.01783 (shared/published/meta-cp-inference.md): 128K-token prefill, TP8 per node,
    # CP over nodes: 42,010 / 21,042 / 10,950 / 5,850 / 3,800 ms at CP 1 / 2 / 4 / 8 / 16 (each pair > 10% apart)
    measured = {1: 42.010, 2: 21.042, 4: 10.950, 8: 5.850, 16: 3.800}
    r = cli(*[o for o in ONE_REQUEST if not o.startswith("workload.")], "workload=explicit",
            "workload.prompt_lens=[131072]", "workload.output_lens=[1]", "search.gpus=128",
            "search.candidates=['tp=8 pcp=1','tp=8 pcp=2 dcp=2','tp=8 pcp=4 dcp=4','tp=8 pcp=8 dcp=8','tp=8 pcp=16 dcp=16']",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    order = [int(row["pcp"]) for row in _rows(tmp_path / "search.csv")]
    assert order == sorted(measured, key=measured.get)


@pytest.mark.slow
def test_goodput_per_gpu_is_a_rate_whose_attainment_holds(tmp_path):
    r = cli("mode=search", "model=llama3_8b", "hardware=h100_sxm", "workload=synthetic", "workload.num_requests=12",
            "workload.prompt_len=[2000,4000]", "workload.output_len=[8,16]", "slo.ttft_s=0.2", "slo.tpot_s=0.02",
            "simulate.objective=goodput_per_gpu", "search.gpus=2", "search.jobs=1", "cudagraph_mode=none",
            "search.candidates=['tp=1','tp=2']", "output.progress=false", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rows = _rows(tmp_path / "search.csv")
    assert [row["priced"] for row in rows] == ["full", "full"]
    from pcpflow.simulate.engine import simulate_run

    for row in rows:
        rate = float(row["goodput_per_gpu"]) * int(row["gpus"])
        if row["goodput_bound"] != "bisected":
            continue
        cfg = compose(["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=synthetic",
                       "workload.num_requests=12", "workload.prompt_len=[2000,4000]", "workload.output_len=[8,16]",
                       "slo.ttft_s=0.2", "slo.tpot_s=0.02", *row["overrides"].split(), f"workload.request_rate={rate}"])
        assert simulate_run(cfg)["metrics"]["goodput"]["share"] >= 0.9
    assert any(row["goodput_bound"] == "bisected" for row in rows)


def test_slos_no_layout_meets_at_any_rate_are_said_and_settled_at_the_floor(tmp_path):
    """A TTFT target no prefill can meet: every layout misses at its burst's rate and then at the
    floor (1/16 of it on the screen, 1/64 in full), so its rate search ends after those two
    runs (plus the run at the workload's own arrivals, which is the burst itself: a workload
    without arrivals in time is searched as a burst, workload.request_rate=inf, on every
    layout) with goodput 0."""
    r = cli("mode=search", "model=llama3_8b", "hardware=h100_sxm", "workload=synthetic", "workload.num_requests=6",
            "workload.prompt_len=[2000,4000]", "workload.output_len=[4,8]", "slo.ttft_s=0.0001",
            "simulate.objective=goodput_per_gpu", "search.gpus=2", "search.jobs=1", "cudagraph_mode=none",
            "search.candidates=['tp=1','tp=2']", "output.progress=false", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rows = _rows(tmp_path / "search.csv")
    runs = {row["overrides"].split()[0]: row["runs"] for row in rows}
    assert runs == {"tp=2": "3", "tp=1": "3"}
    assert {(row["goodput_per_gpu"], row["goodput_bound"]) for row in rows} == {("0", "below")}
    said = "no layout priced keeps 90% of requests within TTFT <= 0.0001 s at any rate it tried (down to 1/64"
    assert said in r.stdout and said in (tmp_path / "search.md").read_text()


@pytest.mark.parametrize("args, field, words", [
    (["search.gpus=8"], "search.gpus", ["at least 16", "tp=16 pcp=1 dcp=1", "the weights do not fit"]),
    pytest.param(["search.gpus=32", "simulate.objective=goodput_per_gpu"], "simulate.objective", ["slo.ttft_s"],
                 marks=pytest.mark.slow),
    (["search.gpus=32", "simulate.objective=goodput_per_gpu", "search.candidates=['tp=16','tp=32']"],
     "simulate.objective", ["slo.ttft_s", "slo.tpot_s"]),
    (["search.gpus=32", "search.candidates=['tp=2','tp=4 pcp=2']"], "search.candidates",
     ["no candidate can run (2 pruned)", "2 x tp"]),
    (["search.gpus=32", "simulate.objective=tpot_x_gpus", "workload.output_lens=[1]"], "simulate.objective",
     ["no request here generates more than one", "workload.output_lens"]),
    ([], "search.gpus", ["required"]),
])
def test_bad_searches_exit_2_naming_the_field(args, field, words, tmp_path):
    base = [o for o in ONE_REQUEST if o != "simulate.weights_dtype=fp8"]  # bf16: 405B needs tp >= 16
    r = cli(*base, *args, f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stdout + r.stderr
    line = next(ln for ln in r.stderr.splitlines() if ln.strip().startswith(f"- {field}:"))
    assert all(w in line for w in words), line
    assert "Traceback" not in r.stderr and not (tmp_path / "run" / "search.csv").exists()


def test_search_settings_outside_mode_search_exit_2_naming_the_mode():
    for args in (["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "search.gpus=8"], ["search.top_k=3"],
                 ["mode=simulate", "hardware=h100_sxm", "model=llama3_8b", "slo.attainment=0.5"]):
        r = cli(*args)
        assert r.returncode == 2 and "mode=search" in r.stderr, r.stderr


def test_ctrl_c_keeps_what_was_priced(tmp_path, monkeypatch):
    import signal

    import pcpflow.search.run as run
    from pcpflow.signals import Interrupted

    real, done = run.evaluate, []

    def evaluate(*args):
        if len(done) == 2:
            raise Interrupted(signal.SIGINT)
        done.append(1)
        return real(*args)

    monkeypatch.setattr(run, "evaluate", evaluate)
    r = cli(*ONE_REQUEST, "search.gpus=32", "search.candidates=['tp=8 pcp=1','tp=8 pcp=2','tp=8 pcp=4','tp=16']",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 130
    (line,) = [ln for ln in r.stderr.splitlines() if "interrupted" in ln]
    assert "2 priced layout(s) kept" in line
    assert len(_rows(tmp_path / "search.csv")) == 2
    assert json.loads((tmp_path / "result.json").read_text())["status"] == "failed"


def test_pools_are_searched_beside_one_pool_and_a_pools_row_is_its_simulated_run(tmp_path):
    # 2 GPUs, one CUDA-graph mode: the 17 one-pool layouts of tests/search/test_space.py and one
    # with pools (a prefill GPU handing its KV to a decode GPU), each either priced or pruned
    wl = ["model=llama3_8b", "hardware=h100_sxm", "workload=explicit", "workload.prompt_lens=[2000,2000]",
          "workload.output_lens=[4]"]
    r = cli("mode=search", *wl, "search.gpus=2", "cudagraph_mode=none", "search.jobs=1", "output.progress=false",
            f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rows, pruned = _rows(tmp_path / "search.csv"), _rows(tmp_path / "pruned.csv")
    assert len(rows) + len(pruned) == 18
    (pools,) = [row for row in rows if row["disagg"] == "pd"]
    assert (pools["tp"], pools["pcp"], pools["dcp"], pools["decode_pool_tp"], pools["decode_pool_dcp"]) == ("1",) * 5
    assert pools["gpus"] == "2" and pools["replicas"] == "1" and pools["overrides"] == "tp=1 pcp=1 dcp=1 disagg=pd workload.request_rate=inf"
    # the row is mode=simulate's answer for the same command line (both pools priced)
    from pcpflow.driver.job import _simulate

    m = _simulate(compose(["mode=simulate", *wl, *pools["overrides"].split()]), None)["metrics"]
    assert m["simulate"]["gpus"] == 2 and set(m["pools"]) == {"prefill", "decode"}
    assert float(pools["ttft_p90_s"]) == pytest.approx(m["ttft"]["p90_s"], rel=1e-5)
    assert float(pools["tpot_p90_s"]) == pytest.approx(m["tpot"]["p90_s"], rel=1e-5)


def test_the_groups_of_searched_keys_fix_them_on_a_search_command_line(tmp_path):
    # decode=sharded and disagg=pd fix decode.mode and disagg.kind, as in a candidate string
    # (they once exited 2); the decode pool's grid stays searched. 2 GPUs, one CUDA-graph mode:
    # one layout with pools (a prefill GPU, a decode GPU), decode sharded
    wl = ["model=llama3_8b", "hardware=h100_sxm", "workload=explicit", "workload.prompt_lens=[2000,2000]",
          "workload.output_lens=[4]"]
    r = cli("mode=search", *wl, "search.gpus=2", "cudagraph_mode=none", "decode=sharded", "disagg=pd",
            "search.jobs=1", "output.progress=false", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    (row,) = _rows(tmp_path / "search.csv")
    assert (row["decode"], row["disagg"], row["decode_pool_tp"]) == ("sharded", "pd", "1")
    # the same search with the keys themselves
    r2 = cli("mode=search", *wl, "search.gpus=2", "cudagraph_mode=none", "decode.mode=sharded", "disagg.kind=pd",
             "search.jobs=1", "output.progress=false", f"hydra.run.dir={tmp_path / 'keys'}")
    assert r2.returncode == 0, r2.stderr
    assert _rows(tmp_path / "keys" / "search.csv") == [row]


@pytest.mark.parametrize("n", [1, 3, 4])
def test_the_walk_outwards_finds_the_first_flip_the_whole_grid_would_with_fewer_points(n):
    """On a side whose order flips once (at grid index k; k = n: never), pricing the side's end
    first and bisecting gives what pricing every point gives, in at most 1 + ceil(log2 n) points."""
    import math

    from pcpflow.search.run import _next_scale, order_holds

    grid = [0.9, 0.8, 0.67, 0.5][:n]
    for k in range(n + 1):
        truth = {s: i < k for i, s in enumerate(grid)}
        keeps, held, flipped = {}, -1, None
        while (i := _next_scale(held, flipped, n)) is not None:
            keeps[grid[i]] = truth[grid[i]]
            held, flipped = (i, flipped) if truth[grid[i]] else (held, i)
        assert order_holds(keeps) == order_holds(truth), (k, keeps)
        assert len(keeps) <= 1 + math.ceil(math.log2(n))


def test_optuna_screens_its_trials_and_prunes_each_layout_once(tmp_path):
    """Past ``search.exhaustive_limit`` Optuna proposes the layouts: ``search.trials`` of them
    are screened, each once, and a layout that cannot run is listed in pruned.csv once (also
    one that planning had pruned before TPE proposed it again), never beside a priced one."""
    r = cli(*ONE_REQUEST, "search.gpus=16", "search.exhaustive_limit=10", "search.trials=12",
            "disagg.kind=none", f"hydra.run.dir={tmp_path}")
    assert r.returncode == 0, r.stderr
    rows, pruned = _rows(tmp_path / "search.csv"), _rows(tmp_path / "pruned.csv")
    screened = [row["overrides"] for row in rows]
    assert len(screened) == 12 == len(set(screened))
    names = [row["overrides"] for row in pruned]
    assert pruned and len(names) == len(set(names)) and not set(names) & set(screened)
    assert "(optuna" in r.stdout
