"""An MTP head after prefix hits drafts what it drafts without prefix caching.

The head's KV entry at position p reads the target's hidden at p and the token at p + 1
(stages/mtp.py). A block found in the prefix cache was written by the request that filled
it: its last entry read that request's next token, which need not be this request's. So the
scheduler reuses a found block only where it was written followed by the block this
request has next, and never the last block found (vLLM drops it for EAGLE/MTP); those are
computed again (``Scheduler(draft_kv_reads_next_token=True)``).

Two stems of two 4-token blocks, S and T:

- r0 = S + [5 6 7] (step 0), r3 = S + [9 6 7 6 5] (step 2): r3 finds S's two blocks; the
  second was written followed by r0's 5, not r3's 9, so r3 reuses the first only (4 tokens)
  and writes its own copy of the second, then caches its third block, [9 6 7 6], after it.
- r5 = r3's prompt + [4 3] (step 3, the next turn) finds r0's two S blocks, then r3's third:
  r0's second one read r0's 5, so r5 reuses S's first block only: 4 tokens.
- r1 = T + [5 6 7] and r2 = T + [9 8 7 6 5], both at step 0, write T's blocks in the same
  step (r1's copy is cached, admitted first); r2 fills a third block, [9 8 7 6]. r4 = r2's
  prompt + [4 3] (step 2) finds r1's two T blocks, then r2's third: 4 tokens, as r5.

vLLM's rule (drop the last block found) alone lets r4 and r5 reuse 8 tokens, r1's and r0's
second blocks included; without any rule r3 reuses 8 and r4, r5 12. Either way their
proposals differ from the run without prefix caching. The reference is that run (and, at
one rank, a dense, cache-free forward of the head's weights: tests/drafting_reference.py);
pcp=2 dcp=2 with sharded decodes proposes the same.

The verification checks the drafter's own cache too (``pcpflow.rank.verify``): the reference
recomputes what a hit reused, the head's entries included, so every rank's MTP cache must
hold at each position it owns what recomputation writes. Without the rule (a hit keeps every
block found) it fails exactly where the rule says: at the last position of S's and T's second
block (7), whose entry read 5 where r3, r4 and r5 have 9.
"""

from __future__ import annotations

import json
import tempfile

import pytest
import shared_ranks
from drafting_reference import PROBE, assert_proposals_match_the_dense_forward
from pcpflow_test_plugins import draft_probe

from pcpflow.testing import compose

S = [11, 22, 33, 44, 55, 66, 77, 88]
T = [101, 3, 202, 7, 150, 9, 60, 31]
PROMPTS = [S + [5, 6, 7], T + [5, 6, 7], T + [9, 8, 7, 6, 5], S + [9, 6, 7, 6, 5], T + [9, 8, 7, 6, 5, 4, 3],
           S + [9, 6, 7, 6, 5, 4, 3]]
OUTPUT = 6  # tokens each request generates
RUN = ["workload=explicit", f"workload.prompts={json.dumps(PROMPTS)}", f"workload.output_lens=[{OUTPUT}]",
       "workload.arrival_steps=[0,0,0,2,2,3]", "dtype=float64", "draft=mtp",
       "output.plots=false", "output.progress=false"]
# by hand (module docstring): what each request takes from the prefix cache
HITS = [0, 0, 0, 4, 4, 4]
# a block-table entry (the hash unit) is kv.block_size x dcp = 4 tokens in every case
CASES = {
    "pcp1": ["pcp=1", "kv.block_size=4", "kv.prefix_caching=true"],
    "pcp2_dcp2_sharded": ["pcp=2", "dcp=2", "decode=sharded", "kv.block_size=2", "kv.prefix_caching=true"],
    "reference": ["pcp=1", "kv.block_size=4", "kv.prefix_caching=false"],
}
_PROBES: dict[str, str] = {}


@shared_ranks.matrix("spec_prefix_cache")
def _runs():
    cfgs = []
    for name, overrides in CASES.items():
        _PROBES[name] = tempfile.mkdtemp(prefix=f"pcpflow-mtp-prefix-{name}-")
        probe = f"+pipeline.extra=[{{kind: '{PROBE}', after: draft, path: '{_PROBES[name]}'}}]"
        cfgs.append(compose([*RUN, *overrides, probe]))
    return cfgs


