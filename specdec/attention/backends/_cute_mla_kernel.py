"""The CuTe DSL kernel of ``cute_mla`` (imported only when ``nvidia-cutlass-dsl`` is installed).

See :mod:`specdec.attention.backends.cute_mla` for the design and the contract. This
module needs ``cutlass`` at import; :mod:`~specdec.attention.backends.cute_mla` imports
it lazily and refuses every shape, with the reason, when it cannot.
"""

from __future__ import annotations

import ctypes

import cutlass  # first: the missing package is what an ImportError should name
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync, warpgroup

import cuda.bindings.driver as cuda  # noqa: E402 - a dependency of nvidia-cutlass-dsl

BLOCK_M = 64  # query rows per CTA: one wgmma M, shared by both consumer warpgroups
THREADS = 384  # warpgroup 0: producer (warp 0: TMA; FP8: warps 1-3 convert); warpgroups 1, 2: consumers
CONVERTERS = 96  # FP8: the producer warpgroup's warps 1-3 turn e4m3 tiles into bf16 tiles
CHUNK = 8  # values a converter thread moves at once: 8 bytes of e4m3 in, 16 bytes of bf16 out
REGS_PRODUCER = 40
REGS_CONSUMER = 232
ZERO_BARRIER = 1  # named barrier of the two consumer warpgroups (0 is __syncthreads)

#: The runtime arguments of :meth:`MLADecodeKernel.launch`, in order, each with the C type the compiled host
#: function reads it as (through one pointer per argument): device addresses, sizes, scales, the stream handle.
LAUNCH_ARGS: tuple[tuple[str, type], ...] = (
    ("q", ctypes.c_void_p), ("kv", ctypes.c_void_p), ("o_part", ctypes.c_void_p), ("lse_part", ctypes.c_void_p),
    ("page_table", ctypes.c_void_p), ("kv_lens", ctypes.c_void_p), ("q_start", ctypes.c_void_p),
    ("q_lens", ctypes.c_void_p),
    ("num_rows", ctypes.c_int32), ("num_slots", ctypes.c_int32), ("num_parts", ctypes.c_int32),
    ("num_seqs", ctypes.c_int32), ("max_pages", ctypes.c_int32), ("page_stride", ctypes.c_int64),
    ("scale_log2", ctypes.c_float), ("v_scale", ctypes.c_float),
    ("num_heads", ctypes.c_int32), ("num_splits", ctypes.c_int32), ("row_blocks", ctypes.c_int32),
    ("cp", ctypes.c_int32), ("rank", ctypes.c_int32),
    ("stream", ctypes.c_void_p),
)


