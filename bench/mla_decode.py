"""Benchmark ``triton_mla`` (paged absorbed-MLA decode / verify) against the H200 roofline.

GPU only; ``--smoke`` checks this script's logic on the CPU with one tiny shape
under Triton's interpreter (latent 32 + rope 16, fp32 queries).

    python bench/mla_decode.py --out bench/mla_decode.md      # full grid, 720 shapes, stops at --budget-s
    python bench/mla_decode.py --quick --out bench/mla_quick.md
    python bench/mla_decode.py --smoke                        # CPU, seconds

Grid: H in {16, 48, 64, 96, 128} x q_len in {1, 2, 4, 8} x batch in {1, 16, 64}
x context in {1K, 8K, 32K} x page in {32, 64} x KV bf16 / FP8 E4M3 (queries bf16).
Every request holds ``context`` tokens (its ``q_len`` new ones included) on
shuffled pages. Per shape:

- time: ``triton.testing.do_bench`` (CUDA events, L2 flushed before each run,
  median) of one ``run`` on a plan built once, as in a decoding step;
- bytes: latent cache actually addressed, in whole pages (page padding
  included), + page tables + q + out. Split-KV partials (fp32, written and read
  once by the merge) are listed apart as ``partial_MB``; they are L2 traffic
  when small;
- flops: ``2 * H * q_len * kv_len * (576 + 512)`` per request;
- ``frac``: the roofline time ``max(bytes / 4.8e12, flops / 989e12)`` over the
  measured time (1.0 = at the roofline); ``bound`` says which term is larger;
- ``kv_reads``: how many programs read each KV tile (row blocks of
  ``q_len * H``); reads after the first mostly hit L2.

Writes a markdown table (``--out``, default stdout) and a CSV (``--csv``,
default next to ``--out`` or ``mla_decode.csv``).
"""

from __future__ import annotations

import argparse
import csv
import itertools
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, like bench/e2e.py

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
DENSE_BF16_FLOPS = 989e12  # H200 dense bf16 tensor-core peak
LATENT, ROPE = 512, 64

FULL = dict(heads=(16, 48, 64, 96, 128), q_lens=(1, 2, 4, 8), batches=(1, 16, 64), contexts=(1024, 8192, 32768),
            pages=(32, 64), kv=("bf16", "fp8"))
QUICK = dict(heads=(16, 96, 128), q_lens=(1, 4), batches=(1, 64), contexts=(8192, 32768), pages=(64,),
             kv=("bf16", "fp8"))
SMOKE = dict(heads=(16,), q_lens=(2,), batches=(1, 2), contexts=(64,), pages=(32,), kv=("bf16", "fp8"))
COLUMNS = ("H", "q_len", "batch", "context", "page", "kv", "splits", "block_m", "kv_reads", "time_us", "GB_s",
           "TFLOP_s", "frac", "bound", "MB", "partial_MB")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="48 shapes instead of 720")
    p.add_argument("--smoke", action="store_true", help="CPU: one tiny shape under TRITON_INTERPRET=1")
    p.add_argument("--out", help="markdown table path (default: stdout)")
    p.add_argument("--csv", help="CSV path (default: --out with .csv, or mla_decode.csv)")
    p.add_argument("--budget-s", type=float, default=420.0, help="stop starting new shapes after this many seconds")
    p.add_argument("--warmup-ms", type=float, default=10.0)
    p.add_argument("--rep-ms", type=float, default=30.0)
    p.add_argument("--force", action="store_true", help="run even where supports() refuses the GPU arch")
    tune = p.add_argument_group("launch config (TritonMLAConfig; default: the backend's heuristics)")
    tune.add_argument("--num-splits", type=int)
    tune.add_argument("--min-split-tokens", type=int)
    tune.add_argument("--waves", type=float)
    tune.add_argument("--block-m", type=int, choices=(16, 32, 64))
    tune.add_argument("--block-n", type=int, choices=(16, 32, 64, 128))
    tune.add_argument("--num-warps", type=int, choices=(1, 2, 4, 8, 16))
    tune.add_argument("--num-stages", type=int)
    return p.parse_args(argv)


