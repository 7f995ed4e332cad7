"""Kernels by shape: GEMMs, attention (prefill and decode kernels apart), memory-bound ops.

Each is a roofline of the kernel's own shape on one GPU, never less than the hardware's
per-kernel floor (``hardware.kernel_floor_us``):

- **GEMM** ``M x N x K``: the tiles a CUTLASS Hopper kernel computes (``TILE_M x TILE_N``,
  ``Shape<_128,_128,_64>`` in CUTLASS's Sm90 examples, e.g. 48_hopper_warp_specialized_gemm;
  a few rows take a tile as tall as a power of two that holds them, at least 8: wgmma's N
  extent, 8 to 256, carries them when the operands are swapped) run in waves over the SMs,
  a wave as long as one tile on one SM (tile and wave quantization), at
  ``peak[dtype] * simulate.gemm_efficiency``; or its bytes (activations in, weights, output
  out) at ``hbm_tbps * simulate.hbm_efficiency``, whichever is slower.
- **prefill attention** (FlashAttention-3): its FLOPs at FlashAttention-3's published share of
  the peak for the shapes of its calls (``pcpflow.simulate.flash``: arXiv 2407.08608, Figure 5,
  by key-loop length, causal or not, in whole 128-row query tiles), or its key tiles (read
  once per query tile) at the HBM share, whichever is slower. No wave quantization:
  FlashAttention-3 on Hopper is a persistent kernel whose tile scheduler hands the SMs query
  tiles of long key loops.
- **decode attention** (split-KV): its keys read once at the HBM share; as a roofline with
  its FLOPs (MLA's 128 heads over one latent can be compute-bound).
- **memory ops** (norms, RoPE, residual adds, activation, KV writes, DCP / ring merges):
  their bytes at the HBM share.
"""

from __future__ import annotations

import numpy as np

from pcpflow.config.hardware import HardwareConfig

TILE_M = 128
TILE_N = 128


def _ceil(a, b):
    return -(-np.asarray(a, dtype=np.float64) // b)


class Kernels:
    """The kernel prices of one hardware profile and one ``simulate`` setting."""

    def __init__(self, hw: HardwareConfig, *, gemm_efficiency: float, hbm_efficiency: float) -> None:
        self.hw = hw
        self.sms = hw.sm_count
        self.hbm = hw.hbm_tbps * 1e12 * hbm_efficiency
        self.gemm_efficiency = gemm_efficiency
        self.floor = hw.kernel_floor_us * 1e-6
        self._peaks: dict[str, float] = {}

    def peak(self, key: str) -> float:
        hit = self._peaks.get(key)
        if hit is None:
            value = self.hw.peak(key)
            assert value is not None, f"{self.hw.name} has no {key} peak (prepare refuses the run)"
            hit = self._peaks[key] = value * 1e12
        return hit

    def gemm(self, m, n: int, k: int, *, peak_key: str, w_bytes: float, a_bytes: float, count: int = 1):
        """Seconds of ``count`` GEMMs ``[m, k] x [k, n]`` (``m`` may be an array) and whether
        each is compute-bound: (seconds, compute_bound)."""
        m = np.asarray(m, dtype=np.float64)
        tile_m = np.clip(2.0 ** np.ceil(np.log2(np.maximum(m, 1.0))), 8, TILE_M)
        tiles = _ceil(m, tile_m) * _ceil(n, TILE_N)
        waves = np.maximum(_ceil(tiles, self.sms), 1.0)
        flops = waves * self.sms * tile_m * TILE_N * 2.0 * k
        t_c = np.where(m > 0, flops / (self.peak(peak_key) * self.gemm_efficiency), 0.0)
        bytes_ = m * k * a_bytes + n * k * w_bytes + m * n * a_bytes
        t_m = np.where(m > 0, bytes_ / self.hbm, 0.0)
        t = np.where(m > 0, np.maximum(np.maximum(t_c, t_m), self.floor), 0.0)
        return count * t, t_c >= t_m

    def gemm_scalar(self, m: int, n: int, k: int, *, peak_key: str, w_bytes: float, a_bytes: float) -> tuple[float, bool]:
        """``gemm`` of one scalar ``m`` (the hot path), in plain floats."""
        if m <= 0:
            return 0.0, False
        tile_m = min(max(8, 1 << max(m - 1, 0).bit_length()), TILE_M)
        tiles = -(-m // tile_m) * -(-n // TILE_N)
        waves = max(-(-tiles // self.sms), 1)
        t_c = waves * self.sms * tile_m * TILE_N * 2.0 * k / (self.peak(peak_key) * self.gemm_efficiency)
        t_m = (m * k * a_bytes + n * k * w_bytes + m * n * a_bytes) / self.hbm
        return max(t_c, t_m, self.floor), t_c >= t_m

    def prefill_attention(self, peak_flops, kv_bytes, *, peak_key: str):
        """Seconds of prefill attention whose FLOPs, each divided by the share of the peak its
        call reaches (``flash.Blocks.peak_pairs``), come to ``peak_flops``; ``kv_bytes``: its key
        tiles, each read once per query tile."""
        peak_flops = np.asarray(peak_flops, dtype=np.float64)
        t = np.maximum(peak_flops / self.peak(peak_key), np.asarray(kv_bytes, dtype=np.float64) / self.hbm)
        return np.where(peak_flops > 0, np.maximum(t, self.floor), 0.0)

    def decode_attention(self, flops, kv_bytes, *, peak_key: str):
        """Seconds of split-KV decode attention (keys read once, or its FLOPs if slower), and
        whether its FLOPs bound it."""
        t_flops, t_bytes = flops / self.peak(peak_key), np.asarray(kv_bytes, dtype=np.float64) / self.hbm
        t = np.maximum(t_bytes, t_flops)
        return np.where(t > 0, np.maximum(t, self.floor), 0.0), t_flops >= t_bytes

    def decode_attention_scalar(self, flops: float, kv_bytes: float, *, peak_key: str) -> tuple[float, bool]:
        """``decode_attention`` of one rank's figures (the hot path), in plain floats."""
        t_flops, t_bytes = flops / self.peak(peak_key), kv_bytes / self.hbm
        t = max(t_bytes, t_flops)
        return (max(t, self.floor) if t > 0 else 0.0), t_flops >= t_bytes

    def memory(self, nbytes):
        """Seconds of memory-bound ops moving ``nbytes`` (floors are counted by kernel)."""
        return np.asarray(nbytes, dtype=np.float64) / self.hbm
