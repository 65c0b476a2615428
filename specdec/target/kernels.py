"""Fused elementwise Triton kernels for a target's GPU forward.

A decode or verify step of a small model is launch-bound: in eager PyTorch an
RMSNorm is six kernels and a rotate-half RoPE ten. These fuse each into one
kernel so that a CUDA-graph step of SmolLM2 (30 layers) is about eleven
kernels per layer. Numerics follow the HF modules they replace, rounding where
those round:

- ``add_rms_norm_``: ``x += delta`` (rounded to ``x``'s dtype, as a bf16 add is),
  then ``weight * (x_fp32 * rsqrt(mean(x_fp32^2) + eps)).to(dtype)``;
- ``rope_``: ``x * cos + rotate_half(x) * sin`` in fp32, rounded once;
  ``rope_write_kv_`` does the same to Q and K and stores K and V at their cache slots;
- ``silu_mul``: ``silu(gate)`` rounded to the dtype (as ``F.silu`` on bf16 is),
  times ``up``, rounded.

Every row is computed by one program with a fixed reduction order, so a row's
result does not depend on how many rows the step has (batch invariance).
They run on CUDA, and on the CPU under ``TRITON_INTERPRET=1`` (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _add_rms_norm_kernel(X, DELTA, W, Y, stride_x, stride_d, stride_y, n_cols, eps,
                         HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0)
    if HAS_DELTA:
        d = tl.load(DELTA + row * stride_d + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(X.dtype.element_ty)  # the residual add rounds
        tl.store(X + row * stride_x + cols, x, mask=ok)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, 0) / n_cols + eps)
    normed = (xf * rstd).to(Y.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * normed).to(Y.dtype.element_ty), mask=ok)


@triton.jit
def _rope_kernel(X, COS, SIN, POS, stride_t, stride_c, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                 BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    pos = tl.load(POS + tok).to(tl.int64)
    base = X + tok * stride_t + head * HEAD_DIM
    x1 = tl.load(base + d, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + d, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(COS + pos * stride_c + d, mask=ok, other=0.0).to(tl.float32)
    c2 = tl.load(COS + pos * stride_c + HALF + d, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(SIN + pos * stride_c + d, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(SIN + pos * stride_c + HALF + d, mask=ok, other=0.0).to(tl.float32)
    tl.store(base + d, (x1 * c1 - x2 * s1).to(X.dtype.element_ty), mask=ok)
    tl.store(base + HALF + d, (x2 * c2 + x1 * s2).to(X.dtype.element_ty), mask=ok)


@triton.jit
def _rope_write_kv_kernel(X, COS, SIN, POS, SLOTS, KC, VC, stride_t, stride_c, stride_ks, stride_kh,
                          stride_vs, stride_vh, num_heads, num_kv_heads,
                          HEAD_DIM: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr):
    # program (token, head): heads [0, H) are Q (rotated in place), [H, H + Hkv) K (rotated,
    # stored in the cache), [H + Hkv, H + 2 Hkv) V (stored in the cache)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK)
    ok = d < HALF
    base = X + tok * stride_t + head * HEAD_DIM
    x1 = tl.load(base + d, mask=ok, other=0.0)
    x2 = tl.load(base + HALF + d, mask=ok, other=0.0)
    slot = tl.load(SLOTS + tok).to(tl.int64)
    if head >= num_heads + num_kv_heads:
        dst = VC + slot * stride_vs + (head - num_heads - num_kv_heads) * stride_vh
        tl.store(dst + d, x1.to(VC.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + d, x2.to(VC.dtype.element_ty), mask=ok)
    else:
        pos = tl.load(POS + tok).to(tl.int64)
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        c1 = tl.load(COS + pos * stride_c + d, mask=ok, other=0.0).to(tl.float32)
        c2 = tl.load(COS + pos * stride_c + HALF + d, mask=ok, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + pos * stride_c + d, mask=ok, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + pos * stride_c + HALF + d, mask=ok, other=0.0).to(tl.float32)
        o1 = (a1 * c1 - a2 * s1).to(X.dtype.element_ty)
        o2 = (a2 * c2 + a1 * s2).to(X.dtype.element_ty)
        if head < num_heads:
            tl.store(base + d, o1, mask=ok)
            tl.store(base + HALF + d, o2, mask=ok)
        else:
            dst = KC + slot * stride_ks + (head - num_heads) * stride_kh
            tl.store(dst + d, o1.to(KC.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + d, o2.to(KC.dtype.element_ty), mask=ok)


@triton.jit
def _silu_mul_kernel(GU, OUT, stride_gu, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n_cols
    g = tl.load(GU + row * stride_gu + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(GU + row * stride_gu + n_cols + cols, mask=ok, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * u).to(OUT.dtype.element_ty), mask=ok)


def add_rms_norm_(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x += delta`` in place (skipped when ``delta`` is None), then RMSNorm of ``x``.

    Args:
        x: residual stream ``[num_tokens, hidden]``, last dim contiguous.
        delta: what the last sub-layer adds ``[num_tokens, hidden]``, or ``None``.
        weight: norm weight ``[hidden]``.
        eps: added to the mean square.

    Returns:
        the normed ``[num_tokens, hidden]`` (a new tensor).
    """
    n, hidden = x.shape
    y = torch.empty_like(x)
    if n == 0:
        return y
    d = delta if delta is not None else x
    _add_rms_norm_kernel[(n,)](x, d, weight, y, x.stride(0), d.stride(0), y.stride(0), hidden, eps,
                               HAS_DELTA=delta is not None, BLOCK=triton.next_power_of_2(hidden),
                               num_warps=4 if hidden >= 1024 else 2)
    return y


