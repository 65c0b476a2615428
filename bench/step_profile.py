"""Where a decode step's time goes: a SmolLM2-135M-shaped target with random weights.

    python bench/step_profile.py --device cuda --out DIR           # the H200
    python bench/step_profile.py --device cpu --dtype float32 --quick  # a smoke run (no kernels profiled)

For each forward path of :class:`~specdec.target.llama.LlamaTarget` on the GPU
(``fused``: fused elementwise kernels beside cuBLAS GEMMs; ``gemm``: the fused
GEMM kernels of ``kernels.py``, five a layer plus attention; ``gemm_pdl1`` /
``gemm_pdl2``: the same with programmatic dependent launch, level 1 or 2, see
``specdec/pdl.py``; ``gemm`` launches plainly) and each batch size, in the same run:

- ``replay µs``: one CUDA-graph replay of the generation bucket, timed over
  many replays (the GPU time of a step, no host work);
- ``forward ms / step``: the engine's forward time per step while generating
  (includes the input copies and the one host sync);
- ``kernels / step`` and the largest kernels: ``torch.profiler`` over eager steps;
- outputs of ``gemm`` equal to ``fused`` (greedy, same prompts).

Needs only torch (+ triton on the GPU): the weights are random, at SmolLM2's
dimensions, so it runs where the real checkpoint is not staged. Writes
``step_profile.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)

from specdec import EngineConfig, KernelConfig, SamplingParams, SpecEngine  # noqa: E402
from specdec.target.llama import LlamaConfig, LlamaTarget  # noqa: E402

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
               max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=2, bos_token_id=1)


def random_target(device: str, dtype: torch.dtype, layers: int | None = None,
                  kernels: KernelConfig | None = None) -> LlamaTarget:
    """A SmolLM2-135M-shaped target with random weights (std 0.02, norms at 1), running ``kernels``
    (default: the device's)."""
    cfg = LlamaConfig.from_hf({**SMOLLM2, **({"num_hidden_layers": layers} if layers else {})})
    g = torch.Generator(device="cpu").manual_seed(0)
    hd, inter, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, Hkv = cfg.num_attention_heads, cfg.num_key_value_heads

    def rnd(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).to(dtype)

    w = {"model.embed_tokens.weight": rnd(cfg.vocab_size, hd), "model.norm.weight": torch.ones(hd, dtype=dtype)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.update({p + "self_attn.q_proj.weight": rnd(H * D, hd), p + "self_attn.k_proj.weight": rnd(Hkv * D, hd),
                  p + "self_attn.v_proj.weight": rnd(Hkv * D, hd), p + "self_attn.o_proj.weight": rnd(hd, H * D),
                  p + "mlp.gate_proj.weight": rnd(inter, hd), p + "mlp.up_proj.weight": rnd(inter, hd),
                  p + "mlp.down_proj.weight": rnd(hd, inter),
                  p + "input_layernorm.weight": torch.ones(hd, dtype=dtype),
                  p + "post_attention_layernorm.weight": torch.ones(hd, dtype=dtype)})
    return LlamaTarget(cfg, w, name="smollm2-shaped-random", dtype=dtype, device=device, kernels=kernels)


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + i % 7,), generator=g).tolist() for i in range(n)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def largest_generation_graph(engine):
    """The captured generation bucket with the most tokens (not a prompt bucket), or None."""
    graphs = [c for c in engine.runner._graphs.values() if c.key.phase == "generation"]
    return max(graphs, key=lambda c: c.key.num_tokens) if graphs else None


def replay_us(engine, device: str, reps: int) -> float | None:
    """GPU time of one replay of the largest captured generation bucket (µs), or None without graphs."""
    g = largest_generation_graph(engine)
    return _replay_us_of(g, device, reps) if g is not None else None


def replay_profile(engine, device: str, reps: int = 20) -> dict:
    """torch.profiler over replays of the largest captured generation bucket: kernels per replay, the largest."""
    g = largest_generation_graph(engine)
    return _graph_profile(g, device, reps, top_n=12) if g is not None else {}


def _replay_us_of(g, device: str, reps: int) -> float:
    """µs per replay of a captured graph, over ``reps`` back-to-back replays after 5 warm ones."""
    for _ in range(5):
        g.graph.replay()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        g.graph.replay()
    sync(device)
    return 1e6 * (time.perf_counter() - t0) / reps


