"""How well the suffix drafter's token confidences predict acceptance, measured on training data.

Replays the target's own greedy responses from a drafter training set (``specdec.drafters.data``;
never evaluation data) through :class:`~specdec.drafters.suffix_automaton.SuffixAutomatonDrafter`
as the engine would at every position: the request's prompt, then its response one token at a
time, a draft proposed before each token, finished responses joining the global automaton. For
each drafted token up to the first wrong one it records what the draft rested on
(:meth:`~specdec.drafters.suffix_automaton.SuffixAutomatonDrafter.explain`) and whether the token
equals the response's (greedy acceptance is exactly that). It prints reliability tables (confidence
bin against accepted fraction, on sequences held out from any fit) for the shipped calibrated
confidence and for the raw count frequency; ``--fit`` refits
:data:`~specdec.drafters.suffix_automaton.CONFIDENCE_WEIGHTS` on the other sequences (Newton's
method on the log loss) and prints the new weights beside them.

    python bench/suffix_calibration.py --data data/drafter-smollm2-135m data/drafter-smollm2-135m-b \\
        --sequences 3000 --fit --out OUT
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.drafters.data import TokenData  # noqa: E402
from specdec.drafters.suffix_automaton import CONFIDENCE_WEIGHTS, SuffixAutomatonDrafter  # noqa: E402

COLUMNS = ("seq", "conf", "accepted", "hits", "total", "distinct", "match_len", "own", "j")


def replay(data: TokenData, idx: list[int], k: int, drafter: SuffixAutomatonDrafter) -> np.ndarray:
    """One row (:data:`COLUMNS`) per drafted token up to and including the first that differs from
    the response; ``seq`` is the row's position in ``idx``."""
    rows = []
    for n, i in enumerate(idx):
        seq = data.sequence(i).tolist()
        p = int(data.prompt_lens[i])
        rid = f"r{n}"
        drafter.start_request(rid, seq[:p])
        for t in range(p, len(seq)):
            for j, (tok, conf, hits, total, distinct, match_len, own) in enumerate(drafter.explain(rid, k)):
                ok = t + j < len(seq) and seq[t + j] == tok
                rows.append((n, conf, ok, hits, total, distinct, match_len, own, j))
                if not ok:
                    break
            drafter.on_accepted(rid, [seq[t]])
        drafter.stop_request(rid)
    return np.array(rows, dtype=np.float64).reshape(-1, len(COLUMNS))


def features(rows: np.ndarray) -> np.ndarray:
    """The model's features (see :func:`~specdec.drafters.suffix_automaton.token_confidence`)."""
    _, _, _, hits, total, distinct, match_len, own, j = rows.T
    return np.stack([np.ones(len(rows)), np.log(np.maximum(match_len + j, 1)), own, (total == 0) * 1.0,
                     np.log1p(hits), np.log1p(total - hits), (distinct > 1) * 1.0], 1)


def fit(x: np.ndarray, y: np.ndarray, iters: int = 40) -> np.ndarray:
    """Logistic regression by Newton's method (a tiny ridge keeps the Hessian invertible)."""
    w = np.zeros(x.shape[1])
    for _ in range(iters):
        p = 1 / (1 + np.exp(-x @ w))
        hess = (x * (p * (1 - p))[:, None]).T @ x + 1e-6 * np.eye(len(w))
        w -= np.linalg.solve(hess, x.T @ (p - y))
    return w


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-6, 1 - 1e-6)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def reliability(name: str, conf: np.ndarray, ok: np.ndarray,
                edges=(0, .2, .4, .5, .6, .7, .8, .9, .95, .99, 1.0001)) -> list[str]:
    lines = [f"#### {name}: log loss {log_loss(conf, ok):.3f}, Brier {float(((conf - ok) ** 2).mean()):.3f}", "",
             "| confidence | tokens | accepted | mean confidence |", "|---|---|---|---|"]
    for lo, hi in zip(edges[:-1], edges[1:]):
        m = (conf >= lo) & (conf < hi)
        if m.sum():
            lines.append(f"| [{lo:.2f}, {min(hi, 1):.2f}) | {int(m.sum())} | {ok[m].mean():.3f} | {conf[m].mean():.3f} |")
    return lines + [""]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", nargs="+", required=True, help="training-data folders (specdec.drafters.data)")
    ap.add_argument("--sequences", type=int, default=2000, help="greedy sequences replayed (a seeded sample)")
    ap.add_argument("--k", type=int, default=8, help="draft tokens proposed per position (the engine's default)")
    ap.add_argument("--held-out", type=float, default=0.3, help="fraction of the sequences kept out of --fit")
    ap.add_argument("--fit", action="store_true", help="refit the confidence model on the other sequences")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write OUT.md and OUT.json")
    args = ap.parse_args(argv)
    if not 0 < args.held_out < 1:
        ap.error("--held-out must be in (0, 1)")
    data = TokenData.concat([TokenData.load(d) for d in args.data])
    greedy = [i for i in range(len(data)) if float(data.temperature[i]) == 0.0]
    rng = np.random.default_rng(args.seed)
    idx = rng.permutation(greedy)[: args.sequences].tolist()
    t0 = time.perf_counter()
    rows = replay(data, idx, args.k, SuffixAutomatonDrafter(min_token_prob=0.0))
    seconds = time.perf_counter() - t0
    held = np.random.default_rng(args.seed + 1).random(len(idx))[rows[:, 0].astype(int)] < args.held_out
    ok = rows[:, 2]
    hits, total, distinct = rows[:, 3], rows[:, 4], rows[:, 5]
    raw = (hits + 1) / (total + distinct)  # the continuation counts' frequency (walk_scored's estimate)
    lines = [f"{len(idx)} greedy sequences ({len(set(rows[held, 0].tolist()))} held out), "
             f"{len(rows)} drafted tokens up to the first wrong one, k = {args.k}, replayed in {seconds:.0f} s", ""]
    lines += reliability("calibrated (token_confidence, shipped weights), held out", rows[held, 1], ok[held])
    lines += reliability("raw count frequency, held out", raw[held], ok[held])
    result = {"sequences": len(idx), "tokens": len(rows), "k": args.k, "shipped_weights": list(CONFIDENCE_WEIGHTS)}
    if args.fit:
        w = fit(features(rows[~held]), ok[~held])
        p = 1 / (1 + np.exp(-features(rows[held]) @ w))
        lines += reliability("refit on the other sequences, held out", p, ok[held])
        lines += ["refit weights: (" + ", ".join(f"{v:.4f}" for v in w) + ")",
                  "shipped:       (" + ", ".join(f"{v:.4f}" for v in CONFIDENCE_WEIGHTS) + ")", ""]
        result["refit_weights"] = [round(float(v), 4) for v in w]
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out + ".md").write_text(text + "\n")
        Path(args.out + ".json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