class MLADecodeKernel:
    """Paged absorbed-MLA decode / verify for sm90: one CTA = 64 query rows x one KV split of one request.

    Compile-time: latent / rope widths, page size, keys per tile, depth of the bf16 ring the
    wgmmas read (``stages``), depth of the e4m3 staging ring (``fp8_stages``; 0: a bf16 cache,
    loaded straight into the bf16 ring), and ``helix`` (rank-local page tables).
    Runtime: the packed queries, the latent cache, the plan's tensors, the scales, the split
    count, and the Helix group size and rank (``cp = 1, rank = 0`` unsharded).

    Output: ``o_part[row * num_splits + split, :]`` (fp32, normalised over the split's keys, times
    ``v_scale``) and ``lse_part[row * num_splits + split]`` (fp32, log2 domain; ``-inf`` for a
    split no key of which the row sees), ``row`` indexing the flattened ``[num_tokens * H]`` query rows.
    """

    def __init__(self, latent: int, rope: int, tokens_per_block: int, block_n: int, stages: int,
                 fp8_stages: int = 0, helix: bool = False):
        if latent % 128 or rope % 64 or tokens_per_block % block_n or block_n % 16:
            raise ValueError(f"unsupported MLA kernel config: latent={latent} rope={rope} "
                             f"tokens_per_block={tokens_per_block} block_n={block_n}")
        self.latent, self.rope = latent, rope
        self.dim = latent + rope
        self.tpb, self.block_n, self.stages = tokens_per_block, block_n, stages
        self.fp8, self.fp8_stages, self.helix = fp8_stages > 0, fp8_stages, helix
        self.load_stages = fp8_stages if self.fp8 else stages  # the ring TMA writes
        self.half = latent // 2  # output columns per consumer warpgroup
        if self.fp8 and (block_n * self.dim // CHUNK) % CONVERTERS:
            raise ValueError(f"block_n={block_n}: {block_n * self.dim // CHUNK} chunks of {CHUNK} do not split "
                             f"evenly over {CONVERTERS} converter threads")

    # ------------------------------------------------------------------ host side

    @cute.jit
    def launch(
        self,
        q: cute.Pointer,  # [num_rows, dim] bf16
        kv: cute.Pointer,  # [num_slots, dim] bf16 or float8_e4m3fn
        o_part: cute.Pointer,  # [num_parts, latent] fp32
        lse_part: cute.Pointer,  # [num_parts] fp32
        page_table: cute.Pointer,  # [num_seqs, max_pages] int32, rows page_stride apart
        kv_lens: cute.Pointer,  # [num_seqs] int32
        q_start: cute.Pointer,  # [num_seqs] int32
        q_lens: cute.Pointer,  # [num_seqs] int32
        num_rows: cutlass.Int32,
        num_slots: cutlass.Int32,
        num_parts: cutlass.Int32,
        num_seqs: cutlass.Int32,
        max_pages: cutlass.Int32,
        page_stride: cutlass.Int64,
        scale_log2: cutlass.Float32,
        v_scale: cutlass.Float32,
        num_heads: cutlass.Int32,
        num_splits: cutlass.Int32,
        row_blocks: cutlass.Int32,
        cp: cutlass.Int32,
        rank: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """:meth:`__call__` on tensors built from device addresses and sizes (``LAUNCH_ARGS``): the entry
        the backend compiles. Its arguments are plain scalars, so a call marshals no tensor objects; the
        tensors it builds have the types ``from_dlpack`` gives contiguous CUDA tensors (global memory,
        dynamic row counts, static row widths, a dynamic 64-bit page-table stride), so the kernel is the
        one ``__call__`` compiles for them (``tests/test_cute_mla.py`` compares the PTX)."""

        def rows(ptr, n, width):  # row-major [n, width], n dynamic
            return cute.make_tensor(ptr, cute.make_layout((n, width), stride=(width, 1)))

        def per_seq(ptr):
            return cute.make_tensor(ptr, cute.make_layout((num_seqs,), stride=(1,)))

        self.__call__(
            rows(q, num_rows, self.dim), rows(kv, num_slots, self.dim), rows(o_part, num_parts, self.latent),
            cute.make_tensor(lse_part, cute.make_layout((num_parts,), stride=(1,))),
            cute.make_tensor(page_table, cute.make_layout((num_seqs, max_pages), stride=(page_stride, 1))),
            per_seq(kv_lens), per_seq(q_start), per_seq(q_lens),
            scale_log2, v_scale, num_heads, num_splits, row_blocks, num_seqs, cp, rank, stream,
        )

    @cute.jit
    def __call__(
        self,
        mQ: cute.Tensor,  # [num_rows, dim] bf16, row = token * H + head
        mKV: cute.Tensor,  # [num_slots, dim] bf16, or float8_e4m3fn with fp8_stages
        mOPart: cute.Tensor,  # [num_rows * num_splits, latent] fp32
        mLsePart: cute.Tensor,  # [num_rows * num_splits] fp32 (log2 domain)
        mPageTable: cute.Tensor,  # [num_seqs, max_pages] int32
        mKvLens: cute.Tensor,  # [num_seqs] int32
        mQStart: cute.Tensor,  # [num_seqs] int32
        mQLens: cute.Tensor,  # [num_seqs] int32
        scale_log2: cutlass.Float32,  # softmax scale * kv_scale * log2(e)
        v_scale: cutlass.Float32,  # kv_scale: multiplies the normalised output (V is read unscaled)
        num_heads: cutlass.Int32,
        num_splits: cutlass.Int32,
        row_blocks: cutlass.Int32,
        num_seqs: cutlass.Int32,
        cp: cutlass.Int32,  # Helix ranks (read with helix only)
        rank: cutlass.Int32,  # this rank (read with helix only)
        stream: cuda.CUstream,
    ):
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        K = cute.nvgpu.OperandMajorMode.K
        MN = cute.nvgpu.OperandMajorMode.MN
        qk_mma = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K, K, f32, (1, 1, 1), (BLOCK_M, self.block_n))
        pv_mma = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K, MN, f32, (1, 1, 1), (BLOCK_M, self.half),
                                                   warpgroup.OperandSource.RMEM)
        row_major = utils.LayoutEnum.ROW_MAJOR
        tile_mnk = (BLOCK_M, self.block_n, self.dim)
        q_layout = sm90_utils.make_smem_layout_a(row_major, tile_mnk, bf16, 1)  # (64, dim, 1)
        kv_layout = sm90_utils.make_smem_layout_b(row_major, tile_mnk, bf16, self.stages)  # (block_n, dim, stages)
        # What TMA writes: the bf16 ring itself, or (FP8) an e4m3 staging ring (64-byte swizzle: 576
        # bytes a row) that the converter warps read back into the bf16 ring.
        load_dtype = cutlass.Float8E4M3FN if cutlass.const_expr(self.fp8) else bf16
        load_layout = kv_layout
        if cutlass.const_expr(self.fp8):
            load_layout = sm90_utils.make_smem_layout_b(row_major, tile_mnk, load_dtype, self.fp8_stages)

        tma_q, tma_mQ = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mQ, cute.slice_(q_layout, (None, None, 0)), (BLOCK_M, self.dim))
        tma_kv, tma_mKV = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mKV, cute.slice_(load_layout, (None, None, 0)),
            (self.block_n, self.dim))
        self.q_bytes = cute.size_in_bytes(bf16, cute.slice_(q_layout, (None, None, 0)))
        self.kv_bytes = cute.size_in_bytes(load_dtype, cute.slice_(load_layout, (None, None, 0)))

        if cutlass.const_expr(self.fp8):
            @cute.struct
            class Storage:
                q_bar: cute.struct.MemRange[cutlass.Int64, 2]
                kv_bar: cute.struct.MemRange[cutlass.Int64, 2 * self.fp8_stages]
                cvt_bar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
                sKV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]
                sLoad: cute.struct.Align[cute.struct.MemRange[load_dtype, cute.cosize(load_layout)], 1024]
        else:
            @cute.struct
            class Storage:
                q_bar: cute.struct.MemRange[cutlass.Int64, 2]
                kv_bar: cute.struct.MemRange[cutlass.Int64, 2 * self.stages]
                sQ: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(q_layout)], 1024]
                sKV: cute.struct.Align[cute.struct.MemRange[bf16, cute.cosize(kv_layout)], 1024]

        self.storage = Storage
        self.kernel(
            qk_mma, pv_mma, tma_q, tma_mQ, tma_kv, tma_mKV, q_layout, kv_layout, load_layout,
            mOPart, mLsePart, mPageTable, mKvLens, mQStart, mQLens, scale_log2, v_scale, num_heads, num_splits,
            cp, rank,
        ).launch(
            grid=(row_blocks, num_splits, num_seqs),
            block=(THREADS, 1, 1),  # shared memory: the DSL sizes it from the kernel's allocations
            stream=stream,
            min_blocks_per_mp=1,
        )

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        qk_mma: cute.TiledMma,
        pv_mma: cute.TiledMma,
        tma_q: cute.CopyAtom,
        tma_mQ: cute.Tensor,
        tma_kv: cute.CopyAtom,
        tma_mKV: cute.Tensor,
        q_layout: cute.ComposedLayout,
        kv_layout: cute.ComposedLayout,
        load_layout: cute.ComposedLayout,
        mOPart: cute.Tensor,
        mLsePart: cute.Tensor,
        mPageTable: cute.Tensor,
        mKvLens: cute.Tensor,
        mQStart: cute.Tensor,
        mQLens: cute.Tensor,
        scale_log2: cutlass.Float32,
        v_scale: cutlass.Float32,
        num_heads: cutlass.Int32,
        num_splits: cutlass.Int32,
        cp: cutlass.Int32,
        rank: cutlass.Int32,
    ):
        BN, D, TPB = self.block_n, self.dim, self.tpb
        tidx, _, _ = cute.arch.thread_idx()
        mblk, split, seq = cute.arch.block_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.storage)
        sQ = storage.sQ.get_tensor(q_layout.outer, swizzle=q_layout.inner)  # (64, D, 1)
        sKV = storage.sKV.get_tensor(kv_layout.outer, swizzle=kv_layout.inner)  # (BN, D, stages)
        sLoad = sKV  # what TMA writes: (BN, D, load_stages)
        if cutlass.const_expr(self.fp8):
            sLoad = storage.sLoad.get_tensor(load_layout.outer, swizzle=load_layout.inner)

        q_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=1,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 8),
            tx_count=self.q_bytes,
            barrier_storage=storage.q_bar.data_ptr(),
        )
        # TMA -> its readers (one arrive per warp): the consumers, or (FP8) the three converter warps.
        kv_pipe = pipeline.PipelineTmaAsync.create(
            num_stages=self.load_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTERS // 32 if self.fp8 else 8),
            tx_count=self.kv_bytes,
            barrier_storage=storage.kv_bar.data_ptr(),
        )
        q_producer, q_consumer = q_pipe.make_participants()
        kv_producer, kv_consumer = kv_pipe.make_participants()
        tile_consumer = kv_consumer  # what the consumers wait on before their wgmmas
        if cutlass.const_expr(self.fp8):
            # converters -> consumers over the bf16 ring (every thread arrives on both sides)
            cvt_pipe = pipeline.PipelineAsync.create(
                num_stages=self.stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTERS),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 256),
                barrier_storage=storage.cvt_bar.data_ptr(),
            )
            cvt_producer, tile_consumer = cvt_pipe.make_participants()

        # ---- this CTA's rows and keys (every thread computes the same scalars)
        q_len = mQLens[seq]
        kv_len = mKvLens[seq]
        q_start = mQStart[seq]
        rows = q_len * num_heads  # query rows of the request, token-major
        first_row = mblk * BLOCK_M
        last_tok = cutlass.min((first_row + BLOCK_M - 1) // num_heads, q_len - 1)
        # Key k is the k-th position the page table holds (under Helix: the k-th this rank owns).
        n_keys = self.owned(kv_len, cp, rank)
        stop = self.owned(kv_len - q_len + last_tok + 1, cp, rank)  # one past the last key any row sees
        chunk = (((n_keys + num_splits - 1) // num_splits + BN - 1) // BN) * BN
        lo = split * chunk
        hi = cutlass.min(cutlass.min(lo + chunk, n_keys), stop)
        n_tiles = cutlass.max((hi - lo + BN - 1) // BN, 0)
        row0 = q_start * num_heads + first_row  # first global query row of the block

        if first_row < rows:
            if wg_idx == 0:
                # ---------------- producer: Q once, then the KV tiles of this split, page by page
                cute.arch.setmaxregister_decrease(REGS_PRODUCER)
                if warp_idx == 0:
                    cpasync.prefetch_descriptor(tma_q)
                    cpasync.prefetch_descriptor(tma_kv)
                    gQ = cute.local_tile(cute.domain_offset((row0, 0), tma_mQ), (BLOCK_M, D), (0, 0))
                    tQsQ, tQgQ = cpasync.tma_partition(
                        tma_q, 0, cute.make_layout(1), cute.group_modes(sQ, 0, 2), cute.group_modes(gQ, 0, 2))
                    q_handle = q_producer.acquire_and_advance()
                    cute.copy(tma_q, tQgQ, tQsQ[(None, 0)], tma_bar_ptr=q_handle.barrier)
                    for t in cutlass.range(n_tiles, unroll=1):
                        key0 = lo + t * BN  # BN divides the page: the tile lies in one page
                        page = mPageTable[seq, key0 // TPB]
                        slot0 = page * TPB + key0 % TPB
                        gKV = cute.local_tile(cute.domain_offset((slot0, 0), tma_mKV), (BN, D), (0, 0))
                        tKsK, tKgK = cpasync.tma_partition(  # into the ring TMA writes (the e4m3 one for FP8)
                            tma_kv, 0, cute.make_layout(1), cute.group_modes(sLoad, 0, 2),
                            cute.group_modes(gKV, 0, 2))
                        kv_handle = kv_producer.acquire_and_advance()
                        cute.copy(tma_kv, tKgK, tKsK[(None, kv_handle.index)], tma_bar_ptr=kv_handle.barrier)
                if cutlass.const_expr(self.fp8):
                    if warp_idx > 0:
                        self.convert(sLoad, sKV, kv_consumer, cvt_producer, tidx - 32, lo, n_keys, n_tiles)
            else:
                # ---------------- consumers: warpgroup w owns output columns [w * half, (w + 1) * half)
                cute.arch.setmaxregister_increase(REGS_CONSUMER)
                self.consume(qk_mma, pv_mma, sQ, sKV, q_consumer, tile_consumer, mOPart, mLsePart,
                             tidx, wg_idx - 1, num_heads, num_splits, scale_log2, v_scale, q_len, kv_len, rows,
                             first_row, row0, split, lo, n_tiles, n_keys, cp, rank)

    @cute.jit
    def owned(self, n, cp, rank):
        """Keys below position ``n``: ``n`` unsharded; under Helix the positions ``[0, n)`` this rank
        owns (page ``p`` belongs to rank ``p % cp``), which is also the rank-local index one past the
        last of them (``HelixLayout.local_length``; ``triton_mla._owned``)."""
        keys = n
        if cutlass.const_expr(self.helix):
            full = n // self.tpb
            keys = ((full - rank + cp - 1) // cp) * self.tpb  # pages p < full with p % cp == rank
            if full % cp == rank:
                keys = keys + n % self.tpb
        return keys

    @cute.jit
    def convert(self, sLoad, sKV, kv_consumer, cvt_producer, t, lo, n_keys, n_tiles):
        """FP8: e4m3 staging tile -> bf16 tile, by the producer warpgroup's warps 1-3 (thread ``t`` of 96).

        The conversion is exact (every e4m3 value is a bf16 value); ``kv_scale`` is not applied here
        (it is folded into ``scale_log2`` and ``v_scale``). Rows of the request's last tile past its
        keys (a page's tail: anything, NaN included) are written as zeros, so the consumers need no
        zeroing pass of their own. Each thread moves ``CHUNK`` consecutive values of a row at a time:
        8 contiguous bytes in the 64-byte-swizzled staging tile, 16 contiguous bytes in the
        128-byte-swizzled bf16 tile (both swizzles permute 16-byte units).
        """
        BN, D = self.block_n, self.dim
        per_row = D // CHUNK
        for it in cutlass.range(n_tiles, unroll=1):
            valid = n_keys - (lo + it * BN)  # rows of this tile inside the context (>= BN: all)
            src = kv_consumer.wait_and_advance()
            dst = cvt_producer.acquire_and_advance()
            for e in cutlass.range(t, BN * per_row, CONVERTERS, unroll=1):
                row = e // per_row
                c = e % per_row
                raw = cute.make_rmem_tensor(cute.make_layout(CHUNK), cutlass.Float8E4M3FN)
                cute.autovec_copy(cute.local_tile(sLoad[(None, None, src.index)], (1, CHUNK), (row, c)), raw)
                val = cute.make_rmem_tensor(cute.make_layout(CHUNK), cutlass.BFloat16)
                val.store(raw.load().to(cutlass.BFloat16))
                if row >= valid:
                    val.fill(0.0)
                cute.autovec_copy(val, cute.local_tile(sKV[(None, None, dst.index)], (1, CHUNK), (row, c)))
            cute.arch.fence_proxy("async.shared", space="cta")  # generic writes -> the wgmmas' async reads
            dst.commit()
            src.release()

    @cute.jit
    def consume(self, qk_mma, pv_mma, sQ, sKV, q_consumer, kv_consumer, mOPart, mLsePart, tidx, wg,
                num_heads, num_splits, scale_log2, v_scale, q_len, kv_len, rows, first_row, row0, split, lo,
                n_tiles, n_keys, cp, rank):
        BN, D, HALF = self.block_n, self.dim, self.half
        f32, bf16 = cutlass.Float32, cutlass.BFloat16
        t = tidx % 128
        qk_thr = qk_mma.get_slice(t)
        pv_thr = pv_mma.get_slice(t)

        # S = Q K^T operands: smem descriptors over Q and the KV ring.
        tSrQ = qk_thr.make_fragment_A(qk_thr.partition_A(sQ))  # (MMA, 1, D/16, 1)
        tSrK = qk_thr.make_fragment_B(qk_thr.partition_B(sKV))  # (MMA, 1, D/16, stages)
        # O += P V: V is the latent part of the same KV tiles, read transposed (dims x keys, MN-major),
        # this warpgroup's half of the latent columns.
        sVt = cute.make_tensor(sKV.iterator, cute.select(sKV.layout, mode=[1, 0, 2]))  # (D, BN, stages)
        sV = cute.local_tile(sVt, (HALF, BN, self.stages), (wg, 0, 0))  # (HALF, BN, stages)
        tOrV = pv_thr.make_fragment_B(pv_thr.partition_B(sV))  # (MMA, 1, BN/16, stages)

        acc_o = pv_thr.make_fragment_C(pv_thr.partition_shape_C((BLOCK_M, HALF)))
        acc_o.fill(0.0)
        s_shape = qk_thr.partition_shape_C((BLOCK_M, BN))

        # (row, key) of every score this thread holds, and of every output value.
        tScS = qk_thr.partition_C(cute.make_identity_tensor((BLOCK_M, BN)))
        tOcO = pv_thr.partition_C(cute.make_identity_tensor((BLOCK_M, HALF)))
        n_s = cute.size(tScS)
        n_o = cute.size(tOcO)
        # A thread holds two rows of the 64 (wgmma accumulator layout): rows r and r + 8 of its warp's 16.
        # Value i of the scores belongs to row half (i // 2) % 2; value j of the output likewise.
        row_a = tScS[0][0]
        row_b = tScS[2][0]
        rows_here = (row_a, row_b)
        # causal bound per row: row r of the request is token r // H and sees positions < kv_len - q_len + token + 1,
        # i.e. the keys below owned(that) (all of them unsharded)
        row_end = cute.make_rmem_tensor(cute.make_layout(2), cutlass.Int32)
        m_i = cute.make_rmem_tensor(cute.make_layout(2), f32)
        l_i = cute.make_rmem_tensor(cute.make_layout(2), f32)
        for h in cutlass.range_constexpr(2):
            r = first_row + rows_here[h]
            tok = cutlass.min(r // num_heads, q_len - 1)  # rows past the request: masked at the store
            row_end[h] = self.owned(kv_len - q_len + tok + 1, cp, rank)
            m_i[h] = -f32.inf
            l_i[h] = 0.0

        q_handle = q_consumer.wait_and_advance()
        for it in cutlass.range(n_tiles, unroll=1):
            key0 = lo + it * BN
            kv_handle = kv_consumer.wait_and_advance()
            stage = kv_handle.index
            if cutlass.const_expr(not self.fp8):  # (FP8: the converters zero the tail)
                if key0 + BN > n_keys:
                    # The request's last, partial tile: the page's tail past its keys may hold anything
                    # (NaN included), and P = 0 does not cancel NaN in P V. Zero those rows first.
                    valid = n_keys - key0
                    n_zero = (BN - valid) * D
                    for e in cutlass.range(tidx - 128, n_zero, 256, unroll=1):
                        sKV[(valid + e // D, e % D, stage)] = bf16(0.0)
                    cute.arch.fence_proxy("async.shared", space="cta")
                    cute.arch.barrier(barrier_id=ZERO_BARRIER, number_of_threads=256)

            # ---- S = Q K^T over the full 576 dims (both warpgroups compute it: each needs all of P)
            acc_s = qk_thr.make_fragment_C(s_shape)
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tSrQ, mode=[2])):
                qk_mma.set(warpgroup.Field.ACCUMULATE, k != 0)
                cute.gemm(qk_mma, acc_s, tSrQ[(None, None, k, 0)], tSrK[(None, None, k, stage)], acc_s)
            warpgroup.commit_group()
            warpgroup.wait_group(0)

            # ---- mask, online softmax (log2 domain)
            tile_max = cute.make_rmem_tensor(cute.make_layout(2), f32)
            tile_max[0] = -f32.inf
            tile_max[1] = -f32.inf
            for i in cutlass.range_constexpr(n_s):
                h = (i // 2) % 2
                s = acc_s[i] * scale_log2
                if key0 + tScS[i][1] >= row_end[h]:
                    s = -f32.inf
                acc_s[i] = s
                tile_max[h] = cute.arch.fmax(tile_max[h], s)
            scale_o = cute.make_rmem_tensor(cute.make_layout(2), f32)
            m_safe = cute.make_rmem_tensor(cute.make_layout(2), f32)
            for h in cutlass.range_constexpr(2):
                tmax = cute.arch.warp_reduction_max(tile_max[h], threads_in_group=4)
                m_new = cute.arch.fmax(m_i[h], tmax)
                ms = m_new
                if m_new == -f32.inf:  # nothing seen yet by this row
                    ms = f32(0.0)
                m_safe[h] = ms
                scale_o[h] = cute.math.exp2(m_i[h] - ms, fastmath=True)
                m_i[h] = m_new
            row_sum = cute.make_rmem_tensor(cute.make_layout(2), f32)
            row_sum[0] = 0.0
            row_sum[1] = 0.0
            for i in cutlass.range_constexpr(n_s):
                h = (i // 2) % 2
                p = cute.math.exp2(acc_s[i] - m_safe[h], fastmath=True)
                acc_s[i] = p
                row_sum[h] = row_sum[h] + p
            for h in cutlass.range_constexpr(2):
                l_i[h] = l_i[h] * scale_o[h] + row_sum[h]  # per-thread partial sums; reduced at the end
            for j in cutlass.range_constexpr(n_o):
                acc_o[j] = acc_o[j] * scale_o[(j // 2) % 2]

            # ---- P (bf16, registers) x V (smem): the score accumulator's register layout is the A
            # operand's for 16-bit types, value for value.
            tOrP = cute.make_rmem_tensor(pv_thr.partition_shape_A((BLOCK_M, BN)), bf16)
            tOrP_as_s = cute.make_tensor(tOrP.iterator, acc_s.layout)
            tOrP_as_s.store(acc_s.load().to(bf16))
            warpgroup.fence()
            for k in cutlass.range_constexpr(cute.size(tOrP, mode=[2])):
                pv_mma.set(warpgroup.Field.ACCUMULATE, True)
                cute.gemm(pv_mma, acc_o, tOrP[(None, None, k)], tOrV[(None, None, k, stage)], acc_o)
            warpgroup.commit_group()
            warpgroup.wait_group(0)
            kv_handle.release()
        q_handle.release()

        # ---- epilogue: normalise, write this split's partial output and LSE (log2)
        lse = cute.make_rmem_tensor(cute.make_layout(2), f32)
        inv = cute.make_rmem_tensor(cute.make_layout(2), f32)
        for h in cutlass.range_constexpr(2):
            total = cute.arch.warp_reduction_sum(l_i[h], threads_in_group=4)
            lse_h = m_i[h] + cute.math.log2(total, fastmath=False)
            inv_h = v_scale / total
            if total == 0.0:  # no key of this split is visible to the row
                lse_h = -f32.inf
                inv_h = f32(0.0)
            lse[h] = lse_h
            inv[h] = inv_h
        for j in cutlass.range_constexpr(n_o):
            r = tOcO[j][0]
            if first_row + r < rows:
                out_row = (row0 + r) * num_splits + split
                mOPart[out_row, wg * HALF + tOcO[j][1]] = acc_o[j] * inv[(j // 2) % 2]
        if wg == 0:
            if tScS[0][1] == 0:  # one thread of the four that share a row
                for h in cutlass.range_constexpr(2):
                    r = rows_here[h]
                    if first_row + r < rows:
                        mLsePart[(row0 + r) * num_splits + split] = lse[h]


def compile_launch(latent: int, rope: int, tokens_per_block: int, block_n: int, stages: int, fp8_stages: int = 0,
                   helix: bool = False):
    """Compile :meth:`MLADecodeKernel.launch` (the backend's entry) against placeholder pointers and sizes.

    Needs no data and no GPU (on a machine without one, ``CUTE_DSL_ARCH`` names the target): the
    pointers' element types and alignments (16 bytes; 4 for the page table) are all the compile
    reads. ``fp8_stages > 0``: an FP8 E4M3 cache; ``helix``: rank-local page tables. Returns the
    compiled function and the kernel object (its ``storage`` sizes the launch's shared memory).
    """
    from cutlass.cute.runtime import make_fake_stream, make_ptr

    k = MLADecodeKernel(latent, rope, tokens_per_block, block_n, stages, fp8_stages, helix)
    kv_dtype = cutlass.Float8E4M3FN if fp8_stages else cutlass.BFloat16
    gmem = cute.AddressSpace.gmem
    i32 = cutlass.Int32
    args = (
        make_ptr(cutlass.BFloat16, 0, gmem, assumed_align=16),  # q
        make_ptr(kv_dtype, 0, gmem, assumed_align=16),  # kv
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=16),  # o_part
        make_ptr(cutlass.Float32, 0, gmem, assumed_align=16),  # lse_part
        make_ptr(cutlass.Int32, 0, gmem, assumed_align=4),  # page_table
        *(make_ptr(cutlass.Int32, 0, gmem, assumed_align=16) for _ in range(3)),  # kv_lens, q_start, q_lens
        i32(1), i32(1), i32(1), i32(1), i32(1), cutlass.Int64(1),  # num_rows ... page_stride
        cutlass.Float32(1.0), cutlass.Float32(1.0),  # scale_log2, v_scale
        i32(1), i32(1), i32(1), i32(1), i32(0),  # num_heads, num_splits, row_blocks, cp, rank
        make_fake_stream(),
    )
    assert len(args) == len(LAUNCH_ARGS)
    return cute.compile(k.launch, *args), k


def compile_fake(latent: int, rope: int, tokens_per_block: int, block_n: int, stages: int, fp8_stages: int = 0,
                 helix: bool = False):
    """Compile the backend's entry without a GPU or data, for ``CUTE_DSL_ARCH``: what a machine
    without a GPU can do (trace, lower, assemble to a cubin; ``CUTE_DSL_KEEP=ptx,cubin`` and
    ``CUTE_DSL_DUMP_DIR`` keep them). Returns the compiled kernel and the dynamic shared memory its
    launch asks for, in bytes."""
    compiled, k = compile_launch(latent, rope, tokens_per_block, block_n, stages, fp8_stages, helix)
    return compiled, k.storage.size_in_bytes()


def register_layout_problems(block_ns=(16, 32, 64), half: int = 256) -> list[str]:
    """Check, from the static MMA layouts, what :meth:`MLADecodeKernel.consume` assumes.

    1. Score and output accumulators: value ``i`` of a thread lies in row ``row(value 0) + 8 * ((i // 2) % 2)``
       (the two rows a thread holds, used for the row statistics and the causal bound).
    2. P: the bf16 A operand of the P V wgmma, viewed through the score accumulator's layout
       (``make_tensor(tOrP.iterator, acc_s.layout)``), puts score (m, n) at A coordinate (m, k = n).

    Returns the problems found (empty: all hold). Needs only the DSL (no GPU).
    """
    found: dict[int, dict] = {}

    def grab(bn):
        bf16, f32 = cutlass.BFloat16, cutlass.Float32
        K, MN = cute.nvgpu.OperandMajorMode.K, cute.nvgpu.OperandMajorMode.MN
        qk = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K, K, f32, (1, 1, 1), (BLOCK_M, bn))
        pv = sm90_utils.make_trivial_tiled_mma(bf16, bf16, K, MN, f32, (1, 1, 1), (BLOCK_M, half),
                                               warpgroup.OperandSource.RMEM)
        tv_c, tv_a, tv_o = qk.tv_layout_C, pv.tv_layout_A, pv.tv_layout_C
        acc = qk.get_slice(0).make_fragment_C(qk.get_slice(0).partition_shape_C((BLOCK_M, bn)))
        r_p = cute.make_rmem_tensor(pv.get_slice(0).partition_shape_A((BLOCK_M, bn)), bf16)
        n_c, n_a, n_o = (cute.size(x, mode=[1]) for x in (tv_c, tv_a, tv_o))
        found[bn] = dict(
            c={(t, v): int(tv_c((t, v))) for t in range(128) for v in range(n_c)},
            a={(t, a): int(tv_a((t, a))) for t in range(128) for a in range(n_a)},
            o={(t, v): int(tv_o((t, v))) for t in range(128) for v in range(n_o)},
            acc_off=[int(acc.layout(i)) for i in range(cute.size(acc))],
            p_off={(a, kb): int(r_p.layout((a, 0, kb))) for a in range(n_a) for kb in range(bn // 16)},
        )

    @cute.jit
    def probe(x: cute.Tensor):
        for bn in block_ns:  # a Python loop over constants: unrolled at trace time
            grab(bn)

    from cutlass.cute.runtime import make_fake_compact_tensor

    cute.compile(probe, make_fake_compact_tensor(cutlass.Float32, (16,)))
    problems = []
    for bn, r in found.items():
        rc = {k: (v % BLOCK_M, v // BLOCK_M) for k, v in r["c"].items()}
        ra = {k: (v % BLOCK_M, v // BLOCK_M) for k, v in r["a"].items()}
        ro = {k: v % BLOCK_M for k, v in r["o"].items()}
        problems += [f"block_n={bn}: score value {v} of thread {t} is in row {m}, not {rc[(t, 0)][0]} + "
                     f"{8 * ((v // 2) % 2)}" for (t, v), (m, _) in rc.items() if m != rc[(t, 0)][0] + 8 * ((v // 2) % 2)]
        problems += [f"block_n={bn}: output value {v} of thread {t} is in row {m}" for (t, v), m in ro.items()
                     if m != ro[(t, 0)] + 8 * ((v // 2) % 2)]
        value_at = {off: v for v, off in enumerate(r["acc_off"])}
        for (a, kb), off in r["p_off"].items():
            v = value_at[off]
            problems += [f"block_n={bn}: thread {t} P value ({a}, k-block {kb}) holds score {rc[(t, v)]}, the A operand "
                         f"wants {(ra[(t, a)][0], ra[(t, a)][1] + 16 * kb)}" for t in range(128)
                         if rc[(t, v)] != (ra[(t, a)][0], ra[(t, a)][1] + 16 * kb)]
    return problems
