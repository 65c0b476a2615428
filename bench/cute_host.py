"""Host cost of a ``cute_mla`` call: the previous calling path, the prepared launch, and ``triton_mla``.

One GPU run (an sm90 GPU with ``nvidia-cutlass-dsl`` 4.8.1, staged as ``cute_mla``'s docstring says;
under a minute, two kernel compiles included):

    python bench/cute_host.py --out OUT/cute_host

Shapes: H 128, q_len 1, pages of 64, bf16 queries and cache, batch {1, 64} x context {1K, 32K}
(queries, cache and pages from ``bench/mla_decode.py``'s ``Bench``). Per shape, the median over
``--reps`` calls, in µs:

- ``*_host``: the call alone, the GPU idle before it (what the call costs the host; the GPU runs
  behind it); ``*_sync``: the call and ``torch.cuda.synchronize()`` (host, GPU and the wait);
- ``prev``: the path ``cute_mla`` had before (:class:`PreviousPath`, also what
  ``tests/test_cute_mla.py`` compares the new path with: eight ``from_dlpack`` conversions, the
  scalars wrapped, the DSL's own argument marshalling on every call, ``merge_partials``);
  ``new``: ``CuteMLABackend(merge="torch").attend`` (``launch_args`` written into a
  ``PreparedLaunch``, ``merge_splits``); ``fused``: the default ``CuteMLABackend().attend`` (the
  same launch, the split partials merged in one Triton launch); ``triton``:
  ``TritonMLABackend.attend``, same inputs;
- ``prep_prev`` / ``prep_new``: the argument preparation alone (conversions + marshalling, against
  ``launch_args`` + ``PreparedLaunch.write``); ``launch_new`` / ``merge_new`` / ``merge_prev``: the
  new path's launch and merge alone, and ``merge_partials``; ``merge_fused``: the fused merge alone;
- ``fused_max_diff``: the fused path's largest difference from ``new`` (output or LSE);
- ``bitwise``: the ``prev`` and ``new`` paths' outputs and LSEs compared bit for bit.

Writes ``cute_host.md`` and ``cute_host.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

H, Q_LEN, PAGE = 128, 1, 64
BATCHES, CONTEXTS = (1, 64), (1024, 32768)
LATENT, ROPE = 512, 64
COLUMNS = ("batch", "context", "splits", "prev_host", "new_host", "triton_host", "prev_sync", "new_sync",
           "triton_sync", "prep_prev", "prep_new", "launch_new", "merge_new", "merge_prev", "fused_host", "fused_sync",
           "merge_fused", "fused_max_diff", "bitwise")


def previous_args(plan, q2, kv2, o_part, lse_part, scale_log2, v_scale, num_heads, splits, grid_m, stream=0, *,
                  wrap=None) -> tuple:
    """The arguments ``cute_mla``'s previous path built on every call, for the tensor entry
    ``MLADecodeKernel.__call__``: each tensor converted with ``from_dlpack`` (its row count dynamic;
    the page table's layout dynamic), the scalars wrapped in ``cutlass`` types. ``wrap`` (tests)
    replaces each tensor with what to convert instead (e.g. a CPU tensor typed as a CUDA one)."""
    import cuda.bindings.driver as cuda_driver
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    wrap = wrap or (lambda t: t)

    def dyn_rows(t):  # dim 0 dynamic, inner dims static
        if t.dtype == torch.float8_e4m3fn:  # DLPack has no float8: bytes, then the element type set
            out = from_dlpack(wrap(t.view(torch.uint8)), assumed_align=16).mark_compact_shape_dynamic(mode=0)
            out.element_type = cutlass.Float8E4M3FN
            return out
        return from_dlpack(wrap(t), assumed_align=16).mark_compact_shape_dynamic(mode=0)

    cp, rank = (plan.shard.cp, plan.shard.rank) if plan.shard is not None else (1, 0)
    return (dyn_rows(q2), dyn_rows(kv2), dyn_rows(o_part), dyn_rows(lse_part),
            from_dlpack(wrap(plan.page_table), assumed_align=4).mark_layout_dynamic(leading_dim=1),
            dyn_rows(plan.kv_lens), dyn_rows(plan.q_start), dyn_rows(plan.q_lens),
            cutlass.Float32(scale_log2), cutlass.Float32(v_scale), cutlass.Int32(num_heads),
            cutlass.Int32(splits), cutlass.Int32(grid_m), cutlass.Int32(plan.num_seqs),
            cutlass.Int32(cp), cutlass.Int32(rank), cuda_driver.CUstream(stream))


class PreviousPath:
    """``CuteMLABackend.attend`` as it was before the prepared launch, for comparison: the tensor
    entry compiled against the first call's converted tensors (one compile per page size, cache
    dtype and Helix), and every call converting its tensors (:func:`previous_args`), the compiled
    function marshalling them, ``merge_partials`` merging. Its argument checks (plain Python, the
    same as the new path's) are left out."""

    def __init__(self, backend):
        self.backend = backend  # the same split choice as the new path
        self.compiled = {}

    def args(self, plan, q2, *rest) -> tuple:
        return previous_args(plan, q2, *rest, stream=torch.cuda.current_stream(q2.device).cuda_stream)

    def kernel(self, plan, args, fp8: bool):
        key = (plan.tokens_per_block, fp8, plan.shard is not None)
        if key not in self.compiled:
            import cutlass.cute as cute

            from specdec.attention.backends import _cute_mla_kernel as K
            from specdec.attention.backends.cute_mla import kernel_config

            k = K.MLADecodeKernel(LATENT, ROPE, plan.tokens_per_block, *kernel_config(plan.tokens_per_block, fp8=fp8),
                                  helix=plan.shard is not None)
            self.compiled[key] = cute.compile(k, *args)
        return self.compiled[key]

    def attend(self, plan, q, k_cache, scale, v_head_dim, *, kv_scale=1.0, return_lse=False, out_dtype=None):
        from specdec.attention.backends.cute_mla import BLOCK_M
        from specdec.attention.mla_pack import LOG2E, merge_partials, row_blocks

        num_tokens, num_heads, head_dim = q.shape
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        q = q.contiguous()
        splits = self.backend.splits_for(plan, num_heads, fp8=fp8)
        n_rows = num_tokens * num_heads
        o_part = torch.empty(n_rows * splits, v_head_dim, dtype=torch.float32, device=q.device)
        lse_part = torch.empty(n_rows * splits, dtype=torch.float32, device=q.device)
        args = self.args(plan, q.view(n_rows, head_dim), k_cache.view(-1, head_dim), o_part, lse_part,
                         scale * kv_scale * LOG2E, kv_scale, num_heads, splits,
                         row_blocks(plan.max_q_len, num_heads, BLOCK_M))
        self.kernel(plan, args, fp8)(*args)
        out, lse = merge_partials(o_part.view(n_rows, splits, v_head_dim), lse_part.view(n_rows, splits),
                                  out_dtype or q.dtype)
        out = out.view(num_tokens, num_heads, v_head_dim)
        return (out, lse.view(num_tokens, num_heads)) if return_lse else out


def median_us(fn, reps: int, sync: bool = False) -> float:
    """Median µs of ``fn()`` with the GPU idle before each call: the call's own cost to the host, or
    with ``sync`` until the GPU has finished it too."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    ints = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(ints[a.dtype]), b.view(ints[b.dtype]))


def measure(bench, prev, new, triton_backend, *, fused, batch: int, context: int, reps: int) -> dict:
    from specdec.attention.backends.cute_mla import BLOCK_M, launch_args, merge_splits
    from specdec.attention.backends.triton_mla import merge_split_partials
    from specdec.attention.mla_pack import LOG2E, merge_partials, row_blocks

    phase, q = bench.step(h=H, q_len=Q_LEN, batch=batch, context=context, page=PAGE)
    cache = bench.cache["bf16"][: batch * -(-context // PAGE) * PAGE]
    scale = (128 + 64) ** -0.5
    plan, t_plan = new.plan(phase), triton_backend.plan(phase)

    out_new, lse_new = new.attend(plan, q, cache, scale, LATENT, return_lse=True)  # compiles on first use
    out_prev, lse_prev = prev.attend(plan, q, cache, scale, LATENT, return_lse=True)
    triton_backend.attend(t_plan, q, cache, scale, LATENT)
    same = bitwise_equal(out_new, out_prev) and bitwise_equal(lse_new, lse_prev)

    def run_prev():
        return prev.attend(plan, q, cache, scale, LATENT)

    def run_new():
        return new.attend(plan, q, cache, scale, LATENT)

    def run_triton():
        return triton_backend.attend(t_plan, q, cache, scale, LATENT)

    def run_fused():
        return fused.attend(plan, q, cache, scale, LATENT)

    out_fused, lse_fused = fused.attend(plan, q, cache, scale, LATENT, return_lse=True)
    fused_err = max((out_fused.float() - out_new.float()).abs().max().item(),
                    (lse_fused - lse_new).abs().max().item())

    # the pieces, on the shape's own buffers
    splits = new.splits_for(plan, H)
    n_rows = batch * Q_LEN * H
    q2, kv2 = q.view(n_rows, -1), cache.view(-1, LATENT + ROPE)
    o_part = torch.empty(n_rows * splits, LATENT, dtype=torch.float32, device=q.device)
    lse_part = torch.empty(n_rows * splits, dtype=torch.float32, device=q.device)
    grid_m = row_blocks(Q_LEN, H, BLOCK_M)
    pieces = (plan, q2, kv2, o_part, lse_part, scale * LOG2E, 1.0, H, splits, grid_m)
    launch = new._compiled[(LATENT, ROPE, PAGE, "bfloat16", False)]
    old_kernel = prev.kernel(plan, prev.args(*pieces), fp8=False)

    def prep_prev():
        return old_kernel.generate_execution_args(*prev.args(*pieces))

    def prep_new():
        launch.write(launch_args(*pieces, torch.cuda.current_stream(q.device).cuda_stream))

    o3, l2 = o_part.view(n_rows, splits, LATENT), lse_part.view(n_rows, splits)
    row = dict(batch=batch, context=context, splits=splits,
               prev_host=median_us(run_prev, reps), new_host=median_us(run_new, reps),
               triton_host=median_us(run_triton, reps),
               prev_sync=median_us(run_prev, reps, sync=True), new_sync=median_us(run_new, reps, sync=True),
               triton_sync=median_us(run_triton, reps, sync=True),
               prep_prev=median_us(prep_prev, reps), prep_new=median_us(prep_new, reps),
               launch_new=median_us(lambda: new._launch(*pieces), reps),
               merge_new=median_us(lambda: merge_splits(o3, l2, torch.bfloat16, with_lse=False), reps),
               merge_prev=median_us(lambda: merge_partials(o3, l2, torch.bfloat16), reps),
               fused_host=median_us(run_fused, reps), fused_sync=median_us(run_fused, reps, sync=True),
               merge_fused=median_us(lambda: merge_split_partials(o_part, lse_part, batch * Q_LEN, H, torch.bfloat16,
                                                                  with_lse=False), reps),
               fused_max_diff=fused_err, bitwise="yes" if same else "NO")
    print(" ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), file=sys.stderr)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="output folder (cute_host.md, cute_host.json); default: print only")
    p.add_argument("--reps", type=int, default=100, help="calls per median")
    args = p.parse_args(argv)

    if not torch.cuda.is_available():
        sys.exit("bench/cute_host.py times cute_mla's kernel launches: it needs a CUDA GPU (sm90) with "
                 "nvidia-cutlass-dsl installed; this machine has no CUDA device")
    from specdec.attention.backends import cute_mla

    if cute_mla.IMPORT_ERROR is not None:
        sys.exit(f"bench/cute_host.py needs nvidia-cutlass-dsl (see cute_mla's docstring): {cute_mla.IMPORT_ERROR}")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        sys.exit(f"bench/cute_host.py: cute_mla's kernel is written for sm90, this GPU is sm{major}{minor}")
    import triton
    from mla_decode import Bench
    from results_io import run_header, write_results

    from specdec.attention.backends.triton_mla import TritonMLABackend

    t0 = time.perf_counter()
    bench = Bench(torch, triton, on_gpu=True, latent=LATENT, rope=ROPE, reps=args.reps,
                  max_tokens=max(BATCHES) * max(CONTEXTS))
    new, fused = cute_mla.CuteMLABackend(merge="torch"), cute_mla.CuteMLABackend()  # fused: the default merge
    prev, triton_backend = PreviousPath(new), TritonMLABackend()
    rows = [measure(bench, prev, new, triton_backend, fused=fused, batch=b, context=c, reps=args.reps)
            for b in BATCHES for c in CONTEXTS]
    fmt = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        fmt.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in COLUMNS) + " |")
    header = run_header("cuda", f"H {H}, q_len {Q_LEN}, page {PAGE}, bf16", f"median of {args.reps} calls")
    md = "\n".join(["# cute_mla host cost per call (µs)", "", header, "",
                    "`*_host`: the call alone, GPU idle before it; `*_sync`: with `torch.cuda.synchronize()`. "
                    "`prev`: the previous path (from_dlpack conversions + the DSL's marshalling + merge_partials); "
                    "`new`: the prepared launch + merge_splits; `fused`: the prepared launch + the fused merge (the "
                    "default); `prep_*`: argument preparation alone; `launch_new` / `merge_*`: the pieces; "
                    "`fused_max_diff`: the fused path's largest difference from `new` (output or LSE); "
                    "`bitwise`: prev and new outputs (and LSEs) bit-identical.",
                    "", *fmt, "", f"{time.perf_counter() - t0:.0f} s in all."])
    write_results(args.out, "cute_host", md, dict(header=header, rows=rows))
    return 0 if all(r["bitwise"] == "yes" for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
