"""A rate probe stops once its SLO attainment can no longer reach the target
(``pcpflow.simulate.slo_watch``): the answer to "attainment >= target?" is the full run's."""

from __future__ import annotations

from functools import cache

import pytest

from pcpflow.simulate.engine import SimulatedRun
from pcpflow.simulate.pools import PooledRun
from pcpflow.simulate.slo_watch import CHECK_EVERY
from pcpflow.testing import compose

SIM = ["mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "output.plots=false", "output.progress=false"]
LOAD = ["workload=synthetic", "workload.num_requests=100", "workload.prompt_len=[200,6000]",
        "workload.output_len=[20,120]", "workload.seed=3"]


def _share(m: dict) -> float:
    return m["goodput"]["share"]


CASES = [
    # (the service, its SLOs): met by exactly 90%, missed late and early, TPOT-bound, replicas, pools
    (["workload.request_rate=10"], ["slo.ttft_s=0.5", "slo.tpot_s=0.05"]),
    (["workload.request_rate=14"], ["slo.ttft_s=0.5", "slo.tpot_s=0.05"]),
    (["workload.request_rate=6"], ["slo.tpot_s=0.02"]),
    (["workload.request_rate=20", "serving.replicas=2", "serving.router=least_loaded"], ["slo.ttft_s=0.3"]),
    (["workload.request_rate=60", "serving.replicas=2", "serving.router=prefix_aware"], ["slo.ttft_s=0.3"]),
    (["workload.request_rate=14", "disagg=pd"], ["slo.ttft_s=0.4", "slo.tpot_s=0.03"]),
    (["workload.request_rate=20", "disagg=pd"], ["slo.ttft_s=0.4", "slo.tpot_s=0.03"]),
]


@cache
def _metrics(case: int, target: float | None) -> dict:
    layout, slo = CASES[case]
    cfg = compose(SIM + LOAD + layout + slo)
    run = PooledRun if cfg.disagg.enabled else SimulatedRun
    return run(cfg, keep_records=False, give_up_below=target).run()["metrics"]


@pytest.mark.parametrize("target", [0.5, 0.9])
@pytest.mark.parametrize("case", range(len(CASES)), ids=[" ".join(a + b) for a, b in CASES])
def test_a_probe_that_stops_answers_as_the_full_run(case, target):
    full, watched = _metrics(case, None), _metrics(case, target)
    assert (_share(watched) >= target) == (_share(full) >= target)
    stopped = watched["goodput"].get("gave_up")
    if stopped is None:  # it ran to the end: the same run
        assert watched["num_steps"] == full["num_steps"] and _share(watched) == _share(full)
        return
    assert _share(full) <= _share(watched) < target  # the bound it reports is a bound
    assert stopped["share_at_most"] == _share(watched) and stopped["requests"] == 100
    assert watched["num_steps"] < full["num_steps"]


def test_the_matrix_has_probes_that_stop_and_probes_that_run_out():
    """The matrix above is not vacuous: at 0.9 some of its probes stop early, one pooled, and
    some do not."""
    stopped = ["gave_up" in _metrics(case, 0.9)["goodput"] for case in range(len(CASES))]
    assert any(stopped) and not all(stopped) and stopped[-1]


def test_every_request_late_stops_at_the_first_check():
    """Eight requests at once, 200 tokens each to generate, a TTFT SLO no step can meet: at the
    first check (step 64) all eight have arrived and are late, with or without a first token;
    the run stops there, the attainment at most 0."""
    cfg = compose(SIM + ["workload=explicit", "workload.prompt_lens=[100,100,100,100,100,100,100,100]",
                         "workload.output_lens=[200]", "workload.request_rate=inf", "slo.ttft_s=1e-9"])
    m = SimulatedRun(cfg, keep_records=False, give_up_below=0.1).run()["metrics"]
    assert m["num_steps"] == CHECK_EVERY
    assert m["goodput"]["gave_up"]["missed"] == 8 and m["goodput"]["share"] == 0.0


def test_no_target_or_a_run_cut_at_max_steps_is_never_stopped():
    work = SIM + ["workload=explicit", "workload.prompt_lens=[100,100,100,100,100,100,100,100]",
                  "workload.output_lens=[200]", "workload.request_rate=inf", "slo.ttft_s=1e-9"]
    assert "gave_up" not in SimulatedRun(compose(work), keep_records=False).run()["metrics"]["goodput"]
    cut = SimulatedRun(compose(work + ["max_steps=150"]), keep_records=False, give_up_below=0.1).run()["metrics"]
    assert cut["num_steps"] == 150 and "gave_up" not in cut["goodput"]


@pytest.mark.parametrize("service", [
    ["workload.request_rate=10"],
    # NOTE: slow: the same watch over two pools' runs (4 s; the default set's budget)
    pytest.param(["workload.request_rate=10", "disagg=pd"], marks=pytest.mark.slow),
], ids=["one pool", "pools"])
def test_a_goodput_search_finds_the_rate_it_finds_without_stopping(service, monkeypatch):
    """The rate search of ``pcpflow.search.evaluate`` tries the same rates and finds the same
    goodput whether its probes stop early or run to the end; some of its probes do stop."""
    from pcpflow.driver.compose import compose_raw
    from pcpflow.driver.job import prepare_job
    from pcpflow.search.evaluate import Settings, evaluate
    from pcpflow.simulate.slo_watch import SloWatch

    # NOTE: a TTFT target kept at no rate above the burst's served rate: the search bisects below it
    raw = compose_raw(SIM + LOAD + service + ["workload.num_requests=40", "slo.ttft_s=0.2", "slo.tpot_s=0.05"])
    settings = Settings(None, True, 0.9, 0.1, 1 / 16)
    watched = evaluate(raw, prepare_job, settings)
    stops = []
    real = SloWatch.hopeless

    def hopeless(self, columns, now):
        stops.append(real(self, columns, now))
        return stops[-1]

    monkeypatch.setattr(SloWatch, "hopeless", hopeless)
    evaluate(raw, prepare_job, settings)
    assert any(stops)
    monkeypatch.setattr(SloWatch, "of", classmethod(lambda cls, *a, **k: None))
    full = evaluate(raw, prepare_job, settings)
    assert "error" not in full and full["goodput_bound"] == "bisected"
    for key in ("goodput_req_s", "goodput_bound", "runs", "ttft_p90_s", "tpot_p90_s"):
        assert watched[key] == full[key], key
    assert [r for r, _ in watched["goodput_tried"]] == [r for r, _ in full["goodput_tried"]]
    assert [a >= 0.9 for _, a in watched["goodput_tried"]] == [a >= 0.9 for _, a in full["goodput_tried"]]
