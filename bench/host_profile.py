"""Where a decode step's *host* time goes: cProfile over engine steps, and the CPU cost of a replay.

    python bench/host_profile.py --device cuda --out DIR       # the H200
    python bench/host_profile.py --device cpu --quick           # a smoke run

A SmolLM2-135M-shaped target with random weights (as ``step_profile.py``), the
null drafter, greedy, graphs pre-captured. For each batch size it reports, in
the same run:

- the engine's per-step timers (schedule+prepare+verify+postprocess as ``host``,
  the runner's ``launch`` and ``wait``) and the wall time per step; ``graph_launch``:
  the runner's fill + replay call of graph steps alone; ``eager_launch_ms``: the launch of
  an eager (prompt) step, which ``launch`` also counts;
- the CPU time of the pieces of a graph launch, each timed alone over many calls
  with the device idle: input fill (NumPy), the two H2D copies, ``graph.replay()``;
- with ``--cprofile``, cProfile's top functions by own time over the generation, and
  over its eager (prompt) steps alone;
- with ``--pdl 2,0,1,2``, each programmatic-dependent-launch level in turn;
- with ``--overlap 0,1``, plain and overlapped decode steps (``EngineConfig.overlap_steps``);
- with ``--eager-prompts``, prompt steps run eagerly (``prompt_graphs=False``), as before they
  replayed graphs by default.

Writes ``host_profile.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, top_functions, write_results  # noqa: E402
from step_profile import largest_generation_graph, prompts, random_target, sync  # noqa: E402

from specdec import EngineConfig, KernelConfig, SamplingParams, SpecEngine  # noqa: E402
from specdec.graphs import pad_step_into  # noqa: E402


def piece_us(fn, device: str, reps: int) -> float:
    """CPU µs per call of ``fn`` (the device drained before and after, not between calls)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t = time.perf_counter() - t0
    sync(device)
    return 1e6 * t / reps


def time_calls(obj, name: str) -> list[float]:
    """Time every call of ``obj.name`` from now on (seconds, appended to the returned list)."""
    fn, times = getattr(obj, name), []

    def timed(*a, **kw):
        t0 = time.perf_counter()
        out = fn(*a, **kw)
        times.append(time.perf_counter() - t0)
        return out

    setattr(obj, name, timed)
    return times


def profile_calls(obj, name: str) -> cProfile.Profile:
    """cProfile only inside calls of ``obj.name`` from now on (e.g. the runner's eager steps)."""
    fn, prof = getattr(obj, name), cProfile.Profile()

    def profiled(*a, **kw):
        prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()

    setattr(obj, name, profiled)
    return prof


