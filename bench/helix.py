"""Helix context parallelism: MLA decode and verify attention time against context length.

Run once per context-parallel degree, one process per GPU (``cp = 1`` runs unsharded, the same
kernel over the whole context), then draw the plot from the runs' JSON::

    torchrun --standalone --nproc-per-node 1 bench/helix.py --device cuda --out OUT/helix
    torchrun --standalone --nproc-per-node 2 bench/helix.py --device cuda --out OUT/helix
    torchrun --standalone --nproc-per-node 4 bench/helix.py --device cuda --out OUT/helix
    python bench/helix.py --plot OUT/helix

Defaults: 96 query heads (Kimi K3's per-rank count), latent 512 + rope 64, bf16 cache, pages
of 64 tokens, contexts 32K to 1M, batch 1, 8 and 64, q_len 1 (decode) and 4 (verify: 1 + 3
drafts); configurations whose per-rank cache exceeds ``--max-cache-gb`` are skipped.

What one measurement is: one layer's attention for the whole batch, on every rank together
(each rank's time is taken with CUDA events; the slowest rank counts), split into

- ``partial``: this rank's attention over the pages it owns, with its log-sum-exp
  (``triton_mla.attend(..., return_lse=True)``; ``helix_ref``: the torch reference);
- ``combine``: the all-to-all of partials by head and the exact LSE combine
  (:func:`specdec.parallel.helix.exchange_heads`), then the all-gather of the heads that
  today's backends return (:func:`~specdec.parallel.helix.gather_heads`);
- ``step``: the backend's whole ``run`` (partial + combine), the figure that matters;

and reports ``combine_share = combine / step`` and attention tokens/s per layer
(``batch * q_len / step``). The first configuration's combined output is checked against the
torch reference over the whole context (rank 0) before anything is timed.

``--device cpu --backend helix_ref`` runs the same logic with gloo on the CPU (tests use it
with tiny shapes); absolute CPU times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout, like bench/e2e.py

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LATENT, ROPE = 512, 64


def parse_sizes(text: str) -> list[int]:
    """``"32K,128K,1M,96"`` -> ``[32768, 131072, 1048576, 96]``."""
    out = []
    for part in text.split(","):
        part = part.strip().upper()
        mult = {"K": 1 << 10, "M": 1 << 20}.get(part[-1:], 1)
        out.append(int(part[:-1] if mult > 1 else part) * mult)
    return out


def build_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--backend", default=None, choices=["triton_mla", "helix_ref"],
                   help="default: triton_mla on CUDA, helix_ref on the CPU")
    p.add_argument("--heads", type=int, default=96)
    p.add_argument("--latent", type=int, default=LATENT)
    p.add_argument("--rope", type=int, default=ROPE)
    p.add_argument("--contexts", default="32K,64K,128K,256K,512K,1M")
    p.add_argument("--batch-sizes", default="1,8,64")
    p.add_argument("--q-lens", default="1,4")
    p.add_argument("--page", type=int, default=64)
    p.add_argument("--kv", default="bf16", choices=["bf16", "fp8", "fp32"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-cache-gb", type=float, default=100.0, help="skip configurations whose per-rank cache is larger")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for helix_cp{N}.json / .md")
    p.add_argument("--plot", default=None, metavar="DIR", help="draw DIR/helix.png from DIR/helix_cp*.json and exit")
    args = p.parse_args(argv)
    if args.plot is None:
        args.contexts, args.batch_sizes, args.q_lens = (parse_sizes(args.contexts), parse_sizes(args.batch_sizes),
                                                        parse_sizes(args.q_lens))
        if args.backend is None:
            args.backend = "triton_mla" if args.device == "cuda" else "helix_ref"
        if min(args.contexts + args.batch_sizes + args.q_lens) < 1 or args.page < 1 or args.reps < 1:
            p.error("contexts, batch sizes, q_lens, --page and --reps must be >= 1")
    return args


class Timer:
    """Wall time of a callable on this rank: CUDA events on CUDA, perf_counter on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn, reps: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        if self.cuda:
            torch.cuda.synchronize()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(reps):
                fn()
            stop.record()
            stop.synchronize()
            return start.elapsed_time(stop) / 1e3 / reps
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps


