"""MXFP4 (the OCP microscaling 4-bit float), as gpt-oss checkpoints store their experts:
``<name>_blocks`` ``[E, rows, G, 16]`` uint8, two FP4 (e2m1) values a byte, low nibble
first, and ``<name>_scales`` ``[E, rows, G]`` uint8, one power-of-two exponent (e8m0, bias
127) for each group of 32 values. The dense tensor is transformers' (``convert_moe_packed_tensors``):
``[E, G * 32, rows]``, the packed rows last (gpt-oss's ``x @ W`` layout)."""

from __future__ import annotations

import torch

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of an e2m1 nibble (sign bit, two exponent bits, one mantissa bit)."""

BLOCKS, SCALES = "_blocks", "_scales"
"""Suffixes of the two tensors a checkpoint stores for one MXFP4 tensor."""


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The dense ``dtype`` tensor of MXFP4 ``blocks [E, rows, G, B]`` and ``scales [E, rows, G]``:
    ``[E, G * 2B, rows]``, each value its nibble's e2m1 value times ``2^(scale - 127)``, bit for
    bit what transformers' ``convert_moe_packed_tensors`` gives (the same table in ``dtype``, the
    same ``ldexp``), without its chunking."""
    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {list(blocks.shape)} and scales {list(scales.shape)}: want blocks "
                         "[E, rows, G, B] and scales [E, rows, G]")
    lut = torch.tensor(FP4_E2M1, dtype=dtype, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    # NOTE: the low nibble is the earlier value of each pair
    values = torch.stack([lut[(blocks & 0x0F).int()], lut[(blocks >> 4).int()]], dim=-1).flatten(-2)
    # NOTE: ldexp multiplies by 2^e in float32 (transformers' too, into its dtype's buffer): round once to dtype
    values = torch.ldexp(values, (scales.to(torch.int32) - 127)[..., None]).to(dtype)
    return values.flatten(-2).transpose(1, 2).contiguous()


def dense_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape ``dequantize_mxfp4`` gives for blocks of ``blocks_shape`` ``[E, rows, G, B]``."""
    e, rows, g, b = blocks_shape
    return (e, g * 2 * b, rows)
