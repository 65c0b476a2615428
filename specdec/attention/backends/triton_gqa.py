"""Paged GQA attention in Triton for Llama-family targets (docs/design.md §4).

One kernel serves every phase: decode (1 query token per request), verify
(1 + k tokens, causal among the draft tokens), the generation part of a mixed
batch, and context (prompt) phases.

Work decomposition. The query rows of one (request, KV head) are the
``q_len × group`` pairs (token, query head of the group), row ``r`` being token
``r // group``, head ``kv_head * group + r % group``. A program takes up to
``BLOCK_M`` of these rows (128 for fp16/bf16), so in decode and verify one
program holds *all* rows of its (request, KV head) and each K/V tile is read
once for the whole group and every draft token (the step is memory-bound);
context phases and fp32 (16-row blocks) use several row blocks, each stopping
at its causal diagonal. Long contexts are cut
into ``num_splits`` KV ranges (split-KV / flash-decoding) when there are too
few (request, KV head) programs to fill the GPU; each split writes its partial
output with its log-sum-exp and a second kernel merges them exactly.

Grid: ``(num_seqs * m_blocks, num_kv_heads, num_splits)``. Inside a program:
online softmax in base 2 with fp32 statistics and accumulator; scores with
``input_precision="ieee"`` for fp32 caches (no TF32), fp16/bf16 tensor-core
dots otherwise. Pages are read through the request's page table (page size is
a ``constexpr``; ``slot = page * tokens_per_block + offset``).

``plan`` packs the step's per-request metadata into one int32 device tensor
(one host-to-device copy per step, shared by every layer); ``run`` only
computes launch parameters from host integers and launches, so it does no
host-device synchronisation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.backends.triton_interp import interpreter_refusal, is_interpreted
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.config import AttentionConfig
from specdec.errors import ConfigError
from specdec.graphs import split_chunk
from specdec.pdl import pdl_enter, pdl_level

DTYPES = ("float16", "bfloat16", "float32")
MAX_HEAD_DIM = 256
MAX_TOKENS_PER_BLOCK = 256  # EngineConfig's largest page
MIN_SM = 80  # bf16 tensor-core dots
# Eager phases of at most this many tokens (default of TritonGQABackend.fixed_split_max_tokens)
# split the KV at the fixed offsets graph steps use
# (graphs.split_chunk), so a row gets the same bits whether its step ran eagerly or from a graph
# (prompt graphs, mixed steps). Above it the splits stay balanced: the fixed ones' partial
# outputs (tokens x heads x splits x v_dim fp32) would grow with the step.
FIXED_SPLIT_MAX_TOKENS = 512


@triton.jit
def _gqa_attn_kernel(
    Q, K, V, O, O_PART, LSE_PART, META,
    stride_meta,
    stride_qt, stride_qh, stride_qd,
    stride_ks, stride_kh, stride_kd,
    stride_vs, stride_vh, stride_vd,
    stride_ot, stride_oh, stride_od,
    num_heads, m_blocks, qk_scale, v_scale, split_chunk,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)  # programmatic dependent launch: wait for the kernel that wrote Q and the cache
    pid = tl.program_id(0)
    seq = pid // m_blocks
    m_block = pid % m_blocks
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # META row: kv_len, q_len, q_start, page ids ...
    meta = META + seq * stride_meta
    kv_len = tl.load(meta)
    q_len = tl.load(meta + 1)
    q_start = tl.load(meta + 2)
    row0 = m_block * BLOCK_M
    if row0 >= q_len * GROUP:
        return

    rows = row0 + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < q_len * GROUP
    tok = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    d_ok = d < HEAD_DIM
    dv_ok = dv < V_DIM

    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    # Query token t (of q_len) sits at position kv_len - q_len + t and sees keys 0 .. that position.
    last_visible = kv_len - q_len + tok  # [BLOCK_M]
    last_tok = tl.minimum((row0 + BLOCK_M - 1) // GROUP, q_len - 1)
    end = kv_len - q_len + last_tok + 1  # no row of this block sees past it
    # Per request: balanced chunks; or a fixed chunk (a multiple of BLOCK_N) so that which keys a
    # split holds, hence the summation order, does not depend on kv_len (batch-invariant steps).
    chunk = ((kv_len + NUM_SPLITS - 1) // NUM_SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    if split_chunk > 0:
        chunk = split_chunk
    lo = split * chunk
    hi = tl.minimum(lo + chunk, end)

    # Finite start: alpha = exp2(m_i - m_new) stays finite when a row sees no key in a tile or split.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = K + kv_head * stride_kh
    v_base = V + kv_head * stride_vh
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n  # [BLOCK_N]
        pos_ok = pos < hi
        page = tl.load(meta + 3 + pos // PAGE, mask=pos_ok, other=0)
        slot = page.to(tl.int64) * PAGE + pos % PAGE
        k = tl.load(k_base + slot[:, None] * stride_ks + d[None, :] * stride_kd,
                    mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_D]
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [BLOCK_M, BLOCK_N], log2 units
        visible = pos_ok[None, :] & (pos[None, :] <= last_visible[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + slot[:, None] * stride_vs + dv[None, :] * stride_vd,
                    mask=pos_ok[:, None] & dv_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    out_mask = row_ok[:, None] & dv_ok[None, :]
    if NUM_SPLITS == 1:
        tl.store(O + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :] * stride_od,
                 out.to(O.dtype.element_ty), mask=out_mask)
    else:
        # Partials: O_PART [num_tokens, num_heads, NUM_SPLITS, V_DIM], LSE_PART [num_tokens, num_heads, NUM_SPLITS].
        part = (q_rows * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(O_PART + part[:, None] * V_DIM + dv[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # -inf: saw nothing
        tl.store(LSE_PART + part, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    O, O_PART, LSE_PART,
    stride_ot, stride_oh, stride_od,
    num_heads,
    NUM_SPLITS: tl.constexpr,
    V_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    part = (tok * num_heads + head) * NUM_SPLITS
    s = tl.arange(0, BLOCK_S)
    dv = tl.arange(0, BLOCK_DV)
    s_ok = s < NUM_SPLITS
    lse = tl.load(LSE_PART + part + s, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
    # Split 0 always holds key 0, which every query sees, so the max is finite.
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(O_PART + (part + s)[:, None] * V_DIM + dv[None, :],
                mask=s_ok[:, None] & (dv[None, :] < V_DIM), other=0.0)  # [BLOCK_S, BLOCK_DV]
    out = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)
    tl.store(O + tok * stride_ot + head * stride_oh + dv * stride_od, out.to(O.dtype.element_ty), mask=dv < V_DIM)


# Built for Triton's CPU interpreter (TRITON_INTERPRET=1 when this module was imported) or for the GPU.
INTERPRETED = is_interpreted(_gqa_attn_kernel)


def _checked_pages(i: int, q_len: int, kv_len: int, table, tokens_per_block: int, width: int) -> int:
    """Pages request ``i`` reads, after checking that its row fits the meta layout."""
    pages = -(-kv_len // tokens_per_block)
    if not 1 <= q_len <= kv_len:
        raise ConfigError(f"request {i}: need 1 <= q_len <= kv_len, got q_len={q_len}, kv_len={kv_len}")
    if len(table) < pages:
        raise ConfigError(f"request {i}: page table has {len(table)} pages, kv_len={kv_len} needs {pages}")
    if 3 + pages > width:
        raise ConfigError(f"request {i}: kv_len={kv_len} needs {pages} pages, more than the {width - 3} columns")
    return pages


def pack_meta(q_lens, kv_lens, page_tables, tokens_per_block: int, width: int) -> list[list[int]]:
    """Per request ``[kv_len, q_len, q_start, page ids...]`` padded with 0 to ``width`` columns
    (:func:`pack_meta_into` on a zeroed buffer).

    Raises:
        ConfigError: a request has ``kv_len < q_len`` or a page table too short for its ``kv_len``.
    """
    out = np.zeros((len(q_lens), width), dtype=np.int32)
    pack_meta_into(out, q_lens, kv_lens, page_tables, tokens_per_block)
    return out.tolist()


def pack_meta_into(out, q_lens, kv_lens, page_tables, tokens_per_block: int) -> None:
    """Per request ``[kv_len, q_len, q_start, page ids...]`` written into ``out`` (NumPy int32
    ``[num_seqs, width]``, e.g. a view of a pinned buffer reused step after step); rows past the
    requests get ``q_len = 0`` (the kernel skips them), columns past a request's pages are never
    read. No Python lists of lists: a batch-32 step's meta in tens of µs, not hundreds.

    Raises:
        ConfigError: a request has ``kv_len < q_len``, a page table too short for its ``kv_len``,
            a row wider than ``out``, or more requests than ``out`` has rows.
    """
    n, width = out.shape
    if len(q_lens) > n:
        raise ConfigError(f"{len(q_lens)} requests, more than the buffer's {n} rows")
    out[len(q_lens):, 1] = 0
    q_start = 0
    for i, (q_len, kv_len, table) in enumerate(zip(q_lens, kv_lens, page_tables)):
        pages = _checked_pages(i, q_len, kv_len, table, tokens_per_block, width)
        row = out[i]
        row[0], row[1], row[2] = kv_len, q_len, q_start
        row[3:3 + pages] = table[:pages]  # columns past kv_len are never read
        q_start += q_len


@dataclass(frozen=True, slots=True)
class TritonGQAPlan:
    """One phase's metadata on the device, shared by every layer of the step.

    Attributes:
        meta: per request ``kv_len, q_len, q_start, page ids...`` (pages padded with 0).
            ``[num_seqs, 3 + max_pages]`` int32
        kv_lens, q_lens, q_start: columns of ``meta``. ``[num_seqs]``
        page_tables: the page-id columns of ``meta``. ``[num_seqs, max_pages]``
        num_seqs, num_tokens, max_q_len, max_kv_len: host integers for launch sizes.
        tokens_per_block: page size.
        num_sms: streaming multiprocessors of the device (sizes the KV split).
        num_splits: KV splits to launch; ``None`` lets ``run`` choose from the occupancy.
        split_chunk: keys per split, fixed (a multiple of 64); 0 = balanced per request.
    """

    meta: torch.Tensor
    kv_lens: torch.Tensor
    q_lens: torch.Tensor
    q_start: torch.Tensor
    page_tables: torch.Tensor
    num_seqs: int
    num_tokens: int
    max_q_len: int
    max_kv_len: int
    tokens_per_block: int
    num_sms: int
    num_splits: int | None = None
    split_chunk: int = 0


class TritonGQABackend(AttentionBackend):
    """Paged GQA attention (decode, verify, mixed, context) in Triton.

    Args:
        max_splits: most balanced KV splits per (request, KV head).
        min_split_tokens: fewest KV tokens per balanced split; below it a context is not split.
        fixed_split_max_tokens: eager phases of at most this many tokens split at the fixed offsets
            of graph steps (:func:`specdec.graphs.split_chunk`, up to 16 splits) instead, so they give
            a row the graph's bits; 0: every eager phase in balanced splits.
        key_tile: keys per tile of 16-bit runs (a power of two >= 16), instead of :func:`_tile_sizes`'
            choice (``bench/gqa_sweep.py``).
        num_stages: software-pipeline depth of the attention kernel.
        pdl: launch with programmatic dependent launch (:mod:`specdec.pdl`); ``None``: where the
            GPU has it (SM90+). ``True`` on a device without it is an error at ``run``. Fixed at
            construction (an engine passes ``EngineConfig.attention_pdl``, :meth:`from_config`).
    """

    name = "triton_gqa"
    capturable = True  # run() launches from host integers only: CUDA-graph safe
    pack_meta = staticmethod(pack_meta)  # the rows of a graph plan's static meta buffer
    pack_meta_into = staticmethod(pack_meta_into)  # the same, written into it in place (what graph steps use)

    def __init__(self, max_splits: int = 16, min_split_tokens: int = 256, key_tile: int | None = None,
                 num_stages: int = 2, pdl: bool | None = None,
                 fixed_split_max_tokens: int = FIXED_SPLIT_MAX_TOKENS):
        if max_splits < 1:
            raise ConfigError(f"TritonGQABackend.max_splits must be >= 1, got {max_splits}")
        if min_split_tokens < 1:
            raise ConfigError(f"TritonGQABackend.min_split_tokens must be >= 1, got {min_split_tokens}")
        if key_tile is not None and (key_tile < 16 or key_tile & (key_tile - 1)):
            raise ConfigError(f"TritonGQABackend.key_tile must be a power of two >= 16 or None, got {key_tile}")
        if num_stages < 1:
            raise ConfigError(f"TritonGQABackend.num_stages must be >= 1, got {num_stages}")
        if fixed_split_max_tokens < 0:
            raise ConfigError(f"TritonGQABackend.fixed_split_max_tokens must be >= 0, got {fixed_split_max_tokens}")
        self.max_splits, self.min_split_tokens = max_splits, min_split_tokens
        self.fixed_split_max_tokens = fixed_split_max_tokens
        if pdl is not None and not isinstance(pdl, bool):
            raise ConfigError(f"TritonGQABackend.pdl must be True, False or None, got {pdl!r}")
        self.key_tile, self.num_stages, self._pdl = key_tile, num_stages, pdl
        self._num_sms: dict[int, int] = {}

    @classmethod
    def from_config(cls, config: AttentionConfig) -> TritonGQABackend:
        """The default launch settings, with ``config.pdl``."""
        return cls(pdl=config.pdl)

    @property
    def pdl(self) -> bool | None:
        """The ``pdl`` it was built with (read-only: an engine's backends are built with
        ``EngineConfig.attention_pdl``)."""
        return self._pdl

    # -- contract --------------------------------------------------------------
    def supports(self, shape: AttnShape) -> Verdict:
        """Any phase and query length of a GQA layer within these limits.

        Limits: ``kind == "gqa"``; ``head_dim`` and ``v_head_dim`` in 1..256
        (padded to a power of two >= 16 inside the kernel); ``tokens_per_block``
        a power of two in 1..256; ``q_dtype == kv_dtype`` in fp16/bf16/fp32;
        ``helix_cp == 1``; device ``cuda`` with ``sm >= 80``, or ``cpu`` only
        when Triton built the kernels for its interpreter (``TRITON_INTERPRET=1``
        when this module was imported) and that interpreter lacks the bugs of
        :mod:`~specdec.attention.backends.triton_interp` (tests fix them). Any ``max_q_len``, mixed or not.
        """
        if shape.kind != "gqa":
            return no(f"kind must be 'gqa', got {shape.kind!r}")
        if shape.helix_cp != 1:
            return no(f"Helix context parallelism is not supported (helix_cp must be 1, got {shape.helix_cp})")
        if shape.head_dim > MAX_HEAD_DIM:
            return no(f"head_dim must be <= {MAX_HEAD_DIM}, got {shape.head_dim}")
        if shape.v_head_dim > MAX_HEAD_DIM:
            return no(f"v_head_dim must be <= {MAX_HEAD_DIM}, got {shape.v_head_dim}")
        tpb = shape.tokens_per_block
        if tpb > MAX_TOKENS_PER_BLOCK or tpb & (tpb - 1):
            return no(f"tokens_per_block must be a power of two <= {MAX_TOKENS_PER_BLOCK}, got {tpb}")
        if shape.kv_dtype not in DTYPES:
            return no(f"kv_dtype must be one of {DTYPES}, got {shape.kv_dtype!r}")
        if shape.q_dtype != shape.kv_dtype:
            return no(f"q_dtype must equal kv_dtype, got q_dtype={shape.q_dtype!r}, kv_dtype={shape.kv_dtype!r}")
        if shape.device == "cuda":
            if shape.sm is None or shape.sm < MIN_SM:
                return no(f"needs a cuda GPU with sm >= {MIN_SM}, got sm={shape.sm}")
            return YES
        if shape.device == "cpu" and INTERPRETED:
            # Triton 3.6's interpreter has bugs that would give wrong answers (triton_interp).
            refusal = interpreter_refusal(loops=True, bf16_dot=shape.q_dtype == "bfloat16")
            return no(refusal) if refusal else YES
        return no(f"device must be 'cuda' (or 'cpu' with TRITON_INTERPRET=1 set before import), got {shape.device!r}")

    def cost(self, shape: AttnShape) -> float:
        # Fast on the GPU; the CPU interpreter is far slower than the reference, used only when requested.
        return 10.0 if shape.device == "cuda" else 1000.0

    def plan(self, batch: PhaseBatch) -> TritonGQAPlan:
        """Pack the phase's requests into one int32 device tensor.

        A phase of at most ``fixed_split_max_tokens`` tokens splits its KV at the fixed
        offsets of graph steps (:func:`specdec.graphs.split_chunk`); a larger one in balanced
        splits sized for the occupancy.

        Raises:
            ConfigError: a request has ``kv_len < q_len`` or a page table too short for its ``kv_len``.
        """
        tpb = batch.tokens_per_block
        width = 3 + max(-(-kv // tpb) for kv in batch.kv_lens)
        rows = np.zeros((len(batch.q_lens), width), dtype=np.int32)
        pack_meta_into(rows, batch.q_lens, batch.kv_lens, batch.page_tables, tpb)
        q_start = batch.num_tokens
        host = torch.from_numpy(rows)
        # on CUDA through pinned memory, non-blocking: a copy from pageable memory would wait for
        # every kernel queued before it (the host would stall on the GPU at each eager step's plan)
        meta = (host.pin_memory().to(batch.device, non_blocking=True) if batch.device.type == "cuda"
                else host.to(batch.device))
        max_kv = max(batch.kv_lens)
        chunk = split_chunk(max_kv) if q_start <= self.fixed_split_max_tokens else 0
        return TritonGQAPlan(
            meta=meta,
            kv_lens=meta[:, 0],
            q_lens=meta[:, 1],
            q_start=meta[:, 2],
            page_tables=meta[:, 3:],
            num_seqs=len(rows),
            num_tokens=q_start,
            max_q_len=max(batch.q_lens),
            max_kv_len=max_kv,
            tokens_per_block=tpb,
            num_sms=self._sm_count(batch.device),
            num_splits=-(-max_kv // chunk) if chunk else None,
            split_chunk=chunk,
        )

    def graph_plan(self, meta: torch.Tensor, num_tokens: int, max_q_len: int, max_kv_len: int,
                   tokens_per_block: int, *, split_chunk: int = 0) -> TritonGQAPlan:
        """A plan over a static ``meta`` buffer that the caller refills each step (CUDA graphs).

        Launch sizes come from the bucket (``meta`` rows, ``max_q_len``, ``max_kv_len``),
        never from the step, so one captured launch serves every step that fits.
        Rows of ``meta`` are :func:`pack_meta` rows; unused rows have ``q_len = 0``.

        Args:
            meta: ``[num_seqs, 3 + max_pages]`` int32 on the device.
            num_tokens: query rows of the bucket.
            max_q_len: largest ``q_len`` a step in the bucket may have.
            max_kv_len: largest ``kv_len`` a step in the bucket may have.
            tokens_per_block: page size.
            split_chunk: fixed keys per split (a multiple of 64), with as many splits as
                ``max_kv_len`` needs; 0 = balanced splits sized for the occupancy.
        """
        if split_chunk and split_chunk % 64:
            raise ConfigError(f"split_chunk must be a multiple of 64 (the key tile), got {split_chunk}")
        return TritonGQAPlan(
            meta=meta, kv_lens=meta[:, 0], q_lens=meta[:, 1], q_start=meta[:, 2], page_tables=meta[:, 3:],
            num_seqs=meta.shape[0], num_tokens=num_tokens, max_q_len=max_q_len, max_kv_len=max_kv_len,
            tokens_per_block=tokens_per_block, num_sms=self._sm_count(meta.device),
            num_splits=-(-max_kv_len // split_chunk) if split_chunk else None, split_chunk=split_chunk,
        )

    def run(self, plan: TritonGQAPlan, q, k_cache, v_cache, scale: float, v_head_dim: int, *,
            kv_scale: float = 1.0) -> torch.Tensor:
        """See :meth:`AttentionBackend.run`; ``v_cache`` is required (GQA layers have V).

        ``kv_scale`` multiplies K and V as read (folded into the score scale and the output).

        Raises:
            ConfigError: ``v_cache`` is None, dtypes differ, or heads do not group.
        """
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        if v_cache is None:
            raise ConfigError("triton_gqa needs v_cache (K-only layers are MLA)")
        if not q.dtype == k_cache.dtype == v_cache.dtype:
            raise ConfigError(f"triton_gqa needs equal dtypes, got q={q.dtype}, k={k_cache.dtype}, v={v_cache.dtype}")
        if num_heads % num_kv_heads:
            raise ConfigError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        out = q.new_empty(num_tokens, num_heads, v_head_dim)  # [num_tokens, H, Dv]
        if num_tokens == 0:
            return out
        pdl = self._launch_pdl(q.device)
        group = num_heads // num_kv_heads
        block_d, block_dv = _pow2(head_dim), _pow2(v_head_dim)
        # tiles from max_q_len rounded up to a power of two, as prompt graph buckets round it: an eager
        # prompt step and its graph then run the same tiles (decode and verify rows, <= 64, already do)
        block_m, block_n = _tile_sizes(q.dtype == torch.float32, max(block_d, block_dv),
                                       triton.next_power_of_2(plan.max_q_len) * group)
        if self.key_tile and q.dtype != torch.float32:
            block_n = self.key_tile
        m_blocks = -(-plan.max_q_len * group // block_m)
        splits = plan.num_splits or self._num_splits(plan, m_blocks * num_kv_heads)
        if splits > 1:
            o_part = q.new_empty(num_tokens, num_heads, splits, v_head_dim, dtype=torch.float32)
            lse_part = q.new_empty(num_tokens, num_heads, splits, dtype=torch.float32)
        else:
            o_part = lse_part = out  # unused by the kernel
        grid = (plan.num_seqs * m_blocks, num_kv_heads, splits)
        _gqa_attn_kernel[grid](
            q, k_cache, v_cache, out, o_part, lse_part, plan.meta,
            plan.meta.stride(0),
            *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(),
            num_heads, m_blocks, scale * kv_scale * math.log2(math.e), kv_scale, plan.split_chunk,
            GROUP=group, HEAD_DIM=head_dim, V_DIM=v_head_dim, PAGE=plan.tokens_per_block, NUM_SPLITS=splits,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PDL=pdl,
            num_warps=8 if block_m * max(block_d, block_dv) >= 128 * 128 else 4,
            num_stages=self.num_stages, launch_pdl=pdl,
        )
        if splits > 1:
            _merge_splits_kernel[(num_tokens, num_heads)](
                out, o_part, lse_part, *out.stride(), num_heads,
                NUM_SPLITS=splits, V_DIM=v_head_dim, BLOCK_S=_pow2(splits), BLOCK_DV=block_dv, PDL=pdl,
                num_warps=4 if block_dv >= 256 else 2, launch_pdl=pdl,
            )
        return out

    # -- helpers ---------------------------------------------------------------
    def _launch_pdl(self, device: torch.device) -> bool:
        available = pdl_level(device) > 0
        if self._pdl and not available:
            raise ConfigError(f"TritonGQABackend(pdl=True) needs a CUDA GPU with SM90 or newer, got {device}")
        return available if self._pdl is None else self._pdl

    def _num_splits(self, plan: TritonGQAPlan, programs_per_seq: int) -> int:
        """Split the KV range only when (request, KV head, row block) programs cannot fill the GPU."""
        by_length = plan.max_kv_len // self.min_split_tokens
        by_occupancy = -(-2 * plan.num_sms // (plan.num_seqs * programs_per_seq))
        return max(1, min(self.max_splits, by_length, by_occupancy))

    def _sm_count(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 4  # the interpreter: a few splits so that the merge path is exercised
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self._num_sms:
            self._num_sms[index] = torch.cuda.get_device_properties(index).multi_processor_count
        return self._num_sms[index]


def _tile_sizes(fp32: bool, block_d: int, rows: int) -> tuple[int, int]:
    """``(BLOCK_M, BLOCK_N)``: query rows per program and keys per tile.

    16-bit: up to 128 rows, so one program holds every row of a verify group
    (q_len x group) and reads each K/V tile once. Heads of <= 64 dims with <= 64
    rows (decode and verify) take 128-key tiles (``bench/gqa_sweep.py``: 6.0 -> 4.5 µs)
    in blocks of at most 32 rows: every such step then runs the same tiles and MMA
    shapes, so a query row's sums run in the same order in a decode step and in a
    verify step of up to 64 rows (bf16 greedy output of a drafter equal to the null
    drafter's, as far as the KV split allows). Other 16-bit shapes: 64-key tiles. fp32
    (IEEE dots on FMA units, used for lossless tests) keeps 16-row blocks: larger ones
    spill registers. Sizes checked with ptxas for sm_90 (no spills).
    """
    if fp32:
        return 16, (64 if block_d <= 128 else 16)
    if block_d <= 64 and rows <= 64:
        return min(32, _pow2(rows)), 128
    cap, block_n = (128, 64) if block_d <= 128 else (64, 32)
    return min(cap, _pow2(rows)), block_n


def _pow2(n: int) -> int:
    """Smallest power of two >= max(n, 16) (``tl.dot`` needs every dimension >= 16)."""
    return max(16, triton.next_power_of_2(n))
