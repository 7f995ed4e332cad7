import json
import math
from pathlib import Path

import numpy as np
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from pcpflow.errors import ConfigError
from pcpflow.scheduling import prefix
from pcpflow.scheduling.workload import (
    MAX_ARRIVAL_S,
    NEVER_PRIVATE,
    ExplicitWorkload,
    SyntheticWorkload,
    TraceWorkload,
    WorkloadConfig,
    build_requests,
    request_table,
)
from pcpflow.testing import cli

REPO = Path(__file__).resolve().parents[2]
FULL_TRACE = REPO.parent / "shared" / "traces" / "mooncake_conversation.jsonl"
# NOTE: the repo bundles the trace's first 1,000 lines for fresh clones (scripts/data).
REAL_TRACE = FULL_TRACE if FULL_TRACE.exists() else REPO / "scripts" / "data" / "mooncake_conversation_head.jsonl"
workload_adapter = TypeAdapter(WorkloadConfig)


def _error(cls, **kwargs):
    with pytest.raises(ValidationError) as e:
        cls(**kwargs)
    (err,) = e.value.errors()
    return err["loc"], err["msg"]


# -- synthetic ---------------------------------------------------------------------------


def test_synthetic_is_deterministic_and_in_range():
    cfg = SyntheticWorkload(
        num_requests=40, prompt_len=(3, 9), output_len=(2, 5), arrival_every=0.5
    )
    a = build_requests(cfg, vocab_size=50, seed=7)
    b = build_requests(cfg, vocab_size=50, seed=7)
    c = build_requests(cfg, vocab_size=50, seed=8)
    assert [r.req_id for r in a] == list(range(40))
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.prompt_token_ids, y.prompt_token_ids)
        assert (x.max_output_tokens, x.arrival_step) == (y.max_output_tokens, y.arrival_step)
    assert any(
        len(x.prompt_token_ids) != len(z.prompt_token_ids)
        or not np.array_equal(x.prompt_token_ids, z.prompt_token_ids)
        for x, z in zip(a, c)
    )
    assert all(3 <= r.prompt_len <= 9 and 2 <= r.max_output_tokens <= 5 for r in a)
    assert {r.prompt_len for r in a} == set(range(3, 10))  # 40 draws cover 7 values
    assert all(r.prompt_token_ids.dtype == np.int64 for r in a)
    tokens = np.concatenate([r.prompt_token_ids for r in a])
    assert tokens.min() >= 0 and tokens.max() < 50
    assert [r.arrival_step for r in a[:5]] == [0, 0, 1, 1, 2]  # floor(i * 0.5)


def test_synthetic_config_seed_overrides_run_seed():
    cfg = SyntheticWorkload(seed=3)
    a = build_requests(cfg, vocab_size=100, seed=1)
    b = build_requests(cfg, vocab_size=100, seed=2)
    assert all(np.array_equal(x.prompt_token_ids, y.prompt_token_ids) for x, y in zip(a, b))


def test_synthetic_all_at_step_zero():
    reqs = build_requests(SyntheticWorkload(arrival_every=0), vocab_size=10, seed=0)
    assert {r.arrival_step for r in reqs} == {0}


def test_synthetic_rejects_inverted_range():
    loc, msg = _error(SyntheticWorkload, prompt_len=(9, 3))
    assert loc == ("prompt_len",) and "min <= max" in msg


def test_unknown_field_and_kind_rejected():
    with pytest.raises(ValidationError, match="extra"):
        SyntheticWorkload(num_request=3)
    with pytest.raises(ValidationError, match="synthetic"):
        workload_adapter.validate_python({"kind": "nope"})


# -- arrivals in time ----------------------------------------------------------------------


def test_the_latest_arrival_is_where_float64_holds_a_microsecond():
    # float64 at MAX_ARRIVAL_S: times 2^-23 s apart (2^29 <= 1e9 < 2^30, 52 fraction bits)
    assert np.spacing(MAX_ARRIVAL_S) == 2.0**-23 < 1e-6


@pytest.mark.parametrize("cls, n_requests", [(SyntheticWorkload, {"num_requests": 3}),
                                              (ExplicitWorkload, {"prompt_lens": [100, 200, 300]})])
