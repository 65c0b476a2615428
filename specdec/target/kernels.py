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

from specdec.pdl import PDL_OFF, check_pdl, pdl_enter, prefetch_lines, prefetch_rows_l2


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


# -- fused linear layers ---------------------------------------------------------------
# A decode or verify step has few rows (tokens); each GEMM there is a few µs of
# launch latency and a small weight read. These kernels fold what surrounds each
# GEMM of a decoder layer into it, so a layer is five kernels plus attention:
#
#   qkv_rope_write_kv:  RMSNorm -> QKV GEMM (+bias) -> RoPE -> Q out, K/V into the cache
#   linear (residual):  x += o @ Wo^T                  (and x += a @ Wdown^T)
#   linear (silu_mul):  RMSNorm -> gate/up GEMM -> silu(gate) * up
#   linear (norm):      RMSNorm -> LM head -> fp32 logits
#
# Rounding follows the unfused forward (the normed input rounded to the dtype, then
# times the norm weight, rounded; each GEMM output rounded to the dtype; the residual
# add rounded once). Rows are tiled 16 at a time whatever the number of rows and the
# reduction order over K is fixed, so a row's result does not depend on how many rows
# the step has: a verify step computes each row as a decode step would.

FUSED_BLOCK_M = 16
#: Steps with more tokens than this use cuBLAS GEMMs (a prompt's prefill is compute-bound).
FUSED_GEMM_MAX_TOKENS = 512


@triton.jit
def _row_rstd(X, rows, rmask, stride_x, K, eps, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    ss = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & (kk < K)[None, :],
                    other=0.0).to(tl.float32)
        ss += tl.sum(x * x, 1)
    return tl.rsqrt(ss / K + eps)


