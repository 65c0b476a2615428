"""Triton paged MLA decode / verify: the generation phase of an absorbed-MLA layer.

Absorbed MLA (docs/design.md §4): every query head attends over one latent "KV head"
whose rows hold ``latent`` values (also used as V) followed by ``rope`` values.
Queries are ``[num_tokens, H, latent + rope]``, the cache is the pool's K-only
layout ``[num_slots, 1, latent + rope]`` addressed through page tables
(``slot = page * tokens_per_block + offset``), the output is ``[num_tokens, H, latent]``.

Kernel design
-------------
Stage 1, ``_mla_stage1``, grid ``(row_blocks, num_splits, num_seqs)``:

* *rows*: the ``q_len * H`` query rows of one request (token-major: row
  ``r`` is verify token ``r // H``, head ``r % H``) are processed together,
  ``BLOCK_M`` rows per program. A program loads its rows' queries once, then
  walks KV tiles of ``BLOCK_N`` tokens (``BLOCK_N`` divides the page size, so a
  tile lies in one page: one page-table lookup per tile). Each tile is loaded
  once per program and used twice: ``[BLOCK_M, latent+rope] x [latent+rope, BLOCK_N]``
  for the scores and its latent part ``[BLOCK_N, latent]`` as V.
* *block sizes* (defaults; :class:`TritonMLAConfig` overrides each): ``BLOCK_M``
  = 16 / 32 / 64 for up to 16 / 32 / more rows (64 rows use Hopper wgmma, 8
  warps); ``BLOCK_N`` = 64 keys (32 for FP8 caches with fewer than 64 rows);
  two pipeline stages. A tile may span pages (one page-table lookup per key
  when ``BLOCK_N`` exceeds the page). ``bench/mla_decode.py --sweep`` times
  the alternatives on an H200.
* *KV reads*: each KV tile of a request is read by ``cdiv(q_len * H, BLOCK_M)``
  programs (the row blocks of that request): exactly once when
  ``q_len * H <= 64`` (H = 16 with ``q_len`` <= 4, H = 48/64 decode), else
  ``cdiv(q_len * H, 64)`` times (H = 96: 2/3/6/12 times for ``q_len`` 1/2/4/8;
  H = 128: 2/4/8/16). Row blocks are the fastest grid axis, so the programs
  sharing a tile run together and the repeats mostly hit L2; HBM sees about
  one read, L2 all of them.
* *causal*: query ``i`` of a request with ``q_len`` tokens and ``kv_len``
  cached tokens sees keys ``0 .. kv_len - q_len + i``. A program stops at the
  last key any of its rows can see.
* *split-KV*: the split count minimises a makespan model (:func:`choose_splits`:
  whole waves of resident programs x keys per split). The ``num_splits``
  programs of a (request, row block) each cover
  a chunk of ``cdiv(cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N`` tokens.
  With one split the program writes the final output; with several, each
  writes a normalised partial output and its log-sum-exp (base 2, fp32), and
  stage 2 (``_mla_merge``, grid ``(num_tokens, cdiv(H, 16))``) merges them exactly.
* *LSE out* (``attend(..., return_lse=True)``): the program writing the final output
  (stage 1 with one split, else the merge) also stores each row's log-sum-exp, natural
  log as :func:`~specdec.parallel.helix.combine_partials` takes it. One store; the
  default launch (no LSE) compiles without it.
* *Helix* (docs/design.md §7): the page table is the rank's own (logical page ``p`` is
  local page ``p // cp`` of rank ``p % cp``), so key ``k`` is the ``k``-th position the
  rank owns; the causal bound of each row and the keys of the request become counts of
  owned positions (``_owned``). A row that sees none of the rank's keys gets output 0
  and LSE ``-inf``. ``run`` then exchanges the partials by head and combines them
  (:func:`~specdec.parallel.helix.exchange_heads`), as ``helix_ref`` does.

Numerics: scores and the output accumulate in fp32 (``exp2`` online softmax).
KV tiles are converted to the query dtype before the dots (the torch reference
does the same), except FP8 E4M3 caches with bf16 queries, whose dots run in
fp16 by default (``fp8_dots``): E4M3 -> fp16 is exact and one hardware
conversion per two values (-> bf16 costs three, which made FP8 slower than
bf16); each query row is scaled by a power of two into fp16's range (exact for
every value >= 2^-10 of the row's largest) and its scores scaled back; P is
rounded to fp16 (finer than bf16). The per-tensor ``kv_scale`` is folded into
the score scale and applied once to the output.
fp32 queries (interpreter tests) use IEEE fp32 dots.

``supports`` states the limits; see :meth:`TritonMLABackend.supports`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.backends.triton_interp import interpreter_refusal, is_interpreted
from specdec.attention.mla_pack import MLAPlan, padded_page_tables, sm_count
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.errors import ConfigError
from specdec.parallel.helix import exchange_heads, gather_heads

TOKENS_PER_BLOCK = (16, 32, 64, 128)
# On the GPU only the configurations the launch heuristics were sized for (shared memory,
# registers; fp32 tiles would double both). fp32 exists for exact tests on the interpreter.
Q_DTYPES_GPU = ("bfloat16",)
KV_DTYPES_GPU = ("bfloat16", "float8_e4m3fn")
Q_DTYPES_CPU = ("float32", "bfloat16")
KV_DTYPES_CPU = ("float32", "bfloat16", "float8_e4m3fn")
LATENT_DIMS = (16, 32, 64, 128, 256, 512)  # tl.arange needs powers of two; tl.dot needs >= 16
ROPE_DIMS = (16, 32, 64)
MAX_Q_LEN = 16  # largest verify length the tests cover (the mask is generic; the claim is not)
# Validated on the GPU by tests/test_triton_mla.py::TestGPU. Add an arch only after that
# test class has passed on it (shared-memory budgets differ: sm86/89/120 have ~100 KB).
VALIDATED_SM = (90,)
# The Helix path (rank-local pages, LSE out) on the GPU, likewise: add an arch only after
# TestGPU::test_helix_shards_* has passed on it. It is checked on the interpreter meanwhile.
HELIX_VALIDATED_SM: tuple[int, ...] = (90,)  # TestGPU::test_helix_shards_* passed on the H200, 2026-12-05
FP8_MIN_SM = 89  # native e4m3 conversion

_LOG2E = 1.4426950408889634


@triton.jit
def _owned(n, cp, rank, TPB: tl.constexpr):
    """How many of positions ``[0, n)`` Helix rank ``rank`` of ``cp`` owns (page ``p`` -> rank ``p % cp``);
    ``n`` for ``cp == 1``. Also the rank-local index one past its last owned position below ``n``."""
    full = n // TPB
    owned_full = tl.maximum((full - rank + cp - 1) // cp, 0)  # pages p < full with p % cp == rank
    return owned_full * TPB + tl.where(full % cp == rank, n % TPB, 0)


@triton.jit
def _mla_stage1(
    Q,  # [num_tokens, H, LAT + ROPE]
    KV,  # [num_slots, 1, LAT + ROPE]
    Out,  # [num_tokens, H, LAT] (used when not SPLIT)
    OPart,  # [num_tokens, H, num_splits, LAT] fp32 (used when SPLIT)
    LsePart,  # [num_tokens, H, num_splits] fp32, log2 domain (used when SPLIT)
    Lse,  # [num_tokens, H] fp32, natural log (used when STORE_LSE and not SPLIT)
    PageTable,  # [num_seqs, max_pages] int32
    KvLens,  # [num_seqs] int32
    QStart,  # [num_seqs] int32
    QLens,  # [num_seqs] int32
    qk_scale,  # softmax scale * kv_scale * log2(e)
    v_scale,  # kv_scale
    num_heads,
    num_splits,
    cp,  # Helix ranks (used when HELIX)
    rank,  # this Helix rank (used when HELIX)
    stride_qt,
    stride_qh,
    stride_kv,
    stride_ot,
    stride_oh,
    stride_pt,
    LAT: tl.constexpr,
    ROPE: tl.constexpr,
    TPB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FP16_DOTS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    HELIX: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_s = tl.program_id(1)
    seq = tl.program_id(2)

    q_len = tl.load(QLens + seq)
    kv_len = tl.load(KvLens + seq)
    q_start = tl.load(QStart + seq)
    rows = q_len * num_heads
    if pid_m * BLOCK_M >= rows:  # a shorter request of the batch: no rows here
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # row within the request
    row_ok = offs_m < rows
    tok = offs_m // num_heads
    head = offs_m % num_heads
    last_key = kv_len - q_len + tok  # causal: row sees positions 0 .. last_key
    offs_lat = tl.arange(0, LAT)
    offs_rope = tl.arange(0, ROPE)
    offs_n = tl.arange(0, BLOCK_N)

    q_row = Q + (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh  # [BLOCK_M] pointers
    q_lat = tl.load(q_row[:, None] + offs_lat[None, :], mask=row_ok[:, None], other=0.0)
    q_rope = tl.load(q_row[:, None] + LAT + offs_rope[None, :], mask=row_ok[:, None], other=0.0)
    row_scale = tl.full([BLOCK_M], 1.0, tl.float32) * qk_scale  # score scale per row (log2 units)
    if FP16_DOTS:
        # FP8 cache: the dots run in fp16 (e4m3 -> fp16 is one hardware conversion per two values and
        # exact; e4m3 -> bf16 costs three). The queries move to fp16 exactly: each row is scaled by a
        # power of two that puts its largest |value| in [2^14, 2^15) (bf16 has 8 significant bits,
        # fp16 11, so every value >= 2^-10 of the row's largest is exact), and the scores are scaled back.
        amax = tl.maximum(tl.max(tl.abs(q_lat.to(tl.float32)), 1), tl.max(tl.abs(q_rope.to(tl.float32)), 1))
        expo = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127  # floor(log2(amax)); amax = 0: -127
        expo = tl.minimum(tl.maximum(tl.where(amax > 0.0, expo - 14, 0), -100), 100)
        up = (127 - expo).to(tl.int32) << 23  # 2^-expo as fp32 bits (normal: |expo| <= 100)
        down = (127 + expo).to(tl.int32) << 23  # 2^expo
        q_lat = (q_lat.to(tl.float32) * up.to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        q_rope = (q_rope.to(tl.float32) * up.to(tl.float32, bitcast=True)[:, None]).to(tl.float16)
        row_scale = row_scale * down.to(tl.float32, bitcast=True)
    dot_dtype = q_lat.dtype

    # Keys are indexed through the page table. Unsharded, key k is position k. Under Helix the page
    # table holds this rank's pages only: key k is the k-th position it owns, positions grow with k,
    # and a row sees the keys below the count of owned positions up to its own.
    last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // num_heads, q_len - 1)
    if HELIX:
        n_keys = _owned(kv_len, cp, rank, TPB)
        row_end = _owned(last_key + 1, cp, rank, TPB)  # [BLOCK_M]: the row sees keys < row_end
        stop = _owned(kv_len - q_len + last_tok + 1, cp, rank, TPB)
    else:
        n_keys = kv_len
        row_end = last_key + 1
        stop = kv_len - q_len + last_tok + 1
    # This program's keys: its split's chunk, cut at the last key any of its rows sees.
    chunk = tl.cdiv(tl.cdiv(n_keys, num_splits), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(tl.minimum(lo + chunk, n_keys), stop)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, LAT], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        keys = start + offs_n
        key_ok = keys < n_keys  # never read past the request's cache: pad slots may hold NaN
        if BLOCK_N <= TPB:  # the tile lies in one page: one page-table lookup
            page = tl.load(PageTable + seq * stride_pt + start // TPB).to(tl.int64)
            slot = page * TPB + (start % TPB) + offs_n  # [BLOCK_N]
        else:  # the tile spans BLOCK_N // TPB pages: a page per key
            page = tl.load(PageTable + seq * stride_pt + keys // TPB, mask=key_ok, other=0).to(tl.int64)
            slot = page * TPB + keys % TPB
        kv_row = KV + slot * stride_kv
        k_lat = tl.load(kv_row[:, None] + offs_lat[None, :], mask=key_ok[:, None], other=0.0).to(dot_dtype)
        k_rope = tl.load(kv_row[:, None] + LAT + offs_rope[None, :], mask=key_ok[:, None], other=0.0).to(dot_dtype)

        s = tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PRECISION)
        s = tl.dot(q_lat, tl.trans(k_lat), s, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] fp32
        s = tl.where(keys[None, :] < row_end[:, None], s * row_scale[:, None], float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(dot_dtype), k_lat, acc, input_precision=DOT_PRECISION)  # V = latent part
        m_i = m_new

    acc = acc * v_scale
    t_row = (q_start + tok).to(tl.int64)
    if SPLIT:
        empty = l_i == 0.0  # no visible key in this chunk
        l_safe = tl.where(empty, 1.0, l_i)
        lse = tl.where(empty, float("-inf"), m_i + tl.log2(l_safe))
        part = (t_row * num_heads + head) * num_splits + pid_s  # [BLOCK_M]
        tl.store(LsePart + part, lse, mask=row_ok)
        tl.store(OPart + part[:, None] * LAT + offs_lat[None, :], acc / l_safe[:, None], mask=row_ok[:, None])
    else:
        # Unsharded, one split sees key 0, which every row may attend to, so l_i > 0. A Helix rank
        # may own no key a row sees: output 0, LSE -inf.
        if HELIX:
            empty = l_i == 0.0
            l_i = tl.where(empty, 1.0, l_i)
        o = acc / l_i[:, None]
        o_ptr = Out + t_row * stride_ot + head * stride_oh
        tl.store(o_ptr[:, None] + offs_lat[None, :], o.to(Out.dtype.element_ty), mask=row_ok[:, None])
        if STORE_LSE:
            lse = (m_i + tl.log2(l_i)) * 0.6931471805599453  # log2 -> natural log
            if HELIX:
                lse = tl.where(empty, float("-inf"), lse)
            tl.store(Lse + t_row * num_heads + head, lse, mask=row_ok)


@triton.jit
def _mla_merge(
    OPart,  # [num_tokens, H, num_splits, LAT] fp32
    LsePart,  # [num_tokens, H, num_splits] fp32, log2 domain
    Out,  # [num_tokens, H, LAT]
    Lse,  # [num_tokens, H] fp32, natural log (used when STORE_LSE)
    num_heads,
    num_splits,
    stride_ot,
    stride_oh,
    LAT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    STORE_LSE: tl.constexpr,
    SKIP_EMPTY: tl.constexpr = False,  # a split with lse = -inf adds nothing, whatever its partial holds
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < num_heads
    offs_d = tl.arange(0, LAT)
    part = (t * num_heads + heads) * num_splits  # [BLOCK_H], split 0
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LAT], dtype=tl.float32)
    for s in range(num_splits):  # online merge; an empty split has lse = -inf and weight 0
        lse = tl.load(LsePart + part + s, mask=head_ok, other=float("-inf"))
        o = tl.load(OPart + (part + s)[:, None] * LAT + offs_d[None, :], mask=head_ok[:, None], other=0.0)
        if SKIP_EMPTY:  # the split saw no key: its partial is ignored (w = 0 times a NaN or inf is NaN)
            o = tl.where((lse == float("-inf"))[:, None], 0.0, o)
        m_new = tl.maximum(m, lse)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * alpha[:, None] + w[:, None] * o
        total = total * alpha + w
        m = m_new
    # Unsharded, total > 0 for every real row: the split holding key 0 is visible to all of them.
    # Padding heads, and under Helix a row that sees none of this rank's keys, have total = 0:
    # output 0, LSE -inf.
    empty = total == 0.0
    total = tl.where(empty, 1.0, total)
    o_ptr = Out + t * stride_ot + heads * stride_oh
    tl.store(o_ptr[:, None] + offs_d[None, :], (acc / total[:, None]).to(Out.dtype.element_ty), mask=head_ok[:, None])
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), (m + tl.log2(total)) * 0.6931471805599453)  # natural log
        tl.store(Lse + t * num_heads + heads, lse, mask=head_ok)


# Triton decides at decoration time whether a kernel is compiled or interpreted
# (TRITON_INTERPRET=1 at import); fixed for the life of the module.
INTERPRET: bool = is_interpreted(_mla_stage1)


def merge_split_partials(o_part: torch.Tensor, lse2_part: torch.Tensor, num_tokens: int, num_heads: int,
                         out_dtype: torch.dtype, *, with_lse: bool = True
                         ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Merge another kernel's split-KV partials in one launch of :func:`_mla_merge` (``cute_mla``'s).

    Args:
        o_part: ``[num_tokens * num_heads * splits, Dv]`` fp32, row ``(t * H + h) * splits + s``:
            split ``s``'s output normalised over its own keys; ignored (whatever it holds, NaN
            included) where that split saw no key.
        lse2_part: ``[num_tokens * num_heads * splits]`` fp32, base-2 log-sum-exp; ``-inf`` where
            the split saw no key.
        out_dtype: the merged output's dtype.
        with_lse: also return the natural-log LSE.

    Returns:
        ``(out [num_tokens, num_heads, Dv] out_dtype, lse [num_tokens, num_heads] fp32 or None)``;
        a row no split saw gets ``out = 0`` and ``lse = -inf``. The same merge as
        :func:`specdec.attention.mla_pack.merge_partials` up to fp32 rounding (an online merge over
        the splits in order, not a max first), for partials as a kernel writes them.
    """
    rows = num_tokens * num_heads
    dv = o_part.shape[-1]
    if o_part.dtype != torch.float32 or lse2_part.dtype != torch.float32:
        raise ValueError(f"merge_split_partials: fp32 partials, got {o_part.dtype} / {lse2_part.dtype}")
    if not (o_part.is_contiguous() and lse2_part.is_contiguous()):
        raise ValueError("merge_split_partials: the partials must be contiguous (rows are indexed, not strided)")
    if rows == 0:
        out = torch.empty(num_tokens, num_heads, dv, dtype=out_dtype, device=o_part.device)
        return out, (torch.empty(num_tokens, num_heads, device=o_part.device) if with_lse else None)
    if o_part.numel() % (rows * dv) or lse2_part.numel() * dv != o_part.numel():
        raise ValueError(f"merge_split_partials: o_part {tuple(o_part.shape)} / lse2_part {tuple(lse2_part.shape)} "
                         f"do not hold {num_tokens} x {num_heads} rows of splits")
    if dv & (dv - 1):
        raise ValueError(f"merge_split_partials: the value width must be a power of two, got {dv}")
    splits = lse2_part.numel() // rows
    out = torch.empty(num_tokens, num_heads, dv, dtype=out_dtype, device=o_part.device)
    lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=o_part.device) if with_lse else out
    block_h = min(16, triton.next_power_of_2(num_heads))
    _mla_merge[(num_tokens, triton.cdiv(num_heads, block_h))](
        o_part, lse2_part, out, lse, num_heads, splits, out.stride(0), out.stride(1),
        LAT=dv, BLOCK_H=block_h, STORE_LSE=with_lse, SKIP_EMPTY=True, num_warps=4,
    )  # fmt: skip
    return out, (lse if with_lse else None)