def test_a_rate_whose_arrivals_outrun_float64_is_refused(cls, n_requests):
    # 3 requests, the first at 0: the last arrives at 2 / rate on average; allowed up to 1e9 s
    loc, msg = _error(cls, **n_requests, request_rate=1e-15)
    assert loc == ("request_rate",)
    assert "~2e+15 s" in msg and ">= 2e-09 requests/s" in msg and "inf" in msg
    assert cls(**n_requests, request_rate=1e-8).request_rate == 1e-8  # 2e8 s
    assert cls(**n_requests, request_rate=math.inf).request_rate == math.inf


def test_one_request_arrives_at_0_whatever_the_rate():
    table = request_table(SyntheticWorkload(num_requests=1, request_rate=1e-300), vocab_size=8, seed=0,
                          with_tokens=False, simulated=True)
    assert table.arrival_s.tolist() == [0.0]


def test_a_trace_stretched_past_float64_is_refused(tmp_path):
    path = _write(tmp_path, [_row(0, 5, 3, [0]), _row(1000, 5, 3, [1])])  # 1 s of timestamps
    with pytest.raises(ConfigError) as e:
        request_table(TraceWorkload(path=path, time_scale=1e10), vocab_size=9, seed=0, with_tokens=False,
                      simulated=True)
    (p,) = e.value.problems
    assert (p.field, p.given) == ("workload.time_scale", 1e10) and "<= 1e+09" in p.allowed
    table = request_table(TraceWorkload(path=path, time_scale=1e9), vocab_size=9, seed=0, with_tokens=False,
                          simulated=True)
    assert table.arrival_s.tolist() == [0.0, 1e9]
    # in steps the clock is not float64's (arrival steps are integers)
    assert request_table(TraceWorkload(path=path, time_scale=1e10, step_ms=1e10), vocab_size=9, seed=0,
                         with_tokens=False, simulated=True).arrival_steps.tolist() == [0, 1000]


def test_a_tiny_rate_is_refused_by_the_driver_and_a_small_one_runs(tmp_path):
    base = ("mode=simulate", "model=llama3_8b", "hardware=h100_sxm", "workload=explicit",
            "workload.prompt_lens=[100,200,300]", "workload.output_lens=[4]", "output.plots=false",
            "output.progress=false", f"hydra.run.dir={tmp_path}")
    r = cli(*base, "workload.request_rate=1e-15")
    assert r.returncode == 2
    (line,) = [x for x in r.stderr.splitlines() if "workload.request_rate" in x]
    assert "got 1e-15" in line and ">= 2e-09 requests/s" in line
    r = cli(*base, "workload.request_rate=0.01")  # arrivals over ~200 s
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "result.json").read_text())["requests"]
    assert all(q["ttft_s"] > 0 and q["tpot_s"] > 0 for q in rows)


# -- explicit ----------------------------------------------------------------------------


def test_explicit_prompt_lens_broadcast_output_and_arrivals():
    cfg = ExplicitWorkload(prompt_lens=[3, 8, 17], output_lens=[4], arrival_steps=[0, 2, 2])
    reqs = build_requests(cfg, vocab_size=32, seed=0)
    assert [r.prompt_len for r in reqs] == [3, 8, 17]
    assert [r.max_output_tokens for r in reqs] == [4, 4, 4]
    assert [r.arrival_step for r in reqs] == [0, 2, 2]


def test_explicit_prompts_are_used_verbatim():
    cfg = ExplicitWorkload(prompts=[[5, 6, 7], [1]], prompt_lens=None, output_lens=[2, 3])
    reqs = build_requests(cfg, vocab_size=8, seed=0)
    assert [r.prompt_token_ids.tolist() for r in reqs] == [[5, 6, 7], [1]]
    assert [r.max_output_tokens for r in reqs] == [2, 3]
    assert [r.arrival_step for r in reqs] == [0, 0]


def test_explicit_prompts_replace_prompt_lens():
    cfg = ExplicitWorkload(prompt_lens=[2, 9, 9], prompts=[[1, 2, 3]], output_lens=[2])
    reqs = build_requests(cfg, vocab_size=8, seed=0)
    assert [r.prompt_token_ids.tolist() for r in reqs] == [[1, 2, 3]]


