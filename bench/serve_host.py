"""Host time `specdec serve` spends per engine step handing requests their new tokens.

For ``--requests`` streams at once, each receiving ``--tokens-per-step`` tokens a step (real
SmolLM2 outputs, HumanEval 100-163 greedy, ``bench/results/smollm2_fp32_humaneval_100-163.json``),
it times the driver's delivery (``EngineDriver._safe_text``: the text a stream may send now) and
the stream's chunk (its server-sent-event JSON) at output lengths up to
``--max-tokens``, with incremental decoding (the default) beside whole-output decoding (the
fallback, forced), in one run:

    python bench/serve_host.py --requests 8,64 --max-tokens 256 --out bench/results/serve_host

Reports microseconds per step (all requests), averaged over the whole output, and the ratio.
No model runs: the tokens are replayed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402

from specdec.serve.app import _sse  # noqa: E402
from specdec.serve.driver import EngineDriver, Handle  # noqa: E402
from specdec.serve.protocol import chunk  # noqa: E402

OUTPUTS = Path(__file__).resolve().parent / "results" / "smollm2_fp32_humaneval_100-163.json"


def replay(tokenizer, outputs: list[list[int]], per_step: int, whole: bool) -> tuple[float, float, int]:
    """Seconds in ``_safe_text`` and in building chunks, and the steps, for all ``outputs`` streamed
    together ``per_step`` tokens a step."""
    driver = SimpleNamespace(tokenizer=tokenizer)
    handles = [Handle(str(i), SimpleNamespace(params=SimpleNamespace(stop=()))) for i in range(len(outputs))]
    for h in handles:
        h.whole = whole
    deliver = send = 0.0
    steps = 0
    for at in range(0, max(map(len, outputs)), per_step):
        steps += 1
        for h, out in zip(handles, outputs):
            new = out[at : at + per_step]
            if not new:
                continue
            t0 = time.perf_counter()
            h.token_ids += new
            text = EngineDriver._safe_text(driver, h)
            delta, h.sent = text[len(h.sent):], text
            t1 = time.perf_counter()
            _sse(chunk("chat", h.req_id, "m", delta, new, None))
            deliver, send = deliver + t1 - t0, send + time.perf_counter() - t1
    return deliver, send, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", default="8,64", help="streams at once (comma-separated)")
    ap.add_argument("--max-tokens", type=int, default=256, help="output tokens per stream")
    ap.add_argument("--tokens-per-step", type=int, default=1, help="new tokens a stream gets a step (tau)")
    ap.add_argument("--out", default=None, help="folder for serve_host.md / .json")
    args = ap.parse_args()

    from specdec.target import load_target

    tokenizer = load_target("smollm2-135m").tokenizer
    outputs = [o[: args.max_tokens] for _, o in json.loads(OUTPUTS.read_text())]
    rows, data = [], []
    for n in (int(x) for x in args.requests.split(",")):
        batch = (outputs * (n // len(outputs) + 1))[:n]
        got = {}
        for whole in (False, True):
            replay(tokenizer, batch[:2], args.tokens_per_step, whole)  # warm up
            deliver, send, steps = replay(tokenizer, batch, args.tokens_per_step, whole)
            got[whole] = (deliver / steps * 1e6, send / steps * 1e6)
        inc, full = got[False], got[True]
        rows.append(f"| {n} | {inc[0]:,.0f} | {full[0]:,.0f} | {full[0] / inc[0]:.1f}x | {inc[1]:,.0f} |")
        data.append({"requests": n, "incremental_us": inc[0], "whole_us": full[0], "chunk_us": inc[1]})
    md = "\n".join([run_header("cpu", f"{args.max_tokens} tokens a stream, {args.tokens_per_step} a step"), "",
                    "| streams | delivery µs / step, incremental | delivery µs / step, whole decode | whole / incremental "
                    "| chunk JSON µs / step |",
                    "|---|---|---|---|---|", *rows])
    write_results(args.out, "serve_host", md, data)


if __name__ == "__main__":
    main()
