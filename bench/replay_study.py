"""Suffix-drafter settings against the target's real greedy outputs, without the target (replay).

    python bench/replay_study.py --generate 100-163 --save out/he_heldout.json    # SmolLM2 fp32, CPU, ~4 min
    python bench/replay_study.py --outputs out/he_heldout.json [--corpus out/he_dev.json] --out out/replay

The first form generates the greedy responses (256 new tokens, batch 16) of
SmolLM2-135M-Instruct for HumanEval chat prompts. The second replays
:class:`~specdec.drafters.SuffixAutomatonDrafter` over them for a grid of
settings (``specdec.drafters.replay``: the response stands in for the target,
so the mean accepted length is what the engine would see with greedy
verification, requests in order, the global automaton learning from finished
ones). ``--corpus`` preloads the global automaton with other responses (e.g.
the development split's), as a server's history would.

Reports, per setting: mean accepted length (tokens per target step), acceptance
rate, draft tokens per step (the verify step's width). Writes markdown + JSON.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)

from specdec.drafters import SuffixAutomatonDrafter  # noqa: E402
from specdec.drafters.replay import replay  # noqa: E402


def generate(problems: str, max_new_tokens: int, batch: int) -> list[tuple[list[int], list[int]]]:
    import torch

    from specdec import SamplingParams, SpecEngine
    from specdec.prompts import humaneval_prompts, parse_range
    from specdec.target import load_target

    target = load_target("smollm2-135m", dtype=torch.float32)
    tok = target.tokenizer
    ids = [tok(tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"] for p in humaneval_prompts(parse_range(problems))]
    outs = SpecEngine(target, None, max_num_seqs=batch).generate(ids, SamplingParams(max_new_tokens=max_new_tokens))
    return [(p, list(o.token_ids)) for p, o in zip(ids, outs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--generate", default=None, help="HumanEval problems to generate responses for (e.g. 100-163)")
    ap.add_argument("--save", default=None, help="with --generate: where to write [[prompt_ids, response_ids], ...]")
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--outputs", default=None, help="responses to replay (a --save file)")
    ap.add_argument("--corpus", default=None, help="responses preloaded into the global automaton")
    ap.add_argument("--out", default=None, help="write replay_study.md / .json here")
    args = ap.parse_args()
    if args.generate:
        t0 = time.perf_counter()
        pairs = generate(args.generate, args.max_new_tokens, args.batch)
        print(f"generated {sum(len(o) for _, o in pairs)} tokens in {time.perf_counter() - t0:.0f} s", flush=True)
        if args.save:
            Path(args.save).parent.mkdir(parents=True, exist_ok=True)
            Path(args.save).write_text(json.dumps(pairs))
        if not args.outputs:
            args.outputs = args.save
    if not args.outputs:
        ap.error("--outputs (or --generate with --save) is required")
    pairs = [(p, o) for p, o in json.loads(Path(args.outputs).read_text())]
    corpus = [o for _, o in json.loads(Path(args.corpus).read_text())] if args.corpus else None
    rows = []
    grid = itertools.product((8, 16), (1.0, 4.0, 16.0), (0.0, 0.1, 0.2), (1, 2))
    for k, factor, min_prob, min_match in grid:
        for with_corpus in ((False, True) if corpus else (False,)):
            d = SuffixAutomatonDrafter(max_draft_tokens=k, match_len_factor=factor, min_token_prob=min_prob,
                                       min_match_len=min_match, corpus=corpus if with_corpus else None)
            st = replay(d, pairs, max_tokens=k)
            rows.append({"max_draft_tokens": k, "match_len_factor": factor, "min_token_prob": min_prob,
                         "min_match_len": min_match, "corpus": with_corpus,
                         "mean_accepted_length": st.mean_accepted_length, "acceptance_rate": st.acceptance_rate,
                         "drafted_per_step": st.drafted / max(1, st.steps)})
    rows.sort(key=lambda r: -r["mean_accepted_length"])
    default = next(r for r in rows if (r["max_draft_tokens"], r["match_len_factor"], r["min_token_prob"],
                                       r["min_match_len"], r["corpus"]) == (8, 1.0, 0.1, 1, False))
    head = run_header("cpu", f"{len(pairs)} responses", f"{sum(len(o) for _, o in pairs)} tokens",
                      *([f"corpus of {len(corpus)} responses"] if corpus else []))
    md = [head, "", "| max_draft_tokens | match_len_factor | min_token_prob | min_match_len | corpus | "
          "mean accepted length | vs default | acceptance | draft tokens / step |", "|---|---|---|---|---|---|---|---|---|"]
    for r in [default] + [r for r in rows if r is not default][:15]:
        md.append(f"| {r['max_draft_tokens']} | {r['match_len_factor']:g} | {r['min_token_prob']:g} | "
                  f"{r['min_match_len']} | {'yes' if r['corpus'] else 'no'} | {r['mean_accepted_length']:.3f} | "
                  f"{r['mean_accepted_length'] / default['mean_accepted_length']:.2f}x | {r['acceptance_rate']:.3f} | "
                  f"{r['drafted_per_step']:.2f} |")
    text = "\n".join(md)
    write_results(args.out, "replay_study", text, {"header": head, "rows": rows})


if __name__ == "__main__":
    main()