def _graph_profile(g, device: str, reps: int = 20, top_n: int = 40) -> dict:
    """torch.profiler over ``reps`` replays of a captured graph (``top_n`` 40: every kernel of a step)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            g.graph.replay()
        sync(device)
    return _summarise(prof, reps, top_n)


def _summarise(prof, steps: int, top_n: int = 12) -> dict:
    per_kernel = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type.name == "CUDA":
            k = per_kernel[e.name[:80]]
            k[0] += 1
            k[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    launches = sum(c for c, _ in per_kernel.values())
    busy = sum(t for _, t in per_kernel.values())
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1][1])[:top_n]
    return {"steps": steps, "kernels_per_step": launches / max(1, steps), "busy_us_per_step": busy / max(1, steps),
            "top": [{"kernel": n, "calls_per_step": c / max(1, steps), "us_per_step": t / max(1, steps)}
                    for n, (c, t) in top]}


def mode_settings(mode: str, on_gpu: bool) -> tuple[KernelConfig, bool]:
    """The target's kernels and the attention's PDL switch (``EngineConfig.attention_pdl``) of a
    forward path of ``--modes``: attention launches as the GEMMs around it do."""
    pdl = int(mode.removeprefix("gemm_pdl")) if mode.startswith("gemm_pdl") else 0
    return KernelConfig(fused=on_gpu, fused_gemm=mode.startswith("gemm"), pdl=pdl), pdl > 0


def verify_profile(target, device: str, batch: int, q_len: int, kv_bucket: int, reps: int,
                   attention_pdl: bool | None = None) -> dict:
    """A decode bucket beside the verify bucket of ``q_len`` tokens per request (the same engine,
    the same context bucket): GPU µs per replay of each, and each one's kernels (``torch.profiler``)."""
    from specdec.drafters.suffix_automaton import SuffixAutomatonDrafter
    from specdec.graphs import GraphKey

    engine = SpecEngine(target, SuffixAutomatonDrafter(max_draft_tokens=q_len - 1),
                        EngineConfig(max_num_seqs=batch, max_draft_tokens=q_len - 1, attention_pdl=attention_pdl))
    engine.capture_graphs(max_kv_len=kv_bucket, progress=False)
    out = {"batch": batch, "q_len": q_len, "kv_bucket": kv_bucket}
    for name, key in (("decode", GraphKey(batch, batch, 1, kv_bucket)),
                      ("verify", GraphKey(batch, batch * q_len, q_len, kv_bucket))):
        g = engine.runner._graphs.get(key)
        if g is None:
            raise SystemExit(f"no graph was captured for {key}; captured: {sorted(engine.runner._graphs)}")
        out[f"{name}_us"] = _replay_us_of(g, device, reps)
        out[f"{name}_profile"] = _graph_profile(g, device)
    return out


