"""Load test of ``specdec serve``: streamed chat requests over Spec-Bench first turns, per drafter.

On the GPU (CUDA, bf16), with Spec-Bench's ``data/spec_bench/question.jsonl`` (``bash
bench/device_gpu.sh serve`` on the device machine, which names the server's wheels to stage):

    python bench/serve.py --device cuda --dtype bfloat16 --target smollm2-135m \\
        --questions question.jsonl --drafters null,suffix,dflash --concurrency 1,8,32,64 --rates 2,8 \\
        --max-requests 80 --max-tokens 256 --max-num-seqs 64 --out bench/results/serve_gpu

CPU smoke run (about two minutes per drafter on two cores: many Spec-Bench prompts are long):

    python bench/serve.py --questions question.jsonl --drafters null,suffix --concurrency 1,2 --rates 2 \\
        --max-requests 8 --max-tokens 16 --out /tmp/serve_smoke

Peers: ``--drafters vllm,vllm-ngram`` runs vLLM's OpenAI server (without speculation, and with its
n-gram drafter at the same draft length) on the target's HF checkpoint under the same load; its
answers carry no accepted lengths or engine timers, so those cells stay empty.

For each drafter it starts one server as a child process (``python -m specdec.cli serve --target ...
--drafter ... --port ...``), waits for ``/health``, sends one untimed request, then runs each load:

  concurrency C   ``--max-requests`` requests, C clients each sending its next request when the
                  last one ended (closed loop);
  rate R          ``--max-requests`` requests arriving as a Poisson process of R requests/s (open
                  loop: arrivals do not wait for answers; seeded, the same arrivals per drafter),

and stops the server with SIGTERM. The questions' first turns are shuffled once (``--seed``) and each
load takes the next ``--max-requests`` of them (cycling only past the end of the file), so that a
drafter that learns from earlier answers (suffix) does not see a load's questions answered before;
every drafter gets the same questions per load. Each is a streamed ``/v1/chat/completions`` request
(temperature 0, ``stream_options.include_usage``). Per load it reports output tokens/s (all output tokens over the
wall time from the first request sent to the last answer ended), TTFT (time from sending to the first
chunk carrying a token) and time per output token (from that chunk to the last, over the tokens after
the first), p50 and p99, and the mean accepted length: generated tokens after the first over
generation steps, from each answer's ``usage`` (``completion_tokens``, ``mean_accepted_length``).
From the server's ``/metrics`` before and after each load it also reports where the server's time
went: its engine steps, their mean wall time as the driver times them (with the engine's own
timers' share in brackets), and the time between steps per step (the server's loop: admitting,
delivering, streaming; and idle time, where arrivals leave the server waiting), and the Triton
kernels the server built during the load (``specdec_triton_kernels_built``: a step that met a
first-time compile the warm-up had not run; 0 is the goal).
Writes ``--out/serve.md`` (the table, with the command, the machine and the date) and ``serve.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.errors import ConfigError, SpecDecError  # noqa: E402

MODEL = "bench"  # the served model name the requests use


# -- a server as a child process ------------------------------------------------
def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(cmd: list[str], port: int, start_timeout_s: float = 600.0, stop_timeout_s: float = 60.0):
    """Run a server command as a child process until the block ends; then stop it with SIGTERM.

    Args:
        cmd: the command; it must serve ``/health`` on ``127.0.0.1:port`` (200 once ready).
        port: its port.
        start_timeout_s: how long it may take to become ready.
        stop_timeout_s: how long it may take to exit after SIGTERM (then it is killed).

    Yields:
        The ``subprocess.Popen`` of the server (its output goes to a temporary log file).

    Raises:
        SpecDecError: it exited, or was not ready in time (the message ends with its log's tail).
    """
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})

        def tail() -> str:
            log.seek(0)
            return log.read()[-4000:]

        try:
            deadline = time.monotonic() + start_timeout_s
            while True:
                if proc.poll() is not None:
                    raise SpecDecError(f"the server exited with status {proc.returncode}:\n{tail()}")
                if time.monotonic() > deadline:
                    raise SpecDecError(f"the server was not ready within {start_timeout_s:.0f} s:\n{tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                time.sleep(0.25)
            yield proc
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(stop_timeout_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(10)


# -- one request ------------------------------------------------------------------
@dataclass(slots=True)
class Result:
    """What one streamed request measured (times in seconds from the load's start)."""

    sent: float
    first_token: float | None = None
    last_token: float | None = None
    ended: float | None = None
    output_tokens: int = 0
    mean_accepted_length: float = 0.0
    error: str | None = None


async def chat_stream(http: httpx.AsyncClient, url: str, question: str, max_tokens: int, t0: float) -> Result:
    """Send one streamed chat request and time its chunks (``t0``: the load's start, ``time.perf_counter``)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    r = Result(sent=time.perf_counter() - t0)
    try:
        async with http.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}"
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                read_chunk(r, json.loads(line[6:]), time.perf_counter() - t0)
    except httpx.HTTPError as e:
        r.error = f"{type(e).__name__}: {e}"
    r.ended = time.perf_counter() - t0
    return r


def read_chunk(r: Result, chunk: dict, now: float) -> None:
    """Record one streamed chunk in ``r``. A chunk brings tokens if it carries ``token_ids``
    (specdec) or, from a server that sends none (a peer such as vLLM), non-empty text; the usage
    chunk gives the output tokens, and with specdec the mean accepted length."""
    if "error" in chunk:
        r.error = chunk["error"]["message"]
        return
    choice = chunk["choices"][0] if chunk.get("choices") else {}
    if choice.get("token_ids") or (choice.get("delta") or {}).get("content") or choice.get("text"):
        r.first_token = now if r.first_token is None else r.first_token
        r.last_token = now
    if chunk.get("usage"):
        r.output_tokens = chunk["usage"]["completion_tokens"]
        r.mean_accepted_length = chunk["usage"].get("mean_accepted_length") or 0.0


# -- loads ------------------------------------------------------------------------
async def closed_loop(url: str, questions: list[str], concurrency: int, max_tokens: int) -> tuple[list[Result], float]:
    """``concurrency`` clients, each sending the next question when its last answer ended.

    Returns:
        The results in question order and the load's wall time.
    """
    todo = iter(enumerate(questions))
    results: list[Result | None] = [None] * len(questions)
    async with _client(concurrency) as http:
        t0 = time.perf_counter()

        async def worker():
            for i, q in todo:  # one shared iterator: each question is taken once
                results[i] = await chat_stream(http, url, q, max_tokens, t0)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - t0


async def poisson_load(url: str, questions: list[str], rate: float, max_tokens: int,
                       seed: int) -> tuple[list[Result], float]:
    """Requests arriving as a Poisson process of ``rate`` per second (exponential gaps, seeded).

    Returns:
        The results in question order and the load's wall time.
    """
    rng = random.Random(seed)
    arrivals, t = [], 0.0
    for _ in questions:
        arrivals.append(t)
        t += rng.expovariate(rate)
    async with _client(len(questions)) as http:
        t0 = time.perf_counter()

        async def one(q: str, at: float) -> Result:
            await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
            return await chat_stream(http, url, q, max_tokens, t0)

        results = await asyncio.gather(*(one(q, at) for q, at in zip(questions, arrivals)))
        return list(results), time.perf_counter() - t0


def _client(connections: int) -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=httpx.Timeout(600, connect=30),
                             limits=httpx.Limits(max_connections=connections + 4, max_keepalive_connections=connections + 4))


def percentile(values: list[float], q: float) -> float | None:
    """The ``q``-th percentile (nearest rank; ``None`` for no values)."""
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, max(0, math.ceil(q / 100 * len(v)) - 1))]


def summarize(results: list[Result], wall_s: float) -> dict:
    """A load's figures: requests, errors, output tokens/s, TTFT and TPOT p50/p99 (ms), mean accepted length."""
    ok = [r for r in results if r.error is None and r.first_token is not None]
    ttft = [(r.first_token - r.sent) * 1e3 for r in ok]
    tpot = [(r.last_token - r.first_token) * 1e3 / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    after_first = sum(r.output_tokens - 1 for r in ok if r.mean_accepted_length > 0)
    steps = sum((r.output_tokens - 1) / r.mean_accepted_length for r in ok if r.mean_accepted_length > 0)
    tokens = sum(r.output_tokens for r in ok)
    return {"requests": len(results), "errors": len(results) - len(ok), "output_tokens": tokens,
            "wall_s": round(wall_s, 3), "output_tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else 0.0,
            "ttft_ms_p50": _r(percentile(ttft, 50)), "ttft_ms_p99": _r(percentile(ttft, 99)),
            "tpot_ms_p50": _r(percentile(tpot, 50)), "tpot_ms_p99": _r(percentile(tpot, 99)),
            "mean_accepted_length": round(after_first / steps, 3) if steps else None,
            "first_error": next((r.error for r in results if r.error), None)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 2)


# -- the benchmark ----------------------------------------------------------------
def first_turns(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """``(category, first turn)`` of each question of a Spec-Bench ``question.jsonl``.

    Raises:
        ConfigError: the file is missing, or a line is not a JSON object with a non-empty ``turns`` list.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"--questions must be a Spec-Bench question.jsonl file, got {str(path)!r}")
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            q = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}:{n}: not a JSON line ({e})") from None
        if not isinstance(q, dict) or not isinstance(q.get("turns"), list) or not q["turns"] or not isinstance(q["turns"][0], str):
            raise ConfigError(f"{path}:{n}: a question needs a non-empty 'turns' list of strings")
        out.append((q.get("category", ""), q["turns"][0]))
        if limit is not None and len(out) >= limit:
            break
    return out


#: peer servers by name: vLLM without speculation, and with its n-gram (prompt lookup) drafter
VLLM_PEERS = {"vllm": None,
              "vllm-ngram": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_max": 4,
                             "prompt_lookup_min": 1}}


def serve_command(args, drafter: str, port: int) -> list[str]:
    """The server command of one drafter: ``specdec serve``, or for a name in :data:`VLLM_PEERS`
    vLLM's OpenAI server on ``--peer-model`` (the target's HF checkpoint) with the same model name,
    dtype, most running requests and draft length."""
    if drafter in VLLM_PEERS:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(peer_model(args)),
               "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--dtype", args.dtype,
               "--max-num-seqs", str(args.max_num_seqs)]
        spec = VLLM_PEERS[drafter]
        if spec is not None:
            cmd += ["--speculative-config", json.dumps({**spec, "num_speculative_tokens": args.max_draft_tokens})]
        return cmd
    name, *variants = drafter.split("+")  # null+chunk512: prompts fed 512 tokens a step; dflash+gate: draft_gate
    extra = []
    for v in variants:
        if v == "gate":
            extra.append("--draft-gate")
        elif v.startswith("chunk") and v[5:].isdigit():
            extra += ["--max-prefill-tokens", v[5:]]
        else:
            raise SystemExit(f"{drafter}: unknown variant '+{v}' ('+chunkN' with a number of tokens, e.g. "
                             f"{name}+chunk512, or '+gate')")
    return [sys.executable, "-m", "specdec.cli", "serve", "--target", args.target, "--drafter", name,
            "--port", str(port), "--device", args.device, "--dtype", args.dtype, "--served-model-name", MODEL,
            "--max-num-seqs", str(args.max_num_seqs), "--max-waiting", str(args.max_waiting),
            "--max-draft-tokens", str(args.max_draft_tokens), "--log-level", "warning", *extra]


def scrape(url: str) -> dict[str, float]:
    """The server's step counters from ``/metrics``: ``steps``, ``step_s`` (engine steps' wall time,
    as the driver times them), ``<phase>_s`` (the engine's own timers), ``kernels`` (Triton kernels
    built so far) and ``kernels:<function>`` (by the function that built them); empty for a server
    that exports none of them (a peer)."""
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name == "specdec_step_seconds_count":
            out["steps"] = float(value)
        elif name == "specdec_step_seconds_sum":
            out["step_s"] = float(value)
        elif name.startswith("specdec_step_phase_seconds_total{phase="):
            out[name.split('"')[1] + "_s"] = float(value)
        elif name == "specdec_triton_kernels_built":
            out["kernels"] = float(value)
        elif name.startswith("specdec_triton_kernels_built_by_function{function="):
            out["kernels:" + name.split('"')[1]] = float(value)
    return out


def step_figures(before: dict, after: dict, wall_s: float) -> dict:
    """Where a load's wall time went on the server: its engine steps, their mean (as the driver
    timed them), the engine's own phases per step, and the time between steps (the server's loop:
    admitting, delivering, streaming)."""
    steps = after.get("steps", 0) - before.get("steps", 0)
    built = int(after["kernels"] - before["kernels"]) if "kernels" in after and "kernels" in before else None
    by_function = {k.removeprefix("kernels:"): int(v - before.get(k, 0.0)) for k, v in after.items()
                   if k.startswith("kernels:") and v > before.get(k, 0.0)}
    if steps <= 0:
        return {"steps": 0, "step_ms": None, "engine_ms": None, "between_ms": None, "kernels_built": built,
                "kernels_by_function": by_function}
    step_s = after.get("step_s", 0) - before.get("step_s", 0)
    engine_s = sum(after[k] - before.get(k, 0.0) for k in after
                   if k.endswith("_s") and k != "step_s" and not k.startswith("kernels"))
    return {"steps": int(steps), "step_ms": _r(step_s / steps * 1e3), "engine_ms": _r(engine_s / steps * 1e3),
            "between_ms": _r(max(0.0, wall_s - step_s) / steps * 1e3), "kernels_built": built,
            "kernels_by_function": by_function}


def peer_model(args) -> Path:
    """The HF checkpoint a peer server loads: ``--peer-model``, else ``--target`` if it is a folder,
    else the folder specdec converted the named target into (``load_target`` makes it).

    Raises:
        ConfigError: none of these exists.
    """
    from specdec.target.loading import cache_dir

    for path in (args.peer_model, args.target, cache_dir() / args.target):
        if path is not None and (Path(path) / "config.json").is_file():
            return Path(path)
    raise ConfigError(f"a peer server needs the target as an HF checkpoint folder: pass --peer-model, or load "
                      f"{args.target!r} with specdec once (load_target converts it under {cache_dir()})")


def run_drafter(args, drafter: str, loads: list[tuple[str, float, list[str]]]) -> list[dict]:
    """Start ``drafter``'s server, run every load (kind, level, questions) against it, stop it; one row
    per load."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    rows = []
    with server_process(serve_command(args, drafter, port), port, args.start_timeout):
        warm = asyncio.run(closed_loop(url, ["Say hello."], 1, args.max_tokens))[0][0]  # untimed
        if warm.error:
            raise SpecDecError(f"the warm-up request to the {drafter} server failed: {warm.error}")
        start = scrape(url)
        if "kernels" in start:
            print(f"{drafter}: {int(start['kernels'])} Triton kernels built by start-up, warm-up and one request",
                  flush=True)
        for kind, level, questions in loads:
            before = scrape(url)
            if kind == "concurrency":
                results, wall = asyncio.run(closed_loop(url, questions, int(level), args.max_tokens))
            else:
                results, wall = asyncio.run(poisson_load(url, questions, level, args.max_tokens, args.seed))
            row = {"drafter": drafter, "load": f"{kind} {level:g}", **summarize(results, wall),
                   **step_figures(before, scrape(url), wall)}
            print(_row(row), flush=True)
            rows.append(row)
    return rows