def rope_(x: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor,
          positions: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE, in place, on the first ``num_heads`` heads of each row of ``x``.

    Args:
        x: ``[num_tokens, >= num_heads * head_dim]`` (e.g. the fused QKV output: the Q
            heads then the K heads are rotated, V is left alone); last dim contiguous.
        num_heads: heads to rotate.
        head_dim: width of one head (even).
        cos, sin: tables ``[max_positions, head_dim]``.
        positions: ``[num_tokens]`` absolute positions.

    Returns:
        ``x``.
    """
    n = x.shape[0]
    if n:
        half = head_dim // 2
        _rope_kernel[(n, num_heads)](x, cos, sin, positions, x.stride(0), cos.stride(0),
                                     HEAD_DIM=head_dim, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return x


def rope_write_kv_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                   sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
    """RoPE on Q (in place) and K, then K and V stored at their cache slots: one kernel.

    Args:
        qkv: the fused QKV output ``[num_tokens, (H + 2 Hkv) * D]``, last dim contiguous.
        num_heads, num_kv_heads, head_dim: H, Hkv, D.
        cos, sin: tables ``[max_positions, D]``.
        positions: ``[num_tokens]`` absolute positions.
        slots: ``[num_tokens]`` cache slots.
        k_cache, v_cache: the layer's cache ``[num_slots, Hkv, D]`` (same dtype as ``qkv``;
            FP8 caches take the unfused path, which quantizes).

    Returns:
        the rotated queries, a view of ``qkv`` ``[num_tokens, H, D]``.
    """
    n = qkv.shape[0]
    if n:
        half = head_dim // 2
        _rope_write_kv_kernel[(n, num_heads + 2 * num_kv_heads)](
            qkv, cos, sin, positions, slots, k_cache, v_cache, qkv.stride(0), cos.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), num_heads, num_kv_heads,
            HEAD_DIM=head_dim, HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return qkv[:, : num_heads * head_dim].view(n, num_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` ``[num_tokens, 2 * inter]`` → ``[num_tokens, inter]``."""
    n, width = gate_up.shape
    inter = width // 2
    out = gate_up.new_empty(n, inter)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](gate_up, out, gate_up.stride(0), out.stride(0), inter,
                                                        BLOCK=block, num_warps=4)
    return out
