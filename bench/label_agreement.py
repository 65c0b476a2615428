"""How often a training set's response tokens are the target's own greedy choice, by kind of response.

    python bench/label_agreement.py --data data/drafter-smollm2-135m*/ --responses 10

For ``--responses`` greedy and as many sampled responses (drawn with ``--seed``), the target's argmax
after each response prefix (one forward per response, its first ``--max-tokens`` tokens) is compared
with the data's next token. The sampled responses' share is what ``--greedy-labels`` relabels
(``specdec.drafters.training.greedy_block_labels``). Prints one line per kind.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.drafters.data import TokenData  # noqa: E402
from specdec.drafters.training import target_features  # noqa: E402
from specdec.target import load_target  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--responses", type=int, default=10)
    ap.add_argument("--max-tokens", type=int, default=900)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    data = TokenData.concat([TokenData.load(d) for d in args.data])
    target = load_target("smollm2-135m", dtype=torch.float32, device=args.device)
    rng = np.random.default_rng(args.seed)
    sampled = data.temperature > 0
    print(f"{int(sampled.sum())} of {len(data)} responses sampled")
    for name, pool in (("sampled", np.nonzero(sampled)[0]), ("greedy", np.nonzero(~sampled)[0])):
        same = total = 0
        for i in rng.choice(pool, args.responses, replace=False):
            seq = data.sequence(i)[:args.max_tokens].astype(np.int64).tolist()
            p = int(data.prompt_lens[i])
            if p >= len(seq) - 2:
                continue
            with torch.no_grad():
                final = target_features(target, [seq], [p], (1,)).final[0, p - 1:len(seq) - 1]
                argmax = target.compute_logits(final).argmax(-1).cpu().numpy()
            same += int((argmax == np.array(seq[p:])).sum())
            total += len(argmax)
        print(f"{name}: the data's token is the target's argmax at {same / total:.3f} of {total} positions")


if __name__ == "__main__":
    main()
