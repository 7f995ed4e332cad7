"""An MTP head after a preempted request is prefilled again in chunks.

A readmitted request prefills its prompt and the outputs it had (``prompt_lens`` counts
both), so a chunk of that prefill can end inside its outputs: the token after the chunk,
which the MTP head embeds, is then an output, not a prompt token. Found by a random sweep
(an IndexError reading it from the prompt); the scheduler now lists it with the batch
(``GlobalBatch.chunk_next_ids``). The run must pass its own verification (float64, exact)
and generate what the same run without drafting generates.
"""

from __future__ import annotations

import pytest
import shared_ranks

from pcpflow.testing import compose

# 4-token blocks, 7 of them, 8 tokens a step: the three requests preempt each other and are
# prefilled again in chunks that end inside their outputs (seed 3 gives such a schedule)
RUN = ["model=tiny_mla", "dtype=float64", "workload=explicit",
       "workload.prompts=[[9,208,27,9,3,27,43,27,27,9],[9,27,9,9,3,27,3,27,9,27],[110,3,199,3,3,3]]",
       "workload.output_lens=[10]", "sampling.temperature=1.0", "sampling.seed=3", "pcp=2", "dcp=2",
       "decode=sharded", "kv.block_size=4", "kv.num_blocks=7", "scheduler.max_num_batched_tokens=8",
       "verify=true", "output.plots=false", "output.progress=false"]

shared_ranks.matrix("spec_preempted")(
    lambda: [compose([*RUN, "draft=mtp", "draft.num_speculative_tokens=2"]), compose(RUN)]
)


@pytest.mark.dist
@pytest.mark.matrix("spec_preempted")
def test_mtp_after_a_preempted_request_is_prefilled_again(shared_runs):
    (_, drafted), (_, plain) = shared_runs["spec_preempted"]
    assert drafted["metrics"]["preemptions"] > 0
    assert drafted["verify"]["passed"], drafted["verify"]
    assert drafted["outputs"] == plain["outputs"]
    assert drafted["metrics"]["draft_proposed"] > 0