def proposals(name: str) -> dict[tuple[int, int], list[int]]:
    return draft_probe.proposals(_PROBES[name])


@pytest.mark.dist
@pytest.mark.matrix("spec_prefix_cache")
def test_mtp_drafts_after_prefix_hits_what_it_drafts_without(shared_runs):
    runs = dict(zip(CASES, shared_runs["spec_prefix_cache"]))
    _, ref = runs.pop("reference")
    want = proposals("reference")
    assert len(want) >= 30 and [r["prefix_hit_tokens"] for r in ref["requests"]] == [0] * 6
    for name, (cfg, res) in runs.items():
        assert res["verify"]["passed"], (name, res["verify"])
        assert res["outputs"] == ref["outputs"], name
        got = proposals(name)
        assert got == want, (name, sorted(k for k in want if got.get(k) != want[k]))
        for key in ("draft_proposed", "draft_accepted", "draft_verify_rows"):
            assert res["metrics"][key] == ref["metrics"][key], (name, key)
        assert [r["prefix_hit_tokens"] for r in res["requests"]] == HITS, name
        assert res["metrics"]["prefix_cache"]["hit_tokens"] == sum(HITS), name
    cfg, res = runs["pcp1"]
    assert_proposals_match_the_dense_forward("mtp", cfg, res, draft_probe.read(_PROBES["pcp1"]), min_checked=30)


@pytest.mark.dist
@pytest.mark.matrix("spec_prefix_cache")
def test_verification_checks_every_ranks_drafter_cache_after_prefix_hits(shared_runs):
    """The drafter's cache is compared, not only the target's: one entry per position a
    request committed (its prompt and outputs, less the newest token, which is never
    computed), on the one rank that owns it (DCP shards it two ways at pcp=2), the positions
    a hit reused among them (recomputed by the reference)."""
    runs = dict(zip(CASES, shared_runs["spec_prefix_cache"]))
    committed = sum(len(p) + OUTPUT - 1 for p in PROMPTS)
    for name in ("pcp1", "pcp2_dcp2_sharded"):
        v = runs[name][1]["verify"]
        assert v["passed"] and v["draft_kv_match"] and v["draft_kv_mismatched_slots"] == 0, (name, v)
        assert v["draft_kv_entries_checked"] == committed, (name, v["draft_kv_entries_checked"], committed)
        assert v["positions_recomputed"] == sum(HITS), (name, v["positions_recomputed"])
        assert v["kv_mismatches"] == [] and v["failures"] == [], name


def test_a_hit_that_reuses_every_block_found_fails_at_the_drafters_entries(monkeypatch):
    """The recent bug, put back (``Scheduler._drafter_hit`` keeps every block found: r3
    reuses 8 tokens, r4 and r5 12): the target's cache and the tokens still match, the
    drafter's cache does not, and only at position 7, the last entry of S's and T's second
    block, which read r0's and r1's 5 where r3, r4 and r5 have 9 (their third blocks' last
    entries, at 11, read 5 as theirs do). At pcp=1 (in process, so the patch holds)."""
    from pcpflow.output.rundir import result_of
    from pcpflow.scheduling.scheduler import Scheduler
    from pcpflow.testing import run

    monkeypatch.setattr(Scheduler, "_drafter_hit", lambda self, keys, found: found)
    (res,) = run([compose([*RUN, *CASES["pcp1"]])])
    assert [r["prefix_hit_tokens"] for r in res["requests"]] == [0, 0, 0, 8, 12, 12]
    v = res["verify"]
    assert v["tokens_match"] and v["kv_match"] and not v["draft_kv_match"] and not v["passed"], v
    named = v["kv_mismatches"]
    assert {m["position"] for m in named} == {7} and {m["req_id"] for m in named} <= {3, 4, 5}, named
    assert {m["cache"] for m in named} == {"drafter KV cache (draft=mtp)"} and named[0]["req_id"] == 3, named
    assert "drafter KV cache (draft=mtp)" in v["failures"][0] and "position 7 " in v["failures"][0], v["failures"]
    assert result_of(res, {})["exit_code"] == 1
