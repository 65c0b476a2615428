"""Launch configurations of the fused GEMM kernels (``specdec/target/kernels.py``) on the GPU.

    python bench/linear_sweep.py --out DIR [--budget-s 300]

SmolLM2-135M's shapes (hidden 576, 9 + 2x3 heads of 64, intermediate 1536,
vocab 49152) at 1, 8 and 32 rows. Each candidate runs over 30 layers' worth of
distinct weights inside one CUDA graph (so weights come from HBM, not L2, and
launch gaps count as in a real step); the figure is µs per kernel. Then the
decoder layer's GEMM part, old path (cuBLAS GEMMs + fused elementwise kernels)
vs new (five fused kernels), with the best configurations, same graph method.
Writes ``linear_sweep.md`` / ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)

from specdec.target import kernels as K  # noqa: E402

LAYERS, HID, INTER, H, HKV, D, VOCAB = 30, 576, 1536, 9, 3, 64, 49152


def bench_graph(fn, reps: int = 20) -> float:
    """µs per call of ``fn`` (which launches LAYERS kernels) replayed in a CUDA graph, / LAYERS."""
    import triton.testing

    return 1e3 * triton.testing.do_bench_cudagraph(fn, rep=reps) / LAYERS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget-s", type=float, default=300)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--kernels", default="qkv,o,gate_up,down,lm_head")
    args = ap.parse_args()
    t_start = time.perf_counter()
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)

    def rnd(*s, std=0.02):
        return torch.randn(*s, device=dev, generator=g, dtype=torch.float32).mul_(std).to(dt)

    Wqkv = [rnd((H + 2 * HKV) * D, HID) for _ in range(LAYERS)]
    Wo = [rnd(HID, H * D) for _ in range(LAYERS)]
    Wgu = [rnd(2 * INTER, HID) for _ in range(LAYERS)]
    Wd = [rnd(HID, INTER) for _ in range(LAYERS)]
    Wlm = rnd(VOCAB, HID)
    nw = torch.ones(HID, device=dev, dtype=dt)
    emb = torch.cat([torch.outer(torch.arange(4096.0), 1e4 ** (-torch.arange(0, D, 2) / D))] * 2, -1)
    cos, sin = emb.cos().to(dev, dt), emb.sin().to(dev, dt)
    kc = torch.zeros(8192, HKV, D, device=dev, dtype=dt)
    vc = torch.zeros_like(kc)
    results = {"configs": [], "best": {}, "layer": []}

    def kernels_for(m, cfg):
        x = rnd(m, HID, std=1.0)
        o = rnd(m, H * D, std=1.0)
        a = rnd(m, INTER, std=1.0)
        pos = torch.arange(100, 100 + m, device=dev)
        slots = torch.arange(m, device=dev) * 7
        return {
            "qkv": lambda: [K.qkv_rope_write_kv(x, Wqkv[i], None, nw, 1e-5, H, HKV, D, cos, sin, pos, slots, kc, vc,
                                                config=cfg) for i in range(LAYERS)],
            "o": lambda: [K.fused_linear(o, Wo[i], residual=x, out=x, config=cfg) for i in range(LAYERS)],
            "gate_up": lambda: [K.fused_linear(x, Wgu[i], norm_weight=nw, eps=1e-5, silu_mul=True, config=cfg)
                                for i in range(LAYERS)],
            "down": lambda: [K.fused_linear(a, Wd[i], residual=x, out=x, config=cfg) for i in range(LAYERS)],
            "lm_head": lambda: [K.fused_linear(x, Wlm, norm_weight=nw, eps=1e-5, out_dtype=torch.float32,
                                               config=cfg) for _ in range(LAYERS)],
        }

    space = {"block_k": [64, 128, 256], "num_stages": [3, 4]}
    second = {"block_n": [16, 32], "num_warps": [2, 4]}
    rows = [int(r) for r in args.rows.split(",")]
    for name in args.kernels.split(","):
        for m in rows:
            if time.perf_counter() - t_start > args.budget_s:
                break
            base = dict(K.QKV_CONFIG if name == "qkv" else K.LINEAR_CONFIG)
            best = (float("inf"), base)
            stage2 = [dict(zip(second, v)) for v in itertools.product(*second.values())]
            if name == "qkv":
                stage2 = [{"head_split": h, "num_warps": w} for h in (1, 2) for w in (2, 4)]
            if name == "lm_head":
                stage2 = [{"block_n_wide": b} for b in (64, 128)]
            for stage in ([dict(zip(space, v)) for v in itertools.product(*space.values())], stage2):
                start_cfg = best[1]
                for over in stage:
                    if time.perf_counter() - t_start > args.budget_s:
                        break
                    cfg = {**start_cfg, **over}
                    try:
                        us = bench_graph(kernels_for(m, cfg)[name])
                    except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped
                        print(f"{name} m={m} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        continue
                    results["configs"].append({"kernel": name, "m": m, "cfg": cfg, "us": us})
                    if us < best[0]:
                        best = (us, cfg)
            results["best"][f"{name}/{m}"] = {"us": best[0], "cfg": best[1]}
            print(f"best {name} m={m}: {best[0]:.2f} us {best[1]}", flush=True)

    # the layer's GEMM part: old (cuBLAS + fused elementwise) vs new (fused GEMMs, best configs at each m)
    for m in rows:
        x = rnd(m, HID, std=1.0)
        pos = torch.arange(100, 100 + m, device=dev)
        slots = torch.arange(m, device=dev) * 7

        def old():
            delta = None
            for i in range(LAYERS):
                h = K.add_rms_norm_(x, delta, nw, 1e-5)
                qkv = F.linear(h, Wqkv[i])
                q = K.rope_write_kv_(qkv, H, HKV, D, cos, sin, pos, slots, kc, vc)
                h = K.add_rms_norm_(x, F.linear(q.reshape(m, H * D), Wo[i]), nw, 1e-5)
                delta = F.linear(K.silu_mul(F.linear(h, Wgu[i])), Wd[i])

        def cfg(name):
            return results["best"].get(f"{name}/{m}", {}).get("cfg")

        def new():
            for i in range(LAYERS):
                q = K.qkv_rope_write_kv(x, Wqkv[i], None, nw, 1e-5, H, HKV, D, cos, sin, pos, slots, kc, vc,
                                        config=cfg("qkv"))
                K.fused_linear(q.reshape(m, H * D), Wo[i], residual=x, out=x, config=cfg("o"))
                a = K.fused_linear(x, Wgu[i], norm_weight=nw, eps=1e-5, silu_mul=True, config=cfg("gate_up"))
                K.fused_linear(a, Wd[i], residual=x, out=x, config=cfg("down"))

        def new_default():
            for i in range(LAYERS):
                q = K.qkv_rope_write_kv(x, Wqkv[i], None, nw, 1e-5, H, HKV, D, cos, sin, pos, slots, kc, vc)
                K.fused_linear(q.reshape(m, H * D), Wo[i], residual=x, out=x)
                a = K.fused_linear(x, Wgu[i], norm_weight=nw, eps=1e-5, silu_mul=True)
                K.fused_linear(a, Wd[i], residual=x, out=x)

        row = {"m": m, "old_us_per_layer": bench_graph(old), "new_us_per_layer": bench_graph(new),
               "new_default_us_per_layer": bench_graph(new_default)}
        results["layer"].append(row)
        print(json.dumps(row), flush=True)

    md = [run_header(dev, str(dt)), "", "| kernel | rows | best µs | config |", "|---|---|---|---|"]
    md += [f"| {k.split('/')[0]} | {k.split('/')[1]} | {v['us']:.2f} | `{v['cfg']}` |" for k, v in results["best"].items()]
    md += ["", "| rows | old µs / layer | new µs / layer (best) | new µs / layer (defaults) |", "|---|---|---|---|"]
    md += [f"| {r['m']} | {r['old_us_per_layer']:.1f} | {r['new_us_per_layer']:.1f} | {r['new_default_us_per_layer']:.1f} |"
           for r in results["layer"]]
    text = "\n".join(md)
    write_results(args.out, "linear_sweep", text, results)


if __name__ == "__main__":
    main()
