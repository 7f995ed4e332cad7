"""KV cache groups: how a model with windowed layers shares one block pool (vLLM's hybrid KV
cache manager, docs/design/hybrid_kv_cache_manager.md).

A windowed layer (sliding, or Llama 4's chunked) never reads a key before its window again,
so the blocks holding only such keys can go back to the pool while the request runs. The
layers are cut into *groups* of one kind (full or windowed) and one size: the smallest layer
count among the kinds (vLLM's rule; the last group of a kind may be short, its missing layers
padding). A block holds one group's KV for ``size`` layers: the KV cache is ``size`` tensors,
tensor ``s`` shared by the ``s``-th layer of every group, each group with its own block table
over the one pool. A request's table entry ``e`` (positions ``e*U .. e*U + U - 1``, ``U`` the
virtual block of ``block_size * dcp`` positions) has a block in every full group; in a window
group only from the entry of the first key a future query reads (``first_kept``), the entries
before it pointing at the *null block* (``num_blocks``: one spare block past the pool that
nobody writes, read only where a kernel masks it out).

A model without windowed layers, or a run that keeps every block (``kv.hybrid=off``), has one
group of all layers: the manager and every path behave as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from pcpflow.layouts.slots import Window


@dataclass(frozen=True)
class KVGroups:
    """The groups of a model's layers (module docstring), full groups first."""

    layers: tuple[tuple[int, ...], ...]  # group -> its layers, ascending
    windowed: tuple[bool, ...]  # group -> whether its layers attend through ``window``
    window: Window | None  # the windowed groups' window; None: no group is windowed

    @classmethod
    def of(cls, num_layers: int, window_layers=(), window: Window | None = None) -> KVGroups:
        """Groups of ``num_layers`` layers of which ``window_layers`` attend through ``window``
        (no window, or no windowed layer: one group of all layers)."""
        slides = set(window_layers) if window is not None else set()
        full = [i for i in range(num_layers) if i not in slides]
        win = [i for i in range(num_layers) if i in slides]
        if not win:
            return cls((tuple(range(num_layers)),), (False,), None)
        size = min(len(full), len(win)) if full else len(win)
        cut = [tuple(kind[k:k + size]) for kind in (full, win) for k in range(0, len(kind), size)]
        return cls(tuple(cut), tuple(g[0] in slides for g in cut), window)

    @classmethod
    def of_counts(cls, num_layers: int, num_windowed: int, window: Window | None) -> KVGroups:
        """Groups of a model known by counts (a model card): its last ``num_windowed`` layers
        windowed. Which layers slide changes no count: what a simulated run needs."""
        return cls.of(num_layers, range(num_layers - num_windowed, num_layers), window)

    @property
    def num_groups(self) -> int:
        return len(self.layers)

    @property
    def size(self) -> int:
        """Layers a block holds (the KV cache's tensors)."""
        return max(len(g) for g in self.layers)

    @property
    def num_full(self) -> int:
        return self.windowed.count(False)

    @property
    def num_windowed(self) -> int:
        return self.windowed.count(True)

    @property
    def num_windowed_layers(self) -> int:
        """Layers of the windowed groups."""
        return sum(len(g) for g, w in zip(self.layers, self.windowed) if w)

    @property
    def hybrid(self) -> bool:
        """Whether any group frees the blocks its window has left."""
        return self.window is not None

    @cached_property
    def layer_group(self) -> np.ndarray:
        """int64 [num_layers]: each layer's group."""
        out = np.zeros(sum(len(g) for g in self.layers), dtype=np.int64)
        for g, layers in enumerate(self.layers):
            out[list(layers)] = g
        return out

    @cached_property
    def layer_slot(self) -> np.ndarray:
        """int64 [num_layers]: each layer's place in its group: the cache tensor it uses."""
        out = np.zeros(sum(len(g) for g in self.layers), dtype=np.int64)
        for layers in self.layers:
            out[list(layers)] = np.arange(len(layers))
        return out

    def first_kept(self, num_computed, tokens_per_block: int, align: int | None = None) -> np.ndarray:
        """int64: the first table entry a window group still needs for a request with
        ``num_computed`` tokens in the cache: the entry of the first key its next query
        (at position ``num_computed``) reads; later queries start no earlier. ``align``: keep
        from that key rounded down to a multiple of ``align`` positions (a prefill pool keeps
        the decode pool's whole entries, ``disagg=pd``: its entries hold ``align`` positions)."""
        c = np.asarray(num_computed, dtype=np.int64)
        if self.window is None:
            return np.zeros_like(c)
        first = self.window.starts(c)
        if align is not None and align != tokens_per_block:
            first = first // align * align
        return first // tokens_per_block

    def first_moved(self, num_tokens, tokens_per_block: int) -> np.ndarray:
        """int64: the first position of a window group's entries that a handover moves to a
        pool of ``tokens_per_block`` positions an entry (``disagg=pd``): the start of the
        first entry that pool keeps for a request of ``num_tokens`` computed tokens; 0
        without a window."""
        return self.first_kept(num_tokens, tokens_per_block) * tokens_per_block

    def peak_window_entries(self, num_tokens, tokens_per_block: int, max_num_batched_tokens: int,
                            lookahead: int = 0, align: int | None = None) -> np.ndarray:
        """int64: most entries a window group holds at once for a request of ``num_tokens``
        positions: the entries from its first kept one to its last written one in a step of
        at most ``max_num_batched_tokens`` tokens plus ``lookahead`` (a window of ``W`` keys:
        ``W - 1`` before the step's first query, ``ceil`` of the span, and one entry that the
        span may straddle; ``align`` not dividing an entry (``first_kept``): ``align - 1``
        more positions), never more than the request's own."""
        n = -(-np.asarray(num_tokens, dtype=np.int64) // tokens_per_block)
        if self.window is None:
            return n
        span = self.window.size - 1 + max_num_batched_tokens + lookahead
        if align is not None and tokens_per_block % align:
            span += align - 1
        return np.minimum(n, -(-span // tokens_per_block) + 1)

    def describe(self) -> dict:
        """What result.json says of the groups."""
        return {
            "groups": self.num_groups,
            "full": self.num_full,
            "windowed": self.num_windowed,
            "layers_per_block": self.size,
            "window": None if self.window is None else {"size": self.window.size, "kind": self.window.kind},
        }


def run_kv_groups(cfg, num_layers: int, window_layers=(), window: Window | None = None) -> KVGroups | None:
    """The groups a run's KV cache uses (``kv.hybrid``), None where it keeps every block of
    every layer: ``off``, no windowed layer, or a drafter beside windowed layers only (its
    caches go by a full group's table, which holds every entry)."""
    return kv_groups_for(cfg.kv.hybrid, num_layers, window_layers, window, drafting=cfg.draft_enabled)


def kv_groups_for(hybrid: str, num_layers: int, window_layers=(), window: Window | None = None, *,
                  drafting: bool = False) -> KVGroups | None:
    """``run_kv_groups`` from the setting itself (a config not yet validated)."""
    if hybrid == "off":
        return None
    groups = KVGroups.of(num_layers, window_layers, window)
    if not groups.hybrid or (drafting and not groups.num_full):
        return None
    return groups
