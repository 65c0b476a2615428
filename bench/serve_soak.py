"""Soak test of ``specdec serve``: many short requests against one server process, its memory sampled.

    python bench/serve_soak.py --out bench/results/serve_soak_cpu          # 1,000 requests, tiny model, CPU
    python bench/serve_soak.py --target smollm2-135m --max-tokens 64 --out /tmp/soak_smollm2
    python bench/serve_soak.py --global-budget-tokens none --max-growth-mb 1000   # unbounded, for contrast

The server is this script run as a child process (``--child``): the target (``tiny``: a random
2-layer Llama, vocab 512, built on the fly; or a name / checkpoint as ``specdec serve`` takes) with
the suffix drafter, whose global automaton is bounded by ``--global-budget-tokens``. The client sends
``--requests`` completion requests of random token-id prompts (4-16 tokens, seeded; half greedy,
half sampled with a per-request seed, all ``ignore_eos`` so each runs ``--max-tokens`` tokens) with
``--concurrency`` in flight, in rounds of ``--sample-every``. After each round (no request in flight)
it reads the server's RSS (``VmRSS`` of ``/proc/<pid>/status``) and its ``/metrics``: the automaton's
size (``specdec_drafter_index_tokens``), its rebuilds, the KV pages in use. While requests run it
polls ``/metrics`` every 20 ms for the automaton's largest size.

Checks (exit status 1 if one fails): RSS after the last round exceeds RSS after ``--warmup``
requests by more than ``--max-growth-mb``; the automaton ever held more than its budget; a KV page
is still in use after a round; a request failed. Writes ``--out/serve_soak.md`` and ``serve_soak.json``.

The defaults' bound: on the tiny model (CPU), the automaton reaches its budget by request ~130 and
RSS then grew 2.2 MiB from request 300 to 1,000; with ``--global-budget-tokens none`` the automaton
indexes ~0.66 KB per token and RSS grew 28.5 MiB over the same requests. 12 MiB is five times the
first and fails the second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve import free_port, server_process  # noqa: E402  (bench/, the script's own folder)
from specdec.errors import ConfigError, SpecDecError  # noqa: E402

MODEL = "soak"
TINY_VOCAB = 512


# -- the server (child process) ----------------------------------------------------
def tiny_target(path: Path, max_positions: int):
    """A random 2-layer Llama (vocab 512, EOS 511) saved under ``path`` and loaded as a target."""
    import torch
    import transformers

    from specdec.target import load_target

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=max_positions, eos_token_id=TINY_VOCAB - 1)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    return load_target(path)


def serve_child(args) -> int:
    """Serve ``args.target`` with the suffix drafter (global budget ``args.global_budget_tokens``) on
    ``args.port`` until SIGTERM."""
    import signal

    import torch
    import uvicorn

    from specdec import SpecEngine
    from specdec.drafters import make_drafter
    from specdec.serve import ServeConfig, create_app
    from specdec.target import load_target

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        if args.target == "tiny":
            target = tiny_target(Path(tmp), 512)
        else:
            target = load_target(args.target, dtype=getattr(torch, args.dtype), device=args.device)
        drafter = make_drafter("suffix", global_budget_tokens=args.global_budget_tokens)
        engine = SpecEngine(target, drafter, max_num_seqs=args.max_num_seqs)
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # uvicorn raises it again after its drain
        try:
            uvicorn.run(create_app(engine, ServeConfig(MODEL, max_waiting=1024, drain_timeout_s=5)),
                        host="127.0.0.1", port=args.port, log_level="warning", timeout_graceful_shutdown=5)
        finally:
            engine.close()
    return 0


# -- the client -----------------------------------------------------------------------
def rss_mb(pid: int) -> float:
    """Resident set size of process ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``).

    Raises:
        SpecDecError: the process is gone or its status has no ``VmRSS`` line.
    """
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError as e:
        raise SpecDecError(f"cannot read the memory of process {pid}: {e}") from None
    raise SpecDecError(f"/proc/{pid}/status has no VmRSS line")


def read_metrics(text: str) -> dict[str, float]:
    """The unlabelled samples of a Prometheus text exposition, by name."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()[:2]
            out[name] = float(value)
    return out


