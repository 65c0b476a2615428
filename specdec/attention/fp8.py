"""FP8 (E4M3) inputs for attention over an FP8 KV cache (docs/design.md §4).

With an FP8 cache, attention computes on E4M3 values. A caller that already
holds E4M3 K and V (and optionally an E4M3 Q with its scale) hands them in and
the conversion is skipped; otherwise they are quantized here, with the same
function, so both paths give the same bits. BF16/FP32 inputs over a BF16/FP32
cache keep their path untouched.
"""

from __future__ import annotations

import torch

from specdec.errors import ConfigError

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0


class FP8InputError(ConfigError):
    """FP8 attention inputs that cannot be used together (names the tensors and dtypes)."""


def quantize_e4m3(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``x / scale`` rounded to E4M3 (saturating at ±448)."""
    if not scale > 0:
        raise FP8InputError(f"FP8 scale must be > 0, got {scale!r}")
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def prepare_kv(k: torch.Tensor, v: torch.Tensor | None, cache_dtype: torch.dtype, kv_scale: float):
    """K/V as the cache stores them: caller-quantized E4M3 passes through, the rest is converted.

    Args:
        k: ``[T, Hkv, D]`` in E4M3 (already divided by ``kv_scale``) or a float dtype.
        v: like ``k``, or ``None`` for a K-only layer.
        cache_dtype: the cache's dtype.
        kv_scale: the cache's per-tensor scale.

    Raises:
        FP8InputError: K and V of different dtypes with one of them E4M3, or E4M3
            inputs for a cache that is not E4M3.
    """
    if v is not None and (k.dtype == E4M3) != (v.dtype == E4M3):
        raise FP8InputError(f"K and V must both be E4M3 or both unquantized, got k={k.dtype}, v={v.dtype}")
    if cache_dtype != E4M3:
        if k.dtype == E4M3:
            raise FP8InputError(f"E4M3 K/V need an E4M3 KV cache, the cache is {cache_dtype}")
        return k.to(cache_dtype), None if v is None else v.to(cache_dtype)

    def conv(x):
        return x if x.dtype == E4M3 else quantize_e4m3(x, kv_scale)

    return conv(k), None if v is None else conv(v)


def prepare_q(q: torch.Tensor, q_scale: float | None, compute_dtype: torch.dtype) -> torch.Tensor:
    """Queries for an FP8 context attention, dequantized to ``compute_dtype``.

    An E4M3 ``q`` needs its ``q_scale``; a float ``q`` with a ``q_scale`` is quantized
    with it (the internal path); a float ``q`` without one is used as is.

    Raises:
        FP8InputError: an E4M3 ``q`` without ``q_scale``.
    """
    if q.dtype == E4M3:
        if q_scale is None:
            raise FP8InputError("an E4M3 q needs q_scale")
        return (q.to(torch.float32) * q_scale).to(compute_dtype)
    if q_scale is not None:
        return (quantize_e4m3(q, q_scale).to(torch.float32) * q_scale).to(compute_dtype)
    return q.to(compute_dtype)