def slowest(seconds: float, device: torch.device) -> float:
    """The largest of every rank's ``seconds`` (a collective: every rank calls it)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return seconds
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def cache_dtype(kv: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp32": torch.float32}[kv]


def setup(args, context: int, batch: int, q_len: int, rank: int, cp: int, device: torch.device):
    """This rank's cache, page tables, queries and backend plan for one configuration.

    Every request holds ``context`` tokens (its last ``q_len`` are the step's queries, already
    written); the rank holds only the pages it owns (:class:`HelixLayout`)."""
    from specdec.attention.backends.base import PhaseBatch
    from specdec.parallel.helix import HelixLayout, HelixShard

    layout = HelixLayout(cp, args.page)
    local = layout.local_length(context, rank)
    pages = -(-local // args.page)
    gen = torch.Generator(device="cpu").manual_seed(args.seed * 1000003 + rank)
    width = args.latent + args.rope
    cache = (torch.randn(batch * pages * args.page + 1, 1, width, generator=gen) * 0.5).to(device)
    cache = cache.to(cache_dtype(args.kv))
    tables = tuple(tuple(range(i * pages, (i + 1) * pages)) for i in range(batch))
    qgen = torch.Generator(device="cpu").manual_seed(args.seed)  # the same queries on every rank
    q = torch.randn(batch * q_len, args.heads, width, generator=qgen).to(device=device, dtype=torch.bfloat16 if
                                                                           device.type == "cuda" else torch.float32)
    shard = HelixShard(layout, rank, None) if cp > 1 else None
    phase = PhaseBatch((q_len,) * batch, (context,) * batch, tables, args.page, device, shard)
    return cache, q, phase


def make_backend(name: str):
    if name == "triton_mla":
        from specdec.attention.backends.triton_mla import TritonMLABackend

        return TritonMLABackend()
    from specdec.attention.backends.helix_ref import HelixRefBackend
    from specdec.attention.backends.torch_ref import TorchRefBackend

    return HelixRefBackend() if dist.is_initialized() and dist.get_world_size() > 1 else TorchRefBackend()


def partial_fn(backend, plan, q, cache, scale: float, latent: int):
    """This rank's partial attention with its LSE (fp32), as the backend's Helix path computes it."""
    if backend.name == "triton_mla":
        return lambda: backend.attend(plan, q, cache, scale, latent, return_lse=True, out_dtype=torch.float32)
    from specdec.parallel.helix import shard_attention

    return lambda: shard_attention(plan.plan, q, cache, scale, latent)


def reference(args, context: int, batch: int, q_len: int, q: torch.Tensor, device: torch.device) -> torch.Tensor:
    """The whole context's attention, every rank's pages gathered back (torch reference, rank-independent)."""
    from specdec.parallel.helix import HelixLayout, mla_attention_lse  # noqa: F401 (the layout the rows follow)

    cp = dist.get_world_size() if dist.is_initialized() else 1
    layout = HelixLayout(cp, args.page)
    width = args.latent + args.rope
    rows = torch.empty(batch, context, width)
    for r in range(cp):  # rebuild each rank's cache exactly as setup() drew it
        local = layout.local_length(context, r)
        pages = -(-local // args.page)
        gen = torch.Generator(device="cpu").manual_seed(args.seed * 1000003 + r)
        cache = (torch.randn(batch * pages * args.page + 1, 1, width, generator=gen) * 0.5).to(cache_dtype(args.kv))
        cache = cache.float()[:, 0]
        local_pos = torch.arange(local)
        gpos = (local_pos // args.page * cp + r) * args.page + local_pos % args.page  # HelixLayout.global_position
        for b in range(batch):
            rows[b, gpos] = cache[b * pages * args.page + local_pos]
    qq = q.float().cpu().view(batch, q_len, args.heads, width)
    q_pos = torch.arange(context - q_len, context).expand(batch, q_len)
    kv_pos = torch.arange(context).expand(batch, context)
    out, _ = mla_attention_lse(qq, rows, q_pos, kv_pos, width ** -0.5, args.latent)
    return out.reshape(batch * q_len, args.heads, args.latent)


def measure(args, context: int, batch: int, q_len: int, rank: int, cp: int, device: torch.device,
            check: bool) -> dict:
    from specdec.parallel.helix import exchange_heads, gather_heads

    cache, q, phase = setup(args, context, batch, q_len, rank, cp, device)
    backend = make_backend(args.backend)
    plan = backend.plan(phase)
    scale = (args.latent + args.rope) ** -0.5
    step = lambda: backend.run(plan, q, cache, None, scale, args.latent)  # noqa: E731
    result = {"cp": cp, "context": context, "batch": batch, "q_len": q_len, "heads": args.heads, "kv": args.kv,
              "page": args.page, "backend": backend.name}
    if check:
        got = step().float().cpu()
        want = reference(args, context, batch, q_len, q, device)
        err = float((got - want).abs().max())
        tol = 3e-2 if q.dtype == torch.bfloat16 or args.kv != "fp32" else 1e-4
        result["max_abs_err"] = err
        if not err <= tol:
            raise AssertionError(f"cp={cp} {backend.name}: combined output differs from the reference by {err} > {tol}")
    timer = Timer(device)
    result["step_s"] = slowest(timer(step, args.reps, args.warmup), device)
    if cp > 1:
        partial = partial_fn(backend, plan, q, cache, scale, args.latent)
        result["partial_s"] = slowest(timer(partial, args.reps, args.warmup), device)
        out, lse = partial()
        combine = lambda: gather_heads(exchange_heads(out, lse), None)  # noqa: E731
        result["combine_s"] = slowest(timer(combine, args.reps, args.warmup), device)
        result["combine_share"] = result["combine_s"] / result["step_s"]
    else:
        result["partial_s"], result["combine_s"], result["combine_share"] = result["step_s"], 0.0, 0.0
    result["tokens_per_s"] = batch * q_len / result["step_s"]
    result["cache_gb_per_rank"] = cache.numel() * cache.element_size() / 1e9
    return result


def table(rows: list[dict]) -> str:
    lines = ["| cp | context | batch | q_len | step (us) | partial (us) | combine (us) | combine share | tokens/s per layer |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['cp']} | {r['context']:,} | {r['batch']} | {r['q_len']} | skipped: {r['skipped']} | | | | |")
            continue
        lines.append(f"| {r['cp']} | {r['context']:,} | {r['batch']} | {r['q_len']} | {r['step_s'] * 1e6:,.1f} | "
                     f"{r['partial_s'] * 1e6:,.1f} | {r['combine_s'] * 1e6:,.1f} | {r['combine_share']:.2f} | "
                     f"{r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def plot(folder: Path) -> Path | None:
    """``folder/helix.png``: step time against context, a panel per q_len, a colour per cp, a line style per batch."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return None
    runs = sorted(folder.glob("helix_cp*.json"))
    if not runs:
        raise SystemExit(f"no helix_cp*.json in {folder}")
    rows = [r for f in runs for r in json.loads(f.read_text())["rows"] if "skipped" not in r]
    q_lens = sorted({r["q_len"] for r in rows})
    cps, batches = sorted({r["cp"] for r in rows}), sorted({r["batch"] for r in rows})
    styles = ["-", "--", ":", "-."]
    fig, axes = plt.subplots(1, len(q_lens), figsize=(6 * len(q_lens), 4.5), squeeze=False, sharey=True)
    for ax, q_len in zip(axes[0], q_lens):
        for ci, cp in enumerate(cps):
            for bi, batch in enumerate(batches):
                pts = sorted((r["context"], r["step_s"] * 1e6) for r in rows
                             if (r["q_len"], r["cp"], r["batch"]) == (q_len, cp, batch))
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=f"C{ci}", linestyle=styles[bi % len(styles)],
                            label=f"cp {cp}, batch {batch}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"q_len {q_len}" + (" (decode)" if q_len == 1 else " (verify)"))
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel("attention step, one layer (us)")
    fig.suptitle("Helix: MLA attention step time against context (colour: cp; line: batch)")
    fig.tight_layout()
    path = folder / "helix.png"
    fig.savefig(path, dpi=120)
    return path


