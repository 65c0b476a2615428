"""CuTe DSL paged MLA decode / verify for Hopper (sm90): the ``cute_mla`` backend.

Status: the kernel compiles for ``sm_90a`` (on a CPU too, ``CUTE_DSL_ARCH=sm_90a``) for bf16 and
FP8 E4M3 caches, with and without Helix page tables, with no spills reported by ptxas (168
registers a thread at compile time, ``setmaxnreg`` 40 / 232 at run time; 222,208 bytes of shared
memory for every page size and both dtypes), and its register-layout assumptions are checked at
compile time (``tests/test_cute_mla.py``). On an H100 (2026-12-06) its GPU tests passed, 156 of
them with the prepared launch (150 before it): bf16, FP8 and Helix (``TestGPU``, against a float64 reference), so ``VALIDATED_SM``,
``FP8_VALIDATED_SM`` and ``HELIX_VALIDATED_SM`` hold 90 and :meth:`CuteMLABackend.supports` accepts
sm90 shapes. Measured beside ``triton_mla`` (BENCHMARKS.md, "MLA: cute_mla"), it is 1.1-1.5x faster
at batch 64 with 96-128 heads, but its host cost per call at batch 1 was 365-400 µs in
``bench/mla_decode.py`` (458-817 µs in ``bench/cute_host.py``) on the calling path it had then;
the prepared launch ("Host cost of a call") brings a call to 148-275 µs in ``bench/cute_host.py``
(``triton_mla``: 42-141), so :meth:`CuteMLABackend.cost` keeps ranking it behind ``triton_mla`` (``MEASURED_FASTER`` is
empty): the selector uses it only when named (``attention_backend="cute_mla"``). To re-run the gate
and the measurements::

    pip install nvidia-cutlass-dsl==4.8.1   # 4.8.1 is what was compiled against
    PYTHONPATH=$PWD python -m pytest -m gpu tests/test_cute_mla.py -q
    PYTHONPATH=$PWD python bench/mla_decode.py --quick --backends torch_ref,triton_mla,cute_mla --out OUT/mla
    PYTHONPATH=$PWD python bench/cute_host.py --out OUT/cute_host

On a machine that cannot reach PyPI, install the wheels (Python 3.12 there: ``nvidia-cutlass-dsl``,
``-libs-base``, ``-libs-core``, ``-libs-cu13``; ``cuda-bindings`` is usually present) with
``pip install --no-index --no-deps --target /tmp/site WHEELS`` and put ``/tmp/site`` on
``PYTHONPATH`` (this module adds the package's ``dsl_packages`` folder itself).

``nvidia-cutlass-dsl`` 4.8.1 is a 10 KB meta package over ``-libs-base`` (3.1 MB wheel),
``-libs-core`` (1.6 MB) and ``-libs-cu12`` or ``-libs-cu13`` (92 MB wheel, 237 MB installed: one
MLIR/LLVM shared library), plus ``cuda-bindings``; about 295 MB installed. It imports and
compiles kernels on a machine without a GPU; running them needs the driver.

Kernel (``_cute_mla_kernel.MLADecodeKernel``)
---------------------------------------------
Absorbed MLA: queries ``[T, H, 512 + 64]``, one latent KV head ``[slots, 1, 576]`` addressed
through page tables, V = the first 512 values of each cached row, output ``[T, H, 512]``.

* Rows: a request's ``q_len * H`` query rows, token-major (a contiguous slab of
  ``q.view(T * H, 576)``), in blocks of 64 (one wgmma M). H = 96 x q_len 2 = 192 rows is three
  full blocks; only a request's last block can be partial (tile granularity).
* Grid ``(row blocks, splits, requests)``, 384 threads: warpgroup 0 is the producer (one warp
  issues TMA: the 64 x 576 Q block once, then the split's KV tiles page by page into a ring of
  ``stages`` shared-memory buffers; ``setmaxnreg`` 40), warpgroups 1 and 2 consume
  (``setmaxnreg`` 232).
* Tiles: ``block_n = min(64, page size)`` keys, so a tile never spans pages: one page-table
  lookup and one TMA copy (nine 64-column boxes, 128-byte swizzle) per tile; ring depth
  ``128 / block_n`` (2 x 64, 4 x 32, 8 x 16 keys: ~144 KB) + Q 72 KB.
* Math per tile, both consumer warpgroups: S = Q K^T with wgmma (m64 n``block_n`` k16, Q and K
  from shared memory, fp32 accumulators); causal mask per row (row r sees keys
  ``< kv_len - q_len + r // H + 1``); online softmax in the log2 domain; P rounded to bf16 in
  registers; O += P V with wgmma m64 n256 k16, A = P from registers, B = V read transposed
  (MN-major) from the same K tile. Warpgroup w owns O columns ``[256 w, 256 w + 256)``: the
  64 x 512 fp32 accumulator is split across the two warpgroups (128 registers per thread each),
  and each computes the whole S itself (S costs 576/512 of a PV; computing it twice trades
  tensor-core time for no exchange of P through shared memory).
* A request's last tile may include the page's tail past ``kv_len`` (anything, NaN included,
  and P = 0 does not cancel NaN): the consumers zero those rows in shared memory first.
* Split-KV: each (row block, split) writes its partial output (fp32, normalised over its
  keys) and LSE (log2); :func:`merge_splits` (``mla_pack.merge_partials`` in fewer torch
  ops) merges them exactly (one split is the same merge). ``attend(..., return_lse=True)`` returns
  the natural-log LSE, as ``triton_mla`` does, for Helix-style combines.

FP8 E4M3 cache (``fp8_stages > 0``)
-----------------------------------
wgmma has no bf16 x e4m3 form, so the tiles are converted in shared memory before the wgmmas:

* Warp 0 of the producer warpgroup TMA-loads e4m3 tiles (``block_n`` x 576 bytes, 64-byte
  swizzle) into a staging ring; warps 1-3 (96 threads, ``MLADecodeKernel.convert``) wait on
  it, write each tile as bf16 into the 128-byte-swizzled ring the wgmmas read (the same tile
  layout as the bf16 path), fence the generic-proxy writes for the async proxy and arrive on a
  second pipeline (``PipelineAsync``) that the consumers wait on; they release the staging
  slot to TMA. Each converter thread moves 8 values at a time (one 8-byte shared load, four
  ``cvt.rn.f16x2.e4m3x2``, f16 -> f32 -> ``cvt.rn.bf16x2.f32``, one 16-byte shared store).
  The converters also write zeros for the rows of the last tile past the request's keys, so
  the FP8 consumers skip their own tail-zeroing pass and its barrier.
* Exactness: every e4m3 value is a bf16 value, so the conversion is exact and unscaled. The
  per-tensor ``kv_scale`` is folded instead: into the score scale (``scale * kv_scale *
  log2 e``) for K, and into the epilogue's normaliser (``v_scale / l``) for V. Folding is
  exact up to fp32 rounding; multiplying each value by ``kv_scale`` before the wgmmas would
  round every product ``value * kv_scale`` to bf16 (8 significant bits) and cost a multiply
  per value. P is rounded to bf16 as in the bf16 path; numerics are otherwise the bf16
  path's (bf16 queries, fp32 accumulation).
* Shared memory: tiles of ``min(32, page)`` keys (``kernel_config``), a bf16 ring of 64
  keys (2 x 32 or 4 x 16: 72 KB) and an e4m3 staging ring of 128 keys (4 x 32 or 8 x 16:
  72 KB), + Q 72 KB: 222,208 bytes with the barriers, as for bf16 (227 KB allowed). Tiles of
  64 keys would leave room for one bf16 stage only (converter and consumers in lock step).
* Cost, not measured yet: a 32-key tile is 18,432 values, 192 per converter thread, and each
  pair of values takes three conversion instructions, which run at a fraction of the FMA
  rate; ``triton_mla`` found e4m3 -> bf16 costly enough to run its FP8 dots in fp16 instead.
  The converters work at the producer warpgroup's 40 registers.

Helix (``helix``)
-----------------
Under Helix the plan's page tables are the rank's own (logical page ``p`` is local page
``p // cp`` of rank ``p % cp``) and ``kv_lens`` stay global. Key ``k`` of a request is the
``k``-th position the rank owns; the kernel turns every bound on positions into a count of
owned positions with ``MLADecodeKernel.owned`` (``triton_mla._owned``; host copy
:func:`~specdec.attention.mla_pack.owned_keys`): the request's keys (split chunks and the
tail zeroing), the block's stop and each row's causal bound. The rest is unchanged. A row
that sees none of the rank's keys gets output 0 and LSE ``-inf``. :meth:`CuteMLABackend.run`
then exchanges the fp32 partials and LSEs by head, combines them and gathers the heads
(:func:`~specdec.parallel.helix.exchange_heads`, :func:`~specdec.parallel.helix.gather_heads`;
``local_heads`` keeps the rank's slice), as ``triton_mla`` and ``helix_ref`` do.

Host cost of a call
-------------------
A call costs the host: its checks and split choice (plain Python), two allocations (the
partials), writing the launch's arguments (~5 µs), the C call into the compiled host function
(it encodes the two TMA descriptors and launches), and the merge's tensor ops (10, a few µs each
on a GPU). Gone is the per-call conversion of every tensor, likely the bulk of the previous
path's cost (``bench/cute_host.py`` times both paths and the pieces on a GPU):

* The backend compiles ``MLADecodeKernel.launch``, an entry that takes device addresses, sizes
  and scales (``LAUNCH_ARGS``) and builds the tensors itself, with the types ``from_dlpack``
  gives contiguous CUDA tensors: the kernel's PTX is the one the tensor entry compiles to
  (compared on the CPU). It compiles against placeholder pointers (``cute.runtime.make_ptr``),
  so no data is needed and one compile serves every shape.
* :class:`PreparedLaunch` keeps one ctypes value per argument for its lifetime; the DSL marshals
  slots pointing at them once (its ``JitArgument`` protocol's ``__c_pointers__``, through
  ``generate_execution_args``), and every launch writes the values (:func:`launch_args`: read
  from the tensors on each call, so nothing can go stale) and runs that argument list through
  the executor (``JitCompiledFunction.to()``, ``run_compiled_program``). That replaces, per call,
  eight ``from_dlpack`` conversions with their memref descriptors, eight ``cutlass`` scalar
  wrappers and the DSL's marshalling of all of them: measured on a slow CPU host without a GPU,
  ~110 µs of Python became ~5 µs. On an H100 host (2026-12-06, ``bench/cute_host.py``, H 128,
  q_len 1, bf16) a batch-1 call with 1K context went from 458 to 156 µs (``triton_mla`` 76), with
  outputs and LSEs bit-identical to the previous path's and the 156 GPU tests passing; argument
  preparation is 8 µs, the launch 19 µs and the merge 83-89 µs, at one split as at 64.
* The merge: by default one Triton launch (``merge="fused"``,
  :func:`~specdec.attention.backends.triton_mla.merge_split_partials`: ``triton_mla``'s own merge
  kernel, told to ignore the partial of a split that saw no key, as ``merge_partials`` does), the
  same merge up to fp32
  rounding. ``merge="torch"`` keeps :func:`merge_splits`: 10 tensor ops (13 with the LSE) where
  ``merge_partials`` takes 20, with the same results bit for bit (the calling-path comparisons
  use it). Not yet timed on a GPU against the 83-89 µs of the tensor ops.
* Not used: TVM-FFI (``cute.compile(..., options="--enable-tvm-ffi")``), which takes torch tensors
  directly but needs the ``apache-tvm-ffi`` package; ``bench/cute_host.py`` times the previous
  path, this one and ``triton_mla`` on the same shapes.

Not done yet (in order): timing the fused merge (the host cost above); measuring the FP8
converters against the consumers (if they are the bottleneck: fp16 dots as ``triton_mla``
does, i.e. e4m3 -> f16 is one ``cvt`` per two values and Q is converted once per CTA with a
power-of-two scale per row, or the consumers converting too); bf16 output written by the
kernel when there is one split; P shared through shared memory instead of
recomputing S in both warpgroups; a persistent grid.
"""