def test_explicit_needs_a_prompt_source():
    loc, msg = _error(ExplicitWorkload)
    assert loc == ("prompts",) and "give prompt_lens" in msg


def test_explicit_mismatched_lengths_name_field_and_allowed():
    loc, msg = _error(ExplicitWorkload, prompt_lens=[2, 3, 4], output_lens=[1, 2])
    assert loc == ("output_lens",)
    assert "2 values for 3 prompts" in msg and "1 value" in msg and "3 values" in msg
    loc, msg = _error(ExplicitWorkload, prompts=[[1], [2]], arrival_steps=[0])
    assert loc == ("arrival_steps",) and "2 values or null" in msg
    loc, _ = _error(ExplicitWorkload, prompt_lens=[2, 0])
    assert loc == ("prompt_lens", 1)
    loc, msg = _error(ExplicitWorkload, prompts=[[1], []])
    assert loc == ("prompts",) and "[1]" in msg


def test_explicit_token_ids_outside_vocab():
    cfg = ExplicitWorkload(prompts=[[1, 2], [3, 10]])
    with pytest.raises(ConfigError) as e:
        build_requests(cfg, vocab_size=10, seed=0)
    (p,) = e.value.problems
    assert p.field == "workload.prompts" and "[0, 10)" in p.allowed and "[1]" in p.allowed


# -- trace -------------------------------------------------------------------------------


def _write(tmp_path, rows):
    path = tmp_path / "trace.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def _row(ts, inp, out, hashes):
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": hashes}


def test_trace_lengths_arrivals_and_cap(tmp_path):
    path = _write(tmp_path, [
        _row(1000, 1024, 30, [0, 1]),
        _row(1000, 600, 1, [0, 2]),
        _row(1149, 3000, 0, [3, 4, 5, 6, 7, 8]),
        _row(1150, 1, 500, [9]),
    ])
    cfg = TraceWorkload(path=path, length_scale=0.1, step_ms=50, output_len_cap=20)
    reqs = build_requests(cfg, vocab_size=1000, seed=0)
    # ceil(len * 0.1), at least 1
    assert [r.prompt_len for r in reqs] == [103, 60, 300, 1]
    assert [r.max_output_tokens for r in reqs] == [3, 1, 1, 20]  # ceil(50) capped at 20
    # floor((ts - 1000) / 50)
    assert [r.arrival_step for r in reqs] == [0, 0, 2, 3]


def test_trace_shared_hash_ids_share_prompt_prefix(tmp_path):
    path = _write(tmp_path, [
        _row(0, 2048, 4, [7, 8, 9, 10]),
        _row(0, 1536, 4, [7, 8, 11]),
        _row(0, 1024, 4, [12, 8]),
    ])
    reqs = build_requests(TraceWorkload(path=path, length_scale=0.05), vocab_size=1 << 20, seed=1)
    a, b, c = (r.prompt_token_ids for r in reqs)
    two_blocks = math.floor(2 * 512 * 0.05)  # scaled end of the second 512-token block
    np.testing.assert_array_equal(a[:two_blocks], b[:two_blocks])
    assert not np.array_equal(a[two_blocks:len(b)], b[two_blocks:])  # block 10 vs 11
    one_block = math.floor(512 * 0.05)
    assert not np.array_equal(a[:one_block], c[:one_block])  # different first block
    # the same seed gives the same tokens, another seed other tokens
    again = build_requests(TraceWorkload(path=path, length_scale=0.05), vocab_size=1 << 20, seed=1)
    np.testing.assert_array_equal(again[0].prompt_token_ids, a)
    other = build_requests(TraceWorkload(path=path, length_scale=0.05), vocab_size=1 << 20, seed=2)
    assert not np.array_equal(other[0].prompt_token_ids, a)