def launch_pieces(engine, device: str, reps: int) -> dict:
    """CPU cost of each piece of a graph launch, on the largest captured generation bucket (not a
    prompt bucket, which prompt graphs make larger)."""
    runner = engine.runner
    g = largest_generation_graph(engine)
    if g is None:
        return {}
    out, n = {}, g.key.num_tokens
    ids, pos, slots = [0] * n, list(range(n)), [runner.scratch_slot] * n
    out["pad_step_into_us"] = piece_us(lambda: pad_step_into(g.tokens_np, g.key, ids, pos, slots,
                                                             runner.scratch_slot), device, reps)
    out["h2d_tokens_us"] = piece_us(lambda: g.tokens_dev.copy_(g.tokens_host, non_blocking=True), device, reps)
    out["h2d_meta_us"] = piece_us(lambda: g.meta_dev.copy_(g.meta_host, non_blocking=True), device, reps)
    # replays back to back queue up on the device; time few so the queue never fills
    out["replay_call_us"] = piece_us(g.graph.replay, device, min(reps, 20))
    idle = []
    for _ in range(20):  # one replay on an idle device, as an engine step launches it after its sync
        sync(device)
        t0 = time.perf_counter()
        g.graph.replay()
        idle.append(time.perf_counter() - t0)
    sync(device)
    out["replay_call_idle_us"] = 1e6 * sorted(idle)[len(idle) // 2]
    out["argmax_tolist_us"] = piece_us(lambda: g.outputs[1].tolist(), device, reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--pdl", default=None,
                    help="comma-separated PDL levels to run in turn (e.g. 2,0,1,2: repeats show host noise); "
                         "default: the device's level only")
    ap.add_argument("--overlap", default="0", help="comma-separated overlap_steps settings to run (e.g. 0,1)")
    ap.add_argument("--cprofile", action="store_true", help="also cProfile each generation (top 25 functions)")
    ap.add_argument("--eager-prompts", action="store_true",
                    help="prompt_graphs=False: prompt steps run eagerly (the default replays them from graphs, "
                         "so the eager-step columns and profile then see none)")
    ap.add_argument("--quick", action="store_true", help="2 layers, 16 tokens (a smoke run)")
    ap.add_argument("--out", default="out/host_profile")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    layers = 2 if args.quick else None
    new_tokens = 16 if args.quick else args.new_tokens
    rows, profiles = [], {}
    # None: the device's level, for the target's GEMMs and attention alike
    levels = [int(x) for x in args.pdl.split(",")] if args.pdl else [None]
    targets = {level: random_target(args.device, dtype, layers, KernelConfig(pdl=level)) for level in set(levels)}
    runs = [(level, int(ov), int(b)) for level in levels for ov in args.overlap.split(",")
            for b in args.batch_sizes.split(",")]
    for asked, overlap, b in runs:
        target = targets[asked]
        level = target.kernels.pdl
        engine = SpecEngine(target, None, EngineConfig(max_num_seqs=b, overlap_steps=bool(overlap),
                                                       prompt_graphs=not args.eager_prompts,
                                                       attention_pdl=level > 0))
        engine.capture_graphs(max_kv_len=64 + new_tokens + 8, progress=False)
        ids = prompts(b, 48, target.config.vocab_size)
        params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        engine.generate(ids, params)  # warm-up
        for k in ("forward_s", "host_s", "draft_s", "verify_s", "steps"):
            engine.timings[k] = 0
        for k in ("launch_s", "wait_s"):
            engine.runner.stats[k] = 0.0
        replay_s = time_calls(engine.runner, "_replay")
        eager_s = time_calls(engine.runner, "_eager")
        sync(args.device)
        t0 = time.perf_counter()
        engine.generate(ids, params)
        sync(args.device)
        wall = time.perf_counter() - t0
        del engine.runner._replay, engine.runner._eager  # the class's methods again
        t, s = engine.timings, engine.runner.stats
        steps = max(1, t["steps"])
        row = {"pdl": level, "overlap": overlap, "batch": b, "steps": steps, "wall_us_per_step": 1e6 * wall / steps,
               "launch_us": 1e6 * s["launch_s"] / steps, "wait_us": 1e6 * s["wait_s"] / steps,
               "host_us": 1e6 * t["host_s"] / steps, "verify_us": 1e6 * t["verify_s"] / steps,
               "draft_us": 1e6 * t["draft_s"] / steps,
               "graph_launch_us": 1e6 * sum(replay_s) / max(1, len(replay_s)),
               "eager_steps": len(eager_s), "eager_launch_ms": 1e3 * sum(eager_s) / max(1, len(eager_s))}
        row.update(launch_pieces(engine, args.device, 200))
        if args.cprofile:
            eager_prof = profile_calls(engine.runner, "_eager")
            engine.generate(ids, params)
            sync(args.device)
            del engine.runner._eager
            profiles[f"eager (prompt) steps only, pdl {level}, batch {b}"] = top_functions(eager_prof, 25)
            prof = cProfile.Profile()
            prof.enable()
            engine.generate(ids, params)
            sync(args.device)
            prof.disable()
            profiles[f"pdl {level}, batch {b}"] = top_functions(prof, 25)
        rows.append(row)
        print({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}, flush=True)
    keys = list(rows[0])
    md = [run_header(args.device, args.dtype, "SmolLM2-135M shape with random weights", "null drafter",
                     f"{new_tokens} new tokens"), "",
          "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    md += ["| " + " | ".join(f"{r.get(k, 0):.1f}" if isinstance(r.get(k), float) else str(r.get(k)) for k in keys)
           + " |" for r in rows]
    for name, text in profiles.items():
        md += ["", f"## cProfile, {name} (top 25 by own time)", "", "```", text.strip(), "```"]
    write_results(args.out, "host_profile", "\n".join(md),
                  {"rows": rows, "device": args.device, "dtype": args.dtype, "new_tokens": new_tokens})


if __name__ == "__main__":
    main()