def request_body(i: int, vocab: int, max_tokens: int, seed: int) -> dict:
    """Request ``i``: a random token-id prompt of 4-16 tokens; even ones greedy, odd ones sampled."""
    rng = random.Random(seed * 1_000_003 + i)
    prompt = [rng.randrange(vocab - 1) for _ in range(rng.randrange(4, 17))]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}
    if i % 2:
        body.update(temperature=1.0, seed=i)
    return body


async def soak(url: str, pid: int, args) -> tuple[list[dict], int, list[str]]:
    """Send the requests in rounds; after each, sample RSS and ``/metrics``.

    Returns:
        One sample per round, the automaton's largest size seen, and the errors of failed requests.
    """
    samples, errors, biggest = [], [], 0
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=args.concurrency + 4)) as http:
        async def poll():
            nonlocal biggest
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    m = read_metrics((await http.get(url + "/metrics")).text)
                    biggest = max(biggest, int(m.get("specdec_drafter_index_tokens", 0)))
                await asyncio.sleep(0.02)

        async def one(i: int):
            try:
                r = await http.post(url + "/v1/completions",
                                    json=request_body(i, args.vocab, args.max_tokens, args.seed))
                if r.status_code != 200 or len(r.json()["choices"][0]["token_ids"]) != args.max_tokens:
                    errors.append(f"request {i}: HTTP {r.status_code} {r.text[:200]}")
            except httpx.HTTPError as e:
                errors.append(f"request {i}: {type(e).__name__}: {e}")

        poller = asyncio.create_task(poll())
        t0, sem = time.perf_counter(), asyncio.Semaphore(args.concurrency)

        async def bounded(i: int):
            async with sem:
                await one(i)

        try:
            for start in range(0, args.requests, args.sample_every):
                end = min(args.requests, start + args.sample_every)
                await asyncio.gather(*(bounded(i) for i in range(start, end)))
                await asyncio.sleep(0.2)  # the driver's last loop turn (pages freed, gauges set)
                m = read_metrics((await http.get(url + "/metrics")).text)
                biggest = max(biggest, int(m.get("specdec_drafter_index_tokens", 0)))
                samples.append({"requests": end, "elapsed_s": round(time.perf_counter() - t0, 1),
                                "rss_mb": round(rss_mb(pid), 1),
                                "index_tokens": int(m.get("specdec_drafter_index_tokens", 0)),
                                "index_rebuilds": int(m.get("specdec_drafter_index_rebuilds", 0)),
                                "kv_pages_in_use": int(m.get("specdec_kv_pages_in_use", -1))})
                print(_row(samples[-1]), flush=True)
        finally:
            poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await poller
    return samples, biggest, errors


HEAD = "| requests | time s | RSS MiB | automaton tokens | rebuilds | KV pages in use |\n|---|---|---|---|---|---|"


def _row(s: dict) -> str:
    return (f"| {s['requests']} | {s['elapsed_s']} | {s['rss_mb']} | {s['index_tokens']} | {s['index_rebuilds']} | "
            f"{s['kv_pages_in_use']} |")


def verdict(samples: list[dict], biggest: int, errors: list[str], args) -> tuple[dict, list[str]]:
    """The checks (module docstring): the figures and the list of failures (empty: it passed)."""
    warm = next((s for s in samples if s["requests"] >= args.warmup), samples[0])
    growth = samples[-1]["rss_mb"] - warm["rss_mb"]
    peak_growth = max(s["rss_mb"] for s in samples if s["requests"] >= warm["requests"]) - warm["rss_mb"]
    fails = []
    if growth > args.max_growth_mb:
        fails.append(f"RSS grew {growth:.1f} MiB from request {warm['requests']} to {samples[-1]['requests']}, "
                     f"more than --max-growth-mb {args.max_growth_mb}")
    budget = args.global_budget_tokens
    if budget is not None and biggest > budget:
        fails.append(f"the automaton held {biggest} tokens, more than its budget of {budget}")
    if any(s["kv_pages_in_use"] != 0 for s in samples):
        fails.append("KV pages were still in use after a round: " + str([s["kv_pages_in_use"] for s in samples]))
    if errors:
        fails.append(f"{len(errors)} requests failed; the first: {errors[0]}")
    figures = {"warmup_requests": warm["requests"], "rss_growth_mb": round(growth, 1),
               "rss_peak_growth_mb": round(peak_growth, 1), "max_index_tokens": biggest,
               "index_rebuilds": samples[-1]["index_rebuilds"], "failed_requests": len(errors)}
    return figures, fails