def test_trace_length_scale_keeps_length_order(tmp_path):
    lengths = [5000, 3, 70000, 512, 513, 1, 0, 12000]
    path = _write(tmp_path, [_row(0, n, n, []) for n in lengths])
    for scale in (0.001, 0.01, 0.3, 1.0):
        reqs = build_requests(TraceWorkload(path=path, length_scale=scale), vocab_size=9, seed=0)
        got = [r.prompt_len for r in reqs]
        assert min(got) >= 1
        for i in range(len(lengths)):
            for j in range(len(lengths)):
                if lengths[i] <= lengths[j]:
                    assert got[i] <= got[j]
        assert [r.max_output_tokens for r in reqs] == got  # outputs scaled the same way


def test_a_trace_left_null_is_16_requests_at_1_percent_executed_and_the_whole_trace_simulated(tmp_path):
    """A tiny model executes the first 16 requests at 1% of their lengths; a simulated run
    prices a model card on every request at its own lengths; what is given is both runs'."""
    lengths = [(7000, 450), (1234, 1)] + [(100 + i, 10) for i in range(18)]
    path = _write(tmp_path, [_row(10 * i, p, o, [i]) for i, (p, o) in enumerate(lengths)])
    scaled = lambda scale, n: ([math.ceil(p * scale) for p, _ in lengths[:n]],  # noqa: E731
                               [math.ceil(o * scale) for _, o in lengths[:n]])
    for kw, executed, simulated in (({}, scaled(0.01, 16), scaled(1, 20)),
                                    ({"length_scale": 0.5, "max_requests": 3}, scaled(0.5, 3), scaled(0.5, 3))):
        cfg = TraceWorkload(path=path, **kw)
        run = request_table(cfg, vocab_size=9, seed=0, with_tokens=False)
        sim = request_table(cfg, vocab_size=9, seed=0, with_tokens=False, simulated=True)
        assert (run.prompt_lens.tolist(), run.output_lens.tolist()) == executed
        assert (sim.prompt_lens.tolist(), sim.output_lens.tolist()) == simulated
    conf = yaml.safe_load((REPO / "conf" / "workload" / "trace.yaml").read_text())
    assert conf["length_scale"] is None and conf["max_requests"] is None


def test_trace_skip_max_requests_and_blank_lines(tmp_path):
    path = _write(tmp_path, [_row(100 * i, 512 * (i + 1), 10, [i]) for i in range(3)] + [""]
                  + [_row(100 * i, 512 * (i + 1), 10, [i]) for i in range(3, 6)])
    reqs = build_requests(TraceWorkload(path=path, skip=2, max_requests=3, step_ms=100,
                                        length_scale=0.01), vocab_size=9, seed=0)
    assert [r.prompt_len for r in reqs] == [16, 21, 26]  # ceil(512 * k * 0.01), k = 3, 4, 5
    assert [r.arrival_step for r in reqs] == [0, 1, 2]  # relative to the first request read
    assert [r.req_id for r in reqs] == [0, 1, 2]


@pytest.mark.parametrize(
    "bad, what",
    [
        ("{not json", "not valid JSON"),
        (json.dumps({"timestamp": 0, "input_length": 5, "hash_ids": []}), "output_length"),
        (json.dumps(_row(0, -5, 3, [])), "input_length must be an integer in [0, 2**53]"),
        (json.dumps(_row(0, 2**63, 3, [])), "input_length must be an integer in [0, 2**53]"),  # past int64
        (json.dumps(_row(0, 5, 10**30, [])), "output_length must be an integer in [0, 2**53]"),
        (json.dumps(_row(0, 5, 3, [2**64])), "hash_ids"),
        (json.dumps(_row(-1, 5, 3, [])), "timestamp"),
        (json.dumps(_row(0, 5, 3, [1, -2])), "hash_ids"),
        (json.dumps([1, 2]), "JSON object"),
    ],
)
def test_trace_malformed_line_names_file_and_line(tmp_path, bad, what):
    path = _write(tmp_path, [_row(0, 5, 3, [0]), "", bad, _row(0, 5, 3, [0])])
    with pytest.raises(ConfigError) as e:
        build_requests(TraceWorkload(path=path), vocab_size=9, seed=0)
    (p,) = e.value.problems
    assert p.field == "workload.path"
    assert f"{path}:3:" in p.allowed and what in p.allowed


