"""mode=simulate from the command line: the contract's names compose, bad input is one
report naming the field (exit 2, nothing run), a run writes its result files and says it
is not verified, model=hf reads only config.json, and cached prefixes start the clock
after the prefix is in the KV cache."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pcpflow.driver.cli import compose_raw
from pcpflow.driver.job import prepare_job
from pcpflow.errors import ConfigError
from pcpflow.scheduling.kv_cache import KVCacheManager
from pcpflow.scheduling.scheduler import Scheduler
from pcpflow.scheduling.workload import Request
from pcpflow.simulate.engine import simulate_run
from pcpflow.testing import cli

REPO = Path(__file__).resolve().parents[2]
SIM = ["mode=simulate", "output.plots=false", "output.progress=false"]
LLAMA = SIM + ["model=llama3_405b", "hardware=gtt_h100", "simulate.weights_dtype=fp8", "tp=8", "workload=explicit"]


def problems(overrides) -> dict[str, str]:
    with pytest.raises(ConfigError) as exc:
        prepare_job(compose_raw(overrides))
    return {p.field: f"{p.given} | {p.allowed}" for p in exc.value.problems}


def test_contract_names_compose():
    cfg = prepare_job(compose_raw(LLAMA + ["pcp=2", "dcp=2", "workload.prompt_lens=[8192]", "workload.output_lens=[1]",
                                           "simulate.kv_dtype=fp8", "simulate.cp_decode=ring_pass_q"]))
    assert (cfg.mode, cfg.simulate.weights_dtype, cfg.hardware.name) == ("simulate", "fp8", "gtt_h100")
    assert (cfg.simulate.kv_dtype, cfg.simulate.cp_decode) == ("fp8", "ring_pass_q")
    assert cfg.verify is False
    # simulated defaults: the prompt unchunked (+ a decode per seat), the HBM left for KV
    assert cfg.scheduler.max_num_batched_tokens == 8192 + cfg.scheduler.max_num_seqs
    assert cfg.kv.num_blocks >= 8193 // (cfg.kv.block_size * 2)
    assert prepare_job(compose_raw([])).mode == "execute"


@pytest.mark.parametrize(
    "overrides, field, says",
    [
        (SIM + ["hardware=a100"], "hardware", "b200, gtt_h100, h100_sxm, h200_sxm"),
        (SIM + ["model=llama2_7b", "hardware=b200"], "model", "llama3_405b"),
        (SIM + ["model=llama3_8b"], "hardware", "gtt_h100"),
        (SIM + ["model=llama3_8b", "hardware=b200", "tp=3"], "tp", "allowed: [1, 2, 4, 8"),
        (LLAMA + ["workload.prompt_lens=[1048576]", "workload.output_lens=[1]"], "workload", "GiB per GPU"),
        (LLAMA + ["workload.prompt_lens=[100, 50]", "workload.cached_lens=[10, 50]"], "workload.cached_lens", "50 >= 50"),
        (["model=llama3_8b"], "model", "mode=simulate"),
    ],
)
def test_bad_input_names_the_field_and_what_is_allowed(overrides, field, says):
    found = problems(overrides)
    assert field in found and says in found[field], found


def test_kv_that_does_not_fit_says_how_much_is_needed():
    msg = problems(LLAMA + ["workload.prompt_lens=[1048576]", "workload.output_lens=[1]"])["workload"]
    # 1048577 tokens x 126 layers x (2 x 128) x 2 B on one KV shard = 63.0 GiB of KV
    need = 1048577 * 126 * 256 * 2 / 2**30
    assert f"needs {need:.1f} GiB per GPU" in msg
    assert prepare_job(compose_raw(LLAMA + ["pcp=16", "dcp=16", "workload.prompt_lens=[1048576]",
                                            "workload.output_lens=[1]"]))


def test_bad_simulation_exits_2_before_anything_runs(tmp_path):
    r = cli(*SIM, "model=llama3_8b", "hardware=b200", "tp=3", f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert "tp" in r.stderr and "allowed" in r.stderr
    assert not (tmp_path / "run").exists()


def test_a_simulated_run_writes_results_and_says_it_is_not_verified(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pcpflow", "mode=simulate", "model=llama3_70b", "hardware=h200_sxm",
                        "tp=8", "pcp=2", "dcp=2", "workload=explicit", "workload.prompt_lens=[32768,2000]",
                        "workload.output_lens=[3]", "output.progress=false", f"hydra.run.dir={tmp_path}"],
                       cwd=REPO, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr
    assert "verification" in r.stdout and "mode=simulate" in r.stdout  # the summary's row
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["status"] == "ok" and "nothing to verify" in result["verification"]
    assert result["config"]["verify"] is False and "verify" not in result
    m = result["metrics"]
    assert m["ttft"]["mean_s"] > 0 and m["tpot"]["mean_s"] > 0
    per_rank = m["simulate"]["per_rank"]
    assert len(per_rank["compute_s"]) == 2 and len(per_rank["communication_s"]) == 2
    assert "tp_all_reduce" in m["collective_bytes"]
    breakdown = m["simulate"]["breakdown_s"]
    assert {"gemm", "attention", "memory_ops", "host_launch", "kv_gather", "tp_all_reduce"} <= set(breakdown)
    assert all(set(v) == {"exposed_s", "hidden_s"} for v in breakdown.values())
    assert set(m["simulate"]["fitted"]) == {"gemm_efficiency", "p2p_efficiency"}
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == m["num_steps"]
    assert (tmp_path / "load.png").exists()


def test_hf_model_is_priced_from_config_json_alone(tmp_path):
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
              "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336}
    (tmp_path / "config.json").write_text(json.dumps(config))
    common = ["tp=2", "pcp=2", "workload=explicit", "workload.prompt_lens=[4096]", "workload.output_lens=[2]"]
    via_hf = simulate_run(prepare_job(compose_raw(SIM + ["model=hf", f"model.path={tmp_path}", "hardware=h100_sxm"] + common)))
    via_card = simulate_run(prepare_job(compose_raw(SIM + ["model=llama3_8b", "hardware=h100_sxm"] + common)))
    assert via_hf["metrics"]["ttft"] == via_card["metrics"]["ttft"]
    assert "model.path" in problems(["model=hf", f"model.path={tmp_path}"])  # executing needs the weights


def test_a_cached_prefix_is_prefilled_before_the_clock_starts():
    """Prompt of 10 with 6 cached, budget 100: step 0 writes the 6 cached tokens (no
    sample), step 1 the other 4 and samples; the request's clock starts at step 1."""
    kv = KVCacheManager(16, 4)
    s = Scheduler([Request(0, np.arange(10), 2, 0, cached_len=6)], max_num_batched_tokens=100, max_num_seqs=2, kv=kv)
    b0 = s.schedule()
    assert b0.num_scheduled_tokens.tolist() == [6] and len(b0.logits_indices) == 0
    s.update(b0, np.zeros(0, dtype=np.int64))
    b1 = s.schedule()
    assert b1.num_scheduled_tokens.tolist() == [4] and b1.num_computed_tokens.tolist() == [6]
    s.update(b1, np.zeros(1, dtype=np.int64))
    t = s.request_timing()[0]
    assert (t["arrival_step"], t["first_token_step"]) == (1, 1)


def test_simulated_ttft_of_a_cached_prefix_is_the_continued_prefill():
    common = LLAMA + ["pcp=4", "dcp=4", "workload.prompt_lens=[128000]", "workload.output_lens=[1]"]
    cold = simulate_run(prepare_job(compose_raw(common)))["metrics"]
    warm = simulate_run(prepare_job(compose_raw(common + ["workload.cached_lens=[126720]"])))["metrics"]
    assert warm["num_steps"] == 2 and warm["num_prefill_tokens"] == 128000
    assert warm["ttft"]["mean_s"] < cold["ttft"]["mean_s"] / 10


def test_every_hardware_and_card_number_cites_its_source():
    for path in [*(REPO / "conf/hardware").glob("*.yaml"),
                 *(REPO / f"conf/model/{c}.yaml" for c in ("llama3_8b", "llama3_70b", "llama3_405b", "deepseek_v3"))]:
        for line in path.read_text().splitlines():
            key, _, value = line.split("#")[0].partition(":")
            value = value.strip()
            if value and value.replace(".", "").isdigit() and "name" not in key:
                assert "#" in line and len(line.split("#", 1)[1].strip()) > 10, f"{path.name}: {line}"
