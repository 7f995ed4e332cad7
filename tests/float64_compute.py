"""transformers' float64 forward at float64: its RMSNorm, RoPE and eager softmax upcast to
float32 (a downcast for a float64 model); ``float64_compute`` runs its unmodified code with
every float32 it asks for given as float64 (tests/models/test_hf_parity.py checks that this
changes precision only)."""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode


class PromoteFloat32(TorchFunctionMode):
    """Run torch code with every float32 it asks for (``.float()``, ``.to(torch.float32)``,
    ``dtype=torch.float32``) given as float64 instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.float:
            return args[0].double()
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        return func(*args, **kwargs)


@contextlib.contextmanager
def float64_compute():
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with PromoteFloat32():
            yield
    finally:
        torch.set_default_dtype(default)


def promote_parameters(model: torch.nn.Module) -> None:
    """A float64 model's float32 parameters — asked for at construction, which ``from_pretrained``
    runs unpromoted (Hunyuan's router, a float32 Linear in a model of any dtype) — as float64,
    exactly: what ``PromoteFloat32`` would have built."""
    for p in model.parameters():
        if p.dtype == torch.float32:
            p.data = p.data.double()