def main(argv=None) -> int:
    args = build_args(argv)
    if args.plot is not None:
        print(plot(Path(args.plot)))
        return 0
    from specdec.parallel.runtime import init_process_group

    if "WORLD_SIZE" in os.environ:
        rank, cp = init_process_group(args.device)
    else:
        rank, cp = 0, 1
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    rows, first = [], True
    width_bytes = (args.latent + args.rope) * cache_dtype(args.kv).itemsize
    for context in args.contexts:
        for batch in args.batch_sizes:
            for q_len in args.q_lens:
                gb = batch * -(-context // (args.page * cp)) * args.page * width_bytes / 1e9
                if gb > args.max_cache_gb:
                    rows.append({"cp": cp, "context": context, "batch": batch, "q_len": q_len,
                                 "skipped": f"{gb:.0f} GB cache per rank > --max-cache-gb {args.max_cache_gb:g}"})
                    continue
                row = measure(args, context, batch, q_len, rank, cp, device, check=first)
                first = False
                rows.append(row)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                if rank == 0:
                    print(f"cp={cp} context={context} batch={batch} q_len={q_len}: {row['step_s'] * 1e6:.1f} us, "
                          f"combine share {row['combine_share']:.2f}", flush=True)
    if rank == 0:
        meta = {"command": " ".join(["bench/helix.py", *(argv if argv is not None else sys.argv[1:])]), "cp": cp,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}
        print(table(rows))
        if args.out:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / f"helix_cp{cp}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
            (out / f"helix_cp{cp}.md").write_text(f"`{meta['command']}` ({meta['device']}, torch {meta['torch']}, "
                                                  f"{meta['date']})\n\n{table(rows)}\n")
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