from __future__ import annotations

import ctypes
import math
import threading
from typing import Any

import torch

from specdec.attention.backends.base import AttentionBackend, PhaseBatch
from specdec.attention.mla_pack import LN2, LOG2E, MLAPlan, choose_splits, padded_page_tables, row_blocks, sm_count
from specdec.attention.shapes import YES, AttnShape, Verdict, no
from specdec.errors import ConfigError
from specdec.parallel.helix import exchange_heads, gather_heads

TOKENS_PER_BLOCK = (16, 32, 64, 128)
LATENT, ROPE = 512, 64  # the only dims compiled and tested (DeepSeek-V3 / Kimi absorbed MLA)
MAX_Q_LEN = 8
MAX_HEADS = 128
Q_DTYPES = ("bfloat16",)
KV_DTYPES = ("bfloat16", "float8_e4m3fn")
BLOCK_M = 64
SMEM_LIMIT = 227 * 1024  # an sm90 CTA's shared memory (kernel_config keeps every ring within it)
# GPU archs on which tests/test_cute_mla.py::TestGPU has passed (bf16 cache, unsharded): sm90 on an
# H100, 2026-12-06 (70 passed). An arch not listed is never selected, never run by a request.
VALIDATED_SM: tuple[int, ...] = (90,)
# Likewise for the FP8 E4M3 cache (TestGPU::test_fp8_*: 69 passed) and Helix page tables
# (TestGPU::test_helix_*: 11 passed), each on top of VALIDATED_SM.
FP8_VALIDATED_SM: tuple[int, ...] = (90,)
HELIX_VALIDATED_SM: tuple[int, ...] = (90,)
# (kv_dtype, max_q_len) classes where bench/mla_decode.py measured cute_mla faster than triton_mla
# on a validated arch; elsewhere cost() ranks it behind triton_mla. Empty: faster at batch 64 with
# 96-128 heads (1.1-1.5x), slower at batch 1 (148-275 µs a call on the host with the prepared launch in
# bench/cute_host.py, 458-817 before it; triton_mla 42-141), and a class has no batch.
MEASURED_FASTER: frozenset[tuple[str, int]] = frozenset()



