"""The sort-free top-k / top-p cutoff kernel on real logits: its settings swept, beside the sorting reference.

    python bench/cutoff_sweep.py --device cuda --data data/drafter-smollm2-135m --out /root/out/cutoff_sweep
    python bench/cutoff_sweep.py --quick --out /tmp/cutoff_sweep       # CPU, interpreter, a check of the script

Rows: the target's (SmolLM2-135M-Instruct, ``--dtype``) logits at the response positions of the
first ``--sequences`` sequences of a drafter training set (``--data``: the target's own responses,
never evaluation data), teacher-forced; ``--rows`` of them drawn at random per row count (default
16, 32, 144, 288: the sampled rows of batch 32 with half / all requests sampled, without and with
8 drafts each). Limits per row: temperature 0.8 with top-p 0.95 (``top-p``), top-k 50 with top-p 0.9
(``top-k+top-p``), top-k 50 alone (``top-k``).

First, where the cutoffs fall (from the reference): the nucleus size and the distance ``max z - thr``
of the cutoff, quantiles over the rows; they show where the kernel's first-pass thresholds
(``max - 32 .. max - 1``) and its candidate capacity (``CUT_CAP``) sit against real rows.

Then, per setting of the kernel (``CUT_BLOCK``, ``CUT_WARPS``, ``CUT_PIVOTS``, ``CUT_CAP``) and
row count: the kernel's median device time (ms; on CUDA from a graph of 10 calls, so without
launch overhead), whether it keeps exactly the reference's tokens, beside the reference
(``specdec.sampling.row_cutoffs``: a stable sort of each row; wall time of a call, synchronised) in
the same run. Writes ``cutoff_sweep.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import run_header, write_results  # noqa: E402

LIMITS = {"top-p": (0.8, 0, 0.95), "top-k+top-p": (0.8, 50, 0.9), "top-k": (0.8, 50, 1.0)}
SETTINGS = [  # (BLOCK, WARPS, PIVOTS, CAP)
    (1024, 8, 8, 1024), (1024, 4, 8, 1024), (512, 4, 8, 1024), (2048, 8, 8, 1024), (2048, 16, 8, 1024),
    (4096, 16, 8, 1024), (1024, 8, 4, 1024), (1024, 8, 16, 1024), (2048, 16, 16, 1024), (1024, 8, 8, 256),
    (2048, 16, 8, 256), (1024, 16, 8, 1024),
]


def real_logits(args, dev: torch.device) -> torch.Tensor:
    """``[P, vocab]`` logits of the target at response positions of training sequences."""
    from specdec.drafters.data import TokenData
    from specdec.drafters.training import target_features
    from specdec.target import load_target

    dtype = getattr(torch, args.dtype)
    target = load_target(args.target, dtype=dtype, device=dev)
    data = TokenData.load(args.data)
    rows = []
    for i in range(min(args.sequences, len(data))):
        seq = data.tokens[data.offsets[i]:data.offsets[i + 1]].astype("int64").tolist()
        start = int(data.prompt_lens[i])
        if len(seq) - start < 2:
            continue
        fb = target_features(target, [seq], [start], [target.num_layers - 1], pad_to=1, with_final=True)
        with torch.inference_mode():
            rows.append(target.compute_logits(fb.final[0, start:len(seq)]))
    return torch.cat(rows)


def timed(fn, dev: torch.device, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        if dev.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if dev.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def graph_ms(fn, iters: int, per_graph: int = 10) -> float:
    """Median device ms of ``fn()`` from a CUDA graph of ``per_graph`` calls (no launch overhead)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # compiled and warm
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(per_graph):
            fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / per_graph)
    return statistics.median(times)


