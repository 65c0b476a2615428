"""Fused Gumbel-max sampling of the sampled rows of a step, in Triton (the fast path of
:func:`specdec.sampling.sample_rows` on CUDA).

What the kernel computes. For every sampled row ``s`` (one program per ``(row, vocab split)``,
walking its split in blocks of ``BLOCK`` tokens), for each vocabulary index ``v``:

- ``z = logits[rows[s], v] / temperature[s]`` in fp32 (round-to-nearest division, as torch's);
- the shaping mask (top-k and top-p): the torch side computes beforehand, for the rows that ask
  for a limit only, a per-row cutoff ``(thr, icut)`` (:func:`specdec.sampling.row_cutoffs`):
  the kept tokens are those with ``z > thr``, or ``z == thr`` and ``v <= icut`` (ties at the
  cutoff kept in index order, exactly the stable-sort prefix that
  :func:`specdec.sampling.shape_logits` keeps); the others get ``-inf``;
- the Gumbel noise ``G(seed, position, v)`` of :func:`specdec.sampling.gumbel_noise`: the same
  counter hash (``mix32`` on uint32, whose wrapping products and logical shifts are the int64
  ``& 0xFFFFFFFF`` arithmetic of ``mix32`` bit for bit), the same uniform, and
  ``-log(-log1p(-u))`` with libdevice's ``log``/``log1p`` (CUDA's own ``logf``/``log1pf``, which
  torch's CUDA kernels call);
- the running maximum of ``z + G`` and its first index.

A second small kernel reduces the splits' maxima (first index on ties, as ``torch.argmax``),
so the token of each row is bit-identical to the torch path's
``argmax(shape_logits(...) + gumbel_noise(...))`` for the same seed and position, and no
``[rows, vocab]`` tensor is ever written (with ``store=True`` the kernel also writes the
perturbed logits ``z + G``, for tests).

How it is tested (``tests/test_sampling_kernel.py``): on CPU the kernels run in Triton's
interpreter (``TRITON_INTERPRET=1`` set before this module is imported, in a subprocess); there
``log``/``log1p`` are torch's own CPU functions (the interpreter has no libdevice), so the
interpreted kernel must give exactly the torch reference's perturbed logits and tokens over
random logits, vocabularies that are not multiples of the block, mixed temperature / top-k /
top-p rows, ties and 64-bit seeds. On a CUDA GPU the compiled kernel (libdevice) is compared
the same way against the torch path on the GPU at vocab 49152.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from specdec.attention.backends.triton_interp import is_interpreted

__all__ = ["INTERPRETED", "sample_tokens"]

BLOCK = 1024
TARGET_PROGRAMS = 1024  # split the vocabulary until rows x splits reaches about this many programs


@triton.jit
def _probe():
    pass


INTERPRETED = is_interpreted(_probe)  # kernels of this module were built for Triton's CPU interpreter

if INTERPRETED:
    from triton.runtime.interpreter import TensorHandle

    def _torch_unary(fn):
        """An elementwise torch CPU function on an interpreted block (the interpreter has no libdevice)."""

        def apply(x):
            data = fn(torch.from_numpy(np.ascontiguousarray(x.handle.data))).numpy()
            return tl.tensor(TensorHandle(data, x.handle.dtype.scalar), x.type)

        return apply

    _log, _log1p = _torch_unary(torch.log), _torch_unary(torch.log1p)

    def _gumbel(u):
        return -_log(-_log1p(-u))
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _gumbel(u):
        return -libdevice.log(-libdevice.log1p(-u))


@triton.jit
def _mix32(x):
    """specdec.sampling.mix32 on uint32: wrapping products, logical shifts."""
    x = x ^ (x >> 16)
    x = x * tl.full((), 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full((), 0x5BD1E995, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.full((), 0x2C1B3C6D, tl.uint32)
    return x ^ (x >> 16)


# One compiled variant per (logit dtype, stream, masked, store), whatever the step's row count: a
# new variant compiles in about 0.25 s on the H200, which a short run pays at every new row count
# if the shape is a compile-time constant. So the blocks per split and the splits are runtime
# arguments, never specialised (Triton would compile apart values of 1 and multiples of 16), nor
# is the alignment of the per-row vectors, read one scalar a program (the keys and positions are
# rows of one [4, S] tensor: 16-byte aligned only for even S).
_SCALAR_PTRS = ["ROWS", "TEMP", "THR", "ICUT", "KEYS", "POS", "PART_VAL", "PART_IDX"]


@triton.jit(do_not_specialize=["n_splits", "blocks"], do_not_specialize_on_alignment=_SCALAR_PTRS)
def _sample_split_kernel(
    LOGITS, stride_row, ROWS, TEMP, THR, ICUT, KEYS, POS, PART_VAL, PART_IDX, PERTURBED,
    vocab, n_splits, blocks,
    STREAM: tl.constexpr,
    MASKED: tl.constexpr,
    STORE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    s = tl.program_id(0)
    split = tl.program_id(1)
    row = tl.load(ROWS + s)
    temp = tl.load(TEMP + s)
    key = tl.load(KEYS + s).to(tl.uint32)  # keys are < 2**32
    pos = tl.load(POS + s).to(tl.uint32)  # positions & 0xFFFFFFFF
    row_key = _mix32(_mix32(key ^ tl.full((), STREAM, tl.uint32)) ^ pos)
    if MASKED:
        thr = tl.load(THR + s)
        icut = tl.load(ICUT + s)
    start = split * (blocks * BLOCK)
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = start
    src = LOGITS + row.to(tl.int64) * stride_row
    for b in range(0, blocks):  # a runtime count: one compiled variant serves every row count
        idx = start + b * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] int32
        inside = idx < vocab
        x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
        z = tl.math.div_rn(x, temp)
        h = _mix32(row_key ^ _mix32(idx.to(tl.uint32) + tl.full((), 0x61C88647, tl.uint32)))
        u = tl.minimum(h.to(tl.float32) * 2.3283064365386963e-10 + 1.1641532182693481e-10, 0.99999994039535522)
        val = z + _gumbel(u)
        if MASKED:
            keep = (z > thr) | ((z == thr) & (idx <= icut))
            val = tl.where(keep, val, float("-inf"))
        val = tl.where(inside, val, float("-inf"))
        if STORE:
            tl.store(PERTURBED + s.to(tl.int64) * vocab + idx, val, mask=inside)
        block_max = tl.max(val, axis=0)
        block_arg = tl.argmax(val, axis=0, tie_break_left=True)
        better = block_max > best_val
        best_idx = tl.where(better, start + b * BLOCK + block_arg, best_idx)
        best_val = tl.where(better, block_max, best_val)
    tl.store(PART_VAL + s * n_splits + split, best_val)
    tl.store(PART_IDX + s * n_splits + split, best_idx)


@triton.jit(do_not_specialize=["n_splits"], do_not_specialize_on_alignment=["PART_VAL", "PART_IDX", "OUT"])
def _reduce_splits_kernel(PART_VAL, PART_IDX, OUT, n_splits, SPLITS: tl.constexpr):
    s = tl.program_id(0)
    offs = tl.arange(0, SPLITS)
    inside = offs < n_splits
    val = tl.load(PART_VAL + s * n_splits + offs, mask=inside, other=float("-inf"))
    idx = tl.load(PART_IDX + s * n_splits + offs, mask=inside, other=0)
    first = tl.argmax(val, axis=0, tie_break_left=True)  # earliest split on ties: the smallest index
    tl.store(OUT + s, tl.sum(tl.where(offs == first, idx, 0), axis=0).to(tl.int64))


def _launch_shape(rows: int, vocab: int) -> tuple[int, int]:
    """``(blocks per split, splits)``: enough programs to fill the GPU; blocks per split a power of two."""
    blocks = triton.cdiv(vocab, BLOCK)
    want_splits = max(1, min(blocks, triton.cdiv(TARGET_PROGRAMS, max(rows, 1))))
    per_split = triton.next_power_of_2(triton.cdiv(blocks, want_splits))
    return per_split, triton.cdiv(blocks, per_split)


def sample_tokens(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  positions: torch.Tensor, stream: int, cutoffs: tuple[torch.Tensor, torch.Tensor] | None = None,
                  store: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The Gumbel-max token of each sampled row (see the module docstring).

    Args:
        logits: ``[n, vocab]`` logits (any float dtype; rows contiguous in the vocabulary).
        rows: ``[S]`` int64 row of ``logits`` per sampled row.
        temperature: ``[S]`` fp32, > 0.
        keys: ``[S]`` int64 request keys (``< 2**32``); positions: ``[S]`` int64.
        stream: the noise stream (``specdec.sampling._STREAM_SAMPLE`` for the target's sample).
        cutoffs: ``(thr [S] fp32, icut [S] int32)`` of :func:`specdec.sampling.row_cutoffs`,
            or ``None`` when no row has a top-k or top-p limit.
        store: also return the perturbed logits ``[S, vocab]`` fp32 (``-inf`` where masked).

    Returns:
        ``([S] int64 tokens, perturbed logits or None)``; no host synchronisation.
    """
    n_rows, vocab = rows.shape[0], logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    blocks, splits = _launch_shape(n_rows, vocab)
    part_val = torch.empty(n_rows, splits, dtype=torch.float32, device=dev)
    part_idx = torch.empty(n_rows, splits, dtype=torch.int32, device=dev)
    tokens = torch.empty(n_rows, dtype=torch.long, device=dev)
    perturbed = torch.empty(n_rows, vocab, dtype=torch.float32, device=dev) if store else None
    if n_rows == 0:
        return tokens, perturbed
    thr, icut = cutoffs if cutoffs is not None else (temperature, temperature)  # unused when not MASKED
    _sample_split_kernel[(n_rows, splits)](
        logits, logits.stride(0), rows, temperature, thr, icut, keys, positions, part_val, part_idx,
        perturbed if store else part_val, vocab, splits, blocks,
        STREAM=stream, MASKED=cutoffs is not None, STORE=store, BLOCK=BLOCK)
    # SPLITS from the vocabulary alone (the most splits it can have): one variant for every row count
    _reduce_splits_kernel[(n_rows,)](part_val, part_idx, tokens, splits,
                                     SPLITS=max(2, triton.next_power_of_2(triton.cdiv(vocab, BLOCK))))
    return tokens, perturbed