def _import_kernel():
    """The kernel module, or the reason it cannot be imported.

    ``pip install --target DIR`` (how wheels are installed beside a read-only environment) skips
    the package's ``.pth`` file, which puts ``nvidia_cutlass_dsl/dsl_packages`` on ``sys.path``:
    that one step is repeated here when ``cutlass`` is otherwise missing.
    """
    try:
        from specdec.attention.backends import _cute_mla_kernel as kernel
        return kernel, None
    except Exception as exc:  # not only ImportError: a broken MLIR library may raise anything
        first = exc
    try:
        import os
        import sys

        import nvidia_cutlass_dsl  # noqa: F401 - the wheel without its .pth applied

        path = os.path.join(nvidia_cutlass_dsl.__path__[0], "dsl_packages")
        if os.path.isdir(path) and path not in sys.path:
            sys.path.insert(0, path)
        from specdec.attention.backends import _cute_mla_kernel as kernel
        return kernel, None
    except Exception:
        return None, f"{type(first).__name__}: {first}"


# The kernel needs nvidia-cutlass-dsl; without it this module still imports and refuses every shape.
_kernel, IMPORT_ERROR = _import_kernel()


CuteMLAPlan = MLAPlan  # the plan both paged MLA backends build (specdec.attention.mla_pack)