HEAD = ("| drafter | load | requests | errors | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
        "TPOT p99 ms | mean accepted length | steps | ms / step (engine's timers) | ms between steps | "
        "Triton kernels built |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def _row(r: dict) -> str:
    cells = [r["drafter"], r["load"], r["requests"], r["errors"], r["output_tokens_per_s"], r["ttft_ms_p50"],
             r["ttft_ms_p99"], r["tpot_ms_p50"], r["tpot_ms_p99"], r["mean_accepted_length"], r.get("steps"),
             None if r.get("step_ms") is None else f"{r['step_ms']} ({r['engine_ms']})", r.get("between_ms"),
             r.get("kernels_built")]
    return "| " + " | ".join("-" if c is None else str(c) for c in cells) + " |"


def _levels(text: str, kind: type, flag: str) -> list:
    try:
        values = [kind(x) for x in text.split(",") if x.strip()] if text else []
    except ValueError:
        raise ConfigError(f"{flag} must be a comma-separated list of numbers, got {text!r}") from None
    if any(v <= 0 for v in values):
        raise ConfigError(f"{flag} values must be > 0, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark (see the module docstring); exit status 1 if a load had failed requests."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--questions", required=True, help="Spec-Bench question.jsonl (a 'turns' list per line)")
    p.add_argument("--target", default="smollm2-135m", help="model name or HF checkpoint dir (with a chat template)")
    p.add_argument("--drafters", default="null,suffix,dflash",
                   help="comma-separated drafter names; vllm and vllm-ngram run vLLM's server as a peer; "
                        "NAME+chunkN serves NAME with --max-prefill-tokens N (chunked prefill), NAME+gate with "
                        "--draft-gate (per batch size, the draft length measured fastest)")
    p.add_argument("--peer-model", default=None,
                   help="the HF checkpoint folder a peer server loads (default: the target's, see peer_model)")
    p.add_argument("--concurrency", default="1,8,32,64", help="closed-loop client counts ('' for none)")
    p.add_argument("--rates", default="2,8", help="Poisson arrival rates in requests/s ('' for none)")
    p.add_argument("--max-requests", type=int, default=80, help="requests per load")
    p.add_argument("--max-tokens", type=int, default=256, help="max_tokens of each request")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the server's most running requests")
    p.add_argument("--max-waiting", type=int, default=1024, help="the server's most waiting requests")
    p.add_argument("--max-draft-tokens", type=int, default=8, help="the server's k")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--seed", type=int, default=0, help="seed of the question order and the Poisson arrivals")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to be ready")
    p.add_argument("--out", default=None, help="folder for serve.md and serve.json")
    args = p.parse_args(argv)
    args.concurrency = _levels(args.concurrency, int, "--concurrency")
    args.rates = _levels(args.rates, float, "--rates")
    for flag in ("max_requests", "max_tokens", "max_num_seqs", "max_waiting"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    drafters = [d for d in args.drafters.split(",") if d]
    turns = first_turns(args.questions)
    if not turns:
        raise ConfigError(f"--questions {args.questions!r} holds no question")
    random.Random(args.seed).shuffle(turns)
    kinds = [("concurrency", c) for c in args.concurrency] + [("rate", r) for r in args.rates]
    n = args.max_requests
    loads = [(kind, level, [turns[(j * n + i) % len(turns)][1] for i in range(n)])
             for j, (kind, level) in enumerate(kinds)]
    from results_io import run_header, write_results  # bench/, the script's own folder (imports torch)

    header = run_header(args.device, args.dtype, f"target {args.target}", f"max_tokens {args.max_tokens}",
                        f"{args.max_requests} requests per load", f"max_num_seqs {args.max_num_seqs}")
    print(header + "\n\n" + HEAD, flush=True)
    rows = [row for d in drafters for row in run_drafter(args, d, loads)]
    categories = sorted({c for c, _ in turns[:len(kinds) * n]})
    md = "\n".join([header, "", f"Spec-Bench first turns ({', '.join(categories)}), shuffled, {n} distinct per "
                    "load where the file has enough; streamed chat requests, greedy; TTFT and TPOT in "
                    "milliseconds.", "", HEAD, *map(_row, rows)]
                   + [""] * any(r.get("kernels_by_function") for r in rows)
                   + [f"- {r['drafter']}, {r['load']}: Triton kernels built during the load, by function: "
                      + ", ".join(f"{k} {v}" for k, v in sorted(r["kernels_by_function"].items()))
                      for r in rows if r.get("kernels_by_function")])
    write_results(args.out, "serve", md, {"header": header, "args": vars(args), "rows": rows})
    return 1 if any(r["errors"] for r in rows) else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SpecDecError as e:
        print(f"serve.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(2)