def quantiles(x: torch.Tensor) -> str:
    q = torch.quantile(x.float(), torch.tensor([0.5, 0.9, 0.99, 1.0], device=x.device))
    return " / ".join(f"{v:.3g}" for v in q.tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--data", default="data/drafter-smollm2-135m")
    ap.add_argument("--sequences", type=int, default=24, help="training sequences whose logits are the rows")
    ap.add_argument("--rows", default="16,32,144,288")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="CPU, Triton's interpreter, random logits, two settings")
    ap.add_argument("--shape-only", action="store_true",
                    help="only where the cutoffs fall (the reference; no kernel: runs on the CPU too)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        os.environ["TRITON_INTERPRET"] = "1"
        args.device, args.rows, args.iters = "cpu", "4", 1
    from specdec import sampling as smp
    from specdec import sampling_kernel as sk
    from specdec.attention.backends.triton_interp import fixed_interpreter

    dev = torch.device(args.device)
    with fixed_interpreter() if args.quick else contextlib.nullcontext():
        if args.quick:
            pool = (torch.randn(64, 2000, generator=torch.Generator().manual_seed(0)) * 3)
            settings = [(256, 4, 8, 64), (512, 4, 4, 32)]  # the interpreter sorts slowly
        else:
            pool = real_logits(args, dev)
            settings = [] if args.shape_only else SETTINGS
        vocab = pool.shape[-1]
        gen = torch.Generator().manual_seed(0)
        shape, results = [], []
        for n in [int(r) for r in args.rows.split(",")]:
            picked = torch.randint(pool.shape[0], (n,), generator=gen).to(dev)
            logits = pool.index_select(0, picked)  # [n, vocab], contiguous
            rows = torch.arange(n, device=dev)
            argmax = logits.argmax(dim=-1)
            for name, (temp, k, p) in LIMITS.items():
                temperature = torch.full((n,), temp, device=dev)
                top_k, top_p = torch.full((n,), k, device=dev), torch.full((n,), p, device=dev)
                z = logits.float() / temperature[:, None]
                ref = smp.row_cutoffs(z, [k] * n, [p] * n)
                keep = torch.isfinite(smp.apply_cutoffs(z, ref))
                shape.append({"rows": n, "limits": name, "kept": quantiles(keep.sum(-1)),
                              "max_minus_thr": quantiles(z.max(-1).values - ref[0])})
                if args.shape_only:
                    continue
                row = {"rows": n, "limits": name,
                       "reference_ms": timed(lambda: smp.row_cutoffs(z, [k] * n, [p] * n), dev, args.iters)}
                for block, warps, pivots, cap in settings:
                    sk.CUT_BLOCK, sk.CUT_WARPS, sk.CUT_PIVOTS, sk.CUT_CAP = block, warps, pivots, cap
                    label = f"{block}/{warps}/{pivots}/{cap}"

                    def run():
                        return sk.row_cutoffs(logits, rows, temperature, top_k, top_p, argmax)

                    try:
                        got = run()
                        same = torch.equal(torch.isfinite(smp.apply_cutoffs(z, got)), keep)
                        took = graph_ms(run, args.iters) if dev.type == "cuda" else timed(run, dev, args.iters)
                        row[label] = f"{took:.3f}{'' if same else ' (differs!)'}"
                    except Exception as e:  # noqa: BLE001 - a setting that does not compile is a result too
                        row[label] = f"{type(e).__name__}"
                    print(n, name, label, row[label], file=sys.stderr, flush=True)
                results.append(row)
    labels = ["/".join(map(str, st)) for st in settings]
    header = run_header(args.device, f"{args.target} {args.dtype} logits of {args.sequences} training sequences "
                        f"({args.data})" if not args.quick else "random logits (quick)", f"vocab {vocab}",
                        f"median of {args.iters}")
    md = [header, "", "## Where the cutoffs fall (quantiles 50 / 90 / 99 / 100 % over the rows)", "",
          "| rows | limits | tokens kept | max z - cutoff |", "|---|---|---|---|"]
    md += [f"| {r['rows']} | {r['limits']} | {r['kept']} | {r['max_minus_thr']} |" for r in shape]
    if results:
        md += ["", "## ms per call (kernel: device time from a CUDA graph; settings BLOCK / WARPS / PIVOTS / CAP)", "",
               "| rows | limits | reference (sort) | " + " | ".join(labels) + " |", "|" + "---|" * (3 + len(labels))]
    md += [f"| {r['rows']} | {r['limits']} | {r['reference_ms']:.3f} | " + " | ".join(r[lb] for lb in labels) + " |"
           for r in results]
    write_results(args.out, "cutoff_sweep", "\n".join(md), {"shape": shape, "times": results})


if __name__ == "__main__":
    main()