#: prepared launches (:class:`PreparedLaunch`) of the compiled kernels by (latent, rope, page size, cache
#: dtype, Helix): a compile takes seconds, so every backend instance (one per engine, and the tests') shares them
_COMPILED: dict[tuple, Any] = {}
_COMPILE_LOCK = threading.Lock()


class CuteMLABackend(AttentionBackend):
    """Paged absorbed-MLA decode / verify in CuTe DSL (wgmma, TMA, warp-specialised), sm90."""

    name = "cute_mla"

    #: how split partials are merged: ``"fused"``, one Triton launch
    #: (:func:`~specdec.attention.backends.triton_mla.merge_split_partials`); ``"torch"``,
    #: :func:`merge_splits` (10-13 tensor ops, bit for bit ``merge_partials``)
    MERGES = ("fused", "torch")

    def __init__(self, num_splits: int | None = None, merge: str = "fused"):
        """Args:
            num_splits: split-KV count for every call; ``None``: the makespan model
                (``mla_pack.choose_splits``).
            merge: ``"fused"`` (default): the split partials merged in one Triton launch, the
                same merge up to fp32 rounding; ``"torch"``: :func:`merge_splits`, bit for bit the
                reference ``merge_partials`` (what the calling-path comparisons use)."""
        if merge not in self.MERGES:
            raise ValueError(f"cute_mla: merge must be one of {self.MERGES}, got {merge!r}")
        self.num_splits = num_splits  # None: the makespan model (mla_pack.choose_splits)
        self.merge = merge
        self._compiled = _COMPILED  # shared by every instance: one compile per kernel configuration

    # ------------------------------------------------------------------ supports / cost

    def supports(self, shape: AttnShape) -> Verdict:
        """Limits: MLA generation phases (decode or verify up to ``MAX_Q_LEN`` tokens), one latent
        KV head of 512 + 64, ``num_heads <= 128`` (under Helix, ``helix_cp > 1``: divisible by
        ``helix_cp``, for the exchange by head), pages of 16/32/64/128, bf16 queries, a bf16 or FP8
        E4M3 cache; cuda at an arch in ``VALIDATED_SM`` (empty until the GPU tests pass), FP8 also
        in ``FP8_VALIDATED_SM`` and Helix in ``HELIX_VALIDATED_SM``, with ``nvidia-cutlass-dsl`` installed."""
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
        if shape.num_heads > MAX_HEADS:
            return no(f"num_heads must be <= {MAX_HEADS}, got {shape.num_heads}")
        if (shape.v_head_dim, shape.head_dim - shape.v_head_dim) != (LATENT, ROPE):
            return no(f"only latent {LATENT} + rope {ROPE} is compiled, got {shape.v_head_dim} + "
                      f"{shape.head_dim - shape.v_head_dim}")
        if shape.tokens_per_block not in TOKENS_PER_BLOCK:
            return no(f"tokens_per_block must be one of {TOKENS_PER_BLOCK}, got {shape.tokens_per_block}")
        if shape.device != "cuda":
            return no(f"device must be cuda (a CuTe DSL kernel for sm90), got {shape.device}")
        if shape.q_dtype not in Q_DTYPES:
            return no(f"q_dtype must be one of {Q_DTYPES}, got {shape.q_dtype}")
        if shape.kv_dtype not in KV_DTYPES:
            return no(f"kv_dtype must be one of {KV_DTYPES}, got {shape.kv_dtype}")
        if IMPORT_ERROR is not None:
            return no(f"nvidia-cutlass-dsl is not importable ({IMPORT_ERROR})")
        if shape.sm != 90:
            return no(f"the kernel is written for sm90 (wgmma, setmaxnreg), got sm={shape.sm}")
        if shape.sm not in VALIDATED_SM:
            return no(f"not yet validated on SM{shape.sm} (gate: tests/test_cute_mla.py::TestGPU; "
                      f"validated: {VALIDATED_SM})")
        if shape.kv_dtype == "float8_e4m3fn" and shape.sm not in FP8_VALIDATED_SM:
            return no(f"the FP8 E4M3 cache is not yet validated on SM{shape.sm} (gate: "
                      f"tests/test_cute_mla.py::TestGPU::test_fp8_*; validated: {FP8_VALIDATED_SM})")
        if shape.helix_cp > 1 and shape.sm not in HELIX_VALIDATED_SM:
            return no(f"Helix (helix_cp={shape.helix_cp}) is not yet validated on SM{shape.sm} (gate: "
                      f"tests/test_cute_mla.py::TestGPU::test_helix_*; validated: {HELIX_VALIDATED_SM})")
        return YES

    def cost(self, shape: AttnShape) -> float:
        # triton_mla costs 10 on the GPU: cute_mla goes ahead of it only in classes measured faster.
        if (shape.kv_dtype, shape.max_q_len) in MEASURED_FASTER:
            return 5.0
        return 20.0

    # ------------------------------------------------------------------ plan / run

    @staticmethod
    def _num_sms(device: torch.device) -> int:
        return sm_count(device, off_cuda=132)  # an H200's, for plans made on the CPU (tests)

    def plan(self, batch: PhaseBatch) -> CuteMLAPlan:
        """Upload the phase's page tables and lengths.

        Under Helix (``batch.shard`` with ``cp > 1``) the page tables are the rank's own and
        ``kv_lens`` global; a request needs only the pages of the positions the rank owns.
        """
        tpb, dev = batch.tokens_per_block, batch.device
        if tpb not in TOKENS_PER_BLOCK:
            raise ValueError(f"cute_mla: tokens_per_block must be one of {TOKENS_PER_BLOCK}, got {tpb}")
        shard = batch.shard if batch.shard is not None and batch.shard.cp > 1 else None
        if shard is not None and shard.layout.tokens_per_block != tpb:
            raise ValueError(f"cute_mla: the Helix layout's pages hold {shard.layout.tokens_per_block} tokens, "
                             f"the batch's {tpb}")
        keys = batch.kv_lens if shard is None else [shard.layout.local_length(kv, shard.rank) for kv in batch.kv_lens]
        page_table, q_lens, q_start = padded_page_tables("cute_mla", batch.q_lens, batch.kv_lens, keys,
                                                         batch.page_tables, tpb, dev)
        return CuteMLAPlan(
            page_table=page_table,
            kv_lens=torch.tensor(batch.kv_lens, dtype=torch.int32).to(dev),
            q_start=q_start,
            q_lens=q_lens,
            num_seqs=len(batch.q_lens),
            num_tokens=batch.num_tokens,
            max_q_len=max(batch.q_lens),
            max_kv_len=max(keys),
            tokens_per_block=tpb,
            num_sms=self._num_sms(dev),
            shard=shard,
        )

    def splits_for(self, plan: CuteMLAPlan, num_heads: int, *, fp8: bool = False) -> int:
        """KV splits of a launch: fixed, or the makespan model over one CTA per SM."""
        if self.num_splits is not None:
            return self.num_splits
        block_n = kernel_config(plan.tokens_per_block, fp8=fp8)[0]
        ctas = plan.num_seqs * row_blocks(plan.max_q_len, num_heads, BLOCK_M)
        return choose_splits(ctas, plan.max_kv_len, plan.num_sms, block_n=block_n)

    def run(self, plan: CuteMLAPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
            scale: float, v_head_dim: int, *, kv_scale: float = 1.0, local_heads: bool = False) -> torch.Tensor:
        """Attend the phase's queries over the latent cache (``TritonMLABackend.run``'s contract).

        Unsharded: one :meth:`attend`. Under Helix every rank of the group calls this for the same
        phase: each attends over its own pages, the fp32 partials and their LSEs are exchanged by
        head and combined (:func:`~specdec.parallel.helix.exchange_heads`), and the heads gathered
        back (``local_heads``: the rank's head slice ``[T, H / cp, latent]`` instead).
        """
        if v_cache is not None:
            raise ValueError("cute_mla reads V from the latent cache; v_cache must be None")
        if plan.shard is None:
            return self.attend(plan, q, k_cache, scale, v_head_dim, kv_scale=kv_scale)
        out, lse = self.attend(plan, q, k_cache, scale, v_head_dim, kv_scale=kv_scale, return_lse=True,
                               out_dtype=torch.float32)  # [T, H, Dv], [T, H]
        head_slice = exchange_heads(out, lse, plan.shard.group).to(q.dtype)  # [T, H / cp, Dv]
        return head_slice if local_heads else gather_heads(head_slice, plan.shard.group)

    def attend(self, plan: CuteMLAPlan, q: torch.Tensor, k_cache: torch.Tensor, scale: float, v_head_dim: int, *,
               kv_scale: float = 1.0, return_lse: bool = False, out_dtype: torch.dtype | None = None,
               ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Same contract as ``TritonMLABackend.attend``: ``out [T, H, latent]`` (and with ``return_lse``
        the natural-log LSE ``[T, H]`` fp32 of ``scale * kv_scale * q . k``); bf16 queries, a bf16 or
        FP8 E4M3 cache (``kv_scale``: its per-tensor dequantisation scale). Under Helix (a plan with a
        shard) a partial over this rank's pages: a row that sees none of them has ``out = 0``, ``lse = -inf``."""
        if _kernel is None:
            raise RuntimeError(f"cute_mla needs nvidia-cutlass-dsl ({IMPORT_ERROR})")
        num_tokens, num_heads, head_dim = q.shape
        if num_tokens != plan.num_tokens or k_cache.shape[1:] != (1, head_dim):
            raise ValueError(f"cute_mla: q {tuple(q.shape)} / k_cache {tuple(k_cache.shape)} do not match the plan "
                             f"({plan.num_tokens} tokens, one latent head of width {head_dim})")
        if (v_head_dim, head_dim - v_head_dim) != (LATENT, ROPE):
            raise ValueError(f"cute_mla: only {LATENT} + {ROPE} is compiled, got {v_head_dim} + {head_dim - v_head_dim}")
        if q.dtype != torch.bfloat16 or k_cache.dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"cute_mla: bf16 queries and a bf16 or float8_e4m3fn cache only, got q {q.dtype}, "
                             f"cache {k_cache.dtype}")
        if not k_cache.is_contiguous():
            raise ValueError("cute_mla: k_cache must be contiguous")
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        q = q.contiguous()
        splits = self.splits_for(plan, num_heads, fp8=fp8)
        n_rows = num_tokens * num_heads
        o_part = torch.empty(n_rows * splits, v_head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(n_rows * splits, dtype=torch.float32, device=q.device)
        grid_m = row_blocks(plan.max_q_len, num_heads, BLOCK_M)
        self._launch(plan, q.view(n_rows, head_dim), k_cache.view(-1, head_dim), o_part, lse_part,
                     scale * kv_scale * LOG2E, kv_scale, num_heads, splits, grid_m)
        if self.merge == "fused" and o_part.is_cuda:
            from specdec.attention.backends.triton_mla import merge_split_partials  # triton: a GPU extra

            out, lse = merge_split_partials(o_part, lse_part, num_tokens, num_heads, out_dtype or q.dtype,
                                            with_lse=return_lse)
        else:
            out, lse = merge_splits(o_part.view(n_rows, splits, v_head_dim), lse_part.view(n_rows, splits),
                                    out_dtype or q.dtype, with_lse=return_lse)
        out = out.view(num_tokens, num_heads, v_head_dim)
        return (out, lse.view(num_tokens, num_heads)) if return_lse else out

    def _launch(self, plan, q2, kv2, o_part, lse_part, scale_log2, v_scale, num_heads, splits, grid_m) -> None:
        fp8, helix = kv2.dtype == torch.float8_e4m3fn, plan.shard is not None
        key = (LATENT, ROPE, plan.tokens_per_block, str(kv2.dtype).removeprefix("torch."), helix)
        launch = self._compiled.get(key)
        if launch is None:
            with _COMPILE_LOCK:  # one compile of a configuration (seconds), whoever asks first
                launch = self._compiled.get(key)
                if launch is None:  # compiled against placeholder pointers: no data needed
                    compiled, _ = _kernel.compile_launch(LATENT, ROPE, plan.tokens_per_block,
                                                         *kernel_config(plan.tokens_per_block, fp8=fp8), helix=helix)
                    launch = self._compiled[key] = PreparedLaunch(compiled)
        stream = torch.cuda.current_stream(q2.device).cuda_stream if q2.is_cuda else 0
        launch(launch_args(plan, q2, kv2, o_part, lse_part, scale_log2, v_scale, num_heads, splits, grid_m, stream))


# --------------------------------------------------------------------------- the host side of a call


def launch_args(plan: CuteMLAPlan, q2: torch.Tensor, kv2: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor,
                scale_log2: float, v_scale: float, num_heads: int, splits: int, grid_m: int, stream: int) -> tuple:
    """The values of ``MLADecodeKernel.launch``'s arguments for one call, in ``LAUNCH_ARGS`` order.

    Read from the tensors on every call (addresses, row counts, the page table's row stride), so
    nothing here can go stale when a buffer is reallocated, resized or replaced. ``q2``, ``kv2``,
    ``o_part`` and the plan's tensors are contiguous (``attend`` and ``plan`` make them so); the
    kernel assumes 16-byte-aligned rows and vectors (TMA, vector stores) and a 4-byte-aligned page
    table, as the tensors' conversion used to check.

    Raises:
        ConfigError: a buffer the kernel would misread: misaligned, not contiguous (the page table:
            rows of contiguous ints), plan vectors or page table not int32, or buffers on several devices.
    """
    table = plan.page_table
    vectors = (plan.kv_lens, plan.q_start, plan.q_lens)
    data = (q2.data_ptr(), kv2.data_ptr(), o_part.data_ptr(), lse_part.data_ptr())
    meta = (table.data_ptr(), *(v.data_ptr() for v in vectors))
    if (data[0] | data[1] | data[2] | data[3] | meta[1] | meta[2] | meta[3]) % 16 or meta[0] % 4:
        raise ConfigError("cute_mla: q, the cache, the partials and the plan's vectors must start 16-byte aligned "
                          "(the page table 4-byte aligned)")
    if table.dtype != torch.int32 or any(v.dtype != torch.int32 for v in vectors):
        raise ConfigError(f"cute_mla: the page table and the plan's vectors must be int32, got {table.dtype}, "
                          f"{[str(v.dtype) for v in vectors]}")
    if table.dim() != 2 or table.stride(1) != 1 or not all(
            t.is_contiguous() for t in (q2, kv2, o_part, lse_part, *vectors)):
        raise ConfigError("cute_mla: q, the cache, the partials and the plan's vectors must be contiguous, and the "
                          "page table rows of contiguous ints")
    if len({t.device for t in (q2, kv2, o_part, lse_part, table, *vectors)}) != 1:
        raise ConfigError("cute_mla: every buffer of a call must be on one device")
    cp, rank = (plan.shard.cp, plan.shard.rank) if plan.shard is not None else (1, 0)
    return (*data, *meta, q2.shape[0], kv2.shape[0], o_part.shape[0], plan.num_seqs, table.shape[1],
            table.stride(0), scale_log2, v_scale, num_heads, splits, grid_m, cp, rank, stream)


class _ArgSlot:
    """Where the compiled host function reads one argument from: a ctypes value's address.

    The runtime half of the DSL's ``JitArgument`` protocol (``__c_pointers__``: the addresses of an
    argument's data), which the DSL's own marshalling accepts for any argument.
    """

    __slots__ = ("_pointers",)

    def __init__(self, value: ctypes._SimpleCData):
        self._pointers = [ctypes.addressof(value)]

    def __c_pointers__(self) -> list[int]:
        return self._pointers


class PreparedLaunch:
    """A compiled ``MLADecodeKernel.launch`` whose argument marshalling is done once.

    Calling the compiled function marshals every argument on every call (the DSL's
    ``generate_execution_args``: a ``from_dlpack`` memref descriptor per tensor, a fresh ctypes
    object per scalar). Here every argument lives in one ctypes value for the launcher's lifetime
    (``LAUNCH_ARGS`` gives their C types); on the first launch the DSL marshals slots pointing at
    them (:class:`_ArgSlot`) into its argument list and the module is loaded (``compiled.to()``).
    A launch then writes the values in place and runs that list through the executor
    (``run_compiled_program``: pack the pointers, call the host function, check its CUDA status).
    A lock serialises launches: the values are shared by every caller of this kernel configuration.
    """

    def __init__(self, compiled: Any):
        self.compiled = compiled
        self.values = [ctype() for _, ctype in _kernel.LAUNCH_ARGS]
        self.slots = [_ArgSlot(v) for v in self.values]
        self._lock = threading.Lock()
        self._exe_args: list | None = None
        self._run = None

    def write(self, args: tuple) -> None:
        """Store one call's argument values (``launch_args``) where the host function reads them."""
        for value, arg in zip(self.values, args, strict=True):
            value.value = arg

    def __call__(self, args: tuple) -> None:
        """Launch the kernel with one call's argument values (:func:`launch_args`, in ``LAUNCH_ARGS``
        order) on the stream they name; marshals and loads the module on the first call."""
        with self._lock:
            self.write(args)
            if self._run is None:  # first launch: marshal the slots, load the module (needs the driver)
                exe_args, _ = self.compiled.generate_execution_args(*self.slots)
                self._run, self._exe_args = self.compiled.to().run_compiled_program, exe_args
            self._run(self._exe_args)


def merge_splits(o_part: torch.Tensor, lse2_part: torch.Tensor, out_dtype: torch.dtype, *, with_lse: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`~specdec.attention.mla_pack.merge_partials` in fewer kernel launches, same results.

    Its arguments and results, except that ``o_part`` (the caller's scratch) has its NaN and
    infinities replaced in place and the LSE is ``None`` without ``with_lse``. Each step is one op
    on the same operands in the same order, so every value is the same, bit for bit but for NaN
    payloads: the maximum's ``-inf`` -> 0 is one ``nan_to_num``; the divisor (the total, or 1 where
    it is 0) is ``clamp(min=1)``, as a total is 0 or at least 1 (the largest split adds exactly
    ``exp2(0)``); the division writes ``out_dtype`` itself (the fp32 quotient rounded once, as
    ``.to`` rounds it); the LSE needs no ``-inf`` fill, as a zero total comes only with an
    all-``-inf`` row whose ``0 + log2(0)`` is already ``-inf``; no constant tensors are built.
    10 launches for the output (13 with the LSE) where ``merge_partials`` makes 20.
    """
    m_safe = lse2_part.amax(dim=1, keepdim=True).nan_to_num_(nan=math.nan, posinf=math.inf, neginf=0.0)
    w = torch.sub(lse2_part, m_safe).exp2_()  # [rows, splits]; -inf -> 0
    total = w.sum(dim=1, keepdim=True)
    numerator = (w.unsqueeze(-1) * o_part.nan_to_num_()).sum(dim=1)
    out = torch.empty(numerator.shape, dtype=out_dtype, device=numerator.device)
    torch.div(numerator, total.clamp(min=1.0), out=out)  # fp32 quotients, rounded once to out_dtype
    lse = torch.log2(total).add_(m_safe).mul_(LN2).squeeze(1) if with_lse else None
    return out, lse


def kernel_config(tokens_per_block: int, fp8: bool = False) -> tuple[int, int, int]:
    """``(block_n, stages, fp8_stages)`` for a page size and cache dtype (see the module docstring).

    bf16: tiles of ``min(64, page)`` keys, a ring of 128 keys (2 x 64 ... 8 x 16), no staging.
    FP8: tiles of ``min(32, page)`` keys, a bf16 ring of 64 keys and an e4m3 staging ring of 128.
    Either way 144 KB of rings + 72 KB of Q (under ``SMEM_LIMIT``).
    """
    if fp8:
        block_n = min(32, tokens_per_block)
        return block_n, max(2, 64 // block_n), max(2, 128 // block_n)
    block_n = min(64, tokens_per_block)
    return block_n, max(2, 128 // block_n), 0
