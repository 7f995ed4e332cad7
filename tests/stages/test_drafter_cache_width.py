"""What a drafter says of its own cache before any rank starts (``DraftConfig.cache_entry_width``,
the host-memory check's count) is what it allocates."""

from __future__ import annotations

import pytest
from stage_ctx import context, stage


@pytest.mark.parametrize("draft, model, settings", [("self", "tiny_gqa", {}), ("mtp", "tiny_mla", {}),
                                                     ("dspark", "tiny_gqa", {"num_layers": 2})])
def test_a_drafter_counts_the_cache_it_allocates(draft, model, settings):
    ctx = context([f"model={model}", f"draft={draft}", "pcp=1"])
    drafter = stage(draft, "draft", ctx, **settings)
    allocated = sum(cache.shape[1] for _, caches in drafter.own_kv() for cache in caches)
    assert allocated > 0 and drafter.config.cache_entry_width(ctx.model) == allocated
