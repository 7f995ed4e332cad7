"""The repetition penalty a checkpoint's generation_config.json sets, applied as transformers'
``generate`` applies it — greedy too (Qwen2.5-Instruct ships 1.05 / 1.1).

The expected values come from transformers alone: its ``RepetitionPenaltyLogitsProcessor``
on random logits and histories, and ``model.generate(do_sample=False)`` on a tiny random
Llama whose generation_config.json says ``repetition_penalty: 1.3``. pcpflow must give the
same tokens at pcp=2 dcp=2 with sharded decodes, through preemption (a readmitted request's
history is its prompt and the outputs it had), with drafts (a draft row's history holds the
drafts before it), and pass its own verification; ``sampling.repetition_penalty=1`` turns
it off (transformers' plain argmax).
"""

from __future__ import annotations

import atexit
import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5.15")

import shared_ranks  # noqa: E402
from repo_scripts import load_script  # noqa: E402

from pcpflow.errors import ConfigError  # noqa: E402
from pcpflow.scheduling.kv_cache import KVCacheManager  # noqa: E402
from pcpflow.scheduling.scheduler import Scheduler  # noqa: E402
from pcpflow.scheduling.workload import Request  # noqa: E402
from pcpflow.testing import compose  # noqa: E402
from pcpflow.tokens.sampling import apply_repetition_penalty  # noqa: E402

PENALTY = 1.3
PROMPTS = [[5, 17, 33, 2, 9, 101, 44, 8, 3, 61, 7], [12, 99, 4], [7, 7, 7, 8, 8, 9, 30, 30]]
NEW = 8
COMMON = ["model=hf", "dtype=float32", "workload=explicit", f"workload.prompts={json.dumps(PROMPTS).replace(' ', '')}",
          f"workload.output_lens=[{NEW}]", "workload.ignore_eos=true", "output.plots=false", "output.progress=false"]
LAYOUTS = {
    "pcp2-dcp2-sharded": ["pcp=2", "dcp=2", "decode=sharded", "verify=true", "output.save_logits=true"],
    # 4-token blocks, 7 of them: the three requests do not fit together, one is preempted
    "preempted": ["pcp=2", "kv.block_size=4", "kv.num_blocks=7", "verify=true"],
    "drafts": ["pcp=2", "draft=self", "draft.num_speculative_tokens=3", "draft.error_rate=0.3", "verify=true"],
    "off": ["pcp=2", "sampling.repetition_penalty=1"],
}


@functools.cache
def checkpoint() -> Path:
    root = Path(tempfile.mkdtemp(prefix="pcpflow-penalty-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    path = load_script("make_tiny_hf_checkpoint").build_checkpoint(root / "llama", "llama", seed=3, rope_scaling="none")
    (path / "generation_config.json").write_text(json.dumps({"repetition_penalty": PENALTY}))
    return path


@functools.cache
def transformers_tokens(penalty: float) -> list[list[int]]:
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(), dtype=torch.float32).eval()
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW,
                               repetition_penalty=penalty)[0, len(p):].tolist() for p in PROMPTS]


shared_ranks.matrix("repetition_penalty")(
    lambda: [compose([*COMMON, f"model.path={checkpoint()}", *extra]) for extra in LAYOUTS.values()]
)