@triton.jit
def _rstd_from_parts(SS, rows, rmask, num_parts, K, eps, BLOCK_M: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    # the row's sum of squares, as partial sums the kernel that wrote the row left behind (one per
    # column block, in a fixed order): one small load instead of a pass over the row
    p = tl.arange(0, PARTS_BLOCK)
    part = tl.load(SS + rows[:, None] * num_parts + p[None, :], mask=rmask[:, None] & (p < num_parts)[None, :],
                   other=0.0)
    return tl.rsqrt(tl.sum(part, 1) / K + eps)


@triton.jit
def _rstd(X, SS_IN, rows, rmask, stride_x, parts_in, K, eps, NORM_FROM_SS: tl.constexpr, BLOCK_M: tl.constexpr,
          BLOCK_K: tl.constexpr, PARTS_BLOCK: tl.constexpr):
    if NORM_FROM_SS:
        return _rstd_from_parts(SS_IN, rows, rmask, parts_in, K, eps, BLOCK_M, PARTS_BLOCK)
    return _row_rstd(X, rows, rmask, stride_x, K, eps, BLOCK_M, BLOCK_K)


@triton.jit
def _load_input(X, NW, rows, rmask, kk, kmask, rstd, stride_x, HAS_NORM: tl.constexpr):
    x = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
    if HAS_NORM:  # weight * (x * rstd).to(dtype), rounded: HF's RMSNorm
        normed = (x.to(tl.float32) * rstd[:, None]).to(X.dtype.element_ty).to(tl.float32)
        nw = tl.load(NW + kk, mask=kmask, other=0.0).to(tl.float32)
        x = (nw[None, :] * normed).to(X.dtype.element_ty)
    return x


@triton.jit
def _linear_kernel(X, W, Y, NW, RES, SS_IN, SS_OUT, M, N, K, stride_x, stride_w, stride_y, stride_r, eps,
                   parts_in, HAS_NORM: tl.constexpr, SILU_MUL: tl.constexpr, HAS_RES: tl.constexpr,
                   PRECISION: tl.constexpr, NORM_FROM_SS: tl.constexpr, WRITE_SS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PARTS_BLOCK: tl.constexpr,
                   PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask, cmask = rows < M, cols < N
    rows64, cols64 = rows.to(tl.int64), cols.to(tl.int64)
    if PDL == 2:
        wrows = tl.minimum(cols64, N - 1)
        prefetch_rows_l2(W, wrows, stride_w, K, PF_LINES, PF_LINE)
        if SILU_MUL:
            prefetch_rows_l2(W, wrows + N, stride_w, K, PF_LINES, PF_LINE)
    pdl_enter(PDL)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        rstd = _rstd(X, SS_IN, rows64, rmask, stride_x, parts_in, K, eps, NORM_FROM_SS, BLOCK_M, BLOCK_K, PARTS_BLOCK)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = _load_input(X, NW, rows64, rmask, kk, kmask, rstd, stride_x, HAS_NORM)
        wmask = cmask[:, None] & kmask[None, :]
        w = tl.load(W + cols64[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
        if SILU_MUL:  # rows [N, 2N) of W are the up projection
            u = tl.load(W + (cols64 + N)[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
            acc_up += tl.dot(x, tl.trans(u), input_precision=PRECISION)
    out = acc.to(X.dtype.element_ty).to(tl.float32)  # the GEMM's output, rounded
    if SILU_MUL:
        act = (out / (1.0 + tl.exp(-out))).to(X.dtype.element_ty).to(tl.float32)
        out = act * acc_up.to(X.dtype.element_ty).to(tl.float32)
    omask = rmask[:, None] & cmask[None, :]
    if HAS_RES:
        out += tl.load(RES + rows64[:, None] * stride_r + cols64[None, :], mask=omask, other=0.0).to(tl.float32)
    y = out.to(Y.dtype.element_ty)
    tl.store(Y + rows64[:, None] * stride_y + cols64[None, :], y, mask=omask)
    if WRITE_SS:  # this block's share of each row's sum of squares, for the next norm
        yf = tl.where(omask, y.to(tl.float32), 0.0)
        tl.store(SS_OUT + rows64 * tl.num_programs(0) + tl.program_id(0), tl.sum(yf * yf, 1), mask=rmask)


@triton.jit
def _qkv_rope_kernel(X, W, BIAS, NW, SS_IN, Q, KC, VC, COS, SIN, POS, SLOTS, M, K, stride_x, stride_w, stride_q,
                     stride_c, stride_ks, stride_kh, stride_vs, stride_vh, num_heads, num_kv_heads, eps, parts_in,
                     HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, NORM_FROM_SS: tl.constexpr,
                     HEAD_DIM: tl.constexpr, HALF: tl.constexpr, HEAD_SPLIT: tl.constexpr, BLOCK_H: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, PARTS_BLOCK: tl.constexpr,
                     PDL: tl.constexpr, PF_LINES: tl.constexpr, PF_LINE: tl.constexpr):
    # program (head part, row block): heads [0, H) are Q, [H, H + Hkv) K, then V. A program
    # computes columns d and d + D/2 of its head (two GEMM tiles), so rotate-half RoPE pairs
    # them in registers; HEAD_SPLIT programs share a head (more programs for a small model).
    head = tl.program_id(0) // HEAD_SPLIT
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < M
    rows64 = rows.to(tl.int64)
    d = (tl.program_id(0) % HEAD_SPLIT) * BLOCK_H + tl.arange(0, BLOCK_H)
    dmask = d < HALF
    lo = (head * HEAD_DIM + d).to(tl.int64)
    if PDL == 2:
        wrow = head * HEAD_DIM + tl.minimum(d, HALF - 1).to(tl.int64)
        prefetch_rows_l2(W, wrow, stride_w, K, PF_LINES, PF_LINE)
        prefetch_rows_l2(W, wrow + HALF, stride_w, K, PF_LINES, PF_LINE)
    pdl_enter(PDL)
    rstd = _rstd(X, SS_IN, rows64, rmask, stride_x, parts_in, K, eps, NORM_FROM_SS, BLOCK_M, BLOCK_K, PARTS_BLOCK)
    acc1 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_H], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        kmask = kk < K
        x = _load_input(X, NW, rows64, rmask, kk, kmask, rstd, stride_x, True)
        wmask = dmask[:, None] & kmask[None, :]
        w1 = tl.load(W + lo[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
        w2 = tl.load(W + (lo + HALF)[:, None] * stride_w + kk[None, :], mask=wmask, other=0.0)
        acc1 += tl.dot(x, tl.trans(w1), input_precision=PRECISION)
        acc2 += tl.dot(x, tl.trans(w2), input_precision=PRECISION)
    if HAS_BIAS:
        acc1 += tl.load(BIAS + lo, mask=dmask, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(BIAS + lo + HALF, mask=dmask, other=0.0).to(tl.float32)[None, :]
    a1 = acc1.to(X.dtype.element_ty)  # the QKV GEMM's output, rounded
    a2 = acc2.to(X.dtype.element_ty)
    omask = rmask[:, None] & dmask[None, :]
    slot = tl.load(SLOTS + rows64, mask=rmask, other=0).to(tl.int64)
    if head >= num_heads + num_kv_heads:  # V: stored as computed
        dst = VC + slot[:, None] * stride_vs + (head - num_heads - num_kv_heads) * stride_vh
        tl.store(dst + d[None, :], a1.to(VC.dtype.element_ty), mask=omask)
        tl.store(dst + HALF + d[None, :], a2.to(VC.dtype.element_ty), mask=omask)
    else:
        pos = tl.load(POS + rows64, mask=rmask, other=0).to(tl.int64)
        tab = pos[:, None] * stride_c + d[None, :]
        c1 = tl.load(COS + tab, mask=omask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + tab + HALF, mask=omask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + tab, mask=omask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + tab + HALF, mask=omask, other=0.0).to(tl.float32)
        f1, f2 = a1.to(tl.float32), a2.to(tl.float32)
        o1 = (f1 * c1 - f2 * s1).to(X.dtype.element_ty)
        o2 = (f2 * c2 + f1 * s2).to(X.dtype.element_ty)
        if head < num_heads:
            dst = Q + rows64[:, None] * stride_q + head * HEAD_DIM
            tl.store(dst + d[None, :], o1, mask=omask)
            tl.store(dst + HALF + d[None, :], o2, mask=omask)
        else:
            dst = KC + slot[:, None] * stride_ks + (head - num_heads) * stride_kh
            tl.store(dst + d[None, :], o1.to(KC.dtype.element_ty), mask=omask)
            tl.store(dst + HALF + d[None, :], o2.to(KC.dtype.element_ty), mask=omask)


#: Launch configuration of the fused GEMMs: BLOCK_N (``block_n_wide`` for N > 2048), BLOCK_K,
#: num_warps, num_stages (and, for the QKV kernel, programs per head).
#: Defaults: the best of ``bench/linear_sweep.py`` on an H200 (SmolLM2's shapes, 1-32 rows); the
#: down projection (K = 1536) and the LM head (N = 49152) take their own (see ``_linear_config``).
LINEAR_CONFIG = {"block_n": 16, "block_n_wide": 128, "block_k": 64, "num_warps": 4, "num_stages": 4}
SILU_MUL_CONFIG = {**LINEAR_CONFIG, "block_n": 32}
LONG_K_CONFIG = {**LINEAR_CONFIG, "block_k": 256, "num_warps": 2}
WIDE_N_CONFIG = {**LINEAR_CONFIG, "num_stages": 3}
QKV_CONFIG = {"block_k": 64, "num_warps": 4, "num_stages": 4, "head_split": 2}


def _linear_config(n: int, k: int, silu_mul: bool) -> dict:
    if silu_mul:
        return SILU_MUL_CONFIG
    if n > 2048:
        return WIDE_N_CONFIG
    return LONG_K_CONFIG if k > 1024 else LINEAR_CONFIG


def ss_parts(n: int, k: int) -> int:
    """Columns of the ``ss_out`` buffer of a plain ``fused_linear`` of an ``[N, K]`` weight."""
    return triton.cdiv(n, _block_n(n, _linear_config(n, k, False)))


def _block_k(k: int, cfg: dict) -> int:
    """Reduction tile: the configured one, or K itself (a power of two >= 16) when smaller."""
    return min(cfg["block_k"], max(16, triton.next_power_of_2(k)))


def _precision(x: torch.Tensor) -> str:
    """``tl.dot`` precision: IEEE for fp32 (lossless tests); ignored for 16-bit operands."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _block_n(n: int, cfg: dict) -> int:
    """Output columns per program: enough programs at one row block to fill the GPU."""
    return cfg["block_n"] if n <= 2048 else cfg["block_n_wide"]


def fused_linear(x: torch.Tensor, weight: torch.Tensor, *, norm_weight: torch.Tensor | None = None,
                 eps: float = 1e-6, silu_mul: bool = False, residual: torch.Tensor | None = None,
                 out: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
                 norm_ss: torch.Tensor | None = None, ss_out: torch.Tensor | None = None,
                 config: dict | None = None, pdl: int = PDL_OFF) -> torch.Tensor:
    """``y = act(norm(x) @ weight^T) (+ residual)`` in one kernel, for steps of few rows.

    Args:
        x: ``[M, K]``, last dim contiguous.
        weight: ``[N, K]`` (``[2 I, K]``, gate rows then up rows, with ``silu_mul``), contiguous.
        norm_weight: RMSNorm ``x`` first (weight ``[K]``), as the unfused forward does.
        eps: the norm's epsilon.
        silu_mul: output ``silu(x @ gate^T) * (x @ up^T)`` ``[M, I]``.
        residual: add it to the output (``[M, N]``); may be ``out`` itself (an in-place residual add).
        out: where to write (default: a new tensor).
        out_dtype: dtype of a new output (default ``x``'s); the result is rounded to ``x``'s dtype
            first either way (fp32 logits of a bf16 LM head).
        norm_ss: with ``norm_weight``: the partial sums of squares of ``x``'s rows that the kernel
            which wrote ``x`` left in its ``ss_out`` (``[M, parts]`` fp32); the norm then skips its
            pass over the row.
        ss_out: write each output row's partial sums of squares here (``[M, ss_parts(N, K)]`` fp32),
            for the next kernel's ``norm_ss``.
        config: overrides of :data:`LINEAR_CONFIG` (benchmarks).
        pdl: programmatic dependent launch level (:mod:`specdec.pdl`).

    Returns:
        ``out``.

    Raises:
        ValueError: shapes or strides that do not fit, or a ``pdl`` level this device cannot use.
    """
    m, k = x.shape
    n = weight.shape[0] // 2 if silu_mul else weight.shape[0]
    check_pdl(pdl, x.device)
    if weight.shape[1] != k or (silu_mul and weight.shape[0] % 2):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit x {tuple(x.shape)} (silu_mul={silu_mul})")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError(f"x and weight need a contiguous last dim, got strides {x.stride()} and {weight.stride()}")
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    if m == 0:
        return out
    res = residual if residual is not None else out
    cfg = {**_linear_config(n, k, silu_mul), **(config or {})}
    bn = _block_n(n, cfg)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, FUSED_BLOCK_M))
    if ss_out is not None and tuple(ss_out.shape) != (m, grid[0]):
        raise ValueError(f"ss_out must be [{m}, {grid[0]}] (rows x column blocks), got {tuple(ss_out.shape)}")
    parts_in = norm_ss.shape[1] if norm_ss is not None else 1
    lines, line = prefetch_lines(k, weight.element_size())
    _linear_kernel[grid](x, weight, out, norm_weight if norm_weight is not None else weight, res,
                         norm_ss if norm_ss is not None else out, ss_out if ss_out is not None else out, m, n, k,
                         x.stride(0), weight.stride(0), out.stride(0), res.stride(0), eps, parts_in,
                         HAS_NORM=norm_weight is not None, SILU_MUL=silu_mul, HAS_RES=residual is not None,
                         PRECISION=_precision(x), NORM_FROM_SS=norm_ss is not None and norm_weight is not None,
                         WRITE_SS=ss_out is not None, BLOCK_M=FUSED_BLOCK_M, BLOCK_N=bn, BLOCK_K=_block_k(k, cfg),
                         PARTS_BLOCK=max(16, triton.next_power_of_2(parts_in)), PDL=pdl, PF_LINES=lines,
                         PF_LINE=line, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
                         launch_pdl=pdl > 0)
    return out


def qkv_rope_write_kv(x: torch.Tensor, w_qkv: torch.Tensor, b_qkv: torch.Tensor | None, norm_weight: torch.Tensor,
                      eps: float, num_heads: int, num_kv_heads: int, head_dim: int, cos: torch.Tensor,
                      sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, norm_ss: torch.Tensor | None = None,
                      config: dict | None = None, pdl: int = PDL_OFF) -> torch.Tensor:
    """RMSNorm, the fused QKV GEMM, RoPE on Q and K, and K/V stored at their cache slots: one kernel.

    Args:
        x: the residual stream ``[T, hidden]``.
        w_qkv: ``[(H + 2 Hkv) * D, hidden]``; b_qkv: its bias or ``None``.
        norm_weight, eps: the layer's input RMSNorm.
        num_heads, num_kv_heads, head_dim: H, Hkv, D (D even).
        cos, sin: tables ``[max_positions, D]``; positions: ``[T]``.
        slots: ``[T]`` cache slots; k_cache, v_cache: ``[num_slots, Hkv, D]``.
        norm_ss: partial sums of squares of ``x``'s rows (see :func:`fused_linear`), or ``None``.
        config: overrides of :data:`QKV_CONFIG` (benchmarks).
        pdl: programmatic dependent launch level (:mod:`specdec.pdl`).

    Returns:
        the rotated queries ``[T, H, D]``.

    Raises:
        ValueError: a ``pdl`` level this device cannot use.
    """
    check_pdl(pdl, x.device)
    t, k = x.shape
    q = torch.empty(t, num_heads * head_dim, dtype=x.dtype, device=x.device)
    if t:
        half = head_dim // 2
        cfg = {**QKV_CONFIG, **(config or {})}
        split = cfg["head_split"] if half % cfg["head_split"] == 0 and half // cfg["head_split"] >= 16 else 1
        grid = ((num_heads + 2 * num_kv_heads) * split, triton.cdiv(t, FUSED_BLOCK_M))
        parts_in = norm_ss.shape[1] if norm_ss is not None else 1
        lines, line = prefetch_lines(k, w_qkv.element_size())
        _qkv_rope_kernel[grid](
            x, w_qkv, b_qkv if b_qkv is not None else w_qkv, norm_weight, norm_ss if norm_ss is not None else q, q,
            k_cache, v_cache, cos, sin, positions,
            slots, t, k, x.stride(0), w_qkv.stride(0), q.stride(0), cos.stride(0), k_cache.stride(0),
            k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), num_heads, num_kv_heads, eps, parts_in,
            HAS_BIAS=b_qkv is not None, PRECISION=_precision(x), NORM_FROM_SS=norm_ss is not None,
            PARTS_BLOCK=max(16, triton.next_power_of_2(parts_in)), HEAD_DIM=head_dim, HALF=half, HEAD_SPLIT=split,
            BLOCK_H=max(16, triton.next_power_of_2(half // split)), BLOCK_M=FUSED_BLOCK_M, BLOCK_K=_block_k(k, cfg),
            PDL=pdl, PF_LINES=lines, PF_LINE=line, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            launch_pdl=pdl > 0)
    return q.view(t, num_heads, head_dim)