TUNABLE = ("num_splits", "min_split_tokens", "waves", "block_m", "block_n", "num_warps", "num_stages")


def make_step(torch, *, h, q_len, batch, context, page, kv, latent, rope, q_dtype, device, seed=0):
    """A decoding step: ``batch`` requests of ``context`` cached tokens on shuffled pages."""
    from specdec.attention.backends.base import PhaseBatch

    g = torch.Generator(device="cpu").manual_seed(seed)
    pages_each = math.ceil(context / page)
    perm = torch.randperm(batch * pages_each, generator=g).view(batch, pages_each)
    tables = tuple(tuple(row) for row in perm.tolist())
    d = latent + rope
    values = torch.randn(batch * pages_each * page, 1, d, device=device, dtype=torch.bfloat16)
    if kv == "fp8":
        kv_scale = float(values.abs().amax().float()) / 448.0
        cache = (values.float() / kv_scale).to(torch.float8_e4m3fn)
    else:
        kv_scale, cache = 1.0, values
    del values
    q = torch.randn(batch * q_len, h, d, device=device, dtype=q_dtype)
    phase = PhaseBatch((q_len,) * batch, (context,) * batch, tables, page, torch.device(device))
    return phase, q, cache, kv_scale


def measure(torch, triton, fn, *, on_gpu: bool, warmup_ms: float, rep_ms: float) -> float:
    """Median seconds of ``fn``."""
    if on_gpu:
        return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3
    fn()  # the interpreter: one run, wall time (only checks the logic)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_one(torch, triton, backend, *, h, q_len, batch, context, page, kv, args, on_gpu, latent, rope):
    from specdec.attention.backends.torch_ref import TorchRefBackend

    device = "cuda" if on_gpu else "cpu"
    q_dtype = torch.bfloat16 if on_gpu else torch.float32  # the interpreter cannot multiply bf16
    phase, q, cache, kv_scale = make_step(torch, h=h, q_len=q_len, batch=batch, context=context, page=page, kv=kv,
                                          latent=latent, rope=rope, q_dtype=q_dtype, device=device)
    scale = (128 + 64) ** -0.5
    plan = backend.plan(phase)
    block_m, row_blocks, splits, _ = backend.launch_config(plan, h)

    def fn():
        return backend.run(plan, q, cache, None, scale, latent, kv_scale=kv_scale)

    if not on_gpu:  # smoke: the numbers must come from a correct kernel
        ref = TorchRefBackend()
        expected = ref.run(ref.plan(phase), q.float(), cache.float() * kv_scale, None, scale, latent)
        torch.testing.assert_close(fn().float(), expected, atol=2e-5, rtol=2e-5)
    seconds = measure(torch, triton, fn, on_gpu=on_gpu, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)

    d, tokens = latent + rope, batch * q_len
    kv_bytes = batch * math.ceil(context / page) * page * d * cache.element_size()
    io_bytes = tokens * h * (d + latent) * q.element_size() + plan.page_table.numel() * 4
    total_bytes = kv_bytes + io_bytes
    partial_bytes = 2 * tokens * h * splits * (latent + 1) * 4 if splits > 1 else 0
    flops = 2 * h * q_len * context * (d + latent) * batch
    t_mem, t_flop = total_bytes / HBM_BYTES_PER_S, flops / DENSE_BF16_FLOPS
    del cache, q
    return dict(H=h, q_len=q_len, batch=batch, context=context, page=page, kv=kv, splits=splits, block_m=block_m,
                kv_reads=row_blocks, time_us=seconds * 1e6, GB_s=total_bytes / seconds / 1e9,
                TFLOP_s=flops / seconds / 1e12, frac=max(t_mem, t_flop) / seconds,
                bound="memory" if t_mem >= t_flop else "compute", MB=total_bytes / 1e6,
                partial_MB=partial_bytes / 1e6)


