"""Benchmark ``triton_mla`` (paged absorbed-MLA decode / verify) against the H200 roofline.

One GPU run does everything (< 8 min on an H200):

    python bench/mla_decode.py --sweep --full --out OUT/mla

- ``--sweep``: times candidate launch configs (:class:`TritonMLAConfig`) on one
  representative shape per class (query rows per request ``q_len * H``: <= 32,
  33..64, > 64; bf16 and FP8 caches; batch 64 x 8K context) and prints the best
  per class, as a dict to paste into the backend's heuristics;
- ``--full``: the issue's grid, H in {16, 48, 64, 96, 128} x q_len in {1, 2, 4, 8}
  x batch in {1, 16, 64} x context in {1K, 8K, 32K} x page in {32, 64} x KV bf16 /
  FP8 E4M3 (720 shapes; ``--quick``: 48), each class with the sweep's winner
  (without ``--sweep``: the backend's default heuristics, or the ``--block-m`` ...
  flags); a sample of shapes is checked against the torch reference;
- ``--out DIR``: ``sweep.md/json``, ``grid.md/json`` (and the summary line: how many
  shapes with batch x context >= 64K reach 70 % of the bound).

Measures: one ``run`` on a plan built once (as in a decoding step); CUDA events
around each call, L2 flushed between calls, median of ``--reps``. ``bytes`` = the
cache rows a request may read (``context`` x 576 x bytes per value; contexts are page
multiples here, so no page padding) + queries + output + page tables; ``flops`` =
``2 x (512 + 576)`` per visible (query row, key) pair (causal verify tokens see
fewer keys; padded query rows of a 64-row block count as waste); ``frac`` =
``max(bytes / 4.8e12, flops / 989e12) / time``. Split-KV partials are not in
``bytes`` (they are overhead, shown as ``partial_MB``).

``--backends torch_ref,triton_mla,cute_mla``: time other backends on the same grid shapes (same
plan-once, L2-flushed median), as columns ``<name>_us`` and ``<name>_x`` (``triton_mla`` time
over theirs: > 1 is faster than Triton); each is checked against the torch reference on the
first shape of every (H, q_len, kv) class, and a dtype or shape a backend does not implement
(``cute_mla``: FP8 caches) shows ``-``. ``triton_mla`` is always the base column. E.g. on the H200:

    python bench/mla_decode.py --quick --backends torch_ref,triton_mla,cute_mla --out OUT/mla

``--smoke``: the script's logic on the CPU, tiny shapes, Triton's interpreter.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, like bench/e2e.py

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e
DENSE_BF16_FLOPS = 989e12  # H200 dense bf16 tensor-core peak
LATENT, ROPE = 512, 64
BIG_TOKENS = 64 * 1024  # the target: >= 70 % at batch x context >= 64K
TARGET = 0.70

FULL = dict(heads=(16, 48, 64, 96, 128), q_lens=(1, 2, 4, 8), batches=(1, 16, 64), contexts=(1024, 8192, 32768),
            pages=(32, 64), kv=("bf16", "fp8"))
QUICK = dict(heads=(16, 96, 128), q_lens=(1, 4), batches=(1, 64), contexts=(8192, 32768), pages=(64,),
             kv=("bf16", "fp8"))
SMOKE = dict(heads=(16,), q_lens=(2,), batches=(1, 2), contexts=(64,), pages=(32,), kv=("bf16", "fp8"))

# Sweep: one shape per class (H, q_len), batch 64 x 8K context, 64-token pages.
CLASSES = {"rows<=32": (16, 1), "rows<=64": (64, 1), "rows>64": (128, 4)}
SMOKE_CLASSES = {"rows<=32": (16, 1), "rows<=64": (4, 16), "rows>64": (8, 16)}
CANDIDATES = {
    "rows<=32": [
        dict(block_n=32, num_warps=4, num_stages=2),  # the previous default
        dict(block_n=64, num_warps=4, num_stages=2),
        dict(block_n=32, num_warps=8, num_stages=2),
        dict(block_n=64, num_warps=8, num_stages=2),
        dict(block_n=32, num_warps=4, num_stages=3),
        dict(block_n=64, num_warps=4, num_stages=3),
        dict(block_n=128, num_warps=8, num_stages=2),
        dict(block_n=64, num_warps=4, num_stages=2, ctas_per_sm=1),
        dict(block_n=64, num_warps=4, num_stages=2, ctas_per_sm=4),
        dict(block_n=32, num_warps=4, num_stages=2, fp8_dots="bf16"),  # previous FP8 path
    ],
    "rows<=64": [
        dict(block_m=64, block_n=32, num_warps=8, num_stages=2),  # the previous default
        dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
        dict(block_m=64, block_n=64, num_warps=8, num_stages=1),
        dict(block_m=64, block_n=128, num_warps=8, num_stages=1),
        dict(block_m=64, block_n=32, num_warps=8, num_stages=3),
        dict(block_m=32, block_n=64, num_warps=8, num_stages=2),
        dict(block_m=16, block_n=64, num_warps=4, num_stages=2),
        dict(block_m=16, block_n=32, num_warps=8, num_stages=2),
        dict(block_m=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=2),
        dict(block_m=64, block_n=32, num_warps=8, num_stages=2, fp8_dots="bf16"),
    ],
    "rows>64": [
        dict(block_m=64, block_n=32, num_warps=8, num_stages=2),  # the previous default
        dict(block_m=64, block_n=64, num_warps=8, num_stages=2),
        dict(block_m=64, block_n=64, num_warps=8, num_stages=1),
        dict(block_m=64, block_n=128, num_warps=8, num_stages=1),
        dict(block_m=64, block_n=32, num_warps=8, num_stages=3),
        dict(block_m=64, block_n=16, num_warps=8, num_stages=3),
        dict(block_m=32, block_n=64, num_warps=8, num_stages=2),
        dict(block_m=32, block_n=32, num_warps=4, num_stages=2),
        dict(block_m=64, block_n=64, num_warps=8, num_stages=2, ctas_per_sm=2),
        dict(block_m=64, block_n=32, num_warps=8, num_stages=2, fp8_dots="bf16"),
    ],
}
TUNABLE = ("num_splits", "min_split_tokens", "max_splits", "ctas_per_sm", "block_m", "block_n", "num_warps",
           "num_stages", "fp8_dots")
COLUMNS = ("H", "q_len", "batch", "context", "page", "kv", "config", "splits", "block_m", "block_n", "row_blocks",
           "time_us", "GB_s", "TFLOP_s", "frac", "bound", "MB", "partial_MB", "checked")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sweep", action="store_true", help="time candidate configs per class, pick the best")
    p.add_argument("--full", action="store_true", help="the issue's 720-shape grid")
    p.add_argument("--quick", action="store_true", help="48-shape grid")
    p.add_argument("--smoke", action="store_true", help="CPU: tiny shapes under TRITON_INTERPRET=1")
    p.add_argument("--out", help="output directory (default: print the tables)")
    p.add_argument("--budget-s", type=float, default=280.0, help="stop starting new grid shapes after this")
    p.add_argument("--sweep-budget-s", type=float, default=170.0, help="stop starting new sweep configs after this")
    p.add_argument("--reps", type=int, default=7, help="timed calls per shape (median)")
    p.add_argument("--check-every", type=int, default=6, help="check every N-th small grid shape vs torch_ref")
    p.add_argument("--force", action="store_true", help="run even where supports() refuses the GPU arch")
    p.add_argument("--backends", default="triton_mla",
                   help="comma-separated: triton_mla (always) plus columns for torch_ref and/or cute_mla")
    tune = p.add_argument_group("grid launch config without --sweep (TritonMLAConfig; default: heuristics)")
    tune.add_argument("--num-splits", type=int)
    tune.add_argument("--min-split-tokens", type=int)
    tune.add_argument("--max-splits", type=int)
    tune.add_argument("--ctas-per-sm", type=int)
    tune.add_argument("--block-m", type=int, choices=(16, 32, 64))
    tune.add_argument("--block-n", type=int, choices=(16, 32, 64, 128))
    tune.add_argument("--num-warps", type=int, choices=(1, 2, 4, 8, 16))
    tune.add_argument("--num-stages", type=int)
    tune.add_argument("--fp8-dots", choices=("fp16", "bf16"))
    args = p.parse_args(argv)
    if not (args.sweep or args.full or args.quick or args.smoke):
        p.error("nothing to do: give --sweep and/or --full (or --quick, --smoke)")
    unknown = set(args.backends.split(",")) - {"", "triton_mla", "torch_ref", "cute_mla"}
    if unknown:
        p.error(f"--backends: unknown {sorted(unknown)} (known: torch_ref, triton_mla, cute_mla)")
    return args


def class_of(h: int, q_len: int) -> str:
    rows = h * q_len
    return "rows<=32" if rows <= 32 else "rows<=64" if rows <= 64 else "rows>64"


class Bench:
    """Shared state of one run: device, big cache buffers reused by every shape, the L2 flush buffer."""

    def __init__(self, torch, triton, *, on_gpu: bool, latent: int, rope: int, reps: int, max_tokens: int):
        self.torch, self.triton, self.on_gpu = torch, triton, on_gpu
        self.device = "cuda" if on_gpu else "cpu"
        self.latent, self.rope, self.reps = latent, rope, reps
        self.q_dtype = torch.bfloat16 if on_gpu else torch.float32
        d = latent + rope
        g = torch.Generator(device=self.device).manual_seed(0)
        # One cache per dtype, as large as the biggest shape; every shape uses its first pages.
        self.kv_scale = 4.0 / 448.0  # randn values stay within +-4.0 (clamped), E4M3's range
        values = torch.randn(max_tokens, 1, d, device=self.device, generator=g).clamp_(-4.0, 4.0)
        self.cache = {"bf16": values.to(torch.bfloat16)}
        self.cache["fp8"] = (values / self.kv_scale).to(torch.float8_e4m3fn)
        del values
        self.flush = torch.empty(256 << 20, dtype=torch.uint8, device=self.device) if on_gpu else None

    def step(self, *, h, q_len, batch, context, page, seed=0):
        from specdec.attention.backends.base import PhaseBatch

        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        pages_each = math.ceil(context / page)
        perm = torch.randperm(batch * pages_each, generator=g).view(batch, pages_each)
        tables = tuple(tuple(row) for row in perm.tolist())
        q = torch.randn(batch * q_len, h, self.latent + self.rope, generator=g).to(self.device, self.q_dtype)
        phase = PhaseBatch((q_len,) * batch, (context,) * batch, tables, page, torch.device(self.device))
        return phase, q

    def time_fn(self, fn) -> float:
        """Median seconds of ``fn`` (first call: compile + warm-up, not timed)."""
        torch = self.torch
        fn()
        if not self.on_gpu:
            t0 = time.perf_counter()
            fn()
            return time.perf_counter() - t0
        times = []
        for _ in range(self.reps):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        times.sort()
        return times[len(times) // 2]

    def run(self, config, *, h, q_len, batch, context, page, kv, check=False, label="default") -> dict:
        from specdec.attention.backends.torch_ref import TorchRefBackend
        from specdec.attention.backends.triton_mla import TritonMLABackend

        torch = self.torch
        backend = TritonMLABackend(config)
        phase, q = self.step(h=h, q_len=q_len, batch=batch, context=context, page=page)
        slots = batch * math.ceil(context / page) * page
        cache = self.cache[kv][:slots]
        kv_scale = self.kv_scale if kv == "fp8" else 1.0
        scale = (128 + 64) ** -0.5
        plan = backend.plan(phase)
        self.last = dict(phase=phase, q=q, cache=cache, kv_scale=kv_scale, scale=scale)
        launch = backend.launch_config(plan, h, kv_bytes=cache.element_size(),
                                       fp8_with_bf16_q=kv == "fp8" and q.dtype == torch.bfloat16)

        def fn():
            return backend.run(plan, q, cache, None, scale, self.latent, kv_scale=kv_scale)

        checked = ""
        if check:  # torch_ref on three of the requests (first, middle, last), fp32 queries
            from specdec.attention.backends.base import PhaseBatch

            out = fn().float()
            ref, errs = TorchRefBackend(), []
            tol = 2e-2 if q.dtype == torch.bfloat16 else 2e-5
            for r in sorted({0, batch // 2, batch - 1}):
                one = PhaseBatch((q_len,), (context,), (phase.page_tables[r],), page, phase.device)
                q_r = q[r * q_len:(r + 1) * q_len].float()
                expected = ref.run(ref.plan(one), q_r, cache, None, scale, self.latent, kv_scale=kv_scale)
                got = out[r * q_len:(r + 1) * q_len]
                errs.append((got - expected).abs().max().item())
                torch.testing.assert_close(got, expected, atol=tol, rtol=tol)
            checked = f"{max(errs):.1e}"
            del out, expected
        seconds = self.time_fn(fn)

        d, tokens = self.latent + self.rope, batch * q_len
        kv_bytes = batch * context * d * cache.element_size()
        io_bytes = tokens * h * (d + self.latent) * q.element_size() + plan.page_table.numel() * 4
        total_bytes = kv_bytes + io_bytes
        splits = launch.num_splits
        partial_bytes = 2 * tokens * h * splits * (self.latent + 1) * 4 if splits > 1 else 0
        visible = q_len * context - q_len * (q_len - 1) // 2  # keys seen by the q_len causal verify tokens
        flops = 2 * h * visible * (d + self.latent) * batch
        t_mem, t_flop = total_bytes / HBM_BYTES_PER_S, flops / DENSE_BF16_FLOPS
        return dict(H=h, q_len=q_len, batch=batch, context=context, page=page, kv=kv, config=label, splits=splits,
                    block_m=launch.block_m, block_n=launch.block_n, row_blocks=launch.row_blocks,
                    time_us=seconds * 1e6, GB_s=total_bytes / seconds / 1e9, TFLOP_s=flops / seconds / 1e12,
                    frac=max(t_mem, t_flop) / seconds, bound="memory" if t_mem >= t_flop else "compute",
                    MB=total_bytes / 1e6, partial_MB=partial_bytes / 1e6, checked=checked)


    def run_extra(self, name: str, *, check: bool) -> float:
        """Median seconds of backend ``name`` on the shape of the last :meth:`run` (same queries, cache,
        pages); with ``check``, first compared with the torch reference on every request."""
        from specdec.attention.backends.torch_ref import TorchRefBackend

        torch, last = self.torch, self.last
        if name == "cute_mla":
            from specdec.attention.backends.cute_mla import CuteMLABackend

            backend = CuteMLABackend()
            if last["cache"].dtype != torch.bfloat16 or q_dtype_of(last) != torch.bfloat16 or not self.on_gpu:
                raise NotImplementedError("cute_mla: bf16 queries and caches on an sm90 GPU only")
        elif name == "torch_ref":
            backend = TorchRefBackend()
        else:
            raise ValueError(f"unknown backend column {name!r}")
        plan = backend.plan(last["phase"])
        q, cache, scale, kv_scale = last["q"], last["cache"], last["scale"], last["kv_scale"]
        extra = {"kv_scale": kv_scale} if kv_scale != 1.0 else {}

        def fn():
            return backend.run(plan, q, cache, None, scale, self.latent, **extra)

        if check and name != "torch_ref":
            ref = TorchRefBackend()
            want = ref.run(ref.plan(last["phase"]), q.float(), cache, None, scale, self.latent, **extra)
            tol = 2e-2 if q.dtype == torch.bfloat16 else 2e-5
            torch.testing.assert_close(fn().float(), want, atol=tol, rtol=tol)
        return self.time_fn(fn)


def q_dtype_of(last: dict):
    return last["q"].dtype


def fmt_rows(rows, columns=COLUMNS) -> list[str]:
    fmt = {"time_us": "{:.1f}", "GB_s": "{:.0f}", "TFLOP_s": "{:.1f}", "frac": "{:.2f}", "MB": "{:.1f}",
           "partial_MB": "{:.1f}"}
    fmt.update({c: ("{:.1f}" if c.endswith("_us") else "{:.2f}") for c in columns if c.endswith(("_us", "_x"))
                and c != "time_us"})
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for r in rows:
        lines.append("| " + " | ".join("-" if r.get(c) is None else fmt.get(c, "{}").format(r[c]) for c in columns)
                     + " |")
    return lines


def label_of(cfg: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in cfg.items()) or "default"


def sweep(bench: Bench, args, classes, shape_kw) -> tuple[list[dict], dict]:
    """Every candidate of each class on its representative shape; returns rows and the winners."""
    from specdec.attention.backends.triton_mla import TritonMLAConfig

    rows, best, start = [], {}, time.perf_counter()
    for (cls, (h, q_len)), kv in itertools.product(classes.items(), ("bf16", "fp8")):
        for cfg in CANDIDATES[cls][:2] if bench.on_gpu is False else CANDIDATES[cls]:
            if "fp8_dots" in cfg and kv != "fp8":
                continue
            if time.perf_counter() - start > args.sweep_budget_s:
                print(f"sweep budget spent: skipping {cls} {kv} {label_of(cfg)}", file=sys.stderr)
                continue
            try:
                row = bench.run(TritonMLAConfig(**cfg), h=h, q_len=q_len, kv=kv, label=label_of(cfg),
                                check=not bench.on_gpu, **shape_kw)
            except Exception as e:  # a config that does not compile (shared memory, registers) loses
                print(f"sweep {cls} {kv} {label_of(cfg)}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
                continue
            row["class"] = cls
            rows.append(row)
            print(f"sweep {cls:9s} {kv:4s} {row['time_us']:9.1f} us frac={row['frac']:.2f} splits={row['splits']}"
                  f" {row['config']}", file=sys.stderr)
            key = (cls, kv)
            if key not in best or row["time_us"] < best[key][1]:
                best[key] = (cfg, row["time_us"])
    winners = {f"{cls}/{kv}": cfg for (cls, kv), (cfg, _) in best.items()}
    return rows, winners


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton or specdec is imported
    import torch

    on_gpu = not args.smoke
    if on_gpu and not torch.cuda.is_available():
        sys.exit("bench/mla_decode.py needs a CUDA GPU; --smoke checks it on the CPU under the Triton interpreter")
    import triton

    from specdec.attention.backends.triton_mla import TritonMLABackend, TritonMLAConfig
    from specdec.attention.shapes import AttnShape

    if args.smoke:
        from specdec.attention.backends.triton_interp import fix_interpreter

        fix_interpreter()  # Triton 3.6 interpreter bugs (tests and smoke runs only)
    t_start = time.perf_counter()
    grid = SMOKE if args.smoke else QUICK if args.quick else FULL
    latent, rope = (32, 16) if args.smoke else (LATENT, ROPE)
    sm, device_name = None, "CPU (Triton interpreter)"
    if on_gpu:
        major, minor = torch.cuda.get_device_capability()
        sm, device_name = major * 10 + minor, torch.cuda.get_device_name()
    verdict = TritonMLABackend().supports(AttnShape("generation", "mla", 96, 1, latent + rope, latent, 64, 4,
                                                    "bfloat16", "bfloat16" if on_gpu else "float32",
                                                    "cuda" if on_gpu else "cpu", sm))
    if not verdict.ok and not args.force:
        sys.exit(f"triton_mla does not support this device: {verdict.reason} (--force to time it anyway)")

    sweep_shape = dict(batch=2, context=64, page=32) if args.smoke else dict(batch=64, context=8192, page=64)
    max_tokens = max(max(grid["batches"]) * max(grid["contexts"]), sweep_shape["batch"] * sweep_shape["context"])
    bench = Bench(torch, triton, on_gpu=on_gpu, latent=latent, rope=rope, reps=args.reps, max_tokens=max_tokens)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    head = (f"triton_mla on {device_name}; latent {latent} + rope {rope}, q bf16{' (fp32 in smoke)' * args.smoke}; "
            f"roofline max(bytes/{HBM_BYTES_PER_S:.1e}, flops/{DENSE_BF16_FLOPS:.3g})")

    winners: dict[str, dict] = {}
    if args.sweep:
        classes = SMOKE_CLASSES if args.smoke else CLASSES
        rows, winners = sweep(bench, args, classes, sweep_shape)
        lines = [f"# Config sweep: {head}", "",
                 f"One shape per class (H, q_len) = {classes}, {sweep_shape}; {time.perf_counter() - t_start:.0f} s.",
                 "", "Best per class (paste into TritonMLABackend.launch_config's heuristics):", "", "```python",
                 json.dumps(winners, indent=1), "```", "",
                 *fmt_rows(rows, ("class",) + COLUMNS)]
        print("SWEEP WINNERS " + json.dumps(winners), file=sys.stderr)
        if out_dir:
            (out_dir / "sweep.md").write_text("\n".join(lines) + "\n")
            (out_dir / "sweep.json").write_text(json.dumps(dict(winners=winners, rows=rows), indent=1))
        torch.cuda.empty_cache() if on_gpu else None

    if not (args.full or args.quick or args.smoke):
        return 0
    manual = {k: getattr(args, k) for k in TUNABLE if getattr(args, k) is not None}
    if args.smoke:
        manual.setdefault("num_splits", 2)  # take the split + merge path at 64 tokens
    shapes = list(itertools.product(grid["heads"], grid["q_lens"], grid["batches"], grid["contexts"], grid["pages"],
                                    grid["kv"]))
    rows, skipped, failures, grid_start = [], 0, [], time.perf_counter()
    extras = [b for b in args.backends.split(",") if b and b != "triton_mla"]
    extra_checked: set = set()
    columns = COLUMNS + tuple(c for b in extras for c in (f"{b}_us", f"{b}_x"))
    for i, (h, q_len, batch, context, page, kv) in enumerate(shapes):
        if time.perf_counter() - grid_start > args.budget_s:
            skipped = len(shapes) - i
            print(f"budget of {args.budget_s:.0f}s spent: {skipped} shapes not run", file=sys.stderr)
            break
        cfg = dict(winners.get(f"{class_of(h, q_len)}/{kv}", {}), **manual)
        check = args.smoke or (context <= 8192 and i % args.check_every == 0) or (
            batch == 64 and context == 8192 and q_len == 8 and page == 32)  # per H and KV dtype: tiles span pages
        try:
            row = bench.run(TritonMLAConfig(**cfg), h=h, q_len=q_len, batch=batch, context=context, page=page,
                            kv=kv, check=check, label=label_of(cfg))
        except AssertionError as e:  # a wrong result: reported, never timed as a success
            failures.append(f"H={h} q_len={q_len} batch={batch} ctx={context} page={page} {kv}: {str(e)[:300]}")
            print("MISMATCH " + failures[-1], file=sys.stderr)
            continue
        for name in extras:  # the other backends on the same shape, checked once per (H, q_len, kv) class
            key = (name, h, q_len, kv)
            try:
                t = bench.run_extra(name, check=key not in extra_checked)
                extra_checked.add(key)
                row[f"{name}_us"], row[f"{name}_x"] = t * 1e6, row["time_us"] / (t * 1e6)
            except NotImplementedError:
                row[f"{name}_us"] = row[f"{name}_x"] = None
            except AssertionError as e:
                failures.append(f"{name} H={h} q_len={q_len} batch={batch} ctx={context} page={page} {kv}: "
                                f"{str(e)[:300]}")
                print("MISMATCH " + failures[-1], file=sys.stderr)
                row[f"{name}_us"] = row[f"{name}_x"] = None
        rows.append(row)
        print(f"[{i + 1}/{len(shapes)}] H={h} q={q_len} b={batch} ctx={context} p={page} {kv} "
              f"{row['time_us']:.1f}us {row['GB_s']:.0f}GB/s {row['TFLOP_s']:.0f}TF frac={row['frac']:.2f} "
              f"splits={row['splits']}{' checked ' + row['checked'] if row['checked'] else ''}", file=sys.stderr)
        if on_gpu and i % 24 == 23:
            torch.cuda.empty_cache()

    big = [r for r in rows if r["batch"] * r["context"] >= BIG_TOKENS]
    met = [r for r in big if r["frac"] >= TARGET]
    by_bound = {b: (sum(r["frac"] >= TARGET for r in big if r["bound"] == b), sum(r["bound"] == b for r in big))
                for b in ("memory", "compute")}
    worst = min(big, key=lambda r: r["frac"]) if big else None
    summary = (f"{len(met)} of {len(big)} shapes with batch x context >= 64K meet {TARGET:.0%} of the bound "
               f"(memory-bound {by_bound['memory'][0]}/{by_bound['memory'][1]}, compute-bound "
               f"{by_bound['compute'][0]}/{by_bound['compute'][1]})"
               + (f"; worst {worst['frac']:.2f} at H={worst['H']} q_len={worst['q_len']} batch={worst['batch']} "
                  f"ctx={worst['context']} {worst['kv']}" if worst else "")
               + f"; {sum(bool(r['checked']) for r in rows)} shapes checked vs torch_ref, {len(failures)} mismatches.")
    lines = [f"# Grid: {head}", "", f"{len(rows)} of {len(shapes)} shapes"
             f"{f' ({skipped} skipped: time budget)' if skipped else ''}; grid {time.perf_counter() - grid_start:.0f} s,"
             f" total {time.perf_counter() - t_start:.0f} s; configs: "
             + ("sweep winners per class" if winners else f"heuristics {label_of(manual)}") + ".", "",
             f"**{summary}**", "", *fmt_rows(rows, columns), *([""] + ["Mismatches:"] + failures if failures else [])]
    text = "\n".join(lines) + "\n"
    if out_dir:
        (out_dir / "grid.md").write_text(text)
        (out_dir / "grid.json").write_text(json.dumps(dict(summary=summary, winners=winners, rows=rows,
                                                           failures=failures), indent=1))
        print(f"wrote {out_dir}/grid.md, grid.json" + (", sweep.md, sweep.json" if args.sweep else ""),
              file=sys.stderr)
    else:
        sys.stdout.write(text)
    print("SUMMARY: " + summary, file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
