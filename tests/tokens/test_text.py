"""Text in, text out: texts and chats through the checkpoint's tokenizer, EOS stops, text
results — equal to transformers' ``generate`` under every layout.

The checkpoint is a tiny random Llama with a real tokenizer (a byte-level BPE trained
offline on a paragraph: ``scripts/make_tiny_hf_checkpoint.py --tokenizer``). A random model
rarely emits a given EOS id, so the EOS id is taken from the model's own greedy output:
the 4th-or-later new token of the first text whose first occurrence it is. transformers
then generates greedily with that EOS (its stop, no ``min_new_tokens``); pcpflow must give
the same ids (EOS included), the same text, and pass its own exact verification.
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
from pcpflow.output.report import first_outputs  # noqa: E402
from pcpflow.scheduling.kv_cache import KVCacheManager  # noqa: E402
from pcpflow.scheduling.scheduler import Scheduler  # noqa: E402
from pcpflow.scheduling.workload import Request  # noqa: E402
from pcpflow.testing import cli, compose  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["The capital of France is", "What is the capital", "Context parallelism splits a long prompt"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_NEW = 12
EOS_AT = 3  # the chosen EOS id is the first text's greedy token at >= this index


def _generate(model, ids: list[int], eos: list[int] | None) -> tuple[list[int], float]:
    """transformers' greedy ``generate`` (its EOS stop), new tokens and the smallest top-2
    logit gap among its choices."""
    model.generation_config.eos_token_id = eos
    model.generation_config.pad_token_id = eos[0] if eos else 0
    # NOTE: an explicit mask: generate would otherwise mask prompt tokens equal to the pad id
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=MAX_NEW,
                         output_scores=True, return_dict_in_generate=True)
    gaps = [float(s[0].topk(2).values.diff().abs()) for s in out.scores]
    return out.sequences[0, len(ids):].tolist(), min(gaps)


@functools.cache
def _ckpt() -> dict:
    """(checkpoint dir, tokenizer, the chosen EOS id, transformers' outputs), built once per
    session: the shared matrices below need it before any fixture runs."""
    tmp = Path(tempfile.mkdtemp(prefix="pcpflow-test-text-"))
    atexit.register(shutil.rmtree, tmp, True)
    script = load_script("make_tiny_hf_checkpoint")
    path = script.build_checkpoint(tmp / "llama", "llama", tokenizer=True)
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    prompts.append(tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)["input_ids"])
    with torch.no_grad():
        free = [_generate(model, p, None)[0] for p in prompts]
        first = free[0]
        k = next(i for i in range(EOS_AT, MAX_NEW) if first[i] not in first[:i])
        eos = [first[k], tok.convert_tokens_to_ids("<|im_end|>")]
        script.write_generation_config(path, eos, tok.bos_token_id)
        stopped = [_generate(model, p, eos) for p in prompts]
    assert all(gap > 1e-3 for _, gap in stopped), "float32 vs float64 needs decisive choices"
    return {"path": path, "tok": tok, "eos": eos, "prompts": prompts, "free": free,
            "stopped": [ids for ids, _ in stopped], "eos_index": k}


@pytest.fixture(scope="module")
def ckpt() -> dict:
    return _ckpt()


def _overrides(ckpt, pcp, dcp, decode, *extra):
    return ["model=hf", f"model.path={ckpt['path']}", "dtype=float64", f"pcp={pcp}", f"dcp={dcp}",
            f"decode={decode}", "workload=explicit", f"workload.output_lens=[{MAX_NEW}]",
            "scheduler.max_num_seqs=2", "output.plots=false", "output.progress=false", *extra]


def _texts(texts=TEXTS):
    return "workload.texts=" + json.dumps(texts)


def _chats():
    return "workload.chats=[[{role: user, content: " + json.dumps(CHAT[0]["content"]) + "}]]"


def _cases(ckpt, layouts, chat_layouts=None):
    cases = {}
    for pcp, dcp, decode in layouts:
        cases[f"texts-pcp{pcp}-dcp{dcp}-{decode}"] = _overrides(ckpt, pcp, dcp, decode, _texts())
    for pcp, dcp, decode in layouts if chat_layouts is None else chat_layouts:
        cases[f"chat-pcp{pcp}-dcp{dcp}-{decode}"] = _overrides(ckpt, pcp, dcp, decode, _chats())
    return cases


DEFAULT_LAYOUTS = [(1, 1, "replicated"), (4, 4, "sharded")]
SLOW_LAYOUTS = [(2, 1, "replicated"), (2, 1, "sharded"), (4, 4, "replicated"), (4, 1, "sharded"), (4, 1, "replicated")]


def _default_cases() -> dict[str, list[str]]:
    ckpt = _ckpt()
    cases = _cases(ckpt, DEFAULT_LAYOUTS, chat_layouts=[(4, 4, "sharded")])
    cases["ignore_eos-pcp4-dcp4-sharded"] = _overrides(ckpt, 4, 4, "sharded", _texts(), "workload.ignore_eos=true")
    # the target drafting itself: every proposal is accepted, so the EOS lands among drafts
    cases["self_draft-pcp4-dcp4-sharded"] = _overrides(ckpt, 4, 4, "sharded", _texts(), "draft=self")
    return cases


def _slow_cases() -> dict[str, list[str]]:
    return _cases(_ckpt(), SLOW_LAYOUTS, chat_layouts=SLOW_LAYOUTS + DEFAULT_LAYOUTS[::2])


# run in the session's shared ranks (tests/shared_ranks.py)
shared_ranks.matrix("text")(lambda: [compose(o) for o in _default_cases().values()])
shared_ranks.matrix("text/slow")(lambda: [compose(o) for o in _slow_cases().values()])


@pytest.fixture(scope="module")
def results(shared_runs):
    return {name: result for name, (_, result) in zip(_default_cases(), shared_runs["text"])}


def _check(result, ckpt, which):
    tok = ckpt["tok"]
    want = ckpt["stopped"][:3] if which == "texts" else ckpt["stopped"][3:]
    prompts = ckpt["prompts"][:3] if which == "texts" else ckpt["prompts"][3:]
    assert result["verify"]["passed"], result["verify"]
    assert [r["prompt_token_ids"] for r in result["requests"]] == prompts
    assert result["outputs"] == want
    assert result["texts"] == [tok.decode(ids, skip_special_tokens=True) for ids in want]


@pytest.mark.dist
@pytest.mark.parametrize("layout", DEFAULT_LAYOUTS, ids=lambda x: "-".join(map(str, x)))
@pytest.mark.matrix("text")
def test_greedy_with_eos_equals_transformers(layout, results, ckpt):
    pcp, dcp, decode = layout
    _check(results[f"texts-pcp{pcp}-dcp{dcp}-{decode}"], ckpt, "texts")
    chat = results.get(f"chat-pcp{pcp}-dcp{dcp}-{decode}")
    if chat is not None:
        _check(chat, ckpt, "chat")


def test_the_stop_path_runs(ckpt):
    # request 0 ends at the chosen EOS, early; the test would be vacuous otherwise
    first = ckpt["stopped"][0]
    assert len(first) == ckpt["eos_index"] + 1 < MAX_NEW and first[-1] == ckpt["eos"][0]
    assert first == ckpt["free"][0][: len(first)]


@pytest.mark.dist
@pytest.mark.matrix("text")
def test_ignore_eos_generates_output_lens(results, ckpt):
    r = results["ignore_eos-pcp4-dcp4-sharded"]
    assert r["verify"]["passed"]
    assert [len(o) for o in r["outputs"]] == [MAX_NEW] * len(TEXTS)
    assert r["outputs"] == ckpt["free"][:3]


@pytest.mark.dist
@pytest.mark.matrix("text")
def test_eos_inside_accepted_drafts_stops_there(results, ckpt):
    r = results["self_draft-pcp4-dcp4-sharded"]
    _check(r, ckpt, "texts")
    assert r["metrics"]["acceptance_rate"] > 0.5


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("text/slow")
def test_greedy_with_eos_equals_transformers_every_layout(ckpt, shared_runs):
    for name, (_, result) in zip(_slow_cases(), shared_runs["text/slow"]):
        _check(result, ckpt, name.split("-")[0])


def test_prompts_are_tokenized_once_with_one_bos(ckpt):
    tok, bos = ckpt["tok"], ckpt["tok"].bos_token_id
    cfg = compose(_overrides(ckpt, 1, 1, "replicated", _chats()))
    (chat_ids,) = cfg.workload.text_token_ids
    assert chat_ids == ckpt["prompts"][3] and chat_ids[0] == bos and chat_ids.count(bos) == 1
    # the template's rendered text re-tokenized would add a second BOS: that is not what runs
    rendered = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert tok(rendered)["input_ids"][:2] == [bos, bos]
    cfg = compose(_overrides(ckpt, 1, 1, "replicated", _texts()))
    assert all(ids[0] == bos and ids.count(bos) == 1 for ids in cfg.workload.text_token_ids)


# ----------------------------------------------------------------- bad input: exit 2
def _problem(overrides) -> str:
    with pytest.raises(ConfigError) as e:
        compose(overrides)
    return e.value.report()


def test_texts_need_a_tokenizer(ckpt, tmp_path):
    report = _problem(["model=tiny_mla", "workload=explicit", _texts()])
    assert "workload.texts" in report and "no tokenizer" in report
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(ckpt["path"]) / name, bare / name)
    report = _problem(["model=hf", f"model.path={bare}", "workload=explicit", _chats()])
    assert "workload.chats" in report and "no tokenizer files" in report


@pytest.mark.parametrize(
    "bad, field",
    [
        (_texts([""]), "workload.texts.0"),
        ("workload.chats=[[]]", "workload.chats.0"),
        ("workload.prompts=[[1,2]]", "workload"),  # with texts: one source only
    ],
)
def test_empty_or_ambiguous_prompts_are_rejected(ckpt, bad, field):
    extra = [bad] if "prompts" not in bad else [_texts(), bad]
    report = _problem(["model=hf", f"model.path={ckpt['path']}", "workload=explicit", *extra])
    assert field in report


def test_cached_lens_of_texts_are_checked_against_their_tokens(ckpt):
    """prompt_lens do not apply to texts: cached_lens is judged on the tokenized prompts,
    whatever prompt_lens the workload's YAML or the command line carries."""
    n = [len(ckpt["tok"](t)["input_ids"]) for t in TEXTS]
    base = ["model=hf", f"model.path={ckpt['path']}", "workload=explicit", _texts()]
    compose([*base, "workload.prompt_lens=[1]", f"workload.cached_lens=[{min(n) - 1}]"])  # fits every text
    report = _problem([*base, "workload.prompt_lens=[100]", f"workload.cached_lens=[{max(n)}]"])
    assert "workload.cached_lens" in report and f"request 0: {max(n)} >= {n[0]}" in report
    report = _problem([*base, "workload.cached_lens=[1,1,1,1,1,1,1]"])
    assert f"cached_lens has 7 values for {len(TEXTS)} prompts" in report


def test_cli_exit_code_2_for_texts_without_tokenizer(tmp_path):
    r = cli("model=tiny_mla", "workload=explicit", _texts(), f"hydra.run.dir={tmp_path / 'run'}")
    assert r.returncode == 2, r.stderr
    assert "workload.texts" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------- the scheduler's stop
def _sched(prompt_lens, outs, *, seqs=8, k=0, stop=(99,)):
    reqs = [Request(i, np.arange(n, dtype=np.int64) + 10, o, 0) for i, (n, o) in enumerate(zip(prompt_lens, outs))]
    kv = KVCacheManager(num_blocks=16, block_size=4)
    return Scheduler(reqs, max_num_batched_tokens=16, max_num_seqs=seqs, kv=kv,
                     num_speculative_tokens=k, stop_token_ids=stop), kv


def test_eos_among_accepted_drafts_ends_the_request_there():
    s, kv = _sched([4], [10], k=3)
    b = s.schedule()
    s.update(b, np.array([7]))  # prefill samples 7
    s.set_draft_tokens(b, np.array([[8, 99, 9]]))
    b = s.schedule()
    assert b.input_ids.tolist() == [7, 8, 99, 9]
    # the target agrees with every draft and samples 5 after them: without the stop the
    # row would append 8, 99, 9, 5
    out = s.update(b, np.array([8, 99, 9, 5]))
    assert s.outputs()[0] == [7, 8, 99]
    assert out.finished_req_ids.tolist() == [0] and s.done
    assert kv.num_free_blocks == kv.num_blocks  # its blocks are freed at once


def test_a_stopped_request_makes_room_for_the_next():
    s, kv = _sched([3, 3], [6, 2], seqs=1)
    b = s.schedule()
    assert b.req_ids.tolist() == [0]
    s.update(b, np.array([99]))  # request 0's first token is an EOS: done after 1 token
    b = s.schedule()
    assert b.req_ids.tolist() == [1] and b.step == 1  # not after 6 steps
    assert s.outputs()[0] == [99]


def test_console_summary_shows_the_first_outputs():
    result = {"outputs": [[1, 2], [3], [4], [5]], "texts": ["Paris.", "b", "c", "d"]}
    rows = dict(first_outputs(result))
    assert "'Paris.' (2 tokens)" in rows["output 0"] and "output 3" not in rows
    assert "[1, 2]" in dict(first_outputs({"outputs": [[1, 2]]}))["output 0"]
