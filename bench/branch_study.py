"""What verifying several suffix-drafter chains a step could buy: an oracle replay, without the target.

    python bench/branch_study.py --outputs bench/results/smollm2_fp32_humaneval_100-163.json \\
        --corpus bench/results/smollm2_fp32_humaneval_0-99.json --out bench/results

The engine verifies one chain per request. A token tree (or several chains as batch rows) would let
the target check several continuations in one step. This replays the target's real greedy responses
(as ``bench/replay_study.py`` does) and, each step, proposes up to ``width`` chains from the suffix
drafter's automata:

- ``chain``: the drafter's own proposal (the engine's behaviour; width 1);
- ``sources``: the walk of each source (the request's own tokens, the global automaton), not only the
  one with the longer match;
- ``first``: per source, the greedy walk plus a walk after each other token ever seen to follow the
  matched context (most frequent first).

The step accepts the longest prefix any chain shares with the response (an oracle choice among the
chains: what tree verification gives), then the bonus token. Reported: the mean accepted length
(tokens per target step) and the verify rows a step would feed (1 + all chains' tokens), so the
acceptance gain can be set against a wider verify step.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from results_io import run_header, write_results  # noqa: E402  (bench/, the script's own folder)

from specdec.drafters import SuffixAutomatonDrafter  # noqa: E402


def chains(d: SuffixAutomatonDrafter, req_id: str, k: int, mode: str, width: int) -> list[list[int]]:
    """Up to ``width`` distinct chains of at most ``k`` tokens for the request's next step."""
    if mode == "chain":
        draft = d.propose([req_id], k)[0]
        return [list(draft.token_ids)] if len(draft) else []
    req = d._requests[req_id]
    own_state = req.sam.match_state()
    sources = [(req.sam.state_len(own_state), req.sam, own_state)]
    if req.matcher is not None:  # the longer match first, as the drafter orders them
        sources.insert(0 if req.matcher.length > sources[0][0] else 1, (req.matcher.length, d._global, req.matcher.state))
    out: list[list[int]] = []
    for length, sam, state in sources:
        if length < d.min_match_len:
            continue
        budget = min(k, math.ceil(d.match_len_factor * length))
        main = sam.walk(state, budget, d.min_token_prob)
        out.append(main)
        if mode == "first":
            stats = sam._stats.get(state)
            seen = sorted(stats[3].items(), key=lambda kv: -kv[1]) if stats else []
            for tok, _ in seen:
                if tok >= 0 and (not main or tok != main[0]) and tok in sam._next[state]:
                    out.append([tok] + sam.walk(sam._next[state][tok], budget - 1, 0.0))
    distinct = []
    for c in out:
        if c and c not in distinct:
            distinct.append(c)
    return distinct[:width]


def oracle_replay(pairs, corpus, k: int, factor: float, mode: str, width: int) -> dict:
    d = SuffixAutomatonDrafter(max_draft_tokens=k, match_len_factor=factor, corpus=corpus)
    steps = tokens = rows = 0
    for i, (prompt, response) in enumerate(pairs):
        rid = f"r{i}"
        d.start_request(rid, prompt)
        pos = 0
        while pos < len(response):
            cs = chains(d, rid, k, mode, width)
            d.overlap()
            best = 0
            for c in cs:
                n = 0
                while n < len(c) and pos + n < len(response) and c[n] == response[pos + n]:
                    n += 1
                best = max(best, n)
            emitted = response[pos:pos + best + 1]
            d.on_accepted(rid, emitted)
            steps, tokens, rows = steps + 1, tokens + len(emitted), rows + 1 + sum(len(c) for c in cs)
            pos += len(emitted)
        d.stop_request(rid)
    return {"mode": mode, "width": width, "max_draft_tokens": k, "match_len_factor": factor,
            "mean_accepted_length": tokens / steps, "rows_per_step": rows / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--outputs", required=True, help="responses to replay (a bench/replay_study.py --save file)")
    ap.add_argument("--corpus", default=None, help="responses preloaded into the global automaton")
    ap.add_argument("--k", type=int, default=15, help="max draft tokens per chain")
    ap.add_argument("--match-len-factor", type=float, default=16.0)
    ap.add_argument("--widths", default="2,4,8", help="most chains per step to try")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    pairs = [(p, o) for p, o in json.loads(Path(args.outputs).read_text())]
    corpus = [o for _, o in json.loads(Path(args.corpus).read_text())] if args.corpus else None
    runs = [("chain", 1)] + [(m, int(w)) for w in args.widths.split(",") for m in ("sources", "first")]
    rows = []
    for mode, width in runs:
        rows.append(oracle_replay(pairs, corpus, args.k, args.match_len_factor, mode, width))
        print(json.dumps(rows[-1]), flush=True)
    base = rows[0]["mean_accepted_length"]
    head = run_header("cpu", f"{len(pairs)} responses", f"{sum(len(o) for _, o in pairs)} tokens",
                      f"k = {args.k}, match_len_factor {args.match_len_factor:g}",
                      *([f"corpus of {len(corpus)} responses"] if corpus else []))
    md = [head, "", "| chains | most per step | mean accepted length | vs one chain | verify rows / step |",
          "|---|---|---|---|---|"]
    md += [f"| {r['mode']} | {r['width']} | {r['mean_accepted_length']:.3f} | {r['mean_accepted_length'] / base:.2f}x | "
           f"{r['rows_per_step']:.1f} |" for r in rows]
    write_results(args.out, "branch_study", "\n".join(md), {"header": head, "rows": rows})


if __name__ == "__main__":
    main()