def test_penalty_is_transformers_processor():
    """Random logits (both signs) and histories with repeats, against transformers' own
    processor on the same rows."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, 50, generator=gen, dtype=torch.float64) * 3
    histories = [torch.randint(0, 50, (n,), generator=gen) for n in (1, 7, 30, 2, 12)]
    processor = transformers.RepetitionPenaltyLogitsProcessor(penalty=PENALTY)
    want = torch.cat([processor(h[None], logits[i:i + 1].clone()) for i, h in enumerate(histories)])
    sample = np.repeat(np.arange(5), [len(h) for h in histories])
    got = apply_repetition_penalty(logits, PENALTY, (sample, torch.cat(histories).numpy()))
    assert torch.equal(got, want)
    assert not torch.equal(got, logits)


def test_history_is_each_sampled_rows_tokens():
    """``sampled_history`` of a batch with a chunked prompt and decodes with drafts: each
    sampled row's request's tokens at positions 0 to its own, drafts included."""
    reqs = [Request(req_id=0, prompt_token_ids=np.array([3, 4, 5, 6, 7]), max_output_tokens=6, arrival_step=0),
            Request(req_id=1, prompt_token_ids=np.array([9, 9, 1]), max_output_tokens=6, arrival_step=0)]
    sched = Scheduler(reqs, max_num_batched_tokens=4, max_num_seqs=2, kv=KVCacheManager(32, 4, 1),
                      num_speculative_tokens=2, history=True)
    first = sched.schedule()  # request 0's first 4 prompt tokens: nothing sampled
    assert len(first.logits_indices) == 0 and len(first.sampled_history[0]) == 0
    sched.update(first, np.zeros(0, dtype=np.int64))
    second = sched.schedule()  # request 0's last prompt token, request 1's whole prompt
    sample, ids = second.sampled_history
    assert [ids[sample == s].tolist() for s in range(2)] == [[3, 4, 5, 6, 7], [9, 9, 1]]
    sched.update(second, np.array([40, 41]))
    sched.set_draft_tokens(second, np.array([[50, 51], [52, 53]]))
    third = sched.schedule()  # decodes: the newest token, then its drafts, each row sampling
    sample, ids = third.sampled_history
    rows = [ids[sample == s].tolist() for s in range(len(third.logits_indices))]
    assert rows == [[3, 4, 5, 6, 7, 40], [3, 4, 5, 6, 7, 40, 50], [3, 4, 5, 6, 7, 40, 50, 51],
                    [9, 9, 1, 41], [9, 9, 1, 41, 52], [9, 9, 1, 41, 52, 53]][:len(rows)]
    assert len(rows) >= 4


@pytest.mark.dist
@pytest.mark.matrix("repetition_penalty")
def test_tokens_match_transformers(shared_runs):
    with_penalty, without = transformers_tokens(PENALTY), transformers_tokens(1.0)
    assert with_penalty != without, "the penalty must change transformers' tokens for this test to bite"
    runs = dict(zip(LAYOUTS, shared_runs["repetition_penalty"]))
    for name, (cfg, result) in runs.items():
        want = without if name == "off" else with_penalty
        assert result["outputs"] == want, name
        assert cfg.sampling.repetition_penalty == (1.0 if name == "off" else PENALTY)  # the driver's resolution
        if "verify=true" in LAYOUTS[name]:
            assert result["verify"]["passed"], (name, result["verify"])
    assert runs["preempted"][1]["metrics"]["preemptions"] > 0
    # the saved logits are the model's (transformers' output_logits), the choice was made on the penalized ones
    model = transformers.AutoModelForCausalLM.from_pretrained(checkpoint(), dtype=torch.float32).eval()
    saved, changed = runs["pcp2-dcp2-sharded"][1]["logits"], 0
    for prompt, out, rows in zip(PROMPTS, with_penalty, saved):
        with torch.no_grad():
            want = model(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:].double()
        got = torch.tensor(rows, dtype=torch.float64)
        assert float((got - want).abs().max()) < 1e-5
        changed += sum(int(r.argmax()) != t for r, t in zip(got, out))
    assert changed > 0, "the penalty changed no choice: the saved logits cannot tell raw from penalized"


def test_bad_penalty_in_generation_config(tmp_path):
    """A generation_config.json penalty that is not a number > 0: exit-2 problem naming the file."""
    src = checkpoint()
    bad = tmp_path / "ckpt"
    shutil.copytree(src, bad)
    (bad / "generation_config.json").write_text(json.dumps({"repetition_penalty": "high"}))
    with pytest.raises(ConfigError) as exc:
        compose([*COMMON, f"model.path={bad}"])
    assert "repetition_penalty must be a number > 0" in exc.value.report()
    with pytest.raises(ConfigError) as exc:
        compose([*COMMON, f"model.path={src}", "sampling.repetition_penalty=0"])
    assert "sampling.repetition_penalty" in exc.value.report()


def test_settings_pcpflow_does_not_apply_are_named(tmp_path):
    """generation_config.json settings that change transformers' greedy tokens and that
    pcpflow does not apply give a warning naming them; neutral values give none."""
    from pcpflow.driver.checks import generation_warnings

    path = tmp_path / "ckpt"
    shutil.copytree(checkpoint(), path)
    (path / "generation_config.json").write_text(json.dumps(
        {"repetition_penalty": 1.1, "no_repeat_ngram_size": 3, "suppress_tokens": [5], "min_length": 0, "bad_words_ids": None}))
    (warning,) = generation_warnings(compose([*COMMON, f"model.path={path}"]))
    assert "no_repeat_ngram_size=3, suppress_tokens=[5], which pcpflow does not apply" in warning
    (path / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.1, "no_repeat_ngram_size": 0}))
    assert generation_warnings(compose([*COMMON, f"model.path={path}"])) == []