@dataclass(frozen=True, slots=True)
class TritonMLAConfig:
    """Launch choices of :class:`TritonMLABackend` (speed only; never correctness).

    ``None`` fields are chosen per launch by :meth:`TritonMLABackend.launch_config`
    from the query rows of a request (``rows = max_q_len * H``) and the cache dtype.

    Attributes:
        num_splits: fixed KV splits per request; ``None``: the split count that
            minimises the modelled makespan (:func:`choose_splits`).
        min_split_tokens: automatic splitting keeps at least this many keys per split.
        max_splits: automatic splitting uses at most this many splits.
        ctas_per_sm: stage-1 programs resident per SM, for the makespan model;
            ``None``: :func:`resident_ctas` (shared-memory estimate).
        block_m: query rows per program (16, 32 or 64); ``None``: 16 / 32 / 64
            for up to 16 / 32 / more rows.
        block_n: KV tokens per tile (16..128, any page size); ``None``: 64.
        num_warps: ``None``: 4 for ``block_m = 16``, else 8.
        num_stages: software-pipelining depth of the KV loop; ``None``: 2.
        fp8_dots: with an FP8 cache and bf16 queries, the dtype of the dots:
            ``"fp16"`` (cache and queries converted exactly, see the kernel) or
            ``"bf16"`` (the cache converted to bf16, three conversions per two values).
    """

    num_splits: int | None = None
    min_split_tokens: int = 256
    max_splits: int = 64
    ctas_per_sm: int | None = None
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    fp8_dots: str = "fp16"

    def __post_init__(self) -> None:
        if self.num_splits is not None and self.num_splits < 1:
            raise ConfigError(f"TritonMLAConfig.num_splits must be >= 1 or None, got {self.num_splits}")
        if self.min_split_tokens < 1:
            raise ConfigError(f"TritonMLAConfig.min_split_tokens must be >= 1, got {self.min_split_tokens}")
        if self.max_splits < 1:
            raise ConfigError(f"TritonMLAConfig.max_splits must be >= 1, got {self.max_splits}")
        if self.ctas_per_sm is not None and not 1 <= self.ctas_per_sm <= 32:
            raise ConfigError(f"TritonMLAConfig.ctas_per_sm must be in 1..32 or None, got {self.ctas_per_sm}")
        if self.block_m is not None and self.block_m not in (16, 32, 64):
            raise ConfigError(f"TritonMLAConfig.block_m must be 16, 32 or 64, got {self.block_m}")
        if self.block_n is not None and self.block_n not in (16, 32, 64, 128):
            raise ConfigError(f"TritonMLAConfig.block_n must be 16, 32, 64 or 128, got {self.block_n}")
        if self.num_warps is not None and self.num_warps not in (1, 2, 4, 8, 16):
            raise ConfigError(f"TritonMLAConfig.num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ConfigError(f"TritonMLAConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.fp8_dots not in ("fp16", "bf16"):
            raise ConfigError(f"TritonMLAConfig.fp8_dots must be 'fp16' or 'bf16', got {self.fp8_dots!r}")


@dataclass(frozen=True, slots=True)
class TritonMLALaunch:
    """Resolved launch parameters of one ``run`` (see :meth:`TritonMLABackend.launch_config`)."""

    block_m: int
    block_n: int
    row_blocks: int
    num_splits: int
    num_warps: int
    num_stages: int
    fp16_dots: bool


def resident_ctas(block_m: int, block_n: int, num_stages: int, kv_bytes: int, num_warps: int = 4,
                  latent: int = 512, rope: int = 64, smem: int = 227 * 1024) -> int:
    """Stage-1 programs an SM holds at once, from a shared-memory estimate (sm90: 227 KB per SM).

    Fitted to offline sm90 compiles (512 + 64, ``ptxas``): 64-row blocks (wgmma) keep the
    queries and ``num_stages`` KV tiles in shared memory (bf16 32 keys x 2 stages: 147 KB;
    64 x 2: 221 KB); smaller blocks about ``num_stages - 1`` tiles + 20 KB (bf16 16 rows,
    32 keys: 56 KB; 64 keys: 94 KB), plus a 16-bit copy of an FP8 tile. Registers (180..255
    per thread) allow 2 programs of 4 warps, 1 of 8.
    """
    d = latent + rope
    tile = block_n * d * kv_bytes
    if block_m >= 64:
        need = num_stages * tile + block_m * d * 2
    else:
        need = max(1, num_stages - 1) * tile + (block_n * d * 2 if kv_bytes != 2 else 0) + 20 * 1024
    return max(1, min(2 if num_warps <= 4 else 1, smem // max(need, 1)))


def choose_splits(num_seqs: int, row_blocks: int, max_kv_len: int, slots: int, *, min_split_tokens: int,
                  max_splits: int, block_n: int, overhead_tokens: int = 128) -> int:
    """Split count minimising the modelled makespan of stage 1.

    ``slots`` programs run at once; a split of ``c`` keys costs ``c + overhead_tokens``
    (queries loaded, partials written and merged). The makespan of ``s`` splits is
    ``ceil(num_seqs * row_blocks * s / slots) * (ceil(max_kv_len / s) + overhead_tokens)``:
    it counts the partial last wave that a fixed ``programs = waves * SMs`` target ignores.
    Ties go to fewer splits (less merge traffic).
    """
    cap = max(1, min(max_splits, max_kv_len // min_split_tokens))
    best, best_cost = 1, None
    for s in range(1, cap + 1):
        chunk = -(-(-(-max_kv_len // s)) // block_n) * block_n
        cost = -(-(num_seqs * row_blocks * s) // slots) * (chunk + overhead_tokens)
        if best_cost is None or cost < best_cost:
            best, best_cost = s, cost
    return best


TritonMLAPlan = MLAPlan  # the plan both paged MLA backends build (specdec.attention.mla_pack)


class TritonMLABackend(AttentionBackend):
    """Paged absorbed-MLA attention for decode and multi-token verify, in Triton."""

    name = "triton_mla"

    def __init__(self, config: TritonMLAConfig | None = None):
        self.config = config or TritonMLAConfig()

    @staticmethod
    def _num_sms(device: torch.device) -> int:
        return sm_count(device, off_cuda=1)  # the interpreter runs one program at a time

    # ------------------------------------------------------------------ supports / cost

    def supports(self, shape: AttnShape) -> Verdict:
        """Whether the kernels compute ``shape`` correctly.

        Limits: ``kind == "mla"`` (the pool's K-only latent layout, one KV head,
        V = the latent part of K); ``phase == "generation"`` (mixed or not);
        ``max_q_len <= 16``; any head count (under Helix, ``helix_cp > 1``: divisible
        by ``helix_cp``, for the exchange by head); latent ``v_head_dim`` in
        16..512 and rope ``head_dim - v_head_dim`` in 16..64, powers of two;
        pages of 16/32/64/128 tokens; device cuda at a validated
        arch (sm90; under Helix one of ``HELIX_VALIDATED_SM``) with q bf16 and KV bf16 or FP8 E4M3; or cpu (q fp32/bf16,
        KV fp32/bf16/FP8) only when the kernels were decorated under
        ``TRITON_INTERPRET=1`` and that interpreter computes them right
        (:func:`~specdec.attention.backends.triton_interp.interpreter_refusal`:
        runtime loop bounds always; bf16 ``tl.dot`` for bf16 queries).
        """
        if shape.kind != "mla":
            return no(f"kind must be 'mla' (latent cache), got {shape.kind!r}")
        if shape.phase != "generation":
            return no(f"phase must be 'generation' (decode/verify), got {shape.phase!r}")
        if shape.num_kv_heads != 1:
            return no(f"num_kv_heads must be 1 (one latent head), got {shape.num_kv_heads}")
        if shape.num_heads % shape.helix_cp:
            return no(f"Helix exchanges partials by head: num_heads ({shape.num_heads}) must be divisible by "
                      f"helix_cp ({shape.helix_cp})")
        if shape.max_q_len > MAX_Q_LEN:
            return no(f"max_q_len must be <= {MAX_Q_LEN}, got {shape.max_q_len}")
        latent, rope = shape.v_head_dim, shape.head_dim - shape.v_head_dim
        if latent not in LATENT_DIMS:
            return no(f"v_head_dim (latent) must be one of {LATENT_DIMS}, got {latent}")
        if rope not in ROPE_DIMS:
            return no(f"head_dim - v_head_dim (rope) must be one of {ROPE_DIMS}, got {shape.head_dim} - {latent}")
        if shape.tokens_per_block not in TOKENS_PER_BLOCK:
            return no(f"tokens_per_block must be one of {TOKENS_PER_BLOCK}, got {shape.tokens_per_block}")
        if INTERPRET:
            if shape.q_dtype not in Q_DTYPES_CPU:
                return no(f"q_dtype must be one of {Q_DTYPES_CPU} on the interpreter, got {shape.q_dtype}")
            if shape.kv_dtype not in KV_DTYPES_CPU:
                return no(f"kv_dtype must be one of {KV_DTYPES_CPU} on the interpreter, got {shape.kv_dtype}")
            if shape.device != "cpu":
                return no(f"kernels were decorated under TRITON_INTERPRET=1: cpu only, got {shape.device}")
            refusal = interpreter_refusal(loops=True, bf16_dot=shape.q_dtype == "bfloat16")
            if refusal:
                return no(refusal)
            return YES
        if shape.device != "cuda":
            return no(f"device must be cuda (cpu only under TRITON_INTERPRET=1 at import), got {shape.device}")
        if shape.q_dtype not in Q_DTYPES_GPU:
            return no(f"q_dtype must be one of {Q_DTYPES_GPU} on the GPU, got {shape.q_dtype}")
        if shape.kv_dtype not in KV_DTYPES_GPU:
            return no(f"kv_dtype must be one of {KV_DTYPES_GPU} on the GPU, got {shape.kv_dtype}")
        if shape.sm not in VALIDATED_SM:
            return no(f"GPU arch sm={shape.sm} not validated (validated: {VALIDATED_SM})")
        if shape.kv_dtype == "float8_e4m3fn" and shape.sm < FP8_MIN_SM:
            return no(f"FP8 E4M3 cache needs sm >= {FP8_MIN_SM}, got sm={shape.sm}")
        if shape.helix_cp > 1 and shape.sm not in HELIX_VALIDATED_SM:
            return no(f"Helix on sm={shape.sm} not validated yet (validated: {HELIX_VALIDATED_SM}; "
                      "gate: tests/test_triton_mla.py::TestGPU::test_helix_shards_*)")
        return YES

    def cost(self, shape: AttnShape) -> float:
        # Fast on the GPU; the CPU interpreter is far slower than the reference, so used there only when requested.
        return 10.0 if shape.device == "cuda" else 1000.0

    # ------------------------------------------------------------------ plan / run

    def plan(self, batch: PhaseBatch) -> TritonMLAPlan:
        """Upload the phase's page tables and lengths (the launch is chosen per layer by ``run``).

        Under Helix (``batch.shard`` with ``cp > 1``) the page tables are the rank's own and
        ``kv_lens`` global; a request needs only the pages of the positions the rank owns.
        """
        tpb, dev = batch.tokens_per_block, batch.device
        if tpb not in TOKENS_PER_BLOCK:
            raise ValueError(f"triton_mla: tokens_per_block must be one of {TOKENS_PER_BLOCK}, got {tpb}")
        shard = batch.shard if batch.shard is not None and batch.shard.cp > 1 else None
        if shard is not None and shard.layout.tokens_per_block != tpb:
            raise ValueError(f"triton_mla: the Helix layout's pages hold {shard.layout.tokens_per_block} tokens, "
                             f"the batch's {tpb}")
        num_seqs = len(batch.q_lens)
        keys = batch.kv_lens if shard is None else [shard.layout.local_length(kv, shard.rank) for kv in batch.kv_lens]
        page_table, q_lens, q_start = padded_page_tables("triton_mla", batch.q_lens, batch.kv_lens, keys,
                                                         batch.page_tables, tpb, dev)
        return TritonMLAPlan(
            page_table=page_table,
            kv_lens=torch.tensor(batch.kv_lens, dtype=torch.int32).to(dev),
            q_start=q_start,
            q_lens=q_lens,
            num_seqs=num_seqs,
            num_tokens=batch.num_tokens,
            max_q_len=max(batch.q_lens),
            max_kv_len=max(keys),
            tokens_per_block=tpb,
            num_sms=self._num_sms(dev),
            shard=shard,
        )

    def launch_config(self, plan: TritonMLAPlan, num_heads: int, *, kv_bytes: int = 2,
                      fp8_with_bf16_q: bool = False) -> TritonMLALaunch:
        """The launch for ``num_heads`` query heads over a cache of ``kv_bytes`` bytes per value.

        Host integers only (no device synchronisation). ``fp8_with_bf16_q``: an FP8 cache read
        by bf16 queries, where ``config.fp8_dots`` picks the dot dtype.
        """
        cfg = self.config
        rows = plan.max_q_len * num_heads
        block_m = cfg.block_m or (16 if rows <= 16 else 32 if rows <= 32 else 64)
        # Offline sm90 compiles (512 + 64, ptxas): bf16 16 rows x 64 keys x 4 warps: 189 registers, 94 KB;
        # FP8 16 rows: 32 keys x 8 warps, 214 registers (4 warps spill); 64 rows: 8 warps, 64 keys (221 KB bf16).
        fp8_small = kv_bytes == 1 and block_m < 64
        block_n = cfg.block_n or (32 if fp8_small else 64)
        num_warps = cfg.num_warps or (4 if block_m <= 16 and not fp8_small else 8)
        num_stages = cfg.num_stages or 2
        row_blocks = triton.cdiv(rows, block_m)
        if cfg.num_splits is not None:
            splits = cfg.num_splits
        else:
            ctas = cfg.ctas_per_sm or resident_ctas(block_m, block_n, num_stages, kv_bytes, num_warps)
            splits = choose_splits(plan.num_seqs, row_blocks, plan.max_kv_len, plan.num_sms * ctas,
                                   min_split_tokens=cfg.min_split_tokens, max_splits=cfg.max_splits, block_n=block_n)
        return TritonMLALaunch(block_m, block_n, row_blocks, splits, num_warps, num_stages,
                               fp8_with_bf16_q and cfg.fp8_dots == "fp16")

    def run(
        self,
        plan: TritonMLAPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        scale: float,
        v_head_dim: int,
        *,
        kv_scale: float = 1.0,
        local_heads: bool = False,
    ) -> torch.Tensor:
        """Attend the phase's queries over the latent cache.

        Unsharded: one :meth:`attend`. Under Helix (a plan with a shard) every rank of the
        group must call this for the same phase: each attends over its own pages, the partials
        and their LSEs are exchanged by head and combined exactly
        (:func:`~specdec.parallel.helix.exchange_heads`), and the heads gathered back (with
        ``local_heads``: not gathered; the rank's head slice ``[T, H / cp, latent]`` is returned,
        for a head-parallel output projection).

        Args:
            plan: from :meth:`plan`.
            q: ``[num_tokens, H, latent + rope]``, bf16 or fp32.
            k_cache: ``[num_slots, 1, latent + rope]`` latent cache (bf16, fp32 or FP8 E4M3).
            v_cache: must be ``None`` (V is the latent part of the cache).
            scale: softmax scale (e.g. ``mscale**2 / sqrt(128 + 64)``), explicit.
            v_head_dim: latent width.
            kv_scale: per-tensor dequantisation scale of the cache (``k = k_cache * kv_scale``).

        Returns:
            ``[num_tokens, H, latent]`` in ``q``'s dtype.

        Raises:
            ValueError: a separate ``v_cache``, or shapes that do not match the plan.
        """
        if v_cache is not None:
            raise ValueError("triton_mla reads V from the latent cache; v_cache must be None")
        if plan.shard is None:
            return self.attend(plan, q, k_cache, scale, v_head_dim, kv_scale=kv_scale)
        # fp32 partials, as helix_ref's: the combine adds no rounding step.
        out, lse = self.attend(plan, q, k_cache, scale, v_head_dim, kv_scale=kv_scale, return_lse=True,
                               out_dtype=torch.float32)  # [T, H, Dv], [T, H]
        head_slice = exchange_heads(out, lse, plan.shard.group).to(q.dtype)  # [T, H / cp, Dv]
        return head_slice if local_heads else gather_heads(head_slice, plan.shard.group)  # [T, H/cp or H, Dv]

    def attend(
        self,
        plan: TritonMLAPlan,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        scale: float,
        v_head_dim: int,
        *,
        kv_scale: float = 1.0,
        return_lse: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Launch the kernels over the pages of ``plan`` (under Helix: this rank's, a partial result).

        Args:
            plan: from :meth:`plan`.
            q: ``[num_tokens, H, latent + rope]``, bf16 or fp32.
            k_cache: ``[num_slots, 1, latent + rope]`` latent cache (bf16, fp32 or FP8 E4M3).
            scale: softmax scale, explicit.
            v_head_dim: latent width.
            kv_scale: per-tensor dequantisation scale of the cache.
            return_lse: also return each row's log-sum-exp (one more store; nothing else changes).
            out_dtype: dtype of the output; ``None``: ``q``'s.

        Returns:
            ``out`` ``[num_tokens, H, latent]`` normalised over the keys attended, or with
            ``return_lse`` ``(out, lse)``, ``lse`` ``[num_tokens, H]`` fp32: the natural-log
            log-sum-exp of the scaled scores (``scale * kv_scale * q . k``), as
            :func:`~specdec.parallel.helix.mla_attention_lse` and
            :func:`~specdec.parallel.helix.combine_partials` use. A row that sees no key (under
            Helix: none of this rank's) has ``out = 0`` and ``lse = -inf``.

        Raises:
            ValueError: shapes that do not match the plan.
        """
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens != plan.num_tokens or k_cache.shape[1:] != (1, head_dim):
            raise ValueError(
                f"triton_mla: q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)} do not match the plan "
                f"({plan.num_tokens} tokens, one latent head of width {head_dim})"
            )
        if q.stride(-1) != 1:
            q = q.contiguous()
        if k_cache.stride(-1) != 1:
            raise ValueError("triton_mla: k_cache must be contiguous in its last dimension")
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        launch = self.launch_config(plan, num_heads, kv_bytes=k_cache.element_size(),
                                    fp8_with_bf16_q=fp8 and q.dtype == torch.bfloat16)
        splits = launch.num_splits
        out = torch.empty(num_tokens, num_heads, v_head_dim, dtype=out_dtype or q.dtype, device=q.device)
        lse = torch.empty(num_tokens, num_heads, dtype=torch.float32, device=q.device) if return_lse else out
        if splits > 1:
            o_part = torch.empty(num_tokens, num_heads, splits, v_head_dim, dtype=torch.float32, device=q.device)
            lse_part = torch.empty(num_tokens, num_heads, splits, dtype=torch.float32, device=q.device)
        else:
            o_part = lse_part = out  # unused
        cp, rank = (plan.shard.cp, plan.shard.rank) if plan.shard is not None else (1, 0)
        _mla_stage1[(launch.row_blocks, splits, plan.num_seqs)](
            q, k_cache, out, o_part, lse_part, lse,
            plan.page_table, plan.kv_lens, plan.q_start, plan.q_lens,
            scale * kv_scale * _LOG2E, kv_scale,
            num_heads, splits, cp, rank,
            q.stride(0), q.stride(1), k_cache.stride(0), out.stride(0), out.stride(1), plan.page_table.stride(0),
            LAT=v_head_dim,
            ROPE=head_dim - v_head_dim,
            TPB=plan.tokens_per_block,
            BLOCK_M=launch.block_m,
            BLOCK_N=launch.block_n,
            SPLIT=splits > 1,
            DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
            FP16_DOTS=launch.fp16_dots,
            STORE_LSE=return_lse,
            HELIX=plan.shard is not None,
            num_warps=launch.num_warps,
            num_stages=launch.num_stages,
        )  # fmt: skip
        if splits > 1:
            block_h = min(16, triton.next_power_of_2(num_heads))
            _mla_merge[(num_tokens, triton.cdiv(num_heads, block_h))](
                o_part, lse_part, out, lse, num_heads, splits, out.stride(0), out.stride(1),
                LAT=v_head_dim, BLOCK_H=block_h, STORE_LSE=return_lse, num_warps=4,
            )  # fmt: skip
        return (out, lse) if return_lse else out
