"""Why the null drafter runs slower after a compiled drafter in the same process: host time, where it goes.

    python bench/null_after_compile.py --device cuda --out /root/out/null_after_compile     # the H200
    python bench/null_after_compile.py --quick --out /tmp/null_after_compile                 # CPU, a check of the script

On the H200, null at batch 8 ran at 3,753-4,105 tokens/s in processes that had compiled a block
drafter's propose earlier, against 6,336 alone, with the runner's host launch time 2.44-3.29 s against
0.52 s (BENCHMARKS.md, 2026-12-05). This runs, in one process: a null engine at ``--batch-size``
(untimed warm-up, then ``--rounds`` timed generations), then a block drafter with its propose
compiled (``torch_compile=True``) over the same prompts, then the null engine again, the same way.
For each null phase it reports tokens/s, the engine's and the runner's per-step timers, the time
the garbage collector ran (per generation, through ``gc.callbacks``), cProfile's top functions by
own time over one generation, and the process state a compile may leave behind (objects the
garbage collector tracks, and how often it ran, included):
Python threads alive (names), child processes, torch's intra-op threads, the garbage collector's
counts and thresholds, whether a TorchFunctionMode or dispatch mode is active, and
``sys.getprofile`` / ``sys.gettrace``, and the CUDA caching allocator's counters. A last phase runs null
once more after ``gc.collect(); gc.freeze()`` (``--no-freeze`` skips it). ``--release`` also drops the drafter engine and runs
``gc.collect()`` and ``torch._dynamo.reset()`` before the second phase (does the slowdown go?).

Target: SmolLM2-135M (``--target``) with the shipped DSpark on CUDA; with ``--quick`` a random
30-layer SmolLM2-shaped target in fp32 on the CPU and a one-layer DSpark of random weights.
HumanEval-style prompts are not needed: random token prompts of ``--prompt-len`` tokens.
Writes ``null_after_compile.md`` and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from results_io import process_state, run_header, top_functions, write_results  # noqa: E402
from step_profile import prompts, random_target  # noqa: E402

from specdec import SamplingParams, SpecEngine  # noqa: E402
from specdec.drafters import NullDrafter  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


class GCTimer:
    """Seconds the garbage collector ran, per generation, while active (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.seconds, self.runs, self._t0 = [0.0, 0.0, 0.0], [0, 0, 0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._t0
            self.runs[info["generation"]] += 1

    def __enter__(self) -> "GCTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def null_phase(target, ps, args, label: str) -> dict:
    params = SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    engine = SpecEngine(target, NullDrafter(), max_num_seqs=len(ps))
    if target.device.type == "cuda":
        engine.capture_graphs(max_kv_len=args.prompt_len + args.new_tokens + 1, progress=False)
    engine.generate(ps, params)  # untimed
    rates, timings = [], {}
    for _ in range(args.rounds):
        engine.timings.update({k: 0 for k in engine.timings})
        runner = engine.runner.stats
        for k in ("graph_steps", "eager_steps", "launch_s", "wait_s"):
            runner[k] = 0 if isinstance(runner.get(k), int) else 0.0
        sync(target.device)
        with GCTimer() as gct:
            t0 = time.perf_counter()
            outs = engine.generate(ps, params)
            sync(target.device)
            rates.append(sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0))
        timings = {"engine": {k: round(v, 4) for k, v in engine.timings.items()},
                   "gc": {"seconds": [round(x, 4) for x in gct.seconds], "runs": gct.runs},
                   "runner": {k: round(runner[k], 4) for k in ("graph_steps", "eager_steps", "launch_s", "wait_s")}}
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(ps, params)
    sync(target.device)
    prof.disable()
    engine.close()
    return {"phase": label, "tokens_per_s": [round(r, 1) for r in rates], **timings, "state": process_state(),
            "top": top_functions(prof, args.top)}


def compiled_drafter_phase(target, ps, args) -> dict:
    from specdec.drafters.dflash import DSparkDrafter

    if args.quick:
        from specdec.drafters.block import BlockDrafterConfig, BlockDrafterNet, init_weights

        cfg = BlockDrafterConfig(block_size=8, shift_label=1, target_layer_ids=(1, 15, 29), target_hidden_size=576,
                                 vocab_size=target.vocab_size, hidden_size=576, num_layers=1, num_heads=9,
                                 num_kv_heads=3, head_dim=64, intermediate_size=256)
        drafter = DSparkDrafter(init_weights(BlockDrafterNet(cfg), seed=1), torch_compile=True)
    else:
        drafter = DSparkDrafter.from_pretrained("smollm2-135m-dspark")
        drafter.torch_compile = True
    engine = SpecEngine(target, drafter, max_num_seqs=len(ps), max_draft_tokens=8, draft_gate=False)  # compiles at its first propose
    t0 = time.perf_counter()
    engine.generate(ps, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True))
    sync(target.device)
    out = {"phase": "compiled DSpark", "seconds": round(time.perf_counter() - t0, 2),
           "compile_s": round(drafter.stats.get("compile_s", 0.0), 2),
           "compile_errors": drafter.stats.get("compile_errors", 0), "state": process_state()}
    if args.release:
        engine.close()
        del engine, drafter
        gc.collect()
        torch._dynamo.reset()
        out["released"] = True
    else:
        out["_keep"] = (engine, drafter)  # alive through the second null phase, as in bench/e2e.py
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--target", default="smollm2-135m")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--top", type=int, default=18, help="cProfile rows per null phase")
    ap.add_argument("--release", action="store_true", help="drop the drafter engine and reset dynamo before phase 2")
    ap.add_argument("--no-freeze", action="store_true", help="skip the last phase (null after gc.collect(); gc.freeze())")
    ap.add_argument("--quick", action="store_true", help="CPU, random weights, short")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.quick:
        args.device, args.dtype, args.new_tokens, args.rounds, args.prompt_len = "cpu", "float32", 12, 1, 16
        torch.set_num_threads(1)
    dev = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    if args.quick:
        target = random_target("cpu", dtype)
    else:
        from specdec.target import load_target

        target = load_target(args.target, dtype=dtype, device=dev)
    ps = prompts(args.batch_size, args.prompt_len, target.vocab_size)
    phases = [null_phase(target, ps, args, "null, first")]
    print(phases[-1]["phase"], phases[-1]["tokens_per_s"], file=sys.stderr, flush=True)
    phases.append(compiled_drafter_phase(target, ps, args))
    keep = phases[-1].pop("_keep", None)
    print(phases[-1], file=sys.stderr, flush=True)
    phases.append(null_phase(target, ps, args, "null, after the compiled drafter"))
    print(phases[-1]["phase"], phases[-1]["tokens_per_s"], file=sys.stderr, flush=True)
    if not args.no_freeze:  # the garbage collector no longer walks what the compile left (as vLLM after warm-up)
        gc.collect()
        gc.freeze()
        phases.append(null_phase(target, ps, args, "null, after gc.freeze()"))
        print(phases[-1]["phase"], phases[-1]["tokens_per_s"], file=sys.stderr, flush=True)
        gc.unfreeze()
    del keep
    header = run_header(args.device, f"{'random SmolLM2-shaped target' if args.quick else args.target} {args.dtype}",
                        f"batch {args.batch_size}", f"{args.new_tokens} new tokens", f"{args.rounds} timed rounds",
                        f"TORCHINDUCTOR_COMPILE_THREADS={os.environ.get('TORCHINDUCTOR_COMPILE_THREADS', 'unset')}",
                        "drafter engine released before phase 2" if args.release else "drafter engine kept alive")
    md = [header, "", "| phase | tokens/s | engine timers | runner timers | GC in the last round: s, runs per generation |",
          "|---|---|---|---|---|"]
    for p in phases:
        if "tokens_per_s" in p:
            md.append(f"| {p['phase']} | {p['tokens_per_s']} | {p.get('engine', '')} | {p.get('runner', '')} | "
                      f"{p['gc']['seconds']}, {p['gc']['runs']} |")
        else:
            md.append(f"| {p['phase']} | {p['seconds']} s (compile {p['compile_s']} s, errors "
                      f"{p['compile_errors']}) | | | |")
    for p in phases:
        md += ["", f"## {p['phase']}: process state", "", "```", *(f"{k}: {v}" for k, v in p["state"].items()), "```"]
        if "top" in p:
            md += ["", f"## {p['phase']}: cProfile, top functions by own time (one generation)", "", "```",
                   p["top"], "```"]
    write_results(args.out, "null_after_compile", "\n".join(md), phases)


if __name__ == "__main__":
    main()
