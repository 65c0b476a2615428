"""The host side of a block drafter's context hooks, step by step: what ``on_contexts`` and the
propose's packing cost the host, and how often the staged context positions are written eagerly.

    python bench/context_host.py --batch 32 --steps 300 --out DIR

The shipped DFlash drafter bound (on the CPU) to a target of SmolLM2-135M's sizes with random
embedding and LM head, its KV layers in the target's page pool (as in the engine), ``--batch``
requests with ``--prompt`` tokens of context each. Two regimes, in turn:

- **plain**: every step accepts one token of every request and nothing is proposed (the steady
  state of a draft gate that stopped drafting): ``on_contexts`` alone;
- **drafting**: every step proposes for every request, then accepts 1-9 tokens of each.

Per regime: host microseconds a step in ``on_contexts`` without its eager writes, the eager writes
a step (and positions a write), and in the drafting regime the propose's packing (``_pack``) a
call. The eager writes' own time is left out: on the CPU it is the network's compute, on a GPU
a few kernel launches. Writes ``context_host.md`` and ``.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results_io import run_header, write_results  # noqa: E402

from specdec.drafters.dflash import DFlashDrafter  # noqa: E402
from specdec.kvcache.draft_kv import DraftKV  # noqa: E402
from specdec.kvcache.manager import KVCacheManager  # noqa: E402
from specdec.kvcache.pool import KVPool  # noqa: E402


def bound_drafter(batch: int, prompt: int, steps: int, tpb: int = 16):
    """The shipped DFlash drafter on a SmolLM2-135M-sized fake target, its layers in a shared pool."""
    d = DFlashDrafter.from_pretrained("smollm2-135m-dflash")
    c = d.config
    g = torch.Generator().manual_seed(0)
    target = SimpleNamespace(hidden_size=c.target_hidden_size, vocab_size=c.vocab_size, num_layers=30,
                             max_context=2048, device=torch.device("cpu"), dtype=torch.float32,
                             embed=torch.randn(c.vocab_size, c.target_hidden_size, generator=g) * 0.02,
                             lm_head=torch.randn(c.vocab_size, c.target_hidden_size, generator=g) * 0.02)
    pages = batch * (-(-(prompt + 10 * steps + 16) // tpb)) + 8
    pool = KVPool(d.kv_layer_specs(), pages + 1, tpb)
    manager = KVCacheManager(pages, tpb)
    d.bind(target, DraftKV(pool, range(c.num_layers), manager, shared=True, scratch_slot=pages * tpb))
    return d, manager


class _Writes:
    """Counts the drafter's eager writes and their time (left out of the host figures)."""

    def __init__(self, d):
        self.n, self.positions, self.seconds = 0, 0, 0.0
        real = d._write

        def counted(hidden, runs):
            t0 = time.perf_counter()
            real(hidden, runs)
            self.seconds += time.perf_counter() - t0
            self.n += 1
            self.positions += sum(len(r[1]) for r in runs)

        d._write = counted


def run(batch: int, prompt: int, steps: int, seed: int = 0) -> dict:
    d, manager = bound_drafter(batch, prompt, steps)
    rng = random.Random(seed)
    feats = len(d.target_layer_ids) * d.config.target_hidden_size
    reqs = [f"r{i}" for i in range(batch)]
    for r in reqs:
        d.start_request(r, [rng.randrange(d.config.vocab_size) for _ in range(prompt)])
        manager.allocate(r, prompt)
    d.on_contexts([(r, 0, i * prompt, prompt) for i, r in enumerate(reqs)], torch.randn(batch * prompt, feats))
    writes = _Writes(d)
    pack_s = []
    real_pack = d._pack

    def timed_pack(*args):
        t0 = time.perf_counter()
        out = real_pack(*args)
        pack_s.append(time.perf_counter() - t0)
        return out

    d._pack = timed_pack
    out = {}
    for regime in ("plain", "drafting"):
        host, n_writes, n_pos = [], writes.n, writes.positions
        for _ in range(steps):
            if regime == "drafting":
                d.propose(reqs, d.config.block_size)
            spans, row = [], 0
            for r in reqs:
                m = 1 if regime == "plain" else rng.randint(1, d.config.block_size + 1)
                start = d._ctx_len[r]
                manager.append(r, m)
                d.on_accepted(r, [rng.randrange(d.config.vocab_size) for _ in range(m)])
                spans.append((r, start, row, m))
                row += m
            hidden = torch.randn(row, feats)
            before = writes.seconds
            t0 = time.perf_counter()
            d.on_contexts(spans, hidden)
            host.append(time.perf_counter() - t0 - (writes.seconds - before))
        w = writes.n - n_writes
        out[regime] = {"on_contexts_host_us": statistics.median(host) * 1e6,
                       "on_contexts_host_mean_us": statistics.fmean(host) * 1e6,
                       "eager_writes_per_step": w / steps,
                       "positions_per_write": (writes.positions - n_pos) / w if w else 0.0,
                       "pack_us": statistics.median(pack_s) * 1e6 if regime == "drafting" and pack_s else None}
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=200, help="context tokens of each request before the steps")
    ap.add_argument("--steps", type=int, default=300, help="steps of each regime")
    ap.add_argument("--out", default="bench/results/context_host")
    args = ap.parse_args(argv)
    with torch.no_grad():
        res = run(args.batch, args.prompt, args.steps)
    rows = ["| regime | on_contexts host µs a step (median / mean) | eager writes a step | positions a write | _pack µs a propose |",
            "|---|---|---|---|---|"]
    for regime, r in res.items():
        pack = "-" if r["pack_us"] is None else f"{r['pack_us']:.0f}"
        rows.append(f"| {regime} | {r['on_contexts_host_us']:.0f} / {r['on_contexts_host_mean_us']:.0f} | "
                    f"{r['eager_writes_per_step']:.3f} | {r['positions_per_write']:.1f} | {pack} |")
    table = run_header("cpu", f"{args.batch} requests of {args.prompt} context tokens, {args.steps} steps a regime") \
        + "\n\n" + "\n".join(rows)
    write_results(args.out, "context_host", table, {"args": vars(args), "results": res})


if __name__ == "__main__":
    main()
