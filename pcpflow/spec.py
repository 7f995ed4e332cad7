"""Public face of the drafting helpers (``pcpflow.speculative``): ``from pcpflow import spec``.
What they are and how a drafter uses them: ``pcpflow.speculative``'s docstring and
docs/writing-stages.md."""

from pcpflow.speculative.attention import (
    KVWriter,
    prefill_attention,
    replicated_attention,
    replicated_layout,
)
from pcpflow.speculative.comm import DraftComm, draft_comm, shard_drafter
from pcpflow.speculative.drafting import (
    DraftConfig,
    DraftStart,
    DraftWork,
    MLALayerConfig,
    allocate_caches,
    draft_draws,
    draft_start,
    greedy,
    layer_problems,
    mla_decoder_layer,
    next_token_ids,
    request_prompts,
    restore_hidden,
    scatter_proposals,
    to_local,
)

__all__ = [
    "DraftComm",
    "DraftConfig",
    "DraftStart",
    "DraftWork",
    "KVWriter",
    "MLALayerConfig",
    "allocate_caches",
    "draft_comm",
    "draft_draws",
    "draft_start",
    "greedy",
    "layer_problems",
    "mla_decoder_layer",
    "next_token_ids",
    "prefill_attention",
    "replicated_attention",
    "replicated_layout",
    "request_prompts",
    "restore_hidden",
    "scatter_proposals",
    "shard_drafter",
    "to_local",
]
