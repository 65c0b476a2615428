"""Helix context-parallel MLA attention on CPU processes (gloo), checked against cp = 1.

    torchrun --nproc-per-node 2 examples/helix_cpu.py    # or 4

A random absorbed-MLA attention layer at real dimensions (96 heads, kv_lora_rank 512,
rope 64, the softmax scale of a DeepSeek-V3-shaped config) runs three verify steps
with rollback over four requests of mixed lengths. Each rank writes only the latent
rows it owns and attends over its shard; one all-to-all over heads and an LSE combine
give each rank its head slice. Rank 0 compares every step to single-rank attention
(``torch_ref`` over the unsharded cache) and the script exits 1 if any step differs
beyond fp32 rounding. This is attention only: the engine does not run Helix yet.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from specdec.attention.backends.base import PhaseBatch
from specdec.attention.backends.torch_ref import TorchRefBackend
from specdec.kvcache import KVCacheManager
from specdec.parallel import HelixKVManager, HelixLayout, gather_heads, helix_attention, plan_shard
from specdec.target.mla import MLAConfig, softmax_scale

HEADS, LATENT, ROPE, TPB, PAGES = 96, 512, 64, 64, 64
CONFIG = MLAConfig(vocab_size=1024, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                   num_attention_heads=HEADS, kv_lora_rank=LATENT, qk_rope_head_dim=ROPE, qk_nope_head_dim=128,
                   v_head_dim=128)


def main() -> int:
    dist.init_process_group("gloo")
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)  # the same data on every rank
    layout, scale, D = HelixLayout(cp, TPB), softmax_scale(CONFIG), LATENT + ROPE
    full, mine = KVCacheManager(PAGES, TPB), HelixKVManager(layout, rank, PAGES)
    full_cache, cache = torch.zeros(PAGES * TPB, 1, D), torch.zeros(PAGES * TPB, 1, D)
    ok = True

    def write(req: int, rows: torch.Tensor) -> None:
        start = full.length(req)
        full.append(req, len(rows))
        mine.append(req, len(rows))
        full_cache[full.slots(req, start, start + len(rows))] = rows[:, None]
        idx, slots = mine.owned_slots(req, start, start + len(rows))  # only the rows this rank owns
        cache[slots] = rows[idx][:, None]

    prompts = (1000, 37, 300, TPB * cp + 1)
    for req, n in enumerate(prompts):
        full.allocate(req, 0)
        mine.allocate(req, 0)
        write(req, torch.randn(n, D, generator=g))
    q_lens = (1, 1, 4, 8)  # decode rows and verify rows (1 + k drafts)
    for step in range(3):
        for req, q_len in enumerate(q_lens):
            write(req, torch.randn(q_len, D, generator=g))
        kv_lens = tuple(full.length(r) for r in range(len(q_lens)))
        q = torch.randn(sum(q_lens), HEADS, D, generator=g)  # [T, H, D] absorbed queries
        plan = plan_shard(q_lens, kv_lens, [mine.page_table(r) for r in range(len(q_lens))], layout, rank)
        out = gather_heads(helix_attention(plan, q, cache, scale, LATENT))  # [T, H, LATENT]
        if rank == 0:
            ref = TorchRefBackend()
            tables = tuple(tuple(full.page_table(r)) for r in range(len(q_lens)))
            ref_plan = ref.plan(PhaseBatch(q_lens, kv_lens, tables, TPB, torch.device("cpu")))
            want = ref.run(ref_plan, q, full_cache, None, scale, LATENT)
            diff = (out - want).abs().max().item()
            same = torch.allclose(out, want, rtol=1e-5, atol=1e-5)
            ok &= same
            print(f"step {step}: kv_lens {kv_lens}, cp={cp} vs cp=1 max |diff| {diff:.2e}: "
                  f"{'equal' if same else 'DIFFERENT'}")
        # Rollback: each request keeps a random number of its verify rows (at least one).
        for req, q_len in enumerate(q_lens):
            keep = kv_lens[req] - q_len + int(torch.randint(1, q_len + 1, (1,), generator=g))
            full.truncate(req, keep)
            mine.truncate(req, keep)
    verdict = torch.tensor([int(ok)])
    dist.broadcast(verdict, src=0)
    if rank == 0:
        held = [mine.local_length(r) for r in range(len(q_lens))]
        print(f"rank 0 holds {held} of {[full.length(r) for r in range(len(q_lens))]} tokens; "
              f"{'PASS' if verdict.item() else 'FAIL'}")
    dist.destroy_process_group()
    return 0 if verdict.item() else 1


if __name__ == "__main__":
    sys.exit(main())
