"""Key tile, pipeline depth and KV splits of ``triton_gqa`` for decode/verify steps on the GPU.

    python bench/gqa_sweep.py --out DIR

SmolLM2's attention (9 query heads, 3 KV heads of 64, pages of 16) at batch 1
and 32, kv_len 256 and 1024, q_len 1 and 4 (bf16). Each configuration runs 30
calls (one per layer, distinct caches) inside one CUDA graph; the figure is µs
per call, launches included, as in a captured step. Writes ``gqa_sweep.md`` /
``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)

from specdec.attention.backends import triton_gqa as G  # noqa: E402

LAYERS, H, HKV, D, TPB = 30, 9, 3, 64, 16


def main() -> None:
    import triton.testing

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev, dt = "cuda", torch.bfloat16
    results = []
    for b, kv, ql in itertools.product((1, 32), (256, 1024), (1, 4)):
        pages = -(-kv // TPB)
        caches = [(torch.randn(b * pages * TPB, HKV, D, device=dev, dtype=dt),
                   torch.randn(b * pages * TPB, HKV, D, device=dev, dtype=dt)) for _ in range(LAYERS)]
        q = torch.randn(b * ql, H, D, device=dev, dtype=dt)
        tables = [list(range(i * pages, (i + 1) * pages)) for i in range(b)]
        width = 3 + pages
        best = None
        for bn, stages, min_split in itertools.product((32, 64, 128), (1, 2, 3), (64, 256, 1 << 20)):
            backend = G.TritonGQABackend(max_splits=16, min_split_tokens=min_split, key_tile=bn, num_stages=stages)
            meta = torch.tensor(backend.pack_meta([ql] * b, [kv] * b, tables, TPB, width), dtype=torch.int32,
                                device=dev)
            plan = backend.graph_plan(meta, b * ql, ql, kv, TPB)

            def fn():
                for kc, vc in caches:
                    backend.run(plan, q, kc, vc, D ** -0.5, D)
            try:
                us = 1e3 * triton.testing.do_bench_cudagraph(fn, rep=10) / LAYERS
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                print(f"b={b} kv={kv} q={ql} bn={bn} st={stages}: {type(e).__name__} {str(e)[:100]}", flush=True)
                continue
            splits = backend._num_splits(plan, -(-ql * (H // HKV) // G._tile_sizes(False, D, ql * H // HKV)[0]) * HKV)
            row = {"batch": b, "kv_len": kv, "q_len": ql, "block_n": bn, "num_stages": stages,
                   "min_split_tokens": min_split, "splits": splits, "us": us}
            results.append(row)
            if best is None or us < best["us"]:
                best = row
        default = [r for r in results if (r["batch"], r["kv_len"], r["q_len"]) == (b, kv, ql)
                   and r["block_n"] == 64 and r["num_stages"] == 2 and r["min_split_tokens"] == 256]
        print(f"b={b} kv={kv} q={ql}: best {best}; default {default[0]['us'] if default else None:.2f} us", flush=True)
    md = [run_header(dev, str(dt)), "", "| batch | kv_len | q_len | default µs (64 keys, 2 stages, split >= 256) | best µs | block_n | stages | "
          "min_split_tokens | splits |", "|---|---|---|---|---|---|---|---|---|"]
    for b, kv, ql in itertools.product((1, 32), (256, 1024), (1, 4)):
        rs = [r for r in results if (r["batch"], r["kv_len"], r["q_len"]) == (b, kv, ql)]
        if not rs:
            continue
        best = min(rs, key=lambda r: r["us"])
        d = [r for r in rs if r["block_n"] == 64 and r["num_stages"] == 2 and r["min_split_tokens"] == 256]
        md.append(f"| {b} | {kv} | {ql} | {d[0]['us']:.2f} | {best['us']:.2f} | {best['block_n']} | "
                  f"{best['num_stages']} | {best['min_split_tokens']} | {best['splits']} |")
    text = "\n".join(md)
    write_results(args.out, "gqa_sweep", text, results)


if __name__ == "__main__":
    main()