def kernel_profile(target, device: str, prompt_ids, new_tokens: int, attention_pdl: bool | None = None) -> dict:
    """torch.profiler over eager decode steps: kernels per step and the largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    engine = SpecEngine(target, None, EngineConfig(cuda_graphs=False, max_num_seqs=len(prompt_ids),
                                                   attention_pdl=attention_pdl))
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate(prompt_ids, params)  # warm-up (compiles)
    steps_before = engine.timings["steps"]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt_ids, params)
        sync(device)
    return _summarise(prof, engine.timings["steps"] - steps_before)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--prompt-len", type=int, default=160)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=200, help="graph replays timed per bucket")
    ap.add_argument("--quick", action="store_true", help="2 layers, batch 1 and 2, 8 tokens (a smoke run)")
    ap.add_argument("--modes", default="fused,gemm,gemm_pdl1,gemm_pdl2", help="forward paths to compare (GPU)")
    ap.add_argument("--verify-rows", type=int, default=0, metavar="Q",
                    help="also a verify bucket of Q tokens per request beside the decode bucket (same engine, "
                         "context bucket 512), with the last path of --modes, per batch size (GPU)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    if args.quick:
        batches, args.new_tokens, args.prompt_len, args.reps = [1, 2], 8, 24, 5
    on_gpu = args.device.startswith("cuda")
    modes = args.modes.split(",") if on_gpu else ["plain"]
    rows, outputs, profiles = [], {}, {}
    for mode in modes:
        kernels, attention_pdl = mode_settings(mode, on_gpu)
        target = random_target(args.device, dtype, layers=2 if args.quick else None, kernels=kernels)
        for b in batches:
            ids = prompts(b, args.prompt_len, target.vocab_size)
            # plain steps, so that launch and wait per step stay comparable between modes and runs
            engine = SpecEngine(target, None, EngineConfig(max_num_seqs=b, overlap_steps=False,
                                                           attention_pdl=attention_pdl))
            params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
            engine.generate(ids, params)  # warm-up: compiles, captures the buckets
            engine.timings.update({k: 0 for k in engine.timings})
            engine.runner.stats.update(launch_s=0.0, wait_s=0.0)
            sync(args.device)
            t0 = time.perf_counter()
            outs = engine.generate(ids, params)
            sync(args.device)
            wall = time.perf_counter() - t0
            steps = max(1, engine.timings["steps"])
            outputs[(mode, b)] = [list(o.token_ids) for o in outs]
            st = engine.graph_stats
            row = {"mode": mode, "batch": b, "tokens_per_s": sum(len(o.token_ids) for o in outs) / wall,
                   "launch_us_per_step": 1e6 * st["launch_s"] / steps, "wait_us_per_step": 1e6 * st["wait_s"] / steps,
                   "forward_ms_per_step": 1e3 * engine.timings["forward_s"] / steps,
                   "step_ms": 1e3 * wall / steps, "replay_us": replay_us(engine, args.device, args.reps),
                   "graph_steps": engine.graph_stats["graph_steps"], "steps": steps}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if on_gpu and b == batches[0] and mode in ("fused", "gemm", modes[-1]):
                profiles[f"{mode} replay b{b}"] = replay_profile(engine, args.device)
        if on_gpu and mode in ("fused", "gemm"):
            profiles[f"{mode} eager b1"] = kernel_profile(target, args.device, prompts(1, args.prompt_len, target.vocab_size),
                                                          min(16, args.new_tokens), attention_pdl)
            print(mode, json.dumps(profiles[f"{mode} eager b1"])[:600], flush=True)
    verify = []
    if on_gpu and args.verify_rows > 1:  # the last mode's target and attention settings
        for b in batches:
            verify.append(verify_profile(target, args.device, b, args.verify_rows, 512, args.reps, attention_pdl))
            print(json.dumps({k: v for k, v in verify[-1].items() if not k.endswith("profile")}), flush=True)
    equal = {f"{m} b{b}": sum(x == y for x, y in zip(outputs[(modes[0], b)], outputs[(m, b)]))
             for m in modes[1:] for b in batches} if on_gpu else {}
    head = run_header(args.device, args.dtype, "SmolLM2-135M shape with random weights",
                      f"prompts of {args.prompt_len}+ tokens", f"{args.new_tokens} new tokens (ignore_eos)")
    md = [head, "", "| path | batch | replay µs | forward ms / step (launch µs + wait µs) | step ms (wall) | "
          "tokens/s | graph steps |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        rep = f"{r['replay_us']:.0f}" if r["replay_us"] else "-"
        md.append(f"| {r['mode']} | {r['batch']} | {rep} | {r['forward_ms_per_step']:.3f} "
                  f"({r['launch_us_per_step']:.0f} + {r['wait_us_per_step']:.0f}) | {r['step_ms']:.3f} | "
                  f"{r['tokens_per_s']:.1f} | {r['graph_steps']}/{r['steps']} |")
    for mode, p in profiles.items():
        if not p:
            continue
        md += ["", f"**{mode}**: {p['kernels_per_step']:.0f} kernels per step, {p['busy_us_per_step']:.0f} µs of "
               "kernel time per step; largest:", "",
               "| kernel | calls / step | µs / step |", "|---|---|---|"]
        md += [f"| `{t['kernel']}` | {t['calls_per_step']:.0f} | {t['us_per_step']:.1f} |" for t in p["top"]]
    for v in verify:
        md += ["", f"**{modes[-1]}, batch {v['batch']}: a {v['q_len']}-token verify replay beside a decode replay** "
               f"(context bucket {v['kv_bucket']}): {v['verify_us']:.0f} µs against {v['decode_us']:.0f} µs "
               f"({v['verify_us'] / v['decode_us']:.2f}x)", "",
               "| kernel | decode calls | decode µs | verify calls | verify µs |", "|---|---|---|---|---|"]
        dec = {t["kernel"]: t for t in v["decode_profile"]["top"]}
        ver = {t["kernel"]: t for t in v["verify_profile"]["top"]}
        for name in sorted(set(dec) | set(ver), key=lambda n: -ver.get(n, dec.get(n))["us_per_step"]):
            d, w = dec.get(name), ver.get(name)
            md.append(f"| `{name}` | {d['calls_per_step'] if d else 0:.0f} | {d['us_per_step'] if d else 0:.1f} | "
                      f"{w['calls_per_step'] if w else 0:.0f} | {w['us_per_step'] if w else 0:.1f} |")
    if equal:
        md += ["", f"greedy outputs equal to `{modes[0]}`'s: "
               + ", ".join(f"{k}: {n}/{k.rsplit(' b', 1)[1]}" for k, n in equal.items())]
    text = "\n".join(md)
    write_results(args.out, "step_profile", text, {"rows": rows, "profiles": profiles, "equal": equal, "verify": verify, "header": head})


if __name__ == "__main__":
    main()
