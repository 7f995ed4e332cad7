"""Speculative decoding changes nothing but speed.

For every drafter (``self`` exact and with corrupted proposals, ``mtp``, ``dspark``, and a
user's plugin) at pcp 1..4, both decode modes, with and without DCP (a matrix that covers
each drafter in every mode across the pcp sizes; each world size starts its ranks once):

- the generated tokens equal those of the run without drafting (float64);
- pcpflow's verification passes (the single-rank target in lockstep: logits, tokens and
  every rank's KV cache, including the KV of rejected drafts);
- every rank proposes the same tokens, and any layout proposes exactly what one rank
  proposes (so the draft prefill, its restore and the replicated steps are exact too);
- the self drafter's proposals are all accepted; with error_rate they are partly
  accepted and the rest rolled back;
- the MTP and DSpark proposals (at one rank: tests/stages/) are what a dense, cache-free forward written from their
  weights proposes (tests/reference.py's building blocks; no pcpflow attention, cache,
  layout or scheduler).
"""

from __future__ import annotations

import itertools
import tempfile

import pytest
import shared_ranks
from drafting_reference import DRAFTERS, OUTPUT_LEN, PROBE, PROMPT_LENS, WORKLOAD  # noqa: E402
from pcpflow_test_plugins import draft_probe

from pcpflow.testing import compose


def modes(pcp: int) -> list[list[str]]:
    """(decode, dcp): replicated/1, sharded/P, replicated/P, sharded/1."""
    return [
        ["decode=replicated", "dcp=1"],
        ["decode=sharded", f"dcp={pcp}"],
        ["decode=replicated", f"dcp={pcp}"],
        ["decode=sharded", "dcp=1"],
    ]


# The mode of each run at each pcp: over pcp 2..4 every drafter runs with DCP under both
# decode modes (1, 2) and once without DCP (pcp=1 adds the plain case).
PLAN = {
    1: {"none": 0, "self": 0, "self_err": 0, "mtp": 0, "dspark": 0},
    2: {"none": 1, "self": 1, "self_err": 0, "mtp": 2, "dspark": 3, "toy": 0},
    3: {"none": 3, "self": 0, "self_err": 2, "mtp": 3, "dspark": 1},
    4: {"none": 2, "self": 2, "self_err": 1, "mtp": 1, "dspark": 2},
}


_CASES: list[tuple[int, str, str]] = []