def test_trace_missing_file_and_required_path(tmp_path):
    missing = str(tmp_path / "nope.jsonl")
    with pytest.raises(ConfigError) as e:
        build_requests(TraceWorkload(path=missing), vocab_size=9, seed=0)
    (p,) = e.value.problems
    assert p.field == "workload.path" and missing in p.allowed and "does not exist" in p.allowed
    loc, msg = _error(TraceWorkload)
    assert loc == ("path",) and "workload.path=" in msg


def test_trace_unreadable_file_and_empty_window(tmp_path):
    with pytest.raises(ConfigError, match="workload.path"):
        build_requests(TraceWorkload(path=str(tmp_path)), vocab_size=9, seed=0)  # a directory
    path = _write(tmp_path, [_row(0, 5, 3, [0])])
    with pytest.raises(ConfigError) as e:
        build_requests(TraceWorkload(path=path, skip=1), vocab_size=9, seed=0)
    (p,) = e.value.problems  # the skip is what is wrong, not the file
    assert (p.field, p.given) == ("workload.skip", 1) and p.allowed.endswith(f"{path} has 1")
    (tmp_path / "blank.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError) as e:
        build_requests(TraceWorkload(path=str(tmp_path / "blank.jsonl")), vocab_size=9, seed=0)
    (p,) = e.value.problems
    assert p.field == "workload.path" and p.allowed.endswith("has none")


def test_trace_relative_path_resolves_against_cwd(tmp_path, monkeypatch):
    _write(tmp_path, [_row(0, 5, 3, [0])])
    monkeypatch.chdir(tmp_path)
    cfg = TraceWorkload(path="trace.jsonl")
    assert cfg.path == str(tmp_path / "trace.jsonl")
    assert len(build_requests(cfg, vocab_size=9, seed=0)) == 1


def test_real_trace_head():
    head = [json.loads(line) for line in REAL_TRACE.open().readlines()[:16]]
    cfg = TraceWorkload(path=str(REAL_TRACE), max_requests=16)
    reqs = build_requests(cfg, vocab_size=32000, seed=0)
    assert len(reqs) == 16
    assert [r.prompt_len for r in reqs] == [math.ceil(h["input_length"] * 0.01) for h in head]
    assert [r.max_output_tokens for r in reqs] == [
        max(1, math.ceil(h["output_length"] * 0.01)) for h in head
    ]
    assert [r.arrival_step for r in reqs] == [h["timestamp"] // 50 for h in head]
    # every request starts with hash block 0: a shared system-prompt prefix
    assert all(h["hash_ids"][0] == 0 for h in head)
    first = math.floor(512 * 0.01)
    assert all(np.array_equal(r.prompt_token_ids[:first], reqs[0].prompt_token_ids[:first])
               for r in reqs)


@pytest.mark.parametrize("scale,block", [(0.05, 4), (0.0371, 3), (0.2, 32)])
def test_trace_block_keys_equal_exactly_where_the_tokens_are_equal(scale, block):
    """A simulated run keys prompt blocks from the trace's hash ids (``identity_contents``,
    many requests at once); an executed run from token ids. Block j of two requests has one
    chained key exactly when their first j + 1 blocks hold the same tokens, and keying the
    requests one at a time gives the same keys."""
    cfg = TraceWorkload(path=str(REAL_TRACE), max_requests=40, length_scale=scale)
    lengths, tokens = (request_table(cfg, vocab_size=1 << 20, seed=3, with_tokens=w) for w in (False, True))
    reqs = np.arange(len(lengths))
    contents, starts, prompt_keys = lengths.identity_contents(reqs, block)
    chained = prefix.chain(contents, lengths=np.diff(starts))
    ids = [chained[starts[i]:starts[i + 1]].tolist() for i in reqs]
    for i in reqs[::7]:
        alone, key = lengths.prompt_contents(int(i), block)
        assert np.array_equal(alone, contents[starts[i]:starts[i + 1]]) and key == prompt_keys[i]
    same_blocks = 0
    for a in reqs:
        pa = tokens.prompt(a)
        for b in reqs[a + 1:]:
            pb = tokens.prompt(b)
            for j in range(min(len(ids[a]), len(ids[b]))):
                equal = np.array_equal(pa[:(j + 1) * block], pb[:(j + 1) * block])
                assert (ids[a][j] == ids[b][j]) == equal, (a, b, j)
                same_blocks += equal
            equal = np.array_equal(pa, pb)
            assert (prompt_keys[a] == prompt_keys[b]) == equal
    assert same_blocks > 20  # NOTE: the trace's shared system prompt and conversations


def _private_cases(tmp_path):
    """The real trace's head at two scales, and a hand-made trace: a repeated prompt (its
    outputs are keyed alike: never private), one that stops inside a shared hash block, and
    one whose only hash block is its own."""
    yield TraceWorkload(path=str(REAL_TRACE), max_requests=60, length_scale=0.05), 4
    yield TraceWorkload(path=str(REAL_TRACE), max_requests=60, length_scale=0.2), 32
    path = _write(tmp_path, [
        _row(0, 2000, 4, [7, 8, 9, 10]),  # NOTE: 100 tokens, all inside the 4 hash blocks (102)
        _row(0, 2000, 4, [7, 8, 9, 10]),
        _row(0, 1100, 4, [7, 8, 9]),
        _row(0, 1536, 4, [7, 8, 11]),
        _row(0, 700, 4, [12]),
    ])
    yield TraceWorkload(path=path, length_scale=0.05), 3


def test_private_from_no_other_prompt_shares_a_private_block(tmp_path):
    """``private_from``: from that block on, no other request can hold a block with the same
    key. Checked on the token ids an executed run draws (the independent reference): no
    other prompt has the same first j + 1 blocks for a private prompt block j, and none is
    the same whole prompt where the outputs are private."""
    for cfg, block in _private_cases(tmp_path):
        lengths, tokens = (request_table(cfg, vocab_size=1 << 20, seed=5, with_tokens=w) for w in (False, True))
        private = lengths.private_from(block)
        assert np.array_equal(tokens.private_from(block), np.full(len(tokens), NEVER_PRIVATE))
        prompts = [tokens.prompt(i) for i in range(len(tokens))]
        privates = 0
        for a, pa in enumerate(prompts):
            full = len(pa) // block
            j = int(private[a])
            if j == NEVER_PRIVATE:
                continue
            assert 0 <= j <= full
            privates += 1
            for b, pb in enumerate(prompts):
                if b == a:
                    continue
                if j < full:  # block j of a's prompt: b's first j + 1 blocks differ
                    assert not np.array_equal(pa[:(j + 1) * block], pb[:(j + 1) * block]), (a, b, j)
                else:  # the outputs: b's prompt is another
                    assert not np.array_equal(pa, pb), (a, b)
        assert privates >= len(prompts) // 2
        # a block before private_from may be shared: not tight, but not empty either
        assert (private > 0).any()
    # the hand-made trace (the last case; hash blocks start at tokens 0, 25, 51, 76; blocks of
    # 3 tokens): the repeated prompt never; row 2's 55 tokens are rows 0 and 1's first 55, so
    # only its outputs (from block 55 // 3 = 18) are its own; row 3 from its own hash id 11 (at
    # token 51: block 17); row 4's lone hash id from block 0
    assert private.tolist() == [NEVER_PRIVATE, NEVER_PRIVATE, 18, 17, 0]


# -- shipped YAML ------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["synthetic", "explicit"])
def test_shipped_yaml_validates_and_builds(name):
    raw = yaml.safe_load((REPO / "conf" / "workload" / f"{name}.yaml").read_text())
    cfg = workload_adapter.validate_python(raw)
    assert cfg.kind == name
    assert build_requests(cfg, vocab_size=64, seed=0)


def test_shipped_trace_yaml_requires_path():
    raw = yaml.safe_load((REPO / "conf" / "workload" / "trace.yaml").read_text())
    with pytest.raises(ValidationError, match="workload.path="):
        workload_adapter.validate_python(raw)
    if REAL_TRACE.exists():
        cfg = workload_adapter.validate_python({**raw, "path": str(REAL_TRACE)})
        assert len(build_requests(cfg, vocab_size=64, seed=0)) == 16  # executed: the first 16
