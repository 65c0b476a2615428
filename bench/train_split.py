"""Where a block-drafter training step's time goes: the target's forward (the hidden states) against
the drafter's forward and backward, per kind; and what training the kinds side by side saves.

    python bench/train_split.py --device cuda --out DIR           # GPU, bf16 autocast as in training
    python bench/train_split.py --device cpu --seqs 4 --steps 3   # CPU, fp32
    python bench/train_split.py --device cuda --seqs 64 --loop-steps 20   # + the training loop, plain
                                                                           # loss against compile_loss

The real SmolLM2-135M target and the shipped checkpoints, on batches of the repo's training data
(``data/drafter-smollm2-135m``), with the recipe's settings (:data:`KIND_SETTINGS`): for each kind,
``--steps`` timed steps after one untimed. "side by side" is one target forward plus every kind's
drafter part (:func:`~specdec.drafters.training.train_block_drafters`), against the kinds trained one
after the other. ``--loop-steps N`` also times N steps of the joint training loop itself, with the
plain loss and with ``TrainConfig.compile_loss`` (the loss's passes over the vocabulary through
``torch.compile``), one after the other in the same process. Writes ``train_split.md`` and ``.json``
under ``--out``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402
from specdec.drafters.block import BlockDrafterNet  # noqa: E402
from specdec.drafters.data import TokenData  # noqa: E402
from specdec.drafters.training import (KIND_SETTINGS, TrainConfig, TrainJob, _autocast, _order,  # noqa: E402
                                       _sample_batch, anchor_range, anchors_from_uniform, block_loss,
                                       train_block_drafters)
from specdec.target import load_target  # noqa: E402


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seqs", type=int, default=16, help="sequences a step (the recipe's default 16)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per kind")
    ap.add_argument("--data", default="data/drafter-smollm2-135m")
    ap.add_argument("--out", default=None)
    ap.add_argument("--loop-steps", type=int, default=0,
                    help="also time this many steps of the joint training loop itself (both kinds, AdamW "
                         "included), with the plain loss and with TrainConfig.compile_loss, side by side")
    ap.add_argument("--compile-loss", action="store_true", help="the timed parts (and --profile) with compile_loss")
    ap.add_argument("--profile", action="store_true",
                    help="also torch.profiler tables of 3 side-by-side steps (optimizer steps included): profile.txt")
    args = ap.parse_args()
    dev = torch.device(args.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    target = load_target("smollm2-135m", dtype=dtype, device=args.device)
    data = TokenData.load(args.data)
    order = _order(len(data), 0, 0)
    rows = []
    for kind, k in KIND_SETTINGS.items():
        net = BlockDrafterNet.load(Path("specdec/drafters/checkpoints") / f"smollm2-135m-{kind}").to(dev).float()
        net.train()
        tc = TrainConfig(seqs_per_step=args.seqs, tv_weight=k["tv_weight"], confidence_weight=k["confidence_weight"],
                         compile_loss=args.compile_loss)
        g = torch.Generator().manual_seed(0)
        fwd, drafter, toks = [], [], []
        for i in range(args.steps + 1):
            sync(dev)
            t0 = time.perf_counter()
            with torch.no_grad():
                batch = _sample_batch(target, data, order, args.seqs * i, tc, net.config.target_layer_ids,
                                      tc.tv_weight > 0)
            sync(dev)
            t1 = time.perf_counter()
            lo, hi = anchor_range(batch.prompt_lens, batch.lengths)
            anchors = anchors_from_uniform(lo, hi, torch.rand(len(lo), tc.anchors_per_seq, generator=g).to(dev))
            with _autocast(dev):
                loss, _ = block_loss(net, target.embed, target.lm_head, batch, anchors, tc,
                                     target.compute_logits if tc.tv_weight else None, compile_terms=tc.compile_loss)
            loss.backward()
            net.zero_grad(set_to_none=True)
            sync(dev)
            t2 = time.perf_counter()
            if i:  # the first step is untimed (kernels, allocator)
                fwd.append(t1 - t0)
                drafter.append(t2 - t1)
                toks.append(int(batch.lengths.sum()))
        f, d = sum(fwd) / len(fwd), sum(drafter) / len(drafter)
        rows.append(dict(kind=kind, target_forward_s=f, drafter_s=d, forward_share=f / (f + d),
                         tokens_per_step=sum(toks) / len(toks)))
    apart = sum(r["target_forward_s"] + r["drafter_s"] for r in rows)
    joint = max(r["target_forward_s"] for r in rows) + sum(r["drafter_s"] for r in rows)
    head = run_header(args.device, str(dtype), f"{args.seqs} sequences a step", f"mean of {args.steps} steps",
                      *(["compiled loss"] if args.compile_loss else []))
    md = [head, "", "| kind | target forward ms | drafter forward+backward ms | target forward share |",
          "|---|---|---|---|"]
    md += [f"| {r['kind']} | {1e3 * r['target_forward_s']:.0f} | {1e3 * r['drafter_s']:.0f} | "
           f"{100 * r['forward_share']:.0f} % |" for r in rows]
    tokens = rows[0]["tokens_per_step"]
    md += ["", f"Both kinds one after the other: {1e3 * apart:.0f} ms a step; side by side (one target forward): "
           f"{1e3 * joint:.0f} ms, {joint / apart:.2f}x; {tokens:,.0f} tokens a step, "
           f"{tokens / joint:,.0f} tokens/s side by side (optimizer steps not included)."]
    loops = []
    if args.loop_steps:
        for compiled in (False, True):
            loops.append(time_loop(target, data, args.seqs, dev, compiled, args.loop_steps))
        md += ["", f"The joint training loop (`train_block_drafters`, both kinds, AdamW included, {args.loop_steps} "
               "steps after 3 untimed ones; no validation):", "",
               "| loss | ms a step | tokens/s | untimed first 3 steps, s |", "|---|---|---|---|"]
        md += [f"| {'compiled (compile_loss)' if r['compile_loss'] else 'plain'} | {1e3 * r['step_s']:.1f} | "
               f"{r['tokens_per_s']:,.0f} | {r['warmup_s']:.1f} |" for r in loops]
    write_results(args.out, "train_split", "\n".join(md),
                  dict(header=head, rows=rows, apart_s=apart, joint_s=joint, loops=loops))
    if args.profile and args.out:
        profile_joint(target, data, args.seqs, dev, Path(args.out) / "profile.txt", compile_loss=args.compile_loss)


def _jobs(n: int, seqs: int, compile_loss: bool) -> list[TrainJob]:
    """Both shipped kinds as jobs of a plan of ``n`` steps of ``seqs`` sequences (no validation)."""
    return [TrainJob(BlockDrafterNet.load(Path("specdec/drafters/checkpoints") / f"smollm2-135m-{kind}"),
                     TrainConfig(steps=n, seqs_per_step=seqs, tv_weight=k["tv_weight"], val_every=0,
                                 confidence_weight=k["confidence_weight"], compile_loss=compile_loss), name=kind)
            for kind, k in KIND_SETTINGS.items()]


def time_loop(target, data, seqs: int, dev: torch.device, compile_loss: bool, steps: int) -> dict:
    """Wall time a step of :func:`train_block_drafters` itself (both kinds), after a 3-step run
    that compiles and warms up (its time reported apart)."""
    t0 = time.perf_counter()
    train_block_drafters(target, data, _jobs(3, seqs, compile_loss), progress=False)
    sync(dev)
    warm = time.perf_counter() - t0
    jobs = _jobs(steps, seqs, compile_loss)  # loading and moving the networks is not a step
    t0 = time.perf_counter()
    _, rec = train_block_drafters(target, data, jobs, progress=False)[0]
    sync(dev)
    step_s = (time.perf_counter() - t0) / steps
    return dict(compile_loss=compile_loss, step_s=step_s, warmup_s=warm,
                tokens_per_s=rec["tokens_seen"] / steps / step_s)


def profile_joint(target, data, seqs: int, dev: torch.device, path: Path, steps: int = 3,
                  compile_loss: bool = False) -> None:
    """``torch.profiler`` over ``steps`` steps of :func:`train_block_drafters` with both kinds (the
    training loop itself: one target forward, each kind's forward, backward and AdamW step), after
    an untimed run of 2 steps: where the GPU time goes, which host calls wait."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    train_block_drafters(target, data, _jobs(2, seqs, compile_loss), progress=False)  # kernels, allocator, shapes
    sync(dev)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    runs = _jobs(steps, seqs, compile_loss)
    t0 = time.perf_counter()
    with tprofile(activities=acts) as prof:
        train_block_drafters(target, data, runs, progress=False)
        sync(dev)
    wall = (time.perf_counter() - t0) / steps
    ev = prof.key_averages()
    key = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    path.write_text(f"# {steps} side-by-side training steps of {seqs} sequences, {1e3 * wall:.0f} ms a step under "
                    f"the profiler\n## by {key}\n{ev.table(sort_by=key, row_limit=30)}\n## by self CPU time\n"
                    f"{ev.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
    print(f"profile: {path}")


if __name__ == "__main__":
    main()
