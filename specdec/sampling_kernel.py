"""Fused Gumbel-max sampling of the sampled rows of a step, in Triton (the fast path of
:func:`specdec.sampling.sample_rows` on CUDA).

What the kernel computes. For every sampled row ``s`` (one program per ``(row, vocab split)``,
walking its split in blocks of ``BLOCK`` tokens), for each vocabulary index ``v``:

- ``z = logits[rows[s], v] / temperature[s]`` in fp32 (round-to-nearest division, as torch's);
- the shaping mask (top-k and top-p): a per-row cutoff ``(thr, icut)`` computed beforehand by
  :func:`row_cutoffs` here (the torch twin is :func:`specdec.sampling.row_cutoffs`): the kept
  tokens are those with ``z > thr``, or ``z == thr`` and ``v <= icut`` (ties at the cutoff kept
  in index order, exactly the stable-sort prefix that :func:`specdec.sampling.shape_logits`
  keeps); the others get ``-inf``. :func:`row_cutoffs` finds that prefix without sorting the
  row (a search on thresholds with exact fixed-point masses, see its docstring);
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
``log``/``log1p``/``exp`` are torch's own CPU functions (the interpreter has no libdevice), so
the interpreted kernels must give exactly the torch reference's cutoffs, perturbed logits and
tokens over random logits, vocabularies that are not multiples of the block, mixed temperature
/ top-k / top-p rows, ties, flat and hot rows, ``-inf`` logits and 64-bit seeds, through each of
the cutoff search's paths (sorted candidates, the exact search and its ties pass). On a CUDA GPU
the compiled kernels (libdevice) are compared the same way against the torch path on the GPU at
vocab 49152.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from specdec.attention.backends.triton_interp import is_interpreted

__all__ = ["INTERPRETED", "row_cutoffs", "sample_tokens"]

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

    _log, _log1p, _exp = _torch_unary(torch.log), _torch_unary(torch.log1p), _torch_unary(torch.exp)

    def _gumbel(u):
        return -_log(-_log1p(-u))
else:
    from triton.language.extra import libdevice

    @triton.jit
    def _gumbel(u):
        return -libdevice.log(-libdevice.log1p(-u))

    @triton.jit
    def _exp(x):
        return libdevice.exp(x)


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


# --------------------------------------------------------------------------- top-k / top-p cutoffs, sort-free

CUT_BLOCK = 1024  # tokens a cutoff program reads per loop iteration
CUT_PIVOTS = 8  # thresholds one pass over the row evaluates, >= 4 (the search narrows 7x a pass, at least)
CUT_CAP = 1024  # most candidates sorted in registers (a power of two)
CUT_MAX_PASSES = 16  # bound on the search's passes: 1 + ceil(32 / log2(7)) = 13 suffice for any fp32 row
CUT_WARPS = 8


@triton.jit
def _ordered(z):
    """fp32 -> int32 whose signed order is the float order, consecutive floats consecutive integers
    (not NaN). ``-0.0`` is folded into ``+0.0`` (key 0): they are equal, as in a sort."""
    bits = tl.where(z == 0.0, 0.0, z).to(tl.int32, bitcast=True)
    return tl.where(bits < 0, (bits ^ 0x7FFFFFFF) + 1, bits)


@triton.jit
def _unordered(key):
    """The inverse of :func:`_ordered` (key 0 is ``+0.0``; keys are above the int32 minimum)."""
    key = tl.maximum(key, -2147483647)  # a padding slot's key: no wrap-around below
    return tl.where(key < 0, (key - 1) ^ 0x7FFFFFFF, key).to(tl.float32, bitcast=True)


@triton.jit
def _weight(z, z_max):
    """specdec.verify.fixed_point_weights: floor(exp(z - z_max) * 2**32) as int64."""
    return (_exp(z - z_max) * 4294967296.0).to(tl.int64)


@triton.jit
def _row_block(src, start, vocab, temp, BLOCK: tl.constexpr):
    """One block of a row: (indices, fp32 z = logits / temperature, -inf past the vocabulary)."""
    idx = start + tl.arange(0, BLOCK)
    inside = idx < vocab
    x = tl.load(src + idx, mask=inside, other=0.0).to(tl.float32)
    return idx, tl.where(inside, tl.math.div_rn(x, temp), float("-inf"))


@triton.jit
def _pick(vec, ar, j, other):
    """``vec[j]`` of a small vector (``other`` is the identity of the max reduction)."""
    return tl.max(tl.where(ar == j, vec, other), axis=0)


@triton.jit
def _pivot_pass(src, vocab, temp, z_max, piv, BLOCK: tl.constexpr, NP: tl.constexpr):
    """Per threshold ``piv[j]``: how many tokens lie above it, their fixed-point mass, and the
    largest value at or below it (``-inf`` if none). Each thread accumulates its own lanes over the
    whole row; the lanes are reduced once, after the loop."""
    count = tl.zeros([BLOCK, NP], tl.int32)
    mass = tl.zeros([BLOCK, NP], tl.int64)
    below = tl.full([BLOCK, NP], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK):
        idx, z = _row_block(src, start, vocab, temp, BLOCK)
        w = _weight(z, z_max)
        above = z[:, None] > piv[None, :]  # [BLOCK, NP]
        count += above.to(tl.int32)
        mass += tl.where(above, w[:, None], 0)
        below = tl.maximum(below, tl.where(above, float("-inf"), z[:, None]))
    return tl.sum(count, axis=0), tl.sum(mass, axis=0), tl.max(below, axis=0)


@triton.jit
def _search(src, vocab, temp, z_max, k, p, use_mass, bound, bound_from_total, limit,
            BLOCK: tl.constexpr, NP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """Narrow down the value ``t`` of the last kept token.

    A threshold ``c`` "passes" when the first token (in the stable order) of the largest value at
    or below ``c`` is kept: fewer than ``k`` tokens lie above ``c`` and (with ``use_mass``) their mass
    is below ``bound``. Passing is monotone in ``c``; ``t`` is the smallest value whose first token
    is kept. Invariant after every pass: ``a`` fails, ``b`` is a value of the row that passes, and
    ``t`` lies in ``(a, b]``. The first pass tries ``-inf``, ``max - 32 .. max - 1`` and ``max``; later
    ones spread their thresholds evenly over the ordered integers between ``a`` and ``b``. Stops when
    no float lies strictly between ``a`` and ``b`` (then ``t == b``) or when at most ``limit``
    tokens lie above ``a`` (then the caller sorts those). With ``bound_from_total`` the mass bound
    is ``p`` times the row's whole mass (measured by the first pass, whose first threshold is -inf).

    Returns ``(a, tokens above a, b, tokens above b, mass above b, bound)``.
    """
    ar = tl.arange(0, NP)
    tl.static_assert(NP >= 4)
    guess = z_max - tl.exp2(5.0 * (NP - 2 - ar).to(tl.float32) / (NP - 3))  # max - 32 .. max - 1, geometric
    piv = tl.where(ar == 0, float("-inf"), tl.where(ar == NP - 1, z_max, guess))
    a = tl.full((), float("-inf"), tl.float32)
    b = z_max
    above_a = tl.full((), 0, tl.int32)
    above_b = tl.full((), 0, tl.int32)
    mass_b = tl.full((), 0, tl.int64)
    passes = tl.full((), 0, tl.int32)
    done = tl.full((), 0, tl.int32)
    while done == 0:
        count, mass, below = _pivot_pass(src, vocab, temp, z_max, piv, BLOCK, NP)
        if bound_from_total & (passes == 0):
            bound = p.to(tl.float64) * _pick(mass, ar, 0, 0).to(tl.float64)  # the mass above -inf: all of it
        ok = (count < k) & ((use_mass == 0) | (mass.to(tl.float64) < bound))
        j = tl.argmax(ok.to(tl.int32), axis=0, tie_break_left=True)  # the first passing threshold
        all_pass = _pick(ok.to(tl.int32), ar, 0, 0) == 1  # only -inf (first pass) can: every finite token is kept
        a = tl.where(all_pass, float("-inf"), _pick(piv, ar, j - 1, float("-inf")))
        above_a = tl.where(all_pass, 0x7FFFFFFF, _pick(count, ar, j - 1, -1))  # above any limit: never sorted
        b = _pick(below, ar, j, float("-inf"))
        above_b = _pick(count, ar, j, -1)
        mass_b = _pick(mass, ar, j, -1)
        passes += 1
        key_a = _ordered(a).to(tl.int64)
        key_b = _ordered(b).to(tl.int64)
        converged = all_pass | (key_b - key_a <= 1)
        done = (converged | (above_a <= limit) | (passes >= MAX_PASSES)).to(tl.int32)
        spread = key_a + ((key_b - key_a) * ar) // (NP - 1)  # [NP] from a to b
        piv = _unordered(spread.to(tl.int32))
    return a, above_a, b, above_b, mass_b, bound


@triton.jit
def _sorted_cutoff(src, vocab, temp, z_max, a, above_a, k, p, use_mass, bound, bound_from_k, scratch,
                   BLOCK: tl.constexpr, CAP: tl.constexpr):
    """The cutoff among the ``above_a <= CAP`` tokens above ``a`` (which hold every kept token):
    gathered into ``scratch`` as (descending value, index) keys, sorted in registers, masses summed
    in order. With ``bound_from_k`` the mass bound is ``p`` times the mass of the first ``k``."""
    base = tl.full((), 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        idx, z = _row_block(src, start, vocab, temp, BLOCK)
        sel = z > a
        slot = base + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        packed = ((~_ordered(z)).to(tl.int64) << 32) | idx.to(tl.int64)  # ascending = stable descending
        tl.store(scratch + slot, packed, mask=sel)
        base += tl.sum(sel.to(tl.int32), axis=0)
    tl.debug_barrier()  # the candidates were written by other threads of this program
    rank = tl.arange(0, CAP)
    valid = rank < above_a
    packed = tl.sort(tl.load(scratch + rank, mask=valid, other=0x7FFFFFFFFFFFFFFF), dim=0)
    z = _unordered(~(packed >> 32).to(tl.int32))
    idx = (packed & 0xFFFFFFFF).to(tl.int32)
    w = _weight(tl.where(valid, z, float("-inf")), z_max)  # 0 past the candidates
    before = tl.cumsum(w, axis=0) - w
    top_k_mass = tl.sum(tl.where(rank < k, w, 0), axis=0)
    bound = tl.where(bound_from_k, p.to(tl.float64) * top_k_mass.to(tl.float64), bound)
    keep = valid & (rank < k) & ((use_mass == 0) | (before.to(tl.float64) < bound))
    last = tl.sum(keep.to(tl.int32), axis=0) - 1
    return _pick(z, rank, last, float("-inf")), _pick(idx, rank, last, -1)


@triton.jit
def _tie_cutoff(src, vocab, temp, z_max, t, above_t, mass_t, k, use_mass, bound, BLOCK: tl.constexpr):
    """The cutoff when the last kept value ``t`` is known: how many of the tokens equal to ``t`` stay
    (index order), and the index of the last of them (``vocab``: all stay). Also returns how many
    tokens equal ``t``."""
    n = k - above_t  # >= 1
    w_t = _weight(t, z_max)
    if use_mass & (w_t > 0):  # the ties j = 0, 1, ... stay while mass_t + j * w_t < bound (exact in float64)
        mass_f = mass_t.to(tl.float64)
        w_f = w_t.to(tl.float64)
        q = tl.minimum((bound - mass_f) / w_f, vocab + 1.0)
        n_p = tl.maximum(q.to(tl.int32) - 1, 0)
        for _ in tl.static_range(3):
            n_p = tl.where(mass_f + n_p.to(tl.float64) * w_f < bound, n_p + 1, n_p)
        n = tl.minimum(n, n_p)
    seen = tl.full((), 0, tl.int32)
    found = tl.full((), 0, tl.int32) + vocab
    for start in range(0, vocab, BLOCK):
        idx, z = _row_block(src, start, vocab, temp, BLOCK)
        eq = z == t
        nth = (seen + tl.cumsum(eq.to(tl.int32), axis=0)) == n
        found = tl.minimum(found, tl.min(tl.where(eq & nth, idx, vocab), axis=0))
        seen += tl.sum(eq.to(tl.int32), axis=0)
    return t, found, seen


@triton.jit
def _cutoff(src, vocab, temp, z_max, k, p, use_mass, bound, bound_from_total, bound_from_k, limit, scratch,
            BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr, MAX_PASSES: tl.constexpr):
    """One search, then the sorted candidates or the ties pass: ``(thr, icut, ties, t, above t, mass above t)``
    (the last four only from the ties pass; ``ties`` is -1 after a sort)."""
    a, above_a, t, above_t, mass_t, bound = _search(src, vocab, temp, z_max, k, p, use_mass, bound,
                                                    bound_from_total, limit, BLOCK, NP, MAX_PASSES)
    if above_a <= limit:
        thr, icut = _sorted_cutoff(src, vocab, temp, z_max, a, above_a, k, p, use_mass | bound_from_k, bound,
                                   bound_from_k, scratch, BLOCK, CAP)
        ties = tl.full((), -1, tl.int32)
    else:
        thr, icut, ties = _tie_cutoff(src, vocab, temp, z_max, t, above_t, mass_t, k, use_mass, bound, BLOCK)
    return thr, icut, ties, t, above_t, mass_t


@triton.jit(do_not_specialize=["vocab", "limit"],
            do_not_specialize_on_alignment=["ROWS", "ARGMAX", "TEMP", "TOP_K", "TOP_P", "THR", "ICUT"])
def _cutoff_kernel(LOGITS, stride_row, ROWS, ARGMAX, TEMP, TOP_K, TOP_P, SCRATCH, THR, ICUT, vocab, limit,
                   HAS_ARGMAX: tl.constexpr, BLOCK: tl.constexpr, NP: tl.constexpr, CAP: tl.constexpr,
                   MAX_PASSES: tl.constexpr):
    s = tl.program_id(0)
    row = tl.load(ROWS + s)
    temp = tl.load(TEMP + s)
    k_in = tl.load(TOP_K + s)
    p = tl.load(TOP_P + s)
    p = tl.where(p > 0.0, p, 1e-45)  # a top-p that rounds to 0 in fp32: the smallest positive (keeps one token)
    has_k = (k_in > 0) & (k_in < vocab)
    has_p = p < 1.0
    k = tl.where(has_k, k_in, vocab + 1).to(tl.int32)  # vocab + 1: the count never binds
    src = LOGITS + row.to(tl.int64) * stride_row
    scratch = SCRATCH + s.to(tl.int64) * CAP
    thr = tl.full((), float("-inf"), tl.float32)
    icut = tl.full((), 0, tl.int32) + vocab
    if has_k | has_p:
        if HAS_ARGMAX:  # the row's largest logit, divided as every z is (rounding keeps the order): max z
            z_max = tl.math.div_rn(tl.load(src + tl.load(ARGMAX + row)).to(tl.float32), temp)
        else:
            lanes = tl.full([BLOCK], float("-inf"), tl.float32)
            for start in range(0, vocab, BLOCK):
                idx, z = _row_block(src, start, vocab, temp, BLOCK)
                lanes = tl.maximum(lanes, z)
            z_max = tl.max(lanes, axis=0)
        dead = z_max == float("-inf")  # a row of -inf only: no mass; top-p keeps its first token alone
        z_max = tl.where(dead, 0.0, z_max)
        # Top-p alone: one search on the mass. Top-k (with or without top-p): a search on the count,
        # whose candidates hold all of top-k; if they were too many to sort, top-k's mass comes from
        # the ties pass and a second search finds top-p's cutoff within it.
        top_p_only = has_p & ~has_k
        zero = tl.full((), 0.0, tl.float64)
        thr, icut, ties, t, above_t, mass_t = _cutoff(src, vocab, temp, z_max, k, p, top_p_only, zero, top_p_only,
                                                      has_p & has_k, limit, scratch, BLOCK, NP, CAP, MAX_PASSES)
        if has_k & has_p & (ties >= 0):
            top_k_mass = mass_t + tl.minimum(ties, k - above_t).to(tl.int64) * _weight(t, z_max)
            bound = p.to(tl.float64) * top_k_mass.to(tl.float64)
            no = tl.full((), 0, tl.int1)
            thr, icut, ties, t, above_t, mass_t = _cutoff(src, vocab, temp, z_max, k, p, has_p, bound, no, no, limit,
                                                          scratch, BLOCK, NP, CAP, MAX_PASSES)
        icut = tl.where(dead & has_p, 0, icut)
        thr = tl.where(dead & has_p, float("-inf"), thr)
    tl.store(THR + s, thr)
    tl.store(ICUT + s, icut)


def row_cutoffs(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                top_p: torch.Tensor, argmax: torch.Tensor | None = None,
                limit: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`specdec.sampling.row_cutoffs` of ``logits[rows] / temperature``, without sorting a row.

    The same ``(thr, icut)`` keep-sets, bit for bit, as the torch reference (one stable sort of every
    top-p row, then exact fixed-point prefix masses, :func:`specdec.verify.nucleus_prefix`). One
    program per row finds the last kept token by a search on thresholds: a pass over the row
    counts, for ``CUT_PIVOTS`` thresholds at once, the tokens above each and their fixed-point mass
    (exact integers: the order of summation does not matter), then narrows to the two thresholds
    around the cutoff. Once at most ``limit`` tokens lie above the lower one (usually after the
    first pass: ``max - 32 .. max - 1``), those are gathered and sorted in registers; otherwise (a
    flat row, a large top-k) the search goes on to the exact value and a last pass places the
    cutoff among its ties. With the rows' argmax given (the step has it already), about three
    passes over the row in the usual case: the first search pass, maybe a second, the gathering.

    Args:
        logits: ``[n, vocab]`` logits, any float dtype, rows contiguous in the vocabulary.
        rows: ``[S]`` int64 row of ``logits`` per sampled row; temperature: ``[S]`` fp32 > 0.
        top_k: ``[S]`` int64, 0 or ``>= vocab`` = no limit; top_p: ``[S]`` fp32 in ``(0, 1]``.
        argmax: ``[n]`` int64 argmax of every row of ``logits`` (its maximum is then read, not searched
            for), or ``None``.
        limit: sort the candidates once at most this many remain (``<= CUT_CAP``, the default;
            0 never sorts: tests use it to run the exact search on every row).

    Returns:
        ``(thr [S] fp32, icut [S] int32)``; rows without limits get ``(-inf, vocab)``. No host
        synchronisation.
    """
    limit = CUT_CAP if limit is None else limit
    if not 0 <= limit <= CUT_CAP:
        raise ValueError(f"limit must be in [0, {CUT_CAP}], got {limit}")
    n_rows, vocab = rows.shape[0], logits.shape[-1]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    thr = torch.empty(n_rows, dtype=torch.float32, device=dev)
    icut = torch.empty(n_rows, dtype=torch.int32, device=dev)
    if n_rows == 0:
        return thr, icut
    scratch = torch.empty(n_rows, CUT_CAP, dtype=torch.int64, device=dev)
    _cutoff_kernel[(n_rows,)](logits, logits.stride(0), rows, argmax if argmax is not None else rows, temperature,
                              top_k, top_p, scratch, thr, icut, vocab, limit, HAS_ARGMAX=argmax is not None,
                              BLOCK=CUT_BLOCK, NP=CUT_PIVOTS, CAP=CUT_CAP, MAX_PASSES=CUT_MAX_PASSES,
                              num_warps=CUT_WARPS)
    return thr, icut