def child_command(args, port: int) -> list[str]:
    """This script as the server process."""
    budget = "none" if args.global_budget_tokens is None else str(args.global_budget_tokens)
    return [sys.executable, str(Path(__file__).resolve()), "--child", "--port", str(port), "--target", args.target,
            "--device", args.device, "--dtype", args.dtype, "--global-budget-tokens", budget,
            "--max-num-seqs", str(args.max_num_seqs), "--threads", str(args.threads)]


def _budget(text: str) -> int | None:
    if text.lower() == "none":
        return None
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'none', got {text!r}")
    return value


def parse_args(argv: list[str] | None):
    """The flags (see ``--help``).

    Raises:
        ConfigError: a flag's value is out of range (the message names it).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--sample-every", type=int, default=100, help="requests per round (one RSS sample each)")
    p.add_argument("--warmup", type=int, default=300, help="RSS growth is measured from this request on")
    p.add_argument("--max-growth-mb", type=float, default=12.0, help="most RSS growth after warm-up (MiB)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per request (ignore_eos)")
    p.add_argument("--global-budget-tokens", type=_budget, default=8192,
                   help="the suffix drafter's global automaton budget ('none': unbounded)")
    p.add_argument("--target", default="tiny", help="'tiny' (random, built on the fly), a model name or checkpoint")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--max-num-seqs", type=int, default=16, help="the server's most running requests")
    p.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    p.add_argument("--vocab", type=int, default=None, help="prompt token ids are below this (default: tiny's 512, "
                                                            "else 32000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="folder for serve_soak.md and serve_soak.json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for flag in ("requests", "concurrency", "sample_every", "max_tokens", "max_num_seqs", "threads"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.vocab is None:
        args.vocab = TINY_VOCAB if args.target == "tiny" else 32000
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the soak (module docstring); exit status 1 if a check failed."""
    args = parse_args(argv)
    if args.child:
        return serve_child(args)
    port = free_port()
    with server_process(child_command(args, port), port) as proc:
        rss_start = rss_mb(proc.pid)
        print(f"server pid {proc.pid}, RSS when ready {rss_start:.1f} MiB\n\n{HEAD}", flush=True)
        samples, biggest, errors = asyncio.run(soak(f"http://127.0.0.1:{port}", proc.pid, args))
    figures, fails = verdict(samples, biggest, errors, args)
    from results_io import run_header, write_results  # bench/, the script's own folder (imports torch)

    header = run_header(args.device, f"target {args.target}", f"{args.requests} requests of {args.max_tokens} tokens",
                        f"concurrency {args.concurrency}", f"global budget {args.global_budget_tokens} tokens",
                        f"max_num_seqs {args.max_num_seqs}")
    lines = [header, "", f"Server RSS when ready: {rss_start:.1f} MiB. After each round of {args.sample_every} "
             "requests (none in flight):", "", HEAD, *map(_row, samples), "",
             f"RSS growth from request {figures['warmup_requests']} to {samples[-1]['requests']}: "
             f"{figures['rss_growth_mb']} MiB (peak {figures['rss_peak_growth_mb']} MiB; bound {args.max_growth_mb}); "
             f"largest automaton seen: {biggest} tokens (budget {args.global_budget_tokens}); "
             f"{figures['index_rebuilds']} rebuilds; {len(errors)} failed requests.",
             "", "PASS" if not fails else "FAIL: " + "; ".join(fails)]
    write_results(args.out, "serve_soak", "\n".join(lines),
                  {"header": header, "args": vars(args), "rss_when_ready_mb": round(rss_start, 1), "samples": samples,
                   **figures, "failures": fails, "errors": errors[:20]})
    return 1 if fails else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecDecError as e:
        print(f"serve_soak.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
