"""Helix context parallelism through the engine on CPU processes (gloo), checked against cp = 1.

    torchrun --nproc-per-node 2 examples/helix_cpu.py    # or 4
    torchrun --nproc-per-node 4 examples/helix_cpu.py --attention-tp 2   # cp = 2 x attention TP 2

A random-weight MLA target at real attention dimensions (96 heads, kv_lora_rank 512,
rope 64; two layers and a narrow hidden size to stay quick on a CPU) generates for eight
prompts with ``helix_cp = N / attention_tp`` (every rank holds the KV pages it owns and
attention merges the ranks' partials; with ``--attention-tp T`` each process computes 1 / T
of the heads) and with ``helix_cp = 1``, both with the suffix drafter, greedy in fp32.
Rank 0 prints whether the outputs are token-equal; the script exits 1 if not.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from specdec import SamplingParams, SpecEngine
from specdec.drafters import SuffixAutomatonDrafter
from specdec.parallel import init_process_group
from specdec.target.mla import MLATarget

PROMPTS = [[5, 6, 7, 8] * 6, [9], list(range(100, 117)), [3, 1, 4, 1, 5, 9, 2, 6] * 5, [42] * 33,
           list(range(300, 340)), [11, 12, 13] * 4, [77, 78]]


def generate(target, cp: int, tp: int = 1) -> tuple[list[tuple[int, ...]], float, dict]:
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    t0 = time.perf_counter()
    with SpecEngine(target, SuffixAutomatonDrafter(), helix_cp=cp, attention_tp=tp, max_num_seqs=4, num_pages=64,
                    tokens_per_block=16, max_draft_tokens=4) as engine:
        outs = engine.generate(PROMPTS, params)
        layout = engine.kv_layout
    return [o.token_ids for o in outs], time.perf_counter() - t0, layout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--attention-tp", type=int, default=1, help="attention tensor-parallel degree (divides the ranks)")
    tp = ap.parse_args().attention_tp
    rank, world = init_process_group("cpu")  # gloo, from the environment torchrun sets
    if tp < 1 or world % tp:
        print(f"--attention-tp must be >= 1 and divide the {world} ranks, got {tp}", file=sys.stderr)
        return 2
    cp = world // tp
    torch.set_num_threads(1)
    target = MLATarget.random(num_heads=96, num_layers=2, hidden_size=256, vocab_size=512, intermediate_size=512,
                              q_lora_rank=128, kv_lora_rank=512, qk_rope_head_dim=64, seed=0)  # the same on every rank
    helix, helix_s, layout = generate(target, cp, tp)
    single, single_s, _ = generate(target, 1)  # every rank alone, unsharded
    same = torch.tensor([int(helix == single)])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)  # every rank must agree
    if rank == 0:
        pool = layout["pools"][0]
        print(f"cp={cp}, attention_tp={tp}: {len(PROMPTS)} prompts, {sum(map(len, helix))} tokens in "
              f"{helix_s:.1f} s; cp=1: {single_s:.1f} s")
        print(f"rank 0 pool: {pool['num_pages']} pages of {pool['tokens_per_block']} tokens, sharded={pool['sharded']}")
        print(f"cp={cp} vs cp=1: {'token-equal' if same.item() else 'DIFFERENT'}")
    dist.destroy_process_group()
    return 0 if same.item() else 1


if __name__ == "__main__":
    sys.exit(main())