def write_outputs(rows, args, header: str) -> None:
    fmt = {"time_us": "{:.1f}", "GB_s": "{:.0f}", "TFLOP_s": "{:.1f}", "frac": "{:.2f}", "MB": "{:.1f}",
           "partial_MB": "{:.1f}"}
    lines = [header, "", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.get(c, "{}").format(r[c]) for c in COLUMNS) + " |")
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        sys.stdout.write(text)
    path = args.csv or (os.path.splitext(args.out)[0] + ".csv" if args.out else "mla_decode.csv")
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out or 'stdout'} and {path}", file=sys.stderr)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton or specdec is imported
    import torch

    on_gpu = not args.smoke
    if on_gpu and not torch.cuda.is_available():
        sys.exit("bench/mla_decode.py needs a CUDA GPU; --smoke checks it on the CPU under the Triton interpreter")
    import triton
    import triton.testing  # noqa: F401

    from specdec.attention.backends.triton_mla import TritonMLABackend, TritonMLAConfig
    from specdec.attention.shapes import AttnShape

    if args.smoke:
        from specdec.attention.backends.triton_interp import fix_interpreter

        fix_interpreter()  # Triton 3.6 interpreter bugs (tests and smoke runs only)
    grid = SMOKE if args.smoke else QUICK if args.quick else FULL
    latent, rope = (32, 16) if args.smoke else (LATENT, ROPE)
    tuned = {k: getattr(args, k) for k in TUNABLE if getattr(args, k) is not None}
    if args.smoke:
        tuned.setdefault("min_split_tokens", 16)  # take the split + merge path at 64 tokens
    backend = TritonMLABackend(TritonMLAConfig(**tuned))
    sm, device_name = None, "CPU (Triton interpreter)"
    if on_gpu:
        major, minor = torch.cuda.get_device_capability()
        sm, device_name = major * 10 + minor, torch.cuda.get_device_name()
    verdict = backend.supports(AttnShape("generation", "mla", 96, 1, latent + rope, latent, grid["pages"][0], 4,
                                         "bfloat16", "bfloat16" if on_gpu else "float32", "cuda" if on_gpu else "cpu",
                                         sm))
    if not verdict.ok and not args.force:
        sys.exit(f"triton_mla does not support this device: {verdict.reason} (--force to time it anyway)")

    shapes = list(itertools.product(grid["heads"], grid["q_lens"], grid["batches"], grid["contexts"], grid["pages"],
                                    grid["kv"]))
    rows, start, skipped = [], time.perf_counter(), 0
    for i, (h, q_len, batch, context, page, kv) in enumerate(shapes):
        if time.perf_counter() - start > args.budget_s:
            skipped = len(shapes) - i
            print(f"budget of {args.budget_s:.0f}s spent: {skipped} shapes not run", file=sys.stderr)
            break
        row = bench_one(torch, triton, backend, h=h, q_len=q_len, batch=batch, context=context, page=page, kv=kv,
                        args=args, on_gpu=on_gpu, latent=latent, rope=rope)
        rows.append(row)
        print(f"[{i + 1}/{len(shapes)}] " + " ".join(f"{c}={row[c]:.3g}" if isinstance(row[c], float) else
                                                   f"{c}={row[c]}" for c in COLUMNS), file=sys.stderr)
    header = (f"# triton_mla decode/verify on {device_name}\n\nlatent {latent} + rope {rope}, q bf16"
              f"{' (fp32 in smoke)' if args.smoke else ''}; roofline max(bytes/{HBM_BYTES_PER_S:.1e}, "
              f"flops/{DENSE_BF16_FLOPS:.3g}); {len(rows)} of {len(shapes)} shapes"
              f"{f' ({skipped} skipped: time budget)' if skipped else ''}; {time.perf_counter() - start:.0f} s; "
              f"config {backend.config}.")
    write_outputs(rows, args, header)
    return 0


if __name__ == "__main__":
    sys.exit(main())
