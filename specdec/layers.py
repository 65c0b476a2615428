"""RMSNorm, rotary embeddings and the SwiGLU MLP in plain PyTorch, shared by the targets' PyTorch
forward and the block drafters.

RoPE is rotate-half everywhere: ``x * cos + [-x2, x1] * sin``, computed as
``x * cos + roll(x) * signed_sin`` where the sine's first half is stored negated
(:func:`rope_factors`). Negating a factor instead of an operand gives the same bits
in every dtype, with fewer kernels.

Two RMSNorms, because one cannot serve both without changing numbers: in 16-bit,
``F.rms_norm`` (one kernel) multiplies by the weight before rounding, HF's formula
after. Targets keep HF's formula (:func:`rms_norm`), so they match ``transformers``
bit for bit; the drafters were trained, and are tested, with :func:`fast_rms_norm`.
The two agree in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension, as HF Llama computes it: fp32 statistics, the normed
    input rounded to ``x``'s dtype, then times ``weight``.

    Args:
        x: ``[..., dim]``.
        weight: ``[dim]``.
        eps: added to the mean square.

    Returns:
        ``[..., dim]``.
    """
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fast_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of the last dimension in one kernel (``F.rms_norm``) where ``x`` and ``weight``
    share a dtype (an inference step); :func:`rms_norm` otherwise (a weight kept in fp32 under
    autocast). Equal to :func:`rms_norm` in fp32; in 16-bit it may differ in the last bit.

    Args:
        x: ``[..., dim]``.
        weight: ``[dim]``.
        eps: added to the mean square.

    Returns:
        ``[..., dim]``.
    """
    if x.dtype == weight.dtype:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm(x, weight, eps)


def inv_freq(dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Plain RoPE inverse frequencies ``theta ** (-2i / dim)``, fp32. ``[dim // 2]``"""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))


def rope_factors(angles: torch.Tensor, dtype: torch.dtype = torch.float32,
                 scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half RoPE factors of rotation angles: cos and signed sin (the first half negated).

    Args:
        angles: ``[..., dim // 2]`` fp32, position times inverse frequency.
        dtype: of the factors (the math of :func:`rotate` runs in it for inputs of that dtype).
        scale: multiplies both, before rounding (YaRN's attention factor).

    Returns:
        ``cos``, ``sin``, each ``[..., dim]``.
    """
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return torch.cat([cos, cos], -1).to(dtype), torch.cat([-sin, sin], -1).to(dtype)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """A plain sine table ``[..., dim]`` (both halves positive, as the fused Triton kernels read
    it) in :func:`rotate`'s layout: the first half negated."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


def rope_cos_sin(pos: torch.Tensor, dim: int, theta: float,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 plain RoPE factors at integer positions: ``pos`` ``[...]`` → cos, signed sin ``[..., 1, dim]``.

    The one place the block drafters' factors are computed, so that per-call factors and a
    precomputed table (:class:`specdec.drafters.block.RopeTable`) are the same numbers.

    Args:
        pos: integer positions, any shape.
        dim: rotated width (even).
        theta: RoPE base.
        device: where to compute (default: ``pos``'s device).

    Returns:
        ``cos``, ``sin``, each ``[..., 1, dim]`` fp32.
    """
    dev = pos.device if device is None else device
    cos, sin = rope_factors(pos.to(torch.float32)[..., None] * inv_freq(dim, theta, dev))
    return cos.unsqueeze(-2), sin.unsqueeze(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[..., heads, D]`` with factors broadcasting to it (cos and signed
    sin ``[..., 1, D]``, :func:`rope_factors`): ``x * cos + roll(x) * sin``, in the factors' dtype
    if wider than ``x``'s (fp32 factors: fp32 math, one rounding), rounded to ``x``'s dtype."""
    return (x * cos + x.roll(x.shape[-1] // 2, -1) * sin).to(x.dtype)


def swiglu(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The SwiGLU MLP with gate and up in one GEMM: ``down(silu(gate(x)) * up(x))``.

    Args:
        x: ``[..., hidden]``.
        w_gate_up: ``[2 * inter, hidden]``, gate rows then up rows.
        w_down: ``[hidden, inter]``.

    Returns:
        ``[..., hidden]``.
    """
    gate, up = F.linear(x, w_gate_up).chunk(2, dim=-1)
    return F.linear(F.silu(gate) * up, w_down)
