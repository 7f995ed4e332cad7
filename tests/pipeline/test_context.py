"""pcpflow.pipeline.context: the KV cache allocation. Classic: a NaN tensor per layer; hybrid
(KV groups): a tensor per place in a group, shared by that place of every group, with the null
block inside the view and the spare pad row outside it."""

from __future__ import annotations

import functools

import torch

from pcpflow.layouts.slots import Window
from pcpflow.models import build_model
from pcpflow.pipeline.context import allocate_kv_caches, with_pad_slot
from pcpflow.scheduling.kv_groups import KVGroups
from pcpflow.testing import compose

NUM_BLOCKS, BLOCK = 6, 4


@functools.cache
def _model(num_layers: int):
    cfg = compose(["model=tiny_gqa", f"model.num_layers={num_layers}"])
    return build_model(cfg.model, dtype=torch.float32, seed=0)


def test_classic_caches_are_one_tensor_per_layer_with_a_pad_row():
    model = _model(3)
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"))
    assert len(caches) == 3 and len({c.untyped_storage().data_ptr() for c in caches}) == 3
    for c in caches:
        assert c.shape == (NUM_BLOCKS * BLOCK, model.attn_spec.entry_dim) and torch.isnan(c).all()
        assert with_pad_slot(c).shape[0] == NUM_BLOCKS * BLOCK + 1


def test_hybrid_caches_alias_each_place_of_every_group_and_hold_the_null_block():
    # full layers 1, 3, 4; windowed 0, 2: groups of 2 layers: (1, 3), (4,), (0, 2)
    model = _model(5)
    groups = KVGroups.of(5, (0, 2), Window(8, "sliding"))
    assert groups.layers == ((1, 3), (4,), (0, 2)) and groups.size == 2
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"), groups=groups)
    assert len(caches) == 5
    # layer l's tensor is place layer_slot[l]'s: the same object for the same place
    assert caches[1] is caches[4] is caches[0] and caches[3] is caches[2] and caches[1] is not caches[3]
    assert caches[1].untyped_storage().data_ptr() != caches[3].untyped_storage().data_ptr()
    for c in (caches[1], caches[3]):
        # the pool's blocks and the null block (id NUM_BLOCKS), NaN: read only where masked
        assert c.shape == ((NUM_BLOCKS + 1) * BLOCK, model.attn_spec.entry_dim) and torch.isnan(c).all()
        padded = with_pad_slot(c)
        assert padded.shape[0] == (NUM_BLOCKS + 1) * BLOCK + 1 and torch.isnan(padded[-1]).all()
    # a write through one layer is seen through every layer of its place
    caches[4][3] = 1.0
    assert (caches[0][3] == 1.0).all() and torch.isnan(caches[3][3]).all()


def test_groups_without_a_window_allocate_the_classic_cache():
    model = _model(2)
    caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK, torch.float32, torch.device("cpu"), groups=KVGroups.of(2))
    assert len(caches) == 2 and caches[0] is not caches[1] and caches[0].shape[0] == NUM_BLOCKS * BLOCK
