"""pcpflow.output.report: the console summary names its clocks, load.png names its config, tells
ranks apart and shows the prefill phases."""

from __future__ import annotations

import json

from pcpflow.output.report import config_title, print_summary, write_plots

CFG = {"pcp": 3, "dcp": 3, "tp": 1, "dtype": "float32", "decode": {"mode": "sharded", "assignment": "balanced"},
       "model": {"name": "tiny_gqa"}, "workload": {"kind": "explicit"}, "draft": {"kind": "mtp"}}


def _record(step, tokens, prefill):
    return {"step": step, "per_rank_tokens": tokens, "per_rank_attention_work": [t * 10 for t in tokens],
            "num_prefill_tokens": prefill}


def test_load_png_names_the_config_styles_each_rank_and_shades_prefill_steps(tmp_path):
    records = [_record(0, [8, 8, 7], 23), _record(1, [9, 8, 8], 25), _record(2, [1, 1, 1], 0),
               _record(3, [5, 4, 4], 10), _record(4, [1, 1, 1], 0)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "result.json").write_text(json.dumps({"config": CFG}))
    drawn = write_plots(tmp_path)
    assert drawn["title"] == (
        "per-rank load per step: pcp=3 dcp=3  decode=sharded/balanced  model=tiny_gqa  workload=explicit  "
        "draft=mtp  float32"
    )
    assert drawn["ranks"] == 3 and len(set(drawn["styles"])) == 3  # solid, dashed, dotted
    assert drawn["prefill_steps"] == [0, 1, 3]
    assert (tmp_path / "load.png").read_bytes()[:4] == b"\x89PNG"


def _metrics(**extra):
    base = {
        "num_steps": 6, "num_tokens": 240, "num_generated_tokens": 9, "tokens_per_s": 1800.0,
        "run_s": 0.13, "wall_s": 0.38, "clocks": {"run_s": 0.13, "loop_s": 0.38, "job_s": 17.2},
        "ttft": {"mean_s": None}, "tpot": {"mean_s": None},
        "balance": {"tokens_max_over_mean": 1.0, "attention_work_max_over_mean": 1.0, "padding_fraction": 0.0},
        "collective_bytes": {}, "framework_overhead_s": 0.001, "framework_overhead_fraction": 0.01,
    }
    return {**base, **extra}



