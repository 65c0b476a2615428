"""A block drafter's mean accepted length on fixed greedy outputs, two ways: the engine's walk
replayed offline, and every response position (what training's validation estimates).

    python bench/walk_tau.py --device cpu --out DIR                      # HumanEval 100-163, fp32
    python bench/walk_tau.py --outputs F.json --prompts 0-15 --drafters dflash

``--outputs`` holds ``[[prompt ids, output ids], ...]`` (by default the fp32 greedy outputs of
SmolLM2-135M on HumanEval 100-163, ``bench/results/smollm2_fp32_humaneval_100-163.json``). For each
shipped drafter, every response position of every sequence is an anchor: the target's hidden states
of the whole sequence feed one pass of the drafter (``block_hidden``, as in training), which drafts
the block after each anchor, and ``k`` = how many drafted tokens equal the output's
(``specdec.drafters.training.accepted_runs`` and ``walk_accepted_lengths``).

- **walk**: the engine's greedy steps at batch 1 with full-width drafts: the first anchor is the first
  response token (it came from the prompt step), a step accepts ``k`` and adds the target's own
  token, so the next anchor is ``k + 1`` further. Its tokens per step is the engine's τ on these
  outputs (the engine in fp32 on the same prompts walks the same sequence; on a tiny model the
  tests find its steps equal to the engine's, step for step).
- **every position**: ``1 + k`` averaged over all anchors, the estimator of training's validation
  τ. The walk's anchors are not uniform: each follows a token the last draft missed, so the walk
  sits below it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402
from specdec.drafters.block import BlockDrafterNet  # noqa: E402
from specdec.drafters.training import accepted_runs, walk_accepted_lengths  # noqa: E402
from specdec.target import load_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--outputs", default=str(ROOT / "bench/results/smollm2_fp32_humaneval_100-163.json"))
    ap.add_argument("--prompts", default=None, help="a range of entries, e.g. 0-15 (default: all)")
    ap.add_argument("--drafters", default="dflash,dspark", help="shipped checkpoints smollm2-135m-<kind>")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    outs = json.loads(Path(args.outputs).read_text())
    if args.prompts:
        lo, hi = (int(x) for x in args.prompts.split("-"))
        outs = outs[lo:hi + 1]
    torch.set_grad_enabled(False)
    target = load_target("smollm2-135m", dtype=getattr(torch, args.dtype), device=args.device)
    rows = []
    for kind in args.drafters.split(","):
        net = BlockDrafterNet.load(ROOT / f"specdec/drafters/checkpoints/smollm2-135m-{kind}")
        net = net.to(device=args.device, dtype=getattr(torch, args.dtype)).eval()
        t0 = time.perf_counter()
        steps = tokens = 0
        every = []
        for prompt, out in outs:
            runs = accepted_runs(net, target, prompt, out)
            walk = walk_accepted_lengths(runs, len(out))
            steps, tokens, every = steps + len(walk), tokens + sum(walk), every + runs
        rows.append(dict(drafter=kind, walk_tau=tokens / steps, steps=steps,
                         every_position_tau=1 + sum(every) / len(every), anchors=len(every),
                         seconds=time.perf_counter() - t0))
        print(f"{kind}: walk τ {tokens / steps:.3f}, every position {rows[-1]['every_position_tau']:.3f}", flush=True)
    head = run_header(args.device, args.dtype, f"{len(outs)} sequences of {Path(args.outputs).name}")
    md = [head, "", "| drafter | walk τ (the engine's) | steps | every-position τ (validation's) | anchors "
          "| walk / every |", "|---|---|---|---|---|---|"]
    md += [f"| {r['drafter']} | {r['walk_tau']:.3f} | {r['steps']:,} | {r['every_position_tau']:.3f} "
           f"| {r['anchors']:,} | "
           f"{r['walk_tau'] / r['every_position_tau']:.2f} |" for r in rows]
    write_results(args.out, "walk_tau", "\n".join(md), dict(header=head, rows=rows))


if __name__ == "__main__":
    main()