@shared_ranks.matrix("spec_engine")
def _drafting_matrix():
    _CASES.clear()
    cfgs = []
    for pcp, plan in PLAN.items():
        for name, mode in plan.items():
            probe = tempfile.mkdtemp(prefix=f"pcpflow-p{pcp}_{name}-")
            extra = [f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{probe}'}}]"]
            overrides = (
                WORKLOAD + [f"pcp={pcp}"] + modes(pcp)[mode] + DRAFTERS.get(name, []) + extra
            )
            if (pcp, name) == (2, "mtp"):
                overrides.append("pipeline.restore.kind=sampled_rows")  # drafters need no all_rows
            _CASES.append((pcp, name, probe))
            cfgs.append(compose(overrides))
    return cfgs


@pytest.fixture(scope="module")
def matrix(shared_runs):
    runs = shared_runs["spec_engine"]
    return {
        (pcp, name): (cfg, res, draft_probe.read(probe))
        for (pcp, name, probe), (cfg, res) in zip(_CASES, runs)
    }


def label(cfg) -> str:
    return f"pcp={cfg.pcp} dcp={cfg.dcp} decode={cfg.decode.mode} draft={cfg.draft_stage_config()['kind']}"


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("spec_engine")
def test_drafting_generates_exactly_the_tokens_of_no_drafting(matrix):
    baseline = matrix[(1, "none")][1]["outputs"]
    assert all(len(o) == OUTPUT_LEN for o in baseline)
    for (pcp, name), (cfg, res, _) in matrix.items():
        v = res["verify"]
        assert v["passed"] and v["tokens_match"] and v["kv_match"], f"{label(cfg)}: {v}"
        assert v["max_abs_logit_diff"] <= 1e-9 and v["max_abs_kv_diff"] <= 1e-9, label(cfg)
        assert res["outputs"] == baseline, label(cfg)
        if name == "self":  # accepted drafts: fewer steps for the same tokens
            assert res["metrics"]["num_steps"] < matrix[(1, "none")][1]["metrics"]["num_steps"], (
                label(cfg)
            )


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("spec_engine")
def test_every_rank_proposes_what_one_rank_proposes(matrix):
    for (pcp, name), (cfg, _, ranks) in matrix.items():
        if name == "none":
            assert all(line[2] is None for lines in ranks.values() for line in lines)
            continue
        assert sorted(ranks) == list(range(pcp)), label(cfg)
        for r in range(1, pcp):
            assert ranks[r] == ranks[0], f"{label(cfg)}: rank {r} proposed differently from rank 0"
        if (1, name) in matrix:
            assert ranks[0] == matrix[(1, name)][2][0], f"{label(cfg)}: proposals differ from pcp=1"
        assert any(d >= 0 for line in ranks[0] for row in line[2] for d in row), label(cfg)


@pytest.mark.dist
@pytest.mark.slow
@pytest.mark.matrix("spec_engine")
def test_acceptance_full_partial_and_rollback(matrix):
    for (pcp, name), (cfg, res, ranks) in matrix.items():
        if name == "none":
            assert "acceptance_rate" not in res["metrics"]
            continue
        m = res["metrics"]
        assert m["acceptance_rate"] == m["draft_accepted"] / m["draft_proposed"], label(cfg)
        assert m["mean_accepted_per_step"] == m["draft_accepted"] / m["draft_verify_rows"], label(
            cfg
        )
        assert m["mean_acceptance_length"] == 1 + m["mean_accepted_per_step"]
        assert 0 < m["draft_time_fraction"] < 1
        if name == "self":
            # Proposals are the target's own argmax: in float64 every one is accepted.
            assert m["acceptance_rate"] == 1.0, label(cfg)
            k = cfg.num_speculative_tokens
            assert m["mean_accepted_per_step"] > 0.5 * k, label(cfg)
        # Every drafter: what was scheduled and accepted, recomputed from the proposals
        # and the tokens the run without drafting generates.
        baseline = matrix[(1, "none")][1]["outputs"]
        assert (m["draft_proposed"], m["draft_accepted"]) == expected_acceptance(ranks[0], baseline), label(cfg)
        if name == "self_err":
            assert 0 < m["draft_accepted"] < m["draft_proposed"], label(cfg)  # partly rejected
        if pcp > 1 and name in ("mtp", "dspark", "self"):
            # Draft traffic is accounted on its own, never as the target's.
            assert any(p.startswith("draft_") for p in m["collective_bytes"]), label(cfg)
    # The same proposals and verification under every layout: the same numbers.
    for name in ("self", "self_err", "mtp", "dspark"):
        rates = {
            (p, n): r[1]["metrics"]["draft_accepted"] for (p, n), r in matrix.items() if n == name
        }
        assert len(set(rates.values())) == 1, rates


def expected_acceptance(lines: list, outputs: list[list[int]]) -> tuple[int, int]:
    """(drafts scheduled, drafts accepted) from a run's recorded proposals.

    The next step schedules a row's leading proposals up to the outputs it has left after
    its newest token (decodes come first and fit the token budget here: 4 seats x (1 + 3)
    <= 20), and accepts the longest prefix that equals what the target generates, which is
    what the run without drafting generated."""
    scheduled = accepted = 0
    for _, req_ids, drafts, next_positions in lines:
        for req, row, pos in zip(req_ids, drafts or [], next_positions):
            if pos < 0:
                continue
            newest = pos - PROMPT_LENS[req]  # output index of the newest token
            room = max(0, OUTPUT_LEN - newest - 2)
            props = list(itertools.takewhile(lambda d: d >= 0, row))[:room]
            truth = outputs[req][newest + 1 : newest + 1 + len(props)]
            scheduled += len(props)
            accepted += sum(itertools.accumulate((int(d == t) for d, t in zip(props, truth)), min))
    return scheduled, accepted


# -- dense references of the drafters, from their weights ----------------------------------