def test_summary_names_the_run_clock_the_engine_loop_and_the_job(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")  # one line per row: no wrapping inside a cell
    print_summary({"config": CFG, "metrics": _metrics(), "status": "ok", "run_dir": "/r"})
    text = " ".join(capsys.readouterr().out.split())
    assert "1800 tokens/s on the run clock" in text
    for clock in ("run clock 0.13 s", "engine loop 0.38 s", "job 17.20 s"):
        assert clock in text, clock
    assert " ".join(config_title(CFG).split()) in text

def test_a_simulated_summary_claims_no_verification_and_no_framework_time(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    sim = {"hardware": "h200_sxm", "gpus": 8, "nodes": 1, "weights_dtype": "bf16", "kv_dtype": "bf16", "tflops_per_gpu": 300.0,
           "breakdown_s": {"gemm": {"exposed_s": 0.3, "hidden_s": 0.0},
                           "kv_gather": {"exposed_s": 0.1, "hidden_s": 0.05}}}
    metrics = _metrics(simulate=sim, framework_overhead_s=None, framework_overhead_fraction=None)
    print_summary({"config": {**CFG, "draft": {"kind": "none"}, "mode": "simulate"}, "metrics": metrics, "status": "ok",
                   "run_dir": "/r", "verification": "off"})
    text = " ".join(capsys.readouterr().out.split())
    assert text.count("verification") == 1  # the row that says it is off
    assert "framework overhead" not in text and "1800 tokens/s on the simulated clock" in text
    assert "simulated 0.130 s" in text and "simulator 0.38 s" in text and "rank start-up" not in text
    # the largest exposed terms first, with their share of the exposed time (0.3 of 0.4 s)
    assert "gemm 0.3 s (75%) · kv_gather 0.1 s (25%) +0.05 s hidden" in text


def test_the_summary_says_how_many_requests_ran_and_how_long(capsys, monkeypatch):
    """A workload's defaults differ by mode (a trace: 16 requests at 1% executed, all of it
    simulated): the summary shows what ran."""
    monkeypatch.setenv("COLUMNS", "400")
    rows = [{"prompt_len": p, "output_len": o} for p, o in ((100, 4), (2000, 30), (1300, 2))]
    print_summary({"config": CFG, "metrics": _metrics(num_requests=3, num_finished_requests=3), "status": "ok",
                   "run_dir": "/r", "requests": rows})
    text = " ".join(capsys.readouterr().out.split())
    assert "requests │ 3 · prompts mean 1,133 tokens (max 2,000) · outputs mean 12 (max 30)" in text


def test_the_results_path_is_printed_whole_on_a_narrow_or_piped_console(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    run_dir = "/a/rather/long/path/" + "x" * 90 + "/2026-12-01/21-03-25-123456"
    print_summary({"config": CFG, "metrics": _metrics(), "status": "ok", "run_dir": run_dir})
    assert f"results: {run_dir}/result.json\n" in capsys.readouterr().out


def test_an_untrained_draft_head_says_why_it_accepts_nothing(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    metrics = _metrics(acceptance_rate=0.0, mean_accepted_per_step=0.0, draft_time_fraction=0.2)
    print_summary({"config": CFG, "metrics": metrics, "status": "ok", "run_dir": "/r"})  # CFG drafts with mtp
    text = " ".join(capsys.readouterr().out.split())
    assert "the mtp head is random weights (not trained)" in text and "draft=self" in text


def test_phases_draw_a_bar_per_phase_on_a_terminal_and_nothing_when_piped():
    import io

    from rich.console import Console

    from pcpflow.output.report import Phases

    def draw(terminal: bool) -> str:
        out = io.StringIO()
        console = Console(file=out, force_terminal=terminal, width=100)
        with Phases(console=console) as phases:
            phases.phase("screen on the first 50 requests", 3)
            for _ in range(3):
                phases.advance()
            phases.phase("price the best in full", 2)
            phases.advance()
        return out.getvalue()  # NOTE: leaving draws the bars once more before it clears them

    drawn = draw(True)
    assert "screen on the first 50 requests" in drawn and "3/3" in drawn and "1/2" in drawn
    assert draw(False) == ""


def test_the_summary_of_a_run_cut_short_before_any_request_finished(capsys, monkeypatch):
    """max_steps=1 with an SLO set: no request finished, so there is no SLO attainment to show
    (metrics.goodput.share is None): the summary says so rather than failing, one pool or two."""
    from pcpflow.simulate.engine import SimulatedRun
    from pcpflow.testing import compose

    monkeypatch.setenv("COLUMNS", "400")
    base = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload.num_requests=4", "max_steps=1",
            "slo.ttft_s=1", "output.plots=false", "output.progress=false"]
    for extra in ([], ["disagg=pd"]):
        cfg = compose([*base, *extra])
        metrics = SimulatedRun(cfg).run()["metrics"]
        assert metrics["num_finished_requests"] == 0 and metrics["goodput"]["share"] is None
        print_summary({"config": cfg.model_dump(mode="json"), "metrics": metrics, "status": "ok", "run_dir": "/r",
                       "verification": "off"})
        text = " ".join(capsys.readouterr().out.split())
        assert "0.00 req/s · no request finished" in text, extra


def test_the_kv_cache_line_names_a_hybrid_caches_groups():
    from pcpflow.output.report import serving_rows

    m = {"throughput": {"requests_s": 1.0, "output_tok_s": 2.0, "output_tok_s_per_gpu": 1.0, "total_tok_s": 3.0,
                        "span_s": 1.0},
         "kv_usage": {"mean": 0.1, "max": 0.2}, "prefix_cache": {"hit_rate": 0.0}, "preemptions": 0}
    line = dict(serving_rows({**m, "kv_groups": None}))["KV cache"]
    assert "KV groups" not in line
    groups = {"groups": 7, "full": 1, "windowed": 6, "layers_per_block": 10, "window": {"size": 1024, "kind": "sliding"}}
    line = dict(serving_rows({**m, "kv_groups": groups}))["KV cache"]
    assert line.endswith(" · 7 KV groups (6 windowed, 10 layer(s) a block)")
