"""Block drafter ``propose`` cost: the old eager path against the new one (and CUDA graphs).

    python bench/drafter_profile.py --device cuda --out OUT/drafter          # H200, bf16 (< 8 min)
    python bench/drafter_profile.py --device cpu --dtype float32 --quick     # the script's logic, < 1 min

Target: a SmolLM2-135M-shaped Llama with random weights (hidden 576, 30 layers,
9 heads, 3 KV heads, head_dim 64, intermediate 1536, vocab 49152), written with
``transformers`` into a temporary directory and loaded by ``load_target`` (no
network, no real weights needed). Drafters: the shipped ``smollm2-135m-dflash``
and ``smollm2-135m-dspark`` checkpoints, bound to it.

For each drafter and batch size N (1, 8, 32): N requests with ~400-token
contexts (random target hidden states, written by ``on_contexts`` in
interleaved chunks so page tables are scattered), then ``--calls`` engine-like
steps after ``--warmup`` untimed ones. A step grows every context by 1-3
accepted positions (``on_contexts``, timed apart), then runs every path on the
same state:

- ``old``: the pre-change ``propose`` (a frozen copy below: per-request gather
  index, RoPE factors recomputed per call and layer, the old layer loop). The
  context grew since the last step, so its shapes are new, as in the engine;
- ``old-again`` (cuda): the same call on the same shapes once more: the
  difference to ``old`` is what per-shape set-up (attention plans) costs;
- ``eager``: ``BlockDrafter.propose`` with ``cuda_graphs=False`` (on cuda its
  shapes padded into buckets);
- ``graph``: ``BlockDrafter.propose`` with CUDA graphs (cuda only);
- ``compiled`` / ``graph+compiled``: the same with ``torch_compile=True`` (the pass
  compiled by inductor; its compiles fall in the warm-up calls).

``--engine`` (default on cuda) adds whole engine runs: ``SpecEngine`` over
the random target with each drafter, 32 prompts of ~400 random tokens, 64 new
tokens, greedy; timed after an untimed run over prompts of other lengths (so
exact shapes do not simply repeat, as in serving), with the old ``propose``
(patched onto the drafter instance) and the new one: ms per step spent in the
target forward and in the drafter (propose + on_contexts), as the engine counts.

Each call is timed with ``torch.cuda.synchronize`` around it; the table shows
medians (ms), the speed-up against ``old`` and how many calls' drafts equal
``old``'s. ``--profile`` adds a ``torch.profiler`` table of 10 calls per path at
the largest N (``profile.txt``). Writes ``drafter_profile.md``
and ``.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(1, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' helpers, as pytest sees them

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)
from specdec.drafters.base import Draft  # noqa: E402
from specdec.drafters.dflash import BlockDrafter  # noqa: E402
from specdec.kvcache import KVCacheManager, KVPool  # noqa: E402
from specdec.kvcache.draft_kv import DraftKV  # noqa: E402
from specdec.target import load_target  # noqa: E402
from tests.test_block_propose import reference_propose  # noqa: E402

SMOLLM2 = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
               rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def build_target(device: str, dtype: torch.dtype):
    """A SmolLM2-shaped random-weight Llama, saved and loaded like a real checkpoint."""
    import transformers

    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMOLLM2)).save_pretrained(tmp)
        return load_target(tmp, dtype=dtype, device=device)


def old_propose(d: BlockDrafter, req_ids, max_tokens: int) -> list[Draft]:
    """``BlockDrafter.propose`` before this change (the baseline): the frozen copy the tests check
    the new path against (``tests/test_block_propose.py``)."""
    return [Draft(t) for t in reference_propose(d, req_ids, max_tokens)[0]]


def load_drafter(name: str, **kwargs):
    """A shipped drafter by name; ``NAME+unfolded`` runs its attention one query head at a time
    (``BlockDrafterNet.fold_queries = False``), to time against the folded default in one run."""
    base, *flags = name.split("+")
    unknown = set(flags) - {"unfolded"}
    if unknown:
        raise SystemExit(f"unknown drafter flag(s) {sorted(unknown)} in {name!r} (known: unfolded)")
    d = BlockDrafter.from_pretrained(base, **kwargs)
    if "unfolded" in flags:
        d.net.fold_queries = False
    return d


class Bench:
    """One drafter bound to the target over its own pool, with N requests' contexts."""

    def __init__(self, name: str, target, n: int, ctx: int, tpb: int, seed: int):
        self.d = load_drafter(name, device_drafts=False)  # drafts read back: compared between paths
        self.target, self.rng = target, random.Random(seed)
        c = self.d.config
        self.width = len(c.target_layer_ids) * target.hidden_size
        pages = n * (-(-(ctx + 400) // tpb) + 2) + 8
        pool = KVPool(self.d.kv_layer_specs(), pages, tpb, device=target.device)
        self.d.bind(target, DraftKV(pool, range(c.num_layers), KVCacheManager(pages, tpb), shared=False))
        self.reqs = [f"r{i}" for i in range(n)]
        lens = [max(1, ctx + self.rng.randint(-ctx // 8, ctx // 8)) for _ in self.reqs]
        for r, length in zip(self.reqs, lens):
            self.d.start_request(r, [self.rng.randrange(1, c.vocab_size) for _ in range(length + 1)])
        done = [0] * n
        for part in range(1, 4):  # interleaved chunks: scattered page tables
            spans, row = [], 0
            for i, (r, length) in enumerate(zip(self.reqs, lens)):
                stop = length * part // 3
                spans.append((r, done[i], row, stop - done[i]))
                row += stop - done[i]
                done[i] = stop
            self._write(spans, row)

    def _write(self, spans, rows: int) -> None:
        self.d.on_contexts(spans, self._hidden(rows))

    def _hidden(self, rows: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.rng.randrange(1 << 30))
        return torch.randn(rows, self.width, generator=g).to(self.target.device, self.target.dtype)

    def grow(self) -> float:
        """Every request accepts 1-3 positions (like a verify step); returns the on_contexts seconds."""
        spans, row = [], 0
        for r in self.reqs:
            k = self.rng.randint(1, 3)
            self.d.on_accepted(r, [self.rng.randrange(1, self.d.vocab_size) for _ in range(k)])
            spans.append((r, self.d._ctx_len[r], row, k))
            row += k
        hidden = self._hidden(row)
        sync(self.target.device)
        t0 = time.perf_counter()
        self.d.on_contexts(spans, hidden)
        sync(self.target.device)
        return time.perf_counter() - t0


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def paths_for(b: Bench) -> dict:
    """The paths timed on every step's state, in this order."""
    d, cuda = b.d, b.target.device.type == "cuda"
    paths = {"old": lambda r, k: old_propose(d, r, k)}
    if cuda:  # the same call on the same shapes again: what per-shape set-up (attention plans) costs "old"
        paths["old-again"] = paths["old"]
    if not hasattr(d, "cuda_graphs"):  # an unchanged drafter: propose is the old path
        paths["eager"] = d.propose
        return paths

    def run(graphs: bool, compiled: bool = False):
        def f(r, k):
            d.cuda_graphs, d.torch_compile = graphs, compiled
            return d.propose(r, k)
        return f

    paths["eager"] = run(False)
    paths["compiled"] = run(False, True)
    if cuda:
        paths["graph"] = run(True)
        paths["graph+compiled"] = run(True, True)
    return paths


def measure(b: Bench, calls: int, warmup: int) -> dict:
    """Per path: median / p10 / p90 ms per propose call, and calls whose drafts equal ``old``'s."""
    paths, dev = paths_for(b), b.target.device
    times = {p: [] for p in paths}
    equal = {p: 0 for p in paths}
    same_as_eager = {p: 0 for p in paths}
    grow = []
    k = b.d.config.draft_width
    for step in range(warmup + calls):
        g = b.grow()
        out = {}
        for p, fn in paths.items():
            sync(dev)
            t0 = time.perf_counter()
            out[p] = fn(b.reqs, k)
            sync(dev)
            if step >= warmup:
                times[p].append(time.perf_counter() - t0)
        if step >= warmup:
            grow.append(g)
            for p in paths:
                equal[p] += out[p] == out["old"]
                same_as_eager[p] += [x.token_ids for x in out[p]] == [x.token_ids for x in out["eager"]]
    res = {p: dict(median_ms=1e3 * statistics.median(t), p10_ms=1e3 * _q(t, 0.1), p90_ms=1e3 * _q(t, 0.9),
                   equal_to_old=equal[p], tokens_equal_to_eager=same_as_eager[p], calls=len(t))
           for p, t in times.items()}
    res["on_contexts_ms"] = 1e3 * statistics.median(grow)
    res["ctx_len_mean"] = statistics.mean(b.d._ctx_len[r] for r in b.reqs)
    stats = dict(getattr(b.d, "stats", {}))
    res["stats"] = {k: dict(v) if isinstance(v, dict) else v for k, v in stats.items()}
    return res


def _q(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def profile(b: Bench, out: Path, tag: str) -> None:
    """``torch.profiler`` tables of 10 calls per path on one state, appended to ``profile.txt``."""
    from torch.profiler import ProfilerActivity, profile as tprofile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if b.target.device.type == "cuda" else [])
    k = b.d.config.draft_width
    for p, fn in paths_for(b).items():
        if p == "old-again":
            continue
        for _ in range(3):
            fn(b.reqs, k)
        sync(b.target.device)
        with tprofile(activities=acts) as prof:
            for _ in range(10):
                fn(b.reqs, k)
            sync(b.target.device)
        ev = prof.key_averages()
        key = "self_cuda_time_total" if len(acts) > 1 else "self_cpu_time_total"
        text = (f"# {tag} path={p}: 10 calls on one state (same shapes)\n## by self CPU time\n"
                + ev.table(sort_by="self_cpu_time_total", row_limit=25)
                + f"\n## by {key}\n" + ev.table(sort_by=key, row_limit=25) + "\n\n")
        with open(out / "profile.txt", "a") as f:
            f.write(text)


def engine_runs(target, name: str, n: int, ctx: int, new_tokens: int,
                paths=("old", "new")) -> list[dict]:
    """Engine steps with the old and the new propose: ms / step in forward and drafter, as the engine counts."""
    from specdec import SamplingParams, SpecEngine

    def prompts(seed: int) -> list[list[int]]:
        rng = random.Random(seed)
        return [[rng.randrange(1, target.vocab_size) for _ in range(ctx + rng.randint(-ctx // 8, ctx // 8))]
                for _ in range(n)]

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    rows, outs = [], {}
    for path in paths:
        d = load_drafter(name, cuda_graphs=path != "new-eager", torch_compile=path == "new+compiled",
                                         device_drafts=False)
        if path == "old":
            d.propose = lambda r, k, d=d: old_propose(d, r, k)
        pages = n * (-(-(ctx + ctx // 8 + new_tokens + 16) // 16) + 1)
        engine = SpecEngine(target, d, max_num_seqs=n, max_draft_tokens=d.config.draft_width, num_pages=pages,
                            draft_gate=False)  # every step proposes: the propose is what is timed
        engine.generate(prompts(1), params)  # untimed, other lengths: kernels, graph captures
        before = dict(engine.timings)
        sync(target.device)
        t0 = time.perf_counter()
        res = engine.generate(prompts(0), params)
        sync(target.device)
        wall = time.perf_counter() - t0
        t = {k: engine.timings[k] - before[k] for k in before}
        outs[path] = [o.token_ids for o in res]
        rows.append(dict(drafter=name, batch=n, path=path, steps=t["steps"], wall_s=wall,
                         tokens_per_s=sum(len(o) for o in outs[path]) / wall,
                         forward_ms=1e3 * t["forward_s"] / t["steps"], draft_ms=1e3 * t["draft_s"] / t["steps"],
                         mean_accepted=sum(sum(o.stats.accepted_lengths) for o in res)
                         / max(1, sum(len(o.stats.accepted_lengths) for o in res)),
                         drafter_stats={k: dict(v) if isinstance(v, dict) else v for k, v in
                                        getattr(d, "stats", {}).items()}))
    if "old" in outs:
        for r in rows[1:]:
            r["outputs_equal_old"] = sum(a == b for a, b in zip(outs["old"], outs[r["path"]]))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--out", default="out/drafter_profile")
    ap.add_argument("--drafters", default="smollm2-135m-dflash,smollm2-135m-dspark",
                    help="shipped drafters; NAME+unfolded: attention one query head at a time (fold_queries=False)")
    ap.add_argument("--batch-sizes", default=None, help="default 1,8,32 (--quick: 1,4)")
    ap.add_argument("--ctx", type=int, default=400, help="mean context tokens per request")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="torch.profiler tables at the largest batch size")
    ap.add_argument("--quick", action="store_true", help="CPU smoke run: batch 1,4, 3 calls, ctx 64")
    ap.add_argument("--engine", action=argparse.BooleanOptionalAction, default=None,
                    help="whole engine runs, old vs new propose (default: on for cuda)")
    ap.add_argument("--engine-batch", type=int, default=32)
    ap.add_argument("--engine-paths", default="old,new-eager,new,new+compiled",
                    help="old, new (graphs), new-eager (cuda_graphs=False), new+compiled (graphs, torch_compile=True)")
    ap.add_argument("--engine-new-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.quick:
        args.calls, args.warmup, args.ctx = 3, 1, 64
    args.batch_sizes = args.batch_sizes or ("1,4" if args.quick else "1,8,32")
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile.txt").unlink(missing_ok=True)
    t0 = time.perf_counter()
    target = build_target(args.device, dtype)
    print(f"target built in {time.perf_counter() - t0:.1f}s", flush=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")]
    results = []
    for name in args.drafters.split(","):
        for n in sizes:
            b = Bench(name, target, n, args.ctx, args.tokens_per_block, seed=n)
            r = measure(b, args.calls, args.warmup)
            results.append(dict(drafter=name, batch=n, **r))
            print(json.dumps(results[-1]), flush=True)
            if args.profile and n == max(sizes):
                profile(b, out, f"{name}_b{n}")
    head = run_header(args.device, str(dtype), f"ctx ~{args.ctx}", f"page {args.tokens_per_block}",
                      f"median of {args.calls} calls after {args.warmup} warm-up")
    md = [head, "", "| drafter | N | mean ctx | path | ms / propose (median) | p10 / p90 | vs old | drafts == old "
          "| tokens == eager | on_contexts ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        for p in ("old", "old-again", "eager", "compiled", "graph", "graph+compiled"):
            if p in r:
                x = r[p]
                md.append(f"| {r['drafter']} | {r['batch']} | {r['ctx_len_mean']:.0f} | {p} | {x['median_ms']:.3f} | "
                          f"{x['p10_ms']:.3f} / {x['p90_ms']:.3f} | {r['old']['median_ms'] / x['median_ms']:.1f}x | "
                          f"{x['equal_to_old']}/{x['calls']} | {x['tokens_equal_to_eager']}/{x['calls']} | "
                          f"{r['on_contexts_ms']:.3f} |")
    md += ["", "DSpark's drafts differ from `old` by design: the old path has no Markov head."]
    engine = []
    if args.engine if args.engine is not None else args.device.startswith("cuda"):
        for name in args.drafters.split(","):
            paths = args.engine_paths.split(",")
            engine += engine_runs(target, name, args.engine_batch, args.ctx, args.engine_new_tokens, paths)
            print(json.dumps(engine[-len(paths):]), flush=True)
        md += ["", f"Engine: {args.engine_batch} prompts of ~{args.ctx} random tokens, {args.engine_new_tokens} new "
               "tokens, greedy, timed after an untimed run over other prompts; ms / step as `SpecEngine.timings` counts them (drafter = propose "
               "+ on_contexts).", "",
               "| drafter | propose | steps | forward ms / step | drafter ms / step | tokens/s | mean accepted "
               "| outputs equal |", "|---|---|---|---|---|---|---|---|"]
        for r in engine:
            md.append(f"| {r['drafter']} | {r['path']} | {r['steps']} | {r['forward_ms']:.3f} | {r['draft_ms']:.3f} | "
                      f"{r['tokens_per_s']:.0f} | {r['mean_accepted']:.2f} | {r.get('outputs_equal_old', '-')} |")
    write_results(out, "drafter_profile", "\n".join(md), dict(header=head, results=results, engine=engine))
    print(f"done in {time.perf_counter() - t0:.1f}s; wrote {out}/drafter_profile.md/.json")


if __name__ == "__main__":
    main()
